//! The node ends its sandboxes' lifetimes on its own (#25): a `LocalNode` in this test
//! process, with no control plane above it, tears down a sandbox whose TTL or idle
//! timeout ran out, lists it as an ended stub until it is destroyed, counts activity but
//! not pings, stops the clock while held, and keeps remaining lifetimes and stubs across
//! a restart.
//!
//! The tests share one node directory (one image import) and take turns on it.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dsec_e2e::{host, require_root, wait_until};
use dsec_node::{LocalNode, NodeConfig};
use dsec_node_api::fake::{sandbox_spec, shell};
use dsec_node_api::lifetime::{IDLE_TIMEOUT, TTL_ENDED};
use dsec_node_api::{ImportSource, Lifetime, NodeApi, NodeCreateSpec, NodeSandbox};
use dsec_wire::ErrorCode;

/// One node at a time on the shared directories.
static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const NAME: &str = "node-lifetimes";

fn config() -> NodeConfig {
    let root = std::env::temp_dir().join("dsec-e2e").join(NAME);
    NodeConfig {
        name: NAME.into(),
        state_dir: root.join("state"),
        run_dir: Path::new(dsec_e2e::TEST_RUN_ROOT).join(NAME),
        agent_bin: std::env::var_os("DSEC_AGENT_BIN")
            .map(PathBuf::from)
            .unwrap_or_else(|| dsec_e2e::target_dir().join("debug/dsec-agent")),
        create_timeout: Duration::from_secs(30),
        disk: None,
        admission: Default::default(),
        swap_file: None,
        network: None,
        cgroup_parent: "dsec-e2e-lifetimes".into(),
        cgroup_favor_dynmods: false,
        run_dir_tmpfs: false,
        netns_pool: 0,
        delete_concurrency: 0,
        userns: None,
        oci_runtime: None,
        gvisor: None,
        microvm: None,
        blob_store: None,
        layer_cache_bytes: None,
        lazy_chunk_cache_bytes: None,
        lazy_prefetch_window: Duration::ZERO,
        chunk_size: 0,
        ref_ttl: Duration::from_secs(1),
        lazy_launcher: None,
        reap_interval: Duration::from_millis(100),
        max_recorded_calls: dsec_wire::v1::MAX_CALLS_PER_SANDBOX,
        registry: Default::default(),
    }
}

/// Opens the node (adopting what an earlier open left), with the base image.
async fn open() -> Arc<LocalNode> {
    let node = LocalNode::open(config()).await.expect("open the node");
    if node.image("base").await.is_err() {
        node.import_image(
            "base",
            ImportSource::NodePath(dsec_e2e::base_tar()),
            false,
            None,
        )
        .await
        .expect("import the base image");
    }
    node
}

/// Opens the node with nothing on it (a failed earlier run may have left sandboxes).
async fn open_clean() -> Arc<LocalNode> {
    let node = open().await;
    for sb in node.list().await.expect("node lists") {
        node.destroy(&sb.id).await.expect("destroy a leftover");
    }
    node
}

/// Stops the node as `dsec serve` does; it is gone once this returns (its reaper holds
/// it only during a pass).
async fn close(node: Arc<LocalNode>) {
    let alone = wait_until(Duration::from_secs(10), || async {
        (Arc::strong_count(&node) == 1).then_some(())
    })
    .await;
    assert!(alone.is_some(), "nothing else holds the node");
    node.shutdown();
    drop(node);
}

fn life(ttl_ms: u64, idle_timeout_ms: Option<u64>) -> Lifetime {
    Lifetime {
        ttl_ms: Some(ttl_ms),
        idle_timeout_ms,
        held: false,
    }
}

fn spec(id: &str, lifetime: Lifetime) -> NodeCreateSpec {
    NodeCreateSpec {
        lifetime,
        ..sandbox_spec(id)
    }
}

fn new_id(what: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("life-{what}-{nanos:08x}")
}

async fn listed(node: &LocalNode, id: &str) -> Option<NodeSandbox> {
    node.list()
        .await
        .expect("node lists")
        .into_iter()
        .find(|s| s.id == id)
}

/// Waits until the node lists `id` as ended; returns its stub.
async fn ended(node: &LocalNode, id: &str, within: Duration) -> Option<NodeSandbox> {
    wait_until(within, || async {
        listed(node, id).await.filter(|s| s.ended.is_some())
    })
    .await
}

/// Nothing of the sandbox is left on the host but its stub (it is listed as ended
/// before its teardown finishes).
async fn torn_down(node: &LocalNode, id: &str) {
    let cfg = config();
    let left = || {
        (
            host::processes(id),
            host::cgroup_dirs(id),
            host::mounts(id),
            cfg.sandbox_run_dir(id).exists(),
            cfg.sandbox_dir(id).exists(),
        )
    };
    let gone = wait_until(Duration::from_secs(10), || async {
        let (procs, cgroups, mounts, run, state) = left();
        (procs.is_empty() && cgroups.is_empty() && mounts.is_empty() && !run && !state)
            .then_some(())
    })
    .await;
    assert!(
        gone.is_some(),
        "{id}: (processes, cgroups, mounts, run dir, state dir) left: {:?}",
        left()
    );
    let e = node.exec(id, shell("true"), None).await.expect_err("ended");
    assert_eq!(e.code, ErrorCode::NotFound, "{}", e.message);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_ttl_ends_on_the_node_and_leaves_a_stub_until_destroyed() {
    if !require_root() {
        return;
    }
    let _turn = TURN.lock().await;
    let node = open_clean().await;
    let id = new_id("ttl");
    let start = Instant::now();
    let sb = node
        .create(spec(&id, life(2000, None)))
        .await
        .expect("create");
    assert!(sb.ttl_left_ms.is_some_and(|t| t <= 2000), "{sb:?}");
    assert!(!host::processes(&id).is_empty(), "it runs");
    let stub = ended(&node, &id, Duration::from_secs(6))
        .await
        .expect("the node ended it");
    assert!(start.elapsed() >= Duration::from_millis(1900));
    assert_eq!(stub.ended.as_deref(), Some(TTL_ENDED));
    assert!(!stub.alive);
    assert!(stub.age_ms >= 1900, "{stub:?}");
    torn_down(&node, &id).await;
    // Still listed, until destroyed.
    assert!(listed(&node, &id).await.is_some());
    let e = node
        .set_lifetime(&id, life(60_000, None))
        .await
        .expect_err("ended");
    assert_eq!(e.code, ErrorCode::NotFound);
    node.destroy(&id).await.expect("destroy forgets the stub");
    assert!(listed(&node, &id).await.is_none());
    node.destroy(&id).await.expect("destroy stays idempotent");
    close(node).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn idle_timeout_counts_activity_not_pings_and_held_stops_the_clock() {
    if !require_root() {
        return;
    }
    let _turn = TURN.lock().await;
    let node = open_clean().await;
    let (idle, busy, held) = (new_id("idle"), new_id("busy"), new_id("held"));
    for id in [&idle, &busy] {
        node.create(spec(id, life(60_000, Some(1500))))
            .await
            .expect("create");
    }
    node.create(spec(&held, life(1000, Some(500))))
        .await
        .expect("create");
    node.set_lifetime(
        &held,
        Lifetime {
            ttl_ms: Some(1000),
            idle_timeout_ms: Some(500),
            held: true,
        },
    )
    .await
    .expect("hold");
    // For 3 s: `busy` runs commands, `idle` only answers the watchdog's pings.
    let until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < until {
        node.exec(&busy, shell("true"), None).await.expect("exec");
        let _ = node.ping(&idle).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let stub = listed(&node, &idle).await.expect("listed");
    assert_eq!(stub.ended.as_deref(), Some(IDLE_TIMEOUT), "{stub:?}");
    torn_down(&node, &idle).await;
    let b = listed(&node, &busy).await.expect("listed");
    assert!(b.ended.is_none() && b.alive, "activity kept it: {b:?}");
    // A command that runs longer than the idle timeout keeps it busy meanwhile.
    let r = node
        .exec(&busy, shell("sleep 2; echo done"), None)
        .await
        .expect("a long command");
    assert_eq!(r.stdout, "done\n");
    assert!(listed(&node, &busy)
        .await
        .is_some_and(|s| s.ended.is_none()));
    let stub = ended(&node, &busy, Duration::from_secs(5))
        .await
        .expect("idle at last");
    assert_eq!(stub.ended.as_deref(), Some(IDLE_TIMEOUT));
    // Held for all that time, past its TTL and idle timeout: the clock stood still.
    let h = listed(&node, &held).await.expect("listed");
    assert_eq!(
        (h.ended.as_deref(), h.ttl_left_ms),
        (None, Some(1000)),
        "{h:?}"
    );
    node.set_lifetime(&held, life(1000, None))
        .await
        .expect("release");
    let stub = ended(&node, &held, Duration::from_secs(5))
        .await
        .expect("its TTL ran on");
    assert_eq!(stub.ended.as_deref(), Some(TTL_ENDED));
    for id in [&idle, &busy, &held] {
        node.destroy(id).await.expect("destroy");
    }
    assert!(node.list().await.expect("node lists").is_empty());
    close(node).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_restarted_node_keeps_remaining_lifetimes_and_stubs() {
    if !require_root() {
        return;
    }
    let _turn = TURN.lock().await;
    let node = open_clean().await;
    let (short, long) = (new_id("short"), new_id("long"));
    let start = Instant::now();
    node.create(spec(&short, life(500, None)))
        .await
        .expect("create");
    node.create(spec(&long, life(5000, None)))
        .await
        .expect("create");
    // The node got the create before this: its clock has run at least as long.
    let created = Instant::now();
    ended(&node, &short, Duration::from_secs(5))
        .await
        .expect("short ended");
    close(node).await;

    let node = open().await;
    let elapsed = created.elapsed().as_millis() as u64;
    let stub = listed(&node, &short)
        .await
        .expect("the stub outlived the restart");
    assert_eq!(stub.ended.as_deref(), Some(TTL_ENDED));
    let l = listed(&node, &long).await.expect("adopted");
    let left = l.ttl_left_ms.expect("its TTL");
    assert!(
        l.alive && left <= 5000 - elapsed.min(5000),
        "the restart kept what was left ({left} ms after {elapsed} ms): {l:?}"
    );
    assert!(l.age_ms >= elapsed, "{l:?}");
    let stub = ended(&node, &long, Duration::from_secs(8))
        .await
        .expect("long ended");
    assert_eq!(stub.ended.as_deref(), Some(TTL_ENDED));
    assert!(start.elapsed() < Duration::from_millis(5000 + 3000));
    torn_down(&node, &long).await;
    for id in [&short, &long] {
        node.destroy(id).await.expect("destroy");
    }
    close(node).await;
    let node = open().await;
    assert!(
        node.list().await.expect("node lists").is_empty(),
        "destroyed stubs stay gone"
    );
    close(node).await;
}

/// A paused sandbox's agent calls answer `paused` at once (a frozen agent would hold
/// them until a resume): an API server whose view is a moment behind another replica's
/// pause learns the state from the node.
#[tokio::test(flavor = "multi_thread")]
async fn agent_calls_on_a_paused_sandbox_answer_paused_at_once() {
    if !require_root() {
        return;
    }
    let _turn = TURN.lock().await;
    let node = open_clean().await;
    let id = new_id("paused");
    node.create(spec(&id, life(600_000, None)))
        .await
        .expect("create");
    node.pause(&id).await.expect("pause");
    let start = Instant::now();
    let e = tokio::time::timeout(Duration::from_secs(5), node.exec(&id, shell("true"), None))
        .await
        .expect("answered, not held by the frozen agent")
        .expect_err("paused");
    assert_eq!(e.code, ErrorCode::Paused, "{e:?}");
    let e = node
        .read_file(&id, "/etc/hostname", 0, None)
        .await
        .err()
        .expect("paused");
    assert_eq!(e.code, ErrorCode::Paused);
    assert!(start.elapsed() < Duration::from_secs(1));
    node.resume(&id).await.expect("resume");
    let r = node
        .exec(&id, shell("echo back"), None)
        .await
        .expect("exec");
    assert_eq!(r.stdout, "back\n");
    node.destroy(&id).await.expect("destroy");
    close(node).await;
}
