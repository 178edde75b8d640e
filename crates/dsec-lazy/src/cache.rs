//! [`ChunkCache`]: fetched chunks as files `DIR/<layer hex>/<chunk index>`, written to a
//! temporary name and renamed, so a crash never leaves half a chunk. Reads refresh a
//! chunk's mtime; past the size limit the oldest chunks go.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

use crate::{LazyError, Result};

/// A cached chunk file: last use, path, size.
type ChunkFile = (SystemTime, PathBuf, u64);

/// The node-local chunk cache.
#[derive(Debug)]
pub struct ChunkCache {
    dir: PathBuf,
    limit: u64,
    /// Bytes held (approximate between trims; recounted at open and trim).
    held: AtomicU64,
}

impl ChunkCache {
    /// Opens (creating) the cache in `dir` with a size limit of `limit` bytes. Chunks an
    /// earlier run left are kept; stray temporary files are removed.
    pub fn open(dir: impl AsRef<Path>, limit: u64) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        std::fs::create_dir_all(&dir).map_err(|e| LazyError::io("mkdir", &dir, e))?;
        let c = Self {
            dir,
            limit,
            held: AtomicU64::new(0),
        };
        let (bytes, _) = c.scan(true)?;
        c.held.store(bytes, Ordering::Relaxed);
        Ok(c)
    }

    fn path(&self, layer: &str, chunk: u64) -> PathBuf {
        self.dir.join(layer).join(chunk.to_string())
    }

    /// Whether a chunk is cached (without reading it).
    pub fn contains(&self, layer: &str, chunk: u64) -> bool {
        self.path(layer, chunk).is_file()
    }

    /// Bytes `part` of a cached chunk whose full length is `len`, if the chunk is cached
    /// whole.
    pub fn read_part(
        &self,
        layer: &str,
        chunk: u64,
        len: u64,
        part: std::ops::Range<u64>,
    ) -> Option<Vec<u8>> {
        use std::os::unix::fs::FileExt;
        let f = std::fs::File::open(self.path(layer, chunk)).ok()?;
        if f.metadata().ok()?.len() != len || part.end > len || part.start > part.end {
            return None;
        }
        let mut buf = vec![0u8; (part.end - part.start) as usize];
        f.read_exact_at(&mut buf, part.start).ok()?;
        // Mark it used for LRU, at most once a minute per chunk.
        let stale = f
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_none_or(|age| age > std::time::Duration::from_secs(60));
        if stale {
            let _ = f.set_modified(SystemTime::now());
        }
        Some(buf)
    }

    /// The cached bytes of a chunk, if present.
    pub fn get(&self, layer: &str, chunk: u64) -> Option<Vec<u8>> {
        let p = self.path(layer, chunk);
        let data = std::fs::read(&p).ok()?;
        if let Ok(f) = std::fs::File::open(&p) {
            let _ = f.set_modified(SystemTime::now());
        }
        Some(data)
    }

    /// Stores a chunk (already verified) and trims the cache if it grew past its limit.
    pub fn put(&self, layer: &str, chunk: u64, data: &[u8]) -> Result<()> {
        let dir = self.dir.join(layer);
        std::fs::create_dir_all(&dir).map_err(|e| LazyError::io("mkdir", &dir, e))?;
        let tmp = dir.join(format!(".{chunk}.{:016x}", rand::random::<u64>()));
        let dest = self.path(layer, chunk);
        if let Err(e) = std::fs::write(&tmp, data).and_then(|()| std::fs::rename(&tmp, &dest)) {
            let _ = std::fs::remove_file(&tmp);
            return Err(LazyError::io("write chunk", &dest, e));
        }
        let held = self.held.fetch_add(data.len() as u64, Ordering::Relaxed) + data.len() as u64;
        if held > self.limit {
            self.trim()?;
        }
        Ok(())
    }

    /// Bytes the cache holds now.
    pub fn held_bytes(&self) -> u64 {
        self.held.load(Ordering::Relaxed)
    }

    /// Every chunk file (path, size, mtime); with `clean`, stray temporary files go.
    fn scan(&self, clean: bool) -> Result<(u64, Vec<ChunkFile>)> {
        let mut all = Vec::new();
        let mut bytes = 0;
        let rd =
            std::fs::read_dir(&self.dir).map_err(|e| LazyError::io("read_dir", &self.dir, e))?;
        for layer in rd.flatten() {
            let Ok(files) = std::fs::read_dir(layer.path()) else {
                continue;
            };
            for f in files.flatten() {
                let name = f.file_name();
                if name.to_string_lossy().starts_with('.') {
                    if clean {
                        let _ = std::fs::remove_file(f.path());
                    }
                    continue;
                }
                let Ok(m) = f.metadata() else { continue };
                bytes += m.len();
                all.push((
                    m.modified().unwrap_or(SystemTime::UNIX_EPOCH),
                    f.path(),
                    m.len(),
                ));
            }
        }
        Ok((bytes, all))
    }

    /// Removes least recently used chunks until the cache is at 90% of its limit.
    pub fn trim(&self) -> Result<u64> {
        let (mut bytes, mut all) = self.scan(false)?;
        all.sort();
        let target = self.limit / 10 * 9;
        let mut freed = 0;
        for (_, path, len) in all {
            if bytes <= target {
                break;
            }
            if std::fs::remove_file(&path).is_ok() {
                bytes -= len;
                freed += len;
            }
        }
        self.held.store(bytes, Ordering::Relaxed);
        Ok(freed)
    }
}
