//! E2B front: the subset of E2B's REST API (`/e2b/...`) and of its in-sandbox daemon envd
//! (`/e2b/envd/...`: `/health`, `/files`, and the `process.Process` and
//! `filesystem.Filesystem` Connect services, JSON codec) that the unmodified `e2b` Python
//! SDK uses, so code written for E2B runs on dsec with
//! `E2B_API_URL=http://HOST:PORT/e2b`, `E2B_SANDBOX_URL=http://HOST:PORT/e2b/envd` and
//! `E2B_API_KEY=<dsec key>` (plus `E2B_VALIDATE_API_KEY=false`). Every call translates to
//! [`SandboxApi`]; the agent keeps its one protocol.
//!
//! Mapping: a template name is a dsec image (`base` is the default Debian image); E2B
//! metadata are labels `e2b.meta.KEY`; sandboxes run as the user `user` (uid 1000, home
//! `/home/user`, made at create when the image lacks it), as E2B's do; envd's
//! `Authorization: Basic` user picks another. envd requests name their sandbox with the
//! `E2b-Sandbox-Id` header and authenticate with `X-Access-Token`, which is the API key
//! (the create answer hands it back as `envdAccessToken`). Networking follows dsec's
//! default (`none`) unless `allow_internet_access` is true.

mod connect;
mod envd;
mod rest;
mod template;

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::HeaderMap;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::Router;
use dsec_control::SandboxApi;

use crate::Scoped;
use dsec_wire::{ApiError, ErrorCode};

/// The envd version reported to the SDK: recent enough for stdin control (0.3.0), a
/// server-side default user (0.4.0), closing stdin (0.5.2) and octet-stream uploads
/// (0.5.7); file metadata (0.6.2) is not served.
pub const ENVD_VERSION: &str = "0.5.7";
/// The user E2B sandboxes run commands as.
pub const DEFAULT_USER: &str = "user";
/// Label prefix of E2B metadata.
const META_PREFIX: &str = "e2b.meta.";
/// Label naming the E2B template a sandbox was created from.
const TEMPLATE_LABEL: &str = "e2b.template";

/// The routes, relative to the server root.
pub fn routes(api: Arc<dyn SandboxApi>) -> Router<Arc<dyn SandboxApi>> {
    let templates = Arc::new(template::Templates::default());
    let rest = rest::routes()
        .route_layer(middleware::from_fn_with_state(
            api.clone(),
            crate::extract::require_api_key,
        ))
        .layer(axum::Extension(templates.clone()));
    let envd = envd::routes().route_layer(middleware::from_fn_with_state(api, require_envd_token));
    // Template file uploads carry their own one-time token (the SDK sends no key there).
    let uploads = Router::new()
        .route(
            "/e2b/template-files/{token}",
            axum::routing::put(template::upload),
        )
        .layer(axum::Extension(templates));
    Router::new()
        .nest("/e2b", rest)
        .nest("/e2b/envd", envd)
        .merge(uploads)
}

/// envd's auth: `X-Access-Token` (or `X-API-Key`) must be the API key.
async fn require_envd_token(
    State(api): State<Arc<dyn SandboxApi>>,
    mut req: Request,
    next: Next,
) -> Response {
    let h = req.headers();
    let token = h
        .get("x-access-token")
        .or_else(|| h.get(dsec_wire::v1::API_KEY_HEADER))
        .and_then(|v| v.to_str().ok());
    match crate::extract::authorize(api.as_ref(), token, &req) {
        Ok(principal) => {
            req.extensions_mut().insert(principal);
            next.run(req).await
        }
        Err(e) => rest::error(e).into_response(),
    }
}

/// The sandbox an envd request is for (`E2b-Sandbox-Id`).
fn sandbox_id(h: &HeaderMap) -> Result<String, ApiError> {
    h.get("e2b-sandbox-id")
        .and_then(|v| v.to_str().ok())
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .ok_or_else(|| {
            ApiError::new(
                ErrorCode::BadRequest,
                "missing E2b-Sandbox-Id header (set E2B_SANDBOX_URL to this server's /e2b/envd)",
            )
        })
}

/// Runs `cmd` as root in sandbox `id` (setup the front does on the caller's behalf).
async fn run_as_root(
    api: &Scoped,
    id: &str,
    cmd: dsec_wire::v1::Command,
) -> Result<dsec_wire::v1::ExecResult, ApiError> {
    api.exec(
        id,
        dsec_wire::v1::ExecRequest {
            cmd,
            env: Default::default(),
            cwd: Some("/".into()),
            stdin: None,
            timeout_s: Some(30.0),
            output_limit: None,
            // By id: an image without /etc/passwd has no name `root` yet.
            user: Some("0:0".into()),
            request_id: None,
        },
    )
    .await
}

/// RFC 3339 (UTC, millisecond precision) of unix milliseconds.
fn rfc3339(ms: u64) -> String {
    let secs = ms / 1000;
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        ms % 1000
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(951_782_400_123), "2000-02-29T00:00:00.123Z");
        assert_eq!(rfc3339(1_796_000_000_000), "2026-11-30T00:53:20.000Z");
    }
}
