//! Tar download and upload.
//!
//! The `tar` crate is synchronous, so each transfer runs on a short-lived helper thread
//! that talks to the connection task through a small bounded channel: the archive is
//! streamed in `DATA_CHUNK` pieces and never held in memory whole.
//!
//! Download walks the tree with `*at` syscalls from a directory descriptor opened inside
//! the root and never follows symlinks (they are archived as symlinks). Upload extracts
//! with descriptors too: entries with absolute paths or `..` are rejected, and every
//! directory on the way is opened with `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`, so a
//! symlink in the destination (planted, or created by an earlier entry) is never followed.

use std::ffi::OsStr;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;

use dsec_wire::agent::Reply;
use dsec_wire::frame::{Frame, DATA_CHUNK};
use dsec_wire::{ApiError, ErrorCode};
use tokio::sync::{mpsc, oneshot};

use crate::conn::{DataKind, FrameReader, FrameWriter};
use crate::error::{bad_request, internal, io_err, thread_error};
use crate::files::show;
use crate::pathsafe::{open_beneath, SandboxPath};
use crate::server::Agent;
use crate::sys;

/// Messages from the download thread.
enum Msg {
    Data(Vec<u8>),
    Done(Result<(), ApiError>),
}

/// A `Write` that ships full `DATA_CHUNK` pieces to the connection task.
struct ChunkSink {
    buf: Vec<u8>,
    tx: mpsc::Sender<Msg>,
}

impl ChunkSink {
    fn ship(&mut self) -> io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let chunk = std::mem::replace(&mut self.buf, Vec::with_capacity(DATA_CHUNK));
        self.tx
            .blocking_send(Msg::Data(chunk))
            .map_err(|_| io::Error::new(io::ErrorKind::BrokenPipe, "node went away"))
    }
}

impl Write for ChunkSink {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        let n = data.len().min(DATA_CHUNK - self.buf.len());
        self.buf.extend_from_slice(&data[..n]);
        if self.buf.len() >= DATA_CHUNK {
            self.ship()?;
        }
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.ship()
    }
}

/// Handles `TarDownload`: `Data` frames with the archive, then `Eof`.
pub async fn download(agent: &Agent, path: &str, wr: &mut FrameWriter) -> io::Result<()> {
    let opened = agent.root.path(path).and_then(|p| {
        let fd = agent
            .root
            .open(&p, libc::O_PATH)
            .map_err(|e| io_err(&e, "open", p.as_str()))?;
        let st = sys::fstat(fd.as_fd()).map_err(|e| io_err(&e, "stat", p.as_str()))?;
        Ok((p, fd, st))
    });
    let (p, fd, st) = match opened {
        Ok(v) => v,
        Err(e) => return wr.error(e).await,
    };
    let is_dir = st.st_mode & libc::S_IFMT == libc::S_IFDIR;
    // A single file is archived under its name, from its parent directory.
    let (dir, single) = if is_dir {
        (fd, None)
    } else {
        match agent.root.parent(&p) {
            Ok((d, name)) => (d, Some(name)),
            Err(e) => return wr.error(e).await,
        }
    };
    let (tx, mut rx) = mpsc::channel::<Msg>(4);
    let thread = std::thread::Builder::new()
        .name("dsec-tar-down".into())
        .spawn(move || {
            let done_tx = tx.clone();
            let res = build_archive(dir, single, tx);
            let _ = done_tx.blocking_send(Msg::Done(res));
        });
    if let Err(e) = thread {
        return wr.error(thread_error(&e, "archiving")).await;
    }
    while let Some(msg) = rx.recv().await {
        match msg {
            Msg::Data(d) => wr.data(DataKind::Data, &d).await?,
            Msg::Done(Ok(())) => return wr.eof().await,
            Msg::Done(Err(e)) => return wr.error(e).await,
        }
    }
    wr.error(internal("tar thread ended without a result"))
        .await
}

fn build_archive(
    dir: OwnedFd,
    single: Option<String>,
    tx: mpsc::Sender<Msg>,
) -> Result<(), ApiError> {
    let sink = ChunkSink {
        buf: Vec::with_capacity(DATA_CHUNK),
        tx,
    };
    let mut builder = tar::Builder::new(sink);
    let fail = |e: io::Error| ApiError::new(crate::error::io_code(&e), format!("tar: {e}"));
    // The file system the archive stays on (as `tar --one-file-system`).
    let dev = sys::fstat(dir.as_fd()).map_err(fail)?.st_dev;
    match single {
        Some(name) => append_entry(
            &mut builder,
            dir.as_fd(),
            name.as_bytes(),
            name.as_bytes(),
            dev,
        )
        .map_err(fail)?,
        None => append_dir_contents(&mut builder, dir.as_fd(), b"", dev).map_err(fail)?,
    }
    let mut sink = builder.into_inner().map_err(fail)?;
    sink.flush().map_err(fail)
}

fn header_for(st: &libc::stat, kind: tar::EntryType) -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(kind);
    h.set_mode(st.st_mode & 0o7777);
    h.set_mtime(st.st_mtime.max(0) as u64);
    h.set_uid(u64::from(st.st_uid));
    h.set_gid(u64::from(st.st_gid));
    h.set_size(0);
    h
}

/// Appends every entry of `dir` (recursively) with names prefixed by `prefix`. A
/// directory on another file system than `dev` (a mount point: the sandbox's `/proc`,
/// `/sys`, `/dev`, a tmpfs) is archived empty, as `tar --one-file-system` does, so an
/// archive of `/` holds the sandbox's files and not the kernel's.
fn append_dir_contents<W: Write>(
    b: &mut tar::Builder<W>,
    dir: BorrowedFd<'_>,
    prefix: &[u8],
    dev: libc::dev_t,
) -> io::Result<()> {
    let dir_r = sys::openat(dir, c".", libc::O_RDONLY | libc::O_DIRECTORY, 0)?;
    let mut names = sys::read_dir_names(dir_r.as_fd())?;
    names.sort();
    for name in names {
        let mut rel = prefix.to_vec();
        rel.extend_from_slice(&name);
        match append_entry(b, dir_r.as_fd(), &name, &rel, dev) {
            Ok(()) => {}
            // Vanished or unreadable entries are skipped; the sink failing is fatal.
            Err(e) if e.kind() == io::ErrorKind::BrokenPipe => return Err(e),
            Err(e) => tracing::warn!(entry = %show(&rel), %e, "tar: skipping entry"),
        }
    }
    Ok(())
}

fn append_entry<W: Write>(
    b: &mut tar::Builder<W>,
    dir: BorrowedFd<'_>,
    name: &[u8],
    rel: &[u8],
    dev: libc::dev_t,
) -> io::Result<()> {
    let c = sys::cstr(name)?;
    let st = sys::fstatat(dir, &c, true)?;
    let rel_path = std::path::Path::new(OsStr::from_bytes(rel));
    match st.st_mode & libc::S_IFMT {
        libc::S_IFDIR => {
            let mut h = header_for(&st, tar::EntryType::Directory);
            let mut dir_name = rel.to_vec();
            dir_name.push(b'/');
            b.append_data(&mut h, OsStr::from_bytes(&dir_name), io::empty())?;
            if st.st_dev != dev {
                return Ok(());
            }
            let sub = open_beneath(dir, name, libc::O_RDONLY | libc::O_DIRECTORY)?;
            append_dir_contents(b, sub.as_fd(), &dir_name, dev)
        }
        libc::S_IFREG => {
            let file = std::fs::File::from(open_beneath(dir, name, libc::O_RDONLY)?);
            let size = st.st_size as u64;
            let mut h = header_for(&st, tar::EntryType::Regular);
            h.set_size(size);
            // Exactly `size` bytes even if the file changes or fails while we read it:
            // its header is out, so anything else would break the rest of the archive.
            let data = ZeroOnError {
                inner: file,
                path: rel_path,
                failed: false,
            }
            .take(size)
            .chain(io::repeat(0))
            .take(size);
            b.append_data(&mut h, rel_path, data)
        }
        libc::S_IFLNK => {
            let target = sys::readlinkat(dir, &c)?;
            let mut h = header_for(&st, tar::EntryType::Symlink);
            b.append_link(&mut h, rel_path, OsStr::from_bytes(&target))
        }
        _ => Ok(()), // fifos, sockets, devices are not archived
    }
}

/// A file being archived: a read error ends its data (logged), so the archive's entry
/// is padded with zeros to the size its header announced instead of being cut short.
struct ZeroOnError<'a> {
    inner: std::fs::File,
    path: &'a std::path::Path,
    failed: bool,
}

impl Read for ZeroOnError<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.failed {
            return Ok(0);
        }
        loop {
            match self.inner.read(buf) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::warn!(entry = %self.path.display(), %e, "tar: read failed; rest of the file archived as zeros");
                    self.failed = true;
                    return Ok(0);
                }
                Ok(n) => return Ok(n),
            }
        }
    }
}

/// A `Read` fed by `Data` payloads from the connection task.
struct ChunkSource {
    cur: Vec<u8>,
    pos: usize,
    rx: mpsc::Receiver<Vec<u8>>,
}

impl Read for ChunkSource {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        while self.pos >= self.cur.len() {
            match self.rx.blocking_recv() {
                Some(c) => {
                    self.cur = c;
                    self.pos = 0;
                }
                None => return Ok(0),
            }
        }
        let n = out.len().min(self.cur.len() - self.pos);
        out[..n].copy_from_slice(&self.cur[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

/// Handles `TarUpload`: extracts `Data` frames (until `Eof`) into a directory.
///
/// All or nothing: the archive is extracted into a staging directory inside the
/// destination (so on the same file system), and moved into place only after the final
/// `Eof` and a clean end of the archive. A disconnect, a bad entry or a full disk removes
/// the staging directory and leaves the destination as it was (see [`Staging`]).
pub async fn upload(
    agent: &Agent,
    path: &str,
    rd: &mut FrameReader,
    wr: &mut FrameWriter,
) -> io::Result<()> {
    let dest = agent.root.path(path).and_then(|p| {
        let created = first_missing(agent, &p);
        agent
            .root
            .mkdir_p(&p)
            .map_err(|e| io_err(&e, "create", p.as_str()))
            .map(|fd| (p, fd, created))
    });
    let (p, dest, created) = match dest {
        Ok(v) => v,
        Err(e) => {
            return wr.error(e).await;
        }
    };
    let (tx, rx) = mpsc::channel::<Vec<u8>>(4);
    let (commit_tx, commit_rx) = oneshot::channel::<()>();
    let (done_tx, done_rx) = oneshot::channel();
    let dest_path = p.clone();
    let thread = std::thread::Builder::new()
        .name("dsec-tar-up".into())
        .spawn(move || {
            let src = ChunkSource {
                cur: Vec::new(),
                pos: 0,
                rx,
            };
            let res = extract_staged(src, dest, &dest_path, commit_rx);
            let _ = done_tx.send(res);
        });
    if let Err(e) = thread {
        return wr.error(thread_error(&e, "extracting")).await;
    }
    let mut bytes = 0u64;
    // Whether the sender finished (`Eof`) or went away; a stop of the extractor on an
    // error (e.g. no space) ends the loop early too, and is answered at once instead of
    // reading the rest of the archive.
    let mut sender_done = false;
    let mut gone = false;
    loop {
        match rd.next().await {
            Ok(Some(Frame::Data(d))) => {
                bytes += d.len() as u64;
                if tx.send(d).await.is_err() {
                    break;
                }
            }
            Ok(Some(Frame::Eof)) => {
                sender_done = true;
                break;
            }
            Ok(Some(_)) => continue,
            // Disconnect: the archive may look whole (cut between two entries), so it
            // is never committed; the extractor removes what it staged.
            Ok(None) | Err(_) => {
                gone = true;
                break;
            }
        }
    }
    drop(tx);
    if sender_done {
        let _ = commit_tx.send(());
    } else {
        drop(commit_tx);
    }
    let res = match done_rx.await {
        Ok(Ok(())) if !sender_done => Err(internal("tar extraction ended without a commit")),
        Ok(res) => res,
        Err(_) => Err(internal("tar thread ended without a result")),
    };
    if res.is_err() {
        // Directories this upload made for its destination go too (only while empty).
        remove_created(agent, &p, created.as_ref());
    }
    if gone {
        return Ok(());
    }
    match res {
        Ok(()) => wr.reply(&Reply::Written { bytes }).await,
        Err(e) => wr.error(e).await,
    }
}

/// The first component of `p` that does not exist yet (what `mkdir_p` will create), if any.
fn first_missing(agent: &Agent, p: &SandboxPath) -> Option<SandboxPath> {
    let mut prefix = agent.root.path("/").ok()?;
    for comp in p.as_str().split('/').filter(|c| !c.is_empty()) {
        prefix = prefix.join(comp);
        if let Err(e) = agent.root.open_dir(&prefix) {
            return (e.raw_os_error() == Some(libc::ENOENT)).then_some(prefix);
        }
    }
    None
}

/// Removes the empty directories from `p` up to `created` (the first one the upload made).
fn remove_created(agent: &Agent, p: &SandboxPath, created: Option<&SandboxPath>) {
    let Some(created) = created else {
        return;
    };
    let mut cur = p.clone();
    loop {
        if let Ok((dir, name)) = agent.root.parent(&cur) {
            if let Ok(c) = sys::cstr(name.as_bytes()) {
                // rmdir: fails (and stops here) on anything not empty.
                if sys::unlinkat(dir.as_fd(), &c, true).is_err() {
                    return;
                }
            }
        }
        if cur.as_str() == created.as_str() || cur.is_root() {
            return;
        }
        cur = cur.parent();
    }
}

/// A staging directory (`.dsec-tar-<random>`, mode 0700) inside an upload's destination.
/// Dropping it removes it with whatever is still inside, on every path: a committed
/// upload has moved everything out by then.
struct Staging {
    dest: OwnedFd,
    name: std::ffi::CString,
    dir: OwnedFd,
}

impl Staging {
    fn new(dest: OwnedFd) -> io::Result<Staging> {
        let name = sys::cstr(format!(".dsec-tar-{:016x}", rand::random::<u64>()).as_bytes())?;
        sys::mkdirat(dest.as_fd(), &name, 0o700)?;
        let dir = match open_beneath(
            dest.as_fd(),
            name.as_bytes(),
            libc::O_PATH | libc::O_DIRECTORY,
        ) {
            Ok(d) => d,
            Err(e) => {
                let _ = sys::unlinkat(dest.as_fd(), &name, true);
                return Err(e);
            }
        };
        Ok(Staging { dest, name, dir })
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if let Err(e) = remove_tree(self.dest.as_fd(), &self.name) {
            tracing::warn!(error = %e, "tar: removing the staging directory");
        }
    }
}

/// `rm -r` of `name` in `dir`, never following symlinks.
fn remove_tree(dir: BorrowedFd<'_>, name: &std::ffi::CStr) -> io::Result<()> {
    let st = match sys::fstatat(dir, name, true) {
        Ok(st) => st,
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(()),
        Err(e) => return Err(e),
    };
    if st.st_mode & libc::S_IFMT != libc::S_IFDIR {
        return sys::unlinkat(dir, name, false);
    }
    let sub = open_beneath(dir, name.to_bytes(), libc::O_RDONLY | libc::O_DIRECTORY)?;
    for child in sys::read_dir_names(sub.as_fd())? {
        remove_tree(sub.as_fd(), &sys::cstr(&child)?)?;
    }
    sys::unlinkat(dir, name, true)
}

/// Entry point of the `agent_tar_upload` cargo fuzz target (`fuzz/` at the repository
/// root): extracts the archive `src` into the directory `dest` as a whole, committed
/// `TarUpload` does (staged, then merged).
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub fn fuzz_upload<R: Read>(src: R, dest: &std::path::Path) -> Result<(), ApiError> {
    let dest_path = crate::pathsafe::normalize("/upload", "/")?;
    let dir = std::fs::File::open(dest).map_err(|e| io_err(&e, "open", dest_path.as_str()))?;
    let (commit_tx, commit_rx) = oneshot::channel();
    let _ = commit_tx.send(());
    extract_staged(src, OwnedFd::from(dir), &dest_path, commit_rx)
}

/// Extracts into a [`Staging`] directory, then, once `commit` fires (the whole archive
/// arrived), moves the staged tree into `dest`. Any error, or `commit` dropped, leaves
/// `dest` untouched.
fn extract_staged<R: Read>(
    mut src: R,
    dest: OwnedFd,
    dest_path: &SandboxPath,
    commit: oneshot::Receiver<()>,
) -> Result<(), ApiError> {
    let dest_w = sys::openat(dest.as_fd(), c".", libc::O_PATH | libc::O_DIRECTORY, 0)
        .map_err(|e| io_err(&e, "open", dest_path.as_str()))?;
    let staging = Staging::new(dest)
        .map_err(|e| io_err(&e, "create staging directory in", dest_path.as_str()))?;
    let explicit_dirs = extract(&mut src, staging.dir.as_fd(), dest_w.as_fd(), dest_path)?;
    // Whatever follows the end of the archive (record padding) is read and dropped, so
    // the sender is never left blocked.
    let _ = io::copy(&mut src, &mut io::sink());
    drop(src);
    if commit.blocking_recv().is_err() {
        return Err(bad_request("upload ended before the whole archive arrived"));
    }
    let stage_r = sys::openat(
        staging.dir.as_fd(),
        c".",
        libc::O_RDONLY | libc::O_DIRECTORY,
        0,
    )
    .map_err(|e| io_err(&e, "open staging directory in", dest_path.as_str()))?;
    let dest_r = sys::openat(dest_w.as_fd(), c".", libc::O_PATH | libc::O_DIRECTORY, 0)
        .map_err(|e| io_err(&e, "open", dest_path.as_str()))?;
    // Conflicts are found before anything moves, so a refused upload changes nothing.
    check_merge(stage_r.as_fd(), dest_r.as_fd(), b"", dest_path)?;
    merge(
        stage_r.as_fd(),
        dest_r.as_fd(),
        b"",
        dest_path,
        &explicit_dirs,
    )?;
    drop(staging);
    Ok(())
}

fn rel_join(prefix: &[u8], name: &[u8]) -> Vec<u8> {
    let mut rel = prefix.to_vec();
    if !rel.is_empty() {
        rel.push(b'/');
    }
    rel.extend_from_slice(name);
    rel
}

fn is_dir(st: &libc::stat) -> bool {
    st.st_mode & libc::S_IFMT == libc::S_IFDIR
}

/// One entry of a staged directory, with what has its name in the destination.
struct StagedEntry {
    name: Vec<u8>,
    /// Path below the upload's destination.
    rel: Vec<u8>,
    /// The sandbox path, for messages.
    shown: String,
    c: std::ffi::CString,
    staged: libc::stat,
    existing: Option<libc::stat>,
}

impl StagedEntry {
    fn err(&self, e: io::Error) -> ApiError {
        io_err(&e, "extract", &self.shown)
    }
}

/// The entries of the staged directory `stage` (at `prefix` below the upload's
/// destination), each with the entry of the same name in `dest`, if any. Neither side's
/// symlinks are followed.
fn staged_entries(
    stage: BorrowedFd<'_>,
    dest: BorrowedFd<'_>,
    prefix: &[u8],
    dest_path: &SandboxPath,
) -> Result<Vec<StagedEntry>, ApiError> {
    let names =
        sys::read_dir_names(stage).map_err(|e| io_err(&e, "read staged", dest_path.as_str()))?;
    names
        .into_iter()
        .map(|name| {
            let rel = rel_join(prefix, &name);
            let shown = format!("{dest_path}/{}", show(&rel));
            let err = |e: io::Error| io_err(&e, "extract", &shown);
            let c = sys::cstr(&name).map_err(err)?;
            let staged = sys::fstatat(stage, &c, true).map_err(err)?;
            let existing = match sys::fstatat(dest, &c, true) {
                Ok(st) => Some(st),
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => None,
                Err(e) => return Err(err(e)),
            };
            Ok(StagedEntry {
                name,
                rel,
                shown,
                c,
                staged,
                existing,
            })
        })
        .collect()
}

/// Refuses a staged tree that cannot replace what is in `dest`: a directory over a
/// non-directory (a symlink included: it is never followed), or the reverse.
fn check_merge(
    stage: BorrowedFd<'_>,
    dest: BorrowedFd<'_>,
    prefix: &[u8],
    dest_path: &SandboxPath,
) -> Result<(), ApiError> {
    for e in staged_entries(stage, dest, prefix, dest_path)? {
        let Some(existing) = e.existing else {
            continue;
        };
        match (is_dir(&e.staged), is_dir(&existing)) {
            (true, true) => {
                let s = open_beneath(stage, &e.name, libc::O_RDONLY | libc::O_DIRECTORY)
                    .map_err(|x| e.err(x))?;
                let d = open_beneath(dest, &e.name, libc::O_PATH | libc::O_DIRECTORY)
                    .map_err(|x| e.err(x))?;
                check_merge(s.as_fd(), d.as_fd(), &e.rel, dest_path)?;
            }
            (true, false) => {
                return Err(ApiError::new(
                    ErrorCode::InvalidPath,
                    format!(
                        "tar entry {}: a parent is a symlink or not a directory",
                        e.shown
                    ),
                ))
            }
            (false, true) => return Err(e.err(io::Error::from_raw_os_error(libc::EISDIR))),
            (false, false) => {}
        }
    }
    Ok(())
}

/// Moves the staged tree into `dest`: new entries (whole directories included) by one
/// rename each, existing directories merged, existing files and symlinks replaced
/// atomically. Across a mount point (`EXDEV`) an entry is copied next to its target
/// and renamed over it instead.
fn merge(
    stage: BorrowedFd<'_>,
    dest: BorrowedFd<'_>,
    prefix: &[u8],
    dest_path: &SandboxPath,
    explicit_dirs: &std::collections::HashMap<Vec<u8>, u32>,
) -> Result<(), ApiError> {
    for e in staged_entries(stage, dest, prefix, dest_path)? {
        let err = |x: io::Error| e.err(x);
        let both_dirs = matches!(e.existing, Some(ex) if is_dir(&e.staged) && is_dir(&ex));
        if !both_dirs {
            match sys::renameat(stage, &e.c, dest, &e.c) {
                Ok(()) => continue,
                Err(x) if x.raw_os_error() == Some(libc::EXDEV) => {}
                Err(x) => return Err(err(x)),
            }
        }
        if is_dir(&e.staged) {
            if e.existing.is_none() {
                match sys::mkdirat(dest, &e.c, e.staged.st_mode & 0o7777) {
                    Ok(()) => {}
                    Err(x) if x.raw_os_error() == Some(libc::EEXIST) => {}
                    Err(x) => return Err(err(x)),
                }
            }
            let s =
                open_beneath(stage, &e.name, libc::O_RDONLY | libc::O_DIRECTORY).map_err(err)?;
            let d = open_beneath(dest, &e.name, libc::O_RDONLY | libc::O_DIRECTORY).map_err(err)?;
            if let Some(mode) = explicit_dirs.get(&e.rel) {
                sys::fchmod(d.as_fd(), *mode).map_err(err)?;
            }
            merge(s.as_fd(), d.as_fd(), &e.rel, dest_path, explicit_dirs)?;
        } else {
            copy_over(stage, dest, &e.name, &e.staged).map_err(err)?;
        }
    }
    Ok(())
}

/// Copies the staged non-directory `name` to a temporary name in `dest` and renames it
/// over `name` there (for a destination on another mount).
fn copy_over(
    stage: BorrowedFd<'_>,
    dest: BorrowedFd<'_>,
    name: &[u8],
    st: &libc::stat,
) -> io::Result<()> {
    let c = sys::cstr(name)?;
    let tmp = sys::cstr(crate::files::temp_name(&String::from_utf8_lossy(name)).as_bytes())?;
    let made = match st.st_mode & libc::S_IFMT {
        libc::S_IFLNK => {
            let target = sys::readlinkat(stage, &c)?;
            sys::symlinkat(&sys::cstr(&target)?, dest, &tmp)
        }
        libc::S_IFREG => (|| {
            let mut from = std::fs::File::from(open_beneath(stage, name, libc::O_RDONLY)?);
            let fd = sys::openat(
                dest,
                &tmp,
                libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW,
                0o600,
            )?;
            let mut to = std::fs::File::from(fd);
            io::copy(&mut from, &mut to)?;
            sys::fchmod(to.as_fd(), st.st_mode & 0o7777)?;
            let _ = sys::set_mtime(to.as_fd(), st.st_mtime);
            Ok(())
        })(),
        _ => return Ok(()),
    };
    let res = made.and_then(|()| sys::renameat(dest, &tmp, dest, &c));
    if res.is_err() {
        let _ = sys::unlinkat(dest, &tmp, false);
    }
    res
}

/// Splits an entry path into safe components, rejecting absolute paths and `..`.
pub fn safe_components(raw: &[u8]) -> Result<Vec<&[u8]>, ApiError> {
    if raw.first() == Some(&b'/') {
        return Err(ApiError::new(
            ErrorCode::InvalidPath,
            format!("tar entry {} has an absolute path", show(raw)),
        ));
    }
    let mut out = Vec::new();
    for comp in raw.split(|b| *b == b'/') {
        match comp {
            b"" | b"." => {}
            b".." => {
                return Err(ApiError::new(
                    ErrorCode::InvalidPath,
                    format!("tar entry {} escapes the destination", show(raw)),
                ))
            }
            c => out.push(c),
        }
    }
    Ok(out)
}

/// Opens (creating if asked) the directory chain `comps` below `base`, never following
/// symlinks.
fn walk(base: BorrowedFd<'_>, comps: &[&[u8]], create: bool) -> io::Result<OwnedFd> {
    let mut cur = sys::openat(base, c".", libc::O_PATH | libc::O_DIRECTORY, 0)?;
    for comp in comps {
        let next = match open_beneath(cur.as_fd(), comp, libc::O_PATH | libc::O_DIRECTORY) {
            Ok(fd) => fd,
            Err(e) if create && e.raw_os_error() == Some(libc::ENOENT) => {
                match sys::mkdirat(cur.as_fd(), &sys::cstr(comp)?, 0o755) {
                    Ok(()) => {}
                    Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
                    Err(e) => return Err(e),
                }
                open_beneath(cur.as_fd(), comp, libc::O_PATH | libc::O_DIRECTORY)?
            }
            Err(e) => return Err(e),
        };
        cur = next;
    }
    Ok(cur)
}

/// Removes a non-directory `name` in `dir` if present, so a new entry can take its place.
fn clear_slot(dir: BorrowedFd<'_>, name: &std::ffi::CStr) -> io::Result<()> {
    match sys::fstatat(dir, name, true) {
        Ok(st) if st.st_mode & libc::S_IFMT == libc::S_IFDIR => {
            Err(io::Error::from_raw_os_error(libc::EISDIR))
        }
        Ok(_) => sys::unlinkat(dir, name, false),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        Err(e) => Err(e),
    }
}

/// Extracts the archive into `stage`. Hard links may name files already in `dest`.
/// Returns the modes of the directories the archive names (relative path to mode), which
/// apply to directories that already exist in `dest` too.
fn extract<R: Read>(
    src: R,
    stage: BorrowedFd<'_>,
    dest: BorrowedFd<'_>,
    dest_path: &SandboxPath,
) -> Result<std::collections::HashMap<Vec<u8>, u32>, ApiError> {
    let mut dir_modes = std::collections::HashMap::new();
    let mut archive = tar::Archive::new(src);
    let entries = archive
        .entries()
        .map_err(|e| bad_request(format!("reading tar: {e}")))?;
    for entry in entries {
        let mut entry = entry.map_err(|e| bad_request(format!("reading tar: {e}")))?;
        let raw = entry.path_bytes().into_owned();
        let comps = safe_components(&raw)?;
        let Some((last, parents)) = comps.split_last() else {
            continue;
        };
        let shown = format!("{dest_path}/{}", show(&raw));
        let err = |e: io::Error| io_err(&e, "extract", &shown);
        let parent = walk(stage, parents, true).map_err(|e| {
            if e.raw_os_error() == Some(libc::ELOOP) || e.raw_os_error() == Some(libc::ENOTDIR) {
                ApiError::new(
                    ErrorCode::InvalidPath,
                    format!("tar entry {shown}: a parent is a symlink or not a directory"),
                )
            } else {
                err(e)
            }
        })?;
        let name = sys::cstr(last).map_err(err)?;
        let header = entry.header();
        let mode = header.mode().unwrap_or(0o644) & 0o7777;
        let mtime = header.mtime().ok();
        match header.entry_type() {
            tar::EntryType::Directory => {
                match sys::mkdirat(parent.as_fd(), &name, 0o755) {
                    Ok(()) => {}
                    Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
                    Err(e) => return Err(err(e)),
                }
                let d = open_beneath(parent.as_fd(), last, libc::O_RDONLY | libc::O_DIRECTORY)
                    .map_err(err)?;
                sys::fchmod(d.as_fd(), mode).map_err(err)?;
                dir_modes.insert(comps.join(&b'/'), mode);
            }
            tar::EntryType::Regular | tar::EntryType::Continuous => {
                clear_slot(parent.as_fd(), &name).map_err(err)?;
                let fd = sys::openat(
                    parent.as_fd(),
                    &name,
                    libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW,
                    0o600,
                )
                .map_err(err)?;
                let mut file = std::fs::File::from(fd);
                io::copy(&mut entry, &mut file).map_err(err)?;
                sys::fchmod(file.as_fd(), mode).map_err(err)?;
                if let Some(m) = mtime {
                    let _ = sys::set_mtime(file.as_fd(), m as i64);
                }
            }
            tar::EntryType::Symlink => {
                let target = entry
                    .link_name_bytes()
                    .ok_or_else(|| {
                        bad_request(format!("tar entry {shown}: symlink without target"))
                    })?
                    .into_owned();
                clear_slot(parent.as_fd(), &name).map_err(err)?;
                sys::symlinkat(&sys::cstr(&target).map_err(err)?, parent.as_fd(), &name)
                    .map_err(err)?;
            }
            tar::EntryType::Link => {
                let target = entry
                    .link_name_bytes()
                    .ok_or_else(|| bad_request(format!("tar entry {shown}: link without target")))?
                    .into_owned();
                let tcomps = safe_components(&target)?;
                let Some((tlast, tparents)) = tcomps.split_last() else {
                    return Err(bad_request(format!("tar entry {shown}: empty link target")));
                };
                let tname = sys::cstr(tlast).map_err(err)?;
                // An earlier entry of this archive, else a file already in the destination.
                let staged = walk(stage, tparents, false)
                    .ok()
                    .filter(|d| sys::fstatat(d.as_fd(), &tname, true).is_ok());
                let tdir = match staged {
                    Some(d) => d,
                    None => walk(dest, tparents, false).map_err(err)?,
                };
                clear_slot(parent.as_fd(), &name).map_err(err)?;
                sys::linkat(tdir.as_fd(), &tname, parent.as_fd(), &name).map_err(err)?;
            }
            other => tracing::debug!(entry = %shown, ?other, "tar: skipping entry type"),
        }
    }
    Ok(dir_modes)
}
