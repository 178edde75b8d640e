//! `GET /v1/sandboxes/{id}/terminal`: a shell on a PTY in the sandbox, over a WebSocket
//! (subprotocol [`TERMINAL_PROTOCOL`]).
//!
//! No new machinery below HTTP: the shell is a background process started with a PTY
//! ([`SandboxApi::start_process`]), its output is the process's followed output, and
//! what the client sends becomes stdin writes, resizes and signals. The shell is started
//! before the upgrade, so a sandbox that is gone or paused is an HTTP error the client
//! can read, not a socket that closes; it is killed when the socket closes, whichever
//! side closes it, and when the upgrade fails.
//!
//! Messages: the client sends [`TerminalInput`] as JSON text (a binary message is stdin
//! bytes); the server sends each [`ExecEvent`] as JSON text (`started` with the shell's
//! pid, `stdout`, then `exit` or `error`, after which it closes).
//!
//! [`SandboxApi::start_process`]: dsec_control::SandboxApi::start_process

use std::collections::BTreeMap;

use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::response::{IntoResponse, Response};
use dsec_control::EventStream;
use dsec_wire::v1::{
    Command, ExecEvent, PtySize, SignalRequest, StartProcessRequest, StdinRequest, TerminalInput,
    TerminalQuery, TERMINAL_PROTOCOL,
};
use dsec_wire::{ApiError, ErrorCode};
use futures::{SinkExt, StreamExt};

use crate::error::HttpError;
use crate::extract::{Path, Query};
use crate::scoped::Scoped;

/// Largest message a client may send (keys typed or pasted).
const MAX_INPUT: usize = 1 << 20;

/// What runs when the client names no command: bash if the image has it.
const DEFAULT_SHELL: &str =
    "if command -v bash >/dev/null 2>&1; then exec bash -i; else exec sh -i; fi";

/// `GET /v1/sandboxes/{id}/terminal?cols=&rows=&cmd=&user=` (a WebSocket upgrade).
pub async fn terminal(
    api: Scoped,
    Path(id): Path<String>,
    Query(q): Query<TerminalQuery>,
    ws: Result<WebSocketUpgrade, axum::extract::ws::rejection::WebSocketUpgradeRejection>,
) -> Result<Response, HttpError> {
    let ws = ws.map_err(|e| {
        HttpError::bad_request(format!(
            "a terminal is a WebSocket (Upgrade: websocket, subprotocol {TERMINAL_PROTOCOL}): {e}"
        ))
    })?;
    let size = PtySize {
        cols: q.cols.unwrap_or(120).clamp(2, 1000),
        rows: q.rows.unwrap_or(32).clamp(2, 1000),
    };
    let env = BTreeMap::from([("TERM".to_string(), "xterm-256color".to_string())]);
    let shell = api
        .start_process(
            &id,
            StartProcessRequest {
                cmd: Command::Shell(q.cmd.unwrap_or_else(|| DEFAULT_SHELL.to_string())),
                env,
                cwd: None,
                pty: Some(size),
                tag: Some("terminal".into()),
                timeout_s: None,
                user: q.user,
                request_id: None,
            },
        )
        .await?;
    let pid = shell.pid;
    let output = match api.process_output(&id, pid, 0, 0, true).await {
        Ok(o) => o,
        Err(e) => {
            kill(&api, &id, pid).await;
            return Err(e.into());
        }
    };
    let (on_fail, fail_id) = (api.clone(), id.clone());
    Ok(ws
        .protocols([TERMINAL_PROTOCOL])
        .max_message_size(MAX_INPUT)
        .on_failed_upgrade(move |e| {
            tracing::warn!(sandbox = %fail_id, error = %e, "terminal upgrade failed");
            tokio::spawn(async move { kill(&on_fail, &fail_id, pid).await });
        })
        .on_upgrade(move |socket| bridge(api, id, pid, output, socket))
        .into_response())
}

async fn kill(api: &Scoped, id: &str, pid: u32) {
    let kill = SignalRequest {
        signal: "KILL".into(),
    };
    if let Err(e) = api.signal_process(id, pid, kill).await {
        if e.code != ErrorCode::NotFound {
            tracing::debug!(sandbox = %id, pid, error = %e.message, "ending a terminal's shell");
        }
    }
}

/// Carries the shell's output to the socket and the socket's input to the shell until
/// either ends, then kills the shell.
async fn bridge(api: Scoped, id: String, pid: u32, mut output: EventStream, socket: WebSocket) {
    let (mut tx, mut rx) = socket.split();
    // First the shell's pid (the followed output starts with what it printed).
    let started = serde_json::to_string(&ExecEvent::Started { pid }).unwrap_or_default();
    if tx.send(Message::Text(started.into())).await.is_err() {
        kill(&api, &id, pid).await;
        return;
    }
    loop {
        tokio::select! {
            event = output.next() => {
                let Some(event) = event else { break };
                let last = matches!(event, ExecEvent::Exit { .. } | ExecEvent::Error { .. });
                let Ok(text) = serde_json::to_string(&event) else { break };
                if tx.send(Message::Text(text.into())).await.is_err() || last {
                    break;
                }
            }
            message = rx.next() => {
                let input = match message {
                    Some(Ok(Message::Text(text))) => serde_json::from_str::<TerminalInput>(&text)
                        .map_err(|e| ApiError::new(ErrorCode::BadRequest, format!("not a terminal input: {e}"))),
                    Some(Ok(Message::Binary(bytes))) => Ok(TerminalInput::Stdin {
                        data: String::from_utf8_lossy(&bytes).into_owned(),
                    }),
                    Some(Ok(Message::Ping(_) | Message::Pong(_))) => continue,
                    Some(Ok(Message::Close(_)) | Err(_)) | None => break,
                };
                let done = match input {
                    Ok(TerminalInput::Stdin { data }) => {
                        api.process_stdin(&id, pid, StdinRequest { data, close: false }).await
                    }
                    Ok(TerminalInput::Resize { cols, rows }) => {
                        api.resize_process(&id, pid, PtySize { cols, rows }).await
                    }
                    Ok(TerminalInput::Signal { signal }) => {
                        api.signal_process(&id, pid, SignalRequest { signal }).await
                    }
                    Err(e) => Err(e),
                };
                // A bad message is told, not fatal; the shell's end comes as its exit.
                if let Err(error) = done {
                    let event = ExecEvent::Error { error };
                    if let Ok(text) = serde_json::to_string(&event) {
                        if tx.send(Message::Text(text.into())).await.is_err() {
                            break;
                        }
                    }
                }
            }
        }
    }
    kill(&api, &id, pid).await;
    let _ = tx.send(Message::Close(None)).await;
}
