//! Who a command runs as: a user named by the request (or the sandbox's default), looked
//! up in the sandbox's own `/etc/passwd` and `/etc/group` (the agent is static: no NSS),
//! or given as `UID[:GID]`.

use std::path::Path;

use dsec_wire::ApiError;

use crate::error::bad_request;

/// A resolved user: ids to switch to and what its environment says about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// User id.
    pub uid: u32,
    /// Primary group id.
    pub gid: u32,
    /// Supplementary groups (from `/etc/group`), the primary one included.
    pub groups: Vec<u32>,
    /// Login name (the uid as text when it has none).
    pub name: String,
    /// Home directory (`/` when unknown).
    pub home: String,
}

impl Identity {
    /// Whether this is root with root's group: nothing to switch.
    pub fn is_root(&self) -> bool {
        self.uid == 0 && self.gid == 0
    }
}

struct PasswdEntry {
    name: String,
    uid: u32,
    gid: u32,
    home: String,
}

fn passwd(root: &Path) -> Vec<PasswdEntry> {
    let text = std::fs::read_to_string(root.join("etc/passwd")).unwrap_or_default();
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(':').collect();
            if f.len() < 7 {
                return None;
            }
            Some(PasswdEntry {
                name: f[0].to_string(),
                uid: f[2].parse().ok()?,
                gid: f[3].parse().ok()?,
                home: f[5].to_string(),
            })
        })
        .collect()
}

/// `(name, gid, members)` of every group.
fn groups(root: &Path) -> Vec<(String, u32, Vec<String>)> {
    let text = std::fs::read_to_string(root.join("etc/group")).unwrap_or_default();
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(':').collect();
            if f.len() < 4 {
                return None;
            }
            let members = f[3]
                .split(',')
                .filter(|m| !m.is_empty())
                .map(str::to_string)
                .collect();
            Some((f[0].to_string(), f[2].parse().ok()?, members))
        })
        .collect()
}

/// Resolves `spec` (`NAME`, `UID`, `NAME:GROUP`, `UID:GID`) against the files under
/// `root`. Unknown names are a bad request naming what is missing.
pub fn resolve(root: &Path, spec: &str) -> Result<Identity, ApiError> {
    let (user, group) = match spec.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (spec, None),
    };
    if user.is_empty() || group.is_some_and(str::is_empty) {
        return Err(bad_request(format!(
            "user {spec:?}: expected NAME, UID, NAME:GROUP or UID:GID"
        )));
    }
    let users = passwd(root);
    let entry = match user.parse::<u32>() {
        Ok(uid) => users
            .into_iter()
            .find(|e| e.uid == uid)
            .or(Some(PasswdEntry {
                name: uid.to_string(),
                uid,
                gid: uid,
                home: "/".into(),
            })),
        Err(_) => users.into_iter().find(|e| e.name == user),
    };
    let Some(entry) = entry else {
        return Err(bad_request(format!(
            "user {user:?} does not exist in the sandbox (no /etc/passwd entry; use a UID to run as an unnamed user)"
        )));
    };
    let all_groups = groups(root);
    let gid = match group {
        None => entry.gid,
        Some(g) => match g.parse::<u32>() {
            Ok(gid) => gid,
            Err(_) => all_groups
                .iter()
                .find(|(n, _, _)| n == g)
                .map(|(_, gid, _)| *gid)
                .ok_or_else(|| bad_request(format!("group {g:?} does not exist in the sandbox")))?,
        },
    };
    let mut supplementary: Vec<u32> = vec![gid];
    for (_, g, members) in &all_groups {
        if members.contains(&entry.name) && !supplementary.contains(g) {
            supplementary.push(*g);
        }
    }
    Ok(Identity {
        uid: entry.uid,
        gid,
        groups: supplementary,
        name: entry.name,
        home: entry.home,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root() -> tempfile::TempDir {
        let d = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir(d.path().join("etc")).expect("mkdir");
        std::fs::write(
            d.path().join("etc/passwd"),
            "root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000::/home/user:/bin/bash\nbad line\n",
        )
        .expect("passwd");
        std::fs::write(
            d.path().join("etc/group"),
            "root:x:0:\nuser:x:1000:\nsudo:x:27:user,other\ndocker:x:999:other\n",
        )
        .expect("group");
        d
    }

    #[test]
    fn names_ids_and_groups() {
        let r = root();
        let u = resolve(r.path(), "user").expect("user");
        assert_eq!((u.uid, u.gid, u.home.as_str()), (1000, 1000, "/home/user"));
        assert_eq!(u.groups, vec![1000, 27]);
        assert!(resolve(r.path(), "root").expect("root").is_root());
        let by_id = resolve(r.path(), "1000").expect("uid");
        assert_eq!(by_id.name, "user");
        let unnamed = resolve(r.path(), "4242:4343").expect("unnamed");
        assert_eq!(
            (unnamed.uid, unnamed.gid, unnamed.home.as_str()),
            (4242, 4343, "/")
        );
        let with_group = resolve(r.path(), "user:docker").expect("group");
        assert_eq!(with_group.gid, 999);
        for bad in ["nobody-here", "", ":1", "user:", "user:nogroup"] {
            assert!(resolve(r.path(), bad).is_err(), "{bad:?}");
        }
    }
}
