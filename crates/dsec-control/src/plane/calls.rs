//! Agent calls: the checks before a sandbox is called, and streams under the watchdog.

use super::*;

impl ControlPlane {
    /// The node of sandbox `id` once the sandbox can take an agent call: `ready`, or
    /// paused with `auto_resume` (then resumed now).
    pub(super) async fn usable(&self, id: &str) -> ApiResult<Arc<dyn NodeApi>> {
        let sb = match self.ready(id).await {
            Ok(sb) => sb,
            Err(e) => {
                let auto = self.records.get(id).is_some_and(|s| s.auto_resume);
                if e.code != ErrorCode::Paused || !auto {
                    return Err(e);
                }
                let resumed = id.to_string();
                self.to_end(move |me| async move { me.resume_sandbox_to_end(&resumed).await })
                    .await?;
                self.ready(id).await?
            }
        };
        self.node_of(&sb)
    }

    pub(super) async fn call(&self, id: &str, req: Request) -> ApiResult<Reply> {
        self.call_within(id, req, Some(Limit::call())).await
    }

    /// [`ControlPlane::call`] with its own deadline (`None`: the watchdog only).
    pub(super) async fn call_within(
        &self,
        id: &str,
        req: Request,
        limit: Option<Limit>,
    ) -> ApiResult<Reply> {
        self.guarded(id, limit, async {
            let node = self.usable(id).await?;
            node.call(id, req).await
        })
        .await
    }

    /// [`ControlPlane::call_within`] recorded under `request_id` on the node.
    pub(super) async fn call_recorded(
        &self,
        id: &str,
        request_id: &str,
        req: Request,
        limit: Option<Limit>,
    ) -> ApiResult<Reply> {
        self.guarded(id, limit, async {
            let node = self.usable(id).await?;
            node.call_recorded(id, request_id, req).await
        })
        .await
    }

    pub(super) async fn call_ok(&self, id: &str, req: Request) -> ApiResult<()> {
        match self.call(id, req).await? {
            Reply::Ok => Ok(()),
            other => Err(unexpected(other)),
        }
    }

    /// `stream` with the watchdog on sandbox `id` between its items, and `limit` (a
    /// command's timeout) over the whole: either ends it with the item `fail` makes of
    /// the error. Dropping the stream drops the node's, which stops the command or
    /// transfer.
    pub(super) fn watched<T: Send + 'static>(
        &self,
        id: &str,
        stream: futures::stream::BoxStream<'static, T>,
        limit: Option<Limit>,
        fail: fn(ApiError) -> T,
    ) -> futures::stream::BoxStream<'static, T> {
        let watchdog = self.watchdog(id);
        let deadline = limit.map(|l| l.deadline());
        futures::stream::unfold(Some(stream), move |inner| {
            let watchdog = watchdog.clone();
            let deadline = deadline.clone();
            async move {
                let mut inner = inner?;
                let (at, late) = match deadline {
                    Some((at, e)) => (Some(at), Some(e)),
                    None => (None, None),
                };
                tokio::select! {
                    item = inner.next() => item.map(|item| (item, Some(inner))),
                    e = watchdog.dead() => Some((fail(e), None)),
                    () = sleep_until_some(at) => {
                        Some((fail(late.unwrap_or_else(|| internal("deadline"))), None))
                    }
                }
            }
        })
        .boxed()
    }

    /// Writes the events a command's end tells of (an OOM kill, output past its cap),
    /// on a task of their own: the answer does not wait for them.
    pub(super) fn note_exit(
        &self,
        id: &str,
        command: &dsec_wire::v1::Command,
        exit: &agent::ExitInfo,
        oom_killed: bool,
        request_id: Option<std::sync::Arc<str>>,
    ) {
        let truncated = exit.stdout_truncated || exit.stderr_truncated;
        if !(oom_killed || truncated) || !self.events.enabled() {
            return;
        }
        let Some(sb) = self.records.get(id) else {
            return;
        };
        // Only now, on the rare exec that has an event: not on every exec's path.
        let command = events::command_text(command);
        let event = |kind, cause: String| {
            let mut e = events::about(&sb, kind);
            e.cause = Some(cause);
            e.command = Some(command.clone());
            e.request_id = request_id.as_ref().map(|r| r.to_string());
            e
        };
        let mut noted = Vec::new();
        if oom_killed {
            noted.push(event(
                EventKind::OomKilled,
                format!(
                    "killed by the sandbox's memory limit ({} MiB)",
                    sb.resources.memory_mb
                ),
            ));
        }
        if truncated {
            noted.push(event(
                EventKind::OutputTruncated,
                format!(
                    "wrote {} bytes to stdout and {} to stderr; what passed the cap was dropped",
                    exit.stdout_bytes, exit.stderr_bytes
                ),
            ));
        }
        for e in noted {
            self.emit_later(e);
        }
    }

    /// Writes a `disk_full` event when `result` is a write that ran out of space.
    pub(super) fn note_no_space<T>(&self, id: &str, path: &str, result: &ApiResult<T>) {
        let Err(e) = result else { return };
        if e.code != ErrorCode::NoSpace || !self.events.enabled() {
            return;
        }
        let Some(sb) = self.records.get(id) else {
            return;
        };
        let mut event = events::about(&sb, EventKind::DiskFull);
        event.cause = Some(format!("writing {path}: {}", e.message));
        self.emit_later(event);
    }

    pub(super) fn exec_spec(req: &ExecRequest, stream: bool) -> ApiResult<ExecSpec> {
        validate::exec(req)?;
        Ok(ExecSpec {
            cmd: req.cmd.clone(),
            env: req.env.clone(),
            cwd: req.cwd.clone(),
            stdin: req.stdin.is_some(),
            timeout_ms: ms_from_s("timeout_s", req.timeout_s)?,
            stream,
            output_limit: req.output_limit,
            user: req.user.clone(),
        })
    }
}

/// Sleeps until `at`; never ends without one.
pub(super) async fn sleep_until_some(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
