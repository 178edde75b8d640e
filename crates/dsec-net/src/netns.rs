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
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};

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
    let name = host_ifname.to_string();
    std::thread::scope(|s| {
        s.spawn(move || prepare_on_this_thread(&name, addrs))
            .join()
            .unwrap_or_else(|_| Err(io::Error::other("namespace thread panicked")))
    })
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

/// A datagram socket of the calling thread's namespace, for interface ioctls.
fn ioctl_socket() -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2); the result is checked and owned.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd was just returned by socket(2) and is owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn ifreq(name: &str) -> io::Result<libc::ifreq> {
    if name.len() >= libc::IFNAMSIZ {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("interface name {name:?} too long"),
        ));
    }
    // SAFETY: ifreq is a plain C struct for which all-zero is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(name.bytes()) {
        *dst = src as libc::c_char;
    }
    Ok(req)
}

fn sockaddr(ip: Ipv4Addr) -> libc::sockaddr {
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from(ip).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: sockaddr_in and sockaddr have the same size; this is how the kernel API
    // expects an IPv4 address in a sockaddr field.
    unsafe { std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sin) }
}

fn ioctl(sock: &OwnedFd, req: libc::Ioctl, arg: *mut libc::c_void) -> io::Result<()> {
    // SAFETY: the callers pass a request code with the matching, live argument struct.
    if unsafe { libc::ioctl(sock.as_raw_fd(), req, arg) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Brings interface `name` up.
pub fn set_up(name: &str) -> io::Result<()> {
    let sock = ioctl_socket()?;
    let mut req = ifreq(name)?;
    ioctl(
        &sock,
        libc::SIOCGIFFLAGS,
        (&mut req as *mut libc::ifreq).cast(),
    )?;
    // SAFETY: SIOCGIFFLAGS filled the flags member of the union.
    unsafe { req.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short };
    ioctl(
        &sock,
        libc::SIOCSIFFLAGS,
        (&mut req as *mut libc::ifreq).cast(),
    )
}

fn set_addr(name: &str, ip: Ipv4Addr, prefix: u8) -> io::Result<()> {
    let sock = ioctl_socket()?;
    let mut req = ifreq(name)?;
    req.ifr_ifru.ifru_addr = sockaddr(ip);
    ioctl(
        &sock,
        libc::SIOCSIFADDR,
        (&mut req as *mut libc::ifreq).cast(),
    )?;
    let mask = if prefix == 0 {
        0
    } else {
        u32::MAX << (32 - prefix)
    };
    req.ifr_ifru.ifru_netmask = sockaddr(Ipv4Addr::from(mask));
    ioctl(
        &sock,
        libc::SIOCSIFNETMASK,
        (&mut req as *mut libc::ifreq).cast(),
    )
}

fn add_default_route(gateway: Ipv4Addr) -> io::Result<()> {
    let sock = ioctl_socket()?;
    // SAFETY: rtentry is a plain C struct for which all-zero is a valid value.
    let mut rt: libc::rtentry = unsafe { std::mem::zeroed() };
    rt.rt_dst = sockaddr(Ipv4Addr::UNSPECIFIED);
    rt.rt_genmask = sockaddr(Ipv4Addr::UNSPECIFIED);
    rt.rt_gateway = sockaddr(gateway);
    rt.rt_flags = libc::RTF_UP | libc::RTF_GATEWAY;
    ioctl(
        &sock,
        libc::SIOCADDRT,
        (&mut rt as *mut libc::rtentry).cast(),
    )
}
