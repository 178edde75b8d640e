//! `dsec events`: the fleet's events, replayed and (with `--follow`) followed, across
//! reconnects; `dsec audit`: the audit log.

use std::time::Duration;

use anyhow::Context;
use dsec_client::{Client, ClientError};
use dsec_wire::v1::{Event, EventQuery};
use futures::StreamExt;

use crate::cli::{AuditArgs, EventsArgs};
use crate::output::{print_json, Table};

/// Longest pause between reconnects while following.
const MAX_RECONNECT_PAUSE: Duration = Duration::from_secs(5);

/// Prints the events `args` selects: the kept ones after `--after` (all kept ones when
/// not following), then, with `--follow`, new ones until interrupted. A dropped
/// connection is resumed from the last event printed.
pub async fn run(client: &Client, args: EventsArgs, json: bool) -> anyhow::Result<()> {
    let mut query = EventQuery {
        after: args.after.or((!args.follow).then_some(0)),
        sandbox: args.sandbox,
        tenant: args.tenant,
        kind: (!args.kind.is_empty()).then(|| args.kind.join(",")),
        label: (!args.label.is_empty()).then(|| args.label.join(",")),
        no_follow: !args.follow,
    };
    let mut pause = Duration::from_millis(200);
    loop {
        let feed = match client.events(&query).await {
            Ok(feed) => feed,
            Err(e) if args.follow && resumable(&e) => {
                eprintln!("events: {e}; reconnecting");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(MAX_RECONNECT_PAUSE);
                continue;
            }
            Err(e) => return Err(e).context("reading events"),
        };
        let mut feed = std::pin::pin!(feed);
        let mut failure = None;
        while let Some(item) = feed.next().await {
            match item {
                Ok(event) => {
                    pause = Duration::from_millis(200);
                    query.after = Some(event.id);
                    print(&event, json)?;
                }
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
        if !args.follow {
            return match failure {
                Some(e) => Err(e).context("reading events"),
                None => Ok(()),
            };
        }
        match failure {
            Some(e) if !resumable(&e) => return Err(e).context("following events"),
            Some(e) => eprintln!("events: {e}; reconnecting"),
            None => eprintln!("events: the server ended the stream; reconnecting"),
        }
        // From the start of the outage on, nothing is missed: the replay covers it.
        query.after.get_or_insert(0);
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(MAX_RECONNECT_PAUSE);
    }
}

/// Whether following may go on after `e` (the server or the connection went away).
fn resumable(e: &ClientError) -> bool {
    use dsec_wire::ErrorCode;
    e.is_connect()
        || matches!(e, ClientError::Http(_))
        || matches!(e.code(), Some(ErrorCode::Unavailable | ErrorCode::Internal))
}

fn print(event: &Event, json: bool) -> anyhow::Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    if json {
        serde_json::to_writer(&mut out, event)?;
        writeln!(out)?;
        return Ok(out.flush()?);
    }
    let at = humantime::format_rfc3339_millis(
        std::time::UNIX_EPOCH + Duration::from_millis(event.at_ms),
    );
    let subject = match (&event.sandbox, &event.pool, &event.node) {
        (Some(sb), _, _) => sb.clone(),
        (None, Some(pool), _) => format!("pool/{pool}"),
        (None, None, Some(node)) => format!("node/{node}"),
        (None, None, None) => "-".into(),
    };
    let mut line = format!("{at}  {:<16} {subject}", event.kind.as_str());
    if let Some(t) = &event.tenant {
        line.push_str(&format!("  tenant={t}"));
    }
    if let Some(cause) = &event.cause {
        line.push_str(&format!("  {cause}"));
    }
    if let Some(cmd) = &event.command {
        line.push_str(&format!("  command: {cmd}"));
    }
    writeln!(out, "{line}")?;
    Ok(out.flush()?)
}

/// Prints the audit entries `args` selects, oldest first.
pub async fn audit(client: &Client, args: AuditArgs, json: bool) -> anyhow::Result<()> {
    let query = dsec_wire::v1::AuditQuery {
        since_ms: args
            .since_s
            .map(|s| crate::output::now_ms().saturating_sub(s.saturating_mul(1000))),
        tenant: args.tenant,
        sandbox: args.sandbox,
        key_id: args.key_id,
        failed: args.failed,
        limit: args.limit,
    };
    let list = client
        .audit(&query)
        .await
        .context("reading the audit log")?;
    if json {
        return print_json(&list);
    }
    let mut t = Table::new(&[
        "TIME", "TENANT", "KEY", "CALL", "SANDBOX", "STATUS", "MS", "REQUEST",
    ]);
    for e in &list.entries {
        let at = humantime::format_rfc3339_millis(
            std::time::UNIX_EPOCH + Duration::from_millis(e.at_ms),
        );
        let status = match &e.error {
            Some(code) => format!("{} {code}", e.status),
            None => e.status.to_string(),
        };
        t.row(vec![
            at.to_string(),
            e.tenant.clone().unwrap_or_else(|| "-".into()),
            e.key_id.clone().unwrap_or_else(|| "-".into()),
            format!("{} {}", e.method, e.path),
            e.sandbox.clone().unwrap_or_else(|| "-".into()),
            status,
            e.duration_ms.to_string(),
            e.request_id.clone().unwrap_or_default(),
        ]);
    }
    print!("{}", t.render());
    if list.truncated {
        eprintln!("(more entries matched: narrow with --since-s, --sandbox or --limit)");
    }
    Ok(())
}
