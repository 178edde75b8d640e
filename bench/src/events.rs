//! What events and traces (#29) cost the create path: time to interactive (create, then
//! `exec true`) on three fresh servers of this build: events off (`--events-retention-s
//! 0`), events on (the default), and events on with every span exported over OTLP
//! (`--otlp-endpoint`, to a collector stub in this process). Rounds alternate between
//! them so all see the same machine. Request ids are on in all (they cannot be turned
//! off).

use std::time::Instant;

use anyhow::bail;
use dsec_e2e::Server;
use dsec_wire::v1::CreateSandboxRequest;

use crate::{argv_true, on_one_thread, Stats};

async fn start(
    name: &str,
    retention: &str,
    otlp: Option<&str>,
    base: &Server,
) -> anyhow::Result<Server> {
    let parent = format!("dsec-{name}");
    let mut args = vec![
        "--events-retention-s",
        retention,
        "--cgroup-parent",
        &parent,
        "--disk-pool",
        "4",
    ];
    if let Some(endpoint) = otlp {
        args.extend(["--otlp-endpoint", endpoint]);
    }
    let s = Server::start_with(name, true, &args).await?;
    s.ensure_base(Some(base)).await?;
    Ok(s)
}

/// Creates with events off, on, and on with traces exported: `n * 4` of each after two
/// warm-ups, alternating.
pub async fn overhead(base: &Server, n: usize) -> anyhow::Result<Vec<Stats>> {
    let collector = dsec_testkit::OtlpCollector::start().await?;
    let endpoint = collector.url();
    let on = start("bench-events-on", "3600", None, base).await?;
    let off = start("bench-events-off", "0", None, base).await?;
    let traced = start("bench-traced", "3600", Some(&endpoint), base).await?;
    let rounds = n * 4 + 2;
    let (c_on, c_off, c_traced) = (on.client(), off.client(), traced.client());
    let (with, without, exported) = on_one_thread(c_on, move |c_on| async move {
        let (mut with, mut without, mut exported) = (Vec::new(), Vec::new(), Vec::new());
        for i in 0..rounds {
            for (c, out) in [
                (&c_on, &mut with),
                (&c_off, &mut without),
                (&c_traced, &mut exported),
            ] {
                let t = Instant::now();
                let sb = c.create_sandbox(CreateSandboxRequest::default()).await?;
                let r = c.exec(&sb.id, argv_true()).await?;
                let ms = t.elapsed().as_secs_f64() * 1000.0;
                if r.exit.exit_code != Some(0) {
                    bail!("exec true failed: {r:?}");
                }
                c.delete_sandbox(&sb.id).await?;
                if i >= 2 {
                    out.push(ms);
                }
            }
        }
        Ok((with, without, exported))
    })?;
    // The events were written: a create and a delete each.
    let kept = on
        .client()
        .events(&dsec_wire::v1::EventQuery {
            after: Some(0),
            no_follow: true,
            ..Default::default()
        })
        .await?;
    let kept = futures::StreamExt::count(kept).await;
    if kept < rounds * 3 {
        bail!("events on: only {kept} events kept for {rounds} sandboxes");
    }
    // The spans were exported: a create span per sandbox (the batch exporter sends
    // within seconds).
    let creates = || {
        collector
            .spans()
            .iter()
            .filter(|s| s.name == "create_sandbox")
            .count()
    };
    let spans = dsec_e2e::wait_until(std::time::Duration::from_secs(30), || {
        let n = creates();
        async move { (n >= rounds).then_some(n) }
    })
    .await;
    let Some(_) = spans else {
        bail!(
            "traces on: the collector got {} create spans for {rounds} sandboxes",
            creates()
        );
    };
    let total = collector.spans().len();
    Ok(vec![
        Stats {
            name: "create + exec true, events off".into(),
            samples: without,
            note: Some("--events-retention-s 0".into()),
        },
        Stats {
            name: "create + exec true, events on".into(),
            samples: with,
            note: Some(format!("default; {kept} events written")),
        },
        Stats {
            name: "create + exec true, events + traces".into(),
            samples: exported,
            note: Some(format!("--otlp-endpoint; {total} spans exported")),
        },
    ])
}
