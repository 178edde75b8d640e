//! The image store's link to a shared [`BlobStore`](crate::BlobStore): the cluster-wide
//! home of layers and refs, with the node's `blobs/` directory as a size-limited cache in
//! front of it.
//!
//! Keys in the shared store:
//!
//! ```text
//! blobs/sha256/<hex>.erofs   a layer (immutable, named by the sha256 of its bytes)
//! blobs/sha256/<hex>.json    its manifest: digest, size, compression, source, created,
//!                            chunk index
//! blobs/sha256/<hex>.prefetch.json   the chunks its first sandbox read (on-demand layers)
//! refs/<name>/@ref.json      a named image: its layers, config, size, source, created
//! ```
//!
//! (`@` cannot occur in a name, so `refs/a/@ref.json` and `refs/a/b/@ref.json` never clash.)
//!
//! Writes go blobs first, then the ref, so no node ever sees a ref whose layers are
//! missing. A node reads a ref from the shared store on resolve (a small object, reused for
//! the store's ref TTL) so that re-pointed names are seen within that time, and falls back to its local copy when the store
//! does not have it (images imported before the store was configured) or cannot be reached.
//! Layers are downloaded on first use, verified against their digest, and kept in the
//! cache; the cache is trimmed to its limit least recently used first, skipping any layer
//! that is mounted or that the shared store does not hold (it could not be fetched again;
//! the trimming is in `blobs`).

use std::collections::HashSet;
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

use crate::blobs::{hash_file, seal_blob};
use crate::catalog::RefEntry;
use crate::{lock, mountinfo, now_ms, parse_digest, ImageError, ImageStore, Result};

/// Key of layer `hex` in the shared store.
pub fn blob_key(hex: &str) -> String {
    format!("blobs/sha256/{hex}.erofs")
}

/// Key of layer `hex`'s manifest in the shared store.
pub fn manifest_key(hex: &str) -> String {
    format!("blobs/sha256/{hex}.json")
}

/// Key of layer `hex`'s prefetch list in the shared store (see `dsec_lazy::PrefetchList`).
pub fn prefetch_key(hex: &str) -> String {
    format!("blobs/sha256/{hex}.prefetch.json")
}

/// Key of ref `name` in the shared store.
pub fn ref_key(name: &str) -> String {
    format!("refs/{name}/@ref.json")
}

/// What the shared store records of one layer next to its bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerManifest {
    /// `sha256:<hex>` of the EROFS blob.
    pub digest: String,
    /// Its size in bytes.
    pub size: u64,
    /// How file data inside the EROFS image may be compressed ("lz4": a tree lz4 would
    /// not shrink is stored plain, which readers need not know).
    pub compression: String,
    /// Where it came from (the image source or the node that built it).
    pub source: String,
    /// Unix milliseconds of the upload.
    pub created_at: u64,
    /// Chunk size of `chunks` (on-demand loading fetches and verifies chunks).
    #[serde(default)]
    pub chunk_size: u64,
    /// Hex sha256 of each chunk of the blob, in order.
    #[serde(default)]
    pub chunks: Vec<String>,
    /// The chunks holding the layer's file system metadata (fetched when a node adds the
    /// layer on demand).
    #[serde(default)]
    pub meta_chunks: Vec<u64>,
}

impl LayerManifest {
    /// The chunk index on-demand loading needs, if the manifest carries one.
    pub fn chunk_index(&self) -> Option<dsec_lazy::ChunkIndex> {
        let index = dsec_lazy::ChunkIndex {
            digest: self.digest.trim_start_matches("sha256:").to_string(),
            size: self.size,
            chunk_size: self.chunk_size,
            chunks: self.chunks.clone(),
            meta: self.meta_chunks.clone(),
        };
        index.validate().ok().map(|()| index)
    }
}

/// A ref as stored in the shared store: the local entry plus its name.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct SharedRef {
    name: String,
    #[serde(flatten)]
    entry: RefEntry,
}

/// Connects to the lazy layer server of the store at `root` (mount `ROOT/lazy`, socket
/// `ROOT/lazy.sock`, chunk cache `ROOT/chunks` kept across restarts), starting one if
/// none runs. When a new server had to start, layer mounts an earlier (dead) server
/// backed are unreadable: they are detached so that new sandboxes mount afresh, and
/// logged, since sandboxes still using them read `EIO` for data they had not read yet.
pub(crate) fn attach_lazy(
    root: &std::path::Path,
    lazy: &crate::LazyLayers,
) -> Result<dsec_lazy::LazyClient> {
    let dir = root.join("lazy");
    let cfg = dsec_lazy::ServeConfig {
        dir: dir.clone(),
        socket: root.join("lazy.sock"),
        chunks: root.join("chunks"),
        chunk_cache_limit: lazy.chunk_cache_limit,
        store: lazy.store_spec.clone(),
        log: root.join("lazy.log"),
        opts: lazy.opts.clone(),
    };
    let client = dsec_lazy::LazyClient::attach(&cfg, &lazy.launcher)
        .map_err(|e| ImageError::io("lazy layers", &dir, std::io::Error::other(e)))?;
    if client.started() {
        let orphans: Vec<_> = mountinfo::read()
            .map_err(|e| ImageError::io("read mountinfo for", root, e))?
            .into_iter()
            .filter(|m| {
                m.fs_type == "erofs"
                    && m.mount_point.starts_with(root.join("mnt"))
                    && std::path::Path::new(&m.source).starts_with(&dir)
            })
            .collect();
        for m in orphans {
            tracing::error!(
                layer = %m.mount_point.display(),
                "this layer's lazy layer server died: sandboxes still on it read EIO for \
                 data they had not read; new sandboxes mount it afresh"
            );
            let _ = nix::mount::umount2(&m.mount_point, nix::mount::MntFlags::MNT_DETACH);
        }
    }
    Ok(client)
}

/// What [`ImageStore::gc_shared`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SharedGc {
    /// Layers deleted from the shared store (`sha256:<hex>`).
    pub deleted: Vec<String>,
    /// Bytes they took.
    pub freed_bytes: u64,
}

fn shared_err(e: dsec_blob::BlobError) -> ImageError {
    ImageError::Shared(e)
}

impl ImageStore {
    /// Whether the shared store holds layer `hex` (false without one).
    pub(crate) fn shared_has_layer(&self, hex: &str) -> Result<bool> {
        match &self.shared {
            Some(s) => Ok(s
                .head(&blob_key(hex))
                .map_err(ImageError::Shared)?
                .is_some()),
            None => Ok(false),
        }
    }

    /// Uploads every layer of `layers` the shared store lacks (blob, then manifest).
    /// Returns the layers' total size. Without a shared store, sizes come from local blobs.
    pub(crate) fn push_layers(&self, layers: &[String], source: &str) -> Result<u64> {
        let mut size = 0;
        for l in layers {
            let hex = parse_digest(l)?;
            let local = std::fs::metadata(self.blob_path(&hex))
                .ok()
                .map(|m| m.len());
            let Some(shared) = &self.shared else {
                size += local.ok_or_else(|| ImageError::NotFound(l.clone()))?;
                continue;
            };
            let remote = shared.head(&blob_key(&hex)).map_err(shared_err)?;
            match (remote, local) {
                (Some(info), _) => size += info.size,
                (None, Some(len)) => {
                    let blob = self.blob_path(&hex);
                    let index = dsec_lazy::ChunkIndex::of_file(&blob, self.chunk_size)
                        .map_err(|e| ImageError::io("index", &blob, std::io::Error::other(e)))?;
                    let scratch = self.tempdir("meta-")?;
                    let meta_chunks = match dsec_lazy::metadata_chunks(
                        &blob,
                        &index,
                        &scratch.path().join("w"),
                    ) {
                        // Worth fetching up front only when compact: mkfs.erofs places
                        // inodes next to their data, so in a layer of many small files
                        // the metadata touches most chunks (prefetch lists carry it).
                        Ok(m) if m.len() * 8 <= index.chunks.len() || m.len() <= 4 => m,
                        Ok(m) => {
                            tracing::info!(
                                digest = %l, meta = m.len(), chunks = index.chunks.len(),
                                "metadata spread over the layer: not fetched up front"
                            );
                            Vec::new()
                        }
                        Err(e) => {
                            // On-demand nodes then fetch metadata as lookups need it.
                            tracing::warn!(digest = %l, error = %e, "finding the layer's metadata chunks");
                            Vec::new()
                        }
                    };
                    shared.upload(&blob_key(&hex), &blob).map_err(shared_err)?;
                    let manifest = LayerManifest {
                        digest: format!("sha256:{hex}"),
                        size: len,
                        compression: "lz4".into(),
                        source: source.to_string(),
                        created_at: now_ms(),
                        chunk_size: index.chunk_size,
                        chunks: index.chunks,
                        meta_chunks,
                    };
                    let json = serde_json::to_vec_pretty(&manifest).map_err(|e| {
                        ImageError::InvalidImage {
                            path: self.blob_path(&hex),
                            message: e.to_string(),
                        }
                    })?;
                    shared.put(&manifest_key(&hex), &json).map_err(shared_err)?;
                    tracing::info!(digest = %l, size = len, store = %shared.url(), "layer uploaded");
                    size += len;
                }
                (None, None) => return Err(ImageError::NotFound(l.clone())),
            }
        }
        Ok(size)
    }

    /// Writes ref `name` to the shared store (after [`ImageStore::push_layers`]).
    pub(crate) fn push_ref(&self, name: &str, entry: &RefEntry) -> Result<()> {
        let Some(shared) = &self.shared else {
            return Ok(());
        };
        let json = serde_json::to_vec_pretty(&SharedRef {
            name: name.to_string(),
            entry: RefEntry {
                shared: false,
                ..entry.clone()
            },
        })
        .map_err(|e| ImageError::Refs {
            path: self.root.join(ref_key(name)),
            source: e,
        })?;
        self.forget_ref(name);
        shared.put(&ref_key(name), &json).map_err(shared_err)
    }

    /// Drops the cached copy of ref `name` (this node changed it).
    fn forget_ref(&self, name: &str) {
        lock(&self.ref_cache).remove(name);
    }

    /// Deletes ref `name` from the shared store; what it was, if there.
    pub(crate) fn delete_shared_ref(&self, name: &str) -> Result<Option<RefEntry>> {
        let Some(shared) = &self.shared else {
            return Ok(None);
        };
        self.forget_ref(name);
        let had = self.fetch_shared_ref(name)?;
        shared.delete(&ref_key(name)).map_err(shared_err)?;
        self.forget_ref(name);
        Ok(had)
    }

    /// Ref `name` from the shared store, if configured and present; a copy read less
    /// than the ref TTL ago serves without a store read. A corrupt or misnamed object is
    /// logged and treated as absent.
    pub(crate) fn fetch_shared_ref(&self, name: &str) -> Result<Option<RefEntry>> {
        let Some(shared) = self.shared.as_ref() else {
            return Ok(None);
        };
        if !self.ref_ttl.is_zero() {
            let cache = lock(&self.ref_cache);
            if let Some((at, entry)) = cache.get(name) {
                if at.elapsed() < self.ref_ttl {
                    return Ok(entry.clone());
                }
            }
        }
        let read_at = std::time::Instant::now();
        let entry = self.read_shared_ref(shared.as_ref(), name)?;
        if !self.ref_ttl.is_zero() {
            lock(&self.ref_cache).insert(name.to_string(), (read_at, entry.clone()));
        }
        Ok(entry)
    }

    fn read_shared_ref(
        &self,
        shared: &dyn dsec_blob::BlobStore,
        name: &str,
    ) -> Result<Option<RefEntry>> {
        let Some(bytes) = shared.get(&ref_key(name)).map_err(shared_err)? else {
            return Ok(None);
        };
        match serde_json::from_slice::<SharedRef>(&bytes) {
            Ok(r) if r.name == name => Ok(Some(r.entry)),
            Ok(r) => {
                tracing::warn!(name, found = %r.name, "shared ref names another image; ignored");
                Ok(None)
            }
            Err(e) => {
                tracing::warn!(name, error = %e, "shared ref is corrupt; ignored");
                Ok(None)
            }
        }
    }

    /// Every ref in the shared store (empty without one).
    pub(crate) fn shared_refs(&self) -> Result<Vec<(String, RefEntry)>> {
        let Some(shared) = &self.shared else {
            return Ok(Vec::new());
        };
        let mut out = Vec::new();
        for obj in shared.list("refs/").map_err(shared_err)? {
            let Some(name) = obj
                .key
                .strip_prefix("refs/")
                .and_then(|k| k.strip_suffix("/@ref.json"))
            else {
                continue;
            };
            if let Some(mut entry) = self.fetch_shared_ref(name)? {
                entry.shared = true;
                out.push((name.to_string(), entry));
            }
        }
        Ok(out)
    }

    /// The on-demand file of layer `hex`, when lazy layers are on and the shared store has
    /// the layer's chunk index (else `None`: the layer is downloaded whole).
    pub(crate) fn lazy_file(&self, hex: &str) -> Result<Option<std::path::PathBuf>> {
        let (Some(lazy), Some(shared)) = (&self.lazy, &self.shared) else {
            return Ok(None);
        };
        if lock(&self.lazy_added).contains(hex) {
            return Ok(Some(lazy.dir().join(format!("{hex}.erofs"))));
        }
        let Some(bytes) = shared.get(&manifest_key(hex)).map_err(shared_err)? else {
            return Ok(None);
        };
        let Some(index) = serde_json::from_slice::<LayerManifest>(&bytes)
            .ok()
            .and_then(|m| m.chunk_index())
            .filter(|i| i.digest == hex)
        else {
            return Ok(None);
        };
        let path = lazy
            .add_layer(&blob_key(hex), index, Some(&prefetch_key(hex)))
            .map_err(|e| ImageError::io("lazy layer", lazy.dir(), std::io::Error::other(e)))?;
        lock(&self.lazy_added).insert(hex.to_string());
        tracing::info!(digest = %hex, "layer served on demand");
        Ok(Some(path))
    }

    /// On-demand accounting: every lazy layer by digest (hex), and the chunk cache's
    /// size; empty without lazy layers.
    pub fn lazy_stats(&self) -> Result<dsec_lazy::ServerStats> {
        match &self.lazy {
            Some(lazy) => lazy
                .stats()
                .map_err(|e| ImageError::io("lazy layers", lazy.dir(), std::io::Error::other(e))),
            None => Ok(Default::default()),
        }
    }

    /// Makes layer `hex` present in the local cache: downloads it from the shared store
    /// into `tmp/`, checks its sha256 and moves it into `blobs/`. No-op when cached.
    /// Returns whether it downloaded (the caller then trims the cache, once the new layer
    /// is mounted and so safe from eviction).
    /// Concurrent calls for one layer download it once: the others wait for it.
    pub(crate) fn fetch_blob(&self, hex: &str) -> Result<bool> {
        let blob = self.blob_path(hex);
        if blob.exists() {
            return Ok(false);
        }
        let Some(shared) = &self.shared else {
            return Err(ImageError::NotFound(format!("sha256:{hex}")));
        };
        let gate = lock(&self.fetching)
            .entry(hex.to_string())
            .or_default()
            .clone();
        let _one_at_a_time = lock(&gate);
        let fetched = self.fetch_blob_now(hex, shared.as_ref(), &blob);
        lock(&self.fetching).remove(hex);
        fetched
    }

    fn fetch_blob_now(
        &self,
        hex: &str,
        shared: &dyn dsec_blob::BlobStore,
        blob: &std::path::Path,
    ) -> Result<bool> {
        if blob.exists() {
            // Another caller fetched it while this one waited.
            return Ok(false);
        }
        let work = self.tempdir("fetch-")?;
        let tmp = work.path().join("layer.erofs");
        let started = std::time::Instant::now();
        let size = match shared.download(&blob_key(hex), &tmp) {
            Ok(n) => n,
            Err(dsec_blob::BlobError::NotFound { .. }) => {
                return Err(ImageError::NotFound(format!("sha256:{hex}")))
            }
            Err(e) => return Err(shared_err(e)),
        };
        let (actual, _) = hash_file(&tmp, &|_| {})?;
        if actual != hex {
            return Err(ImageError::DigestMismatch {
                path: self.root.join(blob_key(hex)),
                what: format!("layer from {}", shared.url()),
                expected: format!("sha256:{hex}"),
                actual: format!("sha256:{actual}"),
            });
        }
        seal_blob(&tmp, blob)?;
        tracing::info!(
            digest = %hex, size, ms = started.elapsed().as_millis() as u64,
            store = %shared.url(), "layer fetched"
        );
        Ok(true)
    }

    /// Deletes from the shared store every layer no shared ref uses and that was written
    /// more than `grace` ago (so a layer uploaded for a ref not yet written survives).
    /// Layers in use on this node stay too.
    pub fn gc_shared(&self, grace: Duration) -> Result<SharedGc> {
        let Some(shared) = &self.shared else {
            return Ok(SharedGc::default());
        };
        let mut used: HashSet<String> = HashSet::new();
        for (_, r) in self.shared_refs()? {
            used.extend(r.layer_digests());
        }
        let mounted: HashSet<String> = self
            .lock_mounts()
            .iter()
            .filter(|(_, n)| **n > 0)
            .map(|(h, _)| format!("sha256:{h}"))
            .collect();
        let now = SystemTime::now();
        let mut out = SharedGc::default();
        for obj in shared.list("blobs/sha256/").map_err(shared_err)? {
            let Some(hex) = obj
                .key
                .strip_prefix("blobs/sha256/")
                .and_then(|k| k.strip_suffix(".erofs"))
            else {
                continue;
            };
            let digest = format!("sha256:{hex}");
            let young = now
                .duration_since(obj.modified)
                .map(|age| age < grace)
                .unwrap_or(true);
            if used.contains(&digest) || mounted.contains(&digest) || young {
                continue;
            }
            shared.delete(&obj.key).map_err(shared_err)?;
            shared.delete(&manifest_key(hex)).map_err(shared_err)?;
            shared.delete(&prefetch_key(hex)).map_err(shared_err)?;
            tracing::info!(%digest, size = obj.size, "layer deleted from the shared store");
            out.freed_bytes += obj.size;
            out.deleted.push(digest);
        }
        Ok(out)
    }

    /// The shared store's URL, if one is configured.
    pub fn shared_url(&self) -> Option<String> {
        self.shared.as_ref().map(|s| s.url())
    }
}
