//! Tenants on a real `dsec serve`: its API key is the bootstrap admin, `dsec tenant` and
//! `dsec key` (the CLI) make a tenant with a quota and a key, the key works for its own
//! sandboxes only, the quota holds, and the operator's key does not see the tenant's
//! sandbox (tenants are isolated from `default` too).

use dsec_client::Client;
use dsec_e2e::{require_root, sh, Server};
use dsec_wire::v1::{CreateSandboxRequest, SandboxState};
use dsec_wire::ErrorCode;

/// Runs the CLI against `s` with the bootstrap key; its stdout, failing on an error.
fn cli(s: &Server, args: &[&str]) -> String {
    let (code, stdout, stderr) = dsec_e2e::run_cli(&s.url, &s.key, args);
    assert_eq!(code, Some(0), "dsec {args:?}: {stderr}");
    stdout
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tenant_made_with_the_cli_gets_its_own_sandboxes_and_quota() {
    if !require_root() {
        return;
    }
    let s = Server::start("tenants", true).await.expect("server");
    s.ensure_base(None).await.expect("base image");
    cli(&s, &["tenant", "create", "team-a", "--max-sandboxes", "1"]);
    let made = cli(
        &s,
        &["--json", "key", "create", "team-a", "--scope", "sandboxes"],
    );
    let made: serde_json::Value = serde_json::from_str(&made).expect("key json");
    let key = made["key"].as_str().expect("key").to_string();
    let team = Client::new(&s.url, Some(key)).expect("client");
    let op = s.client();

    let sb = team
        .create_sandbox(CreateSandboxRequest::default())
        .await
        .expect("create");
    assert_eq!(sb.tenant, "team-a");
    let ran = team.exec(&sb.id, sh("echo hi")).await.expect("exec");
    assert_eq!(ran.stdout, "hi\n");
    let e = team
        .create_sandbox(CreateSandboxRequest::default())
        .await
        .expect_err("over the quota");
    assert_eq!(e.code(), Some(ErrorCode::QuotaExceeded), "{e}");
    let listed = team.list_sandboxes(Default::default()).await.expect("ls");
    assert_eq!(listed.sandboxes.len(), 1, "the refused create left nothing");

    // The operator's key acts for `default`: team-a's sandbox is not its to see.
    let e = op.get_sandbox(&sb.id).await.expect_err("another tenant's");
    assert_eq!(e.code(), Some(ErrorCode::NotFound));
    let e = op
        .delete_sandbox(&sb.id)
        .await
        .expect_err("another tenant's");
    assert_eq!(e.code(), Some(ErrorCode::NotFound));
    let mine = op.list_sandboxes(Default::default()).await.expect("ls");
    assert!(mine.sandboxes.iter().all(|x| x.id != sb.id));
    assert_eq!(
        team.get_sandbox(&sb.id).await.expect("get").state,
        SandboxState::Ready
    );

    team.delete_sandbox(&sb.id).await.expect("delete");
    let shown: serde_json::Value =
        serde_json::from_str(&cli(&s, &["--json", "tenant", "get", "team-a"])).expect("json");
    assert_eq!(shown["usage"]["sandboxes"], 0, "{shown}");
    // Room again.
    let again = team
        .create_sandbox(CreateSandboxRequest::default())
        .await
        .expect("create after the delete");
    team.delete_sandbox(&again.id).await.expect("delete");
}
