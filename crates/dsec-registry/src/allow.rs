//! Which registries a node may pull from (`--allow-registry`), so that a user naming a
//! reference cannot make the server fetch from any host it can reach (SSRF: the cloud
//! metadata endpoint, services on loopback or the private network).
//!
//! - No `--allow-registry`: every registry whose host is a public name or address. A
//!   host that is, or resolves to, a loopback, private, link-local (169.254.0.0/16, the
//!   metadata endpoints), CGNAT, unique-local, unspecified or multicast address is
//!   refused.
//! - `--allow-registry HOST[:PORT]` (repeatable): only the registries named, whatever
//!   their address; `--allow-registry public` adds every public one as above.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use oci_client::Reference;

use crate::{RegistryError, Result};

/// The keyword of `--allow-registry` that allows every public registry.
pub const PUBLIC: &str = "public";

/// The registries a node may pull from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allow {
    /// Registries allowed by name (`host[:port]` as references name them).
    pub named: Vec<String>,
    /// Whether every registry on a public address is allowed too.
    pub public: bool,
}

impl Default for Allow {
    /// Public registries only.
    fn default() -> Self {
        Self {
            named: Vec::new(),
            public: true,
        }
    }
}

impl Allow {
    /// From the `--allow-registry` values (none: [`Allow::default`]).
    pub fn from_flags(values: &[String]) -> Result<Self> {
        if values.is_empty() {
            return Ok(Self::default());
        }
        let mut allow = Self {
            named: Vec::new(),
            public: false,
        };
        for v in values {
            let v = v.trim();
            if v == PUBLIC {
                allow.public = true;
            } else if v.is_empty() || v.contains('/') || v.contains("://") {
                return Err(RegistryError::InvalidReference {
                    reference: v.to_string(),
                    message: "--allow-registry takes HOST[:PORT] (no scheme or path) or \
                              `public`"
                        .into(),
                });
            } else {
                allow.named.push(v.to_ascii_lowercase());
            }
        }
        Ok(allow)
    }

    /// How `reference`'s registry may be pulled from, or why not; resolves its host to
    /// check a registry allowed only as public.
    pub(crate) async fn check(&self, reference: &Reference) -> Result<Reach> {
        let registry = reference.registry().to_ascii_lowercase();
        let resolved = reference.resolve_registry().to_ascii_lowercase();
        if self.named.iter().any(|n| *n == registry || *n == resolved) {
            return Ok(Reach::Named);
        }
        let refuse = |why: String| {
            Err(RegistryError::Refused(format!(
                "registry {registry} is not allowed: {why}; an operator allows it with \
                 `dsec serve --allow-registry {registry}`"
            )))
        };
        if !self.public {
            return refuse(
                "this server pulls only from the registries its \
                           --allow-registry flags name"
                    .into(),
            );
        }
        let (host, port) = split_host_port(&resolved, 443);
        let addrs: Vec<IpAddr> = match host.parse::<IpAddr>() {
            Ok(ip) => vec![ip],
            Err(_) if host == "localhost" || host.ends_with(".localhost") => {
                vec![IpAddr::V4(Ipv4Addr::LOCALHOST)]
            }
            Err(_) => match tokio::net::lookup_host((host, port)).await {
                Ok(a) => a.map(|a| a.ip()).collect(),
                Err(e) => {
                    return Err(RegistryError::Transport(format!(
                        "registry {registry}: cannot resolve {host}: {e}"
                    )))
                }
            },
        };
        match addrs.iter().find(|ip| !is_public(ip)) {
            Some(ip) => refuse(format!(
                "its address {ip} is not public (loopback, private, link-local or \
                 another reserved range)"
            )),
            None => Ok(Reach::Public),
        }
    }
}

/// Why a registry may be pulled from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reach {
    /// An operator named it: its pulls go wherever it sends them.
    Named,
    /// Its address is public: so must be every address its pulls reach (redirects,
    /// token realms, a name resolved again), which [`crate::egress`] enforces.
    Public,
}

/// `host` and port of `host[:port]` (`[v6]:port` too); `default` when none.
pub(crate) fn split_host_port(s: &str, default: u16) -> (&str, u16) {
    if let Some(rest) = s.strip_prefix('[') {
        if let Some((h, tail)) = rest.split_once(']') {
            let port = tail.strip_prefix(':').and_then(|p| p.parse().ok());
            return (h, port.unwrap_or(default));
        }
    }
    match s.rsplit_once(':') {
        Some((h, p)) if !h.contains(':') => (h, p.parse().unwrap_or(default)),
        _ => (s, default),
    }
}

/// Whether `ip` is an address of the public internet.
pub fn is_public(ip: &IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => public_v4(v4),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => public_v4(&v4),
            None => public_v6(v6),
        },
    }
}

fn public_v4(ip: &Ipv4Addr) -> bool {
    let [a, b, ..] = ip.octets();
    !(ip.is_loopback()
        || ip.is_private()
        || ip.is_link_local()
        || ip.is_unspecified()
        || ip.is_broadcast()
        || ip.is_multicast()
        || ip.is_documentation()
        || a == 0
        // CGNAT 100.64.0.0/10.
        || (a == 100 && (64..128).contains(&b))
        // IETF protocol assignments 192.0.0.0/24, benchmarking 198.18.0.0/15, reserved
        // 240.0.0.0/4.
        || (a == 192 && b == 0 && ip.octets()[2] == 0)
        || (a == 198 && (b == 18 || b == 19))
        || a >= 240)
}

fn public_v6(ip: &Ipv6Addr) -> bool {
    let first = ip.segments()[0];
    !(ip.is_loopback()
        || ip.is_unspecified()
        || ip.is_multicast()
        // Unique local fc00::/7, link-local fe80::/10, site-local fec0::/10.
        || (first & 0xfe00) == 0xfc00
        || (first & 0xffc0) == 0xfe80
        || (first & 0xffc0) == 0xfec0
        // Documentation 2001:db8::/32, NAT64 64:ff9b::/96 (may map to private v4).
        || (first == 0x2001 && ip.segments()[1] == 0x0db8)
        || (first == 0x0064 && ip.segments()[1] == 0xff9b))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(s: &str) -> Reference {
        s.parse().unwrap_or_else(|e| panic!("{e}"))
    }

    #[tokio::test]
    async fn private_and_metadata_addresses_need_an_explicit_allow() {
        let default = Allow::default();
        for refused in [
            "127.0.0.1:5000/app",
            "localhost:5000/app",
            "169.254.169.254/latest/meta",
            "10.1.2.3/app",
            "192.168.0.1:443/app",
            "172.16.0.1/app",
            "100.64.0.1/app",
        ] {
            let err = default.check(&r(refused)).await.expect_err(refused);
            let msg = err.to_string();
            assert!(matches!(err, RegistryError::Refused(_)), "{refused}: {msg}");
            assert!(msg.contains("--allow-registry"), "{msg}");
        }
        assert_eq!(
            default.check(&r("8.8.8.8/app")).await.ok(),
            Some(Reach::Public)
        );
        // References cannot spell IPv6 literals, but names resolve to them.
        for v6 in [
            "::1",
            "fd00::1",
            "fe80::1",
            "::ffff:127.0.0.1",
            "::ffff:10.0.0.1",
        ] {
            let ip: IpAddr = v6.parse().unwrap_or_else(|e| panic!("{e}"));
            assert!(!is_public(&ip), "{v6}");
        }
        assert!(is_public(
            &"2606:4700::1".parse().unwrap_or_else(|e| panic!("{e}"))
        ));

        let named = Allow::from_flags(&["127.0.0.1:5000".into()]).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            named.check(&r("127.0.0.1:5000/app")).await.ok(),
            Some(Reach::Named)
        );
        let err = named
            .check(&r("127.0.0.1:5001/app"))
            .await
            .expect_err("other port");
        assert!(
            err.to_string().contains("--allow-registry 127.0.0.1:5001"),
            "{err}"
        );
        // Named only: public registries are refused unless `public` is named too.
        assert!(named.check(&r("8.8.8.8/app")).await.is_err());
        let both = Allow::from_flags(&["127.0.0.1:5000".into(), "public".into()])
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(both.check(&r("8.8.8.8/app")).await.is_ok());
        assert!(both.check(&r("10.0.0.1/app")).await.is_err());
        assert!(Allow::from_flags(&["http://r:5000".into()]).is_err());
    }
}
