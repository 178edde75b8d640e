//! Isolation level `oci`: the sandbox runs under an installed OCI runtime (runc here;
//! runsc/gVisor where installed) instead of dsec's own init, for callers who want that
//! runtime's boundary. The agent contract is the same: the node mounts the sandbox's
//! root (its layers and disk under overlayfs), binds the sandbox's usual socket and
//! writes a bundle whose process is `dsec-agent serve` on that socket, handed over as fd
//! 3 (`runc run --preserve-fds 1`): the socket has no path inside, where the code could
//! otherwise replace it with its own and answer the node in the agent's place. The
//! runtime puts the agent in the sandbox's cgroup, so pause, reclaim, OOM accounting and
//! commit work as for the default level.
//!
//! Unlike the default level, the root is one mount in the host's mount table per
//! sandbox. The bundle carries dsec's own seccomp policy (the same rules as the default
//! level, in the OCI form), which the runtime installs.

use std::os::fd::{AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::json;

use crate::NodeCreateSpec;

/// Where the agent binary appears inside.
const AGENT_IN: &str = "/.dsec/dsec-agent";

/// The agent's listening socket in the container (the first preserved descriptor).
const LISTEN_FD: RawFd = 3;

/// How the agent in a bundle gets its listening socket.
#[derive(Debug, Clone, Copy)]
pub enum AgentListen<'a> {
    /// Inherited as fd 3 (`runc run --preserve-fds 1`): no path inside.
    Fd,
    /// Bound by the agent at [`GVISOR_SOCKET_IN`], in the host directory given here,
    /// mounted at [`GVISOR_SOCKET_DIR_IN`] (runsc passes no descriptors; its gofer makes
    /// the socket a host one, `--host-uds=create`).
    HostDir(&'a Path),
}

/// Where a gVisor sandbox's agent binds its socket (inside).
pub const GVISOR_SOCKET_DIR_IN: &str = "/.dsec/run";
/// The socket's path inside.
pub const GVISOR_SOCKET_IN: &str = "/.dsec/run/agent.sock";

/// The bundle's `config.json` for a sandbox.
pub fn bundle_config(
    spec: &NodeCreateSpec,
    rootfs: &Path,
    agent_bin: &Path,
    cgroup_path: &str,
    listen: AgentListen<'_>,
) -> serde_json::Value {
    let caps: Vec<String> = dsec_container::harden::KEPT_CAPS
        .iter()
        .map(|c| c.to_string())
        .collect();
    let mut args = vec![AGENT_IN.to_string(), "serve".into()];
    match listen {
        AgentListen::Fd => args.extend(["--listen-fd".into(), LISTEN_FD.to_string()]),
        AgentListen::HostDir(_) => args.extend(["--socket".into(), GVISOR_SOCKET_IN.into()]),
    }
    args.extend(["--cwd".into(), spec.workdir.clone()]);
    if let Some(user) = &spec.user {
        args.push("--user".into());
        args.push(user.clone());
    }
    for (k, v) in &spec.env {
        args.push("--env".into());
        args.push(format!("{k}={v}"));
    }
    let period: u64 = 100_000;
    // The policy is static data with a translation test; failing here is a build bug.
    let seccomp = match listen {
        AgentListen::Fd => dsec_container::harden::oci_seccomp().unwrap_or_else(|e| {
            tracing::error!(error = %e, "no seccomp policy for the OCI bundle");
            serde_json::Value::Null
        }),
        // gVisor: its kernel, not the host's, serves these calls, and its 2022 filter
        // inside answers every refusal with EPERM (no `errnoRet`), which would turn our
        // ENOSYS refusals (clone3, new calls) into failures instead of fallbacks. Only
        // the guard of PID 1.
        AgentListen::HostDir(_) => json!({
            "defaultAction": "SCMP_ACT_ALLOW",
            "architectures": ["SCMP_ARCH_X86_64"],
            "syscalls": gvisor_init_guard(),
        }),
    };
    let mut mounts = json!([
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
        {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
         "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]},
        {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
         "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
        {"destination": "/sys", "type": "sysfs", "source": "sysfs",
         "options": ["nosuid", "noexec", "nodev", "ro"]},
        {"destination": AGENT_IN, "type": "bind", "source": agent_bin,
         "options": ["bind", "ro", "nosuid", "nodev"]},
    ]);
    let mut namespaces = json!([
        {"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"},
        {"type": "network"},
    ]);
    match listen {
        AgentListen::Fd => {
            if let Some(ns) = namespaces.as_array_mut() {
                ns.push(json!({"type": "cgroup"}));
            }
        }
        AgentListen::HostDir(dir) => {
            if let Some(m) = mounts.as_array_mut() {
                m.push(json!({"destination": GVISOR_SOCKET_DIR_IN, "type": "bind",
                    "source": dir, "options": ["bind", "rw", "nosuid", "nodev", "noexec"]}));
            }
        }
    }
    // Under gVisor the pids limit is enforced inside (RLIMIT_NPROC: commands hold no
    // CAP_SYS_RESOURCE to raise it); the host's leaves its Sentry room.
    let (pids_max, rlimits) = match listen {
        AgentListen::Fd => (spec.pids_max, json!([])),
        AgentListen::HostDir(_) => (
            crate::gvisor::host_pids_max(spec.pids_max),
            json!([{"type": "RLIMIT_NPROC", "soft": spec.pids_max, "hard": spec.pids_max}]),
        ),
    };
    json!({
        "ociVersion": "1.0.2",
        "root": {"path": rootfs, "readonly": false},
        "hostname": spec.id,
        "process": {
            "terminal": false,
            "user": {"uid": 0, "gid": 0},
            "rlimits": rlimits,
            "args": args,
            "env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
            "cwd": "/",
            "noNewPrivileges": true,
            "capabilities": {
                "bounding": caps, "effective": caps, "permitted": caps,
            },
        },
        "mounts": mounts,
        "linux": {
            "namespaces": namespaces,
            "cgroupsPath": format!("/{cgroup_path}"),
            "resources": {
                "memory": {"limit": spec.memory_bytes, "swap": spec.memory_bytes},
                "pids": {"limit": pids_max},
                "cpu": {"quota": spec.cpu_millis * period / 1000, "period": period},
            },
            "seccomp": seccomp,
            "maskedPaths": dsec_container::rootfs::MASKED_PATHS,
            "readonlyPaths": dsec_container::rootfs::READONLY_PATHS,
        },
    })
}

/// Seccomp rules of a gVisor sandbox that keep its PID 1 (the agent) alive: gVisor's
/// 2022 kernel delivers `SIGKILL` to PID 1 from inside its own pid namespace, which
/// Linux ignores, and the sandbox ends with its init. So no signal may be sent to PID 1
/// by number (`kill`, `tkill`, `tgkill`, `rt_sigqueueinfo`, `rt_tgsigqueueinfo`), nor a
/// pidfd opened on it: `EPERM`.
fn gvisor_init_guard() -> Vec<serde_json::Value> {
    let pid_one = json!([{"index": 0, "value": 1, "op": "SCMP_CMP_EQ"}]);
    [
        "kill",
        "tkill",
        "tgkill",
        "rt_sigqueueinfo",
        "rt_tgsigqueueinfo",
        "pidfd_open",
    ]
    .iter()
    .map(|name| {
        json!({"names": [name], "action": "SCMP_ACT_ERRNO", "errnoRet": libc::EPERM,
                   "args": pid_one})
    })
    .collect()
}

/// The runtime command with its state under the node's run directory.
fn runtime(bin: &Path, state: &Path) -> Command {
    let mut c = Command::new(bin);
    c.arg("--root").arg(state);
    c
}

/// Starts the bundle at `bundle` as container `id`, its agent serving `listener` (bound
/// by the node; connections wait in its backlog until the agent accepts). Returns the
/// container's init pid.
pub fn start(
    bin: &Path,
    state: &Path,
    bundle: &Path,
    id: &str,
    listener: &std::os::unix::net::UnixListener,
) -> Result<i32, String> {
    // The detached container keeps the runtime's stdio: give it a log file, never a
    // pipe we would wait on.
    let log_path = bundle.join("output.log");
    let log = std::fs::File::create(&log_path).map_err(|e| format!("create log: {e}"))?;
    let null = std::fs::File::open("/dev/null").map_err(|e| format!("/dev/null: {e}"))?;
    let (state, bundle) = (state.to_string_lossy(), bundle.to_string_lossy());
    let argv = [
        "runc",
        "--root",
        &state,
        "run",
        "--detach",
        "--preserve-fds",
        "1",
        "--bundle",
        &bundle,
        id,
    ];
    let fds = crate::spawn::SpawnFds {
        stdin: null.as_raw_fd(),
        stdout: log.as_raw_fd(),
        stderr: log.as_raw_fd(),
        fixed: &[(listener.as_raw_fd(), LISTEN_FD)],
    };
    let pid = crate::spawn::spawn(bin, &argv, &fds)
        .map_err(|e| format!("start {}: {e}", bin.display()))?;
    let status = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(pid), None)
        .map_err(|e| format!("wait for {}: {e}", bin.display()))?;
    if !matches!(status, nix::sys::wait::WaitStatus::Exited(_, 0)) {
        let msg = std::fs::read_to_string(&log_path).unwrap_or_default();
        return Err(format!("{} run: {}", bin.display(), msg.trim()));
    }
    let state_out = runtime(bin, Path::new(&*state))
        .arg("state")
        .arg(id)
        .output()
        .map_err(|e| format!("state: {e}"))?;
    serde_json::from_slice::<serde_json::Value>(&state_out.stdout)
        .ok()
        .and_then(|v| v.get("pid").and_then(|p| p.as_i64()))
        .and_then(|p| i32::try_from(p).ok())
        .filter(|p| *p > 0)
        .ok_or_else(|| "runtime reported no pid".to_string())
}

/// Removes container `id` (killing what is left of it). A container the runtime does
/// not know is fine.
pub fn delete(bin: &Path, state: &Path, id: &str) {
    let _ = runtime(bin, state)
        .args(["delete", "--force", id])
        .stderr(std::process::Stdio::null())
        .status();
}

/// The runtime's state directory for this node.
pub fn state_dir(run_dir: &Path) -> PathBuf {
    run_dir.join("oci")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bundle_runs_the_agent_on_the_sandbox_socket_with_its_limits() {
        let spec = NodeCreateSpec {
            id: "sb-x".into(),
            image: "base".into(),
            layers: vec![],
            cpu_millis: 500,
            memory_bytes: 256 << 20,
            pids_max: 128,
            disk_mb: None,
            qos: dsec_wire::v1::Qos::LatencySensitive,
            env: [("A".to_string(), "b".to_string())].into(),
            workdir: "/work".into(),
            network: Default::default(),
            writable_paths: vec![],
            tcp_bind: None,
            tcp_connect: None,
            isolation: dsec_wire::v1::Isolation::Oci,
            user: None,
            labels: Default::default(),
            lifetime: Default::default(),
            model_link: false,
        };
        let c = bundle_config(
            &spec,
            Path::new("/s/rootfs"),
            Path::new("/bin/agent"),
            "dsec/sb-x",
            AgentListen::Fd,
        );
        let args: Vec<&str> = c["process"]["args"]
            .as_array()
            .expect("args")
            .iter()
            .filter_map(|a| a.as_str())
            .collect();
        assert_eq!(
            args,
            [
                AGENT_IN,
                "serve",
                "--listen-fd",
                "3",
                "--cwd",
                "/work",
                "--env",
                "A=b"
            ]
        );
        assert_eq!(c["linux"]["cgroupsPath"], "/dsec/sb-x");
        assert_eq!(c["linux"]["resources"]["cpu"]["quota"], 50_000);
        assert_eq!(c["linux"]["resources"]["pids"]["limit"], 128);
        assert!(c["linux"]["maskedPaths"]
            .as_array()
            .expect("masked")
            .iter()
            .any(|p| p == "/proc/kcore"));
        assert_eq!(c["process"]["noNewPrivileges"], true);

        // gVisor: the agent binds its socket in a mounted host directory, processes are
        // limited inside (RLIMIT_NPROC) with host room for the Sentry, and PID 1 cannot
        // be signalled.
        let dir = Path::new("/run/s/agent-dir");
        let g = bundle_config(
            &spec,
            Path::new("/s/rootfs"),
            Path::new("/bin/agent"),
            "dsec/sb-x",
            AgentListen::HostDir(dir),
        );
        let args: Vec<&str> = g["process"]["args"]
            .as_array()
            .expect("args")
            .iter()
            .filter_map(|a| a.as_str())
            .collect();
        assert_eq!(args[..4], [AGENT_IN, "serve", "--socket", GVISOR_SOCKET_IN]);
        let mounts = g["mounts"].as_array().expect("mounts");
        assert!(
            mounts
                .iter()
                .any(|m| m["destination"] == GVISOR_SOCKET_DIR_IN
                    && m["source"] == "/run/s/agent-dir")
        );
        assert_eq!(g["process"]["rlimits"][0]["type"], "RLIMIT_NPROC");
        assert_eq!(g["process"]["rlimits"][0]["hard"], 128);
        assert_eq!(
            g["linux"]["resources"]["pids"]["limit"],
            crate::gvisor::host_pids_max(128)
        );
        let guarded: Vec<&str> = g["linux"]["seccomp"]["syscalls"]
            .as_array()
            .expect("rules")
            .iter()
            .filter_map(|r| r["names"][0].as_str())
            .collect();
        assert!(
            guarded.contains(&"kill") && guarded.contains(&"tgkill"),
            "{guarded:?}"
        );
        assert!(!g["linux"]["namespaces"]
            .as_array()
            .expect("namespaces")
            .iter()
            .any(|n| n["type"] == "cgroup"));
    }
}
