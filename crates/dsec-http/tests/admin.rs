//! The admin API of tenants and keys over real HTTP, on an in-memory store.

use std::sync::Arc;

use dsec_iam::{Iam, KeyInfo, NewKey, Tenant, Usage};
use dsec_state::MemStore;
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};

const BOOT: &str = "bootstrap-admin-key";

struct Server {
    url: String,
    http: reqwest::Client,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn server() -> Server {
    let iam = Arc::new(
        Iam::new(Arc::new(MemStore::new()), Some(BOOT.into()))
            .await
            .expect("iam"),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let app = dsec_http::admin::admin_router(iam);
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Server {
        url,
        http: reqwest::Client::new(),
        task,
    }
}

impl Server {
    /// A call with `key`; the status and the JSON body (`null` if none).
    async fn call(
        &self,
        key: &str,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> (StatusCode, Value) {
        let mut req = self
            .http
            .request(method, format!("{}{path}", self.url))
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
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
        };
        (status, v)
    }
}

fn code(v: &Value) -> &str {
    v["error"]["code"].as_str().unwrap_or("<none>")
}

#[tokio::test]
async fn tenants_and_keys_over_http() {
    let s = server().await;
    // Unauthenticated.
    let (st, v) = s.call("", Method::GET, "/v1/tenants", None).await;
    assert_eq!((st, code(&v)), (StatusCode::UNAUTHORIZED, "unauthorized"));
    let (st, _) = s.call("wrong", Method::GET, "/v1/tenants", None).await;
    assert_eq!(st, StatusCode::UNAUTHORIZED);

    // The bootstrap key is the cluster admin.
    let body = json!({"name": "acme", "quotas": {"max_sandboxes": 3}});
    let (st, v) = s
        .call(BOOT, Method::POST, "/v1/tenants", Some(body.clone()))
        .await;
    assert_eq!(st, StatusCode::CREATED, "{v}");
    let t: Tenant = serde_json::from_value(v).expect("tenant");
    assert_eq!((t.name.as_str(), t.quotas.max_sandboxes), ("acme", Some(3)));
    let (st, v) = s.call(BOOT, Method::POST, "/v1/tenants", Some(body)).await;
    assert_eq!((st, code(&v)), (StatusCode::CONFLICT, "conflict"));
    for bad in [
        json!({"name": "Bad_Name"}),
        json!({"name": "ok", "extra": 1}),
        json!({"name": "ok", "quotas": {"creates_burst": 2}}),
    ] {
        let (st, v) = s
            .call(BOOT, Method::POST, "/v1/tenants", Some(bad.clone()))
            .await;
        assert_eq!(
            (st, code(&v)),
            (StatusCode::BAD_REQUEST, "bad_request"),
            "{bad}"
        );
    }
    let (st, v) = s.call(BOOT, Method::GET, "/v1/tenants", None).await;
    assert_eq!(st, StatusCode::OK);
    let names: Vec<String> = serde_json::from_value::<Vec<Tenant>>(v)
        .expect("tenants")
        .into_iter()
        .map(|t| t.name)
        .collect();
    assert_eq!(names, ["acme", "default"]);
    let (st, v) = s.call(BOOT, Method::GET, "/v1/tenants/nope", None).await;
    assert_eq!((st, code(&v)), (StatusCode::NOT_FOUND, "not_found"));

    // A tenant admin key, shown once.
    let (st, v) = s
        .call(
            BOOT,
            Method::POST,
            "/v1/tenants/acme/keys",
            Some(json!({"name": "ops", "scopes": ["admin"]})),
        )
        .await;
    assert_eq!(st, StatusCode::CREATED, "{v}");
    let admin: NewKey = serde_json::from_value(v).expect("key");
    let (st, v) = s
        .call(
            &admin.key,
            Method::POST,
            "/v1/tenants/acme/keys",
            Some(json!({"scopes": ["sandboxes"]})),
        )
        .await;
    assert_eq!(st, StatusCode::CREATED, "{v}");
    let user: NewKey = serde_json::from_value(v).expect("key");
    let (st, v) = s
        .call(
            &admin.key,
            Method::POST,
            "/v1/tenants/acme/keys",
            Some(json!({"scopes": ["root"]})),
        )
        .await;
    assert_eq!((st, code(&v)), (StatusCode::BAD_REQUEST, "bad_request"));

    // The tenant admin manages its own keys only; others' look absent.
    let (st, v) = s
        .call(&admin.key, Method::GET, "/v1/tenants/acme/keys", None)
        .await;
    assert_eq!(st, StatusCode::OK);
    let text = v.to_string();
    assert!(!text.contains(&admin.key) && !text.contains(&user.key) && !text.contains("sha256"));
    assert_eq!(
        serde_json::from_value::<Vec<KeyInfo>>(v)
            .expect("keys")
            .len(),
        2
    );
    let (st, v) = s
        .call(&admin.key, Method::GET, "/v1/tenants/default/keys", None)
        .await;
    assert_eq!((st, code(&v)), (StatusCode::NOT_FOUND, "not_found"));
    let (st, v) = s.call(&admin.key, Method::GET, "/v1/tenants", None).await;
    assert_eq!((st, code(&v)), (StatusCode::FORBIDDEN, "forbidden"));
    let (st, _) = s
        .call(
            &admin.key,
            Method::PATCH,
            "/v1/tenants/acme",
            Some(json!({"quotas": {}})),
        )
        .await;
    assert_eq!(
        st,
        StatusCode::FORBIDDEN,
        "a tenant admin does not set its own quotas"
    );
    // A key without the admin scope.
    let (st, v) = s
        .call(&user.key, Method::GET, "/v1/tenants/acme/keys", None)
        .await;
    assert_eq!((st, code(&v)), (StatusCode::FORBIDDEN, "forbidden"));

    // Usage starts at zero.
    let (st, v) = s
        .call(&admin.key, Method::GET, "/v1/tenants/acme/usage", None)
        .await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(
        serde_json::from_value::<Usage>(v).expect("usage"),
        Usage::default()
    );

    // Rotate (no grace): the old key stops, the new one works.
    let path = format!("/v1/keys/{}/rotate?grace_s=0", user.info.key_id);
    let (st, v) = s.call(&admin.key, Method::POST, &path, None).await;
    assert_eq!(st, StatusCode::CREATED, "{v}");
    let rotated: NewKey = serde_json::from_value(v).expect("key");
    assert_eq!(rotated.info.scopes, user.info.scopes);
    let (st, v) = s.call(&admin.key, Method::POST, &path, None).await;
    assert_eq!(
        (st, code(&v)),
        (StatusCode::CONFLICT, "conflict"),
        "rotating a revoked key"
    );
    let (st, v) = s
        .call(
            &admin.key,
            Method::POST,
            &format!("/v1/keys/{}/rotate?grace_s=x", rotated.info.key_id),
            None,
        )
        .await;
    assert_eq!((st, code(&v)), (StatusCode::BAD_REQUEST, "bad_request"));

    // Revoke: the tenant admin cannot see the cluster's keys; unknown keys are not found.
    let (st, v) = s
        .call(
            BOOT,
            Method::POST,
            "/v1/tenants/default/keys",
            Some(json!({"scopes": ["read"]})),
        )
        .await;
    assert_eq!(st, StatusCode::CREATED);
    let ops: NewKey = serde_json::from_value(v).expect("key");
    for id in [ops.info.key_id.as_str(), "aaaaaaaaaaaa", "not-a-key"] {
        let (st, v) = s
            .call(&admin.key, Method::DELETE, &format!("/v1/keys/{id}"), None)
            .await;
        assert_eq!((st, code(&v)), (StatusCode::NOT_FOUND, "not_found"), "{id}");
    }
    let (st, v) = s
        .call(
            &admin.key,
            Method::DELETE,
            &format!("/v1/keys/{}", rotated.info.key_id),
            None,
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert!(serde_json::from_value::<KeyInfo>(v)
        .expect("key")
        .revoked_at
        .is_some());
    let (st, v) = s
        .call(
            &admin.key,
            Method::GET,
            &format!("/v1/keys/{}", rotated.info.key_id),
            None,
        )
        .await;
    assert_eq!(st, StatusCode::OK);
    assert!(v["revoked_at"].is_u64());

    // Disabling the tenant: its admin key is refused with forbidden.
    let (st, v) = s
        .call(
            BOOT,
            Method::PATCH,
            "/v1/tenants/acme",
            Some(json!({"disabled": true, "quotas": {"max_sandboxes": 1}})),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["disabled"], json!(true));
    assert_eq!(v["quotas"]["max_sandboxes"], json!(1));
    let (st, v) = s
        .call(&admin.key, Method::GET, "/v1/tenants/acme/keys", None)
        .await;
    assert_eq!((st, code(&v)), (StatusCode::FORBIDDEN, "forbidden"));
    let (st, v) = s
        .call(
            BOOT,
            Method::PATCH,
            "/v1/tenants/ghost",
            Some(json!({"disabled": true})),
        )
        .await;
    assert_eq!((st, code(&v)), (StatusCode::NOT_FOUND, "not_found"));
}
