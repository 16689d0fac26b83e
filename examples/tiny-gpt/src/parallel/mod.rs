//! Data-parallel replicas on Burn's collective engine: where each replica runs (threads of this
//! process, processes on other machines), their gradients averaged by the collective's
//! all-reduce, and the watchdog the collective lacks (a wait on a peer that died never ends).
//!
//! One module per job, each using only those listed before it:
//!
//! - [`error`]: why the replicas could not train together;
//! - [`topology`]: where the replicas run;
//! - [`flags`]: the topology's flags checked, its addresses and ports read;
//! - [`orchestrator`]: the collective's global orchestrator, served in this process;
//! - [`logging`]: the logger and the panic hook installed before the collective's;
//! - [`gradients`]: a step's gradients flattened into one vector and back;
//! - [`peer`]: one replica's link to the others (joining, the all-reduce, the barrier, leaving);
//! - [`watchdog`]: the steps finished, for the watchdog.

mod error;
mod flags;
mod gradients;
mod logging;
mod orchestrator;
mod peer;
mod topology;
mod watchdog;

pub use error::ParallelError;
pub use flags::port_free;
pub use logging::{panic_message, quiet_logging};
pub use orchestrator::run_orchestrator;
pub use peer::Peer;
pub use topology::Topology;
pub use watchdog::Heartbeat;
