//! A swap file the node sets up itself, so pausing a sandbox can take back its anonymous
//! memory too (hosts often run without swap). Sandboxes still run with swap disabled for
//! them (memsw = limit, v2 `memory.swap.max` 0); only a pause's reclaim opens it.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;

use crate::NodeError;

/// Whether `path` is an active swap area (listed in /proc/swaps).
pub fn is_active(path: &Path) -> bool {
    let Ok(canon) = std::fs::canonicalize(path) else {
        return false;
    };
    std::fs::read_to_string("/proc/swaps")
        .unwrap_or_default()
        .lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().next())
        .any(|f| Path::new(f) == canon)
}

/// Makes `path` an active swap file of `size_mb` (creating and formatting it if needed).
/// Does nothing when it is active already.
pub fn ensure(path: &Path, size_mb: u64) -> Result<(), NodeError> {
    if is_active(path) {
        return Ok(());
    }
    let io = |op| NodeError::io(op, path);
    if !path.exists() {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(NodeError::io("mkdir", dir))?;
        }
        let f = std::fs::File::create(path).map_err(io("create"))?;
        // A swap file must not have holes: allocate every block.
        let len = i64::try_from(size_mb << 20).unwrap_or(i64::MAX);
        nix::fcntl::fallocate(
            std::os::fd::AsRawFd::as_raw_fd(&f),
            nix::fcntl::FallocateFlags::empty(),
            0,
            len,
        )
        .map_err(|e| NodeError::io("fallocate", path)(e.into()))?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
            .map_err(io("chmod"))?;
        let out = Command::new("mkswap")
            .arg(path)
            .output()
            .map_err(io("run mkswap for"))?;
        if !out.status.success() {
            let _ = std::fs::remove_file(path);
            return Err(NodeError::Unsupported(format!(
                "mkswap {}: {}",
                path.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
    }
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| NodeError::Unsupported("swap file path contains NUL".into()))?;
    // SAFETY: swapon with a valid NUL-terminated path and no flags.
    if unsafe { libc::swapon(c.as_ptr(), 0) } != 0 {
        return Err(io("swapon")(std::io::Error::last_os_error()));
    }
    tracing::info!(path = %path.display(), size_mb, "swap file on");
    Ok(())
}
