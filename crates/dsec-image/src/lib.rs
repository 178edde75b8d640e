//! Minimal image store of dsec: content-addressed, read-only EROFS layers plus named refs,
//! and node-wide shared, refcounted, file-backed mounts of those layers.
//!
//! Layout under the store root (e.g. `/var/lib/dsec/images`):
//!
//! ```text
//! blobs/sha256/<hex>.erofs   one layer each, mode 0444, named by the sha256 of its bytes
//! refs.json                  {"version":1,"refs":{name: {digest,size,created_at,source}}}
//! mnt/<hex>/                 mount point of a layer while some sandbox uses it
//! tmp/                       imports in progress (removed on every failure path)
//! .lock                      flock(2) serialising refs.json updates across processes
//! ```
//!
//! An image is a list of layers, bottom first (one for an imported directory or tarball,
//! one per OCI layer for an OCI import), plus the defaults of its config. Layers are
//! addressed by digest and names are only refs; a one-layer image's digest is its layer's,
//! a multi-layer image's is the sha256 of its layer list. A sandbox can stack several
//! images: the node mounts each layer once and hands overlayfs the whole list.
//!
//! Layers are built with `mkfs.erofs -zlz4` (erofs-utils; uncompressed when a sample of
//! the tree shows lz4 would not pay, see `erofs::worth_compressing`) reproducibly: fixed UUID and a
//! fixed `SOURCE_DATE_EPOCH` far in the future (which keeps per-file mtimes), so the same tree
//! gives the same digest.
//!
//! With a shared blob store (see [`shared`]) the store above is the node's cache of it:
//! imports and commits upload their layers and refs, resolves read refs from it, and
//! layers missing here are downloaded on first use and evicted when the cache is full.
//!
//! Mounts use `mount(2)` with the blob file as source (a true file-backed EROFS mount, no loop
//! device), `MS_RDONLY | MS_NODEV | MS_NOSUID`.
//!
//! What lives where: `catalog` (names: `refs.json`, resolve, tag, list, remove, gc of
//! names), `blobs` (layer files by digest, the node's layer cache), `erofs` (the
//! `mkfs.erofs` builder), `import` (directory, tar and `.erofs` imports; OCI images in
//! [`oci`]), [`packdiff`] (commits of a sandbox's upper directory), `mounts` (refcounted
//! layer mounts) and [`shared`] (the cluster's blob store); this file holds the store
//! itself and its `tmp/`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

mod blobs;
mod catalog;
mod erofs;
mod error;
mod extract;
mod import;
mod mounts;
pub mod oci;
pub mod packdiff;
mod pulled;
pub mod shared;
mod tar_erofs;

pub use blobs::{parse_digest, CacheTrim};
pub use catalog::{dedup_layers, image_digest, validate_name, Removed, ResolvedImage};
pub use dsec_blob::BlobStore;
pub use dsec_mountinfo as mountinfo;
pub use dsec_wire::v1::{Image, ImageConfig};
pub use error::{ImageError, Result};
pub use import::{ImportPhase, ImportProgress};
pub use mounts::is_mounted;
pub use pulled::{converted_key, parse_config, PulledLayer};

use catalog::RefEntry;

/// Entry points for the `cargo fuzz` targets (`fuzz/` at the repository root): the tar
/// and OCI importers up to the point where a layer would be built.
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing {
    use std::path::Path;

    use crate::{extract, ImageError, Result};

    /// Extracts the (possibly compressed) tar file `archive` into the empty directory
    /// `dest`, as a root file system import does.
    pub fn extract_tar(archive: &Path, dest: &Path) -> Result<bool> {
        let kind = extract::sniff(archive)?
            .ok_or_else(|| ImageError::UnsupportedSource(archive.to_path_buf()))?;
        extract::extract(archive, kind, dest, &|_| {})
    }

    /// Reads the OCI layout or `docker save` archive `source` and applies its layers
    /// into the empty directory `dest`.
    pub fn unpack_oci(source: &Path, dest: &Path) -> Result<()> {
        crate::oci::unpack_flat(source, dest)
    }

    /// Packs the uncompressed layer tar `data` into the new EROFS image `out`, as a
    /// pull does; returns the image's size.
    pub fn pack_layer(data: &[u8], out: &Path) -> Result<u64> {
        let mut w = crate::tar_erofs::TarErofs::create(out, Path::new("layer.tar"))?;
        let mut r: &[u8] = data;
        w.add_tar(&mut r)?;
        w.finish()
    }
}

/// Default store root on a node.
pub const DEFAULT_ROOT: &str = "/var/lib/dsec/images";

/// Unix time in milliseconds (0 if the clock is before 1970).
pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Locks `m`, also after another holder panicked: every guarded map is updated by
/// single inserts and removes, so it is never left half-changed.
pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Where an [`ImageStore`] keeps layers besides its own directory.
#[derive(Debug, Clone, Default)]
pub struct StoreOptions {
    /// The cluster's shared blob store; `None`: the node's directory is the only store.
    pub shared: Option<Arc<dyn BlobStore>>,
    /// Size limit of the node's layer cache in bytes (only layers the shared store holds
    /// are evicted); `None`: unlimited.
    pub cache_limit: Option<u64>,
    /// Serve layers the node lacks on demand (see `dsec-lazy`) instead of downloading
    /// them whole. Needs a shared store.
    pub lazy: Option<LazyLayers>,
    /// How long a ref read from the shared store is reused before it is read again (zero:
    /// every resolve reads the store). Names re-pointed or removed on other nodes are seen
    /// within this time; this node's own changes at once.
    pub ref_ttl: Duration,
    /// Chunk size of the chunk index written with each uploaded layer (the unit
    /// on-demand loading fetches and verifies; zero: 256 KiB). Smaller chunks fetch less
    /// beyond what is read but need more requests: suit it to the store's latency.
    pub chunk_size: u64,
}

/// How a store serves layers on demand.
#[derive(Debug, Clone)]
pub struct LazyLayers {
    /// The chunk cache's size limit in bytes.
    pub chunk_cache_limit: u64,
    /// The shared store as `dsec_blob::open` takes it (the lazy layer server opens it).
    pub store_spec: String,
    /// How to start the lazy layer server process when none is running.
    pub launcher: dsec_lazy::Launcher,
    /// Fetch and prefetch behaviour.
    pub opts: dsec_lazy::LazyOptions,
}

/// The image store. Cheap operations only touch small files; `import` runs mkfs.erofs.
/// Thread-safe: mount refcounts sit behind a mutex, refs.json updates behind `flock(2)`.
/// With a shared store, calls may do network I/O: call them from blocking threads.
#[derive(Debug)]
pub struct ImageStore {
    root: PathBuf,
    /// Layer hex digest -> number of holders of its mount.
    mounts: Mutex<HashMap<String, usize>>,
    shared: Option<Arc<dyn BlobStore>>,
    cache_limit: Option<u64>,
    /// The server of on-demand layers, when enabled.
    lazy: Option<dsec_lazy::LazyClient>,
    /// Layers (hex) this process has added to the lazy layer server.
    lazy_added: Mutex<std::collections::HashSet<String>>,
    /// One lock per layer being downloaded from the shared store.
    fetching: Mutex<HashMap<String, Arc<Mutex<()>>>>,
    /// Refs read from the shared store: when, and what (`None`: absent there).
    ref_cache: Mutex<HashMap<String, (std::time::Instant, Option<RefEntry>)>>,
    ref_ttl: Duration,
    chunk_size: u64,
}

impl ImageStore {
    /// Open (creating if needed) the store rooted at `root`, with no shared store.
    pub fn open(root: impl AsRef<Path>) -> Result<Self> {
        Self::open_with(root, StoreOptions::default())
    }

    /// Open (creating if needed) the store rooted at `root` in front of `opts.shared`.
    pub fn open_with(root: impl AsRef<Path>, opts: StoreOptions) -> Result<Self> {
        let root = root.as_ref();
        for d in [
            root.to_path_buf(),
            root.join("blobs/sha256"),
            root.join("mnt"),
            root.join("tmp"),
        ] {
            std::fs::create_dir_all(&d).map_err(|e| ImageError::io("mkdir", &d, e))?;
        }
        if !opts.chunk_size.is_multiple_of(4096) {
            return Err(ImageError::io(
                "chunk size",
                root,
                std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("{} bytes is not a multiple of 4096", opts.chunk_size),
                ),
            ));
        }
        let root =
            std::fs::canonicalize(root).map_err(|e| ImageError::io("canonicalize", root, e))?;
        let lazy = match (&opts.lazy, &opts.shared) {
            (Some(lazy), Some(_)) => Some(shared::attach_lazy(&root, lazy)?),
            _ => None,
        };
        Ok(Self {
            root,
            mounts: Mutex::new(HashMap::new()),
            shared: opts.shared,
            cache_limit: opts.cache_limit,
            lazy,
            lazy_added: Mutex::new(Default::default()),
            fetching: Mutex::new(HashMap::new()),
            ref_cache: Mutex::new(HashMap::new()),
            ref_ttl: opts.ref_ttl,
            chunk_size: match opts.chunk_size {
                0 => dsec_lazy::DEFAULT_CHUNK_SIZE,
                n => n,
            },
        })
    }

    /// The (canonical) store root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// A new directory under `tmp/` (removed when the guard drops).
    fn tempdir(&self, prefix: &str) -> Result<tempfile::TempDir> {
        let tmp = self.root.join("tmp");
        std::fs::create_dir_all(&tmp).map_err(|e| ImageError::io("mkdir", &tmp, e))?;
        tempfile::Builder::new()
            .prefix(prefix)
            .tempdir_in(&tmp)
            .map_err(|e| ImageError::io("mkdtemp", &tmp, e))
    }

    /// A directory under `tmp/` to receive an upload in (removed when the guard drops; a
    /// crash's leftover goes with [`ImageStore::clean_tmp`]).
    pub fn upload_dir(&self) -> Result<tempfile::TempDir> {
        self.tempdir("upload-")
    }

    /// Remove leftovers in `tmp/` older than `age` (imports interrupted by a crash).
    pub fn clean_tmp(&self, age: Duration) -> Result<usize> {
        let tmp = self.root.join("tmp");
        let mut n = 0;
        let rd = std::fs::read_dir(&tmp).map_err(|e| ImageError::io("read_dir", &tmp, e))?;
        for ent in rd.flatten() {
            let old = ent
                .metadata()
                .ok()
                .and_then(|m| m.modified().ok())
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|e| e >= age);
            if old {
                let p = ent.path();
                let r = if p.is_dir() {
                    std::fs::remove_dir_all(&p)
                } else {
                    std::fs::remove_file(&p)
                };
                r.map_err(|e| ImageError::io("remove", &p, e))?;
                n += 1;
            }
        }
        Ok(n)
    }
}
