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
    let mut sandbox: Option<String> = None;
    let mut cached = Vec::with_capacity(req.steps.len());
    let res = run_steps(api, caller, node, &req, base, &mut sandbox, &mut cached).await;
    if let Some(id) = sandbox {
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
    sandbox: &mut Option<String>,
    cached: &mut Vec<bool>,
) -> ApiResult<Image> {
    let (mut parent_name, mut parent_digest) = (req.base.clone(), base.digest);
    for (i, step) in req.steps.iter().enumerate() {
        let name = cache_name(&parent_digest, step);
        if let Ok(img) = node.image(&name).await {
            // The build sandbox (if any) is behind the cached image now.
            if let Some(id) = sandbox.take() {
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
                    .create_sandbox(
                        caller,
                        CreateSandboxRequest {
                            image: Some(parent_name.clone()),
                            labels: [("dsec-build".to_string(), req.name.clone())].into(),
                            timeout_s: Some(24 * 3600),
                            ..Default::default()
                        },
                    )
                    .await?;
                *sandbox = Some(sb.id.clone());
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
                api.write_file(caller, &id, path, None, body).await?;
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
                api.upload_tar(caller, &id, dest, body).await?;
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
