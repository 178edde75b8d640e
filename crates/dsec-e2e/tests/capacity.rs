//! Admission: a full node answers a retryable `capacity` error naming the resource, keeps
//! no record of the refused sandbox, and admits again after a delete. Also checks the
//! kernel limits `dsec serve` raises at start, and that `--job-suspend-keeps-lifetime`
//! lets a suspended job's sandboxes expire.

use dsec_e2e::{require_root, Server};
use dsec_wire::v1::*;
use dsec_wire::ErrorCode;

#[tokio::test(flavor = "multi_thread")]
async fn a_full_node_refuses_with_capacity_and_admits_again_after_a_delete() {
    if !require_root() {
        return;
    }
    let s = Server::start_with(
        "capacity",
        true,
        &[
            "--max-sandboxes",
            "3",
            "--disk-pool",
            "2",
            "--cpu-overcommit",
            "8",
        ],
    )
    .await
    .expect("server");
    s.ensure_base(None).await.expect("base image");
    let c = s.client();
    let cap = c
        .health()
        .await
        .expect("health")
        .capacity
        .expect("capacity");
    assert_eq!(cap.max_sandboxes, 3);
    assert_eq!(cap.sandboxes, 0);
    let cpus = std::thread::available_parallelism()
        .map(|p| p.get())
        .unwrap_or(1) as u64;
    assert_eq!(
        cap.cpu_millis_allocatable,
        cpus * 1000 * 8,
        "--cpu-overcommit 8"
    );
    assert!(cap.memory_available_bytes > cap.memory_reserve_bytes);

    let mut ids = Vec::new();
    for _ in 0..3 {
        ids.push(
            c.create_sandbox(CreateSandboxRequest::default())
                .await
                .expect("create")
                .id,
        );
    }
    let cap = c
        .health()
        .await
        .expect("health")
        .capacity
        .expect("capacity");
    assert_eq!((cap.sandboxes, cap.cpu_millis_requested), (3, 3000));
    let e = c
        .create_sandbox(CreateSandboxRequest::default())
        .await
        .expect_err("a fourth does not fit");
    let dsec_client::ClientError::Api(api) = e else {
        panic!("expected an API error, got {e}");
    };
    assert_eq!(api.code, ErrorCode::Capacity);
    assert!(api.code.retryable());
    assert!(api.message.contains("at most 3"), "{}", api.message);
    assert_eq!(
        c.list_sandboxes(Default::default())
            .await
            .expect("list")
            .sandboxes
            .len(),
        3
    );

    c.delete_sandbox(&ids.pop().expect("id"))
        .await
        .expect("delete");
    ids.push(
        c.create_sandbox(CreateSandboxRequest::default())
            .await
            .expect("admitted again")
            .id,
    );

    // CPU: more than CPUs x overcommit is refused whatever the count.
    c.delete_sandbox(&ids.pop().expect("id"))
        .await
        .expect("delete");
    let e = c
        .create_sandbox(CreateSandboxRequest {
            resources: Resources {
                cpu: Some(64.0),
                ..Default::default()
            },
            ..Default::default()
        })
        .await
        .expect_err("64 cores requested");
    let dsec_client::ClientError::Api(api) = e else {
        panic!("expected an API error, got {e}");
    };
    assert_eq!(api.code, ErrorCode::Capacity);
    assert!(api.message.contains("CPU"), "{}", api.message);
    for id in ids {
        c.delete_sandbox(&id).await.expect("delete");
    }

    // Limits that cap density were raised at start.
    let pid_max: u64 = std::fs::read_to_string("/proc/sys/kernel/pid_max")
        .expect("pid_max")
        .trim()
        .parse()
        .expect("number");
    assert!(pid_max >= 4_194_304, "pid_max {pid_max}");
}

#[tokio::test(flavor = "multi_thread")]
async fn with_job_suspend_keeps_lifetime_a_suspended_sandbox_still_expires() {
    if !require_root() {
        return;
    }
    let s = Server::start_with(
        "job-clock",
        true,
        // Its own cgroup parent: the capacity test's node runs beside it.
        &[
            "--job-suspend-keeps-lifetime",
            "--disk-pool",
            "2",
            "--cgroup-parent",
            "dsec-job-clock",
        ],
    )
    .await
    .expect("server");
    s.ensure_base(None).await.expect("base image");
    let c = s.client();
    let sb = c
        .create_sandbox(CreateSandboxRequest {
            labels: [(JOB_LABEL.to_string(), "clock".to_string())].into(),
            timeout_s: Some(2),
            ..Default::default()
        })
        .await
        .expect("create");
    let r = c.suspend_job("clock").await.expect("suspend");
    assert!(r.sandboxes.iter().all(|o| o.error.is_none()));
    let gone = dsec_e2e::wait_until(std::time::Duration::from_secs(10), || async {
        match c.get_sandbox(&sb.id).await {
            Err(e) if e.code() == Some(ErrorCode::Expired) => Some(()),
            _ => None,
        }
    })
    .await;
    assert!(
        gone.is_some(),
        "the lifetime ran on while the job was suspended"
    );
}

/// A deleted sandbox's processes first die at the lowest CPU weight (teardown yields to
/// creates), but not for long: next to busy neighbours, a process at that weight, or a
/// best-effort (`SCHED_IDLE`) one, may not run for seconds, and it has to run to die.
/// Every delete must finish, and quickly, on a node whose CPUs are all taken.
#[tokio::test(flavor = "multi_thread")]
async fn deletes_finish_promptly_next_to_busy_neighbours() {
    if !require_root() {
        return;
    }
    let s = Server::start_with("busy", true, &["--cgroup-parent", "dsec-busy"])
        .await
        .expect("server");
    s.ensure_base(None).await.expect("base image");
    let c = s.client();
    // Spinning, with memory to tear down: four per core, one of them best-effort.
    let hog =
        "x = bytearray(192 << 20)\nfor i in range(0, len(x), 4096): x[i] = 1\nwhile True: pass";
    let cores = std::thread::available_parallelism()
        .map(|p| p.get())
        .unwrap_or(2);
    let mut ids = Vec::new();
    for i in 0..4 * cores {
        let qos = if i == 0 {
            Qos::BestEffort
        } else {
            Qos::LatencySensitive
        };
        let sb = c
            .create_sandbox(CreateSandboxRequest {
                qos,
                ..Default::default()
            })
            .await
            .expect("create");
        c.start_process(
            &sb.id,
            dsec_e2e::background(Command::Argv(vec![
                "python3".into(),
                "-c".into(),
                hog.into(),
            ])),
        )
        .await
        .expect("start hog");
        ids.push(sb.id);
    }
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    // The best-effort one first, while every other one spins.
    for id in &ids {
        let t = std::time::Instant::now();
        c.delete_sandbox(id)
            .await
            .expect("delete next to busy neighbours");
        let took = t.elapsed();
        eprintln!("deleting {id} took {took:?}");
        assert!(
            took < std::time::Duration::from_secs(3),
            "deleting {id} took {took:?}"
        );
    }
}
