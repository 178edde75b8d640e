//! The runner of one batch: drives each task through its states, one compare-and-swap
//! on its record per step, so that a restarted runner knows what may be left of it (see
//! the parent module).

use std::io::Write;

use dsec_blob::BlobStore;
use sha2::Digest;
use tokio_util::sync::CancellationToken;

use super::*;

impl ControlPlane {
    /// Starts the runner of batch `id` here if this plane owns it and none runs.
    pub(super) async fn start_batch_if_owner(&self, id: &str) {
        if self.batches.lock().is_ok_and(|b| b.contains_key(id)) {
            return;
        }
        if !self.elect_owner(NS_BATCH_OWNERS, id).await {
            return;
        }
        let token = CancellationToken::new();
        match self.batches.lock() {
            Ok(mut b) => {
                if b.contains_key(id) {
                    return;
                }
                b.insert(id.to_string(), token.clone());
            }
            Err(_) => return,
        }
        let Some(me) = self.me.upgrade() else {
            return;
        };
        let id = id.to_string();
        tokio::spawn(async move {
            if let Err(e) = me.run_batch(&id, token).await {
                tracing::warn!(batch = %id, error = %e.message, "batch runner stopped; it is picked up again");
            }
            if let Ok(mut b) = me.batches.lock() {
                b.remove(&id);
            }
        });
    }

    /// Runs every unfinished task of batch `id`, then marks it finished.
    async fn run_batch(&self, id: &str, cancel: CancellationToken) -> ApiResult<()> {
        let (batch, _) = self.read_batch(id).await?;
        if batch.state == BatchState::Cancelled {
            cancel.cancel();
        } else if batch.state != BatchState::Running {
            return Ok(());
        }
        let ctx = Arc::new(BatchCtx {
            batch,
            store: self.batch_store()?,
            cancel,
        });
        let tasks = self.stored_tasks(id).await?;
        let open: Vec<TaskRec> = tasks
            .into_iter()
            .filter(|t| !t.task.status.state.is_terminal())
            .collect();
        tracing::info!(batch = %id, open = open.len(), "running batch");
        let parallelism = ctx.batch.parallelism as usize;
        let stops: Vec<Stop> = futures::stream::iter(open)
            .map(|rec| {
                let ctx = ctx.clone();
                async move { self.drive_task(&ctx, rec).await.err() }
            })
            .buffer_unordered(parallelism)
            .filter_map(|stop| async move { stop })
            .collect()
            .await;
        if let Some(stop) = stops.first() {
            return Err(ApiError::new(ErrorCode::Unavailable, stop.0.clone()));
        }
        // Belt and braces: no sandbox of the batch outlives it.
        self.delete_batch_sandboxes(&ctx.batch, None).await;
        let cancelled = ctx.cancel.is_cancelled();
        self.finish_batch(id, cancelled).await
    }

    async fn finish_batch(&self, id: &str, cancelled: bool) -> ApiResult<()> {
        loop {
            let Some(entry) = self.store.get(NS_BATCHES, id).await.map_err(store_err)? else {
                return Ok(());
            };
            let mut batch: StoredBatch = serde_json::from_slice(&entry.value).map_err(internal)?;
            if batch.ended_at_ms.is_some() {
                return Ok(());
            }
            batch.state = if cancelled || batch.state == BatchState::Cancelled {
                BatchState::Cancelled
            } else {
                BatchState::Finished
            };
            batch.ended_at_ms = Some(now_ms());
            let value = serde_json::to_vec(&batch).map_err(internal)?;
            match self
                .store
                .put(NS_BATCHES, id, &value, dsec_state::Expect::Rev(entry.rev))
                .await
            {
                Ok(_) => {
                    tracing::info!(batch = %id, state = ?batch.state, "batch ended");
                    return Ok(());
                }
                Err(dsec_state::StateError::Conflict { .. }) => continue,
                Err(e) => return Err(store_err(e)),
            }
        }
    }

    /// Takes one task from wherever it is to `finalized` or `failed`.
    async fn drive_task(&self, b: &BatchCtx, mut t: TaskRec) -> Step {
        loop {
            let state = t.task.status.state;
            if state.is_terminal() {
                return Ok(());
            }
            if b.cancel.is_cancelled() {
                self.discard_attempt(b, &t).await?;
                let s = &mut t.task.status;
                s.state = TaskState::Failed;
                s.error = Some("cancelled".into());
                s.ended_at_ms = Some(now_ms());
                return self.save_task(b, &mut t).await;
            }
            match state {
                TaskState::Pending => self.run_attempt(b, &mut t).await?,
                TaskState::Collecting => self.resume_collecting(b, &mut t).await?,
                _ => {
                    // Found in flight by a (re)started runner: the attempt is gone with
                    // the runner that made it.
                    self.discard_attempt(b, &t).await?;
                    let s = &mut t.task.status;
                    tracing::info!(batch = %b.batch.id, task = %s.id, attempt = s.attempt, state = state.as_str(), "retrying a task a restart interrupted");
                    s.error = Some(format!(
                        "attempt {} was interrupted while {} (server restart); retried",
                        s.attempt,
                        state.as_str()
                    ));
                    s.state = TaskState::Pending;
                    self.save_task(b, &mut t).await?;
                }
            }
        }
    }

    /// Writes a task's record if nobody changed it since it was read.
    async fn save_task(&self, b: &BatchCtx, t: &mut TaskRec) -> Step {
        let value = serde_json::to_vec(&t.task).map_err(|e| Stop(e.to_string()))?;
        match self
            .store
            .put(
                &tasks_ns(&b.batch.id),
                &t.task.status.id,
                &value,
                dsec_state::Expect::Rev(t.rev),
            )
            .await
        {
            Ok(rev) => {
                t.rev = rev;
                Ok(())
            }
            Err(e) => Err(Stop(format!(
                "saving task {} of batch {}: {e}",
                t.task.status.id, b.batch.id
            ))),
        }
    }

    /// One attempt: create, place inputs, run, collect.
    async fn run_attempt(&self, b: &BatchCtx, t: &mut TaskRec) -> Step {
        {
            let s = &mut t.task.status;
            s.attempt += 1;
            s.state = TaskState::Creating;
            s.sandbox_id = None;
            s.node = None;
            s.exit_code = None;
            s.signal = None;
            s.timed_out = false;
            s.started_at_ms = Some(now_ms());
            t.task.hashed.clear();
        }
        self.save_task(b, t).await?;
        let p = &b.batch.principal;
        let mut req = b.batch.template.clone();
        req.labels.insert(BATCH_LABEL.into(), b.batch.id.clone());
        req.labels.insert(BATCH_TASK_LABEL.into(), attempt_label(t));
        req.queue = Some(QueueOptions {
            priority: b.batch.priority,
            max_wait_s: Some(CREATE_MAX_WAIT_S),
        });
        // The sandbox outlives the command's timeout and the collection after it (a
        // running command is activity: no idle timeout reaps it meanwhile).
        let needed = t.task.spec.timeout_s + COLLECT_MARGIN_S;
        let lifetime = req.timeout_s.unwrap_or(DEFAULT_TIMEOUT_S).max(needed);
        req.timeout_s = Some(lifetime.min(MAX_TIMEOUT_S));
        // Not raced against a cancel: a create dropped half-way could leave a sandbox the
        // cancel's sweep does not yet see.
        let created = self.create_unchecked(&p.tenant, req).await;
        let sb = match created {
            Ok(sb) => sb,
            Err(e)
                if matches!(
                    e.code,
                    ErrorCode::Capacity | ErrorCode::Unavailable | ErrorCode::QuotaExceeded
                ) =>
            {
                // No room yet: not the task's fault, so not a failure.
                tracing::debug!(batch = %b.batch.id, task = %t.task.status.id, error = %e.message, "no capacity for a task; waiting");
                t.task.status.state = TaskState::Pending;
                t.task.status.attempt -= 1;
                self.save_task(b, t).await?;
                tokio::select! {
                    () = tokio::time::sleep(REQUEUE_DELAY) => {}
                    () = b.cancel.cancelled() => {}
                }
                return Ok(());
            }
            Err(e) => {
                return self
                    .attempt_failed(b, t, format!("creating its sandbox: {}", e.message), None)
                    .await
            }
        };
        t.task.status.sandbox_id = Some(sb.id.clone());
        t.task.status.node = Some(sb.node.clone());
        self.save_task(b, t).await?;
        if let Err(e) = self.place_inputs(b, t, &sb.id).await {
            return self
                .attempt_failed(b, t, format!("placing inputs: {}", e.message), None)
                .await;
        }
        t.task.status.state = TaskState::Initialized;
        self.save_task(b, t).await?;
        t.task.status.state = TaskState::Running;
        self.save_task(b, t).await?;

        let spec = &t.task.spec;
        let exec = ExecRequest {
            cmd: Command::Argv(spec.command.clone()),
            env: spec.env.clone(),
            cwd: spec.cwd.clone(),
            stdin: None,
            timeout_s: Some(spec.timeout_s as f64),
            output_limit: None,
            user: None,
            request_id: None,
        };
        let ran = tokio::select! {
            r = self.exec(p, &sb.id, exec) => r,
            () = b.cancel.cancelled() => return Ok(()),
        };
        let r = match ran {
            Ok(r) => r,
            Err(e) => {
                return self
                    .attempt_failed(b, t, format!("running its command: {}", e.message), None)
                    .await
            }
        };
        let s = &mut t.task.status;
        s.exit_code = r.exit.exit_code;
        s.signal = r.exit.signal;
        s.timed_out = r.exit.timed_out;
        if r.exit.exit_code == Some(0) && !r.exit.timed_out && !r.oom_killed {
            return self.collect(b, t, &sb.id).await;
        }
        let why = if r.exit.timed_out {
            format!("timed out after {} s", spec.timeout_s)
        } else if r.oom_killed {
            "killed by the memory limit (OOM)".to_string()
        } else if let Some(sig) = r.exit.signal {
            format!("killed by signal {sig}")
        } else {
            format!("exited with code {}", r.exit.exit_code.unwrap_or(-1))
        };
        let mut env_names: Vec<String> = b.batch.template.env.keys().cloned().collect();
        env_names.extend(spec.env.keys().cloned());
        env_names.sort();
        env_names.dedup();
        let snapshot = ErrorSnapshot {
            task: t.task.status.id.clone(),
            attempt: t.task.status.attempt,
            exit_code: r.exit.exit_code,
            signal: r.exit.signal,
            oom_killed: r.oom_killed,
            timed_out: r.exit.timed_out,
            stdout_tail: tail_lines(&r.stdout, SNAPSHOT_LINES),
            stderr_tail: tail_lines(&r.stderr, SNAPSHOT_LINES),
            env_names,
            duration_ms: r.exit.duration_ms,
        };
        self.attempt_failed(b, t, why, Some(snapshot)).await
    }

    /// Writes a task's inputs into its sandbox, each checked against its digest.
    async fn place_inputs(&self, b: &BatchCtx, t: &TaskRec, id: &str) -> ApiResult<()> {
        for (path, input) in &t.task.spec.inputs {
            if let Some((dir, _)) = path.rsplit_once('/') {
                if !dir.is_empty() {
                    self.mkdir(
                        &b.batch.principal,
                        id,
                        MkdirRequest {
                            path: dir.to_string(),
                        },
                    )
                    .await?;
                }
            }
            let body = blob_stream(b.store.clone(), input.clone());
            self.write_file(&b.batch.principal, id, path, None, body, None)
                .await?;
        }
        Ok(())
    }

    /// Phase one (the agent hashes every output) and phase two (copy, hash, compare).
    async fn collect(&self, b: &BatchCtx, t: &mut TaskRec, id: &str) -> Step {
        t.task.status.state = TaskState::Collecting;
        let mut hashed = BTreeMap::new();
        for path in t.task.spec.outputs.clone() {
            match self
                .call(id, Request::FileHash { path: path.clone() })
                .await
            {
                Ok(Reply::Hashed { sha256, size }) => {
                    if size > MAX_OUTPUT_BYTES {
                        let why =
                            format!("output {path}: {size} bytes, more than {MAX_OUTPUT_BYTES}");
                        return self.attempt_failed(b, t, why, None).await;
                    }
                    hashed.insert(path, (sha256, size));
                }
                Ok(other) => {
                    let why = format!("hashing output {path}: {}", unexpected(other).message);
                    return self.attempt_failed(b, t, why, None).await;
                }
                Err(e) => {
                    let why = if e.code == ErrorCode::NotFound {
                        format!("declared output {path} is missing")
                    } else {
                        format!("hashing output {path}: {}", e.message)
                    };
                    return self.attempt_failed(b, t, why, None).await;
                }
            }
        }
        t.task.hashed = hashed;
        self.save_task(b, t).await?;
        self.copy_outputs(b, t, id).await
    }

    /// Phase two for every output not yet verified in the blob store, then `finalized`.
    async fn copy_outputs(&self, b: &BatchCtx, t: &mut TaskRec, id: &str) -> Step {
        for (i, path) in t.task.spec.outputs.clone().iter().enumerate() {
            let Some((want, size)) = t.task.hashed.get(path).cloned() else {
                let why = format!("output {path} was not hashed");
                return self.attempt_failed(b, t, why, None).await;
            };
            let key = output_key(b, t, i, path);
            match self.copy_output(b, id, path, &key).await {
                Ok((got, bytes)) if got == want && bytes == size => {
                    t.task.status.outputs.insert(
                        path.clone(),
                        OutputRecord {
                            key,
                            sha256: got,
                            bytes,
                        },
                    );
                }
                Ok((got, bytes)) => {
                    let (s, k) = (b.store.clone(), key.clone());
                    let _ = blocking(move || s.delete(&k)).await;
                    tracing::warn!(batch = %b.batch.id, task = %t.task.status.id, output = %path, "output checksum mismatch");
                    let why = format!(
                        "checksum mismatch on output {path}: the agent hashed {size} bytes to \
                         {want}, the copy is {bytes} bytes hashing to {got} (it changed during \
                         collection)"
                    );
                    return self.attempt_failed(b, t, why, None).await;
                }
                Err(e) => {
                    let why = format!("copying output {path}: {}", e.message);
                    return self.attempt_failed(b, t, why, None).await;
                }
            }
        }
        self.finalize(b, t).await
    }

    /// Streams `path` of sandbox `id` to the blob store at `key`, hashing what it copies.
    async fn copy_output(
        &self,
        b: &BatchCtx,
        id: &str,
        path: &str,
        key: &str,
    ) -> ApiResult<(String, u64)> {
        let (_, mut stream) = self
            .read_file(&b.batch.principal, id, path, 0, None)
            .await?;
        let mut tmp = tempfile::NamedTempFile::new().map_err(internal)?;
        let mut hasher = sha2::Sha256::new();
        let mut bytes = 0u64;
        while let Some(chunk) = stream.next().await {
            let chunk = chunk?;
            bytes += chunk.len() as u64;
            if bytes > MAX_OUTPUT_BYTES {
                return Err(ApiError::new(
                    ErrorCode::PayloadTooLarge,
                    format!("grew past {MAX_OUTPUT_BYTES} bytes while copied"),
                ));
            }
            hasher.update(&chunk);
            tmp.write_all(&chunk).map_err(internal)?;
        }
        tmp.flush().map_err(internal)?;
        let tmp = tmp.into_temp_path();
        let (s, k) = (b.store.clone(), key.to_string());
        blocking(move || s.upload(&k, &tmp)).await?;
        Ok((format!("{:x}", hasher.finalize()), bytes))
    }

    /// A task a runner found `collecting`: keeps what is verified in the blob store,
    /// copies the rest again from a live sandbox, or starts the attempt over.
    async fn resume_collecting(&self, b: &BatchCtx, t: &mut TaskRec) -> Step {
        let outputs = t.task.spec.outputs.clone();
        let mut all_there = t.task.hashed.len() == outputs.len();
        for (i, path) in outputs.iter().enumerate() {
            if !all_there {
                break;
            }
            let Some((want, size)) = t.task.hashed.get(path).cloned() else {
                all_there = false;
                break;
            };
            let key = output_key(b, t, i, path);
            let (s, k) = (b.store.clone(), key.clone());
            let stored = blocking(move || hash_blob(&s, &k)).await;
            if matches!(&stored, Ok(Some((got, n))) if *got == want && *n == size) {
                t.task.status.outputs.insert(
                    path.clone(),
                    OutputRecord {
                        key,
                        sha256: want,
                        bytes: size,
                    },
                );
            } else {
                all_there = false;
            }
        }
        if all_there {
            return self.finalize(b, t).await;
        }
        let live = t.task.status.sandbox_id.clone().filter(|id| {
            self.records
                .get(id)
                .is_some_and(|s| s.state == SandboxState::Ready)
        });
        match live {
            Some(id) if t.task.hashed.len() == outputs.len() => {
                t.task.status.outputs.clear();
                self.copy_outputs(b, t, &id).await
            }
            _ => {
                self.discard_attempt(b, t).await?;
                let s = &mut t.task.status;
                s.error = Some(format!(
                    "attempt {} was interrupted while collecting (server restart); retried",
                    s.attempt
                ));
                s.outputs.clear();
                s.state = TaskState::Pending;
                self.save_task(b, t).await
            }
        }
    }

    /// Every output verified: the task is done, then its sandbox goes.
    async fn finalize(&self, b: &BatchCtx, t: &mut TaskRec) -> Step {
        let s = &mut t.task.status;
        s.state = TaskState::Finalized;
        s.ended_at_ms = Some(now_ms());
        s.error = None;
        self.save_task(b, t).await?;
        self.discard_attempt(b, t).await
    }

    /// An attempt went wrong: its snapshot is saved, its sandbox deleted, and the task
    /// is tried again or fails.
    async fn attempt_failed(
        &self,
        b: &BatchCtx,
        t: &mut TaskRec,
        why: String,
        snapshot: Option<ErrorSnapshot>,
    ) -> Step {
        tracing::info!(batch = %b.batch.id, task = %t.task.status.id, attempt = t.task.status.attempt, error = %why, "task attempt failed");
        if let Some(snap) = snapshot {
            let key = format!(
                "{}/tasks/{}/{}/error.json",
                batch_prefix(&b.batch),
                t.task.status.id,
                t.task.status.attempt
            );
            let data = serde_json::to_vec_pretty(&snap).map_err(|e| Stop(e.to_string()))?;
            let (s, k) = (b.store.clone(), key.clone());
            match blocking(move || s.put(&k, &data)).await {
                Ok(()) => t.task.status.error_snapshot = Some(key),
                Err(e) => {
                    tracing::warn!(batch = %b.batch.id, error = %e.message, "saving an error snapshot")
                }
            }
        }
        self.discard_attempt(b, t).await?;
        let s = &mut t.task.status;
        s.failures += 1;
        s.error = Some(why);
        s.outputs.clear();
        if s.failures > t.task.spec.retries {
            s.state = TaskState::Failed;
            s.ended_at_ms = Some(now_ms());
        } else {
            s.state = TaskState::Pending;
        }
        self.save_task(b, t).await
    }

    /// Deletes the sandbox(es) of a task's current attempt: the one its record names,
    /// and any its label finds (a create a crash interrupted before it was recorded).
    async fn discard_attempt(&self, b: &BatchCtx, t: &TaskRec) -> Step {
        if t.task.status.attempt == 0 {
            return Ok(());
        }
        self.delete_batch_sandboxes(&b.batch, Some(&attempt_label(t)))
            .await;
        if let Some(id) = &t.task.status.sandbox_id {
            self.delete_for_batch(&b.batch, id).await?;
        }
        Ok(())
    }

    /// Deletes the sandboxes of a batch (of one attempt, with `attempt`).
    async fn delete_batch_sandboxes(&self, batch: &StoredBatch, attempt: Option<&str>) {
        let ids: Vec<String> = self
            .records
            .filter(|s| {
                s.tenant == batch.principal.tenant
                    && s.labels.get(BATCH_LABEL) == Some(&batch.id)
                    && attempt.is_none_or(|a| {
                        s.labels.get(BATCH_TASK_LABEL).map(String::as_str) == Some(a)
                    })
            })
            .into_iter()
            .map(|s| s.id)
            .collect();
        for id in ids {
            if let Err(e) = self.delete_for_batch(batch, &id).await {
                tracing::warn!(batch = %batch.id, sandbox = %id, error = %e.0, "deleting a batch sandbox");
            }
        }
    }

    /// Deletes one sandbox, tolerating it being gone; retried a few times, since the
    /// next attempt must not start while it lives.
    async fn delete_for_batch(&self, batch: &StoredBatch, id: &str) -> Step {
        let mut last = String::new();
        for _ in 0..5 {
            match self.delete_sandbox(&batch.principal, id).await {
                Ok(()) => return Ok(()),
                Err(e) if matches!(e.code, ErrorCode::NotFound | ErrorCode::Expired) => {
                    return Ok(())
                }
                Err(e) => last = e.message,
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        Err(Stop(format!("could not delete sandbox {id}: {last}")))
    }
}

fn attempt_label(t: &TaskRec) -> String {
    format!("{}.{}", t.task.status.id, t.task.status.attempt)
}

fn output_key(b: &BatchCtx, t: &TaskRec, index: usize, path: &str) -> String {
    let base: String = path
        .rsplit('/')
        .next()
        .unwrap_or("out")
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect();
    let base = if base.is_empty() || base == "." || base == ".." {
        "out".into()
    } else {
        base
    };
    format!(
        "{}/tasks/{}/{}/outputs/{index}-{base}",
        batch_prefix(&b.batch),
        t.task.status.id,
        t.task.status.attempt
    )
}

/// An input's bytes from the blob store in chunks; ends with an error (so the write is
/// not committed) if they do not hash to the digest recorded at submit.
fn blob_stream(store: Arc<dyn BlobStore>, input: InputDigest) -> ByteStream {
    struct At {
        store: Arc<dyn BlobStore>,
        input: InputDigest,
        pos: u64,
        hasher: Option<sha2::Sha256>,
    }
    let start = At {
        store,
        input,
        pos: 0,
        hasher: Some(sha2::Sha256::new()),
    };
    futures::stream::unfold(start, |mut at| async move {
        let hasher = at.hasher.take()?;
        if at.pos >= at.input.bytes {
            let got = format!("{:x}", hasher.finalize());
            if got == at.input.sha256 {
                return None;
            }
            let e = ApiError::new(
                ErrorCode::Conflict,
                format!(
                    "input {} changed since the batch was submitted (sha256 {got}, expected {})",
                    at.input.key, at.input.sha256
                ),
            );
            return Some((Err(e), at));
        }
        let (s, k, range) = (
            at.store.clone(),
            at.input.key.clone(),
            at.pos..(at.pos + INPUT_CHUNK).min(at.input.bytes),
        );
        match blocking(move || s.get_range(&k, range)).await {
            Ok(chunk) if !chunk.is_empty() => {
                let mut hasher = hasher;
                hasher.update(&chunk);
                at.pos += chunk.len() as u64;
                at.hasher = Some(hasher);
                Some((Ok(Bytes::from(chunk)), at))
            }
            Ok(_) => Some((
                Err(ApiError::new(
                    ErrorCode::Conflict,
                    format!("input {} is shorter than at submit", at.input.key),
                )),
                at,
            )),
            Err(e) => Some((Err(e), at)),
        }
    })
    .boxed()
}
