//! Disk tests on real loop devices and real ext4 mounts. They need root and ext4; with
//! `CI=true` a missing prerequisite fails the test instead of skipping it.

use std::io::Write;
use std::path::{Path, PathBuf};

use dsec_disk::{
    release, release_dir, upper_dir, work_dir, Disk, DiskConfig, DiskError, Disks, MountMode,
};

fn usable() -> bool {
    let root = nix::unistd::geteuid().is_root();
    let ext4 = std::fs::read_to_string("/proc/filesystems")
        .map(|s| s.lines().any(|l| l.trim_end().ends_with("ext4")))
        .unwrap_or(false);
    let loop_ctl = Path::new("/dev/loop-control").exists();
    let ok = root && ext4 && loop_ctl;
    let missing = (!ok).then(|| {
        format!("disk tests need root, ext4, /dev/loop-control (root={root}, ext4={ext4}, loop-control={loop_ctl})")
    });
    dsec_testkit::unavailable("disk tests", missing).is_none()
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("dsec-disk-test-{name}"));
    if dir.exists() {
        // A previous failed run may have left mounts.
        for e in std::fs::read_dir(dir.join("root/pool"))
            .into_iter()
            .flatten()
            .flatten()
        {
            let _ = release_dir(&e.path());
        }
        for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let _ = release_dir(&e.path());
        }
        std::fs::remove_dir_all(&dir).expect("clear scratch dir");
    }
    std::fs::create_dir_all(&dir).expect("mkdir scratch");
    dir
}

fn is_mountpoint(p: &Path) -> bool {
    let want = p.to_str().expect("utf-8 path");
    std::fs::read_to_string("/proc/self/mountinfo")
        .expect("mountinfo")
        .lines()
        .any(|l| l.split(' ').nth(4) == Some(want))
}

/// Loop devices whose backing file lies under `dir`.
fn loops_under(dir: &Path) -> Vec<String> {
    let prefix = dir.to_str().expect("utf-8 path");
    std::fs::read_dir("/sys/block")
        .expect("/sys/block")
        .flatten()
        .filter_map(|e| {
            let f = std::fs::read_to_string(e.path().join("loop/backing_file")).ok()?;
            f.starts_with(prefix)
                .then(|| e.file_name().to_string_lossy().into_owned())
        })
        .collect()
}

fn statvfs_mb(p: &Path) -> (u64, u64) {
    let st = nix::sys::statvfs::statvfs(p).expect("statvfs");
    let f = st.fragment_size();
    ((st.blocks() * f) >> 20, (st.blocks_available() * f) >> 20)
}

fn wait_pooled(d: &Disks, n: usize) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while d.pooled() < n {
        assert!(
            std::time::Instant::now() < deadline,
            "pool never reached {n}"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// Whether the disk's file system is attached anywhere in this mount namespace.
fn in_mount_table(disk: &Disk) -> bool {
    let dir = disk.dir().to_str().expect("utf-8 path").to_string();
    std::fs::read_to_string("/proc/self/mountinfo")
        .expect("mountinfo")
        .lines()
        .any(|l| l.split(' ').nth(4).is_some_and(|m| m.starts_with(&dir)))
}

fn open(dir: &Path, default_mb: u64, pool_size: usize, mode: MountMode) -> Disks {
    let disks = Disks::open(DiskConfig {
        root: dir.join("root"),
        default_mb,
        pool_size,
        mount_mode: Some(mode),
    })
    .expect("open");
    assert_eq!(disks.mount_mode(), mode);
    disks
}

const MODES: [MountMode; 2] = [MountMode::Detached, MountMode::Attached];

#[test]
fn a_full_disk_gives_enospc_and_release_frees_everything() {
    if !usable() {
        return;
    }
    for mode in MODES {
        let dir = scratch(&format!("enospc-{mode:?}"));
        let disks = open(&dir, 64, 2, mode);
        wait_pooled(&disks, 2);
        let disk = disks.provision(64, &dir.join("sb1")).expect("provision");
        let root = disk.root();
        match mode {
            MountMode::Attached => assert!(is_mountpoint(&root), "attached at DIR/mnt"),
            MountMode::Detached => {
                assert!(
                    !in_mount_table(&disk),
                    "a detached disk is in no mount table"
                );
                assert!(disk.mount_fd().is_some());
            }
        }
        assert!(upper_dir(&root).is_dir() && work_dir(&root).is_dir());
        let (total, avail) = statvfs_mb(&root);
        assert!(
            (56..=64).contains(&total),
            "size {total} MiB for a 64 MiB disk"
        );
        assert!(avail > 40, "only {avail} MiB free on a fresh disk");
        // The image is sparse: a fresh disk costs a few MiB of host disk, not 64.
        let used = std::fs::metadata(disk.dir().join("disk.img")).map(|m| {
            use std::os::unix::fs::MetadataExt;
            (m.blocks() * 512) >> 20
        });
        assert!(used.expect("stat image") < 16, "image not sparse");

        // Fill it: the write fails with ENOSPC after about the disk's size, not before.
        let mut f = std::fs::File::create(upper_dir(&root).join("fill")).expect("create");
        let chunk = vec![0xa5u8; 1 << 20];
        let mut written = 0u64;
        let err = loop {
            match f.write_all(&chunk).and_then(|()| f.sync_data()) {
                Ok(()) => written += 1,
                Err(e) => break e,
            }
            assert!(written < 200, "wrote {written} MiB into a 64 MiB disk");
        };
        assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
        assert!(written >= 40, "ENOSPC after only {written} MiB");
        drop(f);

        assert_eq!(
            loops_under(&dir).len(),
            3,
            "two pooled disks and one in use"
        );
        let sb1 = disk.dir().to_path_buf();
        release(disk).expect("release");
        assert!(!sb1.exists());
        release_dir(&sb1).expect("release_dir is idempotent");
        drop(disks);
        // Dropping the manager releases the pool; autoclear frees the loop devices.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while !loops_under(&dir).is_empty() {
            assert!(
                std::time::Instant::now() < deadline,
                "loop devices left: {:?}",
                loops_under(&dir)
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert!(std::fs::read_dir(dir.join("root/pool"))
            .expect("pool dir")
            .next()
            .is_none());
    }
}

#[test]
fn other_sizes_are_made_on_demand_and_concurrently() {
    if !usable() {
        return;
    }
    for mode in MODES {
        let dir = scratch(&format!("sizes-{mode:?}"));
        let disks = open(&dir, 32, 0, mode);
        let made: Vec<Disk> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8u64)
                .map(|i| {
                    let (disks, dir) = (&disks, &dir);
                    s.spawn(move || {
                        let size = if i % 2 == 0 { 32 } else { 128 };
                        let disk = disks
                            .provision(size, &dir.join(format!("sb{i}")))
                            .expect("provision");
                        let (total, _) = statvfs_mb(&disk.root());
                        assert!(
                            total <= size && total + size / 16 + 2 >= size,
                            "{total} MiB for {size} MiB"
                        );
                        disk
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("thread"))
                .collect()
        });
        assert_eq!(loops_under(&dir).len(), 8, "one loop device per disk");
        for disk in made {
            release(disk).expect("release");
        }
        assert!(matches!(
            disks.provision(1, &dir.join("tiny")),
            Err(DiskError::TooSmall(1))
        ));
        assert!(
            !dir.join("tiny").exists(),
            "failed provision leaves nothing"
        );
    }
}

#[test]
fn reopening_after_a_crash_empties_the_old_pool() {
    if !usable() {
        return;
    }
    // Only attached disks outlive their process; detached ones die with it.
    let dir = scratch("crash");
    let disks = open(&dir, 32, 3, MountMode::Attached);
    wait_pooled(&disks, 3);
    // A crash: the manager never runs its destructor; three mounted disks stay behind.
    std::mem::forget(disks);
    let left: Vec<_> = std::fs::read_dir(dir.join("root/pool"))
        .expect("pool")
        .flatten()
        .map(|e| e.path())
        .collect();
    assert_eq!(left.len(), 3);
    assert!(left.iter().all(|p| is_mountpoint(&p.join("mnt"))));
    let disks = open(&dir, 32, 0, MountMode::Detached);
    assert!(left.iter().all(|p| !p.exists()), "old pool entries removed");
    assert_eq!(disks.pooled(), 0);
}

#[test]
fn lightly_used_disks_are_recycled_empty_and_heavy_ones_released() {
    if !usable() {
        return;
    }
    for mode in MODES {
        let dir = scratch(&format!("recycle-{mode:?}"));
        let disks = open(&dir, 128, 1, mode);
        wait_pooled(&disks, 1);

        // A sandbox that wrote a little: recycled into the pool, with nothing of it left.
        let light = disks.provision(128, &dir.join("light")).expect("provision");
        std::fs::write(upper_dir(&light.root()).join("secret"), b"tenant A").expect("write");
        std::fs::create_dir_all(work_dir(&light.root()).join("work")).expect("mkdir");
        // What the node keeps beside upper and work (a commit's index) goes too.
        std::fs::write(light.root().join("node-file"), b"tenant A's paths").expect("write");
        wait_pooled(&disks, 1); // refilled after the provision
        let loops = loops_under(&dir).len();
        assert!(
            disks.recycle(light).expect("recycle"),
            "a light disk is recycled"
        );
        assert!(!dir.join("light").exists());
        assert_eq!(disks.pooled(), 2);
        assert_eq!(
            loops_under(&dir).len(),
            loops,
            "no loop device released or made"
        );
        // Whoever gets it next (the pool is last in, first out) finds empty directories.
        let next = disks.provision(128, &dir.join("next")).expect("provision");
        for d in [upper_dir(&next.root()), work_dir(&next.root())] {
            assert_eq!(
                std::fs::read_dir(&d).expect("read").count(),
                0,
                "{d:?} not empty"
            );
        }
        assert!(
            !next.root().join("node-file").exists(),
            "a file beside upper"
        );

        // A sandbox that wrote a lot: released, not emptied file by file.
        let mut f = std::fs::File::create(upper_dir(&next.root()).join("big")).expect("create");
        for _ in 0..80 {
            f.write_all(&[1u8; 1 << 20]).expect("write");
        }
        f.sync_all().expect("sync");
        drop(f);
        let pooled = disks.pooled();
        assert!(
            !disks.recycle(next).expect("recycle"),
            "a heavy disk is released"
        );
        assert!(!dir.join("next").exists());
        assert_eq!(disks.pooled(), pooled);

        // A disk of another size never enters the default pool.
        let other = disks.provision(64, &dir.join("other")).expect("provision");
        assert!(!disks.recycle(other).expect("recycle"));
        assert!(!dir.join("other").exists());
    }
}

#[test]
fn while_disks_come_back_the_pool_makes_no_new_ones() {
    if !usable() {
        return;
    }
    let dir = scratch("churn");
    let disks = open(&dir, 128, 4, MountMode::Detached);
    wait_pooled(&disks, 4);
    let entries = || {
        let mut v: Vec<String> = std::fs::read_dir(dir.join("root/pool"))
            .expect("pool dir")
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    // A delete brings a disk back; two creates right after leave the pool below its
    // size, but disks are coming back, so it waits for them rather than making disks
    // that would go again.
    let a = disks.provision(128, &dir.join("a")).expect("provision");
    wait_pooled(&disks, 4);
    assert!(disks.recycle(a).expect("recycle"));
    let b = disks.provision(128, &dir.join("b")).expect("provision");
    let c = disks.provision(128, &dir.join("c")).expect("provision");
    let after_creates = entries();
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert_eq!(disks.pooled(), 3, "no disk made while they come back");
    assert_eq!(entries(), after_creates);
    release(c).expect("release");
    // Once none came back for a while, it fills up again.
    wait_pooled(&disks, 4);
    // And a pool that runs dry refills at once, recycling or not (the wait for returning
    // disks is 2 s; making one takes a fraction of that).
    assert!(disks.recycle(b).expect("recycle"));
    let recycled = std::time::Instant::now();
    let taken: Vec<Disk> = (0..5)
        .map(|i| {
            disks
                .provision(128, &dir.join(format!("t{i}")))
                .expect("provision")
        })
        .collect();
    wait_pooled(&disks, 1);
    assert!(
        recycled.elapsed() < std::time::Duration::from_millis(1500),
        "a dry pool waited for returning disks: {:?}",
        recycled.elapsed()
    );
    for d in taken {
        release(d).expect("release");
    }
}

/// The ext4 superblock's journal size in bytes, or `None` without `has_journal`.
fn journal_bytes(img: &Path) -> Option<u64> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(img).expect("open image");
    let mut sb = [0u8; 1024];
    f.read_exact_at(&mut sb, 1024).expect("read superblock");
    let u32_at = |o: usize| u32::from_le_bytes(sb[o..o + 4].try_into().expect("4 bytes"));
    assert_eq!(
        u16::from_le_bytes([sb[0x38], sb[0x39]]),
        0xEF53,
        "ext4 magic"
    );
    const HAS_JOURNAL: u32 = 0x4;
    if u32_at(0x5C) & HAS_JOURNAL == 0 {
        return None;
    }
    // s_jnl_blocks[17]: the journal inode's i_block, then i_size_high and i_size.
    let (high, low) = (u32_at(0x10C + 15 * 4), u32_at(0x10C + 16 * 4));
    Some((u64::from(high) << 32) | u64::from(low))
}

#[test]
fn disks_have_a_small_journal_and_old_templates_go() {
    if !usable() {
        return;
    }
    let dir = scratch("journal");
    // A template an older node made, of another format.
    std::fs::create_dir_all(dir.join("root/templates")).expect("mkdir");
    std::fs::write(dir.join("root/templates/128.img"), b"old").expect("old template");
    let disks = open(&dir, 128, 1, MountMode::Detached);
    assert!(
        !dir.join("root/templates/128.img").exists(),
        "old template removed"
    );
    let disk = disks.provision(128, &dir.join("d")).expect("provision");
    let journal = journal_bytes(&disk.dir().join("disk.img")).expect("has a journal");
    assert_eq!(journal, 4 << 20, "a 4 MiB journal");
    // Its file system works with it: files come and go.
    let upper = upper_dir(&disk.root());
    std::fs::write(upper.join("a"), b"x").expect("write");
    std::fs::remove_file(upper.join("a")).expect("remove");
    release(disk).expect("release");
}

#[test]
fn many_disks_made_at_once_all_get_a_loop_device() {
    if !usable() {
        return;
    }
    // A burst of creates with the pool empty: each makes its disk, all at the same time.
    let dir = scratch("burst");
    let disks = open(&dir, 16, 0, MountMode::Detached);
    let made: Vec<Disk> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..64)
            .map(|i| {
                let (disks, dir) = (&disks, &dir);
                s.spawn(move || disks.provision(16, &dir.join(format!("b{i}"))))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("thread").expect("provision"))
            .collect()
    });
    assert_eq!(loops_under(&dir).len(), 64, "one loop device each");
    for d in made {
        release(d).expect("release");
    }
}

#[test]
fn probing_picks_a_mode_whose_disks_work() {
    if !usable() {
        return;
    }
    let dir = scratch("probe");
    let disks = Disks::open(DiskConfig {
        root: dir.join("root"),
        default_mb: 32,
        pool_size: 0,
        mount_mode: None,
    })
    .expect("open");
    let disk = disks.provision(32, &dir.join("sb")).expect("provision");
    assert_eq!(
        disk.mount_fd().is_some(),
        disks.mount_mode() == MountMode::Detached
    );
    std::fs::write(upper_dir(&disk.root()).join("x"), b"x").expect("write");
    release(disk).expect("release");
    let leftovers: Vec<_> = std::fs::read_dir(dir.join("root"))
        .expect("root")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("probe"))
        .collect();
    assert!(leftovers.is_empty(), "probe left {leftovers:?}");
}
