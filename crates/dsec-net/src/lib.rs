//! Sandbox networking for modes `allowlist` and `open` (mode `none` needs none of this:
//! the sandbox unshares a network namespace with only loopback).
//!
//! A networked sandbox gets a *slot*: a /30 of the node's sandbox subnet, a veth link
//! (`eth0` inside, `PREFIX<slot>` on the host), and a chain plus four sets in the node's
//! nftables table (see [`nft`]). Slots are prepared ahead in a small pool, so a create
//! only takes one and writes its policy. The node's filtering resolver ([`dns`]) turns
//! allowed names into admitted addresses.
//!
//! A sandbox with model access (slot option [`SlotOptions::model_link`]) may also call
//! the node's model gateway ([`NetConfig::model_gateway`]) at a fixed virtual address,
//! whatever its policy; in mode `none` it then gets a slot that reaches only that.
//!
//! Everything is found again after a restart: [`Network::start`] rebuilds the table for
//! the slots of re-adopted sandboxes and deletes links nobody owns.

mod dns;
mod netlink;
pub mod netns;
pub mod nft;

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::fd::OwnedFd;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use dsec_wire::v1::{AllowRule, NetworkMode, NetworkPolicy};
use serde::{Deserialize, Serialize};

/// Errors of the network layer.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// The host cannot give sandboxes a network (no nftables, not root, ...).
    #[error("networking unavailable: {0}")]
    Unavailable(String),
    /// A policy is invalid.
    #[error("invalid network policy: {0}")]
    Invalid(String),
    /// Every slot of the subnet is taken.
    #[error("no free network slot in the sandbox subnet")]
    Exhausted,
    /// nftables refused a script.
    #[error("nftables: {0}")]
    Nft(String),
    /// A sandbox asked for model access, but the node has no model gateway configured.
    #[error("model access asked for, but this node has no model gateway configured")]
    NoModelGateway,
    /// A namespace or link operation failed.
    #[error("{op}: {source}")]
    Os {
        /// What was attempted.
        op: String,
        /// OS error.
        source: std::io::Error,
    },
}

/// How the node networks sandboxes.
#[derive(Debug, Clone)]
pub struct NetConfig {
    /// Subnet sliced into one /30 per sandbox: address and prefix length (at most 30).
    pub subnet: (Ipv4Addr, u8),
    /// nftables table (family `inet`) owned by this node.
    pub table: String,
    /// Prefix of host link names (with the slot number at most 15 characters).
    pub link_prefix: String,
    /// Port of the node's resolver (sandboxes' port 53 is redirected to it).
    pub dns_port: u16,
    /// Upstream resolver; `None` takes the first `nameserver` of /etc/resolv.conf.
    pub upstream: Option<SocketAddr>,
    /// Slots kept prepared.
    pub pool_size: usize,
    /// The model gateway sandboxes with model access may call; `None`: no sandbox may
    /// (and the nftables table has no trace of it).
    pub model_gateway: Option<ModelGatewayNet>,
}

/// The virtual address sandboxes call the model gateway at, unless configured otherwise:
/// link-local, so it shadows no real destination, and the same on every node, so the
/// injected `OPENAI_BASE_URL` (`http://169.254.169.250/v1`) needs neither DNS nor a
/// per-node value.
pub const DEFAULT_MODEL_VIP: SocketAddrV4 =
    SocketAddrV4::new(Ipv4Addr::new(169, 254, 169, 250), 80);

/// How sandboxes with model access reach the model gateway.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelGatewayNet {
    /// The address sandboxes call (TCP); only traffic from model-linked sandboxes to it
    /// is sent on to [`Self::target`]. Default [`DEFAULT_MODEL_VIP`].
    pub vip: SocketAddrV4,
    /// Where the gateway actually listens.
    pub target: ModelGatewayTarget,
}

impl ModelGatewayNet {
    /// The default VIP in front of `target`.
    pub fn new(target: ModelGatewayTarget) -> Self {
        Self {
            vip: DEFAULT_MODEL_VIP,
            target,
        }
    }
}

/// Where the model gateway listens, as seen from the node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelGatewayTarget {
    /// On this node (`dsec serve --gateway-config`), bound to `0.0.0.0:port`: the VIP is
    /// redirected to the sandbox link's host end at `port`. From sandbox links only
    /// model-linked ones may use the port; every other link but loopback is refused it,
    /// as the resolver port is (the gateway serves callers outside sandboxes on another
    /// listener).
    Local {
        /// The gateway's TCP port.
        port: u16,
    },
    /// Elsewhere (a `dsec gateway` replica or a balancer in front of several): the VIP
    /// is DNATed to `addr` and masqueraded like other egress, whatever the sandbox's
    /// policy.
    Remote {
        /// The gateway's address and port.
        addr: SocketAddrV4,
    },
}

/// Per-slot options of [`Network::acquire_with`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SlotOptions {
    /// The sandbox may call the model gateway at its VIP (needs
    /// [`NetConfig::model_gateway`]). Kept across policy changes and restarts.
    pub model_link: bool,
}

impl Default for NetConfig {
    fn default() -> Self {
        Self {
            subnet: (Ipv4Addr::new(10, 231, 0, 0), 16),
            table: "dsec".into(),
            link_prefix: "dsv".into(),
            dns_port: 15353,
            upstream: None,
            pool_size: 8,
            model_gateway: None,
        }
    }
}

impl NetConfig {
    fn tables(&self) -> nft::Tables {
        nft::Tables {
            table: self.table.clone(),
            prefix: self.link_prefix.clone(),
            subnet: self.subnet,
            dns_port: self.dns_port,
            model: self.model_gateway,
        }
    }

    /// Checks the model gateway's addresses against the rest.
    fn check_model_gateway(&self) -> Result<(), NetError> {
        let Some(m) = &self.model_gateway else {
            return Ok(());
        };
        let in_subnet = |ip: &Ipv4Addr| {
            let (net, len) = self.subnet;
            let mask = u32::MAX << (32 - u32::from(len));
            u32::from(*ip) & mask == u32::from(net) & mask
        };
        let bad = |what: &str| Err(NetError::Invalid(format!("model gateway: {what}")));
        let vip = m.vip.ip();
        if vip.is_unspecified() || vip.is_loopback() || vip.is_broadcast() || in_subnet(vip) {
            return bad(&format!(
                "VIP {vip} must be a plain address outside the sandbox subnet"
            ));
        }
        // Port 53 from sandboxes always goes to the resolver.
        if m.vip.port() == 0 || m.vip.port() == 53 {
            return bad(&format!("VIP port {} is not usable", m.vip.port()));
        }
        match m.target {
            ModelGatewayTarget::Local { port } => {
                if port == 0 || port == self.dns_port {
                    return bad(&format!("local port {port} is not usable"));
                }
            }
            ModelGatewayTarget::Remote { addr } => {
                let ip = addr.ip();
                // A DNAT from prerouting cannot reach loopback; the subnet is sandboxes'.
                if ip.is_unspecified() || ip.is_loopback() || ip.is_broadcast() || in_subnet(ip) {
                    return bad(&format!(
                        "remote address {ip} must be routable from the node, outside the \
                         sandbox subnet and not loopback"
                    ));
                }
                if addr.port() == 0 {
                    return bad("remote port 0 is not usable");
                }
            }
        }
        Ok(())
    }
}

/// What a sandbox's runtime record keeps of its network, to find it after a restart.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetRecord {
    /// Its slot.
    pub slot: u32,
    /// Its policy.
    pub policy: NetworkPolicy,
    /// Its link is in `model_links` (it may call the model gateway).
    #[serde(default)]
    pub model_link: bool,
    /// Its link is a persistent tap device (a microVM's NIC), not a veth.
    #[serde(default)]
    pub tap: bool,
}

/// A slot handed to a new sandbox.
#[derive(Debug)]
pub struct Lease {
    /// Slot number.
    pub slot: u32,
    /// The sandbox's address.
    pub ip: Ipv4Addr,
    /// Its gateway and resolver (the host end).
    pub gateway: Ipv4Addr,
    /// Its network namespace, to hand to init.
    pub netns: OwnedFd,
    /// It may call the model gateway (for [`NetRecord::model_link`]).
    pub model_link: bool,
}

/// A sandbox's `/etc/resolv.conf`: the node's filtering resolver at the slot's host
/// end, `gateway`.
pub fn resolv_conf(gateway: Ipv4Addr) -> String {
    format!("nameserver {gateway}\noptions timeout:2 attempts:2\n")
}

/// A slot whose link is a tap device on the host, for a microVM: the guest's NIC is
/// the tap's other end, and the guest configures [`TapLease::ip`] on it itself.
#[derive(Debug, Clone)]
pub struct TapLease {
    /// Slot number.
    pub slot: u32,
    /// The tap's name on the host (the slot's link name).
    pub ifname: String,
    /// The guest's address.
    pub ip: Ipv4Addr,
    /// Prefix length of the slot's network.
    pub prefix_len: u8,
    /// Its gateway and resolver (the tap's host address).
    pub gateway: Ipv4Addr,
}

/// What the resolver knows of a sandbox, by its address.
#[derive(Debug, Clone)]
pub(crate) struct Entry {
    pub id: String,
    pub slot: u32,
    pub mode: NetworkMode,
    pub rules: Arc<Vec<AllowRule>>,
}

/// Sandboxes by address, shared with the resolver.
#[derive(Debug, Default)]
pub(crate) struct Registry {
    by_addr: Mutex<HashMap<Ipv4Addr, Entry>>,
    denied: Mutex<HashMap<Ipv4Addr, u64>>,
}

impl Registry {
    fn map(&self) -> MutexGuard<'_, HashMap<Ipv4Addr, Entry>> {
        self.by_addr.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn by_addr(&self, ip: Ipv4Addr) -> Option<Entry> {
        self.map().get(&ip).cloned()
    }

    pub(crate) fn count_denied(&self, ip: Ipv4Addr) {
        *self
            .denied
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(ip)
            .or_default() += 1;
    }
}

/// Parses and checks a policy: rules only with `allowlist`, every rule valid.
pub fn parse_policy(p: &NetworkPolicy) -> Result<Vec<AllowRule>, NetError> {
    if p.mode != NetworkMode::Allowlist && !p.allow.is_empty() {
        return Err(NetError::Invalid(
            "network.allow is only meaningful with mode allowlist".into(),
        ));
    }
    if p.allow.len() > 256 {
        return Err(NetError::Invalid("network.allow: at most 256 rules".into()));
    }
    p.allow
        .iter()
        .map(|r| AllowRule::parse(r).map_err(NetError::Invalid))
        .collect()
}

#[derive(Debug, Default)]
struct Slots {
    /// Where the next search for a free slot starts: slots are handed out round-robin,
    /// so a released one is reused last, long after its namespace is gone.
    cursor: u32,
    /// Slots in use: live, pooled or being prepared.
    taken: std::collections::HashSet<u32>,
    /// Slots of live sandboxes.
    by_id: HashMap<String, Live>,
}

/// A live sandbox's slot.
#[derive(Debug, Clone)]
struct Live {
    slot: u32,
    policy: NetworkPolicy,
    model_link: bool,
    /// Its link is a tap (a microVM's), deleted on release.
    tap: bool,
}

#[derive(Debug, Default)]
struct Pool {
    ready: Vec<(u32, OwnedFd)>,
    stop: bool,
}

/// The node's sandbox networking. Dropping it stops the resolver and the pool; the table
/// and the links of live sandboxes stay for the next run to adopt.
#[derive(Debug)]
pub struct Network {
    cfg: NetConfig,
    tables: nft::Tables,
    slots: Mutex<Slots>,
    pool: Arc<(Mutex<Pool>, Condvar)>,
    registry: Arc<Registry>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Network {
    /// Sets the node up: enables forwarding, replaces the nftables table, starts the
    /// resolver (needs a tokio runtime) and the slot pool, and re-adopts `adopt`
    /// (sandbox id and record). Host links with the prefix that no adopted sandbox owns
    /// are deleted.
    pub fn start(cfg: NetConfig, adopt: &[(String, NetRecord)]) -> Result<Arc<Self>, NetError> {
        let (_, len) = cfg.subnet;
        if !(8..=30).contains(&len) {
            return Err(NetError::Invalid(format!(
                "sandbox subnet prefix /{len}: must be /8 to /30"
            )));
        }
        cfg.check_model_gateway()?;
        let max_slot = (1u32 << (32 - len)) / 4;
        if cfg.link_prefix.len() + max_slot.to_string().len() >= libc::IFNAMSIZ {
            return Err(NetError::Invalid(format!(
                "link prefix {:?} too long for {max_slot} slots",
                cfg.link_prefix
            )));
        }
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|_| NetError::Unavailable("the resolver needs a tokio runtime".into()))?;
        let upstream = match cfg.upstream {
            Some(u) => u,
            None => system_resolver()?,
        };
        std::fs::write("/proc/sys/net/ipv4/ip_forward", "1").map_err(|source| NetError::Os {
            op: "enable IPv4 forwarding".into(),
            source,
        })?;
        let tables = cfg.tables();
        let mut script = tables.base();
        let mut slots = Slots::default();
        let registry = Arc::new(Registry::default());
        let mut rules_of = Vec::new();
        for (id, rec) in adopt {
            let rules = parse_policy(&rec.policy)?;
            script.push_str(&tables.add_slot(rec.slot));
            script.push_str(&tables.set_policy(rec.slot, rec.policy.mode, &rules));
            if rec.model_link {
                if cfg.model_gateway.is_some() {
                    script.push_str(&tables.link_model(rec.slot));
                } else {
                    // The sandbox keeps the right (in its record) for a later start with
                    // a gateway; it cannot use it now, and refusing to start would take
                    // every other sandbox's network down with it.
                    tracing::warn!(%id, "sandbox has model access but no model gateway is configured");
                }
            }
            slots.by_id.insert(
                id.clone(),
                Live {
                    slot: rec.slot,
                    policy: rec.policy.clone(),
                    model_link: rec.model_link,
                    tap: rec.tap,
                },
            );
            rules_of.push((id.clone(), rec.slot, rec.policy.mode, rules));
        }
        let owned: std::collections::HashSet<String> = adopt
            .iter()
            .map(|(_, r)| format!("{}{}", cfg.link_prefix, r.slot))
            .collect();
        for link in netns::links_with_prefix(&cfg.link_prefix) {
            let slot_like = link[cfg.link_prefix.len()..]
                .bytes()
                .all(|b| b.is_ascii_digit());
            if slot_like && !owned.contains(&link) {
                tracing::info!(%link, "deleting a sandbox link nobody owns");
                let _ = netns::remove_link(&link);
            }
        }
        nft::apply(&script)?;
        slots.taken = adopt.iter().map(|(_, r)| r.slot).collect();
        slots.cursor = slots.taken.iter().max().map_or(0, |m| m + 1);
        for (id, slot, mode, rules) in rules_of {
            let ip = slot_addrs(cfg.subnet, slot).sandbox;
            registry.map().insert(
                ip,
                Entry {
                    id,
                    slot,
                    mode,
                    rules: Arc::new(rules),
                },
            );
        }

        let bind = |what: &str, e: std::io::Error| NetError::Os {
            op: format!("bind the resolver's {what} port {}", cfg.dns_port),
            source: e,
        };
        let udp =
            std::net::UdpSocket::bind(("0.0.0.0", cfg.dns_port)).map_err(|e| bind("UDP", e))?;
        let tcp =
            std::net::TcpListener::bind(("0.0.0.0", cfg.dns_port)).map_err(|e| bind("TCP", e))?;
        udp.set_nonblocking(true).map_err(|e| bind("UDP", e))?;
        tcp.set_nonblocking(true).map_err(|e| bind("TCP", e))?;
        let resolver = Arc::new(dns::Resolver::new(
            registry.clone(),
            upstream,
            tables.clone(),
        ));
        let tasks = {
            let _guard = runtime.enter();
            let udp = tokio::net::UdpSocket::from_std(udp).map_err(|e| bind("UDP", e))?;
            let tcp = tokio::net::TcpListener::from_std(tcp).map_err(|e| bind("TCP", e))?;
            Vec::from(dns::serve(resolver, udp, tcp))
        };
        tracing::info!(table = %cfg.table, %upstream, port = cfg.dns_port, "sandbox networking up");
        let net = Arc::new(Self {
            cfg,
            tables,
            slots: Mutex::new(slots),
            pool: Arc::new((Mutex::new(Pool::default()), Condvar::new())),
            registry,
            tasks,
        });
        net.start_pool();
        Ok(net)
    }

    fn slots(&self) -> MutexGuard<'_, Slots> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The host link name of a slot.
    pub fn link_name(&self, slot: u32) -> String {
        format!("{}{slot}", self.cfg.link_prefix)
    }

    /// A free slot whose link name is not in use (a released sandbox's link goes away
    /// with its namespace, asynchronously).
    fn take_slot(&self) -> Result<u32, NetError> {
        let max = (1u32 << (32 - self.cfg.subnet.1)) / 4;
        let mut s = self.slots();
        for _ in 0..max {
            let n = s.cursor % max;
            s.cursor = (n + 1) % max;
            let link = format!("/sys/class/net/{}", self.link_name(n));
            if !s.taken.contains(&n) && !std::path::Path::new(&link).exists() {
                s.taken.insert(n);
                return Ok(n);
            }
        }
        Err(NetError::Exhausted)
    }

    fn give_back(&self, slot: u32) {
        self.slots().taken.remove(&slot);
    }

    /// Makes a slot ready: namespace, link, chain and sets.
    fn prepare(&self, slot: u32) -> Result<OwnedFd, NetError> {
        let link = self.link_name(slot);
        let ns = netns::prepare(&link, slot_addrs(self.cfg.subnet, slot)).map_err(|source| {
            NetError::Os {
                op: format!("prepare network namespace with link {link}"),
                source,
            }
        })?;
        if let Err(e) = nft::apply(&self.tables.add_slot(slot)) {
            let _ = netns::remove_link(&link);
            return Err(e);
        }
        Ok(ns)
    }

    fn start_pool(self: &Arc<Self>) {
        if self.cfg.pool_size == 0 {
            return;
        }
        let weak = Arc::downgrade(self);
        let pool = self.pool.clone();
        let spawned = std::thread::Builder::new()
            .name("dsec-netns-pool".into())
            .spawn(move || loop {
                {
                    let (lock, cv) = &*pool;
                    let mut p = lock.lock().unwrap_or_else(|e| e.into_inner());
                    loop {
                        if p.stop {
                            return;
                        }
                        let Some(net) = weak.upgrade() else { return };
                        if p.ready.len() < net.cfg.pool_size {
                            break;
                        }
                        drop(net);
                        p = cv.wait(p).unwrap_or_else(|e| e.into_inner());
                    }
                }
                let Some(net) = weak.upgrade() else { return };
                let made = net.take_slot().and_then(|slot| match net.prepare(slot) {
                    Ok(ns) => Ok((slot, ns)),
                    Err(e) => {
                        net.give_back(slot);
                        Err(e)
                    }
                });
                match made {
                    Ok(ready) => {
                        let (lock, _) = &*pool;
                        let mut p = lock.lock().unwrap_or_else(|e| e.into_inner());
                        if p.stop {
                            // Stopped while this one was made: it goes like the others.
                            drop(p);
                            let (slot, ns) = ready;
                            drop(ns);
                            let _ = netns::remove_link(&net.link_name(slot));
                            net.discard(slot);
                            return;
                        }
                        p.ready.push(ready);
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "network pool: could not prepare a slot");
                        drop(net);
                        std::thread::sleep(std::time::Duration::from_secs(1));
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "network pool thread not started");
        }
    }

    /// Gives sandbox `id` a slot with `policy` (mode `allowlist` or `open`); the same as
    /// [`Self::acquire_with`] with default options.
    pub fn acquire(&self, id: &str, policy: &NetworkPolicy) -> Result<Lease, NetError> {
        self.acquire_with(id, policy, SlotOptions::default())
    }

    /// Gives sandbox `id` a slot with `policy` and `opts`. Mode `none` gets a slot only
    /// with a model link: it then reaches the model gateway and nothing else. A model
    /// link with no model gateway configured is [`NetError::NoModelGateway`].
    pub fn acquire_with(
        &self,
        id: &str,
        policy: &NetworkPolicy,
        opts: SlotOptions,
    ) -> Result<Lease, NetError> {
        let rules = parse_policy(policy)?;
        if opts.model_link && self.cfg.model_gateway.is_none() {
            return Err(NetError::NoModelGateway);
        }
        if policy.mode == NetworkMode::None && !opts.model_link {
            return Err(NetError::Invalid("mode none needs no slot".into()));
        }
        let pooled = {
            let (lock, cv) = &*self.pool;
            let got = lock.lock().unwrap_or_else(|e| e.into_inner()).ready.pop();
            cv.notify_one();
            got
        };
        let (slot, netns) = match pooled {
            Some(x) => x,
            None => {
                let slot = self.take_slot()?;
                match self.prepare(slot) {
                    Ok(ns) => (slot, ns),
                    Err(e) => {
                        self.give_back(slot);
                        return Err(e);
                    }
                }
            }
        };
        self.admit(id, slot, policy, rules, opts, false)?;
        let addrs = slot_addrs(self.cfg.subnet, slot);
        Ok(Lease {
            slot,
            ip: addrs.sandbox,
            gateway: addrs.host,
            netns,
            model_link: opts.model_link,
        })
    }

    /// Gives microVM `id` a slot whose link is a persistent tap device on the host
    /// (mode `allowlist` or `open`), under the same nftables chain and resolver as a
    /// veth slot: the tap's host end is the guest's gateway and resolver. The tap
    /// outlives its VMM (a paused microVM) and goes on [`Self::release`].
    pub fn acquire_tap(&self, id: &str, policy: &NetworkPolicy) -> Result<TapLease, NetError> {
        let rules = parse_policy(policy)?;
        if policy.mode == NetworkMode::None {
            return Err(NetError::Invalid("mode none needs no slot".into()));
        }
        let slot = self.take_slot()?;
        let ifname = self.link_name(slot);
        let addrs = slot_addrs(self.cfg.subnet, slot);
        let made = dsec_netconf::create_persistent_tap(&ifname)
            .and_then(|()| dsec_netconf::set_addr(&ifname, addrs.host, 30))
            .and_then(|()| dsec_netconf::set_up(&ifname))
            .map_err(|source| NetError::Os {
                op: format!("make tap device {ifname}"),
                source,
            })
            .and_then(|()| nft::apply(&self.tables.add_slot(slot)));
        if let Err(e) = made {
            let _ = netns::remove_link(&ifname);
            self.give_back(slot);
            return Err(e);
        }
        if let Err(e) = self.admit(id, slot, policy, rules, SlotOptions::default(), true) {
            let _ = netns::remove_link(&ifname);
            return Err(e);
        }
        Ok(TapLease {
            slot,
            ifname,
            ip: addrs.sandbox,
            prefix_len: 30,
            gateway: addrs.host,
        })
    }

    /// Writes a prepared slot's policy and makes it sandbox `id`'s; on error the slot is
    /// discarded.
    fn admit(
        &self,
        id: &str,
        slot: u32,
        policy: &NetworkPolicy,
        rules: Vec<AllowRule>,
        opts: SlotOptions,
        tap: bool,
    ) -> Result<(), NetError> {
        let mut script = self.tables.set_policy(slot, policy.mode, &rules);
        if opts.model_link {
            script.push_str(&self.tables.link_model(slot));
        }
        if let Err(e) = nft::apply(&script) {
            self.discard(slot);
            return Err(e);
        }
        let addrs = slot_addrs(self.cfg.subnet, slot);
        self.registry.map().insert(
            addrs.sandbox,
            Entry {
                id: id.to_string(),
                slot,
                mode: policy.mode,
                rules: Arc::new(rules),
            },
        );
        self.slots().by_id.insert(
            id.to_string(),
            Live {
                slot,
                policy: policy.clone(),
                model_link: opts.model_link,
                tap,
            },
        );
        Ok(())
    }

    /// Replaces the policy of a live sandbox. The mode can change between `allowlist`
    /// and `open`, and to `none` only for a sandbox with a model link (which it keeps:
    /// the model link is not part of the policy).
    pub fn set_policy(&self, id: &str, policy: &NetworkPolicy) -> Result<(), NetError> {
        let rules = parse_policy(policy)?;
        let (slot, model_link) = self
            .slots()
            .by_id
            .get(id)
            .map(|l| (l.slot, l.model_link))
            .ok_or_else(|| NetError::Invalid(format!("sandbox {id} has no network")))?;
        if policy.mode == NetworkMode::None && !model_link {
            return Err(NetError::Invalid(
                "a networked sandbox cannot switch to mode none; use an empty allowlist".into(),
            ));
        }
        nft::apply(&self.tables.set_policy(slot, policy.mode, &rules))?;
        let ip = slot_addrs(self.cfg.subnet, slot).sandbox;
        if let Some(e) = self.registry.map().get_mut(&ip) {
            e.mode = policy.mode;
            e.rules = Arc::new(rules);
        }
        if let Some(entry) = self.slots().by_id.get_mut(id) {
            entry.policy = policy.clone();
        }
        Ok(())
    }

    /// The record to keep for sandbox `id`, if it has a slot.
    pub fn record(&self, id: &str) -> Option<NetRecord> {
        self.slots().by_id.get(id).map(|l| NetRecord {
            slot: l.slot,
            policy: l.policy.clone(),
            model_link: l.model_link,
            tap: l.tap,
        })
    }

    /// DNS queries of sandbox `id` answered NXDOMAIN because no rule allowed the name.
    pub fn denied_queries(&self, id: &str) -> u64 {
        let Some(slot) = self.slots().by_id.get(id).map(|l| l.slot) else {
            return 0;
        };
        let ip = slot_addrs(self.cfg.subnet, slot).sandbox;
        self.registry
            .denied
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&ip)
            .copied()
            .unwrap_or(0)
    }

    /// Takes sandbox `id`'s slot away: link, chain and sets, and its `model_links`
    /// membership. Unknown ids are fine.
    pub fn release(&self, id: &str) -> Result<(), NetError> {
        let Some(Live { slot, tap, .. }) = self.slots().by_id.remove(id) else {
            return Ok(());
        };
        if tap {
            // A persistent tap has no namespace to go with: it is deleted here, before
            // its slot can be taken again.
            let link = self.link_name(slot);
            if let Err(e) = netns::remove_link(&link) {
                if std::path::Path::new("/sys/class/net").join(&link).exists() {
                    tracing::warn!(%link, error = %e, "deleting a microVM's tap");
                }
            }
        }
        let ip = slot_addrs(self.cfg.subnet, slot).sandbox;
        self.registry.map().remove(&ip);
        self.registry
            .denied
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&ip);
        self.discard(slot);
        Ok(())
    }

    /// Takes a slot out of the table. Its link is not deleted here: deleting a veth
    /// holds the kernel's RTNL lock for tens of milliseconds (an RCU grace period),
    /// stalling every create meanwhile; the link goes with the namespace once the
    /// sandbox's last process and our fd are gone, and the slot is not reused before.
    fn discard(&self, slot: u32) {
        if let Err(e) = nft::apply(&self.tables.remove_slot(slot)) {
            tracing::warn!(slot, error = %e, "remove slot from nftables");
        }
        self.give_back(slot);
    }

    /// Slots of live sandboxes.
    pub fn live(&self) -> usize {
        self.slots().by_id.len()
    }

    /// Stops the slot pool and takes its prepared slots away, links and chains: only
    /// sandboxes' slots stay in the table. Idempotent.
    pub fn stop_pool(&self) {
        let (lock, cv) = &*self.pool;
        let ready: Vec<(u32, OwnedFd)> = {
            let mut p = lock.lock().unwrap_or_else(|e| e.into_inner());
            p.stop = true;
            p.ready.drain(..).collect()
        };
        cv.notify_all();
        for (slot, ns) in ready {
            drop(ns);
            let _ = netns::remove_link(&self.link_name(slot));
            self.discard(slot);
        }
    }

    /// Stops the node's networking for good (a graceful stop): the pool's slots go, and
    /// with no sandbox left, the table and every slot link too. Returns whether nothing
    /// is left.
    pub fn shutdown(&self) -> bool {
        self.stop_pool();
        for t in &self.tasks {
            t.abort();
        }
        if self.live() > 0 {
            return false;
        }
        remove_traces(&self.cfg);
        true
    }
}

/// Removes what a node with `cfg` leaves on the host when no sandbox of it is left: its
/// nftables table and every slot link of its prefix (`dsec serve --cleanup`, a graceful
/// stop). Failures are logged.
pub fn remove_traces(cfg: &NetConfig) {
    for link in netns::links_with_prefix(&cfg.link_prefix) {
        let slot_like = link[cfg.link_prefix.len()..]
            .bytes()
            .all(|b| b.is_ascii_digit());
        if slot_like {
            if let Err(e) = netns::remove_link(&link) {
                tracing::warn!(%link, error = %e, "removing a sandbox link");
            }
        }
    }
    if let Err(e) = nft::apply(&cfg.tables().delete()) {
        tracing::warn!(table = %cfg.table, error = %e, "deleting the nftables table");
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
        // Unused prepared slots: their namespaces die with the fds; their links and
        // chains go now, so no chain is left for a link that no longer exists.
        self.stop_pool();
    }
}

/// Addresses of slot `n` in `subnet`.
pub fn slot_addrs(subnet: (Ipv4Addr, u8), n: u32) -> netns::SlotAddrs {
    let base = u32::from(subnet.0) + n * 4;
    netns::SlotAddrs {
        host: Ipv4Addr::from(base + 1),
        sandbox: Ipv4Addr::from(base + 2),
    }
}

/// The first IPv4 `nameserver` of /etc/resolv.conf, port 53.
fn system_resolver() -> Result<SocketAddr, NetError> {
    let conf = std::fs::read_to_string("/etc/resolv.conf").map_err(|source| NetError::Os {
        op: "read /etc/resolv.conf".into(),
        source,
    })?;
    conf.lines()
        .filter_map(|l| l.trim().strip_prefix("nameserver"))
        .filter_map(|ip| ip.trim().parse::<Ipv4Addr>().ok())
        .find(|ip| !ip.is_loopback())
        .or_else(|| {
            conf.lines()
                .filter_map(|l| l.trim().strip_prefix("nameserver"))
                .find_map(|ip| ip.trim().parse::<Ipv4Addr>().ok())
        })
        .map(|ip| SocketAddr::from((ip, 53)))
        .ok_or_else(|| {
            NetError::Unavailable(
                "no IPv4 nameserver in /etc/resolv.conf; pass --dns-upstream".into(),
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_consecutive_slash_30s() {
        let s = slot_addrs((Ipv4Addr::new(10, 231, 0, 0), 16), 65);
        assert_eq!(s.host, Ipv4Addr::new(10, 231, 1, 5));
        assert_eq!(s.sandbox, Ipv4Addr::new(10, 231, 1, 6));
    }

    #[test]
    fn policies_are_checked() {
        let bad = NetworkPolicy {
            mode: NetworkMode::Open,
            allow: vec!["pypi.org".into()],
        };
        assert!(matches!(parse_policy(&bad), Err(NetError::Invalid(_))));
        let bad = NetworkPolicy {
            mode: NetworkMode::Allowlist,
            allow: vec!["pypi.org:x".into()],
        };
        assert!(matches!(parse_policy(&bad), Err(NetError::Invalid(_))));
        let ok = NetworkPolicy {
            mode: NetworkMode::Allowlist,
            allow: vec!["pypi.org:443".into(), "*.pythonhosted.org".into()],
        };
        assert_eq!(parse_policy(&ok).expect("valid").len(), 2);
    }

    #[test]
    fn model_gateway_addresses_are_checked() {
        let with = |vip: &str, target| NetConfig {
            model_gateway: Some(ModelGatewayNet {
                vip: vip.parse().expect("vip"),
                target,
            }),
            ..NetConfig::default()
        };
        let local = ModelGatewayTarget::Local { port: 8090 };
        let remote = |a: &str| ModelGatewayTarget::Remote {
            addr: a.parse().expect("addr"),
        };
        assert!(NetConfig::default().check_model_gateway().is_ok());
        assert!(with("169.254.169.250:80", local)
            .check_model_gateway()
            .is_ok());
        assert!(with("169.254.169.250:80", remote("192.0.2.9:443"))
            .check_model_gateway()
            .is_ok());
        for bad in [
            with("10.231.0.9:80", local),
            with("127.0.0.1:80", local),
            with("169.254.169.250:53", local),
            with(
                "169.254.169.250:80",
                ModelGatewayTarget::Local { port: 15353 },
            ),
            with("169.254.169.250:80", ModelGatewayTarget::Local { port: 0 }),
            with("169.254.169.250:80", remote("127.0.0.1:8090")),
            with("169.254.169.250:80", remote("10.231.7.1:8090")),
            with("169.254.169.250:80", remote("192.0.2.9:0")),
        ] {
            assert!(
                matches!(bad.check_model_gateway(), Err(NetError::Invalid(_))),
                "{:?}",
                bad.model_gateway
            );
        }
    }
}
