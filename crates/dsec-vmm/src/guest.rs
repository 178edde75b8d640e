//! What a microVM boots: a Debian kernel from `/boot` and an initramfs the node builds
//! itself, holding the kernel modules the guest needs (virtio, EROFS, overlayfs), in load
//! order, and the static `dsec-agent` as `/init`.
//!
//! The initramfs is built once per (kernel, agent) pair and kept under the node's state
//! directory; each sandbox boots it with its own [`GuestSpec`] appended as a second
//! archive (the kernel unpacks concatenated archives in turn).

use std::collections::{BTreeMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};

use dsec_wire::vm::{GuestSpec, SPEC_PATH};
use sha2::Digest;

use crate::cpio::Cpio;
use crate::VmmError;

/// Modules the guest loads, with their dependencies resolved from `modules.dep`: the
/// virtio-mmio bus (the microvm machine's devices) and virtio-pci (a full machine's), the
/// block, serial, network and balloon (free page reporting) drivers, and the file systems
/// of the sandbox's root. A kernel that has one built in does without.
pub const GUEST_MODULES: &[&str] = &[
    "virtio_mmio",
    "virtio_pci",
    "virtio_blk",
    "virtio_console",
    "virtio_net",
    "virtio_balloon",
    "erofs",
    "overlay",
];

/// Modules a full machine loads as well: its tablet (absolute pointer) and the event
/// devices a system reads it through.
pub const FULL_MACHINE_MODULES: &[&str] = &["virtio_input", "evdev"];

/// Where the guest finds the module list in its initramfs (one path per line, in order).
pub const MODULES_ORDER: &str = "/modules.order";

/// A guest kernel and its modules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestKernel {
    /// The kernel image (bzImage; QEMU's microvm boots it directly).
    pub image: PathBuf,
    /// Its release (`uname -r`).
    pub release: String,
    /// Its module tree (`/lib/modules/<release>`).
    pub modules: PathBuf,
}

impl GuestKernel {
    /// The kernel at `image`, with its release read from the name (`vmlinuz-<release>`).
    pub fn at(image: &Path) -> Result<Self, VmmError> {
        let name = image
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        let release = name.strip_prefix("vmlinuz-").ok_or_else(|| {
            VmmError::Setup(format!(
                "{}: a guest kernel is named vmlinuz-<release>",
                image.display()
            ))
        })?;
        let modules = Path::new("/lib/modules").join(release);
        if !modules.join("modules.dep").exists() {
            return Err(VmmError::Setup(format!(
                "{}: no modules at {} (install the kernel's package, e.g. linux-image-cloud-amd64)",
                image.display(),
                modules.display()
            )));
        }
        Ok(Self {
            image: image.to_path_buf(),
            release: release.to_string(),
            modules,
        })
    }

    /// The newest `/boot/vmlinuz-*` with modules, a `-cloud-` one first (made for VMs:
    /// small, virtio drivers as modules).
    pub fn find() -> Result<Self, VmmError> {
        let mut found: Vec<Self> = std::fs::read_dir("/boot")
            .map_err(|e| VmmError::Setup(format!("/boot: {e}")))?
            .filter_map(|e| e.ok())
            .filter_map(|e| Self::at(&e.path()).ok())
            .collect();
        found.sort_by_key(|k| (k.release.contains("-cloud-"), k.release.clone()));
        found.pop().ok_or_else(|| {
            VmmError::Setup(
                "no guest kernel in /boot with modules (apt-get install linux-image-cloud-amd64)"
                    .into(),
            )
        })
    }

    /// The module files to load, dependencies first, relative to the module tree.
    pub fn module_order(&self, wanted: &[&str]) -> Result<Vec<String>, VmmError> {
        let dep_path = self.modules.join("modules.dep");
        let text = std::fs::read_to_string(&dep_path)
            .map_err(|e| VmmError::Setup(format!("{}: {e}", dep_path.display())))?;
        let mut deps: BTreeMap<String, Vec<String>> = BTreeMap::new();
        let mut by_name: BTreeMap<String, String> = BTreeMap::new();
        for line in text.lines() {
            let Some((module, rest)) = line.split_once(':') else {
                continue;
            };
            let name = module_name(module);
            by_name.insert(name, module.to_string());
            deps.insert(
                module.to_string(),
                rest.split_whitespace().map(str::to_string).collect(),
            );
        }
        let builtin = std::fs::read_to_string(self.modules.join("modules.builtin"))
            .unwrap_or_default()
            .lines()
            .map(module_name)
            .collect::<HashSet<_>>();
        let mut order = Vec::new();
        let mut seen = HashSet::new();
        fn visit(
            m: &str,
            deps: &BTreeMap<String, Vec<String>>,
            seen: &mut HashSet<String>,
            order: &mut Vec<String>,
        ) {
            if !seen.insert(m.to_string()) {
                return;
            }
            for d in deps.get(m).into_iter().flatten() {
                visit(d, deps, seen, order);
            }
            order.push(m.to_string());
        }
        for w in wanted {
            let w = w.replace('-', "_");
            match by_name.get(&w) {
                Some(path) => visit(path, &deps, &mut seen, &mut order),
                None if builtin.contains(&w) => {}
                None => {
                    return Err(VmmError::Setup(format!(
                        "kernel {} has no module {w} (needed by the guest)",
                        self.release
                    )))
                }
            }
        }
        Ok(order)
    }
}

/// `kernel/fs/erofs/erofs.ko` → `erofs` (dashes as underscores, as the kernel names them).
fn module_name(path: &str) -> String {
    let file = path.rsplit('/').next().unwrap_or(path);
    let stem = file.split(".ko").next().unwrap_or(file);
    stem.replace('-', "_")
}

/// The kernel and base initramfs a node boots microVMs with.
#[derive(Debug, Clone)]
pub struct GuestAssets {
    /// The kernel.
    pub kernel: GuestKernel,
    /// What QEMU boots: the kernel's uncompressed ELF `vmlinux` (entered through PVH,
    /// without the bzImage decompressing itself under the guest's CPU first) where it
    /// could be unpacked and the kernel has a PVH entry, else its image.
    pub boot_image: PathBuf,
    /// The gzip-compressed base initramfs (agent, modules).
    pub initrd: PathBuf,
}

impl GuestAssets {
    /// Builds (or finds, when already built) the initramfs for `kernel` and the static
    /// agent at `agent` in `dir`.
    pub fn prepare(kernel: GuestKernel, agent: &Path, dir: &Path) -> Result<Self, VmmError> {
        let agent_bytes = std::fs::read(agent)
            .map_err(|e| VmmError::Setup(format!("agent {}: {e}", agent.display())))?;
        if !is_static_elf(&agent_bytes) {
            return Err(VmmError::Setup(format!(
                "agent {} is not a static binary: the guest has no libc (build it with \
                 scripts/lib.sh's build_static_agent)",
                agent.display()
            )));
        }
        let modules = kernel.module_order(GUEST_MODULES)?;
        let full_modules = kernel.module_order(FULL_MACHINE_MODULES)?;
        let mut h = sha2::Sha256::new();
        h.update(kernel.release.as_bytes());
        h.update(&agent_bytes);
        for m in &modules {
            h.update(m.as_bytes());
        }
        h.update(b"full:");
        for m in &full_modules {
            h.update(m.as_bytes());
        }
        let key = hex::encode(&h.finalize()[..8]);
        let initrd = dir.join(format!("initrd-{key}.cpio.gz"));
        if !initrd.exists() {
            std::fs::create_dir_all(dir)
                .map_err(|e| VmmError::Setup(format!("{}: {e}", dir.display())))?;
            let tmp = dir.join(format!(".initrd-{key}.{}", std::process::id()));
            let built = build_initrd(&kernel, [&modules, &full_modules], &agent_bytes, &tmp)
                .and_then(|()| std::fs::rename(&tmp, &initrd).map_err(VmmError::from));
            if let Err(e) = built {
                let _ = std::fs::remove_file(&tmp);
                return Err(e);
            }
            // Older builds (another agent or kernel) are of no more use.
            for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
                let name = e.file_name();
                let name = name.to_string_lossy();
                if name.starts_with("initrd-") && e.path() != initrd {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        let boot_image = match unpacked_vmlinux(&kernel, dir) {
            Ok(p) => p,
            Err(why) => {
                tracing::info!(kernel = %kernel.image.display(), %why, "booting the compressed image");
                kernel.image.clone()
            }
        };
        Ok(Self {
            kernel,
            boot_image,
            initrd,
        })
    }

    /// Writes the initramfs of one sandbox to `path`: the base one with `spec` appended.
    pub fn write_sandbox_initrd(&self, spec: &GuestSpec, path: &Path) -> Result<(), VmmError> {
        std::fs::copy(&self.initrd, path)?;
        let json = serde_json::to_vec(spec).map_err(|e| VmmError::Setup(e.to_string()))?;
        let mut c = Cpio::new(Vec::new());
        let dir = Path::new(SPEC_PATH)
            .parent()
            .and_then(|p| p.to_str())
            .unwrap_or("/dsec");
        c.dir(dir)?;
        c.file(SPEC_PATH, 0o600, &json)?;
        let tail = c.finish()?;
        let mut f = std::fs::OpenOptions::new().append(true).open(path)?;
        // The kernel takes an uncompressed archive after a compressed one only at a
        // 4-byte aligned offset; zeros in between are skipped.
        let len = f.metadata()?.len();
        let pad = ((4 - len % 4) % 4) as usize;
        f.write_all(&[0u8; 3][..pad])?;
        f.write_all(&tail)?;
        Ok(())
    }
}

/// The kernel's `vmlinux` in `dir`, unpacked from its image on first use.
fn unpacked_vmlinux(kernel: &GuestKernel, dir: &Path) -> Result<PathBuf, String> {
    let config =
        std::fs::read_to_string(Path::new("/boot").join(format!("config-{}", kernel.release)))
            .unwrap_or_default();
    if !config.lines().any(|l| l == "CONFIG_PVH=y") {
        return Err("the kernel's config has no CONFIG_PVH=y".into());
    }
    let out = dir.join(format!("vmlinux-{}", kernel.release));
    if out.exists() {
        return Ok(out);
    }
    let image = std::fs::read(&kernel.image).map_err(|e| e.to_string())?;
    let elf = unpack_bzimage(&image)?;
    let tmp = dir.join(format!(".vmlinux-{}", std::process::id()));
    std::fs::write(&tmp, &elf)
        .and_then(|()| std::fs::rename(&tmp, &out))
        .map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            e.to_string()
        })?;
    Ok(out)
}

/// The uncompressed ELF kernel inside an x86 bzImage (its payload: LZ4 in the kernel's
/// legacy framing, gzip or zstd).
pub fn unpack_bzimage(image: &[u8]) -> Result<Vec<u8>, String> {
    let u32_at = |o: usize| -> Result<usize, String> {
        let b = image.get(o..o + 4).ok_or("truncated image")?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
    };
    if image.get(0x202..0x206) != Some(b"HdrS") {
        return Err("not a bzImage (no HdrS)".into());
    }
    let setup_sects = match image.get(0x1f1) {
        Some(0) | None => 4,
        Some(n) => *n as usize,
    };
    let start = (setup_sects + 1) * 512 + u32_at(0x248)?;
    let payload = image
        .get(start..start + u32_at(0x24c)?)
        .ok_or("payload out of the image")?;
    let elf = match payload {
        [0x02, 0x21, 0x4c, 0x18, rest @ ..] => unpack_lz4_legacy(rest)?,
        [0x1f, 0x8b, ..] => {
            let mut out = Vec::new();
            std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(payload), &mut out)
                .map_err(|e| format!("gzip: {e}"))?;
            out
        }
        [0x28, 0xb5, 0x2f, 0xfd, ..] => {
            zstd::stream::decode_all(payload).map_err(|e| format!("zstd: {e}"))?
        }
        _ => return Err("the payload's compression is not lz4, gzip or zstd".into()),
    };
    if !elf.starts_with(b"\x7fELF") {
        return Err("the payload is not an ELF kernel".into());
    }
    Ok(elf)
}

/// LZ4's legacy frame as the kernel writes it: blocks, each its compressed length
/// (u32, little endian) and at most 8 MiB once decompressed, then the kernel's own
/// trailer (the uncompressed size, 4 bytes).
fn unpack_lz4_legacy(mut rest: &[u8]) -> Result<Vec<u8>, String> {
    const BLOCK: usize = 8 << 20;
    let mut out = Vec::new();
    let mut buf = vec![0u8; BLOCK];
    while rest.len() > 4 {
        let len = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
        // The legacy magic again starts a new frame.
        if len == 0x184c_2102 {
            rest = &rest[4..];
            continue;
        }
        let Some(block) = rest.get(4..4 + len) else {
            // What is left is the trailer.
            break;
        };
        let n =
            lz4_flex::block::decompress_into(block, &mut buf).map_err(|e| format!("lz4: {e}"))?;
        out.extend_from_slice(&buf[..n]);
        rest = &rest[4 + len..];
    }
    Ok(out)
}

/// Whether `elf` is an ELF executable without an interpreter (statically linked).
fn is_static_elf(elf: &[u8]) -> bool {
    if elf.len() < 64 || &elf[..4] != b"\x7fELF" || elf[4] != 2 {
        return false;
    }
    let u16_at = |o: usize| u16::from_le_bytes([elf[o], elf[o + 1]]) as usize;
    let u64_at = |o: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&elf[o..o + 8]);
        u64::from_le_bytes(b) as usize
    };
    let (phoff, phentsize, phnum) = (u64_at(32), u16_at(54), u16_at(56));
    (0..phnum).all(|i| {
        let o = phoff + i * phentsize;
        // PT_INTERP = 3
        o + 4 <= elf.len() && u32::from_le_bytes([elf[o], elf[o + 1], elf[o + 2], elf[o + 3]]) != 3
    })
}

/// Writes the initramfs: the agent as `/init`, and the modules of `lists` (every
/// machine's, then a full machine's) with a load-order file for each.
fn build_initrd(
    kernel: &GuestKernel,
    lists: [&[String]; 2],
    agent: &[u8],
    out: &Path,
) -> Result<(), VmmError> {
    let file = std::fs::File::create(out)?;
    let gz =
        flate2::write::GzEncoder::new(std::io::BufWriter::new(file), flate2::Compression::fast());
    let mut c = Cpio::new(gz);
    for d in ["dev", "proc", "sys", "mnt", "lib", "lib/modules", "dsec"] {
        c.dir(d)?;
    }
    // The kernel opens it as init's stdin, stdout and stderr: the guest's messages reach
    // the serial console, where the node reads them.
    c.char_dev("dev/console", 0o600, 5, 1)?;
    let agent = strip(agent);
    c.file("init", 0o755, &agent)?;
    let mut written = HashSet::new();
    for (modules, order_path) in lists
        .into_iter()
        .zip([MODULES_ORDER, dsec_wire::vm::FULL_MACHINE_MODULES_ORDER])
    {
        let mut order = String::new();
        for m in modules {
            let name = format!("lib/modules/{}.ko", module_name(m));
            if written.insert(name.clone()) {
                let src = kernel.modules.join(m);
                let data = std::fs::read(&src)
                    .map_err(|e| VmmError::Setup(format!("{}: {e}", src.display())))?;
                c.file(&name, 0o644, &data)?;
            }
            order.push_str(&format!("/{name}\n"));
        }
        c.file(order_path, 0o644, order.as_bytes())?;
    }
    let gz = c.finish()?;
    let mut w = gz.finish()?;
    w.flush()?;
    Ok(())
}

/// The agent without its debug sections (`strip`), or as it is when that fails: the
/// guest decompresses and holds every byte of the initramfs.
fn strip(agent: &[u8]) -> Vec<u8> {
    let Ok(dir) = tempdir_in_tmp() else {
        return agent.to_vec();
    };
    let path = dir.join("agent");
    let stripped = std::fs::write(&path, agent).is_ok()
        && std::process::Command::new("strip")
            .arg("--strip-debug")
            .arg(&path)
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
    let out = if stripped {
        std::fs::read(&path).unwrap_or_else(|_| agent.to_vec())
    } else {
        agent.to_vec()
    };
    let _ = std::fs::remove_dir_all(&dir);
    out
}

fn tempdir_in_tmp() -> std::io::Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!(
        "dsec-vmm-{}-{}",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::create_dir(&dir)?;
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn module_names_follow_the_kernel() {
        assert_eq!(module_name("kernel/fs/erofs/erofs.ko"), "erofs");
        assert_eq!(
            module_name("kernel/drivers/x/virtio-mmio.ko.xz"),
            "virtio_mmio"
        );
    }

    #[test]
    fn dependencies_load_first() {
        let dir = tempfile::tempdir().expect("test step");
        std::fs::write(
            dir.path().join("modules.dep"),
            "kernel/a/virtio_ring.ko:\nkernel/a/virtio.ko: kernel/a/virtio_ring.ko\n\
             kernel/a/virtio_mmio.ko: kernel/a/virtio.ko kernel/a/virtio_ring.ko\n\
             kernel/fs/erofs.ko: kernel/lib/libcrc32c.ko\nkernel/lib/libcrc32c.ko:\n",
        )
        .expect("test step");
        std::fs::write(dir.path().join("modules.builtin"), "kernel/fs/overlay.ko\n")
            .expect("test step");
        let k = GuestKernel {
            image: "/boot/vmlinuz-x".into(),
            release: "x".into(),
            modules: dir.path().to_path_buf(),
        };
        let order = k
            .module_order(&["virtio_mmio", "erofs", "overlay"])
            .expect("test step");
        assert_eq!(
            order,
            [
                "kernel/a/virtio_ring.ko",
                "kernel/a/virtio.ko",
                "kernel/a/virtio_mmio.ko",
                "kernel/lib/libcrc32c.ko",
                "kernel/fs/erofs.ko"
            ]
        );
        let err = k.module_order(&["nope"]).expect_err("an error");
        assert!(err.to_string().contains("no module nope"), "{err}");
    }

    #[test]
    fn the_guest_kernel_unpacks_to_its_elf() {
        // The test packages install linux-image-cloud-amd64 (scripts/lib.sh).
        let kernel = match GuestKernel::find() {
            Ok(k) => k,
            Err(e) => {
                assert!(std::env::var_os("CI").is_none(), "{e}");
                eprintln!("skipped: {e}");
                return;
            }
        };
        let image = std::fs::read(&kernel.image).expect("kernel image");
        let elf = unpack_bzimage(&image).expect("unpack");
        assert!(elf.len() > image.len(), "{} vs {}", elf.len(), image.len());
        assert_eq!(&elf[..4], b"\x7fELF");
        assert!(unpack_bzimage(b"not a kernel").is_err());
    }

    #[test]
    fn only_static_binaries_make_an_init() {
        let me = std::fs::read(std::env::current_exe().expect("test step")).expect("test step");
        // Test binaries are dynamically linked.
        assert!(!is_static_elf(&me));
        assert!(!is_static_elf(b"#!/bin/sh\n"));
    }
}
