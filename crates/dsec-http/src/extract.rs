//! Extractors whose rejections are [`HttpError`]s, so that malformed requests get the same
//! JSON error body as every other failure, and the API-key middleware.

use std::sync::Arc;

use axum::extract::{FromRequest, FromRequestParts, OriginalUri, Request, State};
use axum::http::{header, HeaderMap};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use dsec_control::{Principal, SandboxApi};
use dsec_wire::v1::API_KEY_HEADER;
use dsec_wire::ApiError;

use crate::error::HttpError;

/// A JSON request body (`content-type: application/json` required). Rejections (syntax,
/// unknown fields, wrong types, missing content type, too large) become `bad_request` /
/// `payload_too_large` with serde's message. A top-level array is refused too: serde
/// reads a struct from a sequence of its fields, so `[]` would pass as a request with
/// every field at its default.
#[derive(Debug)]
pub struct Json<T>(pub T);

/// Whether the request says its body is JSON (`application/json` or `application/*+json`).
fn json_content_type(headers: &HeaderMap) -> bool {
    let Some(ct) = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let essence = ct
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    essence == "application/json"
        || (essence.starts_with("application/") && essence.ends_with("+json"))
}

impl<T, S> FromRequest<S> for Json<T>
where
    T: serde::de::DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = HttpError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        if !json_content_type(req.headers()) {
            return Err(HttpError::bad_request(
                "Expected request with `Content-Type: application/json`",
            ));
        }
        let bytes = bytes::Bytes::from_request(req, state).await.map_err(|r| {
            let code = if r.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
                dsec_wire::ErrorCode::PayloadTooLarge
            } else {
                dsec_wire::ErrorCode::BadRequest
            };
            HttpError::new(code, r.body_text())
        })?;
        if bytes.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'[') {
            return Err(HttpError::bad_request(
                "request body must be a JSON object, not an array",
            ));
        }
        let axum::Json(v) = axum::Json::<T>::from_bytes(&bytes)?;
        Ok(Json(v))
    }
}

/// A query string decoded with serde; failures become `bad_request`.
#[derive(Debug, FromRequestParts)]
#[from_request(via(axum::extract::Query), rejection(HttpError))]
pub struct Query<T>(pub T);

/// Path parameters; failures (e.g. a non-numeric pid) become `bad_request`.
#[derive(Debug, FromRequestParts)]
#[from_request(via(axum::extract::Path), rejection(HttpError))]
pub struct Path<T>(pub T);

/// The password of `Authorization: Basic` (what an HTTP client sends for a URL of the
/// form `http://user:KEY@host/...`; the user name is ignored).
pub fn basic_password(headers: &HeaderMap) -> Option<String> {
    use base64::Engine as _;
    let auth = headers.get(header::AUTHORIZATION)?.to_str().ok()?.trim();
    let (scheme, creds) = auth.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(creds.trim())
        .ok()?;
    let text = String::from_utf8(decoded).ok()?;
    let (_, password) = text.split_once(':')?;
    Some(password.to_string())
}

/// The API key of a request: header `x-api-key`, else `Authorization: Bearer KEY`.
pub fn api_key(headers: &HeaderMap) -> Option<&str> {
    if let Some(v) = headers.get(API_KEY_HEADER) {
        return v.to_str().ok().map(str::trim);
    }
    let auth = headers.get(header::AUTHORIZATION)?.to_str().ok()?.trim();
    let (scheme, key) = auth.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| key.trim())
}

/// The API key a browser's WebSocket offers as a subprotocol
/// ([`dsec_wire::v1::KEY_PROTOCOL_PREFIX`] and the key in unpadded base64url).
pub fn websocket_key(headers: &HeaderMap) -> Option<String> {
    use base64::Engine as _;
    let offered = headers.get(header::SEC_WEBSOCKET_PROTOCOL)?.to_str().ok()?;
    let encoded = offered
        .split(',')
        .map(str::trim)
        .find_map(|p| p.strip_prefix(dsec_wire::v1::KEY_PROTOCOL_PREFIX))?;
    let key = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(encoded)
        .ok()?;
    String::from_utf8(key).ok()
}

/// The key of a request however it came: [`api_key`]'s headers, the password of
/// `Authorization: Basic` ([`basic_password`]), or a WebSocket's subprotocol
/// ([`websocket_key`]).
pub fn request_key(headers: &HeaderMap) -> Option<String> {
    api_key(headers)
        .map(str::to_string)
        .or_else(|| basic_password(headers))
        .or_else(|| websocket_key(headers))
}

/// Middleware on every route but `/v1/health`: asks the API who the key is, checks that
/// it has the scope the route needs ([`dsec_iam::required_scope`]: `forbidden` if not),
/// and hands the [`dsec_control::Principal`] to the handler (see [`crate::Scoped`]).
pub async fn require_api_key(
    State(api): State<Arc<dyn SandboxApi>>,
    mut req: Request,
    next: Next,
) -> Response {
    // Clients that only take a URL (SandboxFusion's) carry the key as its password, and
    // browsers' WebSockets as a subprotocol.
    let key = request_key(req.headers());
    match authorize(api.as_ref(), key.as_deref(), &req) {
        Ok(principal) => {
            req.extensions_mut().insert(principal);
            next.run(req).await
        }
        Err(e) => HttpError(e).into_response(),
    }
}

/// Who `key` is, if it may make `req` (`unauthorized` / `forbidden` otherwise).
pub fn authorize(
    api: &dyn SandboxApi,
    key: Option<&str>,
    req: &Request,
) -> Result<Principal, ApiError> {
    let principal = api.authenticate(key)?;
    // Nested routers see their path without the prefix: the scope is the full path's.
    let path = req
        .extensions()
        .get::<OriginalUri>()
        .map_or_else(|| req.uri().path(), |u| u.path());
    principal.require(dsec_iam::required_scope(req.method().as_str(), path))?;
    Ok(principal)
}
