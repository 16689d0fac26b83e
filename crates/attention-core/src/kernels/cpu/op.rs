//! The CPU kernel as a Burn operation: tensors to host buffers and back, and on `Autodiff` a
//! graph node whose backward is the kernel's own (Burn would otherwise differentiate attention
//! through its `O(T²)` composite). Which backends reach it is decided in [`crate::kernels`].

use std::marker::PhantomData;
use std::ops::Range;

use burn::backend::Autodiff;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops};
use burn::prelude::*;
use burn::tensor::{Bool, DType, Element, TensorData, TensorPrimitive};

use super::host_cache::{HostKv, HostStorage, Stored, with_host_kv};
use super::kernel::{self, Dims, Forward, Inputs, KernelFloat, Scoring};
use crate::kernels::inputs::KernelInputs;
use crate::kernels::{CachedInputs, KvStorage, same_type};
use crate::score_rule::{ScoreRule, scale_for};

/// The kernel's forward pass as a plain function of host data (on any backend: `Bare`, which `B`
/// is, is not needed).
// `Bare`: the signature every kernel's entry has in the list of `kernels/backends.rs`.
#[allow(clippy::extra_unused_type_parameters)]
pub(crate) fn forward<B: Backend, Bare>(inputs: KernelInputs<B>) -> Tensor<B, 3> {
    fn run<B: Backend, E: HostFloat>(inputs: KernelInputs<B>) -> Tensor<B, 3> {
        let device = inputs.query.device();
        let host = Host::<E>::download(inputs);
        let forward = kernel::forward(host.inputs());
        upload(forward.output, host.query_shape(), &device)
    }
    match inputs.query.dtype() {
        DType::F64 => run::<B, f64>(inputs),
        _ => run::<B, f32>(inputs),
    }
}

/// `B` is `Autodiff<I, C>`: run the kernel on the data and record a node with its backward.
pub(crate) fn on_autodiff<B: Backend, I: Backend, C: CheckpointStrategy>(
    inputs: KernelInputs<B>,
) -> Tensor<B, 3> {
    let inputs: KernelInputs<Autodiff<I, C>> = same_type(inputs);
    let output = match inputs.query.dtype() {
        DType::F64 => tracked::<I, C, f64>(inputs),
        _ => tracked::<I, C, f32>(inputs),
    };
    same_type(output)
}

/// The kernel's forward pass on `I`'s data, recorded as one graph node whose backward is
/// [`kernel::backward`]; its parents are the query, key and value, and the sinks where the layer
/// has them. The nodes are taken before the data so that burn-ndarray can hand the buffers over
/// without copying.
fn tracked<I: Backend, C: CheckpointStrategy, E: HostFloat>(
    inputs: KernelInputs<Autodiff<I, C>>,
) -> Tensor<Autodiff<I, C>, 3> {
    let device = inputs.query.device();
    let (inputs, nodes, sinks_node): (KernelInputs<I>, _, _) = untracked_kernel_inputs!(inputs);
    let host = Host::<E>::download(inputs);
    let forward = kernel::forward(host.inputs());
    let output = upload::<I, E>(forward.output.clone(), host.query_shape(), &device)
        .into_primitive()
        .tensor();
    let saved = Saved {
        host,
        forward,
        device,
    };
    let backward = FlashBackward::<E>(PhantomData);
    let output = record_kernel_node!(backward, C, nodes, sinks_node, saved, output);
    Tensor::from_primitive(TensorPrimitive::Float(output))
}

/// The float types the kernel runs in, as Burn elements.
trait HostFloat: KernelFloat + Element {}
impl<E: KernelFloat + Element> HostFloat for E {}

/// The inputs in host memory, as `E`.
#[derive(Debug, Clone)]
struct Host<E> {
    dims: Dims,
    query: TensorData,
    key: TensorData,
    value: TensorData,
    key_padding: Option<Vec<bool>>,
    /// Each position's document, `[batch, keys, 2]` (see [`Inputs::documents`]).
    documents: Option<Vec<u32>>,
    scale: f64,
    softcap: Option<f64>,
    /// `[heads]`
    sinks: Option<TensorData>,
    element: PhantomData<E>,
}

impl<E: HostFloat> Host<E> {
    /// Takes the tensors by value: burn-ndarray and burn-flex hand over a tensor's buffer without
    /// copying when nothing else holds it (and copy otherwise). The data is kept as it came and
    /// read in place: turning it into a `Vec<E>` would copy it again wherever the backend's
    /// allocation is aligned beyond `E` (burn-flex's).
    fn download<B: Backend>(inputs: KernelInputs<B>) -> Self {
        let [batch, queries, width] = inputs.query.dims();
        let keys = inputs.key.dims()[1];
        let floats = |tensor: Tensor<B, 3>| tensor.into_data().convert::<E>();
        Self {
            dims: Dims {
                batch,
                heads: inputs.heads,
                kv_heads: inputs.kv_heads,
                queries,
                keys,
                head_dim: width / inputs.heads,
                window: inputs.window,
            },
            query: floats(inputs.query),
            key: floats(inputs.key),
            value: floats(inputs.value),
            key_padding: inputs
                .key_padding
                .map(|mask| mask.into_data().iter::<bool>().collect()),
            documents: inputs.documents.as_ref().map(|documents| documents.spans()),
            scale: inputs.scores.scale_for(width / inputs.heads),
            softcap: inputs.scores.softcap,
            sinks: inputs
                .scores
                .sinks
                .map(|sinks| sinks.into_data().convert::<E>()),
            element: PhantomData,
        }
    }

    fn inputs(&self) -> Inputs<'_, E> {
        fn floats<E: HostFloat>(data: &TensorData) -> &[E] {
            data.as_slice().expect("converted to E")
        }
        let buffers = [&self.query, &self.key, &self.value].map(floats::<E>);
        Inputs::packed(self.dims, buffers, self.key_padding.as_deref())
            .with_scoring(scoring(
                self.scale,
                self.softcap,
                self.sinks.as_ref().map(floats::<E>),
            ))
            .with_documents(self.documents.as_deref())
    }

    fn query_shape(&self) -> [usize; 3] {
        let Dims {
            batch,
            queries,
            heads,
            head_dim,
            ..
        } = self.dims;
        [batch, queries, heads * head_dim]
    }

    fn key_shape(&self) -> [usize; 3] {
        let Dims {
            batch,
            keys,
            kv_heads,
            head_dim,
            ..
        } = self.dims;
        [batch, keys, kv_heads * head_dim]
    }
}

/// The kernel's [`Scoring`] in `E`.
pub(super) fn scoring<E: KernelFloat>(
    scale: f64,
    softcap: Option<f64>,
    sinks: Option<&[E]>,
) -> Scoring<'_, E> {
    let float = |x: f64| E::from(x).expect("a float converts");
    Scoring {
        scale: float(scale),
        softcap: softcap.map(float),
        sinks,
    }
}

fn upload<B: Backend, E: HostFloat>(
    data: Vec<E>,
    shape: [usize; 3],
    device: &B::Device,
) -> Tensor<B, 3> {
    Tensor::from_data(TensorData::new(data, shape), device)
}

/// The backward pass of [`on_autodiff`]'s node.
#[derive(Debug)]
struct FlashBackward<E>(PhantomData<E>);

/// What the backward pass needs: the inputs and the forward's output and log-sum-exp, all
/// `O(seq)` — the attention weights are rebuilt block by block.
#[derive(Debug, Clone)]
struct Saved<E, D> {
    host: Host<E>,
    forward: Forward<E>,
    device: D,
}

impl<I: Backend, E: HostFloat, const N: usize> Backward<I, N> for FlashBackward<E> {
    type State = Saved<E, I::Device>;

    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _: &mut Checkpointer) {
        let Saved {
            host,
            forward,
            device,
        } = ops.state;
        let output_grad =
            Tensor::<I, 3>::from_primitive(TensorPrimitive::Float(grads.consume::<I>(&ops.node)))
                .into_data()
                .convert::<E>()
                .into_vec::<E>()
                .expect("converted to E");
        let gradients = kernel::backward(host.inputs(), &forward, &output_grad);
        let register = |grads: &mut Gradients, id: NodeId, gradient: Tensor<I, 3>| {
            grads.register::<I>(id, gradient.into_primitive().tensor());
        };
        // The parents in order: query, key, value, then the sinks if the layer has them.
        let [query, key, value] = [
            (gradients.query, host.query_shape()),
            (gradients.key, host.key_shape()),
            (gradients.value, host.key_shape()),
        ];
        let mut parents = ops.parents.into_iter();
        for (gradient, shape) in [query, key, value] {
            if let Some(node) = parents.next().flatten() {
                register(grads, node.id, upload::<I, E>(gradient, shape, &device));
            }
        }
        if let (Some(node), Some(gradient)) = (parents.next().flatten(), gradients.sinks) {
            let heads = [gradient.len()];
            let gradient = Tensor::<I, 1>::from_data(TensorData::new(gradient, heads), &device);
            grads.register::<I>(node.id, gradient.into_primitive().tensor());
        }
    }
}

/// Ends a layer's decoding step: the CPU backends compute eagerly, a step has nothing queued
/// (`Bare`, which `B` is, is the kernel list's entry shape).
#[allow(clippy::extra_unused_type_parameters)]
pub(crate) fn end_step<B: Backend, Bare>(_: &B::Device) {}

/// A decoding step over a cache in host memory (`Bare`, which `B` is, is not needed).
#[allow(clippy::extra_unused_type_parameters)]
pub(crate) fn cached<B: Backend, Bare>(inputs: CachedInputs<'_, B>) -> Tensor<B, 3> {
    let KvStorage::CpuHost(cache) = inputs.cache else {
        unreachable!("a CPU kernel step is appended to host storage")
    };
    cached_step(CachedStep {
        query: inputs.query,
        cache,
        seen: inputs.seen,
        heads: inputs.heads,
        window: inputs.window,
        key_padding: inputs.key_padding,
        scores: inputs.scores,
    })
}

/// A decoding step on the CPU kernel: the new queries, and the keys and values of a cache in
/// host memory.
///
/// # Shapes
/// - `query`: `[batch, queries, heads · head_dim]`
/// - `cache`: `[batch, kv_heads, allocated, head_dim]`, slots `seen` seen by this step's
///   queries (the last of them the queries' own)
/// - `key_padding`: `[batch, seen.len()]`, `true` = padding
struct CachedStep<'a, B: Backend> {
    pub query: Tensor<B, 3>,
    pub cache: &'a HostStorage,
    pub seen: Range<usize>,
    pub heads: usize,
    pub window: Option<usize>,
    pub key_padding: Option<Tensor<B, 2, Bool>>,
    pub scores: ScoreRule<B>,
}

/// Causal attention of new queries over a host cache on the CPU kernel.
///
/// # Shapes
/// - output: `[batch, queries, heads · head_dim]`
fn cached_step<B: Backend>(inputs: CachedStep<'_, B>) -> Tensor<B, 3> {
    fn run<B: Backend, S: Stored>(inputs: CachedStep<'_, B>, kv: &HostKv<S>) -> Tensor<B, 3> {
        let device = inputs.query.device();
        let [batch, queries, width] = inputs.query.dims();
        let query = inputs.query.into_data().convert::<S::Compute>();
        let key_padding: Option<Vec<bool>> = inputs
            .key_padding
            .map(|mask| mask.into_data().iter::<bool>().collect());
        let ScoreRule {
            scale,
            softcap,
            sinks,
        } = inputs.scores;
        let sinks: Option<Vec<S::Compute>> = sinks.map(|sinks| {
            sinks
                .into_data()
                .convert::<S::Compute>()
                .into_vec()
                .expect("converted to the cache's precision")
        });
        let head_dim = width / inputs.heads;
        assert_eq!(
            head_dim, kv.head_dim,
            "the queries' and the cache's head size"
        );
        let dims = Dims {
            batch,
            heads: inputs.heads,
            kv_heads: kv.kv_heads,
            queries,
            keys: inputs.seen.len(),
            head_dim,
            window: inputs.window,
        };
        let [key, value] = kv.buffers();
        let forward = kernel::forward(Inputs {
            dims,
            query: query
                .as_slice()
                .expect("converted to the cache's precision"),
            key,
            value,
            key_rows: kernel::KeyRows::Rows {
                first: inputs.seen.start,
                per_sequence: kv.allocated,
                head_major: true,
            },
            key_padding: key_padding.as_deref(),
            documents: None,
            scoring: scoring(scale_for(scale, head_dim), softcap, sinks.as_deref()),
        });
        Tensor::from_data(
            TensorData::new(forward.output, [batch, queries, width]),
            &device,
        )
    }
    with_host_kv!(inputs.cache, kv => run(inputs, kv))
}
