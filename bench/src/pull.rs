//! Registry pulls: a multi-layer image (6 layers of 8 MiB of incompressible data, gzip)
//! from a local docker-registry into a fresh image store each time, layer blobs
//! downloaded one at a time vs `dsec-registry`'s default (3 at a time), in one run.
//! Each sample is a whole pull: resolve, download, verify, convert to EROFS.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use dsec_registry::{Allow, RegistryConfig, DEFAULT_PARALLEL_DOWNLOADS};
use dsec_testkit::{oci_layout, Registry};
use dsec_wire::v1::PullImageRequest;

use crate::{print_table, Stats};

const LAYERS: usize = 6;
const LAYER_BYTES: usize = 8 << 20;

/// A tar holding `size` bytes of xorshift noise in `/data-N`.
fn layer_tar(dir: &Path, n: usize, size: usize) -> anyhow::Result<PathBuf> {
    let path = dir.join(format!("layer-{n}.tar"));
    let mut b = tar::Builder::new(std::fs::File::create(&path)?);
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15 ^ n as u64;
    let noise: Vec<u8> = (0..size)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    let mut h = tar::Header::new_gnu();
    h.set_size(noise.len() as u64);
    h.set_mode(0o644);
    h.set_mtime(0);
    h.set_uid(0);
    h.set_gid(0);
    h.set_cksum();
    b.append_data(&mut h, format!("data-{n}"), noise.as_slice())?;
    b.into_inner()?;
    Ok(path)
}

/// Runs the section; prints one table.
pub(crate) fn section(quick: bool) -> anyhow::Result<()> {
    let n = if quick { 3 } else { 8 };
    let Some(reg) = Registry::start("bench registry pull") else {
        println!("\n## registry pull\n\nn/a: docker-registry or skopeo missing");
        return Ok(());
    };
    let dir = tempfile::tempdir()?;
    let tars = (0..LAYERS)
        .map(|i| layer_tar(dir.path(), i, LAYER_BYTES))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let refs: Vec<&Path> = tars.iter().map(PathBuf::as_path).collect();
    let layout = oci_layout(&dir.path().join("layout"), &refs, "amd64", &[]);
    reg.seed(&layout, "bench/multi:v1", "gzip");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut rows = Vec::new();
    for parallel in [1, DEFAULT_PARALLEL_DOWNLOADS] {
        let cfg = RegistryConfig {
            allow: Allow::from_flags(&[reg.addr()])?,
            parallel_downloads: parallel,
            ..Default::default()
        };
        let mut samples = Vec::with_capacity(n);
        for i in 0..n {
            let store = Arc::new(dsec_image::ImageStore::open(
                dir.path().join(format!("store-{parallel}-{i}")),
            )?);
            let req = PullImageRequest {
                reference: format!("{}/bench/multi:v1", reg.addr()),
                name: Some("multi".into()),
                insecure: true,
            };
            let t = Instant::now();
            rt.block_on(dsec_registry::pull(
                store.clone(),
                &cfg,
                &req,
                Arc::new(|_| {}),
            ))?;
            samples.push(t.elapsed().as_secs_f64() * 1000.0);
            std::fs::remove_dir_all(store.root())?;
        }
        rows.push(Stats {
            name: format!("{parallel} layer(s) at a time"),
            samples,
            note: Some(format!(
                "{LAYERS} x {} MiB gzip layers, loopback registry, fresh store",
                LAYER_BYTES >> 20
            )),
        });
    }
    print_table(
        "registry pull of a multi-layer image: serial vs parallel layer downloads",
        &rows,
        "1 layer(s) at a time",
    );
    Ok(())
}
