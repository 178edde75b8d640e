//! Isolation level `vm`: a full machine (QEMU `q35`, TCG here) that boots the image's own
//! systemd from the image's layers and a writable disk, with the agent as that system's
//! service; its screen (PNG screenshots), keyboard (typed input) and pointer (a tablet)
//! through the API.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use dsec_e2e::{require_root, sh, wait_until, Server};
use dsec_wire::v1::*;
use dsec_wire::ErrorCode;

/// Host processes whose command line is QEMU's and names `needle`.
fn qemu_processes(needle: &str) -> usize {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            let cmdline = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
            let cmdline = String::from_utf8_lossy(&cmdline);
            cmdline.contains("qemu-system") && cmdline.contains(needle)
        })
        .count()
}

/// A decoded screenshot: RGB pixels, row by row.
struct Screen {
    width: usize,
    height: usize,
    rgb: Vec<u8>,
}

impl Screen {
    fn decode(png_bytes: &[u8]) -> Screen {
        assert!(png_bytes.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
        let mut reader = png::Decoder::new(png_bytes)
            .read_info()
            .expect("PNG header");
        let mut buf = vec![0; reader.output_buffer_size()];
        let info = reader.next_frame(&mut buf).expect("PNG frame");
        assert_eq!(info.color_type, png::ColorType::Rgb, "{info:?}");
        buf.truncate(info.buffer_size());
        Screen {
            width: info.width as usize,
            height: info.height as usize,
            rgb: buf,
        }
    }

    /// The pixels of text cell (`row`, `col`) of an 80x25 text screen.
    fn cell(&self, row: usize, col: usize) -> Vec<u8> {
        let (w, h) = (self.width / 80, self.height / 25);
        let mut out = Vec::with_capacity(w * h * 3);
        for y in row * h..(row + 1) * h {
            let start = (y * self.width + col * w) * 3;
            out.extend_from_slice(&self.rgb[start..start + w * 3]);
        }
        out
    }
}

/// Linux input event types and codes (linux/input-event-codes.h).
const EV_KEY: u16 = 1;
const EV_ABS: u16 = 3;
const BTN_LEFT: u16 = 0x110;

/// The input events (type, code, value) the guest's tablet reader has caught so far:
/// `struct input_event`, 24 bytes each on x86-64.
async fn tablet_events(c: &dsec_client::Client, id: &str) -> Vec<(u16, u16, i32)> {
    let Ok(r) = c
        .exec(id, sh("od -An -v -tx1 /tmp/tablet | tr -d ' \\n'"))
        .await
    else {
        return Vec::new();
    };
    let bytes: Vec<u8> = (0..r.stdout.len() / 2)
        .filter_map(|i| u8::from_str_radix(&r.stdout[2 * i..2 * i + 2], 16).ok())
        .collect();
    bytes
        .chunks_exact(24)
        .map(|e| {
            (
                u16::from_le_bytes([e[16], e[17]]),
                u16::from_le_bytes([e[18], e[19]]),
                i32::from_le_bytes([e[20], e[21], e[22], e[23]]),
            )
        })
        .collect()
}

/// The text of the VM's first virtual terminal (80x25 characters, row by row).
async fn terminal_text(c: &dsec_client::Client, id: &str) -> Option<String> {
    let r = c.exec(id, sh("cat /dev/vcs1")).await.ok()?;
    (r.exit.exit_code == Some(0) && r.stdout.len() == 80 * 25).then_some(r.stdout)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_vm_boots_its_images_system_runs_commands_and_shows_what_is_typed() {
    if !require_root() || !dsec_e2e::have_microvm() {
        return;
    }
    let Some(tar) = dsec_e2e::vm_tar() else {
        return;
    };
    let s = Server::start_with(
        "vm",
        true,
        &["--cgroup-parent", "dsec-vm", "--disk-pool", "0"],
    )
    .await
    .expect("server");
    s.ensure_base(None).await.expect("base image");
    let c = s.client();
    let health = c.health().await.expect("health");
    assert!(
        health
            .isolation
            .iter()
            .any(|l| l.isolation == Isolation::Vm),
        "health lists vm: {:?}",
        health.isolation
    );
    let file = tokio::fs::File::open(&tar).await.expect("VM image tar");
    c.upload_image("debian-vm", false, file)
        .await
        .expect("import the VM image");

    // What the level does not offer yet is refused before anything is made.
    let refused = c
        .create_sandbox(CreateSandboxRequest {
            image: Some("debian-vm".into()),
            isolation: Isolation::Vm,
            filesystem: FilesystemPolicy {
                writable: vec!["/tmp".into()],
                ..Default::default()
            },
            ..Default::default()
        })
        .await
        .expect_err("no file policy for a vm yet");
    assert_eq!(refused.code(), Some(ErrorCode::BadRequest), "{refused}");
    assert!(
        refused
            .to_string()
            .contains("isolation vm: filesystem.writable"),
        "{refused}"
    );

    let started = Instant::now();
    let sb = c
        .create_sandbox(CreateSandboxRequest {
            image: Some("debian-vm".into()),
            isolation: Isolation::Vm,
            ..Default::default()
        })
        .await
        .expect("create a vm");
    println!("vm ready in {:?} (TCG)", started.elapsed());
    assert_eq!(sb.state, SandboxState::Ready);
    assert_eq!(sb.isolation, Isolation::Vm);

    // The image's own system runs the machine, and the agent is its service, as root.
    let r = c
        .exec(
            &sb.id,
            sh("cat /proc/1/comm; systemctl is-active dsec-agent; id -u; hostname"),
        )
        .await
        .expect("exec");
    assert_eq!(
        r.stdout,
        format!("systemd\nactive\n0\n{}\n", sb.id),
        "{r:?}"
    );
    let r = c
        .exec(
            &sb.id,
            sh("timeout 120 systemctl is-system-running --wait; systemctl --failed --no-legend"),
        )
        .await
        .expect("exec");
    assert!(
        r.stdout.starts_with("running\n") || r.stdout.starts_with("degraded\n"),
        "{r:?}"
    );
    println!("system up in {:?}: {}", started.elapsed(), r.stdout.trim());

    // The first terminal's login prompt is on the screen.
    let before_text = wait_until(Duration::from_secs(90), || async {
        terminal_text(&c, &sb.id)
            .await
            .filter(|t| t.contains("login: "))
    })
    .await
    .expect("a login prompt on tty1");
    let before = Screen::decode(&c.screenshot(&sb.id).await.expect("screenshot"));
    assert_eq!((before.width, before.height), (720, 400), "VGA text mode");

    // Typed at the keyboard, the text reaches the terminal and the screen.
    const TYPED: &str = "nobel login";
    c.send_input(&sb.id, vec![InputEvent::Text { text: TYPED.into() }])
        .await
        .expect("type");
    let typed_line = format!("login: {TYPED}");
    let text = wait_until(Duration::from_secs(30), || async {
        terminal_text(&c, &sb.id)
            .await
            .filter(|t| t.contains(&typed_line))
    })
    .await
    .unwrap_or_else(|| panic!("{typed_line:?} on tty1; it showed {before_text:?}"));
    let after_png = c.screenshot(&sb.id).await.expect("screenshot");
    // For a reader of the CI log: what the VM's screen showed.
    if let Some(dir) = std::env::var_os("DSEC_CI_LOG_DIR") {
        let dir = PathBuf::from(dir).join("vm");
        if std::fs::create_dir_all(&dir).is_ok() {
            let _ = std::fs::write(dir.join("typed.png"), &after_png);
        }
    }
    let after = Screen::decode(&after_png);
    assert_ne!(before.rgb, after.rgb, "the screen changed");
    // Without OCR: every typed character's cell on the screen is drawn exactly as the
    // system drew the same character elsewhere on it (the banner, the prompt).
    let at = text.find(&typed_line).expect("typed line") + "login: ".len();
    let typed_cells = at..at + TYPED.len();
    for (i, ch) in TYPED.chars().enumerate() {
        let pos = at + i;
        let reference = text
            .char_indices()
            .find(|(j, c)| *c == ch && !typed_cells.contains(j))
            .map(|(j, _)| j)
            .unwrap_or_else(|| panic!("{ch:?} drawn elsewhere on {text:?}"));
        assert_eq!(
            after.cell(pos / 80, pos % 80),
            after.cell(reference / 80, reference % 80),
            "typed {ch:?} at cell {pos} is drawn as the system's {ch:?} at cell {reference}"
        );
        if ch != ' ' {
            assert_ne!(
                before.cell(pos / 80, pos % 80),
                after.cell(pos / 80, pos % 80),
                "cell {pos} was blank before typing"
            );
        }
    }
    // A chord: ctrl+u clears the login prompt's line.
    c.send_input(
        &sb.id,
        vec![InputEvent::Keys {
            keys: vec!["ctrl".into(), "u".into()],
        }],
    )
    .await
    .expect("chord");
    wait_until(Duration::from_secs(30), || async {
        terminal_text(&c, &sb.id)
            .await
            .filter(|t| !t.contains(&typed_line))
    })
    .await
    .expect("ctrl+u erased the typed text");

    // Bad input is refused with its reason.
    let err = c
        .send_input(&sb.id, vec![InputEvent::Text { text: "é".into() }])
        .await
        .expect_err("not on a US keyboard");
    assert_eq!(err.code(), Some(ErrorCode::BadRequest), "{err}");
    assert!(err.to_string().contains("cannot type"), "{err}");

    // The pointer: a move and a click on screen pixels reach the guest's tablet as the
    // absolute position a system maps back to those pixels, then the button's press and
    // release. Read from the tablet's event device inside the guest, an event per
    // write (dd, unbuffered).
    c.start_process(
        &sb.id,
        dsec_e2e::background(Command::Shell(
            "ev=$(grep -A6 'Virtio Tablet' /proc/bus/input/devices | grep -o 'event[0-9]*' | head -1); \
             exec 3< /dev/input/$ev && touch /tmp/tablet.open && exec dd bs=24 status=none <&3 > /tmp/tablet"
                .into(),
        )),
    )
    .await
    .expect("a reader of the tablet");
    wait_until(Duration::from_secs(30), || async {
        let r = c.exec(&sb.id, sh("test -e /tmp/tablet.open")).await.ok()?;
        (r.exit.exit_code == Some(0)).then_some(())
    })
    .await
    .expect("the tablet's event device is open in the guest");
    let (x, y) = (100u64, 50u64);
    c.send_input(
        &sb.id,
        vec![InputEvent::Click {
            button: MouseButton::Left,
            x: Some(x as u32),
            y: Some(y as u32),
            count: None,
        }],
    )
    .await
    .expect("click");
    // What a system reading the tablet sees (ABS range 0..=0x7fff), pixel for pixel.
    let pixel = |abs: i32, size: usize| abs as u64 * (size as u64 - 1) / 0x7fff;
    let seen = wait_until(Duration::from_secs(30), || async {
        let events = tablet_events(&c, &sb.id).await;
        let abs = |code| events.iter().rev().find(|e| e.0 == EV_ABS && e.1 == code);
        let buttons: Vec<i32> = events
            .iter()
            .filter(|e| e.0 == EV_KEY && e.1 == BTN_LEFT)
            .map(|e| e.2)
            .collect();
        let (ax, ay) = (abs(0)?.2, abs(1)?.2);
        (buttons == [1, 0]).then_some((pixel(ax, before.width), pixel(ay, before.height)))
    })
    .await;
    let Some(seen) = seen else {
        let events = tablet_events(&c, &sb.id).await;
        panic!("no move and click on the tablet; it saw {events:?}");
    };
    assert_eq!(seen, (x, y), "the click's position, back in screen pixels");
    let err = c
        .send_input(
            &sb.id,
            vec![InputEvent::Move {
                x: before.width as u32,
                y: 0,
            }],
        )
        .await
        .expect_err("off the screen");
    assert_eq!(err.code(), Some(ErrorCode::BadRequest), "{err}");
    assert!(err.to_string().contains("off the 720x400 screen"), "{err}");

    // Paused (its state saved, QEMU gone) and resumed, the system and its screen are
    // where they were.
    c.exec(&sb.id, sh("echo kept > /root/mark"))
        .await
        .expect("write");
    c.pause_sandbox(&sb.id).await.expect("pause");
    assert_eq!(qemu_processes(&sb.id), 0, "a paused vm holds no QEMU");
    c.resume_sandbox(&sb.id).await.expect("resume");
    let r = c
        .exec(&sb.id, sh("cat /root/mark; systemctl is-system-running"))
        .await
        .expect("exec after resume");
    assert!(r.stdout.starts_with("kept\n"), "{r:?}");
    let resumed = Screen::decode(&c.screenshot(&sb.id).await.expect("screenshot"));
    assert_eq!((resumed.width, resumed.height), (720, 400));

    // A container has no screen.
    let plain = c
        .create_sandbox(CreateSandboxRequest::default())
        .await
        .expect("a container");
    let err = c.screenshot(&plain.id).await.expect_err("no screen");
    assert_eq!(err.code(), Some(ErrorCode::BadRequest), "{err}");
    assert!(err.to_string().contains("no screen"), "{err}");

    for id in [&sb.id, &plain.id] {
        c.delete_sandbox(id).await.expect("delete");
    }
    assert_eq!(qemu_processes(&sb.id), 0, "QEMU ended with its sandbox");
    assert!(dsec_e2e::host::cgroup_dirs(&sb.id).is_empty());
}
