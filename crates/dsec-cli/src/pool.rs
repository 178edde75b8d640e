//! `dsec pool`: warm pools (`/v1/pools`).

use anyhow::Context;
use dsec_client::Client;
use dsec_wire::v1::{AutoscalePolicy, Pool, PoolSpec, PoolUpdate};

use crate::cli::PoolCommand;
use crate::output::{self, print_json, Table};

/// Runs a pool command.
pub async fn run(client: &Client, cmd: PoolCommand, json: bool) -> anyhow::Result<()> {
    let pool = match cmd {
        PoolCommand::Create {
            name,
            min,
            max,
            autoscale,
            template,
        } => {
            let defaults: PoolSpec = serde_json::from_value(serde_json::json!({"name": name}))
                .context("pool defaults")?;
            let spec = PoolSpec {
                template: crate::sandbox::create_request(*template).await?,
                min: min.unwrap_or(defaults.min),
                max: max.unwrap_or(defaults.max),
                autoscale: policy(autoscale.as_deref())?.unwrap_or_default(),
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
