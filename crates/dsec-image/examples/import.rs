//! Manual check: `cargo run -p dsec-image --example import -- STORE_ROOT NAME SOURCE`.
//! Imports SOURCE (dir, .tar, .tar.gz) with phase timings, mounts it once and lists `/`.

use std::path::Path;
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let [_, root, name, source] = args.as_slice() else {
        eprintln!("usage: import STORE_ROOT NAME SOURCE");
        std::process::exit(2);
    };
    let store = dsec_image::ImageStore::open(root)?;
    let start = Instant::now();
    let last = std::cell::Cell::new(None);
    let img = store.import(name, Path::new(source), &|p| {
        if last.get() != Some(p.phase) {
            last.set(Some(p.phase));
            eprintln!(
                "{:>7.2}s {:?} {}/{:?}",
                start.elapsed().as_secs_f64(),
                p.phase,
                p.bytes_done,
                p.bytes_total
            );
        }
    })?;
    eprintln!("{:>7.2}s done", start.elapsed().as_secs_f64());
    println!("{}", serde_json::to_string_pretty(&img)?);
    let t = Instant::now();
    let mnt = store.acquire(&img.digest)?;
    let mount_time = t.elapsed();
    let entries: Vec<String> = std::fs::read_dir(&mnt)?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    println!(
        "mounted at {} in {mount_time:?}: {entries:?}",
        mnt.display()
    );
    store.release(&img.digest)?;
    Ok(())
}
