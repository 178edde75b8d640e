//! A real cluster on this machine against `dsec serve`, in one run (issue #25): one etcd,
//! two `dsec apiserver` and three `dsec node` processes started by `scripts/local-cluster`
//! (each node with its own directories, cgroup parent, subnet, nft table, link prefix, DNS
//! port and uid range), next to the bench's own `dsec serve`. Measured side by side:
//! - time to interactive (create + exec `true` until its result is back), interleaved
//!   one serve cycle, one cluster cycle (alternating the API servers);
//! - sustained create -> exec `true` -> delete cycles/s at a fixed concurrency, serve then
//!   the cluster (workers alternating the API servers);
//! - the exec round trip of `true` on one sandbox: through an API server vs straight on
//!   its node's internal API (`RemoteNode`, the node token: the hop an API server makes
//!   itself), interleaved.
//!
//! The cluster is stopped by `local-cluster down` (its sandboxes deleted through the API,
//! then its processes by pid), and the host is scanned for what its names left.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use dsec_client::Client;
use dsec_e2e::{host, Server};
use dsec_node_api::NodeApi;
use dsec_node_rpc::client::RemoteNode;
use dsec_wire::agent::ExecSpec;
use dsec_wire::v1::CreateSandboxRequest;

use crate::{argv_true, cycle, on_one_thread, print_table, record, Churn, Cycle, HostCpu, Stats};

/// Nodes and API servers of the cluster.
const NODES: usize = 3;
const APISERVERS: usize = 2;
/// Workers of the sustained run.
const WORKERS: usize = 16;

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/local-cluster")
}

/// A cluster started by `scripts/local-cluster up`; `down` when dropped.
struct LocalCluster {
    dir: PathBuf,
    /// The API servers' URLs.
    urls: Vec<String>,
    key: String,
    /// The node token (the internal API's).
    token: String,
    /// Node name -> internal API URL.
    nodes: Vec<(String, String)>,
    /// The tag naming its host-wide resources (cgroup parents, nft tables, run dirs).
    tag: String,
    /// Its processes: role (`etcd0`, `apiserver0`, `node1`, ...) and pid.
    pids: Vec<(String, i32)>,
}

impl LocalCluster {
    fn up(dir: &Path) -> anyhow::Result<Self> {
        if dir.join("cluster.json").exists() {
            // An interrupted run's.
            let _ = Command::new(script()).arg("down").arg(dir).status();
        }
        let _ = std::fs::remove_dir_all(dir);
        let out = Command::new(script())
            .arg("up")
            .arg(dir)
            .args(["--nodes", &NODES.to_string()])
            .args(["--apiservers", &APISERVERS.to_string()])
            .arg("--dsec")
            .arg(dsec_e2e::dsec_bin())
            .output()
            .context("running scripts/local-cluster")?;
        let mut c = LocalCluster {
            dir: dir.to_path_buf(),
            urls: Vec::new(),
            key: String::new(),
            token: String::new(),
            nodes: Vec::new(),
            tag: String::new(),
            pids: Vec::new(),
        };
        if !out.status.success() {
            bail!(
                "local-cluster up failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        let state: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("cluster.json"))?)?;
        c.urls = state["apiservers"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|u| u.as_str().map(str::to_string))
            .collect();
        c.tag = state["tag"].as_str().unwrap_or_default().to_string();
        for n in state["nodes"].as_array().into_iter().flatten() {
            let (Some(name), Some(url)) = (n["name"].as_str(), n["url"].as_str()) else {
                bail!("cluster.json: a node without name or url: {n}");
            };
            c.nodes.push((name.to_string(), url.to_string()));
        }
        for p in state["pids"].as_array().into_iter().flatten() {
            if let (Some(role), Some(pid)) = (p["role"].as_str(), p["pid"].as_i64()) {
                c.pids.push((role.to_string(), pid as i32));
            }
        }
        c.key = std::fs::read_to_string(dir.join("api-key"))?
            .trim()
            .to_string();
        c.token = std::fs::read_to_string(dir.join("node-token"))?
            .trim()
            .to_string();
        if c.urls.len() != APISERVERS
            || c.nodes.len() != NODES
            || c.pids.len() != NODES + APISERVERS + 1
            || c.tag.is_empty()
        {
            bail!("cluster.json does not describe the cluster started: {state}");
        }
        Ok(c)
    }

    /// A fresh client (its own connection pool) of API server `i % APISERVERS`.
    fn client(&self, i: usize) -> anyhow::Result<Client> {
        Ok(Client::new(
            &self.urls[i % self.urls.len()],
            Some(self.key.clone()),
        )?)
    }

    /// What the cluster's names left on the host: cgroup directories of its parents,
    /// nft tables, mounts and loop devices under its directories, processes naming them.
    fn leftovers(&self) -> Vec<String> {
        let mut out = Vec::new();
        let parent = format!("dsec-lc-{}-", self.tag);
        let roots = std::fs::read_dir("/sys/fs/cgroup")
            .map(|d| d.flatten().map(|e| e.path()).collect::<Vec<_>>())
            .unwrap_or_default();
        for root in roots
            .iter()
            .map(PathBuf::as_path)
            .chain([Path::new("/sys/fs/cgroup")])
        {
            for e in std::fs::read_dir(root).into_iter().flatten().flatten() {
                if e.file_name().to_string_lossy().starts_with(&parent) {
                    out.push(format!("cgroup {}", e.path().display()));
                }
            }
        }
        let tables = Command::new("nft")
            .args(["list", "tables"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        let table = format!("dsec_lc_{}_", self.tag);
        out.extend(
            tables
                .lines()
                .filter(|l| l.contains(&table))
                .map(|l| format!("nft {l}")),
        );
        let dir = self.dir.display().to_string();
        let run = self.run_root().display().to_string();
        if self.run_root().exists() {
            out.push(format!("directory {run}"));
        }
        for m in host::mounts(&dir).into_iter().chain(host::mounts(&run)) {
            out.push(format!("mount {m}"));
        }
        for l in host::loop_devices(&dir) {
            out.push(format!("loop {l}"));
        }
        for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let named = std::fs::read(e.path().join("cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(&dir));
            if named {
                out.push(format!("process {}", e.file_name().to_string_lossy()));
            }
        }
        out
    }

    /// The parent of its nodes' run directories.
    fn run_root(&self) -> PathBuf {
        Path::new("/run/dsec-local-cluster").join(&self.tag)
    }

    /// `local-cluster down`: its sandboxes deleted through the API, its processes
    /// stopped by pid. Idempotent.
    fn down(&self) -> anyhow::Result<()> {
        if !self.dir.join("cluster.json").exists() {
            return Ok(());
        }
        let out = Command::new(script()).arg("down").arg(&self.dir).output()?;
        if !out.status.success() {
            bail!(
                "local-cluster down failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        // `down` removes the nodes' run directories, not their (then empty) parent.
        let _ = std::fs::remove_dir(self.run_root());
        Ok(())
    }
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        if let Err(e) = self.down() {
            eprintln!("{e:#}");
        }
    }
}

/// Time to interactive, `n` cycles each (two warm-ups), interleaved: a serve cycle, then
/// a cluster cycle through API server `i % 2`. Rows: serve and cluster, and the create
/// calls alone.
fn time_to_interactive(
    serve: &Server,
    cluster: &LocalCluster,
    n: usize,
) -> anyhow::Result<[Stats; 4]> {
    let api = (0..APISERVERS)
        .map(|i| cluster.client(i))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let (s, c) = on_one_thread(serve.client(), move |serve| async move {
        let (mut s, mut c) = (Vec::new(), Vec::new());
        for i in 0..n + 2 {
            let a = cycle(&serve, CreateSandboxRequest::default()).await?;
            let b = cycle(&api[i % api.len()], CreateSandboxRequest::default()).await?;
            if i >= 2 {
                s.push(a);
                c.push(b);
            }
        }
        Ok((s, c))
    })?;
    let row = |name: &str, cycles: &[Cycle], ms: fn(&Cycle) -> f64, note: &str| Stats {
        name: name.into(),
        samples: cycles.iter().map(ms).collect(),
        note: Some(note.into()),
    };
    let tti: fn(&Cycle) -> f64 = |c| c.tti_ms;
    let create: fn(&Cycle) -> f64 = |c| c.create_ms;
    let alone = "the create call alone";
    Ok([
        row(
            "dsec serve create + exec true",
            &s,
            tti,
            "one process, HTTP API",
        ),
        row(
            "cluster create + exec true",
            &c,
            tti,
            "API server (etcd) -> node, alternating 2 API servers",
        ),
        row("dsec serve create (ready)", &s, create, alone),
        row("cluster create (ready)", &c, create, alone),
    ])
}

/// Exec `true` round trips on one cluster sandbox, `n` each (five warm-ups), interleaved:
/// through each API server, then straight on its node's internal API; on a serve sandbox
/// for reference; and a GET of the sandbox through the API server (no node call).
async fn exec_round_trip(
    serve: &Server,
    cluster: &LocalCluster,
    n: usize,
) -> anyhow::Result<Vec<Stats>> {
    let c = cluster.client(0)?;
    let sb = c.create_sandbox(CreateSandboxRequest::default()).await?;
    let on_serve = serve
        .client()
        .create_sandbox(CreateSandboxRequest::default())
        .await;
    let timed = match on_serve {
        Ok(local) => {
            let timed = exec_loops(serve, cluster, &sb, &local.id, n).await;
            let _ = serve.client().delete_sandbox(&local.id).await;
            timed
        }
        Err(e) => Err(e.into()),
    };
    c.delete_sandbox(&sb.id).await?;
    let [api0, api1, direct, local, get] = timed?;
    let row = |name: &str, samples: Vec<f64>, note: String| Stats {
        name: name.into(),
        samples,
        note: Some(note),
    };
    Ok(vec![
        row(
            "direct on the node",
            direct,
            format!("node internal API of {} (node token)", sb.node),
        ),
        row(
            "through API server 1",
            api0,
            "the API server that created it".into(),
        ),
        row("through API server 2", api1, "the other replica".into()),
        row("dsec serve", local, "one process, for reference".into()),
        row(
            "API server 1 alone: GET the sandbox",
            get,
            "its cached record, no node call: the HTTP hop and the plane's lookup".into(),
        ),
    ])
}

async fn exec_loops(
    serve: &Server,
    cluster: &LocalCluster,
    sb: &dsec_wire::v1::Sandbox,
    local: &str,
    n: usize,
) -> anyhow::Result<[Vec<f64>; 5]> {
    let node_url = cluster
        .nodes
        .iter()
        .find(|(name, _)| *name == sb.node)
        .map(|(_, url)| url.clone())
        .with_context(|| format!("sandbox {} on unknown node {:?}", sb.id, sb.node))?;
    let (api0, api1) = (cluster.client(0)?, cluster.client(1)?);
    let (token, id, local) = (cluster.token.clone(), sb.id.clone(), local.to_string());
    // The creates took a disk and a network namespace from pools: let their refills end.
    HostCpu::settle(Duration::from_secs(10)).await;
    on_one_thread(serve.client(), move |serve| async move {
        let node = RemoteNode::connect(&node_url, &token)
            .await
            .map_err(|e| anyhow::anyhow!("node {node_url}: {}", e.message))?;
        let req = argv_true();
        // The spec the API server makes of `req` (`exec_spec`, no streaming).
        let spec = ExecSpec {
            cmd: req.cmd.clone(),
            ..dsec_node_api::fake::shell("")
        };
        let mut out: [Vec<f64>; 5] = Default::default();
        for i in 0..n + 5 {
            let mut ms = [0.0; 5];
            for (k, c) in [&api0, &api1].into_iter().enumerate() {
                let t = Instant::now();
                let r = c.exec(&id, req.clone()).await?;
                ms[k] = t.elapsed().as_secs_f64() * 1000.0;
                if r.exit.exit_code != Some(0) {
                    bail!("exec true failed: {r:?}");
                }
            }
            let t = Instant::now();
            let r = node
                .exec(&id, spec.clone(), None)
                .await
                .map_err(|e| anyhow::anyhow!("exec on the node: {}", e.message))?;
            ms[2] = t.elapsed().as_secs_f64() * 1000.0;
            if r.exit.exit_code != Some(0) {
                bail!("exec true on the node failed: {r:?}");
            }
            let t = Instant::now();
            serve.exec(&local, req.clone()).await?;
            ms[3] = t.elapsed().as_secs_f64() * 1000.0;
            let t = Instant::now();
            api0.get_sandbox(&id).await?;
            ms[4] = t.elapsed().as_secs_f64() * 1000.0;
            if i >= 5 {
                for (v, m) in out.iter_mut().zip(ms) {
                    v.push(m);
                }
            }
        }
        Ok(out)
    })
}

/// Where the CPU of a run goes: processes by role, each pid's own CPU (all its threads).
const ROLES: [&str; 5] = [
    "client (this bench)",
    "dsec serve",
    "API servers",
    "nodes",
    "etcd",
];

/// The processes of [`ROLES`]: index into it and pid.
fn cpu_roles(serve: &Server, cluster: &LocalCluster) -> Vec<(usize, i32)> {
    let mut v = vec![(0, std::process::id() as i32)];
    v.extend(serve.pid().map(|p| (1, p)));
    for (role, pid) in &cluster.pids {
        let k = if role.starts_with("apiserver") {
            2
        } else if role.starts_with("etcd") {
            4
        } else {
            3
        };
        v.push((k, *pid));
    }
    v
}

/// CPU so far of each process of `roles`, ms, and of the host.
fn cpu_of(roles: &[(usize, i32)]) -> (Vec<f64>, HostCpu) {
    let each = roles
        .iter()
        .map(|(_, pid)| crate::lifecycle::proc_cpu_ms(*pid).unwrap_or(f64::NAN))
        .collect();
    (each, HostCpu::now())
}

/// CPU spent since `before` by each role of [`ROLES`], then by the rest of the host
/// (sandbox processes, helpers, kernel threads), ms.
fn spent(roles: &[(usize, i32)], before: &(Vec<f64>, HostCpu)) -> Vec<f64> {
    let (now, _) = cpu_of(roles);
    let mut by_role = vec![0.0; ROLES.len()];
    for ((k, _), (a, b)) in roles.iter().zip(before.0.iter().zip(now)) {
        by_role[*k] += b - a;
    }
    let host = before.1.elapsed_ms();
    by_role.push(host - by_role.iter().sum::<f64>());
    by_role
}

/// The sustained rows' tables (rates against serve's; CPU per cycle by process) and
/// JSON.
fn print_sustained(rows: &[(&str, Churn, Vec<f64>)]) {
    let base = rows.first().map(|(_, r, _)| r.rate()).unwrap_or(f64::NAN);
    println!("| setup | concurrency | s | cycles | failed | cycles/s | vs serve | p50 ms | p99 ms | create p50 ms | delete p50 ms | host CPU ms/cycle |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    let mut json = Vec::new();
    for (name, r, cpu) in rows {
        println!(
            "| {name} | {} | {:.0} | {} | {} | {:.1} | {:.2}x | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} |",
            r.workers,
            r.secs,
            r.ok(),
            r.failed,
            r.rate(),
            r.rate() / base,
            r.tti.pct(50.0),
            r.tti.pct(99.0),
            r.create.pct(50.0),
            r.delete.pct(50.0),
            r.cpu_per_cycle()
        );
        let mut j = r.json();
        j["setup"] = (*name).into();
        j["errors"] = serde_json::json!(r.errors);
        let per = |ms: f64| ms / r.ok().max(1) as f64;
        j["cpu_ms_per_cycle"] = ROLES
            .iter()
            .chain(&["the rest"])
            .zip(cpu)
            .map(|(k, ms)| ((*k).to_string(), serde_json::json!(per(*ms))))
            .collect::<serde_json::Map<_, _>>()
            .into();
        json.push(j);
    }
    println!("\nCPU per cycle by process, ms (each process's own threads; the rest: sandbox processes, helpers, kernel threads):\n");
    println!("| setup | {} | the rest | host |", ROLES.join(" | "));
    println!("|---|{}---|---|", "---|".repeat(ROLES.len()));
    for (name, r, cpu) in rows {
        let per: Vec<String> = cpu
            .iter()
            .map(|ms| format!("{:.1}", ms / r.ok().max(1) as f64))
            .collect();
        println!(
            "| {name} | {} | {:.1} |",
            per.join(" | "),
            r.cpu_per_cycle()
        );
    }
    for (name, r, _) in rows.iter().filter(|(_, r, _)| r.failed > 0) {
        let mut errors: Vec<_> = r.errors.iter().collect();
        errors.sort_by(|a, b| b.1.cmp(a.1));
        println!(
            "\n{name}: {} cycles failed; the most frequent errors:",
            r.failed
        );
        for (why, k) in errors.into_iter().take(5) {
            println!("- {k}x {why}");
        }
    }
    record(
        "cluster vs serve: sustained create -> exec -> delete",
        json.into(),
    );
}

/// The section: starts the cluster next to `serve`, measures, stops it, and checks what
/// it left. `n`: time-to-interactive cycles (exec round trips: 5n); `secs`: each
/// sustained run.
pub(crate) async fn section(serve: &Server, n: usize, secs: u64) -> anyhow::Result<()> {
    println!("\n## a real cluster on this machine vs dsec serve ({NODES} nodes, {APISERVERS} API servers, 1 etcd)\n");
    if dsec_testkit::etcd_binary().is_none() {
        println!("n/a: etcd is not installed (Debian: etcd-server; scripts/bench installs it)");
        return Ok(());
    }
    let dir = std::env::temp_dir().join("dsec-e2e").join("bench-cluster");
    let t = Instant::now();
    let cluster = LocalCluster::up(&dir)?;
    let up_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let tar = tokio::fs::File::open(dsec_e2e::base_tar()).await?;
    cluster.client(0)?.upload_image("base", false, tar).await?;
    println!(
        "cluster up in {up_s:.1} s, base image uploaded in {:.1} s; state in {}\n",
        t.elapsed().as_secs_f64(),
        dir.display()
    );
    let measured = measure(serve, &cluster, n, secs).await;
    let stopped = cluster.down();
    let left = cluster.leftovers();
    println!(
        "\ncluster stopped ({}); left behind by its names (cgroups, nft tables, mounts, loop devices, processes): {}",
        match &stopped {
            Ok(()) => "local-cluster down".to_string(),
            Err(e) => format!("{e:#}"),
        },
        if left.is_empty() { "nothing".to_string() } else { left.join("; ") }
    );
    // A node stopped with no sandboxes keeps its image layers mounted under its state
    // directory: detach them, so that nothing of the cluster outlives the run.
    dsec_e2e::unmount_under(&dir);
    let after = cluster.leftovers();
    if !left.is_empty() {
        println!(
            "after the bench detached the mounts under {}: {}",
            dir.display(),
            if after.is_empty() {
                "nothing".to_string()
            } else {
                after.join("; ")
            }
        );
    }
    record(
        "cluster teardown",
        serde_json::json!([{"stopped": stopped.is_ok(), "left_by_down": left, "left_at_end": after}]),
    );
    measured?;
    stopped
}

async fn measure(
    serve: &Server,
    cluster: &LocalCluster,
    n: usize,
    secs: u64,
) -> anyhow::Result<()> {
    HostCpu::settle(Duration::from_secs(10)).await;
    let tti = time_to_interactive(serve, cluster, n)?;
    let tti_ratio = tti[1].pct(50.0) / tti[0].pct(50.0);
    print_table(
        "cluster vs serve: time to interactive (create -> exec true, interleaved)",
        &tti,
        "dsec serve create + exec true",
    );

    let roles = cpu_roles(serve, cluster);
    HostCpu::settle(Duration::from_secs(10)).await;
    let cpu = cpu_of(&roles);
    let on_serve = crate::churn::sustained(serve, WORKERS, secs).await;
    let serve_cpu = spent(&roles, &cpu);
    HostCpu::settle(Duration::from_secs(10)).await;
    let clients = (0..WORKERS)
        .map(|i| cluster.client(i))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let cpu = cpu_of(&roles);
    let on_cluster = crate::churn::sustained_on(|i| clients[i].clone(), WORKERS, secs).await;
    let cluster_cpu = spent(&roles, &cpu);
    println!("\n## cluster vs serve: sustained create -> exec true -> delete, {WORKERS} workers, {secs} s each\n");
    let rate_ratio = on_cluster.rate() / on_serve.rate();
    let runs = [
        ("dsec serve", on_serve, serve_cpu),
        ("cluster (2 API servers)", on_cluster, cluster_cpu),
    ];
    print_sustained(&runs);

    let exec = exec_round_trip(serve, cluster, n * 5).await?;
    print_table(
        "cluster: exec true round trip, through an API server vs direct on the node (interleaved)",
        &exec,
        "direct on the node",
    );
    let over = exec[1].pct(50.0) - exec[0].pct(50.0);
    println!(
        "\ntargets: time to interactive p50 {tti_ratio:.2}x serve (<= 1.3x); sustained {rate_ratio:.2}x \
         serve (>= 0.8x); exec through the API server {over:+.3} ms p50 over direct (<= 0.3 ms)"
    );
    record(
        "cluster targets",
        serde_json::json!([{"tti_p50_ratio": tti_ratio, "sustained_ratio": rate_ratio,
            "exec_p50_over_direct_ms": over}]),
    );
    Ok(())
}
