//! Layer mounts: one read-only, file-backed EROFS `mount(2)` per layer per node at
//! `mnt/HEX` (the blob file, or its on-demand file, as source; no loop device;
//! `MS_RDONLY | MS_NODEV | MS_NOSUID`), refcounted by the sandboxes using it. A layer whose
//! last sandbox is gone stays mounted (idle) so the next one finds its page cache; mounts
//! that outlive a daemon are re-adopted or cleaned up at its next start.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use crate::{lock, mountinfo, parse_digest, ImageError, ImageStore, Result};

impl ImageStore {
    /// Mount point of layer `hex`.
    pub fn mount_path(&self, hex: &str) -> PathBuf {
        self.root.join("mnt").join(hex)
    }

    /// The mount refcounts (layer hex -> holders; an entry at 0 is an idle mount).
    pub(crate) fn lock_mounts(&self) -> std::sync::MutexGuard<'_, HashMap<String, usize>> {
        lock(&self.mounts)
    }

    /// Mount `hex` at its mount point unless something already is mounted there
    /// (re-adoption after a restart). Caller holds the mounts mutex.
    fn ensure_mounted(&self, hex: &str) -> Result<PathBuf> {
        let local = self.blob_path(hex);
        let mnt = self.mount_path(hex);
        // The local blob, else the layer's on-demand file.
        let blob = if local.exists() {
            local
        } else {
            self.lazy_file(hex)?
                .ok_or_else(|| ImageError::NotFound(format!("sha256:{hex}")))?
        };
        std::fs::create_dir_all(&mnt).map_err(|e| ImageError::io("mkdir", &mnt, e))?;
        if is_mounted(&mnt)? {
            tracing::debug!(digest = %hex, "reusing existing layer mount");
            return Ok(mnt);
        }
        use nix::mount::MsFlags;
        nix::mount::mount(
            Some(&blob),
            &mnt,
            Some("erofs"),
            MsFlags::MS_RDONLY | MsFlags::MS_NODEV | MsFlags::MS_NOSUID,
            None::<&str>,
        )
        .map_err(|errno| ImageError::Mount {
            op: "mount",
            source_path: blob.clone(),
            target: mnt.clone(),
            errno,
        })?;
        tracing::debug!(digest = %hex, mnt = %mnt.display(), "layer mounted");
        Ok(mnt)
    }

    /// Unmount `hex`'s mount point (all stacked mounts) and remove the directory.
    /// Not mounted is fine. A busy mount is detached lazily.
    pub(crate) fn unmount(&self, hex: &str) -> Result<()> {
        use nix::mount::MntFlags;
        let mnt = self.mount_path(hex);
        for _ in 0..16 {
            if !is_mounted(&mnt)? {
                break;
            }
            match nix::mount::umount2(&mnt, MntFlags::empty()) {
                Ok(()) => {}
                Err(nix::errno::Errno::EINVAL) => break,
                Err(nix::errno::Errno::EBUSY) => {
                    tracing::warn!(mnt = %mnt.display(), "layer mount busy; detaching lazily");
                    nix::mount::umount2(&mnt, MntFlags::MNT_DETACH).map_err(|errno| {
                        ImageError::Mount {
                            op: "umount",
                            source_path: mnt.clone(),
                            target: mnt.clone(),
                            errno,
                        }
                    })?;
                }
                Err(errno) => {
                    return Err(ImageError::Mount {
                        op: "umount",
                        source_path: mnt.clone(),
                        target: mnt.clone(),
                        errno,
                    })
                }
            }
        }
        let _ = std::fs::remove_dir(&mnt);
        tracing::debug!(digest = %hex, "layer unmounted");
        Ok(())
    }

    /// Whether layer `hex` must be downloaded from the shared store before it can be
    /// mounted: the node lacks it and does not serve it on demand (with on-demand layers,
    /// a layer whose manifest has a chunk index is not downloaded: ensure_mounted mounts
    /// its lazy file).
    fn must_download(&self, hex: &str) -> Result<bool> {
        Ok(
            self.shared.is_some()
                && !self.blob_path(hex).exists()
                && self.lazy_file(hex)?.is_none(),
        )
    }

    /// Take a reference on the shared read-only mount of layer `digest` (`sha256:<hex>` or hex),
    /// mounting it on first use. Returns the mount point. Pair with [`ImageStore::release`].
    /// A layer only the shared store holds is downloaded first.
    pub fn acquire(&self, digest: &str) -> Result<PathBuf> {
        let hex = parse_digest(digest)?;
        let mut attempt = 0;
        loop {
            let fetched = self.must_download(&hex)? && self.fetch_blob(&hex)?;
            let mut m = self.lock_mounts();
            // An entry means "mounted by us", also at count 0 (idle, kept as a cache).
            let mounted = match m.get(&hex) {
                Some(_) => Ok(self.mount_path(&hex)),
                None => self.ensure_mounted(&hex),
            };
            match mounted {
                Ok(mnt) => {
                    *m.entry(hex.clone()).or_insert(0) += 1;
                    drop(m);
                    self.touch_blob(&hex);
                    if fetched {
                        self.trim_cache_quietly();
                    }
                    return Ok(mnt);
                }
                // Evicted between download and mount by a concurrent trim: fetch again.
                Err(ImageError::NotFound(_)) if self.shared.is_some() && attempt < 2 => {
                    attempt += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// The EROFS file of layer `digest` that its mount reads: the local blob, or the
    /// on-demand file of a lazily served layer. Valid while a reference is held.
    pub fn layer_file(&self, digest: &str) -> Result<PathBuf> {
        let hex = parse_digest(digest)?;
        let blob = self.blob_path(&hex);
        if blob.exists() {
            return Ok(blob);
        }
        self.lazy_file(&hex)?
            .ok_or_else(|| ImageError::NotFound(format!("layer file of sha256:{hex}")))
    }

    /// Drop a reference taken by [`ImageStore::acquire`]. The last one leaves the layer
    /// mounted but idle: the next sandbox of this image then finds its files in the layer's
    /// page cache instead of reading and decompressing them again (a fresh mount is a new
    /// EROFS instance with an empty cache). [`ImageStore::unmount_idle`], image removal and
    /// a node restart drop idle mounts.
    pub fn release(&self, digest: &str) -> Result<()> {
        let hex = parse_digest(digest)?;
        let mut m = self.lock_mounts();
        match m.get_mut(&hex) {
            Some(n) if *n > 0 => {
                *n -= 1;
                Ok(())
            }
            _ => Err(ImageError::NotAcquired(format!("sha256:{hex}"))),
        }
    }

    /// Unmounts every layer that no sandbox uses. Returns the digests unmounted.
    pub fn unmount_idle(&self) -> Result<Vec<String>> {
        let mut m = self.lock_mounts();
        let idle: Vec<String> = m
            .iter()
            .filter(|(_, n)| **n == 0)
            .map(|(h, _)| h.clone())
            .collect();
        let mut out = Vec::new();
        for hex in idle {
            self.unmount(&hex)?;
            m.remove(&hex);
            out.push(format!("sha256:{hex}"));
        }
        Ok(out)
    }

    /// Set the reference count of layer `digest` to `n` (re-adoption after a daemon restart:
    /// `n` = number of surviving sandboxes using it). `n > 0` mounts the layer if needed,
    /// reusing an existing mount; `n == 0` unmounts it.
    pub fn set_refcount(&self, digest: &str, n: usize) -> Result<()> {
        let hex = parse_digest(digest)?;
        let mut m = self.lock_mounts();
        if n == 0 {
            m.remove(&hex);
            return self.unmount(&hex);
        }
        if self.must_download(&hex)? {
            drop(m);
            self.fetch_blob(&hex)?;
            m = self.lock_mounts();
        }
        self.ensure_mounted(&hex)?;
        m.insert(hex, n);
        Ok(())
    }

    /// Current reference count of layer `digest` in this process.
    pub fn refcount(&self, digest: &str) -> Result<usize> {
        let hex = parse_digest(digest)?;
        Ok(self.lock_mounts().get(&hex).copied().unwrap_or(0))
    }

    /// After a crash: unmount every layer mount under `mnt/` that is neither in `in_use`
    /// (digests, `sha256:<hex>` or hex) nor referenced in this process, and remove stale empty
    /// mount point directories. Returns the digests unmounted.
    pub fn cleanup_unused(&self, in_use: &HashSet<String>) -> Result<Vec<String>> {
        let keep: HashSet<String> = in_use.iter().filter_map(|d| parse_digest(d).ok()).collect();
        let mut m = self.lock_mounts();
        let mnt_root = self.root.join("mnt");
        let entries = mountinfo::read()
            .map_err(|e| ImageError::io("read", Path::new("/proc/self/mountinfo"), e))?;
        let mut mounted: Vec<String> = entries
            .iter()
            .filter(|e| e.mount_point.parent() == Some(mnt_root.as_path()))
            .filter_map(|e| {
                e.mount_point
                    .file_name()
                    .and_then(|s| s.to_str())
                    .map(str::to_string)
            })
            .filter(|h| parse_digest(h).is_ok())
            .collect();
        mounted.sort();
        mounted.dedup();
        let mut out = Vec::new();
        for hex in mounted {
            if keep.contains(&hex) || m.get(&hex).copied().unwrap_or(0) > 0 {
                continue;
            }
            self.unmount(&hex)?;
            m.remove(&hex);
            out.push(format!("sha256:{hex}"));
        }
        // Empty mount point dirs left behind.
        if let Ok(rd) = std::fs::read_dir(&mnt_root) {
            for ent in rd.flatten() {
                let name = ent.file_name().to_string_lossy().into_owned();
                if keep.contains(&name) || m.get(&name).copied().unwrap_or(0) > 0 {
                    continue;
                }
                if !mountinfo::is_mounted(&ent.path()).unwrap_or(true) {
                    let _ = std::fs::remove_dir(ent.path());
                }
            }
        }
        Ok(out)
    }
}

/// Whether something is mounted exactly at `path` (per `/proc/self/mountinfo`).
pub fn is_mounted(path: &Path) -> Result<bool> {
    mountinfo::is_mounted(path).map_err(|e| ImageError::io("read mountinfo for", path, e))
}
