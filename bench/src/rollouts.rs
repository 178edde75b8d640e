//! RL rollouts (#32): what recording a call's outcome costs an exec, and a fork of a
//! prepared sandbox into 16 against its two hand-made alternatives (a commit and 16
//! creates of its image; 16 creates that each repeat the setup), on one server in one run.

use std::path::Path;
use std::time::Instant;

use anyhow::bail;
use futures::StreamExt;

use dsec_e2e::{sh, Server};
use dsec_wire::v1::{CreateSandboxRequest, ExecRequest, ForkRequest};

use crate::{argv_true, on_one_thread, Stats};

/// Forks (and creates) per group, as in the issue.
const GROUP: u32 = 16;
/// Creates at once in the baselines: what a fork does.
const AT_ONCE: usize = 8;
/// The prepared state: 200 MB of changes (random bytes, the worst case for the capture).
const SETUP: &str = "mkdir -p /work && head -c 200M /dev/urandom > /work/deps.bin && echo ok";

/// `exec true` without and with a request id, alternating on one sandbox.
pub async fn record_overhead(server: &Server, n: usize) -> anyhow::Result<Vec<Stats>> {
    let c = server.client();
    let sb = c.create_sandbox(CreateSandboxRequest::default()).await?;
    let id = sb.id.clone();
    let (plain, recorded) = on_one_thread(c.clone(), move |c| async move {
        let (mut plain, mut recorded) = (Vec::new(), Vec::new());
        for i in 0..(n * 20) {
            let t = Instant::now();
            c.exec(&id, argv_true()).await?;
            plain.push(t.elapsed().as_secs_f64() * 1000.0);
            let t = Instant::now();
            let r = c
                .exec(
                    &id,
                    ExecRequest {
                        request_id: Some(format!("bench-{i}")),
                        ..argv_true()
                    },
                )
                .await?;
            recorded.push(t.elapsed().as_secs_f64() * 1000.0);
            if r.exit.exit_code != Some(0) {
                bail!("exec true failed: {r:?}");
            }
        }
        Ok((plain, recorded))
    })?;
    c.delete_sandbox(&sb.id).await?;
    Ok(vec![
        Stats {
            name: "exec true".into(),
            samples: plain,
            note: Some("no request id: nothing recorded".into()),
        },
        Stats {
            name: "exec true, recorded".into(),
            samples: recorded,
            note: Some("a request id: outcome kept on the node".into()),
        },
    ])
}

/// Bytes allocated under `state` once written back (`sync` first: a sandbox's disk is a
/// sparse file behind a loop device, which allocates only as the kernel writes back).
fn stored_bytes(state: &Path) -> u64 {
    let _ = std::process::Command::new("sync").status();
    dsec_e2e::dir_allocated_bytes(state)
}

/// One way of making a group of rollouts, with what it cost.
pub struct GroupRow {
    pub name: &'static str,
    pub ms: Vec<f64>,
    pub bytes: u64,
}

/// Fork into 16 vs commit + 16 creates vs 16 creates each repeating the setup.
pub async fn fork_vs_creates(server: &Server, reps: usize) -> anyhow::Result<Vec<GroupRow>> {
    let c = server.client();
    let state = server.state_dir.clone();
    let prepared = async || -> anyhow::Result<String> {
        let sb = c.create_sandbox(CreateSandboxRequest::default()).await?;
        let r = c.exec(&sb.id, sh(SETUP)).await?;
        if r.stdout != "ok\n" {
            bail!("setup failed: {r:?}");
        }
        Ok(sb.id)
    };
    let creates = async |req: CreateSandboxRequest, setup: bool| -> anyhow::Result<Vec<String>> {
        let made: Vec<anyhow::Result<String>> = futures::stream::iter(0..GROUP)
            .map(|_| {
                let (c, req) = (c.clone(), req.clone());
                async move {
                    let sb = c.create_sandbox(req).await?;
                    if setup {
                        let r = c.exec(&sb.id, sh(SETUP)).await?;
                        if r.stdout != "ok\n" {
                            bail!("setup failed: {r:?}");
                        }
                    }
                    Ok(sb.id)
                }
            })
            .buffer_unordered(AT_ONCE)
            .collect()
            .await;
        made.into_iter().collect()
    };
    let mut rows = vec![
        GroupRow {
            name: "fork into 16",
            ms: Vec::new(),
            bytes: 0,
        },
        GroupRow {
            name: "commit + 16 creates",
            ms: Vec::new(),
            bytes: 0,
        },
        GroupRow {
            name: "16 creates, setup each",
            ms: Vec::new(),
            bytes: 0,
        },
    ];
    for rep in 0..reps {
        // Fork.
        let src = prepared().await?;
        let before = stored_bytes(&state);
        let t = Instant::now();
        let forked = c
            .fork_sandbox(
                &src,
                &ForkRequest {
                    count: GROUP,
                    ..ForkRequest::default()
                },
            )
            .await?;
        rows[0].ms.push(t.elapsed().as_secs_f64() * 1000.0);
        rows[0].bytes = stored_bytes(&state).saturating_sub(before);
        for f in &forked.sandboxes {
            c.delete_sandbox(&f.id).await?;
        }
        c.delete_image(&forked.image).await.ok();
        // Commit, then creates of the image.
        let before = stored_bytes(&state);
        let t = Instant::now();
        let name = format!("bench-rollout-{rep}");
        let img = c.commit_sandbox(&src, &name).await?;
        let ids = creates(
            CreateSandboxRequest {
                image: Some(img.name.clone()),
                ..CreateSandboxRequest::default()
            },
            false,
        )
        .await?;
        rows[1].ms.push(t.elapsed().as_secs_f64() * 1000.0);
        rows[1].bytes = stored_bytes(&state).saturating_sub(before);
        for id in ids.iter().chain([&src]) {
            c.delete_sandbox(id).await?;
        }
        c.delete_image(&name).await.ok();
        // Setup repeated in each (once: it writes 3.2 GB).
        if rep == 0 {
            let before = stored_bytes(&state);
            let t = Instant::now();
            let ids = creates(CreateSandboxRequest::default(), true).await?;
            rows[2].ms.push(t.elapsed().as_secs_f64() * 1000.0);
            rows[2].bytes = stored_bytes(&state).saturating_sub(before);
            for id in ids {
                c.delete_sandbox(&id).await?;
            }
        }
    }
    Ok(rows)
}

/// Prints the group table: median time, ratio to commit + creates, bytes stored.
pub fn print_groups(rows: &[GroupRow]) {
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    };
    let base = median(&rows[1].ms);
    println!("\n## group rollouts: 16 sandboxes from one prepared state (200 MB of changes)\n");
    println!("| way | runs | p50 ms | vs commit + 16 creates | bytes stored |");
    println!("|---|---|---|---|---|");
    for r in rows {
        let m = median(&r.ms);
        println!(
            "| {} | {} | {:.0} | {:.2}x | {:.1} MB |",
            r.name,
            r.ms.len(),
            m,
            m / base,
            r.bytes as f64 / 1e6
        );
    }
    println!(
        "\ntarget: fork into 16 <= 1.5x commit + 16 creates: {:.2}x",
        median(&rows[0].ms) / base
    );
}
