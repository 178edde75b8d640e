//! End-to-end test infrastructure (cloud-hypervisor's `test_infra` in spirit).
//!
//! [`Server`] starts the real `dsec serve` binary on a free loopback port with its own
//! state and run directories, imports the base image, and stops it on drop (sandboxes
//! are deleted through the API first). [`require_root`] makes privileged tests fail loudly
//! under `CI=true` and skip with a message elsewhere. [`host`] scans the host for what a
//! sandbox may leave behind.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use dsec_client::Client;

pub mod blob;
pub mod blobserver;
pub mod host;
pub mod s3;

/// Whether privileged tests can run here. Under `CI=true` a missing prerequisite panics:
/// CI must never skip silently.
pub fn require_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let have_erofs = std::fs::read_to_string("/proc/filesystems")
        .map(|s| s.contains("erofs"))
        .unwrap_or(false);
    let ok = root && have_erofs && which("mkfs.erofs");
    let missing = (!ok).then(|| {
        format!("e2e tests need root, EROFS and mkfs.erofs (root={root}, erofs={have_erofs})")
    });
    dsec_testkit::unavailable("e2e", missing).is_none()
}

/// Whether microVM tests can run here: QEMU and a guest kernel in /boot. Under `CI=true`
/// a missing one panics.
pub fn have_microvm() -> bool {
    let qemu = std::process::Command::new("qemu-system-x86_64")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    let kernel = std::fs::read_dir("/boot")
        .map(|d| {
            d.flatten()
                .any(|e| e.file_name().to_string_lossy().starts_with("vmlinuz-"))
        })
        .unwrap_or(false);
    let missing = (!(qemu && kernel)).then(|| {
        "QEMU or a guest kernel is missing (apt-get install qemu-system-x86 \
         linux-image-cloud-amd64)"
            .to_string()
    });
    dsec_testkit::unavailable("microvm", missing).is_none()
}

/// The Debian image with systemd that isolation `vm` tests boot (`scripts/test` builds
/// it: `ensure_vm_tar`), or `None` (said, and a panic under `CI=true`) when it is missing.
pub fn vm_tar() -> Option<std::path::PathBuf> {
    let tar = std::env::var_os("DSEC_VM_TAR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from("/var/cache/dsec/vm-bookworm.tar"));
    if tar.exists() {
        return Some(tar);
    }
    let why = format!(
        "no VM image at {} (scripts/test builds it: ensure_vm_tar)",
        tar.display()
    );
    assert!(std::env::var_os("CI").is_none(), "{why}");
    eprintln!("skipped: {why}");
    None
}

fn which(bin: &str) -> bool {
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(bin).is_file()))
        .unwrap_or(false)
}

/// The workspace's target directory (where `dsec` and `dsec-agent` were built).
pub fn target_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("CARGO_TARGET_DIR") {
        return PathBuf::from(d);
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target")
}

/// The `dsec` binary under test (`DSEC_BIN` or `target/debug/dsec`).
pub fn dsec_bin() -> PathBuf {
    std::env::var_os("DSEC_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| target_dir().join("debug/dsec"))
}

/// Runs the `dsec` CLI with `args` against the server at `url` with API key `key`:
/// (exit code, stdout, stderr).
pub fn run_cli(url: &str, key: &str, args: &[&str]) -> (Option<i32>, String, String) {
    let out = std::process::Command::new(dsec_bin())
        .args(["--url", url, "--api-key", key])
        .args(args)
        .output()
        .expect("run dsec");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The base image rootfs tarball (`DSEC_BASE_TAR` or the build script's default path).
pub fn base_tar() -> PathBuf {
    std::env::var_os("DSEC_BASE_TAR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/dsec/base-bookworm.tar"))
}

fn free_port() -> anyhow::Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

/// An exec request for a shell command line with no other options.
pub fn sh(cmd: &str) -> dsec_wire::v1::ExecRequest {
    dsec_wire::v1::ExecRequest {
        cmd: dsec_wire::v1::Command::Shell(cmd.into()),
        env: Default::default(),
        cwd: None,
        stdin: None,
        timeout_s: None,
        output_limit: None,
        user: None,
        request_id: None,
    }
}

/// A background process running `cmd`, everything else at its default.
pub fn background(cmd: dsec_wire::v1::Command) -> dsec_wire::v1::StartProcessRequest {
    dsec_wire::v1::StartProcessRequest {
        cmd,
        env: Default::default(),
        cwd: None,
        pty: None,
        tag: None,
        timeout_s: None,
        user: None,
        request_id: None,
    }
}

/// Polls `f` until it returns `Some` or the timeout passes.
pub async fn wait_until<T, F, Fut>(timeout: Duration, mut f: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f().await {
            return Some(v);
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The cgroup parent of test servers that name none: not the default `dsec`, which a
/// node on this host (the quick start's) may hold; a node refuses a parent another holds.
pub const TEST_CGROUP_PARENT: &str = "dsec-e2e";

/// Where test servers keep their run directories (`/run/dsec-e2e/NAME`).
pub const TEST_RUN_ROOT: &str = "/run/dsec-e2e";

/// A running `dsec serve`.
#[derive(Debug)]
pub struct Server {
    /// Its state directory.
    pub state_dir: PathBuf,
    /// Its run directory.
    pub run_dir: PathBuf,
    /// Base URL.
    pub url: String,
    /// API key.
    pub key: String,
    child: Option<Child>,
    root: PathBuf,
    extra_args: Vec<String>,
    /// Signals the server process starts with ignored (as `nohup` or a shell's background
    /// job would leave them).
    ignored_signals: Vec<i32>,
    /// Started fresh: its directory goes when it drops after a passing test.
    remove_on_drop: bool,
}

impl Server {
    /// Starts a server in `/tmp/dsec-e2e/NAME`. With `fresh`, the directory is wiped
    /// first, and removed again when the server drops unless the test failed (its log and
    /// state are kept for a look); otherwise an earlier run's state (images, leftover
    /// sandboxes) is reused and the server's own recovery cleans it.
    pub async fn start(name: &str, fresh: bool) -> anyhow::Result<Self> {
        Self::start_with(name, fresh, &[]).await
    }

    /// [`Server::start`] with more `dsec serve` flags.
    pub async fn start_with(name: &str, fresh: bool, args: &[&str]) -> anyhow::Result<Self> {
        Self::start_ignoring(name, fresh, args, &[]).await
    }

    /// [`Server::start_with`], the server process starting with `ignored` signals ignored
    /// (on every start, restarts included).
    pub async fn start_ignoring(
        name: &str,
        fresh: bool,
        args: &[&str],
        ignored: &[i32],
    ) -> anyhow::Result<Self> {
        let root = std::env::temp_dir().join("dsec-e2e").join(name);
        // On a tmpfs, like the default /run/dsec of a real node.
        let run_dir = Path::new(TEST_RUN_ROOT).join(name);
        if fresh && root.exists() {
            kill_leftovers(&root.join("state"));
            kill_lazy_servers(&root.join("state"));
            unmount_under(&root);
            unmount_under(&run_dir);
            let _ = std::fs::remove_dir_all(&root);
            let _ = std::fs::remove_dir_all(&run_dir);
        }
        std::fs::create_dir_all(&root)?;
        let mut s = Server {
            state_dir: root.join("state"),
            run_dir,
            url: String::new(),
            key: String::new(),
            child: None,
            root,
            extra_args: with_test_parent(args),
            ignored_signals: ignored.to_vec(),
            remove_on_drop: fresh,
        };
        s.spawn().await?;
        Ok(s)
    }

    /// Starts (or restarts) the server process on a new port with the same directories.
    /// A port taken between choosing it and the server's bind (another test's server got
    /// it first) makes the server exit: it is started again on another port.
    pub async fn spawn(&mut self) -> anyhow::Result<()> {
        for _ in 0..5 {
            if self.spawn_once().await? {
                return Ok(());
            }
        }
        bail!(
            "dsec serve found no free port in 5 tries; log: {}",
            self.log()
        )
    }

    /// One start on a free port: `false` if the server exited before it answered (its
    /// port was taken meanwhile).
    async fn spawn_once(&mut self) -> anyhow::Result<bool> {
        let port = free_port()?;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.root.join("serve.log"))?;
        let mut cmd = Command::new(dsec_bin());
        let ignored = self.ignored_signals.clone();
        // SAFETY: prctl and signal are async-signal-safe. The server dies with the thread
        // that started it (see `Server::shared`), so no test run leaves a server behind.
        unsafe {
            cmd.pre_exec(move || {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                for &sig in &ignored {
                    libc::signal(sig, libc::SIG_IGN);
                }
                Ok(())
            });
        }
        let mut child = cmd
            .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
            .arg("--state-dir")
            .arg(&self.state_dir)
            .arg("--run-dir")
            .arg(&self.run_dir)
            .args(&self.extra_args)
            .stdout(Stdio::from(log.try_clone()?))
            .stderr(Stdio::from(log))
            .spawn()
            .with_context(|| format!("starting {}", dsec_bin().display()))?;
        let url = format!("http://127.0.0.1:{port}");
        let key_path = self.state_dir.join("api-key");
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            if child.try_wait()?.is_some() {
                return Ok(false);
            }
            // An authenticated call: another server on the port would refuse this key.
            if let Ok(key) = std::fs::read_to_string(&key_path) {
                let key = key.trim().to_string();
                if let Ok(c) = Client::new(&url, Some(key.clone())) {
                    if c.list_images().await.is_ok() {
                        self.child = Some(child);
                        self.url = url;
                        self.key = key;
                        return Ok(true);
                    }
                }
            }
            if std::time::Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                bail!("dsec serve did not come up; log: {}", self.log());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The server shared by all tests of one test binary, started on first use with the
    /// base image imported and no sandboxes. It lives on a thread that never exits, so it
    /// is killed exactly when the test process ends.
    pub fn shared(name: &'static str) -> &'static Server {
        Self::shared_with(name, &[])
    }

    /// [`Server::shared`] with more `dsec serve` flags (one set per test binary: the
    /// first call starts the server).
    pub fn shared_with(name: &'static str, args: &'static [&'static str]) -> &'static Server {
        static SHARED: OnceLock<Server> = OnceLock::new();
        SHARED.get_or_init(|| {
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = tx.send(Err(anyhow::anyhow!(e)));
                        return;
                    }
                };
                let res = rt.block_on(async {
                    let s = Server::start_with(name, false, args).await?;
                    s.ensure_base(None).await?;
                    s.delete_all().await;
                    Ok::<_, anyhow::Error>(s)
                });
                let _ = tx.send(res);
                loop {
                    std::thread::park();
                }
            });
            match rx.recv() {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => panic!("starting the shared dsec server: {e:#}"),
                Err(e) => panic!("starting the shared dsec server: {e}"),
            }
        })
    }

    /// Kills the server process (SIGKILL: a crash, not a clean stop). Sandboxes survive.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Stops the server gracefully (SIGTERM) and waits for it to exit; returns its exit
    /// status, or `None` if it was not running or did not exit within `timeout` (it is
    /// killed then).
    pub fn terminate(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let mut c = self.child.take()?;
        // SAFETY: kill with our child's pid and a signal.
        unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + timeout;
        loop {
            match c.try_wait() {
                Ok(Some(status)) => return Some(status),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                _ => {
                    let _ = c.kill();
                    let _ = c.wait();
                    return None;
                }
            }
        }
    }

    /// Runs `dsec serve --cleanup` with this server's directories and flags (the server
    /// must not be running); returns its exit status and output.
    pub fn cleanup(&self) -> anyhow::Result<std::process::Output> {
        self.cleanup_as("serve")
    }

    /// [`Server::cleanup`] run as `dsec COMMAND --cleanup` (`serve` or `node`) on this
    /// server's directories and names.
    pub fn cleanup_as(&self, command: &str) -> anyhow::Result<std::process::Output> {
        Command::new(dsec_bin())
            .args([command, "--cleanup", "--listen", "127.0.0.1:0"])
            .arg("--state-dir")
            .arg(&self.state_dir)
            .arg("--run-dir")
            .arg(&self.run_dir)
            .args(&self.extra_args)
            .output()
            .with_context(|| format!("running {} {command} --cleanup", dsec_bin().display()))
    }

    /// The server process's pid, while it runs.
    pub fn pid(&self) -> Option<i32> {
        self.child.as_ref().map(|c| c.id() as i32)
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.root.join("serve.log")).unwrap_or_default()
    }

    /// A client with the server's key.
    pub fn client(&self) -> Client {
        Client::new(&self.url, Some(self.key.clone())).expect("client")
    }

    /// Imports the base image as `base` unless already present; `blob_from` reuses the
    /// EROFS blob of another server (fast) instead of building from the tarball.
    pub async fn ensure_base(&self, blob_from: Option<&Server>) -> anyhow::Result<()> {
        let c = self.client();
        if c.list_images()
            .await?
            .images
            .iter()
            .any(|i| i.name == "base")
        {
            return Ok(());
        }
        let source = match blob_from {
            Some(other) => {
                let img = other.client().list_images().await?;
                let digest = img
                    .images
                    .iter()
                    .find(|i| i.name == "base")
                    .context("no base image")?
                    .digest
                    .clone();
                let hex = digest.trim_start_matches("sha256:");
                other
                    .state_dir
                    .join(format!("images/blobs/sha256/{hex}.erofs"))
            }
            None => base_tar(),
        };
        if !source.exists() {
            bail!(
                "{} missing: run scripts/build-base-image.sh {}",
                source.display(),
                source.display()
            );
        }
        c.import_image(dsec_wire::v1::ImportImageRequest {
            name: "base".into(),
            source: source.display().to_string(),
            flatten: false,
        })
        .await?;
        Ok(())
    }

    /// Deletes every sandbox through the API.
    pub async fn delete_all(&self) {
        let c = self.client();
        if let Ok(list) = c.list_sandboxes(Default::default()).await {
            for sb in list.sandboxes {
                let _ = c.delete_sandbox(&sb.id).await;
            }
        }
    }
}

/// `args`, with `--cgroup-parent` [`TEST_CGROUP_PARENT`] unless they name one.
fn with_test_parent(args: &[&str]) -> Vec<String> {
    let mut out: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    if !args.contains(&"--cgroup-parent") {
        out.extend([
            "--cgroup-parent".to_string(),
            TEST_CGROUP_PARENT.to_string(),
        ]);
    }
    out
}

/// Detaches every mount at or below `root` (layer mounts an earlier, killed server left),
/// deepest first, so the directory can be removed.
pub fn unmount_under(root: &Path) {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return;
    };
    let mut points: Vec<PathBuf> = info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|p| PathBuf::from(p.replace("\\040", " ")))
        .filter(|p| p.starts_with(root))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    for p in points {
        let _ = nix::mount::umount2(&p, nix::mount::MntFlags::MNT_DETACH);
    }
}

/// Bytes of the regular files under `dir` (recursively, symlinks not followed); 0 if
/// it does not exist.
pub fn dir_bytes(dir: &Path) -> u64 {
    sum_regular_files(dir, |m| m.len())
}

/// Bytes of disk the regular files under `dir` take (allocated blocks: holes and
/// sparse files count for what they hold), recursively.
pub fn dir_allocated_bytes(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    sum_regular_files(dir, |m| m.blocks() * 512)
}

/// `size` of every regular file under `dir`, summed (symlinks are not followed).
fn sum_regular_files(dir: &Path, size: impl Fn(&std::fs::Metadata) -> u64) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            match e.file_type() {
                Ok(t) if t.is_dir() => stack.push(e.path()),
                Ok(t) if t.is_file() => total += e.metadata().map(|m| size(&m)).unwrap_or(0),
                _ => {}
            }
        }
    }
    total
}

/// Process ids of the lazy layer servers (`dsec lazy-serve`) of a state directory.
pub fn lazy_server_pids(state_dir: &Path) -> Vec<i32> {
    let needle = state_dir.join("images").display().to_string();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    procs
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let cmd = String::from_utf8_lossy(&cmd);
            cmd.contains("\0lazy-serve\0") && cmd.contains(&needle)
        })
        .collect()
}

/// Kills the lazy layer servers of a state directory.
fn kill_lazy_servers(state_dir: &Path) {
    for pid in lazy_server_pids(state_dir) {
        // SAFETY: kill with a pid and a signal.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
}

/// Kills the processes of every sandbox recorded under a state directory.
fn kill_leftovers(state_dir: &Path) {
    if let Ok(entries) = std::fs::read_dir(state_dir.join("sandboxes")) {
        for e in entries.flatten() {
            host::kill_sandbox_cgroup(&e.file_name().to_string_lossy());
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // Tests delete their sandboxes; this is the safety net for failed ones.
        self.kill();
        kill_leftovers(&self.state_dir);
        kill_lazy_servers(&self.state_dir);
        unmount_under(&self.run_dir);
        let _ = std::fs::remove_dir_all(&self.run_dir);
        // Each server holds a copy of the base image: a suite's worth of them is gigabytes.
        if self.remove_on_drop && !std::thread::panicking() {
            unmount_under(&self.root);
            let _ = std::fs::remove_dir_all(&self.root);
        }
    }
}
