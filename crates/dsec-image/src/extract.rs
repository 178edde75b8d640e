//! Safe extraction of a tar stream into a directory: plain `.tar` / `.tar.gz` images, and
//! OCI image layers with their whiteouts.
//!
//! Keeps ownership (when running as root), modes (including setuid bits), mtimes, symlinks,
//! hard links, xattrs (PAX `SCHILY.xattr.*` on files and directories, except
//! `trusted.overlay.*`: only overlayfs itself may set those) and FIFOs. Character and block
//! devices are skipped: image layers are mounted `nodev`, and the sandbox gets its own `/dev`.
//! Entries whose path or hard-link target contains `..` are rejected; the `tar` crate also
//! refuses to write through symlinks that point outside the destination, and so does the
//! whiteout handling here.
//!
//! OCI layers mark deletions with whiteout files: `D/.wh.NAME` deletes `D/NAME` of the layers
//! below, `D/.wh..wh..opq` hides everything the layers below have in `D`. [`Whiteouts`] says
//! whether they are kept as files, converted to overlayfs form, or applied.

use std::collections::{HashMap, HashSet};
use std::ffi::{CString, OsStr};
use std::fs::File;
use std::io::{self, BufReader, Read};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};

use crate::{ImageError, ImportPhase, ImportProgress};

/// Kind of an archive source, from its first bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ArchiveKind {
    Tar,
    TarGz,
    TarZst,
}

impl ArchiveKind {
    /// The decompressed stream of `r`, `compressed` bytes long, cut off with an error past
    /// [`expansion_limit`].
    pub(crate) fn decoder<'a, R: Read + 'a>(
        self,
        r: R,
        compressed: u64,
    ) -> io::Result<Box<dyn Read + 'a>> {
        let limit = expansion_limit(compressed);
        Ok(match self {
            ArchiveKind::Tar => Box::new(r),
            ArchiveKind::TarGz => {
                Box::new(Limited::new(flate2::read::MultiGzDecoder::new(r), limit))
            }
            ArchiveKind::TarZst => {
                Box::new(Limited::new(zstd::stream::read::Decoder::new(r)?, limit))
            }
        })
    }
}

/// Most a compressed archive may expand to, relative to its size: real tarballs stay far
/// below (text ~5-10x); decompression bombs reach 1000x and more.
pub(crate) const MAX_EXPANSION_RATIO: u64 = 100;
/// Small archives may always expand to this much.
pub(crate) const MIN_EXPANSION_LIMIT: u64 = 256 << 20;

/// How many bytes a compressed stream of `compressed` bytes may expand to.
pub(crate) fn expansion_limit(compressed: u64) -> u64 {
    compressed
        .saturating_mul(MAX_EXPANSION_RATIO)
        .max(MIN_EXPANSION_LIMIT)
}

/// A decompressed stream with a size limit: reading past it fails, so a decompression
/// bomb ends in a clear error instead of a full disk.
pub(crate) struct Limited<R> {
    inner: R,
    left: u64,
    limit: u64,
}

impl<R> Limited<R> {
    pub(crate) fn new(inner: R, limit: u64) -> Self {
        Self {
            inner,
            left: limit,
            limit,
        }
    }

    /// The wrapped reader.
    pub(crate) fn into_inner(self) -> R {
        self.inner
    }
}

impl<R: Read> Read for Limited<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        if n as u64 > self.left {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "decompresses to more than {} bytes ({MAX_EXPANSION_RATIO}x its size, at \
                     least {} MiB): refusing a likely decompression bomb",
                    self.limit,
                    MIN_EXPANSION_LIMIT >> 20
                ),
            ));
        }
        self.left -= n as u64;
        Ok(n)
    }
}

/// What to do with OCI whiteout entries (`.wh.NAME`, `.wh..wh..opq`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Whiteouts {
    /// A plain image tarball: `.wh.*` names are ordinary files.
    Keep,
    /// One OCI layer into an empty directory, in overlayfs form: a whiteout becomes a 0:0
    /// character device, an opaque marker the xattr `trusted.overlay.opaque=y` on its directory.
    Overlay,
    /// Apply an OCI layer on top of the tree already in the destination (flattening): a
    /// whiteout deletes its path, an opaque marker deletes what lower layers put in its directory.
    Apply,
}

const WHITEOUT_PREFIX: &[u8] = b".wh.";
/// Prefix of aufs metadata (`.wh..wh.plnk`, ...) and of the opaque marker.
const WHITEOUT_META_PREFIX: &[u8] = b".wh..wh.";
const OPAQUE_MARKER: &[u8] = b".wh..wh..opq";
const OPAQUE_XATTR: &[u8] = b"trusted.overlay.opaque";
const PAX_XATTR_PREFIX: &[u8] = b"SCHILY.xattr.";
/// Xattrs overlayfs interprets (opaque dirs, redirects, metacopy); never taken from an archive.
const OVERLAY_XATTR_PREFIX: &[u8] = b"trusted.overlay.";
/// The opaque marker of overlayfs mounted in a user namespace (`userxattr`).
const USER_OPAQUE_XATTR: &[u8] = b"user.overlay.opaque";
/// Overlayfs metadata in user-namespaced mounts: an archive may not plant it either.
const USER_OVERLAY_XATTR_PREFIX: &[u8] = b"user.overlay.";

/// Sniff gzip or zstd magic or the `ustar` magic at offset 257, else go by the name.
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
    if n >= 4 && head[..4] == [0x28, 0xb5, 0x2f, 0xfd] {
        return Ok(Some(ArchiveKind::TarZst));
    }
    if n >= 262 && &head[257..262] == b"ustar" {
        return Ok(Some(ArchiveKind::Tar));
    }
    let name = path.file_name().and_then(|s| s.to_str()).unwrap_or("");
    if name.ends_with(".tar.gz") || name.ends_with(".tgz") {
        return Ok(Some(ArchiveKind::TarGz));
    }
    if name.ends_with(".tar.zst") || name.ends_with(".tzst") {
        return Ok(Some(ArchiveKind::TarZst));
    }
    if name.ends_with(".tar") {
        return Ok(Some(ArchiveKind::Tar));
    }
    Ok(None)
}

/// Counts bytes read and reports [`ImportPhase::Extracting`] progress every 4 MiB.
pub(crate) struct Counting<'a, R> {
    inner: R,
    done: u64,
    reported: u64,
    total: u64,
    progress: &'a dyn Fn(ImportProgress),
}

impl<'a, R> Counting<'a, R> {
    /// Wraps `inner`, of `total` bytes.
    pub(crate) fn new(inner: R, total: u64, progress: &'a dyn Fn(ImportProgress)) -> Self {
        Self {
            inner,
            done: 0,
            reported: 0,
            total,
            progress,
        }
    }

    /// The wrapped reader.
    pub(crate) fn into_inner(self) -> R {
        self.inner
    }
}

impl<R: Read> Read for Counting<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.done += n as u64;
        if self.done - self.reported >= 4 << 20 || (n == 0 && self.done != self.reported) {
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

/// Whether `p` is a directory itself, not a symlink to one.
fn is_real_dir(p: &Path) -> bool {
    std::fs::symlink_metadata(p).is_ok_and(|m| m.is_dir())
}

fn has_parent_dir(p: &Path) -> bool {
    p.components().any(|c| matches!(c, Component::ParentDir))
}

fn tar_err(archive: &Path, e: io::Error) -> ImageError {
    // The tar crate wraps the OS error ("failed to unpack `x`"): keep the whole chain.
    let mut message = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        message.push_str(": ");
        message.push_str(&s.to_string());
        source = s.source();
    }
    ImageError::Archive {
        path: archive.to_path_buf(),
        message,
    }
}

fn archive_err(archive: &Path, message: String) -> ImageError {
    ImageError::Archive {
        path: archive.to_path_buf(),
        message,
    }
}

/// Decompresses `archive` (of `kind`) into the new file `dest`, reporting extraction
/// progress against the compressed size.
pub(crate) fn decompress(
    archive: &Path,
    kind: ArchiveKind,
    dest: &Path,
    progress: &dyn Fn(ImportProgress),
) -> Result<u64, ImageError> {
    let f = File::open(archive).map_err(|e| ImageError::io("open", archive, e))?;
    let total = f
        .metadata()
        .map_err(|e| ImageError::io("stat", archive, e))?
        .len();
    let counting = Counting::new(BufReader::with_capacity(1 << 20, f), total, progress);
    let mut reader = kind
        .decoder(counting, total)
        .map_err(|e| ImageError::io("decompress", archive, e))?;
    let mut out = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(dest)
        .map_err(|e| ImageError::io("create", dest, e))?;
    io::copy(&mut reader, &mut out).map_err(|e| archive_err(archive, format!("decompressing: {e}")))
}

/// Extract the tar file `archive` into the existing, empty directory `dest`. Returns whether
/// the archive had an entry for the root directory itself (`./`).
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
    let counting = Counting::new(BufReader::with_capacity(1 << 20, f), total, progress);
    let reader = kind
        .decoder(counting, total)
        .map_err(|e| ImageError::io("decompress", archive, e))?;
    let (had_root, _) = extract_from(reader, archive, dest, Whiteouts::Keep)?;
    Ok(had_root)
}

/// Extract the (uncompressed) tar stream `reader` into the existing directory `dest`, which
/// must be empty unless `whiteouts` is [`Whiteouts::Apply`]. `origin` names the stream in
/// errors. Stops at the end-of-archive marker and hands `reader` back (for draining and
/// hashing the rest). Returns whether the archive had an entry for the root itself (`./`).
pub(crate) fn extract_from<R: Read>(
    reader: R,
    origin: &Path,
    dest: &Path,
    whiteouts: Whiteouts,
) -> Result<(bool, R), ImageError> {
    let is_root = nix::unistd::geteuid().is_root();
    let mut ar = tar::Archive::new(reader);
    ar.set_preserve_permissions(true);
    ar.set_preserve_ownerships(is_root);
    ar.set_preserve_mtime(true);
    // Set by `Unpacker::entry` instead: filtered, and on directories too.
    ar.set_unpack_xattrs(false);
    ar.set_overwrite(true);
    let canon_dest =
        std::fs::canonicalize(dest).map_err(|e| ImageError::io("canonicalize", dest, e))?;
    let mut u = Unpacker {
        origin,
        dest,
        canon_dest,
        whiteouts,
        is_root,
        dir_times: Vec::new(),
        implicit_dirs: Vec::new(),
        saved_times: HashMap::new(),
        written: HashSet::new(),
        opaque_dirs: Vec::new(),
        skipped_devices: 0,
        had_root: false,
    };
    for entry in ar.entries().map_err(|e| tar_err(origin, e))? {
        let mut entry = entry.map_err(|e| tar_err(origin, e))?;
        u.entry(&mut entry)?;
    }
    let had_root = u.had_root;
    u.finish()?;
    Ok((had_root, ar.into_inner()))
}

/// State of one extraction.
struct Unpacker<'a> {
    origin: &'a Path,
    dest: &'a Path,
    canon_dest: PathBuf,
    whiteouts: Whiteouts,
    is_root: bool,
    /// Directories listed in the archive with their mtimes; re-applied at the end since
    /// adding children changes them.
    dir_times: Vec<(PathBuf, u64)>,
    /// Parent directories the archive does not list, created on the fly; their metadata is
    /// pinned (0755, mtime 0) so the result does not depend on umask or extraction time.
    implicit_dirs: Vec<PathBuf>,
    /// [`Whiteouts::Apply`]: mtimes of existing directories before this layer changed them.
    saved_times: HashMap<PathBuf, u64>,
    /// [`Whiteouts::Apply`]: paths this layer wrote, with their ancestors.
    written: HashSet<PathBuf>,
    /// [`Whiteouts::Overlay`]: directories to mark opaque at the end.
    opaque_dirs: Vec<PathBuf>,
    skipped_devices: u64,
    had_root: bool,
}

impl Unpacker<'_> {
    fn unsafe_entry(&self, entry: &Path) -> ImageError {
        ImageError::UnsafeEntry {
            archive: self.origin.to_path_buf(),
            entry: entry.to_path_buf(),
        }
    }

    fn entry<R: Read>(&mut self, entry: &mut tar::Entry<'_, R>) -> Result<(), ImageError> {
        let origin = self.origin;
        let path = entry.path().map_err(|e| tar_err(origin, e))?.into_owned();
        if has_parent_dir(&path) {
            return Err(self.unsafe_entry(&path));
        }
        let et = entry.header().entry_type();
        if et.is_hard_link() || et.is_symlink() {
            if let Some(link) = entry.link_name().map_err(|e| tar_err(origin, e))? {
                if et.is_hard_link() && (has_parent_dir(&link) || link.is_absolute()) {
                    return Err(self.unsafe_entry(&path));
                }
            }
        }
        let rel: PathBuf = path
            .components()
            .filter(|c| matches!(c, Component::Normal(_)))
            .collect();
        if self.whiteouts != Whiteouts::Keep && self.whiteout(entry.header(), &path, &rel)? {
            return Ok(());
        }
        if et.is_character_special() || et.is_block_special() {
            self.skipped_devices += 1;
            return Ok(());
        }
        let xattrs = entry_xattrs(entry);
        let target = self.dest.join(&rel);
        if rel.as_os_str().is_empty() {
            // `./`: the tar crate skips it, but it carries the root directory's metadata.
            if et.is_dir() {
                self.had_root = true;
                apply_root_meta(entry.header(), self.dest, self.is_root, origin)?;
                set_xattrs(self.dest, &xattrs)?;
                if let Ok(mtime) = entry.header().mtime() {
                    self.dir_times.push((self.dest.to_path_buf(), mtime));
                }
            }
            return Ok(());
        }
        if self.whiteouts != Whiteouts::Keep {
            self.replace_existing(&target, et.is_dir(), &path)?;
        }
        note_missing_parents(self.dest, &target, &mut self.implicit_dirs);
        if let Some(parent) = target.parent() {
            self.save_time(parent);
        }
        if et.is_fifo() {
            // The tar crate checks each parent it creates; for a FIFO, do the same.
            self.ensure_dir(rel.parent().unwrap_or(Path::new("")), &path)?;
            make_fifo(entry, self.dest, &target, self.is_root, origin)?;
        } else {
            let unpacked = entry.unpack_in(self.dest).map_err(|e| tar_err(origin, e))?;
            if !unpacked {
                return Err(self.unsafe_entry(&path));
            }
            if et.is_dir() {
                if let Ok(mtime) = entry.header().mtime() {
                    self.dir_times.push((target.clone(), mtime));
                }
            }
            if !xattrs.is_empty()
                && std::fs::symlink_metadata(&target).is_ok_and(|m| m.is_file() || m.is_dir())
            {
                set_xattrs(&target, &xattrs)?;
            }
        }
        self.mark_written(&rel);
        Ok(())
    }

    /// Handles an OCI whiteout or opaque marker; false for any other entry.
    fn whiteout(&mut self, h: &tar::Header, path: &Path, rel: &Path) -> Result<bool, ImageError> {
        let Some(base) = rel.file_name().map(OsStr::as_bytes) else {
            return Ok(false);
        };
        let parent = rel.parent().unwrap_or(Path::new(""));
        if parent
            .components()
            .any(|c| c.as_os_str().as_bytes().starts_with(WHITEOUT_META_PREFIX))
        {
            // Inside aufs metadata (`.wh..wh.plnk/...`): not image content.
            return Ok(true);
        }
        if base == OPAQUE_MARKER {
            let dir = self.ensure_dir(parent, path)?;
            match self.whiteouts {
                Whiteouts::Overlay => self.opaque_dirs.push(dir),
                Whiteouts::Apply => {
                    self.save_time(&dir);
                    self.clear_lower(&dir, parent)?;
                }
                Whiteouts::Keep => {}
            }
            return Ok(true);
        }
        if base.starts_with(WHITEOUT_META_PREFIX) {
            return Ok(true);
        }
        let Some(name) = base.strip_prefix(WHITEOUT_PREFIX) else {
            return Ok(false);
        };
        if name.is_empty() || name == b"." || name == b".." {
            return Err(archive_err(
                self.origin,
                format!("invalid whiteout entry {}", path.display()),
            ));
        }
        let dir = self.ensure_dir(parent, path)?;
        let target = dir.join(OsStr::from_bytes(name));
        self.save_time(&dir);
        remove_nofollow(&target)?;
        if self.whiteouts == Whiteouts::Overlay {
            make_whiteout(h, &target, self.is_root, self.origin)?;
        }
        Ok(true)
    }

    /// Creates (as implicit directories) the missing parts of `rel_dir` below the destination
    /// and returns its path. Existing parts must be directories, or symlinks to directories
    /// inside the destination.
    fn ensure_dir(&mut self, rel_dir: &Path, entry: &Path) -> Result<PathBuf, ImageError> {
        let mut cur = self.dest.to_path_buf();
        for c in rel_dir.components() {
            let parent = cur.clone();
            cur.push(c);
            match std::fs::symlink_metadata(&cur) {
                Ok(md) if md.is_dir() => {}
                Ok(md) if md.file_type().is_symlink() => {
                    let canon =
                        std::fs::canonicalize(&cur).map_err(|_| self.unsafe_entry(entry))?;
                    if !canon.starts_with(&self.canon_dest) || !canon.is_dir() {
                        return Err(self.unsafe_entry(entry));
                    }
                }
                Ok(_) => {
                    return Err(archive_err(
                        self.origin,
                        format!(
                            "entry {}: {} is not a directory",
                            entry.display(),
                            cur.display()
                        ),
                    ))
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    self.save_time(&parent);
                    std::fs::create_dir(&cur).map_err(|e| ImageError::io("mkdir", &cur, e))?;
                    self.implicit_dirs.push(cur.clone());
                }
                Err(e) => return Err(ImageError::io("stat", &cur, e)),
            }
        }
        Ok(cur)
    }

    /// Before writing `target` over an existing path: removes it unless both are directories
    /// (a directory over a directory only updates its metadata, as the tar crate does).
    fn replace_existing(
        &mut self,
        target: &Path,
        is_dir: bool,
        entry: &Path,
    ) -> Result<(), ImageError> {
        let Ok(md) = std::fs::symlink_metadata(target) else {
            return Ok(());
        };
        if md.is_dir() && is_dir {
            return Ok(());
        }
        let parent = target.parent().unwrap_or(self.dest);
        let canon = std::fs::canonicalize(parent).map_err(|_| self.unsafe_entry(entry))?;
        if !canon.starts_with(&self.canon_dest) {
            return Err(self.unsafe_entry(entry));
        }
        self.save_time(parent);
        remove_nofollow(target)
    }

    /// [`Whiteouts::Apply`]: deletes everything under `dir` that this layer did not write.
    fn clear_lower(&mut self, dir: &Path, rel: &Path) -> Result<(), ImageError> {
        let names: Vec<_> = std::fs::read_dir(dir)
            .map_err(|e| ImageError::io("read_dir", dir, e))?
            .map(|e| e.map(|e| e.file_name()))
            .collect::<Result<_, _>>()
            .map_err(|e| ImageError::io("read_dir", dir, e))?;
        for name in names {
            let (child, child_rel) = (dir.join(&name), rel.join(&name));
            if !self.written.contains(&child_rel) {
                remove_nofollow(&child)?;
            } else if std::fs::symlink_metadata(&child).is_ok_and(|m| m.is_dir()) {
                self.save_time(&child);
                self.clear_lower(&child, &child_rel)?;
            }
        }
        Ok(())
    }

    /// [`Whiteouts::Apply`]: remembers `dir`'s mtime before this layer first changes it.
    fn save_time(&mut self, dir: &Path) {
        if self.whiteouts != Whiteouts::Apply || self.saved_times.contains_key(dir) {
            return;
        }
        if let Ok(md) = std::fs::symlink_metadata(dir) {
            if md.is_dir() {
                self.saved_times
                    .insert(dir.to_path_buf(), u64::try_from(md.mtime()).unwrap_or(0));
            }
        }
    }

    fn mark_written(&mut self, rel: &Path) {
        if self.whiteouts != Whiteouts::Apply {
            return;
        }
        let mut p = Some(rel);
        while let Some(r) = p {
            if r.as_os_str().is_empty() || !self.written.insert(r.to_path_buf()) {
                break;
            }
            p = r.parent();
        }
    }

    fn finish(self) -> Result<(), ImageError> {
        if self.skipped_devices > 0 {
            tracing::debug!(
                archive = %self.origin.display(),
                skipped_devices = self.skipped_devices,
                "device nodes skipped"
            );
        }
        for dir in &self.opaque_dirs {
            // Both markers: overlayfs mounted by the host reads trusted.*, in a user
            // namespace (userxattr) user.*.
            lsetxattr(dir, OPAQUE_XATTR, b"y")?;
            lsetxattr(dir, USER_OPAQUE_XATTR, b"y")?;
        }
        let explicit: HashSet<&Path> = self.dir_times.iter().map(|(p, _)| p.as_path()).collect();
        // Directories of lower layers keep their times unless this layer lists them.
        for (dir, mtime) in &self.saved_times {
            if !explicit.contains(dir.as_path()) && is_real_dir(dir) {
                set_mtime(dir, *mtime)?;
            }
        }
        for dir in &self.implicit_dirs {
            // Not through a symlink a later entry put in its place: chmod follows it.
            if is_real_dir(dir) && !explicit.contains(dir.as_path()) {
                std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o755))
                    .map_err(|e| ImageError::io("chmod", dir, e))?;
                set_mtime(dir, 0)?;
            }
        }
        // Explicit entries win over implicit defaults (a dir may be listed after its children).
        // Deepest first, so setting a child's time does not disturb its parent's.
        let mut dir_times = self.dir_times;
        dir_times.sort_by_key(|(p, _)| std::cmp::Reverse(p.components().count()));
        for (dir, mtime) in dir_times {
            set_mtime(&dir, mtime)?;
        }
        Ok(())
    }
}

/// The `SCHILY.xattr.*` PAX records of `entry`, without `trusted.overlay.*`.
fn entry_xattrs<R: Read>(entry: &mut tar::Entry<'_, R>) -> Vec<(Vec<u8>, Vec<u8>)> {
    let Ok(Some(exts)) = entry.pax_extensions() else {
        return Vec::new();
    };
    exts.filter_map(Result::ok)
        .filter_map(|e| {
            let key = e.key_bytes().strip_prefix(PAX_XATTR_PREFIX)?;
            (!key.starts_with(OVERLAY_XATTR_PREFIX) && !key.starts_with(USER_OVERLAY_XATTR_PREFIX))
                .then(|| (key.to_vec(), e.value_bytes().to_vec()))
        })
        .collect()
}

fn set_xattrs(path: &Path, xattrs: &[(Vec<u8>, Vec<u8>)]) -> Result<(), ImageError> {
    for (k, v) in xattrs {
        lsetxattr(path, k, v)?;
    }
    Ok(())
}

fn lsetxattr(path: &Path, name: &[u8], value: &[u8]) -> Result<(), ImageError> {
    let invalid = || {
        ImageError::io(
            "setxattr",
            path,
            io::Error::new(io::ErrorKind::InvalidInput, "NUL byte in name"),
        )
    };
    let p = CString::new(path.as_os_str().as_bytes()).map_err(|_| invalid())?;
    let n = CString::new(name).map_err(|_| invalid())?;
    // SAFETY: `p` and `n` are NUL-terminated strings and `value` is a valid buffer of
    // `value.len()` bytes, all alive for the duration of the call.
    let rc = unsafe {
        libc::lsetxattr(
            p.as_ptr(),
            n.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    if rc != 0 {
        return Err(ImageError::io("setxattr", path, io::Error::last_os_error()));
    }
    Ok(())
}

/// Removes `path` (a whole tree for a directory) without following a symlink at `path`.
fn remove_nofollow(path: &Path) -> Result<(), ImageError> {
    let res = match std::fs::symlink_metadata(path) {
        Ok(md) if md.is_dir() => std::fs::remove_dir_all(path),
        Ok(_) => std::fs::remove_file(path),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    };
    res.map_err(|e| ImageError::io("remove", path, e))
}

/// An overlayfs whiteout: character device 0:0, mode 0, the entry's owner and mtime.
fn make_whiteout(
    h: &tar::Header,
    target: &Path,
    is_root: bool,
    archive: &Path,
) -> Result<(), ImageError> {
    use nix::sys::stat::{makedev, mknod, Mode, SFlag};
    mknod(target, SFlag::S_IFCHR, Mode::empty(), makedev(0, 0))
        .map_err(|e| ImageError::io("mknod", target, e.into()))?;
    if is_root {
        let uid = h.uid().map_err(|e| tar_err(archive, e))?;
        let gid = h.gid().map_err(|e| tar_err(archive, e))?;
        chown(target, uid, gid)?;
    }
    if let Ok(mtime) = h.mtime() {
        set_mtime(target, mtime)?;
    }
    Ok(())
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
    // The caller created the parents (`Unpacker::ensure_dir`); this check stays as a
    // second line.
    let parent = target.parent().unwrap_or(dest);
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// A tar of `(path, kind, link target)` entries.
    fn tar_of(entries: &[(&str, tar::EntryType, &str)]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (path, kind, link) in entries {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(*kind);
            h.set_mode(if kind.is_dir() { 0o755 } else { 0o644 });
            h.set_size(0);
            h.set_uid(0);
            h.set_gid(0);
            h.set_mtime(1_700_000_000);
            if !link.is_empty() {
                h.set_link_name(link).unwrap_or_else(|e| panic!("{e}"));
            }
            b.append_data(&mut h, path, io::empty())
                .unwrap_or_else(|e| panic!("{e}"));
        }
        b.into_inner().unwrap_or_else(|e| panic!("{e}"))
    }

    /// A work directory with an empty `root` and a sibling `outside/dir` (mode 0700).
    fn work() -> (tempfile::TempDir, PathBuf, PathBuf) {
        let w = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let (root, outside) = (w.path().join("root"), w.path().join("outside"));
        std::fs::create_dir(&root).unwrap_or_else(|e| panic!("{e}"));
        std::fs::create_dir_all(outside.join("dir")).unwrap_or_else(|e| panic!("{e}"));
        std::fs::set_permissions(outside.join("dir"), std::fs::Permissions::from_mode(0o700))
            .unwrap_or_else(|e| panic!("{e}"));
        (w, root, outside)
    }

    fn mode(p: &Path) -> u32 {
        std::fs::metadata(p)
            .map(|m| m.permissions().mode() & 0o7777)
            .unwrap_or(0)
    }

    /// fuzz/regressions/oci_import/implicit-dir-chmod: an implicit directory (the parent of
    /// an entry) that a later entry of a layer replaces with a symlink out of the tree was
    /// chmodded 0755 at the end, through the symlink.
    #[test]
    fn an_implicit_dir_replaced_by_a_symlink_is_not_chmodded_through_it() {
        for whiteouts in [Whiteouts::Apply, Whiteouts::Overlay] {
            let (_w, root, outside) = work();
            let ar = tar_of(&[
                ("a/b", tar::EntryType::Regular, ""),
                ("a", tar::EntryType::Symlink, "../outside/dir"),
            ]);
            let _ = extract_from(&ar[..], Path::new("layer"), &root, whiteouts);
            assert_eq!(mode(&outside.join("dir")), 0o700, "{whiteouts:?}");
        }
    }

    /// fuzz/regressions/tar_import/fifo-mkdir-outside: a FIFO below a symlink out of the
    /// tree had its parent directories created outside before the check refused it.
    #[test]
    fn a_fifo_below_a_symlink_out_creates_nothing_outside() {
        for whiteouts in [Whiteouts::Keep, Whiteouts::Apply, Whiteouts::Overlay] {
            let (_w, root, outside) = work();
            let ar = tar_of(&[
                ("s", tar::EntryType::Symlink, "../outside"),
                ("s/x/y/f", tar::EntryType::Fifo, ""),
            ]);
            let res = extract_from(&ar[..], Path::new("in.tar"), &root, whiteouts);
            assert!(res.is_err(), "{whiteouts:?}");
            let mut names: Vec<_> = std::fs::read_dir(&outside)
                .map(|d| d.flatten().map(|e| e.file_name()).collect())
                .unwrap_or_default();
            names.sort();
            assert_eq!(
                names,
                vec![std::ffi::OsString::from("dir")],
                "{whiteouts:?}"
            );
        }
    }

    /// A FIFO below a symlink that stays inside the tree is still created.
    #[test]
    fn a_fifo_below_a_symlink_inside_is_created() {
        let (_w, root, _outside) = work();
        let ar = tar_of(&[
            ("d", tar::EntryType::Directory, ""),
            ("s", tar::EntryType::Symlink, "d"),
            ("s/sub/f", tar::EntryType::Fifo, ""),
        ]);
        extract_from(&ar[..], Path::new("in.tar"), &root, Whiteouts::Keep)
            .unwrap_or_else(|e| panic!("{e}"));
        let md = std::fs::symlink_metadata(root.join("d/sub/f")).unwrap_or_else(|e| panic!("{e}"));
        assert!(std::os::unix::fs::FileTypeExt::is_fifo(&md.file_type()));
    }
}
