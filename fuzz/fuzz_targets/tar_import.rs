//! The root file system importer (`dsec image import NAME rootfs.tar[.gz|.zst]`) on an
//! arbitrary archive: it must never panic and never write outside its destination.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(work) = tempfile::tempdir() else {
        return;
    };
    let archive = work.path().join("in.tar");
    let dest = work.path().join("root");
    let outside = work.path().join("outside");
    if std::fs::write(&archive, data).is_err()
        || std::fs::create_dir(&dest).is_err()
        || std::fs::create_dir(&outside).is_err()
    {
        return;
    }
    let _ = dsec_image::fuzzing::extract_tar(&archive, &dest);
    dsec_fuzz_check::nothing_escaped(work.path(), &["in.tar", "root", "outside"], &outside);
});

mod dsec_fuzz_check {
    include!("../src/check.rs");
}
