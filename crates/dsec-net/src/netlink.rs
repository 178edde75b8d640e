//! The two rtnetlink requests the node needs, written by hand: create a veth pair whose
//! peer is born inside a sandbox's network namespace (never moved: moving a link
//! between namespaces costs ~30 ms here, creating it in place a fraction), and delete a
//! link by name. Addresses, flags and routes are set with ioctls in `netns.rs`.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

const NLMSG_HDRLEN: usize = 16;
const IFINFOMSG_LEN: usize = 16;
const NLMSG_ERROR: u16 = 2;
const RTM_NEWLINK: u16 = 16;
const RTM_DELLINK: u16 = 17;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_EXCL: u16 = 0x200;
const NLM_F_CREATE: u16 = 0x400;
const IFLA_IFNAME: u16 = 3;
const IFLA_LINKINFO: u16 = 18;
const IFLA_NET_NS_FD: u16 = 28;
const IFLA_INFO_KIND: u16 = 1;
const IFLA_INFO_DATA: u16 = 2;
const VETH_INFO_PEER: u16 = 1;
const NLA_F_NESTED: u16 = 0x8000;

/// A netlink message under construction: attributes are appended, nests are closed by
/// patching their length.
struct Msg {
    buf: Vec<u8>,
}

impl Msg {
    fn new(kind: u16, flags: u16) -> Self {
        let mut buf = vec![0u8; NLMSG_HDRLEN];
        buf[4..6].copy_from_slice(&kind.to_ne_bytes());
        buf[6..8].copy_from_slice(&(flags | NLM_F_REQUEST | NLM_F_ACK).to_ne_bytes());
        buf[8..12].copy_from_slice(&1u32.to_ne_bytes());
        Self { buf }
    }

    /// An all-zero `ifinfomsg` (family AF_UNSPEC, any index).
    fn ifinfo(&mut self) {
        self.buf.extend_from_slice(&[0u8; IFINFOMSG_LEN]);
    }

    fn align(&mut self) {
        while !self.buf.len().is_multiple_of(4) {
            self.buf.push(0);
        }
    }

    fn attr(&mut self, kind: u16, data: &[u8]) {
        let len = u16::try_from(4 + data.len()).unwrap_or(u16::MAX);
        self.buf.extend_from_slice(&len.to_ne_bytes());
        self.buf.extend_from_slice(&kind.to_ne_bytes());
        self.buf.extend_from_slice(data);
        self.align();
    }

    fn attr_str(&mut self, kind: u16, s: &str) {
        let mut data = s.as_bytes().to_vec();
        data.push(0);
        self.attr(kind, &data);
    }

    /// Opens a nested attribute; returns where its header is, for [`Msg::end`].
    fn begin(&mut self, kind: u16) -> usize {
        let at = self.buf.len();
        self.buf.extend_from_slice(&[0, 0]);
        self.buf
            .extend_from_slice(&(kind | NLA_F_NESTED).to_ne_bytes());
        at
    }

    fn end(&mut self, at: usize) {
        let len = u16::try_from(self.buf.len() - at).unwrap_or(u16::MAX);
        self.buf[at..at + 2].copy_from_slice(&len.to_ne_bytes());
    }

    fn finish(mut self) -> Vec<u8> {
        let len = u32::try_from(self.buf.len()).unwrap_or(u32::MAX);
        self.buf[0..4].copy_from_slice(&len.to_ne_bytes());
        self.buf
    }
}

/// Sends one request on a fresh rtnetlink socket of the calling thread's network
/// namespace and waits for the kernel's acknowledgement.
fn request(msg: Vec<u8>) -> io::Result<()> {
    // SAFETY: plain socket(2); the result is checked and owned below.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::NETLINK_ROUTE,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd was just returned by socket(2) and is owned by nothing else.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: sending a buffer we own, of its real length.
    let sent = unsafe { libc::send(sock.as_raw_fd(), msg.as_ptr().cast(), msg.len(), 0) };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut reply = [0u8; 4096];
    loop {
        // SAFETY: receiving into a buffer we own, of its real length.
        let n = unsafe { libc::recv(sock.as_raw_fd(), reply.as_mut_ptr().cast(), reply.len(), 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        let n = usize::try_from(n).unwrap_or(0);
        if n < NLMSG_HDRLEN + 4 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "short netlink reply",
            ));
        }
        let kind = u16::from_ne_bytes([reply[4], reply[5]]);
        if kind != NLMSG_ERROR {
            continue;
        }
        let code = i32::from_ne_bytes([reply[16], reply[17], reply[18], reply[19]]);
        return if code == 0 {
            Ok(())
        } else {
            Err(io::Error::from_raw_os_error(-code))
        };
    }
}

/// Creates veth `host_name` in the calling thread's namespace with its peer `peer_name`
/// created directly inside the namespace `peer_ns`.
pub fn create_veth(host_name: &str, peer_name: &str, peer_ns: BorrowedFd<'_>) -> io::Result<()> {
    let mut m = Msg::new(RTM_NEWLINK, NLM_F_CREATE | NLM_F_EXCL);
    m.ifinfo();
    m.attr_str(IFLA_IFNAME, host_name);
    let info = m.begin(IFLA_LINKINFO);
    m.attr_str(IFLA_INFO_KIND, "veth");
    let data = m.begin(IFLA_INFO_DATA);
    let peer = m.begin(VETH_INFO_PEER);
    m.ifinfo();
    m.attr_str(IFLA_IFNAME, peer_name);
    m.attr(IFLA_NET_NS_FD, &peer_ns.as_raw_fd().to_ne_bytes());
    m.end(peer);
    m.end(data);
    m.end(info);
    request(m.finish())
}

/// Deletes the link `name` of the calling thread's namespace (for a veth, both ends).
/// A link that does not exist is not an error.
pub fn delete_link(name: &str) -> io::Result<()> {
    let mut m = Msg::new(RTM_DELLINK, 0);
    m.ifinfo();
    m.attr_str(IFLA_IFNAME, name);
    match request(m.finish()) {
        Err(e) if e.raw_os_error() == Some(libc::ENODEV) => Ok(()),
        r => r,
    }
}
