//! Batch jobs over a `FakeNode`, a real redb store and a real directory blob store:
//! inputs placed, outputs collected and verified, failures retried then failed with
//! their snapshot, missing outputs caught, and bad specs refused with clear errors.

use std::sync::Arc;
use std::time::{Duration, Instant};

use dsec_control::{ControlConfig, ControlPlane, Principal, SandboxApi};
use dsec_node_api::fake::FakeNode;
use dsec_state::RedbStore;
use dsec_wire::v1::{
    Batch, BatchSpec, BatchState, CreateSandboxRequest, ErrorSnapshot, InputRef, TaskDefaults,
    TaskListQuery, TaskSpec, TaskState, TaskStatus, BATCH_LABEL,
};
use dsec_wire::ErrorCode;
use sha2::Digest;

mod common;
use common::op;

struct BatchFixture {
    plane: Arc<ControlPlane>,
    _dir: tempfile::TempDir,
}

async fn fixture() -> BatchFixture {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = Arc::new(RedbStore::open(&dir.path().join("state.redb")).expect("store"));
    let blobs = dsec_blob::DirStore::open(dir.path().join("blobs")).expect("blob store");
    let node = Arc::new(FakeNode::new("fake-1"));
    let mut cfg = ControlConfig::with_key("k".into());
    cfg.batch_store = Some(Arc::new(blobs));
    let plane = ControlPlane::open(cfg, node, store)
        .await
        .unwrap_or_else(|e| panic!("open the plane: {e:?}"));
    BatchFixture { plane, _dir: dir }
}

fn task(id: &str, command: &str) -> TaskSpec {
    TaskSpec {
        id: id.into(),
        command: Some(dsec_wire::v1::Command::Shell(command.into())),
        ..Default::default()
    }
}

async fn wait_done(plane: &ControlPlane, caller: &Principal, id: &str) -> Batch {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let b = plane.get_batch(caller, id).await.expect("get batch");
        if b.ended_at_ms.is_some() {
            return b;
        }
        assert!(Instant::now() < deadline, "batch still running: {b:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The bytes of a batch output (or snapshot).
async fn output(
    plane: &ControlPlane,
    caller: &Principal,
    id: &str,
    task: &str,
    path: Option<&str>,
) -> Vec<u8> {
    use futures::StreamExt;
    let (size, mut stream) = plane
        .batch_output(caller, id, task, path)
        .await
        .unwrap_or_else(|e| panic!("output of {task}: {e:?}"));
    let mut out = Vec::new();
    while let Some(chunk) = stream.next().await {
        out.extend_from_slice(&chunk.expect("chunk"));
    }
    assert_eq!(out.len() as u64, size);
    out
}

async fn tasks(plane: &ControlPlane, caller: &Principal, id: &str) -> Vec<TaskStatus> {
    plane
        .batch_tasks(caller, id, TaskListQuery::default())
        .await
        .expect("tasks")
        .tasks
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tasks_end_finalized_with_verified_outputs_or_failed_with_a_snapshot() {
    let f = fixture().await;
    let mut spec = BatchSpec {
        name: Some("judge".into()),
        defaults: TaskDefaults {
            command: Some(dsec_wire::v1::Command::Shell("cat /in/x > /in/r".into())),
            outputs: vec!["/in/r".into()],
            retries: Some(1),
            ..Default::default()
        },
        parallelism: Some(4),
        ..Default::default()
    };
    for i in 0..12 {
        let mut t = task(&format!("ok-{i:02}"), "cat /in/x > /in/r");
        t.inputs
            .insert("/in/x".into(), InputRef::Text(format!("payload {i}\n")));
        spec.tasks.push(t);
    }
    let mut fails = task("exits-3", "exit 3");
    fails.env.insert("SECRET_NAME".into(), "value".into());
    fails
        .inputs
        .insert("/in/x".into(), InputRef::Text("x".into()));
    spec.tasks.push(fails);
    let mut missing = task("no-output", "true");
    missing.outputs = Some(vec!["/in/never".into()]);
    missing.retries = Some(0);
    missing
        .inputs
        .insert("/in/x".into(), InputRef::Text("x".into()));
    spec.tasks.push(missing);

    let b = f.plane.submit_batch(op(), spec).await.expect("submit");
    assert_eq!(b.total, 14);
    let done = wait_done(&f.plane, op(), &b.id).await;
    assert_eq!(done.state, BatchState::Finished);
    assert_eq!(done.counts[&TaskState::Finalized], 12, "{done:?}");
    assert_eq!(done.counts[&TaskState::Failed], 2, "{done:?}");

    for t in tasks(&f.plane, op(), &b.id).await {
        match t.id.as_str() {
            "exits-3" => {
                assert_eq!(t.state, TaskState::Failed);
                assert_eq!((t.attempt, t.failures), (2, 2), "one retry: {t:?}");
                assert_eq!(t.exit_code, Some(3));
                let snap = output(&f.plane, op(), &b.id, &t.id, None).await;
                let snap: ErrorSnapshot = serde_json::from_slice(&snap).expect("snapshot json");
                assert_eq!(snap.exit_code, Some(3));
                assert_eq!(snap.attempt, 2);
                assert_eq!(snap.env_names, vec!["SECRET_NAME".to_string()]);
            }
            "no-output" => {
                assert_eq!(t.state, TaskState::Failed);
                let e = t.error.unwrap_or_default();
                assert!(e.contains("declared output /in/never is missing"), "{e}");
            }
            id => {
                assert_eq!(t.state, TaskState::Finalized, "{t:?}");
                let i: u32 = id[3..].parse().expect("index");
                let want = format!("payload {i}\n");
                let out = &t.outputs["/in/r"];
                assert_eq!(out.sha256, format!("{:x}", sha2::Sha256::digest(&want)));
                let got = output(&f.plane, op(), &b.id, id, Some("/in/r")).await;
                assert_eq!(got, want.as_bytes());
            }
        }
    }
    // Every sandbox of the batch is gone.
    let left = f
        .plane
        .list_sandboxes(op(), [(BATCH_LABEL.to_string(), b.id.clone())].into())
        .await
        .expect("list");
    assert!(left.sandboxes.is_empty(), "{left:?}");

    let manifest = f.plane.batch_manifest(op(), &b.id).await.expect("manifest");
    let manifest_tasks = manifest.tasks.len();
    assert_eq!(manifest.tasks.len(), 14);
    let m = manifest
        .tasks
        .iter()
        .find(|t| t.status.id == "ok-03")
        .expect("task in the manifest");
    assert_eq!(m.spec.command, vec!["/bin/sh", "-c", "cat /in/x > /in/r"]);
    assert_eq!(
        m.spec.inputs["/in/x"].sha256,
        format!("{:x}", sha2::Sha256::digest(b"payload 3\n"))
    );
    let st = &m.status;
    assert!(st.node.is_some() && st.started_at_ms.is_some() && st.ended_at_ms.is_some());

    // Another tenant sees none of it, and cannot purge it.
    let other = common::tenant("other");
    let e = f.plane.get_batch(&other, &b.id).await.expect_err("hidden");
    assert_eq!(e.code, ErrorCode::NotFound);
    let e = f
        .plane
        .purge_batch(&other, &b.id)
        .await
        .expect_err("hidden");
    assert_eq!(e.code, ErrorCode::NotFound);

    // Purged: the batch, its tasks and everything it wrote to the blob store go.
    assert_eq!(manifest_tasks, 14);
    let written = f
        ._dir
        .path()
        .join("blobs/tenants/default/batches")
        .join(&b.id);
    assert!(written.exists(), "{}", written.display());
    f.plane.purge_batch(op(), &b.id).await.expect("purge");
    let e = f.plane.get_batch(op(), &b.id).await.expect_err("purged");
    assert_eq!(e.code, ErrorCode::NotFound);
    let left: Vec<_> = walk(&written);
    assert!(left.is_empty(), "{left:?}");
}

/// Regular files under `dir` (none if it is gone).
fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_specs_get_clear_errors() {
    let f = fixture().await;
    let base = || BatchSpec {
        tasks: vec![task("a", "true")],
        ..Default::default()
    };
    let mut missing = base();
    missing.tasks[0]
        .inputs
        .insert("/in/data".into(), InputRef::Blob("sets/none.txt".into()));
    let e = f
        .plane
        .submit_batch(op(), missing)
        .await
        .expect_err("missing");
    assert!(
        e.message.contains("task \"a\"") && e.message.contains("not found"),
        "{e:?}"
    );

    let mut outside = base();
    outside.tasks[0].outputs = Some(vec!["/out/../../etc/shadow".into()]);
    let e = f
        .plane
        .submit_batch(op(), outside)
        .await
        .expect_err("outside");
    assert_eq!(e.code, ErrorCode::InvalidPath, "{e:?}");
    let mut relative = base();
    relative.tasks[0].outputs = Some(vec!["out.txt".into()]);
    let e = f
        .plane
        .submit_batch(op(), relative)
        .await
        .expect_err("relative");
    assert_eq!(e.code, ErrorCode::InvalidPath, "{e:?}");

    let mut twice = base();
    twice.tasks.push(task("a", "true"));
    let e = f.plane.submit_batch(op(), twice).await.expect_err("dup");
    assert!(e.message.contains("id used twice"), "{e:?}");

    let mut no_cmd = base();
    no_cmd.tasks[0].command = None;
    let e = f
        .plane
        .submit_batch(op(), no_cmd)
        .await
        .expect_err("no cmd");
    assert!(e.message.contains("no command"), "{e:?}");

    let e = f
        .plane
        .submit_batch(op(), BatchSpec::default())
        .await
        .expect_err("empty");
    assert!(e.message.contains("at least one task"), "{e:?}");

    let mut zero = base();
    zero.parallelism = Some(0);
    let e = f
        .plane
        .submit_batch(op(), zero)
        .await
        .expect_err("parallelism");
    assert!(e.message.contains("parallelism"), "{e:?}");

    let mut image = base();
    image.template.image = Some("no-such-image".into());
    let e = f.plane.submit_batch(op(), image).await.expect_err("image");
    assert_eq!(e.code, ErrorCode::ImageNotFound, "{e:?}");

    // A user may not forge a batch's labels on a sandbox of their own.
    let forged = CreateSandboxRequest {
        labels: [(BATCH_LABEL.to_string(), "bt-x".to_string())].into(),
        ..Default::default()
    };
    let e = f
        .plane
        .create_sandbox(op(), forged)
        .await
        .expect_err("label");
    assert!(e.message.contains("set by batches"), "{e:?}");

    // Nothing was stored by the refused submits.
    let list = f.plane.list_batches(op()).await.expect("list");
    assert!(list.batches.is_empty(), "{list:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uploaded_inputs_are_placed_and_a_cancel_ends_the_batch() {
    let f = fixture().await;
    let body = dsec_node_api::once_bytes(b"uploaded data\n".to_vec());
    let obj = f
        .plane
        .put_input(op(), "sets/a.txt", body)
        .await
        .expect("put input");
    assert_eq!(obj.bytes, 14);
    let mut t = task("uses-blob", "cat /in/a > /in/out");
    t.inputs
        .insert("/in/a".into(), InputRef::Blob("sets/a.txt".into()));
    t.outputs = Some(vec!["/in/out".into()]);
    let spec = BatchSpec {
        tasks: vec![t],
        ..Default::default()
    };
    let b = f.plane.submit_batch(op(), spec).await.expect("submit");
    let done = wait_done(&f.plane, op(), &b.id).await;
    assert_eq!(done.counts[&TaskState::Finalized], 1, "{done:?}");
    let got = output(&f.plane, op(), &b.id, "uses-blob", Some("/in/out")).await;
    assert_eq!(got, b"uploaded data\n");

    // A batch of slow tasks, cancelled: every task ends failed `cancelled`.
    let slow = BatchSpec {
        tasks: (0..6).map(|i| task(&format!("s{i}"), "sleep 30")).collect(),
        parallelism: Some(2),
        ..Default::default()
    };
    let b = f.plane.submit_batch(op(), slow).await.expect("submit slow");
    let e = f.plane.purge_batch(op(), &b.id).await.expect_err("running");
    assert_eq!(e.code, ErrorCode::Conflict, "{e:?}");
    f.plane.cancel_batch(op(), &b.id).await.expect("cancel");
    let done = wait_done(&f.plane, op(), &b.id).await;
    assert_eq!(done.state, BatchState::Cancelled);
    assert_eq!(done.counts[&TaskState::Failed], 6, "{done:?}");
    for t in tasks(&f.plane, op(), &b.id).await {
        assert_eq!(t.error.as_deref(), Some("cancelled"), "{t:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_can_run_its_tasks_in_claims_of_a_warm_pool() {
    let f = fixture().await;
    let pool = dsec_wire::v1::PoolSpec {
        name: "warm".into(),
        template: CreateSandboxRequest::default(),
        min: 2,
        max: 4,
        autoscale: Default::default(),
        fncall: None,
    };
    f.plane.create_pool(op(), pool).await.expect("pool");
    let spec = BatchSpec {
        template: CreateSandboxRequest {
            pool: Some("warm".into()),
            ..Default::default()
        },
        tasks: (0..6)
            .map(|i| {
                let mut t = task(&format!("p{i}"), "cat /in/x > /in/y");
                t.inputs
                    .insert("/in/x".into(), InputRef::Text(format!("{i}")));
                t.outputs = Some(vec!["/in/y".into()]);
                t
            })
            .collect(),
        parallelism: Some(3),
        ..Default::default()
    };
    let b = f.plane.submit_batch(op(), spec).await.expect("submit");
    let done = wait_done(&f.plane, op(), &b.id).await;
    assert_eq!(done.counts[&TaskState::Finalized], 6, "{done:?}");
    for i in 0..6 {
        let got = output(&f.plane, op(), &b.id, &format!("p{i}"), Some("/in/y")).await;
        assert_eq!(got, format!("{i}").into_bytes());
    }
    // Claimed sandboxes were the tasks' own: all deleted, the pool refilled.
    let left = f
        .plane
        .list_sandboxes(op(), [(BATCH_LABEL.to_string(), b.id.clone())].into())
        .await
        .expect("list");
    assert!(left.sandboxes.is_empty(), "{left:?}");
    let p = f.plane.get_pool(op(), "warm").await.expect("pool");
    assert!(p.claimed >= 6, "{p:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_sandbox_lives_past_its_command_timeout() {
    let f = fixture().await;
    let mut t = task("long", "sleep 2");
    t.timeout_s = Some(5000);
    let spec = BatchSpec {
        tasks: vec![t],
        ..Default::default()
    };
    let b = f.plane.submit_batch(op(), spec).await.expect("submit");
    let deadline = Instant::now() + Duration::from_secs(10);
    let sb = loop {
        let list = f
            .plane
            .list_sandboxes(op(), [(BATCH_LABEL.to_string(), b.id.clone())].into())
            .await
            .expect("list");
        if let Some(sb) = list.sandboxes.into_iter().next() {
            break sb;
        }
        assert!(
            Instant::now() < deadline,
            "the task's sandbox never appeared"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    // The default lifetime (an hour) would end a 5000 s command.
    assert!(
        sb.expires_at - sb.created_at >= 5000 * 1000,
        "lifetime {} ms",
        sb.expires_at - sb.created_at
    );
    let done = wait_done(&f.plane, op(), &b.id).await;
    assert_eq!(done.counts[&TaskState::Finalized], 1, "{done:?}");
}
