//! RemoteNode against the real internal API server over TCP, serving a FakeNode: every
//! operation crosses HTTP and comes back as the node answered it.

use std::sync::Arc;

use dsec_node_api::fake::{sandbox_spec as spec, shell, FakeNode};
use dsec_node_api::{Lifetime, NodeApi};
use dsec_node_rpc::client::RemoteNode;
use dsec_wire::agent::Request;
use dsec_wire::v1::ExecEvent;
use dsec_wire::ErrorCode;
use futures::StreamExt;
use std::time::Duration;

type TestResult = Result<(), Box<dyn std::error::Error>>;

const TOKEN: &str = "node-token-for-tests";

/// Serves `node` on a free port; returns its base URL.
async fn serve(node: Arc<FakeNode>) -> Result<String, std::io::Error> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let app = dsec_node_rpc::server::router(node, TOKEN.into());
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok(format!("http://{addr}"))
}

#[tokio::test]
async fn every_kind_of_operation_crosses_the_wire() -> TestResult {
    let fake = Arc::new(FakeNode::new("fake-9"));
    let base = serve(fake.clone()).await?;
    let node = RemoteNode::connect(&base, TOKEN).await?;
    assert_eq!(node.name(), "fake-9");

    let sb = node.create(spec("sb-1")).await?;
    assert_eq!(sb.id, "sb-1");
    assert_eq!(fake.sandbox_ids(), ["sb-1"]);
    assert_eq!(node.list().await.expect("node lists").len(), 1);
    assert_eq!(node.capacity().await.sandboxes, 1);
    node.ping("sb-1").await?;

    // A body larger than any single chunk, streamed both ways.
    let big: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    let chunks: Vec<Result<bytes::Bytes, dsec_wire::ApiError>> = big
        .chunks(100_000)
        .map(|c| Ok(bytes::Bytes::copy_from_slice(c)))
        .collect();
    let w = node
        .write_file(
            "sb-1",
            "/data/big",
            Some(0o600),
            futures::stream::iter(chunks).boxed(),
        )
        .await?;
    assert_eq!(w.bytes, big.len() as u64);
    let (info, mut body) = node.read_file("sb-1", "/data/big", 10, None).await?;
    assert_eq!(info.size, big.len() as u64);
    let mut back = Vec::new();
    while let Some(chunk) = body.next().await {
        back.extend_from_slice(&chunk?);
    }
    assert!(back == big[10..], "bytes come back as written");

    let r = node
        .exec(
            "sb-1",
            shell("cat"),
            Some(bytes::Bytes::from_static(b"from stdin")),
        )
        .await?;
    assert_eq!(r.stdout, "from stdin");
    let events: Vec<ExecEvent> = node
        .exec_stream("sb-1", shell("echo streamed"), None)
        .await?
        .collect()
        .await;
    assert!(
        matches!(events.as_slice(), [ExecEvent::Started { .. }, ExecEvent::Stdout { data }, ExecEvent::Exit { .. }] if data == "streamed\n"),
        "{events:?}"
    );
    let reply = node
        .call(
            "sb-1",
            Request::FileStat {
                path: "/data/big".into(),
            },
        )
        .await?;
    assert!(
        matches!(reply, dsec_wire::agent::Reply::File(_)),
        "{reply:?}"
    );

    let (img, diff) = node
        .commit("sb-1", "snap", vec![], Default::default())
        .await?;
    assert_eq!(img.name, "snap");
    assert!(diff.is_some());
    assert_eq!(node.image("snap").await?.digest, img.digest);
    node.tag_image("snap", "snap-2", None).await?;
    assert_eq!(node.list_images().await?.len(), 3);

    node.pause("sb-1").await?;
    let e = node.ping("sb-1").await.expect_err("paused");
    assert_eq!(e.code, ErrorCode::Paused, "the node's own code comes back");
    node.resume("sb-1").await?;
    node.destroy("sb-1").await?;
    assert!(fake.sandbox_ids().is_empty());
    Ok(())
}

#[tokio::test]
async fn lifetimes_and_ended_stubs_cross_the_wire() -> TestResult {
    let fake = Arc::new(FakeNode::new("fake-9"));
    let base = serve(fake.clone()).await?;
    let node = RemoteNode::connect(&base, TOKEN).await?;
    let life = Lifetime {
        ttl_ms: Some(10_000),
        idle_timeout_ms: Some(4_000),
        held: false,
    };
    node.create(dsec_node_api::NodeCreateSpec {
        lifetime: life,
        ..spec("sb-1")
    })
    .await?;
    fake.advance(Duration::from_secs(3));
    let listed = node.list().await.expect("node lists");
    assert_eq!(
        (listed[0].age_ms, listed[0].idle_ms, listed[0].ttl_left_ms),
        (3000, 3000, Some(7000)),
        "the clocks the node keeps come back: {listed:?}"
    );
    node.set_lifetime(
        "sb-1",
        Lifetime {
            ttl_ms: Some(1_000),
            held: true,
            ..life
        },
    )
    .await?;
    assert!(fake.advance(Duration::from_secs(60)).is_empty(), "held");
    node.set_lifetime(
        "sb-1",
        Lifetime {
            ttl_ms: Some(1_000),
            ..life
        },
    )
    .await?;
    assert_eq!(fake.advance(Duration::from_secs(1)), ["sb-1"]);
    let stub = node
        .list()
        .await
        .expect("node lists")
        .pop()
        .ok_or("the stub is listed")?;
    assert_eq!(
        (stub.id.as_str(), stub.alive, stub.ended.as_deref()),
        ("sb-1", false, Some(dsec_node_api::lifetime::TTL_ENDED))
    );
    let e = node.set_lifetime("sb-1", life).await.expect_err("ended");
    assert_eq!(e.code, ErrorCode::NotFound);
    node.destroy("sb-1").await?;
    assert!(node.list().await.expect("node lists").is_empty());
    Ok(())
}

#[tokio::test]
async fn errors_keep_their_codes_and_a_wrong_token_is_refused() -> TestResult {
    let fake = Arc::new(FakeNode::new("fake-9"));
    let base = serve(fake.clone()).await?;
    let e = RemoteNode::connect(&base, "stolen")
        .await
        .expect_err("wrong token");
    assert_eq!(e.code, ErrorCode::Unauthorized);
    let e = RemoteNode::connect(&base, "").await.expect_err("no token");
    assert_eq!(e.code, ErrorCode::Unauthorized);

    let node = RemoteNode::connect(&base, TOKEN).await?;
    let e = node
        .exec("nope", shell("true"), None)
        .await
        .expect_err("unknown");
    assert_eq!(e.code, ErrorCode::NotFound);
    fake.set_max_sandboxes(1);
    node.create(spec("a")).await?;
    let e = node.create(spec("b")).await.expect_err("full");
    assert_eq!(e.code, ErrorCode::Capacity);
    let e = node
        .call(
            "a",
            Request::FileRead {
                path: "/x".into(),
                offset: 0,
                length: None,
            },
        )
        .await
        .expect_err("a streaming request is not a call");
    assert_eq!(e.code, ErrorCode::BadRequest);
    Ok(())
}

#[tokio::test]
async fn a_node_that_is_gone_answers_agent_unavailable() -> TestResult {
    // A port nobody listens on.
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    drop(listener);
    let e = RemoteNode::connect(&format!("http://{addr}"), TOKEN)
        .await
        .expect_err("nobody there");
    assert_eq!(e.code, ErrorCode::AgentUnavailable);
    Ok(())
}

#[tokio::test]
async fn the_api_requests_id_reaches_the_node() -> TestResult {
    let fake = Arc::new(FakeNode::new("fake-7"));
    let base = serve(fake.clone()).await?;
    let node = RemoteNode::connect(&base, TOKEN).await?;
    let id: Arc<str> = Arc::from("req_0123456789abcdef");
    dsec_node_api::request_id::scope(id, node.create(spec("sb-traced"))).await?;
    node.create(spec("sb-plain")).await?;
    assert_eq!(
        fake.create_request_id("sb-traced").as_deref(),
        Some("req_0123456789abcdef")
    );
    assert_eq!(fake.create_request_id("sb-plain"), None);
    Ok(())
}
