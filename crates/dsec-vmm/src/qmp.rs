//! A blocking client of QEMU's machine protocol (QMP): JSON lines on the VM's unix
//! socket, with descriptors passed alongside where a command takes one (`getfd`).
//!
//! Asynchronous events (lines with an `event` member) are skipped; each command waits
//! for its `return` or `error` line.

use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};

use crate::VmmError;

/// One QMP session.
#[derive(Debug)]
pub struct Qmp {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

fn qmp_err(what: impl std::fmt::Display) -> VmmError {
    VmmError::Start(format!("QMP: {what}"))
}

impl Qmp {
    /// Connects to the socket at `path` and leaves the greeting's capability
    /// negotiation mode; every reply is awaited at most `timeout`.
    pub fn connect(path: &Path, timeout: Duration) -> Result<Self, VmmError> {
        let stream = UnixStream::connect(path)?;
        stream.set_read_timeout(Some(timeout))?;
        let writer = stream.try_clone()?;
        let mut qmp = Self {
            reader: BufReader::new(stream),
            writer,
        };
        let greeting = qmp.read_line()?;
        if greeting.get("QMP").is_none() {
            return Err(qmp_err(format!("unexpected greeting {greeting}")));
        }
        qmp.execute("qmp_capabilities", None)?;
        Ok(qmp)
    }

    fn read_line(&mut self) -> Result<Value, VmmError> {
        let mut line = String::new();
        if self.reader.read_line(&mut line)? == 0 {
            return Err(qmp_err("QEMU closed the socket"));
        }
        serde_json::from_str(&line).map_err(|e| qmp_err(format!("{e}: {line:?}")))
    }

    fn reply(&mut self, command: &str) -> Result<Value, VmmError> {
        loop {
            let v = self.read_line()?;
            if v.get("event").is_some() {
                continue;
            }
            if let Some(r) = v.get("return") {
                return Ok(r.clone());
            }
            if let Some(e) = v.get("error") {
                return Err(qmp_err(format!("{command}: {e}")));
            }
        }
    }

    /// Runs `command` with `arguments`; its `return` value.
    pub fn execute(&mut self, command: &str, arguments: Option<Value>) -> Result<Value, VmmError> {
        let mut msg = json!({ "execute": command });
        if let Some(a) = arguments {
            msg["arguments"] = a;
        }
        let mut bytes = serde_json::to_vec(&msg).map_err(qmp_err)?;
        bytes.push(b'\n');
        self.writer.write_all(&bytes)?;
        self.reply(command)
    }

    /// Hands QEMU the descriptor `fd` under `name` (`getfd`), for a later `fd:name`.
    pub fn pass_fd(&mut self, name: &str, fd: BorrowedFd<'_>) -> Result<(), VmmError> {
        use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
        let msg = json!({ "execute": "getfd", "arguments": { "fdname": name } });
        let mut bytes = serde_json::to_vec(&msg).map_err(qmp_err)?;
        bytes.push(b'\n');
        let fds = [fd.as_raw_fd()];
        let iov = [std::io::IoSlice::new(&bytes)];
        let sent = sendmsg::<()>(
            self.writer.as_raw_fd(),
            &iov,
            &[ControlMessage::ScmRights(&fds)],
            MsgFlags::empty(),
            None,
        )
        .map_err(|e| qmp_err(format!("getfd: {e}")))?;
        if sent != bytes.len() {
            self.writer.write_all(&bytes[sent..])?;
        }
        self.reply("getfd").map(|_| ())
    }

    /// Polls `query-migrate` until the migration ended; an error unless it completed.
    pub fn wait_migration(&mut self, timeout: Duration) -> Result<(), VmmError> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let r = self.execute("query-migrate", None)?;
            match r.get("status").and_then(Value::as_str) {
                Some("completed") => return Ok(()),
                Some(s @ ("failed" | "cancelled")) => {
                    let why = r.get("error-desc").and_then(Value::as_str).unwrap_or("");
                    return Err(qmp_err(format!("migration {s}: {why}")));
                }
                _ => {}
            }
            if std::time::Instant::now() > deadline {
                return Err(qmp_err(format!("migration not done within {timeout:?}")));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The VM's run state (`running`, `paused`, `inmigrate`, ...).
    pub fn status(&mut self) -> Result<String, VmmError> {
        let r = self.execute("query-status", None)?;
        Ok(r.get("status")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string())
    }
}
