//! User namespaces for sandboxes: uid and gid 0..65535 inside map to an unprivileged host
//! range, so root in a sandbox is nobody on the host. Layers and writable disks reach a
//! sandbox as idmapped mounts for its namespace, so files keep their owners (0 on disk is
//! 0 inside) while the host sees the range.
//!
//! The node's id space (`dsec serve --userns-base`, `--userns-ranges`) is cut into ranges
//! of [`RANGE_SIZE`] ids. [`UidRanges`] hands them out by [`UsernsScope`]: one per
//! sandbox (default), one per value of a label (a tenant), or one for the whole node.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Write};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::path::Path;

const OPEN_TREE_CLONE: libc::c_uint = 1;
const MOUNT_ATTR_IDMAP: u64 = 0x0010_0000;

/// Ids in one sandbox's (or tenant's) range: uids and gids 0..65535 inside.
pub const RANGE_SIZE: u32 = 65_536;

/// `struct mount_attr` of `mount_setattr(2)`.
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

/// A user namespace mapping `0..size` inside to `base..base+size` on the host.
#[derive(Debug)]
pub struct UserNs {
    fd: OwnedFd,
    /// First host uid/gid of the range.
    pub base: u32,
    /// Number of ids mapped.
    pub size: u32,
}

impl UserNs {
    /// Makes the namespace: a helper process is cloned straight into a new user
    /// namespace (sharing the node's memory, so nothing is copied), the node writes its
    /// maps, keeps a handle and kills the helper. About 0.2 ms.
    pub fn create(base: u32, size: u32) -> io::Result<Self> {
        Self::make(base, size, false).map(|(ns, _)| ns)
    }

    /// Like [`UserNs::create`], with a new network namespace that belongs to it (so root
    /// in the namespace may mount sysfs for it). Its loopback is down.
    pub fn create_with_netns(base: u32, size: u32) -> io::Result<(Self, OwnedFd)> {
        let (ns, net) = Self::make(base, size, true)?;
        let net = net.ok_or_else(|| io::Error::other("network namespace not made"))?;
        Ok((ns, net))
    }

    fn make(base: u32, size: u32, netns: bool) -> io::Result<(Self, Option<OwnedFd>)> {
        if size == 0 || base == 0 || base.checked_add(size).is_none() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("user namespace range {base}+{size}: base and size must be > 0"),
            ));
        }
        let helper = Helper::spawn(if netns { libc::CLONE_NEWNET } else { 0 })?;
        let made = (|| {
            let pid = helper.pid;
            for map in ["uid_map", "gid_map"] {
                File::options()
                    .write(true)
                    .open(format!("/proc/{pid}/{map}"))?
                    .write_all(format!("0 {base} {size}\n").as_bytes())?;
            }
            let user = File::open(format!("/proc/{pid}/ns/user")).map(OwnedFd::from)?;
            let net = match netns {
                true => Some(File::open(format!("/proc/{pid}/ns/net")).map(OwnedFd::from)?),
                false => None,
            };
            Ok::<_, io::Error>((user, net))
        })();
        drop(helper);
        let (fd, net) = made?;
        Ok((Self { fd, base, size }, net))
    }

    /// The namespace, to hand to a sandbox's init.
    pub fn fd(&self) -> BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.fd.as_fd()
    }

    /// A detached clone of the mount at `path` that shows its files through this
    /// namespace's mapping.
    pub fn idmapped_clone(&self, path: &Path) -> io::Result<OwnedFd> {
        let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path with NUL"))?;
        self.clone_at(libc::AT_FDCWD, &c, 0)
    }

    /// Like [`UserNs::idmapped_clone`], for a mount held by an fd (a detached mount).
    pub fn idmapped_clone_fd(&self, mount: BorrowedFd<'_>) -> io::Result<OwnedFd> {
        self.clone_at(mount.as_raw_fd(), c"", libc::AT_EMPTY_PATH as libc::c_uint)
    }

    fn clone_at(
        &self,
        dirfd: i32,
        path: &std::ffi::CStr,
        flags: libc::c_uint,
    ) -> io::Result<OwnedFd> {
        // SAFETY: open_tree with a valid dirfd/path pair; the result is checked and owned.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_open_tree,
                dirfd,
                path.as_ptr(),
                OPEN_TREE_CLONE | libc::O_CLOEXEC as libc::c_uint | flags,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: open_tree returned a new fd that nothing else owns.
        let tree = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        let attr = MountAttr {
            attr_set: MOUNT_ATTR_IDMAP,
            attr_clr: 0,
            propagation: 0,
            userns_fd: self.fd.as_raw_fd() as u64,
        };
        // SAFETY: mount_setattr on the detached tree with a mount_attr of the right size.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_mount_setattr,
                tree.as_raw_fd(),
                c"".as_ptr(),
                libc::AT_EMPTY_PATH as libc::c_uint,
                &attr as *const MountAttr,
                std::mem::size_of::<MountAttr>(),
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(tree)
    }
}

/// A process parked in a fresh user namespace, killed and reaped on drop.
///
/// It never outlives the node nor holds anything of it: it drops every descriptor it
/// was cloned with (its descriptor table is a copy, so the node's stay open) and dies
/// with the thread that made it (`PR_SET_PDEATHSIG`). Without that, a helper alive when
/// the node was killed kept the API socket, client connections, the state database and
/// the cgroup-parent claim forever (every signal is blocked in it), and no restart
/// could take the claim.
struct Helper {
    pid: libc::pid_t,
    /// The helper's stack; it shares the node's memory, so this must outlive it (it is
    /// freed with `Self`, after the helper is reaped).
    _stack: Vec<u8>,
}

/// A system call that leaves `errno` alone: the helper shares the node's memory and the
/// cloning thread's thread pointer, so libc's wrappers would write that thread's errno.
/// Returns the kernel's result (`-errno` on failure).
///
/// # Safety
/// The caller passes arguments valid for system call `nr`.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
unsafe fn raw_syscall(nr: libc::c_long, a: [usize; 4]) -> isize {
    let ret: isize;
    // SAFETY: the caller's contract; the kernel touches only the registers named.
    #[cfg(target_arch = "x86_64")]
    unsafe {
        std::arch::asm!(
            "syscall",
            inlateout("rax") nr as isize => ret,
            in("rdi") a[0],
            in("rsi") a[1],
            in("rdx") a[2],
            in("r10") a[3],
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    // SAFETY: as above.
    #[cfg(target_arch = "aarch64")]
    unsafe {
        std::arch::asm!(
            "svc 0",
            in("x8") nr as usize,
            inlateout("x0") a[0] as isize => ret,
            in("x1") a[1],
            in("x2") a[2],
            in("x3") a[3],
            options(nostack),
        );
    }
    ret
}

/// Elsewhere, libc's wrapper (it may write the cloning thread's errno on failure).
///
/// # Safety
/// The caller passes arguments valid for system call `nr`.
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
unsafe fn raw_syscall(nr: libc::c_long, a: [usize; 4]) -> isize {
    // SAFETY: the caller's contract.
    unsafe { libc::syscall(nr, a[0], a[1], a[2], a[3]) as isize }
}

/// What the helper runs: nothing, until it is killed. Every signal is blocked (the mask
/// was set before the clone), and it makes raw system calls only: it shares the node's
/// memory, including the cloning thread's errno. `parent` is the node's pid.
extern "C" fn park(parent: *mut libc::c_void) -> libc::c_int {
    // SAFETY: system calls on integers only; exit_group ends this process alone (it
    // shares memory, not the thread group, with the node).
    unsafe {
        // SIGKILL cannot be blocked: it comes when the cloning thread ends.
        raw_syscall(
            libc::SYS_prctl,
            [
                libc::PR_SET_PDEATHSIG as usize,
                libc::SIGKILL as usize,
                0,
                0,
            ],
        );
        // The node died before the line above: nothing would ever kill us.
        if raw_syscall(libc::SYS_getppid, [0; 4]) != parent as isize {
            raw_syscall(libc::SYS_exit_group, [0; 4]);
        }
        // Our copy of the node's descriptor table: closing it leaves the node's open.
        raw_syscall(libc::SYS_close_range, [0, libc::c_uint::MAX as usize, 0, 0]);
        loop {
            // ppoll with no fds, no timeout and no mask only sleeps.
            raw_syscall(libc::SYS_ppoll, [0; 4]);
        }
    }
}

impl Helper {
    const STACK: usize = 16 * 1024;

    /// A helper in a new user namespace, and in new namespaces of `extra` clone flags
    /// (which then belong to that user namespace).
    fn spawn(extra: libc::c_int) -> io::Result<Self> {
        let mut stack = vec![0u8; Self::STACK];
        // The stack grows down from its 16-byte aligned top.
        let top = (stack.as_mut_ptr() as usize + Self::STACK) & !15;
        // SAFETY: getpid has no preconditions.
        let me = unsafe { libc::getpid() };
        // SAFETY: sigfillset/pthread_sigmask on local sets; clone with CLONE_VM runs
        // `park` on `stack`, which lives in `Self` until the helper is reaped; the
        // previous mask is restored whatever clone returned.
        let pid = unsafe {
            let mut all: libc::sigset_t = std::mem::zeroed();
            let mut old: libc::sigset_t = std::mem::zeroed();
            libc::sigfillset(&mut all);
            libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old);
            let pid = libc::clone(
                park,
                top as *mut libc::c_void,
                libc::CLONE_NEWUSER | extra | libc::CLONE_VM | libc::SIGCHLD,
                me as isize as *mut libc::c_void,
            );
            let err = io::Error::last_os_error();
            libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
            if pid < 0 {
                return Err(err);
            }
            pid
        };
        Ok(Self { pid, _stack: stack })
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        // SAFETY: kill and waitpid on our own child; its stack is freed only after.
        unsafe {
            libc::kill(self.pid, libc::SIGKILL);
            while libc::waitpid(self.pid, std::ptr::null_mut(), 0) < 0
                && io::Error::last_os_error().raw_os_error() == Some(libc::EINTR)
            {}
        }
    }
}

/// Who shares a uid range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UsernsScope {
    /// Every sandbox gets a range of its own (the default).
    Sandbox,
    /// Sandboxes with the same value of this label share a range (a tenant); those
    /// without the label get one each.
    Label(String),
    /// All sandboxes of the node share the first range.
    Node,
}

impl std::str::FromStr for UsernsScope {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "sandbox" => Ok(Self::Sandbox),
            "node" => Ok(Self::Node),
            _ => match s.strip_prefix("label:") {
                Some(key) if !key.is_empty() => Ok(Self::Label(key.to_string())),
                _ => Err(format!(
                    "user namespace scope {s:?}: expected sandbox, node or label:KEY"
                )),
            },
        }
    }
}

/// The node's user namespace settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsernsConfig {
    /// First host id of the first range.
    pub base: u32,
    /// How many ranges of [`RANGE_SIZE`] ids the node may use (capped to what fits
    /// below 2^32).
    pub ranges: u32,
    /// Who shares a range.
    pub scope: UsernsScope,
}

impl UsernsConfig {
    /// Ranges that exist: the configured number, at most what fits below 2^32.
    pub fn usable_ranges(&self) -> u32 {
        let fit = (u32::MAX - self.base) / RANGE_SIZE;
        self.ranges.min(fit)
    }

    /// The group a sandbox's range is shared by under this scope.
    pub fn group_of(
        &self,
        sandbox_id: &str,
        labels: &std::collections::BTreeMap<String, String>,
    ) -> String {
        match &self.scope {
            UsernsScope::Sandbox => format!("sandbox:{sandbox_id}"),
            UsernsScope::Node => "node".to_string(),
            UsernsScope::Label(key) => match labels.get(key) {
                Some(v) => format!("label:{key}={v}"),
                None => format!("sandbox:{sandbox_id}"),
            },
        }
    }
}

/// A sandbox's uid range, as its runtime record keeps it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct UsernsRecord {
    /// First host id.
    pub base: u32,
    /// Number of ids.
    pub size: u32,
    /// Who shares it (`sandbox:ID`, `label:KEY=VALUE`, `node`).
    pub group: String,
}

/// Every range is taken.
#[derive(Debug, thiserror::Error)]
#[error("no free uid range: all {0} ranges of 65536 ids are taken (dsec serve --userns-ranges)")]
pub struct RangesExhausted(pub u32);

/// Hands out uid ranges to sandboxes by group: round-robin over free ranges, so a range
/// just given back is the last to be reused.
#[derive(Debug)]
pub struct UidRanges {
    base: u32,
    count: u32,
    cursor: u32,
    /// Range index and number of sandboxes, per group: where its next sandbox goes.
    groups: HashMap<String, (u32, usize)>,
    /// Group and range index of each sandbox holding a range.
    sandboxes: HashMap<String, (String, u32)>,
    /// Sandboxes per range index in use.
    users: HashMap<u32, usize>,
}

impl UidRanges {
    /// An allocator over `cfg`'s ranges, none taken.
    pub fn new(cfg: &UsernsConfig) -> Self {
        Self {
            base: cfg.base,
            count: cfg.usable_ranges(),
            cursor: 0,
            groups: HashMap::new(),
            sandboxes: HashMap::new(),
            users: HashMap::new(),
        }
    }

    /// The range for `sandbox` in `group`: the group's if it has one, else a free one.
    /// The node group always gets the first range.
    pub fn acquire(&mut self, sandbox: &str, group: &str) -> Result<UsernsRecord, RangesExhausted> {
        if let Some(rec) = self.held(sandbox) {
            return Ok(rec);
        }
        let index = match self.groups.get(group) {
            Some((index, _)) => *index,
            None if group == "node" => 0,
            None => self.free_index().ok_or(RangesExhausted(self.count))?,
        };
        self.hold(sandbox, group, index);
        Ok(self.record(index, group))
    }

    /// Marks a re-adopted sandbox's range taken, under the group it was made for.
    pub fn adopt(&mut self, sandbox: &str, rec: &UsernsRecord) {
        let Some(index) = rec
            .base
            .checked_sub(self.base)
            .filter(|off| off % RANGE_SIZE == 0)
            .map(|off| off / RANGE_SIZE)
        else {
            tracing::warn!(%sandbox, base = rec.base, "uid range outside this node's; not tracked");
            return;
        };
        self.hold(sandbox, &rec.group, index);
        self.cursor = self.cursor.max(index + 1);
    }

    /// Gives back a sandbox's hold on its range: free again once no sandbox uses it.
    pub fn release(&mut self, sandbox: &str) {
        let Some((group, index)) = self.sandboxes.remove(sandbox) else {
            return;
        };
        if let Some(users) = self.users.get_mut(&index) {
            *users -= 1;
            if *users == 0 {
                self.users.remove(&index);
            }
        }
        if let Some((_, members)) = self.groups.get_mut(&group) {
            *members -= 1;
            if *members == 0 {
                self.groups.remove(&group);
            }
        }
    }

    /// Hands the range `from` holds alone to `sandbox` as the range of `group`, which must
    /// not have one yet. Returns the sandbox's record, or `None` (nothing changed) when
    /// `from` holds nothing or shares its range, or `group` already has one.
    pub fn transfer(&mut self, from: &str, sandbox: &str, group: &str) -> Option<UsernsRecord> {
        if self.groups.contains_key(group) || self.sandboxes.contains_key(sandbox) {
            return None;
        }
        let (_, index) = self.sandboxes.get(from)?.clone();
        if self.users.get(&index) != Some(&1) {
            return None;
        }
        self.release(from);
        self.hold(sandbox, group, index);
        Some(self.record(index, group))
    }

    /// The range a sandbox holds.
    pub fn held(&self, sandbox: &str) -> Option<UsernsRecord> {
        let (group, index) = self.sandboxes.get(sandbox)?;
        Some(self.record(*index, group))
    }

    /// Number of ranges in use.
    pub fn in_use(&self) -> usize {
        self.users.len()
    }

    fn hold(&mut self, sandbox: &str, group: &str, index: u32) {
        // A group keeps the range it was first seen with (two sandboxes of one group in
        // different ranges happen only after the node's scope changed).
        self.groups.entry(group.to_string()).or_insert((index, 0)).1 += 1;
        *self.users.entry(index).or_insert(0) += 1;
        self.sandboxes
            .insert(sandbox.to_string(), (group.to_string(), index));
    }

    fn free_index(&mut self) -> Option<u32> {
        for step in 0..self.count {
            let i = (self.cursor + step) % self.count;
            if !self.users.contains_key(&i) {
                self.cursor = (i + 1) % self.count;
                return Some(i);
            }
        }
        None
    }

    fn record(&self, index: u32, group: &str) -> UsernsRecord {
        UsernsRecord {
            base: self.base + index * RANGE_SIZE,
            size: RANGE_SIZE,
            group: group.to_string(),
        }
    }
}

/// The range of a running process's user namespace (the first line of its uid map).
pub fn range_of(pid: i32) -> Option<(u32, u32)> {
    let map = std::fs::read_to_string(format!("/proc/{pid}/uid_map")).ok()?;
    let mut f = map.lines().next()?.split_whitespace();
    let (inside, outside, size) = (f.next()?, f.next()?, f.next()?);
    (inside == "0").then_some(())?;
    Some((outside.parse().ok()?, size.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_clone_shows_files_through_the_mapping() {
        if !dsec_testkit::require_root("userns") {
            return;
        }
        let ns = UserNs::create(300_000, 65_536).expect("userns");
        let dir = std::env::temp_dir().join(format!("dsec-userns-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        std::fs::write(dir.join("f"), b"x").expect("file");
        std::os::unix::fs::chown(dir.join("f"), Some(1000), Some(1000)).expect("chown");
        let tree = ns.idmapped_clone(&dir).expect("clone");
        let meta = std::fs::metadata(format!("/proc/self/fd/{}/f", tree.as_raw_fd()))
            .expect("stat through the clone");
        use std::os::unix::fs::MetadataExt;
        assert_eq!((meta.uid(), meta.gid()), (301_000, 301_000));
        let again = ns
            .idmapped_clone_fd(std::os::fd::AsFd::as_fd(&tree))
            .map(|_| ());
        // A clone of an idmapped mount cannot be idmapped a second time.
        assert!(again.is_err());
        drop(tree);
        std::fs::remove_dir_all(&dir).expect("cleanup");
        assert!(UserNs::create(0, 10).is_err());
    }

    fn cfg(scope: UsernsScope, ranges: u32) -> UsernsConfig {
        UsernsConfig {
            base: 1_000_000_000,
            ranges,
            scope,
        }
    }

    #[test]
    fn sandboxes_get_distinct_ranges_reused_last() {
        let c = cfg(UsernsScope::Sandbox, 3);
        let mut r = UidRanges::new(&c);
        let labels = Default::default();
        let a = r.acquire("a", &c.group_of("a", &labels)).expect("a");
        let b = r.acquire("b", &c.group_of("b", &labels)).expect("b");
        assert_eq!(a.base, 1_000_000_000);
        assert_eq!(b.base, 1_000_000_000 + RANGE_SIZE);
        assert_eq!(r.acquire("a", "sandbox:a").expect("again"), a);
        r.release("a");
        // Round-robin: the range just freed comes after the one never used.
        let d = r.acquire("d", "sandbox:d").expect("d");
        assert_eq!(d.base, 1_000_000_000 + 2 * RANGE_SIZE);
        let e = r.acquire("e", "sandbox:e").expect("e");
        assert_eq!(e.base, a.base);
        let full = r.acquire("f", "sandbox:f").expect_err("full");
        assert!(full.to_string().contains("all 3 ranges"), "{full}");
        assert_eq!(r.in_use(), 3);
    }

    #[test]
    fn a_label_shares_a_range_until_its_last_sandbox_goes() {
        let c = cfg(UsernsScope::Label("tenant".into()), 8);
        let t1 = [("tenant".to_string(), "t1".to_string())].into();
        let none = Default::default();
        assert_eq!(c.group_of("x", &t1), "label:tenant=t1");
        assert_eq!(c.group_of("x", &none), "sandbox:x");
        let mut r = UidRanges::new(&c);
        let a = r.acquire("a", &c.group_of("a", &t1)).expect("a");
        let b = r.acquire("b", &c.group_of("b", &t1)).expect("b");
        let other = r.acquire("o", &c.group_of("o", &none)).expect("o");
        assert_eq!(a.base, b.base);
        assert_ne!(a.base, other.base);
        r.release("a");
        assert_eq!(r.in_use(), 2);
        r.release("b");
        assert_eq!(r.in_use(), 1);
    }

    #[test]
    fn a_range_held_alone_moves_between_holders() {
        let c = cfg(UsernsScope::Label("tenant".into()), 4);
        let mut r = UidRanges::new(&c);
        let pooled = r.acquire("pool:0", "pool:0").expect("pool");
        let got = r.transfer("pool:0", "a", "sandbox:a").expect("transfer");
        assert_eq!(got.base, pooled.base);
        assert_eq!(got.group, "sandbox:a");
        assert!(r.held("pool:0").is_none());
        assert_eq!(r.in_use(), 1);
        // Back again once the sandbox is gone.
        assert!(r.transfer("a", "pool:1", "pool:1").is_some());
        assert_eq!(r.held("pool:1").expect("held").base, pooled.base);
        // A shared range (a label group's) never moves; nor into a group that has one.
        let t1 = r.acquire("b", "label:tenant=t1").expect("b");
        r.acquire("c", "label:tenant=t1").expect("c");
        assert!(r.transfer("b", "pool:2", "pool:2").is_none());
        assert!(r.transfer("pool:1", "d", "label:tenant=t1").is_none());
        assert_eq!(r.held("b").expect("b").base, t1.base);
        assert!(r.transfer("nobody", "e", "sandbox:e").is_none());
    }

    #[test]
    fn adopted_ranges_are_not_handed_out_again() {
        let c = cfg(UsernsScope::Sandbox, 4);
        let mut r = UidRanges::new(&c);
        let old = UsernsRecord {
            base: 1_000_000_000 + RANGE_SIZE,
            size: RANGE_SIZE,
            group: "node".into(),
        };
        r.adopt("legacy", &old);
        for id in ["a", "b", "c"] {
            let got = r.acquire(id, &format!("sandbox:{id}")).expect("acquire");
            assert_ne!(got.base, old.base, "{id}");
        }
        assert!(r.acquire("d", "sandbox:d").is_err());
        // The node group joins the legacy sandbox's range, wherever that is.
        r.release("a");
        assert_eq!(r.acquire("n", "node").expect("node").base, old.base);
    }

    #[test]
    fn scopes_parse_and_ranges_fit_below_two_to_the_32() {
        assert_eq!("sandbox".parse(), Ok(UsernsScope::Sandbox));
        assert_eq!("node".parse(), Ok(UsernsScope::Node));
        assert_eq!("label:team".parse(), Ok(UsernsScope::Label("team".into())));
        assert!("label:".parse::<UsernsScope>().is_err());
        assert!("tenant".parse::<UsernsScope>().is_err());
        let c = UsernsConfig {
            base: u32::MAX - 3 * RANGE_SIZE,
            ranges: 100,
            scope: UsernsScope::Sandbox,
        };
        assert_eq!(c.usable_ranges(), 3);
    }

    /// A helper holds none of the node's descriptors (the API socket, the state
    /// database, the claim lock) and dies with the thread that made it, so a killed
    /// node leaves none behind.
    #[test]
    fn a_helper_holds_no_descriptor_and_dies_with_its_maker() {
        if !dsec_testkit::require_root("userns helper") {
            return;
        }
        /// Waits until the helper has closed its descriptors (the last thing it does
        /// before it parks, after setting its parent-death signal).
        fn settled(helper: &Helper) {
            let fds = format!("/proc/{}/fd", helper.pid);
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            loop {
                let open = std::fs::read_dir(&fds).map(|d| d.count()).unwrap_or(0);
                if open == 0 {
                    return;
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "the helper still holds {open} descriptors"
                );
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        }
        let held = File::open("/etc/hostname").expect("a descriptor of ours");
        let helper = Helper::spawn(0).expect("helper");
        settled(&helper);
        // Ours are untouched by its closing them.
        assert!(std::fs::metadata(format!("/proc/self/fd/{}", held.as_raw_fd())).is_ok());
        drop(helper);

        // Made by a thread that then ends (as a killed node's threads do): the kernel
        // kills it, although it blocks every signal.
        let helper = std::thread::spawn(|| {
            let helper = Helper::spawn(0).expect("helper");
            settled(&helper);
            helper
        })
        .join()
        .expect("thread");
        let mut status = 0;
        // SAFETY: waitpid on our own child.
        let got = unsafe { libc::waitpid(helper.pid, &mut status, 0) };
        assert_eq!(got, helper.pid);
        assert!(
            libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGKILL,
            "status {status:#x}"
        );
        // Reaped already: its drop must not signal a pid that may be reused (the stack
        // it used is leaked, 16 KiB in a test).
        std::mem::forget(helper);
    }

    #[test]
    fn many_namespaces_are_made_and_their_helpers_reaped() {
        if !dsec_testkit::require_root("userns") {
            return;
        }
        let mut held = Vec::new();
        for i in 0..64u32 {
            let base = 1_000_000_000 + i * RANGE_SIZE;
            let ns = UserNs::create(base, RANGE_SIZE).expect("userns");
            held.push(ns);
        }
        // Each namespace is distinct and kept alive by its fd alone.
        let inodes: std::collections::HashSet<u64> = held
            .iter()
            .map(|ns| {
                use std::os::unix::fs::MetadataExt;
                std::fs::metadata(format!("/proc/self/fd/{}", ns.fd().as_raw_fd()))
                    .expect("ns fd")
                    .ino()
            })
            .collect();
        assert_eq!(inodes.len(), 64);
        // A helper lives in a namespace of its own until dropped, and is then gone,
        // not even a zombie.
        let helper = Helper::spawn(0).expect("helper");
        let pid = helper.pid;
        assert_ne!(
            std::fs::read_link(format!("/proc/{pid}/ns/user")).expect("helper ns"),
            std::fs::read_link("/proc/self/ns/user").expect("own ns")
        );
        drop(helper);
        assert!(
            !Path::new(&format!("/proc/{pid}")).exists(),
            "helper {pid} left"
        );
    }
}
