//! Upload bodies and helpers that copy files and directories between the local disk and a
//! sandbox, streaming (directories are tarred and untarred on the fly).

use std::io::{self, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use dsec_wire::v1::{FileInfo, WriteResult};
use futures::stream::BoxStream;
use futures::task::AtomicWaker;
use futures::{StreamExt, TryStream, TryStreamExt};
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;

use crate::{Client, ClientError};

/// A request body for uploads: bytes in memory, an open `tokio::fs::File`, or any stream
/// of byte chunks. Files and streams are sent chunk by chunk, never buffered whole.
pub struct UploadBody(Body);

enum Body {
    /// Bytes in memory: sent whole.
    Whole(reqwest::Body),
    /// Chunks as they come; stopped once the server has answered (see [`Answered`]).
    Streamed(BoxStream<'static, Result<Bytes, BoxError>>),
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl std::fmt::Debug for UploadBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            Body::Whole(b) => f.debug_tuple("UploadBody").field(b).finish(),
            Body::Streamed(_) => f.write_str("UploadBody(<stream>)"),
        }
    }
}

impl UploadBody {
    /// A body from a stream of chunks; an error item aborts the upload.
    pub fn from_stream<S>(stream: S) -> Self
    where
        S: TryStream + Send + 'static,
        S::Error: Into<BoxError>,
        Bytes: From<S::Ok>,
    {
        Self(Body::Streamed(
            stream.map_ok(Bytes::from).map_err(Into::into).boxed(),
        ))
    }

    /// The body for one request, streamed ones cut off once `answered` is set.
    pub(crate) fn into_reqwest(self, answered: &Answered) -> reqwest::Body {
        match self.0 {
            Body::Whole(b) => b,
            Body::Streamed(inner) => reqwest::Body::wrap_stream(StopWhenAnswered {
                inner,
                answered: answered.0.clone(),
                stopped: false,
            }),
        }
    }
}

/// Set once the response to an upload has been read (or the upload was dropped).
///
/// A server may answer before the body ends (`no_space` after 256 MiB of a 10 GiB
/// upload). HTTP/1 clients go on sending regardless, and the server can only read and
/// discard the rest for a while before it must close, which resets the connection; a
/// client still sending may then see the reset instead of the answer. Stopping the body as
/// soon as the answer is in makes the order certain and wastes nothing.
#[derive(Debug, Default)]
pub(crate) struct Answered(Arc<AnsweredState>);

#[derive(Debug, Default)]
struct AnsweredState {
    set: AtomicBool,
    waker: AtomicWaker,
}

impl Answered {
    /// Marks the answer as read and wakes the body so it stops.
    pub(crate) fn set(&self) {
        self.0.set.store(true, Ordering::Release);
        self.0.waker.wake();
    }
}

impl Drop for Answered {
    fn drop(&mut self) {
        // A caller that dropped the upload's future wants nothing more sent either.
        self.set();
    }
}

/// A body stream that fails once its request is answered, which aborts the connection
/// instead of sending the rest.
struct StopWhenAnswered {
    inner: BoxStream<'static, Result<Bytes, BoxError>>,
    answered: Arc<AnsweredState>,
    stopped: bool,
}

impl futures::Stream for StopWhenAnswered {
    type Item = Result<Bytes, BoxError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.stopped {
            return Poll::Ready(None);
        }
        self.answered.waker.register(cx.waker());
        if self.answered.set.load(Ordering::Acquire) {
            self.stopped = true;
            return Poll::Ready(Some(Err(
                "the server answered before the upload ended".into()
            )));
        }
        self.inner.poll_next_unpin(cx)
    }
}

impl From<tokio::fs::File> for UploadBody {
    fn from(f: tokio::fs::File) -> Self {
        // 64 KiB reads: the default 4 KiB makes a chunk (and a blocking-pool trip) per page.
        Self::from_stream(tokio_util::io::ReaderStream::with_capacity(f, 64 << 10))
    }
}

impl From<Bytes> for UploadBody {
    fn from(b: Bytes) -> Self {
        Self(Body::Whole(reqwest::Body::from(b)))
    }
}

impl From<Vec<u8>> for UploadBody {
    fn from(b: Vec<u8>) -> Self {
        Self(Body::Whole(reqwest::Body::from(b)))
    }
}

impl From<String> for UploadBody {
    fn from(s: String) -> Self {
        Self(Body::Whole(reqwest::Body::from(s)))
    }
}

impl From<&'static str> for UploadBody {
    fn from(s: &'static str) -> Self {
        Self(Body::Whole(reqwest::Body::from(s)))
    }
}

impl From<&'static [u8]> for UploadBody {
    fn from(b: &'static [u8]) -> Self {
        Self(Body::Whole(reqwest::Body::from(b)))
    }
}

/// Adds the path to an I/O error's message.
fn io_ctx(what: &str, path: &Path, e: io::Error) -> ClientError {
    ClientError::Io(io::Error::new(
        e.kind(),
        format!("{what} {}: {e}", path.display()),
    ))
}

impl Client {
    /// Uploads the local file `local` to `remote`, streamed. `mode` defaults to the local
    /// file's permission bits.
    pub async fn write_file_from_path(
        &self,
        id: &str,
        local: &Path,
        remote: &str,
        mode: Option<u32>,
    ) -> Result<WriteResult, ClientError> {
        let file = tokio::fs::File::open(local)
            .await
            .map_err(|e| io_ctx("opening", local, e))?;
        let mode = match mode {
            Some(m) => m,
            None => {
                let meta = file
                    .metadata()
                    .await
                    .map_err(|e| io_ctx("reading", local, e))?;
                meta.permissions().mode() & 0o7777
            }
        };
        self.write_file(id, remote, Some(mode), file).await
    }

    /// Downloads the sandbox file `remote` into the local file `local` (created or
    /// truncated, given the remote permission bits), streamed.
    pub async fn read_file_to_path(
        &self,
        id: &str,
        remote: &str,
        local: &Path,
    ) -> Result<FileInfo, ClientError> {
        let (info, mut stream) = self.read_file(id, remote, 0, None).await?;
        let mut file = tokio::fs::File::create(local)
            .await
            .map_err(|e| io_ctx("creating", local, e))?;
        while let Some(chunk) = stream.next().await {
            file.write_all(&chunk?)
                .await
                .map_err(|e| io_ctx("writing", local, e))?;
        }
        file.flush()
            .await
            .map_err(|e| io_ctx("writing", local, e))?;
        let perms = std::fs::Permissions::from_mode(info.mode & 0o777);
        file.set_permissions(perms)
            .await
            .map_err(|e| io_ctx("setting mode of", local, e))?;
        Ok(info)
    }

    /// Uploads the contents of the local directory `local_dir` into the sandbox directory
    /// `remote_dir` (created if missing), as a tar archive built while it is sent.
    /// Symlinks are sent as symlinks; sockets, fifos and devices are skipped.
    pub async fn upload_dir(
        &self,
        id: &str,
        local_dir: &Path,
        remote_dir: &str,
    ) -> Result<WriteResult, ClientError> {
        let meta = tokio::fs::metadata(local_dir)
            .await
            .map_err(|e| io_ctx("reading", local_dir, e))?;
        if !meta.is_dir() {
            return Err(io_ctx(
                "uploading",
                local_dir,
                io::Error::new(io::ErrorKind::InvalidInput, "not a directory"),
            ));
        }
        let (tx, rx) = mpsc::channel::<io::Result<Bytes>>(8);
        let dir = local_dir.to_owned();
        let writer_tx = tx.clone();
        let tar_task = tokio::task::spawn_blocking(move || {
            let result = write_tar(&dir, ChannelWriter::new(writer_tx));
            if let Err(e) = &result {
                // Abort the upload so the server does not take a truncated archive.
                let _ = tx.blocking_send(Err(io::Error::new(e.kind(), e.to_string())));
            }
            result
        });
        let body =
            futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|c| (c, rx)) });
        let sent = self
            .upload_tar(id, remote_dir, UploadBody::from_stream(body))
            .await;
        // A local failure explains a failed upload better than the HTTP error it caused.
        // A broken pipe only means the upload stopped reading: then the HTTP answer
        // (e.g. `not_found`) is the real reason.
        match tar_task.await {
            Ok(Ok(())) => sent,
            Ok(Err(e)) if e.kind() == io::ErrorKind::BrokenPipe && sent.is_err() => sent,
            Ok(Err(e)) => Err(ClientError::Io(e)),
            Err(join) => Err(ClientError::Io(io::Error::other(format!(
                "tar task failed: {join}"
            )))),
        }
    }

    /// Downloads the sandbox directory `remote_dir` into the local directory `local_dir`
    /// (created if missing), unpacking the tar stream as it arrives. Entries that would
    /// land outside `local_dir` are refused by the unpacker.
    pub async fn download_dir(
        &self,
        id: &str,
        remote_dir: &str,
        local_dir: &Path,
    ) -> Result<(), ClientError> {
        let stream = self.download_tar(id, remote_dir).await?;
        let reader = tokio_util::io::StreamReader::new(stream.map_err(io::Error::other));
        let reader = tokio_util::io::SyncIoBridge::new(reader);
        let dst: PathBuf = local_dir.to_owned();
        tokio::task::spawn_blocking(move || -> Result<(), ClientError> {
            std::fs::create_dir_all(&dst).map_err(|e| io_ctx("creating", &dst, e))?;
            let mut archive = tar::Archive::new(reader);
            archive.set_preserve_permissions(true);
            archive.set_overwrite(true);
            archive
                .unpack(&dst)
                .map_err(|e| io_ctx("unpacking into", &dst, e))
        })
        .await
        .map_err(|join| ClientError::Io(io::Error::other(format!("untar task failed: {join}"))))?
    }
}

/// Writes a tar of the contents of `dir` (paths relative to it) into `out`.
fn write_tar<W: Write>(dir: &Path, out: W) -> io::Result<()> {
    let mut builder = tar::Builder::new(out);
    builder.follow_symlinks(false);
    append_children(&mut builder, dir, Path::new(""))?;
    let mut out = builder.into_inner()?;
    out.flush()
}

fn append_children<W: Write>(
    builder: &mut tar::Builder<W>,
    dir: &Path,
    rel: &Path,
) -> io::Result<()> {
    let mut entries = std::fs::read_dir(dir.join(rel))
        .map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("reading {}: {e}", dir.join(rel).display()),
            )
        })?
        .collect::<io::Result<Vec<_>>>()?;
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let name = rel.join(entry.file_name());
        let full = dir.join(&name);
        let ft = entry.file_type()?;
        if !(ft.is_file() || ft.is_dir() || ft.is_symlink()) {
            continue;
        }
        builder
            .append_path_with_name(&full, &name)
            .map_err(|e| io::Error::new(e.kind(), format!("archiving {}: {e}", full.display())))?;
        if ft.is_dir() {
            append_children(builder, dir, &name)?;
        }
    }
    Ok(())
}

/// A blocking writer that forwards 64 KiB chunks into a channel read by the upload.
struct ChannelWriter {
    tx: mpsc::Sender<io::Result<Bytes>>,
    buf: Vec<u8>,
}

const CHUNK: usize = 64 * 1024;

impl ChannelWriter {
    fn new(tx: mpsc::Sender<io::Result<Bytes>>) -> Self {
        Self {
            tx,
            buf: Vec::with_capacity(CHUNK),
        }
    }

    fn send_buf(&mut self) -> io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let chunk = Bytes::from(std::mem::replace(&mut self.buf, Vec::with_capacity(CHUNK)));
        self.tx
            .blocking_send(Ok(chunk))
            .map_err(|_| io::Error::new(io::ErrorKind::BrokenPipe, "upload ended early"))
    }
}

impl Write for ChannelWriter {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        self.buf.extend_from_slice(data);
        if self.buf.len() >= CHUNK {
            self.send_buf()?;
        }
        Ok(data.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.send_buf()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tar_of_directory_has_relative_paths_and_roundtrips() {
        let src = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(src.path().join("sub/deeper")).expect("mkdir");
        std::fs::write(src.path().join("a.txt"), b"alpha").expect("write");
        std::fs::write(src.path().join("sub/deeper/b.bin"), vec![1u8; 200_000]).expect("write");
        std::os::unix::fs::symlink("a.txt", src.path().join("link")).expect("symlink");

        let mut archive = Vec::new();
        write_tar(src.path(), &mut archive).expect("tar");
        let names: Vec<String> = tar::Archive::new(&archive[..])
            .entries()
            .expect("entries")
            .map(|e| {
                e.expect("entry")
                    .path()
                    .expect("path")
                    .display()
                    .to_string()
            })
            .collect();
        assert_eq!(
            names,
            ["a.txt", "link", "sub", "sub/deeper", "sub/deeper/b.bin"]
        );

        let dst = tempfile::tempdir().expect("tempdir");
        tar::Archive::new(&archive[..])
            .unpack(dst.path())
            .expect("unpack");
        assert_eq!(
            std::fs::read(dst.path().join("sub/deeper/b.bin"))
                .expect("read")
                .len(),
            200_000
        );
        assert_eq!(
            std::fs::read_link(dst.path().join("link")).expect("link"),
            Path::new("a.txt")
        );
    }
}
