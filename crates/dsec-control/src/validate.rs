//! Request validation: bad input gets a `bad_request` that names the field.

use dsec_wire::v1::{
    AllowRule, CreateSandboxRequest, ExecRequest, NetworkMode, NetworkPolicy, MAX_TIMEOUT_S,
};
use dsec_wire::{ApiError, ErrorCode};

fn bad(msg: impl Into<String>) -> ApiError {
    ApiError::new(ErrorCode::BadRequest, msg)
}

/// Limits accepted on create.
pub const MAX_CPU: f64 = 64.0;
/// Smallest CPU limit: the cgroup quota cannot go below 1% of a core (1 ms per 100 ms).
pub const MIN_CPU: f64 = 0.01;
/// Longest single argument or `KEY=VALUE` the kernel passes to a program
/// (`MAX_ARG_STRLEN`, 32 pages, with its NUL).
pub const MAX_ARG_BYTES: usize = 128 * 1024 - 1;
/// Most bytes of arguments and environment one command may take in all: the kernel's
/// limit with the default 8 MiB stack (a quarter of it).
pub const MAX_ARGS_TOTAL: usize = 2 * 1024 * 1024;
/// Memory range in MiB.
pub const MEMORY_MB_RANGE: (u64, u64) = (16, 1024 * 1024);
/// Writable-layer size range in MiB (64 MiB to 16 TiB).
pub const DISK_MB_RANGE: (u64, u64) = (64, 16 * 1024 * 1024);
/// Most images a create may stack on top of its image.
pub const MAX_LAYER_IMAGES: usize = 32;
/// Pids range.
pub const PIDS_RANGE: (u64, u64) = (8, 1 << 22);
/// Largest output ring a caller may ask for.
pub const MAX_OUTPUT_LIMIT: u64 = 64 * 1024 * 1024;

pub fn env(env: &std::collections::BTreeMap<String, String>) -> Result<(), ApiError> {
    for (k, v) in env {
        if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
            return Err(bad(format!(
                "invalid environment variable name or value: {k:?}"
            )));
        }
    }
    Ok(())
}

pub fn sandbox_path(field: &str, p: &str) -> Result<(), ApiError> {
    if p.is_empty() || p.contains('\0') {
        return Err(ApiError::new(
            ErrorCode::InvalidPath,
            format!("{field}: path must be non-empty and contain no NUL byte"),
        ));
    }
    Ok(())
}

/// A byte range of a file read: offsets past `i64::MAX` are no file offset at all.
pub fn read_range(offset: u64, length: Option<u64>) -> Result<(), ApiError> {
    const MAX: u64 = i64::MAX as u64;
    if offset > MAX || length.is_some_and(|l| l > MAX) {
        return Err(bad(format!(
            "offset and length must be at most {MAX} (got offset {offset}, length {length:?})"
        )));
    }
    Ok(())
}

pub fn seconds(field: &str, v: f64) -> Result<u64, ApiError> {
    if !v.is_finite() || v <= 0.0 || v > MAX_TIMEOUT_S as f64 {
        return Err(bad(format!(
            "{field} must be between 0 and {MAX_TIMEOUT_S} seconds, got {v}"
        )));
    }
    Ok((v * 1000.0).ceil() as u64)
}

/// Most rules one network policy may hold.
pub const MAX_ALLOW_RULES: usize = 256;

/// A network policy: rules only with `allowlist`, each one parseable.
pub fn network(p: &NetworkPolicy) -> Result<(), ApiError> {
    if p.mode != NetworkMode::Allowlist && !p.allow.is_empty() {
        return Err(bad("network.allow is only meaningful with mode allowlist"));
    }
    if p.allow.len() > MAX_ALLOW_RULES {
        return Err(bad(format!(
            "network.allow: at most {MAX_ALLOW_RULES} rules"
        )));
    }
    for r in &p.allow {
        AllowRule::parse(r).map_err(|e| bad(format!("network.allow: {e}")))?;
    }
    Ok(())
}

/// Most writable paths one file policy may name.
pub const MAX_WRITABLE_PATHS: usize = 64;

/// Moves a create request's `environment` object into the top-level `image`, `layers`,
/// `env`, `workdir` and `user`, refusing a request that sets both forms of a field.
pub fn flatten_environment(
    mut req: CreateSandboxRequest,
) -> Result<CreateSandboxRequest, ApiError> {
    let Some(env) = req.environment.take() else {
        return Ok(req);
    };
    let both = |field: &str| {
        Err(bad(format!(
            "environment.{field} and {field} are both set: use one form"
        )))
    };
    if req.image.is_some() {
        return both("base (image)");
    }
    if !req.layers.is_empty() {
        return both("layers");
    }
    if !req.env.is_empty() && !env.env.is_empty() {
        return both("env");
    }
    if req.workdir.is_some() && env.workdir.is_some() {
        return both("workdir");
    }
    if req.user.is_some() && env.user.is_some() {
        return both("user");
    }
    if env.base.is_empty() {
        return Err(bad("environment.base: an image name or digest is required"));
    }
    req.image = Some(env.base);
    req.layers = env.layers;
    if !env.env.is_empty() {
        req.env = env.env;
    }
    req.workdir = req.workdir.or(env.workdir);
    req.user = req.user.or(env.user);
    Ok(req)
}

/// Checks a create request's fields (after [`flatten_environment`]).
pub fn create(req: &CreateSandboxRequest) -> Result<(), ApiError> {
    network(&req.network)?;
    if req.filesystem.writable.len() > MAX_WRITABLE_PATHS {
        return Err(bad(format!(
            "filesystem.writable: at most {MAX_WRITABLE_PATHS} paths"
        )));
    }
    for (field, ports) in [
        ("tcp_bind", &req.filesystem.tcp_bind),
        ("tcp_connect", &req.filesystem.tcp_connect),
    ] {
        if let Some(ports) = ports {
            if ports.len() > 64 || ports.contains(&0) {
                return Err(bad(format!(
                    "filesystem.{field}: at most 64 ports, each 1-65535"
                )));
            }
        }
    }
    for p in &req.filesystem.writable {
        if !p.starts_with('/') || p.contains('\0') || p.split('/').any(|c| c == "..") {
            return Err(ApiError::new(
                ErrorCode::InvalidPath,
                format!("filesystem.writable: {p:?} must be an absolute path without '..'"),
            ));
        }
    }
    if let Some(cpu) = req.resources.cpu {
        if !cpu.is_finite() || !(MIN_CPU..=MAX_CPU).contains(&cpu) {
            return Err(bad(format!(
                "resources.cpu must be in [{MIN_CPU}, {MAX_CPU}] cores, got {cpu}"
            )));
        }
    }
    if let Some(m) = req.resources.memory_mb {
        if m < MEMORY_MB_RANGE.0 || m > MEMORY_MB_RANGE.1 {
            return Err(bad(format!(
                "resources.memory_mb must be in [{}, {}], got {m}",
                MEMORY_MB_RANGE.0, MEMORY_MB_RANGE.1
            )));
        }
    }
    if let Some(k) = &req.idempotency_key {
        if k.is_empty() || k.len() > 128 {
            return Err(bad("idempotency_key must be 1 to 128 characters"));
        }
    }
    if req.layers.len() > MAX_LAYER_IMAGES {
        return Err(bad(format!(
            "layers: at most {MAX_LAYER_IMAGES} images can be stacked, got {}",
            req.layers.len()
        )));
    }
    if let Some(d) = req.resources.disk_mb {
        if d < DISK_MB_RANGE.0 || d > DISK_MB_RANGE.1 {
            return Err(bad(format!(
                "resources.disk_mb must be in [{}, {}], got {d}",
                DISK_MB_RANGE.0, DISK_MB_RANGE.1
            )));
        }
    }
    if let Some(p) = req.resources.pids {
        if p < PIDS_RANGE.0 || p > PIDS_RANGE.1 {
            return Err(bad(format!(
                "resources.pids must be in [{}, {}], got {p}",
                PIDS_RANGE.0, PIDS_RANGE.1
            )));
        }
    }
    if let Some(t) = req.timeout_s {
        if t == 0 || t > MAX_TIMEOUT_S {
            return Err(bad(format!(
                "timeout_s must be in [1, {MAX_TIMEOUT_S}], got {t}"
            )));
        }
    }
    if let Some(t) = req.idle_timeout_s {
        if t == 0 || t > MAX_TIMEOUT_S {
            return Err(bad(format!(
                "idle_timeout_s must be in [1, {MAX_TIMEOUT_S}], got {t}"
            )));
        }
    }
    env(&req.env)?;
    for (k, v) in &req.labels {
        if k.is_empty() || k.len() > 128 || v.len() > 1024 || k.contains('=') {
            return Err(bad(format!(
                "invalid label {k:?}: keys are 1-128 bytes without '=', values at most 1024 bytes"
            )));
        }
    }
    for f in &req.files {
        if !f.path.starts_with('/') {
            return Err(ApiError::new(
                ErrorCode::InvalidPath,
                format!("files: path {:?} must be absolute", f.path),
            ));
        }
        sandbox_path("files.path", &f.path)?;
        if let Some(m) = f.mode {
            if m > 0o777 {
                return Err(bad(format!(
                    "files: {}: mode {m:#o} has bits beyond the permissions 0o777 \
                     (file type, setuid, setgid or sticky): give only permission bits",
                    f.path
                )));
            }
        }
    }
    if let Some(u) = &req.user {
        user(u)?;
    }
    if let Some(w) = &req.workdir {
        if !w.starts_with('/') {
            return Err(bad(format!("workdir {w:?} must be an absolute path")));
        }
    }
    Ok(())
}

/// The form of a user spec: `NAME`, `UID`, `NAME:GROUP` or `UID:GID`.
pub fn user(spec: &str) -> Result<(), ApiError> {
    let (u, g) = match spec.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (spec, None),
    };
    let part_ok = |p: &str| {
        !p.is_empty()
            && p.len() <= 256
            && !p.contains([':', '\0', '\n', '/'])
            && !p.chars().any(char::is_whitespace)
    };
    if !part_ok(u) || g.is_some_and(|g| !part_ok(g)) {
        return Err(bad(format!(
            "user {spec:?}: expected NAME, UID, NAME:GROUP or UID:GID"
        )));
    }
    Ok(())
}

/// Whether `spec`'s names are in the sandbox's `/etc/passwd` and `/etc/group` (their
/// text; `None` when the file is missing). Ids need no entry.
pub fn user_known(spec: &str, passwd: Option<&str>, group: Option<&str>) -> Result<(), ApiError> {
    let (u, g) = match spec.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (spec, None),
    };
    let has = |text: Option<&str>, name: &str| {
        text.unwrap_or("")
            .lines()
            .any(|l| l.split(':').next() == Some(name))
    };
    if u.parse::<u32>().is_err() && !has(passwd, u) {
        return Err(bad(format!(
            "user {u:?} does not exist in the image (no entry in its /etc/passwd): \
             name a user of the image, or give a UID[:GID]"
        )));
    }
    if let Some(g) = g {
        if g.parse::<u32>().is_err() && !has(group, g) {
            return Err(bad(format!(
                "group {g:?} does not exist in the image (no entry in its /etc/group): \
                 name a group of the image, or give a GID"
            )));
        }
    }
    Ok(())
}

/// Arguments and environment the kernel would refuse to pass to a program (`E2BIG`).
fn args_fit(
    args: &[&str],
    env: &std::collections::BTreeMap<String, String>,
) -> Result<(), ApiError> {
    let mut total = 0usize;
    for (i, a) in args.iter().enumerate() {
        if a.len() > MAX_ARG_BYTES {
            return Err(bad(format!(
                "cmd: argument {i} is {} bytes, over the kernel's limit of {MAX_ARG_BYTES} \
                 per argument (E2BIG): pass large data through stdin or a file",
                a.len()
            )));
        }
        total += a.len() + 1;
    }
    for (k, v) in env {
        let len = k.len() + v.len() + 1;
        if len > MAX_ARG_BYTES {
            return Err(bad(format!(
                "env: {k} is {len} bytes, over the kernel's limit of {MAX_ARG_BYTES} per \
                 variable (E2BIG): pass large data through stdin or a file"
            )));
        }
        total += len + 1;
    }
    if total > MAX_ARGS_TOTAL {
        return Err(bad(format!(
            "cmd and env are {total} bytes, over the kernel's limit of {MAX_ARGS_TOTAL} \
             (E2BIG): pass large data through stdin or a file"
        )));
    }
    Ok(())
}

/// A call's request id (see [`dsec_wire::v1::CallRecord`]).
pub fn request_id(id: &str) -> Result<(), ApiError> {
    dsec_wire::v1::check_request_id(id).map_err(bad)
}

pub fn exec(req: &ExecRequest) -> Result<(), ApiError> {
    match &req.cmd {
        dsec_wire::v1::Command::Argv(v) if v.is_empty() => {
            return Err(bad("cmd: argv must not be empty"))
        }
        dsec_wire::v1::Command::Argv(v) if v.iter().any(|a| a.contains('\0')) => {
            return Err(bad("cmd: arguments must not contain NUL bytes"))
        }
        dsec_wire::v1::Command::Shell(s) if s.trim().is_empty() || s.contains('\0') => {
            return Err(bad(
                "cmd: shell command must be non-empty and contain no NUL byte",
            ))
        }
        _ => {}
    }
    env(&req.env)?;
    if let Some(rid) = &req.request_id {
        request_id(rid)?;
    }
    let args: Vec<&str> = match &req.cmd {
        dsec_wire::v1::Command::Argv(v) => v.iter().map(String::as_str).collect(),
        // Run as `/bin/sh -c CMD`.
        dsec_wire::v1::Command::Shell(s) => vec!["/bin/sh", "-c", s.as_str()],
    };
    args_fit(&args, &req.env)?;
    if let Some(u) = &req.user {
        user(u)?;
    }
    if let Some(t) = req.timeout_s {
        seconds("timeout_s", t)?;
    }
    if let Some(l) = req.output_limit {
        if l == 0 || l > MAX_OUTPUT_LIMIT {
            return Err(bad(format!(
                "output_limit must be in [1, {MAX_OUTPUT_LIMIT}] bytes, got {l}"
            )));
        }
    }
    if let Some(cwd) = &req.cwd {
        sandbox_path("cwd", cwd)?;
    }
    Ok(())
}

/// Parses `SIGTERM`, `TERM`, `term` or `15`.
pub fn signal(s: &str) -> Result<i32, ApiError> {
    if let Ok(n) = s.parse::<i32>() {
        if (1..=64).contains(&n) {
            return Ok(n);
        }
    }
    let up = s.to_ascii_uppercase();
    let name = up.strip_prefix("SIG").unwrap_or(&up);
    let n = match name {
        "HUP" => 1,
        "INT" => 2,
        "QUIT" => 3,
        "KILL" => 9,
        "USR1" => 10,
        "USR2" => 12,
        "PIPE" => 13,
        "ALRM" => 14,
        "TERM" => 15,
        "CONT" => 18,
        "STOP" => 19,
        "TSTP" => 20,
        "WINCH" => 28,
        _ => return Err(bad(format!("unknown signal {s:?}"))),
    };
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use dsec_wire::v1::Resources;

    #[test]
    fn rejects_absurd_limits() {
        let mut r = CreateSandboxRequest {
            resources: Resources {
                cpu: Some(-1.0),
                ..Default::default()
            },
            ..Default::default()
        };
        assert_eq!(
            create(&r).expect_err("negative cpu").code,
            ErrorCode::BadRequest
        );
        r.resources = Resources {
            memory_mb: Some(1 << 40),
            ..Default::default()
        };
        assert!(create(&r)
            .expect_err("huge memory")
            .message
            .contains("memory_mb"));
        r.resources = Resources::default();
        r.timeout_s = Some(0);
        assert!(create(&r).is_err());
        r.timeout_s = Some(60);
        assert!(create(&r).is_ok());
    }

    #[test]
    fn refuses_what_the_kernel_would() {
        let cpu = |c: f64| CreateSandboxRequest {
            resources: Resources {
                cpu: Some(c),
                ..Default::default()
            },
            ..Default::default()
        };
        assert!(create(&cpu(1e-300)).is_err());
        assert!(create(&cpu(0.01)).is_ok());
        let file = |mode: u32| CreateSandboxRequest {
            files: vec![dsec_wire::v1::InitFile {
                path: "/x".into(),
                content: String::new(),
                encoding: Default::default(),
                mode: Some(mode),
            }],
            ..Default::default()
        };
        assert!(create(&file(0o755)).is_ok());
        for mode in [36855, 0o4755, 0o2755, 0o1777] {
            assert!(create(&file(mode)).is_err(), "{mode:o}");
        }
        let argv = |args: Vec<String>| ExecRequest {
            cmd: dsec_wire::v1::Command::Argv(args),
            env: Default::default(),
            cwd: None,
            stdin: None,
            timeout_s: None,
            output_limit: None,
            user: None,
            request_id: None,
        };
        assert!(exec(&argv(vec!["echo".into(), "a".repeat(MAX_ARG_BYTES)])).is_ok());
        let e =
            exec(&argv(vec!["echo".into(), "a".repeat(MAX_ARG_BYTES + 1)])).expect_err("too long");
        assert!(e.message.contains("E2BIG"), "{e:?}");
        let many = vec!["a".repeat(100_000); 30];
        assert!(exec(&argv(many)).is_err());
        assert!(read_range(i64::MAX as u64, None).is_ok());
        assert!(read_range(u64::MAX, None).is_err());
        assert!(read_range(0, Some(u64::MAX)).is_err());
    }

    #[test]
    fn users_are_checked_against_the_image() {
        let passwd = "root:x:0:0::/root:/bin/sh\nnobody:x:65534:65534::/:/bin/false\n";
        let group = "root:x:0:\nstaff:x:50:\n";
        for ok in ["nobody", "root:staff", "1234", "1234:5678", "nobody:50"] {
            user(ok).expect(ok);
            user_known(ok, Some(passwd), Some(group)).expect(ok);
        }
        for bad in ["ghost", "nobody:ghosts"] {
            assert!(user_known(bad, Some(passwd), Some(group)).is_err(), "{bad}");
        }
        assert!(user_known("root", None, None).is_err());
        assert!(user_known("0:0", None, None).is_ok());
        for bad in ["", ":1", "a:", "a b", "a:b:c"] {
            assert!(user(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn parses_signals() {
        assert_eq!(signal("SIGTERM").expect("term"), 15);
        assert_eq!(signal("int").expect("int"), 2);
        assert_eq!(signal("9").expect("9"), 9);
        assert!(signal("SIGFOO").is_err());
        assert!(signal("0").is_err());
    }

    #[test]
    fn seconds_bounds() {
        assert_eq!(seconds("t", 1.5).expect("ok"), 1500);
        assert!(seconds("t", f64::NAN).is_err());
        assert!(seconds("t", -1.0).is_err());
    }
}
