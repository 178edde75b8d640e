//! Path names: archive entry names checked and normalized, step paths cleaned, and the
//! index keys.
//!
//! An index key is a normalized path with `\0` in place of `/` (names never hold a NUL):
//! sorted that way, a directory's descendants come right after it and before its next
//! sibling (`a`, `a\0x`, `a-b`), so a subtree is one range of the index and the
//! whole index is a depth-first walk with children in name order.

use crate::ContextError;

/// Separator of path components in index keys.
pub(crate) const SEP: char = '\0';
/// The first character after [`SEP`]: `key + END` is past all of `key`'s descendants.
pub(crate) const END: char = '\u{1}';

/// Checks and normalizes an entry name read from an archive: leading `./` and `/`
/// dropped, `.` components and empty ones (`a//b`) dropped; `..`, NUL and non-UTF-8
/// names refused. Returns the `/`-joined components; `""` is the archive's root.
pub(crate) fn entry_name(
    raw: &[u8],
    archive: &str,
    max_len: usize,
) -> Result<String, ContextError> {
    let shown = || String::from_utf8_lossy(raw).into_owned();
    let unsafe_entry = |reason: &str| ContextError::UnsafeEntry {
        archive: archive.to_string(),
        name: shown(),
        reason: reason.to_string(),
    };
    if raw.len() > max_len {
        return Err(ContextError::Limit {
            archive: archive.to_string(),
            what: format!(
                "entry name of {} bytes is too long ({:?}...)",
                raw.len(),
                String::from_utf8_lossy(&raw[..raw.len().min(64)])
            ),
            limit: max_len as u64,
        });
    }
    if raw.contains(&0) {
        return Err(unsafe_entry("the name contains a NUL byte"));
    }
    let name = std::str::from_utf8(raw).map_err(|_| unsafe_entry("the name is not UTF-8"))?;
    let mut out: Vec<&str> = Vec::new();
    for comp in name.split('/') {
        match comp {
            "" | "." => {}
            ".." => return Err(unsafe_entry("the name has a \"..\" component")),
            c => out.push(c),
        }
    }
    Ok(out.join("/"))
}

/// A link target or other text that goes into an entry verbatim: UTF-8, no NUL, not
/// longer than `max_len`.
pub(crate) fn link_target(
    raw: &[u8],
    entry: &str,
    archive: &str,
    max_len: usize,
) -> Result<String, ContextError> {
    let unsafe_entry = |reason: String| ContextError::UnsafeEntry {
        archive: archive.to_string(),
        name: entry.to_string(),
        reason,
    };
    if raw.len() > max_len {
        return Err(ContextError::Limit {
            archive: archive.to_string(),
            what: format!("link target of {entry:?} is {} bytes long", raw.len()),
            limit: max_len as u64,
        });
    }
    if raw.contains(&0) {
        return Err(unsafe_entry("the link target contains a NUL byte".into()));
    }
    match std::str::from_utf8(raw) {
        Ok(s) if !s.is_empty() => Ok(s.to_string()),
        Ok(_) => Err(unsafe_entry("empty link target".into())),
        Err(_) => Err(unsafe_entry("the link target is not UTF-8".into())),
    }
}

/// Components of `path` cleaned as Go's `path.Clean("/" + path)` does: rooted at the
/// context (or the image) root, `.` and empty components dropped, `..` resolved and
/// never above the root. `[]` is the root.
pub(crate) fn clean_rooted(path: &str) -> Vec<&str> {
    let mut out: Vec<&str> = Vec::new();
    for comp in path.split('/') {
        match comp {
            "" | "." => {}
            ".." => {
                out.pop();
            }
            c => out.push(c),
        }
    }
    out
}

/// The index key of a normalized `/`-separated path.
pub(crate) fn key(path: &str) -> String {
    path.replace('/', "\0")
}

/// The `/`-separated path of an index key.
pub(crate) fn path_of(key: &str) -> String {
    key.replace(SEP, "/")
}

/// `base/rel` for `/`-separated relative paths, either of which may be the root `""`.
pub(crate) fn join(base: &str, rel: &str) -> String {
    match (base.is_empty(), rel.is_empty()) {
        (true, _) => rel.to_string(),
        (_, true) => base.to_string(),
        _ => format!("{base}/{rel}"),
    }
}

/// The last component of an index key or path.
pub(crate) fn base_name(key: &str) -> &str {
    key.rsplit([SEP, '/']).next().unwrap_or(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(raw: &str) -> Result<String, String> {
        entry_name(raw.as_bytes(), "t", 4096).map_err(|e| e.to_string())
    }

    #[test]
    fn entry_names() {
        let ok = [
            ("a", "a"),
            ("./a/b", "a/b"),
            ("/a/b/", "a/b"),
            ("//a//./b", "a/b"),
            ("./", ""),
            (".", ""),
            ("a/.", "a"),
            ("..a/b..", "..a/b.."),
        ];
        for (raw, want) in ok {
            assert_eq!(name(raw).as_deref(), Ok(want), "{raw:?}");
        }
        for bad in ["..", "../x", "a/../b", "a/..", "/.."] {
            let e = name(bad).expect_err(bad);
            assert!(e.contains("\"..\""), "{bad}: {e}");
        }
        assert!(entry_name(b"a\0b", "t", 10).is_err());
        assert!(entry_name(b"\xff", "t", 10).is_err());
        assert!(matches!(
            entry_name(b"abcdef", "t", 5),
            Err(ContextError::Limit { limit: 5, .. })
        ));
    }

    #[test]
    fn cleaning() {
        let cases: [(&str, &[&str]); 8] = [
            ("", &[]),
            (".", &[]),
            ("/", &[]),
            ("./src/", &["src"]),
            ("a//b/./c", &["a", "b", "c"]),
            ("../x", &["x"]),
            ("a/../../b", &["b"]),
            ("/usr/src/app/.", &["usr", "src", "app"]),
        ];
        for (p, want) in cases {
            assert_eq!(clean_rooted(p), want, "{p:?}");
        }
    }

    #[test]
    fn keys_sort_subtrees_together() {
        let mut keys = [key("a-b"), key("a/x"), key("a"), key("a/x/y"), key("a.c")];
        keys.sort();
        let paths: Vec<String> = keys.iter().map(|k| path_of(k)).collect();
        assert_eq!(paths, ["a", "a/x", "a/x/y", "a-b", "a.c"]);
        assert_eq!(base_name(&key("a/x/y")), "y");
        assert_eq!(base_name("top"), "top");
        assert_eq!(join("", "a"), "a");
        assert_eq!(join("d", ""), "d");
        assert_eq!(join("d", "a/b"), "d/a/b");
    }
}
