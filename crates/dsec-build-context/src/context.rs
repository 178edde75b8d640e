//! [`Context`]: a tar archive on disk, indexed once, read by offset afterwards.
//!
//! The index maps each normalized name to its type, mode, mtime and, for a file, where
//! its data lies in the archive; [`Context::copy`] reads the data from there with
//! positioned reads, so a context can serve many steps (and threads) without
//! re-reading the archive. Missing parent directories get implicit entries (0755), as
//! extracting the archive would create them.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, BufReader, Read, Seek};
use std::os::unix::fs::FileExt;

use dsec_dockerfile::Ignore;

use crate::glob::{has_wildcards, Pattern};
use crate::name::{self, clean_rooted, entry_name, key, link_target, path_of, END, SEP};
use crate::{ContextError, Limits};

/// Name of the build context in error messages.
pub(crate) const CONTEXT: &str = "build context";
/// Largest `.dockerignore` read.
const MAX_DOCKERIGNORE: u64 = 4 << 20;
/// Symlinks followed to resolve one COPY source (as the kernel's ELOOP limit of 40, but
/// Docker's context walk gives up sooner).
const MAX_SOURCE_LINKS: usize = 16;
/// Mode of directories the archive implies but does not hold.
const IMPLICIT_DIR_MODE: u32 = 0o755;

/// An indexed tar archive on disk: the build context, or a tree downloaded from
/// another stage.
pub struct Context {
    file: File,
    /// The archive's root (`./`): its mode when a COPY of `.` creates the destination.
    pub(crate) root: Meta,
    /// Normalized names as keys (see [`crate::name`]), without the root.
    pub(crate) entries: BTreeMap<String, Node>,
    pub(crate) limits: Limits,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("entries", &self.entries.len())
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

/// Mode and mtime of an entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Meta {
    /// Permission bits (07777).
    pub(crate) mode: u32,
    pub(crate) mtime: u64,
}

/// One indexed entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Node {
    pub(crate) kind: Kind,
    pub(crate) meta: Meta,
}

/// What an entry is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Kind {
    Dir,
    /// A regular file (hard links resolved): its data is `size` bytes at `offset`.
    File {
        offset: u64,
        size: u64,
    },
    Symlink(String),
}

impl Context {
    /// Indexes `file`, a tar archive, from its start. Names are normalized (leading
    /// `./` and `/` stripped, `.` components dropped); an entry with a `..` component, a
    /// NUL or a non-UTF-8 name, or past `limits`, is an error naming it. A later entry
    /// replaces an earlier one of the same name (a non-directory replaces a whole
    /// subtree), as extraction would. Hard links resolve to their target's content.
    /// Device and FIFO entries are left out; sparse files are refused.
    ///
    /// With `honor_dockerignore`, a `.dockerignore` at the archive's root is parsed and
    /// the paths it excludes are invisible to [`copy`](Context::copy) (parents of paths
    /// an exception re-includes stay, as Docker's context walk keeps them).
    pub fn open(
        mut file: File,
        honor_dockerignore: bool,
        limits: &Limits,
    ) -> Result<Context, ContextError> {
        let io_err = |e| ContextError::io("reading the build context", e);
        file.rewind().map_err(io_err)?;
        let len = file.metadata().map_err(io_err)?.len();
        let mut index = Index {
            root: Meta {
                mode: IMPLICIT_DIR_MODE,
                mtime: 0,
            },
            entries: BTreeMap::new(),
        };
        let mut ar = tar::Archive::new(BufReader::new(&file));
        let bad = |e: io::Error| ContextError::BadArchive {
            archive: CONTEXT.into(),
            reason: e.to_string(),
        };
        let mut count = 0usize;
        for entry in ar.entries_with_seek().map_err(bad)? {
            let mut entry = entry.map_err(bad)?;
            count += 1;
            if count > limits.max_entries {
                return Err(ContextError::Limit {
                    archive: CONTEXT.into(),
                    what: "too many entries".into(),
                    limit: limits.max_entries as u64,
                });
            }
            let ty = entry.header().entry_type();
            if ty == tar::EntryType::XGlobalHeader {
                continue;
            }
            if ty == tar::EntryType::GNUSparse || is_pax_sparse(&mut entry).map_err(bad)? {
                return Err(ContextError::Unsupported {
                    archive: CONTEXT.into(),
                    what: format!(
                        "sparse file {:?}",
                        String::from_utf8_lossy(&entry.path_bytes())
                    ),
                });
            }
            let raw = entry.path_bytes();
            let header = entry.header();
            let name = entry_name(&raw, CONTEXT, limits.max_path_len)?;
            let shown = || String::from_utf8_lossy(&raw).into_owned();
            let meta = Meta {
                mode: header.mode().map_err(bad)? & 0o7777,
                mtime: header.mtime().map_err(bad)?,
            };
            let kind = match ty {
                tar::EntryType::Directory => Kind::Dir,
                // Old tars mark directories with a trailing slash on a regular entry.
                tar::EntryType::Regular if raw.ends_with(b"/") => Kind::Dir,
                tar::EntryType::Regular | tar::EntryType::Continuous => {
                    let offset = entry.raw_file_position();
                    let size = entry.size();
                    if offset.checked_add(size).is_none_or(|end| end > len) {
                        return Err(ContextError::BadArchive {
                            archive: CONTEXT.into(),
                            reason: format!("entry {:?} is truncated", shown()),
                        });
                    }
                    Kind::File { offset, size }
                }
                tar::EntryType::Symlink => {
                    let target = entry.link_name_bytes().unwrap_or_default();
                    Kind::Symlink(link_target(
                        &target,
                        &shown(),
                        CONTEXT,
                        limits.max_path_len,
                    )?)
                }
                tar::EntryType::Link => {
                    let target = entry.link_name_bytes().unwrap_or_default();
                    let target = entry_name(&target, CONTEXT, limits.max_path_len)?;
                    let node = index
                        .entries
                        .get(&key(&target))
                        .filter(|_| !target.is_empty());
                    match node {
                        Some(Node {
                            kind: kind @ (Kind::File { .. } | Kind::Symlink(_)),
                            ..
                        }) => kind.clone(),
                        _ => {
                            return Err(ContextError::UnsafeEntry {
                                archive: CONTEXT.into(),
                                name: shown(),
                                reason: format!(
                                    "hard link to {target:?}, which is not an earlier file \
                                     of the archive"
                                ),
                            })
                        }
                    }
                }
                // Devices, FIFOs, GNU volume labels...: not files a build copies.
                _ => continue,
            };
            index.insert(&name, Node { kind, meta }, &shown())?;
        }
        drop(ar);
        let mut ctx = Context {
            file,
            root: index.root,
            entries: index.entries,
            limits: *limits,
        };
        if honor_dockerignore {
            ctx.apply_dockerignore()?;
        }
        Ok(ctx)
    }

    /// Parses the root `.dockerignore`, if any, and drops what it excludes.
    fn apply_dockerignore(&mut self) -> Result<(), ContextError> {
        let Some(Node {
            kind: Kind::File { offset, size },
            ..
        }) = self.entries.get(".dockerignore")
        else {
            return Ok(());
        };
        if *size > MAX_DOCKERIGNORE {
            return Err(ContextError::Limit {
                archive: CONTEXT.into(),
                what: format!(".dockerignore is {size} bytes"),
                limit: MAX_DOCKERIGNORE,
            });
        }
        let mut text = Vec::new();
        self.section(*offset, *size)
            .read_to_end(&mut text)
            .map_err(|e| ContextError::io("reading .dockerignore", e))?;
        let text = String::from_utf8(text).map_err(|_| ContextError::BadArchive {
            archive: CONTEXT.into(),
            reason: ".dockerignore is not UTF-8".into(),
        })?;
        let ignore = Ignore::parse(&text)?;
        let all = std::mem::take(&mut self.entries);
        let mut kept: BTreeMap<String, Node> = BTreeMap::new();
        for (k, node) in &all {
            if ignore.matches(&name::path_of(k)) {
                continue;
            }
            // Keep the parents (an exception can re-include a path in an excluded
            // directory); keys are in depth-first order, so parents are looked up once.
            let mut at = k.as_str();
            while let Some((parent, _)) = at.rsplit_once(SEP) {
                if kept.contains_key(parent) {
                    break;
                }
                if let Some(p) = all.get(parent) {
                    kept.insert(parent.to_string(), p.clone());
                }
                at = parent;
            }
            kept.insert(k.clone(), node.clone());
        }
        self.entries = kept;
        Ok(())
    }

    /// A reader of `size` bytes at `offset` of the archive file.
    pub(crate) fn section(&self, offset: u64, size: u64) -> Section<'_> {
        Section {
            file: &self.file,
            pos: offset,
            left: size,
        }
    }

    /// The node at `key`; the root is `""`.
    pub(crate) fn node(&self, key: &str) -> Option<Node> {
        if key.is_empty() {
            return Some(Node {
                kind: Kind::Dir,
                meta: self.root,
            });
        }
        self.entries.get(key).cloned()
    }

    /// What a COPY source that is a symlink stands for: Docker's builders dereference
    /// the sources themselves (not symlinks inside a copied directory). Follows `key`'s
    /// links within the context, an absolute target rooted at the context and `..`
    /// stopping at its root, at most [`MAX_SOURCE_LINKS`] of them; returns the key and
    /// node reached.
    pub(crate) fn follow(&self, key: &str, source: &str) -> Result<(String, Node), ContextError> {
        let mut key = key.to_string();
        let mut path = path_of(&key);
        for _ in 0..=MAX_SOURCE_LINKS {
            let node = self.node(&key).ok_or_else(|| ContextError::BadSymlink {
                pattern: source.to_string(),
                reason: format!("it is a symlink to /{path}, which is not in the build context"),
            })?;
            let Kind::Symlink(target) = &node.kind else {
                return Ok((key, node));
            };
            let parent = path.rsplit_once('/').map_or("", |(p, _)| p);
            let joined = if target.starts_with('/') {
                target.clone()
            } else {
                format!("{parent}/{target}")
            };
            path = clean_rooted(&joined).join("/");
            key = name::key(&path);
        }
        Err(ContextError::BadSymlink {
            pattern: source.to_string(),
            reason: format!("more than {MAX_SOURCE_LINKS} symlinks to follow"),
        })
    }

    fn is_dir(&self, key: &str) -> bool {
        key.is_empty()
            || matches!(
                self.entries.get(key),
                Some(Node {
                    kind: Kind::Dir,
                    ..
                })
            )
    }

    /// Keys of the direct children of the directory `dir`, in name order: the first
    /// key of each child's range, then a jump past its subtree.
    fn children<'a>(&'a self, dir: &str) -> impl Iterator<Item = &'a str> + 'a {
        let prefix = if dir.is_empty() {
            String::new()
        } else {
            format!("{dir}{SEP}")
        };
        let mut from = prefix.clone();
        std::iter::from_fn(move || {
            let (k, _) = self
                .entries
                .range::<str, _>((
                    std::ops::Bound::Included(from.as_str()),
                    std::ops::Bound::Unbounded,
                ))
                .next()?;
            if !k.starts_with(&prefix) {
                return None;
            }
            from = format!("{k}{END}");
            Some(k.as_str())
        })
    }

    /// Entries strictly under the directory `dir`, depth-first, parents first.
    pub(crate) fn descendants<'a>(
        &'a self,
        dir: &str,
    ) -> impl Iterator<Item = (&'a String, &'a Node)> + 'a {
        let prefix = if dir.is_empty() {
            String::new()
        } else {
            format!("{dir}{SEP}")
        };
        self.entries
            .range::<str, _>((
                std::ops::Bound::Included(prefix.as_str()),
                std::ops::Bound::Unbounded,
            ))
            .take_while(move |(k, _)| k.starts_with(&prefix))
    }

    /// Keys matching one COPY source: cleaned and rooted at the context, wildcards
    /// matched per component (symlinks are not followed). `""` is the root.
    pub(crate) fn expand(&self, source: &str) -> Result<Vec<String>, ContextError> {
        let mut current = vec![String::new()];
        for comp in clean_rooted(source) {
            let mut next = Vec::new();
            if has_wildcards(comp) {
                let pattern =
                    Pattern::compile(comp).map_err(|reason| ContextError::BadPattern {
                        pattern: source.to_string(),
                        reason: reason.to_string(),
                    })?;
                for dir in current.iter().filter(|d| self.is_dir(d)) {
                    next.extend(
                        self.children(dir)
                            .filter(|k| pattern.matches(name::base_name(k)))
                            .map(str::to_string),
                    );
                }
            } else {
                for dir in current.iter().filter(|d| self.is_dir(d)) {
                    let k = if dir.is_empty() {
                        comp.to_string()
                    } else {
                        format!("{dir}{SEP}{comp}")
                    };
                    if self.entries.contains_key(&k) {
                        next.push(k);
                    }
                }
            }
            current = next;
            if current.is_empty() {
                break;
            }
        }
        Ok(current)
    }
}

/// Whether a PAX entry is a sparse file (`GNU.sparse.*` records): the tar crate would
/// read its sparse map as content.
pub(crate) fn is_pax_sparse<R: Read>(entry: &mut tar::Entry<'_, R>) -> io::Result<bool> {
    let Some(exts) = entry.pax_extensions()? else {
        return Ok(false);
    };
    for ext in exts {
        if ext?.key_bytes().starts_with(b"GNU.sparse.") {
            return Ok(true);
        }
    }
    Ok(false)
}

/// The index being built by [`Context::open`].
struct Index {
    root: Meta,
    entries: BTreeMap<String, Node>,
}

impl Index {
    /// Adds the entry `name` (normalized) with tar's replace semantics.
    fn insert(&mut self, name: &str, node: Node, shown: &str) -> Result<(), ContextError> {
        if name.is_empty() {
            if node.kind != Kind::Dir {
                return Err(ContextError::UnsafeEntry {
                    archive: CONTEXT.into(),
                    name: shown.into(),
                    reason: "the archive's root must be a directory".into(),
                });
            }
            self.root = node.meta;
            return Ok(());
        }
        let k = key(name);
        // Parents: must be directories; missing ones are implied.
        for (i, _) in k.match_indices(SEP) {
            let parent = &k[..i];
            match self.entries.get(parent) {
                Some(Node {
                    kind: Kind::Dir, ..
                }) => {}
                Some(_) => {
                    return Err(ContextError::UnsafeEntry {
                        archive: CONTEXT.into(),
                        name: shown.into(),
                        reason: format!(
                            "it is under {:?}, which is not a directory",
                            name::path_of(parent)
                        ),
                    })
                }
                None => {
                    self.entries.insert(
                        parent.to_string(),
                        Node {
                            kind: Kind::Dir,
                            meta: Meta {
                                mode: IMPLICIT_DIR_MODE,
                                mtime: node.meta.mtime,
                            },
                        },
                    );
                }
            }
        }
        let both_dirs = node.kind == Kind::Dir
            && matches!(
                self.entries.get(&k),
                Some(Node {
                    kind: Kind::Dir,
                    ..
                })
            );
        if !both_dirs {
            // A directory replaced by a non-directory (or the reverse) loses its subtree.
            let start = format!("{k}{SEP}");
            let end = format!("{k}{END}");
            let doomed: Vec<String> = self
                .entries
                .range(start..end)
                .map(|(k, _)| k.clone())
                .collect();
            for d in doomed {
                self.entries.remove(&d);
            }
        }
        self.entries.insert(k, node);
        Ok(())
    }
}

/// A reader of one section of the archive file by positioned reads; ending early is an
/// `UnexpectedEof` error, never a short entry.
#[derive(Debug)]
pub(crate) struct Section<'a> {
    file: &'a File,
    pos: u64,
    left: u64,
}

impl Read for Section<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.left == 0 || buf.is_empty() {
            return Ok(0);
        }
        let want = buf
            .len()
            .min(usize::try_from(self.left).unwrap_or(usize::MAX));
        let n = self.file.read_at(&mut buf[..want], self.pos)?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the archive file ends inside an entry",
            ));
        }
        self.pos += n as u64;
        self.left -= n as u64;
        Ok(n)
    }
}
