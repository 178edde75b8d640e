// Shared by the importer targets (included, so each target stays one file for cargo fuzz).
//
// Every run gets a fresh temporary directory, removed when the run ends:
//
//   work/ARCHIVE    the fuzz input
//   work/root/      the importer's destination (empty, or `seed`ed)
//   work/outside/   a sibling: `secret` (0600) and `dir/` (0700), never to be touched
//
// An input that makes the importer write, chmod, chown, retime or hard-link anything
// outside `root` (relative symlinks such as `../outside` reach the sibling) fails the run.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

const SECRET: &[u8] = b"host secret\n";

/// What must not change outside the destination.
#[derive(Debug, PartialEq, Eq)]
struct Snapshot {
    names: Vec<String>,
    /// (name, mode, uid, gid, nlink, mtime, size) of each sentinel.
    meta: Vec<(String, u32, u32, u32, u64, i64, u64)>,
    secret: Vec<u8>,
    dir_entries: usize,
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

fn snapshot(work: &Path) -> Snapshot {
    let outside = work.join("outside");
    let meta = ["", "secret", "dir"]
        .iter()
        .filter_map(|n| {
            let m = std::fs::symlink_metadata(outside.join(n)).ok()?;
            Some((
                n.to_string(),
                m.mode(),
                m.uid(),
                m.gid(),
                m.nlink(),
                m.mtime(),
                if m.is_dir() { 0 } else { m.size() },
            ))
        })
        .collect();
    Snapshot {
        names: names(&outside),
        meta,
        secret: std::fs::read(outside.join("secret")).unwrap_or_default(),
        dir_entries: names(&outside.join("dir")).len(),
    }
}

/// Runs `import(archive, dest)` on `data` (tar checksums fixed, see
/// [`fix_tar_checksums`]) saved as `archive_name` in a fresh work directory, then panics
/// if anything outside the destination changed. `seed` may fill
/// the destination first (an upload into a directory that has files).
#[allow(dead_code)]
pub fn run_import(
    data: &[u8],
    archive_name: &str,
    seed: impl FnOnce(&Path),
    import: impl FnOnce(&Path, &Path),
) {
    let Ok(work) = tempfile::Builder::new().prefix("dsec-fuzz-").tempdir() else {
        return;
    };
    let w = work.path();
    let (archive, dest, outside) = (w.join(archive_name), w.join("root"), w.join("outside"));
    let mut data = data.to_vec();
    fix_tar_checksums(&mut data);
    let ready = (|| {
        std::fs::write(&archive, &data)?;
        std::fs::create_dir(&dest)?;
        std::fs::create_dir(&outside)?;
        std::fs::write(outside.join("secret"), SECRET)?;
        std::fs::set_permissions(
            outside.join("secret"),
            std::os::unix::fs::PermissionsExt::from_mode(0o600),
        )?;
        std::fs::create_dir(outside.join("dir"))?;
        std::fs::set_permissions(
            outside.join("dir"),
            std::os::unix::fs::PermissionsExt::from_mode(0o700),
        )
    })();
    if ready.is_err() {
        return;
    }
    seed(&dest);
    let before = snapshot(w);
    import(&archive, &dest);
    let mut want = vec![archive_name.to_string(), "outside".into(), "root".into()];
    want.sort();
    assert_eq!(names(w), want, "the importer wrote beside its destination");
    assert_eq!(
        snapshot(w),
        before,
        "the importer changed something outside its destination"
    );
    assert_eq!(
        std::fs::read(outside.join("secret")).unwrap_or_default(),
        SECRET
    );
}

/// Rewrites the checksum of every tar header in `data` (ustar and GNU headers; and, recursively,
/// of members that are tars themselves: image layers), so that mutations of header fields reach
/// the extractor instead of failing the checksum test. Sizes are not changed.
pub fn fix_tar_checksums(data: &mut [u8]) {
    let mut pos = 0usize;
    while pos + 512 <= data.len() {
        let h = &mut data[pos..pos + 512];
        if h.iter().all(|b| *b == 0) {
            pos += 512;
            continue;
        }
        // Not a ustar/GNU header (a compressed archive, or garbage): left as it is.
        if &h[257..262] != b"ustar" {
            return;
        }
        h[148..156].fill(b' ');
        let sum: u32 = h.iter().map(|b| u32::from(*b)).sum();
        let field = format!("{sum:06o}\0 ");
        h[148..156].copy_from_slice(field.as_bytes());
        let size = std::str::from_utf8(&h[124..136])
            .ok()
            .and_then(|s| u64::from_str_radix(s.trim_matches(|c| c == '\0' || c == ' '), 8).ok())
            .unwrap_or(0);
        let start = pos + 512;
        let end = usize::try_from(size)
            .ok()
            .and_then(|s| start.checked_add(s))
            .map_or(data.len(), |e| e.min(data.len()));
        // A member that is itself a tar (ustar magic in its first block): a layer.
        if end - start >= 512 && &data[start + 257..start + 262] == b"ustar" {
            fix_tar_checksums(&mut data[start..end]);
        }
        pos = start + (end - start).div_ceil(512) * 512;
    }
}
