//! `dsec`: the command line of the dsec sandbox platform.
//!
//! `dsec serve` runs the server; `dsec sandbox ...` and `dsec image ...` talk to it over
//! HTTP through [`dsec_client::Client`]. Every command prints readable text by default and
//! JSON with `--json`. Failures print `error: ...` with a hint and exit with code 1;
//! `dsec sandbox exec` exits with the command's own exit code.

mod batch;
mod cli;
mod dockerfile;
mod events;
mod iam;
mod image;
mod model_tokens;
mod nodes;
mod output;
mod pool;
mod sandbox;
mod serve;

use std::process::ExitCode;

use anyhow::Context;
use clap::{CommandFactory, FromArgMatches};
use dsec_client::{Client, ClientError};
use dsec_wire::ErrorCode;

use crate::cli::{Cli, Command};

#[tokio::main]
async fn main() -> ExitCode {
    let matches = Cli::command().get_matches();
    let mut cli = match Cli::from_arg_matches(&matches) {
        Ok(c) => c,
        Err(e) => e.exit(),
    };
    // Build steps keep their command-line order across --run and --copy.
    if let (Command::Image(cli::ImageCommand::Build { order, .. }), Some(m)) = (
        &mut cli.command,
        matches
            .subcommand_matches("image")
            .and_then(|m| m.subcommand_matches("build")),
    ) {
        *order = cli::build_order(m);
    }
    let url = cli.url.clone();
    match run(cli).await {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {err:#}");
            if let Some(hint) = hint(&err, &url) {
                eprintln!("hint: {hint}");
            }
            ExitCode::from(1)
        }
    }
}

/// Runs a command; returns the process exit code.
async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let client = || -> anyhow::Result<Client> {
        let key = match cli.api_key.clone() {
            Some(k) => Some(k),
            None => dsec_client::api_key_from_env()?,
        };
        Client::new(&cli.url, key).context("configuring the client")
    };
    match cli.command {
        Command::Serve(args) => serve::run(*args).await.map(|()| ExitCode::SUCCESS),
        Command::Node(mut args) => match args.command.take() {
            Some(cmd) => nodes::run(&client()?, cmd, cli.json)
                .await
                .map(|()| ExitCode::SUCCESS),
            None => serve::run_node(*args).await.map(|()| ExitCode::SUCCESS),
        },
        Command::Apiserver(args) => serve::run_apiserver(*args)
            .await
            .map(|()| ExitCode::SUCCESS),
        Command::Sandbox(cmd) => sandbox::run(&client()?, cmd, cli.json).await,
        Command::Image(cmd) => image::run(&client()?, cmd, cli.json)
            .await
            .map(|()| ExitCode::SUCCESS),
        Command::Fncall(args) => pool::fncall(&client()?, args, cli.json).await,
        Command::Queue => pool::queue(&client()?, cli.json)
            .await
            .map(|()| ExitCode::SUCCESS),
        Command::Audit(args) => events::audit(&client()?, args, cli.json)
            .await
            .map(|()| ExitCode::SUCCESS),
        Command::Events(args) => events::run(&client()?, args, cli.json)
            .await
            .map(|()| ExitCode::SUCCESS),
        Command::Job(cmd) => sandbox::job(&client()?, cmd, cli.json).await,
        Command::Submit(args) => batch::submit(&client()?, args, cli.json).await,
        Command::Batch(cmd) => batch::run(&client()?, cmd, cli.json)
            .await
            .map(|()| ExitCode::SUCCESS),
        Command::Pool(cmd) => pool::run(&client()?, cmd, cli.json)
            .await
            .map(|()| ExitCode::SUCCESS),
        Command::Tenant(cmd) => iam::tenant(&client()?, cmd, cli.json)
            .await
            .map(|()| ExitCode::SUCCESS),
        Command::Key(cmd) => iam::key(&client()?, cmd, cli.json)
            .await
            .map(|()| ExitCode::SUCCESS),
        Command::Gateway(args) => serve::run_gateway(args).await.map(|()| ExitCode::SUCCESS),
        Command::LazyServe { config } => {
            tokio::task::block_in_place(|| serve::lazy_serve(&config)).map(|()| ExitCode::SUCCESS)
        }
    }
}

/// A hint for well-known failures: a missing/wrong key, no server listening.
fn hint(err: &anyhow::Error, url: &str) -> Option<String> {
    let client_err = err.chain().find_map(|e| e.downcast_ref::<ClientError>())?;
    if client_err.is_connect() {
        return Some(format!(
            "is `dsec serve` running at {url}? (set --url or DSEC_URL)"
        ));
    }
    match client_err.code()? {
        ErrorCode::Unauthorized => Some(
            "pass --api-key or set DSEC_API_KEY; the key is in /var/lib/dsec/api-key".to_owned(),
        ),
        ErrorCode::ImageNotFound => Some("list images with `dsec image ls`".to_owned()),
        ErrorCode::Expired => Some(
            "the sandbox's lifetime ran out; extend lifetimes with `dsec sandbox timeout`"
                .to_owned(),
        ),
        _ => None,
    }
}
