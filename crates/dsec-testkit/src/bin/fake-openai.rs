//! `fake-openai --listen ADDR --models A,B`: [`dsec_testkit::openai::FakeOpenAi`] as a
//! process, for tests in other languages (the Python suite drives the gateway with the
//! real `openai` SDK). Prints its base URL on stdout once it listens, then serves until
//! killed.

use std::net::SocketAddr;

fn main() -> std::io::Result<()> {
    let mut listen: SocketAddr = "127.0.0.1:0".parse().map_err(std::io::Error::other)?;
    let mut models = vec!["fake-model".to_string()];
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let value = args.next().ok_or_else(|| {
            std::io::Error::other(format!("{arg} needs a value (--listen ADDR, --models A,B)"))
        })?;
        match arg.as_str() {
            "--listen" => listen = value.parse().map_err(std::io::Error::other)?,
            "--models" => models = value.split(',').map(str::to_string).collect(),
            other => return Err(std::io::Error::other(format!("unknown argument {other}"))),
        }
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let names: Vec<&str> = models.iter().map(String::as_str).collect();
        let fake = dsec_testkit::openai::FakeOpenAi::start_on(listen, &names).await?;
        println!("{}", fake.url());
        std::future::pending::<std::io::Result<()>>().await
    })
}
