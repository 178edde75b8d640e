//! Image pulls from OCI registries: the node pulls (with its own registry credentials);
//! the plane streams its progress. A create naming a registry reference not yet in its
//! node's catalog pulls it first ([`ensure_image`]).

use std::sync::Arc;
use std::time::Duration;

use dsec_node_api::{ImportProgressSink, NodeApi};
use dsec_wire::v1::{registry_image_name, ImportEvent, PullImageRequest};
use dsec_wire::{ApiError, ErrorCode};
use futures::StreamExt;

use crate::api::{ApiResult, ImportStream};

/// Longest reference accepted.
const MAX_REFERENCE: usize = 1024;
/// Longest a create waits for the pull of its image. The pull itself goes on past it (a
/// retried create joins it).
const CREATE_PULL_TIMEOUT: Duration = Duration::from_secs(600);

/// The name `node`'s catalog has `image` under, pulling it first if it is a registry
/// reference ([`registry_image_name`]) the catalog does not have yet. The node pulls
/// once however many creates wait for the image (its single flight); a failed pull
/// fails each of them with the registry's error and stores nothing.
pub(crate) async fn ensure_image(node: &dyn NodeApi, image: String) -> ApiResult<String> {
    let Some(name) = registry_image_name(&image) else {
        return Ok(image);
    };
    match node.image(&name).await {
        Ok(_) => return Ok(name),
        Err(e) if e.code == ErrorCode::ImageNotFound => {}
        Err(e) => return Err(e),
    }
    let req = PullImageRequest {
        reference: image.clone(),
        name: Some(name.clone()),
        insecure: false,
    };
    tracing::info!(%image, "pulling the image of a create");
    match tokio::time::timeout(CREATE_PULL_TIMEOUT, node.pull_image(&req, None)).await {
        Ok(Ok(_)) => Ok(name),
        Ok(Err(e)) => Err(ApiError::new(
            e.code,
            format!(
                "image {image} is not in the catalog, and pulling it from its registry \
                 failed: {}",
                e.message
            ),
        )),
        Err(_) => Err(ApiError::new(
            ErrorCode::Timeout,
            format!(
                "image {image}: its pull did not finish within {}s; it goes on, and a \
                 create retried later uses it",
                CREATE_PULL_TIMEOUT.as_secs()
            ),
        )),
    }
}

/// [`ensure_image`] for a create's image and each of its `layers` at once: the catalog
/// names they have on `node`, in order.
pub(super) async fn ensure_images(
    node: &dyn NodeApi,
    image: &str,
    layers: &[String],
) -> ApiResult<(String, Vec<String>)> {
    let image = ensure_image(node, image.to_string());
    let layers =
        futures::future::try_join_all(layers.iter().map(|l| ensure_image(node, l.clone())));
    futures::future::try_join(image, layers).await
}

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
