//! Create cost by network mode: `none` (own namespace, loopback only), `allowlist` and
//! `open` (a prepared namespace with a veth link and an nftables policy). Each mode runs
//! as a block of create -> exec -> delete cycles.

use dsec_e2e::Server;
use dsec_wire::v1::{CreateSandboxRequest, NetworkMode, NetworkPolicy};

use crate::Stats;

fn policy(mode: NetworkMode) -> NetworkPolicy {
    NetworkPolicy {
        mode,
        allow: match mode {
            NetworkMode::Allowlist => vec!["pypi.org:443".into(), "*.pythonhosted.org:443".into()],
            _ => vec![],
        },
    }
}

/// Time to interactive (create, then `exec true`) per network mode; `none` first.
pub async fn tti_by_mode(server: &Server, n: usize) -> anyhow::Result<Vec<Stats>> {
    let c = server.client();
    let modes = [NetworkMode::None, NetworkMode::Allowlist, NetworkMode::Open];
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); modes.len()];
    // One block per mode: a networked create's background cost (the pool preparing the
    // next namespace) lands on its own mode's numbers, not on the neighbours'.
    for (m, mode) in modes.iter().enumerate() {
        for i in 0..n + 2 {
            let req = CreateSandboxRequest {
                network: policy(*mode),
                ..Default::default()
            };
            let ms = crate::cycle(&c, req)
                .await
                .map_err(|e| anyhow::anyhow!("a {mode:?} sandbox: {e:#}"))?;
            if i >= 2 {
                samples[m].push(ms);
            }
        }
    }
    Ok(modes
        .iter()
        .zip(samples)
        .map(|(mode, samples)| Stats {
            name: format!("network {mode:?}").to_lowercase(),
            samples,
            note: Some(match mode {
                NetworkMode::None => "own netns, loopback only".into(),
                NetworkMode::Allowlist => "pooled netns + veth, nft policy, 2 rules".into(),
                NetworkMode::Open => "pooled netns + veth, nft policy".into(),
            }),
        })
        .collect())
}

/// Time to interactive with sandboxes in the node's user namespace (the default) and
/// without it (`--no-userns`, a second node in the same run), interleaved.
pub async fn tti_by_userns(server: &Server, n: usize) -> anyhow::Result<Vec<Stats>> {
    let plain = Server::start_with(
        "bench-no-userns",
        false,
        &[
            "--no-userns",
            "--cgroup-parent",
            "dsec-bench-no-userns",
            "--disk-pool",
            "8",
        ],
    )
    .await?;
    plain.ensure_base(Some(server)).await?;
    plain.delete_all().await;
    // Let the new node fill its disk pool before measuring both.
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    let clients = [server.client(), plain.client()];
    let mut samples: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    for i in 0..n + 2 {
        for (k, c) in clients.iter().enumerate() {
            let ms = crate::cycle(c, CreateSandboxRequest::default()).await?;
            if i >= 2 {
                samples[k].push(ms);
            }
        }
    }
    let [userns, no_userns] = samples;
    Ok(vec![
        Stats {
            name: "no user namespace".into(),
            samples: no_userns,
            note: Some("dsec serve --no-userns".into()),
        },
        Stats {
            name: "user namespace".into(),
            samples: userns,
            note: Some("default: idmapped layers and disk".into()),
        },
    ])
}
