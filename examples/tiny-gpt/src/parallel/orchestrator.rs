//! The collective's global orchestrator, which the nodes meet at: served by rank 0 in a thread of
//! its own, or by `tiny-gpt orchestrator` on its own.

use burn::collective;

use super::error::ParallelError;
use super::flags::port_of;
use super::topology::Topology;

impl Topology {
    /// Starts the orchestrator in this process when it is rank 0's to start.
    pub fn start_orchestrator(&self) -> Result<(), ParallelError> {
        if self.nodes > 1 && self.rank == 0 && !self.external_orchestrator {
            let (orchestrator, _) = self.addresses()?;
            let port = port_of("--orchestrator", orchestrator)?;
            std::thread::spawn(move || run_orchestrator(port));
        }
        Ok(())
    }
}

/// Serves the collective's global orchestrator on `port` until the process ends.
pub fn run_orchestrator(port: u16) {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime")
        .block_on(collective::start_global_orchestrator(port));
}
