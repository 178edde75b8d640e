//! The behaviour every blob store must show, run against each backend by `tests/blobstore.rs`.

use std::path::Path;

use dsec_blob::{BlobError, BlobStore};

/// Exercises every call of the trait on an empty `store`; `scratch` is a private directory.
pub fn conformance(s: &dyn BlobStore, scratch: &Path) {
    assert!(s.head("a/b").expect("head").is_none());
    assert!(s.get("a/b").expect("get").is_none());
    s.put("a/b", b"hello world").expect("put");
    assert_eq!(
        s.get("a/b").expect("get").as_deref(),
        Some(&b"hello world"[..])
    );
    assert_eq!(s.head("a/b").expect("head").map(|i| i.size), Some(11));
    s.put("a/b", b"hello again").expect("replace");
    assert_eq!(
        s.get("a/b").expect("get").as_deref(),
        Some(&b"hello again"[..])
    );

    assert_eq!(s.get_range("a/b", 6..11).expect("range"), b"again");
    assert_eq!(s.get_range("a/b", 0..1).expect("range"), b"h");
    assert_eq!(
        s.get_range("a/b", 6..100).expect("range past end"),
        b"again"
    );
    let e = s.get_range("a/b", 11..12).expect_err("range at end");
    assert!(matches!(e, BlobError::BadRange { .. }), "{e}");
    let e = s.get_range("nope", 0..1).expect_err("absent");
    assert!(matches!(e, BlobError::NotFound { .. }), "{e}");

    // A file larger than one multipart part goes up and comes back byte for byte.
    let big: Vec<u8> = (0..(12u32 << 20))
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    let src = scratch.join("src");
    std::fs::write(&src, &big).expect("write src");
    s.upload("c/d/big.bin", &src).expect("upload");
    let dest = scratch.join("dest");
    assert_eq!(
        s.download("c/d/big.bin", &dest).expect("download"),
        big.len() as u64
    );
    assert!(
        std::fs::read(&dest).expect("read dest") == big,
        "download differs"
    );
    let mid = s
        .get_range("c/d/big.bin", 5_000_000..5_000_100)
        .expect("range of big");
    assert_eq!(mid, &big[5_000_000..5_000_100]);
    let e = s
        .download("missing", &scratch.join("x"))
        .expect_err("absent");
    assert!(matches!(e, BlobError::NotFound { .. }), "{e}");
    assert!(!scratch.join("x").exists(), "failed download left a file");

    let keys: Vec<String> = s
        .list("")
        .expect("list")
        .into_iter()
        .map(|i| i.key)
        .collect();
    assert_eq!(keys, ["a/b", "c/d/big.bin"]);
    let listed = s.list("c/").expect("list prefix");
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].key, "c/d/big.bin");
    assert_eq!(listed[0].size, big.len() as u64);
    assert!(s.list("zzz/").expect("list empty").is_empty());

    s.delete("a/b").expect("delete");
    s.delete("a/b").expect("delete absent");
    assert!(s.head("a/b").expect("head").is_none());
    for bad in ["../escape", "/abs", "a//b", "a/./b"] {
        let e = s.put(bad, b"x").expect_err(bad);
        assert!(matches!(e, BlobError::InvalidKey { .. }), "{e}");
    }
    assert!(!scratch.join("escape").exists());
}
