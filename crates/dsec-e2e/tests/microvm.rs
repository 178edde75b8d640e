//! Isolation level `microvm`: a QEMU microvm (TCG here) with Debian's cloud kernel, the
//! image's EROFS layers as read-only virtio disks and the agent as the guest's init.
//! The same agent contract as every level: exec, files, sessions, processes, pause and
//! resume; a node restart adopts the VM; a VMM killed from outside is noticed; what the
//! level does not offer is refused up front; a delete leaves nothing behind.

use dsec_e2e::{host, require_root, sh, Server};
use dsec_wire::v1::*;
use dsec_wire::ErrorCode;

/// Host processes whose command line names `needle`.
fn qemu_processes(needle: &str) -> Vec<i32> {
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let cmdline = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline);
        let is_qemu = cmdline.starts_with("qemu-system") || cmdline.contains("/qemu-system");
        if is_qemu && cmdline.contains(needle) {
            found.push(pid);
        }
    }
    found
}

#[tokio::test(flavor = "multi_thread")]
async fn a_microvm_keeps_the_agent_contract_survives_a_restart_and_leaves_nothing() {
    if !require_root() || !dsec_e2e::have_microvm() {
        return;
    }
    let mut s = Server::start_with(
        "microvm",
        true,
        &["--cgroup-parent", "dsec-microvm", "--disk-pool", "1"],
    )
    .await
    .expect("server");
    s.ensure_base(None).await.expect("base image");
    let c = s.client();
    let health = c.health().await.expect("health");
    let level = health
        .isolation
        .iter()
        .find(|l| l.isolation == Isolation::Microvm)
        .unwrap_or_else(|| panic!("health lists microvm: {:?}", health.isolation));
    assert_eq!(level.platform.as_deref(), Some("tcg"), "{level:?}");

    let sb = c
        .create_sandbox(CreateSandboxRequest {
            isolation: Isolation::Microvm,
            env: [("TASK".to_string(), "t1".to_string())].into(),
            resources: Resources {
                memory_mb: Some(384),
                disk_mb: Some(512),
                ..Default::default()
            },
            ..Default::default()
        })
        .await
        .expect("create");
    assert_eq!(sb.isolation, Isolation::Microvm);
    let vmm = qemu_processes(&sb.id);
    assert_eq!(vmm.len(), 1, "one QEMU runs it");
    // Debian's cloud kernel has a PVH entry: QEMU boots its unpacked ELF.
    let args = std::fs::read_to_string(
        s.run_dir
            .join("sandboxes")
            .join(&sb.id)
            .join("vm/qemu.args"),
    )
    .expect("qemu.args");
    assert!(args.contains("/vmlinux-"), "{args}");
    // The guest's own kernel answers, with the agent as its init.
    let r = c
        .exec(
            &sb.id,
            sh("tr '\\0' ' ' < /proc/1/cmdline; echo; hostname; echo $TASK; uname -r; echo hi > /tmp/f; cat /tmp/f"),
        )
        .await
        .expect("exec");
    let lines: Vec<&str> = r.stdout.lines().collect();
    assert!(lines[0].starts_with("/init vm-init"), "{}", r.stdout);
    assert_eq!(&lines[1..3], [sb.id.as_str(), "t1"], "{r:?}");
    let host_release = std::fs::read_to_string("/proc/sys/kernel/osrelease").expect("release");
    assert_ne!(lines[3], host_release.trim(), "the guest's kernel: {r:?}");
    assert!(lines[3].contains("cloud"), "{r:?}");
    assert_eq!(lines[4], "hi");
    // The agent runs ahead of commands in the guest (nice -10); commands start at 0 and
    // cannot raise themselves.
    let r = c
        .exec(
            &sb.id,
            sh("cut -d' ' -f19 /proc/1/stat; cut -d' ' -f19 /proc/self/stat; renice -n -5 $$ >/dev/null 2>&1 && echo raised || echo refused"),
        )
        .await
        .expect("exec");
    assert_eq!(r.stdout, "-10\n0\nrefused\n", "{r:?}");
    the_contract(&mut s, &sb.id).await;

    // A QEMU killed from outside dsec: the sandbox fails, and its delete leaves nothing.
    let c = s.client();
    let sb = c
        .create_sandbox(CreateSandboxRequest {
            isolation: Isolation::Microvm,
            ..Default::default()
        })
        .await
        .expect("create");
    for pid in qemu_processes(&sb.id) {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        )
        .expect("kill QEMU");
    }
    let failed = dsec_e2e::wait_until(std::time::Duration::from_secs(30), || async {
        let got = c.get_sandbox(&sb.id).await.ok()?;
        (got.state == SandboxState::Failed).then_some(got)
    })
    .await
    .expect("the sandbox fails");
    assert!(failed.failure.is_some(), "{failed:?}");
    c.delete_sandbox(&sb.id).await.expect("delete");
    assert!(host::cgroup_dirs(&sb.id).is_empty());
    assert!(!s.run_dir.join("sandboxes").join(&sb.id).exists());
    assert!(!s.state_dir.join("sandboxes").join(&sb.id).exists());

    // A job's suspend saves its microVMs and ends their QEMUs; its resume restores them.
    let sb = c
        .create_sandbox(CreateSandboxRequest {
            isolation: Isolation::Microvm,
            labels: [(JOB_LABEL.to_string(), "rollout-7".to_string())].into(),
            ..Default::default()
        })
        .await
        .expect("create");
    c.exec(&sb.id, sh("echo kept > /tmp/state"))
        .await
        .expect("exec");
    let suspended = c.suspend_job("rollout-7").await.expect("suspend job");
    assert_eq!(suspended.sandboxes.len(), 1, "{suspended:?}");
    assert!(suspended.sandboxes[0].error.is_none(), "{suspended:?}");
    assert!(qemu_processes(&sb.id).is_empty(), "QEMU ended at suspend");
    let resumed = c.resume_job("rollout-7").await.expect("resume job");
    assert!(resumed.sandboxes[0].error.is_none(), "{resumed:?}");
    let r = c.exec(&sb.id, sh("cat /tmp/state")).await.expect("exec");
    assert_eq!(r.stdout, "kept\n");

    // A node restart while it is saved: adopted as it is, and restored on resume.
    c.pause_sandbox(&sb.id).await.expect("pause");
    s.kill();
    s.spawn().await.expect("restart");
    let c = s.client();
    assert_eq!(
        c.get_sandbox(&sb.id).await.expect("get").state,
        SandboxState::Paused
    );
    c.resume_sandbox(&sb.id)
        .await
        .expect("resume after restart");
    let r = c.exec(&sb.id, sh("cat /tmp/state")).await.expect("exec");
    assert_eq!(r.stdout, "kept\n");

    // A paused microVM (saved to its snapshot) is deleted as it is.
    c.pause_sandbox(&sb.id).await.expect("pause");
    let t = std::time::Instant::now();
    c.delete_sandbox(&sb.id).await.expect("delete paused");
    assert!(
        t.elapsed() < std::time::Duration::from_secs(5),
        "{:?}",
        t.elapsed()
    );
    assert!(qemu_processes(&sb.id).is_empty(), "QEMU is gone");
    assert!(host::cgroup_dirs(&sb.id).is_empty());
    assert!(!s.state_dir.join("sandboxes").join(&sb.id).exists());
}

/// Everything after the first boot: files, sessions, processes, pause and resume, a
/// node restart, refusals, a VMM killed from outside, and a clean delete.
async fn the_contract(s: &mut Server, id: &str) {
    let c = s.client();
    // Files, both ways.
    c.write_file(id, "/work/in.txt", None, b"data".to_vec())
        .await
        .expect("upload");
    let r = c
        .exec(id, sh("cat /work/in.txt; echo more >> /work/in.txt"))
        .await
        .expect("exec");
    assert_eq!(r.stdout, "data");
    let (_, mut body) = c
        .read_file(id, "/work/in.txt", 0, None)
        .await
        .expect("download");
    let mut bytes = Vec::new();
    while let Some(chunk) = futures::StreamExt::next(&mut body).await {
        bytes.extend_from_slice(&chunk.expect("chunk"));
    }
    assert_eq!(bytes, b"datamore\n");
    // Output larger than the channel's window, while another stream runs.
    let (big, small) = tokio::join!(
        c.exec(id, sh("head -c 3000000 /dev/zero | tr '\\0' x")),
        c.exec(id, sh("echo small"))
    );
    assert_eq!(big.expect("big").stdout.len(), 3_000_000);
    assert_eq!(small.expect("small").stdout, "small\n");
    // The guest's writable layer is its own ext4 disk.
    let r = c
        .exec(
            id,
            sh("grep -o 'upperdir=[^,]*' /proc/mounts; df -k / | awk 'NR==2 {print $2}'; grep MemTotal /proc/meminfo | awk '{print $2}'"),
        )
        .await
        .expect("exec");
    let lines: Vec<&str> = r.stdout.lines().collect();
    assert_eq!(lines[0], "upperdir=/mnt/disk/upper", "{r:?}");
    // The requested disk and memory are the VM's (less the file system's and the
    // kernel's own share).
    let disk_kb: u64 = lines[1].parse().expect("df");
    assert!((400_000..=512 * 1024).contains(&disk_kb), "{r:?}");
    let mem_kb: u64 = lines[2].parse().expect("meminfo");
    assert!((300_000..=384 * 1024).contains(&mem_kb), "{r:?}");
    // A command that fills the guest's memory is killed inside it (by the guest
    // kernel's OOM killer or the agent's memory guard, whichever is first), and the
    // exec says so as at every level; its shell goes on.
    let r = c
        .exec(
            id,
            sh("python3 -c 'b = [bytearray(1 << 20) for _ in range(1024)]'; echo after $?"),
        )
        .await
        .expect("exec a memory hog");
    let console = || {
        std::fs::read_to_string(s.run_dir.join("sandboxes").join(id).join("vm/console.log"))
            .unwrap_or_default()
    };
    assert!(r.oom_killed, "{r:?}\n{}", console());
    assert_eq!(r.stdout, "after 137\n", "{r:?}\n{}", console());

    // A session keeps its shell's state; a background process runs on.
    let session = c
        .create_session(id, CreateSessionRequest::default())
        .await
        .expect("session");
    let run = |command: &str| SessionRunRequest {
        command: command.into(),
        timeout_s: Some(60.0),
        request_id: None,
    };
    c.run_in_session(id, &session.session, run("cd /tmp; export X=42"))
        .await
        .expect("run");
    let p = c
        .start_process(
            id,
            dsec_e2e::background(Command::Shell("sleep 1000".into())),
        )
        .await
        .expect("process");
    // Pause saves the whole machine to a file and ends its QEMU: nothing of it stays
    // in memory. Resume restores it: the same processes, shell and files.
    let before = qemu_processes(id);
    assert_eq!(before.len(), 1);
    c.pause_sandbox(id).await.expect("pause");
    assert!(qemu_processes(id).is_empty(), "QEMU ended at pause");
    let snapshot = s
        .state_dir
        .join("sandboxes")
        .join(id)
        .join("vm-snapshot.bin");
    let size = std::fs::metadata(&snapshot).expect("snapshot").len();
    assert!(size > 1 << 20, "{size}");
    assert_eq!(
        c.get_sandbox(id).await.expect("get").state,
        SandboxState::Paused
    );
    c.resume_sandbox(id).await.expect("resume");
    let after = qemu_processes(id);
    assert_eq!(after.len(), 1);
    assert_ne!(after, before, "a new QEMU");
    assert!(!snapshot.exists(), "the snapshot is spent");
    let r = c
        .run_in_session(id, &session.session, run("echo $X $(pwd)"))
        .await
        .expect("run");
    assert_eq!(r.output, "42 /tmp\n");
    let listed = c.list_processes(id).await.expect("processes");
    assert!(
        listed.processes.iter().any(|q| q.pid == p.pid),
        "{listed:?}"
    );

    // A crash of the node: the VM runs on and is adopted again, session and all.
    let vmm = qemu_processes(id);
    s.kill();
    s.spawn().await.expect("restart");
    let c = s.client();
    assert_eq!(qemu_processes(id), vmm, "the same QEMU");
    let r = c
        .exec(id, sh("cat /tmp/f"))
        .await
        .expect("exec after restart");
    assert_eq!(r.stdout, "hi\n");
    let r = c
        .run_in_session(id, &session.session, run("echo $X"))
        .await
        .expect("session after restart");
    assert_eq!(r.output, "42\n");

    // Combinations the level does not offer are refused up front, saying why.
    let err = c
        .create_sandbox(CreateSandboxRequest {
            isolation: Isolation::Microvm,
            filesystem: FilesystemPolicy {
                writable: vec!["/tmp".into()],
                ..Default::default()
            },
            ..Default::default()
        })
        .await
        .expect_err("file rules at level microvm");
    assert_eq!(err.code(), Some(ErrorCode::BadRequest), "{err}");
    assert!(err.to_string().contains("isolation microvm"), "{err}");

    c.delete_sandbox(id).await.expect("delete");
    assert!(qemu_processes(id).is_empty(), "QEMU is gone");
    assert!(host::cgroup_dirs(id).is_empty());
    assert!(host::processes(id).is_empty());
    assert!(!s.run_dir.join("sandboxes").join(id).exists());
    assert!(!s.state_dir.join("sandboxes").join(id).exists());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_guest_that_does_not_boot_in_time_fails_clearly_and_leaves_nothing() {
    if !require_root() || !dsec_e2e::have_microvm() {
        return;
    }
    // A boot timeout no TCG guest can meet: to the node, a guest hung at boot.
    let s = Server::start_with(
        "microvm-hang",
        true,
        &[
            "--cgroup-parent",
            "dsec-microvm-hang",
            "--disk-pool",
            "0",
            "--microvm-boot-timeout",
            "300ms",
        ],
    )
    .await
    .expect("server");
    s.ensure_base(None).await.expect("base image");
    let c = s.client();
    let err = c
        .create_sandbox(CreateSandboxRequest {
            isolation: Isolation::Microvm,
            ..Default::default()
        })
        .await
        .expect_err("no guest boots in 300 ms");
    let msg = err.to_string();
    assert!(
        msg.contains("did not start its agent within 300ms"),
        "{msg}"
    );
    // Nothing is left: no QEMU, cgroup or directory of any sandbox.
    let listed = c.list_sandboxes(Default::default()).await.expect("list");
    for sb in &listed.sandboxes {
        assert!(qemu_processes(&sb.id).is_empty(), "{sb:?}");
        assert!(host::cgroup_dirs(&sb.id).is_empty(), "{sb:?}");
    }
    assert!(qemu_processes(&s.run_dir.display().to_string()).is_empty());
    let left = |dir: std::path::PathBuf| std::fs::read_dir(dir).map(|d| d.count()).unwrap_or(0);
    assert_eq!(left(s.run_dir.join("sandboxes")), 0);
    assert_eq!(left(s.state_dir.join("sandboxes")), 0);
}
