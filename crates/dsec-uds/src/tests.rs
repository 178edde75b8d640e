use super::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The tests read this process's epoll registrations: one test at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A connected pair of quiet streams.
fn pair() -> (QuietStream, QuietStream) {
    let (a, b) = std::os::unix::net::UnixStream::pair().expect("socketpair");
    (
        QuietStream::from_std(a).expect("a"),
        QuietStream::from_std(b).expect("b"),
    )
}

/// Every epoll registration of this process: (target fd, event mask).
fn registrations() -> Vec<(i32, u32)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc/self/fd")
        .expect("fd dir")
        .flatten()
    {
        let Ok(target) = std::fs::read_link(entry.path()) else {
            continue;
        };
        if target.to_string_lossy() != "anon_inode:[eventpoll]" {
            continue;
        }
        let info = std::fs::read_to_string(format!(
            "/proc/self/fdinfo/{}",
            entry.file_name().to_string_lossy()
        ))
        .unwrap_or_default();
        for line in info.lines().filter(|l| l.starts_with("tfd:")) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let tfd = fields.get(1).and_then(|v| v.parse().ok()).unwrap_or(-1);
            let events = fields
                .iter()
                .position(|f| *f == "events:")
                .and_then(|i| fields.get(i + 1))
                .and_then(|v| u32::from_str_radix(v, 16).ok())
                .unwrap_or(0);
            out.push((tfd, events));
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}

fn listens_for_space(fd: i32) -> bool {
    registrations()
        .iter()
        .any(|&(t, ev)| t == fd && ev & libc::EPOLLOUT as u32 != 0)
}

fn any_listens_for_space() -> bool {
    registrations()
        .iter()
        .any(|&(_, ev)| ev & libc::EPOLLOUT as u32 != 0)
}

#[tokio::test(flavor = "current_thread")]
async fn the_socket_is_registered_for_reading_only() {
    let _one = SERIAL.lock().await;
    let (a, b) = pair();
    let (fd_a, fd_b) = (a.as_raw_fd(), b.as_raw_fd());
    let (mut ra, mut wa) = a.into_split();
    let (mut rb, mut wb) = b.into_split();
    wa.write_all(b"ping").await.expect("write");
    let mut got = [0u8; 4];
    rb.read_exact(&mut got).await.expect("read");
    assert_eq!(&got, b"ping");
    wb.write_all(b"pong").await.expect("write");
    ra.read_exact(&mut got).await.expect("read");
    assert_eq!(&got, b"pong");
    let regs = registrations();
    for fd in [fd_a, fd_b] {
        let events: Vec<u32> = regs.iter().filter(|r| r.0 == fd).map(|r| r.1).collect();
        assert_eq!(events.len(), 1, "one registration of fd {fd}: {regs:?}");
        assert_ne!(events[0] & libc::EPOLLIN as u32, 0, "fd {fd} readable");
        assert_eq!(events[0] & libc::EPOLLOUT as u32, 0, "fd {fd} not writable");
    }
}

/// Writing more than the socket holds waits for the reader (on a registration for
/// space), delivers every byte in order, and leaves no registration for space behind.
#[tokio::test(flavor = "current_thread")]
async fn a_full_socket_waits_for_space_then_stops_listening_for_it() {
    let _one = SERIAL.lock().await;
    let (a, b) = pair();
    let fd_a = a.as_raw_fd();
    let (_ra, mut wa) = a.into_split();
    let (mut rb, _wb) = b.into_split();
    let big: Vec<u8> = (0..8 * 1024 * 1024).map(|i| (i % 251) as u8).collect();
    let mut writer = std::pin::pin!(async {
        wa.write_all(&big).await.expect("write_all");
        wa.shutdown().await.expect("shutdown");
    });
    tokio::select! {
        () = &mut writer => panic!("the socket took 8 MiB without a reader"),
        () = tokio::time::sleep(std::time::Duration::from_millis(50)) => {}
    }
    assert!(any_listens_for_space(), "a full socket waits for space");
    assert!(!listens_for_space(fd_a), "on a duplicate descriptor");
    let reader = async {
        let mut got = Vec::new();
        rb.read_to_end(&mut got).await.expect("read_to_end");
        got
    };
    let ((), got) = tokio::join!(writer, reader);
    assert_eq!(got.len(), big.len());
    assert!(got == big, "bytes lost or reordered");
    assert!(!any_listens_for_space(), "{:?}", registrations());
}

#[tokio::test(flavor = "current_thread")]
async fn a_closed_peer_is_end_of_file_and_a_write_error() {
    let _one = SERIAL.lock().await;
    let (a, b) = pair();
    let (mut ra, mut wa) = a.into_split();
    drop(b);
    let mut buf = [0u8; 8];
    assert_eq!(ra.read(&mut buf).await.expect("read"), 0, "end of file");
    // No SIGPIPE (it would kill the test): a plain error.
    let err = wa.write_all(&[0u8; 1024]).await.expect_err("peer gone");
    assert_eq!(err.raw_os_error(), Some(libc::EPIPE), "{err}");
}

/// A vectored write is one `sendmsg`: pieces arrive in order, and one larger than the
/// socket waits for space as a plain write does.
#[tokio::test(flavor = "current_thread")]
async fn vectored_writes_keep_the_order_of_their_pieces() {
    let _one = SERIAL.lock().await;
    let (a, b) = pair();
    let (_ra, mut wa) = a.into_split();
    let (mut rb, _wb) = b.into_split();
    assert!(wa.is_write_vectored());
    let big: Vec<u8> = (0..3 * 1024 * 1024).map(|i| (i % 249) as u8).collect();
    let pieces: [&[u8]; 4] = [b"head", &big, b"", b"tail"];
    let writer = async {
        let mut slices: Vec<std::io::IoSlice<'_>> =
            pieces.iter().map(|p| std::io::IoSlice::new(p)).collect();
        let mut rest = &mut slices[..];
        let mut calls = 0;
        while !rest.is_empty() {
            let n = wa.write_vectored(rest).await.expect("write_vectored");
            assert!(n > 0);
            std::io::IoSlice::advance_slices(&mut rest, n);
            calls += 1;
        }
        wa.shutdown().await.expect("shutdown");
        calls
    };
    let reader = async {
        let mut got = Vec::new();
        rb.read_to_end(&mut got).await.expect("read_to_end");
        got
    };
    let (calls, got) = tokio::join!(writer, reader);
    assert!(calls > 1, "3 MiB does not fit a socket in one call");
    assert!(got == pieces.concat(), "bytes lost or reordered");
    assert!(!any_listens_for_space(), "{:?}", registrations());
}
