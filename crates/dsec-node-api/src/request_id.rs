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

tokio::task_local! {
    static REQUEST_ID: Arc<str>;
}

/// The id of the request the current task serves, if any.
pub fn current() -> Option<Arc<str>> {
    REQUEST_ID.try_with(Arc::clone).ok()
}

/// Runs `f` as serving request `id`.
pub async fn scope<F: Future>(id: Arc<str>, f: F) -> F::Output {
    REQUEST_ID.scope(id, f).await
}

/// `f` as serving the current request (for a task spawned on its behalf); `f` itself
/// when there is none.
pub async fn carry<F: Future>(id: Option<Arc<str>>, f: F) -> F::Output {
    match id {
        Some(id) => REQUEST_ID.scope(id, f).await,
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
        let seen = scope(id.clone(), async {
            let here = current();
            let carried = current();
            let spawned = tokio::spawn(carry(carried, async { current() }))
                .await
                .ok()
                .flatten();
            (here, spawned)
        })
        .await;
        assert_eq!(seen.0.as_deref(), Some("req_1"));
        assert_eq!(seen.1.as_deref(), Some("req_1"));
        assert!(current().is_none());
    }
}
