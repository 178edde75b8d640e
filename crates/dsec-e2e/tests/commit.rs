//! Commits with nothing changed (issue #31, defect 7): an empty diff adds no layer, so
//! repeated commits never stack one layer twice (overlayfs refuses a stack naming one
//! lower directory twice with ELOOP), and a stack naming a layer twice is de-duplicated.

use std::collections::HashSet;

use dsec_e2e::{require_root, sh, Server};
use dsec_wire::v1::*;

fn no_duplicates(img: &Image) {
    let unique: HashSet<&String> = img.layers.iter().collect();
    assert_eq!(unique.len(), img.layers.len(), "a layer twice: {img:?}");
}

async fn run(c: &dsec_client::Client, id: &str, cmd: &str) -> String {
    let r = c.exec(id, sh(cmd)).await.expect("exec");
    assert_eq!(r.exit.exit_code, Some(0), "{cmd}: {r:?}");
    r.stdout
}

#[tokio::test(flavor = "multi_thread")]
async fn empty_commits_add_no_layer_and_later_commits_still_work() {
    if !require_root() {
        return;
    }
    let s = Server::start_with("commit", true, &["--cgroup-parent", "dsec-liveness-commit"])
        .await
        .expect("server");
    s.ensure_base(None).await.expect("base");
    let c = s.client();
    let base = c
        .list_images()
        .await
        .expect("images")
        .images
        .into_iter()
        .find(|i| i.name == "base")
        .expect("base image");
    let a = c
        .create_sandbox(CreateSandboxRequest::default())
        .await
        .expect("create");
    run(&c, &a.id, "mkdir -p /work && echo one > /work/f").await;

    let c1 = c.commit_sandbox(&a.id, "e2e/empty-c1").await.expect("c1");
    assert_eq!(c1.layers.len(), base.layers.len() + 1, "{c1:?}");
    // Nothing changed: the same layers, no new one, however often.
    for name in ["e2e/empty-c2", "e2e/empty-c3", "e2e/empty-c4"] {
        let img = c.commit_sandbox(&a.id, name).await.expect(name);
        assert_eq!(img.layers, c1.layers, "{name} added a layer");
    }
    let rec = c.get_sandbox(&a.id).await.expect("get");
    assert_eq!(rec.committed_layers.len(), 1, "{rec:?}");
    assert_eq!(rec.state, SandboxState::Ready);

    // A change after empty commits: one more layer, holding only the change.
    run(&c, &a.id, "echo two > /work/g && rm /work/f").await;
    let c5 = c.commit_sandbox(&a.id, "e2e/empty-c5").await.expect("c5");
    assert_eq!(c5.layers.len(), c1.layers.len() + 1, "{c5:?}");
    assert_eq!(&c5.layers[..c1.layers.len()], &c1.layers[..]);
    no_duplicates(&c5);
    let c6 = c.commit_sandbox(&a.id, "e2e/empty-c6").await.expect("c6");
    assert_eq!(c6.layers, c5.layers);

    // A sandbox of a committed image, committed again (empty, then with a change).
    let b = c
        .create_sandbox(CreateSandboxRequest {
            image: Some("e2e/empty-c6".into()),
            ..Default::default()
        })
        .await
        .expect("create from commit");
    assert_eq!(
        run(&c, &b.id, "cat /work/g; test -e /work/f || echo gone").await,
        "two\ngone\n"
    );
    let b1 = c.commit_sandbox(&b.id, "e2e/empty-b1").await.expect("b1");
    no_duplicates(&b1);
    for name in ["e2e/empty-b2", "e2e/empty-b3"] {
        let img = c.commit_sandbox(&b.id, name).await.expect(name);
        assert_eq!(img.layers, b1.layers, "{name}");
    }
    run(&c, &b.id, "echo three > /work/h").await;
    let b4 = c.commit_sandbox(&b.id, "e2e/empty-b4").await.expect("b4");
    assert_eq!(b4.layers.len(), b1.layers.len() + 1);
    no_duplicates(&b4);
    let d = c
        .create_sandbox(CreateSandboxRequest {
            image: Some("e2e/empty-b4".into()),
            ..Default::default()
        })
        .await
        .expect("create from b4");
    assert_eq!(run(&c, &d.id, "cat /work/g /work/h").await, "two\nthree\n");

    // `layers` naming the same image twice, or images sharing layers: one stack, each
    // layer at its topmost place.
    let e = c
        .create_sandbox(CreateSandboxRequest {
            image: Some("e2e/empty-c1".into()),
            layers: vec!["e2e/empty-c5".into(), "e2e/empty-c5".into()],
            ..Default::default()
        })
        .await
        .expect("create with a layer named twice");
    assert_eq!(
        run(&c, &e.id, "cat /work/g; test -e /work/f || echo gone").await,
        "two\ngone\n"
    );
    let e1 = c.commit_sandbox(&e.id, "e2e/empty-e1").await.expect("e1");
    no_duplicates(&e1);
    c.commit_sandbox(&e.id, "e2e/empty-e2").await.expect("e2");

    // A commit stops a running sandbox's processes only for the copy: a counter runs on
    // after it. A paused sandbox stays paused through a commit, and resumes as before.
    c.start_process(
        &e.id,
        dsec_e2e::background(Command::Argv(vec![
            "sh".into(),
            "-c".into(),
            "i=0; while :; do i=$((i+1)); echo $i > /tmp/n.t; mv /tmp/n.t /tmp/n; sleep 0.01; done"
                .into(),
        ])),
    )
    .await
    .expect("counter");
    let count = |c: &dsec_client::Client, id: String| {
        let c = c.clone();
        async move {
            let out = run(&c, &id, "sleep 0.2; cat /tmp/n").await;
            out.trim().parse::<u64>().expect("a count")
        }
    };
    let before = count(&c, e.id.clone()).await;
    c.commit_sandbox(&e.id, "e2e/empty-e3").await.expect("e3");
    assert_eq!(
        c.get_sandbox(&e.id).await.expect("get").state,
        SandboxState::Ready
    );
    let after = count(&c, e.id.clone()).await;
    assert!(after > before, "the counter stopped: {before} then {after}");
    c.pause_sandbox(&e.id).await.expect("pause");
    c.commit_sandbox(&e.id, "e2e/empty-e4")
        .await
        .expect("e4 of a paused sandbox");
    assert_eq!(
        c.get_sandbox(&e.id).await.expect("get").state,
        SandboxState::Paused
    );
    c.resume_sandbox(&e.id).await.expect("resume");
    let resumed = count(&c, e.id.clone()).await;
    assert!(
        resumed > after,
        "the counter stopped: {after} then {resumed}"
    );
    for id in [&a.id, &b.id, &d.id, &e.id] {
        c.delete_sandbox(id).await.expect("delete");
    }
}
