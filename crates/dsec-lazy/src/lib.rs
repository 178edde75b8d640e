//! On-demand layers: a node exposes a layer it does not hold as a file in a FUSE file
//! system of its own, and mounts EROFS file-backed on that file. A read of a range the
//! node lacks fetches the covering chunks (256 KiB by default) from the blob store with
//! range reads, checks each against the layer's chunk index, keeps it in a node-local
//! chunk cache (size-limited, least recently used out, surviving restarts), and answers.
//! Concurrent reads of one chunk fetch it once.
//!
//! Failures never hang a sandbox: a fetch that does not finish within the fetch timeout,
//! a store that keeps failing (three attempts with backoff), or a chunk whose digest is
//! wrong answers the read with `EIO`, counts a fault and logs it.
//!
//! - [`ChunkIndex`]: a layer's size, chunk size and per-chunk sha256, computed at upload
//!   and stored next to the blob.
//! - [`ChunkCache`]: the node-local chunk files.
//! - [`LazyMount`]: the FUSE file system; [`LazyMount::add_layer`] puts a layer's file in it.
//! - [`PrefetchList`]: the chunks a layer's first readers touched, replayed ahead of reads
//!   on nodes that add the layer later.
//! - [`server`]: the process that owns the mount so that it outlives daemon restarts, and
//!   [`LazyClient`], the daemon's handle on it.

mod cache;
mod fs;
pub mod server;

use std::io::Read;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

pub use cache::ChunkCache;
pub use fs::{LayerStats, LazyMount, LazyOptions, PrefetchList, FETCH_BUCKETS_MS};
pub use server::{Launcher, LazyClient, ServeConfig, ServerStats};

/// Default chunk size: 256 KiB.
pub const DEFAULT_CHUNK_SIZE: u64 = 256 << 10;

/// Errors of this crate.
#[derive(Debug, thiserror::Error)]
pub enum LazyError {
    /// A local file operation failed.
    #[error("{op} {}: {source}", path.display())]
    Io {
        /// What was attempted.
        op: &'static str,
        /// The path.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The FUSE mount failed.
    #[error("mounting the lazy layer file system at {}: {source}", path.display())]
    Mount {
        /// The mount point.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// A chunk index is inconsistent.
    #[error("chunk index of {digest}: {reason}")]
    BadIndex {
        /// The layer.
        digest: String,
        /// What is wrong.
        reason: String,
    },
}

impl LazyError {
    pub(crate) fn io(op: &'static str, path: &Path, source: std::io::Error) -> Self {
        LazyError::Io {
            op,
            path: path.to_path_buf(),
            source,
        }
    }
}

/// Result alias of this crate.
pub type Result<T, E = LazyError> = std::result::Result<T, E>;

/// What a node needs to serve a layer lazily: its size and the digest of every chunk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkIndex {
    /// Hex sha256 of the whole layer (its name).
    pub digest: String,
    /// Layer size in bytes.
    pub size: u64,
    /// Chunk size in bytes; the last chunk may be shorter.
    pub chunk_size: u64,
    /// Hex sha256 of each chunk, in order.
    pub chunks: Vec<String>,
    /// The chunks holding the file system's metadata (superblock, inodes, directories):
    /// a node fetches them when it adds the layer, so path lookups never wait on the
    /// store. Found at upload by [`metadata_chunks`].
    #[serde(default)]
    pub meta: Vec<u64>,
}

impl ChunkIndex {
    /// Reads `file` once and indexes it in chunks of `chunk_size` bytes.
    pub fn of_file(file: &Path, chunk_size: u64) -> Result<Self> {
        let mut f = std::fs::File::open(file).map_err(|e| LazyError::io("open", file, e))?;
        let mut whole = Sha256::new();
        let mut chunks = Vec::new();
        let mut buf = vec![0u8; usize::try_from(chunk_size).unwrap_or(1 << 18)];
        let mut size = 0u64;
        loop {
            let mut filled = 0;
            while filled < buf.len() {
                match f.read(&mut buf[filled..]) {
                    Ok(0) => break,
                    Ok(n) => filled += n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(LazyError::io("read", file, e)),
                }
            }
            if filled == 0 {
                break;
            }
            whole.update(&buf[..filled]);
            chunks.push(hex::encode(Sha256::digest(&buf[..filled])));
            size += filled as u64;
            if filled < buf.len() {
                break;
            }
        }
        Ok(Self {
            digest: hex::encode(whole.finalize()),
            size,
            chunk_size,
            chunks,
            meta: Vec::new(),
        })
    }

    /// Checks that the chunk count matches the size.
    pub fn validate(&self) -> Result<()> {
        let bad = |reason: String| LazyError::BadIndex {
            digest: self.digest.clone(),
            reason,
        };
        if self.chunk_size == 0 || self.chunk_size & 4095 != 0 {
            return Err(bad(format!(
                "chunk size {} is not a positive multiple of 4096",
                self.chunk_size
            )));
        }
        let want = self.size.div_ceil(self.chunk_size);
        if let Some(bad_meta) = self.meta.iter().find(|&&m| m >= want) {
            return Err(bad(format!(
                "metadata chunk {bad_meta} past the last chunk"
            )));
        }
        if self.chunks.len() as u64 != want {
            return Err(bad(format!(
                "{} chunk digests for {} bytes in chunks of {}",
                self.chunks.len(),
                self.size,
                self.chunk_size
            )));
        }
        Ok(())
    }

    /// Byte range of chunk `i`.
    pub fn range(&self, i: u64) -> std::ops::Range<u64> {
        let start = i * self.chunk_size;
        start..(start + self.chunk_size).min(self.size)
    }
}

/// The chunks of the EROFS layer `blob` that a walk of its whole tree reads (every
/// directory listed, every entry's inode looked up): its metadata, in first-read order.
/// Serves the layer through a private [`LazyMount`] backed by the file itself, mounts it,
/// walks it and records what the kernel asked for. Needs root and FUSE; `scratch` is a
/// directory of its own (removed after).
pub fn metadata_chunks(blob: &Path, index: &ChunkIndex, scratch: &Path) -> Result<Vec<u64>> {
    let dir = blob
        .parent()
        .ok_or_else(|| LazyError::io("locate", blob, std::io::Error::other("no parent")))?;
    let key = blob
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| LazyError::io("locate", blob, std::io::Error::other("bad name")))?
        .to_string();
    let store: std::sync::Arc<dyn dsec_blob::BlobStore> = std::sync::Arc::new(
        dsec_blob::DirStore::open(dir)
            .map_err(|e| LazyError::io("open", dir, std::io::Error::other(e)))?,
    );
    let cache = std::sync::Arc::new(ChunkCache::open(scratch.join("chunks"), u64::MAX)?);
    // A node's kernel readahead, so the list holds what lookups on a node will read; no
    // read-ahead of our own, which would add data chunks.
    let opts = LazyOptions {
        read_ahead_bytes: 0,
        ..LazyOptions::default()
    };
    let walked = (|| {
        let lazy = LazyMount::mount(&scratch.join("fuse"), store, cache, opts)?;
        let file = lazy.add_layer(&key, index.clone(), None)?;
        lazy.record_everything(&index.digest);
        let mnt = scratch.join("mnt");
        std::fs::create_dir_all(&mnt).map_err(|e| LazyError::io("mkdir", &mnt, e))?;
        mount_erofs(&file, &mnt)?;
        let mut stack = vec![mnt.clone()];
        while let Some(d) = stack.pop() {
            let Ok(entries) = std::fs::read_dir(&d) else {
                continue;
            };
            for e in entries.flatten() {
                if let Ok(m) = std::fs::symlink_metadata(e.path()) {
                    if m.is_dir() {
                        stack.push(e.path());
                    }
                }
            }
        }
        detach(&mnt);
        Ok(lazy.take_recording(&index.digest))
    })();
    let _ = std::fs::remove_dir_all(scratch);
    walked
}

fn mount_erofs(file: &Path, at: &Path) -> Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| {
        std::ffi::CString::new(p.as_os_str().as_bytes())
            .map_err(|e| LazyError::io("path", p, std::io::Error::other(e)))
    };
    let (src, dst) = (c(file)?, c(at)?);
    // SAFETY: valid C strings; a read-only EROFS mount of a regular file.
    let rc = unsafe {
        libc::mount(
            src.as_ptr(),
            dst.as_ptr(),
            c"erofs".as_ptr(),
            libc::MS_RDONLY | libc::MS_NODEV | libc::MS_NOSUID,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        return Err(LazyError::io(
            "mount erofs on",
            file,
            std::io::Error::last_os_error(),
        ));
    }
    Ok(())
}

/// Detaches the mount at `at` (lazily: busy mounts go when their last user does).
pub(crate) fn detach(at: &Path) {
    use std::os::unix::ffi::OsStrExt;
    if let Ok(c) = std::ffi::CString::new(at.as_os_str().as_bytes()) {
        // SAFETY: a valid C string; MNT_DETACH has no other preconditions.
        unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
    }
}
