//! packdiff's copy of an overlayfs upper directory, on the real file system (root: it
//! sets trusted.* xattrs and makes whiteout devices). With `CI=true` not being root fails.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;

use dsec_image::packdiff::copy_upper;

fn root_or_skip() -> bool {
    dsec_testkit::require_root("packdiff tests")
}

fn c(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).expect("path")
}

fn setxattr(p: &Path, name: &str, value: &[u8]) {
    let n = CString::new(name).expect("name");
    // SAFETY: valid strings and buffer.
    let rc = unsafe {
        libc::lsetxattr(
            c(p).as_ptr(),
            n.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    assert_eq!(
        rc,
        0,
        "setxattr {name}: {}",
        std::io::Error::last_os_error()
    );
}

fn getxattr(p: &Path, name: &str) -> Option<Vec<u8>> {
    let n = CString::new(name).expect("name");
    let mut buf = vec![0u8; 256];
    // SAFETY: valid strings and buffer.
    let len = unsafe {
        libc::lgetxattr(
            c(p).as_ptr(),
            n.as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    (len >= 0).then(|| {
        buf.truncate(len as usize);
        buf
    })
}

#[test]
fn upper_copy_keeps_layer_semantics_and_drops_mount_private_xattrs() {
    if !root_or_skip() {
        return;
    }
    let t = tempfile::tempdir().expect("tmp");
    let (up, out) = (t.path().join("upper"), t.path().join("out"));
    std::fs::create_dir_all(up.join("opaque/inner")).expect("mkdir");
    std::fs::create_dir(&out).expect("mkdir");
    std::fs::write(up.join("file"), b"data").expect("write");
    std::fs::hard_link(up.join("file"), up.join("link")).expect("link");
    std::os::unix::fs::symlink("file", up.join("sym")).expect("symlink");
    let wh = c(&up.join("deleted"));
    // SAFETY: mknod of a 0:0 character device (an overlayfs whiteout).
    let rc = unsafe { libc::mknod(wh.as_ptr(), libc::S_IFCHR | 0o600, 0) };
    assert_eq!(rc, 0);
    setxattr(&up.join("opaque"), "trusted.overlay.opaque", b"y");
    setxattr(&up.join("file"), "trusted.overlay.origin", b"\x00\xfb\x21");
    setxattr(&up.join("opaque"), "trusted.overlay.impure", b"y");
    setxattr(&up.join("file"), "user.note", b"kept");

    let stats = copy_upper(&up, &out, None).expect("copy");
    assert_eq!(stats.whiteouts, 1);
    let wm = std::fs::symlink_metadata(out.join("deleted")).expect("whiteout");
    assert!(wm.file_type().is_char_device() && wm.rdev() == 0);
    assert_eq!(
        getxattr(&out.join("opaque"), "trusted.overlay.opaque").as_deref(),
        Some(&b"y"[..])
    );
    assert_eq!(
        getxattr(&out.join("opaque"), "trusted.overlay.impure"),
        None
    );
    assert_eq!(getxattr(&out.join("file"), "trusted.overlay.origin"), None);
    assert_eq!(
        getxattr(&out.join("file"), "user.note").as_deref(),
        Some(&b"kept"[..])
    );
    let (f, l) = (
        std::fs::metadata(out.join("file")).expect("file"),
        std::fs::metadata(out.join("link")).expect("link"),
    );
    assert_eq!(
        (f.ino(), f.nlink()),
        (l.ino(), 2),
        "hard link kept as a link"
    );
    assert_eq!(
        std::fs::read_link(out.join("sym"))
            .expect("sym")
            .as_os_str(),
        "file"
    );
    assert!(out.join("opaque/inner").is_dir());

    // Against itself as the previous snapshot: nothing changed, nothing but directories.
    let again = t.path().join("again");
    std::fs::create_dir(&again).expect("mkdir");
    let s2 = copy_upper(&up, &again, Some(&out)).expect("copy");
    assert_eq!((s2.unchanged, s2.whiteouts), (4, 0), "{s2:?}");
    assert!(!again.join("file").exists());
    // A file gone since the previous snapshot comes back as a whiteout.
    std::fs::remove_file(up.join("sym")).expect("rm");
    let third = t.path().join("third");
    std::fs::create_dir(&third).expect("mkdir");
    copy_upper(&up, &third, Some(&out)).expect("copy");
    let m = std::fs::symlink_metadata(third.join("sym")).expect("whiteout for sym");
    assert!(m.file_type().is_char_device() && m.rdev() == 0);
}
