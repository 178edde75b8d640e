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
use crate::error::{bad_request, internal, io_err};
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
        return wr
            .error(internal(format!("starting tar thread: {e}")))
            .await;
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
    match single {
        Some(name) => append_entry(&mut builder, dir.as_fd(), name.as_bytes(), name.as_bytes())
            .map_err(fail)?,
        None => append_dir_contents(&mut builder, dir.as_fd(), b"").map_err(fail)?,
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

/// Appends every entry of `dir` (recursively) with names prefixed by `prefix`.
fn append_dir_contents<W: Write>(
    b: &mut tar::Builder<W>,
    dir: BorrowedFd<'_>,
    prefix: &[u8],
) -> io::Result<()> {
    let dir_r = sys::openat(dir, c".", libc::O_RDONLY | libc::O_DIRECTORY, 0)?;
    let mut names = sys::read_dir_names(dir_r.as_fd())?;
    names.sort();
    for name in names {
        let mut rel = prefix.to_vec();
        rel.extend_from_slice(&name);
        match append_entry(b, dir_r.as_fd(), &name, &rel) {
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
            let sub = open_beneath(dir, name, libc::O_RDONLY | libc::O_DIRECTORY)?;
            append_dir_contents(b, sub.as_fd(), &dir_name)
        }
        libc::S_IFREG => {
            let file = std::fs::File::from(open_beneath(dir, name, libc::O_RDONLY)?);
            let size = st.st_size as u64;
            let mut h = header_for(&st, tar::EntryType::Regular);
            h.set_size(size);
            // Exactly `size` bytes even if the file changes while we read it.
            let data = file.take(size).chain(io::repeat(0)).take(size);
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
pub async fn upload(
    agent: &Agent,
    path: &str,
    rd: &mut FrameReader,
    wr: &mut FrameWriter,
) -> io::Result<()> {
    let dest = agent.root.path(path).and_then(|p| {
        agent
            .root
            .mkdir_p(&p)
            .map_err(|e| io_err(&e, "create", p.as_str()))
            .map(|fd| (p, fd))
    });
    let (p, dest) = match dest {
        Ok(v) => v,
        Err(e) => {
            return wr.error(e).await;
        }
    };
    let (tx, rx) = mpsc::channel::<Vec<u8>>(4);
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
            let res = extract(src, dest, &dest_path);
            let _ = done_tx.send(res);
        });
    if let Err(e) = thread {
        return wr
            .error(internal(format!("starting tar thread: {e}")))
            .await;
    }
    let mut bytes = 0u64;
    loop {
        match rd.next().await {
            Ok(Some(Frame::Data(d))) => {
                bytes += d.len() as u64;
                if tx.send(d).await.is_err() {
                    // The extractor stopped on an error (e.g. no space): answer now
                    // instead of reading the rest of the archive.
                    break;
                }
            }
            Ok(Some(Frame::Eof)) => break,
            Ok(Some(_)) => continue,
            Ok(None) | Err(_) => {
                // Disconnect: stop the extractor (it sees a truncated archive).
                drop(tx);
                let _ = done_rx.await;
                return Ok(());
            }
        }
    }
    drop(tx);
    match done_rx.await {
        Ok(Ok(())) => wr.reply(&Reply::Written { bytes }).await,
        Ok(Err(e)) => wr.error(e).await,
        Err(_) => {
            wr.error(internal("tar thread ended without a result"))
                .await
        }
    }
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

fn extract<R: Read>(src: R, dest: OwnedFd, dest_path: &SandboxPath) -> Result<(), ApiError> {
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
        let parent = walk(dest.as_fd(), parents, true).map_err(|e| {
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
                let tdir = walk(dest.as_fd(), tparents, false).map_err(err)?;
                clear_slot(parent.as_fd(), &name).map_err(err)?;
                sys::linkat(
                    tdir.as_fd(),
                    &sys::cstr(tlast).map_err(err)?,
                    parent.as_fd(),
                    &name,
                )
                .map_err(err)?;
            }
            other => tracing::debug!(entry = %shown, ?other, "tar: skipping entry type"),
        }
    }
    Ok(())
}
