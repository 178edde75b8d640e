//! The server processes. `dsec serve`, the embedded single-node default, runs the control
//! plane and the node runtime in one process, state in an embedded redb file, HTTP API on
//! loopback. `dsec node` runs only the node runtime and serves it over the internal API
//! (`dsec-node-rpc`), joining a cluster when given API servers to heartbeat to;
//! `dsec apiserver` runs only the public API, over one such node or over the nodes that
//! register with it (records and registrations in etcd).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use dsec_control::{ControlConfig, ControlPlane};
use dsec_node::{LocalNode, NodeApi, NodeConfig};
use dsec_state::RedbStore;

use crate::cli::{ApiserverArgs, NodeArgs, ServeArgs};

/// Finds the agent binary: the flag, `DSEC_AGENT_BIN`, or `dsec-agent` next to `dsec`.
fn agent_bin(args: &ServeArgs) -> anyhow::Result<PathBuf> {
    let candidate = match (&args.agent_bin, std::env::var_os("DSEC_AGENT_BIN")) {
        (Some(p), _) => p.clone(),
        (None, Some(p)) => PathBuf::from(p),
        (None, None) => std::env::current_exe()
            .context("locating the dsec executable")?
            .with_file_name("dsec-agent"),
    };
    if !candidate.is_file() {
        bail!(
            "agent binary {} not found: build it (`cargo build --release -p dsec-agent`) or pass --agent-bin",
            candidate.display()
        );
    }
    Ok(candidate)
}

/// Marks every descriptor beyond stdio close-on-exec: whatever started `dsec serve` may
/// have left some open (a shell's pipes), and no program the node runs (sandbox inits
/// above all) may inherit them.
fn close_inherited_fds() {
    const CLOSE_RANGE_CLOEXEC: libc::c_uint = 1 << 2;
    // SAFETY: close_range with the CLOEXEC flag only changes descriptor flags.
    let r = unsafe {
        libc::syscall(
            libc::SYS_close_range,
            3,
            libc::c_uint::MAX,
            CLOSE_RANGE_CLOEXEC,
        )
    };
    if r != 0 {
        tracing::warn!(error = %std::io::Error::last_os_error(), "cannot mark inherited fds close-on-exec");
    }
}

/// The first executable `name` on PATH.
/// gVisor for level `gvisor`: `--gvisor-runtime`, else `runsc` from PATH if installed
/// (none: the level is unavailable), on `--gvisor-platform` or the best it has. A runsc
/// named on the command line that does not work is an error; one found in PATH is
/// skipped with a warning.
fn gvisor_of(args: &ServeArgs) -> anyhow::Result<Option<dsec_node::gvisor::Gvisor>> {
    let (runsc, named) = match &args.gvisor_runtime {
        Some(p) => (p.clone(), true),
        None => match find_in_path("runsc") {
            Some(p) => (p, false),
            None => return Ok(None),
        },
    };
    match dsec_node::gvisor::Gvisor::detect(runsc, args.gvisor_platform.as_deref()) {
        Ok(g) => {
            tracing::info!(runsc = %g.runsc.display(), platform = %g.platform, "isolation gvisor available");
            Ok(Some(g))
        }
        Err(e) if named || args.gvisor_platform.is_some() => {
            Err(anyhow::anyhow!("--gvisor-runtime: {e}"))
        }
        Err(e) => {
            tracing::warn!(error = %e, "runsc found but not usable: isolation gvisor is unavailable");
            Ok(None)
        }
    }
}

/// MicroVMs for level `microvm`: QEMU (`--microvm-qemu` or from PATH) and a guest kernel
/// (`--microvm-kernel` or the newest in /boot). Missing pieces make the level unavailable
/// with a warning, unless an option named them: then it is an error.
fn microvm_of(args: &ServeArgs) -> anyhow::Result<Option<dsec_node::microvm::MicroVmConfig>> {
    use dsec_vmm::qemu::{Accel, Vmm};
    let named = args.microvm_qemu.is_some()
        || args.microvm_kernel.is_some()
        || args.microvm_accel.is_some();
    let accel = match args.microvm_accel.as_deref() {
        Some("kvm") => Some(Accel::Kvm),
        Some(_) => Some(Accel::Tcg),
        None => None,
    };
    let found = Vmm::detect(args.microvm_qemu.clone(), accel).and_then(|mut vmm| {
        vmm.free_page_reporting = !args.microvm_no_free_page_reporting;
        let kernel = match &args.microvm_kernel {
            Some(k) => dsec_vmm::guest::GuestKernel::at(k)?,
            None => dsec_vmm::guest::GuestKernel::find()?,
        };
        Ok((vmm, kernel))
    });
    match found {
        Ok((vmm, kernel)) => {
            tracing::info!(qemu = %vmm.qemu.display(), accel = vmm.accel.name(), kernel = %kernel.release, "isolation microvm available");
            Ok(Some(dsec_node::microvm::MicroVmConfig {
                vmm,
                kernel,
                boot_timeout: args.microvm_boot_timeout,
            }))
        }
        Err(e) if named => Err(anyhow::anyhow!("--microvm-*: {e}")),
        Err(e) => {
            tracing::info!(reason = %e, "isolation microvm is unavailable");
            Ok(None)
        }
    }
}

fn find_in_path(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(name))
            .find(|p| p.is_file())
    })
}

/// Raises the soft open-files limit to the hard limit: every sandbox holds a few fds.
fn raise_nofile() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid rlimit struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

/// Kernel limits that cap how many sandboxes fit on a node, and the floor dsec raises
/// them to at start (never lowers): thousands of sandboxes need thousands of pids (each
/// sandbox's processes), inotify instances (editors, file watchers inside) and watches.
const KERNEL_FLOORS: &[(&str, u64)] = &[
    ("/proc/sys/kernel/pid_max", 4_194_304),
    ("/proc/sys/fs/inotify/max_user_instances", 8192),
    ("/proc/sys/fs/inotify/max_user_watches", 1_048_576),
];

fn raise_kernel_limits() {
    for (path, floor) in KERNEL_FLOORS {
        let current = std::fs::read_to_string(path)
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok());
        match current {
            Some(v) if v >= *floor => {}
            Some(v) => match std::fs::write(path, floor.to_string()) {
                Ok(()) => tracing::info!(path, from = v, to = floor, "raised kernel limit"),
                Err(e) => tracing::warn!(path, error = %e, "cannot raise kernel limit"),
            },
            None => tracing::warn!(path, "cannot read kernel limit"),
        }
    }
}

/// Installs logging, and span export when `otlp_endpoint` is given.
fn init_telemetry(
    service: &str,
    otlp_endpoint: Option<&str>,
) -> anyhow::Result<dsec_telemetry::Telemetry> {
    let telemetry = dsec_telemetry::init(service, otlp_endpoint).context("--otlp-endpoint")?;
    if let (true, Some(endpoint)) = (telemetry.exporting(), otlp_endpoint) {
        tracing::info!(endpoint, "exporting spans over OTLP");
    }
    Ok(telemetry)
}

/// Sends the spans not exported yet (off the runtime's threads: it blocks).
async fn flush(telemetry: dsec_telemetry::Telemetry) {
    if telemetry.exporting() {
        let _ = tokio::task::spawn_blocking(move || telemetry.shutdown()).await;
    }
}

fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .try_init();
}

/// `dsec lazy-serve CONFIG`: the lazy layer server `dsec serve --lazy-layers` starts; runs
/// until its mount goes away.
pub fn lazy_serve(config: &str) -> anyhow::Result<()> {
    init_tracing();
    let cfg: dsec_lazy::ServeConfig =
        serde_json::from_str(config).context("parsing the lazy layer server's configuration")?;
    dsec_lazy::server::serve(&cfg).context("serving lazy layers")
}

/// Starts the node runtime of this machine from `serve`'s node flags.
async fn open_node(
    args: &ServeArgs,
    command: &str,
    remote_gateway: Option<std::net::SocketAddrV4>,
) -> anyhow::Result<Arc<LocalNode>> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("dsec {command} must run as root: it creates namespaces, mounts and cgroups");
    }
    close_inherited_fds();
    raise_nofile();
    raise_kernel_limits();
    let agent_bin = agent_bin(args)?;
    let name = match &args.node_name {
        Some(n) => n.clone(),
        None => nix::unistd::gethostname()
            .ok()
            .and_then(|h| h.into_string().ok())
            .unwrap_or_else(|| "local".into()),
    };
    let gvisor = gvisor_of(args)?;
    let microvm = microvm_of(args)?;
    let node_cfg = NodeConfig {
        name,
        state_dir: args.state_dir.clone(),
        run_dir: args.run_dir.clone(),
        agent_bin,
        create_timeout: Duration::from_secs(30),
        disk: (args.disk_mb > 0).then_some(dsec_node::DiskSettings {
            default_mb: args.disk_mb,
            pool_size: args.disk_pool,
        }),
        swap_file: args.swap_file.clone().zip(args.swap_mb),
        admission: dsec_node::admission::AdmissionConfig {
            cpu_overcommit: args.cpu_overcommit,
            memory_reserve_bytes: args.memory_reserve_mb << 20,
            max_sandboxes: args.max_sandboxes,
        },
        cgroup_parent: args.cgroup_parent.clone(),
        cgroup_favor_dynmods: !args.keep_cgroup_mount,
        run_dir_tmpfs: !args.run_dir_on_disk,
        netns_pool: args.netns_pool,
        delete_concurrency: args.delete_concurrency,
        userns: (!args.no_userns).then(|| dsec_node::userns::UsernsConfig {
            base: args.userns_base,
            ranges: args.userns_ranges,
            scope: args.userns_scope.clone(),
        }),
        oci_runtime: args.oci_runtime.clone().or_else(|| find_in_path("runc")),
        gvisor,
        microvm,
        blob_store: args.blob_store.clone(),
        layer_cache_bytes: (args.layer_cache_mb > 0).then_some(args.layer_cache_mb << 20),
        lazy_chunk_cache_bytes: args.lazy_layers.then_some(args.chunk_cache_mb << 20),
        lazy_prefetch_window: Duration::from_secs(args.prefetch_window_s),
        lazy_launcher: None,
        reap_interval: dsec_node::config::DEFAULT_REAP_INTERVAL,
        max_recorded_calls: usize::try_from(args.max_recorded_calls).unwrap_or(usize::MAX),
        registry: dsec_registry::RegistryConfig {
            credentials: match &args.registry_auth {
                Some(path) => dsec_registry::Credentials::load(path)?,
                None => Default::default(),
            },
            allow: dsec_registry::Allow::from_flags(&args.allow_registry)?,
            insecure: args.insecure_registry.clone(),
            ..Default::default()
        },
        ref_ttl: Duration::from_millis(args.ref_cache_ms),
        chunk_size: args.chunk_kib << 10,
        network: (!args.no_network).then(|| dsec_net::NetConfig {
            subnet: args.sandbox_subnet,
            table: args.nft_table.clone(),
            link_prefix: args.link_prefix.clone(),
            dns_port: args.dns_port,
            upstream: args.dns_upstream,
            pool_size: args.net_pool,
            // The in-process gateway's sandbox port, behind the model address.
            model_gateway: match (&args.gateway_config, remote_gateway) {
                (Some(_), _) => Some(dsec_net::ModelGatewayTarget::Local {
                    port: args.gateway_sandbox_port,
                }),
                (None, Some(addr)) => Some(dsec_net::ModelGatewayTarget::Remote { addr }),
                (None, None) => None,
            }
            .map(|target| dsec_net::ModelGatewayNet {
                vip: args.model_address,
                target,
            }),
        }),
    };
    LocalNode::open(node_cfg)
        .await
        .context("starting the node runtime")
}

/// Resolves on SIGINT or SIGTERM.
async fn shutdown_signal() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => return std::future::pending().await,
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    tracing::info!("shutting down");
}

/// Reads the key at `path`, or makes one; says where it is.
fn key_file(path: &Path, what: &str) -> anyhow::Result<String> {
    let (key, created) = dsec_control::auth::load_or_create_key(path)
        .with_context(|| format!("reading or creating the {what} at {}", path.display()))?;
    if created {
        println!("generated {what} {key}");
        println!(
            "  (saved to {}, mode 0600; clients read it from there)",
            path.display()
        );
    } else {
        println!("{what} in {}", path.display());
    }
    Ok(key)
}

/// The blob store of batches: `spec`, or `batch-blobs` in the state directory.
fn open_batch_store(
    spec: Option<String>,
    state_dir: &std::path::Path,
) -> anyhow::Result<Arc<dyn dsec_blob::BlobStore>> {
    let spec = spec.unwrap_or_else(|| state_dir.join("batch-blobs").display().to_string());
    let store =
        dsec_blob::open(&spec).with_context(|| format!("opening the batch store {spec}"))?;
    Ok(Arc::from(store))
}

/// Runs the server until SIGINT or SIGTERM.
pub async fn run(args: ServeArgs) -> anyhow::Result<()> {
    let telemetry = init_telemetry("dsec-serve", args.otlp_endpoint.as_deref())?;
    let result = run_server(args).await;
    flush(telemetry).await;
    result
}

async fn run_server(args: ServeArgs) -> anyhow::Result<()> {
    let node = open_node(&args, "serve", None).await?;
    let local = node.clone();
    let key_path = args.state_dir.join("api-key");
    let (key, created) = dsec_control::auth::load_or_create_key(&key_path)
        .with_context(|| format!("reading or creating the API key at {}", key_path.display()))?;
    if created {
        println!("generated API key {key}");
        println!(
            "  (saved to {}, mode 0600; clients read it from there or DSEC_API_KEY)",
            key_path.display()
        );
    } else {
        println!("API key in {}", key_path.display());
    }
    let store = Arc::new(
        RedbStore::open(&args.state_dir.join("state.redb")).context("opening the state store")?,
    );
    let node_api: Arc<dyn NodeApi> = node;
    let batch_store = args.batch_store.clone().or_else(|| args.blob_store.clone());
    let gateway_config = match &args.gateway_config {
        Some(path) => Some(dsec_gateway::GatewayConfig::load(path)?),
        None => None,
    };
    let control = ControlConfig {
        job_suspend_stops_lifetime: !args.job_suspend_keeps_lifetime,
        slow_create_ms: args.slow_create_ms,
        events_retention_s: args.events_retention_s,
        batch_store: Some(open_batch_store(batch_store, &args.state_dir)?),
        model_gateway: gateway_config
            .as_ref()
            .map(|c| dsec_control::ModelGatewayLink {
                base_url: model_base_url(args.model_address),
                models: c.models.keys().cloned().collect(),
            }),
        ..ControlConfig::with_key(key)
    };
    let plane = ControlPlane::open(control, node_api, store)
        .await
        .map_err(|e| anyhow::anyhow!("starting the control plane: {}", e.message))?;
    if args.cleanup {
        return cleanup(&plane, local).await;
    }
    let gateway = match gateway_config {
        Some(config) => Some(start_gateway(&args, config, plane.iam().clone()).await?),
        None => None,
    };
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    println!("dsec listening on http://{}", listener.local_addr()?);
    let shutdown = shutdown_signal();
    let http = dsec_http::HttpOptions {
        upload_idle_timeout: std::time::Duration::from_secs(args.upload_idle_timeout_s),
        tcp_keepalive: std::time::Duration::from_secs(args.tcp_keepalive_s),
        audit: open_audit(
            args.audit_dir.as_deref(),
            &args.state_dir,
            args.audit_file_mb,
            args.audit_files,
        )?,
    };
    // The key is the bootstrap admin: `dsec tenant` / `dsec key` manage the rest.
    let admin = dsec_http::admin::admin_router(plane.iam().clone());
    let served = dsec_http::serve_with(listener, plane, http, admin, shutdown).await;
    for task in gateway.into_iter().flatten() {
        task.abort();
    }
    served.context("serving HTTP")?;
    stop(local).await
}

/// The `OPENAI_BASE_URL` of sandboxes: the model address, which their node answers.
fn model_base_url(address: std::net::SocketAddrV4) -> String {
    match address.port() {
        80 => format!("http://{}/v1", address.ip()),
        _ => format!("http://{address}/v1"),
    }
}

/// Starts the in-process model gateway (`dsec serve --gateway-config`): its own
/// listener for callers outside sandboxes, and the sandbox port the node redirects
/// sandboxes' model address to. Sandbox tokens are checked against `iam`.
async fn start_gateway(
    args: &ServeArgs,
    config: dsec_gateway::GatewayConfig,
    iam: Arc<dsec_iam::Iam>,
) -> anyhow::Result<Vec<tokio::task::JoinHandle<()>>> {
    let models = config.models.len();
    let ledger =
        crate::model_tokens::IamSpendLedger(dsec_iam::ModelSpendLedger::new(iam.clone(), "serve"));
    let gateway = Arc::new(
        dsec_gateway::Gateway::new(config)?
            .with_authority(Arc::new(crate::model_tokens::IamTokens(iam)))
            .with_spend_ledger(Arc::new(ledger)),
    );
    let outside = tokio::net::TcpListener::bind(args.gateway_listen)
        .await
        .with_context(|| {
            format!(
                "binding the gateway's --gateway-listen {}",
                args.gateway_listen
            )
        })?;
    let sandbox_addr = std::net::SocketAddr::from(([0, 0, 0, 0], args.gateway_sandbox_port));
    let sandboxes = tokio::net::TcpListener::bind(sandbox_addr)
        .await
        .with_context(|| format!("binding the gateway's --gateway-sandbox-port {sandbox_addr}"))?;
    println!(
        "model gateway serving {models} model(s) on http://{}/v1 (sandboxes: {})",
        outside.local_addr()?,
        model_base_url(args.model_address)
    );
    let mut tasks: Vec<_> = gateway.start_health_checks().into_iter().collect();
    tasks.extend(gateway.start_spend_ledger(crate::model_tokens::SPEND_EXCHANGE_EVERY));
    for (listener, what) in [(outside, "outside"), (sandboxes, "sandboxes")] {
        let gateway = gateway.clone();
        tasks.push(tokio::spawn(async move {
            let served =
                dsec_http::gateway::serve_gateway(listener, gateway, std::future::pending()).await;
            if let Err(e) = served {
                tracing::error!(listener = what, error = %e, "the model gateway stopped serving");
            }
        }));
    }
    Ok(tasks)
}

/// `dsec gateway`: the model gateway, until SIGINT or SIGTERM.
pub async fn run_gateway(args: crate::cli::GatewayArgs) -> anyhow::Result<()> {
    init_tracing();
    let config = dsec_gateway::GatewayConfig::load(&args.config)?;
    let models = config.models.len();
    let mut gateway = dsec_gateway::Gateway::new(config)?;
    if !args.etcd.is_empty() {
        // Sandbox tokens, as the API servers mint them into the cluster's store.
        let cfg = dsec_state::EtcdConfig::new(args.etcd.clone(), &args.etcd_prefix);
        let store = dsec_state::EtcdStore::connect(cfg)
            .await
            .with_context(|| format!("connecting to etcd at {}", args.etcd.join(",")))?;
        let iam = dsec_iam::Iam::new(Arc::new(store), None)
            .await
            .context("reading the cluster's model tokens")?;
        let iam = Arc::new(iam);
        let ledger = crate::model_tokens::IamSpendLedger(dsec_iam::ModelSpendLedger::new(
            iam.clone(),
            "gateway",
        ));
        gateway = gateway
            .with_authority(Arc::new(crate::model_tokens::IamTokens(iam)))
            .with_spend_ledger(Arc::new(ledger));
    }
    let gateway = Arc::new(gateway);
    let _probes = gateway.start_health_checks();
    let _ledger = gateway.start_spend_ledger(crate::model_tokens::SPEND_EXCHANGE_EVERY);
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    println!(
        "dsec gateway serving {models} model(s) on http://{}/v1",
        listener.local_addr()?
    );
    dsec_http::gateway::serve_gateway(listener, gateway.clone(), shutdown_signal())
        .await
        .context("serving the gateway")?;
    // What was charged since the last exchange, for the gateways that go on.
    if let Err(e) = gateway.exchange_spending().await {
        tracing::warn!(error = %e, "the last spending was not stored");
    }
    Ok(())
}

/// `dsec node`: the node runtime and its internal API, until SIGINT or SIGTERM.
pub async fn run_node(args: NodeArgs) -> anyhow::Result<()> {
    let telemetry = init_telemetry("dsec-node", args.serve.otlp_endpoint.as_deref())?;
    let result = run_node_server(args).await;
    flush(telemetry).await;
    result
}

async fn run_node_server(args: NodeArgs) -> anyhow::Result<()> {
    if args.serve.gateway_config.is_some() {
        bail!(
            "--gateway-config runs the model gateway inside `dsec serve`; in a cluster run \
             `dsec gateway` on its own"
        );
    }
    let node = open_node(&args.serve, "node", args.model_gateway).await?;
    if args.serve.cleanup {
        return cleanup_node(node).await;
    }
    let token_path = args
        .node_token_file
        .clone()
        .unwrap_or_else(|| args.serve.state_dir.join("node-token"));
    let token = key_file(&token_path, "node token")?;
    let listener = tokio::net::TcpListener::bind(args.serve.listen)
        .await
        .with_context(|| format!("binding {}", args.serve.listen))?;
    println!(
        "dsec node {} serving its internal API on http://{}",
        node.name(),
        listener.local_addr()?
    );
    let node_api: Arc<dyn NodeApi> = node.clone();
    let heartbeat = if args.apiserver.is_empty() {
        None
    } else {
        let url = match &args.advertise_url {
            Some(u) => u.clone(),
            None if listener.local_addr()?.ip().is_unspecified() => bail!(
                "--listen {} is a wildcard address: give --advertise-url, the URL API \
                 servers reach this node at",
                args.serve.listen
            ),
            None => format!("http://{}", listener.local_addr()?),
        };
        Some(join_cluster(&args, node_api.clone(), url, token.clone()).await?)
    };
    let app = dsec_node_rpc::server::router(node_api, token);
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown_signal())
        .await
        .context("serving the node's internal API")?;
    if let Some(h) = heartbeat {
        // Placements stop at once instead of when the lease runs out.
        h.shutdown().await;
    }
    stop(node).await
}

/// Registers the node with the cluster's API servers and keeps heartbeating its load.
async fn join_cluster(
    args: &NodeArgs,
    node: Arc<dyn NodeApi>,
    url: String,
    token: String,
) -> anyhow::Result<dsec_node_rpc::registration::Heartbeater> {
    use dsec_fleet::{Capacity, Load, NodeRegistration};
    use dsec_wire::v1::{Isolation, NetworkMode};
    let at_start = node.capacity().await;
    // Memory is admitted on what the host has free (less the node's reserve), so the
    // registered capacity is that at start and the load what has been taken since.
    let memory_bytes = at_start
        .memory_available_bytes
        .saturating_sub(at_start.memory_reserve_bytes);
    let mut isolation = vec![Isolation::Container];
    isolation.extend(
        node.isolation_levels()
            .into_iter()
            .map(|l| l.isolation)
            .filter(|l| *l != Isolation::Container),
    );
    let network_modes = if args.serve.no_network {
        vec![NetworkMode::None]
    } else {
        vec![NetworkMode::None, NetworkMode::Allowlist, NetworkMode::Open]
    };
    let registration = NodeRegistration {
        name: node.name().to_string(),
        url,
        labels: args.labels.iter().cloned().collect(),
        isolation,
        network_modes,
        capacity: Capacity {
            cpu_millis: at_start.cpu_millis_allocatable,
            memory_bytes,
            max_sandboxes: at_start.max_sandboxes,
        },
        load: Load::default(),
        cached_layers: Vec::new(),
        version: env!("CARGO_PKG_VERSION").to_string(),
        boot_id: dsec_fleet::new_boot_id(),
    };
    registration
        .validate()
        .map_err(|e| anyhow::anyhow!("this node's registration: {e}"))?;
    // The heartbeat reads the load a poller keeps fresh (capacity() is async).
    let (tx, rx) = tokio::sync::watch::channel(Load::default());
    let poller = node.clone();
    tokio::spawn(async move {
        loop {
            let c = poller.capacity().await;
            let load = Load {
                cpu_millis: c.cpu_millis_requested,
                memory_bytes: memory_bytes.saturating_sub(
                    c.memory_available_bytes
                        .saturating_sub(c.memory_reserve_bytes),
                ),
                sandboxes: c.sandboxes,
            };
            if tx.send(load).is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    });
    println!(
        "node {} joining the cluster through {}",
        registration.name,
        args.apiserver.join(",")
    );
    let cfg = dsec_node_rpc::registration::HeartbeaterConfig::new(args.apiserver.clone(), token);
    dsec_node_rpc::registration::Heartbeater::start(cfg, registration, move || {
        dsec_node_rpc::registration::Report {
            load: *rx.borrow(),
            cached_layers: Vec::new(),
        }
    })
    .map_err(|e| anyhow::anyhow!("joining the cluster: {e}"))
}

/// `dsec apiserver`: the public API over a remote node, until SIGINT or SIGTERM.
pub async fn run_apiserver(args: ApiserverArgs) -> anyhow::Result<()> {
    let telemetry = init_telemetry("dsec-apiserver", args.otlp_endpoint.as_deref())?;
    let result = run_apiserver_server(args).await;
    flush(telemetry).await;
    result
}

async fn run_apiserver_server(args: ApiserverArgs) -> anyhow::Result<()> {
    std::fs::create_dir_all(&args.state_dir)
        .with_context(|| format!("creating {}", args.state_dir.display()))?;
    let token = std::fs::read_to_string(&args.node_token_file)
        .with_context(|| format!("reading the node token {}", args.node_token_file.display()))?;
    let token = token.trim().to_string();
    if args.node.is_none() && args.etcd.is_empty() {
        bail!(
            "give --node URL (drive one node) or --etcd URLS (drive the nodes that register \
             with `dsec node --apiserver`)"
        );
    }
    let key_path = args
        .api_key_file
        .clone()
        .unwrap_or_else(|| args.state_dir.join("api-key"));
    let key = key_file(&key_path, "API key")?;
    // With etcd, replicas share the records (and none may reconcile the node alone).
    let (store, sole_owner): (Arc<dyn dsec_state::StateStore>, bool) = if args.etcd.is_empty() {
        let path = args.state_dir.join("state.redb");
        let store = RedbStore::open(&path)
            .with_context(|| format!("opening the state store {}", path.display()))?;
        (Arc::new(store), true)
    } else {
        let cfg = dsec_state::EtcdConfig::new(args.etcd.clone(), &args.etcd_prefix);
        let store = dsec_state::EtcdStore::connect(cfg)
            .await
            .with_context(|| format!("connecting to etcd at {}", args.etcd.join(",")))?;
        (Arc::new(store), false)
    };
    let control = ControlConfig {
        job_suspend_stops_lifetime: !args.job_suspend_keeps_lifetime,
        slow_create_ms: args.slow_create_ms,
        events_retention_s: args.events_retention_s,
        batch_store: Some(open_batch_store(args.batch_store.clone(), &args.state_dir)?),
        sole_owner,
        model_gateway: (!args.model_gateway_models.is_empty()).then(|| {
            dsec_control::ModelGatewayLink {
                base_url: model_base_url(args.model_address),
                models: args.model_gateway_models.clone(),
            }
        }),
        ..ControlConfig::with_key(key)
    };
    let (nodes, registration): (Arc<dyn dsec_control::NodeSet>, axum::Router) = match &args.node {
        Some(url) => {
            let node = dsec_node_rpc::client::RemoteNode::connect(url, &token)
                .await
                .map_err(|e| anyhow::anyhow!("connecting to node {url}: {}", e.message))?;
            println!("node {} at {url}", node.name());
            (
                Arc::new(dsec_control::SingleNode::new(Arc::new(node))),
                axum::Router::new(),
            )
        }
        None => {
            let registry = dsec_fleet::Registry::new(store.clone(), Default::default());
            let placement = dsec_fleet::PlacementConfig {
                overflow_pools: args.overflow_pools.iter().cloned().collect(),
                overflow_threshold: args.overflow_threshold,
                ..Default::default()
            };
            let dial_token = token.clone();
            let dial: dsec_control::nodes::Dialer = Arc::new(move |reg| {
                let info = dsec_node_rpc::NodeInfo {
                    name: reg.name.clone(),
                    cgroup_version: String::new(),
                };
                dsec_node_rpc::client::RemoteNode::known(&reg.url, &dial_token, info)
                    .map(|node| Arc::new(node) as Arc<dyn NodeApi>)
            });
            let fleet = dsec_control::FleetNodes::new(
                dsec_fleet::FleetView::start(store.clone()),
                dsec_fleet::Placer::new(placement),
                registry.clone(),
                dial,
            );
            println!("driving the nodes that register with this cluster");
            (
                Arc::new(fleet),
                dsec_node_rpc::registration::router(registry, token.clone()),
            )
        }
    };
    let plane = ControlPlane::open_on(control, nodes, store)
        .await
        .map_err(|e| anyhow::anyhow!("starting the control plane: {}", e.message))?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    println!(
        "dsec apiserver listening on http://{}",
        listener.local_addr()?
    );
    let http = dsec_http::HttpOptions {
        upload_idle_timeout: Duration::from_secs(args.upload_idle_timeout_s),
        tcp_keepalive: Duration::from_secs(args.tcp_keepalive_s),
        audit: open_audit(
            args.audit_dir.as_deref(),
            &args.state_dir,
            args.audit_file_mb,
            args.audit_files,
        )?,
    };
    let extra = registration.merge(dsec_http::admin::admin_router(plane.iam().clone()));
    dsec_http::serve_with(listener, plane, http, extra, shutdown_signal())
        .await
        .context("serving HTTP")
}

/// A graceful stop once HTTP is done: live sandboxes keep running (and what they need
/// stays on the host) for the next start to adopt; with none left, the node leaves no
/// trace but its state directory.
async fn stop(node: Arc<LocalNode>) -> anyhow::Result<()> {
    let left = tokio::task::spawn_blocking(move || node.shutdown())
        .await
        .context("stopping the node")?;
    if left {
        tracing::info!("stopped; sandboxes keep running and are re-adopted on the next start");
    } else {
        tracing::info!("stopped; no sandbox was left, so nothing of the node stays on the host");
    }
    Ok(())
}

/// `dsec node --cleanup`: destroys every sandbox of the node, then stops as a node with
/// none left. A node keeps no records (the cluster's API servers do): theirs for these
/// sandboxes turn `lost` and are removed by their reapers, or by a delete.
async fn cleanup_node(node: Arc<LocalNode>) -> anyhow::Result<()> {
    let sandboxes = node
        .list()
        .await
        .map_err(|e| anyhow::anyhow!("listing sandboxes: {}", e.message))?;
    for sb in sandboxes {
        node.destroy(&sb.id)
            .await
            .map_err(|e| anyhow::anyhow!("destroying sandbox {}: {}", sb.id, e.message))?;
        println!("destroyed sandbox {}", sb.id);
    }
    stop(node).await?;
    println!("removed this node's traces from the host");
    Ok(())
}

/// `dsec serve --cleanup`: deletes every sandbox (of every tenant), then stops as a node
/// with none left.
async fn cleanup(plane: &Arc<ControlPlane>, node: Arc<LocalNode>) -> anyhow::Result<()> {
    use dsec_control::{Principal, SandboxApi, Scope};
    let tenants = plane
        .iam()
        .list_tenants()
        .await
        .map_err(|e| anyhow::anyhow!("listing tenants: {e}"))?;
    for tenant in tenants {
        // Each tenant's sandboxes, as that tenant sees them.
        let caller = Principal {
            tenant: tenant.name,
            key_id: dsec_iam::BOOTSTRAP_KEY_ID.into(),
            scopes: vec![Scope::Sandboxes],
        };
        let list = plane
            .list_sandboxes(&caller, Default::default())
            .await
            .map_err(|e| anyhow::anyhow!("listing sandboxes: {}", e.message))?;
        for sb in list.sandboxes {
            plane
                .delete_sandbox(&caller, &sb.id)
                .await
                .map_err(|e| anyhow::anyhow!("deleting sandbox {}: {}", sb.id, e.message))?;
            println!("deleted sandbox {}", sb.id);
        }
    }
    stop(node).await?;
    println!("removed this node's traces from the host");
    Ok(())
}

/// The audit log the flags ask for (`None` with `--audit-files 0`).
fn open_audit(
    dir: Option<&std::path::Path>,
    state_dir: &std::path::Path,
    file_mb: u64,
    files: usize,
) -> anyhow::Result<Option<std::sync::Arc<dsec_http::audit::AuditLog>>> {
    if files == 0 {
        return Ok(None);
    }
    if file_mb == 0 {
        anyhow::bail!("--audit-file-mb must be at least 1 (turn the log off with --audit-files 0)");
    }
    let dir = dir.map_or_else(|| state_dir.join("audit"), std::path::Path::to_path_buf);
    let cfg = dsec_http::audit::AuditConfig {
        dir: dir.clone(),
        file_bytes: file_mb.saturating_mul(1 << 20),
        files,
    };
    dsec_http::audit::AuditLog::open(cfg)
        .map(Some)
        .with_context(|| format!("opening the audit log in {}", dir.display()))
}
