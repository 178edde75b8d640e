//! File requests: read, write, list, stat, mkdir, remove, rename.
//!
//! All paths go through [`crate::pathsafe`]. Reads and writes are streamed in chunks of
//! `DATA_CHUNK`, so file size never matters for memory. Writes go to a temporary file in
//! the target directory that is renamed into place only after the final `Eof`; any failure
//! or disconnect removes the temporary file and leaves an existing file untouched.

use std::ffi::OsStr;
use std::fs::File;
use std::io::Write;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;

use dsec_wire::agent::{FileInfo, FileKind, Reply};
use dsec_wire::frame::{Frame, DATA_CHUNK};
use dsec_wire::{ApiError, ErrorCode};

use crate::conn::{DataKind, FrameReader, FrameWriter};
use crate::error::{bad_request, io_err, thread_error, ApiResult};
use crate::pathsafe::{open_beneath, SandboxPath};
use crate::server::Agent;
use crate::sys;

/// Builds wire metadata from a `stat` result.
pub fn file_info(path: &SandboxPath, st: &libc::stat, target: Option<Vec<u8>>) -> FileInfo {
    let kind = match st.st_mode & libc::S_IFMT {
        libc::S_IFREG => FileKind::File,
        libc::S_IFDIR => FileKind::Dir,
        libc::S_IFLNK => FileKind::Symlink,
        _ => FileKind::Other,
    };
    FileInfo {
        name: path.name().to_string(),
        path: path.as_str().to_string(),
        kind,
        size: st.st_size as u64,
        mode: st.st_mode & 0o7777,
        mtime: st.st_mtime,
        uid: st.st_uid,
        gid: st.st_gid,
        symlink_target: target.map(|t| String::from_utf8_lossy(&t).into_owned()),
    }
}

/// `lstat` of `name` in `dir`, with the symlink target for links.
fn lstat_at(dir: BorrowedFd<'_>, name: &str, path: &SandboxPath) -> ApiResult<FileInfo> {
    let c = sys::cstr(name.as_bytes()).map_err(|e| io_err(&e, "stat", path.as_str()))?;
    let st = sys::fstatat(dir, &c, true).map_err(|e| io_err(&e, "stat", path.as_str()))?;
    let target = if st.st_mode & libc::S_IFMT == libc::S_IFLNK {
        sys::readlinkat(dir, &c).ok()
    } else {
        None
    };
    Ok(file_info(path, &st, target))
}

/// Handles `FileRead`: `File`, then `Data` frames, then `Eof`.
pub async fn read(
    agent: &Agent,
    path: &str,
    offset: u64,
    length: Option<u64>,
    wr: &mut FrameWriter,
) -> std::io::Result<()> {
    let opened = agent.root.path(path).and_then(|p| {
        let fd = agent
            .root
            .open(&p, libc::O_RDONLY)
            .map_err(|e| io_err(&e, "open", path))?;
        let st = sys::fstat(fd.as_fd()).map_err(|e| io_err(&e, "stat", path))?;
        if st.st_mode & libc::S_IFMT == libc::S_IFDIR {
            return Err(bad_request(format!("{p} is a directory")));
        }
        Ok((p, fd, st))
    });
    let (p, fd, st) = match opened {
        Ok(v) => v,
        Err(e) => return wr.error(e).await,
    };
    wr.reply(&Reply::File(file_info(&p, &st, None))).await?;
    let file = File::from(fd);
    let mut pos = offset;
    let end = length.map(|l| offset.saturating_add(l));
    let mut buf = vec![0u8; DATA_CHUNK];
    loop {
        let want = match end {
            Some(end) if pos >= end => break,
            Some(end) => ((end - pos) as usize).min(DATA_CHUNK),
            None => DATA_CHUNK,
        };
        // The kernel refuses (EINVAL) a read whose end passes the largest file offset,
        // which after the `File` reply would cut the answer: there is nothing there.
        let want = want.min((i64::MAX as u64).saturating_sub(pos) as usize);
        if want == 0 {
            break;
        }
        let n = match file.read_at(&mut buf[..want], pos) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return wr.error(io_err(&e, "read", p.as_str())).await,
        };
        wr.data(DataKind::Data, &buf[..n]).await?;
        pos += n as u64;
    }
    wr.eof().await
}

/// Removes a temporary upload file unless it was committed.
struct TempGuard<'a> {
    dir: BorrowedFd<'a>,
    name: Option<std::ffi::CString>,
}

impl Drop for TempGuard<'_> {
    fn drop(&mut self) {
        if let Some(name) = self.name.take() {
            let _ = sys::unlinkat(self.dir, &name, false);
        }
    }
}

/// A random name for a temporary file next to `name`.
pub fn temp_name(name: &str) -> String {
    let short: String = name.chars().take(100).collect();
    format!(".{short}.dsec-tmp-{:016x}", rand::random::<u64>())
}

/// Opens the parent of `p`, creating it first if asked.
fn parent_dir(agent: &Agent, p: &SandboxPath, create: bool) -> ApiResult<(OwnedFd, String)> {
    if create && !p.is_root() {
        agent
            .root
            .mkdir_p(&p.parent())
            .map_err(|e| io_err(&e, "create parents of", p.as_str()))?;
    }
    agent.root.parent(p)
}

/// Handles `FileWrite`: `Data` frames until `Eof` into a temp file, then rename.
pub async fn write(
    agent: &Agent,
    path: &str,
    mode: Option<u32>,
    create_parents: bool,
    rd: &mut FrameReader,
    wr: &mut FrameWriter,
) -> std::io::Result<()> {
    let prepared = agent.root.path(path).and_then(|p| {
        let (dir, name) = parent_dir(agent, &p, create_parents)?;
        let cname = sys::cstr(name.as_bytes()).map_err(|e| io_err(&e, "write", path))?;
        // Keep an existing file's permissions unless a mode is given.
        let mut keep_mode = None;
        match sys::fstatat(dir.as_fd(), &cname, true) {
            Ok(st) if st.st_mode & libc::S_IFMT == libc::S_IFDIR => {
                return Err(bad_request(format!("{p} is a directory")));
            }
            Ok(st) if st.st_mode & libc::S_IFMT == libc::S_IFREG => {
                keep_mode = Some(st.st_mode & 0o7777)
            }
            _ => {}
        }
        let mode = mode.or(keep_mode).unwrap_or(0o644) & 0o7777;
        Ok((p, dir, cname, mode))
    });
    let (p, dir, cname, mode) = match prepared {
        Ok(v) => v,
        Err(e) => {
            return wr.error(e).await;
        }
    };
    let tmp = temp_name(p.name());
    let tmp_c = match sys::cstr(tmp.as_bytes()) {
        Ok(c) => c,
        Err(e) => {
            return wr.error(io_err(&e, "write", p.as_str())).await;
        }
    };
    let fd = match sys::openat(
        dir.as_fd(),
        &tmp_c,
        libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW,
        0o600,
    ) {
        Ok(fd) => fd,
        Err(e) => {
            return wr
                .error(io_err(&e, "create temporary file for", p.as_str()))
                .await;
        }
    };
    let mut guard = TempGuard {
        dir: dir.as_fd(),
        name: Some(tmp_c.clone()),
    };
    let mut file = File::from(fd);
    let mut bytes = 0u64;
    // A failure answers at once, without reading the rest: the node stops sending when
    // the connection closes, so a 10 GiB upload into a full disk ends at the first
    // ENOSPC instead of after 10 GiB. The guard removes the temporary file first.
    loop {
        match rd.next().await {
            Ok(Some(Frame::Data(d))) => {
                if let Err(e) = file.write_all(&d) {
                    drop(guard);
                    return wr.error(io_err(&e, "write", p.as_str())).await;
                }
                bytes += d.len() as u64;
            }
            Ok(Some(Frame::Eof)) => break,
            Ok(Some(_)) => {
                drop(guard);
                return wr
                    .error(bad_request("unexpected frame in file upload"))
                    .await;
            }
            // Disconnect before Eof: the guard removes the temporary file.
            Ok(None) | Err(_) => return Ok(()),
        }
    }
    let commit = sys::fchmod(file.as_fd(), mode)
        .and_then(|()| sys::renameat(dir.as_fd(), &tmp_c, dir.as_fd(), &cname));
    match commit {
        Ok(()) => {
            guard.name = None;
            wr.reply(&Reply::Written { bytes }).await
        }
        Err(e) => {
            drop(guard);
            wr.error(io_err(&e, "write", p.as_str())).await
        }
    }
}

/// Handles `FileList`.
pub fn list(agent: &Agent, path: &str) -> ApiResult<Reply> {
    let p = agent.root.path(path)?;
    let fd = agent
        .root
        .open(&p, libc::O_RDONLY | libc::O_DIRECTORY)
        .map_err(|e| io_err(&e, "list", p.as_str()))?;
    let mut names = sys::read_dir_names(fd.as_fd()).map_err(|e| io_err(&e, "list", p.as_str()))?;
    names.sort();
    let mut entries = Vec::with_capacity(names.len());
    for name in names {
        let name = String::from_utf8_lossy(&name).into_owned();
        let child = p.join(&name);
        match lstat_at(fd.as_fd(), &name, &child) {
            Ok(info) => entries.push(info),
            Err(e) if e.code == ErrorCode::NotFound => continue, // removed meanwhile
            Err(e) => return Err(e),
        }
    }
    Ok(Reply::Entries { entries })
}

/// Handles `FileStat` (no follow of a final symlink).
pub fn stat(agent: &Agent, path: &str) -> ApiResult<Reply> {
    let p = agent.root.path(path)?;
    if p.is_root() {
        let st = sys::fstat(agent.root.fd()).map_err(|e| io_err(&e, "stat", "/"))?;
        return Ok(Reply::File(file_info(&p, &st, None)));
    }
    let (dir, name) = agent.root.parent(&p)?;
    lstat_at(dir.as_fd(), &name, &p).map(Reply::File)
}

/// Handles `FileHash`: the sha256 of a regular file, read on a blocking thread so a
/// large file does not stall the agent's other requests.
pub async fn hash(agent: &Agent, path: &str) -> ApiResult<Reply> {
    use sha2::Digest;
    let p = agent.root.path(path)?;
    let fd = agent
        .root
        .open(&p, libc::O_RDONLY)
        .map_err(|e| io_err(&e, "open", p.as_str()))?;
    let st = sys::fstat(fd.as_fd()).map_err(|e| io_err(&e, "stat", p.as_str()))?;
    if st.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Err(bad_request(format!("{p} is not a regular file")));
    }
    let shown = p.as_str().to_string();
    // A thread of its own (not tokio's blocking pool, which panics when it cannot start
    // one): under an exhausted process limit this is the caller's `conflict`.
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    let hashing = move || {
        let file = File::from(fd);
        let mut hasher = sha2::Sha256::new();
        let mut buf = vec![0u8; DATA_CHUNK];
        let mut pos = 0u64;
        loop {
            match file.read_at(&mut buf, pos) {
                Ok(0) => break,
                Ok(n) => {
                    hasher.update(&buf[..n]);
                    pos += n as u64;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(io_err(&e, "read", &shown)),
            }
        }
        Ok((format!("{:x}", hasher.finalize()), pos))
    };
    std::thread::Builder::new()
        .name("dsec-hash".into())
        .spawn(move || {
            let _ = done_tx.send(hashing());
        })
        .map_err(|e| thread_error(&e, &format!("hashing {p}")))?;
    let hashed = done_rx.await.map_err(|_| {
        ApiError::new(ErrorCode::Internal, format!("hashing {p}: the thread died"))
    })??;
    Ok(Reply::Hashed {
        sha256: hashed.0,
        size: hashed.1,
    })
}

/// Handles `FileMkdir` (`mkdir -p`).
pub fn mkdir(agent: &Agent, path: &str) -> ApiResult<Reply> {
    let p = agent.root.path(path)?;
    agent
        .root
        .mkdir_p(&p)
        .map_err(|e| io_err(&e, "mkdir", p.as_str()))?;
    Ok(Reply::Ok)
}

/// Handles `FileRemove`.
pub fn remove(agent: &Agent, path: &str, recursive: bool) -> ApiResult<Reply> {
    let p = agent.root.path(path)?;
    if p.is_root() {
        return Err(ApiError::new(
            ErrorCode::InvalidPath,
            "refusing to remove /",
        ));
    }
    let (dir, name) = agent.root.parent(&p)?;
    let c = sys::cstr(name.as_bytes()).map_err(|e| io_err(&e, "remove", p.as_str()))?;
    let st = sys::fstatat(dir.as_fd(), &c, true).map_err(|e| io_err(&e, "remove", p.as_str()))?;
    let res = if st.st_mode & libc::S_IFMT == libc::S_IFDIR {
        if recursive {
            remove_tree(dir.as_fd(), name.as_bytes())
        } else {
            sys::unlinkat(dir.as_fd(), &c, true)
        }
    } else {
        sys::unlinkat(dir.as_fd(), &c, false)
    };
    res.map_err(|e| {
        let mut err = io_err(&e, "remove", p.as_str());
        if e.raw_os_error() == Some(libc::ENOTEMPTY) {
            err.message = format!("remove {p}: directory not empty (set recursive)");
        }
        err
    })?;
    Ok(Reply::Ok)
}

/// Removes the directory `name` in `dir` and everything below it, never following
/// symlinks.
pub fn remove_tree(dir: BorrowedFd<'_>, name: &[u8]) -> std::io::Result<()> {
    let sub = open_beneath(dir, name, libc::O_RDONLY | libc::O_DIRECTORY)?;
    for child in sys::read_dir_names(sub.as_fd())? {
        let c = sys::cstr(&child)?;
        let st = match sys::fstatat(sub.as_fd(), &c, true) {
            Ok(st) => st,
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => continue,
            Err(e) => return Err(e),
        };
        if st.st_mode & libc::S_IFMT == libc::S_IFDIR {
            remove_tree(sub.as_fd(), &child)?;
        } else {
            match sys::unlinkat(sub.as_fd(), &c, false) {
                Err(e) if e.raw_os_error() != Some(libc::ENOENT) => return Err(e),
                _ => {}
            }
        }
    }
    drop(sub);
    sys::unlinkat(dir, &sys::cstr(name)?, true)
}

/// Handles `FileRename`.
pub fn rename(agent: &Agent, from: &str, to: &str) -> ApiResult<Reply> {
    let pf = agent.root.path(from)?;
    let pt = agent.root.path(to)?;
    let (df, nf) = agent.root.parent(&pf)?;
    let (dt, nt) = agent.root.parent(&pt)?;
    let what = format!("{pf} -> {pt}");
    let cf = sys::cstr(nf.as_bytes()).map_err(|e| io_err(&e, "rename", &what))?;
    let ct = sys::cstr(nt.as_bytes()).map_err(|e| io_err(&e, "rename", &what))?;
    sys::renameat(df.as_fd(), &cf, dt.as_fd(), &ct).map_err(|e| io_err(&e, "rename", &what))?;
    Ok(Reply::Ok)
}

/// Lossy display of raw name bytes.
pub fn show(name: &[u8]) -> String {
    OsStr::from_bytes(name).to_string_lossy().into_owned()
}
