//! Image store tests with real mkfs.erofs and real file-backed EROFS mounts. They need root,
//! erofs-utils and kernel EROFS support. With `CI=true` a missing prerequisite is a failure;
//! otherwise the test prints why and returns.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::CString;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use dsec_image::{mountinfo, ImageError, ImageStore, ImportPhase, ImportProgress};

fn prerequisite_missing() -> Option<String> {
    if !nix::unistd::geteuid().is_root() {
        return Some("not running as root".into());
    }
    let fs = std::fs::read_to_string("/proc/filesystems").unwrap_or_default();
    if !fs
        .lines()
        .any(|l| l.split_whitespace().last() == Some("erofs"))
    {
        return Some("kernel has no erofs".into());
    }
    if Command::new("mkfs.erofs").arg("--help").output().is_err() {
        return Some("mkfs.erofs not installed".into());
    }
    None
}

/// A fresh store under the target tmp dir, or `None` (skip) outside CI.
fn store(test: &str) -> Option<TestStore> {
    if dsec_testkit::unavailable(test, prerequisite_missing()).is_some() {
        return None;
    }
    let dir = tempfile::Builder::new()
        .prefix("dsec-image-test-")
        .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
        .expect("tempdir");
    let store = ImageStore::open(dir.path().join("store")).expect("open store");
    Some(TestStore { store, dir })
}

/// Unmounts anything left under the store's mnt/ before the temp dir is removed.
struct TestStore {
    store: ImageStore,
    dir: tempfile::TempDir,
}

impl Drop for TestStore {
    fn drop(&mut self) {
        let mnt = self.store.root().join("mnt");
        for m in mountinfo::read().unwrap_or_default().iter().rev() {
            if m.mount_point.starts_with(&mnt) {
                let _ = nix::mount::umount2(&m.mount_point, nix::mount::MntFlags::MNT_DETACH);
            }
        }
    }
}

fn lsetxattr(p: &Path, name: &str, value: &[u8]) -> bool {
    let (Ok(cp), Ok(cn)) = (
        CString::new(p.as_os_str().as_encoded_bytes()),
        CString::new(name),
    ) else {
        return false;
    };
    // SAFETY: valid NUL-terminated strings and a valid buffer of the given length.
    unsafe {
        libc::lsetxattr(
            cp.as_ptr(),
            cn.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        ) == 0
    }
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

/// Build the sample tree: files with various modes and owners, a symlink, a hard link,
/// an empty dir, a FIFO, an xattr. Returns whether the xattr could be set.
fn sample_tree(root: &Path) -> bool {
    let w = |p: &str, data: &[u8], mode: u32| {
        let f = root.join(p);
        std::fs::write(&f, data).expect("write");
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(mode)).expect("chmod");
    };
    std::fs::create_dir_all(root.join("bin")).expect("mkdir");
    std::fs::create_dir_all(root.join("etc/deep/er")).expect("mkdir");
    std::fs::create_dir_all(root.join("empty")).expect("mkdir");
    std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o755)).expect("chmod root");
    w("bin/tool", b"#!/bin/sh\necho hi\n", 0o755);
    w("bin/suid", b"suid", 0o4755);
    w("etc/secret", b"top secret", 0o600);
    w("etc/deep/er/file.txt", &vec![b'x'; 200_000], 0o644);
    w("readme", b"hello dsec\n", 0o644);
    std::os::unix::fs::symlink("../readme", root.join("etc/link")).expect("symlink");
    std::os::unix::fs::symlink("/nonexistent/abs", root.join("dangling")).expect("symlink");
    std::fs::hard_link(root.join("readme"), root.join("etc/readme.hard")).expect("hardlink");
    nix::unistd::mkfifo(
        &root.join("fifo"),
        nix::sys::stat::Mode::from_bits_truncate(0o640),
    )
    .expect("mkfifo");
    std::fs::set_permissions(root.join("empty"), std::fs::Permissions::from_mode(0o1777))
        .expect("chmod");
    std::os::unix::fs::lchown(root.join("etc/secret"), Some(1234), Some(5678)).expect("chown");
    // chown clears setuid; set it again.
    std::fs::set_permissions(
        root.join("bin/suid"),
        std::fs::Permissions::from_mode(0o4755),
    )
    .expect("chmod");
    lsetxattr(&root.join("readme"), "user.dsec", b"v1")
}

/// Everything we compare about one tree entry.
#[derive(Debug, PartialEq, Eq)]
struct Node {
    kind: &'static str,
    mode: u32,
    uid: u32,
    gid: u32,
    mtime: i64,
    content: Option<Vec<u8>>,
    link: Option<PathBuf>,
    /// For files with nlink > 1: the first path (sorted) of the same inode.
    hardlink_of: Option<String>,
}

fn snapshot(root: &Path) -> BTreeMap<String, Node> {
    let mut out = BTreeMap::new();
    let mut inodes: HashMap<u64, String> = HashMap::new();
    let mut stack = vec![PathBuf::new()];
    let mut all = Vec::new();
    while let Some(rel) = stack.pop() {
        let p = root.join(&rel);
        let md = std::fs::symlink_metadata(&p).expect("lstat");
        all.push((rel.clone(), md.clone()));
        if md.is_dir() {
            for e in std::fs::read_dir(&p).expect("read_dir") {
                stack.push(rel.join(e.expect("entry").file_name()));
            }
        }
    }
    all.sort_by(|a, b| a.0.cmp(&b.0));
    for (rel, md) in all {
        let p = root.join(&rel);
        let ft = md.file_type();
        let kind = if ft.is_dir() {
            "dir"
        } else if ft.is_symlink() {
            "symlink"
        } else if ft.is_file() {
            "file"
        } else {
            "other"
        };
        let key = format!("/{}", rel.display());
        let hardlink_of = if ft.is_file() && md.nlink() > 1 {
            Some(
                inodes
                    .entry(md.ino())
                    .or_insert_with(|| key.clone())
                    .clone(),
            )
        } else {
            None
        };
        out.insert(
            key,
            Node {
                kind,
                mode: md.mode(),
                uid: md.uid(),
                gid: md.gid(),
                mtime: md.mtime(),
                content: if ft.is_file() {
                    Some(std::fs::read(&p).expect("read"))
                } else {
                    None
                },
                link: if ft.is_symlink() {
                    Some(std::fs::read_link(&p).expect("readlink"))
                } else {
                    None
                },
                hardlink_of,
            },
        );
    }
    out
}

fn assert_same_tree(a: &Path, b: &Path) {
    let sa = snapshot(a);
    let sb = snapshot(b);
    assert_eq!(
        sa.keys().collect::<Vec<_>>(),
        sb.keys().collect::<Vec<_>>(),
        "entries differ"
    );
    for (k, na) in &sa {
        assert_eq!(
            Some(na),
            sb.get(k),
            "{k} differs between {} and {}",
            a.display(),
            b.display()
        );
    }
}

fn tmp_entries(store: &ImageStore) -> Vec<PathBuf> {
    std::fs::read_dir(store.root().join("tmp"))
        .expect("tmp")
        .map(|e| e.expect("entry").path())
        .collect()
}

fn blobs(store: &ImageStore) -> Vec<PathBuf> {
    std::fs::read_dir(store.root().join("blobs/sha256"))
        .expect("blobs")
        .map(|e| e.expect("entry").path())
        .collect()
}

fn mounts_at(p: &Path) -> Vec<mountinfo::MountEntry> {
    mountinfo::read()
        .expect("mountinfo")
        .into_iter()
        .filter(|m| m.mount_point == p)
        .collect()
}

fn make_tgz(src: &Path, out: &Path) {
    let st = Command::new("tar")
        .args(["--xattrs", "--xattrs-include=user.*", "-C"])
        .arg(src)
        .arg("-czf")
        .arg(out)
        .arg(".")
        .status()
        .expect("tar");
    assert!(st.success());
}

#[test]
fn dir_and_targz_import_mount_identically() {
    let Some(ts) = store("dir_and_targz_import_mount_identically") else {
        return;
    };
    let s = &ts.store;
    let src = ts.dir.path().join("src");
    std::fs::create_dir(&src).expect("mkdir");
    let has_xattr = sample_tree(&src);
    let tgz = ts.dir.path().join("sample.tar.gz");
    make_tgz(&src, &tgz);

    let phases = Mutex::new(Vec::<ImportPhase>::new());
    let record = |p: ImportProgress| {
        let mut v = phases.lock().expect("lock");
        if v.last() != Some(&p.phase) {
            v.push(p.phase);
        }
    };
    let from_dir = s.import("sample/dir", &src, &record).expect("import dir");
    assert_eq!(
        *phases.lock().expect("lock"),
        vec![
            ImportPhase::Building,
            ImportPhase::Hashing,
            ImportPhase::Storing
        ]
    );
    phases.lock().expect("lock").clear();
    let from_tgz = s.import("sample:tgz", &tgz, &record).expect("import tgz");
    assert_eq!(
        phases.lock().expect("lock").first(),
        Some(&ImportPhase::Extracting)
    );
    assert!(from_dir.digest.starts_with("sha256:"));
    assert!(from_dir.size_bytes > 0);
    assert_eq!(
        from_tgz.source,
        std::fs::canonicalize(&tgz)
            .expect("canon")
            .display()
            .to_string()
    );

    let blob = s.resolve("sample/dir").expect("resolve").blob_path;
    assert_eq!(
        std::fs::metadata(&blob).expect("blob").permissions().mode() & 0o777,
        0o444
    );

    let m1 = s.acquire(&from_dir.digest).expect("acquire dir image");
    let m2 = s.acquire(&from_tgz.digest).expect("acquire tgz image");
    assert_same_tree(&src, &m1);
    assert_same_tree(&src, &m2);
    if has_xattr {
        assert_eq!(
            lgetxattr(&m1.join("readme"), "user.dsec").as_deref(),
            Some(&b"v1"[..])
        );
        assert_eq!(
            lgetxattr(&m2.join("readme"), "user.dsec").as_deref(),
            Some(&b"v1"[..])
        );
    }
    s.release(&from_dir.digest).expect("release");
    s.release(&from_tgz.digest).expect("release");
    assert!(tmp_entries(s).is_empty(), "{:?}", tmp_entries(s));
}

#[test]
fn same_content_dedups_to_one_blob() {
    let Some(ts) = store("same_content_dedups_to_one_blob") else {
        return;
    };
    let s = &ts.store;
    let src = ts.dir.path().join("src");
    std::fs::create_dir(&src).expect("mkdir");
    sample_tree(&src);
    let a = s.import("a", &src, &|_| {}).expect("import a");
    let b = s.import("b", &src, &|_| {}).expect("import b");
    assert_eq!(a.digest, b.digest);
    assert_eq!(blobs(s).len(), 1);

    // Archives: extraction happens at different times, the digest must not change.
    let tgz = ts.dir.path().join("x.tgz");
    make_tgz(&src, &tgz);
    let c = s.import("c", &tgz, &|_| {}).expect("import c");
    let d = s.import("d", &tgz, &|_| {}).expect("import d");
    assert_eq!(c.digest, d.digest);
    assert!(blobs(s).len() <= 2);

    let names: Vec<String> = s
        .list()
        .expect("list")
        .into_iter()
        .map(|i| i.name)
        .collect();
    assert_eq!(names, vec!["a", "b", "c", "d"]);
    let r = s.resolve(&a.digest).expect("resolve by digest");
    assert_eq!(r.name, "a");
    assert_eq!(r.digest, a.digest);
    assert_eq!(s.image_info("b").expect("info").digest, a.digest);
    assert!(matches!(s.resolve("nope"), Err(ImageError::NotFound(_))));
    assert!(matches!(
        s.resolve(&format!("sha256:{}", "0".repeat(64))),
        Err(ImageError::NotFound(_))
    ));
}

#[test]
fn shared_mount_is_refcounted_and_file_backed() {
    let Some(ts) = store("shared_mount_is_refcounted_and_file_backed") else {
        return;
    };
    let s = &ts.store;
    let src = ts.dir.path().join("src");
    std::fs::create_dir(&src).expect("mkdir");
    sample_tree(&src);
    let img = s.import("base", &src, &|_| {}).expect("import");
    let blob = s.resolve("base").expect("resolve").blob_path;

    let m1 = s.acquire(&img.digest).expect("acquire 1");
    let m2 = s
        .acquire(img.digest.trim_start_matches("sha256:"))
        .expect("acquire 2");
    assert_eq!(m1, m2);
    let ms = mounts_at(&m1);
    assert_eq!(ms.len(), 1, "{ms:?}");
    assert_eq!(ms[0].fs_type, "erofs");
    assert_eq!(
        Path::new(&ms[0].source),
        blob.as_path(),
        "not file-backed: {}",
        ms[0].source
    );
    assert!(!ms[0].source.starts_with("/dev/loop"));
    for opt in ["ro", "nosuid", "nodev"] {
        assert!(
            ms[0].mount_options.split(',').any(|o| o == opt),
            "{opt} missing: {}",
            ms[0].mount_options
        );
    }
    assert_eq!(s.refcount(&img.digest).expect("refcount"), 2);
    assert!(dsec_image::is_mounted(&m1).expect("is_mounted"));

    s.release(&img.digest).expect("release 1");
    assert_eq!(mounts_at(&m1).len(), 1, "unmounted too early");
    s.release(&img.digest).expect("release 2");
    // The last release keeps the layer mounted as an idle cache...
    assert_eq!(mounts_at(&m1).len(), 1, "idle layer unmounted too early");
    assert_eq!(s.refcount(&img.digest).expect("refcount"), 0);
    assert!(matches!(
        s.release(&img.digest),
        Err(ImageError::NotAcquired(_))
    ));
    // ...that the next acquire reuses without mounting again...
    assert_eq!(s.acquire(&img.digest).expect("reacquire"), m1);
    assert_eq!(mounts_at(&m1).len(), 1, "reacquire mounted a second time");
    // ...and that unmount_idle drops only when nobody uses it.
    assert!(s.unmount_idle().expect("unmount_idle").is_empty());
    assert_eq!(mounts_at(&m1).len(), 1);
    s.release(&img.digest).expect("release 3");
    assert_eq!(
        s.unmount_idle().expect("unmount_idle"),
        vec![img.digest.clone()]
    );
    assert!(
        mounts_at(&m1).is_empty(),
        "still mounted after unmount_idle"
    );
    assert!(!dsec_image::is_mounted(&m1).expect("is_mounted"));

    // Re-adoption after a "restart": a second store instance finds the existing mount.
    let m = s.acquire(&img.digest).expect("acquire");
    let s2 = ImageStore::open(s.root()).expect("reopen");
    s2.set_refcount(&img.digest, 1).expect("adopt");
    assert_eq!(mounts_at(&m).len(), 1, "adoption mounted a second time");
    // A third instance cleans it up when nothing uses it; kept when in use.
    let s3 = ImageStore::open(s.root()).expect("reopen");
    let keep: HashSet<String> = [img.digest.clone()].into();
    assert!(s3.cleanup_unused(&keep).expect("cleanup").is_empty());
    assert_eq!(mounts_at(&m).len(), 1);
    assert_eq!(
        s3.cleanup_unused(&HashSet::new()).expect("cleanup"),
        vec![img.digest.clone()]
    );
    assert!(mounts_at(&m).is_empty());
    assert!(!m.exists());
}

#[test]
fn failed_imports_leave_no_temp_files() {
    let Some(ts) = store("failed_imports_leave_no_temp_files") else {
        return;
    };
    let s = &ts.store;
    let d = ts.dir.path();

    let garbage = d.join("bad.tar");
    std::fs::write(&garbage, vec![0x5au8; 10_000]).expect("write");
    let e = s
        .import("bad", &garbage, &|_| {})
        .expect_err("garbage tar imported");
    assert!(matches!(e, ImageError::Archive { .. }), "{e}");

    // Valid gzip header, then truncated.
    let src = d.join("src");
    std::fs::create_dir(&src).expect("mkdir");
    sample_tree(&src);
    let tgz = d.join("ok.tgz");
    make_tgz(&src, &tgz);
    let bytes = std::fs::read(&tgz).expect("read");
    let trunc = d.join("trunc.tar.gz");
    std::fs::write(&trunc, &bytes[..bytes.len() / 2]).expect("write");
    let e = s
        .import("trunc", &trunc, &|_| {})
        .expect_err("truncated tgz imported");
    assert!(matches!(e, ImageError::Archive { .. }), "{e}");

    // An entry escaping the root.
    let evil = d.join("evil.tar");
    {
        let mut b = tar::Builder::new(std::fs::File::create(&evil).expect("create"));
        let mut h = tar::Header::new_ustar();
        let name = b"../escaped";
        h.as_old_mut().name[..name.len()].copy_from_slice(name);
        h.set_size(3);
        h.set_mode(0o644);
        h.set_entry_type(tar::EntryType::Regular);
        h.set_cksum();
        b.append(&h, &b"bad"[..]).expect("append");
        b.finish().expect("finish");
    }
    let e = s
        .import("evil", &evil, &|_| {})
        .expect_err("escaping tar imported");
    assert!(matches!(e, ImageError::UnsafeEntry { .. }), "{e}");
    assert!(!s.root().join("tmp/escaped").exists());

    // Not an archive at all.
    let txt = d.join("notes.txt");
    std::fs::write(&txt, "hello").expect("write");
    assert!(matches!(
        s.import("txt", &txt, &|_| {}),
        Err(ImageError::UnsupportedSource(_))
    ));
    assert!(matches!(
        s.import("missing", &d.join("nope.tar"), &|_| {}),
        Err(ImageError::Io { .. })
    ));
    assert!(matches!(
        s.import_blob("blob", &txt),
        Err(ImageError::NotErofs(_))
    ));

    assert!(
        tmp_entries(s).is_empty(),
        "temp files left: {:?}",
        tmp_entries(s)
    );
    assert!(blobs(s).is_empty());
    assert!(s.list().expect("list").is_empty());
}

#[test]
fn remove_keeps_shared_and_mounted_blobs() {
    let Some(ts) = store("remove_keeps_shared_and_mounted_blobs") else {
        return;
    };
    let s = &ts.store;
    let src = ts.dir.path().join("src");
    std::fs::create_dir(&src).expect("mkdir");
    sample_tree(&src);
    let a = s.import("a", &src, &|_| {}).expect("import");
    s.import("b", &src, &|_| {}).expect("import");
    let blob = s.resolve("a").expect("resolve").blob_path;

    let r = s.remove("a").expect("remove a");
    assert_eq!(r.image.name, "a");
    assert!(!r.blob_deleted, "blob deleted although b refers to it");
    assert!(blob.exists());
    assert!(matches!(s.remove("a"), Err(ImageError::NotFound(_))));

    s.acquire(&a.digest).expect("acquire");
    let r = s.remove("b").expect("remove b");
    assert!(!r.blob_deleted, "blob deleted while mounted");
    assert!(blob.exists());
    s.release(&a.digest).expect("release");

    // Re-import as a blob file, then remove: the blob goes.
    let copy = ts.dir.path().join("layer.erofs");
    std::fs::copy(&blob, &copy).expect("copy");
    let c = s.import_blob("c", &copy).expect("import_blob");
    assert_eq!(c.digest, a.digest);
    let r = s.remove("c").expect("remove c");
    assert!(r.blob_deleted);
    assert!(!blob.exists());
    assert!(s.list().expect("list").is_empty());

    // Replacing a ref drops the unreferenced old blob.
    let x = s.import("x", &src, &|_| {}).expect("import");
    std::fs::write(src.join("readme"), "changed").expect("write");
    let x2 = s.import("x", &src, &|_| {}).expect("reimport");
    assert_ne!(x.digest, x2.digest);
    assert_eq!(blobs(s).len(), 1);
    assert_eq!(s.resolve("x").expect("resolve").digest, x2.digest);
}

#[test]
fn name_validation() {
    let Some(ts) = store("name_validation") else {
        return;
    };
    let s = &ts.store;
    let src = ts.dir.path().join("src");
    std::fs::create_dir(&src).expect("mkdir");
    for bad in [
        "",
        "Upper",
        "-dash",
        "has space",
        "sha256:abc",
        "x@y",
        &"a".repeat(129),
    ] {
        let e = s.import(bad, &src, &|_| {}).expect_err("bad name accepted");
        assert!(matches!(e, ImageError::InvalidName { .. }), "{bad:?}: {e}");
        assert!(e.to_string().contains("invalid image name"), "{e}");
    }
    assert!(s.import("debian:bookworm", &src, &|_| {}).is_ok());
    assert!(s
        .import("registry.local/team/py-3.11_x", &src, &|_| {})
        .is_ok());
    assert!(tmp_entries(s).is_empty());
}

#[test]
fn tar_root_entry_devices_and_fifos() {
    let Some(ts) = store("tar_root_entry_devices_and_fifos") else {
        return;
    };
    let s = &ts.store;
    let tarp = ts.dir.path().join("special.tar");
    {
        let mut b = tar::Builder::new(std::fs::File::create(&tarp).expect("create"));
        let mut add =
            |path: &str, kind: tar::EntryType, mode: u32, data: &[u8], dev: Option<(u32, u32)>| {
                let mut h = tar::Header::new_gnu();
                h.set_path(path).expect("path");
                h.set_entry_type(kind);
                h.set_mode(mode);
                h.set_uid(0);
                h.set_gid(0);
                h.set_mtime(1_600_000_000);
                h.set_size(data.len() as u64);
                if let Some((ma, mi)) = dev {
                    h.set_device_major(ma).expect("major");
                    h.set_device_minor(mi).expect("minor");
                }
                h.set_cksum();
                b.append(&h, data).expect("append");
            };
        add("./", tar::EntryType::Directory, 0o700, b"", None);
        add("./dev/", tar::EntryType::Directory, 0o755, b"", None);
        add("./dev/null", tar::EntryType::Char, 0o666, b"", Some((1, 3)));
        add("./dev/sda", tar::EntryType::Block, 0o660, b"", Some((8, 0)));
        add("./run/pipe", tar::EntryType::Fifo, 0o620, b"", None);
        // Listed after its child: its own mode and mtime must win over the implicit default.
        add("./run/", tar::EntryType::Directory, 0o711, b"", None);
        add(
            "./etc/hostname",
            tar::EntryType::Regular,
            0o644,
            b"dsec\n",
            None,
        );
        b.finish().expect("finish");
    }
    let img = s.import("special", &tarp, &|_| {}).expect("import");
    let again = s.import("special2", &tarp, &|_| {}).expect("import again");
    assert_eq!(img.digest, again.digest);
    let m = s.acquire(&img.digest).expect("acquire");
    let root_md = std::fs::metadata(&m).expect("root");
    assert_eq!(root_md.permissions().mode() & 0o7777, 0o700);
    assert_eq!(root_md.mtime(), 1_600_000_000);
    assert!(m.join("dev").is_dir());
    let run = std::fs::metadata(m.join("run")).expect("run");
    assert_eq!(run.permissions().mode() & 0o7777, 0o711);
    assert_eq!(run.mtime(), 1_600_000_000);
    let etc = std::fs::metadata(m.join("etc")).expect("etc");
    assert_eq!(
        (etc.permissions().mode() & 0o7777, etc.mtime()),
        (0o755, 0),
        "implicit dir not pinned"
    );
    assert!(
        !m.join("dev/null").exists(),
        "device node should be skipped"
    );
    assert!(!m.join("dev/sda").exists(), "device node should be skipped");
    let fifo = std::fs::symlink_metadata(m.join("run/pipe")).expect("fifo");
    assert!(std::os::unix::fs::FileTypeExt::is_fifo(&fifo.file_type()));
    assert_eq!(fifo.permissions().mode() & 0o7777, 0o620);
    assert_eq!(
        std::fs::read_to_string(m.join("etc/hostname")).expect("read"),
        "dsec\n"
    );
    s.release(&img.digest).expect("release");
}

/// A directory store that counts whole-object downloads (the instrument, not a stand-in:
/// every call goes to the real store).
#[derive(Debug)]
struct CountingStore {
    inner: dsec_blob::DirStore,
    downloads: std::sync::atomic::AtomicUsize,
    ref_reads: std::sync::atomic::AtomicUsize,
}

impl dsec_blob::BlobStore for CountingStore {
    fn url(&self) -> String {
        self.inner.url()
    }
    fn head(&self, key: &str) -> dsec_blob::Result<Option<dsec_blob::ObjectInfo>> {
        self.inner.head(key)
    }
    fn get(&self, key: &str) -> dsec_blob::Result<Option<Vec<u8>>> {
        if key.starts_with("refs/") {
            self.ref_reads
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        self.inner.get(key)
    }
    fn get_range(&self, key: &str, range: std::ops::Range<u64>) -> dsec_blob::Result<Vec<u8>> {
        self.inner.get_range(key, range)
    }
    fn download(&self, key: &str, dest: &Path) -> dsec_blob::Result<u64> {
        self.downloads
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        // Slow enough that the other callers arrive while this one downloads.
        std::thread::sleep(std::time::Duration::from_millis(300));
        self.inner.download(key, dest)
    }
    fn put(&self, key: &str, data: &[u8]) -> dsec_blob::Result<()> {
        self.inner.put(key, data)
    }
    fn upload(&self, key: &str, src: &Path) -> dsec_blob::Result<()> {
        self.inner.upload(key, src)
    }
    fn delete(&self, key: &str) -> dsec_blob::Result<()> {
        self.inner.delete(key)
    }
    fn list(&self, prefix: &str) -> dsec_blob::Result<Vec<dsec_blob::ObjectInfo>> {
        self.inner.list(prefix)
    }
}

#[test]
fn concurrent_first_uses_of_a_shared_layer_download_it_once() {
    let Some(ts) = store("concurrent_first_uses_of_a_shared_layer_download_it_once") else {
        return;
    };
    let counting = std::sync::Arc::new(CountingStore {
        inner: dsec_blob::DirStore::open(ts.dir.path().join("shared")).expect("dir store"),
        downloads: Default::default(),
        ref_reads: Default::default(),
    });
    let opts = |shared: std::sync::Arc<CountingStore>| dsec_image::StoreOptions {
        shared: Some(shared),
        ..Default::default()
    };
    // Node A imports (and uploads); node B has nothing.
    let a = ImageStore::open_with(ts.dir.path().join("a"), opts(counting.clone())).expect("a");
    let src = ts.dir.path().join("src");
    std::fs::create_dir(&src).expect("mkdir");
    sample_tree(&src);
    let img = a.import("base", &src, &|_| {}).expect("import");
    let b = ImageStore::open_with(ts.dir.path().join("b"), opts(counting.clone())).expect("b");
    let mounts: Vec<PathBuf> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..4)
            .map(|_| s.spawn(|| b.acquire(&img.digest).expect("acquire")))
            .collect();
        hs.into_iter().map(|h| h.join().expect("join")).collect()
    });
    assert!(mounts.windows(2).all(|w| w[0] == w[1]));
    assert_eq!(
        counting.downloads.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "the layer was downloaded more than once"
    );
    assert_eq!(b.refcount(&img.digest).expect("refcount"), 4);
    for _ in 0..4 {
        b.release(&img.digest).expect("release");
    }
    for m in mountinfo::read().unwrap_or_default().iter().rev() {
        if m.mount_point.starts_with(ts.dir.path()) {
            let _ = nix::mount::umount2(&m.mount_point, nix::mount::MntFlags::MNT_DETACH);
        }
    }
}

#[test]
fn shared_refs_are_reused_for_their_ttl_and_own_changes_show_at_once() {
    use std::sync::atomic::Ordering::SeqCst;
    let Some(ts) = store("shared_refs_are_reused_for_their_ttl_and_own_changes_show_at_once")
    else {
        return;
    };
    let counting = std::sync::Arc::new(CountingStore {
        inner: dsec_blob::DirStore::open(ts.dir.path().join("shared")).expect("dir store"),
        downloads: Default::default(),
        ref_reads: Default::default(),
    });
    let ttl = std::time::Duration::from_millis(400);
    let a = ImageStore::open_with(
        ts.dir.path().join("a"),
        dsec_image::StoreOptions {
            shared: Some(counting.clone()),
            ..Default::default()
        },
    )
    .expect("a");
    let b = ImageStore::open_with(
        ts.dir.path().join("b"),
        dsec_image::StoreOptions {
            shared: Some(counting.clone()),
            ref_ttl: ttl,
            ..Default::default()
        },
    )
    .expect("b");
    let (one, two) = (ts.dir.path().join("one"), ts.dir.path().join("two"));
    for (d, text) in [(&one, "one"), (&two, "two")] {
        std::fs::create_dir(d).expect("mkdir");
        std::fs::write(d.join("f"), text).expect("write");
    }
    let first = a.import("app", &one, &|_| {}).expect("import one");

    // B reads the ref once for many resolves within the TTL.
    let before = counting.ref_reads.load(SeqCst);
    for _ in 0..5 {
        assert_eq!(b.resolve("app").expect("resolve").digest, first.digest);
    }
    assert_eq!(counting.ref_reads.load(SeqCst) - before, 1);

    // A re-points the name: B sees it once its copy is older than the TTL.
    let second = a.import("app", &two, &|_| {}).expect("import two");
    assert_ne!(first.digest, second.digest);
    std::thread::sleep(ttl + std::time::Duration::from_millis(100));
    assert_eq!(b.resolve("app").expect("resolve").digest, second.digest);

    // B's own removal shows on B at once, cache or not.
    assert_eq!(b.resolve("app").expect("resolve").digest, second.digest);
    b.remove("app").expect("remove on b");
    assert!(matches!(b.resolve("app"), Err(ImageError::NotFound(_))));
}
