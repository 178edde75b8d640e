//! `dsec image build [-f Dockerfile] CONTEXT NAME`: tars the build context (what
//! `.dockerignore` leaves in, plus the Dockerfile wherever it is), sends it and shows the
//! build's steps and output as they come.

use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use dsec_client::Client;
use dsec_dockerfile::Ignore;
use dsec_wire::v1::{BuildEvent, DockerfileBuildRequest};
use futures::StreamExt;

use crate::output::print_json;

/// Name the Dockerfile gets in the context tar when it lives outside the context.
const OUTSIDE_DOCKERFILE: &str = ".dsec-dockerfile";

/// Builds `req` from the directory `context` and `dockerfile` (default
/// `context/Dockerfile`), printing progress to stderr and the result to stdout.
pub async fn build(
    client: &Client,
    mut req: DockerfileBuildRequest,
    context: &Path,
    dockerfile: Option<&Path>,
    json: bool,
) -> anyhow::Result<()> {
    let meta = std::fs::metadata(context)
        .with_context(|| format!("build context {}", context.display()))?;
    if !meta.is_dir() {
        anyhow::bail!("build context {} is not a directory", context.display());
    }
    let (context, dockerfile) = (context.to_path_buf(), dockerfile.map(Path::to_path_buf));
    let (tar, member, files) =
        tokio::task::spawn_blocking(move || tar_context(&context, dockerfile.as_deref())).await??;
    req.dockerfile = Some(member);
    let size = tar.metadata().map(|m| m.len()).unwrap_or(0);
    if !json {
        eprintln!(
            "sending the build context: {files} files, {}",
            crate::output::bytes(size)
        );
    }
    let mut events = client
        .build_dockerfile(&req, tokio::fs::File::from_std(tar))
        .await?;
    while let Some(ev) = events.next().await {
        match ev? {
            BuildEvent::Warning { message } => eprintln!("warning: {message}"),
            BuildEvent::Step {
                step,
                steps,
                stage,
                text,
                cached,
                ..
            } => {
                if !json {
                    let cached = if cached { " (cached)" } else { "" };
                    eprintln!("[{stage}] step {step}/{steps}: {text}{cached}");
                }
            }
            BuildEvent::Output { data, .. } => {
                if !json {
                    let mut err = std::io::stderr().lock();
                    let _ = err.write_all(data.as_bytes());
                }
            }
            BuildEvent::Done {
                image,
                steps,
                cached,
            } => {
                if json {
                    print_json(&image)?;
                } else {
                    println!(
                        "built {} {} ({} layers; {cached} of {steps} steps from cache)",
                        image.name,
                        image.digest,
                        image.layers.len().max(1)
                    );
                }
                return Ok(());
            }
            BuildEvent::Error { error } => {
                return Err(dsec_client::ClientError::Api(error).into());
            }
        }
    }
    anyhow::bail!("the server ended the build without a result")
}

/// The context as a tar in a temp file, the Dockerfile's name in it, and how many
/// entries it holds. Symlinks are archived as links; sockets and devices are left out.
fn tar_context(
    context: &Path,
    dockerfile: Option<&Path>,
) -> anyhow::Result<(std::fs::File, String, usize)> {
    let ignore = match std::fs::read_to_string(context.join(".dockerignore")) {
        Ok(text) => Ignore::parse(&text).context(".dockerignore")?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ignore::default(),
        Err(e) => return Err(e).context("reading .dockerignore"),
    };
    let canonical_context = context
        .canonicalize()
        .with_context(|| format!("resolving {}", context.display()))?;
    // The Dockerfile by its name in the context, or added under a name of its own.
    let (member, outside) = match dockerfile {
        None => ("Dockerfile".to_string(), None),
        Some(f) => {
            let real = f
                .canonicalize()
                .with_context(|| format!("Dockerfile {}", f.display()))?;
            match real.strip_prefix(&canonical_context) {
                Ok(rel) if !rel.as_os_str().is_empty() => {
                    (rel.to_string_lossy().into_owned(), None)
                }
                _ => (OUTSIDE_DOCKERFILE.to_string(), Some(real)),
            }
        }
    };
    let file = tempfile::tempfile().context("temp file for the build context")?;
    let mut b = tar::Builder::new(std::io::BufWriter::new(file));
    b.follow_symlinks(false);
    let mut count = 0usize;
    let mut stack: Vec<PathBuf> = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let dir = canonical_context.join(&rel);
        let mut names: Vec<_> = std::fs::read_dir(&dir)
            .with_context(|| format!("reading {}", dir.display()))?
            .collect::<Result<_, _>>()
            .with_context(|| format!("reading {}", dir.display()))?;
        names.sort_by_key(|e| e.file_name());
        for entry in names {
            let path = rel.join(entry.file_name());
            let shown = path.to_string_lossy().into_owned();
            let ty = entry
                .file_type()
                .with_context(|| format!("reading {shown}"))?;
            // The Dockerfile and .dockerignore travel whatever .dockerignore says.
            let always = shown == member || shown == ".dockerignore";
            if !always && ignore.is_ignored(&shown, ty.is_dir()) {
                continue;
            }
            if !(ty.is_dir() || ty.is_file() || ty.is_symlink()) {
                continue;
            }
            b.append_path_with_name(canonical_context.join(&path), &path)
                .with_context(|| format!("archiving {shown}"))?;
            count += 1;
            if ty.is_dir() {
                stack.push(path);
            }
        }
    }
    if let Some(real) = outside {
        b.append_path_with_name(&real, OUTSIDE_DOCKERFILE)
            .with_context(|| format!("archiving {}", real.display()))?;
        count += 1;
    }
    let mut file = b
        .into_inner()
        .context("finishing the context archive")?
        .into_inner()
        .map_err(|e| e.into_error())
        .context("writing the context archive")?;
    file.seek(SeekFrom::Start(0))?;
    Ok((file, member, count))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(file: std::fs::File) -> Vec<String> {
        let mut a = tar::Archive::new(file);
        let mut v: Vec<String> = a
            .entries()
            .expect("tar")
            .map(|e| {
                e.expect("entry")
                    .path()
                    .expect("path")
                    .to_string_lossy()
                    .into_owned()
            })
            .collect();
        v.sort();
        v
    }

    #[test]
    fn context_honors_dockerignore_but_keeps_the_dockerfile() {
        let dir = tempfile::tempdir().expect("tempdir");
        let d = dir.path();
        std::fs::write(d.join("Dockerfile"), "FROM base\n").expect("write");
        std::fs::write(
            d.join(".dockerignore"),
            "Dockerfile\n*.log\nbuild/\n!build/keep\n",
        )
        .expect("write");
        std::fs::write(d.join("a.py"), "x").expect("write");
        std::fs::write(d.join("x.log"), "x").expect("write");
        std::fs::create_dir_all(d.join("build")).expect("mkdir");
        std::fs::write(d.join("build/keep"), "k").expect("write");
        std::fs::write(d.join("build/drop"), "d").expect("write");
        std::os::unix::fs::symlink("a.py", d.join("link")).expect("symlink");
        let (tar, member, n) = tar_context(d, None).expect("tar");
        assert_eq!(member, "Dockerfile");
        let got = names(tar);
        assert_eq!(
            got,
            [
                ".dockerignore",
                "Dockerfile",
                "a.py",
                "build",
                "build/keep",
                "link"
            ]
        );
        assert_eq!(n, got.len());
    }

    #[test]
    fn a_dockerfile_outside_the_context_travels_under_its_own_name() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ctx = dir.path().join("ctx");
        std::fs::create_dir_all(&ctx).expect("mkdir");
        std::fs::write(ctx.join("f"), "x").expect("write");
        std::fs::write(dir.path().join("My.Dockerfile"), "FROM base\n").expect("write");
        let (tar, member, _) =
            tar_context(&ctx, Some(&dir.path().join("My.Dockerfile"))).expect("tar");
        assert_eq!(member, OUTSIDE_DOCKERFILE);
        assert_eq!(names(tar), [OUTSIDE_DOCKERFILE, "f"]);
        // Inside the context it keeps its path.
        std::fs::create_dir_all(ctx.join("docker")).expect("mkdir");
        std::fs::write(ctx.join("docker/Dockerfile.dev"), "FROM base\n").expect("write");
        let (_, member, _) =
            tar_context(&ctx, Some(&ctx.join("docker/Dockerfile.dev"))).expect("tar");
        assert_eq!(member, "docker/Dockerfile.dev");
    }
}
