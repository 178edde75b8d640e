//! Blob stores against real backends: a directory, and an S3-compatible server on loopback.

use dsec_e2e::s3::{server_bin, S3Server};

#[test]
fn dir_store_conformance() {
    let d = tempfile::tempdir().expect("tempdir");
    let store = dsec_blob::open(&d.path().join("store").display().to_string()).expect("open");
    std::fs::create_dir(d.path().join("scratch")).expect("mkdir");
    dsec_e2e::blob::conformance(store.as_ref(), &d.path().join("scratch"));
    let left = std::fs::read_dir(d.path().join("store/.tmp"))
        .expect("tmp")
        .count();
    assert_eq!(left, 0, "writes left temporary files");
    assert!(dsec_blob::DirStore::open("relative").is_err());
}

#[test]
fn s3_store_conformance_and_errors() {
    let Some(bin) = server_bin() else { return };
    let server = S3Server::start(&bin).expect("S3 server");
    server.create_bucket("layers").expect("bucket");
    for (k, v) in server.env() {
        std::env::set_var(k, v);
    }
    let store = dsec_blob::open(&server.store_url("layers", "cluster-a")).expect("open");
    let d = tempfile::tempdir().expect("tempdir");
    dsec_e2e::blob::conformance(store.as_ref(), d.path());

    // A second prefix in the same bucket is a separate store.
    let other = dsec_blob::open(&server.store_url("layers", "cluster-b")).expect("open");
    assert!(other.list("").expect("list").is_empty());

    // A missing bucket and a dead server are clear errors, not hangs.
    let missing = dsec_blob::open(&server.store_url("no-such-bucket", "x")).expect("open");
    let e = missing
        .put("k", b"v")
        .expect_err("missing bucket")
        .to_string();
    assert!(
        e.contains("no-such-bucket") || e.contains("NoSuchBucket"),
        "{e}"
    );
    let url = server.store_url("layers", "cluster-a");
    drop(server);
    let dead = dsec_blob::open(&url).expect("open");
    let started = std::time::Instant::now();
    let e = dead.get("a").expect_err("dead server").to_string();
    assert!(e.contains("put") || e.contains("get"), "{e}");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(60),
        "took {:?}",
        started.elapsed()
    );
}

#[test]
fn http_store_reads_by_range() {
    let d = tempfile::tempdir().expect("tempdir");
    let files = d.path().join("served/layers");
    std::fs::create_dir_all(files.join("blobs")).expect("mkdir");
    let data: Vec<u8> = (0..(3u32 << 20)).map(|i| (i % 251) as u8).collect();
    std::fs::write(files.join("blobs/a.erofs"), &data).expect("write");
    let server = dsec_e2e::blobserver::BlobServer::start(&d.path().join("served")).expect("server");
    let store = dsec_blob::open(&format!("{}/layers", server.url)).expect("open");
    assert_eq!(
        store.head("blobs/a.erofs").expect("head").map(|i| i.size),
        Some(data.len() as u64)
    );
    assert!(store.head("blobs/missing").expect("head").is_none());
    assert_eq!(
        store.get_range("blobs/a.erofs", 1000..1100).expect("range"),
        &data[1000..1100]
    );
    let tail = store.get_range(
        "blobs/a.erofs",
        (data.len() - 10) as u64..(data.len() + 100) as u64,
    );
    assert_eq!(tail.expect("range past end"), &data[data.len() - 10..]);
    let e = store
        .get_range("blobs/a.erofs", data.len() as u64..data.len() as u64 + 1)
        .expect_err("start past end");
    assert!(matches!(e, dsec_blob::BlobError::BadRange { .. }), "{e}");
    let out = d.path().join("dl");
    assert_eq!(
        store.download("blobs/a.erofs", &out).expect("download"),
        data.len() as u64
    );
    assert!(std::fs::read(&out).expect("read") == data);
    let e = store.get_range("blobs/missing", 0..1).expect_err("missing");
    assert!(matches!(e, dsec_blob::BlobError::NotFound { .. }), "{e}");
}

#[test]
fn a_throttled_server_shares_one_link_and_counts_what_it_served() {
    let d = tempfile::tempdir().expect("tempdir");
    let data: Vec<u8> = (0..(1u32 << 20)).map(|i| (i % 253) as u8).collect();
    std::fs::write(d.path().join("a"), &data).expect("write");
    let throttle = dsec_e2e::blobserver::Throttle {
        bytes_per_sec: 4 << 20,
        latency: std::time::Duration::from_millis(50),
    };
    let server =
        dsec_e2e::blobserver::BlobServer::start_with(d.path(), Some(throttle)).expect("server");
    let store: std::sync::Arc<dyn dsec_blob::BlobStore> =
        std::sync::Arc::from(dsec_blob::open(&server.url).expect("open"));
    // Two whole reads at once share the 4 MiB/s link: 2 MiB take at least half a second.
    let started = std::time::Instant::now();
    std::thread::scope(|s| {
        for _ in 0..2 {
            let store = store.clone();
            let data = &data;
            s.spawn(move || {
                let got = store.get("a").expect("get").expect("present");
                assert!(&got == data);
            });
        }
    });
    assert!(started.elapsed() >= std::time::Duration::from_millis(450));
    assert_eq!(server.served_bytes(), 2 << 20);
    // A range read pays the latency and counts only its bytes.
    let started = std::time::Instant::now();
    assert_eq!(store.get_range("a", 10..20).expect("range"), &data[10..20]);
    assert!(started.elapsed() >= throttle.latency);
    assert_eq!(server.served_bytes(), (2 << 20) + 10);
    // PUT stores objects (parents created); keys that would leave the directory are refused.
    store.put("lists/x/a.json", b"{}").expect("put");
    assert_eq!(
        store.get("lists/x/a.json").expect("get").as_deref(),
        Some(&b"{}"[..])
    );
    assert_eq!(
        std::fs::read(d.path().join("lists/x/a.json")).expect("file"),
        b"{}"
    );
    for path in ["/lists/../../evil", "/lists/%2e%2e/%2e%2e/evil"] {
        use std::io::{Read, Write};
        let addr = server.url.trim_start_matches("http://");
        let mut conn = std::net::TcpStream::connect(addr).expect("connect");
        write!(
            conn,
            "PUT {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nConnection: close\r\n\r\nx"
        )
        .expect("send");
        let mut answer = String::new();
        let _ = conn.read_to_string(&mut answer);
        assert!(answer.starts_with("HTTP/1.1 4"), "{path}: {answer}");
    }
    assert!(
        !d.path().join("evil").exists()
            && !d.path().parent().expect("parent").join("evil").exists()
    );
}
