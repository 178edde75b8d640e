//! Lazy layers against the real kernel: an EROFS layer served through our FUSE file from
//! a directory blob store, mounted file-backed, read in part and whole.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dsec_blob::{BlobStore, DirStore};
use dsec_lazy::{ChunkCache, ChunkIndex, LazyMount, LazyOptions, DEFAULT_CHUNK_SIZE};

fn ready() -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let fs = std::fs::read_to_string("/proc/filesystems").unwrap_or_default();
    let ok = root && fs.contains("erofs") && fs.contains("fuse") && Path::new("/dev/fuse").exists();
    let missing = (!ok).then(|| "lazy layer tests need root, EROFS, FUSE and mkfs.erofs".into());
    dsec_testkit::unavailable("lazy layer tests", missing).is_none()
}

/// A tree of 40 files of 256 KiB (incompressible) plus small ones, as an EROFS layer.
fn build_layer(dir: &Path) -> (PathBuf, PathBuf) {
    let src = dir.join("src");
    std::fs::create_dir_all(src.join("small")).expect("mkdir");
    let mut x: u64 = 0x2545_F491_4F6C_DD1D;
    for i in 0..40 {
        let data: Vec<u8> = (0..(256 << 10))
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        std::fs::write(src.join(format!("big{i:02}.bin")), data).expect("write");
    }
    for i in 0..50 {
        std::fs::write(
            src.join("small").join(format!("f{i}.txt")),
            format!("small file {i}\n"),
        )
        .expect("write");
    }
    let blob = dir.join("layer.erofs");
    let st = std::process::Command::new("mkfs.erofs")
        .args(["--quiet", "-zlz4hc"])
        .arg(&blob)
        .arg(&src)
        .status()
        .expect("mkfs.erofs");
    assert!(st.success());
    (src, blob)
}

struct ErofsMount(PathBuf);

impl ErofsMount {
    fn new(file: &Path, at: &Path) -> Self {
        std::fs::create_dir_all(at).expect("mkdir");
        nix::mount::mount(
            Some(file),
            at,
            Some("erofs"),
            nix::mount::MsFlags::MS_RDONLY,
            None::<&str>,
        )
        .expect("mount erofs on the lazy file");
        ErofsMount(at.to_path_buf())
    }
}

impl Drop for ErofsMount {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(&self.0, nix::mount::MntFlags::MNT_DETACH);
    }
}

/// Whether `path` is a mount point of this mount namespace.
fn mounted(path: &Path) -> bool {
    let info = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    let path = path.display().to_string();
    info.lines()
        .any(|l| l.split(' ').nth(4) == Some(path.as_str()))
}

fn drop_caches() {
    // SAFETY: sync has no preconditions.
    unsafe { libc::sync() };
    let _ = std::fs::write("/proc/sys/vm/drop_caches", "3");
}

fn opts() -> LazyOptions {
    LazyOptions {
        fetch_timeout: Duration::from_secs(5),
        attempts: 2,
        threads: 4,
        read_ahead_bytes: 0,
        ..LazyOptions::default()
    }
}

/// A layer in a directory store, with its index and key.
struct StoredLayer {
    src: PathBuf,
    index: ChunkIndex,
    key: String,
    store: Arc<dyn BlobStore>,
}

fn stored_layer(dir: &Path) -> StoredLayer {
    let (src, blob) = build_layer(dir);
    let index = ChunkIndex::of_file(&blob, DEFAULT_CHUNK_SIZE).expect("index");
    let key = format!("blobs/sha256/{}.erofs", index.digest);
    let store: Arc<dyn BlobStore> = Arc::new(DirStore::open(dir.join("store")).expect("store"));
    store.upload(&key, &blob).expect("upload");
    StoredLayer {
        src,
        index,
        key,
        store,
    }
}

fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn the_first_reads_become_a_prefetch_list_that_a_fresh_node_replays() {
    if !ready() {
        return;
    }
    let d = tempfile::tempdir().expect("tempdir");
    let l = stored_layer(d.path());
    let pk = format!("blobs/sha256/{}.prefetch.json", l.index.digest);
    let recording = LazyOptions {
        prefetch_window: Duration::from_secs(1),
        ..opts()
    };
    let files = ["big03.bin", "big21.bin", "small/f9.txt"];

    // Node A: no list yet, so its first second of reads is recorded and saved.
    let cache = Arc::new(ChunkCache::open(d.path().join("cache-a"), 1 << 30).expect("cache"));
    let a = LazyMount::mount(
        &d.path().join("fuse-a"),
        l.store.clone(),
        cache,
        recording.clone(),
    )
    .expect("fuse");
    let file = a
        .add_layer(&l.key, l.index.clone(), Some(&pk))
        .expect("add");
    let m = ErofsMount::new(&file, &d.path().join("mnt-a"));
    for f in files {
        assert_eq!(
            std::fs::read(m.0.join(f)).expect("read"),
            std::fs::read(l.src.join(f)).expect("src")
        );
    }
    let fetched_a = a.stats(&l.index.digest).expect("stats").fetched_chunks;
    wait_for("the prefetch list", || {
        matches!(l.store.head(&pk), Ok(Some(_)))
    });
    let list: dsec_lazy::PrefetchList =
        serde_json::from_slice(&l.store.get(&pk).expect("get").expect("list")).expect("json");
    assert_eq!(list.digest, l.index.digest);
    assert_eq!(list.chunks.len() as u64, fetched_a, "{list:?}");
    assert!(list.chunks.len() < l.index.chunks.len() / 2, "{list:?}");
    drop(m);
    drop(a);

    // Node B, cold: adding the layer fetches the listed chunks before anything reads;
    // the same reads then fetch nothing more.
    drop_caches();
    let cache = Arc::new(ChunkCache::open(d.path().join("cache-b"), 1 << 30).expect("cache"));
    let b = LazyMount::mount(&d.path().join("fuse-b"), l.store.clone(), cache, recording)
        .expect("fuse");
    let file = b
        .add_layer(&l.key, l.index.clone(), Some(&pk))
        .expect("add");
    wait_for("the prefetch", || {
        b.stats(&l.index.digest).expect("stats").prefetched_chunks == list.chunks.len() as u64
    });
    let m = ErofsMount::new(&file, &d.path().join("mnt-b"));
    for f in files {
        assert_eq!(
            std::fs::read(m.0.join(f)).expect("read"),
            std::fs::read(l.src.join(f)).expect("src")
        );
    }
    let s = b.stats(&l.index.digest).expect("stats");
    assert_eq!(
        s.fetched_chunks, s.prefetched_chunks,
        "reads fetched on their own: {s:?}"
    );
    drop(m);
}

#[test]
fn a_server_is_adopted_by_a_new_client_and_exits_when_unmounted() {
    if !ready() {
        return;
    }
    let d = tempfile::tempdir().expect("tempdir");
    let l = stored_layer(d.path());
    let cfg = dsec_lazy::ServeConfig {
        dir: d.path().join("lazy"),
        socket: d.path().join("lazy.sock"),
        chunks: d.path().join("chunks"),
        chunk_cache_limit: 1 << 30,
        store: d.path().join("store").display().to_string(),
        log: d.path().join("lazy.log"),
        opts: opts(),
    };
    let c = cfg.clone();
    let server = std::thread::spawn(move || dsec_lazy::server::serve(&c));
    // A launcher that cannot start anything: attaching must adopt the running server.
    let never = dsec_lazy::Launcher {
        program: d.path().join("no-such-program"),
        args: vec![],
    };
    wait_for("the server socket", || cfg.socket.exists());
    let client = dsec_lazy::LazyClient::attach(&cfg, &never).expect("adopt");
    assert_eq!(client.pid(), std::process::id());
    let file = client
        .add_layer(&l.key, l.index.clone(), None)
        .expect("add");
    let m = ErofsMount::new(&file, &d.path().join("mnt"));
    assert_eq!(
        std::fs::read(m.0.join("big11.bin")).expect("read"),
        std::fs::read(l.src.join("big11.bin")).expect("src")
    );
    let all = client.stats().expect("stats");
    assert!(all.chunk_cache_bytes >= all.layers[0].1.fetched_bytes);
    let stats = all.layers;
    assert_eq!(stats.len(), 1);
    assert_eq!(stats[0].0, l.index.digest);
    assert!(stats[0].1.fetched_chunks > 0);
    assert_eq!(
        stats[0].1.fetch_buckets.iter().sum::<u64>(),
        stats[0].1.fetched_chunks
    );

    // A server for another store is refused, not silently shared.
    let other = dsec_lazy::ServeConfig {
        store: "/elsewhere".into(),
        ..cfg.clone()
    };
    let err = dsec_lazy::LazyClient::attach(&other, &never).expect_err("other store");
    assert!(err.to_string().contains("fetches from"), "{err}");

    // Bad input gets an error answer.
    let err = client
        .add_layer(
            &l.key,
            ChunkIndex {
                chunks: vec![],
                ..l.index.clone()
            },
            None,
        )
        .expect_err("bad index");
    assert!(err.to_string().contains("chunk"), "{err}");

    drop(m);
    nix::mount::umount2(&cfg.dir, nix::mount::MntFlags::MNT_DETACH).expect("umount");
    wait_for("the server to exit", || server.is_finished());
    server.join().expect("join").expect("serve");
    assert!(!cfg.socket.exists());
}

#[test]
fn lazy_layer_reads_only_what_is_read_and_matches_the_layer() {
    if !ready() {
        return;
    }
    let d = tempfile::tempdir().expect("tempdir");
    let (src, blob) = build_layer(d.path());
    let index = ChunkIndex::of_file(&blob, DEFAULT_CHUNK_SIZE).expect("index");
    let key = format!("blobs/sha256/{}.erofs", index.digest);
    let store: Arc<dyn BlobStore> =
        Arc::new(DirStore::open(d.path().join("store")).expect("store"));
    store.upload(&key, &blob).expect("upload");
    let layer_size = index.size;

    // A few files: only the chunks that hold them (and the metadata) are fetched.
    let cache = Arc::new(ChunkCache::open(d.path().join("cache"), 1 << 30).expect("cache"));
    let lazy =
        LazyMount::mount(&d.path().join("fuse"), store.clone(), cache, opts()).expect("fuse");
    let file = lazy.add_layer(&key, index.clone(), None).expect("add");
    let m = ErofsMount::new(&file, &d.path().join("mnt"));
    for name in ["big07.bin", "small/f3.txt"] {
        let got = std::fs::read(m.0.join(name)).expect("read through the lazy layer");
        assert!(
            got == std::fs::read(src.join(name)).expect("read src"),
            "{name} differs"
        );
    }
    let s = lazy.stats(&index.digest).expect("stats");
    assert!(s.fetched_bytes > 0);
    assert!(
        s.fetched_bytes * 4 < layer_size,
        "fetched {} of {} bytes for two files",
        s.fetched_bytes,
        layer_size
    );
    assert_eq!(s.faults, 0);

    // The whole tree, from 8 readers at once: byte-identical, each chunk fetched once.
    drop_caches();
    let names: Vec<String> = (0..40).map(|i| format!("big{i:02}.bin")).collect();
    std::thread::scope(|sc| {
        for _ in 0..8 {
            sc.spawn(|| {
                for n in &names {
                    let got = std::fs::read(m.0.join(n)).expect("read");
                    assert!(
                        got == std::fs::read(src.join(n)).expect("src"),
                        "{n} differs"
                    );
                }
            });
        }
    });
    let s = lazy.stats(&index.digest).expect("stats");
    assert!(
        s.fetched_chunks <= index.chunks.len() as u64,
        "{} fetches for {} chunks",
        s.fetched_chunks,
        index.chunks.len()
    );
    drop(m);
    drop(lazy);
    // Right after its layer mount went, the lazy file system is gone too.
    assert!(
        !mounted(&d.path().join("fuse")),
        "lazy fs outlived its drop"
    );

    // A restart keeps the chunk cache: the same reads fetch nothing.
    drop_caches();
    let cache = Arc::new(ChunkCache::open(d.path().join("cache"), 1 << 30).expect("cache"));
    assert!(cache.held_bytes() > 0);
    let lazy = LazyMount::mount(&d.path().join("fuse"), store, cache, opts()).expect("fuse");
    let file = lazy.add_layer(&key, index.clone(), None).expect("add");
    let m = ErofsMount::new(&file, &d.path().join("mnt"));
    assert_eq!(
        std::fs::read(m.0.join("big07.bin")).expect("read"),
        std::fs::read(src.join("big07.bin")).expect("src")
    );
    let s = lazy.stats(&index.digest).expect("stats");
    assert_eq!(s.fetched_bytes, 0, "{s:?}");
    assert!(s.cached_bytes > 0);
    drop(m);
    drop(lazy);
    assert!(
        !mounted(&d.path().join("fuse")),
        "lazy fs outlived its drop"
    );
}

#[test]
fn corrupt_chunks_and_a_dead_store_give_eio_not_a_hang() {
    if !ready() {
        return;
    }
    let d = tempfile::tempdir().expect("tempdir");
    let (_, blob) = build_layer(d.path());
    let index = ChunkIndex::of_file(&blob, DEFAULT_CHUNK_SIZE).expect("index");
    let key = format!("blobs/sha256/{}.erofs", index.digest);
    // The store holds a copy whose data chunks differ from the index.
    let mut bytes = std::fs::read(&blob).expect("read");
    let at = bytes.len() / 2;
    for b in &mut bytes[at..at + 4096] {
        *b ^= 0x5a;
    }
    let store_dir = d.path().join("store");
    let store: Arc<dyn BlobStore> = Arc::new(DirStore::open(&store_dir).expect("store"));
    store.put(&key, &bytes).expect("put");

    let cache = Arc::new(ChunkCache::open(d.path().join("cache"), 1 << 30).expect("cache"));
    let lazy =
        LazyMount::mount(&d.path().join("fuse"), store, cache.clone(), opts()).expect("fuse");
    let file = lazy.add_layer(&key, index.clone(), None).expect("add");
    // Read the lazy file itself: the corrupt chunk's range fails, the rest reads.
    let started = Instant::now();
    let mut f = std::fs::File::open(&file).expect("open");
    let mut all = Vec::new();
    let e = f.read_to_end(&mut all).expect_err("corrupt chunk read");
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    assert!(started.elapsed() < Duration::from_secs(20));
    let s = lazy.stats(&index.digest).expect("stats");
    assert!(s.faults > 0, "{s:?}");
    drop(f);
    drop(lazy);

    // The store gone entirely: EIO too, within the fetch timeout and retries.
    std::fs::remove_dir_all(&store_dir).expect("rm store");
    let store: Arc<dyn BlobStore> =
        Arc::new(DirStore::open(d.path().join("empty")).expect("store"));
    let empty_cache = Arc::new(ChunkCache::open(d.path().join("cache2"), 1 << 30).expect("cache"));
    let lazy = LazyMount::mount(&d.path().join("fuse"), store, empty_cache, opts()).expect("fuse");
    let file = lazy.add_layer(&key, index.clone(), None).expect("add");
    let started = Instant::now();
    let e = std::fs::read(&file).expect_err("dead store");
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    assert!(started.elapsed() < Duration::from_secs(20));
    assert!(lazy.stats(&index.digest).expect("stats").faults > 0);
}

#[test]
fn chunk_cache_stays_within_its_limit() {
    let d = tempfile::tempdir().expect("tempdir");
    let cache = ChunkCache::open(d.path(), 1 << 20).expect("cache");
    let chunk = vec![7u8; 256 << 10];
    for i in 0..10 {
        cache.put("aa", i, &chunk).expect("put");
    }
    assert!(cache.held_bytes() <= 1 << 20, "{}", cache.held_bytes());
    // The newest survive, the oldest went.
    assert!(cache.get("aa", 9).is_some());
    assert!(cache.get("aa", 0).is_none());
    let bad = ChunkIndex {
        digest: "x".into(),
        size: 10,
        chunk_size: 4096,
        chunks: vec![],
        meta: vec![],
    };
    assert!(bad.validate().is_err());
    let bad_meta = ChunkIndex {
        digest: "x".into(),
        size: 10,
        chunk_size: 4096,
        chunks: vec!["00".into()],
        meta: vec![1],
    };
    assert!(bad_meta.validate().is_err());
}

#[test]
fn read_ahead_fetches_each_chunk_once_and_reads_stay_identical() {
    if !ready() {
        return;
    }
    let d = tempfile::tempdir().expect("tempdir");
    let l = stored_layer(d.path());
    let cache = Arc::new(ChunkCache::open(d.path().join("cache"), 1 << 30).expect("cache"));
    let ahead = LazyOptions {
        read_ahead_bytes: 4 * DEFAULT_CHUNK_SIZE,
        ..opts()
    };
    let lazy = LazyMount::mount(
        &d.path().join("fuse"),
        l.store.clone(),
        cache.clone(),
        ahead,
    )
    .expect("fuse");
    let file = lazy.add_layer(&l.key, l.index.clone(), None).expect("add");
    let m = ErofsMount::new(&file, &d.path().join("mnt"));
    let names: Vec<String> = (0..40).map(|i| format!("big{i:02}.bin")).collect();
    std::thread::scope(|sc| {
        for _ in 0..4 {
            sc.spawn(|| {
                for n in &names {
                    let got = std::fs::read(m.0.join(n)).expect("read");
                    assert!(
                        got == std::fs::read(l.src.join(n)).expect("src"),
                        "{n} differs"
                    );
                }
            });
        }
    });
    // Read-ahead threads may still be finishing: wait for the count to settle.
    let mut last = u64::MAX;
    wait_for("fetches to settle", || {
        let now = lazy.stats(&l.index.digest).expect("stats").fetched_chunks;
        std::thread::sleep(Duration::from_millis(200));
        std::mem::replace(&mut last, now) == now
    });
    let s = lazy.stats(&l.index.digest).expect("stats");
    assert!(
        s.fetched_chunks <= l.index.chunks.len() as u64,
        "{} fetches for {} chunks",
        s.fetched_chunks,
        l.index.chunks.len()
    );
    assert_eq!(s.faults, 0);
    drop(m);
}

#[test]
fn metadata_found_at_upload_is_fetched_when_the_layer_is_added() {
    if !ready() {
        return;
    }
    let d = tempfile::tempdir().expect("tempdir");
    let (src, blob) = build_layer(d.path());
    let mut index = ChunkIndex::of_file(&blob, 64 << 10).expect("index");
    index.meta =
        dsec_lazy::metadata_chunks(&blob, &index, &d.path().join("walk")).expect("metadata walk");
    assert!(!d.path().join("walk").exists(), "scratch left behind");
    assert!(!index.meta.is_empty());
    assert!(
        index.meta.len() * 4 < index.chunks.len(),
        "{} metadata chunks of {}",
        index.meta.len(),
        index.chunks.len()
    );
    index.validate().expect("valid");
    let key = format!("blobs/sha256/{}.erofs", index.digest);
    let store: Arc<dyn BlobStore> =
        Arc::new(DirStore::open(d.path().join("store")).expect("store"));
    store.upload(&key, &blob).expect("upload");

    // Adding the layer fetches its metadata before returning; walking the whole tree
    // (every directory listed, every entry looked up) then fetches nothing.
    drop_caches();
    let cache = Arc::new(ChunkCache::open(d.path().join("cache"), 1 << 30).expect("cache"));
    let lazy = LazyMount::mount(&d.path().join("fuse"), store, cache, opts()).expect("fuse");
    let file = lazy.add_layer(&key, index.clone(), None).expect("add");
    let after_add = lazy.stats(&index.digest).expect("stats").fetched_chunks;
    assert_eq!(after_add, index.meta.len() as u64);
    let m = ErofsMount::new(&file, &d.path().join("mnt"));
    let mut stack = vec![m.0.clone()];
    let mut seen = 0;
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).expect("read_dir").flatten() {
            let md = std::fs::symlink_metadata(e.path()).expect("lstat");
            seen += 1;
            if md.is_dir() {
                stack.push(e.path());
            }
        }
    }
    assert_eq!(seen, 40 + 1 + 50, "every entry found");
    let s = lazy.stats(&index.digest).expect("stats");
    assert_eq!(
        s.fetched_chunks, after_add,
        "lookups waited on the store: {s:?}"
    );
    // Data still reads right (fetched on demand).
    assert_eq!(
        std::fs::read(m.0.join("small/f7.txt")).expect("read"),
        std::fs::read(src.join("small/f7.txt")).expect("src")
    );
    drop(m);
}
