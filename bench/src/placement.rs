//! Placement alone, in a simulated fleet (no server, no root, a few seconds): load
//! imbalance of sample-d, random and least-loaded after 20,000 placements of
//! heterogeneous sandboxes on 100 heterogeneous nodes, with exact loads and with the
//! stale loads two API server replicas really see; and placement throughput.

use dsec_fleet::sim::{imbalance, throughput, SimConfig};
use dsec_fleet::Strategy;

use crate::record;

const STRATEGIES: [Strategy; 3] = [Strategy::SampleD, Strategy::Random, Strategy::LeastLoaded];

/// Prints (and records) the placement tables.
pub fn section(quick: bool) {
    let seeds: u64 = if quick { 2 } else { 5 };
    println!("\n## placement: load imbalance after 20,000 placements on 100 nodes (mean of {seeds} seeds)\n");
    println!("exact: one API server, loads always current. stale: two API servers placing in turn, loads");
    println!(
        "refreshed every 2,000 placements (heartbeats 1 s apart at 2,000 creates/s), each replica"
    );
    println!(
        "knowing only its own in-flight creates (the last 100 placements); a node refuses what it"
    );
    println!("cannot hold and the API server retries elsewhere (3 times).\n");
    println!("| strategy | loads | CV of node utilization | mean utilization | fullest node | refused by a node (retried) | failed |");
    println!("|---|---|---|---|---|---|---|");
    let mut rows = Vec::new();
    for s in STRATEGIES {
        for (loads, make) in [
            ("exact", SimConfig::exact as fn(Strategy, u64) -> SimConfig),
            ("stale", SimConfig::stale),
        ] {
            let runs: Vec<_> = (1..=seeds).map(|seed| imbalance(&make(s, seed))).collect();
            let k = runs.len() as f64;
            let mean = |f: &dyn Fn(&dsec_fleet::sim::SimResult) -> f64| {
                runs.iter().map(f).sum::<f64>() / k
            };
            let (cv, util, max) = (mean(&|r| r.cv), mean(&|r| r.mean), mean(&|r| r.max));
            let (nodes_refused, failed) = (
                mean(&|r| r.node_refusals as f64),
                mean(&|r| r.refused as f64),
            );
            println!(
                "| {} | {loads} | {cv:.3} | {:.0}% | {:.0}% | {nodes_refused:.0} | {failed:.0} |",
                s.name(),
                util * 100.0,
                max * 100.0
            );
            rows.push(serde_json::json!({"strategy": s.name(), "loads": loads, "cv": cv, "mean_util": util,
                "max_util": max, "node_refusals": nodes_refused, "failed": failed}));
        }
    }
    record("placement imbalance", serde_json::Value::Array(rows));

    let n = if quick { 20_000 } else { 100_000 };
    println!("\n## placement throughput: place + release on one thread, {n} placements\n");
    println!("| strategy | nodes | placements/s | p50 us | p99 us |");
    println!("|---|---|---|---|---|");
    let mut rows = Vec::new();
    for (s, nodes) in [
        (Strategy::SampleD, 100),
        (Strategy::Random, 100),
        (Strategy::LeastLoaded, 100),
        (Strategy::SampleD, 1000),
    ] {
        let t = throughput(s, nodes, n, 1);
        println!(
            "| {} | {nodes} | {:.0} | {:.2} | {:.2} |",
            s.name(),
            t.per_sec,
            t.p50_us,
            t.p99_us
        );
        rows.push(
            serde_json::json!({"strategy": s.name(), "nodes": nodes, "per_sec": t.per_sec,
            "p50_us": t.p50_us, "p99_us": t.p99_us}),
        );
    }
    record("placement throughput", serde_json::Value::Array(rows));
}
