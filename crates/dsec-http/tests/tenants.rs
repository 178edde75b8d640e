//! Tenants over real HTTP: two API server replicas (real control planes, each with the
//! admin API, on one in-memory store and one fake node). Keys made with the admin API;
//! hand-written hostile requests of one tenant on another's sandbox (and on guessed ids)
//! through the `/v1`, E2B and SWE-ReX fronts all answer 404 `not_found` and change
//! nothing; scopes are enforced; a revocation made on one replica holds on the other
//! within a second.

use std::sync::Arc;
use std::time::{Duration, Instant};

use dsec_control::{ControlConfig, ControlPlane};
use dsec_node_api::fake::{shell_request, FakeNode};
use dsec_state::{MemStore, StateStore};
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};

const BOOT: &str = "bootstrap-admin-key";

struct Replica {
    url: String,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Replica {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct Cluster {
    r1: Replica,
    r2: Replica,
    node: Arc<FakeNode>,
    http: reqwest::Client,
}

async fn replica(store: Arc<dyn StateStore>, node: Arc<FakeNode>) -> Replica {
    let cfg = ControlConfig {
        sole_owner: false,
        ..ControlConfig::with_key(BOOT.into())
    };
    let plane = ControlPlane::open(cfg, node, store).await.expect("plane");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let admin = dsec_http::admin::admin_router(plane.iam().clone());
    let task = tokio::spawn(async move {
        let _ = dsec_http::serve_with(
            listener,
            plane,
            dsec_http::HttpOptions::default(),
            admin,
            std::future::pending(),
        )
        .await;
    });
    Replica { url, task }
}

async fn cluster() -> Cluster {
    let store: Arc<dyn StateStore> = Arc::new(MemStore::new());
    let node = Arc::new(FakeNode::new("fake-1"));
    Cluster {
        r1: replica(store.clone(), node.clone()).await,
        r2: replica(store, node.clone()).await,
        node,
        http: reqwest::Client::new(),
    }
}

impl Cluster {
    /// A call to `r` with `key`: the status and the JSON body (`null` if none).
    async fn call(
        &self,
        r: &Replica,
        key: &str,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> (StatusCode, Value) {
        let mut req = self
            .http
            .request(method, format!("{}{path}", r.url))
            .header("x-api-key", key);
        if let Some(b) = body {
            req = req.json(&b);
        }
        let resp = req.send().await.expect("send");
        let status = resp.status();
        let text = resp.text().await.expect("body");
        let v = if text.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).unwrap_or(Value::String(text))
        };
        (status, v)
    }

    /// A new key of `tenant` with `scopes`, made by the bootstrap admin on r1.
    async fn key(&self, tenant: &str, scopes: &[&str]) -> (String, String) {
        let (st, v) = self
            .call(
                &self.r1,
                BOOT,
                Method::POST,
                &format!("/v1/tenants/{tenant}/keys"),
                Some(json!({ "scopes": scopes })),
            )
            .await;
        assert_eq!(st, StatusCode::CREATED, "{v}");
        let key = v["key"].as_str().expect("key").to_string();
        let id = v["info"]["key_id"].as_str().expect("key_id").to_string();
        (key, id)
    }

    async fn tenant(&self, name: &str) {
        let (st, v) = self
            .call(
                &self.r1,
                BOOT,
                Method::POST,
                "/v1/tenants",
                // A quota, so that usage is counted (tenants without quotas are not
                // charged).
                Some(json!({ "name": name, "quotas": { "max_sandboxes": 1000 } })),
            )
            .await;
        assert_eq!(st, StatusCode::CREATED, "{v}");
    }
}

fn code(v: &Value) -> &str {
    v["error"]["code"].as_str().unwrap_or("<none>")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_cannot_see_or_touch_another_tenants_sandbox() {
    let c = cluster().await;
    c.tenant("alice").await;
    c.tenant("bob").await;
    let (alice, _) = c.key("alice", &["sandboxes"]).await;
    let (bob, _) = c.key("bob", &["sandboxes"]).await;
    let (st, sb) = c
        .call(
            &c.r1,
            &alice,
            Method::POST,
            "/v1/sandboxes",
            Some(json!({})),
        )
        .await;
    assert_eq!(st, StatusCode::CREATED, "{sb}");
    assert_eq!(sb["tenant"], "alice");
    let id = sb["id"].as_str().expect("id").to_string();
    let destroys = c
        .node
        .counters
        .destroys
        .load(std::sync::atomic::Ordering::Relaxed);
    let exec = serde_json::to_value(shell_request("touch /owned")).expect("json");
    for r in [&c.r1, &c.r2] {
        // Bob lists nothing, and his answers for alice's id are those of a guessed id.
        let (st, v) = c.call(r, &bob, Method::GET, "/v1/sandboxes", None).await;
        assert_eq!(st, StatusCode::OK);
        assert_eq!(v["sandboxes"], json!([]), "{v}");
        let (_, v) = c.call(r, &bob, Method::GET, "/e2b/sandboxes", None).await;
        assert_eq!(v, json!([]), "the E2B list is empty too");
        for target in [id.as_str(), "sb-guessed00000"] {
            let hostile: Vec<(Method, String, Option<Value>)> = vec![
                (Method::GET, format!("/v1/sandboxes/{target}"), None),
                (
                    Method::POST,
                    format!("/v1/sandboxes/{target}/exec"),
                    Some(exec.clone()),
                ),
                (
                    Method::POST,
                    format!("/v1/sandboxes/{target}/exec/stream"),
                    Some(exec.clone()),
                ),
                (
                    Method::GET,
                    format!("/v1/sandboxes/{target}/files?path=/etc/hostname"),
                    None,
                ),
                (
                    Method::GET,
                    format!("/v1/sandboxes/{target}/files/list?path=/"),
                    None,
                ),
                (
                    Method::DELETE,
                    format!("/v1/sandboxes/{target}/files?path=/etc/hostname"),
                    None,
                ),
                (
                    Method::GET,
                    format!("/v1/sandboxes/{target}/files/tar?path=/"),
                    None,
                ),
                (
                    Method::POST,
                    format!("/v1/sandboxes/{target}/sessions"),
                    Some(json!({})),
                ),
                (
                    Method::GET,
                    format!("/v1/sandboxes/{target}/processes"),
                    None,
                ),
                (Method::POST, format!("/v1/sandboxes/{target}/pause"), None),
                (
                    Method::POST,
                    format!("/v1/sandboxes/{target}/timeout"),
                    Some(json!({"timeout_s": 1})),
                ),
                (Method::DELETE, format!("/v1/sandboxes/{target}"), None),
            ];
            for (method, path, body) in hostile {
                let (st, v) = c.call(r, &bob, method.clone(), &path, body).await;
                assert_eq!(st, StatusCode::NOT_FOUND, "{method} {path}: {v}");
                assert_eq!(code(&v), "not_found", "{method} {path}: {v}");
                assert_eq!(
                    v["error"]["message"],
                    format!("sandbox {target} not found"),
                    "{method} {path}: the words of an unknown id"
                );
            }
        }
        // The E2B and SWE-ReX fronts answer in their own shapes: alice's id gets exactly
        // what a guessed id gets, and never success.
        let fronts = |target: &str| {
            vec![
                (Method::GET, format!("/e2b/sandboxes/{target}"), None),
                (Method::DELETE, format!("/e2b/sandboxes/{target}"), None),
                (Method::POST, format!("/e2b/sandboxes/{target}/pause"), None),
                (
                    Method::POST,
                    format!("/swerex/{target}/execute"),
                    Some(json!({"command": "touch /owned", "shell": true})),
                ),
                (
                    Method::POST,
                    format!("/swerex/{target}/read_file"),
                    Some(json!({"path": "/etc/hostname"})),
                ),
            ]
        };
        for (owned, guessed) in fronts(&id).into_iter().zip(fronts("sb-guessed00000")) {
            let (method, path, body) = owned;
            let (st, v) = c.call(r, &bob, method.clone(), &path, body).await;
            let (gst, gv) = c.call(r, &bob, guessed.0, &guessed.1, guessed.2).await;
            assert!(!st.is_success(), "{method} {path}: {v}");
            assert_eq!(st, gst, "{method} {path}: as for a guessed id");
            assert_eq!(
                v.to_string().replace(&id, "ID"),
                gv.to_string().replace("sb-guessed00000", "ID"),
                "{method} {path}"
            );
        }
        // Bob's key is not an admin's.
        let (st, v) = c.call(r, &bob, Method::GET, "/v1/tenants", None).await;
        assert_eq!(st, StatusCode::FORBIDDEN, "{v}");
        let (st, _) = c
            .call(r, &bob, Method::GET, "/v1/tenants/alice/keys", None)
            .await;
        assert_eq!(st, StatusCode::FORBIDDEN);
    }
    // Alice's sandbox is as it was.
    let (st, after) = c
        .call(
            &c.r2,
            &alice,
            Method::GET,
            &format!("/v1/sandboxes/{id}"),
            None,
        )
        .await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(after["state"], "ready");
    assert_eq!(after["expires_at"], sb["expires_at"]);
    assert!(c.node.sandbox_ids().contains(&id));
    assert_eq!(
        c.node
            .counters
            .destroys
            .load(std::sync::atomic::Ordering::Relaxed),
        destroys
    );
    let (st, v) = c
        .call(
            &c.r1,
            &alice,
            Method::GET,
            &format!("/v1/sandboxes/{id}/files?path=/owned"),
            None,
        )
        .await;
    assert_eq!(st, StatusCode::NOT_FOUND, "bob's exec wrote nothing: {v}");
    // Scopes: a read-only key of alice reads but does not change.
    let (reader, _) = c.key("alice", &["read"]).await;
    let (st, _) = c
        .call(
            &c.r2,
            &reader,
            Method::GET,
            &format!("/v1/sandboxes/{id}"),
            None,
        )
        .await;
    assert_eq!(st, StatusCode::OK);
    for (method, path) in [
        (Method::POST, "/v1/sandboxes".to_string()),
        (Method::DELETE, format!("/v1/sandboxes/{id}")),
        (Method::POST, "/v1/images/gc".to_string()),
    ] {
        let (st, v) = c
            .call(&c.r2, &reader, method.clone(), &path, Some(json!({})))
            .await;
        assert_eq!(st, StatusCode::FORBIDDEN, "{method} {path}: {v}");
        assert_eq!(code(&v), "forbidden");
    }
    // Nodes are the operator's.
    let (st, _) = c.call(&c.r1, &alice, Method::GET, "/v1/nodes", None).await;
    assert_eq!(st, StatusCode::FORBIDDEN);
    let (st, _) = c.call(&c.r1, BOOT, Method::GET, "/v1/nodes", None).await;
    assert_eq!(st, StatusCode::OK);
    // The usage the admin sees; delete gives it back.
    let (_, usage) = c
        .call(&c.r2, BOOT, Method::GET, "/v1/tenants/alice/usage", None)
        .await;
    assert_eq!(usage["sandboxes"], 1, "{usage}");
    let (st, _) = c
        .call(
            &c.r2,
            &alice,
            Method::DELETE,
            &format!("/v1/sandboxes/{id}"),
            None,
        )
        .await;
    assert_eq!(st, StatusCode::NO_CONTENT);
    let (_, usage) = c
        .call(&c.r1, BOOT, Method::GET, "/v1/tenants/alice/usage", None)
        .await;
    assert_eq!(usage["sandboxes"], 0, "{usage}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_revoked_on_one_replica_stops_working_on_the_other_within_a_second() {
    let c = cluster().await;
    c.tenant("carol").await;
    let (key, key_id) = c.key("carol", &["sandboxes"]).await;
    // Made on r1, usable on r2 as soon as its watch delivers it.
    let start = Instant::now();
    loop {
        let (st, _) = c
            .call(&c.r2, &key, Method::GET, "/v1/sandboxes", None)
            .await;
        if st == StatusCode::OK {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(1), "new key on r2");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (st, v) = c
        .call(
            &c.r1,
            BOOT,
            Method::DELETE,
            &format!("/v1/keys/{key_id}"),
            None,
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let revoked = Instant::now();
    loop {
        let (st, v) = c
            .call(&c.r2, &key, Method::GET, "/v1/sandboxes", None)
            .await;
        if st == StatusCode::UNAUTHORIZED {
            assert_eq!(code(&v), "unauthorized");
            break;
        }
        assert!(
            revoked.elapsed() < Duration::from_secs(1),
            "the revocation reaches r2 within 1 s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Every front refuses it.
    for path in ["/v1/sandboxes", "/e2b/sandboxes"] {
        let (st, _) = c.call(&c.r1, &key, Method::GET, path, None).await;
        assert_eq!(st, StatusCode::UNAUTHORIZED, "{path}");
    }
}
