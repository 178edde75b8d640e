//! The id of the API request a piece of work serves: set by the HTTP edge (the caller's
//! `x-request-id`, or a fresh one), carried by the task serving it (and by the tasks the
//! control plane spawns for it), sent on to a remote node in the same header, and put
//! in every log line's span and every error answer, so one id follows a call from the
//! edge to the node.

use std::future::Future;
use std::sync::Arc;

/// The header that carries it, on requests and answers.
pub const HEADER: &str = "x-request-id";

/// The longest id accepted from a caller.
pub const MAX_LEN: usize = 128;

/// The header that carries the W3C trace context of a request, on to a remote node.
pub const TRACEPARENT_HEADER: &str = "traceparent";

/// What a task serving a request knows of it.
#[derive(Debug, Clone)]
pub struct Served {
    id: Arc<str>,
    traceparent: Option<Arc<str>>,
}

tokio::task_local! {
    static REQUEST: Served;
}

/// The id of the request the current task serves, if any.
pub fn current() -> Option<Arc<str>> {
    REQUEST.try_with(|r| r.id.clone()).ok()
}

/// The W3C trace context (`traceparent`) of the request the current task serves, if it
/// has one: its span's when spans are exported, else the caller's as it came.
pub fn traceparent() -> Option<Arc<str>> {
    REQUEST.try_with(|r| r.traceparent.clone()).ok().flatten()
}

/// What the current task serves, to hand to a task spawned on its behalf ([`carry`]).
pub fn served() -> Option<Served> {
    REQUEST.try_with(Clone::clone).ok()
}

/// Runs `f` as serving request `id`.
pub async fn scope<F: Future>(id: Arc<str>, f: F) -> F::Output {
    scope_traced(id, None, f).await
}

/// Runs `f` as serving request `id` of trace context `traceparent`.
pub async fn scope_traced<F: Future>(
    id: Arc<str>,
    traceparent: Option<Arc<str>>,
    f: F,
) -> F::Output {
    REQUEST.scope(Served { id, traceparent }, f).await
}

/// `f` as serving what [`served`] returned (for a task spawned on a request's behalf);
/// `f` itself when that was nothing.
pub async fn carry<F: Future>(served: Option<Served>, f: F) -> F::Output {
    match served {
        Some(s) => REQUEST.scope(s, f).await,
        None => f.await,
    }
}

/// Whether a caller's id may be used as given: 1 to [`MAX_LEN`] characters of
/// `[A-Za-z0-9._:-]` (anything else is replaced by a fresh one, never echoed).
pub fn acceptable(id: &str) -> bool {
    (1..=MAX_LEN).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'))
}

/// A fresh id: `req_` and 16 random hex digits.
pub fn generate() -> String {
    format!("req_{:016x}", rand::random::<u64>())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn callers_ids_are_kept_only_when_plain() {
        assert!(acceptable("trainer-7:step.12_a"));
        assert!(acceptable(&"x".repeat(MAX_LEN)));
        for bad in ["", "a b", "a\nb", "x\u{e9}", "<script>"] {
            assert!(!acceptable(bad), "{bad:?}");
        }
        assert!(!acceptable(&"x".repeat(MAX_LEN + 1)));
        let id = generate();
        assert!(
            acceptable(&id) && id.starts_with("req_") && id.len() == 20,
            "{id}"
        );
        assert_ne!(generate(), generate());
    }

    #[tokio::test]
    async fn the_id_is_the_scoped_tasks_and_carried_into_spawned_ones() {
        assert!(current().is_none());
        let id: Arc<str> = Arc::from("req_1");
        let tp: Arc<str> = Arc::from("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
        let seen = scope_traced(id.clone(), Some(tp.clone()), async {
            let here = current();
            let carried = served();
            let spawned = tokio::spawn(carry(carried, async { (current(), traceparent()) }))
                .await
                .ok();
            (here, spawned)
        })
        .await;
        assert_eq!(seen.0.as_deref(), Some("req_1"));
        let (spawned_id, spawned_tp) = seen.1.expect("spawned task ran");
        assert_eq!(spawned_id.as_deref(), Some("req_1"));
        assert_eq!(spawned_tp, Some(tp));
        assert!(current().is_none() && traceparent().is_none());
        assert_eq!(scope(id, async { traceparent() }).await, None);
    }
}
