//! Parsing of `/proc/self/mountinfo` (see `proc(5)`), enough to tell whether and how a path
//! is mounted.

use std::io;
use std::path::{Path, PathBuf};

/// One line of `/proc/self/mountinfo`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEntry {
    /// Unique mount id (field 1).
    pub mount_id: u64,
    /// Mount id of the parent (field 2).
    pub parent_id: u64,
    /// Root of the mount within its filesystem (field 4), unescaped.
    pub root: PathBuf,
    /// Mount point relative to the process root (field 5), unescaped.
    pub mount_point: PathBuf,
    /// Per-mount options (field 6), e.g. `ro,nosuid,nodev,relatime`.
    pub mount_options: String,
    /// Filesystem type (after the ` - ` separator).
    pub fs_type: String,
    /// Mount source (a device, or for a file-backed EROFS mount the image file), unescaped.
    pub source: String,
    /// Per-superblock options.
    pub super_options: String,
}

/// Undo the octal escapes the kernel applies to mountinfo fields (`\040` space, `\011` tab,
/// `\012` newline, `\134` backslash). Invalid escapes are kept literally.
pub fn unescape(field: &str) -> String {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 4 <= b.len() {
            let oct = &b[i + 1..i + 4];
            if oct.iter().all(|c| (b'0'..=b'7').contains(c)) {
                let v = u32::from(oct[0] - b'0') * 64
                    + u32::from(oct[1] - b'0') * 8
                    + u32::from(oct[2] - b'0');
                if let Ok(byte) = u8::try_from(v) {
                    out.push(byte);
                    i += 4;
                    continue;
                }
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Parse one mountinfo line; `None` if it is malformed.
pub fn parse_line(line: &str) -> Option<MountEntry> {
    let (left, right) = line.split_once(" - ")?;
    let mut l = left.split(' ');
    let mount_id = l.next()?.parse().ok()?;
    let parent_id = l.next()?.parse().ok()?;
    let _dev = l.next()?;
    let root = PathBuf::from(unescape(l.next()?));
    let mount_point = PathBuf::from(unescape(l.next()?));
    let mount_options = l.next()?.to_string();
    let mut r = right.split(' ');
    let fs_type = r.next()?.to_string();
    let source = unescape(r.next()?);
    let super_options = r.next().unwrap_or("").to_string();
    Some(MountEntry {
        mount_id,
        parent_id,
        root,
        mount_point,
        mount_options,
        fs_type,
        source,
        super_options,
    })
}

/// Parse a whole mountinfo text, skipping malformed lines.
pub fn parse(text: &str) -> Vec<MountEntry> {
    text.lines().filter_map(parse_line).collect()
}

/// Read and parse `/proc/self/mountinfo`.
pub fn read() -> io::Result<Vec<MountEntry>> {
    Ok(parse(&std::fs::read_to_string("/proc/self/mountinfo")?))
}

/// The topmost mount whose mount point is `path` (canonicalised first), if any.
/// A path that does not exist is not mounted.
pub fn find(path: &Path) -> io::Result<Option<MountEntry>> {
    let canon = match std::fs::canonicalize(path) {
        Ok(p) => p,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    // Later lines are mounted on top of earlier ones.
    Ok(read()?.into_iter().rev().find(|m| m.mount_point == canon))
}

/// Whether something is mounted exactly at `path`.
pub fn is_mounted(path: &Path) -> io::Result<bool> {
    Ok(find(path)?.is_some())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unescapes() {
        assert_eq!(unescape(r"/a\040b"), "/a b");
        assert_eq!(unescape(r"/a\011b\012c\134d"), "/a\tb\nc\\d");
        assert_eq!(unescape(r"/plain"), "/plain");
        assert_eq!(unescape(r"/bad\09"), r"/bad\09");
        assert_eq!(unescape(r"/end\04"), r"/end\04");
        assert_eq!(unescape("\\"), "\\");
    }

    #[test]
    fn parses_lines() {
        let text = "\
22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
95 22 0:52 / /var/lib/dsec/mnt/ab\\040c ro,nosuid,nodev,relatime - erofs /var/lib/dsec/blobs/sha256/ab\\040c.erofs ro,user_xattr
96 22 7:0 / /mnt/x ro,relatime master:3 - erofs /dev/loop0 ro
garbage line
";
        let v = parse(text);
        assert_eq!(v.len(), 3);
        assert_eq!(v[0].mount_point, PathBuf::from("/"));
        assert_eq!(v[0].fs_type, "ext4");
        assert_eq!(v[1].mount_id, 95);
        assert_eq!(v[1].parent_id, 22);
        assert_eq!(v[1].mount_point, PathBuf::from("/var/lib/dsec/mnt/ab c"));
        assert_eq!(v[1].source, "/var/lib/dsec/blobs/sha256/ab c.erofs");
        assert_eq!(v[1].mount_options, "ro,nosuid,nodev,relatime");
        assert_eq!(v[1].super_options, "ro,user_xattr");
        assert_eq!(v[2].source, "/dev/loop0");
    }

    #[test]
    fn root_is_mounted() {
        assert!(is_mounted(Path::new("/")).unwrap_or(false));
        assert!(!is_mounted(Path::new("/definitely/not/here")).unwrap_or(true));
    }
}
