//! What the control plane's integration tests share.

/// The operator: the bootstrap key's principal (tenant `default`, every scope).
pub fn op() -> &'static dsec_control::Principal {
    static OP: std::sync::OnceLock<dsec_control::Principal> = std::sync::OnceLock::new();
    OP.get_or_init(dsec_control::Principal::bootstrap)
}
