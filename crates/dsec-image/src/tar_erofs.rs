//! Packs one OCI layer's tar stream straight into an uncompressed EROFS image, in the
//! overlayfs form an extraction gives (whiteouts as 0:0 character devices, opaque
//! directories marked with `trusted.overlay.opaque` and `user.overlay.opaque`), without
//! creating the tree on disk first.
//!
//! Extracting a layer and running `mkfs.erofs` over the tree creates and deletes every
//! file of the layer on the host file system; on a busy ext4 that inode churn, not the
//! data, was most of a pull. Here file data goes to the image as it is read, and only the
//! metadata (names, modes, owners, xattrs, where each file's blocks are) is kept in memory;
//! the small tails of files (`size % 4096`) wait in a spool file until the inodes are
//! written after the data.
//!
//! Image layout (4 KiB blocks, no compression): block 0 holds the superblock; then the
//! full blocks of regular files in stream order; then the metadata area (extended 64-byte
//! inodes, root first, each followed by its inline xattrs and, when it fits in the block,
//! its data tail); then the blocks of directories and of tails that did not fit inline.
//!
//! Entry handling matches [`crate::extract`] with `Whiteouts::Overlay`: `..` paths and
//! escaping hard links are refused, character and block devices skipped, archive xattrs in
//! `trusted.overlay.*` / `user.overlay.*` dropped, parents the archive does not list made
//! 0755 root:root with mtime 0, later entries replacing earlier ones. An entry below a
//! symlink of the same layer is refused rather than followed. The output is a function of
//! the stream alone: the same layer always packs to the same bytes.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, BufWriter, Read, Seek, SeekFrom, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::{Component, Path};

use crate::ImageError;

const BLOCK: u64 = 4096;
const BLOCK_BITS: u8 = 12;
const SUPER_OFFSET: u64 = 1024;
const MAGIC: u32 = 0xE0F5_E1E2;
/// Size of an extended on-disk inode.
const INODE_SIZE: u64 = 64;
/// Size of an on-disk directory entry (nid, name offset, type, reserved).
const DIRENT_SIZE: usize = 12;
/// Longest name EROFS (and Linux) allows.
const NAME_MAX: usize = 255;
/// Longest symlink target Linux allows (PATH_MAX without the NUL).
const SYMLINK_MAX: usize = 4095;
/// Most files, directories and links one layer may hold: each takes a few hundred bytes
/// of memory while the layer packs (real layers stay under a million).
const MAX_NODES: usize = 2 << 20;

/// `i_format` data layouts.
const LAYOUT_FLAT_PLAIN: u16 = 0;
const LAYOUT_FLAT_INLINE: u16 = 2;
/// `i_format` bit 0: extended (64-byte) inode.
const EXTENDED: u16 = 1;

/// Xattr name indexes: the prefix a stored name is relative to.
const XATTR_USER: u8 = 1;
const XATTR_ACL_ACCESS: u8 = 2;
const XATTR_ACL_DEFAULT: u8 = 3;
const XATTR_TRUSTED: u8 = 4;
const XATTR_SECURITY: u8 = 6;

const S_IFMT: u32 = 0o170000;
const S_IFDIR: u32 = 0o040000;
const S_IFREG: u32 = 0o100000;
const S_IFLNK: u32 = 0o120000;
const S_IFCHR: u32 = 0o020000;
const S_IFIFO: u32 = 0o010000;

const WHITEOUT_PREFIX: &[u8] = b".wh.";
const WHITEOUT_META_PREFIX: &[u8] = b".wh..wh.";
const OPAQUE_MARKER: &[u8] = b".wh..wh..opq";
const PAX_XATTR_PREFIX: &[u8] = b"SCHILY.xattr.";

/// One xattr as stored: its name index, the name after the index's prefix, the value.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Xattr {
    index: u8,
    name: Vec<u8>,
    value: Vec<u8>,
}

/// Where a regular file's last partial block lives.
#[derive(Debug, Clone, Copy)]
enum Tail {
    /// The size is a multiple of the block size.
    None,
    /// In the spool at this offset, to go inline after the inode.
    Inline { spool_at: u64 },
    /// Padded to a whole block right after the file's full blocks.
    Block,
}

#[derive(Debug)]
enum Body {
    Dir {
        children: BTreeMap<Vec<u8>, usize>,
    },
    File {
        size: u64,
        start: u32,
        tail: Tail,
    },
    Symlink {
        target: Vec<u8>,
    },
    /// FIFO or whiteout (character device 0:0): no data.
    Special,
}

#[derive(Debug)]
struct Node {
    /// Full `st_mode`: type and permission bits.
    mode: u32,
    uid: u32,
    gid: u32,
    mtime: u64,
    mtime_nsec: u32,
    xattrs: Vec<Xattr>,
    body: Body,
}

impl Node {
    fn implicit_dir() -> Self {
        Node {
            mode: S_IFDIR | 0o755,
            uid: 0,
            gid: 0,
            mtime: 0,
            mtime_nsec: 0,
            xattrs: Vec::new(),
            body: Body::Dir {
                children: BTreeMap::new(),
            },
        }
    }

    fn is_dir(&self) -> bool {
        matches!(self.body, Body::Dir { .. })
    }

    /// Bytes of the inline xattr area (0 without xattrs).
    fn xattr_size(&self) -> u64 {
        xattr_area_size(&self.xattrs)
    }
}

fn xattr_area_size(xattrs: &[Xattr]) -> u64 {
    if xattrs.is_empty() {
        return 0;
    }
    12 + xattrs
        .iter()
        .map(|x| align(4 + x.name.len() as u64 + x.value.len() as u64, 4))
        .sum::<u64>()
}

fn align(v: u64, to: u64) -> u64 {
    v.div_ceil(to) * to
}

/// Metadata of one tar entry, PAX records applied.
struct EntryMeta {
    mode: u32,
    uid: u32,
    gid: u32,
    mtime: u64,
    mtime_nsec: u32,
    xattrs: Vec<Xattr>,
}

/// Packs a layer's tar stream into an EROFS image; see the module docs.
pub(crate) struct TarErofs<'a> {
    /// Names the stream in errors.
    origin: &'a Path,
    out_path: &'a Path,
    out: BufWriter<File>,
    /// Next free block of the data area.
    next_block: u64,
    spool: BufWriter<File>,
    spool_len: u64,
    nodes: Vec<Node>,
    opaque: Vec<usize>,
    had_root: bool,
    skipped_devices: u64,
    buf: Vec<u8>,
}

impl<'a> TarErofs<'a> {
    /// A writer creating `out` (which must not exist); the spool is an unnamed file in
    /// `out`'s directory.
    pub(crate) fn create(out_path: &'a Path, origin: &'a Path) -> Result<Self, ImageError> {
        let out = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(out_path)
            .map_err(|e| ImageError::io("create", out_path, e))?;
        let dir = out_path.parent().unwrap_or(Path::new("."));
        let spool = tempfile::tempfile_in(dir).map_err(|e| ImageError::io("create", dir, e))?;
        let mut w = BufWriter::with_capacity(1 << 20, out);
        w.seek(SeekFrom::Start(BLOCK))
            .map_err(|e| ImageError::io("seek", out_path, e))?;
        Ok(TarErofs {
            origin,
            out_path,
            out: w,
            next_block: 1,
            spool: BufWriter::with_capacity(256 << 10, spool),
            spool_len: 0,
            nodes: vec![Node::implicit_dir()],
            opaque: Vec::new(),
            had_root: false,
            skipped_devices: 0,
            buf: vec![0u8; 1 << 20],
        })
    }

    fn archive_err(&self, message: impl Into<String>) -> ImageError {
        ImageError::Archive {
            path: self.origin.to_path_buf(),
            message: message.into(),
        }
    }

    fn unsafe_entry(&self, entry: &Path) -> ImageError {
        ImageError::UnsafeEntry {
            archive: self.origin.to_path_buf(),
            entry: entry.to_path_buf(),
        }
    }

    /// Reads the tar stream `reader` up to its end-of-archive marker into the image.
    /// Returns whether it had an entry for the root itself (`./`).
    pub(crate) fn add_tar(&mut self, reader: &mut dyn Read) -> Result<bool, ImageError> {
        let mut ar = tar::Archive::new(reader);
        let entries = ar.entries().map_err(|e| self.tar_err(e))?;
        for entry in entries {
            let mut entry = entry.map_err(|e| self.tar_err(e))?;
            self.entry(&mut entry)?;
        }
        if self.skipped_devices > 0 {
            tracing::debug!(
                archive = %self.origin.display(),
                skipped_devices = self.skipped_devices,
                "device nodes skipped"
            );
        }
        Ok(self.had_root)
    }

    fn tar_err(&self, e: io::Error) -> ImageError {
        let mut message = e.to_string();
        let mut source = std::error::Error::source(&e);
        while let Some(s) = source {
            message.push_str(": ");
            message.push_str(&s.to_string());
            source = s.source();
        }
        self.archive_err(message)
    }

    /// `path`'s normal components, refusing `..`.
    fn components<'p>(&self, path: &'p Path) -> Result<Vec<&'p [u8]>, ImageError> {
        let mut out = Vec::new();
        for c in path.components() {
            match c {
                Component::Normal(n) => {
                    let n = n.as_bytes();
                    if n.contains(&0) {
                        return Err(self.unsafe_entry(path));
                    }
                    if n.len() > NAME_MAX {
                        return Err(self.archive_err(format!(
                            "entry {}: a name is longer than {NAME_MAX} bytes",
                            path.display()
                        )));
                    }
                    out.push(n);
                }
                Component::ParentDir => return Err(self.unsafe_entry(path)),
                _ => {}
            }
        }
        Ok(out)
    }

    fn entry<R: Read>(&mut self, entry: &mut tar::Entry<'_, R>) -> Result<(), ImageError> {
        let path = entry.path().map_err(|e| self.tar_err(e))?.into_owned();
        let rel = self.components(&path)?;
        let et = entry.header().entry_type();
        let link = if et.is_hard_link() || et.is_symlink() {
            let link = entry
                .link_name_bytes()
                .map(|l| l.into_owned())
                .ok_or_else(|| {
                    self.archive_err(format!("entry {}: no link target", path.display()))
                })?;
            Some(link)
        } else {
            None
        };
        if let Some((name, parent)) = rel.split_last() {
            if parent.iter().any(|c| c.starts_with(WHITEOUT_META_PREFIX)) {
                // Inside aufs metadata (`.wh..wh.plnk/...`): not image content.
                return Ok(());
            }
            if *name == OPAQUE_MARKER {
                let dir = self.ensure_dir(parent, &path)?;
                self.opaque.push(dir);
                return Ok(());
            }
            if name.starts_with(WHITEOUT_META_PREFIX) {
                return Ok(());
            }
            if let Some(hidden) = name.strip_prefix(WHITEOUT_PREFIX) {
                if hidden.is_empty() || hidden == b"." || hidden == b".." {
                    return Err(
                        self.archive_err(format!("invalid whiteout entry {}", path.display()))
                    );
                }
                let meta = self.entry_meta(entry);
                let dir = self.ensure_dir(parent, &path)?;
                let node = self.push(Node {
                    mode: S_IFCHR,
                    uid: meta.uid,
                    gid: meta.gid,
                    mtime: meta.mtime,
                    mtime_nsec: meta.mtime_nsec,
                    xattrs: Vec::new(),
                    body: Body::Special,
                })?;
                self.link(dir, hidden, node);
                return Ok(());
            }
        }
        if et.is_character_special() || et.is_block_special() {
            self.skipped_devices += 1;
            return Ok(());
        }
        let meta = self.entry_meta(entry);
        let Some((name, parent)) = rel.split_last() else {
            // `./`: the root directory's metadata.
            if et.is_dir() {
                self.had_root = true;
                self.set_meta(0, meta);
            }
            return Ok(());
        };
        let dir = self.ensure_dir(parent, &path)?;
        if et.is_dir() {
            match self.child(dir, name) {
                Some(existing) if self.nodes[existing].is_dir() => self.set_meta(existing, meta),
                _ => {
                    let node = self.push(Node::implicit_dir())?;
                    self.set_meta(node, meta);
                    self.link(dir, name, node);
                }
            }
        } else if et.is_hard_link() {
            let target = link.unwrap_or_default();
            let target_path = Path::new(std::ffi::OsStr::from_bytes(&target));
            if target_path.is_absolute() {
                return Err(self.unsafe_entry(&path));
            }
            let parts = self
                .components(target_path)
                .map_err(|_| self.unsafe_entry(&path))?;
            let found = self.lookup(&parts).filter(|n| !self.nodes[*n].is_dir());
            let Some(node) = found else {
                return Err(self.archive_err(format!(
                    "entry {}: hard link target {} is not a file earlier in the layer",
                    path.display(),
                    target_path.display()
                )));
            };
            self.link(dir, name, node);
        } else if et.is_symlink() {
            let target = link.unwrap_or_default();
            if target.is_empty() || target.len() > SYMLINK_MAX {
                return Err(self.archive_err(format!(
                    "entry {}: symlink target of {} bytes (1 to {SYMLINK_MAX} allowed)",
                    path.display(),
                    target.len()
                )));
            }
            let node = self.push(Node {
                mode: S_IFLNK | 0o777,
                uid: meta.uid,
                gid: meta.gid,
                mtime: meta.mtime,
                mtime_nsec: meta.mtime_nsec,
                xattrs: Vec::new(),
                body: Body::Symlink { target },
            })?;
            self.link(dir, name, node);
        } else if et.is_fifo() {
            let node = self.push(Node {
                mode: S_IFIFO | meta.mode,
                uid: meta.uid,
                gid: meta.gid,
                mtime: meta.mtime,
                mtime_nsec: meta.mtime_nsec,
                xattrs: meta.xattrs,
                body: Body::Special,
            })?;
            self.link(dir, name, node);
        } else if et.is_file() || et.is_contiguous() || et.is_gnu_sparse() {
            let size = entry.size();
            let xattr_size = xattr_area_size(&meta.xattrs);
            let (start, tail) = self.write_file(entry, size, xattr_size, &path)?;
            let node = self.push(Node {
                mode: S_IFREG | meta.mode,
                uid: meta.uid,
                gid: meta.gid,
                mtime: meta.mtime,
                mtime_nsec: meta.mtime_nsec,
                xattrs: meta.xattrs,
                body: Body::File { size, start, tail },
            })?;
            self.link(dir, name, node);
        } else {
            tracing::debug!(entry = %path.display(), kind = ?et, "tar entry kind skipped");
        }
        Ok(())
    }

    /// Mode bits, owner, mtime and xattrs of `entry`, PAX records (`uid`, `gid`, `mtime`,
    /// `SCHILY.xattr.*`) winning over the header.
    fn entry_meta<R: Read>(&self, entry: &mut tar::Entry<'_, R>) -> EntryMeta {
        let h = entry.header();
        let mut meta = EntryMeta {
            mode: h.mode().unwrap_or(0o644) & 0o7777,
            uid: h
                .uid()
                .ok()
                .and_then(|u| u32::try_from(u).ok())
                .unwrap_or(0),
            gid: h
                .gid()
                .ok()
                .and_then(|g| u32::try_from(g).ok())
                .unwrap_or(0),
            mtime: h.mtime().unwrap_or(0),
            mtime_nsec: 0,
            xattrs: Vec::new(),
        };
        let Ok(Some(exts)) = entry.pax_extensions() else {
            return meta;
        };
        for ext in exts.filter_map(Result::ok) {
            let (key, value) = (ext.key_bytes(), ext.value_bytes());
            let text = std::str::from_utf8(value).unwrap_or("");
            match key {
                b"uid" => meta.uid = text.parse().unwrap_or(meta.uid),
                b"gid" => meta.gid = text.parse().unwrap_or(meta.gid),
                b"mtime" => {
                    let (secs, frac) = text.split_once('.').unwrap_or((text, ""));
                    if let Ok(s) = secs.parse::<u64>() {
                        meta.mtime = s;
                        let digits: String = frac.chars().take(9).collect();
                        meta.mtime_nsec = format!("{digits:0<9}").parse().unwrap_or(0);
                    }
                }
                _ => {
                    if let Some(name) = key.strip_prefix(PAX_XATTR_PREFIX) {
                        if let Some(x) = to_xattr(name, value) {
                            meta.xattrs
                                .retain(|o| (o.index, &o.name) != (x.index, &x.name));
                            meta.xattrs.push(x);
                        }
                    }
                }
            }
        }
        meta
    }

    fn set_meta(&mut self, node: usize, meta: EntryMeta) {
        let n = &mut self.nodes[node];
        n.mode = (n.mode & S_IFMT) | meta.mode;
        n.uid = meta.uid;
        n.gid = meta.gid;
        n.mtime = meta.mtime;
        n.mtime_nsec = meta.mtime_nsec;
        n.xattrs = meta.xattrs;
    }

    /// Adds a node, refusing past [`MAX_NODES`] (a layer of millions of empty entries
    /// would otherwise hold the server's memory).
    fn push(&mut self, node: Node) -> Result<usize, ImageError> {
        if self.nodes.len() >= MAX_NODES {
            return Err(self.archive_err(format!(
                "more than {MAX_NODES} files and directories in one layer"
            )));
        }
        self.nodes.push(node);
        Ok(self.nodes.len() - 1)
    }

    fn child(&self, dir: usize, name: &[u8]) -> Option<usize> {
        match &self.nodes[dir].body {
            Body::Dir { children } => children.get(name).copied(),
            _ => None,
        }
    }

    /// Names `node` `name` in `dir`, replacing (and so dropping) what had that name.
    fn link(&mut self, dir: usize, name: &[u8], node: usize) {
        if let Body::Dir { children } = &mut self.nodes[dir].body {
            children.insert(name.to_vec(), node);
        }
    }

    /// The node at `parts` below the root, without creating anything.
    fn lookup(&self, parts: &[&[u8]]) -> Option<usize> {
        let mut cur = 0;
        for p in parts {
            cur = self.child(cur, p)?;
        }
        Some(cur)
    }

    /// The directory at `parts`, creating missing ones as implicit directories.
    fn ensure_dir(&mut self, parts: &[&[u8]], entry: &Path) -> Result<usize, ImageError> {
        let mut cur = 0;
        for p in parts {
            cur = match self.child(cur, p) {
                Some(n) if self.nodes[n].is_dir() => n,
                Some(n) if matches!(self.nodes[n].body, Body::Symlink { .. }) => {
                    return Err(self.archive_err(format!(
                        "entry {}: a parent is a symlink of the same layer ({}); \
                         entries below symlinks are not followed",
                        entry.display(),
                        String::from_utf8_lossy(p)
                    )))
                }
                Some(_) => {
                    return Err(self.archive_err(format!(
                        "entry {}: {} is not a directory",
                        entry.display(),
                        String::from_utf8_lossy(p)
                    )))
                }
                None => {
                    let n = self.push(Node::implicit_dir())?;
                    self.link(cur, p, n);
                    n
                }
            };
        }
        Ok(cur)
    }

    /// Writes a regular file's `size` bytes: its full blocks to the data area, its tail to
    /// the spool (inline later) or padded to a block. Returns its first block and tail.
    fn write_file(
        &mut self,
        r: &mut dyn Read,
        size: u64,
        xattr_size: u64,
        path: &Path,
    ) -> Result<(u32, Tail), ImageError> {
        let start = self.next_block;
        let full = size / BLOCK * BLOCK;
        let tail_len = size - full;
        let inline = tail_len > 0 && INODE_SIZE + xattr_size + tail_len <= BLOCK;
        let blocks = if tail_len > 0 && !inline {
            full / BLOCK + 1
        } else {
            full / BLOCK
        };
        if start + blocks > u64::from(u32::MAX) {
            return Err(self.archive_err("layer too large for one EROFS image (16 TiB)"));
        }
        let truncated = |this: &Self| {
            this.archive_err(format!(
                "entry {}: stream ends inside its {size} bytes",
                path.display()
            ))
        };
        let mut left = full;
        while left > 0 {
            let want = left.min(self.buf.len() as u64) as usize;
            let n = read_full(r, &mut self.buf[..want]).map_err(|e| self.tar_err(e))?;
            if n < want {
                return Err(truncated(self));
            }
            self.out
                .write_all(&self.buf[..n])
                .map_err(|e| ImageError::io("write", self.out_path, e))?;
            left -= n as u64;
        }
        let tail = if tail_len == 0 {
            Tail::None
        } else {
            let t = tail_len as usize;
            let n = read_full(r, &mut self.buf[..t]).map_err(|e| self.tar_err(e))?;
            if n < t {
                return Err(truncated(self));
            }
            if inline {
                let at = self.spool_len;
                self.spool
                    .write_all(&self.buf[..t])
                    .map_err(|e| ImageError::io("write", self.out_path, e))?;
                self.spool_len += tail_len;
                Tail::Inline { spool_at: at }
            } else {
                self.buf[t..BLOCK as usize].fill(0);
                self.out
                    .write_all(&self.buf[..BLOCK as usize])
                    .map_err(|e| ImageError::io("write", self.out_path, e))?;
                Tail::Block
            }
        };
        self.next_block += blocks;
        Ok((start as u32, tail))
    }

    /// Writes the metadata, directories and superblock and closes the image. Returns the
    /// image's size in bytes.
    pub(crate) fn finish(mut self) -> Result<u64, ImageError> {
        for dir in std::mem::take(&mut self.opaque) {
            // Both markers: overlayfs mounted by the host reads trusted.*, in a user
            // namespace (userxattr) user.*.
            for index in [XATTR_TRUSTED, XATTR_USER] {
                let x = Xattr {
                    index,
                    name: b"overlay.opaque".to_vec(),
                    value: b"y".to_vec(),
                };
                let xs = &mut self.nodes[dir].xattrs;
                xs.retain(|o| (o.index, &o.name) != (x.index, &x.name));
                xs.push(x);
            }
        }
        let spool = self
            .spool
            .into_inner()
            .map_err(|e| ImageError::io("write", self.out_path, e.into_error()))?;

        // Reachable nodes in breadth-first order (root first: its nid must fit 16 bits),
        // each with its parent directory, and link counts.
        let mut order: Vec<usize> = vec![0];
        let mut parent_of = vec![usize::MAX; self.nodes.len()];
        let mut links = vec![0u32; self.nodes.len()];
        parent_of[0] = 0;
        let mut i = 0;
        while i < order.len() {
            let d = order[i];
            i += 1;
            let Body::Dir { children } = &self.nodes[d].body else {
                continue;
            };
            let mut subdirs = 0;
            for &c in children.values() {
                if self.nodes[c].is_dir() {
                    subdirs += 1;
                }
                if parent_of[c] == usize::MAX {
                    parent_of[c] = d;
                    order.push(c);
                }
                links[c] += 1;
            }
            links[d] = 2 + subdirs;
        }

        // Directory contents: sorted names with "." and "..", split into blocks.
        let dir_size = |children: &BTreeMap<Vec<u8>, usize>| -> u64 {
            let names = dir_names(children);
            let blocks = split_dir_blocks(&names);
            let last = blocks.last().map(|b| b.used).unwrap_or(0);
            (blocks.len() as u64 - 1) * BLOCK + last as u64
        };

        // Lay out the metadata area: nid (offset / 32) of each node, and which data goes
        // inline after its inode.
        struct Placed {
            node: usize,
            nid: u64,
            size: u64,
            /// Bytes stored inline after the inode and xattrs.
            inline: u64,
            /// Blocks in the area after the metadata (directories, long symlinks).
            extra_blocks: u64,
        }
        let mut placed = Vec::with_capacity(order.len());
        let mut nid_of = vec![0u64; self.nodes.len()];
        let mut pos = 0u64;
        for &n in &order {
            let node = &self.nodes[n];
            let xsize = node.xattr_size();
            let (size, inline, extra_blocks) = match &node.body {
                Body::Dir { children } => {
                    let size = dir_size(children);
                    let tail = size % BLOCK;
                    if tail > 0 && INODE_SIZE + xsize + tail <= BLOCK {
                        (size, tail, size / BLOCK)
                    } else {
                        (size, 0, size.div_ceil(BLOCK))
                    }
                }
                Body::File { size, tail, .. } => {
                    let inline = match tail {
                        Tail::Inline { .. } => size % BLOCK,
                        _ => 0,
                    };
                    (*size, inline, 0)
                }
                Body::Symlink { target } => {
                    let len = target.len() as u64;
                    if INODE_SIZE + xsize + len <= BLOCK {
                        (len, len, 0)
                    } else {
                        (len, 0, 1)
                    }
                }
                Body::Special => (0, 0, 0),
            };
            let need = INODE_SIZE + xsize + inline;
            pos = align(pos, 32);
            if pos % BLOCK + need > BLOCK {
                pos = align(pos, BLOCK);
            }
            nid_of[n] = pos / 32;
            placed.push(Placed {
                node: n,
                nid: pos / 32,
                size,
                inline,
                extra_blocks,
            });
            pos += need;
        }
        let meta_blkaddr = self.next_block;
        let meta_blocks = align(pos, BLOCK) / BLOCK;
        let mut extra_next = meta_blkaddr + meta_blocks;
        let total_blocks = extra_next + placed.iter().map(|p| p.extra_blocks).sum::<u64>();
        if total_blocks > u64::from(u32::MAX) {
            return Err(ImageError::Archive {
                path: self.origin.to_path_buf(),
                message: "layer too large for one EROFS image (16 TiB)".into(),
            });
        }
        if nid_of[0] != 0 {
            return Err(ImageError::Archive {
                path: self.origin.to_path_buf(),
                message: "internal: the root inode is not first".into(),
            });
        }

        // Write the metadata area, collecting what goes after it.
        let meta_start = meta_blkaddr * BLOCK;
        self.out
            .seek(SeekFrom::Start(meta_start))
            .map_err(|e| ImageError::io("seek", self.out_path, e))?;
        let mut extra: Vec<u8> = Vec::new();
        let mut written = 0u64;
        let mut ino = 1u32;
        for p in &placed {
            let node = &self.nodes[p.node];
            let at = p.nid * 32;
            write_zeros(&mut self.out, at - written)
                .map_err(|e| ImageError::io("write", self.out_path, e))?;
            written = at;
            let (layout, blkaddr, inline_bytes): (u16, u64, Vec<u8>) = match &node.body {
                Body::Dir { children } => {
                    let names = dir_names(children);
                    let bytes = dir_bytes(
                        &names,
                        |c| match c {
                            DirRef::Dot => p.nid,
                            DirRef::DotDot => nid_of[parent_of[p.node]],
                            DirRef::Child(c) => nid_of[c],
                        },
                        &self.nodes,
                    );
                    let full = (p.size / BLOCK * BLOCK) as usize;
                    let addr = if p.extra_blocks > 0 { extra_next } else { 0 };
                    extra_next += p.extra_blocks;
                    if p.inline > 0 {
                        extra.extend_from_slice(&bytes[..full]);
                        (LAYOUT_FLAT_INLINE, addr, bytes[full..].to_vec())
                    } else {
                        extra.extend_from_slice(&bytes);
                        pad_to_block(&mut extra);
                        (LAYOUT_FLAT_PLAIN, addr, Vec::new())
                    }
                }
                Body::File { start, tail, size } => match tail {
                    Tail::Inline { spool_at } => {
                        let mut t = vec![0u8; (size % BLOCK) as usize];
                        spool
                            .read_exact_at(&mut t, *spool_at)
                            .map_err(|e| ImageError::io("read", self.out_path, e))?;
                        let addr = if *size >= BLOCK { u64::from(*start) } else { 0 };
                        (LAYOUT_FLAT_INLINE, addr, t)
                    }
                    _ => {
                        let addr = if *size > 0 { u64::from(*start) } else { 0 };
                        (LAYOUT_FLAT_PLAIN, addr, Vec::new())
                    }
                },
                Body::Symlink { target } => {
                    if p.inline > 0 {
                        (LAYOUT_FLAT_INLINE, 0, target.clone())
                    } else {
                        let addr = extra_next;
                        extra_next += 1;
                        extra.extend_from_slice(target);
                        pad_to_block(&mut extra);
                        (LAYOUT_FLAT_PLAIN, addr, Vec::new())
                    }
                }
                Body::Special => (LAYOUT_FLAT_PLAIN, 0, Vec::new()),
            };
            let mut inode = [0u8; INODE_SIZE as usize];
            let xsize = node.xattr_size();
            let icount: u16 = if xsize == 0 {
                0
            } else {
                ((xsize - 12) / 4 + 1) as u16
            };
            inode[0..2].copy_from_slice(&(EXTENDED | (layout << 1)).to_le_bytes());
            inode[2..4].copy_from_slice(&icount.to_le_bytes());
            inode[4..6].copy_from_slice(&(node.mode as u16).to_le_bytes());
            inode[8..16].copy_from_slice(&p.size.to_le_bytes());
            // i_u: the first data block (rdev 0 for FIFOs and whiteouts).
            inode[16..20].copy_from_slice(&(blkaddr as u32).to_le_bytes());
            inode[20..24].copy_from_slice(&ino.to_le_bytes());
            inode[24..28].copy_from_slice(&node.uid.to_le_bytes());
            inode[28..32].copy_from_slice(&node.gid.to_le_bytes());
            inode[32..40].copy_from_slice(&node.mtime.to_le_bytes());
            inode[40..44].copy_from_slice(&node.mtime_nsec.to_le_bytes());
            inode[44..48].copy_from_slice(&links[p.node].to_le_bytes());
            ino = ino.wrapping_add(1);
            self.out
                .write_all(&inode)
                .map_err(|e| ImageError::io("write", self.out_path, e))?;
            if xsize > 0 {
                let xattrs = xattr_bytes(&node.xattrs);
                self.out
                    .write_all(&xattrs)
                    .map_err(|e| ImageError::io("write", self.out_path, e))?;
            }
            self.out
                .write_all(&inline_bytes)
                .map_err(|e| ImageError::io("write", self.out_path, e))?;
            written += INODE_SIZE + xsize + inline_bytes.len() as u64;
        }
        write_zeros(&mut self.out, meta_blocks * BLOCK - written)
            .map_err(|e| ImageError::io("write", self.out_path, e))?;
        self.out
            .write_all(&extra)
            .map_err(|e| ImageError::io("write", self.out_path, e))?;

        // The superblock.
        let mut sb = [0u8; 128];
        sb[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        sb[12] = BLOCK_BITS;
        sb[14..16].copy_from_slice(&0u16.to_le_bytes()); // root nid
        sb[16..24].copy_from_slice(&(order.len() as u64).to_le_bytes());
        sb[36..40].copy_from_slice(&(total_blocks as u32).to_le_bytes());
        sb[40..44].copy_from_slice(&(meta_blkaddr as u32).to_le_bytes());
        let mut file = self
            .out
            .into_inner()
            .map_err(|e| ImageError::io("write", self.out_path, e.into_error()))?;
        file.seek(SeekFrom::Start(SUPER_OFFSET))
            .and_then(|_| file.write_all(&sb))
            .and_then(|_| file.set_len(total_blocks * BLOCK))
            .map_err(|e| ImageError::io("write", self.out_path, e))?;
        Ok(total_blocks * BLOCK)
    }
}

/// Reads until `buf` is full or the stream ends; the bytes read.
fn read_full(r: &mut dyn Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

fn write_zeros(w: &mut dyn Write, mut n: u64) -> io::Result<()> {
    const ZEROS: [u8; 4096] = [0; 4096];
    while n > 0 {
        let k = n.min(ZEROS.len() as u64) as usize;
        w.write_all(&ZEROS[..k])?;
        n -= k as u64;
    }
    Ok(())
}

fn pad_to_block(v: &mut Vec<u8>) {
    let len = align(v.len() as u64, BLOCK) as usize;
    v.resize(len, 0);
}

/// An archive xattr (`name` without `SCHILY.xattr.`) as stored, or None for names
/// overlayfs interprets and namespaces EROFS cannot hold.
fn to_xattr(name: &[u8], value: &[u8]) -> Option<Xattr> {
    if name.starts_with(b"trusted.overlay.") || name.starts_with(b"user.overlay.") {
        return None;
    }
    let (index, rest) = if let Some(r) = name.strip_prefix(b"user.") {
        (XATTR_USER, r)
    } else if let Some(r) = name.strip_prefix(b"trusted.") {
        (XATTR_TRUSTED, r)
    } else if let Some(r) = name.strip_prefix(b"security.") {
        (XATTR_SECURITY, r)
    } else if name == b"system.posix_acl_access" {
        (XATTR_ACL_ACCESS, &b""[..])
    } else if name == b"system.posix_acl_default" {
        (XATTR_ACL_DEFAULT, &b""[..])
    } else {
        tracing::debug!(name = %String::from_utf8_lossy(name), "xattr namespace not kept");
        return None;
    };
    if rest.len() > NAME_MAX || value.len() > usize::from(u16::MAX) {
        tracing::debug!(name = %String::from_utf8_lossy(name), "xattr too large, not kept");
        return None;
    }
    Some(Xattr {
        index,
        name: rest.to_vec(),
        value: value.to_vec(),
    })
}

/// The inline xattr area: a 12-byte header (no shared xattrs), then each entry padded to
/// 4 bytes.
fn xattr_bytes(xattrs: &[Xattr]) -> Vec<u8> {
    let mut v = vec![0u8; 12];
    for x in xattrs {
        v.push(x.name.len() as u8);
        v.push(x.index);
        v.extend_from_slice(&(x.value.len() as u16).to_le_bytes());
        v.extend_from_slice(&x.name);
        v.extend_from_slice(&x.value);
        pad_to(&mut v, 4);
    }
    v
}

fn pad_to(v: &mut Vec<u8>, to: u64) {
    let len = align(v.len() as u64, to) as usize;
    v.resize(len, 0);
}

/// What a directory entry points at.
#[derive(Clone, Copy)]
enum DirRef {
    Dot,
    DotDot,
    Child(usize),
}

/// A directory's entries sorted by name, "." and ".." included.
fn dir_names(children: &BTreeMap<Vec<u8>, usize>) -> Vec<(&[u8], DirRef)> {
    let mut names: Vec<(&[u8], DirRef)> = Vec::with_capacity(children.len() + 2);
    names.push((b".", DirRef::Dot));
    names.push((b"..", DirRef::DotDot));
    names.extend(
        children
            .iter()
            .map(|(k, &v)| (k.as_slice(), DirRef::Child(v))),
    );
    names.sort_by(|a, b| a.0.cmp(b.0));
    names
}

/// One directory block: entries `start..end` of the sorted names, `used` bytes of it.
struct DirBlock {
    start: usize,
    end: usize,
    used: usize,
}

/// Splits sorted entries into blocks: each holds as many as fit (12 bytes of dirent plus
/// the name each).
fn split_dir_blocks(names: &[(&[u8], DirRef)]) -> Vec<DirBlock> {
    let mut blocks = Vec::new();
    let (mut start, mut used) = (0, 0);
    for (i, (name, _)) in names.iter().enumerate() {
        let need = DIRENT_SIZE + name.len();
        if used + need > BLOCK as usize {
            blocks.push(DirBlock {
                start,
                end: i,
                used,
            });
            start = i;
            used = 0;
        }
        used += need;
    }
    blocks.push(DirBlock {
        start,
        end: names.len(),
        used,
    });
    blocks
}

/// A directory's data: full blocks, then the last block's used bytes only.
fn dir_bytes(names: &[(&[u8], DirRef)], nid: impl Fn(DirRef) -> u64, nodes: &[Node]) -> Vec<u8> {
    let blocks = split_dir_blocks(names);
    let mut out = Vec::with_capacity(blocks.len() * BLOCK as usize);
    let last = blocks.len() - 1;
    for (bi, b) in blocks.iter().enumerate() {
        let base = out.len();
        let entries = &names[b.start..b.end];
        let mut nameoff = DIRENT_SIZE * entries.len();
        for (name, r) in entries {
            let ft = match r {
                DirRef::Dot | DirRef::DotDot => 2,
                DirRef::Child(c) => file_type(&nodes[*c]),
            };
            out.extend_from_slice(&nid(*r).to_le_bytes());
            out.extend_from_slice(&(nameoff as u16).to_le_bytes());
            out.push(ft);
            out.push(0);
            nameoff += name.len();
        }
        for (name, _) in entries {
            out.extend_from_slice(name);
        }
        if bi != last {
            out.resize(base + BLOCK as usize, 0);
        }
    }
    out
}

/// The dirent file type of a node.
fn file_type(n: &Node) -> u8 {
    match n.mode & S_IFMT {
        S_IFREG => 1,
        S_IFDIR => 2,
        S_IFCHR => 3,
        S_IFIFO => 5,
        S_IFLNK => 7,
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directory_blocks_split_where_the_next_entry_would_not_fit() {
        let long = vec![b'x'; 200];
        let children: BTreeMap<Vec<u8>, usize> = (0..40)
            .map(|i| {
                let mut n = long.clone();
                n.extend_from_slice(format!("{i:03}").as_bytes());
                (n, 1)
            })
            .collect();
        let names = dir_names(&children);
        let blocks = split_dir_blocks(&names);
        // 215 bytes per entry: 19 fit in a 4 KiB block.
        assert_eq!(blocks.len(), 3);
        assert!(blocks.iter().all(|b| b.used <= BLOCK as usize));
        assert_eq!(blocks[0].start, 0);
        assert_eq!(blocks.last().map(|b| b.end), Some(42));
    }

    #[test]
    fn xattr_area_sizes_count_the_header_and_padding() {
        let x = |name: &[u8], value: &[u8]| to_xattr(name, value).expect("kept");
        let xs = vec![x(b"user.a", b"1"), x(b"security.capability", &[0u8; 20])];
        // 12 header + align4(4 + 1 + 1) + align4(4 + 10 + 20).
        assert_eq!(xattr_area_size(&xs), 12 + 8 + 36);
        assert_eq!(xattr_bytes(&xs).len() as u64, xattr_area_size(&xs));
        assert!(to_xattr(b"trusted.overlay.opaque", b"y").is_none());
        assert!(to_xattr(b"user.overlay.redirect", b"/x").is_none());
        assert!(to_xattr(b"system.nfs4_acl", b"").is_none());
        assert_eq!(
            to_xattr(b"system.posix_acl_access", b"a").map(|x| x.index),
            Some(2)
        );
    }

    use sha2::Digest as _;
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    use std::path::PathBuf;

    use crate::extract::{extract_from, Whiteouts};

    /// A tar entry for [`tar_with`]: path, kind, data (or link target), mode, uid, mtime,
    /// PAX records.
    type Spec<'a> = (
        &'a str,
        tar::EntryType,
        Vec<u8>,
        u32,
        u64,
        u64,
        Vec<(&'a str, Vec<u8>)>,
    );

    fn tar_with(specs: &[Spec<'_>]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (path, kind, data, mode, uid, mtime, pax) in specs {
            if !pax.is_empty() {
                b.append_pax_extensions(pax.iter().map(|(k, v)| (*k, v.as_slice())))
                    .unwrap_or_else(|e| panic!("{e}"));
            }
            let mut h = tar::Header::new_ustar();
            h.set_entry_type(*kind);
            h.set_mode(*mode);
            h.set_uid(*uid);
            h.set_gid(*uid + 1);
            h.set_mtime(*mtime);
            let is_link = kind.is_symlink() || kind.is_hard_link();
            if is_link {
                h.set_size(0);
                b.append_link(&mut h, path, std::str::from_utf8(data).unwrap_or(""))
                    .unwrap_or_else(|e| panic!("{path}: {e}"));
            } else {
                h.set_size(data.len() as u64);
                b.append_data(&mut h, path, &data[..])
                    .unwrap_or_else(|e| panic!("{path}: {e}"));
            }
        }
        b.into_inner().unwrap_or_else(|e| panic!("{e}"))
    }

    fn pattern(n: usize, seed: u8) -> Vec<u8> {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    /// Every kind of entry a layer has, at the sizes where the layout changes.
    fn every_kind() -> Vec<u8> {
        use tar::EntryType as E;
        let f =
            |p, data: Vec<u8>, mode, uid, mtime| (p, E::Regular, data, mode, uid, mtime, vec![]);
        let mut specs: Vec<Spec<'_>> = vec![
            ("./", E::Directory, vec![], 0o750, 0, 5, vec![]),
            ("etc/", E::Directory, vec![], 0o755, 0, 1000, vec![]),
            f(
                "etc/hosts",
                b"127.0.0.1 localhost\n".to_vec(),
                0o644,
                1000,
                1234,
            ),
            f("etc/motd", b"old\n".to_vec(), 0o644, 0, 1),
            f("big", pattern(3 * 4096 + 100, 1), 0o4755, 0, 99),
            f("exact", pattern(8192, 2), 0o600, 7, 98),
            f("empty", vec![], 0o644, 0, 97),
            f("almost", pattern(4095, 3), 0o644, 0, 96),
            (
                "caps",
                E::Regular,
                pattern(5000, 4),
                0o755,
                0,
                95,
                vec![
                    (
                        "SCHILY.xattr.security.capability",
                        vec![
                            1u8, 0, 0, 2, 0, 32, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                        ],
                    ),
                    ("SCHILY.xattr.user.note", b"hello".to_vec()),
                    ("SCHILY.xattr.trusted.overlay.opaque", b"y".to_vec()),
                ],
            ),
            (
                "fat-tail",
                E::Regular,
                pattern(4096 + 4000, 5),
                0o644,
                0,
                94,
                vec![("SCHILY.xattr.user.big", pattern(200, 6))],
            ),
            (
                "link",
                E::Symlink,
                b"etc/hosts".to_vec(),
                0o777,
                0,
                93,
                vec![],
            ),
            (
                "abs",
                E::Symlink,
                b"/etc/hosts".to_vec(),
                0o777,
                0,
                93,
                vec![],
            ),
            (
                "long-link",
                E::Symlink,
                b"d/".repeat(2045),
                0o777,
                0,
                92,
                vec![],
            ),
            ("hard", E::Link, b"etc/hosts".to_vec(), 0o644, 0, 91, vec![]),
            ("fifo", E::Fifo, vec![], 0o640, 3, 90, vec![]),
            ("dev/null", E::Char, vec![], 0o666, 0, 89, vec![]),
            f("deep/a/b/c.txt", b"deep\n".to_vec(), 0o644, 0, 88),
            ("etc/.wh.motd", E::Regular, vec![], 0o644, 0, 87, vec![]),
            ("gone/.wh.x", E::Regular, vec![], 0o644, 0, 86, vec![]),
            ("opq/.wh..wh..opq", E::Regular, vec![], 0o644, 0, 85, vec![]),
            f("opq/keep", b"k".to_vec(), 0o644, 0, 84),
            (
                "opq/.wh..wh.plnk/123",
                E::Regular,
                vec![],
                0o644,
                0,
                83,
                vec![],
            ),
            f("dup", b"one".to_vec(), 0o644, 0, 82),
            f("dup", b"two!".to_vec(), 0o600, 0, 81),
            f("late/x", b"x".to_vec(), 0o644, 0, 80),
            ("late/", E::Directory, vec![], 0o700, 0, 77, vec![]),
            f("replaced/inner", b"i".to_vec(), 0o644, 0, 76),
            f("replaced", b"now a file".to_vec(), 0o644, 0, 75),
        ];
        let names: Vec<String> = (0..600)
            .map(|i| format!("many/{}-{i:04}", "n".repeat(40 + i % 50)))
            .collect();
        for (i, n) in names.iter().enumerate() {
            specs.push(f(n, pattern(i % 9, i as u8), 0o644, 0, 70));
        }
        tar_with(&specs)
    }

    /// Mounted EROFS image, unmounted on drop.
    struct Mounted(PathBuf);

    impl Drop for Mounted {
        fn drop(&mut self) {
            let _ = nix::mount::umount2(&self.0, nix::mount::MntFlags::MNT_DETACH);
        }
    }

    fn pack(ar: &[u8], out: &Path) -> Result<bool, ImageError> {
        let mut w = TarErofs::create(out, Path::new("layer.tar"))?;
        let mut r: &[u8] = ar;
        let had_root = w.add_tar(&mut r)?;
        w.finish()?;
        Ok(had_root)
    }

    fn mount(img: &Path, at: &Path) -> Mounted {
        std::fs::create_dir_all(at).unwrap_or_else(|e| panic!("{e}"));
        nix::mount::mount(
            Some(img),
            at,
            Some("erofs"),
            nix::mount::MsFlags::MS_RDONLY,
            None::<&str>,
        )
        .unwrap_or_else(|e| panic!("mount {}: {e}", img.display()));
        Mounted(at.to_path_buf())
    }

    fn getxattr(p: &Path, name: &str) -> Option<Vec<u8>> {
        let c = std::ffi::CString::new(p.as_os_str().as_bytes()).ok()?;
        let n = std::ffi::CString::new(name).ok()?;
        let mut buf = vec![0u8; 65536];
        // SAFETY: NUL-terminated strings and a buffer of the given length, alive for the call.
        let rc =
            unsafe { libc::lgetxattr(c.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        (rc >= 0).then(|| buf[..rc as usize].to_vec())
    }

    fn xattrs(p: &Path) -> Vec<(String, Vec<u8>)> {
        let c = std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap_or_default();
        let mut buf = vec![0u8; 65536];
        // SAFETY: a NUL-terminated string and a buffer of the given length.
        let rc = unsafe { libc::llistxattr(c.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        assert!(rc >= 0, "llistxattr {}", p.display());
        let mut out: Vec<(String, Vec<u8>)> = buf[..rc as usize]
            .split(|b| *b == 0)
            .filter(|n| !n.is_empty())
            .map(|n| {
                let name = String::from_utf8_lossy(n).into_owned();
                let v = getxattr(p, &name).unwrap_or_default();
                (name, v)
            })
            .collect();
        out.sort();
        out
    }

    /// Everything about the tree under `root` a sandbox can observe, one line per path.
    fn describe(root: &Path) -> Vec<String> {
        let mut out = Vec::new();
        let mut stack = vec![PathBuf::new()];
        while let Some(rel) = stack.pop() {
            let p = root.join(&rel);
            let md = std::fs::symlink_metadata(&p).unwrap_or_else(|e| panic!("{e}"));
            let ft = md.file_type();
            let mut line = format!(
                "{} mode={:o} uid={} gid={} mtime={}",
                rel.display(),
                md.mode(),
                md.uid(),
                md.gid(),
                md.mtime()
            );
            if ft.is_file() {
                let data = std::fs::read(&p).unwrap_or_else(|e| panic!("{e}"));
                let sum = sha2::Sha256::digest(&data);
                line += &format!(" size={} nlink={} sha={sum:x}", md.len(), md.nlink());
            } else if ft.is_symlink() {
                let t = std::fs::read_link(&p).unwrap_or_else(|e| panic!("{e}"));
                line += &format!(" -> {}", t.display());
            } else if ft.is_char_device() {
                line += &format!(" rdev={}", md.rdev());
            } else if ft.is_dir() {
                line += &format!(" nlink={}", md.nlink());
                let mut names: Vec<_> = std::fs::read_dir(&p)
                    .unwrap_or_else(|e| panic!("{e}"))
                    .map(|e| e.unwrap_or_else(|e| panic!("{e}")).file_name())
                    .collect();
                names.sort();
                stack.extend(names.into_iter().rev().map(|n| rel.join(n)));
            }
            if !ft.is_symlink() {
                for (k, v) in xattrs(&p) {
                    line += &format!(" {k}={v:?}");
                }
            }
            out.push(line);
        }
        out
    }

    fn need_root() -> bool {
        if nix::unistd::geteuid().is_root() {
            return true;
        }
        assert!(
            std::env::var_os("CI").is_none(),
            "mounting EROFS needs root, and CI runs as root"
        );
        eprintln!("skipped: mounting EROFS needs root");
        false
    }

    /// The oracle: the same layer extracted in overlay form by [`extract_from`] (the path
    /// `mkfs.erofs` packed before). The mounted image must match it path for path.
    #[test]
    fn a_packed_layer_mounts_as_the_extracted_layer() {
        if !need_root() {
            return;
        }
        let w = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let ar = every_kind();
        let img = w.path().join("layer.erofs");
        assert!(pack(&ar, &img).unwrap_or_else(|e| panic!("{e}")));
        let tree = w.path().join("tree");
        std::fs::create_dir(&tree).unwrap_or_else(|e| panic!("{e}"));
        extract_from(&ar[..], Path::new("layer.tar"), &tree, Whiteouts::Overlay)
            .unwrap_or_else(|e| panic!("{e}"));
        let mnt = mount(&img, &w.path().join("mnt"));
        let (want, got) = (describe(&tree), describe(&mnt.0));
        for (a, b) in want.iter().zip(&got) {
            assert_eq!(a, b);
        }
        assert_eq!(want.len(), got.len(), "{want:#?}\n{got:#?}");
        // Spot checks that the oracle itself has what the cases are about.
        let m = &mnt.0;
        let md = std::fs::symlink_metadata(m.join("etc/motd")).unwrap_or_else(|e| panic!("{e}"));
        assert!(
            md.file_type().is_char_device() && md.rdev() == 0,
            "whiteout"
        );
        assert_eq!(
            getxattr(&m.join("opq"), "trusted.overlay.opaque"),
            Some(b"y".to_vec())
        );
        assert_eq!(std::fs::read(m.join("dup")).ok(), Some(b"two!".to_vec()));
        assert_eq!(
            std::fs::metadata(m.join("hard")).map(|m| m.nlink()).ok(),
            Some(2)
        );
        assert!(!m.join("dev/null").exists());
        assert_eq!(
            std::fs::read_dir(m.join("many")).map(|d| d.count()).ok(),
            Some(600)
        );

        // Reproducible: the same stream packs to the same bytes.
        let again = w.path().join("again.erofs");
        pack(&ar, &again).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(std::fs::read(&img).ok(), std::fs::read(&again).ok());
    }

    /// A real rootfs (the Debian base, ~10,000 entries) packs like its extraction.
    #[test]
    fn the_base_rootfs_packs_like_its_extraction() {
        if !need_root() {
            return;
        }
        let Some(base) = std::env::var_os("DSEC_BASE_TAR") else {
            assert!(std::env::var_os("CI").is_none(), "CI sets DSEC_BASE_TAR");
            eprintln!("skipped: DSEC_BASE_TAR (the base rootfs tar) is not set");
            return;
        };
        let ar = std::fs::read(&base).unwrap_or_else(|e| panic!("{e}"));
        let w = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let img = w.path().join("base.erofs");
        let t = std::time::Instant::now();
        pack(&ar, &img).unwrap_or_else(|e| panic!("{e}"));
        let size = std::fs::metadata(&img).map(|m| m.len()).unwrap_or(0);
        eprintln!(
            "packed {} bytes of tar into {size} bytes of EROFS in {:?}",
            ar.len(),
            t.elapsed()
        );
        let tree = w.path().join("tree");
        std::fs::create_dir(&tree).unwrap_or_else(|e| panic!("{e}"));
        extract_from(&ar[..], Path::new("base.tar"), &tree, Whiteouts::Overlay)
            .unwrap_or_else(|e| panic!("{e}"));
        let mnt = mount(&img, &w.path().join("mnt"));
        let (want, got) = (describe(&tree), describe(&mnt.0));
        assert!(want.len() > 1000, "{} paths", want.len());
        for (a, b) in want.iter().zip(&got) {
            assert_eq!(a, b);
        }
        assert_eq!(want.len(), got.len());
    }

    /// Without a `./` entry the root is 0755 root:root with mtime 0, like an implicit
    /// directory.
    #[test]
    fn a_layer_without_a_root_entry_gets_a_plain_root() {
        if !need_root() {
            return;
        }
        let w = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let ar = tar_with(&[(
            "f",
            tar::EntryType::Regular,
            b"x".to_vec(),
            0o644,
            0,
            1,
            vec![],
        )]);
        let img = w.path().join("l.erofs");
        assert!(!pack(&ar, &img).unwrap_or_else(|e| panic!("{e}")));
        let mnt = mount(&img, &w.path().join("mnt"));
        let md = std::fs::metadata(&mnt.0).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((md.mode() & 0o7777, md.uid(), md.mtime()), (0o755, 0, 0));
    }

    /// A cheap, deterministic fuzz in the unit tests (`fuzz/` has the libFuzzer target):
    /// thousands of mangled copies of a layer with every entry kind (bytes flipped,
    /// header checksums fixed so the damage reaches the writer, streams cut) either pack
    /// or fail; none panics, and (as root) a sample of those that packed mounts and reads
    /// back without an error.
    #[test]
    fn mangled_streams_never_panic() {
        let w = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let base = every_kind();
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let (mut packed, mut failed, mut mounted) = (0, 0, 0);
        let mount_ok = nix::unistd::geteuid().is_root();
        for i in 0..1500 {
            let mut ar = base.clone();
            for _ in 0..(1 + next() % 8) {
                // Mostly headers: the first block of an entry is where parsing happens.
                let at = if next() % 4 == 0 {
                    (next() as usize) % ar.len()
                } else {
                    let blocks = ar.len() / 512;
                    (next() as usize % blocks) * 512 + (next() as usize % 512)
                };
                ar[at] = next() as u8;
            }
            // Fix up every header-looking block's checksum so the damage is parsed.
            for b in (0..ar.len() / 512).map(|k| k * 512) {
                if &ar[b + 257..b + 262] == b"ustar" {
                    let mut h = tar::Header::new_old();
                    h.as_mut_bytes().copy_from_slice(&ar[b..b + 512]);
                    h.set_cksum();
                    ar[b..b + 512].copy_from_slice(h.as_bytes());
                }
            }
            if next() % 5 == 0 {
                let keep = (next() as usize) % ar.len();
                ar.truncate(keep);
            }
            let out = w.path().join(format!("m{i}.erofs"));
            match pack(&ar, &out) {
                Ok(_) => {
                    packed += 1;
                    // Every 10th image that packed must mount and read back whole.
                    if packed % 10 == 0 && mount_ok {
                        let mnt = mount(&out, &w.path().join("mnt"));
                        let paths = describe(&mnt.0);
                        assert!(!paths.is_empty());
                        mounted += 1;
                    }
                }
                Err(_) => failed += 1,
            }
            let _ = std::fs::remove_file(&out);
        }
        assert!(packed > 0 && failed > 0, "packed {packed}, failed {failed}");
        assert!(!mount_ok || mounted > 0, "none mounted");
    }

    #[test]
    fn bad_streams_are_errors() {
        let w = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let ar = tar_with(&[(
            "f",
            tar::EntryType::Regular,
            pattern(10_000, 1),
            0o644,
            0,
            1,
            vec![],
        )]);
        let cut = &ar[..512 + 6000];
        let err = pack(cut, &w.path().join("cut.erofs")).expect_err("truncated");
        assert!(err.to_string().contains("f"), "{err}");

        use tar::EntryType as E;
        let cases: Vec<(Vec<Spec<'_>>, &str)> = vec![
            (
                vec![
                    ("s", E::Symlink, b"d".to_vec(), 0o777, 0, 1, vec![]),
                    ("s/f", E::Regular, vec![], 0o644, 0, 1, vec![]),
                ],
                "symlink",
            ),
            (
                vec![("h", E::Link, b"nowhere".to_vec(), 0o644, 0, 1, vec![])],
                "hard link target",
            ),
            (
                vec![
                    ("d/", E::Directory, vec![], 0o755, 0, 1, vec![]),
                    ("h", E::Link, b"d".to_vec(), 0o644, 0, 1, vec![]),
                ],
                "hard link target",
            ),
            (
                vec![
                    ("f", E::Regular, vec![], 0o644, 0, 1, vec![]),
                    ("f/g", E::Regular, vec![], 0o644, 0, 1, vec![]),
                ],
                "not a directory",
            ),
        ];
        for (i, (specs, want)) in cases.iter().enumerate() {
            let err = pack(&tar_with(specs), &w.path().join(format!("{i}.erofs"))).expect_err(want);
            assert!(err.to_string().contains(want), "case {i}: {err}");
        }
        // `..` cannot be written with tar::Builder's path checks: patch the header.
        let mut ar = tar_with(&[("xx/f", E::Regular, vec![], 0o644, 0, 1, vec![])]);
        ar[..2].copy_from_slice(b"..");
        let mut h = tar::Header::new_old();
        h.as_mut_bytes().copy_from_slice(&ar[..512]);
        h.set_cksum();
        ar[..512].copy_from_slice(h.as_bytes());
        let err = pack(&ar, &w.path().join("dotdot.erofs")).expect_err("..");
        assert!(matches!(err, ImageError::UnsafeEntry { .. }), "{err}");
    }
}
