//! Interface configuration of the calling thread's network namespace, by ioctl: an
//! IPv4 address and netmask, link up, a default route, and persistent tap devices.
//!
//! The node uses it to wire sandbox links (`dsec-net`); a microVM's guest agent uses it
//! to configure its virtio NIC. Both want a handful of calls, not a netlink stack (the
//! agent is a small static binary).

use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

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

/// Gives interface `name` the address `ip`/`prefix` (its only IPv4 address).
pub fn set_addr(name: &str, ip: Ipv4Addr, prefix: u8) -> io::Result<()> {
    if prefix > 32 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("prefix length /{prefix}"),
        ));
    }
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

/// Adds the default route through `gateway`.
pub fn add_default_route(gateway: Ipv4Addr) -> io::Result<()> {
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

/// `TUNSETIFF`: `_IOW('T', 202, int)`.
const TUNSETIFF: libc::Ioctl = 0x4004_54ca;
/// `TUNSETPERSIST`: `_IOW('T', 203, int)`.
const TUNSETPERSIST: libc::Ioctl = 0x4004_54cb;

/// Makes a persistent tap device `name` (layer 2, no packet info header): it outlives
/// the descriptor that made it, so a VMM can attach to it by name, leave (a paused
/// microVM) and attach again. Delete it as any link. An existing tap of that name is
/// taken as it is.
pub fn create_persistent_tap(name: &str) -> io::Result<()> {
    // SAFETY: open(2) of a constant path; the result is checked and owned.
    let fd = unsafe { libc::open(c"/dev/net/tun".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd was just returned by open(2) and is owned by nothing else.
    let tun = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut req = ifreq(name)?;
    req.ifr_ifru.ifru_flags = (libc::IFF_TAP | libc::IFF_NO_PI) as libc::c_short;
    ioctl(&tun, TUNSETIFF, (&mut req as *mut libc::ifreq).cast())?;
    // SAFETY: TUNSETPERSIST takes its argument by value.
    if unsafe { libc::ioctl(tun.as_raw_fd(), TUNSETPERSIST, 1 as libc::c_ulong) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
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
    if name.is_empty() || name.len() >= libc::IFNAMSIZ || name.contains(['/', '\0']) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("interface name {name:?}: 1 to 15 bytes, no '/'"),
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

fn ioctl(fd: &OwnedFd, req: libc::Ioctl, arg: *mut libc::c_void) -> io::Result<()> {
    // SAFETY: the callers pass a request code with the matching, live argument struct.
    if unsafe { libc::ioctl(fd.as_raw_fd(), req, arg) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_interface_names_are_refused_before_any_call() {
        for name in ["", "a-name-far-too-long", "a/b"] {
            let err = set_up(name).expect_err(name);
            assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{name}");
        }
        assert!(set_addr("lo", Ipv4Addr::LOCALHOST, 33).is_err());
    }

    /// A tap made in a fresh namespace persists once its descriptor is closed, takes an
    /// address, comes up, and routes a default through its peer.
    #[test]
    fn a_persistent_tap_outlives_its_descriptor_and_is_configured() {
        if !dsec_testkit::require_root("tap devices") {
            return;
        }
        let done = std::thread::spawn(|| {
            // This thread's namespace (sysfs shows the mounter's).
            let read = |f: &str| std::fs::read_to_string(format!("/proc/thread-self/net/{f}"));
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).expect("unshare");
            create_persistent_tap("tap-test0").expect("tap");
            assert!(read("dev").expect("dev").contains("tap-test0:"));
            // Attaching again by name (what a VMM does) finds the same device.
            create_persistent_tap("tap-test0").expect("again");
            set_addr("tap-test0", Ipv4Addr::new(10, 9, 0, 1), 30).expect("addr");
            set_up("tap-test0").expect("up");
            // A route through it is taken only once it is up.
            add_default_route(Ipv4Addr::new(10, 9, 0, 2)).expect("route");
            let routes = read("route").expect("routes");
            assert!(
                routes.lines().any(|l| l.starts_with("tap-test0\t00000000")),
                "{routes}"
            );
        });
        done.join().expect("namespace thread");
    }
}
