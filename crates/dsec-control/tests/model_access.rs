//! `model_access` on create over a `FakeNode`: each sandbox gets a model gateway token of
//! its own in its environment, stored with its record and deleted with it; bad requests
//! are refused before anything is made.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::op;
use dsec_control::{ControlConfig, ControlPlane, ModelGatewayLink, SandboxApi};
use dsec_node_api::fake::FakeNode;
use dsec_state::RedbStore;
use dsec_wire::v1::{
    CreateSandboxRequest, ForkRequest, ModelAccess, OPENAI_API_KEY_ENV, OPENAI_BASE_URL_ENV,
};
use dsec_wire::ErrorCode;

type TestResult = Result<(), Box<dyn std::error::Error>>;

const URL: &str = "http://169.254.169.250/v1";

struct Fixture {
    node: Arc<FakeNode>,
    plane: Arc<ControlPlane>,
    _dir: tempfile::TempDir,
}

async fn fixture(gateway: Option<ModelGatewayLink>) -> Fixture {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = Arc::new(RedbStore::open(&dir.path().join("state.redb")).expect("store"));
    let node = Arc::new(FakeNode::new("fake-1"));
    let mut cfg = ControlConfig::with_key("k".into());
    cfg.reap_interval = Duration::from_millis(50);
    cfg.model_gateway = gateway;
    let plane = ControlPlane::open(cfg, node.clone(), store)
        .await
        .unwrap_or_else(|e| panic!("open the plane: {e:?}"));
    Fixture {
        node,
        plane,
        _dir: dir,
    }
}

fn gateway() -> Option<ModelGatewayLink> {
    Some(ModelGatewayLink {
        base_url: URL.into(),
        models: vec!["policy".into(), "judge".into()],
    })
}

fn with_access(models: &[&str]) -> CreateSandboxRequest {
    CreateSandboxRequest {
        model_access: Some(ModelAccess {
            models: models.iter().map(|m| m.to_string()).collect(),
            budget_tokens: Some(10_000),
            ..ModelAccess::default()
        }),
        ..CreateSandboxRequest::default()
    }
}

/// Waits until the plane's IAM no longer accepts `token` (it follows the store by watch).
async fn refused_soon(plane: &ControlPlane, token: &str) -> bool {
    for _ in 0..100 {
        if plane.iam().authenticate_model_token(token).is_err() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

#[tokio::test]
async fn a_sandbox_with_model_access_gets_a_token_that_dies_with_it() -> TestResult {
    let fx = fixture(gateway()).await;
    let sb = fx
        .plane
        .create_sandbox(op(), with_access(&["policy"]))
        .await?;
    let token_id = sb.model_token_id.clone().expect("a token id in the view");
    assert_eq!(
        sb.model_access.as_ref().map(|a| a.models.clone()),
        Some(vec!["policy".to_string()])
    );
    let spec = fx.node.spec_of(&sb.id).expect("on the node");
    assert!(spec.model_link, "the node opens its network to the gateway");
    assert_eq!(
        spec.env.get(OPENAI_BASE_URL_ENV).map(String::as_str),
        Some(URL)
    );
    let token = spec.env.get(OPENAI_API_KEY_ENV).expect("a token").clone();
    assert!(token.starts_with("dsgw_"), "{token}");
    // The view never shows the secret.
    let view = serde_json::to_string(&fx.plane.get_sandbox(op(), &sb.id).await?)?;
    assert!(view.contains(&token_id) && !view.contains(&token), "{view}");

    let grant = fx.plane.iam().authenticate_model_token(&token)?;
    assert_eq!(
        (grant.sandbox.as_str(), grant.token_id.as_str()),
        (sb.id.as_str(), token_id.as_str())
    );
    assert_eq!(grant.access.budget_tokens, Some(10_000));

    // A sandbox without model access gets neither the variables nor the link.
    let plain = fx
        .plane
        .create_sandbox(op(), CreateSandboxRequest::default())
        .await?;
    let spec = fx.node.spec_of(&plain.id).expect("on the node");
    assert!(!spec.model_link && !spec.env.contains_key(OPENAI_API_KEY_ENV));
    assert!(plain.model_token_id.is_none());

    fx.plane.delete_sandbox(op(), &sb.id).await?;
    assert!(
        refused_soon(&fx.plane, &token).await,
        "the token outlived its sandbox"
    );
    Ok(())
}

#[tokio::test]
async fn each_fork_gets_a_token_of_its_own() -> TestResult {
    let fx = fixture(gateway()).await;
    let caller = dsec_control::Principal {
        scopes: vec![dsec_control::Scope::Sandboxes, dsec_control::Scope::Images],
        ..common::tenant("default")
    };
    let src = fx
        .plane
        .create_sandbox(&caller, with_access(&["judge"]))
        .await?;
    let forks = fx
        .plane
        .fork_sandbox(
            &caller,
            &src.id,
            ForkRequest {
                count: 2,
                ..ForkRequest::default()
            },
        )
        .await?
        .sandboxes;
    let src_token = fx.node.spec_of(&src.id).expect("src").env[OPENAI_API_KEY_ENV].clone();
    let mut tokens = vec![src_token.clone()];
    for f in &forks {
        assert_eq!(f.model_access, src.model_access);
        assert_ne!(f.model_token_id, src.model_token_id);
        tokens.push(fx.node.spec_of(&f.id).expect("fork").env[OPENAI_API_KEY_ENV].clone());
    }
    tokens.sort();
    tokens.dedup();
    assert_eq!(tokens.len(), 3, "one token per sandbox");
    for f in &forks {
        fx.plane.delete_sandbox(&caller, &f.id).await?;
    }
    for t in tokens.iter().filter(|t| **t != src_token) {
        assert!(
            refused_soon(&fx.plane, t).await,
            "a fork's token outlived it"
        );
    }
    // The source's token is untouched by its forks' deletes.
    let grant = fx.plane.iam().authenticate_model_token(&src_token)?;
    assert_eq!(grant.sandbox, src.id);
    Ok(())
}

#[tokio::test]
async fn bad_model_access_is_refused_before_anything_is_made() -> TestResult {
    // A server without a gateway says how to get one.
    let fx = fixture(None).await;
    let e = fx
        .plane
        .create_sandbox(op(), with_access(&["policy"]))
        .await
        .expect_err("no gateway");
    assert_eq!(e.code, ErrorCode::BadRequest);
    assert!(e.message.contains("--gateway-config"), "{}", e.message);

    let fx = fixture(gateway()).await;
    let mut sets_key = with_access(&["policy"]);
    sets_key
        .env
        .insert(OPENAI_API_KEY_ENV.into(), "sk-mine".into());
    let mut blocks_port = with_access(&["policy"]);
    blocks_port.filesystem.tcp_connect = Some(vec![443]);
    let pool_claim = CreateSandboxRequest {
        pool: Some("warm".into()),
        ..with_access(&["policy"])
    };
    for (req, says) in [
        (with_access(&["gpt-9"]), "serves no model \"gpt-9\""),
        (with_access(&[]), "empty"),
        (sets_key, OPENAI_API_KEY_ENV),
        (blocks_port, "port 80"),
        (pool_claim, "pool claim"),
    ] {
        let e = fx
            .plane
            .create_sandbox(op(), req)
            .await
            .expect_err("refused");
        assert_eq!(e.code, ErrorCode::BadRequest, "{e:?}");
        assert!(e.message.contains(says), "{says}: {}", e.message);
    }
    assert!(fx.node.sandbox_ids().is_empty(), "nothing was made");
    // Without model access the variables are the caller's to set.
    let mut own = CreateSandboxRequest::default();
    own.env.insert(OPENAI_API_KEY_ENV.into(), "sk-mine".into());
    let sb = fx.plane.create_sandbox(op(), own).await?;
    assert_eq!(
        fx.node.spec_of(&sb.id).expect("made").env[OPENAI_API_KEY_ENV],
        "sk-mine"
    );
    Ok(())
}
