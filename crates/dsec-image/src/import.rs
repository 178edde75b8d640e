//! Importers: a root file system (a directory or a tar, tar.gz, tar.zst), an `.erofs`
//! file, or a `docker save` archive / OCI layout (via `oci`) becomes stored layers and a
//! name, reporting its phases to a progress callback.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use crate::erofs::{build_erofs, check_erofs_magic};
use crate::{extract, oci, validate_name, Image, ImageConfig, ImageError, ImageStore, Result};

/// Phase of an import, for progress display.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImportPhase {
    /// Unpacking a tar; bytes are of the (compressed) archive file.
    Extracting,
    /// Running mkfs.erofs; `bytes_done` is the image size written so far, total unknown.
    Building,
    /// Hashing the built image.
    Hashing,
    /// Moving the blob into place and updating refs.
    Storing,
}

impl ImportPhase {
    /// Its name on the wire (`extracting`, `building`, `hashing`, `storing`).
    pub fn as_str(self) -> &'static str {
        match self {
            ImportPhase::Extracting => "extracting",
            ImportPhase::Building => "building",
            ImportPhase::Hashing => "hashing",
            ImportPhase::Storing => "storing",
        }
    }
}

/// One progress report of [`ImageStore::import`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImportProgress {
    /// Current phase.
    pub phase: ImportPhase,
    /// Bytes processed in this phase.
    pub bytes_done: u64,
    /// Bytes this phase will process, when known.
    pub bytes_total: Option<u64>,
}

impl ImageStore {
    /// Import `source` (a directory, `.tar`, `.tar.gz` or `.tgz`) as image `name`, replacing an
    /// existing ref of that name. Returns the stored image.
    ///
    /// Archives are extracted into a temp dir under the store root; mkfs.erofs packs the tree;
    /// the result is hashed and moved into `blobs/` (or dropped if an identical blob exists).
    /// All temp files are removed on success and on every failure.
    pub fn import(
        &self,
        name: &str,
        source: &Path,
        progress: &dyn Fn(ImportProgress),
    ) -> Result<Image> {
        validate_name(name)?;
        let meta = std::fs::metadata(source).map_err(|e| ImageError::io("stat", source, e))?;
        let work = self.tempdir("import-")?;
        let src_dir = if meta.is_dir() {
            source.to_path_buf()
        } else {
            let kind = extract::sniff(source)?
                .ok_or_else(|| ImageError::UnsupportedSource(source.to_path_buf()))?;
            let rootfs = work.path().join("rootfs");
            std::fs::create_dir(&rootfs).map_err(|e| ImageError::io("mkdir", &rootfs, e))?;
            std::fs::set_permissions(&rootfs, std::fs::Permissions::from_mode(0o755))
                .map_err(|e| ImageError::io("chmod", &rootfs, e))?;
            let had_root_entry = extract::extract(source, kind, &rootfs, progress)?;
            if !had_root_entry {
                // Without a `./` entry the root keeps the extraction time; pin it for reproducibility.
                extract::set_mtime(&rootfs, 0)?;
            }
            rootfs
        };
        let layer = work.path().join("layer.erofs");
        build_erofs(&src_dir, &layer, work.path(), progress)?;
        let img = self.store_layer(name, &layer, &source_label(source), progress)?;
        drop(work);
        Ok(img)
    }

    /// Import a `docker save` archive or an OCI image layout (a directory, or a tar of one) as
    /// image `name`, replacing an existing ref of that name: one layer per image layer, bottom
    /// first, and the image config's defaults. With `flatten`, the layers are applied into one
    /// tree and stored as a single layer. A failed import stores no ref and no new blob.
    /// See [`oci`].
    pub fn import_oci(
        &self,
        name: &str,
        source: &Path,
        flatten: bool,
        progress: &dyn Fn(ImportProgress),
    ) -> Result<Image> {
        oci::import(self, name, source, source, flatten, progress)
    }

    /// Imports whatever `source` is: an `.erofs` file (stored as is); a `docker save`
    /// archive or OCI image layout, also gzip- or zstd-compressed (one layer per image
    /// layer, or one with `flatten`); else a root file system (a directory or a tar,
    /// tar.gz or tar.zst) as one layer.
    pub fn import_path(
        &self,
        name: &str,
        source: &Path,
        flatten: bool,
        progress: &dyn Fn(ImportProgress),
    ) -> Result<Image> {
        if source.extension().is_some_and(|e| e == "erofs") {
            return self.import_blob(name, source);
        }
        if oci::sniff_oci(source) {
            return self.import_oci(name, source, flatten, progress);
        }
        if source.is_file() {
            if let Some(kind @ (extract::ArchiveKind::TarGz | extract::ArchiveKind::TarZst)) =
                extract::sniff(source)?
            {
                if oci::sniff_compressed(source, kind) {
                    validate_name(name)?;
                    // Image archives are read by random access: decompress once into tmp/.
                    let work = self.tempdir("unpack-")?;
                    let tar = work.path().join("image.tar");
                    extract::decompress(source, kind, &tar, progress)?;
                    let img = oci::import(self, name, &tar, source, flatten, progress)?;
                    drop(work);
                    return Ok(img);
                }
            }
        }
        self.import(name, source, progress)
    }

    /// Imports a file received as an upload (its name says nothing): an EROFS image is
    /// recognised by its magic, anything else is imported as [`ImageStore::import_path`]
    /// would (a rootfs tar, compressed or not, a `docker save` or OCI archive).
    pub fn import_uploaded(
        &self,
        name: &str,
        file: &Path,
        flatten: bool,
        progress: &dyn Fn(ImportProgress),
    ) -> Result<Image> {
        if check_erofs_magic(file).is_ok() {
            return self.import_blob(name, file);
        }
        self.import_path(name, file, flatten, progress)
    }

    /// Import an already built EROFS file as image `name` (the file is copied, not moved).
    pub fn import_blob(&self, name: &str, erofs_file: &Path) -> Result<Image> {
        validate_name(name)?;
        check_erofs_magic(erofs_file)?;
        let work = self.tempdir("blob-")?;
        let layer = work.path().join("layer.erofs");
        std::fs::copy(erofs_file, &layer).map_err(|e| ImageError::io("copy", erofs_file, e))?;
        let img = self.store_layer(name, &layer, &source_label(erofs_file), &|_| {})?;
        drop(work);
        Ok(img)
    }

    /// Hash `layer`, move it into blobs/ (dedup), point `name` at it.
    fn store_layer(
        &self,
        name: &str,
        layer: &Path,
        source: &str,
        progress: &dyn Fn(ImportProgress),
    ) -> Result<Image> {
        let (digest, size) = self.put_blob(layer, progress)?;
        let img = self.set_ref(name, &[digest], source, ImageConfig::default())?;
        progress(ImportProgress {
            phase: ImportPhase::Storing,
            bytes_done: size,
            bytes_total: Some(size),
        });
        Ok(img)
    }
}

/// What an image records as its source: `path` made canonical (as given if that fails).
fn source_label(path: &Path) -> String {
    std::fs::canonicalize(path)
        .unwrap_or_else(|_| path.to_path_buf())
        .display()
        .to_string()
}
