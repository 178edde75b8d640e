//! [`DirStore`]: a blob store in a directory, local or on a shared mount.

use std::fs::File;
use std::io::{self, Write};
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::{validate_key, validate_prefix, BlobError, BlobStore, ObjectInfo, Result};

/// Objects are files under `root`, named by their keys. Writes land in `root/.tmp` and are
/// renamed into place.
#[derive(Debug)]
pub struct DirStore {
    root: PathBuf,
}

impl DirStore {
    /// Opens (creating if needed) the store in directory `root`.
    pub fn open(root: impl AsRef<Path>) -> Result<Self> {
        let root = root.as_ref();
        if !root.is_absolute() {
            return Err(BlobError::InvalidUrl {
                url: root.display().to_string(),
                reason: "a directory store needs an absolute path".into(),
            });
        }
        let tmp = root.join(".tmp");
        std::fs::create_dir_all(&tmp).map_err(|e| BlobError::io("mkdir", &tmp, e))?;
        Ok(Self {
            root: root.to_path_buf(),
        })
    }

    fn path(&self, key: &str) -> Result<PathBuf> {
        validate_key(key)?;
        Ok(self.root.join(key))
    }

    fn not_found(&self, key: &str) -> BlobError {
        BlobError::NotFound {
            store: self.url(),
            key: key.to_string(),
        }
    }

    /// A fresh temporary path in `.tmp`.
    fn tmp_path(&self) -> PathBuf {
        self.root
            .join(".tmp")
            .join(format!("{:016x}", rand::random::<u64>()))
    }

    /// Moves the finished temporary file `tmp` to `key`'s path (creating parents), or
    /// removes it on failure.
    fn commit(&self, tmp: &Path, dest: &Path) -> Result<()> {
        let res = (|| {
            if let Some(parent) = dest.parent() {
                std::fs::create_dir_all(parent).map_err(|e| BlobError::io("mkdir", parent, e))?;
            }
            std::fs::rename(tmp, dest).map_err(|e| BlobError::io("rename", dest, e))
        })();
        if res.is_err() {
            let _ = std::fs::remove_file(tmp);
        }
        res
    }
}

/// Hard-links `src` to the new path `dest`, or copies it when they are on different file
/// systems (or links are refused). Returns the size. `dest` is fsynced when copied.
fn link_or_copy(src: &Path, dest: &Path) -> io::Result<u64> {
    match std::fs::hard_link(src, dest) {
        Ok(()) => return Ok(std::fs::metadata(dest)?.len()),
        Err(e)
            if e.kind() == io::ErrorKind::NotFound || e.kind() == io::ErrorKind::AlreadyExists =>
        {
            return Err(e)
        }
        Err(_) => {}
    }
    let mut from = File::open(src)?;
    let mut to = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(dest)?;
    let n = io::copy(&mut from, &mut to)?;
    to.sync_all()?;
    Ok(n)
}

impl BlobStore for DirStore {
    fn url(&self) -> String {
        format!("file://{}", self.root.display())
    }

    fn head(&self, key: &str) -> Result<Option<ObjectInfo>> {
        let p = self.path(key)?;
        match std::fs::metadata(&p) {
            Ok(m) if m.is_file() => Ok(Some(ObjectInfo {
                key: key.to_string(),
                size: m.len(),
                modified: m.modified().map_err(|e| BlobError::io("stat", &p, e))?,
            })),
            Ok(_) => Ok(None),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(BlobError::io("stat", &p, e)),
        }
    }

    fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        let p = self.path(key)?;
        match std::fs::read(&p) {
            Ok(b) => Ok(Some(b)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(BlobError::io("read", &p, e)),
        }
    }

    fn get_range(&self, key: &str, range: Range<u64>) -> Result<Vec<u8>> {
        let p = self.path(key)?;
        let f = match File::open(&p) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(self.not_found(key)),
            Err(e) => return Err(BlobError::io("open", &p, e)),
        };
        let size = f
            .metadata()
            .map_err(|e| BlobError::io("stat", &p, e))?
            .len();
        if range.start >= range.end || range.start >= size {
            return Err(BlobError::BadRange {
                store: self.url(),
                key: key.to_string(),
                start: range.start,
                end: range.end,
            });
        }
        let end = range.end.min(size);
        let len = usize::try_from(end - range.start).map_err(|_| BlobError::BadRange {
            store: self.url(),
            key: key.to_string(),
            start: range.start,
            end: range.end,
        })?;
        let mut buf = vec![0u8; len];
        f.read_exact_at(&mut buf, range.start)
            .map_err(|e| BlobError::io("read", &p, e))?;
        Ok(buf)
    }

    fn download(&self, key: &str, dest: &Path) -> Result<u64> {
        let p = self.path(key)?;
        match link_or_copy(&p, dest) {
            Ok(n) => Ok(n),
            Err(e) if e.kind() == io::ErrorKind::NotFound && !p.exists() => {
                Err(self.not_found(key))
            }
            Err(e) => {
                let _ = std::fs::remove_file(dest);
                Err(BlobError::io("download to", dest, e))
            }
        }
    }

    fn put(&self, key: &str, data: &[u8]) -> Result<()> {
        let dest = self.path(key)?;
        let tmp = self.tmp_path();
        let written = (|| {
            let mut f = File::create(&tmp)?;
            f.write_all(data)?;
            f.sync_all()
        })();
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            return Err(BlobError::io("write", &tmp, e));
        }
        self.commit(&tmp, &dest)
    }

    fn upload(&self, key: &str, src: &Path) -> Result<()> {
        let dest = self.path(key)?;
        let tmp = self.tmp_path();
        if let Err(e) = link_or_copy(src, &tmp) {
            let _ = std::fs::remove_file(&tmp);
            return Err(BlobError::io("upload", src, e));
        }
        self.commit(&tmp, &dest)
    }

    fn delete(&self, key: &str) -> Result<()> {
        let p = self.path(key)?;
        match std::fs::remove_file(&p) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(BlobError::io("unlink", &p, e)),
        }
    }

    fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        validate_prefix(prefix)?;
        let mut out = Vec::new();
        let start = self.root.join(prefix);
        let mut stack = vec![start];
        while let Some(dir) = stack.pop() {
            let rd = match std::fs::read_dir(&dir) {
                Ok(rd) => rd,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(BlobError::io("read_dir", &dir, e)),
            };
            for ent in rd {
                let ent = ent.map_err(|e| BlobError::io("read_dir", &dir, e))?;
                let path = ent.path();
                let ft = ent
                    .file_type()
                    .map_err(|e| BlobError::io("stat", &path, e))?;
                if ft.is_dir() {
                    if path != self.root.join(".tmp") {
                        stack.push(path);
                    }
                    continue;
                }
                if !ft.is_file() {
                    continue;
                }
                let Ok(rel) = path.strip_prefix(&self.root) else {
                    continue;
                };
                let Some(key) = rel.to_str() else { continue };
                let Ok(m) = ent.metadata() else { continue };
                out.push(ObjectInfo {
                    key: key.to_string(),
                    size: m.len(),
                    modified: m.modified().map_err(|e| BlobError::io("stat", &path, e))?,
                });
            }
        }
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    }
}
