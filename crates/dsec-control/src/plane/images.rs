//! Image calls: import (from a path on the node), build, delete, gc.

use super::*;

impl ControlPlane {
    pub(super) async fn gc_images_to_end(&self, req: GcRequest) -> ApiResult<GcResult> {
        self.node.gc_images(&req).await
    }

    pub(super) async fn build_image_to_end(&self, req: BuildRequest) -> ApiResult<BuildResult> {
        crate::build::build(self, self.node.as_ref(), req).await
    }

    pub(super) async fn import_image_to_end(&self, req: ImportImageRequest) -> ApiResult<Image> {
        let source = import_source(&req)?;
        self.node
            .import_image(&req.name, ImportSource::NodePath(source), req.flatten, None)
            .await
    }

    pub(super) async fn delete_image_to_end(&self, name: &str) -> ApiResult<()> {
        self.node.remove_image(name).await
    }
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
