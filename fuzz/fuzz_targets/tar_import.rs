//! The root file system importer (`dsec image import NAME rootfs.tar[.gz|.zst]`) on an
//! arbitrary archive: it must never panic and never touch anything outside its
//! destination (see `src/check.rs`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    check::run_import(
        data,
        "in.tar",
        |_| {},
        |archive, dest| {
            let _ = dsec_image::fuzzing::extract_tar(archive, dest);
        },
    );
});

mod check {
    include!("../src/check.rs");
}
