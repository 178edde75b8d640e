//! Per-sandbox writable disks with a hard size limit.
//!
//! Project quotas are not available on every kernel (this one lacks ext4 `QFMT_V2` and
//! XFS quota), so each sandbox's writable layer is its own small file system: a sparse
//! ext4 image on a loop device, mounted on the host, holding the overlay's `upper` and
//! `work` directories. A full disk gives the sandbox `ENOSPC` and touches nobody else.
//!
//! Making a disk costs an extent copy of a formatted template (a few MiB of metadata; the
//! rest is holes), one `LOOP_CONFIGURE` and one `mount`: a few milliseconds. A background
//! thread keeps a pool of mounted disks of the default size so a create only renames a
//! directory.
//!
//! Layout under the root directory:
//! - `templates/<FORMAT>-<MB>.img`: a freshly formatted file system per size in use
//!   (templates of another format, left by an older node, are removed at open);
//! - `pool/<MB>-<rand>/{disk.img,mnt/{upper,work}}`: ready disks.
//!
//! A provisioned disk is a directory with the same two entries, renamed to where the
//! caller wants it (the mount follows the rename). [`release`] detaches the mount (the
//! loop device goes with its last user) and deletes the directory. After a crash, the
//! pool is emptied and refilled by the next [`Disks::open`]; disks handed out belong to
//! their sandboxes and are released with them.

mod loopdev;
mod mountapi;
mod probe;

use std::fs;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::mount::{mount, umount2, MntFlags, MsFlags};

/// Smallest disk we make: ext4 needs room for its own metadata.
pub const MIN_DISK_MB: u64 = 16;

/// A disk operation failed.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    /// A system call failed.
    #[error("{op}: {source}")]
    Os {
        /// What was attempted.
        op: &'static str,
        /// OS error.
        source: std::io::Error,
    },
    /// A file operation failed.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was attempted.
        op: &'static str,
        /// On which path.
        path: PathBuf,
        /// OS error.
        source: std::io::Error,
    },
    /// `mkfs.ext4` failed or is missing.
    #[error("format {path}: {reason} (is e2fsprogs installed?)")]
    Format {
        /// Image being formatted.
        path: PathBuf,
        /// mkfs's complaint.
        reason: String,
    },
    /// The requested size is out of range.
    #[error("disk size {0} MiB is below the minimum of {MIN_DISK_MB} MiB")]
    TooSmall(u64),
}

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> DiskError + 'a {
    move |source| DiskError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

/// Where a disk's file system is mounted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MountMode {
    /// Held by a file descriptor, attached to no mount namespace (`fsmount`). Creating a
    /// sandbox's mount namespace copies every mount of the host's; with detached disks that
    /// cost does not grow with the number of sandboxes. Needs a kernel whose overlayfs
    /// accepts layers on detached mounts (6.18 here does; [`Disks::open`] probes).
    Detached,
    /// Mounted at `DIR/mnt` in the host's mount namespace: works on every kernel.
    Attached,
}

/// How disks are made and pooled.
#[derive(Debug, Clone)]
pub struct DiskConfig {
    /// Directory for templates and the pool (on the same file system as the places
    /// disks are provisioned to, so that a provision is a rename).
    pub root: PathBuf,
    /// Size of pooled disks, in MiB: the size most sandboxes ask for.
    pub default_mb: u64,
    /// Mounted disks of the default size kept ready; 0 makes every disk on demand.
    pub pool_size: usize,
    /// `None` probes the kernel and prefers [`MountMode::Detached`].
    pub mount_mode: Option<MountMode>,
}

/// One disk: a directory holding `disk.img` (and `mnt/` when attached), and its mounted
/// file system. Dropping it without [`Disks::recycle`] or [`release`] leaves the directory
/// (and, when attached, the mount) for a later [`release_dir`].
#[derive(Debug)]
pub struct Disk {
    dir: PathBuf,
    mount: Option<OwnedFd>,
}

impl Disk {
    /// The disk's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The detached mount's fd, when the disk is detached. Pass it to whoever mounts the
    /// overlay; [`Disk::root`] as seen by that process is `/proc/self/fd/N`.
    pub fn mount_fd(&self) -> Option<BorrowedFd<'_>> {
        self.mount.as_ref().map(|f| f.as_fd())
    }

    /// Bytes a write may still take on the disk (what an unprivileged writer sees).
    pub fn free_bytes(&self) -> Result<u64, DiskError> {
        let st = match &self.mount {
            Some(fd) => nix::sys::statvfs::fstatvfs(fd),
            None => nix::sys::statvfs::statvfs(&self.dir.join("mnt")),
        }
        .map_err(|e| DiskError::Io {
            op: "statvfs",
            path: self.dir.clone(),
            source: e.into(),
        })?;
        Ok(st.blocks_available().saturating_mul(st.fragment_size()))
    }

    /// The root of the disk's file system, as a path usable by this process.
    pub fn root(&self) -> PathBuf {
        match &self.mount {
            Some(fd) => PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd())),
            None => self.dir.join("mnt"),
        }
    }
}

/// The overlay's upper directory under a disk root.
pub fn upper_dir(root: &Path) -> PathBuf {
    root.join("upper")
}

/// The overlay's work directory under a disk root.
pub fn work_dir(root: &Path) -> PathBuf {
    root.join("work")
}

/// The node's disk maker: templates, pool and the thread that refills it.
#[derive(Debug)]
pub struct Disks {
    shared: Arc<Shared>,
    refill: Option<JoinHandle<()>>,
}

#[derive(Debug)]
struct Shared {
    cfg: DiskConfig,
    mode: MountMode,
    ready: Mutex<Vec<Disk>>,
    wake: Condvar,
    stop: AtomicBool,
    /// Serialises template creation.
    templates: Mutex<()>,
    /// When a deleted sandbox's disk last came back into the pool.
    recycled_at: Mutex<Option<Instant>>,
}

/// Journal size of disks of 64 MiB and more (ext4's smallest with 4 KiB blocks; smaller
/// disks get 1 MiB).
const JOURNAL_MB: u64 = 4;

/// The format of the disks this version makes: part of template names, so that a node
/// upgraded from a version that made them otherwise stops using its old templates.
const FORMAT: &str = "ext4j4";

/// A template's file name.
fn template_name(size_mb: u64) -> String {
    format!("{FORMAT}-{size_mb}.img")
}

/// While deleted sandboxes' disks have come back within this long, the pool waits for
/// more of them instead of making new disks (unless it runs low): under create/delete
/// churn, new disks would only be released again when the recycled ones overflow it.
const RECYCLE_WINDOW: Duration = Duration::from_secs(2);

impl Shared {
    fn ready(&self) -> MutexGuard<'_, Vec<Disk>> {
        self.ready.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn recycled_at(&self) -> Option<Instant> {
        *self.recycled_at.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn pool_dir(&self) -> PathBuf {
        self.cfg.root.join("pool")
    }

    fn pool_entry(&self) -> PathBuf {
        self.pool_dir().join(format!(
            "{}-{:016x}",
            self.cfg.default_mb,
            rand::random::<u64>()
        ))
    }

    fn template(&self, size_mb: u64) -> Result<PathBuf, DiskError> {
        let path = self.cfg.root.join("templates").join(template_name(size_mb));
        let _guard = self.templates.lock().unwrap_or_else(|p| p.into_inner());
        if path.exists() {
            return Ok(path);
        }
        let tmp = path.with_extension("img.tmp");
        let _ = fs::remove_file(&tmp);
        let file = fs::File::create(&tmp).map_err(io_err("create", &tmp))?;
        file.set_len(size_mb << 20)
            .map_err(io_err("truncate", &tmp))?;
        drop(file);
        // A small journal, though a sandbox's disk does not outlive a host crash: without
        // one, ext4 skips every inode freed in the last 5-300 s when it allocates one,
        // walking them one by one, and a sandbox that deletes a tree and writes a new one
        // (`rm -rf build && make`, a branch switch, a reinstall) creates files ~10x
        // slower. Lazy inode tables stay holes in the sparse image (mounted with
        // `noinit_itable`, never zeroed); so does the journal until it is written.
        let mut mkfs = Command::new("mkfs.ext4");
        mkfs.args(["-q", "-F", "-m", "0", "-i", "16384", "-L", "dsec-disk"])
            .args(["-O", "has_journal"]);
        // mkfs would take 64 MiB for a 10 GiB disk (host disk that each disk fills as its
        // sandbox writes metadata) and an eighth of a 32 MiB one.
        let journal_mb = if size_mb >= 64 { JOURNAL_MB } else { 1 };
        mkfs.args(["-J", &format!("size={journal_mb}")]);
        let out = mkfs
            .args([
                "-E",
                "lazy_itable_init=1,lazy_journal_init=1,nodiscard,root_owner=0:0",
            ])
            .arg(&tmp)
            .output()
            .map_err(|e| DiskError::Format {
                path: tmp.clone(),
                reason: e.to_string(),
            })?;
        if !out.status.success() {
            let _ = fs::remove_file(&tmp);
            return Err(DiskError::Format {
                path: tmp,
                reason: String::from_utf8_lossy(&out.stderr).trim().to_string(),
            });
        }
        fs::rename(&tmp, &path).map_err(io_err("rename", &path))?;
        Ok(path)
    }

    /// Makes a mounted disk of `size_mb` in the new directory `dir`.
    fn make(&self, size_mb: u64, dir: &Path, mode: MountMode) -> Result<Disk, DiskError> {
        let template = self.template(size_mb)?;
        fs::DirBuilder::new()
            .mode(0o700)
            .create(dir)
            .map_err(io_err("mkdir", dir))?;
        let res = make_in(&template, size_mb, dir, mode);
        if res.is_err() {
            let _ = release_dir(dir);
        }
        res
    }

    fn refill_loop(&self) {
        let mut failures = 0u32;
        loop {
            {
                let mut ready = self.ready();
                let low = (self.cfg.pool_size / 4).max(1);
                while !self.stop.load(Ordering::Acquire) {
                    if ready.len() >= self.cfg.pool_size {
                        ready = self.wake.wait(ready).unwrap_or_else(|p| p.into_inner());
                        continue;
                    }
                    let since = self.recycled_at().map(|t| t.elapsed());
                    match since {
                        Some(since) if since < RECYCLE_WINDOW && ready.len() >= low => {
                            ready = self
                                .wake
                                .wait_timeout(ready, RECYCLE_WINDOW - since)
                                .unwrap_or_else(|p| p.into_inner())
                                .0;
                        }
                        _ => break,
                    }
                }
            }
            if self.stop.load(Ordering::Acquire) {
                return;
            }
            match self.make(self.cfg.default_mb, &self.pool_entry(), self.mode) {
                Ok(disk) => {
                    failures = 0;
                    self.ready().push(disk);
                }
                Err(e) => {
                    failures += 1;
                    tracing::warn!(error = %e, "cannot refill the disk pool");
                    // Back off; creates still make disks on demand and report errors.
                    let wait = Duration::from_millis(100 << failures.min(6));
                    let ready = self.ready();
                    let _ = self.wake.wait_timeout(ready, wait);
                }
            }
        }
    }
}

fn make_in(template: &Path, size_mb: u64, dir: &Path, mode: MountMode) -> Result<Disk, DiskError> {
    let img = dir.join("disk.img");
    clone_sparse(template, &img)?;
    let backing = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&img)
        .map_err(io_err("open", &img))?;
    backing
        .set_len(size_mb << 20)
        .map_err(io_err("truncate", &img))?;
    let dev = loopdev::attach(&backing)?;
    drop(backing);
    let disk = match mode {
        MountMode::Detached => {
            let device = dev.path.to_string_lossy();
            let fd = mountapi::mount_detached_ext4(&device, &["noinit_itable"])?;
            Disk {
                dir: dir.to_path_buf(),
                mount: Some(fd),
            }
        }
        MountMode::Attached => {
            let mnt = dir.join("mnt");
            fs::DirBuilder::new()
                .mode(0o755)
                .create(&mnt)
                .map_err(io_err("mkdir", &mnt))?;
            mount(
                Some(&dev.path),
                &mnt,
                Some("ext4"),
                MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
                Some("noinit_itable"),
            )
            .map_err(|e| DiskError::Io {
                op: "mount ext4",
                path: mnt.clone(),
                source: e.into(),
            })?;
            Disk {
                dir: dir.to_path_buf(),
                mount: None,
            }
        }
    };
    // The mount holds the loop device now; closing ours lets autoclear detach it later.
    drop(dev);
    let root = disk.root();
    for p in [upper_dir(&root), work_dir(&root)] {
        fs::DirBuilder::new()
            .mode(0o755)
            .create(&p)
            .map_err(io_err("mkdir", &p))?;
    }
    Ok(disk)
}

/// Copies only the data extents of `src` into the new file `dst`, leaving holes as holes.
fn clone_sparse(src: &Path, dst: &Path) -> Result<(), DiskError> {
    use nix::unistd::{lseek, Whence};
    let from = fs::File::open(src).map_err(io_err("open", src))?;
    let to = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(dst)
        .map_err(io_err("create", dst))?;
    let len = from.metadata().map_err(io_err("stat", src))?.len() as i64;
    to.set_len(len as u64).map_err(io_err("truncate", dst))?;
    let mut pos = 0i64;
    let errno = |op: &'static str| {
        move |e: nix::errno::Errno| DiskError::Io {
            op,
            path: src.to_path_buf(),
            source: e.into(),
        }
    };
    while pos < len {
        let data = match lseek(from.as_raw_fd(), pos, Whence::SeekData) {
            Ok(d) => d,
            Err(nix::errno::Errno::ENXIO) => break,
            Err(e) => return Err(errno("seek data")(e)),
        };
        let hole = lseek(from.as_raw_fd(), data, Whence::SeekHole).map_err(errno("seek hole"))?;
        let (mut off_in, mut off_out) = (data, data);
        let mut left = (hole - data) as usize;
        while left > 0 {
            let n = nix::fcntl::copy_file_range(
                from.as_fd(),
                Some(&mut off_in),
                to.as_fd(),
                Some(&mut off_out),
                left,
            )
            .map_err(errno("copy_file_range"))?;
            if n == 0 {
                break;
            }
            left -= n;
        }
        pos = hole;
    }
    Ok(())
}

/// Releases a disk: closes its detached mount (the file system and loop device go once
/// no sandbox uses them) and deletes its directory.
pub fn release(disk: Disk) -> Result<(), DiskError> {
    let Disk { dir, mount } = disk;
    drop(mount);
    release_dir(&dir)
}

/// Deletes a disk directory found without its [`Disk`] (after a restart): detaches
/// `mnt` first if it is mounted, so removal never walks into a file system. Idempotent.
pub fn release_dir(dir: &Path) -> Result<(), DiskError> {
    let mnt = dir.join("mnt");
    match umount2(&mnt, MntFlags::MNT_DETACH | MntFlags::UMOUNT_NOFOLLOW) {
        Ok(()) | Err(nix::errno::Errno::EINVAL) | Err(nix::errno::Errno::ENOENT) => {}
        Err(e) => {
            return Err(DiskError::Io {
                op: "unmount",
                path: mnt,
                source: e.into(),
            })
        }
    }
    match fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(DiskError::Io {
            op: "remove",
            path: dir.to_path_buf(),
            source: e,
        }),
    }
}

impl Disks {
    /// Prepares the root, empties a pool left by an earlier run, picks the mount mode and
    /// starts the refill thread.
    pub fn open(cfg: DiskConfig) -> Result<Self, DiskError> {
        if cfg.default_mb < MIN_DISK_MB {
            return Err(DiskError::TooSmall(cfg.default_mb));
        }
        let mut b = fs::DirBuilder::new();
        b.recursive(true).mode(0o700);
        for d in [cfg.root.join("templates"), cfg.root.join("pool")] {
            b.create(&d).map_err(io_err("mkdir", &d))?;
        }
        // Templates of another format (an older node's) are never used again.
        let templates = cfg.root.join("templates");
        for entry in fs::read_dir(&templates)
            .map_err(io_err("read_dir", &templates))?
            .filter_map(Result::ok)
        {
            let name = entry.file_name();
            if !name.to_string_lossy().starts_with(&format!("{FORMAT}-")) {
                let _ = fs::remove_file(entry.path());
            }
        }
        let pool = cfg.root.join("pool");
        for entry in fs::read_dir(&pool)
            .map_err(io_err("read_dir", &pool))?
            .filter_map(Result::ok)
        {
            release_dir(&entry.path())?;
        }
        let mut shared = Shared {
            mode: cfg.mount_mode.unwrap_or(MountMode::Attached),
            cfg,
            ready: Mutex::new(Vec::new()),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
            templates: Mutex::new(()),
            recycled_at: Mutex::new(None),
        };
        // Make the default template now: a broken mkfs shows at start, not at create.
        shared.template(shared.cfg.default_mb)?;
        if shared.cfg.mount_mode.is_none() {
            shared.mode = probe::mount_mode(&shared)?;
        }
        tracing::info!(mode = ?shared.mode, "sandbox disks");
        let shared = Arc::new(shared);
        let refill = if shared.cfg.pool_size > 0 {
            let s = shared.clone();
            Some(
                std::thread::Builder::new()
                    .name("dsec-disk-pool".into())
                    .spawn(move || s.refill_loop())
                    .map_err(|source| DiskError::Os {
                        op: "spawn pool thread",
                        source,
                    })?,
            )
        } else {
            None
        };
        Ok(Self { shared, refill })
    }

    /// The configured default size in MiB.
    pub fn default_mb(&self) -> u64 {
        self.shared.cfg.default_mb
    }

    /// How disks are mounted on this node.
    pub fn mount_mode(&self) -> MountMode {
        self.shared.mode
    }

    /// Puts a mounted disk of `size_mb` at `dest` (which must not exist): a pooled one
    /// when the size is the default and the pool has one, else a fresh one.
    pub fn provision(&self, size_mb: u64, dest: &Path) -> Result<Disk, DiskError> {
        if size_mb < MIN_DISK_MB {
            return Err(DiskError::TooSmall(size_mb));
        }
        if size_mb == self.shared.cfg.default_mb {
            let pooled = self.shared.ready().pop();
            self.shared.wake.notify_all();
            if let Some(mut disk) = pooled {
                match fs::rename(&disk.dir, dest) {
                    Ok(()) => {
                        disk.dir = dest.to_path_buf();
                        return Ok(disk);
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, dir = %disk.dir.display(), "pooled disk unusable");
                        let _ = release(disk);
                    }
                }
            }
        }
        self.shared.make(size_mb, dest, self.shared.mode)
    }

    /// Writes a formatted, unmounted disk image of `size_mb` to `dest` (which must not
    /// exist), for a guest to mount (a microVM's writable disk): a sparse copy of the
    /// size's template, the same file system as every sandbox's disk.
    pub fn image(&self, size_mb: u64, dest: &Path) -> Result<(), DiskError> {
        if size_mb < MIN_DISK_MB {
            return Err(DiskError::TooSmall(size_mb));
        }
        let template = self.shared.template(size_mb)?;
        clone_sparse(&template, dest)
    }

    /// Gets a handle back on a disk this process lost (after a restart) while a sandbox
    /// still uses it: mounts the ext4 of the loop device that backs `dir/disk.img` once
    /// more, detached (the same file system, a second mount of it), or takes the attached
    /// mount at `dir/mnt`.
    pub fn reopen(&self, dir: &Path) -> Result<Disk, DiskError> {
        let mnt = dir.join("mnt");
        if is_mountpoint(&mnt, dir) {
            return Ok(Disk {
                dir: dir.to_path_buf(),
                mount: None,
            });
        }
        let img = dir.join("disk.img");
        let want = fs::canonicalize(&img).map_err(io_err("resolve", &img))?;
        let device = fs::read_dir("/sys/block")
            .map_err(io_err("read_dir", Path::new("/sys/block")))?
            .filter_map(Result::ok)
            .find(|e| {
                fs::read_to_string(e.path().join("loop/backing_file"))
                    .is_ok_and(|b| Path::new(b.trim_end()) == want)
            })
            .map(|e| format!("/dev/{}", e.file_name().to_string_lossy()))
            .ok_or_else(|| DiskError::Io {
                op: "find the loop device of",
                path: img.clone(),
                source: std::io::Error::from_raw_os_error(libc::ENOENT),
            })?;
        let fd = mountapi::mount_detached_ext4(&device, &["noinit_itable"])?;
        Ok(Disk {
            dir: dir.to_path_buf(),
            mount: Some(fd),
        })
    }

    /// Number of ready disks in the pool.
    pub fn pooled(&self) -> usize {
        self.shared.ready().len()
    }

    /// Takes back a sandbox's disk once nothing runs on it any more: a lightly used disk
    /// of the default size is emptied and returned to the pool (no unmount, no loop
    /// teardown, no new file system: the cheap path for the create/delete churn of RL
    /// rollouts); any other disk is released. Returns whether it was recycled.
    ///
    /// Emptying removes the old `upper` and `work` whole, so nothing of the previous
    /// sandbox stays visible; ext4 never shows freed blocks through new files.
    pub fn recycle(&self, disk: Disk) -> Result<bool, DiskError> {
        match self.recyclable(&disk) {
            Ok(true) => {}
            Ok(false) => return release(disk).map(|()| false),
            Err(e) => {
                tracing::debug!(error = %e, dir = %disk.dir.display(), "disk not recyclable");
                return release(disk).map(|()| false);
            }
        }
        match self.empty_into_pool(disk) {
            Ok(()) => Ok(true),
            Err((disk, e)) => {
                tracing::debug!(error = %e, dir = %disk.dir.display(), "recycling failed");
                release(disk).map(|()| false)
            }
        }
    }

    fn recyclable(&self, disk: &Disk) -> Result<bool, DiskError> {
        if self.shared.cfg.pool_size == 0 || self.pooled() >= self.shared.cfg.pool_size * 2 {
            return Ok(false);
        }
        let root = disk.root();
        if disk.mount.is_none() && !is_mountpoint(&root, &disk.dir) {
            return Ok(false);
        }
        let st = nix::sys::statvfs::statvfs(&root).map_err(|e| DiskError::Io {
            op: "statvfs",
            path: root.clone(),
            source: e.into(),
        })?;
        let used = (st.blocks() - st.blocks_free()) * st.fragment_size();
        let inodes = st.files() - st.files_free();
        let img = disk.dir.join("disk.img");
        let size = fs::metadata(&img).map_err(io_err("stat", &img))?.len();
        // Only a writable disk of the default size with little in it: removing much
        // would make the delete slow, so big ones go the release way.
        Ok(!st.flags().contains(nix::sys::statvfs::FsFlags::ST_RDONLY)
            && size == self.shared.cfg.default_mb << 20
            && used <= RECYCLE_MAX_USED
            && inodes <= RECYCLE_MAX_INODES)
    }

    fn empty_into_pool(&self, mut disk: Disk) -> Result<(), (Disk, DiskError)> {
        let root = disk.root();
        let trash = root.join(".trash");
        let step = || -> Result<(), DiskError> {
            let _ = fs::remove_dir_all(&trash);
            fs::create_dir(&trash).map_err(io_err("mkdir", &trash))?;
            for p in [upper_dir(&root), work_dir(&root)] {
                let name = p.file_name().unwrap_or_default();
                fs::rename(&p, trash.join(name)).map_err(io_err("rename", &p))?;
            }
            // Whatever else the node kept beside them for the sandbox (a commit's index
            // of clean files) goes too.
            for entry in fs::read_dir(&root).map_err(io_err("read_dir", &root))? {
                let entry = entry.map_err(io_err("read_dir", &root))?;
                let name = entry.file_name();
                if name != ".trash" && name != "lost+found" {
                    let p = entry.path();
                    fs::rename(&p, trash.join(&name)).map_err(io_err("rename", &p))?;
                }
            }
            fs::remove_dir_all(&trash).map_err(io_err("remove", &trash))?;
            for p in [upper_dir(&root), work_dir(&root)] {
                fs::DirBuilder::new()
                    .mode(0o755)
                    .create(&p)
                    .map_err(io_err("mkdir", &p))?;
            }
            Ok(())
        };
        if let Err(e) = step() {
            return Err((disk, e));
        }
        let dest = self.shared.pool_entry();
        if let Err(e) = fs::rename(&disk.dir, &dest) {
            let path = disk.dir.clone();
            return Err((
                disk,
                DiskError::Io {
                    op: "rename",
                    path,
                    source: e,
                },
            ));
        }
        disk.dir = dest;
        *self
            .shared
            .recycled_at
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
        self.shared.ready().push(disk);
        Ok(())
    }
}

/// Most a disk may hold and still be recycled rather than released.
const RECYCLE_MAX_USED: u64 = 64 << 20;
/// Most inodes in use on a disk that is recycled rather than released.
const RECYCLE_MAX_INODES: u64 = 4096;

/// Whether `mnt` is a mount point, judged by its device differing from its parent's
/// (cheap, unlike scanning a mount table that holds one disk per sandbox).
fn is_mountpoint(mnt: &Path, parent: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (fs::symlink_metadata(mnt), fs::symlink_metadata(parent)) {
        (Ok(m), Ok(p)) => m.is_dir() && m.dev() != p.dev(),
        _ => false,
    }
}

impl Drop for Disks {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.shared.wake.notify_all();
        if let Some(t) = self.refill.take() {
            let _ = t.join();
        }
        for disk in self.shared.ready().drain(..) {
            let _ = release(disk);
        }
    }
}
