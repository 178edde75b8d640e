//! Upstream health through [`Gateway::handle`] against real sockets: an upstream that
//! refuses connections is ejected after one failure and no longer delays requests, a
//! model whose upstreams are all down still tries each, a 5xx is the caller's answer
//! (counted, not ejected), and probes take an upstream out of rotation and bring it back
//! when it answers again.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use dsec_gateway::{
    CallOptions, Gateway, GatewayConfig, ModelConfig, Route, UpstreamConfig, UpstreamStatus,
};
use dsec_testkit::openai::FakeOpenAi;
use serde_json::json;

const KEY: &str = "operator-key";

/// A loopback address nothing listens on (bound, then let go).
fn dead_addr() -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("addr")
}

fn url(addr: SocketAddr) -> String {
    format!("http://{addr}/v1")
}

fn gateway(urls: &[String], health_check_interval_s: f64) -> Gateway {
    let upstreams = urls
        .iter()
        .map(|u| UpstreamConfig {
            url: u.clone(),
            ..UpstreamConfig::default()
        })
        .collect();
    let config = GatewayConfig {
        api_keys: vec![KEY.into()],
        models: BTreeMap::from([("policy".to_string(), ModelConfig { upstreams })]),
        connect_timeout_s: 2.0,
        health_check_interval_s,
        ..GatewayConfig::default()
    };
    Gateway::new(config).expect("gateway")
}

async fn chat(gw: &Gateway, prompt: &str) -> u16 {
    let body = json!({"model": "policy", "messages": [{"role": "user", "content": prompt}]});
    gw.handle(
        Some(KEY),
        Route::ChatCompletions,
        Bytes::from(body.to_string()),
        CallOptions::default(),
    )
    .await
    .status
}

fn status_of(gw: &Gateway, url: &str) -> UpstreamStatus {
    gw.upstreams()
        .into_iter()
        .find(|u| u.url == url.trim_end_matches('/'))
        .expect("the upstream is listed")
}

/// Polls `check` until it holds or 10 s pass.
async fn wait_until(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !check() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn an_unreachable_upstream_is_ejected_after_one_failed_connect() {
    let fake = FakeOpenAi::start(&["policy"]).await.expect("fake");
    let dead = url(dead_addr());
    let gw = gateway(&[dead.clone(), fake.url()], 0.0);
    for i in 0..6 {
        assert_eq!(chat(&gw, &format!("hello {i}")).await, 200, "request {i}");
    }
    let down = status_of(&gw, &dead);
    assert!(!down.healthy, "{down:?}");
    assert_eq!(
        down.connect_errors, 1,
        "only the first request tried it: {down:?}"
    );
    let up = status_of(&gw, &fake.url());
    assert!(up.healthy && up.connect_errors == 0, "{up:?}");
    assert_eq!(fake.stats.count("/v1/chat/completions"), 6);
}

#[tokio::test]
async fn with_every_upstream_down_each_is_still_tried() {
    let (a, b) = (url(dead_addr()), url(dead_addr()));
    let gw = gateway(&[a.clone(), b.clone()], 0.0);
    for _ in 0..2 {
        assert_eq!(chat(&gw, "anyone?").await, 502);
    }
    for u in [&a, &b] {
        let s = status_of(&gw, u);
        assert!(!s.healthy, "{s:?}");
        assert_eq!(s.connect_errors, 2, "tried on both requests: {s:?}");
    }
}

#[tokio::test]
async fn a_5xx_answer_is_counted_and_passed_on_without_a_second_try() {
    let a = FakeOpenAi::start(&["policy"]).await.expect("fake");
    let b = FakeOpenAi::start(&["policy"]).await.expect("fake");
    let gw = gateway(&[a.url(), b.url()], 0.0);
    assert_eq!(chat(&gw, "[fake fail=503] down for now").await, 503);
    let sent = a.stats.count("/v1/chat/completions") + b.stats.count("/v1/chat/completions");
    assert_eq!(sent, 1, "a request that reached a model is not sent twice");
    let errors: u64 = gw.upstreams().iter().map(|u| u.status_errors).sum();
    assert_eq!(errors, 1);
    assert!(
        gw.upstreams().iter().all(|u| u.healthy),
        "an answer is not an outage"
    );
}

#[tokio::test]
async fn probes_eject_a_dead_upstream_and_restore_it_when_it_answers() {
    let addr = dead_addr();
    let gw = gateway(&[url(addr)], 0.05);
    let _probes = gw.start_health_checks().expect("probes are on");
    wait_until("a probe fails", || {
        let s = status_of(&gw, &url(addr));
        !s.healthy && s.probe_errors >= 1
    })
    .await;
    assert_eq!(
        status_of(&gw, &url(addr)).connect_errors,
        0,
        "no request was sent"
    );

    let _fake = FakeOpenAi::start_on(addr, &["policy"])
        .await
        .expect("the upstream comes up on its old port");
    wait_until("a probe succeeds", || status_of(&gw, &url(addr)).healthy).await;
    assert_eq!(chat(&gw, "back?").await, 200);
}

#[tokio::test]
async fn probes_are_off_at_zero() {
    let gw = gateway(&[url(dead_addr())], 0.0);
    assert!(gw.start_health_checks().is_none());
}
