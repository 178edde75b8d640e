//! The catalog: image names. `refs.json` maps each name to an image (its layers bottom
//! first, config, size, source, creation time), rewritten atomically under `flock(2)` on
//! `.lock`; with a shared store the cluster's refs win and the local file keeps copies.
//! Naming, resolving, tagging, listing and removing images, deleting the layers no name
//! uses any more, and garbage collection of names by prefix (the build cache).

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, Write};
use std::path::PathBuf;
use std::time::{Duration, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

use crate::{now_ms, parse_digest, Image, ImageConfig, ImageError, ImageStore, Result};

/// Result of [`ImageStore::resolve`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedImage {
    /// The ref name; for a digest lookup the first ref (by name) pointing at it, or the digest
    /// itself if no ref does.
    pub name: String,
    /// `sha256:<hex>`.
    pub digest: String,
    /// The blob file of its top layer.
    pub blob_path: PathBuf,
    /// Its layer digests, bottom first.
    pub layers: Vec<String>,
    /// Its defaults.
    pub config: ImageConfig,
}

/// Result of [`ImageStore::remove`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Removed {
    /// The ref that was removed.
    pub image: Image,
    /// Whether a blob was deleted too (a layer no other ref uses and not mounted).
    pub blob_deleted: bool,
}

/// One name's image as `refs.json` (and the shared store) records it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct RefEntry {
    pub(crate) digest: String,
    pub(crate) size: u64,
    pub(crate) created_at: u64,
    pub(crate) source: String,
    /// Layer digests bottom first; empty for a one-layer image (the layer is `digest`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) layers: Vec<String>,
    #[serde(default, skip_serializing_if = "ImageConfig::is_empty")]
    pub(crate) config: ImageConfig,
    /// A local copy of a ref the shared store holds: gone there means removed in the
    /// cluster (a ref that never was shared stays).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub(crate) shared: bool,
}

/// `refs.json`.
#[derive(Debug, Default, Serialize, Deserialize)]
pub(crate) struct RefsFile {
    version: u32,
    refs: BTreeMap<String, RefEntry>,
}

impl RefEntry {
    pub(crate) fn to_image(&self, name: &str) -> Image {
        Image {
            name: name.to_string(),
            digest: self.digest.clone(),
            size_bytes: self.size,
            created_at: self.created_at,
            source: self.source.clone(),
            layers: self.layer_digests(),
            config: self.config.clone(),
        }
    }

    pub(crate) fn layer_digests(&self) -> Vec<String> {
        if self.layers.is_empty() {
            vec![self.digest.clone()]
        } else {
            self.layers.clone()
        }
    }

    pub(crate) fn uses_layer(&self, digest: &str) -> bool {
        self.digest == digest || self.layers.iter().any(|l| l == digest)
    }
}

/// `layers` (bottom first) with each layer only at its topmost place. The tree is the
/// same: whatever a lower copy of a layer shows, its upper copy shows too. Overlayfs
/// refuses a stack naming one layer directory twice (ELOOP), so every stack mounted or
/// stored goes through this.
pub fn dedup_layers(layers: &[String]) -> Vec<String> {
    let mut seen = std::collections::HashSet::new();
    let mut out: Vec<String> = layers
        .iter()
        .rev()
        .filter(|d| seen.insert(d.as_str()))
        .cloned()
        .collect();
    out.reverse();
    out
}

/// The digest of an image made of `layers` (bottom first): the layer's own for one layer,
/// else the sha256 of the list.
pub fn image_digest(layers: &[String]) -> String {
    match layers {
        [one] => one.clone(),
        _ => {
            let joined = layers.join("\n");
            format!("sha256:{}", hex::encode(Sha256::digest(joined.as_bytes())))
        }
    }
}

/// Check an image name: `[a-z0-9][a-z0-9._:/-]{0,127}`, not `sha256:...` (that is how
/// digests are written), and no empty, `.` or `..` component between `/`s.
pub fn validate_name(name: &str) -> Result<()> {
    let bad = |reason| {
        Err(ImageError::InvalidName {
            name: name.to_string(),
            reason,
        })
    };
    let b = name.as_bytes();
    let Some(first) = b.first() else {
        return bad("empty");
    };
    if b.len() > 128 {
        return bad("longer than 128 characters");
    }
    if !(first.is_ascii_lowercase() || first.is_ascii_digit()) {
        return bad("must start with a lowercase letter or digit");
    }
    if !b
        .iter()
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || b"._:/-".contains(c))
    {
        return bad("contains a character other than a-z 0-9 . _ : / -");
    }
    if name.starts_with("sha256:") {
        return bad("`sha256:` prefix is reserved for digests");
    }
    // Names become paths in a shared store: no empty, `.` or `..` components.
    if name
        .split('/')
        .any(|c| c.is_empty() || c == "." || c == "..")
    {
        return bad("has an empty, `.` or `..` path component");
    }
    Ok(())
}

/// Holds `.lock` exclusively while alive.
pub(crate) struct RefsLock(#[allow(dead_code)] nix::fcntl::Flock<File>);

impl ImageStore {
    fn refs_path(&self) -> PathBuf {
        self.root.join("refs.json")
    }

    pub(crate) fn lock_refs(&self) -> Result<RefsLock> {
        let p = self.root.join(".lock");
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&p)
            .map_err(|e| ImageError::io("open", &p, e))?;
        let l = nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusive)
            .map_err(|(_, e)| ImageError::io("flock", &p, e.into()))?;
        Ok(RefsLock(l))
    }

    pub(crate) fn read_refs(&self) -> Result<RefsFile> {
        let p = self.refs_path();
        match std::fs::read(&p) {
            Ok(b) => {
                serde_json::from_slice(&b).map_err(|e| ImageError::Refs { path: p, source: e })
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(RefsFile {
                version: 1,
                refs: BTreeMap::new(),
            }),
            Err(e) => Err(ImageError::io("read", &p, e)),
        }
    }

    /// Write refs.json atomically: temp file, fsync, rename, fsync dir.
    fn write_refs(&self, refs: &RefsFile) -> Result<()> {
        let p = self.refs_path();
        let tmp = self
            .root
            .join(format!(".refs.json.{:016x}", rand::random::<u64>()));
        let res = (|| {
            let mut f = File::create(&tmp).map_err(|e| ImageError::io("create", &tmp, e))?;
            let data = serde_json::to_vec_pretty(refs).map_err(|e| ImageError::Refs {
                path: p.clone(),
                source: e,
            })?;
            f.write_all(&data)
                .map_err(|e| ImageError::io("write", &tmp, e))?;
            f.sync_all().map_err(|e| ImageError::io("fsync", &tmp, e))?;
            std::fs::rename(&tmp, &p).map_err(|e| ImageError::io("rename", &p, e))?;
            if let Ok(d) = File::open(&self.root) {
                let _ = d.sync_all();
            }
            Ok(())
        })();
        if res.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        res
    }

    /// Removes every ref whose name starts with `prefix` (e.g. `build-cache/`) and that is
    /// older than `min_age`, and the blobs only they used (mounted ones stay). Returns the
    /// removed names and the bytes of blobs deleted.
    pub fn gc_prefix(&self, prefix: &str, min_age: Duration) -> Result<(Vec<String>, u64)> {
        let now = now_ms();
        let age_ms = u64::try_from(min_age.as_millis()).unwrap_or(u64::MAX);
        let names: Vec<String> = self
            .read_refs()?
            .refs
            .iter()
            .filter(|(n, r)| n.starts_with(prefix) && now.saturating_sub(r.created_at) >= age_ms)
            .map(|(n, _)| n.clone())
            .collect();
        let before = self.blob_bytes();
        for n in &names {
            self.remove(n)?;
        }
        Ok((names, before.saturating_sub(self.blob_bytes())))
    }

    /// Points `name` at the same layers as `source` (a name or digest), with its config
    /// or `config` when given.
    pub fn tag(&self, source: &str, name: &str, config: Option<ImageConfig>) -> Result<Image> {
        let src = self.resolve(source)?;
        self.set_ref(
            name,
            &src.layers,
            &format!("tag of {}", src.name),
            config.unwrap_or(src.config),
        )
    }

    /// Points `name` at the stored layers `layers` (bottom first), replacing an existing
    /// ref and collecting the layers only it used.
    pub(crate) fn set_ref(
        &self,
        name: &str,
        layers: &[String],
        source: &str,
        config: ImageConfig,
    ) -> Result<Image> {
        validate_name(name)?;
        // Every layer must be stored (here or in the shared store, where the missing ones
        // are uploaded first); the image's size is theirs together.
        let size = self.push_layers(layers, source)?;
        let entry = RefEntry {
            digest: image_digest(layers),
            size,
            created_at: now_ms(),
            source: source.to_string(),
            layers: if layers.len() == 1 {
                Vec::new()
            } else {
                layers.to_vec()
            },
            config,
            shared: self.shared.is_some(),
        };
        let img = entry.to_image(name);
        self.push_ref(name, &entry)?;
        self.replace_ref(name, Some(entry))?;
        tracing::info!(name, digest = %img.digest, layers = layers.len(), size, "image stored");
        if self.cache_limit.is_some() {
            self.trim_cache_quietly();
        }
        Ok(img)
    }

    /// Points `name` at `new` in `refs.json` (`None`: drops the name) under the refs lock,
    /// then deletes the blobs of layers only the old version used (mounted ones stay).
    /// Returns the old version and whether a blob was deleted.
    fn replace_ref(&self, name: &str, new: Option<RefEntry>) -> Result<(Option<RefEntry>, bool)> {
        let _lock = self.lock_refs()?;
        let mut refs = self.read_refs()?;
        let keep = new
            .as_ref()
            .map(RefEntry::layer_digests)
            .unwrap_or_default();
        let (old, changed) = match new {
            Some(entry) => (refs.refs.insert(name.to_string(), entry), true),
            None => {
                let old = refs.refs.remove(name);
                let changed = old.is_some();
                (old, changed)
            }
        };
        if changed {
            self.write_refs(&refs)?;
        }
        let mut deleted = false;
        for l in old.iter().flat_map(RefEntry::layer_digests) {
            if keep.contains(&l) {
                continue;
            }
            // A malformed digest in the old version names no blob.
            if let Ok(hex) = parse_digest(&l) {
                deleted |= self.gc_blob(&refs, &hex)?;
            }
        }
        Ok((old, deleted))
    }

    /// Delete blob `hex` if no ref points at it and no sandbox mounts it. Caller holds the
    /// refs lock.
    pub(crate) fn gc_blob(&self, refs: &RefsFile, hex: &str) -> Result<bool> {
        let digest = format!("sha256:{hex}");
        if refs.refs.values().any(|r| r.uses_layer(&digest)) {
            return Ok(false);
        }
        self.delete_blob(hex)
    }

    /// Resolve an image name or `sha256:<hex>` digest.
    pub fn resolve(&self, name_or_digest: &str) -> Result<ResolvedImage> {
        let refs = self.read_refs()?;
        let of_ref = |name: &str, r: &RefEntry| -> Result<ResolvedImage> {
            let layers = r.layer_digests();
            let top = layers
                .last()
                .ok_or_else(|| ImageError::NotFound(name_or_digest.to_string()))?;
            Ok(ResolvedImage {
                name: name.to_string(),
                digest: r.digest.clone(),
                blob_path: self.blob_path(&parse_digest(top)?),
                layers,
                config: r.config.clone(),
            })
        };
        if name_or_digest.starts_with("sha256:") {
            let hex = parse_digest(name_or_digest)?;
            let digest = format!("sha256:{hex}");
            // A ref's own digest (a multi-layer image), else a bare layer.
            if let Some((name, r)) = refs.refs.iter().find(|(_, r)| r.digest == digest) {
                return of_ref(name, r);
            }
            let blob = self.blob_path(&hex);
            if !blob.exists() && !self.shared_has_layer(&hex)? {
                return Err(ImageError::NotFound(name_or_digest.to_string()));
            }
            return Ok(ResolvedImage {
                name: digest.clone(),
                digest: digest.clone(),
                blob_path: blob,
                layers: vec![digest],
                config: ImageConfig::default(),
            });
        }
        let r = self
            .lookup_ref(name_or_digest, &refs)
            .ok_or_else(|| ImageError::NotFound(name_or_digest.to_string()))?;
        of_ref(name_or_digest, &r)
    }

    /// Describe an image by name or digest. A digest with no ref is described with its digest
    /// as name, its blob's size and mtime, and an empty source.
    pub fn image_info(&self, name_or_digest: &str) -> Result<Image> {
        let refs = self.read_refs()?;
        if let Some(r) = self.lookup_ref(name_or_digest, &refs) {
            return Ok(r.to_image(name_or_digest));
        }
        let res = self.resolve(name_or_digest)?;
        if let Some(r) = refs.refs.get(&res.name) {
            return Ok(r.to_image(&res.name));
        }
        let meta = std::fs::metadata(&res.blob_path)
            .map_err(|e| ImageError::io("stat", &res.blob_path, e))?;
        let created_at = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        Ok(Image {
            name: res.name,
            digest: res.digest,
            size_bytes: meta.len(),
            created_at,
            source: String::new(),
            layers: res.layers,
            config: res.config,
        })
    }

    /// All images (refs), sorted by name: this node's and, with a shared store, the
    /// cluster's (whose version wins where both have a name).
    pub fn list(&self) -> Result<Vec<Image>> {
        let mut all = self.read_refs()?.refs;
        if self.shared.is_some() {
            match self.shared_refs() {
                Ok(shared) => {
                    // Local copies of refs removed in the cluster are not listed.
                    all.retain(|_, r| !r.shared);
                    all.extend(shared);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "shared store unreachable; listing local refs")
                }
            }
        }
        Ok(all.iter().map(|(n, r)| r.to_image(n)).collect())
    }

    /// Ref `name`: the shared store's (refreshing the local copy when it differs), else
    /// the local one.
    /// A local copy of a shared ref the store no longer has is dropped (removed in the
    /// cluster); when the store cannot be reached, the local ref serves.
    fn lookup_ref(&self, name: &str, local: &RefsFile) -> Option<RefEntry> {
        let local_entry = local.refs.get(name);
        let fresh = match self.fetch_shared_ref(name) {
            Err(e) => {
                tracing::warn!(name, error = %e, "shared store unreachable; using the local ref");
                return local_entry.cloned();
            }
            Ok(None) if local_entry.is_some_and(|r| r.shared) => None,
            Ok(None) => return local_entry.cloned(),
            Ok(Some(mut r)) => {
                r.shared = true;
                Some(r)
            }
        };
        if local_entry != fresh.as_ref() {
            // Layers only the old version used leave the cache now.
            if let Err(e) = self.replace_ref(name, fresh.clone()) {
                tracing::warn!(name, error = %e, "could not update the local copy of a shared ref");
            }
        }
        fresh
    }

    /// Remove the ref `name`. Its blob is deleted too unless another ref points at it or it
    /// is mounted.
    pub fn remove(&self, name: &str) -> Result<Removed> {
        let shared = self.delete_shared_ref(name)?;
        let (local, blob_deleted) = self.replace_ref(name, None)?;
        let entry = match (local, shared) {
            (Some(local), _) => local,
            (None, Some(shared)) => {
                tracing::info!(name, "image removed from the shared store");
                return Ok(Removed {
                    image: shared.to_image(name),
                    blob_deleted: false,
                });
            }
            (None, None) => return Err(ImageError::NotFound(name.to_string())),
        };
        tracing::info!(name, digest = %entry.digest, blob_deleted, "image removed");
        Ok(Removed {
            image: entry.to_image(name),
            blob_deleted,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_layer_named_twice_stays_at_its_topmost_place() {
        let l = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            dedup_layers(&l(&["a", "b", "a", "c", "c"])),
            l(&["b", "a", "c"])
        );
        assert_eq!(dedup_layers(&l(&["a", "b"])), l(&["a", "b"]));
        assert!(dedup_layers(&[]).is_empty());
    }

    #[test]
    fn names() {
        for ok in [
            "base",
            "debian:bookworm",
            "python:3.11",
            "a",
            "0",
            "my/img-1_x.y",
            &"a".repeat(128),
        ] {
            assert!(validate_name(ok).is_ok(), "{ok:?} rejected");
        }
        for bad in [
            "",
            "Base",
            "-x",
            ".x",
            "_x",
            "a b",
            "a\n",
            "a@b",
            "ä",
            "sha256:abc",
            &"a".repeat(129),
            "/x",
            "a/../b",
            "a//b",
            "a/",
            "a/./b",
        ] {
            assert!(
                matches!(validate_name(bad), Err(ImageError::InvalidName { .. })),
                "{bad:?} accepted"
            );
        }
    }

    #[test]
    fn refs_roundtrip_format() {
        let mut r = RefsFile {
            version: 1,
            refs: BTreeMap::new(),
        };
        r.refs.insert(
            "base".into(),
            RefEntry {
                digest: format!("sha256:{}", "b".repeat(64)),
                size: 5,
                created_at: 7,
                source: "/x.tar".into(),
                layers: Vec::new(),
                config: ImageConfig::default(),
                shared: false,
            },
        );
        let s = serde_json::to_string(&r).unwrap_or_default();
        assert!(
            s.contains("\"refs\":{\"base\":{\"digest\":\"sha256:"),
            "{s}"
        );
        let back: RefsFile = serde_json::from_str(&s).unwrap_or_default();
        assert_eq!(back.refs["base"].size, 5);
        // A one-layer ref written before multi-layer images reads as its own layer.
        assert_eq!(
            back.refs["base"].layer_digests(),
            vec![format!("sha256:{}", "b".repeat(64))]
        );
    }

    #[test]
    fn image_digest_is_the_layer_for_one_layer_and_a_list_hash_otherwise() {
        let a = format!("sha256:{}", "a".repeat(64));
        let b = format!("sha256:{}", "b".repeat(64));
        assert_eq!(image_digest(std::slice::from_ref(&a)), a);
        let ab = image_digest(&[a.clone(), b.clone()]);
        assert!(parse_digest(&ab).is_ok());
        assert_ne!(ab, image_digest(&[b, a]), "order matters");
    }
}
