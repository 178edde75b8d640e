//! Path resolution confined to the sandbox root.
//!
//! Untrusted code inside the sandbox may plant symlinks (`link -> /etc`,
//! `link -> ../../..`). Every user path is therefore resolved by the kernel with
//! `openat2(RESOLVE_IN_ROOT)` relative to a descriptor of the root opened once at start:
//! `..` and absolute symlinks are clamped to the root, and magic links (`/proc/*/fd/*`,
//! `/proc/*/root`) are refused. Operations on a final component (write, mkdir, remove,
//! rename, lstat) open the *parent* that way and then use `*at` syscalls on the name, so
//! the final component is never followed unless the operation wants that.
//!
//! No user path is ever joined onto a host path and passed to plain `std::fs`.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;

use dsec_wire::{ApiError, ErrorCode};

use crate::error::io_err;
use crate::sys;

/// `openat2` resolve flags used for every user path.
const RESOLVE: u64 = libc::RESOLVE_IN_ROOT | libc::RESOLVE_NO_MAGICLINKS;

/// A handle on the sandbox root.
#[derive(Debug)]
pub struct Root {
    fd: OwnedFd,
    cwd: String,
}

/// A user path after lexical normalization: absolute inside the sandbox, no `.`/`..`
/// components, no trailing slash (`/` for the root itself).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxPath(String);

impl SandboxPath {
    /// The normalized absolute path.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// True for the root directory.
    pub fn is_root(&self) -> bool {
        self.0 == "/"
    }

    /// The last component (`/` for the root).
    pub fn name(&self) -> &str {
        match self.0.rfind('/') {
            Some(i) if self.0.len() > 1 => &self.0[i + 1..],
            _ => "/",
        }
    }

    /// The parent directory (the root for the root).
    pub fn parent(&self) -> SandboxPath {
        match self.0.rfind('/') {
            Some(0) | None => SandboxPath("/".into()),
            Some(i) => SandboxPath(self.0[..i].to_string()),
        }
    }

    /// A child of this directory.
    pub fn join(&self, name: &str) -> SandboxPath {
        if self.is_root() {
            SandboxPath(format!("/{name}"))
        } else {
            SandboxPath(format!("{}/{name}", self.0))
        }
    }
}

impl std::fmt::Display for SandboxPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Lexically normalizes `path` (relative paths are taken relative to `cwd`).
pub fn normalize(path: &str, cwd: &str) -> Result<SandboxPath, ApiError> {
    if path.is_empty() {
        return Err(ApiError::new(ErrorCode::InvalidPath, "empty path"));
    }
    if path.contains('\0') {
        return Err(ApiError::new(
            ErrorCode::InvalidPath,
            format!("path contains NUL: {path:?}"),
        ));
    }
    let mut parts: Vec<&str> = Vec::new();
    let full = if path.starts_with('/') {
        path.to_string()
    } else {
        format!("{cwd}/{path}")
    };
    for comp in full.split('/') {
        match comp {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            c => parts.push(c),
        }
    }
    Ok(SandboxPath(format!("/{}", parts.join("/"))))
}

impl Root {
    /// Opens the root directory. `cwd` is the sandbox's default working directory.
    pub fn new(root: &Path, cwd: &str) -> io::Result<Root> {
        // The configured root itself is trusted host configuration, not user input.
        let fd: OwnedFd = std::fs::File::open(root)?.into();
        let st = sys::fstat(fd.as_fd())?;
        if st.st_mode & libc::S_IFMT != libc::S_IFDIR {
            return Err(io::Error::from_raw_os_error(libc::ENOTDIR));
        }
        let cwd = if cwd.starts_with('/') {
            cwd.to_string()
        } else {
            format!("/{cwd}")
        };
        Ok(Root { fd, cwd })
    }

    /// The root descriptor.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Normalizes a user path against the default working directory.
    pub fn path(&self, user: &str) -> Result<SandboxPath, ApiError> {
        normalize(user, &self.cwd)
    }

    /// Opens `path` with `flags`, resolved inside the root (a final symlink is followed,
    /// clamped to the root, unless `flags` has `O_NOFOLLOW`).
    pub fn open(&self, path: &SandboxPath, flags: libc::c_int) -> io::Result<OwnedFd> {
        let c = sys::cstr(path.as_str().as_bytes())?;
        sys::openat2(self.fd(), &c, flags, 0, RESOLVE)
    }

    /// Opens a directory for `*at` operations (`O_PATH`).
    pub fn open_dir(&self, path: &SandboxPath) -> io::Result<OwnedFd> {
        self.open(path, libc::O_PATH | libc::O_DIRECTORY)
    }

    /// Opens the parent of `path` and returns it with the final component. Fails with
    /// `InvalidPath` for the root itself.
    pub fn parent(&self, path: &SandboxPath) -> Result<(OwnedFd, String), ApiError> {
        if path.is_root() {
            return Err(ApiError::new(
                ErrorCode::InvalidPath,
                "the root directory has no parent; name a path below it",
            ));
        }
        let parent = path.parent();
        let fd = self
            .open_dir(&parent)
            .map_err(|e| io_err(&e, "open parent of", path.as_str()))?;
        Ok((fd, path.name().to_string()))
    }

    /// `mkdir -p`: creates `path` and missing parents, returning an `O_PATH` descriptor.
    /// Each prefix is resolved inside the root, so symlinks on the way stay confined.
    pub fn mkdir_p(&self, path: &SandboxPath) -> io::Result<OwnedFd> {
        let mut cur = self.open_dir(&SandboxPath("/".into()))?;
        let mut prefix = SandboxPath("/".into());
        for comp in path.as_str().split('/').filter(|c| !c.is_empty()) {
            prefix = prefix.join(comp);
            match self.open_dir(&prefix) {
                Ok(fd) => cur = fd,
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                    let name = sys::cstr(comp.as_bytes())?;
                    match sys::mkdirat(cur.as_fd(), &name, 0o755) {
                        Ok(()) => {}
                        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
                        Err(e) => return Err(e),
                    }
                    cur = self.open_dir(&prefix)?;
                }
                Err(e) => return Err(e),
            }
        }
        Ok(cur)
    }
}

/// Opens `name` inside `dir` without following any symlink and without leaving `dir`.
pub fn open_beneath(dir: BorrowedFd<'_>, name: &[u8], flags: libc::c_int) -> io::Result<OwnedFd> {
    let c = sys::cstr(name)?;
    sys::openat2(
        dir,
        &c,
        flags,
        0,
        libc::RESOLVE_BENEATH | libc::RESOLVE_NO_SYMLINKS | libc::RESOLVE_NO_MAGICLINKS,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalizes_lexically() {
        let n = |p: &str| {
            normalize(p, "/work")
                .map(|p| p.0)
                .unwrap_or_else(|e| e.message)
        };
        assert_eq!(n("/a/b/../c"), "/a/c");
        assert_eq!(n("../../../etc"), "/etc");
        assert_eq!(n("x/./y/"), "/work/x/y");
        assert_eq!(n("/"), "/");
        assert_eq!(n("/.."), "/");
        assert!(normalize("", "/").is_err());
        let p = normalize("/a/b", "/").expect("valid");
        assert_eq!(p.name(), "b");
        assert_eq!(p.parent().as_str(), "/a");
        assert_eq!(p.parent().parent().as_str(), "/");
    }
}
