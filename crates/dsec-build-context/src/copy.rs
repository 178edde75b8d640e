//! [`Context::copy`]: one COPY/ADD step as a tar archive to extract at `/` of the build
//! sandbox, with Docker's COPY semantics (see the crate documentation), and its digest.
//!
//! The [`Writer`] writes the entries (relative names, the step's owner and `--chmod`)
//! and hashes what was copied: per entry its destination, type, mode, link target and
//! content digest, never mtimes or the archive's owners, so the same files checked out
//! again produce the same digest.

use std::collections::HashSet;
use std::fs::File;
use std::io::{self, BufWriter, Read};

use dsec_dockerfile::CopyStep;
use sha2::{Digest, Sha256};

use crate::archive;
use crate::context::{Context, Kind, Meta, Node, CONTEXT};
use crate::name::{base_name, clean_rooted, join, path_of};
use crate::{ContextError, CopyOutcome};

/// First line of every digest's input: bump it when the input changes, so old cache
/// entries are not taken for new ones.
const DIGEST_VERSION: &str = "dsec-build-context copy v1\n";

impl Context {
    /// Writes to `out` the tar archive to upload at `/` for `step`, whose `from` is
    /// ignored (this context is the source).
    ///
    /// `dest_is_dir`: the builder found `step.dest` to be an existing directory of the
    /// image (a single file then goes inside it, as with Docker). `owner`: uid and gid of
    /// every entry. Entry names are relative to `/`; the parents of the destination get
    /// no entries (the sandbox creates missing ones, 0755). `out` is written from its
    /// current position, normally a new empty file.
    pub fn copy(
        &self,
        step: &CopyStep,
        dest_is_dir: bool,
        owner: (u32, u32),
        out: &mut File,
    ) -> Result<CopyOutcome, ContextError> {
        if step.dest.contains('\0') {
            return Err(ContextError::BadDest {
                dest: step.dest.clone(),
                reason: "it contains a NUL byte".into(),
            });
        }
        let dest_hint = step.dest.is_empty()
            || step.dest == "."
            || step.dest.ends_with('/')
            || step.dest.ends_with("/.");
        let dest = clean_rooted(&step.dest).join("/");
        if step.sources.is_empty() {
            return Err(ContextError::NoMatch {
                pattern: String::new(),
            });
        }
        // (source as written, matched key): a key names the copy, what it leads to (a
        // symlink source is dereferenced) is copied.
        let mut sources = Vec::new();
        for source in &step.sources {
            let keys = self.expand(source)?;
            if keys.is_empty() {
                return Err(ContextError::NoMatch {
                    pattern: source.clone(),
                });
            }
            sources.extend(keys.into_iter().map(|k| (source, k)));
        }
        let into_dir = dest_hint || dest_is_dir || sources.len() > 1 || dest.is_empty();
        let mut w = Writer::new(out, owner, step.chmod, self.limits.max_path_len);
        for (source, name_key) in &sources {
            let (key, node) = self.follow(name_key, source)?;
            let key = &key;
            match node.kind {
                Kind::Dir => {
                    // The directory's contents go into dest; dest takes its mode.
                    if !dest.is_empty() && !w.seen.contains(&dest) {
                        w.dir(&dest, node.meta)?;
                    }
                    let prefix = key.len() + usize::from(!key.is_empty());
                    for (k, n) in self.descendants(key) {
                        let rel = path_of(&k[prefix..]);
                        self.write_node(&join(&dest, &rel), n, &mut w)?;
                    }
                }
                Kind::File { offset, size } if step.extract_tars => {
                    match archive::sniff(self, key, offset, size)? {
                        Some(format) => {
                            archive::extract(self, key, format, (offset, size), &dest, &mut w)?
                        }
                        None => {
                            let target = file_target(&dest, name_key, into_dir);
                            self.write_node(&target, &node, &mut w)?;
                        }
                    }
                }
                Kind::File { .. } | Kind::Symlink(_) => {
                    let target = file_target(&dest, name_key, into_dir);
                    self.write_node(&target, &node, &mut w)?;
                }
            }
        }
        w.finish()
    }

    /// Writes one entry of this context at `path` of the output.
    fn write_node(&self, path: &str, node: &Node, w: &mut Writer<'_>) -> Result<(), ContextError> {
        match &node.kind {
            Kind::Dir => w.dir(path, node.meta),
            Kind::File { offset, size } => {
                w.file(path, node.meta, *size, self.section(*offset, *size), |e| {
                    ContextError::io(format!("reading the {CONTEXT}"), e)
                })
            }
            Kind::Symlink(target) => w.symlink(path, node.meta, target),
        }
    }
}

/// Where a file or symlink source goes: into `dest`, or at `dest` itself.
fn file_target(dest: &str, key: &str, into_dir: bool) -> String {
    if into_dir {
        join(dest, base_name(key))
    } else {
        dest.to_string()
    }
}

/// The output archive of one copy, and its digest.
pub(crate) struct Writer<'a> {
    tar: tar::Builder<BufWriter<&'a mut File>>,
    owner: (u32, u32),
    chmod: Option<u32>,
    max_path_len: usize,
    digest: Sha256,
    paths: Vec<String>,
    /// Relative paths written so far.
    pub(crate) seen: HashSet<String>,
    bytes: u64,
}

impl<'a> Writer<'a> {
    fn new(out: &'a mut File, owner: (u32, u32), chmod: Option<u32>, max_path_len: usize) -> Self {
        let mut digest = Sha256::new();
        digest.update(DIGEST_VERSION);
        Writer {
            tar: tar::Builder::new(BufWriter::with_capacity(256 << 10, out)),
            owner,
            chmod: chmod.map(|m| m & 0o7777),
            max_path_len,
            digest,
            paths: Vec::new(),
            seen: HashSet::new(),
            bytes: 0,
        }
    }

    /// A header for an entry at `path` (relative, checked against the path limit).
    fn header(
        &self,
        path: &str,
        ty: tar::EntryType,
        mode: u32,
        mtime: u64,
    ) -> Result<tar::Header, ContextError> {
        if path.is_empty() {
            // Never happens: the destination root gets no entry, sources are below it.
            return Err(ContextError::BadDest {
                dest: "/".into(),
                reason: "an entry for the root itself".into(),
            });
        }
        if path.len() + 1 > self.max_path_len {
            return Err(ContextError::Limit {
                archive: "copy".into(),
                what: format!("destination path /{path} is too long"),
                limit: self.max_path_len as u64,
            });
        }
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(ty);
        h.set_mode(mode);
        h.set_uid(u64::from(self.owner.0));
        h.set_gid(u64::from(self.owner.1));
        h.set_mtime(mtime);
        h.set_size(0);
        Ok(h)
    }

    /// Adds one entry to the digest and to the list of paths.
    fn record(&mut self, path: &str, ty: char, mode: u32, link: &str, content: &str) {
        self.digest
            .update(format!("/{path}\0{ty}\0{mode:o}\0{link}\0{content}\n"));
        if self.seen.insert(path.to_string()) {
            self.paths.push(format!("/{path}"));
        }
    }

    fn write_error(e: io::Error) -> ContextError {
        ContextError::io("writing the copy", e)
    }

    /// A directory (mode: `--chmod` or `meta`'s).
    pub(crate) fn dir(&mut self, path: &str, meta: Meta) -> Result<(), ContextError> {
        let mode = self.chmod.unwrap_or(meta.mode);
        let mut h = self.header(path, tar::EntryType::Directory, mode, meta.mtime)?;
        self.tar
            .append_data(&mut h, path, io::empty())
            .map_err(Self::write_error)?;
        self.record(path, 'd', mode, "", "");
        Ok(())
    }

    /// A regular file of `size` bytes read from `src`; an error reading `src` is
    /// reported through `source_error`.
    pub(crate) fn file<R: Read>(
        &mut self,
        path: &str,
        meta: Meta,
        size: u64,
        src: R,
        source_error: impl Fn(io::Error) -> ContextError,
    ) -> Result<(), ContextError> {
        let mode = self.chmod.unwrap_or(meta.mode);
        let mut h = self.header(path, tar::EntryType::Regular, mode, meta.mtime)?;
        h.set_size(size);
        let mut src = Hashing {
            inner: src,
            left: size,
            hasher: Sha256::new(),
            failed: None,
        };
        if let Err(e) = self.tar.append_data(&mut h, path, &mut src) {
            return Err(match src.failed.take() {
                Some(e) => source_error(e),
                None => Self::write_error(e),
            });
        }
        let content = hex::encode(src.hasher.finalize());
        self.bytes += size;
        self.record(path, 'f', mode, "", &content);
        Ok(())
    }

    /// A symbolic link to `target`, verbatim (mode 0777: `--chmod` does not apply).
    pub(crate) fn symlink(
        &mut self,
        path: &str,
        meta: Meta,
        target: &str,
    ) -> Result<(), ContextError> {
        let mut h = self.header(path, tar::EntryType::Symlink, 0o777, meta.mtime)?;
        self.tar
            .append_link(&mut h, path, target)
            .map_err(Self::write_error)?;
        self.record(path, 'l', 0o777, target, "");
        Ok(())
    }

    /// A hard link to `target`, an earlier entry of this output (relative path).
    pub(crate) fn hardlink(
        &mut self,
        path: &str,
        meta: Meta,
        target: &str,
    ) -> Result<(), ContextError> {
        let mut h = self.header(path, tar::EntryType::Link, 0, meta.mtime)?;
        self.tar
            .append_link(&mut h, path, target)
            .map_err(Self::write_error)?;
        self.record(path, 'h', 0, &format!("/{target}"), "");
        Ok(())
    }

    /// Ends the archive, flushes it, and returns the outcome.
    fn finish(self) -> Result<CopyOutcome, ContextError> {
        let mut buf = self.tar.into_inner().map_err(Self::write_error)?;
        io::Write::flush(&mut buf).map_err(Self::write_error)?;
        Ok(CopyOutcome {
            digest: hex::encode(self.digest.finalize()),
            paths: self.paths,
            bytes: self.bytes,
        })
    }
}

/// A source of exactly `left` bytes that hashes what it yields and keeps its own error
/// (so that a failed append can tell a bad source from a bad output).
struct Hashing<R> {
    inner: R,
    left: u64,
    hasher: Sha256,
    failed: Option<io::Error>,
}

impl<R: Read> Read for Hashing<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.left == 0 || buf.is_empty() {
            return Ok(0);
        }
        let want = buf
            .len()
            .min(usize::try_from(self.left).unwrap_or(usize::MAX));
        let n = match self.inner.read(&mut buf[..want]) {
            Ok(0) => {
                self.failed = Some(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the entry's data ends early",
                ));
                return Err(io::Error::other("source failed"));
            }
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => return Err(e),
            Err(e) => {
                self.failed = Some(e);
                return Err(io::Error::other("source failed"));
            }
        };
        self.hasher.update(&buf[..n]);
        self.left -= n as u64;
        Ok(n)
    }
}
