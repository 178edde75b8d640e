//! The node's nftables table: scripts for the base table, a slot's chain and sets, a
//! policy, and resolved DNS answers, each applied as one transaction through
//! libnftables (in process: spawning `nft` costs ~20 ms here, the library ~0.3 ms).
//!
//! Layout (`T` the table, `P` the link prefix, one chain and four sets per slot `N`):
//!
//! - `prerouting` (dstnat): DNS from a sandbox, to any address, goes to the node's
//!   resolver port, so a sandbox cannot pick its own resolver to tunnel through. With a
//!   model gateway configured, TCP from a link in `model_links` to the gateway's VIP
//!   (default `169.254.169.250:80`) is redirected to the local gateway's port, or
//!   DNATed to a remote gateway's address.
//! - `postrouting` (srcnat): sandbox traffic leaving through a non-sandbox link is
//!   masqueraded.
//! - `input`: from a sandbox link (chain `to_host`) only the resolver port is open, and
//!   for links in `model_links` the local gateway's port (or a remote gateway's address
//!   and port, should it be one of the node's own); the resolver port and the local
//!   gateway's port are closed to every other link but loopback (the gateway serves
//!   callers outside sandboxes on a listener of its own).
//! - `forward`: traffic from a sandbox link goes through `egress`: established flows
//!   pass; links in `model_links` may reach a remote gateway's address and port; the
//!   sandbox subnet and link-local addresses are always rejected; then the `slots`
//!   verdict map jumps to the slot's chain `sN`; what it does not accept is rejected
//!   (TCP reset, ICMP admin-prohibited) so agents fail fast instead of hanging. Nothing
//!   from outside may open a connection into a sandbox.
//! - `sN` holds the policy: `open` accepts; `allowlist` accepts destinations in
//!   `sN_net` (CIDRs, any port), `sN_netport` (CIDR . port), `sN_dns` and `sN_dnsport`
//!   (what the resolver answered for allowed names, with the answer's TTL as timeout);
//!   `none` accepts nothing (a slot in mode `none` exists only for the model gateway).
//! - `model_links` (only with a model gateway configured; without one the table has no
//!   trace of it): the host links of sandboxes with model access. Membership is
//!   independent of the policy: replacing the policy leaves it alone.

use std::fmt::Write as _;
use std::net::Ipv4Addr;

use dsec_wire::v1::{AllowRule, AllowTarget, NetworkMode};

use crate::{ModelGatewayNet, ModelGatewayTarget, NetError};

/// Names and numbers the scripts are made from.
#[derive(Debug, Clone)]
pub struct Tables {
    /// nftables table name (family `inet`).
    pub table: String,
    /// Prefix of host link names.
    pub prefix: String,
    /// The sandbox subnet: address and prefix length.
    pub subnet: (Ipv4Addr, u8),
    /// Port the node's resolver listens on.
    pub dns_port: u16,
    /// Where sandboxes with model access reach the model gateway, if anywhere.
    pub model: Option<ModelGatewayNet>,
}

const REJECT: &str =
    "meta l4proto tcp reject with tcp reset; reject with icmpx type admin-prohibited";

impl Tables {
    /// Replaces the whole table with an empty base (no slots).
    pub fn base(&self) -> String {
        let Self {
            table,
            prefix,
            dns_port,
            ..
        } = self;
        let (net, len) = self.subnet;
        // The model gateway's rules: empty strings without one, so the table is then
        // exactly what it was before there was a model gateway.
        let (mut model_set, mut model_nat, mut model_in, mut model_out, mut model_closed) = (
            String::new(),
            String::new(),
            String::new(),
            String::new(),
            String::new(),
        );
        if let Some(m) = &self.model {
            let (vip, vport) = (m.vip.ip(), m.vip.port());
            model_set = "\tset model_links { type ifname; }\n".into();
            let to = match m.target {
                ModelGatewayTarget::Local { port } => {
                    model_in = format!("\t\tiifname @model_links tcp dport {port} accept\n");
                    model_closed = format!("\t\tiifname != \"lo\" tcp dport {port} drop\n");
                    format!("redirect to :{port}")
                }
                ModelGatewayTarget::Remote { addr } => {
                    let (ip, port) = (addr.ip(), addr.port());
                    let rule =
                        format!("\t\tiifname @model_links ip daddr {ip} tcp dport {port} accept\n");
                    model_in = rule.clone();
                    model_out = rule;
                    format!("dnat ip to {addr}")
                }
            };
            model_nat = format!("\t\tiifname @model_links ip daddr {vip} tcp dport {vport} {to}\n");
        }
        format!(
            "table inet {table}\n\
             delete table inet {table}\n\
             table inet {table} {{\n\
             \tset never {{ type ipv4_addr; flags interval; elements = {{ {net}/{len}, 169.254.0.0/16 }} }}\n\
             \tmap slots {{ type ifname : verdict; }}\n\
             {model_set}\
             \tchain prerouting {{ type nat hook prerouting priority dstnat; policy accept;\n\
             \t\tiifname \"{prefix}*\" meta l4proto {{ tcp, udp }} th dport 53 redirect to :{dns_port}\n\
             {model_nat}\t}}\n\
             \tchain postrouting {{ type nat hook postrouting priority srcnat; policy accept;\n\
             \t\tip saddr {net}/{len} oifname != \"{prefix}*\" masquerade\n\t}}\n\
             \tchain input {{ type filter hook input priority filter; policy accept;\n\
             \t\tiifname \"{prefix}*\" jump to_host\n\
             \t\tiifname != \"lo\" meta l4proto {{ tcp, udp }} th dport {dns_port} drop\n\
             {model_closed}\t}}\n\
             \tchain to_host {{ ct state established,related accept\n\
             \t\tmeta l4proto {{ tcp, udp }} th dport {dns_port} accept\n\
             {model_in}\
             \t\t{REJECT}\n\t}}\n\
             \tchain forward {{ type filter hook forward priority filter; policy accept;\n\
             \t\tiifname \"{prefix}*\" jump egress\n\
             \t\toifname \"{prefix}*\" ct state established,related accept\n\
             \t\toifname \"{prefix}*\" drop\n\t}}\n\
             \tchain egress {{ ct state established,related accept\n\
             {model_out}\
             \t\tip daddr @never goto deny\n\
             \t\tiifname vmap @slots\n\
             \t\tgoto deny\n\t}}\n\
             \tchain deny {{\n\t\t{REJECT}\n\t}}\n\
             }}\n"
        )
    }

    /// Adds slot `n`'s chain (empty: deny all) and sets, and routes its link there.
    pub fn add_slot(&self, n: u32) -> String {
        let t = &self.table;
        let p = &self.prefix;
        format!(
            "add set inet {t} s{n}_net {{ type ipv4_addr; flags interval; }}\n\
             add set inet {t} s{n}_netport {{ type ipv4_addr . inet_service; flags interval; }}\n\
             add set inet {t} s{n}_dns {{ type ipv4_addr; flags timeout; }}\n\
             add set inet {t} s{n}_dnsport {{ type ipv4_addr . inet_service; flags timeout; }}\n\
             add chain inet {t} s{n}\n\
             add element inet {t} slots {{ \"{p}{n}\" : jump s{n} }}\n"
        )
    }

    /// Puts slot `n`'s link into `model_links`: its sandbox may call the model gateway.
    /// Only valid with a model gateway configured.
    pub fn link_model(&self, n: u32) -> String {
        format!(
            "add element inet {t} model_links {{ \"{p}{n}\" }}\n",
            t = self.table,
            p = self.prefix
        )
    }

    /// Removes slot `n` entirely (from `model_links` too, whether it was there or not).
    pub fn remove_slot(&self, n: u32) -> String {
        let t = &self.table;
        let p = &self.prefix;
        let unlink = match self.model {
            // add first, so that delete cannot fail.
            Some(_) => format!(
                "add element inet {t} model_links {{ \"{p}{n}\" }}\n\
                 delete element inet {t} model_links {{ \"{p}{n}\" }}\n"
            ),
            None => String::new(),
        };
        format!(
            "{unlink}\
             delete element inet {t} slots {{ \"{p}{n}\" }}\n\
             delete chain inet {t} s{n}\n\
             delete set inet {t} s{n}_net\n\
             delete set inet {t} s{n}_netport\n\
             delete set inet {t} s{n}_dns\n\
             delete set inet {t} s{n}_dnsport\n"
        )
    }

    /// Replaces slot `n`'s policy: its chain and all four sets (DNS answers of the old
    /// policy are dropped; names are resolved again under the new one).
    pub fn set_policy(&self, n: u32, mode: NetworkMode, rules: &[AllowRule]) -> String {
        let t = &self.table;
        let mut s = format!("flush chain inet {t} s{n}\n");
        for set in ["net", "netport", "dns", "dnsport"] {
            let _ = writeln!(s, "flush set inet {t} s{n}_{set}");
        }
        match mode {
            NetworkMode::None => {}
            NetworkMode::Open => {
                let _ = writeln!(s, "add rule inet {t} s{n} accept");
            }
            NetworkMode::Allowlist => {
                let _ = write!(
                    s,
                    "add rule inet {t} s{n} ip daddr @s{n}_net accept\n\
                     add rule inet {t} s{n} meta l4proto {{ tcp, udp }} ip daddr . th dport @s{n}_netport accept\n\
                     add rule inet {t} s{n} ip daddr @s{n}_dns accept\n\
                     add rule inet {t} s{n} meta l4proto {{ tcp, udp }} ip daddr . th dport @s{n}_dnsport accept\n"
                );
                let mut any_port = Vec::new();
                let mut with_port = Vec::new();
                for r in rules {
                    if let AllowTarget::Cidr(ip, len) = r.target {
                        match r.port {
                            None => any_port.push(format!("{ip}/{len}")),
                            Some(p) => with_port.push(format!("{ip}/{len} . {p}")),
                        }
                    }
                }
                for (set, elems) in [("net", any_port), ("netport", with_port)] {
                    if !elems.is_empty() {
                        let _ = writeln!(
                            s,
                            "add element inet {t} s{n}_{set} {{ {} }}",
                            elems.join(", ")
                        );
                    }
                }
            }
        }
        s
    }

    /// Admits addresses a DNS answer gave for an allowed name, for `timeout_s` seconds:
    /// `(address, port)` pairs, `None` meaning any port. An address already admitted gets
    /// the new timeout.
    pub fn admit(&self, n: u32, addrs: &[(Ipv4Addr, Option<u16>)], timeout_s: u64) -> String {
        let t = &self.table;
        let mut s = String::new();
        for (ip, port) in addrs {
            let (set, elem) = match port {
                None => ("dns", ip.to_string()),
                Some(p) => ("dnsport", format!("{ip} . {p}")),
            };
            // add (so that delete cannot fail), delete, add with the fresh timeout.
            let _ = write!(
                s,
                "add element inet {t} s{n}_{set} {{ {elem} }}\n\
                 delete element inet {t} s{n}_{set} {{ {elem} }}\n\
                 add element inet {t} s{n}_{set} {{ {elem} timeout {timeout_s}s }}\n"
            );
        }
        s
    }

    /// Deletes the table (node shutdown with no networked sandbox left, tests).
    pub fn delete(&self) -> String {
        format!("table inet {t}\ndelete table inet {t}\n", t = self.table)
    }
}

/// libnftables, loaded once per process, with one context (not thread-safe: behind a
/// mutex).
struct Lib {
    ctx: std::sync::Mutex<usize>,
    run: unsafe extern "C" fn(*mut libc::c_void, *const libc::c_char) -> libc::c_int,
    error: unsafe extern "C" fn(*mut libc::c_void) -> *const libc::c_char,
    // Keeps the library mapped for the function pointers above.
    _lib: libloading::Library,
}

fn lib() -> Result<&'static Lib, NetError> {
    static LIB: std::sync::OnceLock<Result<Lib, String>> = std::sync::OnceLock::new();
    LIB.get_or_init(|| {
        // SAFETY: loading the system's libnftables, whose initialisers have no
        // preconditions; the symbols below are its documented C API.
        unsafe {
            let lib = libloading::Library::new("libnftables.so.1")
                .map_err(|e| format!("load libnftables.so.1 (install Debian's nftables): {e}"))?;
            type New = unsafe extern "C" fn(u32) -> *mut libc::c_void;
            type Buffer = unsafe extern "C" fn(*mut libc::c_void) -> libc::c_int;
            let sym = |name: &[u8]| -> Result<usize, String> {
                lib.get::<*const libc::c_void>(name)
                    .map(|s| *s as usize)
                    .map_err(|e| format!("libnftables: {e}"))
            };
            let new: New = std::mem::transmute::<usize, New>(sym(b"nft_ctx_new\0")?);
            let buffer_output: Buffer =
                std::mem::transmute::<usize, Buffer>(sym(b"nft_ctx_buffer_output\0")?);
            let buffer_error: Buffer =
                std::mem::transmute::<usize, Buffer>(sym(b"nft_ctx_buffer_error\0")?);
            let run = std::mem::transmute::<
                usize,
                unsafe extern "C" fn(*mut libc::c_void, *const libc::c_char) -> libc::c_int,
            >(sym(b"nft_run_cmd_from_buffer\0")?);
            let error = std::mem::transmute::<
                usize,
                unsafe extern "C" fn(*mut libc::c_void) -> *const libc::c_char,
            >(sym(b"nft_ctx_get_error_buffer\0")?);
            let ctx = new(0);
            if ctx.is_null() {
                return Err("nft_ctx_new failed".to_string());
            }
            // Keep messages in the context instead of printing them on our stdio.
            buffer_output(ctx);
            buffer_error(ctx);
            Ok(Lib {
                ctx: std::sync::Mutex::new(ctx as usize),
                run,
                error,
                _lib: lib,
            })
        }
    })
    .as_ref()
    .map_err(|e| NetError::Unavailable(e.clone()))
}

/// Applies a script as one nftables transaction: all of it or nothing.
pub fn apply(script: &str) -> Result<(), NetError> {
    let lib = lib()?;
    let script = std::ffi::CString::new(script)
        .map_err(|_| NetError::Nft("script contains a NUL byte".into()))?;
    let ctx = lib.ctx.lock().unwrap_or_else(|p| p.into_inner());
    let ctx = *ctx as *mut libc::c_void;
    // SAFETY: ctx is the live context made in lib() and used under the mutex only;
    // script is a NUL-terminated string that outlives the call.
    let rc = unsafe { (lib.run)(ctx, script.as_ptr()) };
    if rc != 0 {
        // SAFETY: the error buffer is a NUL-terminated string owned by the context,
        // valid until the next command, which the mutex we hold prevents.
        let msg = unsafe {
            let p = (lib.error)(ctx);
            if p.is_null() {
                String::new()
            } else {
                std::ffi::CStr::from_ptr(p)
                    .to_string_lossy()
                    .trim()
                    .to_string()
            }
        };
        return Err(NetError::Nft(msg));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tables() -> Tables {
        Tables {
            table: "dsec".into(),
            prefix: "dsv".into(),
            subnet: (Ipv4Addr::new(10, 231, 0, 0), 16),
            dns_port: 15353,
            model: None,
        }
    }

    #[test]
    fn an_allowlist_becomes_a_chain_and_set_elements() {
        let rules: Vec<AllowRule> = ["pypi.org:443", "10.9.0.0/16", "192.0.2.7:80"]
            .iter()
            .map(|r| AllowRule::parse(r).expect("rule"))
            .collect();
        let s = tables().set_policy(3, NetworkMode::Allowlist, &rules);
        assert!(s.starts_with("flush chain inet dsec s3\n"));
        assert!(s.contains("add element inet dsec s3_net { 10.9.0.0/16 }\n"));
        assert!(s.contains("add element inet dsec s3_netport { 192.0.2.7/32 . 80 }\n"));
        // Names are never turned into addresses here: only the resolver admits them.
        assert!(!s.contains("pypi"));
        assert!(!s.contains("s3 accept"));
        let open = tables().set_policy(3, NetworkMode::Open, &rules);
        assert!(open.ends_with("add rule inet dsec s3 accept\n"));
    }

    #[test]
    fn base_table_rejects_by_default_and_redirects_dns() {
        let b = tables().base();
        assert!(b.contains("th dport 53 redirect to :15353"));
        assert!(b.contains("elements = { 10.231.0.0/16, 169.254.0.0/16 }"));
        assert!(b.contains("goto deny\n"));
        assert!(b.contains("oifname \"dsv*\" drop\n"));
        // No model gateway configured: no trace of one.
        assert!(!b.contains("model_links"));
        assert!(!tables().remove_slot(3).contains("model_links"));
    }

    #[test]
    fn a_local_model_gateway_is_a_redirect_and_an_open_port_for_model_links_only() {
        let mut t = tables();
        t.model = Some(ModelGatewayNet::new(ModelGatewayTarget::Local {
            port: 8090,
        }));
        let b = t.base();
        assert!(b.contains("set model_links { type ifname; }"));
        assert!(b.contains(
            "iifname @model_links ip daddr 169.254.169.250 tcp dport 80 redirect to :8090\n"
        ));
        let to_host = &b[b.find("chain to_host").expect("to_host")..];
        let accept = to_host
            .find("iifname @model_links tcp dport 8090 accept")
            .expect("accept");
        assert!(accept < to_host.find("reject").expect("reject"));
        // Closed to other links (trainers call another listener), after the sandbox jump.
        let input = &b[b.find("chain input").expect("input")..];
        let closed = input
            .find("iifname != \"lo\" tcp dport 8090 drop")
            .expect("closed to other links");
        assert!(input.find("jump to_host").expect("jump") < closed);
        assert!(!b.contains("dnat"));
        assert_eq!(
            t.link_model(3),
            "add element inet dsec model_links { \"dsv3\" }\n"
        );
        // Removal cannot fail whether the slot was linked or not.
        assert!(t.remove_slot(3).starts_with(
            "add element inet dsec model_links { \"dsv3\" }\n\
             delete element inet dsec model_links { \"dsv3\" }\n"
        ));
    }

    #[test]
    fn a_remote_model_gateway_is_a_dnat_let_through_before_never() {
        let mut t = tables();
        t.model = Some(ModelGatewayNet::new(ModelGatewayTarget::Remote {
            addr: "192.0.2.9:8443".parse().expect("addr"),
        }));
        let b = t.base();
        assert!(b.contains(
            "iifname @model_links ip daddr 169.254.169.250 tcp dport 80 dnat ip to 192.0.2.9:8443\n"
        ));
        let egress = &b[b.find("chain egress").expect("egress")..];
        let accept = egress
            .find("iifname @model_links ip daddr 192.0.2.9 tcp dport 8443 accept")
            .expect("accept");
        assert!(accept < egress.find("@never").expect("never"));
        assert!(!b.contains("redirect to :8443"));
    }
}
