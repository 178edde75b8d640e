//! The node's filtering resolver. Every DNS query a sandbox sends (to any address: the
//! table redirects port 53) arrives here. For an `allowlist` sandbox a name that no rule
//! allows is answered NXDOMAIN without going upstream, so data cannot be tunnelled out
//! through query names; an allowed name is resolved upstream and, before the answer is
//! passed back, its IPv4 addresses are admitted to the sandbox's sets for the answer's
//! TTL (plus a grace period), so the connection that follows is let through.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use dsec_wire::v1::NetworkMode;
use hickory_proto::op::{Message, MessageType, ResponseCode};
use hickory_proto::rr::RData;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::sync::Semaphore;

use crate::{nft, Registry};

/// How long an upstream query may take, per attempt.
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(2);
/// Added to an answer's TTL for the admitted addresses: clients reuse answers a little
/// past their TTL.
const GRACE_S: u64 = 60;
/// Queries in flight at once, over all sandboxes; more are dropped (the client retries).
const MAX_IN_FLIGHT: usize = 256;

/// What the resolver needs: who asks, where to forward, how to admit addresses.
#[derive(Debug)]
pub(crate) struct Resolver {
    pub registry: Arc<Registry>,
    pub upstream: SocketAddr,
    pub tables: nft::Tables,
    pub in_flight: Arc<Semaphore>,
}

impl Resolver {
    pub(crate) fn new(registry: Arc<Registry>, upstream: SocketAddr, tables: nft::Tables) -> Self {
        Self {
            registry,
            upstream,
            tables,
            in_flight: Arc::new(Semaphore::new(MAX_IN_FLIGHT)),
        }
    }
}

/// Serves DNS on the two sockets; returns the UDP and TCP server tasks.
pub(crate) fn serve(
    resolver: Arc<Resolver>,
    udp: UdpSocket,
    tcp: TcpListener,
) -> [tokio::task::JoinHandle<()>; 2] {
    let tcp_resolver = resolver.clone();
    let tcp_task = tokio::spawn(async move {
        loop {
            let Ok((stream, peer)) = tcp.accept().await else {
                continue;
            };
            let r = tcp_resolver.clone();
            tokio::spawn(async move {
                let _ = serve_tcp(r, stream, peer).await;
            });
        }
    });
    let udp = Arc::new(udp);
    let udp_task = tokio::spawn(async move {
        let mut buf = vec![0u8; 4096];
        loop {
            let (n, peer) = match udp.recv_from(&mut buf).await {
                Ok(x) => x,
                Err(e) => {
                    tracing::warn!(error = %e, "dns: receive");
                    continue;
                }
            };
            let Ok(permit) = resolver.in_flight.clone().try_acquire_owned() else {
                continue;
            };
            let query = buf[..n].to_vec();
            let (r, sock) = (resolver.clone(), udp.clone());
            tokio::spawn(async move {
                if let Some(answer) = answer(&r, &query, peer, false).await {
                    let _ = sock.send_to(&answer, peer).await;
                }
                drop(permit);
            });
        }
    });
    [udp_task, tcp_task]
}

async fn serve_tcp(
    r: Arc<Resolver>,
    mut stream: TcpStream,
    peer: SocketAddr,
) -> std::io::Result<()> {
    loop {
        let len = match tokio::time::timeout(Duration::from_secs(10), stream.read_u16()).await {
            Ok(Ok(l)) => usize::from(l),
            _ => return Ok(()),
        };
        let mut query = vec![0u8; len];
        stream.read_exact(&mut query).await?;
        let Ok(_permit) = r.in_flight.try_acquire() else {
            return Ok(());
        };
        let Some(answer) = answer(&r, &query, peer, true).await else {
            return Ok(());
        };
        let len = u16::try_from(answer.len()).unwrap_or(u16::MAX);
        stream.write_u16(len).await?;
        stream.write_all(&answer).await?;
    }
}

/// The reply to one query from `peer`, or `None` to stay silent (garbage, unknown peer).
async fn answer(r: &Resolver, query: &[u8], peer: SocketAddr, tcp: bool) -> Option<Vec<u8>> {
    let msg = Message::from_vec(query).ok()?;
    if msg.message_type() != MessageType::Query {
        return None;
    }
    let SocketAddr::V4(peer) = peer else {
        return refuse(&msg, ResponseCode::Refused);
    };
    let Some(who) = r.registry.by_addr(*peer.ip()) else {
        // Not a sandbox of ours (the table only lets sandboxes reach this port).
        return refuse(&msg, ResponseCode::Refused);
    };
    let names: Vec<String> = msg
        .queries()
        .iter()
        .map(|q| {
            q.name()
                .to_ascii()
                .trim_end_matches('.')
                .to_ascii_lowercase()
        })
        .collect();
    if names.is_empty() {
        return refuse(&msg, ResponseCode::FormErr);
    }
    let mut ports = Vec::new();
    match who.mode {
        NetworkMode::None => return refuse(&msg, ResponseCode::Refused),
        NetworkMode::Open => {}
        NetworkMode::Allowlist => {
            for name in &names {
                let matching: Vec<Option<u16>> = who
                    .rules
                    .iter()
                    .filter(|rule| rule.matches_name(name))
                    .map(|rule| rule.port)
                    .collect();
                if matching.is_empty() {
                    tracing::info!(sandbox = %who.id, %name, "dns: name not allowed");
                    r.registry.count_denied(*peer.ip());
                    return refuse(&msg, ResponseCode::NXDomain);
                }
                ports.extend(matching);
            }
            if ports.contains(&None) {
                ports = vec![None];
            }
            ports.sort_unstable();
            ports.dedup();
        }
    }
    let reply = forward(r.upstream, query, tcp).await;
    let Some(reply) = reply else {
        return refuse(&msg, ResponseCode::ServFail);
    };
    if who.mode == NetworkMode::Allowlist {
        if let Ok(parsed) = Message::from_vec(&reply) {
            let mut ttl = u64::MAX;
            let mut addrs: Vec<Ipv4Addr> = Vec::new();
            for rec in parsed.answers() {
                if let Some(RData::A(a)) = rec.data() {
                    addrs.push(a.0);
                    ttl = ttl.min(u64::from(rec.ttl()));
                }
            }
            if !addrs.is_empty() {
                let pairs: Vec<(Ipv4Addr, Option<u16>)> = addrs
                    .iter()
                    .flat_map(|a| ports.iter().map(move |p| (*a, *p)))
                    .collect();
                let script = r.tables.admit(who.slot, &pairs, ttl.max(1) + GRACE_S);
                let applied = tokio::task::spawn_blocking(move || nft::apply(&script)).await;
                if !matches!(applied, Ok(Ok(()))) {
                    // The sandbox may be going away; without the addresses admitted the
                    // answer would only lead to a rejected connection.
                    tracing::warn!(sandbox = %who.id, "dns: could not admit addresses");
                    return refuse(&msg, ResponseCode::ServFail);
                }
            }
        }
    }
    Some(reply)
}

/// An answer with no records and the given code.
fn refuse(q: &Message, code: ResponseCode) -> Option<Vec<u8>> {
    let mut m = Message::new();
    m.set_id(q.id())
        .set_message_type(MessageType::Response)
        .set_op_code(q.op_code())
        .set_recursion_desired(q.recursion_desired())
        .set_recursion_available(true)
        .set_response_code(code);
    m.add_queries(q.queries().to_vec());
    m.to_vec().ok()
}

/// Sends the query upstream (two tries over UDP, or once over TCP) and returns the reply
/// bytes when their id matches.
async fn forward(upstream: SocketAddr, query: &[u8], tcp: bool) -> Option<Vec<u8>> {
    if tcp {
        return tokio::time::timeout(UPSTREAM_TIMEOUT, forward_tcp(upstream, query))
            .await
            .ok()?
            .ok();
    }
    let sock = UdpSocket::bind("0.0.0.0:0").await.ok()?;
    sock.connect(upstream).await.ok()?;
    let mut buf = vec![0u8; 65535];
    for _ in 0..2 {
        sock.send(query).await.ok()?;
        let deadline = tokio::time::Instant::now() + UPSTREAM_TIMEOUT;
        loop {
            match tokio::time::timeout_at(deadline, sock.recv(&mut buf)).await {
                Ok(Ok(n)) if n >= 2 && buf[..2] == query[..2] => return Some(buf[..n].to_vec()),
                Ok(Ok(_)) => continue,
                Ok(Err(_)) | Err(_) => break,
            }
        }
    }
    None
}

async fn forward_tcp(upstream: SocketAddr, query: &[u8]) -> std::io::Result<Vec<u8>> {
    let mut s = TcpStream::connect(upstream).await?;
    let len = u16::try_from(query.len()).map_err(std::io::Error::other)?;
    s.write_u16(len).await?;
    s.write_all(query).await?;
    let n = usize::from(s.read_u16().await?);
    let mut reply = vec![0u8; n];
    s.read_exact(&mut reply).await?;
    Ok(reply)
}
