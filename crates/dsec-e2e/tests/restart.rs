//! Restart of `dsec serve` (SIGKILL, as in a crash) with 20 live sandboxes: all are
//! re-adopted with their processes and files, and still usable afterwards.

use std::collections::BTreeMap;

use dsec_e2e::{host, require_root, sh, Server};
use dsec_wire::v1::*;

#[tokio::test(flavor = "multi_thread")]
async fn restart_readopts_20_live_sandboxes() {
    if !require_root() {
        return;
    }
    let seed = Server::shared("restart-seed");
    // Its own cgroup parent: the seed server beside it holds the default one.
    let mut s = Server::start_with("restart", true, &["--cgroup-parent", "dsec-restart"])
        .await
        .expect("server");
    s.ensure_base(Some(seed)).await.expect("base image");
    let c = s.client();
    let mut ids = Vec::new();
    for i in 0..20 {
        let sb = c
            .create_sandbox(CreateSandboxRequest::default())
            .await
            .expect("create");
        // A background process and a file: state that must survive the restart.
        let r = c
            .exec(
                &sb.id,
                sh(&format!(
                    "echo {i} > /root/n; (sleep 1000 &) ; echo started"
                )),
            )
            .await
            .expect("exec");
        assert_eq!(r.stdout, "started\n");
        ids.push(sb.id);
    }
    let sess = c
        .create_session(&ids[0], CreateSessionRequest::default())
        .await
        .expect("session");
    c.run_in_session(
        &ids[0],
        &sess.session,
        SessionRunRequest {
            command: "export KEEP=yes; cd /tmp".into(),
            timeout_s: None,
        },
    )
    .await
    .expect("session run");
    // One sandbox paused, one committed once: both must carry over the restart.
    c.pause_sandbox(&ids[1]).await.expect("pause");
    c.commit_sandbox(&ids[2], "e2e/restart-c1")
        .await
        .expect("commit before restart");
    let pids_before: Vec<Vec<i32>> = ids.iter().map(|id| host::processes(id)).collect();

    s.kill();
    // Sandboxes keep running while the server is down.
    for (id, before) in ids.iter().zip(&pids_before) {
        assert_eq!(
            &host::processes(id),
            before,
            "{id} changed while the server was down"
        );
    }
    s.spawn().await.expect("restart");
    let c = s.client();
    let listed = c.list_sandboxes(BTreeMap::new()).await.expect("list");
    assert_eq!(listed.sandboxes.len(), 20);
    // The paused one is still paused (its cgroup stayed frozen) and resumes.
    assert_eq!(
        c.get_sandbox(&ids[1]).await.expect("get").state,
        SandboxState::Paused
    );
    let e = c.exec(&ids[1], sh("true")).await.expect_err("paused");
    assert_eq!(e.code(), Some(dsec_wire::ErrorCode::Paused));
    c.resume_sandbox(&ids[1])
        .await
        .expect("resume after restart");
    for (i, id) in ids.iter().enumerate() {
        let sb = c.get_sandbox(id).await.expect("get");
        assert_eq!(sb.state, SandboxState::Ready, "{id}");
        let r = c
            .exec(id, sh("cat /root/n; pgrep -c sleep"))
            .await
            .expect("exec after restart");
        assert_eq!(r.stdout, format!("{i}\n1\n"), "{id}");
    }
    let r = c
        .run_in_session(
            &ids[0],
            &sess.session,
            SessionRunRequest {
                command: "echo $KEEP $(pwd)".into(),
                timeout_s: None,
            },
        )
        .await
        .expect("session after restart");
    assert_eq!(r.output, "yes /tmp\n");

    // A second commit after the restart: the node lost its disk handle and mounts the
    // sandbox's disk again; the commit is incremental over the first.
    c.exec(&ids[2], sh("echo after > /root/after"))
        .await
        .expect("exec");
    let img = c
        .commit_sandbox(&ids[2], "e2e/restart-c2")
        .await
        .expect("commit after restart");
    let first = c.list_images().await.expect("images").images;
    let c1 = first
        .iter()
        .find(|i| i.name == "e2e/restart-c1")
        .expect("first commit");
    assert_eq!(img.layers.len(), c1.layers.len() + 1);
    let from = c
        .create_sandbox(CreateSandboxRequest {
            image: Some("e2e/restart-c2".into()),
            ..Default::default()
        })
        .await
        .expect("create from commit");
    let r = c
        .exec(&from.id, sh("cat /root/n /root/after"))
        .await
        .expect("exec");
    assert_eq!(r.stdout, "2\nafter\n");
    c.delete_sandbox(&from.id).await.expect("delete");
    for name in ["e2e/restart-c2", "e2e/restart-c1"] {
        c.delete_image(name).await.expect("delete image");
    }
    for id in &ids {
        c.delete_sandbox(id).await.expect("delete");
        assert!(
            host::processes(id).is_empty() && host::cgroup_dirs(id).is_empty(),
            "{id} leaked"
        );
    }
}
