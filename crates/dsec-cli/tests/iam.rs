//! `dsec tenant` and `dsec key` against the admin API served over real HTTP (an in-memory
//! store behind it).

use std::sync::Arc;

use dsec_iam::Iam;
use dsec_state::MemStore;
use serde_json::Value;

const BOOT: &str = "cli-bootstrap-key";

struct Out {
    ok: bool,
    stdout: String,
    stderr: String,
}

async fn dsec(url: &str, args: &[&str]) -> Out {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_dsec"));
    cmd.args(["--url", url, "--api-key", BOOT])
        .args(args)
        .env_remove("DSEC_API_KEY");
    let out = tokio::task::spawn_blocking(move || cmd.output())
        .await
        .expect("task")
        .expect("run dsec");
    Out {
        ok: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

async fn json(url: &str, args: &[&str]) -> Value {
    let mut a = args.to_vec();
    a.push("--json");
    let out = dsec(url, &a).await;
    assert!(out.ok, "dsec {args:?}: {}", out.stderr);
    serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", out.stdout))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_and_key_commands() {
    let iam = Iam::new(Arc::new(MemStore::new()), Some(BOOT.into()))
        .await
        .expect("iam");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let app = dsec_http::admin::admin_router(Arc::new(iam));
    let server = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });

    let t = json(
        &url,
        &[
            "tenant",
            "create",
            "acme",
            "--max-sandboxes",
            "3",
            "--max-cpus",
            "1.5",
        ],
    )
    .await;
    assert_eq!(t["quotas"]["max_sandboxes"], 3);
    assert_eq!(t["quotas"]["max_cpu_millis"], 1500);
    let bad = dsec(&url, &["tenant", "create", "Bad_Name"]).await;
    assert!(
        !bad.ok && bad.stderr.contains("invalid tenant name"),
        "{}",
        bad.stderr
    );
    let ls = dsec(&url, &["tenant", "ls"]).await;
    assert!(
        ls.ok && ls.stdout.contains("acme") && ls.stdout.contains("default"),
        "{}",
        ls.stdout
    );

    // The secret goes to stdout alone, once.
    let created = dsec(
        &url,
        &[
            "key",
            "create",
            "acme",
            "--scope",
            "sandboxes",
            "--name",
            "ci",
        ],
    )
    .await;
    assert!(created.ok, "{}", created.stderr);
    let key = created.stdout.trim().to_string();
    assert!(key.starts_with("dsec_"), "{key}");
    let keys = json(&url, &["key", "ls", "acme"]).await;
    assert_eq!(keys.as_array().map(Vec::len), Some(1));
    assert!(!keys.to_string().contains(&key));
    let id = keys[0]["key_id"].as_str().expect("id").to_string();
    assert!(key.starts_with(&format!("dsec_{id}_")));
    let bad = dsec(&url, &["key", "create", "acme", "--scope", "root"]).await;
    assert!(
        !bad.ok && bad.stderr.contains("unknown scope"),
        "{}",
        bad.stderr
    );

    let rotated = json(&url, &["key", "rotate", &id, "--grace", "10m"]).await;
    let new_id = rotated["info"]["key_id"].as_str().expect("id").to_string();
    assert_ne!(new_id, id);
    let table = dsec(&url, &["key", "ls", "acme"]).await;
    assert!(table.stdout.contains("ends in"), "{}", table.stdout);
    let revoked = dsec(&url, &["key", "revoke", &new_id]).await;
    assert!(
        revoked.ok && revoked.stdout.contains("revoked"),
        "{}",
        revoked.stderr
    );
    let unknown = dsec(&url, &["key", "revoke", "aaaaaaaaaaaa"]).await;
    assert!(
        !unknown.ok && unknown.stderr.contains("no API key"),
        "{}",
        unknown.stderr
    );

    let t = json(&url, &["tenant", "disable", "acme"]).await;
    assert_eq!(t["disabled"], true);
    let t = json(
        &url,
        &["tenant", "set-quotas", "acme", "--creates-per-second", "5"],
    )
    .await;
    assert_eq!(t["quotas"]["creates_per_second"], 5);
    assert_eq!(
        t["quotas"]["max_sandboxes"],
        Value::Null,
        "set-quotas replaces all"
    );
    let got = dsec(&url, &["tenant", "get", "acme"]).await;
    assert!(
        got.ok && got.stdout.contains("disabled") && got.stdout.contains("usage"),
        "{}",
        got.stdout
    );
    server.abort();
}
