//! Starting a process the way every dsec process starts: a `vfork`-style child (shared
//! memory, the parent suspended until the exec) that applies recorded file actions,
//! optionally starts a new session or process group, sets every signal this process
//! ignores back to its default (the Rust runtime ignores SIGPIPE, and ignored signals
//! survive exec), empties the signal mask and execs. Shared by the node (init) and the
//! agent (commands).
//!
//! glibc's `posix_spawn` does the same but visits all 64 signals in the child (two
//! `rt_sigaction` calls each) and leaves its two internal signals ignored in the new
//! program. Here every signal stays blocked from before the clone until the exec, so no
//! handler of the parent can run in the child, and exec itself resets the handled ones:
//! the child makes about ten system calls instead of about 140 (a fifth of an exec's
//! cost on a paravirtualised host, where each one is a world switch).

use std::ffi::{CStr, CString};
use std::os::fd::RawFd;

/// Process attributes: a new session or process group.
#[derive(Debug, Clone, Copy)]
pub struct SpawnAttr {
    flags: libc::c_short,
}

impl SpawnAttr {
    /// Attributes from `POSIX_SPAWN_SETSID` and/or `POSIX_SPAWN_SETPGROUP` (the child
    /// then leads a new session, or a new process group). The signal mask is always
    /// emptied and every ignored signal defaulted.
    pub fn new(flags: libc::c_short) -> Self {
        Self { flags }
    }

    fn has(&self, flag: impl Into<i32>) -> bool {
        i32::from(self.flags) & flag.into() != 0
    }
}

/// One recorded file action.
#[derive(Debug)]
enum Action {
    Dup2(RawFd, RawFd),
    Open(RawFd, CString, i32, libc::mode_t),
    Close(RawFd),
    CloseFrom(RawFd),
    Chdir(CString),
    TryWrite(CString, Vec<u8>),
}

/// File actions the child applies in order before the exec. Any failure makes
/// [`spawn`] fail instead of starting a process without it: a missing close would leak a
/// descriptor into a sandbox.
#[derive(Debug, Default)]
pub struct FileActions {
    actions: Vec<Action>,
}

impl FileActions {
    /// No actions yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// The child's `to` becomes a copy of the parent's `from` (without close-on-exec,
    /// also when they are the same number).
    pub fn dup2(&mut self, from: RawFd, to: RawFd) {
        self.actions.push(Action::Dup2(from, to));
    }

    /// The child opens `path` at `fd`.
    pub fn open(&mut self, fd: RawFd, path: &CStr, flags: i32, mode: libc::mode_t) {
        self.actions
            .push(Action::Open(fd, path.to_owned(), flags, mode));
    }

    /// The child closes `fd` (no error if it is not open).
    pub fn close(&mut self, fd: RawFd) {
        self.actions.push(Action::Close(fd));
    }

    /// The child closes every descriptor from `fd` up.
    pub fn close_from(&mut self, fd: RawFd) {
        self.actions.push(Action::CloseFrom(fd));
    }

    /// The child changes to `dir` before the exec.
    pub fn chdir(&mut self, dir: &CStr) {
        self.actions.push(Action::Chdir(dir.to_owned()));
    }

    /// The child writes `data` to the existing file `path` if it may (no failure if it
    /// may not): e.g. its own `/proc/self/oom_score_adj`.
    pub fn try_write(&mut self, path: &CStr, data: &[u8]) {
        self.actions
            .push(Action::TryWrite(path.to_owned(), data.to_vec()));
    }
}

/// Size of the child's stack: it only makes system calls through libc.
const CHILD_STACK: usize = 64 << 10;

/// The child's stack, one per thread (a thread is suspended while its child uses it),
/// unmapped when the thread ends. Its lowest page is a guard.
struct ChildStack {
    base: *mut libc::c_void,
    len: usize,
}

impl ChildStack {
    fn new() -> std::io::Result<Self> {
        // SAFETY: sysconf with a constant name.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
        let len = CHILD_STACK + page;
        // SAFETY: an anonymous private mapping; the result is checked.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: the first page of the mapping just made.
        unsafe { libc::mprotect(base, page, libc::PROT_NONE) };
        Ok(Self { base, len })
    }

    /// The (page-aligned) top: stacks grow down.
    fn top(&self) -> *mut libc::c_void {
        // SAFETY: one past the end of our own mapping.
        unsafe { self.base.cast::<u8>().add(self.len).cast() }
    }
}

impl Drop for ChildStack {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once.
        unsafe { libc::munmap(self.base, self.len) };
    }
}

thread_local! {
    static STACK: std::cell::RefCell<Option<ChildStack>> = const { std::cell::RefCell::new(None) };
}

/// What the child needs, prepared by the parent (the child must not allocate: another
/// thread of the parent may hold the allocator's lock).
struct ChildArgs<'a> {
    exe: &'a CStr,
    argv: *const *const libc::c_char,
    env: *const *const libc::c_char,
    actions: &'a [Action],
    attr: SpawnAttr,
    /// [`ignored_signals`].
    ignored: u64,
    /// The errno of the step that failed; the parent reads it once the child is gone.
    error: std::sync::atomic::AtomicI32,
}

/// Sets the calling thread's signal mask (every bit a signal, glibc's internal ones
/// too, which its wrappers refuse to block) and returns the previous one.
fn set_signal_mask(mask: u64) -> u64 {
    let mut old: u64 = 0;
    // SAFETY: rt_sigprocmask with 8-byte sets on our own stack.
    unsafe {
        libc::syscall(
            libc::SYS_rt_sigprocmask,
            libc::SIG_SETMASK,
            &mask as *const u64,
            &mut old as *mut u64,
            8usize,
        )
    };
    old
}

/// Signals to set back to their default in the child, as a mask (bit `n - 1` for
/// signal `n`): SIGPIPE, and whatever this process ignored when it first spawned
/// (inherited from whoever started it; glibc's spawn leaves its own signals 32 and 33
/// ignored in the programs it starts). Dispositions are looked at once: dsec changes
/// none to ignored later.
fn ignored_signals() -> u64 {
    static IGNORED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *IGNORED.get_or_init(|| {
        (1..=64)
            .filter(|&sig| sig != libc::SIGKILL && sig != libc::SIGSTOP)
            .filter(|&sig| sig == libc::SIGPIPE || crate::signals::is_ignored(sig))
            .fold(0u64, |mask, sig| mask | 1 << (sig - 1))
    })
}

/// The child: only libc calls on data the parent prepared.
extern "C" fn child_main(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` points at the parent's `ChildArgs`, alive and unmoved while the
    // parent is suspended (CLONE_VFORK) until this child execs or exits.
    let args = unsafe { &*(arg as *const ChildArgs<'_>) };
    let fail = || -> libc::c_int {
        // SAFETY: reading errno and leaving without running any of the parent's code.
        unsafe {
            let e = *libc::__errno_location();
            args.error.store(
                if e == 0 { libc::EINVAL } else { e },
                std::sync::atomic::Ordering::SeqCst,
            );
            libc::_exit(127)
        }
    };
    // SAFETY: plain system calls on integers and on strings the parent keeps alive.
    unsafe {
        if args.attr.has(libc::POSIX_SPAWN_SETSID) && libc::setsid() < 0 {
            return fail();
        }
        if args.attr.has(libc::POSIX_SPAWN_SETPGROUP) && libc::setpgid(0, 0) < 0 {
            return fail();
        }
        for sig in 1..=64 {
            if args.ignored & 1 << (sig - 1) != 0 && crate::signals::set_default(sig, 0).is_err() {
                return fail();
            }
        }
        for action in args.actions {
            let ok = match action {
                Action::Dup2(from, to) if from == to => {
                    let flags = libc::fcntl(*from, libc::F_GETFD);
                    flags >= 0 && libc::fcntl(*from, libc::F_SETFD, flags & !libc::FD_CLOEXEC) >= 0
                }
                Action::Dup2(from, to) => libc::dup2(*from, *to) >= 0,
                Action::Open(fd, path, flags, mode) => {
                    let got = libc::open(path.as_ptr(), *flags, *mode as libc::c_uint);
                    got >= 0 && (got == *fd || (libc::dup2(got, *fd) >= 0 && libc::close(got) == 0))
                }
                Action::Close(fd) => {
                    libc::close(*fd) == 0 || *libc::__errno_location() == libc::EBADF
                }
                Action::CloseFrom(fd) => {
                    libc::syscall(
                        libc::SYS_close_range,
                        *fd as libc::c_uint,
                        libc::c_uint::MAX,
                        0,
                    ) == 0
                }
                Action::Chdir(dir) => libc::chdir(dir.as_ptr()) == 0,
                Action::TryWrite(path, data) => {
                    let fd = libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                    if fd >= 0 {
                        libc::write(fd, data.as_ptr().cast(), data.len());
                        libc::close(fd);
                    }
                    true
                }
            };
            if !ok {
                return fail();
            }
        }
        set_signal_mask(0);
        libc::execve(args.exe.as_ptr(), args.argv, args.env);
    }
    fail()
}

/// Starts `exe` with `argv` (argv[0] included) and `env` (`KEY=VALUE`) after `actions`;
/// returns the child's pid, which the caller reaps. A failure in the child before or at
/// the exec is returned as its errno (the child is reaped here then).
pub fn spawn(
    exe: &CStr,
    argv: &[CString],
    env: &[CString],
    actions: &FileActions,
    attr: &SpawnAttr,
) -> std::io::Result<libc::pid_t> {
    let pointers = |strings: &[CString]| -> Vec<*const libc::c_char> {
        strings
            .iter()
            .map(|s| s.as_ptr())
            .chain([std::ptr::null()])
            .collect()
    };
    let (argv_p, env_p) = (pointers(argv), pointers(env));
    let args = ChildArgs {
        exe,
        argv: argv_p.as_ptr(),
        env: env_p.as_ptr(),
        actions: &actions.actions,
        attr: *attr,
        ignored: ignored_signals(),
        error: std::sync::atomic::AtomicI32::new(0),
    };
    let pid = STACK.with(|cell| -> std::io::Result<libc::pid_t> {
        let mut slot = cell.borrow_mut();
        if slot.is_none() {
            *slot = Some(ChildStack::new()?);
        }
        let top = slot.as_ref().map_or(std::ptr::null_mut(), ChildStack::top);
        let old = set_signal_mask(!0);
        // SAFETY: CLONE_VM|CLONE_VFORK: the child runs `child_main` on its own stack and
        // this thread stays suspended until it execs or exits, so `args` (and the
        // strings it points at) outlive every use by the child.
        let pid = unsafe {
            libc::clone(
                child_main,
                top,
                libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
                &args as *const ChildArgs<'_> as *mut libc::c_void,
            )
        };
        let err = std::io::Error::last_os_error();
        set_signal_mask(old);
        if pid < 0 {
            return Err(err);
        }
        Ok(pid)
    })?;
    let error = args.error.load(std::sync::atomic::Ordering::SeqCst);
    if error != 0 {
        // The child exited (127) without exec'ing: reap it here, nobody else knows it.
        let mut status = 0;
        // SAFETY: waitpid on the child just made.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        return Err(std::io::Error::from_raw_os_error(error));
    }
    Ok(pid)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

    fn pipe() -> (OwnedFd, OwnedFd) {
        let mut fds = [0; 2];
        // SAFETY: pipe2 fills both fds on success.
        assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
        // SAFETY: both were just made and are owned by nobody else.
        unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
    }

    fn c(s: &str) -> CString {
        CString::new(s).expect("no NUL")
    }

    fn wait(pid: libc::pid_t) -> i32 {
        let mut status = 0;
        // SAFETY: waitpid on our own child.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status), "status {status:#x}");
        libc::WEXITSTATUS(status)
    }

    /// Runs `sh -c script` with stdout on a pipe; returns (exit code, output).
    fn run(script: &str, attr: SpawnAttr, extra: impl FnOnce(&mut FileActions)) -> (i32, String) {
        let (r, w) = pipe();
        let mut actions = FileActions::new();
        actions.dup2(w.as_raw_fd(), 1);
        extra(&mut actions);
        let argv = [c("sh"), c("-c"), c(script)];
        let pid = spawn(
            &c("/bin/sh"),
            &argv,
            &[c("PATH=/usr/bin:/bin")],
            &actions,
            &attr,
        )
        .expect("spawn");
        drop(w);
        let mut out = String::new();
        std::fs::File::from(r)
            .read_to_string(&mut out)
            .expect("read");
        (wait(pid), out)
    }

    #[test]
    fn the_child_starts_with_default_signals_an_empty_mask_and_its_own_group() {
        // The test harness ignores SIGPIPE like every Rust program (and 32 when cargo
        // started it with glibc's spawn).
        let (code, out) = run(
            "grep -E '^(SigIgn|SigBlk)' /proc/self/status; ps -o pgid= -o sid= -p $$; echo $$",
            SpawnAttr::new(libc::POSIX_SPAWN_SETPGROUP as libc::c_short),
            |_| {},
        );
        assert_eq!(code, 0, "{out}");
        assert!(
            crate::signals::is_ignored(libc::SIGPIPE),
            "the harness ignores SIGPIPE"
        );
        let ignored = out
            .lines()
            .find_map(|l| l.strip_prefix("SigIgn:\t"))
            .and_then(|m| u64::from_str_radix(m, 16).ok())
            .expect("SigIgn line");
        // SIGPIPE and glibc's 32 and 33 (other tests may briefly ignore others).
        let reset = 1 << (libc::SIGPIPE - 1) | 1 << 31 | 1 << 32;
        assert_eq!(ignored & reset, 0, "{out}");
        assert!(out.contains("SigBlk:\t0000000000000000"), "{out}");
        let lines: Vec<&str> = out.lines().collect();
        let ids: Vec<&str> = lines[2].split_whitespace().collect();
        assert_eq!(
            ids[0],
            lines[3].trim(),
            "leads its own process group: {out}"
        );
    }

    #[test]
    fn the_child_writes_its_own_score_before_the_exec_if_it_may() {
        let (code, out) = run("cat /proc/self/oom_score_adj", SpawnAttr::new(0), |a| {
            a.try_write(c"/proc/self/oom_score_adj", b"500");
            a.try_write(c"/nonexistent/file", b"x");
        });
        assert_eq!((code, out.as_str()), (0, "500\n"));
    }

    #[test]
    fn a_new_session_when_asked() {
        let (code, out) = run(
            "ps -o sid= -p $$; echo $$",
            SpawnAttr::new(libc::POSIX_SPAWN_SETSID),
            |_| {},
        );
        assert_eq!(code, 0, "{out}");
        let lines: Vec<&str> = out.lines().map(str::trim).collect();
        assert_eq!(lines[0], lines[1], "leads its own session: {out}");
    }

    #[test]
    fn file_actions_apply_in_order() {
        let dir = std::env::temp_dir().join(format!("dsec-spawn-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        std::fs::write(dir.join("in"), "from a file\n").expect("write");
        // A descriptor that must not reach the child, and one kept at its own number.
        let (_leak_r, leak_w) = pipe();
        let (keep_r, _keep_w) = pipe();
        let keep = keep_r.as_raw_fd();
        let dir_c = c(dir.to_str().expect("utf-8"));
        let (code, out) = run(
            &format!("cat; pwd; test -e /proc/self/fd/{} || echo closed; test -e /proc/self/fd/{keep} && echo kept", leak_w.as_raw_fd()),
            SpawnAttr::new(0),
            |a| {
                a.chdir(&dir_c);
                a.open(0, &c("in"), libc::O_RDONLY, 0);
                a.dup2(keep, keep);
                a.close(leak_w.as_raw_fd());
            },
        );
        assert_eq!(code, 0, "{out}");
        assert_eq!(
            out,
            format!("from a file\n{}\nclosed\nkept\n", dir.display()),
        );
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[test]
    fn failures_before_or_at_the_exec_are_errors() {
        let actions = FileActions::new();
        let attr = SpawnAttr::new(0);
        let err = spawn(&c("/nonexistent/prog"), &[c("prog")], &[], &actions, &attr)
            .expect_err("no such program");
        assert_eq!(err.raw_os_error(), Some(libc::ENOENT));
        let mut actions = FileActions::new();
        actions.chdir(&c("/nonexistent-dir"));
        let err = spawn(&c("/bin/true"), &[c("true")], &[], &actions, &attr)
            .expect_err("no such directory");
        assert_eq!(err.raw_os_error(), Some(libc::ENOENT));
    }
}
