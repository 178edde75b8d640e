//! Loop devices through `/dev/loop-control` and `LOOP_CONFIGURE` (Linux 5.8+): one ioctl
//! attaches a backing file with its flags, no `losetup` process.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::PathBuf;

use crate::DiskError;

const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;
const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
/// Detach the device when its last user (the mount) goes away.
const LO_FLAGS_AUTOCLEAR: u32 = 4;
/// Bypass the page cache for the backing file: the ext4 above caches already.
const LO_FLAGS_DIRECT_IO: u32 = 16;

#[repr(C)]
struct LoopInfo64 {
    lo_device: u64,
    lo_inode: u64,
    lo_rdevice: u64,
    lo_offset: u64,
    lo_sizelimit: u64,
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    lo_file_name: [u8; 64],
    lo_crypt_name: [u8; 64],
    lo_encrypt_key: [u8; 32],
    lo_init: [u64; 2],
}

#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

const _: () = assert!(std::mem::size_of::<LoopInfo64>() == 232);
const _: () = assert!(std::mem::size_of::<LoopConfig>() == 304);

/// An attached loop device. It detaches itself once closed and unused (autoclear), so
/// hold it open until the file system on it is mounted.
#[derive(Debug)]
pub struct LoopDevice {
    /// `/dev/loopN`.
    pub path: PathBuf,
    _dev: File,
}

fn ioctl_err(op: &'static str) -> DiskError {
    DiskError::Os {
        op,
        source: std::io::Error::last_os_error(),
    }
}

/// Attaches `backing` to a free loop device.
pub fn attach(backing: &File) -> Result<LoopDevice, DiskError> {
    let ctl = OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/loop-control")
        .map_err(|source| DiskError::Os {
            op: "open /dev/loop-control",
            source,
        })?;
    let mut direct_io = true;
    // Attaches of this process take turns: between LOOP_CTL_GET_FREE and LOOP_CONFIGURE
    // the device is still free, so concurrent attaches would all pick it and all but one
    // fail (128 creates at once lost 64 retries in a row).
    static ATTACH: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _turn = ATTACH.lock().unwrap_or_else(|p| p.into_inner());
    // Another process racing for the same free device: the loser gets EBUSY and retries.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while std::time::Instant::now() < deadline {
        // SAFETY: LOOP_CTL_GET_FREE takes no argument and returns a device number.
        let n = unsafe { libc::ioctl(ctl.as_raw_fd(), LOOP_CTL_GET_FREE as _) };
        if n < 0 {
            return Err(ioctl_err("LOOP_CTL_GET_FREE"));
        }
        let path = PathBuf::from(format!("/dev/loop{n}"));
        let dev = match OpenOptions::new().read(true).write(true).open(&path) {
            Ok(f) => f,
            // udev/devtmpfs may not have made the node yet.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                std::thread::sleep(std::time::Duration::from_millis(1));
                continue;
            }
            Err(source) => {
                return Err(DiskError::Os {
                    op: "open loop device",
                    source,
                })
            }
        };
        let mut flags = LO_FLAGS_AUTOCLEAR;
        if direct_io {
            flags |= LO_FLAGS_DIRECT_IO;
        }
        let cfg = LoopConfig {
            fd: backing.as_raw_fd() as u32,
            block_size: 0,
            // SAFETY: all-zero is a valid LoopInfo64 (plain integers and byte arrays).
            info: LoopInfo64 {
                lo_flags: flags,
                ..unsafe { std::mem::zeroed() }
            },
            reserved: [0; 8],
        };
        // SAFETY: `cfg` is a valid, fully initialised loop_config that outlives the call.
        let rc = unsafe { libc::ioctl(dev.as_raw_fd(), LOOP_CONFIGURE as _, &cfg) };
        if rc == 0 {
            return Ok(LoopDevice { path, _dev: dev });
        }
        match std::io::Error::last_os_error().raw_os_error() {
            Some(libc::EBUSY) => {
                std::thread::sleep(std::time::Duration::from_micros(200));
                continue;
            }
            // The backing file system cannot do direct I/O: use the page cache.
            Some(libc::EINVAL) if direct_io => direct_io = false,
            _ => return Err(ioctl_err("LOOP_CONFIGURE")),
        }
    }
    Err(DiskError::Os {
        op: "find a free loop device",
        source: std::io::Error::from_raw_os_error(libc::EBUSY),
    })
}
