//! Provisioning a workspace: mounting it as an EROFS layer (how dsec composes a sandbox's
//! workspace) against extracting the same workspace from a tar.gz into a directory (how a
//! `docker pull` or a per-task checkout lands it), cold page cache each time.
//!
//! Each way ends with one walk over the tree (an `lstat` of every path), so "ready" means
//! every file can be found. Bytes written are the file system's device writes across the
//! provisioning plus a `sync`, so writeback that would come later is counted too.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context};

/// One way of provisioning, measured `n` times.
#[derive(Debug, Default)]
pub(crate) struct Way {
    pub(crate) name: String,
    pub(crate) ms: Vec<f64>,
    pub(crate) written: Vec<u64>,
}

/// What the workspace is.
#[derive(Debug)]
pub(crate) struct Workspace {
    pub(crate) files: u64,
    pub(crate) bytes: u64,
    pub(crate) tar_gz_bytes: u64,
    pub(crate) erofs_bytes: u64,
}

/// Sectors written so far to the block device holding `path` (`/sys/dev/block/M:m/stat`).
fn device_writes(path: &Path) -> anyhow::Result<u64> {
    let dev = std::fs::metadata(path)?.dev();
    let (major, minor) = (libc::major(dev), libc::minor(dev));
    let stat = std::fs::read_to_string(format!("/sys/dev/block/{major}:{minor}/stat"))
        .with_context(|| format!("{} is not on a block device", path.display()))?;
    let sectors: u64 = stat
        .split_whitespace()
        .nth(6)
        .context("short block device stat")?
        .parse()?;
    Ok(sectors * 512)
}

fn sync_and_drop_caches() {
    // SAFETY: sync has no preconditions.
    unsafe { libc::sync() };
    let _ = std::fs::write("/proc/sys/vm/drop_caches", "3");
}

/// `lstat` of every path under `root`; (files, bytes of regular files).
fn walk(root: &Path) -> anyhow::Result<(u64, u64)> {
    let mut stack = vec![root.to_path_buf()];
    let (mut files, mut bytes) = (0u64, 0u64);
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).with_context(|| format!("read {}", dir.display()))? {
            let e = e?;
            let m = std::fs::symlink_metadata(e.path())?;
            files += 1;
            if m.is_dir() {
                stack.push(e.path());
            } else if m.is_file() {
                bytes += m.len();
            }
        }
    }
    Ok((files, bytes))
}

/// Runs `f` cold (synced, caches dropped) and returns (ms, bytes written incl. writeback).
fn measure(on: &Path, f: impl FnOnce() -> anyhow::Result<()>) -> anyhow::Result<(f64, u64)> {
    sync_and_drop_caches();
    let before = device_writes(on)?;
    let t = Instant::now();
    f()?;
    let ms = t.elapsed().as_secs_f64() * 1000.0;
    // SAFETY: as above.
    unsafe { libc::sync() };
    Ok((ms, device_writes(on)?.saturating_sub(before)))
}

fn mount_erofs(blob: &Path, at: &Path) -> anyhow::Result<()> {
    use nix::mount::{mount, MsFlags};
    mount(
        Some(blob),
        at,
        Some("erofs"),
        MsFlags::MS_RDONLY | MsFlags::MS_NODEV | MsFlags::MS_NOSUID,
        None::<&str>,
    )
    .with_context(|| format!("mount {} on {}", blob.display(), at.display()))
}

fn umount(at: &Path) {
    let _ = nix::mount::umount2(at, nix::mount::MntFlags::MNT_DETACH);
}

/// Measures the three ways `n` times each. `blob` is the workspace's EROFS layer in the
/// node's cache, `tar_gz` the same tree as a tarball; `scratch` is on the same file system.
pub(crate) fn compare(
    blob: &Path,
    tar_gz: &Path,
    scratch: &Path,
    n: usize,
) -> anyhow::Result<(Workspace, Vec<Way>)> {
    let _ = std::fs::remove_dir_all(scratch);
    std::fs::create_dir_all(scratch)?;
    let mnt = scratch.join("mnt");
    std::fs::create_dir_all(&mnt)?;
    mount_erofs(blob, &mnt)?;
    let (files, bytes) = walk(&mnt)?;
    umount(&mnt);
    let ws = Workspace {
        files,
        bytes,
        tar_gz_bytes: std::fs::metadata(tar_gz)?.len(),
        erofs_bytes: std::fs::metadata(blob)?.len(),
    };

    let mut ways = vec![
        Way {
            name: "tar.gz extracted into a directory (GNU tar)".into(),
            ..Default::default()
        },
        Way {
            name: "EROFS layer fetched into the node cache, mounted".into(),
            ..Default::default()
        },
        Way {
            name: "EROFS layer in the node cache, mounted".into(),
            ..Default::default()
        },
    ];
    for _ in 0..n {
        let dir = scratch.join("extracted");
        std::fs::create_dir_all(&dir)?;
        let (ms, w) = measure(scratch, || {
            let st = Command::new("tar")
                .arg("-xzf")
                .arg(tar_gz)
                .arg("-C")
                .arg(&dir)
                .status()
                .context("running tar")?;
            if !st.success() {
                bail!("tar -xzf {} failed: {st}", tar_gz.display());
            }
            walk(&dir).map(drop)
        })?;
        ways[0].ms.push(ms);
        ways[0].written.push(w);
        std::fs::remove_dir_all(&dir)?;

        let cached = scratch.join("cache.erofs");
        let (ms, w) = measure(scratch, || {
            let mut from = std::fs::File::open(blob)?;
            let mut to = std::fs::File::create(&cached)?;
            std::io::copy(&mut from, &mut to)?;
            to.sync_all()?;
            mount_erofs(&cached, &mnt)?;
            walk(&mnt).map(drop)
        })?;
        umount(&mnt);
        ways[1].ms.push(ms);
        ways[1].written.push(w);
        std::fs::remove_file(&cached)?;

        let (ms, w) = measure(scratch, || {
            mount_erofs(blob, &mnt)?;
            walk(&mnt).map(drop)
        })?;
        umount(&mnt);
        ways[2].ms.push(ms);
        ways[2].written.push(w);
    }
    let _ = std::fs::remove_dir_all(scratch);
    Ok((ws, ways))
}

/// The benchmark workspace (built by `scripts/bench`): its directory and tarball.
pub(crate) fn workspace_paths() -> Option<(PathBuf, PathBuf)> {
    let dir = PathBuf::from(std::env::var_os("DSEC_BENCH_WORKSPACE")?);
    let tar = PathBuf::from(std::env::var_os("DSEC_BENCH_WORKSPACE_TAR")?);
    (dir.is_dir() && tar.is_file()).then_some((dir, tar))
}
