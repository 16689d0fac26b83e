//! Data-parallel replicas on Burn's collective engine: where each replica runs (threads of this
//! process, processes on other machines), their gradients averaged by the collective's
//! all-reduce, and the watchdog the collective lacks (a wait on a peer that died never ends).

use std::net::{TcpListener, ToSocketAddrs};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use burn::collective::{self, CollectiveConfig, PeerId, ReduceOperation};
use burn::module::{ModuleMapper, Param, ParamId};
use burn::optim::GradientsParams;
use burn::prelude::*;
use burn::tensor::TensorPrimitive;
use burn::tensor::backend::AutodiffBackend;
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
            let others: Vec<String> = (0..self.nodes)
                .filter(|&rank| rank != self.rank)
                .map(|rank| rank.to_string())
                .collect();
            format!("node rank {}", others.join(", "))
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
        // Not the default ring: it splits every tensor into one slice per node and refuses
        // smaller ones (the loss, a scalar; a width-1 bias).
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
        };
        let config = topology.collective_config()?;
        collective::register::<B::InnerBackend>(peer.id(), device.clone(), config)
            .map_err(|e| peer.failed("register", e))?;
        Ok(peer)
    }

    fn id(self) -> PeerId {
        PeerId::from(self.index as u32)
    }

    fn failed(self, operation: &'static str, error: impl std::fmt::Debug) -> ParallelError {
        ParallelError::Collective {
            peer: self.index,
            operation,
            reason: format!("{error:?}"),
        }
    }

    /// The mean of `loss` over all replicas.
    pub fn mean_loss<B: AutodiffBackend>(
        self,
        loss: f64,
        device: &B::Device,
    ) -> Result<f64, ParallelError> {
        // One copy per node: across nodes the collective's ring all-reduce splits a tensor into
        // one slice per node, and refuses a tensor smaller than that.
        let copies = vec![loss; self.nodes];
        let tensor = Tensor::<B::InnerBackend, 1>::from_floats(copies.as_slice(), device);
        let mean = collective::all_reduce::<B::InnerBackend>(
            self.id(),
            tensor.into_primitive().tensor(),
            ReduceOperation::Mean,
        )
        .map_err(|e| self.failed("all-reduce the loss", e))?;
        let mean = Tensor::<B::InnerBackend, 1>::from_primitive(TensorPrimitive::Float(mean));
        Ok(mean.narrow(0, 0, 1).into_scalar().elem())
    }

    /// The gradients averaged over all replicas.
    pub fn mean_gradients<B: AutodiffBackend>(
        self,
        grads: GradientsParams,
    ) -> Result<GradientsParams, ParallelError> {
        grads
            .all_reduce::<B::InnerBackend>(self.id(), ReduceOperation::Mean)
            .map_err(|e| self.failed("all-reduce the gradients", e))
    }

    /// Returns once every replica has called it: a replica that has finished its last
    /// all-reduce no longer needs the others.
    pub fn barrier<B: AutodiffBackend>(self, device: &B::Device) -> Result<(), ParallelError> {
        self.mean_loss::<B>(0.0, device).map(drop)
    }

    /// Leaves the collective.
    pub fn finish<B: AutodiffBackend>(self) -> Result<(), ParallelError> {
        collective::finish_collective::<B::InnerBackend>(self.id())
            .map_err(|e| self.failed("leave", e))
    }
}

/// Numbers a module's parameters in the order they are visited.
///
/// `GradientsParams::all_reduce` reduces the gradients in the order of their `ParamId`s, and
/// Burn draws those at random: two processes initialising the same model from the same seed get
/// the same values but different ids, so they would average different parameters with each other
/// (silently, where two have the same shape). Ids from the parameters' order make the order
/// the same everywhere.
pub struct NumberParameters {
    next: u64,
}

impl NumberParameters {
    /// `module` with parameter ids `0, 1, 2, …` in visiting order.
    pub fn apply<B: Backend, M: Module<B>>(module: M) -> M {
        module.map(&mut Self { next: 0 })
    }
}

impl<B: Backend> ModuleMapper<B> for NumberParameters {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (_, tensor, mapper) = param.consume();
        let id = ParamId::from(self.next);
        self.next += 1;
        Param::from_mapped_value(id, tensor, mapper)
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
