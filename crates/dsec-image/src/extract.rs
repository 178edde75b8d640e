//! Safe extraction of a `.tar` / `.tar.gz` into a directory.
//!
//! Keeps ownership (when running as root), modes (including setuid bits), mtimes, symlinks,
//! hard links, xattrs (PAX `SCHILY.xattr.*`) and FIFOs. Character and block devices are
//! skipped: image layers are mounted `nodev`, and the sandbox gets its own `/dev`.
//! Entries whose path or hard-link target contains `..` are rejected; the `tar` crate also
//! refuses to write through symlinks that point outside the destination.

use std::fs::File;
use std::io::{self, BufReader, Read};
use std::path::{Component, Path, PathBuf};

use crate::{ImageError, ImportPhase, ImportProgress};

/// Kind of an archive source, from its first bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ArchiveKind {
    Tar,
    TarGz,
}

/// Sniff gzip magic or the `ustar` magic at offset 257.
pub(crate) fn sniff(path: &Path) -> Result<Option<ArchiveKind>, ImageError> {
    let mut f = File::open(path).map_err(|e| ImageError::io("open", path, e))?;
    let mut head = [0u8; 512];
    let mut n = 0;
    while n < head.len() {
        match f.read(&mut head[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(ImageError::io("read", path, e)),
        }
    }
    if n >= 2 && head[0] == 0x1f && head[1] == 0x8b {
        return Ok(Some(ArchiveKind::TarGz));
    }
    if n >= 262 && &head[257..262] == b"ustar" {
        return Ok(Some(ArchiveKind::Tar));
    }
    let name = path.file_name().and_then(|s| s.to_str()).unwrap_or("");
    if name.ends_with(".tar.gz") || name.ends_with(".tgz") {
        return Ok(Some(ArchiveKind::TarGz));
    }
    if name.ends_with(".tar") {
        return Ok(Some(ArchiveKind::Tar));
    }
    Ok(None)
}

/// Counts bytes read from the source file and reports progress every 4 MiB.
struct Counting<'a, R> {
    inner: R,
    done: u64,
    reported: u64,
    total: u64,
    progress: &'a dyn Fn(ImportProgress),
}

impl<R: Read> Read for Counting<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.done += n as u64;
        if self.done - self.reported >= 4 << 20 {
            self.reported = self.done;
            (self.progress)(ImportProgress {
                phase: ImportPhase::Extracting,
                bytes_done: self.done,
                bytes_total: Some(self.total),
            });
        }
        Ok(n)
    }
}

fn has_parent_dir(p: &Path) -> bool {
    p.components().any(|c| matches!(c, Component::ParentDir))
}

fn tar_err(archive: &Path, e: io::Error) -> ImageError {
    ImageError::Archive {
        path: archive.to_path_buf(),
        message: e.to_string(),
    }
}

/// Extract `archive` into the existing, empty directory `dest`. Returns whether the archive
/// had an entry for the root directory itself (`./`).
pub(crate) fn extract(
    archive: &Path,
    kind: ArchiveKind,
    dest: &Path,
    progress: &dyn Fn(ImportProgress),
) -> Result<bool, ImageError> {
    let f = File::open(archive).map_err(|e| ImageError::io("open", archive, e))?;
    let total = f
        .metadata()
        .map_err(|e| ImageError::io("stat", archive, e))?
        .len();
    progress(ImportProgress {
        phase: ImportPhase::Extracting,
        bytes_done: 0,
        bytes_total: Some(total),
    });
    let counting = Counting {
        inner: BufReader::with_capacity(1 << 20, f),
        done: 0,
        reported: 0,
        total,
        progress,
    };
    let reader: Box<dyn Read + '_> = match kind {
        ArchiveKind::Tar => Box::new(counting),
        ArchiveKind::TarGz => Box::new(flate2::read::GzDecoder::new(counting)),
    };
    let is_root = nix::unistd::geteuid().is_root();
    let mut ar = tar::Archive::new(reader);
    ar.set_preserve_permissions(true);
    ar.set_preserve_ownerships(is_root);
    ar.set_preserve_mtime(true);
    ar.set_unpack_xattrs(true);
    ar.set_overwrite(true);

    // Directory mtimes change as children are added; re-apply them at the end.
    let mut dir_times: Vec<(PathBuf, u64)> = Vec::new();
    let mut skipped_devices = 0u64;
    let mut had_root = false;
    // Parent directories the archive does not list get created on the fly; pin their metadata
    // (0755, mtime 0) so the result does not depend on umask or extraction time.
    let mut implicit_dirs: Vec<PathBuf> = Vec::new();
    for entry in ar.entries().map_err(|e| tar_err(archive, e))? {
        let mut entry = entry.map_err(|e| tar_err(archive, e))?;
        let path = entry.path().map_err(|e| tar_err(archive, e))?.into_owned();
        if has_parent_dir(&path) {
            return Err(ImageError::UnsafeEntry {
                archive: archive.to_path_buf(),
                entry: path,
            });
        }
        let et = entry.header().entry_type();
        if et.is_hard_link() || et.is_symlink() {
            if let Some(link) = entry.link_name().map_err(|e| tar_err(archive, e))? {
                if et.is_hard_link() && (has_parent_dir(&link) || link.is_absolute()) {
                    return Err(ImageError::UnsafeEntry {
                        archive: archive.to_path_buf(),
                        entry: path,
                    });
                }
            }
        }
        if et.is_character_special() || et.is_block_special() {
            skipped_devices += 1;
            continue;
        }
        let rel: PathBuf = path
            .components()
            .filter(|c| matches!(c, Component::Normal(_)))
            .collect();
        let target = dest.join(&rel);
        if rel.as_os_str().is_empty() {
            // `./`: the tar crate skips it, but it carries the root directory's metadata.
            if et.is_dir() {
                had_root = true;
                apply_root_meta(entry.header(), dest, is_root, archive)?;
                if let Ok(mtime) = entry.header().mtime() {
                    dir_times.push((dest.to_path_buf(), mtime));
                }
            }
            continue;
        }
        if et.is_fifo() {
            note_missing_parents(dest, &target, &mut implicit_dirs);
            make_fifo(&mut entry, dest, &target, is_root, archive)?;
            continue;
        }
        note_missing_parents(dest, &target, &mut implicit_dirs);
        let unpacked = entry.unpack_in(dest).map_err(|e| tar_err(archive, e))?;
        if !unpacked {
            return Err(ImageError::UnsafeEntry {
                archive: archive.to_path_buf(),
                entry: path,
            });
        }
        if et.is_dir() {
            if let Ok(mtime) = entry.header().mtime() {
                dir_times.push((target, mtime));
            }
        }
    }
    if skipped_devices > 0 {
        tracing::debug!(archive = %archive.display(), skipped_devices, "device nodes skipped");
    }
    let explicit: std::collections::HashSet<&Path> =
        dir_times.iter().map(|(p, _)| p.as_path()).collect();
    for dir in &implicit_dirs {
        if dir.is_dir() && !explicit.contains(dir.as_path()) {
            std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o755))
                .map_err(|e| ImageError::io("chmod", dir, e))?;
            set_mtime(dir, 0)?;
        }
    }
    // Explicit entries win over implicit defaults (a dir may be listed after its children).
    // Deepest first, so setting a child's time does not disturb its parent's.
    dir_times.sort_by_key(|(p, _)| std::cmp::Reverse(p.components().count()));
    for (dir, mtime) in dir_times {
        set_mtime(&dir, mtime)?;
    }
    Ok(had_root)
}

/// Record the ancestors of `target` (below `dest`) that do not exist yet.
fn note_missing_parents(dest: &Path, target: &Path, out: &mut Vec<PathBuf>) {
    let mut p = target.parent();
    while let Some(d) = p {
        if d == dest || !d.starts_with(dest) || d.exists() {
            break;
        }
        out.push(d.to_path_buf());
        p = d.parent();
    }
}

pub(crate) fn set_mtime(path: &Path, mtime: u64) -> Result<(), ImageError> {
    let t = nix::sys::time::TimeSpec::new(i64::try_from(mtime).unwrap_or(i64::MAX), 0);
    nix::sys::stat::utimensat(
        None,
        path,
        &t,
        &t,
        nix::sys::stat::UtimensatFlags::NoFollowSymlink,
    )
    .map_err(|e| ImageError::io("utimensat", path, e.into()))
}

fn apply_root_meta(
    h: &tar::Header,
    dest: &Path,
    is_root: bool,
    archive: &Path,
) -> Result<(), ImageError> {
    if is_root {
        let uid = h.uid().map_err(|e| tar_err(archive, e))?;
        let gid = h.gid().map_err(|e| tar_err(archive, e))?;
        chown(dest, uid, gid)?;
    }
    let mode = h.mode().map_err(|e| tar_err(archive, e))? & 0o7777;
    std::fs::set_permissions(dest, std::os::unix::fs::PermissionsExt::from_mode(mode))
        .map_err(|e| ImageError::io("chmod", dest, e))
}

fn chown(path: &Path, uid: u64, gid: u64) -> Result<(), ImageError> {
    nix::unistd::fchownat(
        None,
        path,
        Some(nix::unistd::Uid::from_raw(u32::try_from(uid).unwrap_or(0))),
        Some(nix::unistd::Gid::from_raw(u32::try_from(gid).unwrap_or(0))),
        nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
    )
    .map_err(|e| ImageError::io("chown", path, e.into()))
}

fn make_fifo<R: Read>(
    entry: &mut tar::Entry<'_, R>,
    dest: &Path,
    target: &Path,
    is_root: bool,
    archive: &Path,
) -> Result<(), ImageError> {
    let h = entry.header();
    let mode = h.mode().map_err(|e| tar_err(archive, e))? & 0o7777;
    let parent = target.parent().unwrap_or(dest);
    std::fs::create_dir_all(parent).map_err(|e| ImageError::io("mkdir", parent, e))?;
    let canon =
        std::fs::canonicalize(parent).map_err(|e| ImageError::io("canonicalize", parent, e))?;
    let canon_dest =
        std::fs::canonicalize(dest).map_err(|e| ImageError::io("canonicalize", dest, e))?;
    if !canon.starts_with(&canon_dest) {
        return Err(ImageError::UnsafeEntry {
            archive: archive.to_path_buf(),
            entry: target.to_path_buf(),
        });
    }
    let _ = std::fs::remove_file(target);
    nix::unistd::mkfifo(target, nix::sys::stat::Mode::from_bits_truncate(mode))
        .map_err(|e| ImageError::io("mkfifo", target, e.into()))?;
    // mkfifo applies the umask; set the exact mode.
    nix::sys::stat::fchmodat(
        None,
        target,
        nix::sys::stat::Mode::from_bits_truncate(mode),
        nix::sys::stat::FchmodatFlags::FollowSymlink,
    )
    .map_err(|e| ImageError::io("chmod", target, e.into()))?;
    if is_root {
        let uid = h.uid().map_err(|e| tar_err(archive, e))?;
        let gid = h.gid().map_err(|e| tar_err(archive, e))?;
        chown(target, uid, gid)?;
        // chown may clear mode bits; re-apply.
        nix::sys::stat::fchmodat(
            None,
            target,
            nix::sys::stat::Mode::from_bits_truncate(mode),
            nix::sys::stat::FchmodatFlags::FollowSymlink,
        )
        .map_err(|e| ImageError::io("chmod", target, e.into()))?;
    }
    if let Ok(mtime) = h.mtime() {
        set_mtime(target, mtime)?;
    }
    Ok(())
}
