//! Unix stream sockets on tokio, registered with the reactor for reading only.
//!
//! tokio registers a `UnixStream` for both directions. Each time the peer reads, the
//! kernel reports the socket writable again and wakes whatever waits on the reactor, even
//! when nothing has anything to write: one wake-up of the sender per message it sent.
//! Between the node and a sandbox's agent, with one request and one reply per exec, that
//! is a wasted wake-up on each side per exec, often of the CPU the next step needs (on a
//! VM, waking an idle vCPU is the dearest part of an exec round trip).
//!
//! A [`QuietStream`] registers its socket for reading only. Writes go straight to the
//! socket; only when it is full does the writer wait for space, on a registration of a
//! duplicate descriptor that lives until a write succeeds again.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};

/// A connected unix stream socket with a read-only reactor registration.
#[derive(Debug)]
pub struct QuietStream {
    io: Arc<AsyncFd<OwnedFd>>,
}

/// The reading half of a [`QuietStream`].
#[derive(Debug)]
pub struct ReadHalf {
    io: Arc<AsyncFd<OwnedFd>>,
}

/// The writing half of a [`QuietStream`].
#[derive(Debug)]
pub struct WriteHalf {
    io: Arc<AsyncFd<OwnedFd>>,
    /// A registration for write space (of a duplicate descriptor), only while the socket
    /// is full.
    space: Option<AsyncFd<OwnedFd>>,
}

impl QuietStream {
    /// Takes over a connected socket (made non-blocking here). Needs a tokio runtime with
    /// I/O enabled.
    pub fn from_std(stream: std::os::unix::net::UnixStream) -> io::Result<Self> {
        stream.set_nonblocking(true)?;
        // SAFETY: the OwnedFd is the AsyncFd's own, open until it is dropped.
        let io =
            unsafe { AsyncFd::register_with_interest(OwnedFd::from(stream), Interest::READABLE)? };
        Ok(Self { io: Arc::new(io) })
    }

    /// Splits into halves that can be used concurrently.
    pub fn into_split(self) -> (ReadHalf, WriteHalf) {
        (
            ReadHalf {
                io: self.io.clone(),
            },
            WriteHalf {
                io: self.io,
                space: None,
            },
        )
    }
}

impl AsRawFd for QuietStream {
    fn as_raw_fd(&self) -> RawFd {
        self.io.get_ref().as_raw_fd()
    }
}

impl AsRawFd for ReadHalf {
    fn as_raw_fd(&self) -> RawFd {
        self.io.get_ref().as_raw_fd()
    }
}

impl AsRawFd for WriteHalf {
    fn as_raw_fd(&self) -> RawFd {
        self.io.get_ref().as_raw_fd()
    }
}

/// One `recv`/`send` result as `io::Result`.
fn cvt(n: isize) -> io::Result<usize> {
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

impl AsyncRead for ReadHalf {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            let mut guard = ready!(self.io.poll_read_ready(cx))?;
            let unfilled = buf.initialize_unfilled();
            let read = guard.try_io(|fd| {
                // SAFETY: recv into the initialized, unfilled part of `buf`.
                cvt(unsafe {
                    libc::recv(
                        fd.get_ref().as_raw_fd(),
                        unfilled.as_mut_ptr().cast(),
                        unfilled.len(),
                        libc::MSG_DONTWAIT,
                    )
                })
            });
            match read {
                Ok(Ok(n)) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => continue,
                Ok(Err(e)) => return Poll::Ready(Err(e)),
                Err(_would_block) => continue,
            }
        }
    }
}

impl WriteHalf {
    /// Writes what the socket takes now of `bufs`, in order, in one `sendmsg`, without the
    /// reactor.
    fn send_now(&self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        // SAFETY: msghdr is plain data, all-zero is a valid (empty) value. IoSlice is an
        // iovec (std guarantees the layout on Unix).
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = bufs.as_ptr() as *mut libc::iovec;
        msg.msg_iovlen = bufs.len().min(MAX_IOVECS) as _;
        loop {
            // SAFETY: sendmsg of iovecs that borrow live slices; MSG_NOSIGNAL: a closed
            // peer is an error, not a SIGPIPE.
            match cvt(unsafe {
                libc::sendmsg(
                    self.as_raw_fd(),
                    &msg,
                    libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
                )
            }) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                other => return other,
            }
        }
    }

    /// Waits for write space (only ever called after a send found the socket full).
    fn poll_space(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let space = match &mut self.space {
            Some(space) => space,
            None => {
                let dup = self.io.get_ref().try_clone()?;
                // SAFETY: the duplicate is the AsyncFd's own, open until it is dropped.
                let space = unsafe { AsyncFd::register_with_interest(dup, Interest::WRITABLE)? };
                self.space.insert(space)
            }
        };
        // Registered after the failed send: if space appeared in between, the
        // registration reports it at once.
        let mut guard = ready!(space.poll_write_ready(cx))?;
        guard.clear_ready();
        Poll::Ready(Ok(()))
    }

    /// [`AsyncWrite::poll_write_vectored`] and `poll_write` alike.
    fn poll_send(
        &mut self,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        loop {
            match self.send_now(bufs) {
                Ok(n) => {
                    // Space again: stop listening for it.
                    self.space = None;
                    return Poll::Ready(Ok(n));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Poll::Ready(Err(e)),
            }
            ready!(self.poll_space(cx))?;
        }
    }
}

/// The most iovecs one `sendmsg` is given (the kernel refuses more than `UIO_MAXIOV`).
const MAX_IOVECS: usize = 1024;

impl AsyncWrite for WriteHalf {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().poll_send(cx, &[io::IoSlice::new(data)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().poll_send(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.space = None;
        // SAFETY: shutdown of our own socket's write side.
        if unsafe { libc::shutdown(self.as_raw_fd(), libc::SHUT_WR) } < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::ENOTCONN) {
                return Poll::Ready(Err(e));
            }
        }
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests;
