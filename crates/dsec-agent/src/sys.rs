//! Thin safe wrappers over the raw syscalls the agent needs (`openat2`, the `*at` family,
//! `killpg`, `poll`, ...).
//!
//! Every `unsafe` block of the crate that touches libc outside `pre_exec` lives here, each
//! with its safety argument. All functions return `io::Error` built from `errno`.

use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

/// Converts a path component or path to a C string; a NUL byte is an `InvalidInput` error.
pub fn cstr(bytes: &[u8]) -> io::Result<CString> {
    CString::new(bytes)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))
}

fn check(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// Wraps a freshly returned file descriptor.
fn owned(fd: libc::c_int) -> io::Result<OwnedFd> {
    let fd = check(fd)?;
    // SAFETY: the kernel just returned this descriptor to us and nobody else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `openat2(2)` with the given `resolve` flags; `O_CLOEXEC` is always added.
pub fn openat2(
    dir: BorrowedFd<'_>,
    path: &CStr,
    flags: libc::c_int,
    mode: u32,
    resolve: u64,
) -> io::Result<OwnedFd> {
    if NO_OPENAT2.load(std::sync::atomic::Ordering::Relaxed) {
        return openat2_emulated(dir, path, flags, mode, resolve);
    }
    let mut how: libc::open_how =
        // SAFETY: open_how is a plain C struct of integers; all-zero is a valid value.
        unsafe { std::mem::zeroed() };
    how.flags = (flags | libc::O_CLOEXEC) as u64;
    how.mode = if flags & (libc::O_CREAT | libc::O_TMPFILE) != 0 {
        u64::from(mode)
    } else {
        0
    };
    how.resolve = resolve;
    loop {
        // SAFETY: `path` is a valid C string, `how` a valid open_how of the size we pass;
        // the kernel does not retain either pointer.
        let ret = unsafe {
            libc::syscall(
                libc::SYS_openat2,
                dir.as_raw_fd(),
                path.as_ptr(),
                &how as *const libc::open_how,
                std::mem::size_of::<libc::open_how>(),
            )
        };
        if ret < 0 {
            let err = io::Error::last_os_error();
            // EAGAIN: a concurrent rename raced a RESOLVE_IN_ROOT lookup; retry.
            if matches!(err.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EINTR)) {
                continue;
            }
            if err.raw_os_error() == Some(libc::ENOSYS) {
                NO_OPENAT2.store(true, std::sync::atomic::Ordering::Relaxed);
                return openat2_emulated(dir, path, flags, mode, resolve);
            }
            return Err(err);
        }
        return owned(ret as libc::c_int);
    }
}

/// Set once the kernel answered `openat2` with `ENOSYS` (gVisor before 2023).
static NO_OPENAT2: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// What `openat2` does with the two resolve sets the agent uses, for kernels without it
/// (gVisor's before 2023), where the agent's root is the sandbox's own root:
/// - `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`: each component opened with `O_NOFOLLOW`,
///   no absolute path and no `..` (`EXDEV`), a symlink anywhere `ELOOP`;
/// - `RESOLVE_IN_ROOT`: only from a descriptor of `/` itself, where `..` and absolute
///   symlinks stop at the root anyway; `RESOLVE_NO_MAGICLINKS` becomes a refusal of
///   anything on procfs (`ELOOP`), where magic links live.
///
/// Any other use is `ENOSYS`, as before.
fn openat2_emulated(
    dir: BorrowedFd<'_>,
    path: &CStr,
    flags: libc::c_int,
    mode: u32,
    resolve: u64,
) -> io::Result<OwnedFd> {
    let errno = |e| io::Error::from_raw_os_error(e);
    let bytes = path.to_bytes();
    if resolve & libc::RESOLVE_NO_SYMLINKS != 0 && resolve & libc::RESOLVE_BENEATH != 0 {
        if bytes.starts_with(b"/") {
            return Err(errno(libc::EXDEV));
        }
        let parts: Vec<&[u8]> = bytes
            .split(|b| *b == b'/')
            .filter(|p| !p.is_empty() && *p != b".")
            .collect();
        if parts.iter().any(|p| *p == b"..") {
            return Err(errno(libc::EXDEV));
        }
        let Some((last, dirs)) = parts.split_last() else {
            return openat(dir, c".", flags, mode);
        };
        let mut held: Option<OwnedFd> = None;
        for part in dirs {
            let at = held.as_ref().map_or(dir, |f| f.as_fd());
            let next = openat(
                at,
                &cstr(part)?,
                libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW,
                0,
            )
            .map_err(|e| match e.raw_os_error() {
                Some(libc::ENOTDIR) => errno(libc::ELOOP),
                _ => e,
            })?;
            held = Some(next);
        }
        let at = held.as_ref().map_or(dir, |f| f.as_fd());
        let fd = openat(at, &cstr(last)?, flags | libc::O_NOFOLLOW, mode)?;
        if fstat(fd.as_fd())?.st_mode & libc::S_IFMT == libc::S_IFLNK {
            return Err(errno(libc::ELOOP));
        }
        return Ok(fd);
    }
    if resolve & libc::RESOLVE_IN_ROOT != 0 {
        let here = fstat(dir)?;
        let root = fstatat(dir, c"/", false)?;
        if (here.st_dev, here.st_ino) != (root.st_dev, root.st_ino) {
            return Err(errno(libc::ENOSYS));
        }
        return open_in_root(dir, bytes, flags, mode);
    }
    Err(errno(libc::ENOSYS))
}

/// Symlinks one lookup follows at most (the kernel's limit).
const MAX_SYMLINKS: usize = 40;

/// Resolves `path` from `root` (a descriptor of `/`) one component at a time, following
/// symlinks itself: `..` stops at the root, and a symlink on procfs (where the magic
/// links are) is refused with `ELOOP`. The final component is opened with `flags`
/// (followed if a symlink, unless `flags` has `O_NOFOLLOW`).
fn open_in_root(
    root: BorrowedFd<'_>,
    path: &[u8],
    flags: libc::c_int,
    mode: u32,
) -> io::Result<OwnedFd> {
    let errno = |e| io::Error::from_raw_os_error(e);
    let mut todo: std::collections::VecDeque<Vec<u8>> = path
        .split(|b| *b == b'/')
        .filter(|p| !p.is_empty() && *p != b".")
        .map(<[u8]>::to_vec)
        .collect();
    let mut cur: Option<OwnedFd> = None;
    let mut links = 0;
    while let Some(part) = todo.pop_front() {
        let at = cur.as_ref().map_or(root, |f| f.as_fd());
        let name = cstr(&part)?;
        let last = todo.is_empty();
        let probe = openat(at, &name, libc::O_PATH | libc::O_NOFOLLOW, 0);
        let probe = match probe {
            Ok(fd) => fd,
            // The final component may not exist yet (O_CREAT).
            Err(e) if last && e.raw_os_error() == Some(libc::ENOENT) => {
                return openat(at, &name, flags | libc::O_NOFOLLOW, mode)
            }
            Err(e) => return Err(e),
        };
        let is_link = fstat(probe.as_fd())?.st_mode & libc::S_IFMT == libc::S_IFLNK;
        if is_link && !(last && flags & libc::O_NOFOLLOW != 0) {
            if on_procfs(probe.as_fd())? {
                return Err(errno(libc::ELOOP));
            }
            links += 1;
            if links > MAX_SYMLINKS {
                return Err(errno(libc::ELOOP));
            }
            let target = readlinkat(at, &name)?;
            if target.starts_with(b"/") {
                cur = None;
            }
            for p in target
                .split(|b| *b == b'/')
                .filter(|p| !p.is_empty() && *p != b".")
                .rev()
            {
                todo.push_front(p.to_vec());
            }
            continue;
        }
        if last {
            return openat(at, &name, flags | libc::O_NOFOLLOW, mode);
        }
        // `..` from the root is the root itself (it is the process's root).
        cur = Some(openat(at, &name, libc::O_PATH | libc::O_DIRECTORY, 0)?);
    }
    // The root itself (or a path that resolved back to it).
    let at = cur.as_ref().map_or(root, |f| f.as_fd());
    openat(at, c".", flags, mode)
}

/// Whether `fd` is on a procfs.
fn on_procfs(fd: BorrowedFd<'_>) -> io::Result<bool> {
    // SAFETY: statfs is plain old data; zero is a valid initial value.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid fd and out pointer.
    check(unsafe { libc::fstatfs(fd.as_raw_fd(), &mut st) })?;
    Ok(st.f_type == libc::PROC_SUPER_MAGIC)
}

/// `openat(2)` relative to `dir`; `O_CLOEXEC` is always added.
pub fn openat(
    dir: BorrowedFd<'_>,
    name: &CStr,
    flags: libc::c_int,
    mode: u32,
) -> io::Result<OwnedFd> {
    // SAFETY: valid dirfd and C string; mode is passed as the variadic argument.
    owned(unsafe {
        libc::openat(
            dir.as_raw_fd(),
            name.as_ptr(),
            flags | libc::O_CLOEXEC,
            mode as libc::c_uint,
        )
    })
}

/// `fstatat(2)`; with `nofollow` a final symlink is not followed.
pub fn fstatat(dir: BorrowedFd<'_>, name: &CStr, nofollow: bool) -> io::Result<libc::stat> {
    // SAFETY: stat is plain old data; zero is a valid initial value.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    let flags = if nofollow {
        libc::AT_SYMLINK_NOFOLLOW
    } else {
        0
    };
    // SAFETY: valid dirfd, C string and out pointer.
    check(unsafe { libc::fstatat(dir.as_raw_fd(), name.as_ptr(), &mut st, flags) })?;
    Ok(st)
}

/// `fstat(2)`.
pub fn fstat(fd: BorrowedFd<'_>) -> io::Result<libc::stat> {
    // SAFETY: stat is plain old data; zero is a valid initial value.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid fd and out pointer.
    check(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) })?;
    Ok(st)
}

/// `mkdirat(2)`.
pub fn mkdirat(dir: BorrowedFd<'_>, name: &CStr, mode: u32) -> io::Result<()> {
    // SAFETY: valid dirfd and C string.
    check(unsafe { libc::mkdirat(dir.as_raw_fd(), name.as_ptr(), mode as libc::mode_t) }).map(drop)
}

/// `unlinkat(2)`; `dir_flag` removes a directory (`AT_REMOVEDIR`).
pub fn unlinkat(dir: BorrowedFd<'_>, name: &CStr, remove_dir: bool) -> io::Result<()> {
    let flags = if remove_dir { libc::AT_REMOVEDIR } else { 0 };
    // SAFETY: valid dirfd and C string.
    check(unsafe { libc::unlinkat(dir.as_raw_fd(), name.as_ptr(), flags) }).map(drop)
}

/// `renameat(2)`.
pub fn renameat(
    from_dir: BorrowedFd<'_>,
    from: &CStr,
    to_dir: BorrowedFd<'_>,
    to: &CStr,
) -> io::Result<()> {
    // SAFETY: valid dirfds and C strings.
    check(unsafe {
        libc::renameat(
            from_dir.as_raw_fd(),
            from.as_ptr(),
            to_dir.as_raw_fd(),
            to.as_ptr(),
        )
    })
    .map(drop)
}

/// `readlinkat(2)`: the raw target bytes of a symlink.
pub fn readlinkat(dir: BorrowedFd<'_>, name: &CStr) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; libc::PATH_MAX as usize + 1];
    // SAFETY: valid dirfd, C string and a buffer of the length we pass.
    let n = unsafe {
        libc::readlinkat(
            dir.as_raw_fd(),
            name.as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    buf.truncate(n as usize);
    Ok(buf)
}

/// `symlinkat(2)`: creates `name` in `dir` pointing at `target`.
pub fn symlinkat(target: &CStr, dir: BorrowedFd<'_>, name: &CStr) -> io::Result<()> {
    // SAFETY: valid C strings and dirfd.
    check(unsafe { libc::symlinkat(target.as_ptr(), dir.as_raw_fd(), name.as_ptr()) }).map(drop)
}

/// `linkat(2)` without following symlinks.
pub fn linkat(
    from_dir: BorrowedFd<'_>,
    from: &CStr,
    to_dir: BorrowedFd<'_>,
    to: &CStr,
) -> io::Result<()> {
    // SAFETY: valid dirfds and C strings.
    check(unsafe {
        libc::linkat(
            from_dir.as_raw_fd(),
            from.as_ptr(),
            to_dir.as_raw_fd(),
            to.as_ptr(),
            0,
        )
    })
    .map(drop)
}

/// `fchmod(2)`.
pub fn fchmod(fd: BorrowedFd<'_>, mode: u32) -> io::Result<()> {
    // SAFETY: valid fd.
    check(unsafe { libc::fchmod(fd.as_raw_fd(), mode as libc::mode_t) }).map(drop)
}

/// Sets access and modification time of an open file to `mtime` (seconds).
pub fn set_mtime(fd: BorrowedFd<'_>, mtime: i64) -> io::Result<()> {
    let ts = libc::timespec {
        tv_sec: mtime as libc::time_t,
        tv_nsec: 0,
    };
    let times = [ts, ts];
    // SAFETY: valid fd and a two-element timespec array.
    check(unsafe { libc::futimens(fd.as_raw_fd(), times.as_ptr()) }).map(drop)
}

/// Names in a directory (without `.` and `..`), read through a duplicate of `dir`.
pub fn read_dir_names(dir: BorrowedFd<'_>) -> io::Result<Vec<Vec<u8>>> {
    // Re-open "." so the directory stream gets its own offset and needs read access.
    let fd = openat(dir, c".", libc::O_RDONLY | libc::O_DIRECTORY, 0)?;
    let raw = std::os::fd::IntoRawFd::into_raw_fd(fd);
    // SAFETY: `raw` is an open directory descriptor we own; fdopendir takes ownership.
    let dirp = unsafe { libc::fdopendir(raw) };
    if dirp.is_null() {
        let err = io::Error::last_os_error();
        // SAFETY: fdopendir failed, so we still own `raw`.
        unsafe { libc::close(raw) };
        return Err(err);
    }
    let mut names = Vec::new();
    let result = loop {
        // SAFETY: errno location is thread-local; resetting it distinguishes end from error.
        unsafe { *libc::__errno_location() = 0 };
        // SAFETY: dirp is a valid open DIR stream used only by this thread.
        let ent = unsafe { libc::readdir(dirp) };
        if ent.is_null() {
            let err = io::Error::last_os_error();
            break if err.raw_os_error().unwrap_or(0) == 0 {
                Ok(())
            } else {
                Err(err)
            };
        }
        // SAFETY: readdir returned a valid dirent whose d_name is NUL-terminated.
        let name = unsafe { CStr::from_ptr((*ent).d_name.as_ptr()) }.to_bytes();
        if name != b"." && name != b".." {
            names.push(name.to_vec());
        }
    };
    // SAFETY: dirp is valid and closed exactly once.
    unsafe { libc::closedir(dirp) };
    result.map(|()| names)
}

/// Sends `sig` to the process group `pgid` (`killpg`). ESRCH is not an error.
pub fn killpg(pgid: i32, sig: i32) -> io::Result<()> {
    if pgid <= 1 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "refusing to signal group <= 1",
        ));
    }
    // SAFETY: plain syscall with integer arguments.
    match check(unsafe { libc::kill(-pgid, sig) }) {
        Err(e) if e.raw_os_error() == Some(libc::ESRCH) => Ok(()),
        other => other.map(drop),
    }
}

/// Sends `sig` to the single process `pid`. ESRCH is not an error.
pub fn kill(pid: i32, sig: i32) -> io::Result<()> {
    if pid <= 1 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "refusing to signal pid <= 1",
        ));
    }
    // SAFETY: plain syscall with integer arguments.
    match check(unsafe { libc::kill(pid, sig) }) {
        Err(e) if e.raw_os_error() == Some(libc::ESRCH) => Ok(()),
        other => other.map(drop),
    }
}

/// Puts a descriptor into non-blocking mode.
pub fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor the caller owns.
    let flags = check(unsafe { libc::fcntl(fd, libc::F_GETFL) })?;
    // SAFETY: as above.
    check(unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) }).map(drop)
}

/// Marks a descriptor close-on-exec.
pub fn set_cloexec(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor the caller owns.
    let flags = check(unsafe { libc::fcntl(fd, libc::F_GETFD) })?;
    // SAFETY: as above.
    check(unsafe { libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC) }).map(drop)
}

/// A close-on-exec pipe: `(read end, write end)`.
pub fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: fds is a two-element array as pipe2 requires.
    check(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) })?;
    // SAFETY: pipe2 succeeded; both descriptors are new and ours.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// True if the peer of a socket has fully closed it (POLLHUP/POLLERR), as opposed to
/// only shutting down its write side.
pub fn peer_hung_up(fd: RawFd) -> bool {
    let mut pfd = libc::pollfd {
        fd,
        events: 0,
        revents: 0,
    };
    // SAFETY: one valid pollfd, zero timeout.
    let n = unsafe { libc::poll(&mut pfd, 1, 0) };
    n > 0 && pfd.revents & (libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0
}

/// Sets the window size of a terminal (`TIOCSWINSZ`).
pub fn set_winsize(fd: BorrowedFd<'_>, rows: u16, cols: u16) -> io::Result<()> {
    let ws = libc::winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads one winsize struct from the pointer.
    check(unsafe {
        libc::ioctl(
            fd.as_raw_fd(),
            libc::TIOCSWINSZ,
            &ws as *const libc::winsize,
        )
    })
    .map(drop)
}

/// Opens a new PTY pair `(master, slave)` with the given size; both close-on-exec.
pub fn openpty(rows: u16, cols: u16) -> io::Result<(OwnedFd, OwnedFd)> {
    let master = owned(
        // SAFETY: plain syscall wrapper.
        unsafe { libc::posix_openpt(libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC) },
    )?;
    // SAFETY: master is a valid pty master.
    check(unsafe { libc::grantpt(master.as_raw_fd()) })?;
    // SAFETY: as above.
    check(unsafe { libc::unlockpt(master.as_raw_fd()) })?;
    let mut name = [0 as libc::c_char; 128];
    // SAFETY: buffer of the given length for the reentrant ptsname.
    let rc = unsafe { libc::ptsname_r(master.as_raw_fd(), name.as_mut_ptr(), name.len()) };
    if rc != 0 {
        return Err(io::Error::from_raw_os_error(rc));
    }
    // SAFETY: ptsname_r wrote a NUL-terminated string into `name`.
    let path = unsafe { CStr::from_ptr(name.as_ptr()) };
    // SAFETY: valid C string; flags as documented.
    let slave = owned(unsafe {
        libc::open(
            path.as_ptr(),
            libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC,
        )
    })?;
    set_winsize(std::os::fd::AsFd::as_fd(&master), rows, cols)?;
    Ok((master, slave))
}

/// Switches the (forked, not yet exec'd) child to `uid`/`gid` with supplementary
/// `groups`: setgroups, then setgid, then setuid, so no step is left half done.
/// Only async-signal-safe syscalls; `groups` was allocated before the fork.
pub fn switch_user(uid: u32, gid: u32, groups: &[u32]) -> io::Result<()> {
    // SAFETY: plain syscalls on integers and on a slice that outlives the call.
    unsafe {
        if libc::setgroups(groups.len(), groups.as_ptr()) < 0
            || libc::setresgid(gid, gid, gid) < 0
            || libc::setresuid(uid, uid, uid) < 0
        {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Writes `data` to the existing file `path` if the process may; errors are ignored.
/// Async-signal-safe (for a forked child before `exec`).
pub fn try_write(path: &std::ffi::CStr, data: &[u8]) {
    // SAFETY: open/write/close on a valid C string and a live buffer.
    unsafe {
        let fd = libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
        if fd >= 0 {
            libc::write(fd, data.as_ptr().cast(), data.len());
            libc::close(fd);
        }
    }
}

/// Code run in a forked child before `exec`: new session (so the child leads its own
/// process group), optional controlling terminal on fd 0, optional extra fd placed at 3,
/// default signal dispositions and an empty signal mask.
///
/// Only async-signal-safe calls are made.
pub fn child_setup(ctty: bool, fd3: Option<RawFd>) -> io::Result<()> {
    // SAFETY: all calls below are async-signal-safe syscalls on integer arguments or on
    // stack-local sigset storage; this runs in the single-threaded child after fork.
    unsafe {
        if libc::setsid() < 0 {
            return Err(io::Error::last_os_error());
        }
        if ctty && libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
            return Err(io::Error::last_os_error());
        }
        if let Some(fd) = fd3 {
            if fd == 3 {
                let flags = libc::fcntl(3, libc::F_GETFD);
                if flags < 0 || libc::fcntl(3, libc::F_SETFD, flags & !libc::FD_CLOEXEC) < 0 {
                    return Err(io::Error::last_os_error());
                }
            } else if libc::dup2(fd, 3) < 0 {
                return Err(io::Error::last_os_error());
            }
        }
        for sig in 1..32 {
            if sig != libc::SIGKILL && sig != libc::SIGSTOP {
                libc::signal(sig, libc::SIG_DFL);
            }
        }
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigprocmask(libc::SIG_SETMASK, &set, std::ptr::null_mut());
    }
    Ok(())
}

/// `(state, pgrp)` of every process found in `/proc`, keyed by pid.
pub fn proc_groups() -> Vec<(i32, char, i32)> {
    let mut out = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for ent in dir.flatten() {
        let Some(pid) = ent.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // Format: pid (comm) state ppid pgrp ...; comm may contain spaces and parens.
        let Some(close) = stat.rfind(')') else {
            continue;
        };
        let mut fields = stat[close + 1..].split_whitespace();
        let state = fields.next().and_then(|s| s.chars().next()).unwrap_or('?');
        let _ppid = fields.next();
        let Some(pgrp) = fields.next().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        out.push((pid, state, pgrp));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(p: &std::path::Path) -> OwnedFd {
        let c = cstr(p.as_os_str().as_encoded_bytes()).expect("path");
        // SAFETY: valid C string; the descriptor is wrapped at once.
        owned(unsafe {
            libc::open(
                c.as_ptr(),
                libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
            )
        })
        .expect("open dir")
    }

    fn errno_of(r: io::Result<OwnedFd>) -> Option<i32> {
        r.err().and_then(|e| e.raw_os_error())
    }

    /// The emulation used where `openat2` is missing (gVisor) refuses what the kernel's
    /// resolve flags refuse.
    #[test]
    fn the_openat2_emulation_refuses_what_the_resolve_flags_refuse() {
        let tmp = tempfile::tempdir().expect("tmp");
        std::fs::create_dir(tmp.path().join("d")).expect("mkdir");
        std::fs::write(tmp.path().join("d/f"), b"x").expect("write");
        std::os::unix::fs::symlink("d", tmp.path().join("link")).expect("symlink");
        std::os::unix::fs::symlink("f", tmp.path().join("d/flink")).expect("symlink");
        let base = dir(tmp.path());
        let beneath =
            libc::RESOLVE_BENEATH | libc::RESOLVE_NO_SYMLINKS | libc::RESOLVE_NO_MAGICLINKS;
        let open = |p: &CStr, flags| openat2_emulated(base.as_fd(), p, flags, 0, beneath);
        assert!(open(c"d/f", libc::O_RDONLY).is_ok());
        assert_eq!(errno_of(open(c"link/f", libc::O_RDONLY)), Some(libc::ELOOP));
        assert_eq!(
            errno_of(open(c"d/flink", libc::O_RDONLY)),
            Some(libc::ELOOP)
        );
        assert_eq!(errno_of(open(c"d/flink", libc::O_PATH)), Some(libc::ELOOP));
        assert_eq!(
            errno_of(open(c"d/../d/f", libc::O_RDONLY)),
            Some(libc::EXDEV)
        );
        assert_eq!(
            errno_of(open(c"/etc/passwd", libc::O_RDONLY)),
            Some(libc::EXDEV)
        );
        // In-root resolution only from the root itself; procfs is refused there.
        let in_root = libc::RESOLVE_IN_ROOT | libc::RESOLVE_NO_MAGICLINKS;
        let r = openat2_emulated(base.as_fd(), c"d/f", libc::O_RDONLY, 0, in_root);
        assert_eq!(
            errno_of(r),
            Some(libc::ENOSYS),
            "not from a directory below /"
        );
        let root = dir(std::path::Path::new("/"));
        for magic in [
            c"/proc/self/root",
            c"/proc/self/root/etc/hostname",
            c"/proc/1/cwd",
        ] {
            let r = openat2_emulated(root.as_fd(), magic, libc::O_PATH, 0, in_root);
            assert_eq!(errno_of(r), Some(libc::ELOOP), "{magic:?}");
        }
        // Symlinks resolve inside the root: `..` stops there.
        std::os::unix::fs::symlink("/../../etc", tmp.path().join("up")).expect("symlink");
        let up = tmp.path().join("up/hostname");
        let up = cstr(up.as_os_str().as_encoded_bytes()).expect("path");
        let r = openat2_emulated(root.as_fd(), &up, libc::O_RDONLY, 0, in_root);
        assert!(r.is_ok(), "{r:?}");
        let r = openat2_emulated(
            root.as_fd(),
            c"/tmp/../../../etc/hostname",
            libc::O_RDONLY,
            0,
            in_root,
        );
        assert!(r.is_ok(), "{r:?}");
        let r = openat2_emulated(root.as_fd(), c"/etc/hostname", libc::O_RDONLY, 0, in_root);
        assert!(r.is_ok(), "{r:?}");
    }
}
