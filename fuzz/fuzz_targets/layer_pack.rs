//! The EROFS writer of image layers (`tar_erofs`, what a pull or an OCI import packs each
//! layer with) on an arbitrary tar stream: it must never panic, and a stream it accepts
//! packs into a file it closes (errors are fine).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(dir) = tempfile::tempdir() else {
        return;
    };
    let _ = dsec_image::fuzzing::pack_layer(data, &dir.path().join("layer.erofs"));
});
