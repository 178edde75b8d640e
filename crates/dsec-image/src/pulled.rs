//! Images whose manifest and blobs came from a registry (see `dsec-registry`): the
//! downloaded layer blobs become EROFS layers with the same code an OCI import uses
//! (digest and diff_id checks, gzip/zstd with the decompression-bomb cutoff, whiteouts),
//! and each layer blob is converted once: `layers/sha256/BLOBHEX` (and, with a shared
//! store, the key of [`converted_key`]) names the EROFS layer it became, so a later pull
//! of an image sharing that layer neither downloads nor converts it.

use std::path::Path;

use crate::oci::{self, LayerPlan, Source};
use crate::{
    parse_digest, validate_name, Image, ImageConfig, ImageError, ImageStore, ImportProgress, Result,
};

/// One layer of a pulled image, bottom first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PulledLayer {
    /// sha256 hex of the blob as the registry serves it (maybe compressed).
    pub blob: String,
    /// Its size in bytes (from the manifest).
    pub size: u64,
    /// sha256 hex of the uncompressed tar (the config's `rootfs.diff_ids`), when known.
    pub diff_id: Option<String>,
}

/// The shared store's key naming the EROFS layer blob `hex` was converted to.
pub fn converted_key(blob_hex: &str) -> String {
    format!("oci-layers/sha256/{blob_hex}")
}

/// The defaults and `rootfs.diff_ids` (sha256 hex) of an image config blob.
pub fn parse_config(bytes: &[u8]) -> Result<(ImageConfig, Option<Vec<String>>)> {
    oci::parse_config(bytes)
}

impl ImageStore {
    fn converted_path(&self, blob_hex: &str) -> std::path::PathBuf {
        self.root.join("layers/sha256").join(blob_hex)
    }

    /// The EROFS layer (`sha256:` digest) layer blob `blob_hex` was converted to, if that
    /// layer is still stored here or in the shared store.
    pub fn converted_layer(&self, blob_hex: &str) -> Option<String> {
        let blob_hex = parse_digest(blob_hex).ok()?;
        let local = std::fs::read_to_string(self.converted_path(&blob_hex))
            .ok()
            .and_then(|s| parse_digest(s.trim()).ok());
        let shared = || {
            let s = self.shared.as_ref()?;
            let bytes = s.get(&converted_key(&blob_hex)).ok()??;
            parse_digest(String::from_utf8_lossy(&bytes).trim()).ok()
        };
        let hex = local.or_else(shared)?;
        let stored = self.blob_path(&hex).exists() || self.shared_has_layer(&hex).unwrap_or(false);
        stored.then(|| format!("sha256:{hex}"))
    }

    /// Stores a pulled image as `name`: each layer either already converted (see
    /// [`ImageStore::converted_layer`]) or read from `blobs/blobs/sha256/BLOBHEX` and
    /// checked against its digest, size and diff_id while it is converted. A failure
    /// stores no ref and no new layer.
    pub fn import_pulled(
        &self,
        name: &str,
        blobs: &Path,
        layers: &[PulledLayer],
        config: ImageConfig,
        label: &str,
        progress: &dyn Fn(ImportProgress),
    ) -> Result<Image> {
        validate_name(name)?;
        if layers.is_empty() {
            return Err(ImageError::InvalidImage {
                path: blobs.to_path_buf(),
                message: "image has no layers".into(),
            });
        }
        let src = Source::dir(blobs);
        let work = self.tempdir("pull-")?;
        // Per layer: the converted layer's digest, or the EROFS file built now (the
        // layers to build are built side by side).
        let mut parts: Vec<Result<String, std::path::PathBuf>> = Vec::new();
        let mut to_build = Vec::new();
        for (i, l) in layers.iter().enumerate() {
            if let Some(d) = self.converted_layer(&l.blob) {
                parts.push(Ok(d));
                continue;
            }
            parts.push(Err(std::path::PathBuf::new()));
            to_build.push((
                i,
                LayerPlan {
                    index: i + 1,
                    member: format!("blobs/sha256/{}", l.blob),
                    blob: Some(l.blob.clone()),
                    size: Some(l.size),
                    diff_id: l.diff_id.clone(),
                },
            ));
        }
        let built = oci::build_layers(&src, &to_build, work.path(), progress)?;
        for ((i, _), file) in to_build.iter().zip(built) {
            parts[*i] = Err(file);
        }
        let mut created = Vec::new();
        let mut converted = Vec::new();
        let res = (|| {
            let mut digests = Vec::new();
            for (part, l) in parts.iter().zip(layers) {
                let digest = match part {
                    Ok(d) => d.clone(),
                    Err(file) => {
                        let (digest, _) = self.put_blob(file, progress)?;
                        // put_blob moves a new blob into place and leaves the file when
                        // one existed.
                        if !file.exists() {
                            created.push(digest.clone());
                        }
                        converted.push((l.blob.clone(), digest.clone()));
                        digest
                    }
                };
                digests.push(digest);
            }
            oci::store_image(self, name, &digests, label, config, progress)
        })();
        match &res {
            Ok(_) => {
                for (blob, digest) in &converted {
                    self.record_converted(blob, digest);
                }
            }
            Err(_) => oci::drop_new_blobs(self, &created),
        }
        drop(work);
        res
    }

    /// Records that layer blob `blob_hex` became EROFS layer `digest` (a cache: a failed
    /// write only costs a later conversion).
    fn record_converted(&self, blob_hex: &str, digest: &str) {
        let path = self.converted_path(blob_hex);
        let res = (|| {
            let dir = self.root.join("layers/sha256");
            std::fs::create_dir_all(&dir)?;
            let tmp = tempfile::NamedTempFile::new_in(&dir)?;
            std::fs::write(tmp.path(), digest)?;
            tmp.persist(&path).map_err(|e| e.error)?;
            if let Some(s) = &self.shared {
                s.put(&converted_key(blob_hex), digest.as_bytes())
                    .map_err(std::io::Error::other)?;
            }
            Ok::<_, std::io::Error>(())
        })();
        if let Err(e) = res {
            tracing::warn!(blob = blob_hex, error = %e, "could not record a converted layer");
        }
    }
}
