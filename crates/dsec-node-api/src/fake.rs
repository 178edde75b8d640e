//! [`FakeNode`]: a node in memory, for unit tests of what sits above [`NodeApi`]
//! (the control plane, placement, retries) without root, namespaces or an agent.
//!
//! Sandboxes cost nothing: each is an entry with a small in-memory file system. Commands
//! understand a handful of words (`echo`, `cat FILE`, `exit N`, `true`, `false`, and
//! `sleep SECS` in `exec`); anything else exits 127. Tests steer it: a capacity limit,
//! a failure injected into the next create, a node that is down, slow pings, agents
//! frozen while paused, and counters of what was called.
//!
//! Lifetimes follow the local node's rules (see [`crate::lifetime`]) on a clock that
//! stands still until the test moves it: [`FakeNode::advance`] moves it and ends what
//! is due, [`FakeNode::reap_now`] ends what is due without moving it.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use bytes::Bytes;
use futures::StreamExt;

use dsec_wire::agent::{Command, ExecSpec, ExitInfo, FileInfo, FileKind, Reply, Request};
use dsec_wire::v1::{
    ExecEvent, ExecResult, GcRequest, GcResult, Image, ImageConfig, LayerStatsList, NetworkPolicy,
    NodeCapacity, WriteResult,
};
use dsec_wire::{ApiError, ErrorCode};

use crate::lifetime::{Clocks, Lifetime};
use crate::{
    ByteStream, EventStream, ImportProgressSink, ImportSource, NodeApi, NodeCreateSpec, NodeResult,
    NodeSandbox,
};

/// One fake sandbox.
#[derive(Debug, Clone)]
struct FakeSandbox {
    spec: NodeCreateSpec,
    paused: bool,
    /// Files by absolute path.
    files: BTreeMap<String, Vec<u8>>,
    /// Its lifetime.
    clocks: Clocks,
}

impl FakeSandbox {
    fn new(spec: NodeCreateSpec, now: u64) -> Self {
        Self {
            clocks: Clocks::new(spec.lifetime, now),
            spec,
            paused: false,
            files: BTreeMap::new(),
        }
    }

    fn listed(&self, now: u64) -> NodeSandbox {
        NodeSandbox {
            id: self.spec.id.clone(),
            image_digest: fake_digest(&self.spec.image),
            pid: 0,
            alive: true,
            disk_mb: None,
            ip: None,
            age_ms: self.clocks.age_ms(now),
            idle_ms: self.clocks.idle_ms(now),
            ttl_left_ms: self.clocks.ttl_left_ms(now),
            ended: None,
        }
    }
}

#[derive(Debug, Default)]
struct State {
    sandboxes: HashMap<String, FakeSandbox>,
    /// Sandboxes whose lifetime ended, until destroyed.
    ended: BTreeMap<String, NodeSandbox>,
    /// The node's clock (ms); moves only with [`FakeNode::advance`].
    now_ms: u64,
    images: BTreeMap<String, Image>,
    /// An error the next create answers with.
    fail_next_create: Option<ApiError>,
    /// Every call fails with `agent_unavailable` (the node is unreachable).
    down: bool,
    /// At most this many sandboxes (0: no limit).
    max_sandboxes: usize,
    /// At most this much requested CPU (millicores) and memory (bytes) in all.
    admit: Option<(u64, u64)>,
    /// How long each ping takes.
    ping_latency: std::time::Duration,
    /// Set: paused sandboxes act frozen (pings wait for the resume), and a resume
    /// thaws this long after it is asked.
    freeze: Option<std::time::Duration>,
    /// Creates wait while this is set (a node slow to build, for a test to act meanwhile).
    stall_creates: bool,
}

/// What a [`FakeNode`] was asked to do, for assertions.
#[derive(Debug, Default)]
pub struct FakeCounters {
    /// Sandboxes created.
    pub creates: AtomicU64,
    /// Create calls, counted as they arrive (before any refusal or stall).
    pub create_calls: AtomicU64,
    /// Destroy calls (including of unknown ids).
    pub destroys: AtomicU64,
    /// Commands run (exec and exec_stream).
    pub execs: AtomicU64,
}

/// An in-memory node.
#[derive(Debug)]
pub struct FakeNode {
    name: String,
    state: Mutex<State>,
    /// What was called.
    pub counters: FakeCounters,
}

impl FakeNode {
    /// A node named `name` with one image, `base`, and no capacity limit.
    pub fn new(name: &str) -> Self {
        let node = Self {
            name: name.to_string(),
            state: Mutex::new(State::default()),
            counters: FakeCounters::default(),
        };
        node.add_image("base");
        node
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds an image of one layer named `name`.
    pub fn add_image(&self, name: &str) -> Image {
        let image = Image {
            name: name.to_string(),
            digest: fake_digest(name),
            size_bytes: 0,
            created_at: 0,
            source: "fake".into(),
            layers: vec![fake_digest(name)],
            config: ImageConfig::default(),
        };
        self.state().images.insert(name.to_string(), image.clone());
        image
    }

    /// Limits the node to `n` sandboxes (0: no limit); more answer `capacity`.
    pub fn set_max_sandboxes(&self, n: usize) {
        self.state().max_sandboxes = n;
    }

    /// Admits sandboxes only while their requests add up to at most `cpu_millis` and
    /// `memory_bytes`, as a real node's admission does; more answer `capacity`.
    pub fn set_admission(&self, cpu_millis: u64, memory_bytes: u64) {
        self.state().admit = Some((cpu_millis, memory_bytes));
    }

    /// The next create fails with `error` (and creates nothing).
    pub fn fail_next_create(&self, error: ApiError) {
        self.state().fail_next_create = Some(error);
    }

    /// While `down`, every call fails with `agent_unavailable` and `list` is empty, as
    /// a node that cannot be reached.
    pub fn set_down(&self, down: bool) {
        self.state().down = down;
    }

    /// While `stall`, creates wait before doing anything (dropping one meanwhile leaves
    /// nothing on the node).
    pub fn stall_creates(&self, stall: bool) {
        self.state().stall_creates = stall;
    }

    /// Every ping takes `latency` (an agent slow to answer).
    pub fn set_ping_latency(&self, latency: std::time::Duration) {
        self.state().ping_latency = latency;
    }

    /// Paused sandboxes act as frozen agents do: a ping waits until its sandbox is
    /// resumed, and a resume thaws it `thaw` after it is asked.
    pub fn freeze_on_pause(&self, thaw: std::time::Duration) {
        self.state().freeze = Some(thaw);
    }

    /// Ids of the sandboxes the node runs, sorted (not the ended ones).
    pub fn sandbox_ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = self.state().sandboxes.keys().cloned().collect();
        ids.sort();
        ids
    }

    /// What the node's sandboxes request in all, as its heartbeat reports it: CPU
    /// (millicores), memory (bytes) and the number of sandboxes.
    pub fn requested(&self) -> (u64, u64, u64) {
        let st = self.state();
        st.sandboxes.values().fold((0, 0, 0), |(c, m, n), s| {
            (c + s.spec.cpu_millis, m + s.spec.memory_bytes, n + 1)
        })
    }

    /// Ids of the sandboxes whose lifetime ended and that are not destroyed yet, sorted.
    pub fn ended_ids(&self) -> Vec<String> {
        self.state().ended.keys().cloned().collect()
    }

    /// Starts a sandbox the control plane did not ask for (as one left by a crash).
    pub fn adopt(&self, spec: NodeCreateSpec) {
        let mut st = self.state();
        let sb = FakeSandbox::new(spec, st.now_ms);
        st.sandboxes.insert(sb.spec.id.clone(), sb);
    }

    /// Moves the node's clock on by `by`, then ends the sandboxes that are due (as the
    /// local node's reaper would); returns their ids.
    pub fn advance(&self, by: std::time::Duration) -> Vec<String> {
        {
            let mut st = self.state();
            let ms = u64::try_from(by.as_millis()).unwrap_or(u64::MAX);
            st.now_ms = st.now_ms.saturating_add(ms);
        }
        self.reap_now()
    }

    /// Ends the sandboxes whose TTL or idle timeout ran out by the node's clock; returns
    /// their ids, sorted. Each stays listed as ended until destroyed.
    pub fn reap_now(&self) -> Vec<String> {
        let mut st = self.state();
        let now = st.now_ms;
        let mut due: Vec<(String, &'static str)> = st
            .sandboxes
            .iter()
            .filter_map(|(id, sb)| sb.clocks.due(now).map(|r| (id.clone(), r)))
            .collect();
        due.sort();
        for (id, reason) in &due {
            if let Some(sb) = st.sandboxes.remove(id) {
                let mut stub = sb.listed(now);
                stub.alive = false;
                stub.ttl_left_ms = None;
                stub.ended = Some(reason.to_string());
                st.ended.insert(id.clone(), stub);
            }
        }
        due.into_iter().map(|(id, _)| id).collect()
    }

    /// Runs `f` on a live, unpaused sandbox; with `activity`, the call counts as its
    /// activity.
    fn with_sandbox_as<T>(
        &self,
        id: &str,
        activity: bool,
        f: impl FnOnce(&mut FakeSandbox) -> NodeResult<T>,
    ) -> NodeResult<T> {
        let mut st = self.state();
        if st.down {
            return Err(unreachable_node(&self.name));
        }
        let now = st.now_ms;
        let Some(sb) = st.sandboxes.get_mut(id) else {
            return Err(gone(&st, id));
        };
        if sb.paused {
            return Err(ApiError::new(
                ErrorCode::Paused,
                format!("sandbox {id} is paused"),
            ));
        }
        if activity {
            sb.clocks.touch(now);
        }
        f(sb)
    }

    /// Runs `f` on a live, unpaused sandbox, as its activity.
    fn with_sandbox<T>(
        &self,
        id: &str,
        f: impl FnOnce(&mut FakeSandbox) -> NodeResult<T>,
    ) -> NodeResult<T> {
        self.with_sandbox_as(id, true, f)
    }

    fn up(&self) -> NodeResult<()> {
        if self.state().down {
            return Err(unreachable_node(&self.name));
        }
        Ok(())
    }

    fn run(&self, id: &str, spec: &ExecSpec, stdin: Option<Bytes>) -> NodeResult<ExecResult> {
        self.counters.execs.fetch_add(1, Ordering::Relaxed);
        self.with_sandbox(id, |sb| Ok(run_command(sb, &spec.cmd, stdin)))
    }
}

fn fake_digest(name: &str) -> String {
    // Not a hash anyone verifies: a stable, valid-looking digest per name.
    let mut hex = String::new();
    for b in name.bytes().cycle().take(32) {
        hex.push_str(&format!("{b:02x}"));
    }
    format!("sha256:{hex}")
}

fn not_found(id: &str) -> ApiError {
    ApiError::new(
        ErrorCode::NotFound,
        format!("sandbox {id} not found on this node"),
    )
}

/// The error for a sandbox the node does not run: unknown, or ended.
fn gone(st: &State, id: &str) -> ApiError {
    match st.ended.get(id).and_then(|s| s.ended.as_deref()) {
        Some(reason) => ApiError::new(
            ErrorCode::NotFound,
            format!("sandbox {id} ended on this node: {reason}"),
        ),
        None => not_found(id),
    }
}

fn unreachable_node(name: &str) -> ApiError {
    ApiError::new(
        ErrorCode::AgentUnavailable,
        format!("node {name} is unreachable"),
    )
}

fn unsupported(what: &str) -> ApiError {
    ApiError::new(
        ErrorCode::BadRequest,
        format!("the fake node does not do {what}"),
    )
}

/// The words of a command.
fn words(cmd: &Command) -> Vec<String> {
    match cmd {
        Command::Argv(argv) => argv.clone(),
        Command::Shell(line) => line.split_whitespace().map(str::to_string).collect(),
    }
}

fn run_command(sb: &mut FakeSandbox, cmd: &Command, stdin: Option<Bytes>) -> ExecResult {
    let words = words(cmd);
    let (mut stdout, mut stderr, mut code) = (Vec::new(), Vec::new(), 0);
    match words.first().map(String::as_str) {
        Some("echo") => {
            stdout = words[1..].join(" ").into_bytes();
            stdout.push(b'\n');
        }
        Some("cat") if words.len() == 1 => stdout = stdin.map(|b| b.to_vec()).unwrap_or_default(),
        Some("cat") => match sb.files.get(&words[1]) {
            Some(b) => stdout = b.clone(),
            None => {
                stderr = format!("cat: {}: No such file or directory\n", words[1]).into_bytes();
                code = 1;
            }
        },
        Some("exit") => code = words.get(1).and_then(|w| w.parse().ok()).unwrap_or(0),
        Some("true" | "sleep") => {}
        Some("false") => code = 1,
        Some(other) => {
            stderr = format!("{other}: command not found\n").into_bytes();
            code = 127;
        }
        None => {}
    }
    ExecResult {
        exit: ExitInfo {
            exit_code: Some(code),
            stdout_bytes: stdout.len() as u64,
            stderr_bytes: stderr.len() as u64,
            ..Default::default()
        },
        stdout: String::from_utf8_lossy(&stdout).into_owned(),
        stderr: String::from_utf8_lossy(&stderr).into_owned(),
        oom_killed: false,
    }
}

fn file_info(path: &str, size: u64, kind: FileKind) -> FileInfo {
    FileInfo {
        name: path.rsplit('/').next().unwrap_or_default().to_string(),
        path: path.to_string(),
        kind,
        size,
        mode: 0o644,
        mtime: 0,
        uid: 0,
        gid: 0,
        symlink_target: None,
    }
}

/// Reads a whole body (the fake keeps files in memory).
async fn collect(mut body: ByteStream) -> NodeResult<Vec<u8>> {
    let mut all = Vec::new();
    while let Some(chunk) = body.next().await {
        all.extend_from_slice(&chunk?);
    }
    Ok(all)
}

#[async_trait::async_trait]
impl NodeApi for FakeNode {
    fn name(&self) -> &str {
        &self.name
    }

    fn cgroup_version(&self) -> &'static str {
        "v2"
    }

    async fn create(&self, spec: NodeCreateSpec) -> NodeResult<NodeSandbox> {
        self.counters.create_calls.fetch_add(1, Ordering::Relaxed);
        while self.state().stall_creates {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        let mut st = self.state();
        if st.down {
            return Err(unreachable_node(&self.name));
        }
        if let Some(e) = st.fail_next_create.take() {
            return Err(e);
        }
        if st.max_sandboxes > 0 && st.sandboxes.len() >= st.max_sandboxes {
            return Err(ApiError::new(
                ErrorCode::Capacity,
                format!("node {} at capacity: sandboxes", self.name),
            ));
        }
        if let Some((cpu, mem)) = st.admit {
            let (c, m) = st.sandboxes.values().fold((0, 0), |(c, m), s| {
                (c + s.spec.cpu_millis, m + s.spec.memory_bytes)
            });
            if c + spec.cpu_millis > cpu || m + spec.memory_bytes > mem {
                return Err(ApiError::new(
                    ErrorCode::Capacity,
                    format!("node {} at capacity: requests", self.name),
                ));
            }
        }
        let image = st.images.get(&spec.image).cloned().ok_or_else(|| {
            ApiError::new(
                ErrorCode::ImageNotFound,
                format!("image {} not found", spec.image),
            )
        })?;
        if st.sandboxes.contains_key(&spec.id) || st.ended.contains_key(&spec.id) {
            return Err(ApiError::new(
                ErrorCode::Conflict,
                format!("sandbox {} exists", spec.id),
            ));
        }
        let id = spec.id.clone();
        let sb = FakeSandbox::new(spec, st.now_ms);
        let mut created = sb.listed(st.now_ms);
        created.image_digest = image.digest;
        st.sandboxes.insert(id, sb);
        self.counters.creates.fetch_add(1, Ordering::Relaxed);
        Ok(created)
    }

    async fn destroy(&self, id: &str) -> NodeResult<()> {
        self.up()?;
        self.counters.destroys.fetch_add(1, Ordering::Relaxed);
        let mut st = self.state();
        st.sandboxes.remove(id);
        st.ended.remove(id);
        Ok(())
    }

    async fn list(&self) -> NodeResult<Vec<NodeSandbox>> {
        self.up()?;
        let st = self.state();
        Ok(st
            .sandboxes
            .values()
            .map(|sb| sb.listed(st.now_ms))
            .chain(st.ended.values().cloned())
            .collect())
    }

    async fn set_lifetime(&self, id: &str, lifetime: Lifetime) -> NodeResult<()> {
        self.up()?;
        let mut st = self.state();
        let now = st.now_ms;
        let Some(sb) = st.sandboxes.get_mut(id) else {
            return Err(gone(&st, id));
        };
        sb.clocks.set(lifetime, now);
        sb.clocks.touch(now);
        Ok(())
    }

    async fn pause(&self, id: &str) -> NodeResult<(u64, u64)> {
        self.with_sandbox_as(id, false, |sb| {
            sb.paused = true;
            sb.clocks.paused = true;
            Ok((sb.spec.memory_bytes / 4, 0))
        })
    }

    async fn resume(&self, id: &str) -> NodeResult<()> {
        self.up()?;
        let thaw = self.state().freeze;
        if let Some(thaw) = thaw {
            tokio::time::sleep(thaw).await;
        }
        let mut st = self.state();
        let now = st.now_ms;
        let Some(sb) = st.sandboxes.get_mut(id) else {
            return Err(gone(&st, id));
        };
        sb.paused = false;
        sb.clocks.paused = false;
        sb.clocks.touch(now);
        Ok(())
    }

    async fn commit(
        &self,
        id: &str,
        name: &str,
        previous_diffs: Vec<String>,
        config: ImageConfig,
    ) -> NodeResult<(Image, Option<String>)> {
        let base = self.with_sandbox(id, |sb| Ok(sb.spec.image.clone()))?;
        let diff = fake_digest(&format!("{id}/{name}"));
        let mut layers = vec![fake_digest(&base)];
        layers.extend(previous_diffs);
        layers.push(diff.clone());
        let image = Image {
            name: name.to_string(),
            digest: diff.clone(),
            size_bytes: 0,
            created_at: 0,
            source: format!("commit of {id}"),
            layers,
            config,
        };
        self.state().images.insert(name.to_string(), image.clone());
        Ok((image, Some(diff)))
    }

    async fn set_network(&self, id: &str, policy: NetworkPolicy) -> NodeResult<()> {
        self.with_sandbox(id, |sb| {
            sb.spec.network = policy;
            Ok(())
        })
    }

    async fn capacity(&self) -> NodeCapacity {
        let st = self.state();
        NodeCapacity {
            cpu_millis_allocatable: 1_000_000,
            cpu_millis_requested: st.sandboxes.values().map(|s| s.spec.cpu_millis).sum(),
            memory_available_bytes: 64 << 30,
            memory_reserve_bytes: 0,
            sandboxes: st.sandboxes.len() as u64,
            max_sandboxes: st.max_sandboxes as u64,
            core_scheduling: false,
        }
    }

    async fn ping(&self, id: &str) -> NodeResult<()> {
        let (latency, frozen) = {
            let st = self.state();
            (st.ping_latency, st.freeze.is_some())
        };
        tokio::time::sleep(latency).await;
        while frozen && self.state().sandboxes.get(id).is_some_and(|s| s.paused) {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        // Not activity: the control plane's watchdog must not keep a sandbox alive.
        self.with_sandbox_as(id, false, |_| Ok(()))
    }

    async fn call(&self, id: &str, req: Request) -> NodeResult<Reply> {
        if !crate::is_unary(&req) {
            return Err(ApiError::new(
                ErrorCode::BadRequest,
                "this request streams: use its own NodeApi method",
            ));
        }
        self.with_sandbox(id, |sb| match req {
            Request::Ping => Ok(Reply::Pong {
                version: dsec_wire::agent::PROTOCOL_VERSION,
                pid: 1,
            }),
            Request::FileStat { path } => match sb.files.get(&path) {
                Some(b) => Ok(Reply::File(file_info(
                    &path,
                    b.len() as u64,
                    FileKind::File,
                ))),
                None => Err(ApiError::new(
                    ErrorCode::NotFound,
                    format!("{path}: no such file"),
                )),
            },
            Request::FileList { path } => {
                let dir = format!("{}/", path.trim_end_matches('/'));
                let entries = sb
                    .files
                    .iter()
                    .filter(|(p, _)| p.starts_with(&dir) && !p[dir.len()..].contains('/'))
                    .map(|(p, b)| file_info(p, b.len() as u64, FileKind::File))
                    .collect();
                Ok(Reply::Entries { entries })
            }
            Request::FileMkdir { .. } => Ok(Reply::Ok),
            Request::FileRemove { path, .. } => {
                sb.files.remove(&path);
                Ok(Reply::Ok)
            }
            Request::FileRename { from, to } => {
                let data = sb.files.remove(&from).ok_or_else(|| {
                    ApiError::new(ErrorCode::NotFound, format!("{from}: no such file"))
                })?;
                sb.files.insert(to, data);
                Ok(Reply::Ok)
            }
            other => Err(unsupported(&format!("{other:?}"))),
        })
    }

    async fn exec(&self, id: &str, spec: ExecSpec, stdin: Option<Bytes>) -> NodeResult<ExecResult> {
        let words = words(&spec.cmd);
        if let (Some("sleep"), Some(secs)) = (
            words.first().map(String::as_str),
            words.get(1).and_then(|w| w.parse::<f64>().ok()),
        ) {
            // A command that is silent for a while (the node's time: tokio's clock).
            tokio::time::sleep(std::time::Duration::from_secs_f64(secs.max(0.0))).await;
        }
        self.run(id, &spec, stdin)
    }

    async fn exec_stream(
        &self,
        id: &str,
        spec: ExecSpec,
        stdin: Option<Bytes>,
    ) -> NodeResult<EventStream> {
        let r = self.run(id, &spec, stdin)?;
        let mut events = vec![ExecEvent::Started { pid: 2 }];
        if !r.stdout.is_empty() {
            events.push(ExecEvent::Stdout { data: r.stdout });
        }
        if !r.stderr.is_empty() {
            events.push(ExecEvent::Stderr { data: r.stderr });
        }
        events.push(ExecEvent::Exit {
            exit: r.exit,
            oom_killed: r.oom_killed,
        });
        Ok(futures::stream::iter(events).boxed())
    }

    async fn process_output(
        &self,
        _id: &str,
        _pid: u32,
        _stdout_offset: u64,
        _stderr_offset: u64,
        _follow: bool,
    ) -> NodeResult<EventStream> {
        Err(unsupported("background processes"))
    }

    async fn process_stdin(
        &self,
        _id: &str,
        _pid: u32,
        _data: Bytes,
        _close: bool,
    ) -> NodeResult<()> {
        Err(unsupported("background processes"))
    }

    async fn read_file(
        &self,
        id: &str,
        path: &str,
        offset: u64,
        length: Option<u64>,
    ) -> NodeResult<(FileInfo, ByteStream)> {
        let data = self.with_sandbox(id, |sb| {
            sb.files
                .get(path)
                .cloned()
                .ok_or_else(|| ApiError::new(ErrorCode::NotFound, format!("{path}: no such file")))
        })?;
        let info = file_info(path, data.len() as u64, FileKind::File);
        let start = (offset as usize).min(data.len());
        let end = length.map_or(data.len(), |l| (start + l as usize).min(data.len()));
        Ok((info, crate::once_bytes(data[start..end].to_vec())))
    }

    async fn write_file(
        &self,
        id: &str,
        path: &str,
        _mode: Option<u32>,
        body: ByteStream,
    ) -> NodeResult<WriteResult> {
        self.with_sandbox(id, |_| Ok(()))?;
        // All or nothing: a body that breaks off writes nothing.
        let data = collect(body).await?;
        let bytes = data.len() as u64;
        self.with_sandbox(id, |sb| {
            sb.files.insert(path.to_string(), data);
            Ok(WriteResult { bytes })
        })
    }

    async fn download_tar(&self, _id: &str, _path: &str) -> NodeResult<ByteStream> {
        Err(unsupported("tar"))
    }

    async fn upload_tar(
        &self,
        _id: &str,
        _path: &str,
        _body: ByteStream,
    ) -> NodeResult<WriteResult> {
        Err(unsupported("tar"))
    }

    async fn list_images(&self) -> NodeResult<Vec<Image>> {
        self.up()?;
        Ok(self.state().images.values().cloned().collect())
    }

    async fn image(&self, name: &str) -> NodeResult<Image> {
        self.up()?;
        let st = self.state();
        st.images
            .get(name)
            .or_else(|| st.images.values().find(|i| i.digest == name))
            .cloned()
            .ok_or_else(|| {
                ApiError::new(ErrorCode::ImageNotFound, format!("image {name} not found"))
            })
    }

    async fn import_image(
        &self,
        name: &str,
        source: ImportSource,
        _flatten: bool,
        _progress: Option<ImportProgressSink>,
    ) -> NodeResult<Image> {
        self.up()?;
        if let ImportSource::Archive(body) = source {
            collect(body).await?;
        }
        Ok(self.add_image(name))
    }

    async fn remove_image(&self, name: &str) -> NodeResult<()> {
        self.up()?;
        match self.state().images.remove(name) {
            Some(_) => Ok(()),
            None => Err(ApiError::new(
                ErrorCode::ImageNotFound,
                format!("image {name} not found"),
            )),
        }
    }

    async fn gc_images(&self, _req: &GcRequest) -> NodeResult<GcResult> {
        Err(unsupported("image gc"))
    }

    async fn layer_stats(&self) -> NodeResult<LayerStatsList> {
        Err(unsupported("layer stats"))
    }

    async fn tag_image(
        &self,
        source: &str,
        name: &str,
        config: Option<ImageConfig>,
    ) -> NodeResult<Image> {
        let mut image = self.image(source).await?;
        image.name = name.to_string();
        if let Some(config) = config {
            image.config = config;
        }
        self.state().images.insert(name.to_string(), image.clone());
        Ok(image)
    }
}

/// A create spec of a small sandbox from `base`, for tests.
pub fn sandbox_spec(id: &str) -> NodeCreateSpec {
    NodeCreateSpec {
        id: id.into(),
        image: "base".into(),
        layers: vec![],
        cpu_millis: 1000,
        memory_bytes: 512 << 20,
        pids_max: 512,
        disk_mb: None,
        qos: Default::default(),
        env: Default::default(),
        workdir: "/".into(),
        user: None,
        network: Default::default(),
        writable_paths: vec![],
        tcp_bind: None,
        tcp_connect: None,
        isolation: Default::default(),
        labels: Default::default(),
        lifetime: Default::default(),
    }
}

/// A public-API exec request of a shell command line with no other options, for tests
/// of what sits above the node.
pub fn shell_request(cmd: &str) -> dsec_wire::v1::ExecRequest {
    dsec_wire::v1::ExecRequest {
        cmd: Command::Shell(cmd.into()),
        env: Default::default(),
        cwd: None,
        stdin: None,
        timeout_s: None,
        output_limit: None,
        user: None,
    }
}

/// An exec of a shell command line with no other options, for tests.
pub fn shell(cmd: &str) -> ExecSpec {
    ExecSpec {
        cmd: Command::Shell(cmd.into()),
        env: Default::default(),
        cwd: None,
        stdin: false,
        timeout_ms: None,
        stream: false,
        output_limit: None,
        user: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn runs_commands_and_keeps_files_per_sandbox() {
        let node = FakeNode::new("n1");
        node.create(sandbox_spec("a")).await.expect("fake call");
        node.create(sandbox_spec("b")).await.expect("fake call");
        node.write_file("a", "/f", None, crate::once_bytes("hi"))
            .await
            .expect("fake call");
        let r = node
            .exec("a", shell("cat /f"), None)
            .await
            .expect("fake call");
        assert_eq!((r.stdout.as_str(), r.exit.exit_code), ("hi", Some(0)));
        let r = node
            .exec("b", shell("cat /f"), None)
            .await
            .expect("fake call");
        assert_eq!(r.exit.exit_code, Some(1));
        let r = node
            .exec("a", shell("exit 3"), None)
            .await
            .expect("fake call");
        assert_eq!(r.exit.exit_code, Some(3));
    }

    #[tokio::test]
    async fn capacity_failures_and_down_are_steerable() {
        let node = FakeNode::new("n1");
        node.set_max_sandboxes(1);
        node.create(sandbox_spec("a")).await.expect("fake call");
        let e = node.create(sandbox_spec("b")).await.expect_err("must fail");
        assert_eq!(e.code, ErrorCode::Capacity);
        node.set_max_sandboxes(0);
        let one = sandbox_spec("x");
        node.set_admission(2 * one.cpu_millis - 1, u64::MAX);
        let e = node.create(sandbox_spec("b")).await.expect_err("must fail");
        assert_eq!(
            e.code,
            ErrorCode::Capacity,
            "a CPU request over the admission"
        );
        node.set_admission(u64::MAX, 2 * one.memory_bytes);
        node.fail_next_create(ApiError::new(ErrorCode::Failed, "boom"));
        assert_eq!(
            node.create(sandbox_spec("b"))
                .await
                .expect_err("must fail")
                .code,
            ErrorCode::Failed
        );
        node.create(sandbox_spec("b")).await.expect("fake call");
        node.set_down(true);
        // A node that does not answer lists nothing rather than an empty list.
        assert_eq!(
            node.list().await.expect_err("must fail").code,
            ErrorCode::AgentUnavailable
        );
        assert_eq!(
            node.ping("a").await.expect_err("must fail").code,
            ErrorCode::AgentUnavailable
        );
        node.set_down(false);
        assert_eq!(node.sandbox_ids(), ["a", "b"]);
        assert_eq!(
            node.requested(),
            (2 * one.cpu_millis, 2 * one.memory_bytes, 2),
            "a and b are requested"
        );
        node.destroy("a").await.expect("fake call");
        node.destroy("a").await.expect("fake call");
        assert_eq!(node.sandbox_ids(), ["b"]);
        assert_eq!(node.requested(), (one.cpu_millis, one.memory_bytes, 1));
    }

    #[tokio::test]
    async fn paused_sandboxes_refuse_agent_calls() {
        let node = FakeNode::new("n1");
        node.create(sandbox_spec("a")).await.expect("fake call");
        node.pause("a").await.expect("fake call");
        assert_eq!(
            node.ping("a").await.expect_err("must fail").code,
            ErrorCode::Paused
        );
        node.resume("a").await.expect("fake call");
        node.ping("a").await.expect("fake call");
    }

    fn lifetime(ttl_s: u64, idle_s: Option<u64>) -> Lifetime {
        Lifetime {
            ttl_ms: Some(ttl_s * 1000),
            idle_timeout_ms: idle_s.map(|s| s * 1000),
            held: false,
        }
    }

    fn spec_with(id: &str, life: Lifetime) -> NodeCreateSpec {
        NodeCreateSpec {
            lifetime: life,
            ..sandbox_spec(id)
        }
    }

    fn secs(s: u64) -> std::time::Duration {
        std::time::Duration::from_secs(s)
    }

    #[tokio::test]
    async fn a_ttl_ends_the_sandbox_into_a_stub_that_destroy_forgets() {
        let node = FakeNode::new("n1");
        node.create(spec_with("a", lifetime(10, None)))
            .await
            .expect("fake call");
        node.create(sandbox_spec("forever"))
            .await
            .expect("fake call");
        assert!(node.advance(secs(9)).is_empty());
        let listed = node.list().await.expect("node lists");
        let a = listed.iter().find(|s| s.id == "a").expect("listed");
        assert_eq!((a.age_ms, a.ttl_left_ms), (9000, Some(1000)));
        assert_eq!(node.advance(secs(1)), ["a"]);
        let stub = node
            .list()
            .await
            .expect("node lists")
            .into_iter()
            .find(|s| s.id == "a")
            .expect("the stub stays listed");
        assert_eq!(stub.ended.as_deref(), Some(crate::lifetime::TTL_ENDED));
        assert!(!stub.alive);
        let e = node
            .exec("a", shell("true"), None)
            .await
            .expect_err("ended");
        assert_eq!(e.code, ErrorCode::NotFound);
        assert!(e.message.contains("lifetime"), "{}", e.message);
        assert_eq!(
            node.set_lifetime("a", Lifetime::default())
                .await
                .expect_err("ended")
                .code,
            ErrorCode::NotFound
        );
        node.destroy("a").await.expect("fake call");
        node.destroy("a").await.expect("fake call");
        assert!(node.ended_ids().is_empty());
        assert_eq!(node.sandbox_ids(), ["forever"]);
        assert!(node.advance(secs(1_000_000)).is_empty());
    }

    #[tokio::test]
    async fn idle_timeout_counts_activity_but_not_pings_nor_paused_time() {
        let node = FakeNode::new("n1");
        node.create(spec_with("a", lifetime(1000, Some(10))))
            .await
            .expect("fake call");
        node.advance(secs(8));
        node.exec("a", shell("true"), None)
            .await
            .expect("fake call");
        assert!(node.advance(secs(8)).is_empty(), "the exec was activity");
        node.ping("a").await.expect("fake call");
        assert_eq!(node.list().await.expect("node lists")[0].idle_ms, 8000);
        node.pause("a").await.expect("fake call");
        assert!(node.advance(secs(100)).is_empty(), "paused: no idleness");
        node.resume("a").await.expect("fake call");
        assert!(node.advance(secs(9)).is_empty(), "resume was activity");
        assert_eq!(node.advance(secs(1)), ["a"], "pings kept nothing alive");
        let stub = &node.list().await.expect("node lists")[0];
        assert_eq!(stub.ended.as_deref(), Some(crate::lifetime::IDLE_TIMEOUT));
    }

    #[tokio::test]
    async fn a_paused_sandbox_ttl_runs_unless_held_and_set_lifetime_replaces_it() {
        let node = FakeNode::new("n1");
        for id in ["paused", "held"] {
            node.create(spec_with(id, lifetime(10, Some(1))))
                .await
                .expect("fake call");
            node.pause(id).await.expect("fake call");
        }
        node.advance(secs(4));
        node.set_lifetime(
            "held",
            Lifetime {
                ttl_ms: Some(6000),
                idle_timeout_ms: Some(1000),
                held: true,
            },
        )
        .await
        .expect("fake call");
        assert_eq!(node.advance(secs(6)), ["paused"]);
        assert!(
            node.advance(secs(3600)).is_empty(),
            "held: the clock stopped"
        );
        let held = node
            .list()
            .await
            .expect("node lists")
            .into_iter()
            .find(|s| s.id == "held")
            .expect("listed");
        assert_eq!(held.ttl_left_ms, Some(6000));
        // Resumed: the TTL goes on where it stopped.
        node.resume("held").await.expect("fake call");
        node.set_lifetime("held", lifetime(6, None))
            .await
            .expect("fake call");
        assert!(node.advance(secs(5)).is_empty());
        assert_eq!(node.advance(secs(1)), ["held"]);
        assert_eq!(
            node.set_lifetime("nope", Lifetime::default())
                .await
                .expect_err("unknown")
                .code,
            ErrorCode::NotFound
        );
    }
}
