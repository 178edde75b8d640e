//! What starting a program costs on this machine, apart from any sandbox: a libc-free
//! no-op executable (the exec rows' second command, which pays for `execve` and nothing
//! else), the price of one `cpuid` instruction, which glibc's start-up runs dozens of
//! times (every one a hypervisor exit in a VM), and how idle CPUs wait, which sets the
//! price of every wake-up along an exec's path.

use std::time::Instant;

/// Where the no-op lives next to the `cat` payload (uploaded into dsec's sandbox, bound
/// into crun's container, spawned from the bundle on the host).
pub const NOP_FILE_NAME: &str = "nop";

/// Machine code of the no-op: `mov eax, 60` (exit); `xor edi, edi`; `syscall`.
const NOP_CODE: [u8; 9] = [0xb8, 0x3c, 0x00, 0x00, 0x00, 0x31, 0xff, 0x0f, 0x05];
/// Where the single segment is loaded.
const LOAD_ADDR: u64 = 0x40_0000;
const EHDR_LEN: u16 = 64;
const PHDR_LEN: u16 = 56;

/// A static x86-64 ELF executable of one segment that exits 0 at once: no dynamic
/// loader, no libc, no page beyond its first; its spawn is `execve` alone.
pub fn nop_elf() -> Vec<u8> {
    let code_at = u64::from(EHDR_LEN) + u64::from(PHDR_LEN);
    let len = code_at + NOP_CODE.len() as u64;
    let mut elf = Vec::with_capacity(len as usize);
    // e_ident: magic, 64-bit, little-endian, version 1, System V ABI, padding.
    elf.extend_from_slice(&[0x7f, b'E', b'L', b'F', 2, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    elf.extend_from_slice(&2u16.to_le_bytes()); // e_type: ET_EXEC
    elf.extend_from_slice(&0x3eu16.to_le_bytes()); // e_machine: x86-64
    elf.extend_from_slice(&1u32.to_le_bytes()); // e_version
    elf.extend_from_slice(&(LOAD_ADDR + code_at).to_le_bytes()); // e_entry
    elf.extend_from_slice(&u64::from(EHDR_LEN).to_le_bytes()); // e_phoff
    elf.extend_from_slice(&0u64.to_le_bytes()); // e_shoff
    elf.extend_from_slice(&0u32.to_le_bytes()); // e_flags
    elf.extend_from_slice(&EHDR_LEN.to_le_bytes()); // e_ehsize
    elf.extend_from_slice(&PHDR_LEN.to_le_bytes()); // e_phentsize
    elf.extend_from_slice(&1u16.to_le_bytes()); // e_phnum
    elf.extend_from_slice(&[0; 6]); // e_shentsize, e_shnum, e_shstrndx
    elf.extend_from_slice(&1u32.to_le_bytes()); // p_type: PT_LOAD
    elf.extend_from_slice(&5u32.to_le_bytes()); // p_flags: R + X
    elf.extend_from_slice(&0u64.to_le_bytes()); // p_offset
    elf.extend_from_slice(&LOAD_ADDR.to_le_bytes()); // p_vaddr
    elf.extend_from_slice(&LOAD_ADDR.to_le_bytes()); // p_paddr
    elf.extend_from_slice(&len.to_le_bytes()); // p_filesz
    elf.extend_from_slice(&len.to_le_bytes()); // p_memsz
    elf.extend_from_slice(&0x1000u64.to_le_bytes()); // p_align
    elf.extend_from_slice(&NOP_CODE);
    debug_assert_eq!(elf.len() as u64, len);
    elf
}

/// Microseconds one `cpuid` takes here (median of 5 rounds of 2000): on bare metal a
/// few dozen cycles; in a VM every one exits to the hypervisor.
#[cfg(target_arch = "x86_64")]
pub fn cpuid_us() -> Option<f64> {
    const ROUND: u32 = 2000;
    let mut rounds: Vec<f64> = (0..5)
        .map(|_| {
            let t = Instant::now();
            for leaf in 0..ROUND {
                // cpuid exists on every x86-64 CPU; leaves 0 and 1 always do.
                let r = std::arch::x86_64::__cpuid(leaf & 1);
                std::hint::black_box(r);
            }
            t.elapsed().as_secs_f64() * 1e6 / f64::from(ROUND)
        })
        .collect();
    rounds.sort_by(|a, b| a.total_cmp(b));
    Some(rounds[2])
}

/// Not measured off x86-64.
#[cfg(not(target_arch = "x86_64"))]
pub fn cpuid_us() -> Option<f64> {
    None
}

/// How this machine's idle CPUs wait: the cpuidle driver and, under `haltpoll` (a VM
/// guest), how long a CPU polls before it halts. A halted vCPU takes tens of
/// microseconds to wake, and a round trip through client, node and agent wakes three.
pub fn idle_policy() -> String {
    let read = |p: &str| std::fs::read_to_string(p).map(|s| s.trim().to_string());
    let driver =
        read("/sys/devices/system/cpu/cpuidle/current_driver").unwrap_or_else(|_| "none".into());
    match read("/sys/module/haltpoll/parameters/guest_halt_poll_ns") {
        Ok(ns) if driver == "haltpoll" => format!("cpuidle {driver}, guest_halt_poll_ns {ns}"),
        _ => format!("cpuidle {driver}"),
    }
}

/// One line on what a program start and a wake-up cost here, for the report's header.
pub fn machine_line() -> String {
    let cpuid = cpuid_us().map_or("n/a".into(), |us| format!("{us:.2} us"));
    format!("# machine: one cpuid {cpuid}; {}", idle_policy())
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn the_nop_elf_runs_and_exits_zero() {
        let dir = std::env::temp_dir().join(format!("dsec-bench-nop-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        let path = dir.join(NOP_FILE_NAME);
        std::fs::write(&path, nop_elf()).expect("write");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        let out = std::process::Command::new(&path)
            .output()
            .expect("spawn the nop");
        assert!(out.status.success(), "{:?}", out.status);
        assert!(out.stdout.is_empty() && out.stderr.is_empty());
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}
