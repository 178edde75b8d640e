//! `dsec sandbox ...`.

use std::collections::BTreeMap;
use std::io::{ErrorKind, IsTerminal, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context};
use base64::Engine;
use dsec_client::{Client, ClientError, EventStream};
use dsec_wire::v1::{
    Command, ContentEncoding, CreateSandboxRequest, CreateSessionRequest, ExecEvent, ExecRequest,
    ExitInfo, FileKind, InitFile, Resources, Sandbox, SessionRunRequest, SetTimeoutRequest,
};
use dsec_wire::ErrorCode;
use futures::StreamExt;
use tokio::io::{AsyncBufReadExt, AsyncReadExt};

use crate::cli::{CpSide, CreateArgs, ExecArgs, JobCommand, QosArg, SandboxCommand};
use crate::output::{self, print_json, Table};

/// Exit code when our stdout was closed by the reader (128 + SIGPIPE).
const BROKEN_PIPE_EXIT: u8 = 141;

/// Runs a sandbox command; returns the exit code.
pub async fn run(client: &Client, cmd: SandboxCommand, json: bool) -> anyhow::Result<ExitCode> {
    match cmd {
        SandboxCommand::Create(args) => create(client, *args, json).await?,
        SandboxCommand::Ls { labels } => ls(client, labels.into_iter().collect(), json).await?,
        SandboxCommand::Get { id } => {
            let sb = client.get_sandbox(&id).await?;
            if json {
                print_json(&sb)?;
            } else {
                print!("{}", describe(&sb));
            }
        }
        SandboxCommand::Rm { ids } => rm(client, ids, json).await?,
        SandboxCommand::Exec(args) => return exec(client, args, json).await,
        SandboxCommand::Shell { id, timeout } => return shell(client, &id, timeout, json).await,
        SandboxCommand::Cp { src, dst } => cp(client, src, dst, json).await?,
        SandboxCommand::Logs { id, pid, follow } => {
            let events = client.process_output(&id, pid, 0, 0, follow).await?;
            if let StreamEnd::BrokenPipe = print_events(events, json).await? {
                return Ok(ExitCode::from(BROKEN_PIPE_EXIT));
            }
        }
        SandboxCommand::Commit { id, name } => {
            let img = client.commit_sandbox(&id, &name).await?;
            if json {
                print_json(&img)?;
            } else {
                println!(
                    "{} {} ({} layers, {})",
                    img.name,
                    img.digest,
                    img.layers.len(),
                    output::bytes(img.size_bytes)
                );
            }
        }
        SandboxCommand::Network { id, mode, allow } => {
            let sb = client.set_network(&id, &mode.policy(allow)).await?;
            if json {
                print_json(&sb)?;
            } else {
                println!(
                    "{} network {:?} {}",
                    sb.id,
                    sb.network.mode,
                    sb.network.allow.join(" ")
                );
            }
        }
        SandboxCommand::Screen { id, output } => {
            let png = client.screenshot(&id).await?;
            if output.as_os_str() == "-" {
                std::io::Write::write_all(&mut std::io::stdout(), &png)?;
            } else {
                std::fs::write(&output, &png)
                    .with_context(|| format!("writing {}", output.display()))?;
                eprintln!("{} ({} bytes)", output.display(), png.len());
            }
        }
        SandboxCommand::Type { id, text, keys } => {
            let mut events = Vec::new();
            if let Some(text) = text {
                events.push(dsec_wire::v1::InputEvent::Text { text });
            }
            for chord in keys {
                events.push(dsec_wire::v1::InputEvent::Keys {
                    keys: chord.split('+').map(str::to_string).collect(),
                });
            }
            if events.is_empty() {
                anyhow::bail!("nothing to type: give --text or --keys");
            }
            client.send_input(&id, events).await?;
        }
        SandboxCommand::Click {
            id,
            x,
            y,
            button,
            count,
        } => {
            let click = dsec_wire::v1::InputEvent::Click {
                button: button.into(),
                x: Some(x),
                y: Some(y),
                count: Some(count),
            };
            client.send_input(&id, vec![click]).await?;
        }
        SandboxCommand::Scroll { id, dy } => {
            client
                .send_input(&id, vec![dsec_wire::v1::InputEvent::Scroll { dy }])
                .await?;
        }
        SandboxCommand::Pause { ids } => {
            for id in ids {
                let r = client.pause_sandbox(&id).await?;
                if json {
                    print_json(&r)?;
                } else {
                    println!(
                        "{} paused, memory {} -> {}",
                        r.sandbox.id,
                        output::bytes(r.memory_before_bytes),
                        output::bytes(r.memory_after_bytes)
                    );
                }
            }
        }
        SandboxCommand::Resume { ids } => {
            for id in ids {
                let sb = client.resume_sandbox(&id).await?;
                if json {
                    print_json(&sb)?;
                } else {
                    println!("{} {}", sb.id, state_name(&sb));
                }
            }
        }
        SandboxCommand::Timeout { id, duration } => {
            let sb = client
                .set_timeout(
                    &id,
                    SetTimeoutRequest {
                        timeout_s: ceil_secs(duration),
                    },
                )
                .await?;
            if json {
                print_json(&sb)?;
            } else {
                println!("{} expires {}", sb.id, output::until(sb.expires_at));
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Whole seconds, rounded up.
fn ceil_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

// ---------------------------------------------------------------- create, ls, get, rm

async fn create(client: &Client, a: CreateArgs, json: bool) -> anyhow::Result<()> {
    let req = create_request(a).await?;
    let sb = client.create_sandbox(req).await?;
    if json {
        print_json(&sb)
    } else {
        println!("{}", sb.id);
        Ok(())
    }
}

/// The create request `dsec sandbox create`'s flags describe (local files read).
pub(crate) async fn create_request(a: CreateArgs) -> anyhow::Result<CreateSandboxRequest> {
    let mut files = Vec::with_capacity(a.files.len());
    for (local, remote) in a.files {
        files.push(init_file(&local, remote).await?);
    }
    let req = CreateSandboxRequest {
        image: a.image,
        layers: a.layers,
        auto_resume: a.auto_resume,
        qos: match a.qos {
            QosArg::LatencySensitive => dsec_wire::v1::Qos::LatencySensitive,
            QosArg::BestEffort => dsec_wire::v1::Qos::BestEffort,
        },
        resources: Resources {
            cpu: a.cpu,
            memory_mb: a.memory_mb,
            pids: a.pids,
            disk_mb: a.disk_mb,
        },
        timeout_s: a.timeout.map(ceil_secs),
        idle_timeout_s: a.idle_timeout.map(ceil_secs),
        env: a.env.into_iter().collect(),
        labels: a.labels.into_iter().collect(),
        files,
        workdir: a.workdir,
        user: a.user,
        network: a.network.policy(a.allow),
        filesystem: dsec_wire::v1::FilesystemPolicy {
            writable: a.writable,
            tcp_bind: (!a.tcp_bind.is_empty()).then_some(a.tcp_bind),
            tcp_connect: (!a.tcp_connect.is_empty()).then_some(a.tcp_connect),
        },
        isolation: if a.oci {
            dsec_wire::v1::Isolation::Oci
        } else if a.gvisor {
            dsec_wire::v1::Isolation::Gvisor
        } else if a.microvm {
            dsec_wire::v1::Isolation::Microvm
        } else if a.vm {
            dsec_wire::v1::Isolation::Vm
        } else {
            dsec_wire::v1::Isolation::Container
        },
        pool: a.pool,
        queue: (a.max_wait.is_some() || a.priority.is_some()).then(|| {
            dsec_wire::v1::QueueOptions {
                max_wait_s: a.max_wait.map(|w| w.as_secs_f64()),
                priority: a.priority.unwrap_or_default(),
            }
        }),
        model_access: (!a.models.is_empty()).then(|| dsec_wire::v1::ModelAccess {
            models: a.models,
            budget_tokens: a.model_budget,
            rpm: a.model_rpm,
            ..Default::default()
        }),
        ..Default::default()
    };
    Ok(req)
}

/// Reads a local file into an inline [`InitFile`] (UTF-8 as text, anything else base64).
async fn init_file(local: &Path, remote: String) -> anyhow::Result<InitFile> {
    let data = tokio::fs::read(local)
        .await
        .with_context(|| format!("reading {}", local.display()))?;
    let mode = tokio::fs::metadata(local)
        .await
        .with_context(|| format!("reading {}", local.display()))?
        .permissions()
        .mode()
        & 0o7777;
    let (content, encoding) = match String::from_utf8(data) {
        Ok(text) => (text, ContentEncoding::Utf8),
        Err(e) => (
            base64::engine::general_purpose::STANDARD.encode(e.into_bytes()),
            ContentEncoding::Base64,
        ),
    };
    Ok(InitFile {
        path: remote,
        content,
        encoding,
        mode: Some(mode),
    })
}

async fn ls(client: &Client, labels: BTreeMap<String, String>, json: bool) -> anyhow::Result<()> {
    let list = client.list_sandboxes(labels).await?;
    if json {
        return print_json(&list);
    }
    let mut t = Table::new(&["ID", "STATE", "IMAGE", "AGE", "EXPIRES", "LABELS"]);
    for sb in &list.sandboxes {
        t.row(vec![
            sb.id.clone(),
            state_name(sb),
            sb.image.clone(),
            output::compact_duration(output::now_ms().saturating_sub(sb.created_at)),
            output::until(sb.expires_at),
            output::labels(&sb.labels),
        ]);
    }
    print!("{}", t.render());
    Ok(())
}

fn state_name(sb: &Sandbox) -> String {
    serde_json::to_value(sb.state)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_else(|| format!("{:?}", sb.state))
}

/// A readable multi-line description of a sandbox.
fn describe(sb: &Sandbox) -> String {
    let r = &sb.resources;
    let mut lines = vec![
        ("id", sb.id.clone()),
        ("state", state_name(sb)),
        (
            "image",
            if sb.layers.is_empty() {
                format!("{} ({})", sb.image, sb.image_digest)
            } else {
                format!(
                    "{} + {} ({})",
                    sb.image,
                    sb.layers.join(" + "),
                    sb.image_digest
                )
            },
        ),
        (
            "resources",
            match r.disk_mb {
                Some(d) => format!(
                    "{} cpu, {} MiB memory, {} pids, {d} MiB disk",
                    r.cpu, r.memory_mb, r.pids
                ),
                None => format!("{} cpu, {} MiB memory, {} pids", r.cpu, r.memory_mb, r.pids),
            },
        ),
        ("created", output::ago(sb.created_at)),
        ("expires", output::until(sb.expires_at)),
        ("last active", output::ago(sb.last_active_at)),
    ];
    if let Some(idle) = sb.idle_timeout_s {
        lines.push(("idle timeout", output::compact_duration(idle * 1000)));
    }
    lines.push(("labels", output::labels(&sb.labels)));
    lines.push(("node", sb.node.clone()));
    if let Some(f) = &sb.failure {
        lines.push(("failure", f.clone()));
    }
    lines
        .iter()
        .map(|(k, v)| format!("{:<13}{v}\n", format!("{k}:")))
        .collect()
}

async fn rm(client: &Client, ids: Vec<String>, json: bool) -> anyhow::Result<()> {
    let mut deleted = Vec::new();
    let mut failed = 0;
    for id in &ids {
        match client.delete_sandbox(id).await {
            Ok(()) => {
                if !json {
                    println!("{id}");
                }
                deleted.push(id.clone());
            }
            Err(e) if ids.len() > 1 => {
                eprintln!("error: {id}: {e}");
                failed += 1;
            }
            Err(e) => return Err(e).with_context(|| format!("removing {id}")),
        }
    }
    if json {
        print_json(&serde_json::json!({ "deleted": deleted }))?;
    }
    if failed > 0 {
        bail!("{failed} of {} sandboxes could not be removed", ids.len());
    }
    Ok(())
}

// ---------------------------------------------------------------- exec, logs

/// How an event stream ended.
#[derive(Debug)]
enum StreamEnd {
    /// The process exited.
    Exit(ExitInfo, bool),
    /// A non-following read reached the current end of output.
    End,
    /// The server closed the stream without a final event.
    Eof,
    /// Our stdout was closed.
    BrokenPipe,
}

/// Writes output events to stdout/stderr (or as NDJSON with `json`) until the stream ends.
async fn print_events(mut events: EventStream, json: bool) -> anyhow::Result<StreamEnd> {
    while let Some(ev) = events.next().await {
        let ev = ev?;
        let written = if json {
            serde_json::to_string(&ev)
                .map_err(std::io::Error::other)
                .and_then(|line| {
                    write_flush(&mut std::io::stdout(), format!("{line}\n").as_bytes())
                })
        } else {
            match &ev {
                ExecEvent::Stdout { data } => write_flush(&mut std::io::stdout(), data.as_bytes()),
                ExecEvent::Stderr { data } => write_flush(&mut std::io::stderr(), data.as_bytes()),
                _ => Ok(()),
            }
        };
        match written {
            Err(e) if e.kind() == ErrorKind::BrokenPipe => return Ok(StreamEnd::BrokenPipe),
            Err(e) => return Err(e).context("writing output"),
            Ok(()) => {}
        }
        match ev {
            ExecEvent::Exit { exit, oom_killed } => return Ok(StreamEnd::Exit(exit, oom_killed)),
            ExecEvent::End { .. } => return Ok(StreamEnd::End),
            ExecEvent::Error { error } => return Err(ClientError::Api(error).into()),
            _ => {}
        }
    }
    Ok(StreamEnd::Eof)
}

fn write_flush(w: &mut impl Write, data: &[u8]) -> std::io::Result<()> {
    w.write_all(data)?;
    w.flush()
}

/// The shell convention: the exit code, or 128 + signal number.
fn exit_code(exit: &ExitInfo) -> u8 {
    match (exit.exit_code, exit.signal) {
        (Some(code), _) => (code & 0xff) as u8,
        (None, Some(sig)) => ((128 + sig) & 0xff) as u8,
        (None, None) => 1,
    }
}

async fn exec(client: &Client, a: ExecArgs, json: bool) -> anyhow::Result<ExitCode> {
    let stdin = if a.stdin {
        let mut buf = Vec::new();
        tokio::io::stdin()
            .read_to_end(&mut buf)
            .await
            .context("reading stdin")?;
        Some(String::from_utf8(buf).context("--stdin takes UTF-8 text")?)
    } else {
        None
    };
    let req = ExecRequest {
        cmd: Command::Argv(a.cmd),
        env: a.env.into_iter().collect(),
        cwd: a.cwd,
        stdin,
        timeout_s: a.timeout.map(|d| d.as_secs_f64()),
        output_limit: None,
        user: a.user,
        request_id: None,
    };
    let events = client.exec_stream(&a.id, req).await?;
    match print_events(events, json).await? {
        StreamEnd::Exit(exit, oom_killed) => {
            if !json {
                if exit.timed_out {
                    eprintln!(
                        "dsec: command timed out after {}",
                        output::compact_duration(exit.duration_ms)
                    );
                }
                if oom_killed {
                    eprintln!("dsec: command killed by the sandbox's memory limit");
                }
            }
            Ok(ExitCode::from(exit_code(&exit)))
        }
        StreamEnd::BrokenPipe => Ok(ExitCode::from(BROKEN_PIPE_EXIT)),
        StreamEnd::End | StreamEnd::Eof => {
            bail!("the output stream ended before the command exited")
        }
    }
}

// ---------------------------------------------------------------- shell

async fn shell(
    client: &Client,
    id: &str,
    timeout: Option<Duration>,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let session = client
        .create_session(id, CreateSessionRequest::default())
        .await?
        .session;
    let interactive = std::io::stdin().is_terminal();
    if interactive {
        eprintln!("dsec shell in {id} (one bash session; Ctrl-C interrupts, Ctrl-D exits)");
    }
    let result = shell_loop(client, id, &session, timeout, json, interactive).await;
    // Best effort: the session dies with the sandbox anyway.
    let _ = client.close_session(id, &session).await;
    result.map(ExitCode::from)
}

async fn shell_loop(
    client: &Client,
    id: &str,
    session: &str,
    timeout: Option<Duration>,
    json: bool,
    interactive: bool,
) -> anyhow::Result<u8> {
    let mut lines = tokio::io::BufReader::new(tokio::io::stdin()).lines();
    let mut last: i32 = 0;
    loop {
        if interactive {
            eprint!("{id} [{last}]$ ");
            let _ = std::io::stderr().flush();
        }
        let line = tokio::select! {
            line = lines.next_line() => line.context("reading stdin")?,
            _ = tokio::signal::ctrl_c() => {
                eprintln!();
                continue;
            }
        };
        let Some(line) = line else {
            if interactive {
                eprintln!();
            }
            break;
        };
        let command = line.trim();
        if command.is_empty() {
            continue;
        }
        if command == "exit" || command == "logout" {
            break;
        }
        let req = SessionRunRequest {
            command: command.to_owned(),
            timeout_s: timeout.map(|d| d.as_secs_f64()),
            request_id: None,
        };
        let run = client.run_in_session(id, session, req);
        tokio::pin!(run);
        let result = loop {
            tokio::select! {
                r = &mut run => break r,
                _ = tokio::signal::ctrl_c() => {
                    if let Err(e) = client.interrupt_session(id, session).await {
                        eprintln!("error: interrupting: {e}");
                    }
                }
            }
        };
        match result {
            Ok(r) => {
                if json {
                    println!("{}", serde_json::to_string(&r)?);
                } else {
                    let mut out = std::io::stdout();
                    let mut text = r.output.clone();
                    if interactive && !text.is_empty() && !text.ends_with('\n') {
                        text.push('\n');
                    }
                    if let Err(e) = write_flush(&mut out, text.as_bytes()) {
                        if e.kind() == ErrorKind::BrokenPipe {
                            return Ok(BROKEN_PIPE_EXIT);
                        }
                        return Err(e).context("writing output");
                    }
                    if r.timed_out {
                        eprintln!("dsec: command timed out and was interrupted");
                    }
                    if r.truncated {
                        eprintln!("dsec: output truncated");
                    }
                }
                last = r.exit_code;
            }
            Err(e) => {
                let fatal = matches!(
                    e.code(),
                    Some(ErrorCode::NotFound | ErrorCode::Expired | ErrorCode::Failed) | None
                );
                if fatal {
                    return Err(e.into());
                }
                eprintln!("error: {e}");
                last = 1;
            }
        }
    }
    Ok((last & 0xff) as u8)
}

// ---------------------------------------------------------------- cp

/// `parent/name` for sandbox paths.
fn remote_join(dir: &str, name: &str) -> String {
    format!("{}/{name}", dir.trim_end_matches('/'))
}

/// The last component of a sandbox path (`None` for `/`).
fn remote_basename(path: &str) -> Option<&str> {
    path.trim_end_matches('/')
        .rsplit('/')
        .next()
        .filter(|n| !n.is_empty())
}

async fn cp(client: &Client, src: CpSide, dst: CpSide, json: bool) -> anyhow::Result<()> {
    match (src, dst) {
        (CpSide::Local(local), CpSide::Remote { id, path }) => {
            upload(client, &local, &id, &path, json).await
        }
        (CpSide::Remote { id, path }, CpSide::Local(local)) => {
            download(client, &id, &path, &local, json).await
        }
        (CpSide::Local(_), CpSide::Local(_)) => {
            bail!("one side of cp must be in a sandbox: ID:/PATH (both are local paths)")
        }
        (CpSide::Remote { .. }, CpSide::Remote { .. }) => {
            bail!("copying between sandboxes is not supported; copy through a local path")
        }
    }
}

/// Like `cp -r`: into an existing directory DST as DST/basename(SRC), else as DST.
async fn upload(
    client: &Client,
    local: &Path,
    id: &str,
    path: &str,
    json: bool,
) -> anyhow::Result<()> {
    let meta = tokio::fs::metadata(local)
        .await
        .with_context(|| format!("reading {}", local.display()))?;
    let target = match client.stat_file(id, path).await {
        Ok(info) if info.kind == FileKind::Dir => {
            match local.file_name().and_then(|n| n.to_str()) {
                Some(name) => remote_join(path, name),
                None => path.to_owned(),
            }
        }
        Ok(_) => path.to_owned(),
        Err(e) if e.code() == Some(ErrorCode::NotFound) => path.to_owned(),
        Err(e) => return Err(e.into()),
    };
    let written = if meta.is_dir() {
        client.upload_dir(id, local, &target).await?
    } else {
        client
            .write_file_from_path(id, local, &target, None)
            .await?
    };
    if json {
        print_json(&serde_json::json!({ "path": target, "bytes": written.bytes }))
    } else {
        println!(
            "{} -> {id}:{target} ({})",
            local.display(),
            output::bytes(written.bytes)
        );
        Ok(())
    }
}

async fn download(
    client: &Client,
    id: &str,
    path: &str,
    local: &Path,
    json: bool,
) -> anyhow::Result<()> {
    let info = client.stat_file(id, path).await?;
    let target: PathBuf = match (tokio::fs::metadata(local).await, remote_basename(path)) {
        (Ok(m), Some(name)) if m.is_dir() => local.join(name),
        _ => local.to_owned(),
    };
    if info.kind == FileKind::Dir {
        client.download_dir(id, path, &target).await?;
    } else {
        client.read_file_to_path(id, path, &target).await?;
    }
    if json {
        print_json(&serde_json::json!({ "path": target, "kind": info.kind }))
    } else {
        println!("{id}:{path} -> {}", target.display());
        Ok(())
    }
}

/// `dsec job suspend|resume`: prints one line per sandbox; fails if any sandbox failed.
pub async fn job(client: &Client, cmd: JobCommand, json: bool) -> anyhow::Result<ExitCode> {
    let result = match &cmd {
        JobCommand::Suspend { job } => client.suspend_job(job).await?,
        JobCommand::Resume { job } => client.resume_job(job).await?,
    };
    if json {
        print_json(&result)?;
    } else if result.sandboxes.is_empty() {
        println!("no sandbox has the label job={}", result.job);
    } else {
        for o in &result.sandboxes {
            match &o.error {
                Some(e) => println!("{} failed: {}", o.id, e.message),
                None => println!(
                    "{} {}",
                    o.id,
                    serde_json::to_value(o.state)
                        .ok()
                        .and_then(|v| v.as_str().map(str::to_owned))
                        .unwrap_or_default()
                ),
            }
        }
    }
    Ok(if result.sandboxes.iter().any(|o| o.error.is_some()) {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_follow_the_shell() {
        let e = |code, signal| ExitInfo {
            exit_code: code,
            signal,
            ..Default::default()
        };
        assert_eq!(exit_code(&e(Some(0), None)), 0);
        assert_eq!(exit_code(&e(Some(3), None)), 3);
        assert_eq!(exit_code(&e(None, Some(9))), 137);
        assert_eq!(exit_code(&e(None, None)), 1);
    }

    #[test]
    fn remote_paths() {
        assert_eq!(remote_join("/work/", "a"), "/work/a");
        assert_eq!(remote_join("/", "a"), "/a");
        assert_eq!(remote_basename("/work/dir/"), Some("dir"));
        assert_eq!(remote_basename("/"), None);
    }

    #[test]
    fn ceil_seconds() {
        assert_eq!(ceil_secs(Duration::from_millis(1500)), 2);
        assert_eq!(ceil_secs(Duration::from_secs(60)), 60);
    }
}
