//! Where the replicas run: threads of this process times processes, and the counts and names
//! derived from that.

use std::time::Duration;

/// Where the replicas run: `peers` threads in each of `nodes` processes.
#[derive(Debug, Clone)]
pub struct Topology {
    /// Replicas in this process, one thread each.
    pub peers: usize,
    /// Processes (on one machine or several), 1 when there is only this one.
    pub nodes: usize,
    /// This process's rank among them (0 writes the checkpoint and starts the orchestrator).
    pub rank: usize,
    /// The orchestrator's `HOST:PORT`, with several nodes.
    pub orchestrator: Option<String>,
    /// Whether rank 0 leaves the orchestrator to `tiny-gpt orchestrator`.
    pub external_orchestrator: bool,
    /// This node's data service, `HOST:PORT` as the other nodes reach it, with several nodes.
    pub data_address: Option<String>,
    /// How long the replicas may go without finishing a step.
    pub timeout: Duration,
}

impl Topology {
    /// Replicas in all processes together.
    pub fn replicas(&self) -> usize {
        self.peers * self.nodes
    }

    /// Whether gradients cross replicas at all.
    pub fn is_parallel(&self) -> bool {
        self.replicas() > 1
    }

    /// The replica index of this process's `local` peer among all of them.
    pub fn global_peer(&self, local: usize) -> usize {
        self.rank * self.peers + local
    }

    /// Whom a stalled step waits for: the other nodes, or this process's other peers.
    pub fn waiting_for(&self) -> String {
        if self.nodes > 1 {
            other_nodes(self.nodes, self.rank)
        } else {
            "a peer".into()
        }
    }
}

/// `node rank 1, 2`: the nodes other than `rank` of `nodes`.
pub(super) fn other_nodes(nodes: usize, rank: usize) -> String {
    let others: Vec<String> = (0..nodes)
        .filter(|&other| other != rank)
        .map(|other| other.to_string())
        .collect();
    format!("node rank {}", others.join(", "))
}
