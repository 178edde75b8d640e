//! Content-addressed layer files: `blobs/sha256/HEX.erofs`, each named by the sha256 of
//! its bytes, read-only once stored. How a built layer gets there (hash, seal, keep one
//! copy), and the node's layer cache: with a shared store, `blobs/` is a cache of it,
//! trimmed to its limit least recently used first (the download itself is in `shared`).

use std::fs::File;
use std::io::{self, Read};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use sha2::{Digest as _, Sha256};

use crate::shared::blob_key;
use crate::{is_mounted, ImageError, ImageStore, ImportPhase, ImportProgress, Result};

/// Parse `sha256:<hex>` or a bare 64-char lowercase hex into the hex part.
pub fn parse_digest(digest: &str) -> Result<String> {
    let hex = digest.strip_prefix("sha256:").unwrap_or(digest);
    if hex.len() == 64
        && hex
            .bytes()
            .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c))
    {
        Ok(hex.to_string())
    } else {
        Err(ImageError::InvalidDigest(digest.to_string()))
    }
}

/// What [`ImageStore::trim_cache`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CacheTrim {
    /// Layers removed from the node's cache (`sha256:<hex>`).
    pub evicted: Vec<String>,
    /// Bytes they took.
    pub freed_bytes: u64,
    /// Bytes the cache holds now.
    pub cached_bytes: u64,
}

impl ImageStore {
    /// The directory of the blobs.
    pub(crate) fn blob_dir(&self) -> PathBuf {
        self.root.join("blobs/sha256")
    }

    /// Path of the blob of layer `hex`.
    pub fn blob_path(&self, hex: &str) -> PathBuf {
        self.blob_dir().join(format!("{hex}.erofs"))
    }

    /// Hashes a built EROFS file and moves it into `blobs/` (or drops it when an identical
    /// blob is stored). Returns its `sha256:` digest and size.
    pub(crate) fn put_blob(
        &self,
        layer: &Path,
        progress: &dyn Fn(ImportProgress),
    ) -> Result<(String, u64)> {
        let (hex, size) = hash_file(layer, progress)?;
        progress(ImportProgress {
            phase: ImportPhase::Storing,
            bytes_done: 0,
            bytes_total: Some(size),
        });
        let blob = self.blob_path(&hex);
        if blob.exists() {
            tracing::debug!(digest = %hex, "identical layer already stored");
        } else {
            seal_blob(layer, &blob)?;
        }
        Ok((format!("sha256:{hex}"), size))
    }

    /// Bytes of all stored blobs.
    pub(crate) fn blob_bytes(&self) -> u64 {
        std::fs::read_dir(self.blob_dir())
            .map(|d| {
                d.filter_map(Result::ok)
                    .filter_map(|e| e.metadata().ok())
                    .map(|m| m.len())
                    .sum()
            })
            .unwrap_or(0)
    }

    /// Deletes layer `hex`'s blob and mount point unless a sandbox mounts it; an idle
    /// mount of it is dropped first. Returns whether the blob is gone. Deciding that no
    /// image needs the layer any more is the caller's part.
    pub(crate) fn delete_blob(&self, hex: &str) -> Result<bool> {
        let mut mounts = self.lock_mounts();
        match mounts.get(hex).copied() {
            Some(n) if n > 0 => return Ok(false),
            Some(_) => {
                // An idle mount of a layer that is going away.
                self.unmount(hex)?;
                mounts.remove(hex);
            }
            None => {}
        }
        let mnt = self.mount_path(hex);
        if is_mounted(&mnt)? {
            return Ok(false);
        }
        let blob = self.blob_path(hex);
        match std::fs::remove_file(&blob) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(ImageError::io("unlink", &blob, e)),
        }
        let _ = std::fs::remove_dir(&mnt);
        Ok(true)
    }

    /// Marks layer `hex` as just used (its cache entry's mtime orders eviction).
    pub(crate) fn touch_blob(&self, hex: &str) {
        if self.cache_limit.is_none() {
            return;
        }
        let p = self.blob_path(hex);
        if let Ok(f) = File::open(&p) {
            let _ = f.set_modified(SystemTime::now());
        }
    }

    /// [`ImageStore::trim_cache`], logging a failure.
    pub(crate) fn trim_cache_quietly(&self) {
        if let Err(e) = self.trim_cache() {
            tracing::warn!(error = %e, "trimming the layer cache failed");
        }
    }

    /// Brings the node's layer cache under its limit, least recently used first. Only
    /// layers that are not mounted and that the shared store holds are removed; without a
    /// limit or a shared store nothing is.
    pub fn trim_cache(&self) -> Result<CacheTrim> {
        let dir = self.blob_dir();
        let mut entries: Vec<(SystemTime, String, u64)> = Vec::new();
        let rd = std::fs::read_dir(&dir).map_err(|e| ImageError::io("read_dir", &dir, e))?;
        for ent in rd.flatten() {
            let name = ent.file_name().to_string_lossy().into_owned();
            let Some(hex) = name.strip_suffix(".erofs") else {
                continue;
            };
            let Ok(m) = ent.metadata() else { continue };
            let used = m.modified().unwrap_or(UNIX_EPOCH);
            entries.push((used, hex.to_string(), m.len()));
        }
        let mut cached: u64 = entries.iter().map(|e| e.2).sum();
        let mut out = CacheTrim::default();
        let (Some(limit), Some(shared)) = (self.cache_limit, &self.shared) else {
            out.cached_bytes = cached;
            return Ok(out);
        };
        entries.sort();
        let in_use = |hex: &str| self.lock_mounts().get(hex).copied().unwrap_or(0) > 0;
        for (_, hex, len) in entries {
            if cached <= limit {
                break;
            }
            // The store is asked without holding the mounts lock: creates go on meanwhile.
            if in_use(&hex)
                || shared
                    .head(&blob_key(&hex))
                    .map_err(ImageError::Shared)?
                    .is_none()
            {
                continue;
            }
            if !self.delete_blob(&hex)? {
                continue; // acquired since, or still mounted
            }
            tracing::info!(digest = %hex, size = len, "layer evicted from the node cache");
            cached -= len;
            out.freed_bytes += len;
            out.evicted.push(format!("sha256:{hex}"));
        }
        out.cached_bytes = cached;
        Ok(out)
    }
}

/// Makes the finished layer file `tmp` read-only and durable and moves it to `blob`.
pub(crate) fn seal_blob(tmp: &Path, blob: &Path) -> Result<()> {
    std::fs::set_permissions(tmp, std::fs::Permissions::from_mode(0o444))
        .map_err(|e| ImageError::io("chmod", tmp, e))?;
    File::open(tmp)
        .and_then(|f| f.sync_all())
        .map_err(|e| ImageError::io("fsync", tmp, e))?;
    std::fs::rename(tmp, blob).map_err(|e| ImageError::io("rename", blob, e))
}

/// sha256 of a file as lowercase hex, and its size; reports [`ImportPhase::Hashing`].
pub(crate) fn hash_file(path: &Path, progress: &dyn Fn(ImportProgress)) -> Result<(String, u64)> {
    let mut f = File::open(path).map_err(|e| ImageError::io("open", path, e))?;
    let total = f
        .metadata()
        .map_err(|e| ImageError::io("stat", path, e))?
        .len();
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut done = 0u64;
    let mut reported = 0u64;
    progress(ImportProgress {
        phase: ImportPhase::Hashing,
        bytes_done: 0,
        bytes_total: Some(total),
    });
    loop {
        let n = match f.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(ImageError::io("read", path, e)),
        };
        h.update(&buf[..n]);
        done += n as u64;
        if done - reported >= 16 << 20 {
            reported = done;
            progress(ImportProgress {
                phase: ImportPhase::Hashing,
                bytes_done: done,
                bytes_total: Some(total),
            });
        }
    }
    progress(ImportProgress {
        phase: ImportPhase::Hashing,
        bytes_done: done,
        bytes_total: Some(total),
    });
    Ok((hex::encode(h.finalize()), done))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests() {
        let hex = "a".repeat(64);
        assert_eq!(
            parse_digest(&format!("sha256:{hex}")).ok(),
            Some(hex.clone())
        );
        assert_eq!(parse_digest(&hex).ok(), Some(hex.clone()));
        for bad in [
            "sha256:",
            "sha256:xyz",
            &"A".repeat(64),
            &"a".repeat(63),
            "sha512:aa",
        ] {
            assert!(parse_digest(bad).is_err(), "{bad:?} accepted");
        }
    }
}
