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
//!
//! Telling an unchanged file costs a byte compare against the previous snapshot, unless
//! the last commit left a [`CleanFiles`] index: a file whose inode, ctime and size are
//! what they were then is unchanged without reading it (ctime moves on every write and
//! metadata change, and no process can set it back), which keeps a commit of a sandbox
//! holding gigabytes proportional to what changed, not to what it holds.

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

/// What identifies one state of an upper file: a write or a metadata change moves its
/// ctime, which no process can set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    ino: u64,
    ctime: i64,
    ctime_nsec: i64,
    size: u64,
}

impl Stamp {
    fn of(meta: &fs::Metadata) -> Self {
        Self {
            ino: meta.ino(),
            ctime: meta.ctime(),
            ctime_nsec: meta.ctime_nsec(),
            size: meta.len(),
        }
    }
}

/// The regular files of an upper directory known, at a commit, to be held as they are by
/// the snapshot that commit made (by path under the upper, with the [`Stamp`] they had).
/// Only files whose ctime was older than the commit's start (less a margin for coarse
/// clocks) are recorded, so a later change always shows as a newer ctime.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct CleanFiles {
    files: HashMap<Vec<u8>, Stamp>,
}

/// How far before a commit's start a ctime must be for its file to be recorded clean:
/// well above the coarsest kernel clock tick (10 ms at HZ=100).
const CLEAN_MARGIN: std::time::Duration = std::time::Duration::from_millis(100);
/// First line of a saved [`CleanFiles`] index.
const CLEAN_HEADER: &str = "dsec-clean-files 1";

impl CleanFiles {
    /// Reads the index at `path` if it was saved for exactly the snapshot `diffs` (the
    /// layers earlier commits added); anything else (none, another snapshot, unreadable)
    /// is an empty index, which only costs byte compares.
    pub fn load(path: &Path, diffs: &[String]) -> Self {
        let Ok(text) = fs::read_to_string(path) else {
            return Self::default();
        };
        let mut lines = text.lines();
        if lines.next() != Some(CLEAN_HEADER) || lines.next() != Some(&diffs.join(" ")) {
            return Self::default();
        }
        let mut files = HashMap::new();
        for line in lines {
            let f: Vec<&str> = line.split(' ').collect();
            let parsed = (|| {
                let [ino, ctime, nsec, size, path] = f.as_slice() else {
                    return None;
                };
                let stamp = Stamp {
                    ino: ino.parse().ok()?,
                    ctime: ctime.parse().ok()?,
                    ctime_nsec: nsec.parse().ok()?,
                    size: size.parse().ok()?,
                };
                Some((hex::decode(path).ok()?, stamp))
            })();
            match parsed {
                Some((p, stamp)) => {
                    files.insert(p, stamp);
                }
                None => return Self::default(),
            }
        }
        Self { files }
    }

    /// Saves the index at `path` for the snapshot `diffs` (replacing any; a failure
    /// removes it: a stale index must not survive).
    pub fn save(&self, path: &Path, diffs: &[String]) {
        use std::fmt::Write as _;
        let mut text = format!("{CLEAN_HEADER}\n{}\n", diffs.join(" "));
        for (p, s) in &self.files {
            let _ = writeln!(
                text,
                "{} {} {} {} {}",
                s.ino,
                s.ctime,
                s.ctime_nsec,
                s.size,
                hex::encode(p)
            );
        }
        let tmp = path.with_extension("tmp");
        if fs::write(&tmp, text)
            .and_then(|()| fs::rename(&tmp, path))
            .is_err()
        {
            let _ = fs::remove_file(&tmp);
            let _ = fs::remove_file(path);
        }
    }

    /// Files recorded.
    pub fn len(&self) -> usize {
        self.files.len()
    }

    /// Whether nothing is recorded.
    pub fn is_empty(&self) -> bool {
        self.files.is_empty()
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
    copy_upper_with(upper, dest, previous, None, &CleanFiles::default()).map(|(stats, _)| stats)
}

/// [`copy_upper`], trusting `clean` (the index the commit that made `previous` left) for
/// which files are unchanged; returns the index for the snapshot this copy makes. The
/// caller keeps `upper` still from before this call until it returns.
///
/// `base`: the mounted layers the sandbox's image is made of (any order), when known.
/// Overlayfs marks a directory made inside a merged one opaque (an optimization), so an
/// upper is full of opaque directories that hide nothing. An opaque directory hides
/// everything under it, so it must be copied whole, again at every commit, unless no
/// base layer has anything at its path: then its opacity is dropped in the new layer and
/// it is compared with the previous snapshot like any other directory (what that
/// snapshot has and the upper no longer has gets a whiteout).
pub fn copy_upper_with(
    upper: &Path,
    dest: &Path,
    previous: Option<&Path>,
    base: Option<&[PathBuf]>,
    clean: &CleanFiles,
) -> Result<(DiffStats, CleanFiles), ImageError> {
    let cutoff = std::time::SystemTime::now()
        .checked_sub(CLEAN_MARGIN)
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| (d.as_secs() as i64, i64::from(d.subsec_nanos())))
        .unwrap_or((0, 0));
    let mut walk = Walk {
        links: HashMap::new(),
        stats: DiffStats::default(),
        base,
        clean,
        next: CleanFiles::default(),
        cutoff,
    };
    let root_meta = fs::symlink_metadata(upper).map_err(|e| ImageError::io("stat", upper, e))?;
    copy_meta(upper, dest, &root_meta, true)?;
    walk.copy_dir(upper, dest, previous, &mut Vec::new())?;
    set_times(dest, &root_meta)?;
    walk.stats.copied += 1;
    if previous.is_some_and(|p| same_dir(&root_meta, p)) {
        walk.stats.dirs_same += 1;
    }
    Ok((walk.stats, walk.next))
}

/// One copy's state.
struct Walk<'a> {
    links: HashMap<(u64, u64), PathBuf>,
    stats: DiffStats,
    /// The image's layer mounts, when known (see [`copy_upper_with`]).
    base: Option<&'a [PathBuf]>,
    clean: &'a CleanFiles,
    next: CleanFiles,
    /// `(secs, nsecs)` a ctime must be older than to go into `next`.
    cutoff: (i64, i64),
}

impl Walk<'_> {
    /// Whether the image under the sandbox may have something at `rel` (unknown: yes).
    fn base_has(&self, rel: &[u8]) -> bool {
        let rel = Path::new(std::ffi::OsStr::from_bytes(rel));
        self.base.is_none_or(|layers| {
            layers
                .iter()
                .any(|l| fs::symlink_metadata(l.join(rel)).is_ok())
        })
    }

    /// Records the regular file at `rel` as held by the snapshot being made.
    fn held(&mut self, rel: &[u8], meta: &fs::Metadata) {
        if meta.file_type().is_file() && (meta.ctime(), meta.ctime_nsec()) < self.cutoff {
            self.next.files.insert(rel.to_vec(), Stamp::of(meta));
        }
    }

    fn copy_dir(
        &mut self,
        src: &Path,
        dest: &Path,
        previous: Option<&Path>,
        rel: &mut Vec<u8>,
    ) -> Result<(), ImageError> {
        let mut entries: Vec<_> = fs::read_dir(src)
            .map_err(|e| ImageError::io("read_dir", src, e))?
            .collect::<Result<_, _>>()
            .map_err(|e| ImageError::io("read_dir", src, e))?;
        entries.sort_by_key(|e| e.file_name());
        for entry in entries {
            let rel_len = rel.len();
            if !rel.is_empty() {
                rel.push(b'/');
            }
            rel.extend_from_slice(entry.file_name().as_bytes());
            let res = self.copy_entry(&entry, dest, previous, rel);
            rel.truncate(rel_len);
            res?;
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
                self.stats.whiteouts += 1;
            }
        }
        Ok(())
    }

    /// Copies one entry of a directory (`rel`: its path under the upper).
    fn copy_entry(
        &mut self,
        entry: &fs::DirEntry,
        dest: &Path,
        previous: Option<&Path>,
        rel: &mut Vec<u8>,
    ) -> Result<(), ImageError> {
        {
            let from = entry.path();
            let to = dest.join(entry.file_name());
            let prev = previous.map(|p| p.join(entry.file_name()));
            let meta = fs::symlink_metadata(&from).map_err(|e| ImageError::io("stat", &from, e))?;
            let ft = meta.file_type();
            if ft.is_dir() {
                fs::create_dir(&to).map_err(|e| ImageError::io("mkdir", &to, e))?;
                let prev = prev.filter(|p| p.is_dir());
                // An opaque directory hides everything below it: compared with the previous
                // snapshot only where it hides nothing of the image (then it goes into the
                // layer without its opacity, see `copy_upper_with`); else copied whole.
                let opaque = is_opaque(&from);
                let merge = !opaque || (prev.is_some() && !self.base_has(rel));
                copy_meta(&from, &to, &meta, !merge)?;
                let same = prev.as_deref().is_some_and(|p| same_dir(&meta, p));
                let prev = if merge { prev } else { None };
                self.copy_dir(&from, &to, prev.as_deref(), rel)?;
                set_times(&to, &meta)?;
                self.stats.copied += 1;
                if same {
                    self.stats.dirs_same += 1;
                }
                return Ok(());
            }
            let known_clean = self.clean.files.get(rel.as_slice()) == Some(&Stamp::of(&meta));
            if prev
                .as_deref()
                .is_some_and(|p| same_entry(&from, &meta, p, known_clean))
            {
                self.held(rel, &meta);
                self.stats.unchanged += 1;
                return Ok(());
            }
            if meta.nlink() > 1 && !ft.is_dir() {
                if let Some(first) = self.links.get(&(meta.dev(), meta.ino())) {
                    fs::hard_link(first, &to).map_err(|e| ImageError::io("link", &to, e))?;
                    self.held(rel, &meta);
                    self.stats.copied += 1;
                    return Ok(());
                }
            }
            if ft.is_file() {
                fs::copy(&from, &to).map_err(|e| ImageError::io("copy", &from, e))?;
            } else if ft.is_symlink() {
                let target =
                    fs::read_link(&from).map_err(|e| ImageError::io("readlink", &from, e))?;
                std::os::unix::fs::symlink(&target, &to)
                    .map_err(|e| ImageError::io("symlink", &to, e))?;
            } else if ft.is_char_device() && meta.rdev() == 0 {
                mknod(&to, libc::S_IFCHR, 0)?;
                self.stats.whiteouts += 1;
            } else if ft.is_fifo() {
                mknod(&to, libc::S_IFIFO, 0)?;
            } else {
                // Devices and sockets do not belong in an image layer.
                return Ok(());
            }
            copy_meta(&from, &to, &meta, true)?;
            set_times(&to, &meta)?;
            if meta.nlink() > 1 {
                self.links.insert((meta.dev(), meta.ino()), to);
            }
            self.held(rel, &meta);
            self.stats.copied += 1;
        }
        Ok(())
    }
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
fn same_entry(src: &Path, meta: &fs::Metadata, prev: &Path, known_clean: bool) -> bool {
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
        meta.len() == pm.len() && (known_clean || same_bytes(src, prev))
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

/// Owner, mode and xattrs of `src` onto `dest` (times come last, see [`set_times`]);
/// without `keep_opaque`, not the opaque marker.
fn copy_meta(
    src: &Path,
    dest: &Path,
    meta: &fs::Metadata,
    keep_opaque: bool,
) -> Result<(), ImageError> {
    std::os::unix::fs::lchown(dest, Some(meta.uid()), Some(meta.gid()))
        .map_err(|e| ImageError::io("chown", dest, e))?;
    if !meta.file_type().is_symlink() {
        fs::set_permissions(dest, fs::Permissions::from_mode(meta.mode() & 0o7777))
            .map_err(|e| ImageError::io("chmod", dest, e))?;
    }
    let c = cpath(dest)?;
    let mut attrs = xattrs(src);
    if !keep_opaque {
        attrs.retain(|(n, _)| n != OPAQUE_XATTR && n != USER_OPAQUE_XATTR);
    }
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

/// The sandbox side of a commit: its upper directory and what it stacks on.
#[derive(Debug, Clone, Copy)]
pub struct UpperCommit<'a> {
    /// The overlayfs upper directory.
    pub upper: &'a Path,
    /// The sandbox's layers, bottom first.
    pub stack: &'a [String],
    /// The layers earlier commits of the sandbox added, bottom first.
    pub previous_diffs: &'a [String],
    /// Where the sandbox's [`CleanFiles`] index lives (outside the upper).
    pub clean_index: Option<&'a Path>,
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
    /// `clean_index` is where this sandbox's [`CleanFiles`] index lives (outside the
    /// upper, out of the sandbox's reach): read if it describes `previous_diffs`, and
    /// replaced by the one for the snapshot made.
    pub fn commit_upper(
        &self,
        name: &str,
        sandbox: &UpperCommit<'_>,
        config: ImageConfig,
        source: &str,
    ) -> Result<(Image, DiffStats, Option<String>)> {
        let UpperCommit {
            upper,
            stack,
            previous_diffs,
            clean_index,
        } = *sandbox;
        validate_name(name)?;
        let previous_diffs = &dedup_layers(previous_diffs)[..];
        let clean = clean_index
            .map(|p| CleanFiles::load(p, previous_diffs))
            .unwrap_or_default();
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
        // The image's own layers (mounted for the sandbox already), to tell which opaque
        // directories hide nothing; unknown if one cannot be had.
        let mut base: Vec<(String, PathBuf)> = Vec::new();
        let base_known = !previous_diffs.is_empty()
            && dedup_layers(stack).iter().all(|d| match self.acquire(d) {
                Ok(p) => {
                    base.push((d.clone(), p));
                    true
                }
                Err(e) => {
                    tracing::debug!(layer = %d, error = %e, "image layer not at hand for a commit");
                    false
                }
            });
        let base_paths: Vec<PathBuf> = base.iter().map(|(_, p)| p.clone()).collect();
        let copied = match &view {
            Ok(v) => copy_upper_with(
                upper,
                &tree,
                v.as_deref(),
                base_known.then_some(&base_paths[..]),
                &clean,
            ),
            Err(_) => Ok((DiffStats::default(), CleanFiles::default())),
        };
        if held.len() > 1 {
            let _ =
                nix::mount::umount2(&work.path().join("view"), nix::mount::MntFlags::MNT_DETACH);
        }
        for (d, _) in held.iter().chain(&base) {
            let _ = self.release(d);
        }
        view?;
        let (stats, next_clean) = copied?;
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
        if let Some(path) = clean_index {
            // The diffs the sandbox's next commit names: these, the new one moved on top.
            let mut next: Vec<String> = previous_diffs.to_vec();
            if let Some(d) = &diff {
                next.retain(|x| x != d);
                next.push(d.clone());
            }
            next_clean.save(path, &next);
        }
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

    /// With the index of the last copy, a file whose stamp is unchanged is not compared
    /// (a snapshot copy altered behind the index's back is not noticed: proof the bytes
    /// were not read), while a file rewritten to the same size with its old mtime put
    /// back is copied: its ctime moved. The index survives a save and load only for the
    /// snapshot it was saved for.
    #[test]
    fn the_clean_index_skips_byte_compares_and_misses_no_rewrite() {
        let dir = tempfile::tempdir().expect("tempdir");
        let upper = dir.path().join("upper");
        fs::create_dir_all(&upper).expect("mkdir");
        fs::write(upper.join("a"), b"aaaa").expect("write");
        fs::write(upper.join("b"), b"bbbb").expect("write");
        // Only files older than the copy's start less the margin are recorded.
        std::thread::sleep(CLEAN_MARGIN + std::time::Duration::from_millis(50));
        let first = dir.path().join("first");
        fs::create_dir(&first).expect("mkdir");
        let (_, clean) =
            copy_upper_with(&upper, &first, None, None, &CleanFiles::default()).expect("copy");
        assert_eq!(clean.len(), 2, "{clean:?}");

        // Rewrite a: same size, the old mtime set back.
        let meta = fs::metadata(upper.join("a")).expect("stat");
        fs::write(upper.join("a"), b"AAAA").expect("write");
        set_times(&upper.join("a"), &meta).expect("utimensat");
        // Alter the snapshot's b behind the index's back (same size and times).
        let bm = fs::metadata(first.join("b")).expect("stat");
        fs::write(first.join("b"), b"XXXX").expect("write");
        set_times(&first.join("b"), &bm).expect("utimensat");

        let copy = |name: &str, clean: &CleanFiles| {
            let dest = dir.path().join(name);
            fs::create_dir(&dest).expect("mkdir");
            let (stats, _) =
                copy_upper_with(&upper, &dest, Some(&first), None, clean).expect("copy");
            (dest, stats)
        };
        let (second, stats) = copy("second", &clean);
        assert_eq!(fs::read(second.join("a")).expect("a"), b"AAAA", "{stats:?}");
        assert!(
            !second.join("b").exists(),
            "b trusted to the index: {stats:?}"
        );
        assert_eq!(stats.unchanged, 1);
        let (third, _) = copy("third", &CleanFiles::default());
        assert!(
            third.join("b").exists(),
            "without the index b's bytes are compared"
        );

        let diffs = vec!["sha256:1".to_string(), "sha256:2".to_string()];
        let path = dir.path().join("index");
        clean.save(&path, &diffs);
        assert_eq!(CleanFiles::load(&path, &diffs), clean);
        assert!(
            CleanFiles::load(&path, &diffs[..1]).is_empty(),
            "another snapshot"
        );
        fs::write(&path, "garbage").expect("write");
        assert!(CleanFiles::load(&path, &diffs).is_empty());
    }

    fn set_opaque(dir: &Path) {
        let c = cpath(dir).expect("path");
        let name = CString::new(USER_OPAQUE_XATTR).expect("name");
        // SAFETY: setxattr with valid strings and a buffer of the given length.
        let rc = unsafe { libc::setxattr(c.as_ptr(), name.as_ptr(), b"y".as_ptr().cast(), 1, 0) };
        assert_eq!(rc, 0, "setxattr: {}", std::io::Error::last_os_error());
    }

    /// An opaque directory the image has nothing under (overlayfs marks new directories
    /// in merged ones opaque) is compared with the previous snapshot and stored without
    /// its opacity: unchanged files stay out, a deletion is a whiteout. One over a path
    /// of the image (removed and made again) is copied whole and stays opaque.
    #[test]
    fn opaque_directories_that_hide_nothing_are_diffed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let base = dir.path().join("base");
        fs::create_dir_all(base.join("keep")).expect("mkdir");
        fs::write(base.join("keep/old"), b"image").expect("write");
        let upper = dir.path().join("upper");
        for d in ["new/sub", "keep"] {
            fs::create_dir_all(upper.join(d)).expect("mkdir");
        }
        for f in ["new/a", "new/b", "new/sub/c", "keep/g"] {
            fs::write(upper.join(f), f.as_bytes()).expect("write");
        }
        for d in ["new", "new/sub", "keep"] {
            set_opaque(&upper.join(d));
        }
        let layers = [base];
        let copy = |name: &str, prev: Option<&Path>| {
            let dest = dir.path().join(name);
            fs::create_dir(&dest).expect("mkdir");
            let (stats, _) =
                copy_upper_with(&upper, &dest, prev, Some(&layers), &CleanFiles::default())
                    .expect("copy");
            (dest, stats)
        };
        let (first, _) = copy("first", None);
        assert!(
            is_opaque(&first.join("new")),
            "no previous snapshot: kept as is"
        );

        fs::remove_file(upper.join("new/b")).expect("rm");
        let (second, stats) = copy("second", Some(&first));
        assert!(!is_opaque(&second.join("new")) && !is_opaque(&second.join("new/sub")));
        assert!(!second.join("new/a").exists() && !second.join("new/sub/c").exists());
        let b = fs::symlink_metadata(second.join("new/b")).expect("whiteout");
        assert!(
            b.file_type().is_char_device() && b.rdev() == 0,
            "b's deletion"
        );
        assert!(
            is_opaque(&second.join("keep")),
            "hides the image's keep/old"
        );
        assert_eq!(fs::read(second.join("keep/g")).expect("g"), b"keep/g");
        assert_eq!((stats.unchanged, stats.whiteouts), (2, 1), "{stats:?}");

        // Unknown image layers: every opaque directory is copied whole, as before.
        let dest = dir.path().join("third");
        fs::create_dir(&dest).expect("mkdir");
        copy_upper_with(&upper, &dest, Some(&first), None, &CleanFiles::default()).expect("copy");
        assert!(is_opaque(&dest.join("new")) && dest.join("new/a").exists());
    }
}
