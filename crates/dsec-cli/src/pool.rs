//! `dsec pool`: warm pools (`/v1/pools`).

use anyhow::Context;
use dsec_client::Client;
use dsec_wire::v1::{AutoscalePolicy, FnCallPolicy, FnCallRequest, Pool, PoolSpec, PoolUpdate};

use crate::cli::{FnCallArgs, PoolCommand};
use crate::output::{self, print_json, Table};

/// Runs a pool command.
pub async fn run(client: &Client, cmd: PoolCommand, json: bool) -> anyhow::Result<()> {
    let pool = match cmd {
        PoolCommand::Create {
            name,
            min,
            max,
            autoscale,
            fncall,
            max_calls,
            template,
        } => {
            let defaults: PoolSpec = serde_json::from_value(serde_json::json!({"name": name}))
                .context("pool defaults")?;
            let spec = PoolSpec {
                template: crate::sandbox::create_request(*template).await?,
                min: min.unwrap_or(defaults.min),
                max: max.unwrap_or(defaults.max),
                autoscale: policy(autoscale.as_deref())?.unwrap_or_default(),
                fncall: fncall.then(|| {
                    let mut p = FnCallPolicy::default();
                    if let Some(n) = max_calls {
                        p.max_calls = n;
                    }
                    p
                }),
                ..defaults
            };
            client.create_pool(&spec).await?
        }
        PoolCommand::Ls => {
            let list = client.list_pools().await?;
            if json {
                return print_json(&list);
            }
            let mut t = Table::new(&[
                "NAME",
                "IMAGE",
                "MIN",
                "MAX",
                "TARGET",
                "READY",
                "CREATING",
                "QUEUE",
                "WAIT (ms)",
                "CLAIMED",
            ]);
            for p in &list.pools {
                t.row(vec![
                    p.spec.name.clone(),
                    p.spec
                        .template
                        .image
                        .clone()
                        .unwrap_or_else(|| "(default)".into()),
                    p.spec.min.to_string(),
                    p.spec.max.to_string(),
                    p.target.to_string(),
                    p.ready.to_string(),
                    p.creating.to_string(),
                    p.queue_length.to_string(),
                    format!("{:.0}", p.queue_wait_ms),
                    p.claimed.to_string(),
                ]);
            }
            print!("{}", t.render());
            return Ok(());
        }
        PoolCommand::Get { name } => client.get_pool(&name).await?,
        PoolCommand::Set {
            name,
            min,
            max,
            autoscale,
        } => {
            let update = PoolUpdate {
                min,
                max,
                autoscale: policy(autoscale.as_deref())?,
            };
            client.update_pool(&name, &update).await?
        }
        PoolCommand::Rm { name } => {
            client.delete_pool(&name).await?;
            if !json {
                println!("pool {name} deleted");
            }
            return Ok(());
        }
    };
    if json {
        print_json(&pool)
    } else {
        print!("{}", describe(&pool));
        Ok(())
    }
}

/// An autoscale policy given as JSON (missing fields take their defaults).
fn policy(json: Option<&str>) -> anyhow::Result<Option<AutoscalePolicy>> {
    json.map(|j| serde_json::from_str(j).context("--autoscale: not an autoscale policy"))
        .transpose()
}

/// A pool in a few lines.
fn describe(p: &Pool) -> String {
    let mut out = format!(
        "pool {} (tenant {}): target {} in [{}, {}], {} ready, {} creating, {} claimed\n\
         queue: {} waiting, {:.0} ms average wait (target {} ms)\n",
        p.spec.name,
        p.tenant,
        p.target,
        p.spec.min,
        p.spec.max,
        p.ready,
        p.creating,
        p.claimed,
        p.queue_length,
        p.queue_wait_ms,
        p.spec.autoscale.target_queue_wait_ms,
    );
    if p.stale {
        out.push_str(&format!(
            "ALARM: the autoscaler's inputs are {:.0} s old\n",
            p.inputs_age_s
        ));
    }
    if let Some(e) = &p.last_error {
        out.push_str(&format!("last error: {e}\n"));
    }
    for e in &p.scale_events {
        out.push_str(&format!(
            "  {}: {} -> {} ({:?})\n",
            output::ago(e.at),
            e.from,
            e.to,
            e.reason
        ));
    }
    out
}

/// `dsec fncall`: runs one call, prints its output, exits with its exit code.
pub async fn fncall(
    client: &Client,
    args: FnCallArgs,
    json: bool,
) -> anyhow::Result<std::process::ExitCode> {
    use std::io::{Read, Write};
    let code = match &args.code_file {
        Some(path) => Some(
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?,
        ),
        None => None,
    };
    let stdin = if args.stdin {
        let mut s = String::new();
        std::io::stdin()
            .read_to_string(&mut s)
            .context("reading stdin")?;
        Some(s)
    } else {
        None
    };
    let mut req: FnCallRequest =
        serde_json::from_value(serde_json::json!({"pool": args.pool})).context("call defaults")?;
    if !args.command.is_empty() {
        req.command = Some(dsec_wire::agent::Command::Argv(args.command));
    }
    req.code = code;
    req.language = args.language;
    req.stdin = stdin;
    if let Some(t) = args.timeout {
        req.timeout_s = t.as_secs_f64();
    }
    let r = client.fncall(&req).await?;
    if json {
        print_json(&r)?;
    } else {
        print!("{}", r.stdout);
        std::io::stdout().flush().ok();
        eprint!("{}", r.stderr);
        if let Some(e) = &r.error {
            eprintln!("dsec: the call could not start: {e}");
        }
        if let Some(c) = &r.compile {
            if r.status == dsec_wire::v1::FnCallStatus::CompileError {
                eprint!("{}{}", c.stdout, c.stderr);
                eprintln!("dsec: the code did not compile");
            }
        }
        if r.status == dsec_wire::v1::FnCallStatus::TimedOut {
            eprintln!("dsec: the call timed out");
        }
    }
    let code = match (r.status, r.exit_code) {
        (dsec_wire::v1::FnCallStatus::Finished, Some(c)) => c,
        (dsec_wire::v1::FnCallStatus::TimedOut, _) => 124,
        (dsec_wire::v1::FnCallStatus::SetupError, _) => 127,
        (dsec_wire::v1::FnCallStatus::CompileError, _) => 1,
        (_, None) => 128 + r.signal.unwrap_or(0),
    };
    Ok(std::process::ExitCode::from(
        u8::try_from(code.clamp(0, 255)).unwrap_or(1),
    ))
}

/// `dsec queue`: the capacity queue's levels.
pub async fn queue(client: &Client, json: bool) -> anyhow::Result<()> {
    let q = client.queue_status().await?;
    if json {
        return print_json(&q);
    }
    let mut t = Table::new(&["PRIORITY", "WAITING", "OLDEST (ms)", "SERVED", "TENANTS"]);
    for l in &q.levels {
        let tenants: Vec<String> = l
            .tenants
            .iter()
            .map(|t| format!("{}:{}", t.tenant, t.waiting))
            .collect();
        t.row(vec![
            format!("{:?}", l.priority).to_lowercase(),
            l.waiting.to_string(),
            l.oldest_wait_ms.to_string(),
            l.served.to_string(),
            tenants.join(" "),
        ]);
    }
    print!("{}", t.render());
    Ok(())
}
