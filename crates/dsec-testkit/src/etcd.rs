//! [`Etcd`]: a real etcd (one member or a cluster) on free 127.0.0.1 ports with its own
//! temporary data, for tests of the etcd state store and of the cluster.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::unavailable;

/// The variable naming the etcd binary (default: `etcd` on `PATH`, then /usr/bin/etcd).
pub const ETCD_BIN_VAR: &str = "DSEC_ETCD_BIN";

/// How long a member may take to answer after it starts.
const READY_WITHIN: Duration = Duration::from_secs(30);

/// The etcd binary, if there is one.
pub fn etcd_binary() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(ETCD_BIN_VAR) {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/bin")])
        .map(|d| d.join("etcd"))
        .find(|p| p.is_file())
}

#[derive(Debug)]
struct Member {
    name: String,
    client_port: u16,
    peer_port: u16,
    data_dir: PathBuf,
    log: PathBuf,
    child: Option<Child>,
}

/// A running etcd: one member ([`Etcd::start`]) or several ([`Etcd::start_cluster`]),
/// each its own process with its own data directory under one temporary directory.
/// Members can be stopped (SIGKILL, as a crash) and started again on the same data.
/// Drop kills exactly the processes it started and removes the data.
#[derive(Debug)]
pub struct Etcd {
    members: Vec<Member>,
    initial_cluster: String,
    token: String,
    bin: PathBuf,
    // Last: removed after the members are killed.
    dir: tempfile::TempDir,
}

/// Free TCP ports on 127.0.0.1 (held together while chosen, so they differ).
fn free_ports(n: usize) -> Vec<u16> {
    let listeners: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("binding a free port"))
        .collect();
    listeners
        .iter()
        .map(|l| l.local_addr().expect("local address").port())
        .collect()
}

/// Whether the member at `port` says it is healthy (it has a leader and answers).
fn healthy(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect_timeout(
        &std::net::SocketAddr::from(([127, 0, 0, 1], port)),
        Duration::from_millis(500),
    ) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    if s.write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut body = String::new();
    let _ = s.read_to_string(&mut body);
    body.contains("\"health\":\"true\"")
}

fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

impl Etcd {
    /// One member. `None` if etcd is missing and skipping is allowed (see
    /// [`crate::unavailable`]); panics if it is missing otherwise, or does not start.
    pub fn start(test: &str) -> Option<Self> {
        Self::start_cluster(test, 1)
    }

    /// A cluster of `members` members, all answering when this returns.
    pub fn start_cluster(test: &str, members: usize) -> Option<Self> {
        let bin = etcd_binary();
        let missing = bin
            .is_none()
            .then(|| "etcd (install Debian's etcd-server, or set DSEC_ETCD_BIN)".to_string());
        if unavailable(test, missing).is_some() {
            return None;
        }
        let bin = bin?;
        let dir = tempfile::Builder::new()
            .prefix("dsec-etcd-")
            .tempdir()
            .expect("a temporary directory for etcd");
        let ports = free_ports(2 * members);
        let members: Vec<Member> = (0..members)
            .map(|i| Member {
                name: format!("m{i}"),
                client_port: ports[2 * i],
                peer_port: ports[2 * i + 1],
                data_dir: dir.path().join(format!("m{i}")),
                log: dir.path().join(format!("m{i}.log")),
                child: None,
            })
            .collect();
        let initial_cluster = members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer_port))
            .collect::<Vec<_>>()
            .join(",");
        let token = format!("dsec-test-{}-{}", std::process::id(), ports[0]);
        let mut etcd = Self {
            members,
            initial_cluster,
            token,
            bin,
            dir,
        };
        for i in 0..etcd.members.len() {
            etcd.spawn(i);
        }
        for i in 0..etcd.members.len() {
            etcd.wait_ready(i);
        }
        Some(etcd)
    }

    fn spawn(&mut self, i: usize) {
        let m = &self.members[i];
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&m.log)
            .expect("etcd log file");
        let err = log.try_clone().expect("etcd log file");
        let client = format!("http://127.0.0.1:{}", m.client_port);
        let peer = format!("http://127.0.0.1:{}", m.peer_port);
        let child = Command::new(&self.bin)
            .arg("--name")
            .arg(&m.name)
            .arg("--data-dir")
            .arg(&m.data_dir)
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &self.initial_cluster])
            .args(["--initial-cluster-state", "new"])
            .args(["--initial-cluster-token", &self.token])
            // Fast elections: a lost member is replaced in about a second, and the
            // shortest lease TTL etcd allows is 1 s.
            .args(["--heartbeat-interval", "50", "--election-timeout", "500"])
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .spawn()
            .expect("starting etcd");
        self.members[i].child = Some(child);
    }

    /// Waits until member `i` answers healthy; panics with its log if it died or
    /// took too long.
    fn wait_ready(&mut self, i: usize) {
        let end = Instant::now() + READY_WITHIN;
        loop {
            let m = &mut self.members[i];
            if healthy(m.client_port) {
                return;
            }
            if let Some(c) = m.child.as_mut() {
                if let Ok(Some(status)) = c.try_wait() {
                    panic!(
                        "etcd member {} exited ({status}):\n{}",
                        m.name,
                        tail(&m.log)
                    );
                }
            }
            if Instant::now() > end {
                panic!(
                    "etcd member {} did not answer within {READY_WITHIN:?}:\n{}",
                    m.name,
                    tail(&m.log)
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The client URLs of every member, running or not (a client tries them all).
    pub fn endpoints(&self) -> Vec<String> {
        (0..self.members.len()).map(|i| self.endpoint(i)).collect()
    }

    /// The client URL of member `i`.
    pub fn endpoint(&self, i: usize) -> String {
        format!("http://127.0.0.1:{}", self.members[i].client_port)
    }

    /// How many members the cluster has.
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// Always `false`: an [`Etcd`] has at least one member.
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// The directory holding the members' data and logs.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Kills member `i` (SIGKILL: a crash; its data stays) and reaps it.
    pub fn stop(&mut self, i: usize) {
        if let Some(mut c) = self.members[i].child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts member `i` again on its data and waits until it answers healthy.
    pub fn start_member(&mut self, i: usize) {
        assert!(self.members[i].child.is_none(), "member {i} is running");
        self.spawn(i);
        self.wait_ready(i);
    }

    /// Starts the stopped members `which` together (a majority cannot come up one at a
    /// time) and waits until each answers healthy.
    pub fn start_members(&mut self, which: &[usize]) {
        for &i in which {
            assert!(self.members[i].child.is_none(), "member {i} is running");
            self.spawn(i);
        }
        for &i in which {
            self.wait_ready(i);
        }
    }

    /// [`Etcd::stop`] then [`Etcd::start_member`].
    pub fn restart(&mut self, i: usize) {
        self.stop(i);
        self.start_member(i);
    }

    /// Whether member `i` runs and says it is healthy (it has a leader).
    pub fn is_healthy(&self, i: usize) -> bool {
        self.members[i].child.is_some() && healthy(self.members[i].client_port)
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.stop(i);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 3-member cluster serves, loses one member and still has a healthy majority,
    /// and takes the member back.
    #[test]
    fn a_three_member_cluster_survives_the_loss_of_one() {
        let Some(mut etcd) =
            Etcd::start_cluster("a_three_member_cluster_survives_the_loss_of_one", 3)
        else {
            return;
        };
        assert!((0..3).all(|i| etcd.is_healthy(i)));
        etcd.stop(0);
        assert!(!etcd.is_healthy(0));
        // The other two elect a leader (if the lost one led) and answer healthy.
        let end = Instant::now() + Duration::from_secs(10);
        while !(etcd.is_healthy(1) && etcd.is_healthy(2)) {
            assert!(
                Instant::now() < end,
                "the remaining majority is not healthy"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        etcd.start_member(0);
        assert!((0..3).all(|i| etcd.is_healthy(i)));
    }

    #[test]
    fn drop_kills_the_member_and_removes_its_data() {
        let Some(etcd) = Etcd::start("drop_kills_the_member_and_removes_its_data") else {
            return;
        };
        let pid = etcd.members[0].child.as_ref().map(|c| c.id()).expect("pid");
        let dir = etcd.dir().to_path_buf();
        drop(etcd);
        assert!(
            !Path::new(&format!("/proc/{pid}")).exists(),
            "etcd {pid} is gone"
        );
        assert!(!dir.exists());
    }
}
