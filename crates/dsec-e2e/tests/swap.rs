//! Pause with a swap file the node sets up: reclaim takes back anonymous memory too, and
//! it comes back intact. Its own test binary: it turns swap on and off for the whole host,
//! which must not overlap other tests (cargo runs test binaries one at a time).

use std::time::Duration;

use dsec_e2e::{require_root, sh, Server};
use dsec_wire::v1::*;

#[tokio::test(flavor = "multi_thread")]
async fn with_a_node_swap_file_pause_takes_back_anonymous_memory_too() {
    if !require_root() {
        return;
    }
    let swapfile = std::env::temp_dir().join("dsec-e2e-swap/swapfile");
    let swap_arg = swapfile.display().to_string();
    let mut s = Server::start_with(
        "pause-swap",
        true,
        &[
            "--swap-file",
            &swap_arg,
            "--swap-mb",
            "512",
            "--disk-pool",
            "2",
            // The shared `pause` server it takes the base image from holds the default.
            "--cgroup-parent",
            "dsec-pause-swap",
        ],
    )
    .await
    .expect("server");
    s.ensure_base(Some(Server::shared("pause")))
        .await
        .expect("base");
    let c = s.client();
    let sb = c
        .create_sandbox(CreateSandboxRequest {
            resources: Resources {
                memory_mb: Some(512),
                ..Default::default()
            },
            ..Default::default()
        })
        .await
        .expect("create");
    // 128 MiB of anonymous memory whose checksum is taken before and after.
    let hog = "import hashlib, os, time\n\
        b = bytearray(os.urandom(1 << 20)) * 128\n\
        open('/tmp/h1', 'w').write(hashlib.sha256(b).hexdigest())\n\
        while not os.path.exists('/tmp/go'): time.sleep(0.05)\n\
        open('/tmp/h2', 'w').write(hashlib.sha256(b).hexdigest())\n\
        time.sleep(1000)\n";
    c.write_file(&sb.id, "/tmp/hog.py", None, hog)
        .await
        .expect("write");
    c.start_process(
        &sb.id,
        dsec_e2e::background(Command::Argv(vec!["python3".into(), "/tmp/hog.py".into()])),
    )
    .await
    .expect("hog");
    let ready = dsec_e2e::wait_until(Duration::from_secs(30), || async {
        c.exec(&sb.id, sh("test -s /tmp/h1"))
            .await
            .ok()
            .filter(|r| r.exit.exit_code == Some(0))
    })
    .await;
    assert!(ready.is_some(), "hog never allocated");

    let p = c.pause_sandbox(&sb.id).await.expect("pause");
    assert!(p.memory_before_bytes > 128 << 20, "{p:?}");
    assert!(
        p.memory_after_bytes * 5 < p.memory_before_bytes,
        "at least 80% back: {} -> {}",
        p.memory_before_bytes,
        p.memory_after_bytes
    );
    c.resume_sandbox(&sb.id).await.expect("resume");
    let r = c
        .exec(
            &sb.id,
            sh("touch /tmp/go; for i in $(seq 200); do test -s /tmp/h2 && break; sleep 0.05; done; cmp /tmp/h1 /tmp/h2 && echo same"),
        )
        .await
        .expect("exec");
    assert_eq!(r.stdout, "same\n", "memory intact after swap-in: {r:?}");
    c.delete_sandbox(&sb.id).await.expect("delete");
    s.kill();
    // The node leaves its swap on (production); the test host goes back to none.
    let path = std::ffi::CString::new(swap_arg.as_bytes()).expect("path");
    // SAFETY: swapoff with a valid NUL-terminated path.
    let rc = unsafe { libc::swapoff(path.as_ptr()) };
    assert_eq!(rc, 0, "swapoff: {}", std::io::Error::last_os_error());
    let _ = std::fs::remove_file(&swapfile);
}
