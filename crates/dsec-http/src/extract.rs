//! Extractors whose rejections are [`HttpError`]s, so that malformed requests get the same
//! JSON error body as every other failure, and the API-key middleware.

use std::sync::Arc;

use axum::extract::{FromRequest, FromRequestParts, Request, State};
use axum::http::{header, HeaderMap};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use dsec_control::SandboxApi;
use dsec_wire::v1::API_KEY_HEADER;

use crate::error::HttpError;

/// A JSON request body (`content-type: application/json` required). Rejections (syntax,
/// unknown fields, wrong types, missing content type, too large) become `bad_request` /
/// `payload_too_large` with serde's message.
#[derive(Debug, FromRequest)]
#[from_request(via(axum::Json), rejection(HttpError))]
pub struct Json<T>(pub T);

/// A query string decoded with serde; failures become `bad_request`.
#[derive(Debug, FromRequestParts)]
#[from_request(via(axum::extract::Query), rejection(HttpError))]
pub struct Query<T>(pub T);

/// Path parameters; failures (e.g. a non-numeric pid) become `bad_request`.
#[derive(Debug, FromRequestParts)]
#[from_request(via(axum::extract::Path), rejection(HttpError))]
pub struct Path<T>(pub T);

/// The API key of a request: header `x-api-key`, else `Authorization: Bearer KEY`.
pub fn api_key(headers: &HeaderMap) -> Option<&str> {
    if let Some(v) = headers.get(API_KEY_HEADER) {
        return v.to_str().ok().map(str::trim);
    }
    let auth = headers.get(header::AUTHORIZATION)?.to_str().ok()?.trim();
    let (scheme, key) = auth.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| key.trim())
}

/// Middleware on every route but `/v1/health`: asks the API whether the key is valid.
pub async fn require_api_key(
    State(api): State<Arc<dyn SandboxApi>>,
    req: Request,
    next: Next,
) -> Response {
    if let Err(e) = api.authenticate(api_key(req.headers())) {
        return HttpError(e).into_response();
    }
    next.run(req).await
}
