//! File operations, path confinement and tar transfers.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::Read;

use common::*;
use dsec_wire::agent::{FileKind, Reply};
use dsec_wire::frame::Frame;
use dsec_wire::ErrorCode;
use serde_json::json;
use sha2::{Digest, Sha256};

fn err_code(r: Reply) -> ErrorCode {
    match r {
        Reply::Error(e) => e.code,
        other => panic!("expected error, got {other:?}"),
    }
}

/// FileRead: (metadata reply or error, data).
fn read_file(a: &TestAgent, path: &str, extra: serde_json::Value) -> (Reply, Vec<u8>) {
    let mut v = json!({"op":"file_read","path":path});
    if let serde_json::Value::Object(m) = extra {
        for (k, x) in m {
            v[k] = x;
        }
    }
    let mut c = a.connect(&req(v));
    let first = c.next_reply();
    let mut data = Vec::new();
    if matches!(first, Reply::File(_)) {
        loop {
            match c.next().expect("frame") {
                Frame::Data(d) => data.extend_from_slice(&d),
                Frame::Eof => break,
                other => panic!("{other:?}"),
            }
        }
    }
    (first, data)
}

fn write_file(a: &TestAgent, v: serde_json::Value, data: &[u8]) -> Reply {
    let frames = a.call(&req(v), Some(data));
    json(&frames[0])
}

#[test]
fn write_read_round_trip_64mib() {
    let a = TestAgent::start();
    let size = 64 * 1024 * 1024;
    let mut data = vec![0u8; size];
    let mut x: u32 = 12345;
    for b in data.iter_mut() {
        x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
        *b = (x >> 16) as u8;
    }
    let want = Sha256::digest(&data);
    let r = write_file(
        &a,
        json!({"op":"file_write","path":"/big/file.bin","create_parents":true}),
        &data,
    );
    assert_eq!(r, Reply::Written { bytes: size as u64 });
    let on_disk = std::fs::read(a.root().join("big/file.bin")).unwrap();
    assert_eq!(Sha256::digest(&on_disk), want);
    drop(on_disk);

    let (info, back) = read_file(&a, "/big/file.bin", json!({}));
    match info {
        Reply::File(i) => {
            assert_eq!(i.size, size as u64);
            assert_eq!(i.kind, FileKind::File);
            assert_eq!(i.mode, 0o644);
            assert_eq!(i.path, "/big/file.bin");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(Sha256::digest(&back), want);

    let (_, part) = read_file(&a, "big/file.bin", json!({"offset":1000,"length":5000}));
    assert_eq!(part, &data[1000..6000]);
}

#[test]
fn write_is_atomic_and_modes() {
    let a = TestAgent::start();
    let r = write_file(
        &a,
        json!({"op":"file_write","path":"/f.txt","mode":0o600}),
        b"old",
    );
    assert_eq!(r, Reply::Written { bytes: 3 });
    let meta = std::fs::metadata(a.root().join("f.txt")).unwrap();
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o777,
        0o600
    );

    // An upload cut off before Eof leaves the old file and no temp file.
    let mut c = a.connect(&req(json!({"op":"file_write","path":"/f.txt"})));
    c.send(&Frame::Data(b"new partial".to_vec()));
    drop(c);
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert_eq!(std::fs::read(a.root().join("f.txt")).unwrap(), b"old");
    let names: Vec<_> = std::fs::read_dir(a.root())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names.len(), 1, "{names:?}");

    // Missing parent without create_parents.
    let r = write_file(&a, json!({"op":"file_write","path":"/no/such/f"}), b"x");
    assert_eq!(err_code(r), ErrorCode::NotFound);
    // Writing onto a directory.
    std::fs::create_dir(a.root().join("d")).unwrap();
    let r = write_file(&a, json!({"op":"file_write","path":"/d"}), b"x");
    assert_eq!(err_code(r), ErrorCode::BadRequest);
}

#[test]
fn list_stat_mkdir_remove_rename() {
    let a = TestAgent::start();
    assert_eq!(
        a.reply(&req(json!({"op":"file_mkdir","path":"/a/b/c"}))),
        Reply::Ok
    );
    assert_eq!(
        a.reply(&req(json!({"op":"file_mkdir","path":"/a/b/c"}))),
        Reply::Ok
    );
    write_file(&a, json!({"op":"file_write","path":"/a/z.txt"}), b"zz");
    write_file(&a, json!({"op":"file_write","path":"/a/m.txt"}), b"m");
    std::os::unix::fs::symlink("z.txt", a.root().join("a/link")).unwrap();
    match a.reply(&req(json!({"op":"file_list","path":"/a"}))) {
        Reply::Entries { entries } => {
            let names: Vec<_> = entries.iter().map(|e| e.name.as_str()).collect();
            assert_eq!(names, vec!["b", "link", "m.txt", "z.txt"]);
            assert_eq!(entries[0].kind, FileKind::Dir);
            assert_eq!(entries[1].kind, FileKind::Symlink);
            assert_eq!(entries[1].symlink_target.as_deref(), Some("z.txt"));
            assert_eq!(entries[3].size, 2);
            assert_eq!(entries[3].path, "/a/z.txt");
        }
        other => panic!("{other:?}"),
    }
    match a.reply(&req(json!({"op":"file_stat","path":"/a/link"}))) {
        Reply::File(i) => assert_eq!(i.kind, FileKind::Symlink),
        other => panic!("{other:?}"),
    }
    match a.reply(&req(json!({"op":"file_stat","path":"/"}))) {
        Reply::File(i) => assert_eq!(i.kind, FileKind::Dir),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        err_code(a.reply(&req(json!({"op":"file_stat","path":"/nope"})))),
        ErrorCode::NotFound
    );

    assert_eq!(
        a.reply(&req(
            json!({"op":"file_rename","from":"/a/m.txt","to":"/a/b/n.txt"})
        )),
        Reply::Ok
    );
    assert!(a.root().join("a/b/n.txt").exists());
    assert_eq!(
        err_code(a.reply(&req(json!({"op":"file_remove","path":"/a/b"})))),
        ErrorCode::Conflict
    );
    assert_eq!(
        a.reply(&req(json!({"op":"file_remove","path":"/a/link"}))),
        Reply::Ok
    );
    assert!(
        a.root().join("a/z.txt").exists(),
        "removing a link must not remove its target"
    );
    assert_eq!(
        a.reply(&req(
            json!({"op":"file_remove","path":"/a","recursive":true})
        )),
        Reply::Ok
    );
    assert!(!a.root().join("a").exists());
    assert_eq!(
        err_code(a.reply(&req(
            json!({"op":"file_remove","path":"/","recursive":true})
        ))),
        ErrorCode::InvalidPath
    );
    assert_eq!(
        err_code(a.reply(&req(json!({"op":"file_remove","path":"/.."})))),
        ErrorCode::InvalidPath
    );
}

#[test]
fn symlink_escapes_stay_inside_root() {
    let a = TestAgent::start();
    let root = a.root();
    std::os::unix::fs::symlink("/etc", root.join("etc_link")).unwrap();
    std::os::unix::fs::symlink("../../../../..", root.join("up")).unwrap();
    std::fs::create_dir(root.join("sub")).unwrap();
    std::os::unix::fs::symlink("/etc/passwd", root.join("sub/pw")).unwrap();
    assert!(std::path::Path::new("/etc/passwd").exists());

    for p in [
        "/etc_link/passwd",
        "/up/etc/passwd",
        "../../../etc/passwd",
        "/sub/pw",
        "/up/up/etc/passwd",
    ] {
        let (r, _) = read_file(&a, p, json!({}));
        assert_eq!(
            err_code(r),
            ErrorCode::NotFound,
            "{p} must not reach the host"
        );
    }
    // With an etc/passwd inside the root, the same paths find that one.
    std::fs::create_dir(root.join("etc")).unwrap();
    std::fs::write(root.join("etc/passwd"), "sandbox").unwrap();
    for p in ["/etc_link/passwd", "/up/etc/passwd", "/sub/pw"] {
        let (_, d) = read_file(&a, p, json!({}));
        assert_eq!(d, b"sandbox", "{p}");
    }
    // Writes through links land inside the root.
    let r = write_file(
        &a,
        json!({"op":"file_write","path":"/up/tmp/dsec-escape-test"}),
        b"x",
    );
    assert!(matches!(r, Reply::Written { .. }) || matches!(r, Reply::Error(_)));
    assert!(!std::path::Path::new("/tmp/dsec-escape-test").exists());
    let r = write_file(
        &a,
        json!({"op":"file_write","path":"/etc_link/hosts-test","create_parents":true}),
        b"x",
    );
    assert!(matches!(r, Reply::Written { .. }), "{r:?}");
    assert!(root.join("etc/hosts-test").exists());
    assert!(!std::path::Path::new("/etc/hosts-test").exists());
    // Listing through a link lists the in-root directory.
    match a.reply(&req(json!({"op":"file_list","path":"/up"}))) {
        Reply::Entries { entries } => assert!(entries.iter().any(|e| e.name == "etc_link")),
        other => panic!("{other:?}"),
    }
    // mkdir through an escaping link stays inside.
    assert_eq!(
        a.reply(&req(json!({"op":"file_mkdir","path":"/up/newdir"}))),
        Reply::Ok
    );
    assert!(root.join("newdir").is_dir());
    // Magic links are refused.
    let (r, _) = read_file(&a, "/proc/self/root/etc/passwd", json!({}));
    assert!(matches!(r, Reply::Error(_)));
}

fn tar_download(a: &TestAgent, path: &str) -> Vec<u8> {
    let frames = a.call(&req(json!({"op":"tar_download","path":path})), None);
    let mut out = Vec::new();
    let n = frames.len();
    for (i, f) in frames.into_iter().enumerate() {
        match f {
            Frame::Data(d) => out.extend_from_slice(&d),
            Frame::Eof => assert_eq!(i, n - 1),
            other => panic!("{other:?}"),
        }
    }
    out
}

#[test]
fn tar_round_trip_preserves_symlinks() {
    let a = TestAgent::start();
    let root = a.root();
    std::fs::create_dir_all(root.join("src/sub/deep")).unwrap();
    std::fs::write(root.join("src/a.txt"), "alpha").unwrap();
    let big: Vec<u8> = (0..1_000_000u32).map(|i| (i * 7) as u8).collect();
    std::fs::write(root.join("src/sub/big.bin"), &big).unwrap();
    std::os::unix::fs::symlink("/etc/passwd", root.join("src/sub/abs_link")).unwrap();
    std::os::unix::fs::symlink("../a.txt", root.join("src/sub/rel_link")).unwrap();
    std::os::unix::fs::symlink("/etc", root.join("src/etc_dir_link")).unwrap();

    let archive = tar_download(&a, "/src");
    let mut names = Vec::new();
    let mut ar = tar::Archive::new(&archive[..]);
    for e in ar.entries().unwrap() {
        let mut e = e.unwrap();
        let name = e.path().unwrap().to_string_lossy().into_owned();
        if name == "etc_dir_link" {
            assert_eq!(
                e.header().entry_type(),
                tar::EntryType::Symlink,
                "links are not followed"
            );
        }
        let mut s = Vec::new();
        e.read_to_end(&mut s).unwrap();
        names.push(name);
    }
    names.sort();
    assert_eq!(
        names,
        vec![
            "a.txt",
            "etc_dir_link",
            "sub/",
            "sub/abs_link",
            "sub/big.bin",
            "sub/deep/",
            "sub/rel_link"
        ]
    );

    let r = write_file(&a, json!({"op":"tar_upload","path":"/dst/x"}), &archive);
    assert_eq!(
        r,
        Reply::Written {
            bytes: archive.len() as u64
        }
    );
    assert_eq!(std::fs::read(root.join("dst/x/sub/big.bin")).unwrap(), big);
    assert_eq!(
        std::fs::read_link(root.join("dst/x/sub/abs_link"))
            .unwrap()
            .to_str(),
        Some("/etc/passwd")
    );
    assert_eq!(
        std::fs::read_to_string(root.join("dst/x/sub/rel_link")).unwrap(),
        "alpha"
    );
    assert!(root.join("dst/x/sub/deep").is_dir());
}

fn raw_tar(entries: &[(&str, tar::EntryType, &[u8], Option<&str>)]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (name, kind, data, link) in entries {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(*kind);
        h.set_mode(0o644);
        h.set_size(data.len() as u64);
        // Write the name bytes directly so `..` and absolute names reach the agent.
        {
            let gnu = h.as_gnu_mut().unwrap();
            gnu.name[..name.len()].copy_from_slice(name.as_bytes());
            if let Some(l) = link {
                gnu.linkname[..l.len()].copy_from_slice(l.as_bytes());
            }
        }
        h.set_cksum();
        b.append(&h, *data).unwrap();
    }
    b.into_inner().unwrap()
}

#[test]
fn tar_upload_rejects_escapes() {
    let a = TestAgent::start();
    let root = a.root();
    std::fs::create_dir(root.join("dst")).unwrap();

    let evil = raw_tar(&[
        ("ok.txt", tar::EntryType::Regular, b"fine", None),
        ("../evil", tar::EntryType::Regular, b"bad", None),
    ]);
    let r = write_file(&a, json!({"op":"tar_upload","path":"/dst"}), &evil);
    assert_eq!(err_code(r), ErrorCode::InvalidPath);
    assert!(!root.join("evil").exists());

    let abs = raw_tar(&[("/abs.txt", tar::EntryType::Regular, b"bad", None)]);
    let r = write_file(&a, json!({"op":"tar_upload","path":"/dst"}), &abs);
    assert_eq!(err_code(r), ErrorCode::InvalidPath);

    // A symlink entry followed by a file "through" it must not write outside.
    let outside = tempfile::tempdir().unwrap();
    let target = outside.path().to_str().unwrap();
    let through = raw_tar(&[
        ("link", tar::EntryType::Symlink, b"", Some(target)),
        ("link/pwned", tar::EntryType::Regular, b"bad", None),
    ]);
    let r = write_file(&a, json!({"op":"tar_upload","path":"/dst"}), &through);
    assert_eq!(err_code(r), ErrorCode::InvalidPath);
    assert!(!outside.path().join("pwned").exists());

    // A pre-planted symlink in the destination is not followed either.
    std::os::unix::fs::symlink(outside.path(), root.join("dst/planted")).unwrap();
    let planted = raw_tar(&[("planted/x", tar::EntryType::Regular, b"bad", None)]);
    let r = write_file(&a, json!({"op":"tar_upload","path":"/dst"}), &planted);
    assert_eq!(err_code(r), ErrorCode::InvalidPath);
    assert!(!outside.path().join("x").exists());
    // Overwriting a planted symlink with a file replaces the link, not its target.
    std::fs::write(outside.path().join("victim"), "keep").unwrap();
    std::os::unix::fs::symlink(outside.path().join("victim"), root.join("dst/v")).unwrap();
    let over = raw_tar(&[("v", tar::EntryType::Regular, b"new", None)]);
    let r = write_file(&a, json!({"op":"tar_upload","path":"/dst"}), &over);
    assert!(matches!(r, Reply::Written { .. }), "{r:?}");
    assert_eq!(
        std::fs::read_to_string(outside.path().join("victim")).unwrap(),
        "keep"
    );
    assert_eq!(std::fs::read_to_string(root.join("dst/v")).unwrap(), "new");
}
