//! The sandbox lifecycle: create (with its init files and user check), delete, pause, resume, commit, network and timeout changes.

use super::*;

/// How many nodes may refuse a sandbox (`capacity`) before the create gives up.
const MAX_REFUSALS: usize = 3;
/// How often a keyed create may find its key's earlier attempt gone (failed, or its
/// replica dead) and try to take the key again before it gives up.
const MAX_TAKEOVERS: usize = 3;

/// A keyed create that kept losing its key to attempts that then went away.
fn key_contended(req: &CreateSandboxRequest) -> ApiError {
    ApiError::new(
        ErrorCode::Conflict,
        format!(
            "idempotency_key {:?} is contended by other attempts: retry",
            req.idempotency_key.as_deref().unwrap_or_default()
        ),
    )
}

impl ControlPlane {
    /// A create of `tenant` whose labels were checked (or set by the server): a pool
    /// claim, a queued create, or a plain one.
    pub(super) async fn create_unchecked(
        &self,
        tenant: &str,
        req: CreateSandboxRequest,
    ) -> ApiResult<Sandbox> {
        let tenant = tenant.to_string();
        if req.pool.is_some() && req.model_access.is_some() {
            // A pool member's environment is fixed when the member is made.
            return Err(ApiError::new(
                ErrorCode::BadRequest,
                "model_access cannot be given to a pool claim: a warm sandbox's environment \
                 is made with it",
            ));
        }
        if req.pool.is_some() {
            return self
                .to_end(move |me| async move { me.claim_to_end(&tenant, req).await })
                .await;
        }
        if req.queue.is_some() {
            return self
                .to_end(move |me| async move { me.create_queued_to_end(&tenant, req).await })
                .await;
        }
        self.to_end(move |me| async move { me.create_sandbox_to_end(&tenant, req).await })
            .await
    }

    /// The sandbox `id` once it is past `creating` (its first create may still be running).
    pub(super) async fn await_created(&self, id: &str) -> ApiResult<Sandbox> {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            let sb = self.record(id).await?;
            if sb.state != SandboxState::Creating
                || std::time::Instant::now() > deadline
                || self.records.abandoned(&sb).await?
            {
                return Ok(sb);
            }
            // Another replica's create shows here through the watch.
            self.records.changed(Duration::from_millis(50)).await;
        }
    }

    /// The defaults of an image with `layers` stacked on it: their configs applied bottom
    /// first (env merged, later workdir/user/entrypoint/cmd win). An unknown name fails
    /// when `strict`, else it is skipped.
    pub(super) async fn stack_config(
        &self,
        node: &dyn NodeApi,
        image: &str,
        layers: &[String],
        strict: bool,
    ) -> ApiResult<ImageConfig> {
        let mut config = ImageConfig::default();
        for name in std::iter::once(image).chain(layers.iter().map(String::as_str)) {
            let c = match node.image(name).await {
                Ok(img) => img.config,
                Err(e) if strict => return Err(e),
                Err(_) => continue,
            };
            config.env.extend(c.env);
            config.workdir = c.workdir.or(config.workdir);
            config.user = c.user.or(config.user);
            if !c.entrypoint.is_empty() {
                config.entrypoint = c.entrypoint;
            }
            if !c.cmd.is_empty() {
                config.cmd = c.cmd;
            }
        }
        Ok(config)
    }

    pub(super) async fn place_files(
        &self,
        node: &dyn NodeApi,
        id: &str,
        files: &[InitFile],
    ) -> ApiResult<()> {
        for f in files {
            let bytes = match f.encoding {
                ContentEncoding::Utf8 => f.content.as_bytes().to_vec(),
                ContentEncoding::Base64 => base64::engine::general_purpose::STANDARD
                    .decode(&f.content)
                    .map_err(|e| {
                        ApiError::new(
                            ErrorCode::BadRequest,
                            format!("files: {}: invalid base64: {e}", f.path),
                        )
                    })?,
            };
            let body = dsec_node_api::once_bytes(bytes);
            self.guarded(
                id,
                Some(Limit::call()),
                node.write_file(id, &f.path, f.mode, body),
            )
            .await?;
        }
        Ok(())
    }

    /// `bad_request` (the create is undone by the caller) when the sandbox's default user
    /// names a user or group its image does not have: every command would fail.
    pub(super) async fn check_user(&self, id: &str, user: Option<&str>) -> ApiResult<()> {
        let Some(user) = user else {
            return Ok(());
        };
        let (u, g) = user
            .split_once(':')
            .map_or((user, None), |(u, g)| (u, Some(g)));
        let named = |s: &str| s.parse::<u32>().is_err();
        let passwd = if named(u) {
            self.small_file(id, "/etc/passwd").await?
        } else {
            None
        };
        let group = match g {
            Some(g) if named(g) => self.small_file(id, "/etc/group").await?,
            _ => None,
        };
        validate::user_known(user, passwd.as_deref(), group.as_deref())
    }

    /// A small text file of the sandbox (`None` if it does not exist).
    pub(super) async fn small_file(&self, id: &str, path: &str) -> ApiResult<Option<String>> {
        const LIMIT: usize = 16 << 20;
        let (_, mut stream) = match self.read_file_of(id, path, 0, None).await {
            Ok(v) => v,
            Err(e) if e.code == ErrorCode::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        let mut text = Vec::new();
        while let Some(chunk) = stream.next().await {
            text.extend_from_slice(&chunk?);
            if text.len() > LIMIT {
                break;
            }
        }
        Ok(Some(String::from_utf8_lossy(&text).into_owned()))
    }

    /// Creates a sandbox of `tenant`. Its record and the reservation of its quota are
    /// one transaction; a tenant with quotas has it stored before the node is asked, so
    /// a refusal (`quota_exceeded`) leaves nothing anywhere. A plain sandbox of a tenant
    /// without quotas is one store write, made once its node answered.
    pub(super) async fn create_sandbox_to_end(
        &self,
        tenant: &str,
        req: CreateSandboxRequest,
    ) -> ApiResult<Sandbox> {
        // The create's span (exported with --otlp-endpoint): the sandbox, and its phases
        // once known (they are measured on the timeline, not as spans of their own).
        let span = tracing::info_span!(
            "create_sandbox",
            tenant,
            sandbox = tracing::field::Empty,
            total_ms = tracing::field::Empty,
            phases = tracing::field::Empty,
        );
        let mut timeline = Timeline::start();
        let wants_timings = req.timings;
        let mut made = None;
        let mut sb = tracing::Instrument::instrument(
            self.create_timed(tenant, req, &mut timeline, &mut made),
            span.clone(),
        )
        .await?;
        // This attempt's own sandbox (not an earlier attempt's, found by its key): its
        // phases, the last write included.
        if made.as_deref() == Some(sb.id.as_str()) {
            timeline.mark("commit");
            let timings = timeline.finish();
            self.create_stats
                .record(&sb.id, &timings, self.cfg.slow_create_ms);
            if !span.is_disabled() {
                let phases: Vec<String> = timings
                    .phases
                    .iter()
                    .map(|p| format!("{}={:.2}", p.phase, p.ms))
                    .collect();
                span.record("sandbox", sb.id.as_str());
                span.record("total_ms", timings.total_ms);
                span.record("phases", phases.join(" "));
            }
            sb.timings = Some(timings);
        }
        if !wants_timings {
            sb.timings = None;
        }
        Ok(sb)
    }

    /// A create, its phases marked on `timeline`; `made` is the id of the sandbox this
    /// attempt makes, once it has one.
    async fn create_timed(
        &self,
        tenant: &str,
        req: CreateSandboxRequest,
        timeline: &mut Timeline,
        made: &mut Option<String>,
    ) -> ApiResult<Sandbox> {
        let req = validate::flatten_environment(req)?;
        validate::create(&req)?;
        let gateway_url = self.check_model_access(&req)?;
        timeline.mark("validate");
        let now = now_ms();
        let id = new_id();
        *made = Some(id.clone());
        let image = req
            .image
            .clone()
            .unwrap_or_else(|| self.cfg.default_image.clone());
        let cpu = req.resources.cpu.unwrap_or(self.cfg.default_cpu);
        let memory_mb = req
            .resources
            .memory_mb
            .unwrap_or(self.cfg.default_memory_mb);
        let pids = req.resources.pids.unwrap_or(self.cfg.default_pids);
        let timeout_s = req.timeout_s.unwrap_or(DEFAULT_TIMEOUT_S);
        let cpu_millis = (cpu * 1000.0).round() as u64;
        let memory_bytes = memory_mb * 1024 * 1024;
        // Nodes that refused this sandbox (their own admission is the last word).
        let mut refused: Vec<String> = Vec::new();
        let placement = |exclude: &[String]| {
            self.nodes.place(&Placement {
                cpu_millis,
                memory_bytes,
                isolation: req.isolation,
                network: req.network.mode,
                exclude,
            })
        };
        let mut placed = placement(&refused)?;
        timeline.mark("placement");
        // Registry references (the image, layers) the node's catalog lacks are pulled
        // first; from here on they go by their catalog names.
        let requested_image = image;
        let (image, layers) =
            pull::ensure_images(&*placed.node, &requested_image, &req.layers).await?;
        // The images' own defaults, bottom first; unknown names fail here, before any
        // record exists.
        let config = self
            .stack_config(&*placed.node, &image, &layers, true)
            .await?;
        timeline.mark("images");
        let charge = dsec_iam::Usage::sandbox(cpu_millis, memory_mb);
        let mut sb = Sandbox {
            id: id.clone(),
            tenant: tenant.to_string(),
            state: SandboxState::Creating,
            image: image.clone(),
            auto_resume: req.auto_resume,
            qos: req.qos,
            idempotency_key: req.idempotency_key.clone(),
            layers: layers.clone(),
            image_digest: String::new(),
            backend: req.backend,
            resources: EffectiveResources {
                cpu,
                memory_mb,
                pids,
                disk_mb: None,
            },
            labels: req.labels.clone(),
            created_at: now,
            expires_at: now + timeout_s * 1000,
            idle_timeout_s: req.idle_timeout_s,
            last_active_at: now,
            failure: None,
            unhealthy_cause: None,
            unhealthy_since: None,
            lost_since: None,
            lost_from: None,
            disk_full_since: None,
            node: placed.name.clone(),
            job_suspended_at: None,
            committed_layers: Vec::new(),
            network: req.network.clone(),
            ip: None,
            filesystem: req.filesystem.clone(),
            isolation: req.isolation,
            model_access: None,
            model_token_id: None,
            timings: None,
        };
        let mut env = BTreeMap::from([
            (
                "PATH".to_string(),
                "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".to_string(),
            ),
            ("HOME".to_string(), "/root".to_string()),
            ("LANG".to_string(), "C.UTF-8".to_string()),
            ("TERM".to_string(), "xterm".to_string()),
            ("HOSTNAME".to_string(), id.clone()),
        ]);
        env.extend(config.env);
        env.extend(req.env.clone());
        // Its own model gateway token, stored with its record and deleted with it; the
        // caller's env cannot replace it (checked above).
        let model_token = match (&req.model_access, gateway_url) {
            (Some(access), Some(url)) => {
                let (minted, op) = self.iam.mint_model_token(tenant, &id, access.clone());
                env.insert(OPENAI_BASE_URL_ENV.into(), url);
                env.insert(OPENAI_API_KEY_ENV.into(), minted.token);
                sb.model_access = Some(access.clone());
                sb.model_token_id = Some(minted.record.token_id);
                Some(op)
            }
            _ => None,
        };
        let stored = records::Extras {
            launch: launch_of(&req),
            model_token,
        };
        let workdir = req
            .workdir
            .clone()
            .or(config.workdir)
            .unwrap_or_else(|| "/".into());
        let user = req
            .user
            .clone()
            .or(config.user)
            .filter(|u| u != "root" && u != "0");
        let spec_user = user.clone();
        let spec = NodeCreateSpec {
            id: id.clone(),
            image,
            layers,
            cpu_millis,
            memory_bytes,
            pids_max: pids,
            disk_mb: req.resources.disk_mb,
            qos: req.qos,
            env,
            workdir,
            user,
            network: req.network.clone(),
            writable_paths: req.filesystem.writable.clone(),
            tcp_bind: req.filesystem.tcp_bind.clone(),
            tcp_connect: req.filesystem.tcp_connect.clone(),
            isolation: req.isolation,
            labels: req.labels.clone(),
            lifetime: dsec_node_api::Lifetime {
                ttl_ms: Some(timeout_s.saturating_mul(1000)),
                idle_timeout_ms: req.idle_timeout_s.map(|s| s.saturating_mul(1000)),
                held: false,
            },
            model_link: sb.model_token_id.is_some(),
        };
        let claim = req.idempotency_key.as_deref().map(|key| {
            (
                key,
                records::IdemEntry {
                    id: id.clone(),
                    digest: Some(hex::encode(idempotency::request_digest(&req))),
                },
            )
        });
        // What is stored when. A plain sandbox (no init files, no user to check) of a
        // tenant without quotas is stored once, `ready`, with its idempotency key, in one
        // transaction after its node made it: a retry racing it makes a second sandbox,
        // which loses that transaction and is destroyed, and a crash before it leaves a
        // sandbox without a record, which the reaper destroys. Otherwise the record
        // (`creating`, with its key and its quota reservation) is stored before the node
        // is asked, so a retry on any replica finds it, and `ready` after.
        let limited = self
            .iam
            .cached_tenant(tenant)
            .is_none_or(|t| t.quotas != dsec_iam::Quotas::default());
        let deferred = !limited && req.files.is_empty() && spec_user.is_none();
        match (&claim, deferred) {
            (Some((key, _)), true) => {
                // A retry of a create that was made answers without asking a node. The
                // cache knows (a retry comes after its first attempt's record reached this
                // replica's watch); a create racing its retry builds a sandbox the losing
                // transaction destroys.
                let known = self.records.key_cached(tenant, key);
                if let Some(first) = match known {
                    true => self.records.idempotency(tenant, key).await?,
                    false => None,
                } {
                    if let Some(found) = self.first_attempt(&first, &req).await? {
                        return Ok(found);
                    }
                }
            }
            (Some(_), false) => {
                if let Some(found) = self
                    .insert_keyed(&sb, &claim, charge, &req, &stored)
                    .await?
                {
                    return Ok(found);
                }
            }
            (None, false) => self
                .records
                .insert(&sb, None, charge, &stored)
                .await
                .map_err(records::InsertError::into_api)?,
            (None, true) => {}
        }
        timeline.mark("store");
        let mut created = placed.node.create(spec.clone()).await;
        // A node's own admission may refuse a placement made on a load a heartbeat old:
        // the sandbox goes to another node, up to MAX_REFUSALS times.
        while let Err(e) = &created {
            if e.code != ErrorCode::Capacity || refused.len() >= MAX_REFUSALS {
                break;
            }
            refused.push(placed.name.clone());
            let Ok(next) = placement(&refused) else { break };
            tracing::info!(%id, refused = %placed.name, node = %next.name, "node refused the sandbox; placing it again");
            placed = next;
            sb.node = placed.name.clone();
            let to = placed.name.clone();
            if !deferred {
                if let Err(e) = self
                    .records
                    .update(&id, |r| {
                        r.node = to.clone();
                        Ok(true)
                    })
                    .await
                {
                    created = Err(e);
                    break;
                }
            }
            created = match pull::ensure_images(&*placed.node, &requested_image, &req.layers).await
            {
                Ok(_) => placed.node.create(spec.clone()).await,
                Err(e) => Err(e),
            };
        }
        let created = match created {
            Ok(c) => c,
            Err(e) => {
                if !deferred {
                    self.records.give_up(&sb).await;
                }
                return Err(e);
            }
        };
        timeline.nest(&created.timings, "node_call");
        sb.image_digest = created.image_digest;
        sb.resources.disk_mb = created.disk_mb;
        sb.ip = created.ip.map(|ip| ip.to_string());
        sb.state = SandboxState::Ready;
        if deferred {
            // The record keeps the phases up to its write.
            sb.timings = Some(timeline.clone().finish());
            return self
                .store_created(sb, &claim, charge, &req, &stored, placed)
                .await;
        }
        // Ready in this replica's cache for the calls below; stored once they are done.
        self.records.cache_only(&sb);
        if let Err(e) = self.place_files(&*placed.node, &id, &req.files).await {
            let _ = self.remove(&id, None).await;
            return Err(e);
        }
        if let Err(e) = self.check_user(&id, spec_user.as_deref()).await {
            let _ = self.remove(&id, None).await;
            return Err(e);
        }
        timeline.mark("files");
        sb.timings = Some(timeline.clone().finish());
        let done = self
            .records
            .complete_create(&id, |rec| {
                if rec.state != SandboxState::Creating && rec.state != SandboxState::Ready {
                    // Deleted (stopping) meanwhile: that delete wins.
                    return Err(state_error(rec));
                }
                *rec = sb.clone();
                Ok(true)
            })
            .await;
        match done {
            Ok(Some((sb, _))) => {
                placed.linger(&sb.id);
                Ok(sb)
            }
            failed => {
                match &failed {
                    // Whether the store kept it is unknown: it must not stay.
                    Err(e) if e.code == ErrorCode::Unavailable => self.records.give_up(&sb).await,
                    _ => self.records.finish_create(&id).await,
                }
                let _ = placed.node.destroy(&id).await;
                Err(match failed {
                    Err(e) => e,
                    _ => self.missing(&id).await,
                })
            }
        }
    }

    /// Stores the record (`creating`) of a keyed create with its key, before its node is
    /// asked. `Some` if an earlier attempt with the key is the answer.
    async fn insert_keyed(
        &self,
        sb: &Sandbox,
        claim: &Option<(&str, records::IdemEntry)>,
        charge: dsec_iam::Usage,
        req: &CreateSandboxRequest,
        stored: &records::Extras,
    ) -> ApiResult<Option<Sandbox>> {
        for _ in 0..=MAX_TAKEOVERS {
            match self.records.insert(sb, claim.clone(), charge, stored).await {
                Ok(()) => return Ok(None),
                Err(records::InsertError::KeyTaken(first)) => {
                    if let Some(found) = self.first_attempt(&first, req).await? {
                        return Ok(Some(found));
                    }
                }
                Err(e) => return Err(e.into_api()),
            }
        }
        Err(key_contended(req))
    }

    /// Stores a create made on its node in one transaction: the record, `ready`, with
    /// its idempotency key. If a racing attempt with the key stored its sandbox first,
    /// that one is the answer and this one is destroyed; if the store refuses, it is
    /// destroyed too, unless the store could not say whether it kept a keyed record.
    async fn store_created(
        &self,
        sb: Sandbox,
        claim: &Option<(&str, records::IdemEntry)>,
        charge: dsec_iam::Usage,
        req: &CreateSandboxRequest,
        stored: &records::Extras,
        placed: crate::nodes::Placed,
    ) -> ApiResult<Sandbox> {
        let mut answer = Err(key_contended(req));
        for _ in 0..=MAX_TAKEOVERS {
            match self
                .records
                .insert(&sb, claim.clone(), charge, stored)
                .await
            {
                Ok(()) => {
                    placed.linger(&sb.id);
                    return Ok(sb);
                }
                Err(records::InsertError::KeyTaken(first)) => {
                    match self.first_attempt(&first, req).await {
                        Ok(None) => continue,
                        Ok(Some(found)) => answer = Ok(found),
                        Err(e) => answer = Err(e),
                    }
                    break;
                }
                Err(e) => {
                    let e = e.into_api();
                    if e.code == ErrorCode::Unavailable && claim.is_some() {
                        // The store may keep the record yet (see `Records::insert`): the
                        // sandbox stays, for a retry with the key to find whole; if the
                        // record never lands, its node's reaper destroys it as an orphan.
                        return Err(e);
                    }
                    answer = Err(e);
                    break;
                }
            }
        }
        let _ = placed.node.destroy(&sb.id).await;
        answer
    }

    /// What a keyed create gets from the attempt that took its key first: that sandbox
    /// once it is made, or `None` when this attempt is to make it (the first failed and
    /// its record went, or its replica died mid-create and what it left is undone here).
    pub(super) async fn first_attempt(
        &self,
        first: &records::IdemEntry,
        req: &CreateSandboxRequest,
    ) -> ApiResult<Option<Sandbox>> {
        self.same_request(first, req).await?;
        // An attempt this replica gave up on (its store's answer was lost, and the
        // store kept it after all): what it left goes now, and the retry makes anew.
        if let Some(removed) = self.records.remove_if_given_up(&first.id).await {
            removed?;
            return Ok(None);
        }
        let found = match self.await_created(&first.id).await {
            Ok(found) => found,
            Err(e) if e.code == ErrorCode::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        if !self.records.abandoned(&found).await? {
            return Ok(Some(found));
        }
        tracing::info!(id = %found.id, "taking over a create whose replica is gone");
        // On a node that is gone, the sandbox is an orphan its node destroys when it is
        // back.
        if let Ok(node) = self.node_of(&found) {
            node.destroy(&found.id).await?;
        }
        self.records.remove(&found, None).await?;
        Ok(None)
    }

    pub(super) async fn delete_sandbox_to_end(&self, id: &str) -> ApiResult<()> {
        self.remove(id, None).await
    }

    pub(super) async fn pause_sandbox_to_end(&self, id: &str) -> ApiResult<PauseResult> {
        if !self
            .transition(id, SandboxState::Ready, SandboxState::Paused)
            .await?
        {
            let sandbox = self.record(id).await?;
            return Ok(PauseResult {
                sandbox,
                memory_before_bytes: 0,
                memory_after_bytes: 0,
            });
        }
        let node = match self.node_for(id).await {
            Ok(node) => node,
            Err(e) => {
                let _ = self
                    .transition(id, SandboxState::Paused, SandboxState::Ready)
                    .await;
                return Err(e);
            }
        };
        let (before, after) = match node.pause(id).await {
            Ok(v) => v,
            Err(e) => {
                // Whatever froze runs again; the sandbox stays usable.
                let _ = node.resume(id).await;
                let _ = self
                    .transition(id, SandboxState::Paused, SandboxState::Ready)
                    .await;
                return Err(e);
            }
        };
        let sandbox = self.record(id).await?;
        Ok(PauseResult {
            sandbox,
            memory_before_bytes: before,
            memory_after_bytes: after,
        })
    }

    pub(super) async fn resume_sandbox_to_end(&self, id: &str) -> ApiResult<Sandbox> {
        if self
            .transition(id, SandboxState::Paused, SandboxState::Ready)
            .await?
        {
            let resumed = match self.node_for(id).await {
                Ok(node) => node.resume(id).await.map(|()| node),
                Err(e) => Err(e),
            };
            let node = match resumed {
                Ok(node) => node,
                Err(e) => {
                    let _ = self
                        .transition(id, SandboxState::Ready, SandboxState::Paused)
                        .await;
                    return Err(e);
                }
            };
            let now = now_ms();
            let stops_clock = self.cfg.job_suspend_stops_lifetime;
            let mut was_held = false;
            let (sandbox, _) = self
                .change(id, |sb| {
                    sb.last_active_at = now;
                    // A job suspend stopped the clock: the lifetime goes on where it stopped.
                    was_held = sb.job_suspended_at.is_some();
                    if let Some(at) = sb.job_suspended_at.take() {
                        if stops_clock {
                            sb.expires_at += now.saturating_sub(at);
                        }
                    }
                    Ok(true)
                })
                .await?;
            // The node's clock runs again.
            if stops_clock && was_held {
                node.set_lifetime(id, node_lifetime(&sandbox, now, false))
                    .await?;
            }
            return Ok(sandbox);
        }
        self.record(id).await
    }

    pub(super) async fn commit_sandbox_to_end(
        &self,
        id: &str,
        req: CommitRequest,
    ) -> ApiResult<Image> {
        let sb = self.record(id).await?;
        // No pause or resume races the copy: a running sandbox is marked paused meanwhile.
        // The node stops its processes for the copy (without a pause's memory reclaim,
        // which would write back and drop the very pages the copy reads).
        let held_here = match sb.state {
            SandboxState::Ready => {
                self.transition(id, SandboxState::Ready, SandboxState::Paused)
                    .await?
            }
            SandboxState::Paused => false,
            _ => {
                self.ready(id).await?;
                false
            }
        };
        // An image removed since the create does not stop a commit of its files.
        let node = self.node_of(&sb)?;
        let config = self
            .stack_config(&*node, &sb.image, &sb.layers, false)
            .await?;
        let mut res = node
            .commit(id, &req.name, sb.committed_layers.clone(), config.clone())
            .await;
        // An earlier commit's layer is gone (its image was deleted and collected): the
        // writable layer still holds every change since the create, so capture all of it
        // on the sandbox's own layers instead.
        let restart = matches!(&res, Err(e) if e.code == ErrorCode::ImageNotFound)
            && !sb.committed_layers.is_empty();
        if restart {
            res = node.commit(id, &req.name, Vec::new(), config).await;
        }
        if held_here {
            self.transition(id, SandboxState::Paused, SandboxState::Ready)
                .await?;
        }
        let (img, diff) = res?;
        // An empty diff added no layer: nothing to remember.
        if diff.is_some() || restart {
            self.change(id, |rec| {
                if restart {
                    rec.committed_layers.clear();
                }
                if let Some(diff) = &diff {
                    rec.committed_layers.retain(|d| d != diff);
                    rec.committed_layers.push(diff.clone());
                }
                Ok(true)
            })
            .await?;
        }
        Ok(img)
    }

    pub(super) async fn set_network_to_end(
        &self,
        id: &str,
        policy: NetworkPolicy,
    ) -> ApiResult<Sandbox> {
        validate::network(&policy)?;
        let sb = self.ready(id).await?;
        self.node_of(&sb)?.set_network(id, policy.clone()).await?;
        self.change(id, |sb| {
            sb.network = policy.clone();
            Ok(true)
        })
        .await
        .map(|(sb, _)| sb)
    }

    pub(super) async fn set_timeout_to_end(
        &self,
        id: &str,
        req: SetTimeoutRequest,
    ) -> ApiResult<Sandbox> {
        if req.timeout_s == 0 || req.timeout_s > MAX_TIMEOUT_S {
            return Err(ApiError::new(
                ErrorCode::BadRequest,
                format!("timeout_s must be in [1, {MAX_TIMEOUT_S}]"),
            ));
        }
        let sb = self.ready(id).await?;
        let expires_at = now_ms() + req.timeout_s * 1000;
        // The node keeps the clock: it ends the sandbox when the new lifetime is over.
        self.node_of(&sb)?
            .set_lifetime(
                id,
                dsec_node_api::Lifetime {
                    ttl_ms: Some(req.timeout_s * 1000),
                    idle_timeout_ms: sb.idle_timeout_s.map(|s| s.saturating_mul(1000)),
                    held: false,
                },
            )
            .await?;
        self.change(id, |sb| {
            sb.expires_at = expires_at;
            Ok(true)
        })
        .await
        .map(|(sb, _)| sb)
    }
}

/// The lifetime the node keeps for `sb` as of `now`: what is left of it, and whether its
/// clock is stopped (a suspended job).
pub(super) fn node_lifetime(sb: &Sandbox, now: u64, held: bool) -> dsec_node_api::Lifetime {
    dsec_node_api::Lifetime {
        ttl_ms: Some(sb.expires_at.saturating_sub(now)),
        idle_timeout_ms: sb.idle_timeout_s.map(|s| s.saturating_mul(1000)),
        held,
    }
}

/// What a create asks for that its record does not show, kept for its forks.
impl ControlPlane {
    /// Checks a create's `model_access` against the server's model gateway: the URL to
    /// give the sandbox when it has some.
    fn check_model_access(&self, req: &CreateSandboxRequest) -> ApiResult<Option<String>> {
        let Some(access) = &req.model_access else {
            return Ok(None);
        };
        access.validate()?;
        let bad = |m: String| Err(ApiError::new(ErrorCode::BadRequest, m));
        let Some(gateway) = &self.cfg.model_gateway else {
            return bad(
                "model_access: this server has no model gateway (start it with \
                 --gateway-config)"
                    .into(),
            );
        };
        if let Some(m) = access
            .models
            .iter()
            .find(|m| !gateway.models.is_empty() && !gateway.models.contains(m))
        {
            return bad(format!(
                "model_access: the model gateway serves no model {m:?} (it serves {})",
                gateway.models.join(", ")
            ));
        }
        for name in [OPENAI_BASE_URL_ENV, OPENAI_API_KEY_ENV] {
            if req.env.contains_key(name) {
                return bad(format!(
                    "env sets {name}, which model_access sets to the sandbox's own gateway \
                     token and URL: leave it out"
                ));
            }
        }
        if let Some(ports) = &req.filesystem.tcp_connect {
            let port = gateway_port(&gateway.base_url);
            if !ports.contains(&port) {
                return bad(format!(
                    "filesystem.tcp_connect leaves out port {port}, which the sandbox \
                     needs to reach the model gateway ({})",
                    gateway.base_url
                ));
            }
        }
        Ok(Some(gateway.base_url.clone()))
    }
}

/// The TCP port of a gateway URL (`http://host[:port]/...`).
fn gateway_port(url: &str) -> u16 {
    let https = url.starts_with("https://");
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let host = rest.split('/').next().unwrap_or(rest);
    host.rsplit_once(':')
        .and_then(|(_, p)| p.parse().ok())
        .unwrap_or(if https { 443 } else { 80 })
}

fn launch_of(req: &CreateSandboxRequest) -> records::Launch {
    records::Launch {
        env: req.env.clone(),
        workdir: req.workdir.clone(),
        user: req.user.clone(),
    }
}
