//! Nothing leaks after a failed create or a crash mid-create, and a sandbox that died
//! while the server was down is reported `failed` and cleaned up. This binary runs alone
//! (cargo runs test binaries one at a time), so it may check the host's `dsec/` cgroups.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command as Proc, Stdio};

use dsec_e2e::{host, require_root, sh, Server};
use dsec_wire::v1::*;
use dsec_wire::ErrorCode;

/// Sandbox cgroups (subdirectories of the test servers' parent) in every v1 hierarchy or in v2.
fn sandbox_cgroups() -> Vec<String> {
    let mut out = Vec::new();
    let roots: Vec<_> = std::fs::read_dir("/sys/fs/cgroup")
        .map(|d| {
            d.flatten()
                .map(|e| e.path().join(dsec_e2e::TEST_CGROUP_PARENT))
                .collect()
        })
        .unwrap_or_default();
    for dir in roots
        .into_iter()
        .chain([Path::new("/sys/fs/cgroup").join(dsec_e2e::TEST_CGROUP_PARENT)])
    {
        if let Ok(entries) = std::fs::read_dir(&dir) {
            out.extend(
                entries
                    .flatten()
                    .filter(|e| e.path().is_dir())
                    .map(|e| e.path().display().to_string()),
            );
        }
    }
    out.sort();
    out.dedup();
    out
}

fn subdirs(p: &Path) -> Vec<String> {
    std::fs::read_dir(p)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread")]
async fn failed_and_half_created_sandboxes_leave_nothing() {
    if !require_root() {
        return;
    }
    let mut s = Server::start("recovery", true).await.expect("server");
    s.ensure_base(None).await.expect("base image");
    let c = s.client();
    assert!(
        sandbox_cgroups().is_empty(),
        "leftover cgroups before the test: {:?}",
        sandbox_cgroups()
    );

    // 1. A create that fails after namespaces, cgroup and directories exist: placing an
    //    initial file under /proc is refused inside the sandbox.
    let bad = CreateSandboxRequest {
        files: vec![InitFile {
            path: "/proc/sys/no/such".into(),
            content: "x".into(),
            encoding: ContentEncoding::Utf8,
            mode: None,
        }],
        ..Default::default()
    };
    let err = c.create_sandbox(bad).await.expect_err("create must fail");
    assert!(err.code().is_some(), "typed error expected: {err}");
    assert!(c
        .list_sandboxes(BTreeMap::new())
        .await
        .expect("list")
        .sandboxes
        .is_empty());
    assert!(
        subdirs(&s.state_dir.join("sandboxes")).is_empty(),
        "dirs: {:?}",
        subdirs(&s.state_dir.join("sandboxes"))
    );
    assert!(subdirs(&s.run_dir.join("sandboxes")).is_empty());
    assert!(
        sandbox_cgroups().is_empty(),
        "cgroups: {:?}",
        sandbox_cgroups()
    );

    // 2. One live sandbox whose init we kill while the server is down.
    let victim = c
        .create_sandbox(CreateSandboxRequest::default())
        .await
        .expect("create");
    let rec: serde_json::Value = serde_json::from_slice(
        &std::fs::read(
            s.run_dir
                .join("sandboxes")
                .join(&victim.id)
                .join("runtime.json"),
        )
        .expect("runtime.json"),
    )
    .expect("json");
    let init_pid = rec["pid"].as_i64().expect("pid") as i32;
    // And one that lives on, whose record an older node kept in the state directory.
    let survivor = c
        .create_sandbox(CreateSandboxRequest::default())
        .await
        .expect("create");
    s.kill();
    let record_now = s
        .run_dir
        .join("sandboxes")
        .join(&survivor.id)
        .join("runtime.json");
    let record_before = s
        .state_dir
        .join("sandboxes")
        .join(&survivor.id)
        .join("runtime.json");
    // Copied, not renamed: the run directory is a tmpfs of its own.
    std::fs::copy(&record_now, &record_before).expect("copy the record where it used to be");
    std::fs::remove_file(&record_now).expect("remove the record from the run directory");
    // SAFETY: kill with a pid read from the sandbox's own record.
    unsafe { libc::kill(init_pid, libc::SIGKILL) };

    // 3. Leftovers of a crash mid-create: a sandbox directory without runtime.json, and a
    //    cgroup with a live process but no directory at all.
    let half = s.state_dir.join("sandboxes/sb-halfdone");
    std::fs::create_dir_all(half.join("rootfs")).expect("mkdir");
    // Its disk was provisioned (a pool disk moved in) before the crash. Attached disks
    // (kernels without detached overlay layers) stay mounted after a crash; detached
    // ones die with the server and leave only their image files.
    let pool_dir = s.state_dir.join("disks/pool");
    let old_pool = subdirs(&pool_dir);
    assert!(!old_pool.is_empty(), "the server keeps a disk pool");
    std::fs::rename(pool_dir.join(&old_pool[0]), half.join("disk")).expect("move disk");
    let attached = half.join("disk/mnt").exists();
    assert_eq!(host::mounts("sb-halfdone").len(), usize::from(attached));
    let mut sleeper = Proc::new("sleep")
        .arg("300")
        .stdin(Stdio::null())
        .spawn()
        .expect("sleep");
    let orphan = "sb-orphaned";
    let mut joined = false;
    for ctrl in ["memory", "pids", "cpu", "freezer"] {
        let dir = Path::new("/sys/fs/cgroup")
            .join(ctrl)
            .join(dsec_e2e::TEST_CGROUP_PARENT)
            .join(orphan);
        if std::fs::create_dir_all(&dir).is_ok() {
            joined |= std::fs::write(dir.join("cgroup.procs"), sleeper.id().to_string()).is_ok();
        }
    }
    let v2 = Path::new("/sys/fs/cgroup")
        .join(dsec_e2e::TEST_CGROUP_PARENT)
        .join(orphan);
    if Path::new("/sys/fs/cgroup/cgroup.controllers").exists()
        && std::fs::create_dir_all(&v2).is_ok()
    {
        joined |= std::fs::write(v2.join("cgroup.procs"), sleeper.id().to_string()).is_ok();
    }
    assert!(joined, "could not place the orphan process in a cgroup");

    s.spawn().await.expect("restart");
    let c = s.client();
    // The sleeper was killed by the cleanup (reap it so it does not linger as a zombie).
    let status = sleeper.wait().expect("wait sleeper");
    assert!(!status.success(), "orphan process must be killed");
    assert!(!half.exists(), "half-created sandbox dir left");
    assert!(
        host::cgroup_dirs(orphan).is_empty(),
        "orphan cgroup left: {:?}",
        host::cgroup_dirs(orphan)
    );
    assert!(host::cgroup_dirs("sb-halfdone").is_empty());
    assert!(
        host::mounts("sb-halfdone").is_empty(),
        "half-created disk still mounted"
    );
    assert!(
        host::mounts(&victim.id).is_empty(),
        "dead sandbox's disk still mounted"
    );
    // The old pool was emptied, its loop devices freed (they detach asynchronously).
    let pool_now = subdirs(&pool_dir);
    assert!(
        old_pool.iter().all(|p| !pool_now.contains(p)),
        "old pool entries left"
    );
    let leaked = dsec_e2e::wait_until(std::time::Duration::from_secs(5), || async {
        let left: Vec<String> = old_pool
            .iter()
            .chain([&victim.id, &"sb-halfdone".to_string()])
            .flat_map(|name| host::loop_devices(name))
            .collect();
        left.is_empty().then_some(())
    })
    .await;
    assert!(leaked.is_some(), "loop devices of dead disks left");

    // The survivor is adopted from its old record, which moves to the run directory.
    let r = c
        .exec(&survivor.id, sh("echo alive"))
        .await
        .expect("exec survivor");
    assert_eq!(r.stdout, "alive\n");
    assert!(record_now.exists(), "record moved to the run directory");
    assert!(!record_before.exists(), "old record removed");
    c.delete_sandbox(&survivor.id)
        .await
        .expect("delete survivor");

    // The sandbox that died while the server was down is reported, not silently lost.
    let sb = c.get_sandbox(&victim.id).await.expect("record kept");
    assert_eq!(sb.state, SandboxState::Failed);
    assert!(
        sb.failure
            .as_deref()
            .unwrap_or("")
            .contains("no longer running"),
        "{:?}",
        sb.failure
    );
    let e = c
        .exec(&victim.id, sh("true"))
        .await
        .expect_err("exec on a failed sandbox");
    assert_eq!(e.code(), Some(ErrorCode::Failed));
    assert!(host::processes(&victim.id).is_empty());
    assert!(
        host::cgroup_dirs(&victim.id).is_empty(),
        "dead sandbox's cgroup left"
    );
    c.delete_sandbox(&victim.id)
        .await
        .expect("delete failed sandbox");
    assert!(subdirs(&s.state_dir.join("sandboxes")).is_empty());
    assert!(
        sandbox_cgroups().is_empty(),
        "cgroups: {:?}",
        sandbox_cgroups()
    );
}

/// A record a crash left `creating` while its sandbox lives on (the server died after the
/// node built it, before the create answered): the restart removes both, so nothing is
/// stuck in `creating`, and a retry with the same idempotency key makes a new sandbox at
/// once instead of waiting for the old record.
#[tokio::test(flavor = "multi_thread")]
async fn a_record_left_creating_by_a_crash_is_resolved_at_restart() {
    use dsec_state::StateStore;
    if !require_root() {
        return;
    }
    let mut s = Server::start_with(
        "recovery-creating",
        true,
        &["--cgroup-parent", "dsec-e2e-creating"],
    )
    .await
    .expect("server");
    s.ensure_base(None).await.expect("base image");
    let keyed = || CreateSandboxRequest {
        idempotency_key: Some("crash-mid-create".into()),
        ..Default::default()
    };
    let first = s.client().create_sandbox(keyed()).await.expect("create");
    assert!(!host::processes(&first.id).is_empty());
    s.kill();
    {
        let store = dsec_state::RedbStore::open(&s.state_dir.join("state.redb")).expect("store");
        let bytes = store
            .get("sandboxes", &first.id)
            .await
            .expect("get")
            .expect("the record")
            .value;
        let mut rec: serde_json::Value = serde_json::from_slice(&bytes).expect("json");
        rec["sandbox"]["state"] = "creating".into();
        store
            .put(
                "sandboxes",
                &first.id,
                &serde_json::to_vec(&rec).expect("json"),
                dsec_state::Expect::Any,
            )
            .await
            .expect("put");
    }
    s.spawn().await.expect("restart");
    let c = s.client();
    let e = c
        .get_sandbox(&first.id)
        .await
        .expect_err("the half-created record is gone");
    assert_eq!(e.code(), Some(ErrorCode::NotFound), "{e}");
    assert!(
        host::processes(&first.id).is_empty(),
        "its sandbox was destroyed"
    );
    assert!(host::cgroup_dirs(&first.id).is_empty());
    let started = std::time::Instant::now();
    let again = tokio::time::timeout(
        std::time::Duration::from_secs(30),
        c.create_sandbox(keyed()),
    )
    .await
    .expect("a retried create does not wait for a stuck record")
    .expect("retried create");
    assert_ne!(again.id, first.id);
    assert_eq!(again.state, SandboxState::Ready);
    let r = c.exec(&again.id, sh("echo ok")).await.expect("exec");
    assert_eq!(r.stdout, "ok\n");
    eprintln!("retried create answered in {:?}", started.elapsed());
    c.delete_sandbox(&again.id).await.expect("delete");
}
