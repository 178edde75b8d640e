//! Image calls: import (from a path on the node), build, delete, gc.

use super::*;

impl ControlPlane {
    /// Every live node collects its own cache; the answer sums theirs.
    pub(super) async fn gc_images_to_end(&self, req: GcRequest) -> ApiResult<GcResult> {
        let mut total: Option<GcResult> = None;
        for (_, node) in self.nodes.live() {
            let r = node.gc_images(&req).await?;
            total = Some(match total {
                None => r,
                Some(t) => gc_sum(t, r),
            });
        }
        total.ok_or_else(|| {
            self.nodes
                .any()
                .err()
                .unwrap_or_else(|| internal("no node"))
        })
    }

    pub(super) async fn build_image_to_end(
        &self,
        caller: &Principal,
        req: BuildRequest,
    ) -> ApiResult<BuildResult> {
        crate::build::build(self, caller, self.nodes.any()?.as_ref(), req).await
    }

    pub(super) async fn import_image_to_end(&self, req: ImportImageRequest) -> ApiResult<Image> {
        let source = import_source(&req)?;
        self.nodes
            .any()?
            .import_image(&req.name, ImportSource::NodePath(source), req.flatten, None)
            .await
    }

    pub(super) async fn delete_image_to_end(&self, name: &str) -> ApiResult<()> {
        self.nodes.any()?.remove_image(name).await
    }
}

/// Two nodes' collections as one (a ref or layer named by both is counted once).
fn gc_sum(mut a: GcResult, b: GcResult) -> GcResult {
    fn merge(into: &mut Vec<String>, from: Vec<String>) {
        for x in from {
            if !into.contains(&x) {
                into.push(x);
            }
        }
    }
    merge(&mut a.removed, b.removed);
    merge(&mut a.shared_deleted, b.shared_deleted);
    a.evicted.extend(b.evicted);
    a.freed_bytes += b.freed_bytes;
    a.evicted_bytes += b.evicted_bytes;
    a.shared_freed_bytes += b.shared_freed_bytes;
    a
}

/// The source path of an import request: absolute, on the server.
pub(super) fn import_source(req: &ImportImageRequest) -> ApiResult<PathBuf> {
    let source = PathBuf::from(&req.source);
    if !source.is_absolute() {
        return Err(ApiError::new(
            ErrorCode::BadRequest,
            format!(
                "source {:?} must be an absolute path on the server",
                req.source
            ),
        ));
    }
    if let Err(e) = std::fs::metadata(&source) {
        let why = match e.kind() {
            std::io::ErrorKind::NotFound => "does not exist".to_string(),
            std::io::ErrorKind::PermissionDenied => "is not readable by the server".to_string(),
            _ => format!("cannot be read: {e}"),
        };
        return Err(ApiError::new(
            ErrorCode::BadRequest,
            format!(
                "source {:?} {why}: give a directory, tar, OCI layout or .erofs file on \
                 the server",
                req.source
            ),
        ));
    }
    Ok(source)
}
