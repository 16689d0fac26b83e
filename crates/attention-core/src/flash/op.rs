//! The CPU kernel as a Burn operation: tensors to host buffers and back, and on `Autodiff` a
//! graph node whose backward is the kernel's own (Burn would otherwise differentiate attention
//! through its `O(T²)` composite).
//!
//! Burn has no specialization, so the backends the kernel serves are recognised by type here, in
//! one place ([`supports`]); every other backend keeps Burn's own attention op.

use std::any::{Any, TypeId};
use std::marker::PhantomData;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::{Autodiff, Flex, NdArray};
use burn::prelude::*;
use burn::tensor::{Bool, DType, Element, TensorData, TensorPrimitive};

use super::kernel::{self, Dims, Forward, Inputs, KernelFloat};

/// The inputs of causal attention with the heads still side by side.
///
/// # Shapes
/// - `query`: `[batch, queries, heads · head_dim]`
/// - `key`, `value`: `[batch, keys, heads · head_dim]`
/// - `key_padding`: `[batch, keys]`, `true` = padding
#[derive(Debug, Clone)]
pub(crate) struct FlashInputs<B: Backend> {
    pub query: Tensor<B, 3>,
    pub key: Tensor<B, 3>,
    pub value: Tensor<B, 3>,
    pub heads: usize,
    pub key_padding: Option<Tensor<B, 2, Bool>>,
}

/// Whether [`causal_attention`] runs on backend `B`: ndarray (f32, f64) and burn-flex, with or
/// without `Autodiff` (with its default checkpointing).
pub(crate) fn supports<B: Backend>() -> bool {
    host_backend::<B>() || autodiff_backend::<B>()
}

/// Backends whose tensors live in host memory.
fn host_backend<B: Backend>() -> bool {
    [
        TypeId::of::<NdArray<f32>>(),
        TypeId::of::<NdArray<f64>>(),
        TypeId::of::<Flex>(),
    ]
    .contains(&TypeId::of::<B>())
}

fn autodiff_backend<B: Backend>() -> bool {
    [
        TypeId::of::<Autodiff<NdArray<f32>>>(),
        TypeId::of::<Autodiff<NdArray<f64>>>(),
        TypeId::of::<Autodiff<Flex>>(),
    ]
    .contains(&TypeId::of::<B>())
}

/// Causal attention on the CPU kernel (see [`kernel::forward`]).
///
/// # Shapes
/// - output: `[batch, queries, heads · head_dim]`, the heads side by side
///
/// # Panics
/// When `B` is not one of the backends of [`supports`].
pub(crate) fn causal_attention<B: Backend>(inputs: FlashInputs<B>) -> Tensor<B, 3> {
    let id = TypeId::of::<B>();
    if host_backend::<B>() {
        host_forward::<B>(inputs)
    } else if id == TypeId::of::<Autodiff<NdArray<f32>>>() {
        on_autodiff::<B, NdArray<f32>>(inputs)
    } else if id == TypeId::of::<Autodiff<NdArray<f64>>>() {
        on_autodiff::<B, NdArray<f64>>(inputs)
    } else if id == TypeId::of::<Autodiff<Flex>>() {
        on_autodiff::<B, Flex>(inputs)
    } else {
        panic!(
            "the CPU attention kernel does not run on {}",
            std::any::type_name::<B>()
        )
    }
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

/// `B` is `Autodiff<I>`: run the kernel on the data and record a node with its backward.
fn on_autodiff<B: Backend, I: Backend>(inputs: FlashInputs<B>) -> Tensor<B, 3> {
    let inputs: FlashInputs<Autodiff<I>> = same_type(inputs);
    let output = match inputs.query.dtype() {
        DType::F64 => tracked::<I, f64>(inputs),
        _ => tracked::<I, f32>(inputs),
    };
    same_type(output)
}

/// The kernel's forward pass on `I`'s data, recorded as one graph node whose backward is
/// [`kernel::backward`]. The nodes are taken before the data so that burn-ndarray can hand the
/// buffers over without copying.
fn tracked<I: Backend, E: HostFloat>(inputs: FlashInputs<Autodiff<I>>) -> Tensor<Autodiff<I>, 3> {
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
        key_padding: inputs
            .key_padding
            .map(|mask| Tensor::from_primitive(mask.into_primitive())),
    });
    let forward = kernel::forward(host.inputs());
    let output = upload::<I, E>(forward.output.clone(), host.query_shape(), &device)
        .into_primitive()
        .tensor();
    let output = match FlashBackward::<E>(PhantomData)
        .prepare::<NoCheckpointing>(nodes)
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

/// The inputs, copied to host memory.
#[derive(Debug, Clone)]
struct Host<E> {
    dims: Dims,
    query: Vec<E>,
    key: Vec<E>,
    value: Vec<E>,
    key_padding: Option<Vec<bool>>,
}

impl<E: HostFloat> Host<E> {
    /// Takes the tensors by value: burn-ndarray hands over a tensor's buffer without copying only
    /// when nothing else holds it, and copies element by element (10× slower) otherwise.
    fn download<B: Backend>(inputs: FlashInputs<B>) -> Self {
        let [batch, queries, width] = inputs.query.dims();
        let keys = inputs.key.dims()[1];
        let floats = |tensor: Tensor<B, 3>| -> Vec<E> {
            tensor
                .into_data()
                .convert::<E>()
                .into_vec()
                .expect("converted to E")
        };
        Self {
            dims: Dims {
                batch,
                heads: inputs.heads,
                queries,
                keys,
                head_dim: width / inputs.heads,
            },
            query: floats(inputs.query),
            key: floats(inputs.key),
            value: floats(inputs.value),
            key_padding: inputs
                .key_padding
                .map(|mask| mask.into_data().iter::<bool>().collect()),
        }
    }

    fn inputs(&self) -> Inputs<'_, E> {
        Inputs {
            dims: self.dims,
            query: &self.query,
            key: &self.key,
            value: &self.value,
            key_padding: self.key_padding.as_deref(),
        }
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
        let [batch, _, width] = self.query_shape();
        [batch, self.dims.keys, width]
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
