//! The model gateway's core: an OpenAI-compatible front door for the models that code in
//! sandboxes (tool-using agents, LLM judges) calls.
//!
//! [`Gateway::handle`] takes one request of an OpenAI route (chat completions,
//! completions, embeddings) with the caller's bearer key and answers a [`Reply`]: the
//! upstream's answer passed through (a stream chunk by chunk, never buffered), or an
//! error in OpenAI's shape. Upstreams are configured per public model name
//! ([`GatewayConfig`]); their keys stay here, never in a sandbox. A request goes to the
//! upstream of its model with the fewest requests in flight, and to the next one when an
//! upstream cannot be reached.
//!
//! There is no HTTP server here: `dsec-http::gateway` maps routes onto this, as the
//! `/v1` API maps onto `SandboxApi`.

pub mod config;
pub mod openai;
mod upstream;

use std::sync::Arc;

use bytes::Bytes;
use futures::stream::BoxStream;

pub use config::{ConfigError, GatewayConfig, ModelConfig, UpstreamConfig};
use openai::ErrorKind;
use upstream::Upstreams;

/// An OpenAI route the gateway forwards.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// `POST /v1/chat/completions`.
    ChatCompletions,
    /// `POST /v1/completions`.
    Completions,
    /// `POST /v1/embeddings`.
    Embeddings,
}

impl Route {
    /// Its path below the base URL (`/v1`).
    pub fn path(self) -> &'static str {
        match self {
            Route::ChatCompletions => "/chat/completions",
            Route::Completions => "/completions",
            Route::Embeddings => "/embeddings",
        }
    }
}

/// A body streamed to the caller as it arrives from the upstream.
pub type ByteStream = BoxStream<'static, Result<Bytes, std::io::Error>>;

/// The body of a [`Reply`].
pub enum ReplyBody {
    /// All of it.
    Full(Bytes),
    /// Passed through as the upstream sends it (an SSE stream, a large answer).
    Stream(ByteStream),
}

impl std::fmt::Debug for ReplyBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReplyBody::Full(b) => f.debug_tuple("Full").field(&b.len()).finish(),
            ReplyBody::Stream(_) => f.write_str("Stream"),
        }
    }
}

/// What the gateway answers a request.
#[derive(Debug)]
pub struct Reply {
    /// HTTP status.
    pub status: u16,
    /// Response headers (content type first).
    pub headers: Vec<(String, String)>,
    /// Response body.
    pub body: ReplyBody,
}

/// The gateway: configured models, their upstreams, and the keys allowed to call them.
#[derive(Debug)]
pub struct Gateway {
    config: GatewayConfig,
    upstreams: Arc<Upstreams>,
}

impl Gateway {
    /// A gateway over `config` (checked first).
    pub fn new(config: GatewayConfig) -> Result<Self, ConfigError> {
        config.check()?;
        let upstreams = Arc::new(Upstreams::new(&config)?);
        Ok(Self { config, upstreams })
    }

    /// Its configuration.
    pub fn config(&self) -> &GatewayConfig {
        &self.config
    }

    /// Checks the caller's bearer key; the error is the answer to give.
    pub fn authorize(&self, bearer: Option<&str>) -> Result<(), Box<Reply>> {
        let Some(key) = bearer else {
            return Err(Box::new(openai::error(
                401,
                "no API key: send Authorization: Bearer KEY",
                ErrorKind::InvalidRequest,
                Some("invalid_api_key"),
            )));
        };
        if self.config.key_allowed(key) {
            Ok(())
        } else {
            Err(Box::new(openai::error(
                401,
                "the API key is not valid for this gateway",
                ErrorKind::InvalidRequest,
                Some("invalid_api_key"),
            )))
        }
    }

    /// Answers a request of `route` with JSON `body`, from a caller holding `bearer`.
    pub async fn handle(&self, bearer: Option<&str>, route: Route, body: Bytes) -> Reply {
        if let Err(reply) = self.authorize(bearer) {
            return *reply;
        }
        let request = match openai::RequestView::parse(&body) {
            Ok(r) => r,
            Err(message) => {
                return openai::error(400, message, ErrorKind::InvalidRequest, None);
            }
        };
        if !self.config.models.contains_key(&request.model) {
            return openai::model_not_found(&request.model);
        }
        let model = request.model.clone();
        self.upstreams.forward(&model, route, request, body).await
    }

    /// `GET /v1/models`: the public model names.
    pub fn list_models(&self, bearer: Option<&str>) -> Reply {
        if let Err(reply) = self.authorize(bearer) {
            return *reply;
        }
        let data: Vec<serde_json::Value> =
            self.config.models.keys().map(|m| model_entry(m)).collect();
        openai::json(200, &serde_json::json!({"object": "list", "data": data}))
    }

    /// `GET /v1/models/{id}`.
    pub fn get_model(&self, bearer: Option<&str>, id: &str) -> Reply {
        if let Err(reply) = self.authorize(bearer) {
            return *reply;
        }
        if !self.config.models.contains_key(id) {
            return openai::model_not_found(id);
        }
        openai::json(200, &model_entry(id))
    }
}

fn model_entry(id: &str) -> serde_json::Value {
    serde_json::json!({"id": id, "object": "model", "created": 0, "owned_by": "dsec"})
}
