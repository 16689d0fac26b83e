//! Data-parallel replicas on Burn's collective engine: where each replica runs (threads of this
//! process, processes on other machines), their gradients averaged by the collective's
//! all-reduce, and the watchdog the collective lacks (a wait on a peer that died never ends).

use std::net::{TcpListener, ToSocketAddrs};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use burn::collective::{self, CollectiveConfig, CollectiveError, PeerId, ReduceOperation};
use burn::module::{AutodiffModule, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::prelude::*;
use burn::tensor::TensorPrimitive;
use burn::tensor::backend::AutodiffBackend;
use thiserror::Error;
use tracing_subscriber::EnvFilter;

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

    /// The collective's settings for this process's peers.
    fn collective_config(&self) -> Result<CollectiveConfig, ParallelError> {
        let config = CollectiveConfig::default().with_num_devices(self.peers);
        if self.nodes == 1 {
            return Ok(config);
        }
        let (orchestrator, data_address) = self.addresses()?;
        let port = port_of("--data-address", data_address)?;
        let ws = |address: &str| {
            format!("ws://{address}")
                .parse()
                .expect("an address parses")
        };
        // Burn's default strategy across nodes, the ring, splits every tensor into one slice per
        // node and refuses a smaller one: the step's one vector and the barrier's one element per
        // node are both large enough.
        Ok(config
            .with_num_nodes(self.nodes as u32)
            .with_global_address(ws(orchestrator))
            .with_node_address(ws(data_address))
            .with_data_service_port(port))
    }

    fn addresses(&self) -> Result<(&str, &str), ParallelError> {
        let missing = |flag| ParallelError::Flag {
            flag,
            reason: "required with --nodes above 1",
        };
        Ok((
            self.orchestrator
                .as_deref()
                .ok_or_else(|| missing("--orchestrator"))?,
            self.data_address
                .as_deref()
                .ok_or_else(|| missing("--data-address"))?,
        ))
    }

    /// Checks the flags, and that the ports this node listens on are free, before any training.
    pub fn validate(&self, batch: usize) -> Result<(), ParallelError> {
        let setting = |flag, value: String, reason: String| ParallelError::Setting {
            flag,
            value,
            reason,
        };
        for (flag, value) in [("--peers", self.peers), ("--nodes", self.nodes)] {
            if value == 0 {
                return Err(setting(flag, "0".into(), "must be at least 1".into()));
            }
        }
        if !batch.is_multiple_of(self.replicas()) {
            return Err(setting(
                "--batch",
                batch.to_string(),
                format!(
                    "must be divisible by the {} replicas (--peers {} × --nodes {})",
                    self.replicas(),
                    self.peers,
                    self.nodes
                ),
            ));
        }
        if self.nodes == 1 {
            let stray = [
                ("--orchestrator", self.orchestrator.is_some()),
                ("--data-address", self.data_address.is_some()),
                ("--node-rank", self.rank != 0),
            ];
            if let Some((flag, _)) = stray.into_iter().find(|(_, given)| *given) {
                return Err(ParallelError::Flag {
                    flag,
                    reason: "only with --nodes above 1",
                });
            }
            return Ok(());
        }
        if self.rank >= self.nodes {
            return Err(setting(
                "--node-rank",
                self.rank.to_string(),
                format!("must be below --nodes {}", self.nodes),
            ));
        }
        let (orchestrator, data_address) = self.addresses()?;
        for (flag, address) in [
            ("--orchestrator", orchestrator),
            ("--data-address", data_address),
        ] {
            if address.contains("://") || address.to_socket_addrs().is_err() {
                return Err(setting(
                    flag,
                    address.into(),
                    "must be HOST:PORT, a host this machine can resolve".into(),
                ));
            }
        }
        port_free("data service", port_of("--data-address", data_address)?)?;
        if self.rank == 0 && !self.external_orchestrator {
            port_free("orchestrator", port_of("--orchestrator", orchestrator)?)?;
        }
        Ok(())
    }

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

/// Logs warnings and errors on stderr (`RUST_LOG` shows more), and reports a panic of the
/// collective's network tasks as one warning.
///
/// Installed before anything else: the collective's network layer otherwise installs its own
/// logger when it starts, at INFO on stdout, one line for every tensor it sends. Its tasks (the
/// only tokio tasks of this program) panic when a connection to another node breaks; the replica
/// waiting on them then fails with an error naming the node, so their backtraces are noise.
pub fn quiet_logging() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn"));
    // Fails only if a logger is already installed, which then stays.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if std::thread::current().name() == Some("tokio-rt-worker") {
            let message = panic_message(info.payload());
            let location = info
                .location()
                .map(|l| format!(" at {l}"))
                .unwrap_or_default();
            tracing::warn!("the collective's network task failed{location}: {message}");
        } else {
            default_hook(info);
        }
    }));
}

/// A panic's message, from its payload.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

/// Serves the collective's global orchestrator on `port` until the process ends.
pub fn run_orchestrator(port: u16) {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime")
        .block_on(collective::start_global_orchestrator(port));
}

/// Refuses a port taken by another program: the orchestrator and the data service would only log
/// it and leave the peers waiting.
pub fn port_free(what: &'static str, port: u16) -> Result<(), ParallelError> {
    TcpListener::bind(("0.0.0.0", port))
        .map(drop)
        .map_err(|source| ParallelError::PortInUse { what, port, source })
}

/// `node rank 1, 2`: the nodes other than `rank` of `nodes`.
fn other_nodes(nodes: usize, rank: usize) -> String {
    let others: Vec<String> = (0..nodes)
        .filter(|&other| other != rank)
        .map(|other| other.to_string())
        .collect();
    format!("node rank {}", others.join(", "))
}

fn port_of(flag: &'static str, address: &str) -> Result<u16, ParallelError> {
    address
        .rsplit_once(':')
        .and_then(|(_, port)| port.parse().ok())
        .ok_or_else(|| ParallelError::Setting {
            flag,
            value: address.into(),
            reason: "must end in :PORT".into(),
        })
}

/// One replica's link to the others: its peer id in the collective.
#[derive(Debug, Clone, Copy)]
pub struct Peer {
    /// Its index among all replicas (its share of each batch, its collective id).
    pub index: usize,
    /// The processes the replicas run in.
    nodes: usize,
    /// The rank of this one among them.
    rank: usize,
}

impl Peer {
    /// Joins the collective (every peer of every node must, before the first all-reduce).
    pub fn register<B: AutodiffBackend>(
        index: usize,
        topology: &Topology,
        device: &B::Device,
    ) -> Result<Self, ParallelError> {
        let peer = Self {
            index,
            nodes: topology.nodes,
            rank: topology.rank,
        };
        let config = topology.collective_config()?;
        collective::register::<B::InnerBackend>(peer.id(), device.clone(), config)
            .map_err(|e| peer.failed("register", e))?;
        Ok(peer)
    }

    fn id(self) -> PeerId {
        PeerId::from(self.index as u32)
    }

    fn failed(self, operation: &'static str, error: CollectiveError) -> ParallelError {
        // Across processes a broken connection to another node ends the collective's server (a
        // panic in its network task), or comes back as `PeerLost` (its error type is not
        // exported; the variant's name is in its debug form).
        let lost = match &error {
            CollectiveError::LocalServerMissing => true,
            CollectiveError::Global(global) => format!("{global:?}").starts_with("PeerLost"),
            _ => false,
        };
        if self.nodes > 1 && lost {
            return ParallelError::LostNode {
                peer: self.index,
                operation,
                nodes: other_nodes(self.nodes, self.rank),
            };
        }
        ParallelError::Collective {
            peer: self.index,
            operation,
            reason: format!("{error:?}"),
        }
    }

    /// The loss and the gradients averaged over all replicas, in one all-reduce.
    ///
    /// Every parameter's gradient is flattened into one vector in the order `model` visits its
    /// parameters (the same in every process running the same model; a parameter without a
    /// gradient counts as zeros), the loss appended, and the vector averaged: one round of
    /// messages per step instead of one per parameter, and nothing paired by `ParamId` (Burn
    /// draws those at random, so they differ between processes).
    pub fn mean_step<B: AutodiffBackend, M: AutodiffModule<B>>(
        self,
        model: &M,
        loss: f64,
        mut grads: GradientsParams,
        device: &B::Device,
    ) -> Result<(f64, GradientsParams), ParallelError> {
        let mut flatten = Flatten::<B> {
            grads: &mut grads,
            parts: Vec::new(),
            device: device.clone(),
        };
        model.visit(&mut flatten);
        let mut parts = flatten.parts;
        parts.push(Tensor::full([1], loss, device));
        let mean = self.mean(Tensor::cat(parts, 0), "all-reduce the loss and gradients")?;
        let length = mean.dims()[0];
        let loss = mean.clone().narrow(0, length - 1, 1).into_scalar().elem();
        model.visit(&mut Unflatten::<B> {
            mean,
            offset: 0,
            grads: &mut grads,
        });
        Ok((loss, grads))
    }

    /// Returns once every replica has called it: a replica that has finished its last
    /// all-reduce no longer needs the others.
    pub fn barrier<B: AutodiffBackend>(self, device: &B::Device) -> Result<(), ParallelError> {
        // One element per node: across nodes the collective's ring all-reduce splits a tensor
        // into one slice per node, and refuses a tensor smaller than that.
        let zeros = Tensor::<B::InnerBackend, 1>::zeros([self.nodes], device);
        self.mean(zeros, "wait for the others at the end").map(drop)
    }

    fn mean<B: Backend>(
        self,
        tensor: Tensor<B, 1>,
        operation: &'static str,
    ) -> Result<Tensor<B, 1>, ParallelError> {
        let mean = collective::all_reduce::<B>(
            self.id(),
            tensor.into_primitive().tensor(),
            ReduceOperation::Mean,
        )
        .map_err(|e| self.failed(operation, e))?;
        Ok(Tensor::from_primitive(TensorPrimitive::Float(mean)))
    }

    /// Leaves the collective.
    pub fn finish<B: AutodiffBackend>(self) -> Result<(), ParallelError> {
        collective::finish_collective::<B::InnerBackend>(self.id())
            .map_err(|e| self.failed("leave", e))
    }
}

/// Takes a step's gradients out of `grads` into flat parts, in the model's parameter order.
struct Flatten<'a, B: AutodiffBackend> {
    grads: &'a mut GradientsParams,
    parts: Vec<Tensor<B::InnerBackend, 1>>,
    device: B::Device,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Flatten<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let grad = self
            .grads
            .remove::<B::InnerBackend, D>(param.id)
            .unwrap_or_else(|| Tensor::zeros(param.val().shape(), &self.device));
        self.parts.push(grad.reshape([-1]));
    }
}

/// Puts the averaged gradients back into `grads`, in the order [`Flatten`] took them.
struct Unflatten<'a, B: AutodiffBackend> {
    mean: Tensor<B::InnerBackend, 1>,
    offset: usize,
    grads: &'a mut GradientsParams,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Unflatten<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let shape = param.val().shape();
        let length = shape.num_elements();
        let grad = self
            .mean
            .clone()
            .narrow(0, self.offset, length)
            .reshape(shape);
        self.grads.register::<B::InnerBackend, D>(param.id, grad);
        self.offset += length;
    }
}

/// Steps finished, as the replicas report them, for the watchdog.
#[derive(Debug)]
pub struct Heartbeat {
    step: AtomicUsize,
    at: Mutex<Instant>,
}

impl Heartbeat {
    /// Nothing finished yet; the clock starts now.
    pub fn new() -> Self {
        Self {
            step: AtomicUsize::new(0),
            at: Mutex::new(Instant::now()),
        }
    }

    /// A replica finished `step`.
    pub fn beat(&self, step: usize) {
        self.step.fetch_max(step, Ordering::Relaxed);
        *self.at.lock().expect("heartbeat lock") = Instant::now();
    }

    /// The last step finished, and how long ago.
    pub fn last(&self) -> (usize, Duration) {
        let at = *self.at.lock().expect("heartbeat lock");
        (self.step.load(Ordering::Relaxed), at.elapsed())
    }
}
