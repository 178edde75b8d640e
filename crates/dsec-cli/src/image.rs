//! `dsec image ...`.

use std::io::IsTerminal;
use std::time::Duration;

use anyhow::Context;
use dsec_client::Client;
use dsec_wire::v1::ImportImageRequest;
use indicatif::{ProgressBar, ProgressStyle};

use crate::cli::{BuildArg, ImageCommand};
use crate::output::{self, print_json, Table};

/// Runs an image command.
pub async fn run(client: &Client, cmd: ImageCommand, json: bool) -> anyhow::Result<()> {
    match cmd {
        ImageCommand::Build {
            first,
            second,
            file,
            build_args,
            target,
            no_cache,
            network,
            order,
            ..
        } if second.is_some() || file.is_some() => {
            if !order.is_empty() {
                anyhow::bail!(
                    "--run and --copy make a build without a Dockerfile; a Dockerfile build \
                     takes its steps from the Dockerfile"
                );
            }
            let (context, name) = match second {
                Some(name) => (std::path::PathBuf::from(first), name),
                None => anyhow::bail!("a Dockerfile build takes CONTEXT and NAME"),
            };
            let mut req = dsec_wire::v1::DockerfileBuildRequest {
                name,
                target,
                no_cache,
                ..Default::default()
            };
            for arg in build_args {
                let (k, v) = match arg.split_once('=') {
                    Some((k, v)) => (k.to_string(), v.to_string()),
                    // Docker's `--build-arg NAME` takes NAME from the environment.
                    None => match std::env::var(&arg) {
                        Ok(v) => (arg.clone(), v),
                        Err(_) => continue,
                    },
                };
                req.build_args.insert(k, v);
            }
            if let Some(mode) = network {
                req.network = serde_json::from_value(serde_json::Value::String(mode.clone()))
                    .map_err(|_| anyhow::anyhow!("--network {mode:?}: none, allowlist or open"))?;
            }
            crate::dockerfile::build(client, req, &context, file.as_deref(), json).await?;
        }
        ImageCommand::Build {
            first: name,
            from,
            order,
            ..
        } => {
            let mut steps = Vec::with_capacity(order.len());
            for arg in order {
                steps.push(match arg {
                    BuildArg::Run(cmd) => dsec_wire::v1::BuildStep::Run(cmd),
                    BuildArg::Copy(spec) => copy_step(&spec)?,
                });
            }
            let req = dsec_wire::v1::BuildRequest {
                name,
                base: from,
                steps,
                step_timeout_s: None,
            };
            let r = client.build_image(req).await?;
            if json {
                print_json(&r)?;
            } else {
                let hits = r.cached.iter().filter(|c| **c).count();
                println!(
                    "built {} {} ({} layers; {hits} of {} steps from cache)",
                    r.image.name,
                    r.image.digest,
                    r.image.layers.len(),
                    r.cached.len()
                );
            }
        }
        ImageCommand::Gc {
            older_than,
            shared,
            shared_grace,
        } => {
            let r = client
                .gc_images(&dsec_wire::v1::GcRequest {
                    older_than_s: older_than.map_or(0, |d| d.as_secs()),
                    shared_store: shared,
                    shared_grace_s: shared_grace.map(|d| d.as_secs()),
                })
                .await?;
            if json {
                print_json(&r)?;
            } else {
                println!(
                    "removed {} build-cache entries, freed {}",
                    r.removed.len(),
                    output::bytes(r.freed_bytes)
                );
                println!(
                    "evicted {} layers from the node cache, freed {}",
                    r.evicted.len(),
                    output::bytes(r.evicted_bytes)
                );
                if shared {
                    println!(
                        "deleted {} unused layers from the shared store, freed {}",
                        r.shared_deleted.len(),
                        output::bytes(r.shared_freed_bytes)
                    );
                }
            }
        }
        ImageCommand::Import {
            name,
            source,
            flatten,
            upload: true,
        } => {
            let file = tokio::fs::File::open(&source)
                .await
                .with_context(|| format!("opening {}", source.display()))?;
            if file.metadata().await?.is_dir() {
                anyhow::bail!(
                    "{} is a directory: tar it first (tar -C DIR -cf rootfs.tar .)",
                    source.display()
                );
            }
            let started = std::time::Instant::now();
            let image = client.upload_image(&name, flatten, file).await?;
            print_stored("uploaded", &image, started, json)?;
        }
        ImageCommand::Import {
            name,
            source,
            flatten,
            upload: false,
        } => {
            let source = std::path::absolute(&source)
                .with_context(|| format!("resolving {}", source.display()))?;
            let source = source
                .to_str()
                .with_context(|| format!("{} is not valid UTF-8", source.display()))?
                .to_owned();
            let req = ImportImageRequest {
                name: name.clone(),
                source,
                flatten,
            };
            let events = client.import_image_stream(req);
            with_progress(format!("importing {name}"), "imported", json, events).await?;
        }
        ImageCommand::Pull {
            reference,
            name,
            insecure_registry,
        } => {
            let label = format!("pulling {reference}");
            let req = dsec_wire::v1::PullImageRequest {
                reference,
                name,
                insecure: insecure_registry,
            };
            with_progress(label, "pulled", json, client.pull_image_stream(req)).await?;
        }
        ImageCommand::Ls => {
            let list = client.list_images().await?;
            if json {
                return print_json(&list);
            }
            let mut t = Table::new(&["NAME", "DIGEST", "SIZE", "CREATED", "SOURCE"]);
            for i in &list.images {
                let digest = i.digest.strip_prefix("sha256:").unwrap_or(&i.digest);
                t.row(vec![
                    i.name.clone(),
                    digest.chars().take(12).collect(),
                    output::bytes(i.size_bytes),
                    output::ago(i.created_at),
                    i.source.clone(),
                ]);
            }
            print!("{}", t.render());
        }
        ImageCommand::Rm { name } => {
            client.delete_image(&name).await?;
            if json {
                print_json(&serde_json::json!({ "deleted": name }))?;
            } else {
                println!("removed {name}");
            }
        }
    }
    Ok(())
}

fn spinner_style() -> ProgressStyle {
    ProgressStyle::with_template("{spinner} {msg} {bytes} ({elapsed})")
        .unwrap_or_else(|_| ProgressStyle::default_spinner())
}

fn bar_style() -> ProgressStyle {
    ProgressStyle::with_template(
        "{msg:>10} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta} ({elapsed})",
    )
    .map(|s| s.progress_chars("=> "))
    .unwrap_or_else(|_| ProgressStyle::default_bar())
}

type Events = futures::stream::BoxStream<
    'static,
    Result<dsec_wire::v1::ImportEvent, dsec_client::ClientError>,
>;

/// Runs an import or pull through its progress stream (`events`), with a progress bar
/// labelled `label` on a terminal, and prints the stored image (`verb NAME DIGEST ...`).
async fn with_progress(
    label: String,
    verb: &str,
    json: bool,
    events: impl std::future::Future<Output = Result<Events, dsec_client::ClientError>>,
) -> anyhow::Result<()> {
    let bar = (!json && std::io::stderr().is_terminal()).then(|| {
        let pb = ProgressBar::new_spinner();
        pb.set_style(spinner_style());
        pb.set_message(label);
        pb.enable_steady_tick(Duration::from_millis(100));
        pb
    });
    let started = std::time::Instant::now();
    let result = match events.await {
        Ok(events) => show_progress(events, bar.as_ref()).await,
        Err(e) => Err(e.into()),
    };
    if let Some(pb) = bar {
        pb.finish_and_clear();
    }
    print_stored(verb, &result?, started, json)
}

/// Prints an image just stored: as JSON, or `verb NAME DIGEST (SIZE) in Ns`.
fn print_stored(
    verb: &str,
    image: &dsec_wire::v1::Image,
    started: std::time::Instant,
    json: bool,
) -> anyhow::Result<()> {
    if json {
        return print_json(image);
    }
    println!(
        "{verb} {} {} ({}) in {:.1}s",
        image.name,
        image.digest,
        output::bytes(image.size_bytes),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Shows the progress events of an import or pull on `bar`; returns the stored image.
async fn show_progress(
    mut events: Events,
    bar: Option<&ProgressBar>,
) -> anyhow::Result<dsec_wire::v1::Image> {
    use dsec_wire::v1::ImportEvent;
    use futures::StreamExt;
    let mut phase = String::new();
    while let Some(ev) = events.next().await {
        match ev.context("reading import progress")? {
            ImportEvent::Progress {
                phase: p,
                bytes_done,
                bytes_total,
            } => {
                let Some(pb) = bar else { continue };
                if p != phase {
                    pb.set_style(if bytes_total.is_some() {
                        bar_style()
                    } else {
                        spinner_style()
                    });
                    pb.set_message(p.clone());
                    phase = p;
                }
                if let Some(total) = bytes_total {
                    pb.set_length(total);
                }
                pb.set_position(bytes_done);
            }
            ImportEvent::Done { image } => return Ok(image),
            ImportEvent::Error { error } => return Err(dsec_client::ClientError::Api(error).into()),
        }
    }
    anyhow::bail!("the server ended the progress stream without a result")
}

/// A `--copy SRC:DEST` build step: SRC (a file, or a directory's contents) as a tar for
/// directory DEST in the image. Symlinks are kept as links, not followed.
fn copy_step(spec: &str) -> anyhow::Result<dsec_wire::v1::BuildStep> {
    use base64::Engine;
    let (src, dest) = spec
        .rsplit_once(':')
        .with_context(|| format!("--copy {spec:?}: expected SRC:DEST"))?;
    if !dest.starts_with('/') {
        anyhow::bail!("--copy {spec:?}: DEST must be an absolute path in the image");
    }
    let src = std::path::Path::new(src);
    let meta = std::fs::symlink_metadata(src)
        .with_context(|| format!("--copy: reading {}", src.display()))?;
    let mut b = tar::Builder::new(Vec::new());
    b.follow_symlinks(false);
    if meta.is_dir() {
        b.append_dir_all(".", src)
    } else {
        let name = src
            .file_name()
            .with_context(|| format!("--copy: {} has no file name", src.display()))?;
        b.append_path_with_name(src, name)
    }
    .with_context(|| format!("--copy: archiving {}", src.display()))?;
    let data = b.into_inner().context("--copy: finishing the archive")?;
    if data.len() > 40 << 20 {
        anyhow::bail!(
            "--copy {}: {} MiB is more than a build step carries (40 MiB); copy it into a \
             sandbox and commit it instead",
            src.display(),
            data.len() >> 20
        );
    }
    Ok(dsec_wire::v1::BuildStep::Copy {
        dest: dest.to_string(),
        tar: base64::engine::general_purpose::STANDARD.encode(data),
    })
}
