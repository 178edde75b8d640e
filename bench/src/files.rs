//! File churn on a sandbox's disk: how fast files are created in a fresh directory, and
//! right after a tree of the same size was deleted (`rm -rf build && make`, a branch
//! switch). A journal-less ext4 walks every recently freed inode on each allocation; the
//! baselines are loop-mounted ext4 file systems with and without a journal, measured on
//! the host by the same script in the same run.

use std::path::Path;
use std::process::Command;

use anyhow::{bail, Context};
use dsec_e2e::{sh, Server};
use dsec_wire::v1::CreateSandboxRequest;

/// The measurement, run where the files go: prints "fresh_us after_us".
const SCRIPT: &str = r#"
import os, shutil, sys, time
base, n = sys.argv[1], int(sys.argv[2])
def make(d):
    os.makedirs(d)
    t = time.perf_counter()
    for i in range(n):
        open(f"{d}/f{i}", "w").close()
    return (time.perf_counter() - t) / n * 1e6
fresh = make(f"{base}/a/one")
shutil.rmtree(f"{base}/a/one")
time.sleep(1.5)  # ext4 counts deletions from the next second on
after = make(f"{base}/a/two")
shutil.rmtree(f"{base}/a")
print(f"{fresh:.2f} {after:.2f}")
"#;

/// One row: where, and microseconds per created file fresh and after a delete.
#[derive(Debug)]
pub struct Row {
    /// What was measured.
    pub name: String,
    /// Per file in a fresh directory.
    pub fresh_us: f64,
    /// Per file right after deleting as many.
    pub after_delete_us: f64,
}

fn parse(name: &str, out: &str) -> anyhow::Result<Row> {
    let mut it = out.split_whitespace().map(str::parse::<f64>);
    match (it.next(), it.next()) {
        (Some(Ok(fresh_us)), Some(Ok(after_delete_us))) => Ok(Row {
            name: name.into(),
            fresh_us,
            after_delete_us,
        }),
        _ => bail!("{name}: unexpected output {out:?}"),
    }
}

/// A loop-mounted ext4 like a sandbox disk, with or without a journal, on the host.
fn host_ext4(scratch: &Path, journal: bool, files: usize) -> anyhow::Result<Row> {
    let tag = if journal { "journal" } else { "nojournal" };
    let img = scratch.join(format!("{tag}.img"));
    let mnt = scratch.join(tag);
    std::fs::create_dir_all(&mnt)?;
    std::fs::File::create(&img)?.set_len(10 << 30)?;
    let features = if journal {
        "has_journal"
    } else {
        "^has_journal"
    };
    let ok = Command::new("mkfs.ext4")
        .args(["-q", "-F", "-m", "0", "-i", "16384", "-O", features])
        .args(["-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard"])
        .arg(&img)
        .status()?
        .success()
        && Command::new("mount")
            .args(["-o", "loop,noinit_itable"])
            .arg(&img)
            .arg(&mnt)
            .status()?
            .success();
    if !ok {
        bail!("cannot make the {tag} ext4 baseline");
    }
    let out = Command::new("python3")
        .args(["-c", SCRIPT])
        .arg(&mnt)
        .arg(files.to_string())
        .output();
    let _ = Command::new("umount").arg(&mnt).status();
    let _ = std::fs::remove_file(&img);
    let out = out?;
    if !out.status.success() {
        bail!("{tag}: {}", String::from_utf8_lossy(&out.stderr));
    }
    let name = format!(
        "host ext4 {}",
        if journal {
            "with journal"
        } else {
            "without journal"
        }
    );
    parse(&name, &String::from_utf8_lossy(&out.stdout))
}

/// The same script in a sandbox (its disk), then on the two host baselines.
pub async fn churn(server: &Server, files: usize) -> anyhow::Result<Vec<Row>> {
    let c = server.client();
    let sb = c.create_sandbox(CreateSandboxRequest::default()).await?;
    let script = SCRIPT.replace('\'', r"'\''");
    let r = c
        .exec(&sb.id, sh(&format!("python3 -c '{script}' /root {files}")))
        .await;
    c.delete_sandbox(&sb.id).await?;
    let r = r?;
    if r.exit.exit_code != Some(0) {
        bail!("in the sandbox: {}", r.stderr);
    }
    let mut rows = vec![parse("dsec sandbox disk", &r.stdout)?];
    let scratch = std::env::temp_dir().join("dsec-bench-files");
    std::fs::create_dir_all(&scratch).context("scratch dir")?;
    for journal in [false, true] {
        rows.push(host_ext4(&scratch, journal, files)?);
    }
    let _ = std::fs::remove_dir_all(&scratch);
    Ok(rows)
}
