//! The guest side of a microVM's agent channel (see `dsec_wire::vm`).
//!
//! The channel is one virtio-serial port. While no host is connected a read of it returns
//! end of file at once, so the guest waits for the host's hello by polling; then it
//! answers, and serves a yamux session in which every stream the host opens becomes one
//! connection to the agent's own (guest-local) socket. When the host goes away (a node
//! restart) the session ends and the guest waits for the next hello.

use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use dsec_wire::vm::{HELLO, MAX_HANDSHAKE_LINE, READY};
use futures::future::poll_fn;
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio_util::compat::{FuturesAsyncReadCompatExt, TokioAsyncReadCompatExt};

/// How often the guest looks for a host while none is connected.
const HOST_POLL: Duration = Duration::from_millis(20);

/// A character device (the virtio-serial port) as a non-blocking async stream.
#[derive(Debug)]
pub struct PortIo(AsyncFd<std::fs::File>);

impl PortIo {
    /// Opens the port at `path`, non-blocking.
    pub fn open(path: &Path) -> io::Result<Self> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC | libc::O_NOCTTY)
            .open(path)?;
        Self::new(file)
    }

    /// Takes an open, non-blocking port (registered with the current runtime).
    pub fn new(file: std::fs::File) -> io::Result<Self> {
        // SAFETY: the file is owned by the AsyncFd for as long as it is registered.
        Ok(Self(unsafe {
            AsyncFd::register_with_interest(
                file,
                tokio::io::Interest::READABLE | tokio::io::Interest::WRITABLE,
            )?
        }))
    }
}

impl AsyncRead for PortIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        use std::io::Read;
        loop {
            let mut guard = ready!(self.0.poll_read_ready(cx))?;
            let unfilled = buf.initialize_unfilled();
            match guard.try_io(|f| f.get_ref().read(unfilled)) {
                Ok(Ok(n)) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Ok(Err(e)) => return Poll::Ready(Err(e)),
                Err(_would_block) => continue,
            }
        }
    }
}

impl AsyncWrite for PortIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        use std::io::Write;
        loop {
            let mut guard = ready!(self.0.poll_write_ready(cx))?;
            match guard.try_io(|f| f.get_ref().write(data)) {
                Ok(r) => return Poll::Ready(r),
                Err(_would_block) => continue,
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// The nonce of a host's hello line, if `line` is one.
pub fn parse_hello(line: &[u8]) -> Option<&str> {
    let line = std::str::from_utf8(line).ok()?;
    let nonce = line.strip_prefix(HELLO)?.strip_prefix(' ')?;
    (!nonce.is_empty() && nonce.bytes().all(|b| b.is_ascii_alphanumeric())).then_some(nonce)
}

/// Reads until a hello line; end of file (no host connected) is waited out.
async fn await_hello<S: AsyncRead + Unpin>(io: &mut S) -> io::Result<String> {
    let mut line = Vec::with_capacity(MAX_HANDSHAKE_LINE);
    let mut byte = [0u8; 1];
    loop {
        if io.read(&mut byte).await? == 0 {
            line.clear();
            tokio::time::sleep(HOST_POLL).await;
            continue;
        }
        match byte[0] {
            b'\n' => {
                if let Some(nonce) = parse_hello(&line) {
                    return Ok(nonce.to_string());
                }
                line.clear();
            }
            b if line.len() < MAX_HANDSHAKE_LINE => line.push(b),
            _ => line.clear(),
        }
    }
}

/// Serves one host connection on `io`: answers its hello, then relays every stream of
/// the yamux session to a fresh connection to `agent` (a unix socket address, abstract
/// when it starts with a NUL). Returns when the host goes away.
pub async fn serve_session<S>(mut io: S, agent: &Path) -> io::Result<()>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let nonce = await_hello(&mut io).await?;
    io.write_all(format!("{READY} {nonce}\n").as_bytes())
        .await?;
    io.flush().await?;
    let mut conn =
        yamux::Connection::new(io.compat(), yamux::Config::default(), yamux::Mode::Server);
    loop {
        match poll_fn(|cx| conn.poll_next_inbound(cx)).await {
            Some(Ok(stream)) => {
                let agent = agent.to_path_buf();
                tokio::spawn(async move {
                    let mut stream = stream.compat();
                    match connect(&agent).await {
                        Ok(mut local) => {
                            let _ = tokio::io::copy_bidirectional(&mut stream, &mut local).await;
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "agent socket refused a channel stream")
                        }
                    }
                });
            }
            Some(Err(e)) => return Err(io::Error::other(e)),
            None => return Ok(()),
        }
    }
}

/// Connects to a unix socket; a path starting with NUL names an abstract socket.
async fn connect(agent: &Path) -> io::Result<tokio::net::UnixStream> {
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::ffi::OsStrExt;
    let bytes = agent.as_os_str().as_bytes();
    let std_stream = match bytes.strip_prefix(b"\0") {
        Some(name) => {
            let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
            std::os::unix::net::UnixStream::connect_addr(&addr)?
        }
        None => std::os::unix::net::UnixStream::connect(agent)?,
    };
    std_stream.set_nonblocking(true)?;
    tokio::net::UnixStream::from_std(std_stream)
}

/// Serves the channel on the open port `port` for ever: one host connection after
/// another.
pub async fn serve(port: std::fs::File, agent: PathBuf) -> io::Result<()> {
    let mut io = PortIo::new(port)?;
    loop {
        if let Err(e) = serve_session(&mut io, &agent).await {
            tracing::debug!(error = %e, "agent channel session ended");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hello_lines_are_parsed_strictly() {
        assert_eq!(parse_hello(b"dsec-hello abc123"), Some("abc123"));
        assert_eq!(parse_hello(b"dsec-hello "), None);
        assert_eq!(parse_hello(b"dsec-hello a b"), None);
        assert_eq!(parse_hello(b"dsec-hellox abc"), None);
        assert_eq!(parse_hello(b"\xff"), None);
    }
}
