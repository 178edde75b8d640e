//! `dsec submit` and `dsec batch`: batch jobs (`/v1/batches`).

use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context};
use dsec_client::Client;
use dsec_wire::v1::{Batch, BatchSpec, BatchState, TaskListQuery, TaskState};
use sha2::Digest;

use crate::cli::{BatchCommand, SubmitArgs};
use crate::output::{print_json, Table};

/// `dsec submit FILE`: uploads the job's local input files, submits it, and with
/// `--wait` follows it to the end (exit code 1 if a task failed).
pub async fn submit(client: &Client, args: SubmitArgs, json: bool) -> anyhow::Result<ExitCode> {
    let text = std::fs::read_to_string(&args.file)
        .with_context(|| format!("reading {}", args.file.display()))?;
    let mut doc: serde_json::Value = serde_yaml_ng::from_str(&text)
        .with_context(|| format!("parsing {} (YAML or JSON)", args.file.display()))?;
    let base = args.file.parent().unwrap_or(Path::new("."));
    upload_local_inputs(client, &mut doc, base).await?;
    let spec: BatchSpec = serde_json::from_value(doc)
        .with_context(|| format!("{} is not a batch spec", args.file.display()))?;
    let batch = client.submit_batch(&spec).await?;
    if !args.wait {
        if json {
            print_json(&batch)?;
        } else {
            println!("{}", batch.id);
        }
        return Ok(ExitCode::SUCCESS);
    }
    eprintln!("batch {} submitted: {} tasks", batch.id, batch.total);
    let done = wait(client, &batch.id).await?;
    if json {
        print_json(&done)?;
    } else {
        println!("{}", summary(&done));
    }
    Ok(
        if done.counts.get(&TaskState::Failed).copied().unwrap_or(0) > 0
            || done.state != BatchState::Finished
        {
            ExitCode::FAILURE
        } else {
            ExitCode::SUCCESS
        },
    )
}

/// Replaces every `{file: PATH}` input (relative to the job file) by `{blob: KEY}`,
/// uploading the file under a key named by its sha256 (so a rerun uploads nothing new
/// to name).
async fn upload_local_inputs(
    client: &Client,
    doc: &mut serde_json::Value,
    base: &Path,
) -> anyhow::Result<()> {
    let Some(tasks) = doc.get_mut("tasks").and_then(|t| t.as_array_mut()) else {
        return Ok(());
    };
    let mut uploaded = std::collections::HashMap::new();
    for task in tasks {
        let Some(inputs) = task.get_mut("inputs").and_then(|i| i.as_object_mut()) else {
            continue;
        };
        for (path, input) in inputs.iter_mut() {
            let Some(file) = input.get("file").and_then(|f| f.as_str()) else {
                continue;
            };
            let local = base.join(file);
            let key = match uploaded.get(&local) {
                Some(k) => String::clone(k),
                None => {
                    let data = std::fs::read(&local)
                        .with_context(|| format!("input {path}: reading {}", local.display()))?;
                    let key = format!("sha256/{:x}", sha2::Sha256::digest(&data));
                    client
                        .put_input(&key, data)
                        .await
                        .with_context(|| format!("uploading {}", local.display()))?;
                    uploaded.insert(local.clone(), key.clone());
                    key
                }
            };
            *input = serde_json::json!({ "blob": key });
        }
    }
    Ok(())
}

/// Follows batch `id` until it ends, with a progress line on stderr.
async fn wait(client: &Client, id: &str) -> anyhow::Result<Batch> {
    loop {
        let b = client.get_batch(id).await?;
        if b.ended_at_ms.is_some() {
            return Ok(b);
        }
        eprintln!("{}", summary(&b));
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

fn summary(b: &Batch) -> String {
    let counts: Vec<String> = b
        .counts
        .iter()
        .filter(|(_, n)| **n > 0)
        .map(|(s, n)| format!("{} {n}", s.as_str()))
        .collect();
    format!(
        "{} {:?}: {} of {} done ({})",
        b.id,
        b.state,
        b.counts.get(&TaskState::Finalized).copied().unwrap_or(0)
            + b.counts.get(&TaskState::Failed).copied().unwrap_or(0),
        b.total,
        counts.join(", ")
    )
}

/// Runs a `dsec batch` command.
pub async fn run(client: &Client, cmd: BatchCommand, json: bool) -> anyhow::Result<()> {
    match cmd {
        BatchCommand::Ls => {
            let list = client.list_batches().await?;
            if json {
                return print_json(&list);
            }
            let mut t = Table::new(&["ID", "NAME", "STATE", "TOTAL", "FINALIZED", "FAILED"]);
            for b in &list.batches {
                t.row(vec![
                    b.id.clone(),
                    b.name.clone().unwrap_or_default(),
                    format!("{:?}", b.state).to_lowercase(),
                    b.total.to_string(),
                    count(b, TaskState::Finalized),
                    count(b, TaskState::Failed),
                ]);
            }
            print!("{}", t.render());
            Ok(())
        }
        BatchCommand::Get { id } => {
            let b = client.get_batch(&id).await?;
            if json {
                return print_json(&b);
            }
            println!("{}", summary(&b));
            Ok(())
        }
        BatchCommand::Wait { id } => {
            let b = wait(client, &id).await?;
            if json {
                return print_json(&b);
            }
            println!("{}", summary(&b));
            Ok(())
        }
        BatchCommand::Tasks { id, state } => {
            if let Some(s) = &state {
                if TaskState::parse(s).is_none() {
                    bail!("unknown state {s:?}");
                }
            }
            let mut query = TaskListQuery {
                state,
                ..Default::default()
            };
            let mut tasks = Vec::new();
            loop {
                let page = client.batch_tasks(&id, &query).await?;
                tasks.extend(page.tasks);
                match page.next {
                    Some(n) => query.after = Some(n),
                    None => break,
                }
            }
            if json {
                return print_json(&tasks);
            }
            let mut t = Table::new(&["TASK", "STATE", "ATTEMPT", "EXIT", "ERROR"]);
            for s in &tasks {
                t.row(vec![
                    s.id.clone(),
                    s.state.as_str().to_string(),
                    s.attempt.to_string(),
                    s.exit_code.map(|c| c.to_string()).unwrap_or_default(),
                    s.error.clone().unwrap_or_default(),
                ]);
            }
            print!("{}", t.render());
            Ok(())
        }
        BatchCommand::Manifest { id } => print_json(&client.batch_manifest(&id).await?),
        BatchCommand::Output {
            id,
            task,
            path,
            out,
        } => {
            let data = client.batch_output(&id, &task, path.as_deref()).await?;
            match out {
                Some(file) => std::fs::write(&file, &data)
                    .with_context(|| format!("writing {}", file.display())),
                None => {
                    use std::io::Write;
                    std::io::stdout().write_all(&data).context("writing stdout")
                }
            }
        }
        BatchCommand::Cancel { id } => {
            let b = client.cancel_batch(&id).await?;
            if json {
                return print_json(&b);
            }
            println!("{}", summary(&b));
            Ok(())
        }
        BatchCommand::Rm { id } => {
            client.purge_batch(&id).await?;
            if !json {
                println!("{id} purged");
            }
            Ok(())
        }
        BatchCommand::PutInput { key, file } => {
            let f = tokio::fs::File::open(&file)
                .await
                .with_context(|| format!("opening {}", file.display()))?;
            let obj = client.put_input(&key, f).await?;
            if json {
                return print_json(&obj);
            }
            println!("{} {} bytes sha256:{}", obj.key, obj.bytes, obj.sha256);
            Ok(())
        }
    }
}

fn count(b: &Batch, s: TaskState) -> String {
    b.counts.get(&s).copied().unwrap_or(0).to_string()
}
