//! [`FakeNode`]: a node in memory, for unit tests of what sits above [`NodeApi`]
//! (the control plane, placement, retries) without root, namespaces or an agent.
//!
//! Sandboxes cost nothing: each is an entry with a small in-memory file system. Commands
//! understand a handful of words (`echo`, `cat [FILE]`, `exit N`, `true`, `false`, and
//! `sleep SECS` in `exec`); anything else exits 127. Tests steer it: a capacity limit,
//! a failure injected into the next create, a node that is down, slow pings, agents
//! frozen while paused, and counters of what was called.
//!
//! Function calls (`Request::Call`) run on a copy of the sandbox's files that is dropped
//! after the call, as the agent's throw-away view is: input files are written to the
//! copy, the command runs, `fetch` reads from it. The command `fake-anomaly` reports an
//! anomaly (what a process outliving its call makes the agent report), so tests can
//! drive the control plane's replacement of a sandbox.
//!
//! Files: a sandbox's root is a tree of regular files (bytes), symlinks (a target as
//! written) and directories; every parent of a path written is a directory, as `mkdir
//! -p` would make it, and `/` always is. Modes, owners, mtimes and hard links are not
//! kept (an upload holding a hard link is refused, so a test never passes on a link
//! silently lost). Paths are taken lexically (`.`, `..`, doubled slashes resolved) and a
//! symlink on the way is never followed (a path below one is refused). Stat (lstat:
//! a symlink is reported with its target), list, mkdir (`-p`), remove, rename, read and
//! write act on it; a tar upload extracts the files, symlinks and directories of the
//! archive below its destination, all or nothing, refusing absolute names and `..` as
//! the agent does; a tar download archives a directory's contents (names relative to
//! it, directories with a trailing `/`) or one file or symlink under its name.
//!
//! Images carry files: each is a snapshot of a whole root. A sandbox starts with its
//! image's files, each of its `layers`' snapshots laid over them in order (a deletion in
//! an upper snapshot is not modeled); a commit stores the sandbox's files with the new
//! image, a tag copies them, an archive import extracts its tar (a node path imports an
//! image without files). Images added with [`FakeNode::add_image`] are empty;
//! [`FakeNode::add_image_with_files`] gives one files. Digests are stable hashes of the
//! name (of sandbox and name for a commit), never of content: two commits of the same
//! files differ, as two packdiff commits do.
//!
//! Commands do not read the image's binaries: the words above work in every sandbox
//! (even one from an image without `/bin/sh`). A command given as a shell line (a
//! `Shell` command, or argv `sh`/`bash` ... `-c LINE`) may end with `> FILE` or
//! `>> FILE`, which writes its stdout to FILE (relative to the working directory; the
//! parent must be a directory, else the shell's exit 2); no other shell syntax is
//! understood. `cat FILE` reads the sandbox's files, relative paths from the command's
//! working directory (`/` by default), following a symlink in the last component.
//!
//! Lifetimes follow the local node's rules (see [`crate::lifetime`]) on a clock that
//! stands still until the test moves it: [`FakeNode::advance`] moves it and ends what
//! is due, [`FakeNode::reap_now`] ends what is due without moving it.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::Read;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use bytes::Bytes;
use futures::StreamExt;

use dsec_wire::agent::{
    CallResult, CallSpec, Command, ExecSpec, ExitInfo, FetchedFile, FileInfo, FileKind, Reply,
    Request,
};
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
    /// Its root file system.
    tree: Tree,
    /// Its lifetime.
    clocks: Clocks,
    /// Free disk space it reports (`FakeNode::set_disk_free`); `None`: no disk limit.
    disk_free_mb: Option<u64>,
}

impl FakeSandbox {
    fn new(spec: NodeCreateSpec, now: u64) -> Self {
        Self {
            clocks: Clocks::new(spec.lifetime, now),
            spec,
            paused: false,
            tree: Tree::default(),
            disk_free_mb: None,
        }
    }

    fn listed(&self, now: u64) -> NodeSandbox {
        NodeSandbox {
            id: self.spec.id.clone(),
            image_digest: fake_digest(&self.spec.image),
            pid: 0,
            alive: true,
            disk_mb: self.disk_free_mb.map(|_| 64),
            disk_free_mb: self.disk_free_mb,
            ip: None,
            age_ms: self.clocks.age_ms(now),
            idle_ms: self.clocks.idle_ms(now),
            ttl_left_ms: self.clocks.ttl_left_ms(now),
            ended: None,
            timings: Vec::new(),
        }
    }
}

#[derive(Debug, Default)]
struct State {
    sandboxes: HashMap<String, FakeSandbox>,
    /// The request id each create served (see [`crate::request_id`]), by sandbox id.
    create_request_ids: HashMap<String, String>,
    /// Sandboxes whose lifetime ended, until destroyed.
    ended: BTreeMap<String, NodeSandbox>,
    /// The node's clock (ms); moves only with [`FakeNode::advance`].
    now_ms: u64,
    images: BTreeMap<String, Image>,
    /// The files of each image, by image name (an image without an entry has none).
    image_trees: HashMap<String, Tree>,
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
    /// How long each create takes.
    create_latency: std::time::Duration,
    /// The next function call never answers (its sandbox's agent is stuck).
    stall_next_call: bool,
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
    /// Commits (images made of a sandbox).
    pub commits: AtomicU64,
    /// Image imports.
    pub imports: AtomicU64,
    /// Tar uploads into a sandbox (counted as they arrive).
    pub tar_uploads: AtomicU64,
    /// Tar downloads from a sandbox (counted as they arrive).
    pub tar_downloads: AtomicU64,
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

    /// Adds an image of one layer named `name`, without files.
    pub fn add_image(&self, name: &str) -> Image {
        self.add_image_tree(name, Tree::default())
    }

    /// Adds an image of one layer named `name` holding `files` (absolute path, content;
    /// their parents are directories).
    ///
    /// # Panics
    /// If a path is relative, or names a directory another path needs (a test's mistake).
    pub fn add_image_with_files(&self, name: &str, files: &[(&str, &[u8])]) -> Image {
        let mut tree = Tree::default();
        for (path, data) in files {
            assert!(path.starts_with('/'), "{path}: not an absolute path");
            if let Err(e) = tree.put_file(&resolve("/", path), data.to_vec()) {
                panic!("image {name}: {}", e.message);
            }
        }
        self.add_image_tree(name, tree)
    }

    /// The regular files of image `name` (absolute path, content), if it exists.
    pub fn image_files(&self, name: &str) -> Option<BTreeMap<String, Vec<u8>>> {
        let st = self.state();
        st.images.get(name)?;
        Some(
            st.image_trees
                .get(name)
                .map(|t| t.files.clone())
                .unwrap_or_default(),
        )
    }

    /// The regular files of sandbox `id` (absolute path, content), if it runs.
    pub fn sandbox_files(&self, id: &str) -> Option<BTreeMap<String, Vec<u8>>> {
        self.state()
            .sandboxes
            .get(id)
            .map(|sb| sb.tree.files.clone())
    }

    fn add_image_tree(&self, name: &str, tree: Tree) -> Image {
        let image = Image {
            name: name.to_string(),
            digest: fake_digest(name),
            size_bytes: 0,
            created_at: 0,
            source: "fake".into(),
            layers: vec![fake_digest(name)],
            config: ImageConfig::default(),
        };
        let mut st = self.state();
        st.images.insert(name.to_string(), image.clone());
        st.image_trees.insert(name.to_string(), tree);
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

    /// Makes sandbox `id` report `mb` MiB free on a disk of its own (0: full).
    pub fn set_disk_free(&self, id: &str, mb: u64) {
        if let Some(sb) = self.state().sandboxes.get_mut(id) {
            sb.disk_free_mb = Some(mb);
        }
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

    /// The next function call ([`Request::Call`]) never answers, as an agent that was
    /// stopped mid-call; later ones answer.
    pub fn stall_next_call(&self) {
        self.state().stall_next_call = true;
    }

    /// Every create takes `latency` (a node slow to make sandboxes).
    pub fn set_create_latency(&self, latency: std::time::Duration) {
        self.state().create_latency = latency;
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

    /// The id of the API request the create of sandbox `id` served, if it carried one.
    pub fn create_request_id(&self, id: &str) -> Option<String> {
        self.state().create_request_ids.get(id).cloned()
    }

    /// The spec sandbox `id` was created with (`None` if the node does not run it).
    pub fn spec_of(&self, id: &str) -> Option<NodeCreateSpec> {
        self.state().sandboxes.get(id).map(|s| s.spec.clone())
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
        let cwd = spec.cwd.as_deref().unwrap_or("/");
        self.with_sandbox(id, |sb| Ok(run_command(sb, &spec.cmd, cwd, stdin)))
    }
}

fn fake_digest(name: &str) -> String {
    // Not a hash anyone verifies: a stable, valid-looking digest per name (FNV-1a, four
    // times with a different start), so that long names sharing a prefix differ.
    let mut hex = String::new();
    for round in 0u64..4 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ round.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        for b in name.bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        hex.push_str(&format!("{h:016x}"));
    }
    format!("sha256:{hex}")
}

/// A file system in memory: regular files by absolute path, symlinks (their target, as
/// written) and directories. Every parent of an entry held is a directory held (`/` is
/// implied). Paths are taken as written: a symlink on the way is never followed (an
/// entry below one is refused, as the agent's uploads refuse it).
#[derive(Debug, Clone, Default)]
struct Tree {
    files: BTreeMap<String, Vec<u8>>,
    links: BTreeMap<String, String>,
    dirs: BTreeSet<String>,
}

/// The directories above absolute path `p`, outermost first, without `/` and `p`.
fn ancestors(p: &str) -> impl Iterator<Item = &str> {
    p.match_indices('/').skip(1).map(move |(i, _)| &p[..i])
}

/// `dir/name` of an absolute directory.
fn join(dir: &str, name: &str) -> String {
    if dir == "/" {
        format!("/{name}")
    } else {
        format!("{dir}/{name}")
    }
}

/// The directory holding absolute path `p`.
fn parent(p: &str) -> &str {
    match p.rsplit_once('/') {
        Some(("", _)) | None => "/",
        Some((dir, _)) => dir,
    }
}

/// Path `p` from directory `cwd`, `.`, `..` and doubled slashes resolved lexically.
fn resolve(cwd: &str, p: &str) -> String {
    let joined = if p.starts_with('/') {
        p.to_string()
    } else {
        format!("{cwd}/{p}")
    };
    let mut out: Vec<&str> = Vec::new();
    for c in joined.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                out.pop();
            }
            c => out.push(c),
        }
    }
    format!("/{}", out.join("/"))
}

fn no_such(path: &str) -> ApiError {
    ApiError::new(
        ErrorCode::NotFound,
        format!("{path}: no such file or directory"),
    )
}

impl Tree {
    fn is_dir(&self, p: &str) -> bool {
        p == "/" || self.dirs.contains(p)
    }

    fn kind(&self, p: &str) -> Option<FileKind> {
        if self.files.contains_key(p) {
            Some(FileKind::File)
        } else if self.links.contains_key(p) {
            Some(FileKind::Symlink)
        } else if self.is_dir(p) {
            Some(FileKind::Dir)
        } else {
            None
        }
    }

    /// What stat (lstat: a symlink is reported, not followed) says of `p`.
    fn info(&self, p: &str) -> NodeResult<FileInfo> {
        if let Some(data) = self.files.get(p) {
            return Ok(file_info(p, data.len() as u64, FileKind::File));
        }
        if let Some(target) = self.links.get(p) {
            let mut info = file_info(p, target.len() as u64, FileKind::Symlink);
            info.symlink_target = Some(target.clone());
            return Ok(info);
        }
        if self.is_dir(p) {
            return Ok(file_info(p, 0, FileKind::Dir));
        }
        Err(no_such(p))
    }

    /// `p`, or where the symlink at `p` leads (a chain of at most 16, in the last
    /// component only): what a command reading `p` opens.
    fn follow(&self, p: &str) -> String {
        let mut at = p.to_string();
        for _ in 0..16 {
            match self.links.get(&at) {
                Some(target) => at = resolve(parent(&at), target),
                None => break,
            }
        }
        at
    }

    /// Paths strictly below directory `dir`: files, symlinks, then directories.
    fn below<'a>(&'a self, dir: &str) -> impl Iterator<Item = &'a String> {
        let prefix = join(dir, "");
        let under = move |k: &&String| k.starts_with(&prefix);
        let start = join(dir, "");
        let files = self.files.range(start.clone()..).map(|(k, _)| k);
        let links = self.links.range(start.clone()..).map(|(k, _)| k);
        let dirs = self.dirs.range(start..);
        files
            .take_while(under.clone())
            .chain(links.take_while(under.clone()))
            .chain(dirs.take_while(under))
    }

    /// The entries directly in directory `dir`, by name.
    fn children(&self, dir: &str) -> BTreeMap<String, FileKind> {
        let skip = join(dir, "").len();
        self.below(dir)
            .filter(|k| !k[skip..].contains('/'))
            .map(|k| {
                let kind = self.kind(k).unwrap_or(FileKind::Dir);
                (k[skip..].to_string(), kind)
            })
            .collect()
    }

    /// Fails unless every parent of `p` is a directory or missing (then it is made).
    fn parents_fit(&self, p: &str) -> NodeResult<()> {
        for a in ancestors(p) {
            if self.files.contains_key(a) {
                return Err(ApiError::new(
                    ErrorCode::BadRequest,
                    format!("{p}: {a} is not a directory"),
                ));
            }
            if self.links.contains_key(a) {
                return Err(ApiError::new(
                    ErrorCode::InvalidPath,
                    format!("{p}: {a} is a symlink, which the fake node does not follow"),
                ));
            }
        }
        Ok(())
    }

    fn add_parents(&mut self, p: &str) {
        for a in ancestors(p) {
            self.dirs.insert(a.to_string());
        }
    }

    /// `mkdir -p p`.
    fn mkdir_p(&mut self, p: &str) -> NodeResult<()> {
        if p == "/" {
            return Ok(());
        }
        self.parents_fit(p)?;
        if self.files.contains_key(p) || self.links.contains_key(p) {
            return Err(ApiError::new(
                ErrorCode::Conflict,
                format!("{p} exists and is not a directory"),
            ));
        }
        self.add_parents(p);
        self.dirs.insert(p.to_string());
        Ok(())
    }

    /// Fails if `p` is a directory; else makes its parents and clears its slot.
    fn make_slot(&mut self, p: &str) -> NodeResult<()> {
        self.parents_fit(p)?;
        if self.is_dir(p) {
            return Err(ApiError::new(
                ErrorCode::BadRequest,
                format!("{p} is a directory"),
            ));
        }
        self.add_parents(p);
        self.files.remove(p);
        self.links.remove(p);
        Ok(())
    }

    /// Writes file `p` (replacing a file or symlink there), making its parents.
    fn put_file(&mut self, p: &str, data: Vec<u8>) -> NodeResult<()> {
        self.make_slot(p)?;
        self.files.insert(p.to_string(), data);
        Ok(())
    }

    /// Makes `p` a symlink to `target` (replacing a file or symlink there).
    fn put_link(&mut self, p: &str, target: &str) -> NodeResult<()> {
        self.make_slot(p)?;
        self.links.insert(p.to_string(), target.to_string());
        Ok(())
    }

    /// Drops `p` and everything below it, whatever it is.
    fn clear(&mut self, p: &str) {
        let prefix = join(p, "");
        let keep = |k: &String| k != p && !k.starts_with(&prefix);
        self.files.retain(|k, _| keep(k));
        self.links.retain(|k, _| keep(k));
        self.dirs.retain(keep);
    }

    /// Removes `p` (a directory only if empty, unless `recursive`).
    fn remove(&mut self, p: &str, recursive: bool) -> NodeResult<()> {
        if p == "/" {
            return Err(ApiError::new(
                ErrorCode::InvalidPath,
                "refusing to remove /",
            ));
        }
        if self.kind(p).is_none() {
            return Err(no_such(p));
        }
        if !recursive && self.below(p).next().is_some() {
            return Err(ApiError::new(
                ErrorCode::Conflict,
                format!("{p}: directory not empty"),
            ));
        }
        self.clear(p);
        Ok(())
    }

    /// Moves `from` (a file, a symlink, or a directory with what it holds) to `to`, as
    /// rename(2) does (a directory replaces only an empty one), making `to`'s parents.
    fn rename(&mut self, from: &str, to: &str) -> NodeResult<()> {
        let kind = self.kind(from).ok_or_else(|| no_such(from))?;
        if from == "/" || to == "/" || to.starts_with(&join(from, "")) {
            return Err(ApiError::new(
                ErrorCode::BadRequest,
                format!("cannot move {from} to {to}"),
            ));
        }
        if from == to {
            return Ok(());
        }
        let mut next = self.clone();
        match kind {
            FileKind::Dir => {
                if next.files.contains_key(to) || next.links.contains_key(to) {
                    return Err(ApiError::new(
                        ErrorCode::BadRequest,
                        format!("{to} is not a directory"),
                    ));
                }
                let prefix = join(from, "");
                let moved = |k: &String| format!("{to}/{}", &k[prefix.len()..]);
                next.clear(from);
                if next.is_dir(to) {
                    next.remove(to, false)?;
                }
                next.mkdir_p(to)?;
                for d in self.dirs.iter().filter(|k| k.starts_with(&prefix)) {
                    next.dirs.insert(moved(d));
                }
                for (f, data) in self.files.iter().filter(|(k, _)| k.starts_with(&prefix)) {
                    next.files.insert(moved(f), data.clone());
                }
                for (l, target) in self.links.iter().filter(|(k, _)| k.starts_with(&prefix)) {
                    next.links.insert(moved(l), target.clone());
                }
            }
            FileKind::Symlink => {
                let target = next.links.remove(from).unwrap_or_default();
                next.put_link(to, &target)?;
            }
            _ => {
                let data = next.files.remove(from).unwrap_or_default();
                next.put_file(to, data)?;
            }
        }
        *self = next;
        Ok(())
    }

    /// Lays `upper` over this tree: its entries replace what is at their paths.
    fn overlay(&mut self, upper: &Tree) {
        for d in &upper.dirs {
            self.files.remove(d);
            self.links.remove(d);
            self.dirs.insert(d.clone());
        }
        for (p, data) in &upper.files {
            self.clear(p);
            self.files.insert(p.clone(), data.clone());
        }
        for (p, target) in &upper.links {
            self.clear(p);
            self.links.insert(p.clone(), target.clone());
        }
    }

    /// Extracts tar archive `data` below directory `at` (made if missing): all of it, or
    /// nothing.
    fn extract(&mut self, at: &str, data: &[u8]) -> NodeResult<()> {
        let bad =
            |e: std::io::Error| ApiError::new(ErrorCode::BadRequest, format!("reading tar: {e}"));
        let mut next = self.clone();
        next.mkdir_p(at)?;
        let mut archive = tar::Archive::new(data);
        for entry in archive.entries().map_err(bad)? {
            let mut entry = entry.map_err(bad)?;
            let raw = String::from_utf8_lossy(&entry.path_bytes()).into_owned();
            if raw.starts_with('/') {
                return Err(ApiError::new(
                    ErrorCode::InvalidPath,
                    format!("tar entry {raw} has an absolute path"),
                ));
            }
            if raw.split('/').any(|c| c == "..") {
                return Err(ApiError::new(
                    ErrorCode::InvalidPath,
                    format!("tar entry {raw} escapes the destination"),
                ));
            }
            let path = resolve(at, &raw);
            match entry.header().entry_type() {
                tar::EntryType::Directory => next.mkdir_p(&path)?,
                tar::EntryType::Regular | tar::EntryType::Continuous if raw.ends_with('/') => {
                    next.mkdir_p(&path)?
                }
                tar::EntryType::Regular | tar::EntryType::Continuous => {
                    let mut content = Vec::new();
                    entry.read_to_end(&mut content).map_err(bad)?;
                    next.put_file(&path, content)?;
                }
                tar::EntryType::Symlink => {
                    let target = entry
                        .link_name_bytes()
                        .map(|t| String::from_utf8_lossy(&t).into_owned())
                        .ok_or_else(|| {
                            ApiError::new(
                                ErrorCode::BadRequest,
                                format!("tar entry {raw}: symlink without target"),
                            )
                        })?;
                    next.put_link(&path, &target)?;
                }
                tar::EntryType::Link => {
                    return Err(unsupported(&format!("hard links (tar entry {raw})")));
                }
                // As the agent: devices, FIFOs and the like are skipped.
                _ => {}
            }
        }
        *self = next;
        Ok(())
    }

    /// A tar archive of `p`: a directory's contents, or one file or symlink under its
    /// name.
    fn archive(&self, p: &str) -> NodeResult<Vec<u8>> {
        let fail = |e: std::io::Error| ApiError::new(ErrorCode::Internal, format!("tar: {e}"));
        let mut b = tar::Builder::new(Vec::new());
        match self.kind(p) {
            None => return Err(no_such(p)),
            Some(FileKind::Dir) => self.append_contents(&mut b, p, "").map_err(fail)?,
            Some(_) => {
                let name = p.rsplit('/').next().unwrap_or_default();
                self.append_entry(&mut b, p, name).map_err(fail)?;
            }
        }
        b.into_inner().map_err(fail)
    }

    fn append_contents(
        &self,
        b: &mut tar::Builder<Vec<u8>>,
        dir: &str,
        prefix: &str,
    ) -> std::io::Result<()> {
        for (name, kind) in self.children(dir) {
            let path = join(dir, &name);
            let rel = format!("{prefix}{name}");
            if kind == FileKind::Dir {
                let rel = format!("{rel}/");
                append(b, &rel, tar::EntryType::Directory, &[])?;
                self.append_contents(b, &path, &rel)?;
            } else {
                self.append_entry(b, &path, &rel)?;
            }
        }
        Ok(())
    }

    /// Appends the file or symlink at `path` as `name`.
    fn append_entry(
        &self,
        b: &mut tar::Builder<Vec<u8>>,
        path: &str,
        name: &str,
    ) -> std::io::Result<()> {
        if let Some(target) = self.links.get(path) {
            let mut h = header(tar::EntryType::Symlink, 0o777, 0);
            return b.append_link(&mut h, name, target);
        }
        let data = self.files.get(path).map(Vec::as_slice).unwrap_or_default();
        append(b, name, tar::EntryType::Regular, data)
    }
}

fn header(kind: tar::EntryType, mode: u32, size: u64) -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(kind);
    h.set_mode(mode);
    h.set_mtime(0);
    h.set_uid(0);
    h.set_gid(0);
    h.set_size(size);
    h
}

fn append(
    b: &mut tar::Builder<Vec<u8>>,
    name: &str,
    kind: tar::EntryType,
    data: &[u8],
) -> std::io::Result<()> {
    let mode = if kind == tar::EntryType::Directory {
        0o755
    } else {
        0o644
    };
    b.append_data(&mut header(kind, mode, data.len() as u64), name, data)
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

/// The words of a command, and whether a shell reads them (a `Shell` line, or argv
/// `sh`/`bash` with `-c LINE`): only then is `> FILE` a redirection.
fn words(cmd: &Command) -> (Vec<String>, bool) {
    let split = |line: &str| line.split_whitespace().map(str::to_string).collect();
    match cmd {
        Command::Shell(line) => (split(line), true),
        Command::Argv(argv) => {
            let shell = argv
                .first()
                .map(|a| a.rsplit('/').next().unwrap_or_default())
                .is_some_and(|a| a == "sh" || a == "bash");
            // `sh -c LINE`, `bash -l -c LINE`, `bash -lc LINE`.
            let script = argv
                .iter()
                .enumerate()
                .skip(1)
                .take_while(|(_, a)| a.starts_with('-'))
                .find(|(_, a)| a.len() > 1 && a.ends_with('c'))
                .and_then(|(i, _)| argv.get(i + 1));
            match script {
                Some(line) if shell => (split(line), true),
                _ => (argv.clone(), false),
            }
        }
    }
}

/// Where a shell line's stdout goes: `> FILE` or `>> FILE` at its end (`>FILE` too).
struct Redirect {
    path: String,
    append: bool,
}

/// Takes a trailing redirection off `words`.
fn redirect(words: &mut Vec<String>, cwd: &str) -> Option<Redirect> {
    let last = words.last()?.clone();
    let (op, target) = match last.strip_prefix(">>").or_else(|| last.strip_prefix('>')) {
        Some("") | None => {
            let op = words.get(words.len().checked_sub(2)?)?.clone();
            if op != ">" && op != ">>" {
                return None;
            }
            words.truncate(words.len() - 2);
            (op, last)
        }
        Some(target) => {
            let op = last[..last.len() - target.len()].to_string();
            words.pop();
            (op, target.to_string())
        }
    };
    Some(Redirect {
        path: resolve(cwd, &target),
        append: op == ">>",
    })
}

/// One function call on `sb`'s files (the caller restores them after).
fn fake_call(sb: &mut FakeSandbox, spec: &CallSpec) -> CallResult {
    for (path, data) in &spec.files {
        let p = resolve("/", path);
        if let Err(e) = sb.tree.put_file(&p, data.0.clone()) {
            return CallResult {
                setup_error: Some(format!("writing {p}: {}", e.message)),
                ..Default::default()
            };
        }
    }
    let (words, _) = words(&spec.cmd);
    if words.first().map(String::as_str) == Some("fake-anomaly") {
        return CallResult {
            ran: true,
            exit: ExitInfo {
                exit_code: Some(0),
                ..Default::default()
            },
            anomaly: Some("a process of the call outlived it (fake)".into()),
            ..Default::default()
        };
    }
    let cwd = spec.cwd.as_deref().unwrap_or("/");
    let stdin = spec.stdin.as_ref().map(|b| Bytes::from(b.0.clone()));
    let r = run_command(sb, &spec.cmd, cwd, stdin);
    let files = spec
        .fetch
        .iter()
        .map(|path| {
            let p = resolve("/", path);
            let fetched = match sb.tree.files.get(&p) {
                Some(data) => FetchedFile {
                    data: Some(data.clone().into()),
                    error: None,
                },
                None => FetchedFile {
                    data: None,
                    error: Some(format!("{p}: no such file")),
                },
            };
            (path.clone(), fetched)
        })
        .collect();
    CallResult {
        ran: true,
        exit: r.exit,
        stdout: r.stdout.into_bytes().into(),
        stderr: r.stderr.into_bytes().into(),
        files,
        ..Default::default()
    }
}

fn run_command(sb: &mut FakeSandbox, cmd: &Command, cwd: &str, stdin: Option<Bytes>) -> ExecResult {
    let (mut words, shell) = words(cmd);
    let to = if shell {
        redirect(&mut words, cwd)
    } else {
        None
    };
    let (mut stdout, mut stderr, mut code) = (Vec::new(), Vec::new(), 0);
    // The shell opens the file first: a parent that is no directory runs nothing.
    let open = to.as_ref().map(|r| {
        let parent = parent(&r.path);
        if sb.tree.is_dir(&r.path) {
            Err(format!("sh: 1: cannot create {}: Is a directory\n", r.path))
        } else if !sb.tree.is_dir(parent) {
            Err(format!(
                "sh: 1: cannot create {}: Directory nonexistent\n",
                r.path
            ))
        } else {
            Ok(())
        }
    });
    let opened = matches!(open, Some(Ok(())));
    match (open, words.first().map(String::as_str)) {
        (Some(Err(e)), _) => {
            stderr = e.into_bytes();
            code = 2;
        }
        (_, Some("echo")) => {
            stdout = words[1..].join(" ").into_bytes();
            stdout.push(b'\n');
        }
        (_, Some("cat")) if words.len() == 1 => {
            stdout = stdin.map(|b| b.to_vec()).unwrap_or_default()
        }
        (_, Some("cat")) => {
            for w in &words[1..] {
                let path = sb.tree.follow(&resolve(cwd, w));
                match (sb.tree.files.get(&path), sb.tree.is_dir(&path)) {
                    (Some(b), _) => stdout.extend_from_slice(b),
                    (None, true) => {
                        stderr.extend(format!("cat: {w}: Is a directory\n").into_bytes());
                        code = 1;
                    }
                    (None, false) => {
                        stderr
                            .extend(format!("cat: {w}: No such file or directory\n").into_bytes());
                        code = 1;
                    }
                }
            }
        }
        (_, Some("exit")) => code = words.get(1).and_then(|w| w.parse().ok()).unwrap_or(0),
        (_, Some("true" | "sleep")) => {}
        (_, Some("false")) => code = 1,
        (_, Some(other)) => {
            stderr = format!("{other}: command not found\n").into_bytes();
            code = 127;
        }
        (_, None) => {}
    }
    if let (Some(r), true) = (&to, opened) {
        let mut data = if r.append {
            sb.tree.files.get(&r.path).cloned().unwrap_or_default()
        } else {
            Vec::new()
        };
        data.append(&mut stdout);
        // Checked above: the parent is a directory and the path no directory.
        let _ = sb.tree.put_file(&r.path, data);
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
        mode: if kind == FileKind::Dir { 0o755 } else { 0o644 },
        kind,
        size,
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
        if let Some(request) = crate::request_id::current() {
            self.state()
                .create_request_ids
                .insert(spec.id.clone(), request.to_string());
        }
        while self.state().stall_creates {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        let latency = self.state().create_latency;
        if !latency.is_zero() {
            tokio::time::sleep(latency).await;
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
        // Its files: the image's, each layer's laid over them.
        let mut tree = st.image_trees.get(&spec.image).cloned().unwrap_or_default();
        for layer in &spec.layers {
            if !st.images.contains_key(layer) {
                return Err(ApiError::new(
                    ErrorCode::ImageNotFound,
                    format!("image {layer} not found"),
                ));
            }
            if let Some(upper) = st.image_trees.get(layer) {
                tree.overlay(upper);
            }
        }
        if st.sandboxes.contains_key(&spec.id) || st.ended.contains_key(&spec.id) {
            return Err(ApiError::new(
                ErrorCode::Conflict,
                format!("sandbox {} exists", spec.id),
            ));
        }
        let id = spec.id.clone();
        let mut sb = FakeSandbox::new(spec, st.now_ms);
        sb.tree = tree;
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
        let (base, tree) =
            self.with_sandbox(id, |sb| Ok((sb.spec.image.clone(), sb.tree.clone())))?;
        self.counters.commits.fetch_add(1, Ordering::Relaxed);
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
        let mut st = self.state();
        st.images.insert(name.to_string(), image.clone());
        st.image_trees.insert(name.to_string(), tree);
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
        if matches!(req, Request::Call(_)) && std::mem::take(&mut self.state().stall_next_call) {
            return std::future::pending().await;
        }
        self.with_sandbox(id, |sb| match req {
            Request::Ping => Ok(Reply::Pong {
                version: dsec_wire::agent::PROTOCOL_VERSION,
                pid: 1,
            }),
            Request::FileStat { path } => sb.tree.info(&resolve("/", &path)).map(Reply::File),
            Request::Call(spec) => {
                let view = sb.tree.clone();
                let ran = fake_call(sb, &spec);
                sb.tree = view;
                Ok(Reply::Called(ran))
            }
            Request::FileHash { path } => {
                use sha2::Digest;
                let p = sb.tree.follow(&resolve("/", &path));
                match (sb.tree.files.get(&p), sb.tree.kind(&p)) {
                    (Some(data), _) => Ok(Reply::Hashed {
                        sha256: format!("{:x}", sha2::Sha256::digest(data)),
                        size: data.len() as u64,
                    }),
                    (None, Some(_)) => Err(ApiError::new(
                        ErrorCode::BadRequest,
                        format!("{p} is not a regular file"),
                    )),
                    (None, None) => Err(no_such(&p)),
                }
            }
            Request::FileList { path } => {
                let dir = resolve("/", &path);
                match sb.tree.kind(&dir) {
                    Some(FileKind::Dir) => {}
                    Some(_) => {
                        return Err(ApiError::new(
                            ErrorCode::BadRequest,
                            format!("list {dir}: not a directory"),
                        ))
                    }
                    None => return Err(no_such(&dir)),
                }
                let entries = sb
                    .tree
                    .children(&dir)
                    .into_keys()
                    .map(|name| sb.tree.info(&join(&dir, &name)))
                    .collect::<NodeResult<_>>()?;
                Ok(Reply::Entries { entries })
            }
            Request::FileMkdir { path } => {
                sb.tree.mkdir_p(&resolve("/", &path))?;
                Ok(Reply::Ok)
            }
            Request::FileRemove { path, recursive } => {
                sb.tree.remove(&resolve("/", &path), recursive)?;
                Ok(Reply::Ok)
            }
            Request::FileRename { from, to } => {
                sb.tree.rename(&resolve("/", &from), &resolve("/", &to))?;
                Ok(Reply::Ok)
            }
            other => Err(unsupported(&format!("{other:?}"))),
        })
    }

    async fn exec(&self, id: &str, spec: ExecSpec, stdin: Option<Bytes>) -> NodeResult<ExecResult> {
        let (words, _) = words(&spec.cmd);
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
        let path = &resolve("/", path);
        let data = self.with_sandbox(id, |sb| match sb.tree.kind(path) {
            Some(FileKind::File) => Ok(sb.tree.files.get(path).cloned().unwrap_or_default()),
            Some(_) => Err(ApiError::new(
                ErrorCode::BadRequest,
                format!("{path} is a directory"),
            )),
            None => Err(no_such(path)),
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
            sb.tree.put_file(&resolve("/", path), data)?;
            Ok(WriteResult { bytes })
        })
    }

    async fn download_tar(&self, id: &str, path: &str) -> NodeResult<ByteStream> {
        self.counters.tar_downloads.fetch_add(1, Ordering::Relaxed);
        let tar = self.with_sandbox(id, |sb| sb.tree.archive(&resolve("/", path)))?;
        Ok(crate::once_bytes(tar))
    }

    async fn upload_tar(&self, id: &str, path: &str, body: ByteStream) -> NodeResult<WriteResult> {
        self.counters.tar_uploads.fetch_add(1, Ordering::Relaxed);
        self.with_sandbox(id, |_| Ok(()))?;
        // All or nothing: a body that breaks off, or an archive with a bad entry,
        // changes nothing.
        let data = collect(body).await?;
        self.with_sandbox(id, |sb| {
            sb.tree.extract(&resolve("/", path), &data)?;
            Ok(WriteResult {
                bytes: data.len() as u64,
            })
        })
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
        self.counters.imports.fetch_add(1, Ordering::Relaxed);
        let mut tree = Tree::default();
        if let ImportSource::Archive(body) = source {
            tree.extract("/", &collect(body).await?)?;
        }
        Ok(self.add_image_tree(name, tree))
    }

    async fn remove_image(&self, name: &str) -> NodeResult<()> {
        self.up()?;
        let mut st = self.state();
        st.image_trees.remove(name);
        match st.images.remove(name) {
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
        let mut st = self.state();
        let tree = st.image_trees.get(&image.name).cloned().unwrap_or_default();
        image.name = name.to_string();
        if let Some(config) = config {
            image.config = config;
        }
        st.images.insert(name.to_string(), image.clone());
        st.image_trees.insert(name.to_string(), tree);
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
        model_link: false,
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
        request_id: None,
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

    fn argv(words: &[&str]) -> ExecSpec {
        ExecSpec {
            cmd: Command::Argv(words.iter().map(|w| w.to_string()).collect()),
            ..shell("")
        }
    }

    async fn stat(node: &FakeNode, id: &str, path: &str) -> NodeResult<FileInfo> {
        match node
            .call(id, Request::FileStat { path: path.into() })
            .await?
        {
            Reply::File(info) => Ok(info),
            other => panic!("stat {path}: {other:?}"),
        }
    }

    async fn list(node: &FakeNode, id: &str, path: &str) -> NodeResult<Vec<(String, FileKind)>> {
        match node
            .call(id, Request::FileList { path: path.into() })
            .await?
        {
            Reply::Entries { entries } => {
                Ok(entries.into_iter().map(|e| (e.name, e.kind)).collect())
            }
            other => panic!("list {path}: {other:?}"),
        }
    }

    async fn bytes_of(body: ByteStream) -> Vec<u8> {
        collect(body).await.expect("whole body")
    }

    fn tar_of(entries: &[(&str, Option<&[u8]>)]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (name, data) in entries {
            let kind = match data {
                Some(_) => tar::EntryType::Regular,
                None => tar::EntryType::Directory,
            };
            append(&mut b, name, kind, data.unwrap_or_default()).expect("tar in memory");
        }
        b.into_inner().expect("tar in memory")
    }

    /// (name, content; `None` for a directory) of each entry of `tar`.
    fn entries_of(tar: &[u8]) -> Vec<(String, Option<Vec<u8>>)> {
        let mut archive = tar::Archive::new(tar);
        let mut out = Vec::new();
        for e in archive.entries().expect("a tar") {
            let mut e = e.expect("an entry");
            let name = String::from_utf8_lossy(&e.path_bytes()).into_owned();
            let data = if e.header().entry_type() == tar::EntryType::Directory {
                None
            } else {
                let mut d = Vec::new();
                e.read_to_end(&mut d).expect("entry data");
                Some(d)
            };
            out.push((name, data));
        }
        out
    }

    #[tokio::test]
    async fn parents_of_files_are_directories_that_stat_list_and_remove_see() {
        let node = FakeNode::new("n1");
        node.create(sandbox_spec("a")).await.expect("fake call");
        node.write_file("a", "/w/sub/f", None, crate::once_bytes("hi"))
            .await
            .expect("fake call");
        assert_eq!(
            stat(&node, "a", "/w").await.expect("a dir").kind,
            FileKind::Dir
        );
        assert_eq!(
            stat(&node, "a", "/w/sub/").await.expect("a dir").kind,
            FileKind::Dir
        );
        let f = stat(&node, "a", "/w/sub/f").await.expect("a file");
        assert_eq!((f.kind, f.size, f.name.as_str()), (FileKind::File, 2, "f"));
        assert_eq!(
            stat(&node, "a", "/").await.expect("root").kind,
            FileKind::Dir
        );
        assert_eq!(
            stat(&node, "a", "/nope").await.expect_err("missing").code,
            ErrorCode::NotFound
        );
        node.call(
            "a",
            Request::FileMkdir {
                path: "/w/e/e2".into(),
            },
        )
        .await
        .expect("mkdir -p");
        assert_eq!(
            list(&node, "a", "/w").await.expect("a dir"),
            [
                ("e".to_string(), FileKind::Dir),
                ("sub".to_string(), FileKind::Dir)
            ]
        );
        assert_eq!(
            list(&node, "a", "/w/sub/f").await.expect_err("a file").code,
            ErrorCode::BadRequest
        );
        let e = node
            .call(
                "a",
                Request::FileMkdir {
                    path: "/w/sub/f/x".into(),
                },
            )
            .await
            .expect_err("a file on the way");
        assert_eq!(e.code, ErrorCode::BadRequest);
        let e = node
            .call(
                "a",
                Request::FileRemove {
                    path: "/w".into(),
                    recursive: false,
                },
            )
            .await
            .expect_err("not empty");
        assert_eq!(e.code, ErrorCode::Conflict);
        node.call(
            "a",
            Request::FileRename {
                from: "/w/sub".into(),
                to: "/v".into(),
            },
        )
        .await
        .expect("rename a directory");
        let r = node
            .exec("a", shell("cat /v/f"), None)
            .await
            .expect("fake call");
        assert_eq!(r.stdout, "hi");
        // Removing the last file leaves its directory.
        node.call(
            "a",
            Request::FileRemove {
                path: "/v/f".into(),
                recursive: false,
            },
        )
        .await
        .expect("remove");
        assert_eq!(list(&node, "a", "/v").await.expect("still a dir"), []);
        node.call(
            "a",
            Request::FileRemove {
                path: "/w".into(),
                recursive: true,
            },
        )
        .await
        .expect("remove -r");
        assert_eq!(
            list(&node, "a", "/").await.expect("root"),
            [("v".to_string(), FileKind::Dir)]
        );
    }

    #[tokio::test]
    async fn tars_go_in_whole_or_not_at_all_and_come_out_relative() {
        let node = FakeNode::new("n1");
        node.create(sandbox_spec("a")).await.expect("fake call");
        let tar = tar_of(&[
            ("./", None),
            ("d/", None),
            ("d/f", Some(b"one")),
            ("g", Some(b"two")),
        ]);
        let w = node
            .upload_tar("a", "/x", crate::once_bytes(tar.clone()))
            .await
            .expect("upload");
        assert_eq!(w.bytes, tar.len() as u64);
        let files = node.sandbox_files("a").expect("runs");
        assert_eq!(files.get("/x/d/f").map(Vec::as_slice), Some(&b"one"[..]));
        assert_eq!(files.get("/x/g").map(Vec::as_slice), Some(&b"two"[..]));
        let down = bytes_of(node.download_tar("a", "/x").await.expect("download")).await;
        assert_eq!(
            entries_of(&down),
            [
                ("d/".to_string(), None),
                ("d/f".to_string(), Some(b"one".to_vec())),
                ("g".to_string(), Some(b"two".to_vec())),
            ]
        );
        let one = bytes_of(node.download_tar("a", "/x/d/f").await.expect("download")).await;
        assert_eq!(entries_of(&one), [("f".to_string(), Some(b"one".to_vec()))]);
        assert_eq!(
            node.download_tar("a", "/none").await.err().map(|e| e.code),
            Some(ErrorCode::NotFound)
        );
        // A bad entry after a good one: nothing lands.
        let mut bad = tar::Builder::new(Vec::new());
        append(&mut bad, "ok", tar::EntryType::Regular, b"1").expect("tar");
        bad.append_link(&mut header(tar::EntryType::Link, 0o644, 0), "hard", "ok")
            .expect("tar");
        let bad = bad.into_inner().expect("tar");
        let e = node
            .upload_tar("a", "/y", crate::once_bytes(bad))
            .await
            .expect_err("hard links are not kept");
        assert_eq!(e.code, ErrorCode::BadRequest);
        let mut escape = tar_of(&[("a", Some(b"1"))]);
        // `../a` in place of `a` (the builder refuses to write it).
        escape[..4].copy_from_slice(b"../a");
        let mut h = tar::Header::from_byte_slice(&escape[..512]).clone();
        h.set_cksum();
        escape[..512].copy_from_slice(h.as_bytes());
        let e = node
            .upload_tar("a", "/y", crate::once_bytes(escape))
            .await
            .expect_err("escapes");
        assert_eq!(e.code, ErrorCode::InvalidPath);
        assert!(node
            .sandbox_files("a")
            .expect("runs")
            .keys()
            .all(|k| !k.starts_with("/y")));
        assert_eq!(
            stat(&node, "a", "/y")
                .await
                .expect_err("no partial upload")
                .code,
            ErrorCode::NotFound
        );
    }

    #[tokio::test]
    async fn images_carry_files_through_commits_tags_imports_and_layers() {
        let node = FakeNode::new("n1");
        node.add_image_with_files("etc", &[("/etc/os", b"fake"), ("/etc/keep", b"base")]);
        node.create(NodeCreateSpec {
            image: "etc".into(),
            ..sandbox_spec("a")
        })
        .await
        .expect("fake call");
        node.exec("a", shell("echo made > /etc/made"), None)
            .await
            .expect("fake call");
        let (img, _) = node
            .commit("a", "snap", vec![], Default::default())
            .await
            .expect("fake call");
        assert_eq!(node.counters.commits.load(Ordering::Relaxed), 1);
        node.tag_image(&img.digest, "snap-2", None)
            .await
            .expect("tag by digest");
        let files = node.image_files("snap-2").expect("tagged");
        assert_eq!(
            files.keys().collect::<Vec<_>>(),
            ["/etc/keep", "/etc/made", "/etc/os"]
        );
        node.import_image(
            "upper",
            ImportSource::Archive(crate::once_bytes(tar_of(&[
                ("./", None),
                ("etc/keep", Some(b"upper")),
            ]))),
            false,
            None,
        )
        .await
        .expect("import");
        assert_eq!(node.counters.imports.load(Ordering::Relaxed), 1);
        node.create(NodeCreateSpec {
            image: "snap-2".into(),
            layers: vec!["upper".into()],
            ..sandbox_spec("b")
        })
        .await
        .expect("fake call");
        let r = node
            .exec("b", shell("cat /etc/made /etc/keep"), None)
            .await
            .expect("fake call");
        assert_eq!(r.stdout, "made\nupper");
        let e = node
            .create(NodeCreateSpec {
                layers: vec!["nope".into()],
                ..sandbox_spec("c")
            })
            .await
            .expect_err("unknown layer");
        assert_eq!(e.code, ErrorCode::ImageNotFound);
        node.remove_image("snap-2").await.expect("fake call");
        assert!(node.image_files("snap-2").is_none());
        assert_ne!(
            fake_digest("build-cache/0123456789abcdef0123456789abcdef-x"),
            fake_digest("build-cache/0123456789abcdef0123456789abcdef-y")
        );
    }

    #[tokio::test]
    async fn shell_lines_redirect_stdout_and_argv_does_not() {
        let node = FakeNode::new("n1");
        node.create(sandbox_spec("a")).await.expect("fake call");
        let run = |spec: ExecSpec| node.exec("a", spec, None);
        let r = run(argv(&["/bin/sh", "-c", "echo one two > /o"]))
            .await
            .expect("fake call");
        assert_eq!((r.stdout.as_str(), r.exit.exit_code), ("", Some(0)));
        let r = run(ExecSpec {
            cwd: Some("/".into()),
            ..argv(&["bash", "-lc", "echo three >>o"])
        })
        .await
        .expect("fake call");
        assert_eq!(r.exit.exit_code, Some(0));
        let r = run(ExecSpec {
            cwd: Some("/".into()),
            ..argv(&["cat", "o"])
        })
        .await
        .expect("fake call");
        assert_eq!(r.stdout, "one two\nthree\n");
        let r = run(argv(&["echo", ">", "/p"])).await.expect("fake call");
        assert_eq!(r.stdout, "> /p\n", "no shell, no redirection");
        let r = run(shell("echo x > /no/dir/f")).await.expect("fake call");
        assert_eq!(r.exit.exit_code, Some(2));
        assert!(r.stderr.contains("nonexistent"), "{}", r.stderr);
        let r = run(argv(&["/bin/sh", "-c", "exit 3"]))
            .await
            .expect("fake call");
        assert_eq!(r.exit.exit_code, Some(3));
        let r = run(shell("cat /")).await.expect("fake call");
        assert_eq!(r.exit.exit_code, Some(1));
    }

    #[tokio::test]
    async fn symlinks_are_stated_archived_and_read_through_but_never_walked() {
        let node = FakeNode::new("n1");
        node.create(sandbox_spec("a")).await.expect("fake call");
        let mut b = tar::Builder::new(Vec::new());
        append(&mut b, "d/real", tar::EntryType::Regular, b"data").expect("tar");
        b.append_link(
            &mut header(tar::EntryType::Symlink, 0o777, 0),
            "d/link",
            "real",
        )
        .expect("tar");
        let tar = b.into_inner().expect("tar");
        node.upload_tar("a", "/", crate::once_bytes(tar))
            .await
            .expect("upload");
        let info = stat(&node, "a", "/d/link").await.expect("lstat");
        assert_eq!(
            (info.kind, info.symlink_target.as_deref()),
            (FileKind::Symlink, Some("real"))
        );
        assert_eq!(
            list(&node, "a", "/d").await.expect("a dir"),
            [
                ("link".to_string(), FileKind::Symlink),
                ("real".to_string(), FileKind::File)
            ]
        );
        let r = node
            .exec("a", shell("cat /d/link"), None)
            .await
            .expect("fake call");
        assert_eq!(r.stdout, "data");
        let down = bytes_of(node.download_tar("a", "/d").await.expect("download")).await;
        let mut archive = tar::Archive::new(&down[..]);
        let kinds: Vec<(String, tar::EntryType)> = archive
            .entries()
            .expect("a tar")
            .map(|e| {
                let e = e.expect("an entry");
                let name = String::from_utf8_lossy(&e.path_bytes()).into_owned();
                (name, e.header().entry_type())
            })
            .collect();
        assert_eq!(
            kinds,
            [
                ("link".to_string(), tar::EntryType::Symlink),
                ("real".to_string(), tar::EntryType::Regular)
            ]
        );
        let e = node
            .write_file("a", "/d/link/x", None, crate::once_bytes("x"))
            .await
            .expect_err("below a symlink");
        assert_eq!(e.code, ErrorCode::InvalidPath);
    }
}
