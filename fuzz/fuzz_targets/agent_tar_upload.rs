//! The agent's tar upload (`PUT /v1/sandboxes/ID/files/tar`: the archive comes from the
//! API caller) on an arbitrary archive, into a directory that already holds files, a
//! directory and a symlink pointing out of it: it must never panic and never touch
//! anything outside its destination (see `src/check.rs`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    check::run_import(
        data,
        "upload.tar",
        |dest| {
            let _ = std::fs::create_dir(dest.join("keep"));
            let _ = std::fs::write(dest.join("keep/old.txt"), b"old\n");
            let _ = std::os::unix::fs::symlink("../outside", dest.join("out"));
        },
        |archive, dest| {
            if let Ok(f) = std::fs::File::open(archive) {
                let _ = dsec_agent::tar::fuzz_upload(f, dest);
            }
        },
    );
});

mod check {
    include!("../src/check.rs");
}
