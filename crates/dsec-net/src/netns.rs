//! Preparing a sandbox's network namespace: a new namespace with loopback up and a veth
//! link to the host (`eth0` inside, the slot's link name outside), addressed as a /30
//! point-to-point network with the host end as default gateway.
//!
//! The namespace is made by a short-lived thread that unshares, so no thread of the node
//! ever stays in a foreign namespace; it is kept alive by an fd, never bind-mounted, so
//! nothing lands in the host's mount table and a crash of the node frees every unused
//! one.

use std::fs::File;
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsFd, OwnedFd};

pub use dsec_netconf::set_up;
use dsec_netconf::{add_default_route, set_addr};
use nix::sched::{setns, unshare, CloneFlags};

use crate::netlink;

/// Name of the sandbox's end of the veth link.
pub const SANDBOX_IFNAME: &str = "eth0";

/// Addresses of one slot's /30.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotAddrs {
    /// The host end: the sandbox's gateway and resolver.
    pub host: Ipv4Addr,
    /// The sandbox end.
    pub sandbox: Ipv4Addr,
}

/// Makes a network namespace wired to the host through veth `host_ifname`. Returns the
/// namespace's fd. On error nothing is left behind.
pub fn prepare(host_ifname: &str, addrs: SlotAddrs) -> io::Result<OwnedFd> {
    in_thread(|| prepare_on_this_thread(host_ifname, addrs))
}

fn prepare_on_this_thread(host_ifname: &str, addrs: SlotAddrs) -> io::Result<OwnedFd> {
    let host_ns: OwnedFd = File::open("/proc/thread-self/ns/net")?.into();
    unshare(CloneFlags::CLONE_NEWNET).map_err(io::Error::from)?;
    let ns: OwnedFd = File::open("/proc/thread-self/ns/net")?.into();
    set_up("lo")?;
    setns(&host_ns, CloneFlags::CLONE_NEWNET).map_err(io::Error::from)?;
    netlink::create_veth(host_ifname, SANDBOX_IFNAME, ns.as_fd())?;
    let wired = (|| {
        set_addr(host_ifname, addrs.host, 30)?;
        set_up(host_ifname)?;
        setns(&ns, CloneFlags::CLONE_NEWNET).map_err(io::Error::from)?;
        let inside = (|| {
            set_addr(SANDBOX_IFNAME, addrs.sandbox, 30)?;
            set_up(SANDBOX_IFNAME)?;
            add_default_route(addrs.host)
        })();
        setns(&host_ns, CloneFlags::CLONE_NEWNET).map_err(io::Error::from)?;
        inside
    })();
    if let Err(e) = wired {
        let _ = netlink::delete_link(host_ifname);
        return Err(e);
    }
    Ok(ns)
}

/// A new network namespace with only loopback, up (network mode `none`). Made by a
/// short-lived thread, like [`prepare`].
pub fn loopback_only() -> io::Result<OwnedFd> {
    in_thread(|| {
        unshare(CloneFlags::CLONE_NEWNET).map_err(io::Error::from)?;
        let ns: OwnedFd = File::open("/proc/thread-self/ns/net")?.into();
        set_up("lo")?;
        Ok(ns)
    })
}

/// Sets loopback up in the network namespace `ns` (which may belong to a user namespace
/// of the node's), from a short-lived thread that joins it.
pub fn loopback_up_in(ns: std::os::fd::BorrowedFd<'_>) -> io::Result<()> {
    in_thread(|| {
        setns(ns, CloneFlags::CLONE_NEWNET).map_err(io::Error::from)?;
        set_up("lo")
    })
}

/// Whether the network namespace `ns` is as [`loopback_only`] made it, as far as a
/// sandbox without `CAP_NET_ADMIN` can change it: no socket of any kind left, a TCP
/// connection's `TIME_WAIT` included, and no interface but `lo`. Its traffic counters
/// are not reset.
///
/// Reads the namespace's own counters (`/proc/net/sockstat`): listing its sockets
/// (`/proc/net/tcp`, or sock_diag) walks the host's whole connection hash table.
pub fn is_pristine(ns: std::os::fd::BorrowedFd<'_>) -> io::Result<bool> {
    in_thread(|| {
        setns(ns, CloneFlags::CLONE_NEWNET).map_err(io::Error::from)?;
        let sockstat = std::fs::read_to_string("/proc/thread-self/net/sockstat")?;
        let dev = std::fs::read_to_string("/proc/thread-self/net/dev")?;
        Ok(sockstat_is_empty(&sockstat) && only_loopback(&dev))
    })
}

/// No socket in use (`sockets: used 0`, which counts every family) and none in
/// `TIME_WAIT` (`TCP: ... tw 0`, IPv4 and IPv6 alike).
fn sockstat_is_empty(sockstat: &str) -> bool {
    let field = |line: &str, name: &str| -> Option<u64> {
        let mut words = line.split_whitespace();
        while let Some(w) = words.next() {
            if w == name {
                return words.next()?.parse().ok();
            }
        }
        None
    };
    let mut used = None;
    let mut tw = None;
    for line in sockstat.lines() {
        if let Some(rest) = line.strip_prefix("sockets:") {
            used = field(rest, "used");
        } else if let Some(rest) = line.strip_prefix("TCP:") {
            tw = field(rest, "tw");
        }
    }
    used == Some(0) && tw == Some(0)
}

/// `/proc/net/dev` lists `lo` and nothing else.
fn only_loopback(dev: &str) -> bool {
    let mut links = dev
        .lines()
        .skip(2)
        .filter_map(|l| l.split(':').next().map(str::trim));
    links.next() == Some("lo") && links.next().is_none()
}

/// Runs `f` on a thread of its own that ends with it: whatever namespace `f` joins, no
/// thread of the node stays there.
fn in_thread<T: Send>(f: impl FnOnce() -> io::Result<T> + Send) -> io::Result<T> {
    std::thread::scope(|s| {
        s.spawn(f)
            .join()
            .unwrap_or_else(|_| Err(io::Error::other("namespace thread panicked")))
    })
}

/// Deletes the host end of a slot's link (the sandbox end goes with it).
pub fn remove_link(host_ifname: &str) -> io::Result<()> {
    netlink::delete_link(host_ifname)
}

/// Host link names that start with `prefix` (what an earlier run may have left).
pub fn links_with_prefix(prefix: &str) -> Vec<String> {
    std::fs::read_dir("/sys/class/net")
        .map(|d| {
            d.filter_map(Result::ok)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(prefix))
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root() -> bool {
        dsec_testkit::require_root("netns")
    }

    /// Runs `f` in `ns` on a thread of its own.
    fn inside<T: Send>(ns: &OwnedFd, f: impl FnOnce() -> T + Send) -> T {
        in_thread(|| {
            setns(ns.as_fd(), CloneFlags::CLONE_NEWNET).map_err(io::Error::from)?;
            Ok(f())
        })
        .expect("join namespace")
    }

    #[test]
    fn sockstat_and_dev_are_read_as_the_kernel_writes_them() {
        let clean =
            "sockets: used 0\nTCP: inuse 0 orphan 3 tw 0 alloc 9 mem 12\nUDP: inuse 0 mem 0\n";
        assert!(sockstat_is_empty(clean), "orphan and alloc are host-wide");
        assert!(!sockstat_is_empty(&clean.replace("used 0", "used 1")));
        assert!(!sockstat_is_empty(&clean.replace("tw 0", "tw 2")));
        assert!(
            !sockstat_is_empty("sockets: used 0\n"),
            "no TCP line: unknown"
        );
        let dev = "Inter-|   Receive\n face |bytes\n    lo: 1 2 3\n";
        assert!(only_loopback(dev));
        assert!(!only_loopback(&format!("{dev}  eth0: 0 0\n")));
        assert!(!only_loopback("Inter-|\n face |\n"));
    }

    #[test]
    fn a_namespace_is_pristine_until_a_socket_or_a_time_wait_is_left_in_it() {
        if !root() {
            return;
        }
        let ns = loopback_only().expect("namespace");
        assert!(is_pristine(ns.as_fd()).expect("check"), "fresh");
        // An open socket (any family) counts while it lives.
        let held = inside(&ns, || {
            std::net::UdpSocket::bind("127.0.0.1:0").expect("udp")
        });
        assert!(!is_pristine(ns.as_fd()).expect("check"), "socket open");
        drop(held);
        assert!(is_pristine(ns.as_fd()).expect("check"), "socket closed");
        // A TCP connection closed by its client leaves TIME_WAIT behind for a minute.
        inside(&ns, || {
            let server = std::net::TcpListener::bind("127.0.0.1:0").expect("listen");
            let client =
                std::net::TcpStream::connect(server.local_addr().expect("addr")).expect("connect");
            let (accepted, _) = server.accept().expect("accept");
            drop(client);
            drop(accepted);
        });
        assert!(!is_pristine(ns.as_fd()).expect("check"), "TIME_WAIT left");
        // Another namespace, and the host's, are not looked at.
        let other = loopback_only().expect("namespace");
        assert!(is_pristine(other.as_fd()).expect("check"));
        loopback_up_in(other.as_fd()).expect("lo up again");
    }
}
