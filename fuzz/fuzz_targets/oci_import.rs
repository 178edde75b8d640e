//! The OCI layout / `docker save` importer on an arbitrary archive (a tar holding
//! `oci-layout`, `index.json`, blobs, or `manifest.json`), flattening every layer with
//! its whiteouts into one tree: it must never panic and never touch anything outside
//! its destination (see `src/check.rs`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    check::run_import(
        data,
        "image.tar",
        |_| {},
        |archive, dest| {
            let _ = dsec_image::fuzzing::unpack_oci(archive, dest);
        },
    );
});

mod check {
    include!("../src/check.rs");
}
