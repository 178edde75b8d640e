//! ADD's local archives: detecting a tar (plain, gzip or zstd) by content, as Docker
//! does, and extracting it into the destination through the copy's [`Writer`].
//!
//! Detection decompresses the first block and checks it is a tar header, so a gzipped
//! file that is not a tar is copied as it is (Docker's behavior). bzip2 and xz archives
//! are recognized and refused as not supported: extracting them would need C libraries
//! this crate does not link.
//!
//! Extraction reads the archive once, streaming; entry names are checked like the
//! context's (`..` refused, leading `/` dropped), and the decompressed stream is capped
//! at [`Limits::max_extracted_bytes`](crate::Limits) and at [`MAX_EXPANSION_RATIO`]
//! times the compressed size, so a decompression bomb ends in an error.

use std::collections::HashSet;
use std::io::{self, BufReader, Read};

use crate::context::{is_pax_sparse, Context, Meta};
use crate::copy::Writer;
use crate::name::{entry_name, join, link_target, path_of};
use crate::ContextError;

/// Most a compressed archive may expand to, relative to its size: real tarballs stay far
/// below (text ~5-10x); decompression bombs reach 1000x and more. Same cutoff as
/// dsec-image's layer extraction.
pub const MAX_EXPANSION_RATIO: u64 = 100;
/// Small compressed archives may always expand to this much (if the limits allow).
pub const MIN_EXPANSION_LIMIT: u64 = 256 << 20;

/// How an ADD source is stored, when it is a tar archive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Format {
    Tar,
    Gzip,
    Zstd,
}

/// How many decompressed bytes an archive of `size` bytes may yield.
pub(crate) fn extraction_limit(format: Format, size: u64, max_extracted_bytes: u64) -> u64 {
    match format {
        Format::Tar => max_extracted_bytes,
        Format::Gzip | Format::Zstd => size
            .saturating_mul(MAX_EXPANSION_RATIO)
            .max(MIN_EXPANSION_LIMIT)
            .min(max_extracted_bytes),
    }
}

const TAR_BLOCK: usize = 512;

/// Whether the file at `offset` (`size` bytes) of the context is a tar archive, and how
/// it is compressed. bzip2 and xz data is an `Unsupported` error.
pub(crate) fn sniff(
    ctx: &Context,
    key: &str,
    offset: u64,
    size: u64,
) -> Result<Option<Format>, ContextError> {
    let mut head = Vec::with_capacity(TAR_BLOCK);
    ctx.section(offset, size)
        .take(TAR_BLOCK as u64)
        .read_to_end(&mut head)
        .map_err(|e| ContextError::io("reading the build context", e))?;
    let unsupported = |what: &str| ContextError::Unsupported {
        archive: format!("ADD source {:?}", path_of(key)),
        what: format!("extracting a {what}-compressed archive"),
    };
    if head.starts_with(&[0x1f, 0x8b]) {
        let dec = flate2::read::MultiGzDecoder::new(ctx.section(offset, size));
        return Ok(starts_with_tar_header(dec).then_some(Format::Gzip));
    }
    if head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        let Ok(dec) = zstd::stream::read::Decoder::new(ctx.section(offset, size)) else {
            return Ok(None);
        };
        return Ok(starts_with_tar_header(dec).then_some(Format::Zstd));
    }
    if head.starts_with(&[0xfd, b'7', b'z', b'X', b'Z', 0]) {
        return Err(unsupported("xz"));
    }
    // "BZh", a block size digit, then the magic of a block or of the end of the stream.
    if head.len() >= 10
        && head.starts_with(b"BZh")
        && (b'1'..=b'9').contains(&head[3])
        && (head[4..10] == [0x31, 0x41, 0x59, 0x26, 0x53, 0x59]
            || head[4..10] == [0x17, 0x72, 0x45, 0x38, 0x50, 0x90])
    {
        return Err(unsupported("bzip2"));
    }
    Ok(is_tar_header(&head).then_some(Format::Tar))
}

/// Whether the stream's first block is a tar header; read or decompression errors mean
/// it is not.
fn starts_with_tar_header(mut r: impl Read) -> bool {
    let mut block = [0u8; TAR_BLOCK];
    r.read_exact(&mut block).is_ok() && is_tar_header(&block)
}

/// Whether `block` is a tar header: not all zeros (an empty archive is no archive to
/// Docker either), and its checksum (unsigned or signed sum, as Go accepts) is right.
fn is_tar_header(block: &[u8]) -> bool {
    if block.len() < TAR_BLOCK || block.iter().all(|b| *b == 0) {
        return false;
    }
    let Some(stored) = parse_octal(&block[148..156]) else {
        return false;
    };
    let (mut unsigned, mut signed) = (0i64, 0i64);
    for (i, b) in block[..TAR_BLOCK].iter().enumerate() {
        let b = if (148..156).contains(&i) { b' ' } else { *b };
        unsigned += i64::from(b);
        signed += i64::from(b as i8);
    }
    stored == unsigned || stored == signed
}

/// A tar numeric field: optional leading spaces, octal digits, then NUL or spaces.
fn parse_octal(field: &[u8]) -> Option<i64> {
    let s = field.iter().skip_while(|b| **b == b' ');
    let mut value: i64 = 0;
    let mut digits = 0;
    let mut ended = false;
    for &b in s {
        match b {
            b'0'..=b'7' if !ended => {
                value = value.checked_mul(8)? + i64::from(b - b'0');
                digits += 1;
            }
            b' ' | 0 => ended = true,
            _ => return None,
        }
    }
    (digits > 0).then_some(value)
}

/// The error a [`Limited`] stream returns past its limit, found again by downcasting.
#[derive(Debug)]
struct LimitExceeded;

impl std::fmt::Display for LimitExceeded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("extraction limit exceeded")
    }
}

impl std::error::Error for LimitExceeded {}

/// A decompressed stream with a size limit: reading past it fails with
/// [`LimitExceeded`].
struct Limited<R> {
    inner: R,
    left: u64,
}

impl<R: Read> Read for Limited<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        if n as u64 > self.left {
            return Err(io::Error::new(io::ErrorKind::InvalidData, LimitExceeded));
        }
        self.left -= n as u64;
        Ok(n)
    }
}

/// The error for an I/O error met reading an ADD archive.
fn archive_error(label: &str, format: Format, limit: u64, e: io::Error) -> ContextError {
    if e.get_ref().is_some_and(|inner| inner.is::<LimitExceeded>()) {
        let what = match format {
            Format::Tar => "the archive is larger than the extraction limit".to_string(),
            Format::Gzip | Format::Zstd => format!(
                "the archive decompresses to more than {limit} bytes: refusing a likely \
                 decompression bomb (at most {MAX_EXPANSION_RATIO}x its size, at least \
                 {} MiB, and the extraction limit)",
                MIN_EXPANSION_LIMIT >> 20
            ),
        };
        return ContextError::Limit {
            archive: label.to_string(),
            what,
            limit,
        };
    }
    ContextError::BadArchive {
        archive: label.to_string(),
        reason: e.to_string(),
    }
}

/// Extracts the archive at `offset` (`size` bytes, of `format`) of the context into the
/// directory `dest` (relative, `""` for the root). The archive's own root entry is not
/// applied to `dest` (an existing directory keeps its mode); hard links must point at
/// earlier files of the archive and stay hard links; devices and FIFOs are left out.
pub(crate) fn extract(
    ctx: &Context,
    key: &str,
    format: Format,
    (offset, size): (u64, u64),
    dest: &str,
    w: &mut Writer<'_>,
) -> Result<(), ContextError> {
    let label = format!("ADD archive {:?}", path_of(key));
    let limits = ctx.limits;
    let limit = extraction_limit(format, size, limits.max_extracted_bytes);
    let err = |e: io::Error| archive_error(&label, format, limit, e);
    let raw = BufReader::with_capacity(64 << 10, ctx.section(offset, size));
    let stream: Box<dyn Read + '_> = match format {
        Format::Tar => Box::new(raw),
        Format::Gzip => Box::new(flate2::read::MultiGzDecoder::new(raw)),
        Format::Zstd => Box::new(zstd::stream::read::Decoder::with_buffer(raw).map_err(err)?),
    };
    let mut ar = tar::Archive::new(Limited {
        inner: stream,
        left: limit,
    });
    // Files and symlinks extracted so far: the targets hard links may name.
    let mut linkable: HashSet<String> = HashSet::new();
    let mut count = 0usize;
    for entry in ar.entries().map_err(err)? {
        let mut entry = entry.map_err(err)?;
        count += 1;
        if count > limits.max_entries {
            return Err(ContextError::Limit {
                archive: label,
                what: "too many entries".into(),
                limit: limits.max_entries as u64,
            });
        }
        let ty = entry.header().entry_type();
        if ty == tar::EntryType::XGlobalHeader {
            continue;
        }
        let raw = entry.path_bytes().into_owned();
        let shown = String::from_utf8_lossy(&raw).into_owned();
        if ty == tar::EntryType::GNUSparse || is_pax_sparse(&mut entry).map_err(err)? {
            return Err(ContextError::Unsupported {
                archive: label,
                what: format!("sparse file {shown:?}"),
            });
        }
        let name = entry_name(&raw, &label, limits.max_path_len)?;
        let header = entry.header();
        let meta = Meta {
            mode: header.mode().map_err(err)? & 0o7777,
            mtime: header.mtime().map_err(err)?,
        };
        let target = join(dest, &name);
        let is_dir = ty == tar::EntryType::Directory
            || (ty == tar::EntryType::Regular && raw.ends_with(b"/"));
        if name.is_empty() {
            if is_dir {
                continue;
            }
            return Err(ContextError::UnsafeEntry {
                archive: label,
                name: shown,
                reason: "the archive's root must be a directory".into(),
            });
        }
        match ty {
            _ if is_dir => {
                w.dir(&target, meta)?;
                linkable.remove(&name);
            }
            tar::EntryType::Regular | tar::EntryType::Continuous => {
                let size = entry.size();
                w.file(&target, meta, size, &mut entry, err)?;
                linkable.insert(name);
            }
            tar::EntryType::Symlink => {
                let link = entry.link_name_bytes().unwrap_or_default();
                let link = link_target(&link, &shown, &label, limits.max_path_len)?;
                w.symlink(&target, meta, &link)?;
                linkable.insert(name);
            }
            tar::EntryType::Link => {
                let link = entry.link_name_bytes().unwrap_or_default();
                let link = entry_name(&link, &label, limits.max_path_len)?;
                if !linkable.contains(&link) {
                    return Err(ContextError::UnsafeEntry {
                        archive: label,
                        name: shown,
                        reason: format!(
                            "hard link to {link:?}, which is not an earlier file of the archive"
                        ),
                    });
                }
                w.hardlink(&target, meta, &join(dest, &link))?;
                linkable.insert(name);
            }
            // Devices, FIFOs...: left out.
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_of_compressed_archives() {
        let max = 20 << 30;
        // Small archives: the floor.
        assert_eq!(
            extraction_limit(Format::Gzip, 1 << 20, max),
            MIN_EXPANSION_LIMIT
        );
        // Large ones: 100x.
        assert_eq!(extraction_limit(Format::Zstd, 10 << 20, max), 1000 << 20);
        // Never past the configured limit.
        assert_eq!(extraction_limit(Format::Gzip, 1 << 30, max), max);
        assert_eq!(extraction_limit(Format::Gzip, 1 << 20, 1000), 1000);
        // Plain tars cannot be bombs: only the configured limit.
        assert_eq!(extraction_limit(Format::Tar, 1, max), max);
    }

    #[test]
    fn tar_headers() {
        let mut h = tar::Header::new_ustar();
        h.set_path("a").expect("path");
        h.set_size(3);
        h.set_cksum();
        assert!(is_tar_header(h.as_bytes()));
        let mut bad = *h.as_bytes();
        bad[0] = b'b';
        assert!(!is_tar_header(&bad));
        assert!(!is_tar_header(&[0u8; 512]));
        assert!(!is_tar_header(b"short"));
        assert!(!is_tar_header(&[b'x'; 512]));
        assert_eq!(parse_octal(b"  0123 \0"), Some(0o123));
        assert_eq!(parse_octal(b"0001750\0"), Some(0o1750));
        assert_eq!(parse_octal(b"        "), None);
        assert_eq!(parse_octal(b"12 3"), None);
    }
}
