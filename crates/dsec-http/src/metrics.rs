//! `GET /metrics`: the node's (or cluster's) state in the Prometheus text exposition
//! format (version 0.0.4), built per scrape from the same snapshots the JSON API serves
//! (`/v1/health`, `/v1/images/layers` and, for a cluster admin's key, `/v1/nodes`: one
//! series per registered node, so any API server replica shows the whole fleet). The values live in other processes (the lazy layer server) and
//! are snapshots, not live metric objects, so they are rendered directly.

use std::fmt::Write;

use dsec_wire::v1::{
    ClusterNode, ClusterNodeList, CreatePhaseStats, Health, LayerStatsList, PhaseHistogram, Pool,
    PoolList, CREATE_PHASE_BUCKETS_S,
};

/// Writes the Prometheus text format (version 0.0.4) into a string, one family at a
/// time: its `# HELP` and `# TYPE` lines, then its samples. Every `/metrics` here is
/// written through it.
#[derive(Debug)]
pub struct PromText<'a> {
    out: &'a mut String,
}

/// One series of a histogram for [`PromText::histogram`].
#[derive(Debug, Clone, Copy)]
pub struct HistogramSeries<'a, B> {
    /// Its labels without braces (`layer="sha256:…"`), empty for none.
    pub labels: &'a str,
    /// `(upper bound, samples in this bucket only)` in increasing order; the last
    /// bound is `f64::INFINITY` (`+Inf`). The writer makes them cumulative.
    pub buckets: B,
    /// Sum of the samples.
    pub sum: f64,
    /// Number of samples.
    pub count: u64,
}

impl<'a> PromText<'a> {
    /// A writer appending to `out`.
    pub fn new(out: &'a mut String) -> Self {
        Self { out }
    }

    /// A family of `kind` (`counter`, `gauge`): a sample per `(labels, value)`, the
    /// labels with their braces (`{limit="tokens"}`) or empty.
    pub fn family<L, V>(
        &mut self,
        name: &str,
        kind: &str,
        help: &str,
        series: impl IntoIterator<Item = (L, V)>,
    ) where
        L: std::fmt::Display,
        V: std::fmt::Display,
    {
        self.header(name, kind, help);
        for (labels, v) in series {
            let _ = writeln!(self.out, "{name}{labels} {v}");
        }
    }

    /// A histogram family: per series its cumulative `_bucket`s, `_sum` and `_count`.
    pub fn histogram<'s, B>(
        &mut self,
        name: &str,
        help: &str,
        series: impl IntoIterator<Item = HistogramSeries<'s, B>>,
    ) where
        B: IntoIterator<Item = (f64, u64)>,
    {
        self.header(name, "histogram", help);
        for s in series {
            let sep = if s.labels.is_empty() { "" } else { "," };
            let mut cumulative = 0;
            for (le, n) in s.buckets {
                cumulative += n;
                let le = if le == f64::INFINITY {
                    "+Inf".to_string()
                } else {
                    format!("{le}")
                };
                let _ = writeln!(
                    self.out,
                    "{name}_bucket{{{}{sep}le=\"{le}\"}} {cumulative}",
                    s.labels
                );
            }
            let braced = if s.labels.is_empty() {
                String::new()
            } else {
                format!("{{{}}}", s.labels)
            };
            let _ = writeln!(
                self.out,
                "{name}_sum{braced} {}\n{name}_count{braced} {}",
                s.sum, s.count
            );
        }
    }

    fn header(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.out, "# HELP {name} {help}\n# TYPE {name} {kind}");
    }
}

/// Prometheus text of `health`, `layers` and, when given, the cluster's `nodes`.
pub fn render(health: &Health, layers: &LayerStatsList, nodes: Option<&ClusterNodeList>) -> String {
    let mut out = String::new();
    let mut p = PromText::new(&mut out);
    let mut gauge = |name: &str, help: &str, v: u64| p.family(name, "gauge", help, [("", v)]);
    gauge(
        "dsec_sandboxes",
        "Live sandboxes on this node.",
        health.sandboxes,
    );
    gauge(
        "dsec_sandboxes_unhealthy",
        "Sandboxes whose agent does not answer (state unhealthy).",
        health.unhealthy_sandboxes,
    );
    if let Some(c) = &health.capacity {
        gauge(
            "dsec_cpu_millis_requested",
            "CPU its sandboxes requested, millicores.",
            c.cpu_millis_requested,
        );
        gauge(
            "dsec_cpu_millis_allocatable",
            "CPU the node admits in total, millicores.",
            c.cpu_millis_allocatable,
        );
        gauge(
            "dsec_memory_available_bytes",
            "Host memory available now.",
            c.memory_available_bytes,
        );
        gauge(
            "dsec_max_sandboxes",
            "Most sandboxes the node runs (0: no count limit).",
            c.max_sandboxes,
        );
    }

    if let Some(nodes) = nodes {
        render_nodes(&mut out, nodes);
    }
    let mut p = PromText::new(&mut out);
    p.family(
        "dsec_sandbox_unhealthy_total",
        "counter",
        "Times a sandbox became unhealthy since the server started.",
        [("", health.unhealthy_marks_total)],
    );
    p.family(
        "dsec_lazy_chunk_cache_bytes",
        "gauge",
        "Bytes the on-demand chunk cache holds on disk.",
        [("", layers.node.chunk_cache_bytes)],
    );

    // One family at a time, each with a line per layer.
    type Field = fn(&dsec_wire::v1::LazyLayerStats) -> u64;
    let counters: [(&str, &str, Field); 5] = [
        (
            "dsec_lazy_fetched_bytes_total",
            "Bytes of on-demand layers fetched from the blob store (each written once to the chunk cache).",
            |l| l.fetched_bytes,
        ),
        (
            "dsec_lazy_fetched_chunks_total",
            "Chunks of on-demand layers fetched from the blob store.",
            |l| l.fetched_chunks,
        ),
        (
            "dsec_lazy_cache_served_bytes_total",
            "Bytes of on-demand layers served from the node's chunk cache.",
            |l| l.cached_bytes,
        ),
        (
            "dsec_lazy_prefetched_chunks_total",
            "Chunks fetched ahead of reads from layers' prefetch lists.",
            |l| l.prefetched_chunks,
        ),
        (
            "dsec_lazy_faults_total",
            "Reads of on-demand layers answered with EIO (store down, timeout, bad chunk).",
            |l| l.faults,
        ),
    ];
    for (name, help, field) in counters {
        p.family(
            name,
            "counter",
            help,
            layers
                .lazy
                .iter()
                .map(|l| (format!("{{layer=\"{}\"}}", l.digest), field(l))),
        );
    }
    let labels: Vec<String> = layers
        .lazy
        .iter()
        .map(|l| format!("layer=\"{}\"", l.digest))
        .collect();
    p.histogram(
        "dsec_lazy_fetch_duration_seconds",
        "Time to fetch one chunk of an on-demand layer.",
        layers
            .lazy
            .iter()
            .zip(&labels)
            .map(|(l, labels)| HistogramSeries {
                labels,
                buckets: l.fetch_latency_ms.iter().map(|&(le_ms, n)| {
                    let le = if le_ms == u64::MAX {
                        f64::INFINITY
                    } else {
                        le_ms as f64 / 1000.0
                    };
                    (le, n)
                }),
                sum: l.fetch_us_total as f64 / 1e6,
                count: l.fetched_chunks,
            }),
    );
    out
}

/// Creates' phases: `dsec_create_seconds` (whole creates) and
/// `dsec_create_phase_seconds{phase}`, histograms since the server started.
pub fn render_create_phases(out: &mut String, stats: &CreatePhaseStats) {
    let buckets = |h: &PhaseHistogram| -> Vec<(f64, u64)> {
        CREATE_PHASE_BUCKETS_S
            .iter()
            .copied()
            .chain(std::iter::once(f64::INFINITY))
            .zip(h.counts.iter().copied())
            .collect()
    };
    let mut p = PromText::new(out);
    p.histogram(
        "dsec_create_seconds",
        "Creates that made a sandbox, from the request to ready (their phases sum to it).",
        [HistogramSeries {
            labels: "",
            buckets: buckets(&stats.total),
            sum: stats.total.sum_s,
            count: stats.total.count,
        }],
    );
    let labels: Vec<String> = stats
        .phases
        .iter()
        .map(|h| format!("phase=\"{}\"", label(&h.phase)))
        .collect();
    p.histogram(
        "dsec_create_phase_seconds",
        "Each phase of the creates that made a sandbox (see CreateTimings).",
        stats
            .phases
            .iter()
            .zip(&labels)
            .map(|(h, l)| HistogramSeries {
                labels: l,
                buckets: buckets(h),
                sum: h.sum_s,
                count: h.count,
            }),
    );
}

/// One family per warm-pool figure, a series per pool (`tenant` and `pool` labels).
pub fn render_pools(out: &mut String, pools: &PoolList) {
    type Field = fn(&Pool) -> f64;
    let families: [(&str, &str, &str, Field); 11] = [
        (
            "dsec_pool_size",
            "gauge",
            "Sandboxes a warm pool holds (warm and in the making).",
            |p| f64::from(p.size),
        ),
        (
            "dsec_pool_target",
            "gauge",
            "The size the pool's autoscaler wants.",
            |p| f64::from(p.target),
        ),
        (
            "dsec_pool_ready",
            "gauge",
            "Warm sandboxes ready to be claimed.",
            |p| f64::from(p.ready),
        ),
        (
            "dsec_pool_claimed_total",
            "counter",
            "Claims served since the server started.",
            |p| p.claimed as f64,
        ),
        (
            "dsec_pool_calls_total",
            "counter",
            "Function calls served since the server started.",
            |p| p.calls as f64,
        ),
        (
            "dsec_pool_busy",
            "gauge",
            "Sandboxes of the pool running a function call.",
            |p| f64::from(p.busy),
        ),
        (
            "dsec_pool_queue_length",
            "gauge",
            "Claims waiting for a warm sandbox.",
            |p| f64::from(p.queue_length),
        ),
        (
            "dsec_pool_queue_wait_seconds",
            "gauge",
            "Average wait of claims over the autoscale window.",
            |p| p.queue_wait_ms / 1000.0,
        ),
        (
            "dsec_pool_scale_events",
            "gauge",
            "Scale events the pool keeps (its latest 32).",
            |p| p.scale_events.len() as f64,
        ),
        (
            "dsec_pool_autoscaler_inputs_age_seconds",
            "gauge",
            "Age of the autoscaler's inputs.",
            |p| p.inputs_age_s,
        ),
        (
            "dsec_pool_autoscaler_stale",
            "gauge",
            "1 when the autoscaler's inputs are older than its policy allows (an alarm).",
            |p| f64::from(u8::from(p.stale)),
        ),
    ];
    let labels: Vec<String> = pools
        .pools
        .iter()
        .map(|p| {
            format!(
                "{{tenant=\"{}\",pool=\"{}\"}}",
                label(&p.tenant),
                label(&p.spec.name)
            )
        })
        .collect();
    let mut text = PromText::new(out);
    for (name, kind, help, field) in families {
        text.family(
            name,
            kind,
            help,
            pools.pools.iter().zip(&labels).map(|(p, l)| (l, field(p))),
        );
    }
}

/// A label value in the exposition format's escaping.
pub(crate) fn label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// One gauge family per node field, a series per node (`node` and `pool` labels).
fn render_nodes(out: &mut String, nodes: &ClusterNodeList) {
    let mut p = PromText::new(out);
    p.family(
        "dsec_nodes_live",
        "gauge",
        "Registered nodes whose heartbeats this API server sees.",
        [("", nodes.nodes.iter().filter(|n| n.live).count())],
    );
    type Field = fn(&ClusterNode) -> u64;
    let families: [(&str, &str, Field); 8] = [
        ("dsec_node_live", "1 while the node heartbeats.", |n| {
            n.live as u64
        }),
        (
            "dsec_node_draining",
            "1 while no new sandbox is placed on the node.",
            |n| n.draining as u64,
        ),
        (
            "dsec_node_sandboxes",
            "Sandboxes on the node at its last heartbeat.",
            |n| n.sandboxes,
        ),
        (
            "dsec_node_cpu_millis_used",
            "CPU its sandboxes requested at its last heartbeat, millicores.",
            |n| n.cpu_millis_used,
        ),
        (
            "dsec_node_cpu_millis_capacity",
            "CPU the node admits in total, millicores.",
            |n| n.cpu_millis,
        ),
        (
            "dsec_node_memory_bytes_used",
            "Memory its sandboxes requested at its last heartbeat.",
            |n| n.memory_bytes_used,
        ),
        (
            "dsec_node_memory_bytes_capacity",
            "Memory the node admits in total.",
            |n| n.memory_bytes,
        ),
        (
            "dsec_node_max_sandboxes",
            "Most sandboxes the node runs (0: no count limit).",
            |n| n.max_sandboxes,
        ),
    ];
    let labels: Vec<String> = nodes
        .nodes
        .iter()
        .map(|n| {
            let pool = n.labels.get("pool").map(String::as_str).unwrap_or("");
            format!("{{node=\"{}\",pool=\"{}\"}}", label(&n.name), label(pool))
        })
        .collect();
    for (name, help, field) in families {
        p.family(
            name,
            "gauge",
            help,
            nodes.nodes.iter().zip(&labels).map(|(n, l)| (l, field(n))),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dsec_wire::v1::LazyLayerStats;

    fn value(text: &str, series: &str) -> Option<f64> {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    }

    #[test]
    fn layers_become_counters_and_a_cumulative_histogram() {
        let health = Health {
            status: "ok".into(),
            version: "0".into(),
            node: "n".into(),
            cgroup: "v1".into(),
            sandboxes: 3,
            unhealthy_sandboxes: 1,
            unhealthy_marks_total: 2,
            capacity: None,
            isolation: Vec::new(),
        };
        let layers = LayerStatsList {
            lazy: vec![LazyLayerStats {
                digest: "sha256:ab".into(),
                fetched_bytes: 1 << 20,
                fetched_chunks: 4,
                cached_bytes: 7,
                faults: 1,
                mean_fetch_us: 2500,
                fetch_us_total: 10_000,
                fetch_latency_ms: vec![(1, 1), (5, 2), (u64::MAX, 1)],
                prefetched_chunks: 2,
                last_fault: None,
            }],
            node: dsec_wire::v1::LazyNodeStats {
                chunk_cache_bytes: 5,
                ..Default::default()
            },
        };
        let text = render(&health, &layers, None);
        assert_eq!(value(&text, "dsec_sandboxes"), Some(3.0));
        assert_eq!(value(&text, "dsec_sandboxes_unhealthy"), Some(1.0));
        assert_eq!(value(&text, "dsec_sandbox_unhealthy_total"), Some(2.0));
        assert_eq!(value(&text, "dsec_lazy_chunk_cache_bytes"), Some(5.0));
        let l = "{layer=\"sha256:ab\"}";
        assert_eq!(
            value(&text, &format!("dsec_lazy_fetched_bytes_total{l}")),
            Some(1048576.0)
        );
        assert_eq!(
            value(&text, &format!("dsec_lazy_faults_total{l}")),
            Some(1.0)
        );
        let b = "dsec_lazy_fetch_duration_seconds_bucket{layer=\"sha256:ab\",le=";
        assert_eq!(value(&text, &format!("{b}\"0.001\"}}")), Some(1.0));
        assert_eq!(value(&text, &format!("{b}\"0.005\"}}")), Some(3.0));
        assert_eq!(value(&text, &format!("{b}\"+Inf\"}}")), Some(4.0));
        assert_eq!(
            value(&text, &format!("dsec_lazy_fetch_duration_seconds_count{l}")),
            Some(4.0)
        );
        assert_eq!(
            value(&text, &format!("dsec_lazy_fetch_duration_seconds_sum{l}")),
            Some(0.01)
        );
        // Every family is declared once, before its samples.
        let types: Vec<&str> = text.lines().filter(|l| l.starts_with("# TYPE")).collect();
        let mut unique = types.clone();
        unique.dedup();
        assert_eq!(types, unique);
    }

    #[test]
    fn every_registered_node_is_a_series_of_each_node_family() {
        let health = Health {
            status: "ok".into(),
            version: "0".into(),
            node: "cluster of 1 live nodes".into(),
            cgroup: String::new(),
            sandboxes: 2,
            unhealthy_sandboxes: 0,
            unhealthy_marks_total: 0,
            capacity: None,
            isolation: Vec::new(),
        };
        let node = |name: &str, live: bool, pool: &str| ClusterNode {
            name: name.into(),
            url: "http://n".into(),
            labels: [("pool".to_string(), pool.to_string())].into(),
            live,
            draining: !live,
            cpu_millis: 2000,
            memory_bytes: 1 << 30,
            max_sandboxes: 0,
            cpu_millis_used: 800,
            memory_bytes_used: 128 << 20,
            sandboxes: 2,
            version: "0".into(),
            boot_id: "b".into(),
        };
        let nodes = ClusterNodeList {
            nodes: vec![node("n1", true, "onprem"), node("n\"2", false, "cloud")],
        };
        let text = render(&health, &LayerStatsList::default(), Some(&nodes));
        assert_eq!(value(&text, "dsec_nodes_live"), Some(1.0));
        let n1 = "{node=\"n1\",pool=\"onprem\"}";
        assert_eq!(value(&text, &format!("dsec_node_live{n1}")), Some(1.0));
        assert_eq!(
            value(&text, &format!("dsec_node_cpu_millis_used{n1}")),
            Some(800.0)
        );
        assert_eq!(
            value(&text, &format!("dsec_node_memory_bytes_capacity{n1}")),
            Some(1073741824.0)
        );
        // Label values are escaped.
        let n2 = "{node=\"n\\\"2\",pool=\"cloud\"}";
        assert_eq!(value(&text, &format!("dsec_node_draining{n2}")), Some(1.0));
        let types: Vec<&str> = text.lines().filter(|l| l.starts_with("# TYPE")).collect();
        let mut unique = types.clone();
        unique.dedup();
        assert_eq!(types, unique);
        // Without the list (a key that may not see nodes), no node series.
        let text = render(&health, &LayerStatsList::default(), None);
        assert!(!text.contains("dsec_node_"), "{text}");
    }

    #[test]
    fn prom_text_writes_families_and_cumulative_histograms() {
        let mut out = String::from("# before\n");
        let mut p = PromText::new(&mut out);
        p.family("a_total", "counter", "A.", [("", 1), ("{x=\"y\"}", 2)]);
        let series = |labels| HistogramSeries {
            labels,
            buckets: [(0.5, 1), (1.0, 0), (f64::INFINITY, 2)],
            sum: 4.25,
            count: 3,
        };
        p.histogram("h_seconds", "H.", [series(""), series("m=\"x\"")]);
        assert_eq!(
            out,
            "# before\n# HELP a_total A.\n# TYPE a_total counter\na_total 1\na_total{x=\"y\"} 2\n\
             # HELP h_seconds H.\n# TYPE h_seconds histogram\n\
             h_seconds_bucket{le=\"0.5\"} 1\nh_seconds_bucket{le=\"1\"} 1\n\
             h_seconds_bucket{le=\"+Inf\"} 3\nh_seconds_sum 4.25\nh_seconds_count 3\n\
             h_seconds_bucket{m=\"x\",le=\"0.5\"} 1\nh_seconds_bucket{m=\"x\",le=\"1\"} 1\n\
             h_seconds_bucket{m=\"x\",le=\"+Inf\"} 3\nh_seconds_sum{m=\"x\"} 4.25\n\
             h_seconds_count{m=\"x\"} 3\n"
        );
    }
}
