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
    if !ok {
        let msg = "lazy layer tests need root, EROFS, FUSE and mkfs.erofs";
        if std::env::var("CI").as_deref() == Ok("true") {
            panic!("{msg}");
        }
        eprintln!("SKIPPED: {msg}");
    }
    ok
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
    }
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
    let file = lazy.add_layer(&key, index.clone()).expect("add");
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

    // A restart keeps the chunk cache: the same reads fetch nothing.
    drop_caches();
    let cache = Arc::new(ChunkCache::open(d.path().join("cache"), 1 << 30).expect("cache"));
    assert!(cache.held_bytes() > 0);
    let lazy = LazyMount::mount(&d.path().join("fuse"), store, cache, opts()).expect("fuse");
    let file = lazy.add_layer(&key, index.clone()).expect("add");
    let m = ErofsMount::new(&file, &d.path().join("mnt"));
    assert_eq!(
        std::fs::read(m.0.join("big07.bin")).expect("read"),
        std::fs::read(src.join("big07.bin")).expect("src")
    );
    let s = lazy.stats(&index.digest).expect("stats");
    assert_eq!(s.fetched_bytes, 0, "{s:?}");
    assert!(s.cached_bytes > 0);
    drop(m);
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
    let file = lazy.add_layer(&key, index.clone()).expect("add");
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
    let file = lazy.add_layer(&key, index.clone()).expect("add");
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
    };
    assert!(bad.validate().is_err());
}
