//! What events (#29) cost the create path: time to interactive (create, then `exec
//! true`) on two fresh servers of this build that differ only in `--events-retention-s`
//! (3600 against 0), alternating between them so both see the same machine. Request ids
//! and spans are on in both (they cannot be turned off).

use std::time::Instant;

use anyhow::bail;
use dsec_e2e::Server;
use dsec_wire::v1::CreateSandboxRequest;

use crate::{argv_true, on_one_thread, Stats};

async fn start(name: &str, retention: &str, base: &Server) -> anyhow::Result<Server> {
    let parent = format!("dsec-{name}");
    let s = Server::start_with(
        name,
        true,
        &[
            "--events-retention-s",
            retention,
            "--cgroup-parent",
            &parent,
            "--disk-pool",
            "4",
        ],
    )
    .await?;
    s.ensure_base(Some(base)).await?;
    Ok(s)
}

/// Creates with events on and off, `n * 4` of each after two warm-ups, alternating.
pub async fn overhead(base: &Server, n: usize) -> anyhow::Result<Vec<Stats>> {
    let on = start("bench-events-on", "3600", base).await?;
    let off = start("bench-events-off", "0", base).await?;
    let rounds = n * 4 + 2;
    let (c_on, c_off) = (on.client(), off.client());
    let (with, without) = on_one_thread(c_on, move |c_on| async move {
        let (mut with, mut without) = (Vec::new(), Vec::new());
        for i in 0..rounds {
            for (c, out) in [(&c_on, &mut with), (&c_off, &mut without)] {
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
        Ok((with, without))
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
    ])
}
