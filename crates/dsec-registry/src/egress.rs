//! The guard on every connection of a pull whose registry is allowed only because it is
//! public ([`Allow`](crate::Allow) without a name for it).
//!
//! Checking the reference's host before the pull is not enough: the registry answers
//! with a token realm, blob redirects (to a CDN or a bucket) and other hosts of its
//! choosing, and a name may resolve to a public address when checked and to the cloud
//! metadata endpoint when connected (DNS rebinding). So such a pull's client sends every
//! request through [`Egress`], a proxy on loopback that lives for the pull: it resolves
//! each destination once, refuses it unless every address is permitted, and connects to
//! the address it checked. HTTPS goes through `CONNECT` (the TLS stays end to end); plain
//! HTTP comes in absolute form and is passed on as it is (servers must accept it).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

/// Whether a pull may connect to a destination address.
pub(crate) type Permit = Arc<dyn Fn(&SocketAddr) -> bool + Send + Sync>;

/// Longest request head the proxy reads.
const HEAD_LIMIT: usize = 16 << 10;

/// How long resolving and connecting to one destination may take.
const DIAL_TIMEOUT: Duration = Duration::from_secs(10);

/// A loopback proxy that lets a pull reach only permitted addresses; stops (with every
/// connection through it) when dropped.
pub(crate) struct Egress {
    addr: SocketAddr,
    refused: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Egress {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Egress {
    /// Starts a proxy that connects only where `permit` says.
    pub(crate) async fn start(permit: Permit) -> std::io::Result<Self> {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
        let addr = listener.local_addr()?;
        let refused = Arc::new(Mutex::new(Vec::new()));
        let task = tokio::spawn(serve(listener, permit, refused.clone()));
        Ok(Self {
            addr,
            refused,
            task,
        })
    }

    /// The proxy URL for the pull's client.
    pub(crate) fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The first destination refused (`host:port (address)`), if any was.
    pub(crate) fn refused(&self) -> Option<String> {
        self.refused
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .first()
            .cloned()
    }
}

/// Accepts connections until the task is aborted; aborting it drops (and so closes)
/// every connection it relays.
async fn serve(listener: TcpListener, permit: Permit, refused: Arc<Mutex<Vec<String>>>) {
    let mut relays = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    relays.spawn(relay(stream, permit.clone(), refused.clone()));
                }
                Err(e) => {
                    tracing::debug!(error = %e, "registry egress proxy: accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            },
            Some(_) = relays.join_next(), if !relays.is_empty() => {}
        }
    }
}

/// Why a destination was not reached.
enum DialError {
    /// Not permitted: `host:port (address)`.
    Refused(String),
    /// Could not be resolved or connected to.
    Failed(String),
}

/// Relays one client connection to the destination its first request names.
async fn relay(stream: TcpStream, permit: Permit, refused: Arc<Mutex<Vec<String>>>) {
    let mut client = BufReader::new(stream);
    let Some(head) = read_head(&mut client).await else {
        return;
    };
    let line = String::from_utf8_lossy(head.split(|b| *b == b'\n').next().unwrap_or(&[]))
        .trim_end()
        .to_string();
    let mut words = line.split(' ');
    let (method, target) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    let tunnel = method.eq_ignore_ascii_case("CONNECT");
    let destination = if tunnel {
        Some(crate::allow::split_host_port(target, 443))
    } else {
        target
            .strip_prefix("http://")
            .map(|rest| rest.split(['/', '?']).next().unwrap_or(rest))
            .map(|authority| crate::allow::split_host_port(authority, 80))
    };
    let Some((host, port)) = destination else {
        let _ = reply(client.get_mut(), "400 Bad Request", "not a proxy request").await;
        return;
    };
    let mut upstream = match dial(host, port, &permit).await {
        Ok(s) => s,
        Err(DialError::Refused(what)) => {
            tracing::warn!(destination = %what, "a pull tried to reach an address that is not public; refused");
            refused
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(what.clone());
            let _ = reply(
                client.get_mut(),
                "403 Forbidden",
                &format!("{what} is not a public address"),
            )
            .await;
            return;
        }
        Err(DialError::Failed(why)) => {
            let _ = reply(client.get_mut(), "502 Bad Gateway", &why).await;
            return;
        }
    };
    let started = if tunnel {
        client
            .get_mut()
            .write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
            .await
    } else {
        upstream.write_all(&head).await
    };
    // Whatever the client sent past the head goes first.
    let early = client.buffer().to_vec();
    if started.is_err() || upstream.write_all(&early).await.is_err() {
        return;
    }
    let mut client = client.into_inner();
    let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
}

/// The request head (through its blank line), or `None` if the client sent none within
/// [`HEAD_LIMIT`].
async fn read_head(client: &mut BufReader<TcpStream>) -> Option<Vec<u8>> {
    let mut head = Vec::new();
    loop {
        let start = head.len();
        let n = client.read_until(b'\n', &mut head).await.ok()?;
        if n == 0 || head.len() > HEAD_LIMIT {
            return None;
        }
        if matches!(&head[start..], b"\r\n" | b"\n") {
            return Some(head);
        }
    }
}

/// Resolves `host` once and connects to one of its addresses, if `permit` allows all.
async fn dial(host: &str, port: u16, permit: &Permit) -> Result<TcpStream, DialError> {
    let resolve = async {
        match host.parse::<IpAddr>() {
            Ok(ip) => Ok(vec![SocketAddr::new(ip, port)]),
            Err(_) => tokio::net::lookup_host((host, port))
                .await
                .map(|a| a.collect()),
        }
    };
    let addrs: Vec<SocketAddr> = match tokio::time::timeout(DIAL_TIMEOUT, resolve).await {
        Ok(Ok(a)) if !a.is_empty() => a,
        Ok(Ok(_)) => return Err(DialError::Failed(format!("{host} has no address"))),
        Ok(Err(e)) => return Err(DialError::Failed(format!("cannot resolve {host}: {e}"))),
        Err(_) => return Err(DialError::Failed(format!("resolving {host} timed out"))),
    };
    // A name with any address not permitted is refused whole: which one a connect
    // would take is not ours to guess.
    if let Some(bad) = addrs.iter().find(|a| !permit(a)) {
        return Err(DialError::Refused(format!("{host}:{port} ({})", bad.ip())));
    }
    let mut last = String::new();
    for a in addrs {
        match tokio::time::timeout(DIAL_TIMEOUT, TcpStream::connect(a)).await {
            Ok(Ok(s)) => return Ok(s),
            Ok(Err(e)) => last = format!("connecting to {a}: {e}"),
            Err(_) => last = format!("connecting to {a} timed out"),
        }
    }
    Err(DialError::Failed(last))
}

/// Answers the client with `status` and a short text body, and closes.
async fn reply(client: &mut TcpStream, status: &str, body: &str) -> std::io::Result<()> {
    let msg = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    );
    client.write_all(msg.as_bytes()).await?;
    client.shutdown().await
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    /// Sends `request` to the proxy and returns all it answers.
    async fn ask(proxy: &Egress, request: &str) -> String {
        let mut s = TcpStream::connect(proxy.addr).await.expect("connect");
        s.write_all(request.as_bytes()).await.expect("write");
        let mut out = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await;
        String::from_utf8_lossy(&out).into_owned()
    }

    /// A server on loopback that answers one HTTP request with `body`.
    async fn origin(body: &'static str) -> SocketAddr {
        let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .await
            .expect("bind");
        let addr = l.local_addr().expect("addr");
        tokio::spawn(async move {
            if let Ok((s, _)) = l.accept().await {
                let mut s = BufReader::new(s);
                let _ = read_head(&mut s).await;
                let _ = reply(s.get_mut(), "200 OK", body).await;
            }
        });
        addr
    }

    #[tokio::test]
    async fn addresses_that_are_not_public_are_refused_by_address_and_by_name() {
        let proxy = Egress::start(Arc::new(|a: &SocketAddr| crate::allow::is_public(&a.ip())))
            .await
            .expect("start");
        for (request, what) in [
            (
                "CONNECT 169.254.169.254:443 HTTP/1.1\r\n\r\n",
                "169.254.169.254:443",
            ),
            (
                "GET http://169.254.169.254/latest/meta-data/ HTTP/1.1\r\nHost: x\r\n\r\n",
                "169.254.169.254:80",
            ),
            // A name is resolved and its address checked.
            ("CONNECT localhost:5000 HTTP/1.1\r\n\r\n", "localhost:5000"),
            ("CONNECT [::1]:443 HTTP/1.1\r\n\r\n", "::1:443"),
        ] {
            let answer = ask(&proxy, request).await;
            assert!(answer.starts_with("HTTP/1.1 403"), "{request:?}: {answer}");
            assert!(answer.contains("not a public address"), "{answer}");
            assert!(
                proxy
                    .refused
                    .lock()
                    .expect("lock")
                    .iter()
                    .any(|r| r.starts_with(what)),
                "{what}"
            );
        }
        let answer = ask(&proxy, "GET /v2/ HTTP/1.1\r\nHost: x\r\n\r\n").await;
        assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    }

    #[tokio::test]
    async fn permitted_destinations_are_relayed_both_ways() {
        let allowed = origin("hello through the proxy").await;
        let proxy = Egress::start(Arc::new(move |a: &SocketAddr| *a == allowed))
            .await
            .expect("start");
        let answer = ask(
            &proxy,
            &format!("GET http://{allowed}/v2/ HTTP/1.1\r\nHost: {allowed}\r\n\r\n"),
        )
        .await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(answer.ends_with("hello through the proxy"), "{answer}");
        // A tunnel: the proxy's 200, then the origin's answer to what went through.
        let allowed2 = origin("tunnelled").await;
        let proxy = Egress::start(Arc::new(move |a: &SocketAddr| *a == allowed2))
            .await
            .expect("start");
        let answer = ask(
            &proxy,
            &format!("CONNECT {allowed2} HTTP/1.1\r\n\r\nGET / HTTP/1.1\r\nHost: x\r\n\r\n"),
        )
        .await;
        assert!(
            answer.starts_with("HTTP/1.1 200 Connection established\r\n\r\nHTTP/1.1 200 OK"),
            "{answer}"
        );
        assert!(answer.ends_with("tunnelled"), "{answer}");
        assert!(proxy.refused().is_none());
    }
}
