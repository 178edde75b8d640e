//! Image pulls from OCI registries: the node pulls (with its own registry credentials);
//! the plane streams its progress.

use std::sync::Arc;

use dsec_node_api::{ImportProgressSink, NodeApi};
use dsec_wire::v1::{ImportEvent, PullImageRequest};
use dsec_wire::{ApiError, ErrorCode};
use futures::StreamExt;

use crate::api::{ApiResult, ImportStream};

/// Longest reference accepted.
const MAX_REFERENCE: usize = 1024;

/// Starts `node` pulling `req`; the stream carries its progress and ends with `Done` or
/// `Error`. A request the node refuses before it contacts the registry (a reference or
/// name that does not parse) is an error, not a stream. The pull runs to its end even if
/// the caller goes away: it then either stores the image or leaves nothing behind.
pub(super) async fn pull_stream(
    node: Arc<dyn NodeApi>,
    req: PullImageRequest,
) -> ApiResult<ImportStream> {
    let reference = req.reference.trim();
    if reference.is_empty()
        || reference.len() > MAX_REFERENCE
        || reference
            .chars()
            .any(|c| c.is_whitespace() || c.is_control())
    {
        return Err(ApiError::new(
            ErrorCode::BadRequest,
            format!(
                "reference {:?} is not an image reference ([REGISTRY[:PORT]/]REPOSITORY[:TAG]\
                 [@sha256:DIGEST])",
                req.reference
            ),
        ));
    }
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let progress_tx = tx.clone();
    let sink: ImportProgressSink = Arc::new(move |ev| {
        let _ = progress_tx.send(ev);
    });
    tokio::spawn(async move {
        let end = match node.pull_image(&req, Some(sink)).await {
            Ok(image) => ImportEvent::Done { image },
            Err(error) => ImportEvent::Error { error },
        };
        let _ = tx.send(end);
    });
    let mut events = tokio_stream::wrappers::UnboundedReceiverStream::new(rx);
    match events.next().await {
        Some(ImportEvent::Error { error }) => Err(error),
        Some(first) => Ok(Box::pin(
            futures::stream::once(async { first }).chain(events),
        )),
        None => Err(ApiError::new(
            ErrorCode::Internal,
            "the pull ended without a result",
        )),
    }
}
