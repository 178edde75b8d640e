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
                .map_err(|e| anyhow::anyhow!("a {mode:?} sandbox: {e:#}"))?
                .tti_ms;
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

/// Time to interactive with a user namespace per sandbox (the default), with one for the
/// whole node (`--userns-scope node`) and without any (`--no-userns`), each on a fresh node
/// of its own in the same run, interleaved.
pub async fn tti_by_userns(server: &Server, n: usize) -> anyhow::Result<Vec<Stats>> {
    let mut nodes = Vec::new();
    for (name, flag, value) in [
        ("bench-no-userns", "--no-userns", None),
        ("bench-userns-node", "--userns-scope", Some("node")),
        ("bench-userns-sandbox", "--userns-scope", Some("sandbox")),
    ] {
        let cgroup = format!("dsec-{name}");
        let mut args = vec![flag];
        args.extend(value);
        args.extend(["--cgroup-parent", &cgroup, "--disk-pool", "8"]);
        let node = Server::start_with(name, false, &args).await?;
        node.ensure_base(Some(server)).await?;
        node.delete_all().await;
        nodes.push(node);
    }
    // Let the new nodes fill their disk pools before measuring.
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    let clients = [nodes[0].client(), nodes[1].client(), nodes[2].client()];
    let mut samples: [Vec<f64>; 3] = Default::default();
    for i in 0..n + 2 {
        for (k, c) in clients.iter().enumerate() {
            let ms = crate::cycle(c, CreateSandboxRequest::default())
                .await?
                .tti_ms;
            if i >= 2 {
                samples[k].push(ms);
            }
        }
    }
    let [none, node, per_sandbox] = samples;
    Ok(vec![
        Stats {
            name: "no user namespace".into(),
            samples: none,
            note: Some("dsec serve --no-userns".into()),
        },
        Stats {
            name: "one user namespace per node".into(),
            samples: node,
            note: Some("--userns-scope node: idmapped layers and disk".into()),
        },
        Stats {
            name: "a uid range per sandbox".into(),
            samples: per_sandbox,
            note: Some("default: a namespace made per create".into()),
        },
    ])
}
