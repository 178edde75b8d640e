//! [`Puller`]: pulls with single flight. Concurrent pulls of one reference into one name
//! (N creates naming an image not pulled yet) share one pull: the first starts it, the
//! others wait for it and get its result, image or error, and its progress from then on.
//! The pull runs on a task of its own, so it ends (storing the image, or leaving nothing)
//! even if every caller goes away; a caller that comes back joins it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use dsec_image::{Image, ImageStore};
use dsec_wire::v1::{ImportEvent, PullImageRequest};
use futures::future::{BoxFuture, FutureExt as _, Shared};

use crate::{Progress, RegistryConfig, RegistryError};

/// What a shared pull ends with.
type Outcome = Result<Image, Arc<RegistryError>>;

/// One pull under way: who gets its progress, and its end.
struct Flight {
    watchers: Arc<Mutex<Vec<Progress>>>,
    done: Shared<BoxFuture<'static, Outcome>>,
}

/// Pulls into one store with one configuration, one pull per (reference, name, plain
/// HTTP) at a time.
pub struct Puller {
    store: Arc<ImageStore>,
    config: Arc<RegistryConfig>,
    flights: Flights,
}

impl std::fmt::Debug for Puller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Puller")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Puller {
    /// A puller into `store`.
    pub fn new(store: Arc<ImageStore>, config: RegistryConfig) -> Self {
        Self {
            store,
            config: Arc::new(config),
            flights: Arc::default(),
        }
    }

    /// Its configuration.
    pub fn config(&self) -> &RegistryConfig {
        &self.config
    }

    /// Pulls `req`, or joins the pull of the same request already under way. Every
    /// caller of one pull gets its result; a failed pull fails them all alike.
    pub async fn pull(&self, req: &PullImageRequest, progress: Progress) -> Outcome {
        let name = req
            .name
            .clone()
            .unwrap_or_else(|| crate::default_name(&req.reference));
        let key = (req.reference.trim().to_string(), name, req.insecure);
        let done = {
            let mut flights = self.flights.lock().unwrap_or_else(|p| p.into_inner());
            match flights.get(&key) {
                Some(f) => {
                    f.watchers
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push(progress);
                    tracing::debug!(reference = %key.0, "joining a pull under way");
                    f.done.clone()
                }
                None => {
                    let watchers = Arc::new(Mutex::new(vec![progress]));
                    let done = self.start(key.clone(), req.clone(), watchers.clone());
                    flights.insert(
                        key,
                        Flight {
                            watchers,
                            done: done.clone(),
                        },
                    );
                    done
                }
            }
        };
        done.await
    }

    /// Starts the pull of `key` on its own task; it leaves `flights` when it ends.
    fn start(
        &self,
        key: (String, String, bool),
        req: PullImageRequest,
        watchers: Arc<Mutex<Vec<Progress>>>,
    ) -> Shared<BoxFuture<'static, Outcome>> {
        let (store, config, flights) = (
            self.store.clone(),
            self.config.clone(),
            self.flights.clone(),
        );
        let fan_out: Progress = Arc::new(move |ev: ImportEvent| {
            for w in watchers.lock().unwrap_or_else(|p| p.into_inner()).iter() {
                w(ev.clone());
            }
        });
        let task = tokio::spawn(async move {
            // Leaves `flights` however the pull ends (a panic too).
            let _leave = Leave { flights, key };
            crate::pull::pull(store, &config, &req, fan_out)
                .await
                .map_err(Arc::new)
        });
        async move {
            task.await.unwrap_or_else(|e| {
                Err(Arc::new(RegistryError::Transport(format!(
                    "the pull task failed: {e}"
                ))))
            })
        }
        .boxed()
        .shared()
    }
}

type Flights = Arc<Mutex<HashMap<(String, String, bool), Flight>>>;

/// Removes a pull from `flights` when dropped.
struct Leave {
    flights: Flights,
    key: (String, String, bool),
}

impl Drop for Leave {
    fn drop(&mut self) {
        self.flights
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.key);
    }
}
