//! Async reading and writing of raw descriptors (pipes, PTY masters) on the tokio reactor.
//!
//! `tokio::process` is not used (see [`crate::reaper`]), so child pipes are wrapped here
//! with [`AsyncFd`]. A PTY master returns `EIO` once the last slave descriptor closes;
//! that is reported as end of file.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};

use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

use crate::sys;

/// Reads from a non-blocking descriptor.
#[derive(Debug)]
pub struct FdReader {
    fd: AsyncFd<OwnedFd>,
}

impl FdReader {
    /// Registers `fd` (made non-blocking) for reading.
    pub fn new(fd: OwnedFd) -> io::Result<Self> {
        sys::set_nonblocking(fd.as_raw_fd())?;
        // SAFETY: `fd` is an OwnedFd that the AsyncFd owns until it is dropped; it is
        // never closed or replaced meanwhile.
        let fd = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE)? };
        Ok(Self { fd })
    }

    /// Reads into `buf`; `Ok(0)` at end of file (or PTY hang-up).
    pub async fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            let mut guard = self.fd.readable().await?;
            let res = guard.try_io(|inner| {
                // SAFETY: reading into a valid buffer of the given length from an open fd.
                let n = unsafe {
                    libc::read(
                        inner.get_ref().as_raw_fd(),
                        buf.as_mut_ptr().cast(),
                        buf.len(),
                    )
                };
                if n < 0 {
                    Err(io::Error::last_os_error())
                } else {
                    Ok(n as usize)
                }
            });
            match res {
                Ok(Ok(n)) => return Ok(n),
                Ok(Err(e)) if e.raw_os_error() == Some(libc::EIO) => return Ok(0),
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => continue,
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => continue,
            }
        }
    }
}

/// Writes to a non-blocking descriptor.
#[derive(Debug)]
pub struct FdWriter {
    fd: AsyncFd<OwnedFd>,
}

impl FdWriter {
    /// Registers `fd` (made non-blocking) for writing.
    pub fn new(fd: OwnedFd) -> io::Result<Self> {
        sys::set_nonblocking(fd.as_raw_fd())?;
        // SAFETY: `fd` is an OwnedFd that the AsyncFd owns until it is dropped; it is
        // never closed or replaced meanwhile.
        let fd = unsafe { AsyncFd::register_with_interest(fd, Interest::WRITABLE)? };
        Ok(Self { fd })
    }

    /// Writes all of `data`.
    pub async fn write_all(&self, mut data: &[u8]) -> io::Result<()> {
        while !data.is_empty() {
            let mut guard = self.fd.writable().await?;
            let res = guard.try_io(|inner| {
                // SAFETY: writing from a valid buffer of the given length to an open fd.
                let n = unsafe {
                    libc::write(
                        inner.get_ref().as_raw_fd(),
                        data.as_ptr().cast(),
                        data.len(),
                    )
                };
                if n < 0 {
                    Err(io::Error::last_os_error())
                } else {
                    Ok(n as usize)
                }
            });
            match res {
                Ok(Ok(n)) => data = &data[n..],
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => continue,
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => continue,
            }
        }
        Ok(())
    }
}
