//! Why the replicas could not train together: the one error type of data-parallel training.

use thiserror::Error;

/// Why the replicas could not train together.
#[derive(Debug, Error)]
pub enum ParallelError {
    /// A flag's value does not describe a run.
    #[error("{flag} {value}: {reason}")]
    Setting {
        /// The flag.
        flag: &'static str,
        /// Its value.
        value: String,
        /// Why not.
        reason: String,
    },
    /// A flag missing, or given where it means nothing.
    #[error("{flag}: {reason}")]
    Flag {
        /// The flag.
        flag: &'static str,
        /// Why.
        reason: &'static str,
    },
    /// A port this node would listen on is taken.
    #[error("{what} port {port} is in use ({source}): pick another")]
    PortInUse {
        /// The orchestrator's or the data service's.
        what: &'static str,
        /// The port.
        port: u16,
        /// What binding it said.
        source: std::io::Error,
    },
    /// The collective refused an operation.
    #[error("peer {peer}: the collective failed to {operation}: {reason}")]
    Collective {
        /// The peer.
        peer: usize,
        /// `register`, `all-reduce the loss`, …
        operation: &'static str,
        /// The collective's error.
        reason: String,
    },
    /// The collective lost its connection to another node mid-operation.
    #[error(
        "peer {peer}: the collective failed to {operation}: the connection to {nodes} broke \
         (it died or left early)"
    )]
    LostNode {
        /// The peer.
        peer: usize,
        /// `all-reduce the loss`, …
        operation: &'static str,
        /// The other nodes.
        nodes: String,
    },
    /// A replica thread of this process ended without a result.
    #[error("peer {peer} panicked: {message}")]
    Panicked {
        /// The peer.
        peer: usize,
        /// The panic's message.
        message: String,
    },
    /// No replica finished a step within the timeout.
    #[error(
        "no step finished for {seconds} s (waiting at step {step}): {waiting_for} did not answer \
         (it died or never joined); raise --peer-timeout if steps are that slow"
    )]
    Stalled {
        /// The timeout.
        seconds: u64,
        /// The step the replicas wait in.
        step: usize,
        /// The peers or nodes not heard from.
        waiting_for: String,
    },
}
