//! Per-sandbox file and socket rules with Landlock: when a sandbox names its writable
//! paths, the commands it runs may create, change or delete files only beneath them (and
//! write to the devices in `/dev`); reading and executing stay as they are. When it names
//! TCP ports to bind or connect to, those are the only ones (Landlock ABI 4+). The agent itself is
//! not restricted, so the files API and the platform's own uploads still reach every path.
//!
//! The ruleset is built once, inside the sandbox after the pivot; the agent applies it in
//! each child between fork and exec (`landlock_restrict_self` is async-signal-safe).

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

const SYS_LANDLOCK_CREATE_RULESET: libc::c_long = 444;
const SYS_LANDLOCK_ADD_RULE: libc::c_long = 445;
const SYS_LANDLOCK_RESTRICT_SELF: libc::c_long = 446;
const CREATE_RULESET_VERSION: u32 = 1;
const RULE_PATH_BENEATH: libc::c_int = 1;
const RULE_NET_PORT: libc::c_int = 2;
const NET_BIND_TCP: u64 = 1 << 0;
const NET_CONNECT_TCP: u64 = 1 << 1;

const WRITE_FILE: u64 = 1 << 1;
const REMOVE_DIR: u64 = 1 << 4;
const REMOVE_FILE: u64 = 1 << 5;
const MAKE_CHAR: u64 = 1 << 6;
const MAKE_DIR: u64 = 1 << 7;
const MAKE_REG: u64 = 1 << 8;
const MAKE_SOCK: u64 = 1 << 9;
const MAKE_FIFO: u64 = 1 << 10;
const MAKE_BLOCK: u64 = 1 << 11;
const MAKE_SYM: u64 = 1 << 12;
const REFER: u64 = 1 << 13;
const TRUNCATE: u64 = 1 << 14;

/// Rights that apply to a file (not a directory) in a rule.
const FILE_RIGHTS: u64 = WRITE_FILE | TRUNCATE;

#[repr(C)]
struct RulesetAttr {
    handled_access_fs: u64,
    handled_access_net: u64,
}

#[repr(C, packed)]
struct NetPortAttr {
    allowed_access: u64,
    port: u64,
}

/// What a sandbox's commands are held to.
#[derive(Debug, Clone, Default)]
pub struct Rules<'a> {
    /// Writes only beneath these paths (none: writes unrestricted).
    pub writable: &'a [String],
    /// TCP ports `bind` may use (`None`: any).
    pub tcp_bind: Option<&'a [u16]>,
    /// TCP ports `connect` may reach (`None`: any).
    pub tcp_connect: Option<&'a [u16]>,
}

#[repr(C, packed)]
struct PathBeneathAttr {
    allowed_access: u64,
    parent_fd: i32,
}

/// The Landlock ABI version of the running kernel, or `None` without Landlock.
pub fn abi_version() -> Option<u32> {
    // SAFETY: landlock_create_ruleset(NULL, 0, VERSION) only returns a number.
    let v = unsafe {
        libc::syscall(
            SYS_LANDLOCK_CREATE_RULESET,
            std::ptr::null::<RulesetAttr>(),
            0usize,
            CREATE_RULESET_VERSION,
        )
    };
    (v > 0).then_some(v as u32)
}

/// The write rights this kernel's Landlock knows.
fn write_rights(abi: u32) -> u64 {
    let mut r = WRITE_FILE
        | REMOVE_DIR
        | REMOVE_FILE
        | MAKE_CHAR
        | MAKE_DIR
        | MAKE_REG
        | MAKE_SOCK
        | MAKE_FIFO
        | MAKE_BLOCK
        | MAKE_SYM;
    if abi >= 2 {
        r |= REFER;
    }
    if abi >= 3 {
        r |= TRUNCATE;
    }
    r
}

/// Builds the ruleset: writes allowed beneath each of `writable` (which must exist) and
/// to files in `/dev`.
pub fn writable_ruleset(writable: &[String]) -> io::Result<OwnedFd> {
    ruleset(&Rules {
        writable,
        ..Rules::default()
    })
}

/// Builds the ruleset for `rules`: file rights as in [`writable_ruleset`] when paths are
/// given, and the listed TCP ports only when port lists are given.
pub fn ruleset(rules: &Rules<'_>) -> io::Result<OwnedFd> {
    let abi = abi_version()
        .ok_or_else(|| io::Error::new(io::ErrorKind::Unsupported, "this kernel has no Landlock"))?;
    let net = (u64::from(rules.tcp_bind.is_some()) * NET_BIND_TCP)
        | (u64::from(rules.tcp_connect.is_some()) * NET_CONNECT_TCP);
    if net != 0 && abi < 4 {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            format!("TCP port rules need Landlock ABI 4; this kernel has {abi}"),
        ));
    }
    let handled = if rules.writable.is_empty() {
        0
    } else {
        write_rights(abi)
    };
    let attr = RulesetAttr {
        handled_access_fs: handled,
        handled_access_net: net,
    };
    // SAFETY: landlock_create_ruleset with a valid attribute of the size given.
    let fd = unsafe {
        libc::syscall(
            SYS_LANDLOCK_CREATE_RULESET,
            &attr as *const RulesetAttr,
            std::mem::size_of::<RulesetAttr>(),
            0u32,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new fd (close-on-exec) owned by nothing else.
    let ruleset = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let dev = ["/dev".to_string()];
    let dev: &[String] = if rules.writable.is_empty() { &[] } else { &dev };
    for (access, ports) in [
        (NET_BIND_TCP, rules.tcp_bind),
        (NET_CONNECT_TCP, rules.tcp_connect),
    ] {
        for port in ports.unwrap_or_default() {
            let rule = NetPortAttr {
                allowed_access: access,
                port: u64::from(*port),
            };
            // SAFETY: landlock_add_rule with a valid ruleset fd and net-port attribute.
            let rc = unsafe {
                libc::syscall(
                    SYS_LANDLOCK_ADD_RULE,
                    ruleset.as_raw_fd(),
                    RULE_NET_PORT,
                    &rule as *const NetPortAttr,
                    0u32,
                )
            };
            if rc != 0 {
                let e = io::Error::last_os_error();
                return Err(io::Error::new(
                    e.kind(),
                    format!("landlock port {port}: {e}"),
                ));
            }
        }
    }
    for path in rules.writable.iter().chain(dev.iter()) {
        let c = CString::new(path.as_bytes())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in path"))?;
        // SAFETY: open with O_PATH of a NUL-terminated path; checked and owned below.
        let pfd = unsafe { libc::open(c.as_ptr(), libc::O_PATH | libc::O_CLOEXEC) };
        if pfd < 0 {
            let e = io::Error::last_os_error();
            return Err(io::Error::new(e.kind(), format!("{path}: {e}")));
        }
        // SAFETY: open returned a new fd owned by nothing else.
        let parent = unsafe { OwnedFd::from_raw_fd(pfd) };
        let is_dir = std::fs::metadata(path).map(|m| m.is_dir()).unwrap_or(false);
        let allowed = if path == "/dev" {
            WRITE_FILE | (handled & TRUNCATE)
        } else if is_dir {
            handled
        } else {
            handled & FILE_RIGHTS
        };
        let rule = PathBeneathAttr {
            allowed_access: allowed,
            parent_fd: parent.as_raw_fd(),
        };
        // SAFETY: landlock_add_rule with a valid ruleset fd and path-beneath attribute.
        let rc = unsafe {
            libc::syscall(
                SYS_LANDLOCK_ADD_RULE,
                ruleset.as_raw_fd(),
                RULE_PATH_BENEATH,
                &rule as *const PathBeneathAttr,
                0u32,
            )
        };
        if rc != 0 {
            let e = io::Error::last_os_error();
            return Err(io::Error::new(
                e.kind(),
                format!("landlock rule {path}: {e}"),
            ));
        }
    }
    Ok(ruleset)
}

/// Restricts the calling process (and what it execs) to `ruleset`. For use between fork
/// and exec: one syscall, no allocation. Needs no_new_privs, which every sandbox process
/// inherits from PID 1.
///
/// # Safety
/// `ruleset` must be a Landlock ruleset fd.
pub unsafe fn restrict_self(ruleset: i32) -> io::Result<()> {
    // SAFETY: guaranteed by the caller.
    if unsafe { libc::syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0u32) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rights_grow_with_the_abi() {
        assert_eq!(write_rights(1) & (REFER | TRUNCATE), 0);
        assert_eq!(write_rights(2) & REFER, REFER);
        assert_eq!(write_rights(3) & TRUNCATE, TRUNCATE);
        assert_eq!(std::mem::size_of::<PathBeneathAttr>(), 12);
    }

    /// Runs `interpreter -c script` confined by `ruleset` (with no_new_privs, as in a
    /// sandbox).
    fn run_confined(interpreter: &str, script: &str, ruleset: &OwnedFd) -> std::process::Output {
        use std::os::unix::process::CommandExt;
        let fd = ruleset.as_raw_fd();
        let mut cmd = std::process::Command::new(interpreter);
        cmd.args(["-c", script]);
        // SAFETY: prctl and landlock_restrict_self are async-signal-safe.
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
                    return Err(io::Error::last_os_error());
                }
                restrict_self(fd)
            });
        }
        cmd.output().expect("run")
    }

    #[test]
    fn a_restricted_child_binds_and_connects_only_to_listed_ports() {
        let missing = abi_version().is_none_or(|v| v < 4);
        let missing = missing.then(|| "this kernel lacks Landlock ABI 4".to_string());
        if dsec_testkit::unavailable("landlock ports", missing).is_some() {
            return;
        }
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("listener");
        let open_port = listener.local_addr().expect("addr").port();
        let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("listener");
        let closed_port = closed.local_addr().expect("addr").port();
        let ports = [open_port];
        let ruleset = ruleset(&Rules {
            writable: &[],
            tcp_bind: Some(&[]),
            tcp_connect: Some(&ports),
        })
        .expect("ruleset");
        let script = format!(
            "import socket\n\
             def t(f):\n    try:\n        f(); return 'ok'\n    except OSError as e:\n        return e.__class__.__name__\n\
             print(t(lambda: socket.create_connection(('127.0.0.1', {open_port}))))\n\
             print(t(lambda: socket.create_connection(('127.0.0.1', {closed_port}))))\n\
             print(t(lambda: socket.socket().bind(('127.0.0.1', 0))))\n"
        );
        let out = run_confined("python3", &script, &ruleset);
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "ok\nPermissionError\nPermissionError\n",
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    #[test]
    fn a_restricted_child_writes_only_where_allowed() {
        let missing = abi_version()
            .is_none()
            .then(|| "this kernel lacks Landlock".to_string());
        if dsec_testkit::unavailable("landlock writes", missing).is_some() {
            return;
        }
        let base = std::env::temp_dir().join(format!("dsec-landlock-{}", std::process::id()));
        let (ok_dir, ro_dir) = (base.join("w"), base.join("r"));
        std::fs::create_dir_all(&ok_dir).expect("dir");
        std::fs::create_dir_all(&ro_dir).expect("dir");
        let ruleset = writable_ruleset(&[ok_dir.display().to_string()]).expect("ruleset");
        let script = format!(
            "echo a > {0}/f && echo allowed; echo b > {1}/f 2>/dev/null || echo denied; cat {1}/../w/f",
            ok_dir.display(),
            ro_dir.display()
        );
        let out = run_confined("sh", &script, &ruleset);
        assert_eq!(String::from_utf8_lossy(&out.stdout), "allowed\ndenied\na\n");
        assert!(!ro_dir.join("f").exists());
        std::fs::remove_dir_all(&base).expect("cleanup");
    }
}
