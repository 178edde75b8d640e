//! Idempotent creates: a retry with the same key must be the same request as the first.

use super::*;

impl ControlPlane {
    /// `conflict` when a create reusing the key of `first` asks for something else: by
    /// the first request's digest, or (keys stored before digests were) by what the
    /// sandbox's record says (image, layers, resources, labels, policies).
    pub(super) async fn same_request(
        &self,
        first: &records::IdemEntry,
        req: &CreateSandboxRequest,
    ) -> ApiResult<()> {
        let Some(key) = &req.idempotency_key else {
            return Ok(());
        };
        let same = match &first.digest {
            Some(digest) => *digest == hex::encode(request_digest(req)),
            None => match self.records.find(&first.id).await? {
                Some(rec) => self.record_matches(&rec, req),
                None => true,
            },
        };
        if same {
            return Ok(());
        }
        Err(ApiError::new(
            ErrorCode::Conflict,
            format!(
                "idempotency_key {key:?} belongs to sandbox {}, created by a different \
                 request: retry with the same body, or use a new key for a new sandbox",
                first.id
            ),
        ))
    }

    pub(super) fn record_matches(&self, rec: &Sandbox, req: &CreateSandboxRequest) -> bool {
        let image = req.image.as_deref().unwrap_or(&self.cfg.default_image);
        let r = &req.resources;
        rec.image == image
            && rec.layers == req.layers
            && rec.backend == req.backend
            && rec.resources.cpu == r.cpu.unwrap_or(self.cfg.default_cpu)
            && rec.resources.memory_mb == r.memory_mb.unwrap_or(self.cfg.default_memory_mb)
            && rec.resources.pids == r.pids.unwrap_or(self.cfg.default_pids)
            && rec.labels == req.labels
            && rec.network == req.network
            && rec.filesystem == req.filesystem
            && rec.isolation == req.isolation
            && rec.qos == req.qos
            && rec.auto_resume == req.auto_resume
            && rec.idle_timeout_s == req.idle_timeout_s
    }
}

/// SHA-256 of a create request's JSON (maps are ordered, so equal requests hash equal).
pub(super) fn request_digest(req: &CreateSandboxRequest) -> [u8; 32] {
    use sha2::Digest;
    let json = serde_json::to_vec(req).unwrap_or_default();
    sha2::Sha256::digest(&json).into()
}
