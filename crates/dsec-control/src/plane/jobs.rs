//! Jobs: the sandboxes labelled with one job, suspended and resumed together.

use super::*;

impl ControlPlane {
    /// Ids of `tenant`'s sandboxes labelled `job=<job>`, sorted.
    pub(super) fn job_members(&self, tenant: &str, job: &str) -> ApiResult<Vec<String>> {
        if job.is_empty() || job.len() > 256 {
            return Err(ApiError::new(
                ErrorCode::BadRequest,
                "job must be 1 to 256 characters",
            ));
        }
        let mut ids: Vec<String> = self
            .records
            .filter(|s| {
                s.tenant == tenant && s.labels.get(JOB_LABEL).map(String::as_str) == Some(job)
            })
            .into_iter()
            .map(|s| s.id)
            .collect();
        ids.sort();
        Ok(ids)
    }

    pub(super) fn job_outcome(&self, id: String, error: ApiError) -> JobSandboxOutcome {
        let state = self
            .records
            .get(&id)
            .map(|s| s.state)
            .unwrap_or(SandboxState::Failed);
        JobSandboxOutcome {
            id,
            state,
            error: Some(error),
            memory_before_bytes: 0,
            memory_after_bytes: 0,
        }
    }

    pub(super) fn job_result(job: &str, mut sandboxes: Vec<JobSandboxOutcome>) -> JobResult {
        sandboxes.sort_by(|a, b| a.id.cmp(&b.id));
        JobResult {
            job: job.to_string(),
            sandboxes,
        }
    }

    pub(super) async fn suspend_job_to_end(&self, tenant: &str, job: &str) -> ApiResult<JobResult> {
        let ids = self.job_members(tenant, job)?;
        let outcomes = futures::stream::iter(ids)
            .map(|id| async move {
                match self.pause_sandbox_to_end(&id).await {
                    Ok(p) => {
                        let now = now_ms();
                        let (sb, mut error) = match self
                            .change(&id, |rec| {
                                Ok(rec.job_suspended_at.get_or_insert(now) == &now)
                            })
                            .await
                        {
                            Ok((sb, _)) => (sb, None),
                            Err(e) => (p.sandbox, Some(e)),
                        };
                        // The node stops the sandbox's clock (a preempted trainer must
                        // find its rollouts when it comes back).
                        if error.is_none() && self.cfg.job_suspend_stops_lifetime {
                            let lifetime = lifecycle::node_lifetime(&sb, now, true);
                            error = match self.node_of(&sb) {
                                Ok(node) => node.set_lifetime(&id, lifetime).await.err(),
                                Err(e) => Some(e),
                            };
                        }
                        JobSandboxOutcome {
                            id,
                            state: sb.state,
                            error,
                            memory_before_bytes: p.memory_before_bytes,
                            memory_after_bytes: p.memory_after_bytes,
                        }
                    }
                    Err(error) => self.job_outcome(id, error),
                }
            })
            .buffer_unordered(JOB_PARALLELISM)
            .collect::<Vec<_>>()
            .await;
        Ok(Self::job_result(job, outcomes))
    }

    pub(super) async fn resume_job_to_end(&self, tenant: &str, job: &str) -> ApiResult<JobResult> {
        let ids = self.job_members(tenant, job)?;
        let outcomes = futures::stream::iter(ids)
            .map(|id| async move {
                match self.resume_sandbox_to_end(&id).await {
                    Ok(sb) => JobSandboxOutcome {
                        id,
                        state: sb.state,
                        error: None,
                        memory_before_bytes: 0,
                        memory_after_bytes: 0,
                    },
                    Err(error) => self.job_outcome(id, error),
                }
            })
            .buffer_unordered(JOB_PARALLELISM)
            .collect::<Vec<_>>()
            .await;
        Ok(Self::job_result(job, outcomes))
    }
}
