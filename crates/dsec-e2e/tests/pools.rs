//! Warm pools on a real `dsec serve`: made with the CLI, claimed through the API (the
//! claimed sandbox runs commands in the pool's environment), refilled, shown in
//! `/metrics`, refused when bad, and deleted with their warm sandboxes.

use std::time::{Duration, Instant};

use dsec_e2e::{require_root, sh, wait_until, Server};
use dsec_wire::v1::*;
use dsec_wire::ErrorCode;

fn server() -> &'static Server {
    Server::shared("pools")
}

fn dsec(args: &[&str]) -> (Option<i32>, String, String) {
    let s = server();
    dsec_e2e::run_cli(&s.url, &s.key, args)
}

async fn metrics(s: &Server) -> String {
    reqwest::Client::new()
        .get(format!("{}/metrics", s.url))
        .header("x-api-key", &s.key)
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("metrics body")
}

async fn ready(c: &dsec_client::Client, name: &str, n: u32) -> Pool {
    wait_until(Duration::from_secs(60), || async {
        let p = c.get_pool(name).await.ok()?;
        (p.ready == n).then_some(p)
    })
    .await
    .unwrap_or_else(|| panic!("pool {name} never had {n} warm sandboxes"))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_pool_made_with_the_cli_serves_claims_in_its_environment() {
    if !require_root() {
        return;
    }
    let s = server();
    let c = s.client();
    let (code, out, err) = dsec(&[
        "pool",
        "create",
        "py",
        "--min",
        "2",
        "--max",
        "4",
        "--env",
        "FROM_POOL=yes",
        "--workdir",
        "/tmp",
        "--memory-mb",
        "256",
    ]);
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(out.contains("pool py"), "{out}");
    let p = ready(&c, "py", 2).await;
    assert_eq!((p.target, p.size), (2, 2), "{p:?}");
    let warm: Vec<String> = c
        .list_sandboxes([(POOL_LABEL.to_string(), "py".to_string())].into())
        .await
        .expect("list")
        .sandboxes
        .into_iter()
        .map(|s| s.id)
        .collect();
    assert_eq!(warm.len(), 2);

    // A claim answers with one of the warm sandboxes, at once.
    let started = Instant::now();
    let sb = c
        .create_sandbox(CreateSandboxRequest {
            pool: Some("py".into()),
            labels: [("task".to_string(), "1".to_string())].into(),
            timeout_s: Some(600),
            ..Default::default()
        })
        .await
        .expect("claim");
    let took = started.elapsed();
    assert!(warm.contains(&sb.id), "{} is not one of {warm:?}", sb.id);
    assert_eq!(
        sb.labels.get(POOL_ORIGIN_LABEL).map(String::as_str),
        Some("py")
    );
    assert_eq!(sb.labels.get(POOL_LABEL), None);
    assert_eq!(sb.resources.memory_mb, 256);
    eprintln!("claim took {took:?}");
    let r = c
        .exec(&sb.id, sh("echo $FROM_POOL $(pwd)"))
        .await
        .expect("exec");
    assert_eq!(r.stdout, "yes /tmp\n", "{r:?}");

    // The CLI claims too, and the pool refills behind both.
    let (code, out, err) = dsec(&["sandbox", "create", "--pool", "py", "--label", "task=2"]);
    assert_eq!(code, Some(0), "{out}{err}");
    let second = out.trim().to_string();
    assert!(second.starts_with("sb-"), "{out}");
    let p = ready(&c, "py", 2).await;
    assert_eq!(p.claimed, 2, "{p:?}");

    let text = metrics(s).await;
    assert!(
        text.contains("dsec_pool_ready{tenant=\"default\",pool=\"py\"} 2"),
        "{text}"
    );
    assert!(text.contains("dsec_pool_autoscaler_stale{tenant=\"default\",pool=\"py\"} 0"));

    let (code, out, _) = dsec(&["pool", "ls"]);
    assert_eq!(code, Some(0));
    assert!(out.lines().any(|l| l.starts_with("py ")), "{out}");

    // Deleting the pool deletes its warm sandboxes; claimed ones stay.
    let (code, out, err) = dsec(&["pool", "rm", "py"]);
    assert_eq!(code, Some(0), "{out}{err}");
    let left = c
        .list_sandboxes([(POOL_LABEL.to_string(), "py".to_string())].into())
        .await
        .expect("list")
        .sandboxes;
    assert!(left.is_empty(), "{left:?}");
    for id in [&sb.id, &second] {
        let r = c
            .exec(id, sh("true"))
            .await
            .expect("claimed ones still run");
        assert_eq!(r.exit.exit_code, Some(0));
        c.delete_sandbox(id).await.expect("delete");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_pools_and_claims_are_refused() {
    if !require_root() {
        return;
    }
    let s = server();
    let c = s.client();
    let (code, _, err) = dsec(&["pool", "create", "bad", "--min", "3", "--max", "1"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("min (3) is larger than max (1)"), "{err}");
    let e = c
        .create_sandbox(CreateSandboxRequest {
            pool: Some("nope".into()),
            ..Default::default()
        })
        .await
        .expect_err("refused");
    assert_eq!(e.code(), Some(ErrorCode::NotFound), "{e}");
    // A pool whose image does not exist: claims wait, then get `capacity`, and the pool
    // says why.
    let spec = PoolSpec {
        name: "missing".into(),
        template: CreateSandboxRequest {
            image: Some("no-such-image".into()),
            ..Default::default()
        },
        min: 1,
        max: 2,
        autoscale: AutoscalePolicy::default(),
        fncall: None,
    };
    c.create_pool(&spec).await.expect("create");
    let e = c
        .create_sandbox(CreateSandboxRequest {
            pool: Some("missing".into()),
            queue: Some(QueueOptions {
                max_wait_s: Some(0.5),
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .expect_err("refused");
    assert_eq!(e.code(), Some(ErrorCode::Capacity), "{e}");
    let p = c.get_pool("missing").await.expect("get");
    assert!(
        p.last_error
            .as_deref()
            .unwrap_or("")
            .contains("no-such-image"),
        "{p:?}"
    );
    c.delete_pool("missing").await.expect("delete");
}
