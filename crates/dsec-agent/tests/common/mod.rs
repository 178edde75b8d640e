//! Test client for the agent: starts the real `dsec-agent` binary on a temp socket with a
//! temp root and speaks the frame protocol over a blocking unix socket.
#![allow(dead_code, clippy::unwrap_used)]

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use dsec_wire::agent::{ExitInfo, Reply, Request};
use dsec_wire::frame::{Frame, DATA_CHUNK};

/// A running agent process.
pub struct TestAgent {
    child: Child,
    pub sock: PathBuf,
    pub root: tempfile::TempDir,
    _sockdir: tempfile::TempDir,
}

impl TestAgent {
    pub fn start() -> TestAgent {
        let root = tempfile::tempdir().unwrap();
        let sockdir = tempfile::tempdir().unwrap();
        let sock = sockdir.path().join("agent.sock");
        let child = Command::new(env!("CARGO_BIN_EXE_dsec-agent"))
            .args(["serve", "--socket"])
            .arg(&sock)
            .arg("--root")
            .arg(root.path())
            .args(["--cwd", "/", "--env", "DSEC_TEST=1"])
            .stdin(Stdio::null())
            .env("DSEC_LOG", "warn")
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while UnixStream::connect(&sock).is_err() {
            assert!(Instant::now() < deadline, "agent did not start");
            std::thread::sleep(Duration::from_millis(10));
        }
        TestAgent {
            child,
            sock,
            root,
            _sockdir: sockdir,
        }
    }

    pub fn root(&self) -> &Path {
        self.root.path()
    }

    pub fn connect(&self, req: &Request) -> Conn {
        let s = UnixStream::connect(&self.sock).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let mut c = Conn { s };
        c.send(&Frame::json(req));
        c
    }

    /// Sends a request (and optional input data + Eof), returns all frames until close
    /// (see [`Conn::read_all`]).
    pub fn call(&self, req: &Request, input: Option<&[u8]>) -> Vec<Frame> {
        let mut c = self.connect(req);
        if let Some(data) = input {
            c.send_data(data);
        }
        c.read_all()
    }

    /// A request whose reply is one JSON frame.
    pub fn reply(&self, req: &Request) -> Reply {
        let frames = self.call(req, None);
        assert_eq!(frames.len(), 1, "expected one frame, got {frames:?}");
        json(&frames[0])
    }
}

impl Drop for TestAgent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One connection.
pub struct Conn {
    pub s: UnixStream,
}

impl Conn {
    pub fn send(&mut self, f: &Frame) {
        self.s.write_all(&f.to_bytes()).unwrap();
    }

    /// Sends `data` then `Eof`. The agent may answer an upload with an error before it
    /// has read everything and close: then the rest is not sent (as the node does).
    pub fn send_data(&mut self, data: &[u8]) {
        let frames = data
            .chunks(DATA_CHUNK)
            .map(|c| Frame::Data(c.to_vec()))
            .chain([Frame::Eof]);
        for f in frames {
            match self.s.write_all(&f.to_bytes()) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => return,
                Err(e) => panic!("send: {e}"),
            }
        }
    }

    /// The next frame, or None at close.
    pub fn next(&mut self) -> Option<Frame> {
        let mut header = [0u8; 5];
        match self.s.read_exact(&mut header) {
            Ok(()) => {}
            // A reset follows the agent closing with input unread (an early error).
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset
                ) =>
            {
                return None
            }
            Err(e) => panic!("read: {e}"),
        }
        let (tag, len) = Frame::parse_header(header).unwrap();
        let mut payload = vec![0u8; len];
        self.s.read_exact(&mut payload).unwrap();
        Some(Frame::from_parts(tag, payload).unwrap())
    }

    pub fn next_reply(&mut self) -> Reply {
        json(&self.next().expect("a frame"))
    }

    /// Every frame until the agent closes. The agent keeps a connection open for the next
    /// request after most requests, so this first says that none will follow (a
    /// half-close, which does not count as the node going away).
    pub fn read_all(&mut self) -> Vec<Frame> {
        let _ = self.s.shutdown(std::net::Shutdown::Write);
        let mut v = Vec::new();
        while let Some(f) = self.next() {
            v.push(f);
        }
        v
    }
}

pub fn json(f: &Frame) -> Reply {
    match f {
        Frame::Json(b) => serde_json::from_slice(b).unwrap(),
        other => panic!("expected JSON frame, got {other:?}"),
    }
}

/// Collected result of an exec.
#[derive(Debug)]
pub struct ExecOut {
    /// Reported by `Started`, which only a streaming exec sends.
    pub pid: Option<u32>,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub exit: ExitInfo,
    /// Order of output frames: (is_stdout, bytes).
    pub frames: Vec<(bool, Vec<u8>)>,
}

impl ExecOut {
    pub fn out(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }
    pub fn err(&self) -> String {
        String::from_utf8_lossy(&self.stderr).into_owned()
    }
}

pub fn parse_exec(frames: Vec<Frame>) -> ExecOut {
    let mut out = ExecOut {
        pid: None,
        stdout: vec![],
        stderr: vec![],
        exit: ExitInfo::default(),
        frames: vec![],
    };
    for f in frames {
        match f {
            Frame::Stdout(d) => {
                out.stdout.extend_from_slice(&d);
                out.frames.push((true, d));
            }
            Frame::Stderr(d) => {
                out.stderr.extend_from_slice(&d);
                out.frames.push((false, d));
            }
            f @ Frame::Json(_) => match json(&f) {
                Reply::Started { pid } if out.pid.is_none() && out.frames.is_empty() => {
                    out.pid = Some(pid)
                }
                Reply::Exited(e) => out.exit = e,
                other => panic!("unexpected reply {other:?}"),
            },
            other => panic!("unexpected frame {other:?}"),
        }
    }
    out
}

pub fn exec_json(agent: &TestAgent, spec: serde_json::Value, input: Option<&[u8]>) -> ExecOut {
    let req: Request = serde_json::from_value(spec).unwrap();
    parse_exec(agent.call(&req, input))
}

pub fn req(v: serde_json::Value) -> Request {
    serde_json::from_value(v).unwrap()
}

/// True if the process is gone or a zombie.
pub fn is_dead(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(s) => {
            let state = s
                .rsplit(')')
                .next()
                .unwrap_or("")
                .trim_start()
                .chars()
                .next();
            matches!(state, Some('Z') | Some('X'))
        }
    }
}

pub fn wait_until(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    f()
}
