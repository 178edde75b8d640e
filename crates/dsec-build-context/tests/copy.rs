//! COPY/ADD over real tar archives built here: contexts written with the `tar` crate to
//! temporary files, opened, copied, and the output archives read back.

use std::fs::File;
use std::io::{Read, Seek, Write};

use dsec_build_context::{Context, ContextError, CopyOutcome, Limits};
use dsec_dockerfile::{CopyFrom, CopyStep};

/// One entry of a test archive.
#[derive(Clone)]
struct Ent {
    name: Vec<u8>,
    ty: tar::EntryType,
    mode: u32,
    data: Vec<u8>,
    link: Option<String>,
    mtime: u64,
    uid: u64,
}

fn ent(name: &str, ty: tar::EntryType, mode: u32) -> Ent {
    Ent {
        name: name.as_bytes().to_vec(),
        ty,
        mode,
        data: Vec::new(),
        link: None,
        mtime: 1_700_000_000,
        uid: 1000,
    }
}

fn file(name: &str, data: &[u8]) -> Ent {
    Ent {
        data: data.to_vec(),
        ..ent(name, tar::EntryType::Regular, 0o644)
    }
}

fn dir(name: &str, mode: u32) -> Ent {
    ent(name, tar::EntryType::Directory, mode)
}

fn symlink(name: &str, target: &str) -> Ent {
    Ent {
        link: Some(target.into()),
        ..ent(name, tar::EntryType::Symlink, 0o777)
    }
}

fn hardlink(name: &str, target: &str) -> Ent {
    Ent {
        link: Some(target.into()),
        ..ent(name, tar::EntryType::Link, 0o644)
    }
}

/// A tar archive of `entries`, in memory. Names are written as given (`..` included),
/// through a GNU long-name entry when they do not fit the header.
fn tar_bytes(entries: &[Ent]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for e in entries {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(e.ty);
        h.set_mode(e.mode);
        h.set_mtime(e.mtime);
        h.set_uid(e.uid);
        h.set_gid(e.uid);
        h.set_size(e.data.len() as u64);
        if let Some(link) = &e.link {
            h.set_link_name_literal(link.as_bytes()).expect("link name");
        }
        if e.name.len() < 100 {
            h.as_old_mut().name[..e.name.len()].copy_from_slice(&e.name);
            h.set_cksum();
            b.append(&h, e.data.as_slice()).expect("append");
        } else {
            let name = std::str::from_utf8(&e.name).expect("utf-8 long name");
            b.append_data(&mut h, name, e.data.as_slice())
                .expect("append long");
        }
    }
    b.into_inner().expect("finish")
}

fn temp_with(bytes: &[u8]) -> File {
    let mut f = tempfile::tempfile().expect("tempfile");
    f.write_all(bytes).expect("write");
    f
}

fn open_with(
    entries: &[Ent],
    dockerignore: bool,
    limits: &Limits,
) -> Result<Context, ContextError> {
    Context::open(temp_with(&tar_bytes(entries)), dockerignore, limits)
}

fn open(entries: &[Ent]) -> Context {
    open_with(entries, true, &Limits::default()).expect("open context")
}

fn step(sources: &[&str], dest: &str) -> CopyStep {
    CopyStep {
        from: CopyFrom::Context,
        sources: sources.iter().map(|s| s.to_string()).collect(),
        dest: dest.into(),
        chown: None,
        chmod: None,
        extract_tars: false,
    }
}

fn add(sources: &[&str], dest: &str) -> CopyStep {
    CopyStep {
        extract_tars: true,
        ..step(sources, dest)
    }
}

/// One entry of an output archive.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Out {
    path: String,
    /// 'd', 'f', 'l' (symlink), 'h' (hard link)
    ty: char,
    mode: u32,
    uid: u64,
    gid: u64,
    mtime: u64,
    data: Vec<u8>,
    link: String,
}

fn try_copy(
    ctx: &Context,
    s: &CopyStep,
    dest_is_dir: bool,
    owner: (u32, u32),
) -> Result<(CopyOutcome, Vec<Out>), ContextError> {
    let mut out = tempfile::tempfile().expect("tempfile");
    let outcome = ctx.copy(s, dest_is_dir, owner, &mut out)?;
    out.rewind().expect("rewind");
    let mut ar = tar::Archive::new(out);
    let mut list = Vec::new();
    for e in ar.entries().expect("output is a tar") {
        let mut e = e.expect("output entry");
        let h = e.header().clone();
        let mut data = Vec::new();
        e.read_to_end(&mut data).expect("output data");
        let ty = match h.entry_type() {
            tar::EntryType::Directory => 'd',
            tar::EntryType::Regular => 'f',
            tar::EntryType::Symlink => 'l',
            tar::EntryType::Link => 'h',
            other => panic!("unexpected output entry type {other:?}"),
        };
        list.push(Out {
            path: String::from_utf8(e.path_bytes().into_owned()).expect("utf-8 path"),
            ty,
            mode: h.mode().expect("mode"),
            uid: h.uid().expect("uid"),
            gid: h.gid().expect("gid"),
            mtime: h.mtime().expect("mtime"),
            data,
            link: e
                .link_name_bytes()
                .map(|l| String::from_utf8_lossy(&l).into_owned())
                .unwrap_or_default(),
        });
    }
    Ok((outcome, list))
}

fn copy(ctx: &Context, s: &CopyStep) -> (CopyOutcome, Vec<Out>) {
    try_copy(ctx, s, false, (0, 0)).expect("copy")
}

/// (path, type) of each output entry.
fn listing(out: &[Out]) -> Vec<(String, char)> {
    out.iter().map(|o| (o.path.clone(), o.ty)).collect()
}

fn names(out: &[Out]) -> Vec<&str> {
    out.iter().map(|o| o.path.as_str()).collect()
}

fn sample() -> Vec<Ent> {
    vec![
        dir("./", 0o755),
        file("./a.txt", b"alpha"),
        file("./b.txt", b"beta"),
        dir("./src/", 0o750),
        file("./src/main.py", b"print(1)"),
        dir("./src/pkg/", 0o755),
        file("./src/pkg/x.py", b"x = 1"),
    ]
}

#[test]
fn file_to_file() {
    let ctx = open(&sample());
    let (outcome, out) = copy(&ctx, &step(&["a.txt"], "/etc/b.conf"));
    assert_eq!(listing(&out), [("etc/b.conf".into(), 'f')]);
    assert_eq!(out[0].data, b"alpha");
    assert_eq!(out[0].mode, 0o644);
    assert_eq!(out[0].mtime, 1_700_000_000);
    assert_eq!(outcome.paths, ["/etc/b.conf"]);
    assert_eq!(outcome.bytes, 5);
    assert_eq!(outcome.digest.len(), 64);
    // A leading "/" or "./" in the source is the context root too.
    for src in ["/a.txt", "./a.txt", "src/../a.txt"] {
        let (_, out) = copy(&ctx, &step(&[src], "/x"));
        assert_eq!(names(&out), ["x"], "{src}");
    }
}

#[test]
fn file_into_directory() {
    let ctx = open(&sample());
    for dest in ["/app/", "/app/."] {
        let (_, out) = copy(&ctx, &step(&["a.txt"], dest));
        assert_eq!(names(&out), ["app/a.txt"], "{dest}");
    }
    // The builder found /app to be a directory in the image.
    let mut o = tempfile::tempfile().expect("tempfile");
    let outcome = ctx
        .copy(&step(&["a.txt"], "/app"), true, (0, 0), &mut o)
        .expect("copy");
    assert_eq!(outcome.paths, ["/app/a.txt"]);
    // Several sources: dest is a directory even without a '/'.
    let (outcome, out) = copy(&ctx, &step(&["a.txt", "b.txt"], "/app"));
    assert_eq!(names(&out), ["app/a.txt", "app/b.txt"]);
    assert_eq!(outcome.paths, ["/app/a.txt", "/app/b.txt"]);
    assert_eq!(outcome.bytes, 9);
    // The root.
    let (_, out) = copy(&ctx, &step(&["a.txt"], "/"));
    assert_eq!(names(&out), ["a.txt"]);
}

#[test]
fn directory_contents() {
    let ctx = open(&sample());
    for dest in ["/app", "/app/"] {
        let (outcome, out) = copy(&ctx, &step(&["src"], dest));
        assert_eq!(
            listing(&out),
            [
                ("app".into(), 'd'),
                ("app/main.py".into(), 'f'),
                ("app/pkg".into(), 'd'),
                ("app/pkg/x.py".into(), 'f'),
            ],
            "{dest}"
        );
        // dest takes the source directory's mode.
        assert_eq!(out[0].mode, 0o750);
        assert_eq!(
            outcome.paths,
            ["/app", "/app/main.py", "/app/pkg", "/app/pkg/x.py"]
        );
    }
    // Into the root: no entry for "/" itself.
    let (_, out) = copy(&ctx, &step(&["src/"], "/"));
    assert_eq!(names(&out), ["main.py", "pkg", "pkg/x.py"]);
}

#[test]
fn implied_parents_and_long_names() {
    let long = format!("deep/{}/f.txt", "n".repeat(150));
    let ctx = open(&[file("deep/a/b.txt", b"b"), file(&long, b"long")]);
    let (_, out) = copy(&ctx, &step(&["deep"], "/x"));
    assert_eq!(
        listing(&out),
        [
            ("x".into(), 'd'),
            ("x/a".into(), 'd'),
            ("x/a/b.txt".into(), 'f'),
            (format!("x/{}", "n".repeat(150)), 'd'),
            (format!("x/{}/f.txt", "n".repeat(150)), 'f'),
        ]
    );
    assert_eq!(out[1].mode, 0o755);
    assert_eq!(out[4].data, b"long");
}

#[test]
fn wildcards() {
    let ctx = open(&[
        file("a.py", b"a"),
        file("b.py", b"b"),
        file("c.txt", b"c"),
        file("sub/d.py", b"d"),
        file("src/one/x/f1", b"1"),
        file("src/two/x/f2", b"2"),
        file("src/three/y/f3", b"3"),
        file("src/four/x", b"plain file"),
        file("p/a/x", b"x"),
        file("p/a-b", b"-"),
        file("p/a.c", b"."),
    ]);
    let (_, out) = copy(&ctx, &step(&["*.py"], "/d/"));
    assert_eq!(names(&out), ["d/a.py", "d/b.py"]);
    // A single match into a dest without '/' is a file copy.
    let (_, out) = copy(&ctx, &step(&["c.*"], "/etc/c"));
    assert_eq!(names(&out), ["etc/c"]);
    let (_, out) = copy(&ctx, &step(&["[ab].p?"], "/d/"));
    assert_eq!(names(&out), ["d/a.py", "d/b.py"]);
    let (_, out) = copy(&ctx, &step(&["[^a].py"], "/d/"));
    assert_eq!(names(&out), ["d/b.py"]);
    // `*` does not cross '/'.
    let (_, out) = copy(&ctx, &step(&["*/*.py"], "/d/"));
    assert_eq!(names(&out), ["d/d.py"]);
    // src/*/x, in name order: a file (four/x) and two directories whose contents are
    // merged into dest (its directory entry written once).
    let (outcome, out) = copy(&ctx, &step(&["src/*/x"], "/d"));
    assert_eq!(names(&out), ["d/x", "d", "d/f1", "d/f2"]);
    assert_eq!(outcome.paths, ["/d/x", "/d", "/d/f1", "/d/f2"]);
    // Siblings whose names sort between a directory and its children ("a-b" < "a/x").
    let (_, out) = copy(&ctx, &step(&["p/a*"], "/d/"));
    assert_eq!(names(&out), ["d", "d/x", "d/a-b", "d/a.c"]);
}

#[test]
fn no_match_and_bad_patterns() {
    let ctx = open(&sample());
    for src in ["nope.txt", "*.rs", "src/*/nothing", "a.txt/x"] {
        let e = try_copy(&ctx, &step(&["a.txt", src], "/d/"), false, (0, 0)).expect_err(src);
        assert!(
            matches!(&e, ContextError::NoMatch { pattern } if pattern == src),
            "{e}"
        );
        let msg = e.to_string();
        assert!(
            msg.starts_with("no source files were specified") && msg.contains(src),
            "{msg}"
        );
    }
    let e = try_copy(&ctx, &step(&["src/[a"], "/d/"), false, (0, 0)).expect_err("bad");
    assert!(matches!(e, ContextError::BadPattern { .. }), "{e}");
}

#[test]
fn dockerignore() {
    let entries = vec![
        file(".dockerignore", b"*.log\nbuild\n!build/keep.txt\nsecret/\n"),
        file("a.log", b"log"),
        file("app.py", b"app"),
        dir("build", 0o700),
        file("build/tmp.o", b"obj"),
        file("build/keep.txt", b"keep"),
        file("secret/key", b"hunter2"),
        file("src/debug.log", b"nested logs are not matched by *.log"),
    ];
    let ctx = open(&entries);
    let (_, out) = copy(&ctx, &step(&["."], "/c/"));
    assert_eq!(
        names(&out),
        [
            "c",
            "c/.dockerignore",
            "c/app.py",
            "c/build",
            "c/build/keep.txt",
            "c/src",
            "c/src/debug.log"
        ]
    );
    // The excluded directory kept for its exception keeps its own mode.
    assert_eq!(out[3].mode, 0o700);
    for src in ["a.log", "*.log", "secret/key", "secret", "build/tmp.o"] {
        let e = try_copy(&ctx, &step(&[src], "/d/"), false, (0, 0)).expect_err(src);
        assert!(matches!(e, ContextError::NoMatch { .. }), "{src}: {e}");
    }
    let (_, out) = copy(&ctx, &step(&["build"], "/b"));
    assert_eq!(names(&out), ["b", "b/keep.txt"]);

    // Not honored (a stage's tree): everything is visible.
    let ctx = open_with(&entries, false, &Limits::default()).expect("open");
    let (_, out) = copy(&ctx, &step(&["secret/key"], "/k"));
    assert_eq!(out[0].data, b"hunter2");

    // A .dockerignore that does not parse is an error.
    let e = open_with(
        &[file(".dockerignore", b"[z-a]\n")],
        true,
        &Limits::default(),
    )
    .expect_err("bad .dockerignore");
    assert!(matches!(e, ContextError::DockerIgnore(_)), "{e}");
}

#[test]
fn whole_context() {
    let ctx = open(&sample());
    for src in [".", "", "/", "./"] {
        let (_, out) = copy(&ctx, &step(&[src], "/"));
        assert_eq!(
            names(&out),
            [
                "a.txt",
                "b.txt",
                "src",
                "src/main.py",
                "src/pkg",
                "src/pkg/x.py"
            ],
            "{src:?}"
        );
    }
    // Into a directory: it takes the root's mode.
    let mut entries = sample();
    entries[0].mode = 0o711;
    let ctx = open(&entries);
    let (_, out) = copy(&ctx, &step(&["."], "/w/"));
    assert_eq!((out[0].path.as_str(), out[0].mode), ("w", 0o711));
}

#[test]
fn chmod_and_owner() {
    let mut entries = sample();
    entries.push(symlink("link", "a.txt"));
    let ctx = open(&entries);
    let s = CopyStep {
        chmod: Some(0o700),
        ..step(&["."], "/w/")
    };
    let (_, out) = try_copy(&ctx, &s, false, (1000, 2000)).expect("copy");
    for o in &out {
        let want = if o.ty == 'l' { 0o777 } else { 0o700 };
        assert_eq!(o.mode, want, "{}", o.path);
        assert_eq!((o.uid, o.gid), (1000, 2000), "{}", o.path);
    }
    // Without chmod the archive's modes, and root by default (not the archive's 1000).
    let (_, out) = copy(&ctx, &step(&["src"], "/w"));
    assert_eq!(
        out.iter()
            .map(|o| (o.mode, o.uid, o.gid))
            .collect::<Vec<_>>(),
        [(0o750, 0, 0), (0o644, 0, 0), (0o755, 0, 0), (0o644, 0, 0)]
    );
}

/// A source that is a symlink is dereferenced, as Docker's builders do (`COPY link /x`
/// copies what the link points to, under the link's name); symlinks inside a copied
/// directory stay symlinks, and so does a symlink in the middle of a source path.
#[test]
fn source_symlinks_are_followed_inner_ones_copied() {
    let ctx = open(&[
        file("real/f.txt", b"f"),
        symlink("ln", "real"),
        symlink("abs", "/etc/passwd"),
        symlink("real/up", "../ln"),
        symlink("file-ln", "real/f.txt"),
        symlink("chain", "file-ln"),
        symlink("rooted", "/real/f.txt"),
        symlink("escape", "../../../real/f.txt"),
        symlink("loop", "loop"),
    ]);
    // A directory link: the directory's contents, the link's name.
    let (_, out) = copy(&ctx, &step(&["ln"], "/x"));
    assert_eq!(
        listing(&out),
        [
            ("x".into(), 'd'),
            ("x/f.txt".into(), 'f'),
            ("x/up".into(), 'l')
        ]
    );
    // File links, through a chain, an absolute target (rooted at the context) and `..`
    // past the root (stops there).
    for src in ["file-ln", "chain", "rooted", "escape"] {
        let (_, out) = copy(&ctx, &step(&[src], "/d/"));
        assert_eq!(listing(&out), [(format!("d/{src}"), 'f')], "{src}");
        assert_eq!(out[0].data, b"f", "{src}");
    }
    // Into a directory by wildcard: each matched link is followed too.
    let (_, out) = copy(&ctx, &step(&["file-*"], "/w/"));
    assert_eq!(listing(&out), [("w/file-ln".into(), 'f')]);
    // Leading out of the context, or in a loop: a clear error naming the source.
    let e = try_copy(&ctx, &step(&["abs"], "/d/"), false, (0, 0)).expect_err("outside");
    assert!(
        matches!(&e, ContextError::BadSymlink { pattern, .. } if pattern == "abs")
            && e.to_string().contains("/etc/passwd"),
        "{e}"
    );
    let e = try_copy(&ctx, &step(&["loop"], "/d/"), false, (0, 0)).expect_err("loop");
    assert!(matches!(e, ContextError::BadSymlink { .. }), "{e}");
    // Inside a copied directory, a link is copied as it is.
    let (outcome, out) = copy(&ctx, &step(&["real"], "/r"));
    assert_eq!(
        listing(&out),
        [
            ("r".into(), 'd'),
            ("r/f.txt".into(), 'f'),
            ("r/up".into(), 'l')
        ]
    );
    assert_eq!(out[2].link, "../ln");
    assert_eq!(outcome.paths, ["/r", "/r/f.txt", "/r/up"]);
    // A symlink in the source path is not followed.
    let e = try_copy(&ctx, &step(&["ln/f.txt"], "/d/"), false, (0, 0)).expect_err("via link");
    assert!(matches!(e, ContextError::NoMatch { .. }), "{e}");
}

#[test]
fn context_names_and_replacement() {
    // Absolute names are relative to the root; a later entry replaces an earlier one,
    // and a file replacing a directory drops its subtree.
    let ctx = open(&[
        file("/abs/x", b"x"),
        file("dup", b"first"),
        file("dup", b"second"),
        file("d/old", b"old"),
        file("d", b"now a file"),
        hardlink("hl", "dup"),
    ]);
    let (_, out) = copy(&ctx, &step(&["abs/x"], "/x"));
    assert_eq!(out[0].data, b"x");
    let (_, out) = copy(&ctx, &step(&["dup"], "/dup"));
    assert_eq!(out[0].data, b"second");
    let (_, out) = copy(&ctx, &step(&["d"], "/d"));
    assert_eq!(listing(&out), [("d".into(), 'f')]);
    assert_eq!(out[0].data, b"now a file");
    // A hard link of the context is a regular file with its target's content.
    let (_, out) = copy(&ctx, &step(&["hl"], "/hl"));
    assert_eq!((out[0].ty, out[0].data.as_slice()), ('f', &b"second"[..]));
}

#[test]
fn unsafe_context_entries() {
    let cases: Vec<(Vec<Ent>, &str)> = vec![
        (vec![file("ok", b""), file("../evil", b"x")], "../evil"),
        (vec![file("a/../../evil", b"x")], "a/../../evil"),
        (vec![hardlink("h", "missing")], "h"),
        (vec![file("f", b""), file("f/under", b"")], "f/under"),
    ];
    for (entries, bad) in cases {
        let e = open_with(&entries, true, &Limits::default()).expect_err(bad);
        assert!(
            matches!(&e, ContextError::UnsafeEntry { name, .. } if name == bad),
            "{bad}: {e}"
        );
        assert!(e.to_string().contains(bad), "{e}");
    }
    let mut not_utf8 = file("a", b"");
    not_utf8.name = b"a\xffb".to_vec();
    assert!(matches!(
        open_with(&[not_utf8], true, &Limits::default()),
        Err(ContextError::UnsafeEntry { .. })
    ));
    // Not a tar at all.
    let e = Context::open(temp_with(&[b'x'; 1024]), true, &Limits::default()).expect_err("garbage");
    assert!(matches!(e, ContextError::BadArchive { .. }), "{e}");
    // Data past the end of the file.
    let mut bytes = tar_bytes(&[file("big", &[7u8; 4096])]);
    bytes.truncate(1024);
    let e = Context::open(temp_with(&bytes), true, &Limits::default()).expect_err("truncated");
    assert!(matches!(e, ContextError::BadArchive { .. }), "{e}");
}

#[test]
fn context_limits() {
    let limits = Limits {
        max_entries: 2,
        ..Limits::default()
    };
    let e = open_with(&sample()[..3], true, &limits).expect_err("3 entries");
    assert!(matches!(e, ContextError::Limit { limit: 2, .. }), "{e}");
    let limits = Limits {
        max_path_len: 10,
        ..Limits::default()
    };
    let e = open_with(&[file("0123456789abc", b"")], true, &limits).expect_err("long");
    assert!(matches!(e, ContextError::Limit { limit: 10, .. }), "{e}");
}

fn gzip(data: &[u8]) -> Vec<u8> {
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    enc.write_all(data).expect("gzip");
    enc.finish().expect("gzip")
}

#[test]
fn add_extracts_archives() {
    let inner = tar_bytes(&[
        dir("./", 0o700),
        dir("./bin/", 0o755),
        Ent {
            mode: 0o755,
            ..file("./bin/tool", b"#!/bin/sh")
        },
        file("/etc/conf", b"absolute becomes relative"),
        hardlink("bin/tool2", "bin/tool"),
        symlink("bin/sh", "/bin/busybox"),
    ]);
    let zst = zstd::encode_all(inner.as_slice(), 3).expect("zstd");
    let ctx = open(&[
        file("app.tar.gz", &gzip(&inner)),
        file("app.tar.zst", &zst),
        file("app.tar", &inner),
        file("notes.txt", b"just text"),
        file("notes.gz", &gzip(b"gzipped text, not a tar")),
    ]);
    let want = [
        ("opt/bin".to_string(), 'd'),
        ("opt/bin/tool".into(), 'f'),
        ("opt/etc/conf".into(), 'f'),
        ("opt/bin/tool2".into(), 'h'),
        ("opt/bin/sh".into(), 'l'),
    ];
    for src in ["app.tar.gz", "app.tar.zst", "app.tar"] {
        // Extracted into dest, with or without a trailing '/'.
        for dest in ["/opt/", "/opt"] {
            let (outcome, out) = copy(&ctx, &add(&[src], dest));
            assert_eq!(listing(&out), want, "{src} -> {dest}");
            assert_eq!(out[1].data, b"#!/bin/sh");
            assert_eq!(out[1].mode, 0o755);
            assert_eq!(out[3].link, "opt/bin/tool");
            assert_eq!(out[4].link, "/bin/busybox");
            assert_eq!(outcome.bytes, 9 + 25);
        }
    }
    // COPY does not extract.
    let (_, out) = copy(&ctx, &step(&["app.tar.gz"], "/opt/"));
    assert_eq!(names(&out), ["opt/app.tar.gz"]);
    // Not archives: copied as they are.
    let (_, out) = copy(&ctx, &add(&["notes.txt", "notes.gz"], "/opt/"));
    assert_eq!(names(&out), ["opt/notes.txt", "opt/notes.gz"]);
    assert_eq!(out[1].data, gzip(b"gzipped text, not a tar"));
}

#[test]
fn add_refuses_unsafe_archives() {
    for bad in ["../evil", "a/../../evil"] {
        let inner = tar_bytes(&[file("ok", b"ok"), file(bad, b"x")]);
        let ctx = open(&[file("evil.tar.gz", &gzip(&inner)), file("evil.tar", &inner)]);
        for src in ["evil.tar.gz", "evil.tar"] {
            let e = try_copy(&ctx, &add(&[src], "/opt/"), false, (0, 0)).expect_err(bad);
            assert!(
                matches!(&e, ContextError::UnsafeEntry { name, .. } if name == bad),
                "{src}: {e}"
            );
        }
    }
    // A hard link to something that is not an earlier file of the archive.
    let inner = tar_bytes(&[hardlink("h", "/etc/shadow")]);
    let ctx = open(&[file("h.tar", &inner)]);
    let e = try_copy(&ctx, &add(&["h.tar"], "/"), false, (0, 0)).expect_err("link");
    assert!(matches!(e, ContextError::UnsafeEntry { .. }), "{e}");
    // xz: recognized, not supported.
    let ctx = open(&[file("a.tar.xz", b"\xfd7zXZ\x00\x00\x04rest")]);
    let e = try_copy(&ctx, &add(&["a.tar.xz"], "/"), false, (0, 0)).expect_err("xz");
    assert!(matches!(e, ContextError::Unsupported { .. }), "{e}");
    assert!(e.to_string().contains("xz"), "{e}");
}

#[test]
fn add_refuses_decompression_bombs() {
    // A tar header for a 200 MiB file, then 200 gzip members of 1 MiB of zeros each:
    // ~200 KiB that decompresses to 200 MiB.
    const MIB: usize = 1 << 20;
    let mut h = tar::Header::new_gnu();
    h.set_path("zeros").expect("path");
    h.set_size(200 * MIB as u64);
    h.set_mode(0o644);
    h.set_cksum();
    let mut bomb = gzip(h.as_bytes());
    let member = gzip(&vec![0u8; MIB]);
    for _ in 0..200 {
        bomb.extend_from_slice(&member);
    }
    assert!(bomb.len() < 2 * MIB);
    let ctx = open_with(
        &[file("bomb.tar.gz", &bomb)],
        true,
        &Limits {
            max_extracted_bytes: 16 * MIB as u64,
            ..Limits::default()
        },
    )
    .expect("open");
    let e = try_copy(&ctx, &add(&["bomb.tar.gz"], "/"), false, (0, 0)).expect_err("bomb");
    assert!(
        matches!(e, ContextError::Limit { limit, .. } if limit == 16 * MIB as u64),
        "{e}"
    );
    assert!(e.to_string().contains("decompression bomb"), "{e}");
    // The same archive within the limits extracts (the floor allows 256 MiB).
    let ctx = open(&[file("bomb.tar.gz", &bomb)]);
    let (outcome, _) = copy(&ctx, &add(&["bomb.tar.gz"], "/"));
    assert_eq!(outcome.bytes, 200 * MIB as u64);
}

#[test]
fn digest_is_about_content_not_metadata() {
    let digest = |entries: &[Ent], s: &CopyStep| {
        let ctx = open(entries);
        copy(&ctx, s).0.digest
    };
    let s = step(&["."], "/app/");
    let base = sample();
    let d0 = digest(&base, &s);
    // Other mtimes and owners (a fresh checkout, another user): same digest.
    let touched: Vec<Ent> = base
        .iter()
        .map(|e| Ent {
            mtime: e.mtime + 12345,
            uid: 0,
            ..e.clone()
        })
        .collect();
    assert_eq!(digest(&touched, &s), d0);
    // The same copy again, and the output owner, do not change it either.
    let ctx = open(&base);
    let (a, _) = try_copy(&ctx, &s, false, (5, 5)).expect("copy");
    assert_eq!(a.digest, d0);
    // Content, mode, name, destination and chmod do.
    let mut content = base.clone();
    content[1].data = b"alphA".to_vec();
    let mut mode = base.clone();
    mode[1].mode = 0o755;
    let mut name = base.clone();
    name[1].name = b"./a2.txt".to_vec();
    let others = [
        digest(&content, &s),
        digest(&mode, &s),
        digest(&name, &s),
        digest(&base, &step(&["."], "/app2/")),
        digest(
            &base,
            &CopyStep {
                chmod: Some(0o600),
                ..s.clone()
            },
        ),
    ];
    for (i, d) in others.iter().enumerate() {
        assert_ne!(*d, d0, "variant {i}");
    }
}

#[test]
fn sparse_files_are_refused_devices_skipped() {
    // GNU sparse entry: 5 bytes of data at offset 0 of a 10-byte file.
    let mut h = tar::Header::new_gnu();
    h.set_path("s").expect("path");
    h.set_entry_type(tar::EntryType::GNUSparse);
    h.set_mode(0o644);
    h.set_size(5);
    let gnu = h.as_gnu_mut().expect("gnu header");
    gnu.set_real_size(10);
    gnu.sparse[0].set_offset(0);
    gnu.sparse[0].set_length(5);
    gnu.sparse[1].set_offset(10);
    gnu.sparse[1].set_length(0);
    h.set_cksum();
    let mut b = tar::Builder::new(Vec::new());
    b.append(&h, &b"12345"[..]).expect("append");
    let bytes = b.into_inner().expect("finish");
    let e = Context::open(temp_with(&bytes), true, &Limits::default()).expect_err("gnu sparse");
    assert!(matches!(e, ContextError::Unsupported { .. }), "{e}");
    // PAX sparse (format 1.0): a local PAX header with GNU.sparse.* records.
    let record = b"22 GNU.sparse.major=1\n";
    assert_eq!(record.len(), 22);
    let pax = Ent {
        data: record.to_vec(),
        ..ent("PaxHeaders/s", tar::EntryType::XHeader, 0o644)
    };
    let entries = [pax, file("s", b"map and data")];
    let e = open_with(&entries, true, &Limits::default()).expect_err("pax sparse");
    assert!(matches!(e, ContextError::Unsupported { .. }), "{e}");
    let ctx = open(&[file("a.tar", &tar_bytes(&entries))]);
    let e = try_copy(&ctx, &add(&["a.tar"], "/"), false, (0, 0)).expect_err("inner sparse");
    assert!(matches!(e, ContextError::Unsupported { .. }), "{e}");
    // FIFOs and devices are not part of what a build copies.
    let ctx = open(&[
        ent("fifo", tar::EntryType::Fifo, 0o644),
        ent("dev", tar::EntryType::Char, 0o644),
        file("f", b"f"),
    ]);
    let (_, out) = copy(&ctx, &step(&["."], "/"));
    assert_eq!(names(&out), ["f"]);
}

#[test]
fn no_sources_is_an_error() {
    let ctx = open(&sample());
    let e = try_copy(&ctx, &step(&[], "/d/"), false, (0, 0)).expect_err("no sources");
    assert!(matches!(e, ContextError::NoMatch { .. }), "{e}");
}

#[test]
fn contexts_are_shared_across_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Context>();
    let ctx = open(&sample());
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                let (outcome, _) = copy(&ctx, &step(&["src"], "/app"));
                assert_eq!(outcome.bytes, 13);
            });
        }
    });
}
