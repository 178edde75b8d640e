//! packdiff: a sandbox's writable layer (an overlayfs upper directory) into a new layer.
//!
//! The upper directory is already in the form a lower layer needs: deletions are 0:0
//! character devices, replaced directories carry `trusted.overlay.opaque`. The copy keeps
//! files, directories, symlinks, hard links (as links), FIFOs, owners, modes (setuid
//! included), nanosecond mtimes and `user.*`/`security.*` xattrs, and of overlayfs's own
//! xattrs only `opaque`: `origin`, `impure` and the like describe the sandbox's mount and
//! must not travel. Other device nodes are dropped, as on import. With a previous snapshot
//! of the same sandbox, only what differs from it is copied (incremental packdiff).
//! [`ImageStore::commit_upper`] builds the copy into a layer and names the new image.

use std::collections::HashMap;
use std::ffi::CString;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::erofs::build_erofs;
use crate::{dedup_layers, validate_name, Image, ImageConfig, ImageError, ImageStore, Result};

const OPAQUE_XATTR: &[u8] = b"trusted.overlay.opaque";
/// The opaque marker overlayfs writes when mounted in a user namespace (`userxattr`).
const USER_OPAQUE_XATTR: &[u8] = b"user.overlay.opaque";
/// Overlayfs's own metadata in user-namespaced mounts: never copied into a layer.
const USER_OVERLAY_PREFIX: &[u8] = b"user.overlay.";

/// What one copy did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct DiffStats {
    /// Entries copied.
    pub copied: u64,
    /// Entries skipped because the previous snapshot already has them as they are.
    pub unchanged: u64,
    /// Whiteouts (deletions) carried.
    pub whiteouts: u64,
    /// Of the directories copied (the root included), those the previous snapshot has
    /// with the same mode, owner and mtime: kept for the tree, not a change.
    pub dirs_same: u64,
}

impl DiffStats {
    /// Whether the copy holds no change against the previous snapshot: only directories
    /// it already has as they are, and no deletion. Without a previous snapshot every
    /// directory counts as a change.
    pub fn is_empty(&self) -> bool {
        self.copied == self.dirs_same && self.whiteouts == 0
    }
}

/// Copies the upper directory `upper` into the empty directory `dest`. With `previous`
/// (the mounted tree of this sandbox's last snapshot), a regular file, symlink or whiteout
/// that the previous snapshot holds identically is left out; directories are always kept
/// (they carry the tree and their metadata).
pub fn copy_upper(
    upper: &Path,
    dest: &Path,
    previous: Option<&Path>,
) -> Result<DiffStats, ImageError> {
    let mut stats = DiffStats::default();
    let mut links: HashMap<(u64, u64), std::path::PathBuf> = HashMap::new();
    let root_meta = fs::symlink_metadata(upper).map_err(|e| ImageError::io("stat", upper, e))?;
    copy_meta(upper, dest, &root_meta)?;
    copy_dir(upper, dest, previous, &mut links, &mut stats)?;
    set_times(dest, &root_meta)?;
    stats.copied += 1;
    if previous.is_some_and(|p| same_dir(&root_meta, p)) {
        stats.dirs_same += 1;
    }
    Ok(stats)
}

fn copy_dir(
    src: &Path,
    dest: &Path,
    previous: Option<&Path>,
    links: &mut HashMap<(u64, u64), std::path::PathBuf>,
    stats: &mut DiffStats,
) -> Result<(), ImageError> {
    let mut entries: Vec<_> = fs::read_dir(src)
        .map_err(|e| ImageError::io("read_dir", src, e))?
        .collect::<Result<_, _>>()
        .map_err(|e| ImageError::io("read_dir", src, e))?;
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let from = entry.path();
        let to = dest.join(entry.file_name());
        let prev = previous.map(|p| p.join(entry.file_name()));
        let meta = fs::symlink_metadata(&from).map_err(|e| ImageError::io("stat", &from, e))?;
        let ft = meta.file_type();
        if ft.is_dir() {
            fs::create_dir(&to).map_err(|e| ImageError::io("mkdir", &to, e))?;
            copy_meta(&from, &to, &meta)?;
            let same = prev.as_deref().is_some_and(|p| same_dir(&meta, p));
            // An opaque directory hides everything below it: compare nothing underneath.
            let prev = if is_opaque(&from) { None } else { prev };
            copy_dir(
                &from,
                &to,
                prev.as_deref().filter(|p| p.is_dir()),
                links,
                stats,
            )?;
            set_times(&to, &meta)?;
            stats.copied += 1;
            if same {
                stats.dirs_same += 1;
            }
            continue;
        }
        if prev.as_deref().is_some_and(|p| same_entry(&from, &meta, p)) {
            stats.unchanged += 1;
            continue;
        }
        if meta.nlink() > 1 && !ft.is_dir() {
            if let Some(first) = links.get(&(meta.dev(), meta.ino())) {
                fs::hard_link(first, &to).map_err(|e| ImageError::io("link", &to, e))?;
                stats.copied += 1;
                continue;
            }
        }
        if ft.is_file() {
            fs::copy(&from, &to).map_err(|e| ImageError::io("copy", &from, e))?;
        } else if ft.is_symlink() {
            let target = fs::read_link(&from).map_err(|e| ImageError::io("readlink", &from, e))?;
            std::os::unix::fs::symlink(&target, &to)
                .map_err(|e| ImageError::io("symlink", &to, e))?;
        } else if ft.is_char_device() && meta.rdev() == 0 {
            mknod(&to, libc::S_IFCHR, 0)?;
            stats.whiteouts += 1;
        } else if ft.is_fifo() {
            mknod(&to, libc::S_IFIFO, 0)?;
        } else {
            // Devices and sockets do not belong in an image layer.
            continue;
        }
        copy_meta(&from, &to, &meta)?;
        set_times(&to, &meta)?;
        if meta.nlink() > 1 {
            links.insert((meta.dev(), meta.ino()), to);
        }
        stats.copied += 1;
    }
    // What the previous snapshot has here and the upper no longer has was deleted since
    // (the upper only grows, and keeps a whiteout for what the base layers hold).
    if let Some(prev) = previous {
        let gone: Vec<_> = fs::read_dir(prev)
            .map_err(|e| ImageError::io("read_dir", prev, e))?
            .filter_map(Result::ok)
            .map(|e| e.file_name())
            .filter(|n| !src.join(n).exists() && fs::symlink_metadata(src.join(n)).is_err())
            .collect();
        for name in gone {
            mknod(&dest.join(&name), libc::S_IFCHR, 0)?;
            stats.whiteouts += 1;
        }
    }
    Ok(())
}

/// Whether `prev` (in the previous snapshot) is a directory with the mode, owner and
/// mtime of the directory `meta` describes. A directory removed and made again has a new
/// mtime, so an opaque one matches only the snapshot that already held it.
fn same_dir(meta: &fs::Metadata, prev: &Path) -> bool {
    fs::symlink_metadata(prev).is_ok_and(|pm| {
        pm.is_dir()
            && meta.mode() == pm.mode()
            && meta.uid() == pm.uid()
            && meta.gid() == pm.gid()
            && meta.mtime() == pm.mtime()
            && meta.mtime_nsec() == pm.mtime_nsec()
    })
}

/// Whether `prev` (in the previous snapshot) is the same entry as `src`: same type, mode,
/// owner, mtime and link count (a hard link whose partner was deleted must be stored
/// again), and the same size and bytes (files), target (symlinks) or whiteout.
fn same_entry(src: &Path, meta: &fs::Metadata, prev: &Path) -> bool {
    let Ok(pm) = fs::symlink_metadata(prev) else {
        return false;
    };
    let (a, b) = (meta.file_type(), pm.file_type());
    if meta.mode() != pm.mode()
        || meta.uid() != pm.uid()
        || meta.gid() != pm.gid()
        || meta.mtime() != pm.mtime()
        || meta.mtime_nsec() != pm.mtime_nsec()
        || meta.nlink() != pm.nlink()
    {
        return false;
    }
    if a.is_file() && b.is_file() {
        meta.len() == pm.len() && same_bytes(src, prev)
    } else if a.is_symlink() && b.is_symlink() {
        fs::read_link(src).ok() == fs::read_link(prev).ok()
    } else {
        a.is_char_device() && b.is_char_device() && meta.rdev() == 0 && pm.rdev() == 0
    }
}

fn same_bytes(a: &Path, b: &Path) -> bool {
    use std::io::Read;
    let (Ok(mut fa), Ok(mut fb)) = (fs::File::open(a), fs::File::open(b)) else {
        return false;
    };
    let (mut ba, mut bb) = (vec![0u8; 1 << 16], vec![0u8; 1 << 16]);
    loop {
        let (Ok(na), Ok(nb)) = (fa.read(&mut ba), fb.read(&mut bb)) else {
            return false;
        };
        if na != nb || ba[..na] != bb[..nb] {
            return false;
        }
        if na == 0 {
            return true;
        }
    }
}

fn cpath(p: &Path) -> Result<CString, ImageError> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| ImageError::Archive {
        path: p.to_path_buf(),
        message: "path contains NUL".into(),
    })
}

fn mknod(path: &Path, kind: libc::mode_t, dev: libc::dev_t) -> Result<(), ImageError> {
    let c = cpath(path)?;
    // SAFETY: mknod with a valid NUL-terminated path.
    if unsafe { libc::mknod(c.as_ptr(), kind | 0o600, dev) } != 0 {
        return Err(ImageError::io(
            "mknod",
            path,
            std::io::Error::last_os_error(),
        ));
    }
    Ok(())
}

/// The xattrs of `path` that travel into a layer.
fn xattrs(path: &Path) -> Vec<(Vec<u8>, Vec<u8>)> {
    let Ok(c) = cpath(path) else {
        return Vec::new();
    };
    let mut names = vec![0u8; 4096];
    // SAFETY: llistxattr into a buffer of the given size.
    let n = unsafe { libc::llistxattr(c.as_ptr(), names.as_mut_ptr().cast(), names.len()) };
    if n <= 0 {
        return Vec::new();
    }
    names.truncate(n as usize);
    let mut out = Vec::new();
    for name in names.split(|&b| b == 0).filter(|n| !n.is_empty()) {
        let keep = name == OPAQUE_XATTR
            || name == USER_OPAQUE_XATTR
            || (name.starts_with(b"user.") && !name.starts_with(USER_OVERLAY_PREFIX))
            || name.starts_with(b"security.");
        if !keep {
            continue;
        }
        let Ok(cname) = CString::new(name) else {
            continue;
        };
        let mut value = vec![0u8; 65536];
        // SAFETY: lgetxattr into a buffer of the given size.
        let len = unsafe {
            libc::lgetxattr(
                c.as_ptr(),
                cname.as_ptr(),
                value.as_mut_ptr().cast(),
                value.len(),
            )
        };
        if len >= 0 {
            value.truncate(len as usize);
            out.push((name.to_vec(), value));
        }
    }
    out
}

fn is_opaque(dir: &Path) -> bool {
    xattrs(dir)
        .iter()
        .any(|(n, v)| (n == OPAQUE_XATTR || n == USER_OPAQUE_XATTR) && v.as_slice() == b"y")
}

/// Owner, mode and xattrs of `src` onto `dest` (times come last, see [`set_times`]).
fn copy_meta(src: &Path, dest: &Path, meta: &fs::Metadata) -> Result<(), ImageError> {
    std::os::unix::fs::lchown(dest, Some(meta.uid()), Some(meta.gid()))
        .map_err(|e| ImageError::io("chown", dest, e))?;
    if !meta.file_type().is_symlink() {
        fs::set_permissions(dest, fs::Permissions::from_mode(meta.mode() & 0o7777))
            .map_err(|e| ImageError::io("chmod", dest, e))?;
    }
    let c = cpath(dest)?;
    let mut attrs = xattrs(src);
    // An opaque directory carries both markers, so the layer reads the same to overlayfs
    // mounted by the host (trusted.*) and in a user namespace (user.*).
    if attrs
        .iter()
        .any(|(n, v)| (n == OPAQUE_XATTR || n == USER_OPAQUE_XATTR) && v.as_slice() == b"y")
    {
        attrs.retain(|(n, _)| n != OPAQUE_XATTR && n != USER_OPAQUE_XATTR);
        attrs.push((OPAQUE_XATTR.to_vec(), b"y".to_vec()));
        attrs.push((USER_OPAQUE_XATTR.to_vec(), b"y".to_vec()));
    }
    for (name, value) in attrs {
        let Ok(cname) = CString::new(name) else {
            continue;
        };
        // SAFETY: lsetxattr with valid strings and a buffer of the given length.
        let rc = unsafe {
            libc::lsetxattr(
                c.as_ptr(),
                cname.as_ptr(),
                value.as_ptr().cast(),
                value.len(),
                0,
            )
        };
        if rc != 0 {
            let err = std::io::Error::last_os_error();
            // Some file systems refuse xattrs on symlinks; that loses nothing we need.
            if !meta.file_type().is_symlink() {
                return Err(ImageError::io("setxattr", dest, err));
            }
        }
    }
    Ok(())
}

fn set_times(dest: &Path, meta: &fs::Metadata) -> Result<(), ImageError> {
    let t = nix::sys::time::TimeSpec::new(meta.mtime(), meta.mtime_nsec());
    nix::sys::stat::utimensat(
        None,
        dest,
        &t,
        &t,
        nix::sys::stat::UtimensatFlags::NoFollowSymlink,
    )
    .map_err(|e| ImageError::io("utimensat", dest, e.into()))
}

impl ImageStore {
    /// packdiff: stores a sandbox's overlayfs upper directory `upper` as a new layer and
    /// points `name` at `stack` (the sandbox's layers, bottom first) + `previous_diffs`
    /// (the layers earlier commits of the same sandbox added, bottom first) + the new one.
    /// With earlier commits only what changed since is stored, deletions as whiteouts.
    /// Nothing changed since the last commit: no layer is added (`None`), and `name`
    /// names the stack and earlier diffs as they are. A layer named twice stays only at
    /// its topmost place ([`dedup_layers`]).
    /// The caller keeps `upper` still (the sandbox paused) while this runs.
    pub fn commit_upper(
        &self,
        name: &str,
        upper: &Path,
        stack: &[String],
        previous_diffs: &[String],
        config: ImageConfig,
        source: &str,
    ) -> Result<(Image, DiffStats, Option<String>)> {
        validate_name(name)?;
        let previous_diffs = &dedup_layers(previous_diffs)[..];
        let work = self.tempdir("commit-")?;
        let tree = work.path().join("tree");
        std::fs::create_dir(&tree).map_err(|e| ImageError::io("mkdir", &tree, e))?;
        let mut held = Vec::new();
        let view = (|| -> Result<Option<PathBuf>> {
            for d in previous_diffs {
                held.push((d.clone(), self.acquire(d)?));
            }
            match held.as_slice() {
                [] => Ok(None),
                [(_, one)] => Ok(Some(one.clone())),
                many => {
                    // The merged view of the earlier diffs: a read-only overlay of them.
                    let view = work.path().join("view");
                    std::fs::create_dir(&view).map_err(|e| ImageError::io("mkdir", &view, e))?;
                    let lower: Vec<String> = many
                        .iter()
                        .rev()
                        .map(|(_, p)| p.display().to_string())
                        .collect();
                    nix::mount::mount(
                        Some("overlay"),
                        &view,
                        Some("overlay"),
                        nix::mount::MsFlags::MS_RDONLY,
                        Some(format!("lowerdir={}", lower.join(":")).as_str()),
                    )
                    .map_err(|e| ImageError::io("mount overlay", &view, e.into()))?;
                    Ok(Some(view))
                }
            }
        })();
        let copied = match &view {
            Ok(v) => copy_upper(upper, &tree, v.as_deref()),
            Err(_) => Ok(DiffStats::default()),
        };
        if held.len() > 1 {
            let _ =
                nix::mount::umount2(&work.path().join("view"), nix::mount::MntFlags::MNT_DETACH);
        }
        for (d, _) in &held {
            let _ = self.release(d);
        }
        view?;
        let stats = copied?;
        let mut layers = stack.to_vec();
        layers.extend(previous_diffs.iter().cloned());
        let diff = if !previous_diffs.is_empty() && stats.is_empty() {
            None
        } else {
            let layer = work.path().join("layer.erofs");
            build_erofs(&tree, &layer, work.path(), &|_| {})?;
            let (digest, _) = self.put_blob(&layer, &|_| {})?;
            layers.push(digest.clone());
            Some(digest)
        };
        let img = self.set_ref(name, &dedup_layers(&layers), source, config)?;
        drop(work);
        Ok((img, stats, diff))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A copy against a snapshot of the same upper holds no change; a new file, a
    /// deletion or a directory's new mode is one.
    #[test]
    fn an_unchanged_upper_is_an_empty_diff() {
        let dir = tempfile::tempdir().expect("tempdir");
        let upper = dir.path().join("upper");
        fs::create_dir_all(upper.join("work/sub")).expect("mkdir");
        fs::write(upper.join("work/f"), b"one").expect("write");
        let first = dir.path().join("first");
        fs::create_dir(&first).expect("mkdir");
        let stats = copy_upper(&upper, &first, None).expect("copy");
        assert!(!stats.is_empty(), "no previous snapshot: {stats:?}");

        let again = |name: &str| {
            let dest = dir.path().join(name);
            fs::create_dir(&dest).expect("mkdir");
            copy_upper(&upper, &dest, Some(&first)).expect("copy")
        };
        let stats = again("second");
        assert!(stats.is_empty(), "{stats:?}");
        assert_eq!(stats.copied, 3, "root, work, work/sub kept for the tree");

        fs::set_permissions(upper.join("work/sub"), fs::Permissions::from_mode(0o700))
            .expect("chmod");
        assert!(!again("third").is_empty(), "a directory's new mode");
        fs::set_permissions(upper.join("work/sub"), fs::Permissions::from_mode(0o755))
            .expect("chmod");
        let meta = fs::symlink_metadata(first.join("work/sub")).expect("stat");
        assert_eq!(meta.mode() & 0o777, 0o755);
        fs::write(upper.join("work/g"), b"two").expect("write");
        assert!(!again("fourth").is_empty(), "a new file");
    }
}
