//! Import of `docker save` archives and OCI image layouts as multi-layer images.
//!
//! A source is a directory or a plain tar file holding a Docker `manifest.json` (the
//! `docker save` format; Docker 25+ writes an OCI layout next to it, which it also names)
//! or an OCI image layout (`oci-layout`, `index.json`, `blobs/sha256/<hex>`). `manifest.json`
//! wins when both are present. Members of a tar are read in place: one scan records where
//! each member's bytes are, then readers use positioned reads; nothing is unpacked but layers.
//!
//! Everything read is verified while it is read: OCI blobs (and `docker save` members named
//! by digest) against their digests, each layer's uncompressed tar against the config's
//! `rootfs.diff_ids`. Layers are plain, gzip or zstd tars (sniffed). Member paths
//! with `..` or a leading `/` are refused, JSON documents are limited to 16 MiB.
//!
//! Each layer is extracted into a fresh directory in overlayfs form (whiteouts become 0:0
//! character devices, opaque markers `trusted.overlay.opaque=y`) and packed as one EROFS
//! layer, so the node's overlay mount of the layer list reproduces the image. Flattened, all
//! layers are applied in order into one tree instead and stored as one layer. A layer that
//! appears twice is kept only at its topmost position (overlayfs refuses a lower layer twice;
//! the lower copy is fully shadowed by the upper one anyway).

use std::collections::HashMap;
use std::fmt::Write as _;
use std::fs::File;
use std::io::{self, BufRead, BufReader, Read};
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Mutex};

use serde::de::DeserializeOwned;
use serde::Deserialize;
use sha2::{Digest as _, Sha256};

use crate::erofs::build_erofs;
use crate::extract::{self, expansion_limit, Counting, Limited, Whiteouts};
use crate::tar_erofs::TarErofs;
use crate::{
    parse_digest, validate_name, Image, ImageConfig, ImageError, ImageStore, ImportPhase,
    ImportProgress, Result,
};

/// Largest JSON document (manifest, index, config) read into memory.
const JSON_LIMIT: u64 = 16 << 20;
/// Symlink / hard link hops followed when resolving a tar member.
const MAX_LINK_HOPS: usize = 8;
const GZIP_MAGIC: &[u8] = &[0x1f, 0x8b];
const ZSTD_MAGIC: &[u8] = &[0x28, 0xb5, 0x2f, 0xfd];

/// Whether `path` looks like an image [`ImageStore::import_oci`] takes: a directory or plain
/// tar with an `oci-layout` file, or with a `manifest.json` in `docker save` form.
pub fn sniff_oci(path: &Path) -> bool {
    let Ok(src) = Source::open(path) else {
        return false;
    };
    src.has("oci-layout")
        || (src.has("manifest.json")
            && src
                .read_json::<Vec<DockerManifest>>("manifest.json", None)
                .is_ok())
}

/// Whether the compressed tar `path` holds a `docker save` archive or an OCI layout
/// rather than a root file system: its first entries are image metadata (`oci-layout`,
/// `index.json`, `manifest.json`, `repositories`, `blobs/`) or layer directories named by
/// a 64-hex id. Reads only the first entries' headers.
pub(crate) fn sniff_compressed(path: &Path, kind: extract::ArchiveKind) -> bool {
    let Ok(f) = File::open(path) else {
        return false;
    };
    let size = f.metadata().map(|m| m.len()).unwrap_or(0);
    let Ok(dec) = kind.decoder(BufReader::new(f), size) else {
        return false;
    };
    let mut ar = tar::Archive::new(dec);
    let Ok(entries) = ar.entries() else {
        return false;
    };
    for e in entries.take(4) {
        let Ok(e) = e else { return false };
        let Ok(p) = e.path() else { return false };
        let s = p.to_string_lossy();
        let s = s.trim_start_matches("./");
        let first = s.split('/').next().unwrap_or("");
        let first = first.strip_suffix(".json").unwrap_or(first);
        if matches!(
            s,
            "oci-layout" | "index.json" | "manifest.json" | "repositories"
        ) || s.starts_with("blobs/")
            || (first.len() == 64 && first.bytes().all(|b| b.is_ascii_hexdigit()))
        {
            return true;
        }
    }
    false
}

/// [`ImageStore::import_oci`]; `label` is what the image's `source` records.
pub(crate) fn import(
    store: &ImageStore,
    name: &str,
    source: &Path,
    label: &Path,
    flatten: bool,
    progress: &dyn Fn(ImportProgress),
) -> Result<Image> {
    validate_name(name)?;
    let src = Source::open(source)?;
    let plan = src.plan()?;
    let work = store.tempdir("oci-")?;
    let mut built = Vec::new();
    if flatten {
        let root = make_root(&work.path().join("rootfs"))?;
        let mut had_root = false;
        for layer in &plan.layers {
            had_root |= src.unpack_layer(layer, &root, Whiteouts::Apply, progress)?;
        }
        if !had_root {
            extract::set_mtime(&root, 0)?;
        }
        let out = work.path().join("layer.erofs");
        build_erofs(&root, &out, work.path(), progress)?;
        let _ = std::fs::remove_dir_all(&root);
        built.push(out);
    } else {
        let layers: Vec<(usize, LayerPlan)> = plan.layers.iter().cloned().enumerate().collect();
        built = build_layers(&src, &layers, work.path(), progress)?;
    }

    let source_str = std::fs::canonicalize(label)
        .unwrap_or_else(|_| label.to_path_buf())
        .display()
        .to_string();
    let mut created = Vec::new();
    let res = (|| {
        let mut digests = Vec::new();
        for file in &built {
            let (digest, _) = store.put_blob(file, progress)?;
            // put_blob moves a new blob into place and leaves the file when one existed.
            if !file.exists() {
                created.push(digest.clone());
            }
            digests.push(digest);
        }
        store_image(
            store,
            name,
            &digests,
            &source_str,
            plan.config.clone(),
            progress,
        )
    })();
    if res.is_err() && !created.is_empty() {
        drop_new_blobs(store, &created);
    }
    drop(work);
    res
}

/// Reads the image at `source` and applies all its layers into `dest` (an empty
/// directory), as a flattened import does before it builds the layer.
#[cfg(feature = "fuzzing")]
pub(crate) fn unpack_flat(source: &Path, dest: &Path) -> Result<()> {
    let src = Source::open(source)?;
    let plan = src.plan()?;
    for layer in &plan.layers {
        src.unpack_layer(layer, dest, Whiteouts::Apply, &|_| {})?;
    }
    Ok(())
}

/// Packs `layer` of `src` as the EROFS image `work/layer-I.erofs`, in overlayfs form,
/// straight from its tar stream (see [`crate::tar_erofs`]).
pub(crate) fn build_layer(
    src: &Source,
    layer: &LayerPlan,
    work: &Path,
    i: usize,
    progress: &dyn Fn(ImportProgress),
) -> Result<PathBuf> {
    let out = work.join(format!("layer-{i}.erofs"));
    let origin = src.origin(&layer.member);
    let res = (|| {
        let mut writer = TarErofs::create(&out, &origin)?;
        src.read_layer(layer, progress, &mut |r| writer.add_tar(r))?;
        // The data went into the image while it was read; what is left is its metadata.
        let size = writer.finish()?;
        progress(ImportProgress {
            phase: ImportPhase::Building,
            bytes_done: size,
            bytes_total: Some(size),
        });
        Ok(())
    })();
    match res {
        Ok(_) => Ok(out),
        Err(e) => {
            let _ = std::fs::remove_file(&out);
            Err(e)
        }
    }
}

/// Builds each of `layers` of `src` as [`build_layer`] does (`(i, plan)`: `i` names its
/// files), on as many threads as there are CPUs, and returns the built files in the order
/// given. Extracting and packing are CPU-bound and one layer's are serial, so a
/// multi-layer image converts about N times faster on N cores. The first failure stops
/// the layers not yet started and is returned; `progress` is called on this thread.
pub(crate) fn build_layers(
    src: &Source,
    layers: &[(usize, LayerPlan)],
    work: &Path,
    progress: &dyn Fn(ImportProgress),
) -> Result<Vec<PathBuf>> {
    let workers = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .min(layers.len());
    if workers <= 1 {
        return layers
            .iter()
            .map(|(i, plan)| build_layer(src, plan, work, *i, progress))
            .collect();
    }
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let results: Vec<Mutex<Option<Result<PathBuf>>>> =
        layers.iter().map(|_| Mutex::new(None)).collect();
    let (tx, rx) = mpsc::channel::<ImportProgress>();
    std::thread::scope(|scope| {
        for _ in 0..workers {
            let tx = tx.clone();
            let (next, failed, results) = (&next, &failed, &results);
            scope.spawn(move || loop {
                let k = next.fetch_add(1, Ordering::Relaxed);
                if k >= layers.len() || failed.load(Ordering::Relaxed) {
                    break;
                }
                let (i, plan) = &layers[k];
                let res = build_layer(src, plan, work, *i, &|p| {
                    let _ = tx.send(p);
                });
                if res.is_err() {
                    failed.store(true, Ordering::Relaxed);
                }
                *results[k].lock().unwrap_or_else(|p| p.into_inner()) = Some(res);
            });
        }
        drop(tx);
        for p in rx {
            progress(p);
        }
    });
    let mut built = Vec::with_capacity(layers.len());
    let mut first_err = None;
    for r in results {
        match r.into_inner().unwrap_or_else(|p| p.into_inner()) {
            Some(Ok(path)) => built.push(path),
            Some(Err(e)) => {
                first_err.get_or_insert(e);
            }
            None => {}
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(built),
    }
}

/// Names the stored layers `digests` (bottom first, a repeat kept at its top) `name`.
pub(crate) fn store_image(
    store: &ImageStore,
    name: &str,
    digests: &[String],
    source: &str,
    config: ImageConfig,
    progress: &dyn Fn(ImportProgress),
) -> Result<Image> {
    let layers = dedup_keep_top(digests);
    let img = store.set_ref(name, &layers, source, config)?;
    progress(ImportProgress {
        phase: ImportPhase::Storing,
        bytes_done: img.size_bytes,
        bytes_total: Some(img.size_bytes),
    });
    Ok(img)
}

/// The defaults and `rootfs.diff_ids` (sha256 hex) of an image config.
pub(crate) fn parse_config(bytes: &[u8]) -> Result<(ImageConfig, Option<Vec<String>>)> {
    let invalid = |message: String| ImageError::InvalidImage {
        path: PathBuf::from("config"),
        message,
    };
    if bytes.len() as u64 > JSON_LIMIT {
        return Err(invalid(format!(
            "the image config is {} bytes, more than the {JSON_LIMIT} allowed",
            bytes.len()
        )));
    }
    let config: ConfigFile =
        serde_json::from_slice(bytes).map_err(|e| invalid(format!("parse config: {e}")))?;
    let diff_ids = match &config.rootfs {
        Some(r) => Some(
            r.diff_ids
                .iter()
                .map(|d| match d.strip_prefix("sha256:") {
                    Some(_) => parse_digest(d),
                    None => Err(invalid(format!("unsupported diff_id {d:?}"))),
                })
                .collect::<Result<Vec<_>>>()?,
        ),
        None => None,
    };
    Ok((
        config.config.unwrap_or_default().to_image_config(),
        diff_ids,
    ))
}

/// Creates `dir` (mode 0755) as the root of an extracted tree.
fn make_root(dir: &Path) -> Result<PathBuf> {
    std::fs::create_dir(dir).map_err(|e| ImageError::io("mkdir", dir, e))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))
        .map_err(|e| ImageError::io("chmod", dir, e))?;
    Ok(dir.to_path_buf())
}

/// `digests` without repeats, each kept at its last (topmost) position.
fn dedup_keep_top(digests: &[String]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for d in digests.iter().rev() {
        if !out.contains(d) {
            out.push(d.clone());
        }
    }
    out.reverse();
    out
}

/// After a failed import: deletes the blobs it added, unless a ref uses them by now.
pub(crate) fn drop_new_blobs(store: &ImageStore, digests: &[String]) {
    let res = (|| {
        let _lock = store.lock_refs()?;
        let refs = store.read_refs()?;
        for d in digests {
            store.gc_blob(&refs, &parse_digest(d)?)?;
        }
        Ok::<_, ImageError>(())
    })();
    if let Err(e) = res {
        tracing::warn!(error = %e, "could not remove the blobs of a failed import");
    }
}

/// One entry of a `docker save` `manifest.json`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct DockerManifest {
    config: String,
    #[serde(default)]
    repo_tags: Option<Vec<String>>,
    layers: Vec<String>,
}

/// An OCI descriptor, as image indexes and manifests (OCI or Docker v2) list them.
/// Lenient: fields a reader does not need may be missing. `dsec-registry` reads the same
/// documents with these types.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Descriptor {
    /// What the blob is.
    #[serde(default)]
    pub media_type: Option<String>,
    /// `sha256:<hex>` of its bytes.
    pub digest: String,
    /// Its size in bytes.
    #[serde(default)]
    pub size: Option<u64>,
    /// The platform of an index entry.
    #[serde(default)]
    pub platform: Option<Platform>,
}

/// The platform of an image index entry.
#[derive(Debug, Clone, Deserialize)]
pub struct Platform {
    /// Go architecture name (`amd64`, `arm64`).
    #[serde(default)]
    pub architecture: String,
    /// Operating system (`linux`).
    #[serde(default)]
    pub os: String,
}

/// An OCI image index or image manifest (or their Docker equivalents): an index has
/// `manifests`, a manifest `config` and `layers`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Manifest {
    /// Its declared media type.
    #[serde(default)]
    pub media_type: Option<String>,
    /// An index's entries.
    #[serde(default)]
    pub manifests: Option<Vec<Descriptor>>,
    /// A manifest's config blob.
    #[serde(default)]
    pub config: Option<Descriptor>,
    /// A manifest's layer blobs, bottom first.
    #[serde(default)]
    pub layers: Option<Vec<Descriptor>>,
}

/// The entry of an index for linux on this machine's architecture, or (`Err`) the
/// platforms the index has, `, `-separated, to say what was found instead.
pub fn pick_platform(list: &[Descriptor]) -> std::result::Result<&Descriptor, String> {
    let arch = host_arch();
    list.iter()
        .find(|d| {
            d.platform
                .as_ref()
                .is_some_and(|p| p.os == "linux" && p.architecture == arch)
        })
        .ok_or_else(|| {
            list.iter()
                .map(|d| match &d.platform {
                    Some(p) => format!("{}/{}", p.os, p.architecture),
                    None => "unknown".to_string(),
                })
                .collect::<Vec<_>>()
                .join(", ")
        })
}

/// The parts of an image config we use.
#[derive(Debug, Deserialize)]
struct ConfigFile {
    #[serde(default)]
    config: Option<RunConfig>,
    #[serde(default)]
    rootfs: Option<RootFs>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct RunConfig {
    #[serde(default)]
    env: Option<Vec<String>>,
    #[serde(default)]
    working_dir: Option<String>,
    #[serde(default)]
    user: Option<String>,
    #[serde(default)]
    entrypoint: Option<Vec<String>>,
    #[serde(default)]
    cmd: Option<Vec<String>>,
    #[serde(default)]
    labels: Option<std::collections::BTreeMap<String, String>>,
}

#[derive(Debug, Deserialize)]
struct RootFs {
    #[serde(default)]
    diff_ids: Vec<String>,
}

impl RunConfig {
    fn to_image_config(&self) -> ImageConfig {
        let env = self
            .env
            .iter()
            .flatten()
            .filter_map(|kv| kv.split_once('='))
            .filter(|(k, _)| !k.is_empty())
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let non_empty = |s: &Option<String>| s.clone().filter(|s| !s.is_empty());
        ImageConfig {
            env,
            workdir: non_empty(&self.working_dir),
            user: non_empty(&self.user),
            entrypoint: self.entrypoint.clone().unwrap_or_default(),
            cmd: self.cmd.clone().unwrap_or_default(),
            labels: self.labels.clone().unwrap_or_default(),
        }
    }
}

/// What to import.
#[derive(Debug)]
struct Plan {
    layers: Vec<LayerPlan>,
    config: ImageConfig,
}

/// One layer: where it is and what it must hash to.
#[derive(Debug, Clone)]
pub(crate) struct LayerPlan {
    /// 1-based position, bottom first (for messages).
    pub(crate) index: usize,
    pub(crate) member: String,
    /// sha256 hex of the stored (maybe compressed) bytes, when known.
    pub(crate) blob: Option<String>,
    /// Size of the stored bytes, when known.
    pub(crate) size: Option<u64>,
    /// sha256 hex of the uncompressed tar (`rootfs.diff_ids`), when known.
    pub(crate) diff_id: Option<String>,
}

/// Where a tar member's bytes are.
#[derive(Debug, Clone)]
enum Member {
    File {
        offset: u64,
        size: u64,
    },
    /// Symlink or hard link: the normalized name it points at.
    Link(String),
}

#[derive(Debug)]
enum Backing {
    Dir,
    Tar {
        file: File,
        members: HashMap<String, Member>,
    },
}

/// An image source: a directory or a scanned tar file.
#[derive(Debug)]
pub(crate) struct Source {
    path: PathBuf,
    backing: Backing,
}

/// Reads `len` bytes of `file` from `pos` with positioned reads.
struct Slice<'a> {
    file: &'a File,
    pos: u64,
    end: u64,
}

impl Read for Slice<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.end.saturating_sub(self.pos);
        let want = usize::try_from(left).unwrap_or(usize::MAX).min(buf.len());
        if want == 0 {
            return Ok(0);
        }
        let n = self.file.read_at(&mut buf[..want], self.pos)?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "archive member ends early (truncated archive?)",
            ));
        }
        self.pos += n as u64;
        Ok(n)
    }
}

/// Passes reads through, hashing them.
struct Hashing<R> {
    inner: R,
    hasher: Sha256,
    bytes: u64,
}

impl<R> Hashing<R> {
    fn new(inner: R) -> Self {
        Self {
            inner,
            hasher: Sha256::new(),
            bytes: 0,
        }
    }

    /// The reader, the sha256 hex of what was read, and its length.
    fn finish(self) -> (R, String, u64) {
        (self.inner, hex::encode(self.hasher.finalize()), self.bytes)
    }
}

impl<R: Read> Read for Hashing<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }
}

/// A tar member name without `.` parts and repeated slashes; `None` for `..` or empty.
fn normalize(path: &Path) -> Option<String> {
    let mut parts = Vec::new();
    for c in path.components() {
        match c {
            Component::Normal(p) => parts.push(p.to_str()?),
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
            Component::ParentDir => return None,
        }
    }
    (!parts.is_empty()).then(|| parts.join("/"))
}

/// Where a tar link points: a symlink relative to its own directory, a hard link relative to
/// the archive root. `None` when it leaves the archive.
fn link_target(name: &str, target: &Path, symlink: bool) -> Option<String> {
    let mut parts: Vec<&str> = Vec::new();
    if symlink && !target.is_absolute() {
        parts.extend(name.split('/'));
        parts.pop();
    }
    for c in target.components() {
        match c {
            Component::Normal(p) => parts.push(p.to_str()?),
            Component::ParentDir => {
                parts.pop()?;
            }
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    (!parts.is_empty()).then(|| parts.join("/"))
}

/// The sha256 hex a member name carries: `blobs/sha256/<hex>` or `<hex>.json`.
fn digest_in_name(name: &str) -> Option<String> {
    let hex = name
        .strip_prefix("blobs/sha256/")
        .or_else(|| name.strip_suffix(".json"))?;
    parse_digest(hex).ok()
}

/// The Go name of this machine's architecture, as image platforms spell it.
pub fn host_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "x86" => "386",
        "powerpc64" => "ppc64le",
        "loongarch64" => "loong64",
        other => other,
    }
}

impl Source {
    /// The directory `path`, whose members are read as files.
    pub(crate) fn dir(path: &Path) -> Self {
        Self {
            path: path.to_path_buf(),
            backing: Backing::Dir,
        }
    }

    fn open(path: &Path) -> Result<Self> {
        let meta = std::fs::metadata(path).map_err(|e| ImageError::io("stat", path, e))?;
        let backing = if meta.is_dir() {
            Backing::Dir
        } else {
            if let Some(extract::ArchiveKind::TarGz) = extract::sniff(path)? {
                return Err(ImageError::InvalidImage {
                    path: path.to_path_buf(),
                    message: "compressed image archives are not supported; decompress it \
                              (e.g. gunzip) and import the plain tar"
                        .into(),
                });
            }
            Self::scan(path, meta.len())?
        };
        Ok(Self {
            path: path.to_path_buf(),
            backing,
        })
    }

    /// Records the position of every member of the tar file `path` (seeking over the data).
    fn scan(path: &Path, len: u64) -> Result<Backing> {
        let file = File::open(path).map_err(|e| ImageError::io("open", path, e))?;
        let archive_err = |message: String| ImageError::Archive {
            path: path.to_path_buf(),
            message,
        };
        let mut members = HashMap::new();
        {
            let mut ar = tar::Archive::new(&file);
            for entry in ar
                .entries_with_seek()
                .map_err(|e| archive_err(e.to_string()))?
            {
                let entry = entry.map_err(|e| archive_err(e.to_string()))?;
                let et = entry.header().entry_type();
                let Some(name) = entry.path().ok().and_then(|p| normalize(&p)) else {
                    continue;
                };
                let member = if et.is_file() || et == tar::EntryType::Continuous {
                    let (offset, size) = (entry.raw_file_position(), entry.size());
                    if offset.checked_add(size).is_none_or(|end| end > len) {
                        return Err(archive_err(format!(
                            "truncated: member {name} ({size} bytes at offset {offset}) \
                             extends past the end of the file ({len} bytes)"
                        )));
                    }
                    Member::File { offset, size }
                } else if et.is_symlink() || et.is_hard_link() {
                    let target = entry.link_name().ok().flatten();
                    match target.and_then(|t| link_target(&name, &t, et.is_symlink())) {
                        Some(t) => Member::Link(t),
                        None => continue,
                    }
                } else {
                    continue;
                };
                members.insert(name, member);
            }
        }
        Ok(Backing::Tar { file, members })
    }

    fn invalid(&self, message: impl Into<String>) -> ImageError {
        ImageError::InvalidImage {
            path: self.path.clone(),
            message: message.into(),
        }
    }

    /// A member name from image metadata: relative, without `..`.
    fn member_name(&self, raw: &str) -> Result<String> {
        if raw.starts_with('/') {
            return Err(self.invalid(format!("unsafe path {raw:?}: absolute")));
        }
        let mut parts = Vec::new();
        for p in raw.split('/') {
            match p {
                "" | "." => {}
                ".." => return Err(self.invalid(format!("unsafe path {raw:?}: contains `..`"))),
                p => parts.push(p),
            }
        }
        if parts.is_empty() {
            return Err(self.invalid(format!("empty path {raw:?}")));
        }
        Ok(parts.join("/"))
    }

    /// How errors name member `name`.
    fn origin(&self, name: &str) -> PathBuf {
        match self.backing {
            Backing::Dir => self.path.join(name),
            Backing::Tar { .. } => PathBuf::from(format!("{}:{name}", self.path.display())),
        }
    }

    fn has(&self, name: &str) -> bool {
        match &self.backing {
            Backing::Dir => self.path.join(name).is_file(),
            Backing::Tar { .. } => self.locate(name).is_ok(),
        }
    }

    /// A tar member's data, following links.
    fn locate(&self, name: &str) -> Result<(u64, u64)> {
        let Backing::Tar { members, .. } = &self.backing else {
            return Err(self.invalid("not a tar"));
        };
        let mut cur = name;
        for _ in 0..MAX_LINK_HOPS {
            match members.get(cur) {
                Some(Member::File { offset, size }) => return Ok((*offset, *size)),
                Some(Member::Link(t)) => cur = t,
                None => return Err(self.invalid(format!("{name} not found"))),
            }
        }
        Err(self.invalid(format!("{name}: too many levels of links")))
    }

    /// Opens member `name` (a normalized name); returns a reader and its size.
    fn open_member(&self, name: &str) -> Result<(Box<dyn Read + '_>, u64)> {
        match &self.backing {
            Backing::Dir => {
                let p = self.path.join(name);
                let f = match File::open(&p) {
                    Ok(f) => f,
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {
                        return Err(self.invalid(format!("{name} not found")))
                    }
                    Err(e) => return Err(ImageError::io("open", &p, e)),
                };
                let md = f.metadata().map_err(|e| ImageError::io("stat", &p, e))?;
                if !md.is_file() {
                    return Err(self.invalid(format!("{name} is not a regular file")));
                }
                Ok((Box::new(f.take(md.len())), md.len()))
            }
            Backing::Tar { file, .. } => {
                let (offset, size) = self.locate(name)?;
                let slice = Slice {
                    file,
                    pos: offset,
                    end: offset + size,
                };
                Ok((Box::new(slice), size))
            }
        }
    }

    /// Reads and parses the JSON member `name`, checking its sha256 hex if given.
    fn read_json<T: DeserializeOwned>(&self, name: &str, digest: Option<&str>) -> Result<T> {
        let (r, size) = self.open_member(name)?;
        if size > JSON_LIMIT {
            return Err(self.invalid(format!(
                "{name} is {size} bytes, more than the {JSON_LIMIT} allowed for JSON"
            )));
        }
        let mut buf = Vec::new();
        r.take(JSON_LIMIT)
            .read_to_end(&mut buf)
            .map_err(|e| ImageError::io("read", &self.origin(name), e))?;
        if let Some(want) = digest {
            let got = hex::encode(Sha256::digest(&buf));
            if got != want {
                return Err(ImageError::DigestMismatch {
                    path: self.path.clone(),
                    what: name.to_string(),
                    expected: format!("sha256:{want}"),
                    actual: format!("sha256:{got}"),
                });
            }
        }
        serde_json::from_slice(&buf).map_err(|e| self.invalid(format!("parse {name}: {e}")))
    }

    /// The sha256 hex of a descriptor's digest.
    fn descriptor_hex(&self, d: &Descriptor) -> Result<String> {
        if !d.digest.starts_with("sha256:") {
            return Err(self.invalid(format!(
                "unsupported digest {:?} (only sha256 is supported)",
                d.digest
            )));
        }
        parse_digest(&d.digest).map_err(|_| self.invalid(format!("invalid digest {:?}", d.digest)))
    }

    /// Reads and parses the JSON blob `d` points at, checking its digest and size.
    fn read_blob_json<T: DeserializeOwned>(&self, d: &Descriptor) -> Result<T> {
        let hex = self.descriptor_hex(d)?;
        let name = format!("blobs/sha256/{hex}");
        if let Some(want) = d.size {
            let (_, size) = self.open_member(&name)?;
            if size != want {
                return Err(self.invalid(format!(
                    "{name} is {size} bytes, its descriptor says {want}"
                )));
            }
        }
        self.read_json(&name, Some(&hex))
    }

    /// Works out the layers and config of the image.
    fn plan(&self) -> Result<Plan> {
        let plan = if self.has("manifest.json") {
            self.plan_docker()?
        } else if self.has("oci-layout") {
            self.plan_oci()?
        } else {
            return Err(self.invalid(
                "neither manifest.json (docker save) nor oci-layout (OCI image layout) found",
            ));
        };
        if plan.layers.is_empty() {
            return Err(self.invalid("image has no layers"));
        }
        Ok(plan)
    }

    fn plan_docker(&self) -> Result<Plan> {
        let entries: Vec<DockerManifest> = self.read_json("manifest.json", None)?;
        let entry = match entries.as_slice() {
            [one] => one,
            [] => return Err(self.invalid("manifest.json lists no image")),
            many => {
                let mut tags = String::new();
                for m in many {
                    let t = m.repo_tags.as_deref().unwrap_or_default().join(",");
                    let _ = write!(tags, " [{t}]");
                }
                return Err(self.invalid(format!(
                    "manifest.json lists {} images:{tags}; import one image per archive",
                    many.len()
                )));
            }
        };
        let config_name = self.member_name(&entry.config)?;
        let config: ConfigFile =
            self.read_json(&config_name, digest_in_name(&config_name).as_deref())?;
        let diff_ids = self
            .diff_ids(&config, entry.layers.len())?
            .ok_or_else(|| self.invalid(format!("{config_name} has no rootfs.diff_ids")))?;
        let layers = entry
            .layers
            .iter()
            .zip(diff_ids)
            .enumerate()
            .map(|(i, (l, diff_id))| {
                let member = self.member_name(l)?;
                Ok(LayerPlan {
                    index: i + 1,
                    blob: digest_in_name(&member).filter(|_| member.starts_with("blobs/")),
                    member,
                    size: None,
                    diff_id: Some(diff_id),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Plan {
            layers,
            config: config.config.unwrap_or_default().to_image_config(),
        })
    }

    fn plan_oci(&self) -> Result<Plan> {
        let index: Manifest = self.read_json("index.json", None)?;
        let desc = self.pick(index.manifests.as_deref().unwrap_or_default(), "index.json")?;
        let mut manifest: Manifest = self.read_blob_json(&desc)?;
        if let Some(nested) = manifest.manifests.take() {
            let what = format!("image index {}", desc.digest);
            let desc = self.pick(&nested, &what)?;
            manifest = self.read_blob_json(&desc)?;
            if manifest.manifests.is_some() {
                return Err(self.invalid(format!(
                    "{} is an image index nested two levels deep",
                    desc.digest
                )));
            }
        }
        let (Some(config_desc), Some(layer_descs)) = (manifest.config, manifest.layers) else {
            return Err(self.invalid(format!(
                "manifest {} has no config or no layers",
                desc.digest
            )));
        };
        let config: ConfigFile = self.read_blob_json(&config_desc)?;
        let diff_ids = self.diff_ids(&config, layer_descs.len())?;
        let mut layers = Vec::new();
        for (i, d) in layer_descs.iter().enumerate() {
            let media = d.media_type.as_deref().unwrap_or_default();
            if !media.is_empty() && !media.contains("tar") {
                return Err(self.invalid(format!(
                    "layer {} has unsupported media type {media}",
                    i + 1
                )));
            }
            let hex = self.descriptor_hex(d)?;
            layers.push(LayerPlan {
                index: i + 1,
                member: format!("blobs/sha256/{hex}"),
                blob: Some(hex),
                size: d.size,
                diff_id: diff_ids.as_ref().and_then(|ids| ids.get(i).cloned()),
            });
        }
        Ok(Plan {
            layers,
            config: config.config.unwrap_or_default().to_image_config(),
        })
    }

    /// The config's `rootfs.diff_ids` as sha256 hex, checked against the layer count.
    fn diff_ids(&self, config: &ConfigFile, layers: usize) -> Result<Option<Vec<String>>> {
        let Some(rootfs) = &config.rootfs else {
            return Ok(None);
        };
        if rootfs.diff_ids.len() != layers {
            return Err(self.invalid(format!(
                "the manifest lists {layers} layers but the config's rootfs.diff_ids has {}",
                rootfs.diff_ids.len()
            )));
        }
        rootfs
            .diff_ids
            .iter()
            .map(|d| {
                self.descriptor_hex(&Descriptor {
                    media_type: None,
                    digest: d.clone(),
                    size: None,
                    platform: None,
                })
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    /// The one manifest of `list`, or the one for linux on this machine's architecture.
    fn pick(&self, list: &[Descriptor], what: &str) -> Result<Descriptor> {
        if let [one] = list {
            return Ok(one.clone());
        }
        if list.is_empty() {
            return Err(self.invalid(format!("{what} lists no manifests")));
        }
        pick_platform(list).cloned().map_err(|found| {
            self.invalid(format!(
                "{what} lists {} manifests and none for linux/{} (found: {found})",
                list.len(),
                host_arch()
            ))
        })
    }

    /// Extracts `layer` into `dest`, verifying its digests. Returns whether it had a `./`
    /// entry.
    fn unpack_layer(
        &self,
        layer: &LayerPlan,
        dest: &Path,
        whiteouts: Whiteouts,
        progress: &dyn Fn(ImportProgress),
    ) -> Result<bool> {
        let origin = self.origin(&layer.member);
        self.read_layer(layer, progress, &mut |r| {
            extract::extract_from(r, &origin, dest, whiteouts).map(|(had_root, _)| had_root)
        })
    }

    /// Feeds `layer`'s uncompressed tar stream to `consume`, then reads the rest of it
    /// and checks the blob's size and digest and the tar's diff_id. Returns what
    /// `consume` did.
    fn read_layer(
        &self,
        layer: &LayerPlan,
        progress: &dyn Fn(ImportProgress),
        consume: &mut dyn FnMut(&mut dyn Read) -> Result<bool>,
    ) -> Result<bool> {
        let (raw, size) = self.open_member(&layer.member)?;
        if let Some(want) = layer.size {
            if want != size {
                return Err(self.invalid(format!(
                    "layer {} ({}) is {size} bytes, its descriptor says {want}",
                    layer.index, layer.member
                )));
            }
        }
        let origin = self.origin(&layer.member);
        progress(ImportProgress {
            phase: ImportPhase::Extracting,
            bytes_done: 0,
            bytes_total: Some(size),
        });
        let mut buf =
            BufReader::with_capacity(1 << 20, Counting::new(Hashing::new(raw), size, progress));
        let head = buf
            .fill_buf()
            .map_err(|e| ImageError::io("read", &origin, e))?;
        let drain = |r: &mut dyn Read| {
            io::copy(r, &mut io::sink())
                .map(drop)
                .map_err(|e| ImageError::Archive {
                    path: origin.clone(),
                    message: e.to_string(),
                })
        };
        let (had_root, diff_hex, mut buf) = if head.starts_with(ZSTD_MAGIC) {
            let zst =
                zstd::stream::read::Decoder::with_buffer(buf).map_err(|e| ImageError::Archive {
                    path: origin.clone(),
                    message: format!("zstd: {e}"),
                })?;
            let zst = Limited::new(zst, expansion_limit(size));
            let mut h = Hashing::new(zst);
            let had_root = consume(&mut h)?;
            drain(&mut h)?;
            let (zst, diff_hex, _) = h.finish();
            (had_root, diff_hex, zst.into_inner().finish())
        } else if head.starts_with(GZIP_MAGIC) {
            let gz = Limited::new(
                flate2::read::MultiGzDecoder::new(buf),
                expansion_limit(size),
            );
            let mut h = Hashing::new(gz);
            let had_root = consume(&mut h)?;
            drain(&mut h)?;
            let (gz, diff_hex, _) = h.finish();
            (had_root, diff_hex, gz.into_inner().into_inner())
        } else {
            let mut h = Hashing::new(buf);
            let had_root = consume(&mut h)?;
            drain(&mut h)?;
            let (buf, diff_hex, _) = h.finish();
            (had_root, diff_hex, buf)
        };
        drain(&mut buf)?;
        let (_, blob_hex, _) = buf.into_inner().into_inner().finish();
        let mismatch = |what: &str, want: &str, got: &str| ImageError::DigestMismatch {
            path: self.path.clone(),
            what: format!("layer {} ({}) {what}", layer.index, layer.member),
            expected: format!("sha256:{want}"),
            actual: format!("sha256:{got}"),
        };
        if let Some(want) = &layer.blob {
            if *want != blob_hex {
                return Err(mismatch("blob", want, &blob_hex));
            }
        }
        if let Some(want) = &layer.diff_id {
            if *want != diff_hex {
                return Err(mismatch("uncompressed tar (diff_id)", want, &diff_hex));
            }
        }
        Ok(had_root)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_targets_stay_inside() {
        let p = |s: &str| PathBuf::from(s);
        assert_eq!(
            link_target("a/layer.tar", &p("../b/layer.tar"), true).as_deref(),
            Some("b/layer.tar")
        );
        assert_eq!(link_target("a/x", &p("../../etc"), true), None);
        assert_eq!(link_target("a/x", &p("b/y"), false).as_deref(), Some("b/y"));
        assert_eq!(normalize(&p("./a//b/./c")).as_deref(), Some("a/b/c"));
        assert_eq!(normalize(&p("a/../b")), None);
    }

    #[test]
    fn digests_in_member_names() {
        let hex = "a".repeat(64);
        assert_eq!(
            digest_in_name(&format!("blobs/sha256/{hex}")).as_deref(),
            Some(hex.as_str())
        );
        assert_eq!(
            digest_in_name(&format!("{hex}.json")).as_deref(),
            Some(hex.as_str())
        );
        assert_eq!(digest_in_name("config.json"), None);
    }

    #[test]
    fn duplicate_layers_keep_the_top_one() {
        let v = |s: &[&str]| s.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        assert_eq!(
            dedup_keep_top(&v(&["a", "b", "a", "c"])),
            v(&["b", "a", "c"])
        );
    }

    #[test]
    fn run_config_defaults() {
        let c: ConfigFile = serde_json::from_str(
            r#"{"config":{"Env":["A=1","B=x=y","BAD"],"WorkingDir":"","User":"app",
                "Entrypoint":null,"Cmd":["sh"]},"rootfs":{"type":"layers","diff_ids":[]}}"#,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let ic = c.config.unwrap_or_default().to_image_config();
        assert_eq!(ic.env.get("A").map(String::as_str), Some("1"));
        assert_eq!(ic.env.get("B").map(String::as_str), Some("x=y"));
        assert_eq!(ic.env.len(), 2);
        assert_eq!(ic.workdir, None);
        assert_eq!(ic.user.as_deref(), Some("app"));
        assert!(ic.entrypoint.is_empty());
        assert_eq!(ic.cmd, vec!["sh".to_string()]);
    }
}
