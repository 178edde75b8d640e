//! `dsec image build`: an image from a base and a list of steps, run in a sandbox of our
//! own. Each step becomes one layer (a packdiff commit), and is cached under a name
//! derived from (parent image digest, step): a rebuild reuses every step up to the first
//! change, like a Dockerfile, but on dsec sandboxes.

use dsec_node_api::NodeApi;
use dsec_wire::v1::*;
use dsec_wire::{ApiError, ErrorCode};
use futures::StreamExt;
use sha2::{Digest, Sha256};

use crate::api::{ApiResult, ByteStream, Principal, SandboxApi};

pub mod dockerfile;

/// Most steps one build may have.
pub const MAX_STEPS: usize = 128;
/// Default time limit of one `run` step.
const STEP_TIMEOUT_S: f64 = 1800.0;

/// Idle timeout of a build sandbox. Its build touches it more often than this while the
/// build lives ([`Held::keep_alive`]), so a build whose API server died (killed,
/// crashed) leaves its sandboxes for its node to end this soon after, on any node and
/// whichever replica ran it.
pub(crate) const BUILD_SANDBOX_IDLE_S: u64 = 20;
/// How often a build touches its sandboxes.
const BUILD_HEARTBEAT: std::time::Duration = std::time::Duration::from_secs(4);

/// The sandboxes a build holds, kept from idling out while the build runs.
#[derive(Debug, Default)]
pub(crate) struct Held(std::sync::Mutex<Vec<String>>);

impl Held {
    fn ids(&self) -> std::sync::MutexGuard<'_, Vec<String>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The build holds `id` from now.
    pub(crate) fn add(&self, id: &str) {
        self.ids().push(id.to_string());
    }

    /// The build no longer holds `id`.
    pub(crate) fn remove(&self, id: &str) {
        self.ids().retain(|s| s != id);
    }

    /// Every sandbox held, which the build no longer holds.
    pub(crate) fn take_all(&self) -> Vec<String> {
        std::mem::take(&mut *self.ids())
    }

    /// Runs `work`, touching the sandboxes held (a stat of `/`: activity on their node)
    /// every [`BUILD_HEARTBEAT`] until it ends.
    pub(crate) async fn keep_alive<T>(
        &self,
        api: &dyn SandboxApi,
        caller: &Principal,
        work: impl std::future::Future<Output = T>,
    ) -> T {
        let heartbeat = async {
            loop {
                tokio::time::sleep(BUILD_HEARTBEAT).await;
                let ids = self.ids().clone();
                for id in ids {
                    let _ = api.stat_file(caller, &id, "/").await;
                }
            }
        };
        tokio::select! {
            out = work => out,
            never = heartbeat => never,
        }
    }
}

/// What a build sandbox of `image`, labelled for `build` (its result's name), is
/// created with.
pub(crate) fn build_sandbox_request(image: &str, build: &str) -> CreateSandboxRequest {
    CreateSandboxRequest {
        image: Some(image.to_string()),
        labels: [("dsec-build".to_string(), build.to_string())].into(),
        timeout_s: Some(24 * 3600),
        idle_timeout_s: Some(BUILD_SANDBOX_IDLE_S),
        ..Default::default()
    }
}

/// The cache name of `step` on top of the image `parent_digest`.
pub fn cache_name(parent_digest: &str, step: &BuildStep) -> String {
    let mut h = Sha256::new();
    h.update(parent_digest.as_bytes());
    h.update(b"\n");
    h.update(serde_json::to_vec(step).unwrap_or_default());
    format!("build-cache/{}", &hex::encode(h.finalize())[..32])
}

/// Runs the build for `caller` (the build sandbox is one of its tenant's). The build
/// sandbox is deleted on every path.
pub async fn build(
    api: &dyn SandboxApi,
    caller: &Principal,
    node: &dyn NodeApi,
    req: BuildRequest,
) -> ApiResult<BuildResult> {
    if req.steps.is_empty() || req.steps.len() > MAX_STEPS {
        return Err(ApiError::new(
            ErrorCode::BadRequest,
            format!("steps: 1 to {MAX_STEPS} steps, got {}", req.steps.len()),
        ));
    }
    let base = node.image(&req.base).await?;
    let held = Held::default();
    let mut cached = Vec::with_capacity(req.steps.len());
    let res = held
        .keep_alive(
            api,
            caller,
            run_steps(api, caller, node, &req, base, &held, &mut cached),
        )
        .await;
    for id in held.take_all() {
        let _ = api.delete_sandbox(caller, &id).await;
    }
    Ok(BuildResult {
        image: res?,
        cached,
    })
}

async fn run_steps(
    api: &dyn SandboxApi,
    caller: &Principal,
    node: &dyn NodeApi,
    req: &BuildRequest,
    base: Image,
    held: &Held,
    cached: &mut Vec<bool>,
) -> ApiResult<Image> {
    // The one build sandbox, on the last image built (`held` holds it too).
    let mut sandbox: Option<String> = None;
    let (mut parent_name, mut parent_digest) = (req.base.clone(), base.digest);
    for (i, step) in req.steps.iter().enumerate() {
        let name = cache_name(&parent_digest, step);
        if let Ok(img) = node.image(&name).await {
            // The build sandbox (if any) is behind the cached image now.
            if let Some(id) = sandbox.take() {
                held.remove(&id);
                let _ = api.delete_sandbox(caller, &id).await;
            }
            parent_name = name;
            parent_digest = img.digest;
            cached.push(true);
            continue;
        }
        let id = match sandbox.clone() {
            Some(id) => id,
            None => {
                let sb = api
                    .create_sandbox(caller, build_sandbox_request(&parent_name, &req.name))
                    .await?;
                held.add(&sb.id);
                sandbox = Some(sb.id.clone());
                sb.id
            }
        };
        match step {
            BuildStep::Run(cmd) => {
                let r = api
                    .exec(
                        caller,
                        &id,
                        ExecRequest {
                            cmd: Command::Shell(cmd.clone()),
                            env: Default::default(),
                            cwd: None,
                            stdin: None,
                            timeout_s: Some(req.step_timeout_s.unwrap_or(STEP_TIMEOUT_S)),
                            output_limit: None,
                            user: None,
                            request_id: None,
                        },
                    )
                    .await?;
                if r.exit.exit_code != Some(0) {
                    let tail: String = r
                        .stderr
                        .chars()
                        .rev()
                        .take(2000)
                        .collect::<Vec<_>>()
                        .into_iter()
                        .rev()
                        .collect();
                    return Err(ApiError::new(
                        ErrorCode::Failed,
                        format!(
                            "build step {} ({cmd:?}) failed: exit {:?}, signal {:?}{}: {tail}",
                            i + 1,
                            r.exit.exit_code,
                            r.exit.signal,
                            if r.exit.timed_out { ", timed out" } else { "" },
                        ),
                    ));
                }
            }
            BuildStep::File { path, content } => {
                let body: ByteStream =
                    futures::stream::iter([Ok(bytes::Bytes::from(content.clone()))]).boxed();
                api.write_file(caller, &id, path, None, body, None).await?;
            }
            BuildStep::Copy { dest, tar } => {
                use base64::Engine;
                let data = base64::engine::general_purpose::STANDARD
                    .decode(tar)
                    .map_err(|e| {
                        ApiError::new(
                            ErrorCode::BadRequest,
                            format!(
                                "build step {}: copy to {dest}: tar is not base64: {e}",
                                i + 1
                            ),
                        )
                    })?;
                api.mkdir(caller, &id, MkdirRequest { path: dest.clone() })
                    .await?;
                let body: ByteStream =
                    futures::stream::iter([Ok(bytes::Bytes::from(data))]).boxed();
                api.upload_tar(caller, &id, dest, body, None).await?;
            }
        }
        let img = api
            .commit_sandbox(caller, &id, CommitRequest { name: name.clone() })
            .await?;
        parent_name = name;
        parent_digest = img.digest;
        cached.push(false);
    }
    node.tag_image(&parent_name, &req.name, None).await
}
