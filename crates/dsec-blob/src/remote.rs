//! [`ObjectStoreBackend`]: S3-compatible and HTTP stores through the `object_store` crate,
//! driven on a runtime of their own behind the blocking [`BlobStore`] trait.

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use futures::TryStreamExt;
use object_store::path::Path as ObjPath;
use object_store::{ClientOptions, ObjectStore, PutPayload, RetryConfig};
use tokio::io::AsyncWriteExt;

use crate::{block_on, validate_key, validate_prefix, BlobError, BlobStore, ObjectInfo, Result};

/// A store reached over the network. Holds the client and the runtime that drives it.
pub struct ObjectStoreBackend {
    url: String,
    /// Key prefix inside the bucket or under the base URL (no leading or trailing `/`).
    prefix: String,
    store: Arc<dyn ObjectStore>,
    /// `Option` so `Drop` can shut it down without blocking (dropping a runtime inside
    /// another runtime's context would panic).
    rt: Option<tokio::runtime::Runtime>,
}

impl std::fmt::Debug for ObjectStoreBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObjectStoreBackend")
            .field("url", &self.url)
            .finish_non_exhaustive()
    }
}

impl Drop for ObjectStoreBackend {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

/// Time limits: a dead store must not hang a caller for long, a large layer must still fit.
fn client_options() -> ClientOptions {
    ClientOptions::new()
        .with_connect_timeout(Duration::from_secs(5))
        .with_timeout(Duration::from_secs(600))
}

fn retry() -> RetryConfig {
    RetryConfig {
        max_retries: 3,
        retry_timeout: Duration::from_secs(30),
        ..RetryConfig::default()
    }
}

fn invalid(spec: &str, reason: impl ToString) -> BlobError {
    BlobError::InvalidUrl {
        url: spec.to_string(),
        reason: reason.to_string(),
    }
}

/// The URL's query parameter `name`, if given.
fn query(url: &url::Url, name: &str) -> Option<String> {
    url.query_pairs()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.into_owned())
}

impl ObjectStoreBackend {
    fn new(spec: &str, prefix: &str, store: Arc<dyn ObjectStore>) -> Result<Self> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("dsec-blob")
            .enable_all()
            .build()
            .map_err(|e| BlobError::io("start runtime for", Path::new(spec), e))?;
        Ok(Self {
            url: spec.to_string(),
            prefix: prefix.trim_matches('/').to_string(),
            store,
            rt: Some(rt),
        })
    }

    /// `s3://bucket[/prefix][?endpoint=URL&region=R]`; everything else from `AWS_*`.
    pub fn s3(spec: &str, url: &url::Url) -> Result<Self> {
        let bucket = url
            .host_str()
            .filter(|b| !b.is_empty())
            .ok_or_else(|| invalid(spec, "no bucket (expected s3://bucket/prefix)"))?;
        let mut b = object_store::aws::AmazonS3Builder::from_env()
            .with_bucket_name(bucket)
            .with_client_options(client_options())
            .with_retry(retry());
        if let Some(endpoint) = query(url, "endpoint") {
            b = b
                .with_allow_http(endpoint.starts_with("http://"))
                .with_endpoint(endpoint);
        } else if std::env::var("AWS_ENDPOINT_URL")
            .or_else(|_| std::env::var("AWS_ENDPOINT"))
            .is_ok_and(|e| e.starts_with("http://"))
        {
            b = b.with_allow_http(true);
        }
        if let Some(region) = query(url, "region") {
            b = b.with_region(region);
        }
        let store = b.build().map_err(|e| invalid(spec, e))?;
        Self::new(spec, url.path(), Arc::new(store))
    }

    /// `http(s)://host[:port][/prefix]`.
    pub fn http(spec: &str, url: &url::Url) -> Result<Self> {
        let mut base = url.clone();
        base.set_path("");
        base.set_query(None);
        let store = object_store::http::HttpBuilder::new()
            .with_url(base.as_str())
            .with_client_options(client_options().with_allow_http(true))
            .with_retry(retry())
            .build()
            .map_err(|e| invalid(spec, e))?;
        Self::new(spec, url.path(), Arc::new(store))
    }

    fn rt(&self) -> &tokio::runtime::Runtime {
        // Only `Drop` takes it.
        self.rt
            .as_ref()
            .unwrap_or_else(|| unreachable!("runtime taken before drop"))
    }

    fn obj_path(&self, key: &str) -> Result<ObjPath> {
        validate_key(key)?;
        let full = if self.prefix.is_empty() {
            key.to_string()
        } else {
            format!("{}/{key}", self.prefix)
        };
        ObjPath::parse(&full).map_err(|e| BlobError::InvalidKey {
            key: format!("{key}: {e}"),
            reason: "not a valid object path",
        })
    }

    fn key_of(&self, path: &ObjPath) -> String {
        let s = path.as_ref();
        if self.prefix.is_empty() {
            s.to_string()
        } else {
            s.strip_prefix(&self.prefix)
                .map(|k| k.trim_start_matches('/'))
                .unwrap_or(s)
                .to_string()
        }
    }

    fn remote_err(&self, op: &'static str, key: &str, e: impl std::fmt::Display) -> BlobError {
        BlobError::Remote {
            store: self.url.clone(),
            op,
            key: key.to_string(),
            message: e.to_string(),
        }
    }

    /// Maps an object_store error: NotFound stays distinguishable.
    fn map_err(&self, op: &'static str, key: &str, e: object_store::Error) -> BlobError {
        match e {
            object_store::Error::NotFound { .. } => BlobError::NotFound {
                store: self.url.clone(),
                key: key.to_string(),
            },
            other => {
                // The whole chain: object_store puts the useful part in the source.
                let mut msg = other.to_string();
                let mut src = std::error::Error::source(&other);
                while let Some(s) = src {
                    msg.push_str(": ");
                    msg.push_str(&s.to_string());
                    src = s.source();
                }
                self.remote_err(op, key, msg)
            }
        }
    }

    /// Runs `fut` to completion on our runtime.
    fn run<T, F>(&self, op: &'static str, key: &str, fut: F) -> Result<T>
    where
        F: std::future::Future<Output = Result<T, object_store::Error>> + Send + 'static,
        T: Send + 'static,
    {
        match block_on(self.rt(), fut) {
            Ok(r) => r.map_err(|e| self.map_err(op, key, e)),
            Err(panic) => Err(self.remote_err(op, key, panic)),
        }
    }
}

fn info(key: String, m: &object_store::ObjectMeta) -> ObjectInfo {
    ObjectInfo {
        key,
        size: m.size,
        modified: m.last_modified.into(),
    }
}

impl BlobStore for ObjectStoreBackend {
    fn url(&self) -> String {
        self.url.clone()
    }

    fn head(&self, key: &str) -> Result<Option<ObjectInfo>> {
        let p = self.obj_path(key)?;
        let store = self.store.clone();
        match self.run("head", key, async move { store.head(&p).await }) {
            Ok(m) => Ok(Some(info(key.to_string(), &m))),
            Err(BlobError::NotFound { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        let p = self.obj_path(key)?;
        let store = self.store.clone();
        let got = self.run("get", key, async move {
            let r = store.get(&p).await?;
            r.bytes().await
        });
        match got {
            Ok(b) => Ok(Some(b.to_vec())),
            Err(BlobError::NotFound { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn get_range(&self, key: &str, range: Range<u64>) -> Result<Vec<u8>> {
        if range.start >= range.end {
            return Err(BlobError::BadRange {
                store: self.url.clone(),
                key: key.to_string(),
                start: range.start,
                end: range.end,
            });
        }
        let p = self.obj_path(key)?;
        let store = self.store.clone();
        let r = range.clone();
        let got = self.run("get range of", key, async move {
            let opts = object_store::GetOptions {
                range: Some(object_store::GetRange::Bounded(r)),
                ..Default::default()
            };
            store.get_opts(&p, opts).await?.bytes().await
        });
        match got {
            Ok(b) => Ok(b.to_vec()),
            // Servers answer 416 for a start past the end.
            Err(BlobError::Remote { message, .. })
                if message.contains("416") || message.contains("Range") =>
            {
                Err(BlobError::BadRange {
                    store: self.url.clone(),
                    key: key.to_string(),
                    start: range.start,
                    end: range.end,
                })
            }
            Err(e) => Err(e),
        }
    }

    fn download(&self, key: &str, dest: &Path) -> Result<u64> {
        let p = self.obj_path(key)?;
        let store = self.store.clone();
        let dest_owned = dest.to_path_buf();
        let res = match block_on(self.rt(), async move {
            let mut file = tokio::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&dest_owned)
                .await
                .map_err(|e| Err(BlobError::io("create", &dest_owned, e)))?;
            let mut stream = store.get(&p).await.map_err(Ok)?.into_stream();
            let mut n = 0u64;
            while let Some(chunk) = stream.try_next().await.map_err(Ok)? {
                file.write_all(&chunk)
                    .await
                    .map_err(|e| Err(BlobError::io("write", &dest_owned, e)))?;
                n += chunk.len() as u64;
            }
            file.sync_all()
                .await
                .map_err(|e| Err(BlobError::io("fsync", &dest_owned, e)))?;
            Ok::<u64, Result<object_store::Error, BlobError>>(n)
        }) {
            Ok(Ok(n)) => Ok(n),
            Ok(Err(Ok(e))) => Err(self.map_err("download", key, e)),
            Ok(Err(Err(e))) => Err(e),
            Err(panic) => Err(self.remote_err("download", key, panic)),
        };
        if res.is_err() {
            let _ = std::fs::remove_file(dest);
        }
        res
    }

    fn put(&self, key: &str, data: &[u8]) -> Result<()> {
        let p = self.obj_path(key)?;
        let store = self.store.clone();
        let payload = PutPayload::from(data.to_vec());
        self.run("put", key, async move { store.put(&p, payload).await })
            .map(|_| ())
    }

    fn upload(&self, key: &str, src: &Path) -> Result<()> {
        let p = self.obj_path(key)?;
        let store = self.store.clone();
        let src_owned = src.to_path_buf();
        match block_on(self.rt(), async move {
            let mut file = tokio::fs::File::open(&src_owned)
                .await
                .map_err(|e| Err(BlobError::io("open", &src_owned, e)))?;
            // Switches to a multipart upload past its buffer size (10 MiB).
            let mut w = object_store::buffered::BufWriter::new(store, p);
            tokio::io::copy(&mut file, &mut w)
                .await
                .map_err(|e| Err(BlobError::io("upload", &src_owned, e)))?;
            w.shutdown()
                .await
                .map_err(|e| Err(BlobError::io("upload", &src_owned, e)))?;
            Ok::<(), Result<object_store::Error, BlobError>>(())
        }) {
            Ok(Ok(())) => Ok(()),
            Ok(Err(Ok(e))) => Err(self.map_err("upload", key, e)),
            Ok(Err(Err(e))) => Err(e),
            Err(panic) => Err(self.remote_err("upload", key, panic)),
        }
    }

    fn delete(&self, key: &str) -> Result<()> {
        let p = self.obj_path(key)?;
        let store = self.store.clone();
        match self.run("delete", key, async move { store.delete(&p).await }) {
            Ok(()) | Err(BlobError::NotFound { .. }) => Ok(()),
            Err(e) => Err(e),
        }
    }

    fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        validate_prefix(prefix)?;
        let full = format!("{}/{}", self.prefix, prefix.trim_end_matches('/'));
        let full = full.trim_matches('/').to_string();
        let p = if full.is_empty() {
            None
        } else {
            Some(ObjPath::parse(&full).map_err(|e| BlobError::InvalidKey {
                key: format!("{prefix}: {e}"),
                reason: "not a valid object path",
            })?)
        };
        let store = self.store.clone();
        let metas = self.run("list", prefix, async move {
            store.list(p.as_ref()).try_collect::<Vec<_>>().await
        })?;
        let mut out: Vec<ObjectInfo> = metas
            .iter()
            .map(|m| info(self.key_of(&m.location), m))
            .collect();
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    }
}
