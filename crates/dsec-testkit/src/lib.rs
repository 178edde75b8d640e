//! What a dsec test does when this machine lacks something it needs (root, a kernel
//! feature, a tool): it fails, saying what is missing. A test that returned early would
//! print `ok` for work it never did.
//!
//! A developer on a machine that cannot run a test (no root, an old kernel) may set
//! `DSEC_TEST_SKIP_UNAVAILABLE=1`; then such a test prints `SKIPPED: <reason>` and returns
//! early. `CI=true` never skips, whatever else is set.
//!
//! It also starts real services tests need: [`Etcd`] (one member or a cluster) and
//! [`Registry`] (an OCI registry, with [`oci_layout`] to seed it, [`CutProxy`] to
//! break its transfers off and [`TokenServer`] for its bearer-token auth), and fakes of
//! outside services: [`openai::FakeOpenAi`], an OpenAI-compatible model upstream.

mod etcd;
pub mod openai;
pub mod otlp;
pub mod registry;
pub mod token;
pub use etcd::{etcd_binary, Etcd, ETCD_BIN_VAR};
pub use otlp::{OtlpCollector, ReceivedSpan};
pub use registry::{layer_tar, oci_layout, CutProxy, Registry};
pub use token::TokenServer;

/// The variable that lets tests skip on a machine that lacks their prerequisites.
pub const SKIP_VAR: &str = "DSEC_TEST_SKIP_UNAVAILABLE";

/// Whether a missing prerequisite may skip a test: only when [`SKIP_VAR`] is `1` or
/// `true` and `CI` is not `true`/`1`.
pub fn skipping_allowed() -> bool {
    let set = |name: &str| {
        std::env::var(name)
            .map(|v| v == "1" || v.eq_ignore_ascii_case("true"))
            .unwrap_or(false)
    };
    set(SKIP_VAR) && !set("CI")
}

/// `None` if the test can run (`missing` is `None`); otherwise panics naming what is
/// missing, or, where skipping is allowed, prints `SKIPPED: test: reason` and returns the
/// reason so the test can return.
///
/// ```
/// let missing = (!std::path::Path::new("/").exists()).then(|| "a root directory".to_string());
/// if dsec_testkit::unavailable("doc_example", missing).is_some() {
///     return;
/// }
/// ```
pub fn unavailable(test: &str, missing: Option<String>) -> Option<String> {
    let why = missing?;
    if !skipping_allowed() {
        panic!(
            "{test}: this machine cannot run it: {why} \
             (set {SKIP_VAR}=1 to skip such tests outside CI)"
        );
    }
    eprintln!("SKIPPED: {test}: {why}");
    Some(why)
}

/// [`unavailable`] for tests that need root: `true` if the test may go on.
pub fn require_root(test: &str) -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    unavailable(test, (!root).then(|| "needs root".to_string())).is_none()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_present_prerequisite_runs_the_test() {
        assert_eq!(unavailable("t", None), None);
    }

    #[test]
    fn a_missing_prerequisite_fails_unless_skipping_is_asked_for() {
        // Both outcomes in one test: the environment is process-wide.
        let ci = std::env::var_os("CI");
        let skip = std::env::var_os(SKIP_VAR);
        std::env::remove_var("CI");
        std::env::remove_var(SKIP_VAR);
        let failed = std::panic::catch_unwind(|| unavailable("t", Some("x".into())));
        assert!(failed.is_err(), "fails by default");
        std::env::set_var(SKIP_VAR, "1");
        assert_eq!(unavailable("t", Some("x".into())), Some("x".into()));
        std::env::set_var("CI", "true");
        let failed = std::panic::catch_unwind(|| unavailable("t", Some("x".into())));
        assert!(failed.is_err(), "CI=true never skips");
        match ci {
            Some(v) => std::env::set_var("CI", v),
            None => std::env::remove_var("CI"),
        }
        match skip {
            Some(v) => std::env::set_var(SKIP_VAR, v),
            None => std::env::remove_var(SKIP_VAR),
        }
    }
}
