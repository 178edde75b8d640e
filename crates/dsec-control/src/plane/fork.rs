//! Fork: a sandbox's files captured once, as a layer every fork shares read-only, and
//! `count` sandboxes made from them with the source's settings.
//!
//! The capture is the commit path: the source is frozen while its writable layer is
//! stored as a new layer on top of its stack (image `fork-<source id>`, re-pointed by
//! each fork of that source), then runs on. Each fork is a plain create of that image,
//! so forks of forks, placement and quotas work as for any create; the captured files
//! exist once, in the layer, whatever the count. A fork that cannot be made undoes the
//! ones made before it: the call makes all of them or none.

use super::*;

/// Forks created at once (each is a full create on its node).
const FORKS_AT_ONCE: usize = 8;

impl ControlPlane {
    pub(super) async fn fork_sandbox_to_end(
        &self,
        tenant: &str,
        id: &str,
        req: ForkRequest,
    ) -> ApiResult<ForkResult> {
        if req.count == 0 || req.count > MAX_FORKS {
            return Err(ApiError::new(
                ErrorCode::BadRequest,
                format!("count must be 1 to {MAX_FORKS} (got {})", req.count),
            ));
        }
        let sb = self.record(id).await?;
        let launch = self.records.launch(id).await?;
        let r = &req.resources;
        self.forks_fit_quota(
            tenant,
            req.count,
            r.cpu.unwrap_or(sb.resources.cpu),
            r.memory_mb.unwrap_or(sb.resources.memory_mb),
        )
        .await?;
        let image = self
            .commit_sandbox_to_end(
                id,
                CommitRequest {
                    name: format!("fork-{id}"),
                },
            )
            .await?;
        let mut labels = req.labels.clone().unwrap_or_else(|| sb.labels.clone());
        for server_label in [
            POOL_LABEL,
            POOL_ORIGIN_LABEL,
            FNCALL_LABEL,
            BATCH_LABEL,
            BATCH_TASK_LABEL,
        ] {
            labels.remove(server_label);
        }
        labels.insert(FORK_OF_LABEL.into(), id.to_string());
        let mut env = launch.env;
        env.extend(req.env.clone());
        let create = CreateSandboxRequest {
            image: Some(image.name.clone()),
            backend: sb.backend,
            resources: Resources {
                cpu: r.cpu.or(Some(sb.resources.cpu)),
                memory_mb: r.memory_mb.or(Some(sb.resources.memory_mb)),
                pids: r.pids.or(Some(sb.resources.pids)),
                disk_mb: r.disk_mb.or(sb.resources.disk_mb),
            },
            timeout_s: req.timeout_s,
            idle_timeout_s: sb.idle_timeout_s,
            env,
            labels,
            network: sb.network.clone(),
            filesystem: sb.filesystem.clone(),
            isolation: sb.isolation,
            workdir: req.workdir.clone().or(launch.workdir),
            auto_resume: sb.auto_resume,
            qos: sb.qos,
            user: req.user.clone().or(launch.user),
            // Each fork gets a token of its own.
            model_access: sb.model_access.clone(),
            ..CreateSandboxRequest::default()
        };
        let made: Vec<ApiResult<Sandbox>> = futures::stream::iter(0..req.count)
            .map(|_| self.create_sandbox_to_end(tenant, create.clone()))
            .buffer_unordered(FORKS_AT_ONCE)
            .collect()
            .await;
        let mut forks = Vec::with_capacity(made.len());
        let mut failure = None;
        for r in made {
            match r {
                Ok(sb) => forks.push(sb),
                Err(e) => {
                    failure.get_or_insert(e);
                }
            }
        }
        if let Some(e) = failure {
            for f in &forks {
                if let Err(undo) = self.delete_sandbox_to_end(&f.id).await {
                    tracing::warn!(fork = %f.id, error = %undo, "undoing a fork");
                }
            }
            return Err(ApiError::new(
                e.code,
                format!(
                    "fork of {id}: {} of {} forks could be made, none is kept: {}",
                    forks.len(),
                    req.count,
                    e.message
                ),
            ));
        }
        forks.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(ForkResult {
            sandboxes: forks,
            captured_layer: image.layers.last().cloned(),
            image: image.name,
        })
    }

    /// Refuses a fork into `count` that the tenant's quotas cannot hold before anything
    /// is captured. Each fork is still admitted on its own when it is created; this only
    /// spares a capture and creates that would all be undone.
    async fn forks_fit_quota(
        &self,
        tenant: &str,
        count: u32,
        cpu: f64,
        memory_mb: u64,
    ) -> ApiResult<()> {
        let unlimited = self
            .iam
            .cached_tenant(tenant)
            .is_some_and(|t| !t.disabled && t.quotas == dsec_iam::Quotas::default());
        if unlimited {
            return Ok(());
        }
        let n = u64::from(count);
        let cpu_millis = (cpu.max(0.0) * 1000.0).round() as u64;
        let all = dsec_iam::Usage {
            sandboxes: n,
            cpu_millis: cpu_millis.saturating_mul(n),
            memory_mb: memory_mb.saturating_mul(n),
        };
        match self.iam.reserve(tenant, all).await {
            Ok(_) => Ok(()),
            Err(e) => {
                let e = ApiError::from(e);
                Err(ApiError::new(
                    e.code,
                    format!("a fork into {count} does not fit: {}", e.message),
                ))
            }
        }
    }
}
