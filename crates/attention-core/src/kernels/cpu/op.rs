//! The CPU kernel as a Burn operation: tensors to host buffers and back, and on `Autodiff` a
//! graph node whose backward is the kernel's own (Burn would otherwise differentiate attention
//! through its `O(T²)` composite).
//!
//! Burn has no specialization, so the backends the kernel serves are recognised by type here, in
//! one place ([`kernel_entry`], from the one list in [`for_each_kernel_backend!`]), with or without
//! `Autodiff` and under every checkpointing strategy; every other backend keeps Burn's own
//! attention op.

use std::any::{Any, TypeId};
use std::marker::PhantomData;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::{
    BalancedCheckpointing, CheckpointStrategy, NoCheckpointing,
};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::{Autodiff, Flex, NdArray};
use burn::prelude::*;
use burn::tensor::{Bool, DType, Element, TensorData, TensorPrimitive};

use super::host_cache::{HostStorage, with_host_kv};
use super::kernel::{self, Dims, Forward, Inputs, KernelFloat};

/// The inputs of causal attention with the heads still side by side.
///
/// # Shapes
/// - `query`: `[batch, queries, heads · head_dim]`
/// - `key`, `value`: `[batch, keys, kv_heads · head_dim]`
/// - `key_padding`: `[batch, keys]`, `true` = padding
#[derive(Debug, Clone)]
pub(crate) struct FlashInputs<B: Backend> {
    pub query: Tensor<B, 3>,
    pub key: Tensor<B, 3>,
    pub value: Tensor<B, 3>,
    pub heads: usize,
    pub kv_heads: usize,
    pub window: Option<usize>,
    pub key_padding: Option<Tensor<B, 2, Bool>>,
}

/// The host backends the kernel runs on: adding a CPU backend to the kernel is one entry here.
macro_rules! for_each_kernel_backend {
    ($action:ident) => {
        $action!(NdArray<f32>);
        $action!(NdArray<f64>);
        $action!(Flex);
    };
}

/// The kernel's entry point for backend `B`, or `None` when `B` is not one it runs on: a host
/// backend of [`for_each_kernel_backend!`] directly, or `Autodiff` around one with either
/// checkpointing strategy.
fn kernel_entry<B: Backend>() -> Option<fn(FlashInputs<B>) -> Tensor<B, 3>> {
    let id = TypeId::of::<B>();
    macro_rules! recognise {
        ($inner:ty) => {
            if id == TypeId::of::<$inner>() {
                return Some(host_forward::<B>);
            }
            if id == TypeId::of::<Autodiff<$inner, NoCheckpointing>>() {
                return Some(on_autodiff::<B, $inner, NoCheckpointing>);
            }
            if id == TypeId::of::<Autodiff<$inner, BalancedCheckpointing>>() {
                return Some(on_autodiff::<B, $inner, BalancedCheckpointing>);
            }
        };
    }
    for_each_kernel_backend!(recognise);
    None
}

/// Whether [`causal_attention`] runs on backend `B`.
pub(crate) fn supports<B: Backend>() -> bool {
    kernel_entry::<B>().is_some()
}

/// Causal attention on the CPU kernel (see [`kernel::forward`]).
///
/// # Shapes
/// - output: `[batch, queries, heads · head_dim]`, the heads side by side
///
/// # Panics
/// When `B` is not one of the backends of [`supports`] (the route checks first).
pub(crate) fn causal_attention<B: Backend>(inputs: FlashInputs<B>) -> Tensor<B, 3> {
    let entry = kernel_entry::<B>().unwrap_or_else(|| {
        panic!(
            "the CPU attention kernel does not run on {}",
            std::any::type_name::<B>()
        )
    });
    entry(inputs)
}

/// `value` as the type it is known (by its `TypeId`) to be.
fn same_type<T: 'static, U: 'static>(value: T) -> U {
    *(Box::new(value) as Box<dyn Any>)
        .downcast::<U>()
        .expect("the caller checked the type")
}

/// The kernel's forward pass as a plain function of host data.
fn host_forward<B: Backend>(inputs: FlashInputs<B>) -> Tensor<B, 3> {
    fn run<B: Backend, E: HostFloat>(inputs: FlashInputs<B>) -> Tensor<B, 3> {
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
fn on_autodiff<B: Backend, I: Backend, C: CheckpointStrategy>(
    inputs: FlashInputs<B>,
) -> Tensor<B, 3> {
    let inputs: FlashInputs<Autodiff<I, C>> = same_type(inputs);
    let output = match inputs.query.dtype() {
        DType::F64 => tracked::<I, C, f64>(inputs),
        _ => tracked::<I, C, f32>(inputs),
    };
    same_type(output)
}

/// The kernel's forward pass on `I`'s data, recorded as one graph node whose backward is
/// [`kernel::backward`]. The nodes are taken before the data so that burn-ndarray can hand the
/// buffers over without copying.
fn tracked<I: Backend, C: CheckpointStrategy, E: HostFloat>(
    inputs: FlashInputs<Autodiff<I, C>>,
) -> Tensor<Autodiff<I, C>, 3> {
    let device = inputs.query.device();
    let [query, key, value] =
        [inputs.query, inputs.key, inputs.value].map(|tensor| tensor.into_primitive().tensor());
    let nodes = [&query, &key, &value].map(|tensor| tensor.node.clone());
    let [query, key, value] = [query, key, value]
        .map(|tensor| Tensor::<I, 3>::from_primitive(TensorPrimitive::Float(tensor.primitive)));
    let host = Host::<E>::download(FlashInputs {
        query,
        key,
        value,
        heads: inputs.heads,
        kv_heads: inputs.kv_heads,
        window: inputs.window,
        key_padding: inputs
            .key_padding
            .map(|mask| Tensor::from_primitive(mask.into_primitive())),
    });
    let forward = kernel::forward(host.inputs());
    let output = upload::<I, E>(forward.output.clone(), host.query_shape(), &device)
        .into_primitive()
        .tensor();
    let output = match FlashBackward::<E>(PhantomData)
        .prepare::<C>(nodes)
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(
            Saved {
                host,
                forward,
                device,
            },
            output,
        ),
        OpsKind::UnTracked(prep) => prep.finish(output),
    };
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
    element: PhantomData<E>,
}

impl<E: HostFloat> Host<E> {
    /// Takes the tensors by value: burn-ndarray and burn-flex hand over a tensor's buffer without
    /// copying when nothing else holds it (and copy otherwise). The data is kept as it came and
    /// read in place: turning it into a `Vec<E>` would copy it again wherever the backend's
    /// allocation is aligned beyond `E` (burn-flex's).
    fn download<B: Backend>(inputs: FlashInputs<B>) -> Self {
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
            element: PhantomData,
        }
    }

    fn inputs(&self) -> Inputs<'_, E> {
        fn floats<E: HostFloat>(data: &TensorData) -> &[E] {
            data.as_slice().expect("converted to E")
        }
        let buffers = [&self.query, &self.key, &self.value].map(floats::<E>);
        Inputs::packed(self.dims, buffers, self.key_padding.as_deref())
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

impl<I: Backend, E: HostFloat> Backward<I, 3> for FlashBackward<E> {
    type State = Saved<E, I::Device>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
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
        let [query, key, value] = ops.parents;
        let inputs = [
            (query, gradients.query, host.query_shape()),
            (key, gradients.key, host.key_shape()),
            (value, gradients.value, host.key_shape()),
        ];
        for (node, gradient, shape) in inputs {
            if let Some(node) = node {
                let gradient = upload::<I, E>(gradient, shape, &device);
                grads.register::<I>(node.id, gradient.into_primitive().tensor());
            }
        }
    }
}

/// Whether the kernel reads `B`'s data in place between calls: a host backend of
/// [`for_each_kernel_backend!`] without `Autodiff`. The cached path keeps its keys and values in
/// host memory for those ([`HostStorage`]).
pub(crate) fn keeps_host_cache<B: Backend>() -> bool {
    let id = TypeId::of::<B>();
    let mut found = false;
    macro_rules! recognise {
        ($inner:ty) => {
            found |= id == TypeId::of::<$inner>();
        };
    }
    for_each_kernel_backend!(recognise);
    found
}

/// The inputs of a cached call on the kernel: the new queries, and the keys and values of a
/// cache in host memory.
///
/// # Shapes
/// - `query`: `[batch, queries, heads · head_dim]`
/// - `cache`: `[batch, allocated, kv_heads · head_dim]`, positions `key_rows.first ..
///   key_rows.first + keys` seen by this call's queries (the last of them the queries' own)
/// - `key_padding`: `[batch, keys]`, `true` = padding
pub(crate) struct CachedInputs<'a, B: Backend> {
    pub query: Tensor<B, 3>,
    pub cache: &'a HostStorage,
    pub key_rows: kernel::KeyRows,
    pub keys: usize,
    pub heads: usize,
    pub window: Option<usize>,
    pub key_padding: Option<Tensor<B, 2, Bool>>,
}

/// Causal attention of new queries over a host cache on the CPU kernel.
///
/// # Shapes
/// - output: `[batch, queries, heads · head_dim]`
pub(crate) fn cached_attention<B: Backend>(inputs: CachedInputs<B>) -> Tensor<B, 3> {
    let device = inputs.query.device();
    let [batch, queries, width] = inputs.query.dims();
    let query = inputs.query.into_data();
    let key_padding: Option<Vec<bool>> = inputs
        .key_padding
        .map(|mask| mask.into_data().iter::<bool>().collect());
    with_host_kv!(inputs.cache, kv => {
        let query = query.convert_dtype(element_dtype(&kv.keys));
        let query_floats = query.as_slice().expect("converted to the cache's precision");
        let head_dim = width / inputs.heads;
        let dims = Dims {
            batch,
            heads: inputs.heads,
            kv_heads: kv.row / head_dim,
            queries,
            keys: inputs.keys,
            head_dim,
            window: inputs.window,
        };
        let forward = kernel::forward(Inputs {
            dims,
            query: query_floats,
            key: &kv.keys,
            value: &kv.values,
            key_rows: inputs.key_rows,
            key_padding: key_padding.as_deref(),
        });
        Tensor::from_data(TensorData::new(forward.output, [batch, queries, width]), &device)
    })
}

/// The dtype of `E`, read off a buffer of it.
fn element_dtype<E: Element>(_: &[E]) -> DType {
    E::dtype()
}
