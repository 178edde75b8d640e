//! `docker save` / OCI layout import tests with real mkfs.erofs, real EROFS mounts and a real
//! overlayfs mount of the imported layers. The archives are built here with the `tar` crate.
//! They need root, erofs-utils and kernel EROFS and overlayfs support. With `CI=true` a
//! missing prerequisite is a failure; otherwise the test prints why and returns.
//!
//! The expected tree is computed independently: the layers are described as entry lists, and
//! a small in-memory model applies them with OCI semantics (whiteouts and opaque markers
//! delete what lower layers have; a directory over a directory updates its metadata; anything
//! else replaces).

use std::collections::{BTreeMap, HashSet};
use std::ffi::CString;
use std::io::Write;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use dsec_image::oci::sniff_oci;
use dsec_image::{mountinfo, ImageConfig, ImageError, ImageStore, ImportPhase, ImportProgress};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

fn prerequisite_missing() -> Option<String> {
    if !nix::unistd::geteuid().is_root() {
        return Some("not running as root".into());
    }
    let has_fs = |name: &str| {
        std::fs::read_to_string("/proc/filesystems")
            .unwrap_or_default()
            .lines()
            .any(|l| l.split_whitespace().last() == Some(name))
    };
    if !has_fs("erofs") {
        return Some("kernel has no erofs".into());
    }
    if !has_fs("overlay") {
        let _ = Command::new("modprobe").arg("overlay").status();
        if !has_fs("overlay") {
            return Some("kernel has no overlayfs".into());
        }
    }
    if Command::new("mkfs.erofs").arg("--help").output().is_err() {
        return Some("mkfs.erofs not installed".into());
    }
    None
}

/// Unmounts anything left under the store's mnt/ before the temp dir is removed.
struct TestStore {
    store: ImageStore,
    dir: tempfile::TempDir,
}

impl Drop for TestStore {
    fn drop(&mut self) {
        let mnt = self.store.root().join("mnt");
        let base = self.dir.path().to_path_buf();
        for m in mountinfo::read().unwrap_or_default().iter().rev() {
            if m.mount_point.starts_with(&mnt) || m.mount_point.starts_with(&base) {
                let _ = nix::mount::umount2(&m.mount_point, nix::mount::MntFlags::MNT_DETACH);
            }
        }
    }
}

/// A fresh store under the target tmp dir, or `None` (skip) outside CI.
fn store(test: &str) -> Option<TestStore> {
    if dsec_testkit::unavailable(test, prerequisite_missing()).is_some() {
        return None;
    }
    let dir = tempfile::Builder::new()
        .prefix("dsec-oci-test-")
        .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
        .expect("tempdir");
    let store = ImageStore::open(dir.path().join("store")).expect("open store");
    Some(TestStore { store, dir })
}

// ---------------------------------------------------------------------------------------
// Layer descriptions, tar building, and the expected-tree model.

#[derive(Debug, Clone)]
enum Kind {
    Dir,
    File(Vec<u8>),
    Symlink(&'static str),
    Hardlink(&'static str),
    /// `.wh.<name>` for the entry's path.
    Whiteout,
    /// `.wh..wh..opq` in the entry's path (a directory).
    Opaque,
}

#[derive(Debug, Clone)]
struct E {
    path: &'static str,
    kind: Kind,
    mode: u32,
    uid: u64,
    gid: u64,
    mtime: u64,
}

fn dir(path: &'static str, mode: u32, uid: u64, gid: u64) -> E {
    E {
        path,
        kind: Kind::Dir,
        mode,
        uid,
        gid,
        mtime: 1_700_000_100,
    }
}

fn file(path: &'static str, data: &[u8], mode: u32, uid: u64, gid: u64) -> E {
    E {
        path,
        kind: Kind::File(data.to_vec()),
        mode,
        uid,
        gid,
        mtime: 1_700_000_000 + data.len() as u64,
    }
}

fn symlink(path: &'static str, target: &'static str) -> E {
    E {
        path,
        kind: Kind::Symlink(target),
        mode: 0o777,
        uid: 0,
        gid: 0,
        mtime: 1_700_000_200,
    }
}

fn hardlink(path: &'static str, target: &'static str) -> E {
    E {
        path,
        kind: Kind::Hardlink(target),
        mode: 0o644,
        uid: 0,
        gid: 0,
        mtime: 1_700_000_300,
    }
}

fn whiteout(path: &'static str) -> E {
    E {
        path,
        kind: Kind::Whiteout,
        mode: 0o644,
        uid: 0,
        gid: 0,
        mtime: 1_700_000_400,
    }
}

fn opaque(dir: &'static str) -> E {
    E {
        path: dir,
        kind: Kind::Opaque,
        mode: 0o644,
        uid: 0,
        gid: 0,
        mtime: 1_700_000_500,
    }
}

/// The tar of one layer (uncompressed).
fn layer_tar(entries: &[E]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for e in entries {
        let mut h = tar::Header::new_gnu();
        h.set_mode(e.mode);
        h.set_uid(e.uid);
        h.set_gid(e.gid);
        h.set_mtime(e.mtime);
        h.set_size(0);
        let in_dir = |name: &str| match e.path.rsplit_once('/') {
            Some((d, base)) => format!("{d}/{}", name.replace("{}", base)),
            None => name.replace("{}", e.path),
        };
        match &e.kind {
            Kind::Dir => {
                h.set_entry_type(tar::EntryType::Directory);
                b.append_data(&mut h, format!("{}/", e.path), &[][..])
                    .expect("append dir");
            }
            Kind::File(data) => {
                h.set_entry_type(tar::EntryType::Regular);
                h.set_size(data.len() as u64);
                b.append_data(&mut h, e.path, &data[..])
                    .expect("append file");
            }
            Kind::Symlink(t) => {
                h.set_entry_type(tar::EntryType::Symlink);
                b.append_link(&mut h, e.path, t).expect("append symlink");
            }
            Kind::Hardlink(t) => {
                h.set_entry_type(tar::EntryType::Link);
                b.append_link(&mut h, e.path, t).expect("append hardlink");
            }
            Kind::Whiteout => {
                h.set_entry_type(tar::EntryType::Regular);
                b.append_data(&mut h, in_dir(".wh.{}"), &[][..])
                    .expect("append whiteout");
            }
            Kind::Opaque => {
                h.set_entry_type(tar::EntryType::Regular);
                b.append_data(&mut h, format!("{}/.wh..wh..opq", e.path), &[][..])
                    .expect("append opaque");
            }
        }
    }
    b.into_inner().expect("finish tar")
}

fn gzip(data: &[u8]) -> Vec<u8> {
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    enc.write_all(data).expect("gzip");
    enc.finish().expect("gzip")
}

fn zstd(data: &[u8]) -> Vec<u8> {
    zstd::stream::encode_all(data, 3).expect("zstd")
}

/// A gzip tar holding one 300 MiB file of zeros: about 300 KiB, a 1000x expansion.
fn gzip_bomb() -> Vec<u8> {
    let size: u64 = 300 << 20;
    let mut h = tar::Header::new_ustar();
    h.set_path("zeros").expect("path");
    h.set_size(size);
    h.set_mode(0o644);
    h.set_entry_type(tar::EntryType::Regular);
    h.set_cksum();
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    enc.write_all(h.as_bytes()).expect("gzip");
    let chunk = vec![0u8; 1 << 20];
    for _ in 0..(size >> 20) {
        enc.write_all(&chunk).expect("gzip");
    }
    enc.write_all(&[0u8; 1024]).expect("gzip");
    enc.finish().expect("gzip")
}

fn sha256_hex(data: &[u8]) -> String {
    hex::encode(Sha256::digest(data))
}

/// What we compare of one tree entry. `mtime` only for non-directories (directory times are
/// disturbed by adding and removing children when a tree is built on disk).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Node {
    mode: u32,
    uid: u32,
    gid: u32,
    mtime: Option<i64>,
    sha256: Option<String>,
    link: Option<PathBuf>,
}

type Tree = BTreeMap<String, Node>;

fn key(path: &str) -> String {
    format!("/{path}")
}

fn remove_tree(t: &mut Tree, k: &str) {
    let prefix = format!("{k}/");
    t.retain(|p, _| p != k && !p.starts_with(&prefix));
}

fn remove_children(t: &mut Tree, k: &str) {
    let prefix = if k == "/" {
        "/".to_string()
    } else {
        format!("{k}/")
    };
    t.retain(|p, _| p == "/" || !p.starts_with(&prefix));
}

/// Applies one layer to the model with OCI semantics.
fn apply(t: &mut Tree, layer: &[E]) {
    // Whiteouts and opaque markers hide what the layers below have, whatever their position.
    for e in layer {
        match e.kind {
            Kind::Whiteout => remove_tree(t, &key(e.path)),
            Kind::Opaque => remove_children(t, &key(e.path)),
            _ => {}
        }
    }
    for e in layer {
        let k = key(e.path);
        let node = match &e.kind {
            Kind::Whiteout | Kind::Opaque => continue,
            Kind::Dir => Node {
                mode: libc::S_IFDIR | e.mode,
                uid: e.uid as u32,
                gid: e.gid as u32,
                mtime: None,
                sha256: None,
                link: None,
            },
            Kind::File(data) => Node {
                mode: libc::S_IFREG | e.mode,
                uid: e.uid as u32,
                gid: e.gid as u32,
                mtime: Some(e.mtime as i64),
                sha256: Some(sha256_hex(data)),
                link: None,
            },
            Kind::Symlink(target) => Node {
                mode: libc::S_IFLNK | 0o777,
                uid: e.uid as u32,
                gid: e.gid as u32,
                mtime: Some(e.mtime as i64),
                sha256: None,
                link: Some(PathBuf::from(target)),
            },
            Kind::Hardlink(target) => t.get(&key(target)).cloned().expect("link target"),
        };
        let dir_over_dir =
            matches!(e.kind, Kind::Dir) && t.get(&k).is_some_and(|n| n.mtime.is_none());
        if !dir_over_dir {
            remove_tree(t, &k);
        }
        t.insert(k, node);
    }
}

fn expected(layers: &[Vec<E>]) -> Tree {
    let mut t = Tree::new();
    t.insert(
        "/".into(),
        Node {
            mode: libc::S_IFDIR | 0o755,
            uid: 0,
            gid: 0,
            mtime: None,
            sha256: None,
            link: None,
        },
    );
    for l in layers {
        apply(&mut t, l);
    }
    t
}

fn snapshot(root: &Path) -> Tree {
    let mut out = Tree::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let p = root.join(&rel);
        let md = std::fs::symlink_metadata(&p).expect("lstat");
        let ft = md.file_type();
        if ft.is_dir() {
            for e in std::fs::read_dir(&p).expect("read_dir") {
                stack.push(rel.join(e.expect("entry").file_name()));
            }
        }
        out.insert(
            format!("/{}", rel.display()),
            Node {
                mode: md.mode(),
                uid: md.uid(),
                gid: md.gid(),
                mtime: (!ft.is_dir()).then(|| md.mtime()),
                sha256: ft
                    .is_file()
                    .then(|| sha256_hex(&std::fs::read(&p).expect("read"))),
                link: ft
                    .is_symlink()
                    .then(|| std::fs::read_link(&p).expect("readlink")),
            },
        );
    }
    out
}

fn assert_tree(got: &Tree, want: &Tree, what: &str) {
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>(),
        "{what}: paths differ"
    );
    for (k, w) in want {
        assert_eq!(got.get(k), Some(w), "{what}: {k} differs");
    }
}

fn same_inode(root: &Path, a: &str, b: &str) -> bool {
    let ma = std::fs::symlink_metadata(root.join(a)).expect("lstat");
    let mb = std::fs::symlink_metadata(root.join(b)).expect("lstat");
    (ma.dev(), ma.ino()) == (mb.dev(), mb.ino())
}

fn lgetxattr(p: &Path, name: &str) -> Option<Vec<u8>> {
    let cp = CString::new(p.as_os_str().as_encoded_bytes()).ok()?;
    let cn = CString::new(name).ok()?;
    let mut buf = vec![0u8; 256];
    // SAFETY: valid NUL-terminated strings and a writable buffer of the given length.
    let n =
        unsafe { libc::lgetxattr(cp.as_ptr(), cn.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 {
        return None;
    }
    buf.truncate(n as usize);
    Some(buf)
}

/// The three layers of the test image, bottom first.
fn sample_layers() -> Vec<Vec<E>> {
    let big: Vec<u8> = (0..200_000u32).map(|i| (i * 7 % 251) as u8).collect();
    let l1 = vec![
        dir("bin", 0o755, 0, 0),
        file("bin/tool", b"#!/bin/sh\necho v1\n", 0o755, 0, 0),
        file("bin/suid", b"suid", 0o4755, 0, 0),
        symlink("bin/sh", "tool"),
        dir("etc", 0o755, 0, 0),
        file("etc/passwd", b"root:x:0:0::/root:/bin/sh\n", 0o644, 0, 0),
        hardlink("etc/passwd.hard", "etc/passwd"),
        file("etc/secret", b"top secret", 0o600, 1234, 5678),
        dir("data", 0o755, 1000, 1000),
        file("data/a.txt", b"a v1", 0o644, 1000, 1000),
        dir("data/sub", 0o700, 1000, 1000),
        file("data/sub/b.txt", b"b", 0o600, 1000, 1000),
        dir("opaq", 0o755, 0, 0),
        file("opaq/old1", b"old1", 0o644, 0, 0),
        dir("opaq/olddir", 0o755, 0, 0),
        file("opaq/olddir/x", b"x", 0o644, 0, 0),
        file("big", &big, 0o644, 0, 0),
        dir("empty", 0o1777, 0, 0),
    ];
    let l2 = vec![
        dir("etc", 0o755, 0, 0),
        whiteout("etc/secret"),
        file("etc/new", b"new in layer 2", 0o640, 42, 43),
        dir("data", 0o755, 1000, 1000),
        whiteout("data/sub"),
        file("data/a.txt", b"a v2, longer", 0o664, 1000, 1000),
        dir("opaq", 0o755, 0, 0),
        file("opaq/mid", b"mid", 0o644, 0, 0),
    ];
    let l3 = vec![
        dir("opaq", 0o750, 7, 8),
        // Before the marker: the marker hides only what lower layers have.
        file("opaq/new", b"new in opaque", 0o644, 7, 8),
        opaque("opaq"),
        dir("opaq/olddir", 0o700, 0, 0),
        file("opaq/olddir/y", b"y", 0o644, 0, 0),
        dir("bin", 0o755, 0, 0),
        file("bin/tool", b"#!/bin/sh\necho v3\n", 0o700, 0, 0),
        symlink("latest", "etc/new"),
        file("h1", b"hard", 0o644, 5, 6),
        hardlink("h2", "h1"),
        dir("data", 0o755, 1000, 1000),
        file("data/sub", b"now a file", 0o644, 1000, 1000),
        whiteout("big"),
    ];
    vec![l1, l2, l3]
}

fn sample_config(diff_ids: &[String]) -> Value {
    json!({
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Env": ["PATH=/usr/local/bin:/usr/bin:/bin", "LANG=C.UTF-8"],
            "WorkingDir": "/data",
            "User": "1000:1000",
            "Entrypoint": ["/bin/sh", "-c"],
            "Cmd": ["echo hi"]
        },
        "rootfs": {
            "type": "layers",
            "diff_ids": diff_ids.iter().map(|d| format!("sha256:{d}")).collect::<Vec<_>>()
        }
    })
}

fn sample_image_config() -> ImageConfig {
    ImageConfig {
        env: [
            (
                "PATH".to_string(),
                "/usr/local/bin:/usr/bin:/bin".to_string(),
            ),
            ("LANG".to_string(), "C.UTF-8".to_string()),
        ]
        .into(),
        workdir: Some("/data".into()),
        user: Some("1000:1000".into()),
        entrypoint: vec!["/bin/sh".into(), "-c".into()],
        cmd: vec!["echo hi".into()],
        labels: Default::default(),
    }
}

/// The layer tars: uncompressed, and as stored (the middle one gzipped).
struct Layers {
    plain: Vec<Vec<u8>>,
    stored: Vec<Vec<u8>>,
}

fn build_layers(layers: &[Vec<E>]) -> Layers {
    let plain: Vec<Vec<u8>> = layers.iter().map(|l| layer_tar(l)).collect();
    let stored = plain
        .iter()
        .enumerate()
        .map(|(i, t)| if i == 1 { gzip(t) } else { t.clone() })
        .collect();
    Layers { plain, stored }
}

/// Members of a legacy `docker save` archive, `manifest.json` first.
fn docker_members(layers: &Layers, config: &Value) -> Vec<(String, Vec<u8>)> {
    let config_bytes = serde_json::to_vec(config).expect("json");
    let config_name = format!("{}.json", sha256_hex(&config_bytes));
    let layer_names: Vec<String> = layers
        .stored
        .iter()
        .enumerate()
        .map(|(i, l)| {
            format!(
                "{}/layer.tar",
                sha256_hex(&[l.as_slice(), &[i as u8]].concat())
            )
        })
        .collect();
    let manifest = json!([{
        "Config": config_name,
        "RepoTags": ["test/sample:latest"],
        "Layers": layer_names,
    }]);
    let mut m = vec![
        (
            "manifest.json".to_string(),
            serde_json::to_vec(&manifest).expect("json"),
        ),
        (config_name, config_bytes),
    ];
    for (name, data) in layer_names.iter().zip(&layers.stored) {
        let id = name.trim_end_matches("/layer.tar");
        m.push((format!("{id}/VERSION"), b"1.0".to_vec()));
        m.push((name.clone(), data.clone()));
    }
    m.push(("repositories".to_string(), b"{}".to_vec()));
    m
}

fn write_tar(out: &Path, members: &[(String, Vec<u8>)]) {
    let mut b = tar::Builder::new(std::fs::File::create(out).expect("create"));
    for (name, data) in members {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Regular);
        h.set_mode(0o644);
        h.set_mtime(1_700_000_000);
        h.set_size(data.len() as u64);
        b.append_data(&mut h, name, &data[..]).expect("append");
    }
    b.finish().expect("finish");
}

fn descriptor(media_type: &str, data: &[u8]) -> Value {
    json!({
        "mediaType": media_type,
        "digest": format!("sha256:{}", sha256_hex(data)),
        "size": data.len(),
    })
}

fn host_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    }
}

/// Members of an OCI image layout: `index.json` -> image index (two platforms) -> manifest.
/// `media_types` per layer; layer 1 is stored uncompressed, the others gzipped.
fn oci_members(layers: &Layers, config: &Value, media_types: &[&str]) -> Vec<(String, Vec<u8>)> {
    let mut blobs: Vec<Vec<u8>> = Vec::new();
    let config_bytes = serde_json::to_vec(config).expect("json");
    let mut layer_descs = Vec::new();
    for (i, plain) in layers.plain.iter().enumerate() {
        let data = if i == 0 {
            plain.clone()
        } else if media_types[i].ends_with("zstd") {
            zstd(plain)
        } else {
            gzip(plain)
        };
        layer_descs.push(descriptor(media_types[i], &data));
        blobs.push(data);
    }
    let manifest = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": descriptor("application/vnd.oci.image.config.v1+json", &config_bytes),
        "layers": layer_descs,
    }))
    .expect("json");
    let other_arch = if host_arch() == "riscv64" {
        "s390x"
    } else {
        "riscv64"
    };
    let mut mdesc = descriptor("application/vnd.oci.image.manifest.v1+json", &manifest);
    mdesc["platform"] = json!({"os": "linux", "architecture": host_arch()});
    let mut bogus = descriptor("application/vnd.oci.image.manifest.v1+json", b"not stored");
    bogus["platform"] = json!({"os": "linux", "architecture": other_arch});
    let nested = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [bogus, mdesc],
    }))
    .expect("json");
    let index = json!({
        "schemaVersion": 2,
        "manifests": [descriptor("application/vnd.oci.image.index.v1+json", &nested)],
    });
    blobs.push(config_bytes);
    blobs.push(manifest);
    blobs.push(nested);
    let mut m = vec![
        (
            "oci-layout".to_string(),
            br#"{"imageLayoutVersion":"1.0.0"}"#.to_vec(),
        ),
        (
            "index.json".to_string(),
            serde_json::to_vec(&index).expect("json"),
        ),
    ];
    for b in blobs {
        m.push((format!("blobs/sha256/{}", sha256_hex(&b)), b));
    }
    m
}

fn write_dir(out: &Path, members: &[(String, Vec<u8>)]) {
    for (name, data) in members {
        let p = out.join(name);
        std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
        std::fs::write(&p, data).expect("write");
    }
}

/// Mounts `layers` (bottom first) with overlayfs, read-only, at `at`; unmounts on drop.
struct Overlay<'a> {
    store: &'a ImageStore,
    layers: Vec<String>,
    path: PathBuf,
}

impl<'a> Overlay<'a> {
    fn mount(store: &'a ImageStore, layers: &[String], at: &Path) -> Self {
        let lowers: Vec<String> = layers
            .iter()
            .rev()
            .map(|l| store.acquire(l).expect("acquire").display().to_string())
            .collect();
        std::fs::create_dir_all(at).expect("mkdir");
        let ov = Overlay {
            store,
            layers: layers.to_vec(),
            path: at.to_path_buf(),
        };
        nix::mount::mount(
            Some("overlay"),
            at,
            Some("overlay"),
            nix::mount::MsFlags::MS_RDONLY,
            Some(format!("lowerdir={}", lowers.join(":")).as_str()),
        )
        .expect("mount overlay");
        ov
    }
}

impl Drop for Overlay<'_> {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(&self.path, nix::mount::MntFlags::MNT_DETACH);
        for l in &self.layers {
            let _ = self.store.release(l);
        }
    }
}

fn tmp_entries(store: &ImageStore) -> Vec<PathBuf> {
    std::fs::read_dir(store.root().join("tmp"))
        .expect("tmp")
        .map(|e| e.expect("entry").path())
        .collect()
}

fn blobs(store: &ImageStore) -> HashSet<PathBuf> {
    std::fs::read_dir(store.root().join("blobs/sha256"))
        .expect("blobs")
        .map(|e| e.expect("entry").path())
        .collect()
}

/// Imports `source` layered and flattened and checks both against the model.
fn check_import(ts: &TestStore, name: &str, source: &Path, want: &Tree) {
    let s = &ts.store;
    let img = s.import_oci(name, source, false, &|_| {}).expect("import");
    assert_eq!(img.layers.len(), 3, "{:?}", img.layers);
    assert_eq!(img.config, sample_image_config());
    let ov = Overlay::mount(
        s,
        &img.layers,
        &ts.dir.path().join(format!("merged-{name}")),
    );
    assert_tree(&snapshot(&ov.path), want, name);
    drop(ov);

    let flat_name = format!("{name}-flat");
    let flat = s
        .import_oci(&flat_name, source, true, &|_| {})
        .expect("import flattened");
    assert_eq!(flat.layers, vec![flat.digest.clone()]);
    assert_eq!(flat.config, sample_image_config());
    let m = s.acquire(&flat.digest).expect("acquire");
    assert_tree(&snapshot(&m), want, &flat_name);
    s.release(&flat.digest).expect("release");
    // Flattening is reproducible too (directory times of lower layers are kept).
    let again = s
        .import_oci(&format!("{name}-flat2"), source, true, &|_| {})
        .expect("import flattened again");
    assert_eq!(again.digest, flat.digest);
}

// ---------------------------------------------------------------------------------------

#[test]
fn docker_save_imports_as_layers_that_stack_like_the_image() {
    let Some(ts) = store("docker_save_imports_as_layers_that_stack_like_the_image") else {
        return;
    };
    let s = &ts.store;
    let spec = sample_layers();
    let layers = build_layers(&spec);
    let diff_ids: Vec<String> = layers.plain.iter().map(|t| sha256_hex(t)).collect();
    let archive = ts.dir.path().join("sample.tar");
    write_tar(
        &archive,
        &docker_members(&layers, &sample_config(&diff_ids)),
    );
    assert!(sniff_oci(&archive));

    let phases = Mutex::new(Vec::<ImportPhase>::new());
    let record = |p: ImportProgress| {
        let mut v = phases.lock().expect("lock");
        if v.last() != Some(&p.phase) {
            v.push(p.phase);
        }
    };
    let img = s
        .import_oci("sample", &archive, false, &record)
        .expect("import");
    {
        let v = phases.lock().expect("lock");
        assert_eq!(v.first(), Some(&ImportPhase::Extracting), "{v:?}");
        assert_eq!(v.last(), Some(&ImportPhase::Storing), "{v:?}");
        assert!(v.contains(&ImportPhase::Building) && v.contains(&ImportPhase::Hashing));
    }

    // (a) three layers, bottom first, and the config's defaults.
    assert_eq!(img.layers.len(), 3);
    assert_eq!(
        img.source,
        std::fs::canonicalize(&archive)
            .expect("canon")
            .display()
            .to_string()
    );
    assert_eq!(img.config, sample_image_config());
    let resolved = s.resolve("sample").expect("resolve");
    assert_eq!(resolved.layers, img.layers);
    assert_eq!(resolved.config, img.config);
    assert_eq!(blobs(s).len(), 3);
    let mounts: Vec<PathBuf> = img
        .layers
        .iter()
        .map(|l| s.acquire(l).expect("acquire"))
        .collect();
    // Bottom layer: its own files; middle: whiteouts as 0:0 char devices; top: opaque dir.
    assert!(mounts[0].join("etc/secret").is_file());
    let wh = std::fs::symlink_metadata(mounts[1].join("etc/secret")).expect("whiteout");
    assert!(wh.file_type().is_char_device());
    assert_eq!(wh.rdev(), 0);
    assert!(std::fs::symlink_metadata(mounts[1].join("data/sub"))
        .expect("whiteout")
        .file_type()
        .is_char_device());
    assert!(!mounts[1].join("etc/.wh.secret").exists());
    assert_eq!(
        lgetxattr(&mounts[2].join("opaq"), "trusted.overlay.opaque").as_deref(),
        Some(&b"y"[..])
    );
    assert!(!mounts[2].join("opaq/.wh..wh..opq").exists());
    for l in &img.layers {
        s.release(l).expect("release");
    }

    // (b) the overlay of the layers is the image; (c) so is the flattened import.
    let want = expected(&spec);
    assert!(want.contains_key("/etc/new") && !want.contains_key("/etc/secret"));
    assert!(!want.contains_key("/opaq/old1") && !want.contains_key("/opaq/mid"));
    check_import(&ts, "sample-check", &archive, &want);
    let ov = Overlay::mount(s, &img.layers, &ts.dir.path().join("merged"));
    assert!(same_inode(&ov.path, "etc/passwd", "etc/passwd.hard"));
    assert!(same_inode(&ov.path, "h1", "h2"));
    drop(ov);

    // Same archive again: same layers, no new blobs.
    let before = blobs(s);
    let again = s
        .import_oci("sample-again", &archive, false, &|_| {})
        .expect("reimport");
    assert_eq!(again.layers, img.layers);
    assert_eq!(again.digest, img.digest);
    s.remove("sample-again").expect("remove");
    assert_eq!(blobs(s), before);
    assert!(tmp_entries(s).is_empty(), "{:?}", tmp_entries(s));
}

#[test]
fn oci_layout_dir_and_tar_import() {
    let Some(ts) = store("oci_layout_dir_and_tar_import") else {
        return;
    };
    let s = &ts.store;
    let spec = sample_layers();
    let layers = build_layers(&spec);
    let diff_ids: Vec<String> = layers.plain.iter().map(|t| sha256_hex(t)).collect();
    let members = oci_members(
        &layers,
        &sample_config(&diff_ids),
        &[
            "application/vnd.oci.image.layer.v1.tar",
            "application/vnd.oci.image.layer.v1.tar+gzip",
            "application/vnd.docker.image.rootfs.diff.tar.gzip",
        ],
    );
    let layout = ts.dir.path().join("layout");
    write_dir(&layout, &members);
    let layout_tar = ts.dir.path().join("layout.tar");
    write_tar(&layout_tar, &members);
    assert!(sniff_oci(&layout));
    assert!(sniff_oci(&layout_tar));

    let want = expected(&spec);
    check_import(&ts, "oci-dir", &layout, &want);
    check_import(&ts, "oci-tar", &layout_tar, &want);
    // Docker 25+ `docker save`: an OCI layout plus a manifest.json naming its blobs
    // (members after oci-layout and index.json: the three layers, then the config).
    let blob_names: Vec<&String> = members[2..].iter().map(|(n, _)| n).collect();
    let manifest = json!([{
        "Config": blob_names[3],
        "RepoTags": ["test/sample:latest"],
        "Layers": [blob_names[0], blob_names[1], blob_names[2]],
    }]);
    let mut both = members.clone();
    both.insert(
        0,
        (
            "manifest.json".to_string(),
            serde_json::to_vec(&manifest).expect("json"),
        ),
    );
    let docker25 = ts.dir.path().join("docker25.tar");
    write_tar(&docker25, &both);
    assert!(sniff_oci(&docker25));
    check_import(&ts, "docker25", &docker25, &want);

    // The same layers whatever the container: a directory, a tar of it, docker's variant.
    let a = s.resolve("oci-dir").expect("resolve");
    let b = s.resolve("oci-tar").expect("resolve");
    let c = s.resolve("docker25").expect("resolve");
    assert_eq!(a.layers, b.layers);
    assert_eq!(a.layers, c.layers);
    assert!(tmp_entries(s).is_empty(), "{:?}", tmp_entries(s));
}

#[test]
fn sniffing_tells_images_from_plain_rootfs_sources() {
    let Some(ts) = store("sniffing_tells_images_from_plain_rootfs_sources") else {
        return;
    };
    let d = ts.dir.path();
    let rootfs = d.join("rootfs");
    std::fs::create_dir_all(rootfs.join("etc")).expect("mkdir");
    std::fs::write(rootfs.join("etc/hostname"), "x").expect("write");
    assert!(!sniff_oci(&rootfs));
    let plain = d.join("rootfs.tar");
    write_tar(&plain, &[("etc/hostname".into(), b"x".to_vec())]);
    assert!(!sniff_oci(&plain));
    // A rootfs that happens to ship a manifest.json of another kind.
    let other = d.join("other.tar");
    write_tar(
        &other,
        &[("manifest.json".into(), br#"{"name":"app"}"#.to_vec())],
    );
    assert!(!sniff_oci(&other));
    let gz = d.join("rootfs.tar.gz");
    std::fs::write(&gz, gzip(&std::fs::read(&plain).expect("read"))).expect("write");
    assert!(!sniff_oci(&gz));
    let e = ts
        .store
        .import_oci("gz", &gz, false, &|_| {})
        .expect_err("gzip archive imported");
    assert!(e.to_string().contains("decompress"), "{e}");
    assert!(!sniff_oci(&d.join("missing.tar")));
}

#[test]
fn bad_images_fail_cleanly() {
    let Some(ts) = store("bad_images_fail_cleanly") else {
        return;
    };
    let s = &ts.store;
    let d = ts.dir.path();
    let spec = sample_layers();
    let layers = build_layers(&spec);
    let diff_ids: Vec<String> = layers.plain.iter().map(|t| sha256_hex(t)).collect();
    let config = sample_config(&diff_ids);
    let good = docker_members(&layers, &config);
    // A good import first: failures must not touch its ref or blobs.
    let good_tar = d.join("good.tar");
    write_tar(&good_tar, &good);
    s.import_oci("good", &good_tar, false, &|_| {})
        .expect("good import");
    let refs_before = s.list().expect("list");
    let blobs_before = blobs(s);

    let set_manifest_layers = |members: &mut Vec<(String, Vec<u8>)>, f: &dyn Fn(&mut Value)| {
        let mut m: Value = serde_json::from_slice(&members[0].1).expect("manifest");
        f(&mut m);
        members[0].1 = serde_json::to_vec(&m).expect("json");
    };
    type Check = fn(&ImageError) -> bool;
    let mut cases: Vec<(&str, PathBuf, Check)> = Vec::new();

    // Layer 2's diff_id does not match its content.
    let mut wrong_ids = diff_ids.clone();
    wrong_ids[1] = sha256_hex(b"something else");
    let p = d.join("diffid.tar");
    write_tar(&p, &docker_members(&layers, &sample_config(&wrong_ids)));
    cases.push((
        "diff_id mismatch",
        p,
        |e| matches!(e, ImageError::DigestMismatch { what, .. } if what.contains("layer 2")),
    ));

    // Manifest paths leaving the archive.
    for (i, bad) in ["../../etc/passwd", "/etc/passwd"].iter().enumerate() {
        let mut m = good.clone();
        set_manifest_layers(&mut m, &|v| v[0]["Layers"][0] = json!(bad));
        let p = d.join(format!("dotdot-{i}.tar"));
        write_tar(&p, &m);
        cases.push(("unsafe manifest path", p, |e| {
            matches!(e, ImageError::InvalidImage { message, .. } if message.contains("unsafe path"))
        }));
    }

    // A layer entry escaping the root (with a correct diff_id).
    let mut evil_layers = build_layers(&spec);
    let evil = {
        let mut b = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_ustar();
        let name = b"../escaped";
        h.as_old_mut().name[..name.len()].copy_from_slice(name);
        h.set_size(3);
        h.set_mode(0o644);
        h.set_entry_type(tar::EntryType::Regular);
        h.set_cksum();
        b.append(&h, &b"bad"[..]).expect("append");
        b.into_inner().expect("finish")
    };
    evil_layers.plain[2] = evil.clone();
    evil_layers.stored[2] = evil;
    let evil_ids: Vec<String> = evil_layers.plain.iter().map(|t| sha256_hex(t)).collect();
    let p = d.join("evil.tar");
    write_tar(&p, &docker_members(&evil_layers, &sample_config(&evil_ids)));
    cases.push(("escaping layer entry", p, |e| {
        matches!(e, ImageError::UnsafeEntry { .. })
    }));

    // The manifest names a layer the archive does not have.
    let mut m = good.clone();
    set_manifest_layers(&mut m, &|v| v[0]["Layers"][2] = json!("missing/layer.tar"));
    let p = d.join("missing-layer.tar");
    write_tar(&p, &m);
    cases.push(("missing layer", p, |e| {
        matches!(e, ImageError::InvalidImage { message, .. } if message.contains("missing/layer.tar not found"))
    }));

    // Two images in one archive.
    let mut m = good.clone();
    set_manifest_layers(&mut m, &|v| {
        let first = v[0].clone();
        v.as_array_mut().expect("array").push(first);
    });
    let p = d.join("two.tar");
    write_tar(&p, &m);
    cases.push((
        "two images",
        p,
        |e| matches!(e, ImageError::InvalidImage { message, .. } if message.contains("2 images")),
    ));

    // Truncated in the middle of the first layer.
    let bytes = std::fs::read(&good_tar).expect("read");
    let p = d.join("truncated.tar");
    std::fs::write(&p, &bytes[..bytes.len() / 2]).expect("write");
    cases.push((
        "truncated archive",
        p,
        |e| matches!(e, ImageError::Archive { message, .. } if message.contains("truncated")),
    ));

    // OCI: a blob whose content does not match its digest.
    let oci_types = [
        "application/vnd.oci.image.layer.v1.tar",
        "application/vnd.oci.image.layer.v1.tar+gzip",
        "application/vnd.oci.image.layer.v1.tar+gzip",
    ];
    let oci = oci_members(&layers, &config, &oci_types);
    let layer1 = format!("blobs/sha256/{}", sha256_hex(&layers.plain[0]));
    let mut tampered = oci.clone();
    for (name, data) in tampered.iter_mut() {
        if *name == layer1 {
            // Same size, same valid tar structure, one byte of file content changed.
            let at = data
                .windows(6)
                .position(|w| w == b"root:x")
                .expect("passwd content");
            data[at + 5] = b'y';
        }
    }
    let p = d.join("tampered");
    write_dir(&p, &tampered);
    cases.push(("oci blob mismatch", p, |e| {
        matches!(e, ImageError::DigestMismatch { what, .. } if what.contains("layer 1") && what.contains("blob"))
    }));

    // A decompression bomb as layer 2.
    let mut bomb_layers = build_layers(&spec);
    bomb_layers.stored[1] = gzip_bomb();
    let p = d.join("bomb.tar");
    write_tar(&p, &docker_members(&bomb_layers, &config));
    cases.push((
        "gzip bomb layer",
        p,
        |e| matches!(e, ImageError::Archive { message, .. } if message.contains("decompression bomb")),
    ));

    // Neither format.
    let p = d.join("plain.tar");
    write_tar(&p, &[("etc/hostname".into(), b"x".to_vec())]);
    cases.push((
        "not an image",
        p,
        |e| matches!(e, ImageError::InvalidImage { message, .. } if message.contains("neither")),
    ));

    for (what, path, check) in &cases {
        for flatten in [false, true] {
            let e = s.import_oci("bad", path, flatten, &|_| {}).expect_err(what);
            assert!(
                check(&e),
                "{what} (flatten={flatten}): unexpected error: {e:?}"
            );
            assert!(!e.to_string().is_empty());
            eprintln!("{what}: {e}");
            assert_eq!(s.list().expect("list"), refs_before, "{what}: refs changed");
            assert_eq!(blobs(s), blobs_before, "{what}: blobs changed");
            assert!(
                tmp_entries(s).is_empty(),
                "{what}: temp files left: {:?}",
                tmp_entries(s)
            );
        }
    }
    assert!(!s.root().join("tmp/escaped").exists());
    // The good image is intact.
    let img = s.resolve("good").expect("resolve");
    assert_eq!(img.layers.len(), 3);
}

#[test]
fn compressed_archives_and_zstd_layers() {
    let Some(ts) = store("compressed_archives_and_zstd_layers") else {
        return;
    };
    let s = &ts.store;
    let d = ts.dir.path();
    let spec = sample_layers();
    let layers = build_layers(&spec);
    let diff_ids: Vec<String> = layers.plain.iter().map(|t| sha256_hex(t)).collect();
    let config = sample_config(&diff_ids);
    let want = expected(&spec);

    // `docker save`, then `| gzip` and `| zstd`: the same image three times.
    let plain = d.join("image.tar");
    write_tar(&plain, &docker_members(&layers, &config));
    let bytes = std::fs::read(&plain).expect("read");
    let gz = d.join("image.tar.gz");
    std::fs::write(&gz, gzip(&bytes)).expect("write");
    let zst = d.join("image.tar.zst");
    std::fs::write(&zst, zstd(&bytes)).expect("write");
    let a = s
        .import_path("plain", &plain, false, &|_| {})
        .expect("plain");
    let b = s
        .import_path("gz", &gz, false, &|_| {})
        .expect("gzip archive");
    let c = s
        .import_path("zst", &zst, false, &|_| {})
        .expect("zstd archive");
    assert_eq!(a.layers.len(), 3);
    assert_eq!(a.layers, b.layers);
    assert_eq!(a.layers, c.layers);
    assert_eq!(c.config, sample_image_config());
    assert!(c.source.ends_with("image.tar.zst"), "{}", c.source);
    let ov = Overlay::mount(s, &c.layers, &d.join("merged-zst"));
    assert_tree(&snapshot(&ov.path), &want, "zstd docker archive");
    drop(ov);

    // An OCI layout whose layers are zstd (and gzip) compressed.
    let members = oci_members(
        &layers,
        &config,
        &[
            "application/vnd.oci.image.layer.v1.tar",
            "application/vnd.oci.image.layer.v1.tar+zstd",
            "application/vnd.oci.image.layer.v1.tar+gzip",
        ],
    );
    let layout = d.join("layout-zstd");
    write_dir(&layout, &members);
    check_import(&ts, "oci-zstd", &layout, &want);
    assert_eq!(s.resolve("oci-zstd").expect("resolve").layers, a.layers);

    // A root file system as .tar.zst gives the very layer its .tar gives.
    let rootfs_tar = d.join("rootfs.tar");
    std::fs::write(&rootfs_tar, layer_tar(&spec[0])).expect("write");
    let rootfs_zst = d.join("rootfs.tar.zst");
    std::fs::write(&rootfs_zst, zstd(&layers.plain[0])).expect("write");
    let r1 = s
        .import_path("rootfs", &rootfs_tar, false, &|_| {})
        .expect("tar");
    let r2 = s
        .import_path("rootfs-zst", &rootfs_zst, false, &|_| {})
        .expect("tar.zst");
    assert_eq!(r1.digest, r2.digest);

    // A decompression bomb as a root file system: refused, nothing kept.
    let refs_before = s.list().expect("list");
    let blobs_before = blobs(s);
    let bomb = d.join("bomb.tar.gz");
    std::fs::write(&bomb, gzip_bomb()).expect("write");
    let e = s
        .import_path("bomb", &bomb, false, &|_| {})
        .expect_err("bomb");
    assert!(e.to_string().contains("decompression bomb"), "{e}");
    assert_eq!(s.list().expect("list"), refs_before);
    assert_eq!(blobs(s), blobs_before);
    assert!(tmp_entries(s).is_empty(), "{:?}", tmp_entries(s));
}
