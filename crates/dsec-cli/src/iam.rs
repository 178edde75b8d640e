//! `dsec tenant ...` and `dsec key ...`: the admin API of tenants and keys.

use std::time::Duration;

use anyhow::Context;
use clap::{Args, Subcommand};
use dsec_client::Client;
use dsec_iam::api::{CreateKey, CreateTenant, UpdateTenant};
use dsec_iam::{KeyInfo, NewKey, Quotas, Scope, Tenant};

use crate::cli::parse_duration;
use crate::output::{self, print_json, Table};

/// `dsec tenant`.
#[derive(Debug, Subcommand)]
pub enum TenantCommand {
    /// List tenants (cluster admin).
    Ls,
    /// Create a tenant (cluster admin).
    Create {
        /// Its name: 1-63 of a-z, 0-9 and '-'.
        name: String,
        /// Its quotas (unset: unlimited).
        #[command(flatten)]
        quotas: QuotaArgs,
    },
    /// Show a tenant, its quotas and its usage.
    Get {
        /// The tenant.
        name: String,
    },
    /// Replace a tenant's quotas: flags not given become unlimited (cluster admin).
    SetQuotas {
        /// The tenant.
        name: String,
        /// The new quotas.
        #[command(flatten)]
        quotas: QuotaArgs,
    },
    /// Disable a tenant: its keys are refused and it creates nothing (cluster admin).
    Disable {
        /// The tenant.
        name: String,
    },
    /// Enable a disabled tenant again (cluster admin).
    Enable {
        /// The tenant.
        name: String,
    },
}

/// Quota flags.
#[derive(Debug, Args)]
pub struct QuotaArgs {
    /// Sandboxes at once.
    #[arg(long)]
    pub max_sandboxes: Option<u64>,
    /// CPUs in all (sum of the sandboxes' limits), e.g. 16 or 0.5.
    #[arg(long, value_parser = parse_cpus)]
    pub max_cpus: Option<u64>,
    /// Memory in all, in MiB.
    #[arg(long)]
    pub max_memory_mb: Option<u64>,
    /// Sustained creates per second.
    #[arg(long)]
    pub creates_per_second: Option<u32>,
    /// Creates at once after a quiet spell (default: the rate).
    #[arg(long, requires = "creates_per_second")]
    pub creates_burst: Option<u32>,
}

impl QuotaArgs {
    fn quotas(&self) -> Quotas {
        Quotas {
            max_sandboxes: self.max_sandboxes,
            max_cpu_millis: self.max_cpus,
            max_memory_mb: self.max_memory_mb,
            creates_per_second: self.creates_per_second,
            creates_burst: self.creates_burst,
        }
    }
}

/// CPUs as thousandths.
fn parse_cpus(s: &str) -> Result<u64, String> {
    let cpus: f64 = s
        .parse()
        .map_err(|_| format!("{s:?} is not a number of CPUs"))?;
    if !(0.0..=1e9).contains(&cpus) {
        return Err(format!("{s:?} is not a number of CPUs"));
    }
    Ok((cpus * 1000.0).round() as u64)
}

/// `dsec key`.
#[derive(Debug, Subcommand)]
pub enum KeyCommand {
    /// List a tenant's keys (never their secrets).
    Ls {
        /// The tenant.
        tenant: String,
    },
    /// Create a key; its secret is printed once.
    Create {
        /// The tenant it acts for.
        tenant: String,
        /// What it may do: read, sandboxes, images, admin (repeatable).
        #[arg(long = "scope", required = true, value_parser = parse_scope)]
        scopes: Vec<Scope>,
        /// A label.
        #[arg(long, default_value = "")]
        name: String,
        /// Expire after this long (e.g. 30d, 12h).
        #[arg(long, value_parser = parse_duration)]
        expires_in: Option<Duration>,
    },
    /// Revoke a key now.
    Revoke {
        /// The key id.
        key_id: String,
    },
    /// Replace a key by a new one; the old one works for `--grace` more (default: stops now).
    Rotate {
        /// The key id.
        key_id: String,
        /// How long the old key keeps working (e.g. 10m).
        #[arg(long, value_parser = parse_duration)]
        grace: Option<Duration>,
    },
}

fn parse_scope(s: &str) -> Result<Scope, String> {
    s.parse().map_err(|e: dsec_iam::IamError| e.to_string())
}

fn quota_text(q: &Quotas) -> String {
    let n = |v: Option<u64>| v.map_or("-".to_owned(), |v| v.to_string());
    let rate = match (q.creates_per_second, q.creates_burst) {
        (Some(r), Some(b)) => format!("{r}/s burst {b}"),
        (Some(r), None) => format!("{r}/s"),
        _ => "-".into(),
    };
    format!(
        "sandboxes {}  cpus {}  memory_mb {}  creates {rate}",
        n(q.max_sandboxes),
        q.max_cpu_millis
            .map_or("-".to_owned(), |m| format!("{}", m as f64 / 1000.0)),
        n(q.max_memory_mb),
    )
}

fn print_tenant(t: &Tenant) {
    let state = if t.disabled { "disabled" } else { "enabled" };
    println!("{}  {state}  {}", t.name, quota_text(&t.quotas));
}

fn print_new_key(k: &NewKey) {
    println!("{}", k.key);
    eprintln!(
        "key {} for tenant {} ({}): the secret above is shown only now",
        k.info.key_id,
        k.info.tenant,
        scopes_text(&k.info.scopes)
    );
}

fn scopes_text(s: &[Scope]) -> String {
    s.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(",")
}

fn key_state(k: &KeyInfo) -> String {
    let now = output::now_ms();
    match (k.revoked_at, k.expires_at) {
        (Some(t), _) if t <= now => "revoked".into(),
        (Some(t), _) => format!("ends {}", output::until(t)),
        (_, Some(t)) if t <= now => "expired".into(),
        (_, Some(t)) => format!("expires {}", output::until(t)),
        _ => "active".into(),
    }
}

/// Runs `dsec tenant ...`.
pub async fn tenant(client: &Client, cmd: TenantCommand, json: bool) -> anyhow::Result<()> {
    let t = match cmd {
        TenantCommand::Ls => {
            let list = client.list_tenants().await?;
            if json {
                return print_json(&list);
            }
            let mut table = Table::new(&["NAME", "STATE", "QUOTAS", "CREATED"]);
            for t in &list {
                table.row(vec![
                    t.name.clone(),
                    if t.disabled { "disabled" } else { "enabled" }.into(),
                    quota_text(&t.quotas),
                    if t.created_at == 0 {
                        "-".into()
                    } else {
                        output::ago(t.created_at)
                    },
                ]);
            }
            print!("{}", table.render());
            return Ok(());
        }
        TenantCommand::Get { name } => {
            let t = client.get_tenant(&name).await?;
            let usage = client.tenant_usage(&name).await?;
            if json {
                return print_json(&serde_json::json!({"tenant": t, "usage": usage}));
            }
            print_tenant(&t);
            println!(
                "usage: sandboxes {}  cpus {}  memory_mb {}",
                usage.sandboxes,
                usage.cpu_millis as f64 / 1000.0,
                usage.memory_mb
            );
            return Ok(());
        }
        TenantCommand::Create { name, quotas } => {
            let req = CreateTenant {
                name,
                quotas: quotas.quotas(),
            };
            client.create_tenant(&req).await?
        }
        TenantCommand::SetQuotas { name, quotas } => {
            let req = UpdateTenant {
                quotas: Some(quotas.quotas()),
                disabled: None,
            };
            client.update_tenant(&name, &req).await?
        }
        TenantCommand::Disable { name } => set_disabled(client, &name, true).await?,
        TenantCommand::Enable { name } => set_disabled(client, &name, false).await?,
    };
    if json {
        print_json(&t)
    } else {
        print_tenant(&t);
        Ok(())
    }
}

async fn set_disabled(client: &Client, name: &str, disabled: bool) -> anyhow::Result<Tenant> {
    let req = UpdateTenant {
        quotas: None,
        disabled: Some(disabled),
    };
    Ok(client.update_tenant(name, &req).await?)
}

/// Runs `dsec key ...`.
pub async fn key(client: &Client, cmd: KeyCommand, json: bool) -> anyhow::Result<()> {
    match cmd {
        KeyCommand::Ls { tenant } => {
            let keys = client.list_keys(&tenant).await?;
            if json {
                return print_json(&keys);
            }
            let mut table = Table::new(&["KEY ID", "NAME", "SCOPES", "STATE", "CREATED"]);
            for k in &keys {
                table.row(vec![
                    k.key_id.clone(),
                    k.name.clone(),
                    scopes_text(&k.scopes),
                    key_state(k),
                    output::ago(k.created_at),
                ]);
            }
            print!("{}", table.render());
            Ok(())
        }
        KeyCommand::Create {
            tenant,
            scopes,
            name,
            expires_in,
        } => {
            let expires_at = expires_in
                .map(|d| {
                    u64::try_from(d.as_millis())
                        .ok()
                        .and_then(|ms| output::now_ms().checked_add(ms))
                        .context("--expires-in is too long")
                })
                .transpose()?;
            let req = CreateKey {
                name,
                scopes,
                expires_at,
            };
            let k = client.create_key(&tenant, &req).await?;
            if json {
                print_json(&k)
            } else {
                print_new_key(&k);
                Ok(())
            }
        }
        KeyCommand::Revoke { key_id } => {
            let k = client.revoke_key(&key_id).await?;
            if json {
                print_json(&k)
            } else {
                println!("{} revoked", k.key_id);
                Ok(())
            }
        }
        KeyCommand::Rotate { key_id, grace } => {
            let grace_s = grace.map_or(0, |d| d.as_secs_f64().ceil() as u64);
            let k = client.rotate_key(&key_id, grace_s).await?;
            if json {
                print_json(&k)
            } else {
                print_new_key(&k);
                Ok(())
            }
        }
    }
}
