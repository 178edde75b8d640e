//! `dsec node ls|drain|undrain`: a cluster's nodes, through an API server.

use dsec_client::Client;
use dsec_wire::v1::ClusterNode;

use crate::cli::NodeCommand;
use crate::output::print_json;

/// Runs a node management command.
pub async fn run(client: &Client, cmd: NodeCommand, json: bool) -> anyhow::Result<()> {
    let (name, drain) = match cmd {
        NodeCommand::Ls => {
            let list = client.list_nodes().await?;
            if json {
                return print_json(&list);
            }
            println!(
                "{:<24} {:<9} {:<10} {:>13} {:>15} {:>9}  URL",
                "NAME", "STATE", "POOL", "CPU (m)", "MEMORY (MiB)", "SANDBOXES"
            );
            for n in &list.nodes {
                println!("{}", row(n));
            }
            return Ok(());
        }
        NodeCommand::Drain { name } => (name, true),
        NodeCommand::Undrain { name } => (name, false),
    };
    let node = client.drain_node(&name, drain).await?;
    if json {
        print_json(&node)
    } else {
        if drain {
            println!(
                "node {} drained: no new sandboxes; its {} sandboxes keep running",
                node.name, node.sandboxes
            );
        } else {
            println!("node {} takes new sandboxes again", node.name);
        }
        Ok(())
    }
}

/// One line of `dsec node ls`.
fn row(n: &ClusterNode) -> String {
    let state = match (n.live, n.draining) {
        (false, _) => "down",
        (true, true) => "draining",
        (true, false) => "ready",
    };
    let pool = n.labels.get("pool").map_or("default", String::as_str);
    format!(
        "{:<24} {:<9} {:<10} {:>13} {:>15} {:>9}  {}",
        n.name,
        state,
        pool,
        format!("{}/{}", n.cpu_millis_used, n.cpu_millis),
        format!("{}/{}", n.memory_bytes_used >> 20, n.memory_bytes >> 20),
        n.sandboxes,
        n.url
    )
}
