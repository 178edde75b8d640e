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
        if !cpu.is_finite() || cpu <= 0.0 || cpu > MAX_CPU {
            return Err(bad(format!(
                "resources.cpu must be in (0, {MAX_CPU}] cores, got {cpu}"
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
    }
    if let Some(w) = &req.workdir {
        if !w.starts_with('/') {
            return Err(bad(format!("workdir {w:?} must be an absolute path")));
        }
    }
    Ok(())
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
