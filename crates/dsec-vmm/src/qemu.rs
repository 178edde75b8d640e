//! The QEMU process of one microVM: its command line, its start (daemonized, in the
//! sandbox's cgroups) and the files it keeps in the sandbox's VM directory.
//!
//! The machine is QEMU's `microvm`: virtio-mmio devices only, no PCI, no firmware option
//! ROMs. Under TCG (no usable KVM) the guest cannot calibrate its TSC without an HPET or
//! PM timer and hangs at boot unless told the rate (`tsc_early_khz`); ACPI stays on, as
//! it is how the guest finds the virtio-mmio devices.

use std::ffi::CString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::qmp::Qmp;
use crate::VmmError;

/// How long QEMU may take to set up its devices and sockets.
const SOCKETS_WAIT: Duration = Duration::from_secs(20);

/// How the guest's CPU runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accel {
    /// Hardware virtualization (`/dev/kvm` that runs stock guests).
    Kvm,
    /// QEMU's translator: slower, runs anywhere.
    Tcg,
}

impl Accel {
    /// Its name, as QEMU and `/v1/health` spell it.
    pub fn name(self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }
}

/// How a node runs its microVMs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Vmm {
    /// `qemu-system-x86_64`.
    pub qemu: PathBuf,
    /// The accelerator.
    pub accel: Accel,
    /// The host's TSC rate in kHz (passed to TCG guests).
    pub tsc_khz: u64,
    /// Guests hand the memory they free back to the host (a virtio balloon with free
    /// page reporting). On by default.
    pub free_page_reporting: bool,
}

/// The kind of machine QEMU emulates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MachineKind {
    /// QEMU's `microvm`: no firmware tables beyond the minimum, no PCI, virtio-mmio
    /// devices, a serial console only. Boots fastest.
    Micro,
    /// A PC (`q35`) with PCI virtio devices, a standard VGA screen and a PS/2 keyboard:
    /// a whole operating system's machine, whose screen can be read and typed into.
    Full,
}

impl MachineKind {
    /// The most host memory, in MiB, its TCG translation cache takes: about what a
    /// microVM's commands fill (up to 40 MiB measured), twice that for a whole system.
    pub fn tcg_cache_mib(self) -> u64 {
        match self {
            MachineKind::Micro => 64,
            MachineKind::Full => 128,
        }
    }

    /// The virtio transport's device suffix (`virtio-blk-device` or `virtio-blk-pci`).
    fn virtio(self, device: &str) -> String {
        match self {
            MachineKind::Micro => format!("virtio-{device}-device"),
            MachineKind::Full => format!("virtio-{device}-pci"),
        }
    }
}

/// What one machine is made of.
#[derive(Debug, Clone)]
pub struct Machine<'a> {
    /// Its kind.
    pub kind: MachineKind,
    /// The sandbox's VM directory (sockets, logs, pid file, disk).
    pub dir: &'a Path,
    /// Kernel image.
    pub kernel: &'a Path,
    /// The sandbox's initramfs.
    pub initrd: &'a Path,
    /// Guest memory in MiB.
    pub memory_mib: u64,
    /// Virtual CPUs.
    pub cpus: u32,
    /// Read-only EROFS layer files, bottom first.
    pub layers: &'a [PathBuf],
    /// The writable disk image, if any.
    pub disk: Option<&'a Path>,
    /// A persistent tap device on the host for the guest's one NIC; `None`: no NIC.
    pub tap: Option<&'a str>,
}

/// The files QEMU keeps in a sandbox's VM directory.
#[derive(Debug, Clone)]
pub struct MachineFiles {
    /// The agent channel's socket (QEMU listens).
    pub agent_port: PathBuf,
    /// QMP's socket.
    pub qmp: PathBuf,
    /// The guest's serial console.
    pub console: PathBuf,
    /// QEMU's own messages.
    pub log: PathBuf,
    /// Its command line (JSON), to start it again from a snapshot.
    pub args: PathBuf,
}

impl MachineFiles {
    /// The files of the VM directory `dir`.
    pub fn in_dir(dir: &Path) -> Self {
        Self {
            agent_port: dir.join("agent-port.sock"),
            qmp: dir.join("qmp.sock"),
            console: dir.join("console.log"),
            log: dir.join("qemu.log"),
            args: dir.join("qemu.args"),
        }
    }
}

/// The host's TSC rate in kHz, from `/proc/cpuinfo` (`cpu MHz`).
pub fn host_tsc_khz() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    info.lines()
        .find_map(|l| l.strip_prefix("cpu MHz")?.split(':').nth(1))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map(|mhz| (mhz * 1000.0).round() as u64)
        .filter(|k| *k > 0)
}

impl Vmm {
    /// Finds QEMU (`qemu` or `qemu-system-x86_64` in PATH) and picks the accelerator:
    /// `requested` when given, else TCG (KVM is taken only when asked for: a `/dev/kvm`
    /// can exist and still not run a stock guest, as under PVM).
    pub fn detect(qemu: Option<PathBuf>, requested: Option<Accel>) -> Result<Self, VmmError> {
        let qemu = match qemu {
            Some(q) => q,
            None => which("qemu-system-x86_64").ok_or_else(|| {
                VmmError::Setup(
                    "no qemu-system-x86_64 in PATH (apt-get install qemu-system-x86)".into(),
                )
            })?,
        };
        let out = Command::new(&qemu)
            .arg("--version")
            .output()
            .map_err(|e| VmmError::Setup(format!("{}: {e}", qemu.display())))?;
        if !out.status.success() {
            return Err(VmmError::Setup(format!(
                "{} --version failed",
                qemu.display()
            )));
        }
        let accel = requested.unwrap_or(Accel::Tcg);
        if accel == Accel::Kvm && std::fs::File::open("/dev/kvm").is_err() {
            return Err(VmmError::Setup(
                "accelerator kvm: no usable /dev/kvm".into(),
            ));
        }
        let tsc_khz = host_tsc_khz().ok_or_else(|| {
            VmmError::Setup("cannot read the host's TSC rate from /proc/cpuinfo".into())
        })?;
        Ok(Self {
            qemu,
            accel,
            tsc_khz,
            free_page_reporting: true,
        })
    }

    /// The guest kernel's command line for a machine of `kind`.
    pub fn kernel_cmdline(&self, kind: MachineKind) -> String {
        let mut c = String::new();
        if kind == MachineKind::Full {
            // The screen shows the virtual terminals; the last console (the serial port,
            // the node's log) is /dev/console.
            c.push_str("console=tty0 ");
            // The NIC keeps the name the agent configured it under (`eth0`): the image's
            // udev would rename it after the fact.
            c.push_str("net.ifnames=0 ");
        }
        c.push_str(
            "console=ttyS0 loglevel=4 panic=-1 reboot=t mitigations=off cryptomgr.notests \
             8250.nr_uarts=1 random.trust_cpu=on",
        );
        if self.accel == Accel::Tcg {
            c.push_str(&format!(
                " tsc_early_khz={k} tsc=reliable no_timer_check lpj={lpj}",
                k = self.tsc_khz,
                lpj = self.tsc_khz * 4
            ));
        }
        c.push_str(" -- vm-init");
        c
    }

    /// QEMU's arguments for `m`.
    pub fn args(&self, m: &Machine<'_>) -> Vec<String> {
        let f = MachineFiles::in_dir(m.dir);
        let p = |p: &Path| p.display().to_string();
        let kind = m.kind;
        let mut a: Vec<String> = vec![
            "-M".into(),
            match kind {
                MachineKind::Micro => "microvm,x-option-roms=off".into(),
                MachineKind::Full => "q35".into(),
            },
            "-accel".into(),
            match self.accel {
                Accel::Kvm => self.accel.name().into(),
                // QEMU's default translation cache is 1 GiB, filled as the guest runs
                // new code: a full system's boot reached 750 MiB of host memory in a
                // 512 MiB machine, past its cgroup. A bounded cache is flushed and
                // refilled instead.
                Accel::Tcg => format!("tcg,tb-size={}", kind.tcg_cache_mib()),
            },
            "-cpu".into(),
            match self.accel {
                Accel::Kvm => "host".into(),
                Accel::Tcg => "max".into(),
            },
            "-m".into(),
            format!("{}M", m.memory_mib),
            "-smp".into(),
            m.cpus.max(1).to_string(),
            "-nodefaults".into(),
            "-no-user-config".into(),
            // No window: a full machine's screen is read with QMP's screendump.
            "-display".into(),
            "none".into(),
            "-no-reboot".into(),
            // QEMU's own system call filter: no new privileges, no processes, no
            // resource changes, nothing obsolete.
            "-sandbox".into(),
            "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny".into(),
            "-kernel".into(),
            p(m.kernel),
            "-initrd".into(),
            p(m.initrd),
            "-append".into(),
            self.kernel_cmdline(kind),
            // Appended to, so a restored machine's console follows its boot's.
            "-chardev".into(),
            format!("file,id=console,path={},append=on", escape(&p(&f.console))),
            "-serial".into(),
            "chardev:console".into(),
        ];
        if kind == MachineKind::Full {
            // The screen (a standard VGA card: the text console, or a system's
            // framebuffer); the PS/2 keyboard is the machine's own; a tablet points at
            // absolute positions, as a screenshot's pixels are.
            a.extend([
                "-vga".into(),
                "std".into(),
                "-device".into(),
                "virtio-tablet-pci".into(),
            ]);
        }
        // One virtio disk: its drive (file, options) and its device (found by serial).
        let mut disk = |file: &Path, id: &str, options: &str, serial: &str| {
            a.extend([
                "-drive".into(),
                format!(
                    "file={},if=none,format=raw,{options},id={id}",
                    escape(&p(file))
                ),
                "-device".into(),
                format!("{},drive={id},serial={serial}", kind.virtio("blk")),
            ]);
        };
        for (i, layer) in m.layers.iter().enumerate() {
            let serial = dsec_wire::vm::layer_serial(i);
            disk(
                layer,
                &format!("layer{i}"),
                "readonly=on,file.locking=off",
                &serial,
            );
        }
        if let Some(file) = m.disk {
            disk(file, "disk", "discard=unmap", dsec_wire::vm::DISK_SERIAL);
        }
        if let Some(tap) = m.tap {
            // QEMU attaches to the node's tap by name (no scripts: the node configured
            // it); the same argument attaches a restored machine again.
            a.extend([
                "-netdev".into(),
                format!("tap,id=net0,ifname={tap},script=no,downscript=no"),
                "-device".into(),
                // No boot ROM: the kernel is loaded directly.
                match kind {
                    MachineKind::Micro => "virtio-net-device,netdev=net0".into(),
                    MachineKind::Full => "virtio-net-pci,netdev=net0,romfile=".into(),
                },
            ]);
        }
        if self.free_page_reporting {
            // The guest hands back the memory it frees (in 2 MiB blocks, after 2 s),
            // which QEMU discards, so an idle guest holds what it uses rather than the
            // most it ever touched.
            a.extend([
                "-device".into(),
                format!("{},free-page-reporting=on", kind.virtio("balloon")),
            ]);
        }
        a.extend([
            "-device".into(),
            kind.virtio("serial"),
            "-chardev".into(),
            format!(
                "socket,id=agent,path={},server=on,wait=off",
                escape(&p(&f.agent_port))
            ),
            "-device".into(),
            format!(
                "virtserialport,chardev=agent,name={}",
                dsec_wire::vm::AGENT_PORT
            ),
            "-qmp".into(),
            format!("unix:{},server=on,wait=off", escape(&p(&f.qmp))),
        ]);
        a
    }

    /// Starts the machine `m`, QEMU in its own session and in the cgroups whose
    /// `cgroup.procs` files are `procs` from its first instruction. Returns QEMU once it
    /// has made its sockets (the guest is booting then). The caller reaps it.
    pub fn launch(&self, m: &Machine<'_>, procs: &[PathBuf]) -> Result<Child, VmmError> {
        let args = self.args(m);
        let f = MachineFiles::in_dir(m.dir);
        let json = serde_json::to_vec(&args).map_err(|e| VmmError::Setup(e.to_string()))?;
        std::fs::write(&f.args, json)?;
        self.spawn(m.dir, &args, procs)
    }

    /// Starts the machine of VM directory `dir` again from `snapshot` (written by
    /// [`save`]): the same command line, waiting for the incoming state, which is then
    /// read from the file and run. Returns QEMU once the guest runs.
    pub fn restore(
        &self,
        dir: &Path,
        snapshot: &Path,
        procs: &[PathBuf],
        timeout: Duration,
    ) -> Result<Child, VmmError> {
        let f = MachineFiles::in_dir(dir);
        let mut args: Vec<String> = serde_json::from_slice(&std::fs::read(&f.args)?)
            .map_err(|e| VmmError::Start(format!("{}: {e}", f.args.display())))?;
        args.extend(["-incoming".into(), "defer".into()]);
        let mut child = self.spawn(dir, &args, procs)?;
        let restored = (|| {
            let mut q = Qmp::connect(&f.qmp, timeout)?;
            let file = std::fs::File::open(snapshot)?;
            q.pass_fd("snapshot", std::os::fd::AsFd::as_fd(&file))?;
            q.execute(
                "migrate-incoming",
                Some(serde_json::json!({ "uri": "fd:snapshot" })),
            )?;
            let deadline = Instant::now() + timeout;
            loop {
                match q.status()?.as_str() {
                    "inmigrate" | "restore-vm" => {}
                    "running" => return Ok(()),
                    "paused" | "postmigrate" | "prelaunch" => {
                        q.execute("cont", None)?;
                        return Ok(());
                    }
                    other => return Err(VmmError::Start(format!("restored VM in state {other}"))),
                }
                if Instant::now() > deadline {
                    return Err(VmmError::Start(format!(
                        "restore not done within {timeout:?}"
                    )));
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        })();
        match restored {
            Ok(()) => Ok(child),
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                Err(e)
            }
        }
    }

    fn spawn(&self, dir: &Path, args: &[String], procs: &[PathBuf]) -> Result<Child, VmmError> {
        let f = MachineFiles::in_dir(dir);
        // A previous QEMU's sockets would look like this one's.
        for stale in [&f.agent_port, &f.qmp] {
            let _ = std::fs::remove_file(stale);
        }
        let log = std::fs::File::create(&f.log)?;
        let procs: Vec<CString> = procs
            .iter()
            .filter_map(|p| CString::new(p.as_os_str().as_encoded_bytes()).ok())
            .collect();
        let mut cmd = Command::new(&self.qemu);
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        // SAFETY: the closure only makes system calls (open, write, close) on memory
        // prepared before the fork.
        unsafe {
            cmd.pre_exec(move || {
                // Out of the node's session: a signal to its group is not QEMU's.
                libc::setsid();
                for p in &procs {
                    let fd = libc::open(p.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                    if fd < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    let r = libc::write(fd, b"0".as_ptr().cast(), 1);
                    libc::close(fd);
                    if r < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| VmmError::Setup(format!("{}: {e}", self.qemu.display())))?;
        // QEMU makes its sockets once its devices are set up, before the guest runs.
        let deadline = Instant::now() + SOCKETS_WAIT;
        loop {
            if let Some(status) = child.try_wait()? {
                let msg = std::fs::read_to_string(&f.log).unwrap_or_default();
                return Err(VmmError::Start(format!(
                    "qemu exited with {status}: {}",
                    msg.trim()
                )));
            }
            if f.agent_port.exists() && f.qmp.exists() {
                return Ok(child);
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err(VmmError::Start(format!(
                    "qemu made no sockets within {SOCKETS_WAIT:?}"
                )));
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

/// Saves the whole state of the running machine of VM directory `dir` to `snapshot`
/// (stopped first, then migrated into the file through a descriptor, as QEMU's sandbox
/// lets it start no helper) and ends its QEMU. Returns the snapshot's size in bytes.
pub fn save(dir: &Path, snapshot: &Path, timeout: Duration) -> Result<u64, VmmError> {
    let f = MachineFiles::in_dir(dir);
    let mut q = Qmp::connect(&f.qmp, timeout)?;
    q.execute("stop", None)?;
    let file = std::fs::File::create(snapshot)?;
    q.pass_fd("snapshot", std::os::fd::AsFd::as_fd(&file))?;
    q.execute("migrate", Some(serde_json::json!({ "uri": "fd:snapshot" })))?;
    q.wait_migration(timeout)?;
    file.sync_all()?;
    let size = file.metadata()?.len();
    // QEMU exits as it answers; a lost answer is not a failure.
    let _ = q.execute("quit", None);
    Ok(size)
}

/// QEMU option values separate by commas; a comma in a value is written twice.
fn escape(s: &str) -> String {
    s.replace(',', ",,")
}

fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file())
}

/// The last `lines` lines of the guest's console (for a failure's message).
pub fn console_tail(dir: &Path, lines: usize) -> String {
    use std::io::{Read, Seek, SeekFrom};
    // Only the file's end is read: the console is appended to for the machine's life.
    const TAIL_BYTES: u64 = 64 << 10;
    let mut text = Vec::new();
    if let Ok(mut file) = std::fs::File::open(MachineFiles::in_dir(dir).console) {
        let len = file.metadata().map(|m| m.len()).unwrap_or(0);
        let _ = file.seek(SeekFrom::Start(len.saturating_sub(TAIL_BYTES)));
        let _ = file.take(TAIL_BYTES).read_to_end(&mut text);
    }
    let text = String::from_utf8_lossy(&text);
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Counts the guest's OOM kills in its console ([`dsec_wire::vm::OOM_KILL_MARKERS`]),
/// reading only what was appended since the last count.
#[derive(Debug, Default)]
pub struct OomCounter {
    offset: u64,
    kills: u64,
    /// The unfinished last line (at most [`MAX_LINE`] bytes are kept of it).
    partial: Vec<u8>,
}

/// Longest console line kept whole for matching.
const MAX_LINE: usize = 4096;

impl OomCounter {
    /// The kills counted so far in the console of VM directory `dir`, after reading
    /// what was added to it. A console that shrank (a new file) is counted again from
    /// its start, on top of what was counted.
    pub fn update(&mut self, dir: &Path) -> std::io::Result<u64> {
        use std::io::{Read, Seek, SeekFrom};
        let mut file = std::fs::File::open(MachineFiles::in_dir(dir).console)?;
        let len = file.metadata()?.len();
        if len < self.offset {
            self.offset = 0;
            self.partial.clear();
        }
        file.seek(SeekFrom::Start(self.offset))?;
        let mut chunk = vec![0u8; 64 << 10];
        loop {
            let n = file.read(&mut chunk)?;
            if n == 0 {
                break;
            }
            self.offset += n as u64;
            for piece in chunk[..n].split_inclusive(|b| *b == b'\n') {
                let room = MAX_LINE.saturating_sub(self.partial.len());
                self.partial
                    .extend_from_slice(&piece[..piece.len().min(room)]);
                if piece.ends_with(b"\n") {
                    let line = String::from_utf8_lossy(&self.partial);
                    if dsec_wire::vm::OOM_KILL_MARKERS
                        .iter()
                        .any(|m| line.contains(m))
                    {
                        self.kills += 1;
                    }
                    self.partial.clear();
                }
            }
        }
        Ok(self.kills)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vmm(accel: Accel) -> Vmm {
        Vmm {
            qemu: "qemu".into(),
            accel,
            tsc_khz: 2_600_000,
            free_page_reporting: true,
        }
    }

    #[test]
    fn oom_kills_are_counted_from_the_console_as_it_grows() {
        let dir = tempfile::tempdir().expect("tempdir");
        let console = MachineFiles::in_dir(dir.path()).console;
        let mut counter = OomCounter::default();
        assert!(counter.update(dir.path()).is_err(), "no console yet");
        std::fs::write(
            &console,
            "boot\n[ 3.1] Out of memory: Killed process 42 (py",
        )
        .expect("write");
        assert_eq!(
            counter.update(dir.path()).expect("count"),
            0,
            "line unfinished"
        );
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&console)
            .expect("open");
        use std::io::Write;
        write!(
            f,
            "thon3) total-vm:1kB\n{}77 (oom_score 900): full\nnothing\n",
            dsec_wire::vm::MEMORY_GUARD_KILLED
        )
        .expect("append");
        assert_eq!(counter.update(dir.path()).expect("count"), 2);
        assert_eq!(
            counter.update(dir.path()).expect("count"),
            2,
            "counted once"
        );
    }

    #[test]
    fn tcg_guests_are_told_the_tsc_rate() {
        let micro = MachineKind::Micro;
        assert!(vmm(Accel::Tcg)
            .kernel_cmdline(micro)
            .contains("tsc_early_khz=2600000"));
        assert!(!vmm(Accel::Kvm)
            .kernel_cmdline(micro)
            .contains("tsc_early_khz"));
        assert!(vmm(Accel::Kvm)
            .kernel_cmdline(micro)
            .ends_with("-- vm-init"));
        // A full machine's screen shows the terminals; the serial port stays the console.
        let full = vmm(Accel::Kvm).kernel_cmdline(MachineKind::Full);
        assert!(full.find("console=tty0") < full.find("console=ttyS0"));
        assert!(full.contains("net.ifnames=0"));
    }

    #[test]
    fn paths_with_commas_stay_one_value() {
        let layers = [PathBuf::from("/x,y/l.erofs")];
        let m = Machine {
            kind: MachineKind::Micro,
            dir: Path::new("/run/a,b"),
            kernel: Path::new("/k"),
            initrd: Path::new("/i"),
            memory_mib: 256,
            cpus: 1,
            layers: &layers,
            disk: None,
            tap: None,
        };
        let args = vmm(Accel::Tcg).args(&m);
        assert!(
            !args.iter().any(|a| a.contains("netdev")),
            "no NIC without a tap"
        );
        let with_tap = vmm(Accel::Tcg).args(&Machine {
            tap: Some("dsv7"),
            ..m
        });
        assert!(with_tap.contains(&"tap,id=net0,ifname=dsv7,script=no,downscript=no".to_string()));
        assert!(args.iter().any(|a| a.starts_with("file=/x,,y/l.erofs,")));
        assert!(args
            .iter()
            .any(|a| a.contains("path=/run/a,,b/agent-port.sock,")));
        assert!(
            args.contains(&"dsec-layer0".to_string())
                || args.iter().any(|a| a.ends_with("serial=dsec-layer0"))
        );
    }

    #[test]
    fn a_full_machine_is_a_pc_with_a_screen_and_pci_devices() {
        let layers = [PathBuf::from("/l.erofs")];
        let args = vmm(Accel::Tcg).args(&Machine {
            kind: MachineKind::Full,
            dir: Path::new("/run/vm"),
            kernel: Path::new("/k"),
            initrd: Path::new("/i"),
            memory_mib: 1024,
            cpus: 1,
            layers: &layers,
            disk: None,
            tap: Some("dsv7"),
        });
        let has = |v: &str| args.iter().any(|a| a == v);
        assert!(
            has("q35") && has("std") && has("virtio-tablet-pci"),
            "{args:?}"
        );
        assert!(has("virtio-serial-pci") && has("virtio-net-pci,netdev=net0,romfile="));
        assert!(args
            .iter()
            .any(|a| a.starts_with("virtio-blk-pci,drive=layer0,")));
        assert!(!args
            .iter()
            .any(|a| a.starts_with("virtio-") && a.contains("-device")));
        assert!(!args.iter().any(|a| a.contains("microvm")));
    }

    #[test]
    fn the_tsc_rate_is_read() {
        assert!(host_tsc_khz().expect("test step") > 100_000);
    }
}
