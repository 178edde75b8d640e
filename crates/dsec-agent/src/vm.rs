//! `dsec-agent vm-init`: PID 1 of a microVM guest.
//!
//! The kernel starts it from the node's initramfs (`/init -- vm-init`). It loads the
//! modules listed in `/modules.order`, reads the sandbox's [`GuestSpec`], mounts the
//! read-only EROFS layer disks (found by serial number) under an overlay whose upper
//! directory is on the writable disk, moves that root over the initramfs, and then serves
//! the agent protocol: on an abstract unix socket that the agent channel's relay (a
//! thread, `vm_channel`) connects each host stream to. Any failure is printed on the
//! console, where the node reads it, and powers the guest off.
//!
//! In a full VM ([`GuestSpec::system_init`]) the initramfs's part ends at the root: the
//! agent installs itself into it as a systemd service ([`AGENT_SERVICE`], running
//! `dsec-agent vm-service`) and hands the machine to the image's own init, as an
//! initramfs's `switch_root` does. The service then serves the same protocol over the
//! same port, as root of that system.

use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use dsec_agent::AgentConfig;
use dsec_wire::vm::{
    GuestSpec, AGENT_INSTALL_DIR, AGENT_PORT, AGENT_SERVICE, DISK_SERIAL, SPEC_PATH,
};
use nix::mount::{mount, MsFlags};

/// Abstract socket name the agent listens on inside the guest.
const AGENT_SOCKET: &str = "dsec-agent";
/// The initramfs's list of modules to load (written by the node's `dsec_vmm::guest`).
const MODULES_ORDER: &str = "/modules.order";
/// How long the guest waits for its disks and port to appear after loading drivers.
const DEVICE_WAIT: Duration = Duration::from_secs(20);

type Error = Box<dyn std::error::Error>;

/// Runs the guest's init; returns only after it failed (the caller powers off).
pub fn vm_init() -> Result<(), Error> {
    let t0 = Instant::now();
    mount_fs(
        "devtmpfs",
        "/dev",
        "devtmpfs",
        MsFlags::MS_NOSUID,
        "mode=0755",
    )?;
    mount_fs("proc", "/proc", "proc", nosuid_nodev_noexec(), "")?;
    mount_fs("sysfs", "/sys", "sysfs", nosuid_nodev_noexec(), "")?;
    if let Err(e) = crate::memguard::protect_working_set() {
        eprintln!("dsec-agent: no thrashing prevention (/sys/kernel/mm/lru_gen: {e})");
    }
    load_modules(Path::new(MODULES_ORDER))?;
    let spec: GuestSpec =
        serde_json::from_slice(&std::fs::read(SPEC_PATH).map_err(|e| format!("{SPEC_PATH}: {e}"))?)
            .map_err(|e| format!("{SPEC_PATH}: {e}"))?;
    if spec.system_init.is_some() {
        // A full machine: its pointer too.
        load_modules(Path::new(dsec_wire::vm::FULL_MACHINE_MODULES_ORDER))?;
    }
    let port = wait_for(|| find_port(AGENT_PORT), "the agent's virtio-serial port")?;
    // Lower layers, bottom first, each on its own disk.
    let mut lowers = Vec::with_capacity(spec.layers);
    for i in 0..spec.layers {
        let serial = dsec_wire::vm::layer_serial(i);
        let dev = wait_for(|| find_disk(&serial), &format!("layer disk {serial}"))?;
        let mnt = PathBuf::from(format!("/mnt/layer{i}"));
        mkdir(&mnt)?;
        mount(
            Some(&dev),
            &mnt,
            Some("erofs"),
            MsFlags::MS_RDONLY | MsFlags::MS_NODEV,
            None::<&str>,
        )
        .map_err(|e| format!("mount {} (erofs) on {}: {e}", dev.display(), mnt.display()))?;
        lowers.push(mnt);
    }
    let disk = PathBuf::from("/mnt/disk");
    mkdir(&disk)?;
    if spec.disk {
        let dev = wait_for(|| find_disk(DISK_SERIAL), "the writable disk")?;
        mount(
            Some(&dev),
            &disk,
            Some("ext4"),
            MsFlags::MS_NODEV,
            None::<&str>,
        )
        .map_err(|e| format!("mount {} (ext4): {e}", dev.display()))?;
    } else {
        mount_fs(
            "tmpfs",
            "/mnt/disk",
            "tmpfs",
            MsFlags::MS_NODEV,
            "mode=0755",
        )?;
    }
    let (upper, work) = (disk.join("upper"), disk.join("work"));
    mkdir(&upper)?;
    mkdir(&work)?;
    let root = Path::new("/mnt/root");
    mkdir(root)?;
    let lowerdir = lowers
        .iter()
        .rev()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(":");
    let opts = if lowerdir.is_empty() {
        return Err("the sandbox has no layers".into());
    } else {
        format!(
            "lowerdir={lowerdir},upperdir={},workdir={}",
            upper.display(),
            work.display()
        )
    };
    mount(
        Some("overlay"),
        root,
        Some("overlay"),
        MsFlags::empty(),
        Some(opts.as_str()),
    )
    .map_err(|e| format!("mount overlay: {e}"))?;
    if let Some(init) = &spec.system_init {
        return hand_over(&spec, root, init);
    }
    // The same views as a container's: sysfs read-only, a /dev of the usual few nodes
    // (not the guest's disks, its agent port or its memory).
    for (src, dst, fstype, flags, data) in [
        ("proc", "proc", "proc", nosuid_nodev_noexec(), ""),
        (
            "sysfs",
            "sys",
            "sysfs",
            nosuid_nodev_noexec() | MsFlags::MS_RDONLY,
            "",
        ),
        (
            "tmpfs",
            "dev",
            "tmpfs",
            MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
            "mode=0755",
        ),
        (
            "tmpfs",
            "run",
            "tmpfs",
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
            "mode=0755",
        ),
    ] {
        let target = root.join(dst);
        mkdir(&target)?;
        mount(Some(src), &target, Some(fstype), flags, Some(data))
            .map_err(|e| format!("mount {fstype} on {}: {e}", target.display()))?;
    }
    make_devices(&root.join("dev"))?;
    let pts = root.join("dev/pts");
    mkdir(&pts)?;
    mount(
        Some("devpts"),
        &pts,
        Some("devpts"),
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("newinstance,ptmxmode=0666,mode=0620"),
    )
    .map_err(|e| format!("mount devpts: {e}"))?;
    let shm = root.join("dev/shm");
    mkdir(&shm)?;
    mount(
        Some("shm"),
        &shm,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some("mode=1777"),
    )
    .map_err(|e| format!("mount /dev/shm: {e}"))?;
    limit_processes(spec.pids_max)?;
    // The agent port, opened while its node is in view (the sandbox's /dev lacks it).
    let port_io = open_port(&port)?;
    // The overlay becomes the root (the initramfs cannot be pivoted away; it stays below).
    std::env::set_current_dir(root)?;
    mount(Some("."), "/", None::<&str>, MsFlags::MS_MOVE, None::<&str>)
        .map_err(|e| format!("move the root: {e}"))?;
    nix::unistd::chroot(".").map_err(|e| format!("chroot: {e}"))?;
    std::env::set_current_dir("/")?;
    let _ = nix::unistd::sethostname(&spec.sandbox_id);
    loopback_up();
    if let Some(net) = &spec.net {
        configure_network(net)?;
    }
    dsec_container::rootfs::mask_paths(false).map_err(|e| format!("mask paths: {e}"))?;
    // A masked file is /dev/null bound over it; here read-only as well. The guest's
    // kernel has what the host's may lack (`/proc/sysrq-trigger`): a write must fail,
    // not seem to succeed.
    for p in dsec_container::rootfs::MASKED_PATHS {
        if std::fs::symlink_metadata(p).is_ok_and(|m| !m.is_dir()) {
            let flags =
                MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY | nosuid_nodev_noexec();
            let _ = mount(None::<&str>, *p, None::<&str>, flags, None::<&str>);
        }
    }
    let listener = bind_agent_socket()?;
    // The relay and the agent run ahead of commands (a fork bomb's 128 processes share
    // the guest's CPU, and the node's pings must still be answered): nice AGENT_NICE,
    // which the commands do not inherit (SCHED_RESET_ON_FORK). The relay thread sets
    // its own and then hardens itself: both are per thread.
    let (hardened_tx, hardened_rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("channel".into())
        .spawn(move || {
            raise_priority();
            let hardened = dsec_container::harden::apply().map_err(|e| e.to_string());
            let ok = hardened.is_ok();
            let _ = hardened_tx.send(hardened);
            if ok {
                relay(port_io);
            }
        })?;
    hardened_rx
        .recv()
        .map_err(|e| format!("channel thread: {e}"))?
        .map_err(|e| format!("harden the channel thread: {e}"))?;
    start_memory_guard();
    raise_priority();
    // Commands get a container's privileges here too (capabilities, no_new_privs,
    // seccomp policy): the guest kernel is the boundary, this is depth.
    dsec_container::harden::apply().map_err(|e| format!("harden: {e}"))?;
    eprintln!(
        "dsec-agent: guest ready in {} ms (kernel uptime {})",
        t0.elapsed().as_millis(),
        std::fs::read_to_string("/proc/uptime")
            .unwrap_or_default()
            .trim()
    );
    let cfg = AgentConfig {
        root: "/".into(),
        default_env: spec.env.clone(),
        default_cwd: spec.workdir.clone(),
        is_init: true,
        landlock: None,
        default_user: spec.user.clone(),
        call_helper: None,
    };
    dsec_agent::run(listener, cfg)?;
    Ok(())
}

/// Opens the agent's virtio-serial port for the channel thread.
fn open_port(port: &Path) -> Result<std::fs::File, Error> {
    Ok(std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC | libc::O_NOCTTY)
        .open(port)
        .map_err(|e| format!("open {}: {e}", port.display()))?)
}

/// The abstract socket the channel's relay connects host streams to.
fn bind_agent_socket() -> Result<std::os::unix::net::UnixListener, Error> {
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(AGENT_SOCKET)?;
    let listener = std::os::unix::net::UnixListener::bind_addr(&addr)?;
    // SAFETY: fcntl on a descriptor we own.
    unsafe { libc::fcntl(listener.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) };
    Ok(listener)
}

/// The spec a full VM's agent service reads (written by [`hand_over`]).
const SERVICE_SPEC: &str = "guest.json";

/// The agent's systemd unit in a full VM: started as soon as the local file systems
/// are, without waiting for the rest of the boot; restarted if it ends, without touching
/// the commands it started (they stay in its cgroup: `KillMode=process`); the last
/// process the guest's OOM killer picks; its messages (the memory guard's kills) on the
/// console, where the node reads them.
fn service_unit() -> String {
    format!(
        "[Unit]\n\
         Description=dsec agent (the node's commands, files and sessions)\n\
         DefaultDependencies=no\n\
         After=local-fs.target\n\
         \n\
         [Service]\n\
         ExecStart={AGENT_INSTALL_DIR}/dsec-agent vm-service\n\
         Restart=always\n\
         RestartSec=100ms\n\
         KillMode=process\n\
         OOMScoreAdjust=-1000\n\
         StandardError=journal+console\n\
         \n\
         [Install]\n\
         WantedBy=sysinit.target\n"
    )
}

/// A full VM: installs the agent and its service in `root` (the overlay, on the
/// writable disk) and hands the machine to the image's `init`, with the kernel's file
/// systems moved over. Returns only if that failed.
fn hand_over(spec: &GuestSpec, root: &Path, init: &str) -> Result<(), Error> {
    let dir = root.join(AGENT_INSTALL_DIR.trim_start_matches('/'));
    std::fs::create_dir_all(&dir).map_err(|e| format!("mkdir {}: {e}", dir.display()))?;
    // This binary, the initramfs's /init: the agent the node booted the guest with.
    let agent = dir.join("dsec-agent");
    std::fs::copy("/proc/self/exe", &agent)
        .map_err(|e| format!("install the agent at {}: {e}", agent.display()))?;
    std::fs::write(dir.join(SERVICE_SPEC), serde_json::to_vec(spec)?)?;
    let units = root.join("etc/systemd/system");
    let wants = units.join("sysinit.target.wants");
    std::fs::create_dir_all(&wants).map_err(|e| format!("mkdir {}: {e}", wants.display()))?;
    std::fs::write(units.join(AGENT_SERVICE), service_unit())?;
    let link = wants.join(AGENT_SERVICE);
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(format!("/etc/systemd/system/{AGENT_SERVICE}"), &link)
        .map_err(|e| format!("enable {AGENT_SERVICE}: {e}"))?;
    // The kernel's file systems go along (the system would mount its own otherwise,
    // but devtmpfs's nodes and the loaded drivers' state are already here).
    for fs in ["dev", "proc", "sys"] {
        let target = root.join(fs);
        mkdir(&target)?;
        mount(
            Some(&Path::new("/").join(fs)),
            &target,
            None::<&str>,
            MsFlags::MS_MOVE,
            None::<&str>,
        )
        .map_err(|e| format!("move /{fs} to the root: {e}"))?;
    }
    std::env::set_current_dir(root)?;
    mount(Some("."), "/", None::<&str>, MsFlags::MS_MOVE, None::<&str>)
        .map_err(|e| format!("move the root: {e}"))?;
    nix::unistd::chroot(".").map_err(|e| format!("chroot: {e}"))?;
    std::env::set_current_dir("/")?;
    // The network is up before the system starts: it has no network manager of ours to
    // run, and its services may reach out at once.
    loopback_up();
    if let Some(net) = &spec.net {
        configure_network(net)?;
    }
    eprintln!("dsec-agent: handing the machine to {init}");
    let path = std::ffi::CString::new(init)?;
    let err = nix::unistd::execv(&path, &[&path]).unwrap_err();
    Err(format!("exec the image's init {init}: {err}").into())
}

/// `dsec-agent vm-service`: the agent as a full VM's system service, serving the node
/// over the agent port as the guest's root (the machine is the boundary; commands get
/// the system's own privileges, not a container's).
pub fn vm_service() -> Result<(), Error> {
    let path = Path::new(AGENT_INSTALL_DIR).join(SERVICE_SPEC);
    let spec: GuestSpec = serde_json::from_slice(
        &std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?,
    )
    .map_err(|e| format!("{}: {e}", path.display()))?;
    let port = wait_for(|| find_port(AGENT_PORT), "the agent's virtio-serial port")?;
    let port_io = open_port(&port)?;
    let _ = nix::unistd::sethostname(&spec.sandbox_id);
    let listener = bind_agent_socket()?;
    std::thread::Builder::new()
        .name("channel".into())
        .spawn(move || {
            raise_priority();
            relay(port_io);
        })?;
    start_memory_guard();
    raise_priority();
    eprintln!("dsec-agent: serving the node as a system service");
    let cfg = AgentConfig {
        root: "/".into(),
        default_env: spec.env.clone(),
        default_cwd: spec.workdir.clone(),
        is_init: false,
        landlock: None,
        default_user: spec.user.clone(),
        call_helper: None,
    };
    dsec_agent::run(listener, cfg)?;
    Ok(())
}

/// Starts the memory-pressure guard ([`crate::memguard`]) on a thread of its own, ahead of
/// commands and hardened like the others. A guest kernel without PSI runs without it.
fn start_memory_guard() {
    let guard = match crate::memguard::Guard::arm() {
        Ok(g) => g,
        Err(e) => {
            eprintln!("dsec-agent: no memory-pressure guard (/proc/pressure/memory: {e})");
            return;
        }
    };
    let spawned = std::thread::Builder::new()
        .name("memguard".into())
        .spawn(move || {
            // SIGCHLD belongs to the agent's reaper.
            let mut set = nix::sys::signal::SigSet::empty();
            set.add(nix::sys::signal::Signal::SIGCHLD);
            let _ = set.thread_block();
            raise_priority();
            match dsec_container::harden::apply() {
                Ok(()) => guard.run(),
                Err(e) => eprintln!("dsec-agent: memory guard not hardened, not run: {e}"),
            }
        });
    if let Err(e) = spawned {
        eprintln!("dsec-agent: memory guard thread: {e}");
    }
}

/// The channel thread: relays host streams to the agent's socket, for the guest's life.
fn relay(port: std::fs::File) {
    // SIGCHLD belongs to the agent's reaper (a signalfd on the main thread).
    let mut set = nix::sys::signal::SigSet::empty();
    set.add(nix::sys::signal::Signal::SIGCHLD);
    let _ = set.thread_block();
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("dsec-agent: channel runtime: {e}");
            return;
        }
    };
    let agent = PathBuf::from(format!("\0{AGENT_SOCKET}"));
    if let Err(e) = rt.block_on(dsec_agent::vm_channel::serve(port, agent)) {
        eprintln!("dsec-agent: agent channel failed: {e}");
    }
}

fn nosuid_nodev_noexec() -> MsFlags {
    MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC
}

fn mkdir(p: &Path) -> Result<(), Error> {
    std::fs::create_dir_all(p).map_err(|e| format!("mkdir {}: {e}", p.display()).into())
}

fn mount_fs(src: &str, dst: &str, fstype: &str, flags: MsFlags, data: &str) -> Result<(), Error> {
    mkdir(Path::new(dst))?;
    mount(Some(src), dst, Some(fstype), flags, Some(data))
        .map_err(|e| format!("mount {fstype} on {dst}: {e}").into())
}

/// Loads each module listed (one path per line), in order; one already loaded is fine.
fn load_modules(list: &Path) -> Result<(), Error> {
    let text = std::fs::read_to_string(list).map_err(|e| format!("{}: {e}", list.display()))?;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let f = std::fs::File::open(line).map_err(|e| format!("{line}: {e}"))?;
        // SAFETY: finit_module with an open file and an empty parameter string.
        let rc = unsafe { libc::syscall(libc::SYS_finit_module, f.as_raw_fd(), c"".as_ptr(), 0) };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EEXIST) {
                return Err(format!("load module {line}: {e}").into());
            }
        }
    }
    Ok(())
}

/// Retries `find` until it finds something or [`DEVICE_WAIT`] is over.
fn wait_for(mut find: impl FnMut() -> Option<PathBuf>, what: &str) -> Result<PathBuf, Error> {
    let start = Instant::now();
    loop {
        if let Some(p) = find() {
            return Ok(p);
        }
        if start.elapsed() > DEVICE_WAIT {
            return Err(format!("{what} did not appear in {DEVICE_WAIT:?}").into());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The block device whose virtio serial number is `serial`.
fn find_disk(serial: &str) -> Option<PathBuf> {
    for e in std::fs::read_dir("/sys/block").ok()?.flatten() {
        let name = e.file_name();
        let Ok(s) = std::fs::read_to_string(e.path().join("serial")) else {
            continue;
        };
        if s.trim() == serial {
            return Some(Path::new("/dev").join(name));
        }
    }
    None
}

/// The device of the virtio-serial port named `name`.
fn find_port(name: &str) -> Option<PathBuf> {
    for e in std::fs::read_dir("/sys/class/virtio-ports").ok()?.flatten() {
        let Ok(n) = std::fs::read_to_string(e.path().join("name")) else {
            continue;
        };
        if n.trim() == name {
            let dev = Path::new("/dev").join(e.file_name());
            return dev.exists().then_some(dev);
        }
    }
    None
}

/// Brings the loopback interface up (a guest without a network still has localhost).
fn loopback_up() {
    if let Err(e) = dsec_netconf::set_up("lo") {
        eprintln!("dsec-agent: loopback up: {e}");
    }
}

/// Configures the guest's NIC as the node leased it (address, route, resolver): the
/// host end of its tap is the gateway, behind the node's nftables rules.
fn configure_network(net: &dsec_wire::vm::GuestNet) -> Result<(), Error> {
    let ifname = dsec_wire::vm::GUEST_IFNAME;
    let sys = Path::new("/sys/class/net").join(ifname);
    wait_for(|| sys.exists().then(|| sys.clone()), "the guest's NIC")?;
    let step =
        |what: &str, r: std::io::Result<()>| r.map_err(|e| format!("{what} of {ifname}: {e}"));
    step(
        "address",
        dsec_netconf::set_addr(ifname, net.address, net.prefix_len),
    )?;
    step("link up", dsec_netconf::set_up(ifname))?;
    step(
        "default route",
        dsec_netconf::add_default_route(net.gateway),
    )?;
    // The image's /etc/resolv.conf may be a link into a resolver the guest lacks.
    let resolv = Path::new("/etc/resolv.conf");
    let _ = std::fs::remove_file(resolv);
    std::fs::write(resolv, &net.resolv_conf).map_err(|e| format!("write /etc/resolv.conf: {e}"))?;
    Ok(())
}

/// Nice value of the agent's threads in the guest (commands start at 0).
const AGENT_NICE: libc::c_int = -10;

/// Gives the calling thread [`AGENT_NICE`], not inherited by what it starts.
fn raise_priority() {
    // SAFETY: plain system calls on the calling thread with valid arguments.
    unsafe {
        let param = libc::sched_param { sched_priority: 0 };
        if libc::sched_setscheduler(0, libc::SCHED_OTHER | libc::SCHED_RESET_ON_FORK, &param) != 0 {
            eprintln!(
                "dsec-agent: SCHED_RESET_ON_FORK: {}",
                std::io::Error::last_os_error()
            );
            return;
        }
        if libc::setpriority(libc::PRIO_PROCESS, 0, AGENT_NICE) != 0 {
            eprintln!("dsec-agent: nice: {}", std::io::Error::last_os_error());
        }
    }
}

/// Puts the agent, and so everything it starts, in a guest cgroup of at most `max`
/// processes (a fork bomb stops there; as the guest's root, commands are not subject to
/// `RLIMIT_NPROC`). The hierarchy is mounted in the initramfs, out of the sandbox's view.
fn limit_processes(max: u64) -> Result<(), Error> {
    let root = Path::new("/sys/fs/cgroup");
    mount(
        Some("cgroup2"),
        root,
        Some("cgroup2"),
        nosuid_nodev_noexec(),
        None::<&str>,
    )
    .map_err(|e| format!("mount cgroup2: {e}"))?;
    let write = |file: &Path, value: &str| {
        std::fs::write(file, value).map_err(|e| format!("{}: {e}", file.display()))
    };
    write(&root.join("cgroup.subtree_control"), "+pids")?;
    let group = root.join("sandbox");
    mkdir(&group)?;
    // As in a container's cgroup, the agent's own tasks count too.
    write(&group.join("pids.max"), &max.to_string())?;
    write(&group.join("cgroup.procs"), "0")?;
    Ok(())
}

/// A container's device nodes in `dev` (a fresh tmpfs) and the usual links.
fn make_devices(dev: &Path) -> Result<(), Error> {
    use nix::sys::stat::{makedev, mknod, Mode, SFlag};
    use std::os::unix::fs::PermissionsExt;
    for (name, major, minor) in dsec_container::rootfs::DEVICES {
        let path = dev.join(name);
        mknod(
            &path,
            SFlag::S_IFCHR,
            Mode::from_bits_truncate(0o666),
            makedev(*major, *minor),
        )
        .map_err(|e| format!("mknod {}: {e}", path.display()))?;
        // The umask took some bits.
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666))?;
    }
    for (link, target) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
        ("ptmx", "pts/ptmx"),
    ] {
        std::os::unix::fs::symlink(target, dev.join(link))?;
    }
    Ok(())
}

/// Prints `err` on the console and powers the guest off (the node sees QEMU end).
pub fn fail(err: &Error) -> ! {
    let _ = writeln!(std::io::stderr(), "dsec-agent: vm-init failed: {err}");
    // SAFETY: reboot(2) with a valid command; as PID 1 this ends the guest.
    unsafe { libc::reboot(libc::RB_POWER_OFF) };
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}
