//! One replica's link to the others through the collective: joining it, the one all-reduce of
//! each step (the loss and the gradients together), the barrier at the end, and leaving it.

use burn::collective::{self, CollectiveConfig, CollectiveError, PeerId, ReduceOperation};
use burn::module::AutodiffModule;
use burn::optim::GradientsParams;
use burn::prelude::*;
use burn::tensor::TensorPrimitive;
use burn::tensor::backend::AutodiffBackend;

use super::error::ParallelError;
use super::flags::port_of;
use super::gradients;
use super::topology::{Topology, other_nodes};

impl Topology {
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
        let mut parts = gradients::flatten::<B, M>(model, &mut grads, device);
        parts.push(Tensor::full([1], loss, device));
        let mean = self.mean(Tensor::cat(parts, 0), "all-reduce the loss and gradients")?;
        let length = mean.dims()[0];
        let loss = mean.clone().narrow(0, length - 1, 1).into_scalar().elem();
        gradients::unflatten::<B, M>(model, mean, &mut grads);
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
