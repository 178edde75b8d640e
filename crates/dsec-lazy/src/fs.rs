//! [`LazyMount`]: the FUSE file system of on-demand layer files (one flat directory,
//! `<layer hex>.erofs` per layer) and the fetch path behind its reads.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::{Duration, Instant, UNIX_EPOCH};

use dsec_blob::BlobStore;
use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, INodeNo, LockOwner, MountOption,
    OpenFlags, ReplyAttr, ReplyData, ReplyDirectory, ReplyEntry, ReplyOpen, Request,
};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::{ChunkCache, ChunkIndex, LazyError, Result};

/// How the fetch path behaves.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LazyOptions {
    /// Longest wait for one chunk fetch before the read fails with `EIO`.
    pub fetch_timeout: Duration,
    /// Fetch attempts per chunk (with 100 ms, 400 ms, ... backoff between them).
    pub attempts: u32,
    /// FUSE worker threads (reads of different chunks proceed in parallel).
    pub threads: usize,
    /// How long after a layer's first read its reads are recorded into its prefetch
    /// list (only when the store has no list for it yet); zero turns recording off.
    pub prefetch_window: Duration,
    /// Parallel fetches when a layer's prefetch list is replayed.
    pub prefetch_threads: usize,
    /// On a sequential read that misses (the chunk before it is cached), also fetch this
    /// many bytes of following chunks (at least one chunk) in the background, in one
    /// request, so a file read front to back waits on few round trips. Zero: off.
    pub read_ahead_bytes: u64,
    /// The kernel's readahead on the layer files, bytes (at least 4096). The kernel's
    /// default (128 KiB) often spills a small read into the next chunk and fetches it
    /// for nothing; EROFS reads ahead inside files itself.
    pub kernel_readahead: u32,
}

impl Default for LazyOptions {
    fn default() -> Self {
        Self {
            fetch_timeout: Duration::from_secs(30),
            attempts: 3,
            threads: 8,
            prefetch_window: Duration::from_secs(30),
            prefetch_threads: 8,
            read_ahead_bytes: 256 << 10,
            kernel_readahead: 32 << 10,
        }
    }
}

/// Upper bounds (milliseconds) of the fetch latency histogram's buckets; a last bucket
/// holds the slower fetches.
pub const FETCH_BUCKETS_MS: [u64; 11] = [1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 5000];

/// Accounting of one lazy layer.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerStats {
    /// Bytes fetched from the blob store (and written to the chunk cache).
    pub fetched_bytes: u64,
    /// Chunks fetched.
    pub fetched_chunks: u64,
    /// Bytes served from the chunk cache.
    pub cached_bytes: u64,
    /// Reads answered with `EIO` (store down, timeout, bad chunk).
    pub faults: u64,
    /// Sum of fetch latencies in microseconds (mean = this / fetched_chunks).
    pub fetch_micros: u64,
    /// Fetches per latency bucket ([`FETCH_BUCKETS_MS`], then one for slower ones).
    pub fetch_buckets: Vec<u64>,
    /// Chunks fetched ahead of any read, from the layer's prefetch list.
    pub prefetched_chunks: u64,
    /// The last fault: unix milliseconds and what went wrong.
    pub last_fault: Option<(u64, String)>,
}

#[derive(Debug, Default)]
struct Counters {
    fetched_bytes: AtomicU64,
    fetched_chunks: AtomicU64,
    cached_bytes: AtomicU64,
    faults: AtomicU64,
    fetch_micros: AtomicU64,
    fetch_buckets: [AtomicU64; FETCH_BUCKETS_MS.len() + 1],
    prefetched_chunks: AtomicU64,
    last_fault: Mutex<Option<(u64, String)>>,
}

impl Counters {
    fn fault(&self, what: String) {
        self.faults.fetch_add(1, Ordering::Relaxed);
        let now = std::time::SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        *self.last_fault.lock().unwrap_or_else(|e| e.into_inner()) = Some((now, what));
    }

    fn fetched(&self, bytes: u64, took: Duration) {
        self.fetched_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.fetched_chunks.fetch_add(1, Ordering::Relaxed);
        self.fetch_micros
            .fetch_add(took.as_micros() as u64, Ordering::Relaxed);
        let ms = took.as_millis() as u64;
        let bucket = FETCH_BUCKETS_MS
            .iter()
            .position(|&b| ms < b)
            .unwrap_or(FETCH_BUCKETS_MS.len());
        self.fetch_buckets[bucket].fetch_add(1, Ordering::Relaxed);
    }

    fn snapshot(&self) -> LayerStats {
        LayerStats {
            fetched_bytes: self.fetched_bytes.load(Ordering::Relaxed),
            fetched_chunks: self.fetched_chunks.load(Ordering::Relaxed),
            cached_bytes: self.cached_bytes.load(Ordering::Relaxed),
            faults: self.faults.load(Ordering::Relaxed),
            fetch_micros: self.fetch_micros.load(Ordering::Relaxed),
            fetch_buckets: self
                .fetch_buckets
                .iter()
                .map(|b| b.load(Ordering::Relaxed))
                .collect(),
            prefetched_chunks: self.prefetched_chunks.load(Ordering::Relaxed),
            last_fault: self
                .last_fault
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
        }
    }
}

#[derive(Debug)]
struct Layer {
    ino: u64,
    name: String,
    key: String,
    index: ChunkIndex,
    counters: Counters,
    /// Records the chunks read in the layer's first window, when no prefetch list exists.
    recorder: Mutex<Option<Recorder>>,
}

/// The chunks a layer's first readers touched, in first-read order.
#[derive(Debug)]
struct Recorder {
    /// Where the finished list goes in the blob store.
    save_to: String,
    /// When the first read came (the window starts then).
    started: Option<Instant>,
    seen: std::collections::HashSet<u64>,
    order: Vec<u64>,
}

/// A layer's prefetch list: the chunks its first sandbox read in its first seconds, in
/// the order it read them. Stored next to the layer in the blob store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefetchList {
    /// Hex sha256 of the layer.
    pub digest: String,
    /// Chunk size the indices count in.
    pub chunk_size: u64,
    /// Chunk indices, first read first.
    pub chunks: Vec<u64>,
    /// Length of the recording window, milliseconds.
    pub window_ms: u64,
}

/// One in-flight chunk fetch that later readers of the same chunk wait on.
#[derive(Debug, Default)]
struct Flight {
    result: Mutex<Option<Option<Arc<Vec<u8>>>>>,
    done: Condvar,
}

#[derive(Debug)]
struct Inner {
    store: Arc<dyn BlobStore>,
    cache: Arc<ChunkCache>,
    layers: RwLock<Vec<Arc<Layer>>>,
    inflight: Mutex<HashMap<(u64, u64), Arc<Flight>>>,
    opts: LazyOptions,
}

const ROOT: u64 = 1;
const TTL: Duration = Duration::from_secs(3600);

fn attr(ino: u64, size: u64, dir: bool) -> FileAttr {
    FileAttr {
        ino: INodeNo(ino),
        size,
        blocks: size.div_ceil(512),
        atime: UNIX_EPOCH,
        mtime: UNIX_EPOCH,
        ctime: UNIX_EPOCH,
        crtime: UNIX_EPOCH,
        kind: if dir {
            FileType::Directory
        } else {
            FileType::RegularFile
        },
        perm: if dir { 0o555 } else { 0o444 },
        nlink: if dir { 2 } else { 1 },
        uid: 0,
        gid: 0,
        rdev: 0,
        blksize: 4096,
        flags: 0,
    }
}

impl Inner {
    fn layer(&self, ino: u64) -> Option<Arc<Layer>> {
        let layers = self.layers.read().unwrap_or_else(|e| e.into_inner());
        ino.checked_sub(2)
            .and_then(|i| layers.get(usize::try_from(i).ok()?))
            .cloned()
    }

    /// Notes the chunks a kernel read of `offset..offset+size` covers, while `layer`'s
    /// recording window is open; the first read opens it and schedules the save.
    fn record(self: &Arc<Self>, layer: &Arc<Layer>, offset: u64, size: u32) {
        let end = (offset + u64::from(size)).min(layer.index.size);
        if offset >= end {
            return;
        }
        let mut guard = layer.recorder.lock().unwrap_or_else(|e| e.into_inner());
        let Some(rec) = guard.as_mut() else { return };
        let started = *rec.started.get_or_insert_with(|| {
            let (inner, layer) = (self.clone(), layer.clone());
            let window = self.opts.prefetch_window;
            std::thread::spawn(move || {
                std::thread::sleep(window);
                inner.save_recording(&layer);
            });
            Instant::now()
        });
        if started.elapsed() > self.opts.prefetch_window {
            return;
        }
        let cs = layer.index.chunk_size;
        for i in offset / cs..=(end - 1) / cs {
            if rec.seen.insert(i) {
                rec.order.push(i);
            }
        }
    }

    /// Ends `layer`'s recording and writes its prefetch list, unless another node wrote
    /// one meanwhile.
    fn save_recording(&self, layer: &Layer) {
        let Some(rec) = layer
            .recorder
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        else {
            return;
        };
        if rec.order.is_empty() || matches!(self.store.head(&rec.save_to), Ok(Some(_))) {
            return;
        }
        let list = PrefetchList {
            digest: layer.index.digest.clone(),
            chunk_size: layer.index.chunk_size,
            chunks: rec.order,
            window_ms: self.opts.prefetch_window.as_millis() as u64,
        };
        let saved = serde_json::to_vec(&list)
            .map_err(std::io::Error::other)
            .and_then(|b| {
                self.store
                    .put(&rec.save_to, &b)
                    .map_err(std::io::Error::other)
            });
        match saved {
            Ok(()) => tracing::info!(
                layer = %list.digest, chunks = list.chunks.len(), "prefetch list recorded"
            ),
            Err(e) => tracing::warn!(layer = %list.digest, error = %e, "saving the prefetch list"),
        }
    }

    /// Replays `layer`'s prefetch list in the background; counts what it fetched.
    fn prefetch(self: &Arc<Self>, layer: &Arc<Layer>, list: PrefetchList) {
        let (inner, layer) = (self.clone(), layer.clone());
        std::thread::spawn(move || {
            let got = inner.fetch_chunks(&layer, list.chunks);
            layer
                .counters
                .prefetched_chunks
                .fetch_add(got, Ordering::Relaxed);
        });
    }

    /// Fetches the chunks of `chunks` that are neither cached nor being fetched, and
    /// waits for them: runs of consecutive chunks go in one request (up to 1 MiB),
    /// `prefetch_threads` requests at a time. Returns how many chunks it fetched.
    fn fetch_chunks(&self, layer: &Layer, chunks: Vec<u64>) -> u64 {
        let n = layer.index.chunks.len() as u64;
        let max_run = ((1 << 20) / layer.index.chunk_size).max(1);
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for i in chunks.into_iter().filter(|&i| i < n) {
            match runs.last_mut() {
                Some((start, len)) if *start + *len == i && *len < max_run => *len += 1,
                _ => runs.push((i, 1)),
            }
        }
        let queue = Mutex::new(runs.into_iter());
        let fetched = AtomicU64::new(0);
        std::thread::scope(|s| {
            for _ in 0..self.opts.prefetch_threads.max(1) {
                s.spawn(|| loop {
                    let next = queue.lock().unwrap_or_else(|e| e.into_inner()).next();
                    let Some((start, len)) = next else { return };
                    let mut j = start;
                    while j < start + len {
                        let claimed = self.claim_run(layer, j, start + len - j);
                        if claimed.is_empty() {
                            j += 1;
                            continue;
                        }
                        j += claimed.len() as u64;
                        let got = self.fetch_claimed(layer, claimed);
                        let ok = got.iter().filter(|c| c.is_some()).count() as u64;
                        fetched.fetch_add(ok, Ordering::Relaxed);
                    }
                });
            }
        });
        fetched.into_inner()
    }

    /// Claims up to `max` consecutive chunks from `start` for one fetch: it stops at the
    /// first chunk that is cached or already being fetched. The caller must pass the
    /// claim to [`Inner::fetch_claimed`].
    fn claim_run(&self, layer: &Layer, start: u64, max: u64) -> Vec<(u64, Arc<Flight>)> {
        let n = layer.index.chunks.len() as u64;
        let mut inflight = self.inflight.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = Vec::new();
        for j in start..start.saturating_add(max).min(n) {
            if inflight.contains_key(&(layer.ino, j)) || self.cache.contains(&layer.index.digest, j)
            {
                break;
            }
            let f = Arc::new(Flight::default());
            inflight.insert((layer.ino, j), f.clone());
            out.push((j, f));
        }
        out
    }

    /// Fetches a claimed run in one request, ends its flights with the result, and
    /// returns each chunk's data (`None` for all if the fetch failed).
    fn fetch_claimed(
        &self,
        layer: &Layer,
        claimed: Vec<(u64, Arc<Flight>)>,
    ) -> Vec<Option<Arc<Vec<u8>>>> {
        let (Some(first), Some(last)) = (claimed.first(), claimed.last()) else {
            return Vec::new();
        };
        let got: Vec<Option<Arc<Vec<u8>>>> = match self.fetch_range(layer, first.0, last.0) {
            Some(chunks) => chunks.into_iter().map(Some).collect(),
            None => vec![None; claimed.len()],
        };
        let mut inflight = self.inflight.lock().unwrap_or_else(|e| e.into_inner());
        for ((j, f), r) in claimed.iter().zip(&got) {
            *f.result.lock().unwrap_or_else(|e| e.into_inner()) = Some(r.clone());
            f.done.notify_all();
            inflight.remove(&(layer.ino, *j));
        }
        got
    }

    /// Starts background fetches of the chunks after this read's when the read continues
    /// a sequential scan (the chunk before it is cached) into a chunk not cached yet.
    fn read_ahead(self: &Arc<Self>, layer: &Arc<Layer>, offset: u64, size: u32) {
        let (ra, cs, digest) = (
            self.opts.read_ahead_bytes,
            layer.index.chunk_size,
            &layer.index.digest,
        );
        let end = (offset + u64::from(size)).min(layer.index.size);
        if ra == 0 || offset >= end {
            return;
        }
        let (first, last) = (offset / cs, (end - 1) / cs);
        if first == 0
            || !self.cache.contains(digest, first - 1)
            || self.cache.contains(digest, last)
        {
            return;
        }
        let claimed = self.claim_run(layer, last + 1, (ra / cs).max(1));
        if !claimed.is_empty() {
            let (inner, layer) = (self.clone(), layer.clone());
            std::thread::spawn(move || inner.fetch_claimed(&layer, claimed));
        }
    }

    /// The bytes `offset..offset+size` of `layer` (cut at its end), or `None` (→ EIO).
    fn read(&self, layer: &Layer, offset: u64, size: u32) -> Option<Vec<u8>> {
        let end = (offset + u64::from(size)).min(layer.index.size);
        if offset >= end {
            return Some(Vec::new());
        }
        let cs = layer.index.chunk_size;
        let mut out = Vec::with_capacity((end - offset) as usize);
        for i in offset / cs..=(end - 1) / cs {
            let range = layer.index.range(i);
            let (from, to) = (
                offset.max(range.start) - range.start,
                end.min(range.end) - range.start,
            );
            // A cached chunk: read just the part asked for.
            let chunk_len = range.end - range.start;
            if let Some(part) = self
                .cache
                .read_part(&layer.index.digest, i, chunk_len, from..to)
            {
                layer
                    .counters
                    .cached_bytes
                    .fetch_add(part.len() as u64, Ordering::Relaxed);
                out.extend_from_slice(&part);
                continue;
            }
            let data = self.chunk(layer, i)?;
            out.extend_from_slice(data.get(from as usize..to as usize)?);
        }
        Some(out)
    }

    /// Chunk `i` of `layer`: from the cache, or fetched once for all concurrent readers.
    fn chunk(&self, layer: &Layer, i: u64) -> Option<Arc<Vec<u8>>> {
        if let Some(d) = self.cache.get(&layer.index.digest, i) {
            if d.len() as u64 == layer.index.range(i).end - layer.index.range(i).start {
                layer
                    .counters
                    .cached_bytes
                    .fetch_add(d.len() as u64, Ordering::Relaxed);
                return Some(Arc::new(d));
            }
        }
        let (flight, leader) = {
            let mut inflight = self.inflight.lock().unwrap_or_else(|e| e.into_inner());
            match inflight.get(&(layer.ino, i)) {
                Some(f) => (f.clone(), false),
                None => {
                    let f = Arc::new(Flight::default());
                    inflight.insert((layer.ino, i), f.clone());
                    (f, true)
                }
            }
        };
        if leader {
            // A fetch that finished between our cache miss and now left the chunk in the
            // cache (it is cached before its flight ends): do not fetch it again.
            let got = match self.cache.get(&layer.index.digest, i) {
                Some(d) => {
                    layer
                        .counters
                        .cached_bytes
                        .fetch_add(d.len() as u64, Ordering::Relaxed);
                    Some(Arc::new(d))
                }
                None => self.fetch_range(layer, i, i).and_then(|mut v| v.pop()),
            };
            *flight.result.lock().unwrap_or_else(|e| e.into_inner()) = Some(got.clone());
            flight.done.notify_all();
            self.inflight
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&(layer.ino, i));
            return got;
        }
        let wait = self.opts.fetch_timeout * (self.opts.attempts + 1);
        let guard = flight.result.lock().unwrap_or_else(|e| e.into_inner());
        let (guard, _) = flight
            .done
            .wait_timeout_while(guard, wait, |r| r.is_none())
            .unwrap_or_else(|e| e.into_inner());
        match guard.as_ref() {
            Some(r) => r.clone(),
            None => {
                layer
                    .counters
                    .fault(format!("chunk {i}: no fetch result within {wait:?}"));
                None
            }
        }
    }

    /// Fetches chunks `first..=last` in one range request, verifies and caches each,
    /// retrying the whole request; `None` after the last attempt.
    fn fetch_range(&self, layer: &Layer, first: u64, last: u64) -> Option<Vec<Arc<Vec<u8>>>> {
        let range = layer.index.range(first).start..layer.index.range(last).end;
        let want: Vec<String> = (first..=last)
            .map(|i| layer.index.chunks.get(usize::try_from(i).ok()?).cloned())
            .collect::<Option<_>>()?;
        let mut backoff = Duration::from_millis(100);
        let mut problem = String::new();
        for attempt in 1..=self.opts.attempts.max(1) {
            let started = Instant::now();
            let (tx, rx) = std::sync::mpsc::channel();
            let (store, key, r) = (self.store.clone(), layer.key.clone(), range.clone());
            // The store call cannot be cancelled; bound the wait, not the call.
            std::thread::spawn(move || {
                let _ = tx.send(store.get_range(&key, r));
            });
            problem = match rx.recv_timeout(self.opts.fetch_timeout) {
                Ok(Ok(data)) if data.len() as u64 == range.end - range.start => {
                    let took = started.elapsed();
                    let mut out = Vec::with_capacity(want.len());
                    for (k, i) in (first..=last).enumerate() {
                        let r = layer.index.range(i);
                        let part =
                            &data[(r.start - range.start) as usize..(r.end - range.start) as usize];
                        if hex::encode(Sha256::digest(part)) != want[k] {
                            break;
                        }
                        if let Err(e) = self.cache.put(&layer.index.digest, i, part) {
                            tracing::warn!(error = %e, "chunk cache write failed");
                        }
                        layer.counters.fetched(part.len() as u64, took);
                        out.push(Arc::new(part.to_vec()));
                    }
                    if out.len() == want.len() {
                        return Some(out);
                    }
                    format!("chunk {} digest mismatch", first + out.len() as u64)
                }
                Ok(Ok(data)) => format!(
                    "{} bytes for a range of {}",
                    data.len(),
                    range.end - range.start
                ),
                Ok(Err(e)) => e.to_string(),
                Err(_) => format!("no answer within {:?}", self.opts.fetch_timeout),
            };
            tracing::warn!(
                layer = %layer.index.digest, first, last, attempt, problem = %problem,
                "lazy layer chunk fetch failed"
            );
            if attempt < self.opts.attempts {
                std::thread::sleep(backoff);
                backoff *= 4;
            }
        }
        layer.counters.fault(format!(
            "chunks {first}..={last}: {problem} ({} attempts)",
            self.opts.attempts
        ));
        None
    }
}

/// The `Filesystem` fuser drives; the state is shared with [`LazyMount`].
struct Fs(Arc<Inner>);

impl Filesystem for Fs {
    fn init(&mut self, _req: &Request, config: &mut fuser::KernelConfig) -> std::io::Result<()> {
        let want = self.0.opts.kernel_readahead.max(4096);
        if let Err(max) = config.set_max_readahead(want) {
            let _ = config.set_max_readahead(max);
        }
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        if u64::from(parent) != ROOT {
            return reply.error(Errno::ENOENT);
        }
        let layers = self.0.layers.read().unwrap_or_else(|e| e.into_inner());
        match layers.iter().find(|l| OsStr::new(&l.name) == name) {
            Some(l) => reply.entry(
                &TTL,
                &attr(l.ino, l.index.size, false),
                fuser::Generation(0),
            ),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        let ino = u64::from(ino);
        if ino == ROOT {
            return reply.attr(&TTL, &attr(ROOT, 0, true));
        }
        match self.0.layer(ino) {
            Some(l) => reply.attr(&TTL, &attr(ino, l.index.size, false)),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        match self.0.layer(u64::from(ino)) {
            // Layers never change: let the kernel keep what it read.
            Some(_) => reply.opened(FileHandle(0), FopenFlags::FOPEN_KEEP_CACHE),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let Some(layer) = self.0.layer(u64::from(ino)) else {
            return reply.error(Errno::ENOENT);
        };
        self.0.record(&layer, offset, size);
        self.0.read_ahead(&layer, offset, size);
        match self.0.read(&layer, offset, size) {
            Some(data) => reply.data(&data),
            None => reply.error(Errno::EIO),
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        if u64::from(ino) != ROOT {
            return reply.error(Errno::ENOTDIR);
        }
        let layers = self.0.layers.read().unwrap_or_else(|e| e.into_inner());
        let mut entries = vec![
            (ROOT, FileType::Directory, ".".to_string()),
            (ROOT, FileType::Directory, "..".to_string()),
        ];
        entries.extend(
            layers
                .iter()
                .map(|l| (l.ino, FileType::RegularFile, l.name.clone())),
        );
        for (i, (ino, kind, name)) in entries.into_iter().enumerate().skip(offset as usize) {
            if reply.add(INodeNo(ino), (i + 1) as u64, kind, name) {
                break;
            }
        }
        reply.ok();
    }
}

/// The mounted FUSE file system of lazy layer files. Dropping it unmounts it (unmount
/// the EROFS mounts on its files first).
pub struct LazyMount {
    inner: Arc<Inner>,
    dir: PathBuf,
    /// Taken only by `Drop`.
    session: Option<fuser::BackgroundSession>,
}

impl std::fmt::Debug for LazyMount {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LazyMount")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

impl Drop for LazyMount {
    /// Unmounts the file system. A layer mount that was just detached can keep it busy
    /// for a moment; the unmount is retried, then detached, so no dead FUSE mount
    /// ("Transport endpoint is not connected") outlives the process.
    fn drop(&mut self) {
        let Some(session) = self.session.take() else {
            return;
        };
        if session.umount_and_join().is_ok() {
            return;
        }
        for _ in 0..40 {
            match nix::mount::umount2(&self.dir, nix::mount::MntFlags::empty()) {
                Err(nix::errno::Errno::EBUSY) => {
                    std::thread::sleep(std::time::Duration::from_millis(25))
                }
                // Unmounted now, or by someone else already.
                _ => return,
            }
        }
        tracing::warn!(dir = %self.dir.display(), "lazy file system still busy: detaching it");
        let _ = nix::mount::umount2(&self.dir, nix::mount::MntFlags::MNT_DETACH);
    }
}

impl LazyMount {
    /// Mounts an empty lazy file system at `dir` (created if missing) that fetches from
    /// `store` into `cache`.
    pub fn mount(
        dir: &Path,
        store: Arc<dyn BlobStore>,
        cache: Arc<ChunkCache>,
        opts: LazyOptions,
    ) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(|e| LazyError::io("mkdir", dir, e))?;
        let inner = Arc::new(Inner {
            store,
            cache,
            layers: RwLock::new(Vec::new()),
            inflight: Mutex::new(HashMap::new()),
            opts: opts.clone(),
        });
        let mut cfg = fuser::Config::default();
        cfg.mount_options = vec![
            MountOption::RO,
            MountOption::NoSuid,
            MountOption::NoDev,
            MountOption::FSName("dsec-lazy".into()),
        ];
        cfg.n_threads = Some(opts.threads.max(1));
        let session = fuser::spawn_mount(Fs(inner.clone()), dir, &cfg).map_err(|source| {
            LazyError::Mount {
                path: dir.to_path_buf(),
                source,
            }
        })?;
        Ok(Self {
            inner,
            dir: dir.to_path_buf(),
            session: Some(session),
        })
    }

    /// Serves layer `index` (stored at `key` in the blob store) as a file; returns its
    /// path. Adding a layer twice returns the same file.
    ///
    /// With `prefetch_key`: if the store holds a [`PrefetchList`] there, its chunks are
    /// fetched in the background; if not, the layer's first reads are recorded and saved
    /// there (see [`LazyOptions::prefetch_window`]).
    pub fn add_layer(
        &self,
        key: &str,
        index: ChunkIndex,
        prefetch_key: Option<&str>,
    ) -> Result<PathBuf> {
        index.validate()?;
        let name = format!("{}.erofs", index.digest);
        let added = {
            let mut layers = self.inner.layers.write().unwrap_or_else(|e| e.into_inner());
            if layers.iter().any(|l| l.name == name) {
                None
            } else {
                let layer = Arc::new(Layer {
                    ino: layers.len() as u64 + 2,
                    name: name.clone(),
                    key: key.to_string(),
                    index,
                    counters: Counters::default(),
                    recorder: Mutex::new(None),
                });
                layers.push(layer.clone());
                Some(layer)
            }
        };
        if let Some(layer) = &added {
            // Lookups must not wait on the store: metadata comes first, synchronously.
            self.fetch_metadata(layer);
        }
        if let (Some(layer), Some(pk)) = (added, prefetch_key) {
            self.start_prefetch(&layer, pk);
        }
        Ok(self.dir.join(name))
    }

    /// Records every read of layer `digest` from now on (no window, nothing saved);
    /// [`LazyMount::take_recording`] returns them.
    pub(crate) fn record_everything(&self, digest: &str) {
        if let Some(l) = self.find(digest) {
            *l.recorder.lock().unwrap_or_else(|e| e.into_inner()) = Some(Recorder {
                save_to: String::new(),
                // A window start far ahead: `record` keeps recording and never saves.
                started: Some(Instant::now() + Duration::from_secs(1 << 30)),
                seen: Default::default(),
                order: Vec::new(),
            });
        }
    }

    /// The chunks recorded since [`LazyMount::record_everything`], in first-read order.
    pub(crate) fn take_recording(&self, digest: &str) -> Vec<u64> {
        self.find(digest)
            .and_then(|l| l.recorder.lock().unwrap_or_else(|e| e.into_inner()).take())
            .map(|r| r.order)
            .unwrap_or_default()
    }

    fn find(&self, digest: &str) -> Option<Arc<Layer>> {
        self.inner
            .layers
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .find(|l| l.index.digest == digest)
            .cloned()
    }

    /// Fetches `layer`'s metadata chunks now and waits for them.
    fn fetch_metadata(&self, layer: &Layer) {
        let mut meta = layer.index.meta.clone();
        meta.sort_unstable();
        meta.dedup();
        self.inner.fetch_chunks(layer, meta);
    }

    /// Replays `layer`'s prefetch list from `pk`, or arms its recorder when there is none.
    fn start_prefetch(&self, layer: &Arc<Layer>, pk: &str) {
        let list = match self.inner.store.get(pk) {
            Ok(Some(bytes)) => serde_json::from_slice::<PrefetchList>(&bytes)
                .ok()
                .filter(|l| {
                    l.digest == layer.index.digest && l.chunk_size == layer.index.chunk_size
                }),
            Ok(None) => None,
            Err(e) => {
                // Neither replay nor record: another node may have written the list.
                tracing::warn!(layer = %layer.index.digest, error = %e, "reading the prefetch list");
                return;
            }
        };
        match list {
            Some(list) => self.inner.prefetch(layer, list),
            None if !self.inner.opts.prefetch_window.is_zero() => {
                *layer.recorder.lock().unwrap_or_else(|e| e.into_inner()) = Some(Recorder {
                    save_to: pk.to_string(),
                    started: None,
                    seen: Default::default(),
                    order: Vec::new(),
                });
            }
            None => {}
        }
    }

    /// Accounting of layer `digest` (hex), if served here.
    pub fn stats(&self, digest: &str) -> Option<LayerStats> {
        let layers = self.inner.layers.read().unwrap_or_else(|e| e.into_inner());
        let l = layers.iter().find(|l| l.index.digest == digest)?;
        Some(l.counters.snapshot())
    }

    /// Accounting of every layer served here, by digest (hex).
    pub fn all_stats(&self) -> Vec<(String, LayerStats)> {
        let digests: Vec<String> = self
            .inner
            .layers
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|l| l.index.digest.clone())
            .collect();
        digests
            .into_iter()
            .filter_map(|d| self.stats(&d).map(|s| (d, s)))
            .collect()
    }

    /// The mount point.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Bytes the chunk cache holds.
    pub fn chunk_cache_bytes(&self) -> u64 {
        self.inner.cache.held_bytes()
    }

    /// Whether the FUSE session still runs (it ends when the mount goes away).
    pub fn is_serving(&self) -> bool {
        self.session
            .as_ref()
            .is_some_and(|s| !s.guard.is_finished())
    }
}
