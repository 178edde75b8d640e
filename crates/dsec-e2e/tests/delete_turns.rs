//! Deletes take turns (`dsec serve --delete-concurrency N`): a burst of deletes queues
//! at the node instead of tearing everything down at once. Every queued delete still
//! completes and leaves nothing behind, and creates go on meanwhile.

use dsec_e2e::{host, require_root, sh, Server};
use dsec_wire::v1::*;

#[tokio::test(flavor = "multi_thread")]
async fn a_burst_of_deletes_queues_completes_and_leaves_nothing() {
    if !require_root() {
        return;
    }
    let seed = Server::shared("delete-turns-seed");
    let s = Server::start_with(
        "delete-turns",
        true,
        &[
            "--cgroup-parent",
            "dsec-delete-turns",
            "--delete-concurrency",
            "1",
        ],
    )
    .await
    .expect("server");
    s.ensure_base(Some(seed)).await.expect("base image");
    let c = s.client();
    let mut ids = Vec::new();
    for _ in 0..6 {
        let sb = c
            .create_sandbox(CreateSandboxRequest::default())
            .await
            .expect("create");
        // Something to kill and something written to the sandbox's disk.
        let r = c
            .exec(&sb.id, sh("setsid -f sleep 600; echo data > /tmp/f"))
            .await
            .expect("exec");
        assert_eq!(r.exit.exit_code, Some(0), "{r:?}");
        ids.push(sb.id);
    }
    // All at once: one is torn down at a time, the rest wait their turn.
    let deletes: Vec<_> = ids
        .iter()
        .map(|id| {
            let c = c.clone();
            let id = id.clone();
            tokio::spawn(async move { c.delete_sandbox(&id).await })
        })
        .collect();
    // Creates do not wait behind the queue of deletes.
    let fresh = c
        .create_sandbox(CreateSandboxRequest::default())
        .await
        .expect("create while deletes queue");
    let r = c.exec(&fresh.id, sh("echo up")).await.expect("exec");
    assert_eq!(r.stdout, "up\n", "{r:?}");
    for d in deletes {
        d.await.expect("join").expect("queued delete");
    }
    let left = c.list_sandboxes(Default::default()).await.expect("list");
    assert_eq!(
        left.sandboxes
            .iter()
            .map(|s| s.id.as_str())
            .collect::<Vec<_>>(),
        [fresh.id.as_str()]
    );
    for id in &ids {
        assert!(host::cgroup_dirs(id).is_empty(), "{id}: cgroups left");
        assert!(host::processes(id).is_empty(), "{id}: processes left");
        assert!(host::mounts(id).is_empty(), "{id}: mounts left");
    }
    c.delete_sandbox(&fresh.id).await.expect("delete");
}
