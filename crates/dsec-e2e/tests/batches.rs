//! Batch jobs on real sandboxes: 200 tasks of which some fail, some time out and one has
//! its output rewritten between the agent's hash and the server's copy, with a `kill -9`
//! of the server in the middle. Every task must end finalized with outputs whose bytes
//! and checksums are right, or failed with its reason and snapshot; nothing is left
//! running; and `dsec submit --wait` drives a job file end to end.

use std::collections::BTreeMap;
use std::time::Duration;

use dsec_e2e::{require_root, run_cli, wait_until, Server};
use dsec_wire::v1::{
    BatchSpec, BatchState, Command, ErrorSnapshot, InputRef, TaskDefaults, TaskSpec, TaskState,
    BATCH_LABEL,
};
use sha2::Digest;

/// Swaps /out/victim for other bytes while the agent's hash (phase one) opens it, so the
/// hash reads what the task wrote and the server's copy (phase two) reads the swap: it
/// holds a write lease, which blocks the first open until released, and it renames the
/// new file over the old one before releasing, so the blocked open keeps the old inode.
/// Deterministic: no race between the rewrite and the copy.
const CORRUPTER: &str = r#"
import fcntl, os, signal
F_SETLEASE, F_WRLCK, F_UNLCK = 1024, 1, 2
with open('/out/victim', 'w') as f:
    f.write('what the task wrote\n')
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGIO])
fd = os.open('/out/victim', os.O_RDONLY)
fcntl.fcntl(fd, F_SETLEASE, F_WRLCK)
open('/out/ready', 'w').close()
signal.sigwait([signal.SIGIO])
with open('/out/victim.new', 'w') as f:
    f.write('rewritten behind the checksum\n')
os.rename('/out/victim.new', '/out/victim')
fcntl.fcntl(fd, F_SETLEASE, F_UNLCK)
"#;

/// What an `ok-` task runs: copies its input and writes its index.
const TASK_COMMAND: &str = "mkdir -p /out && cat /in/data > /out/copy && echo $N > /out/n";

/// How long ok-000 sleeps before its work: longer than the batch takes to reach the kill.
const HELD_S: u32 = 40;

fn sh(cmd: &str) -> Option<Command> {
    Some(Command::Shell(cmd.to_string()))
}

fn sha(data: &[u8]) -> String {
    format!("{:x}", sha2::Sha256::digest(data))
}

#[tokio::test(flavor = "multi_thread")]
async fn two_hundred_tasks_survive_kill_9_and_end_verified_or_failed_with_a_snapshot() {
    if !require_root() {
        return;
    }
    let mut s = Server::start_with("batches", true, &["--cgroup-parent", "dsec-batches"])
        .await
        .unwrap_or_else(|e| panic!("server: {e:#}"));
    s.ensure_base(None)
        .await
        .unwrap_or_else(|e| panic!("base image: {e:#}"));
    let c = s.client();

    let mut tasks = Vec::new();
    for i in 0..185 {
        let mut t = TaskSpec {
            id: format!("ok-{i:03}"),
            env: BTreeMap::from([("N".to_string(), i.to_string())]),
            ..Default::default()
        };
        t.inputs
            .insert("/in/data".into(), InputRef::Text(format!("data of {i}\n")));
        if i == 0 {
            // Held in flight until the kill: some task must be mid-attempt when the
            // server dies, whatever the machine's speed (fast tasks may all sit in
            // collection at that instant, which resumes without a retry).
            t.command = sh(&format!("sleep {HELD_S}; {TASK_COMMAND}"));
        }
        tasks.push(t);
    }
    for i in 0..8 {
        tasks.push(TaskSpec {
            id: format!("fails-{i}"),
            command: sh(&format!("echo boom-{i}; echo to stderr >&2; exit 7")),
            retries: Some(1),
            ..Default::default()
        });
    }
    for i in 0..6 {
        tasks.push(TaskSpec {
            id: format!("slow-{i}"),
            command: sh("echo started; sleep 60"),
            timeout_s: Some(1),
            retries: Some(0),
            ..Default::default()
        });
    }
    let mut corrupt = TaskSpec {
        id: "corrupted".into(),
        command: sh(
            "mkdir -p /out && (setsid python3 /in/corrupt.py </dev/null >/dev/null 2>&1 &) \
             && for i in $(seq 200); do [ -e /out/ready ] && exit 0; sleep 0.05; done; exit 9",
        ),
        outputs: Some(vec!["/out/victim".into()]),
        retries: Some(1),
        ..Default::default()
    };
    corrupt
        .inputs
        .insert("/in/corrupt.py".into(), InputRef::Text(CORRUPTER.into()));
    tasks.push(corrupt);
    assert_eq!(tasks.len(), 200);
    let spec = BatchSpec {
        name: Some("e2e".into()),
        defaults: TaskDefaults {
            command: sh(TASK_COMMAND),
            outputs: vec!["/out/copy".into(), "/out/n".into()],
            timeout_s: Some(60),
            ..Default::default()
        },
        tasks,
        parallelism: Some(8),
        ..Default::default()
    };
    let batch = c.submit_batch(&spec).await.expect("submit");
    assert_eq!(batch.total, 200);

    // Mid-batch: kill -9 the server (and with it the node's side of every task in
    // flight), then start it again on the same state.
    wait_until(Duration::from_secs(240), || async {
        let b = c.get_batch(&batch.id).await.ok()?;
        if b.counts[&TaskState::Finalized] < 24 {
            return None;
        }
        let tasks = c.all_batch_tasks(&batch.id).await.ok()?;
        let held = tasks.iter().find(|t| t.id == "ok-000")?;
        assert!(
            !held.state.is_terminal(),
            "ok-000 ended before the kill (it sleeps {HELD_S} s): {held:?}"
        );
        (held.state == TaskState::Running).then_some(())
    })
    .await
    .expect("24 tasks never finalized beside a running ok-000");
    s.kill();
    s.spawn()
        .await
        .unwrap_or_else(|e| panic!("restart after kill -9: {e:#}"));
    let c = s.client();
    let done = wait_until(Duration::from_secs(600), || async {
        let b = c.get_batch(&batch.id).await.ok()?;
        b.ended_at_ms.is_some().then_some(b)
    })
    .await
    .expect("the batch never ended after the restart");
    let statuses = c.all_batch_tasks(&batch.id).await.expect("tasks");
    let odd: Vec<_> = statuses
        .iter()
        .filter(|t| t.id.starts_with("ok-") != (t.state == TaskState::Finalized))
        .collect();
    assert_eq!(done.state, BatchState::Finished, "{done:?}");
    assert!(odd.is_empty(), "tasks that ended otherwise: {odd:#?}");
    assert_eq!(done.counts[&TaskState::Finalized], 185, "{done:?}");
    assert_eq!(done.counts[&TaskState::Failed], 15, "{done:?}");

    assert_eq!(statuses.len(), 200);
    let mut retried_after_restart = 0;
    for t in &statuses {
        if let Some(i) = t.id.strip_prefix("ok-") {
            let i: u32 = i.parse().expect("index");
            assert_eq!(t.state, TaskState::Finalized, "{t:?}");
            if t.attempt > 1 {
                retried_after_restart += 1;
            }
            let want = [
                ("/out/copy", format!("data of {i}\n")),
                ("/out/n", format!("{i}\n")),
            ];
            for (path, content) in want {
                let rec = &t.outputs[path];
                assert_eq!(rec.sha256, sha(content.as_bytes()), "{}: {path}", t.id);
                let got = c
                    .batch_output(&batch.id, &t.id, Some(path))
                    .await
                    .expect("output");
                assert_eq!(got.as_ref(), content.as_bytes(), "{}: {path}", t.id);
            }
            continue;
        }
        assert_eq!(t.state, TaskState::Failed, "{t:?}");
        let error = t.error.clone().unwrap_or_default();
        if t.id.starts_with("fails-") {
            assert_eq!(t.exit_code, Some(7), "{t:?}");
            assert_eq!(t.failures, 2, "one retry: {t:?}");
            let snap = c
                .batch_output(&batch.id, &t.id, None)
                .await
                .expect("snapshot");
            let snap: ErrorSnapshot = serde_json::from_slice(&snap).expect("snapshot json");
            assert_eq!(snap.exit_code, Some(7));
            assert_eq!(snap.stdout_tail, vec![format!("boom-{}", &t.id[6..])]);
            assert_eq!(snap.stderr_tail, vec!["to stderr".to_string()]);
            assert!(snap.env_names.is_empty(), "{snap:?}");
        } else if t.id.starts_with("slow-") {
            assert!(t.timed_out, "{t:?}");
            assert!(error.contains("timed out after 1 s"), "{error}");
            let snap = c
                .batch_output(&batch.id, &t.id, None)
                .await
                .expect("snapshot");
            let snap: ErrorSnapshot = serde_json::from_slice(&snap).expect("snapshot json");
            assert!(
                snap.timed_out && snap.stdout_tail == ["started"],
                "{snap:?}"
            );
        } else {
            assert_eq!(t.id, "corrupted");
            assert!(
                error.contains("checksum mismatch on output /out/victim"),
                "the rewritten output was not caught: {t:?}"
            );
            assert!(t.outputs.is_empty(), "{t:?}");
        }
    }
    assert!(
        retried_after_restart > 0,
        "no task in flight at the kill was retried"
    );
    let held = statuses.iter().find(|t| t.id == "ok-000").expect("ok-000");
    assert_eq!(
        held.attempt, 2,
        "running at the kill, so retried once: {held:?}"
    );

    // Nothing of the batch runs on.
    let left = c
        .list_sandboxes(BTreeMap::from([(
            BATCH_LABEL.to_string(),
            batch.id.clone(),
        )]))
        .await
        .expect("list");
    assert!(left.sandboxes.is_empty(), "{:?}", left.sandboxes);
    let manifest = c.batch_manifest(&batch.id).await.expect("manifest");
    assert_eq!(manifest.tasks.len(), 200);
    assert!(manifest.batch.image_digest.is_some() && !manifest.layers.is_empty());
    let t = manifest
        .tasks
        .iter()
        .find(|t| t.status.id == "ok-000")
        .expect("ok-000 in the manifest");
    assert!(
        t.status.node.is_some() && t.status.sandbox_id.is_some(),
        "{t:?}"
    );
    assert_eq!(t.spec.inputs["/in/data"].sha256, sha(b"data of 0\n"));
}

#[tokio::test(flavor = "multi_thread")]
async fn dsec_submit_uploads_local_inputs_and_waits_for_the_end() {
    if !require_root() {
        return;
    }
    let s = Server::start_with(
        "batches-cli",
        true,
        &["--cgroup-parent", "dsec-batches-cli"],
    )
    .await
    .unwrap_or_else(|e| panic!("server: {e:#}"));
    s.ensure_base(None)
        .await
        .unwrap_or_else(|e| panic!("base image: {e:#}"));
    let dir = tempfile::tempdir().expect("dir");
    std::fs::write(dir.path().join("words.txt"), "b\na\nc\n").expect("input");
    let job = r#"
name: sort-words
defaults:
  command: "mkdir -p /out && sort /in/words > /out/sorted"
  outputs: [/out/sorted]
  timeout_s: 30
tasks:
  - id: one
    inputs:
      /in/words: {file: words.txt}
  - id: two
    inputs:
      /in/words: {text: "z\ny\n"}
"#;
    let path = dir.path().join("job.yaml");
    std::fs::write(&path, job).expect("job file");
    let file = path.to_string_lossy().into_owned();
    let (code, out, err) = run_cli(&s.url, &s.key, &["submit", &file, "--wait", "--json"]);
    assert_eq!(code, Some(0), "stdout {out}\nstderr {err}");
    let batch: dsec_wire::v1::Batch = serde_json::from_str(&out).expect("batch json");
    assert_eq!(batch.counts[&TaskState::Finalized], 2, "{batch:?}");
    let (code, out, err) = run_cli(
        &s.url,
        &s.key,
        &["batch", "output", &batch.id, "one", "--path", "/out/sorted"],
    );
    assert_eq!((code, out.as_str()), (Some(0), "a\nb\nc\n"), "{err}");

    // A job with a missing input is refused before anything runs.
    let bad =
        "tasks:\n  - id: x\n    command: \"true\"\n    inputs:\n      /in/a: {blob: no/such}\n";
    std::fs::write(&path, bad).expect("job file");
    let (code, _, err) = run_cli(&s.url, &s.key, &["submit", &file]);
    assert_ne!(code, Some(0));
    assert!(
        err.contains("no/such") && err.contains("not found"),
        "{err}"
    );
}
