//! The model gateway (#30): what a call through `dsec gateway` costs over calling its
//! upstream directly, measured side by side in one run. The upstream is the fake
//! (`dsec-testkit::openai`), which answers at once, so the difference is the gateway's
//! own time: a chat completion, and a stream's time to its first token, at concurrency 1
//! and 64, and requests per second at 64; each with a one-line prompt and with a
//! conversation of ~32 KB (what agents send: the gateway's costs that grow with the
//! body show there). The paced rows give the upstream a model's pace (50 ms to answer,
//! a stream's 20 chunks 10 ms apart), and their 64 callers start spread over those 50 ms
//! (as independent agents call, not in lockstep): the cores are then far from full, so
//! the difference is the gateway's own time under concurrency rather than a share of
//! saturated cores or of a burst of 64 at once (the unpaced c=64 rows measure
//! throughput). Fake and gateway run
//! on one runtime, the load
//! generator on another, all in this process and on this machine's cores (so the c=64
//! rates are the whole machine's, the load generator included).

use std::sync::Arc;
use std::time::Instant;

use anyhow::{ensure, Context};
use futures::StreamExt;

use dsec_gateway::{ApiKey, Gateway, GatewayConfig, ModelConfig, UpstreamConfig};
use dsec_testkit::openai::FakeOpenAi;

use crate::Stats;

const KEY: &str = "bench-gateway-key";
const MODEL: &str = "policy";
/// Callers at once in the concurrent rows.
const CONCURRENCY: usize = 64;
/// Rounds of the concurrent rows, direct and gateway taking turns (drift hits both).
const ROUNDS: usize = 4;
/// The size of the large prompt's conversation.
const LARGE_PROMPT: usize = 32 * 1024;

/// A kind of call: whether it streams, its prompt, and its rows' name.
#[derive(Clone, Copy)]
struct Kind {
    stream: bool,
    /// A conversation of about [`LARGE_PROMPT`] bytes before the last message.
    large: bool,
    /// The fake upstream answers at a model's pace ([`PACE`]); measured at c=64 only.
    paced: bool,
    what: &'static str,
}

/// The fake upstream's directive for the paced rows: 50 ms to the answer (or the first
/// chunk), a stream in 20 chunks 10 ms apart.
const PACE: &str = "[fake latency_ms=50 chunks=20 chunk_ms=10] ";
/// [`PACE`]'s time to answer.
const PACE_MS: f64 = 50.0;

/// A request body: the small one, or one whose conversation is about `LARGE_PROMPT`
/// bytes before its last, short, message (which the fake upstream echoes).
fn request_body(kind: Kind) -> &'static [u8] {
    let mut messages = Vec::new();
    if kind.large {
        // Text with what JSON escapes (quotes, newlines), as code and logs have.
        let line = "fn main() { println!(\"tool output: {}\", 42); } // a line of context\n";
        let half = line.repeat(LARGE_PROMPT / 2 / line.len());
        messages.push(serde_json::json!({"role": "system", "content": half}));
        messages.push(serde_json::json!({"role": "user", "content": half}));
        messages.push(serde_json::json!({"role": "assistant", "content": "ok"}));
    }
    let pace = if kind.paced { PACE } else { "" };
    messages.push(serde_json::json!({"role": "user", "content": format!("{pace}say something")}));
    let body = serde_json::json!({"model": MODEL, "messages": messages, "stream": kind.stream});
    // Leaked once per kind: sent without a copy per call.
    body.to_string().into_bytes().leak()
}

const fn kind(stream: bool, large: bool, paced: bool, what: &'static str) -> Kind {
    Kind {
        stream,
        large,
        paced,
        what,
    }
}

/// The kinds of call measured.
const KINDS: [Kind; 6] = [
    kind(false, false, false, "chat completion"),
    kind(true, false, false, "stream, first token"),
    kind(false, true, false, "chat completion, 32 KB prompt"),
    kind(true, true, false, "stream, first token, 32 KB prompt"),
    kind(false, false, true, "chat completion, paced upstream"),
    kind(true, false, true, "stream, first token, paced upstream"),
];

/// The section: prints its table, and the added p50 of each pair against the target.
pub fn section(quick: bool) -> anyhow::Result<()> {
    let n = if quick { 200 } else { 2_000 };
    let servers = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("bench-gateway")
        .enable_all()
        .build()?;
    let (fake, gateway_base, stop) = servers.block_on(start())?;
    let direct_base = fake.url();
    let load = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("bench-load")
        .enable_all()
        .build()?;
    let rows = load.block_on(measure(&direct_base, &gateway_base, n))?;
    let _ = stop.send(());
    drop(fake);

    let (mut stats, rates): (Vec<Stats>, Vec<(String, f64)>) = (
        rows.iter().map(|r| r.stats.clone()).collect(),
        rows.iter()
            .filter_map(|r| r.rate.map(|v| (r.stats.name.clone(), v)))
            .collect(),
    );
    for s in &mut stats {
        s.note = Some(if s.name.starts_with("gateway") {
            "through dsec gateway".into()
        } else {
            "straight to the upstream".into()
        });
    }
    crate::print_table_vs(
        "model gateway: added latency over calling the upstream directly",
        &stats,
        "p50 vs direct",
        &|r| r.name.replacen("gateway", "direct", 1),
    );
    println!();
    for pair in stats.chunks(2) {
        if let [direct, via] = pair {
            println!(
                "added by the gateway, {}: p50 {:+.3} ms, p99 {:+.3} ms (target: p50 <= 1 ms)",
                direct.name.trim_start_matches("direct, "),
                via.pct(50.0) - direct.pct(50.0),
                via.pct(99.0) - direct.pct(99.0)
            );
        }
    }
    for (name, rate) in rates {
        println!("{name}: {rate:.0} requests/s");
    }
    Ok(())
}

/// The fake upstream and a gateway in front of it (on the current runtime), and what
/// stops the gateway.
async fn start() -> anyhow::Result<(FakeOpenAi, String, tokio::sync::oneshot::Sender<()>)> {
    let fake = FakeOpenAi::start(&[MODEL]).await.context("fake upstream")?;
    let config = GatewayConfig {
        api_keys: vec![ApiKey::from(KEY)],
        models: [(
            MODEL.to_string(),
            ModelConfig {
                upstreams: vec![UpstreamConfig {
                    url: fake.url(),
                    ..UpstreamConfig::default()
                }],
            },
        )]
        .into(),
        ..GatewayConfig::default()
    };
    let gateway = Arc::new(Gateway::new(config)?);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}/v1", listener.local_addr()?);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(dsec_http::gateway::serve_gateway(
        listener,
        gateway,
        async move {
            let _ = stopped.await;
        },
    ));
    Ok((fake, base, stop))
}

/// One measured row, and its rate for the concurrent ones.
struct Row {
    stats: Stats,
    rate: Option<f64>,
}

fn row(name: String, samples: Vec<f64>, rate: Option<f64>) -> Row {
    Row {
        stats: Stats {
            name,
            samples,
            note: None,
        },
        rate,
    }
}

/// Every row, direct before gateway for each kind of call.
async fn measure(direct: &str, gateway: &str, n: usize) -> anyhow::Result<Vec<Row>> {
    let client = reqwest::Client::builder()
        .tcp_nodelay(true)
        .pool_max_idle_per_host(CONCURRENCY)
        .build()?;
    let bodies: Vec<&'static [u8]> = KINDS.iter().map(|&k| request_body(k)).collect();
    // Warm both paths (connections, the gateway's upstream pool).
    for base in [direct, gateway] {
        for (k, &body) in KINDS.iter().zip(&bodies).filter(|(k, _)| !k.paced) {
            for _ in 0..20 {
                call(&client, base, k.stream, body).await?;
            }
        }
    }
    let mut rows = Vec::new();
    for (k, &body) in KINDS.iter().zip(&bodies).filter(|(k, _)| !k.paced) {
        // One at a time, direct and gateway taking turns call by call.
        let (mut d, mut g) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for _ in 0..n {
            d.push(call(&client, direct, k.stream, body).await?);
            g.push(call(&client, gateway, k.stream, body).await?);
        }
        rows.push(row(format!("direct, {}, c=1", k.what), d, None));
        rows.push(row(format!("gateway, {}, c=1", k.what), g, None));
    }
    for (k, &body) in KINDS.iter().zip(&bodies) {
        let (mut d, mut g) = (Vec::new(), Vec::new());
        let (mut d_time, mut g_time) = (0.0, 0.0);
        // A paced call takes 50 to 250 ms: fewer of them.
        let per_round = if k.paced {
            CONCURRENCY * (n / 250).max(1)
        } else {
            (n * 4 / ROUNDS).max(CONCURRENCY)
        };
        // Paced callers start spread over the upstream's 50 ms and so stay spread, as
        // independent agents' calls are; unpaced ones start together.
        let stagger = if k.paced {
            PACE_MS / CONCURRENCY as f64
        } else {
            0.0
        };
        for _ in 0..ROUNDS {
            let (samples, secs) =
                at_once(&client, direct, k.stream, body, per_round, stagger).await?;
            d.extend(samples);
            d_time += secs;
            let (samples, secs) =
                at_once(&client, gateway, k.stream, body, per_round, stagger).await?;
            g.extend(samples);
            g_time += secs;
        }
        let (d_rate, g_rate) = (d.len() as f64 / d_time, g.len() as f64 / g_time);
        rows.push(row(
            format!("direct, {}, c={CONCURRENCY}", k.what),
            d,
            Some(d_rate),
        ));
        rows.push(row(
            format!("gateway, {}, c={CONCURRENCY}", k.what),
            g,
            Some(g_rate),
        ));
    }
    Ok(rows)
}

/// `total` calls by [`CONCURRENCY`] callers at once, caller `i` starting `i * stagger_ms`
/// late: each call's milliseconds, and the seconds all took.
async fn at_once(
    client: &reqwest::Client,
    base: &str,
    stream: bool,
    body: &'static [u8],
    total: usize,
    stagger_ms: f64,
) -> anyhow::Result<(Vec<f64>, f64)> {
    let per = total.div_ceil(CONCURRENCY);
    let t = Instant::now();
    let callers: Vec<_> = (0..CONCURRENCY)
        .map(|i| {
            let (client, base) = (client.clone(), base.to_string());
            let late = std::time::Duration::from_secs_f64(i as f64 * stagger_ms / 1000.0);
            tokio::spawn(async move {
                tokio::time::sleep(late).await;
                let mut v = Vec::with_capacity(per);
                for _ in 0..per {
                    v.push(call(&client, &base, stream, body).await?);
                }
                anyhow::Ok(v)
            })
        })
        .collect();
    let mut all = Vec::with_capacity(per * CONCURRENCY);
    for c in callers {
        all.extend(c.await??);
    }
    Ok((all, t.elapsed().as_secs_f64()))
}

/// One chat completion of `body`: milliseconds to the whole answer, or with `stream` to
/// the first event carrying data (the first token).
async fn call(
    client: &reqwest::Client,
    base: &str,
    stream: bool,
    body: &'static [u8],
) -> anyhow::Result<f64> {
    let t = Instant::now();
    let resp = client
        .post(format!("{base}/chat/completions"))
        .bearer_auth(KEY)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await?;
    ensure!(resp.status().is_success(), "{base}: HTTP {}", resp.status());
    if !stream {
        resp.bytes().await?;
        return Ok(t.elapsed().as_secs_f64() * 1000.0);
    }
    let mut first = None;
    let mut chunks = resp.bytes_stream();
    while let Some(chunk) = chunks.next().await {
        let chunk = chunk?;
        if first.is_none() && chunk.windows(6).any(|w| w == b"data: ") {
            first = Some(t.elapsed().as_secs_f64() * 1000.0);
        }
    }
    first.context("a stream without a data event")
}
