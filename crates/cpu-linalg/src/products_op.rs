//! The projections' products under `Autodiff`: the forward on [`products`] over the inner
//! backend's buffers, one graph node per product whose backward is three more of them —
//! `dx = dy · Wᵀ`, `dW = xᵀ · dy` (both operands read in place, transposed), `db = Σ dy`.
//!
//! Burn's `Linear` under `Autodiff` on burn-flex and burn-ndarray runs a training step's
//! products per batch row and its weight gradient as one product per batch row, summed after;
//! here each is one product over the whole batch (`linear-grad-rate` times both; BENCHMARKS.md).

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::prelude::*;
use burn::tensor::TensorPrimitive;
use burn::tensor::ops::FloatTensor;

use crate::host_matrix::HostBackend;
use crate::packed::PackedWeightsCache;
use crate::products::{Packing, WeightAndBias, products};

/// [`products`] of `x` and `N` weights under `Autodiff`, on the inner backend's buffers, each
/// output recorded with its backward; `None` (nothing recorded) where the products do not take
/// the operands.
///
/// # Shapes
/// - `x`: `[..., in]`; each weight `[in, out_i]`, each bias `[out_i]`
/// - outputs: `[..., out_i]`
pub(crate) fn tracked_products<
    I: HostBackend,
    C: CheckpointStrategy,
    const D: usize,
    const N: usize,
>(
    x: &Tensor<Autodiff<I, C>, D>,
    weights: [WeightAndBias<'_, Autodiff<I, C>>; N],
    cache: &PackedWeightsCache,
) -> Option<[Tensor<Autodiff<I, C>, D>; N]> {
    let x = Tracked::<I, C, D>::of(x);
    let weights = weights.map(|(weight, bias)| {
        let bias = bias.map(Tracked::<I, C, 1>::of);
        (Tracked::<I, C, 2>::of(weight), bias)
    });
    let outputs = products(
        &x.inner,
        weights
            .each_ref()
            .map(|(weight, bias)| (&weight.inner, bias.as_ref().map(|bias| &bias.inner))),
        Packing::FewRowsOnly(cache),
    )?;
    let mut weights = weights.into_iter();
    Some(outputs.map(|output| {
        let (weight, bias) = weights.next().expect("one weight per output");
        let saved = Saved {
            x: x.inner.clone(),
            weight: weight.inner,
        };
        let output = output.into_primitive().tensor();
        let output = match bias {
            Some(bias) => {
                record::<I, C, D, 3>([&x.tensor, &weight.tensor, &bias.tensor], saved, output)
            }
            None => record::<I, C, D, 2>([&x.tensor, &weight.tensor], saved, output),
        };
        Tensor::<Autodiff<I, C>, D>::from_primitive(TensorPrimitive::Float(output))
    }))
}

/// An `Autodiff<I, C>` tensor, and its inner backend's tensor (the same buffer).
struct Tracked<I: Backend, C: CheckpointStrategy, const D: usize> {
    tensor: FloatTensor<Autodiff<I, C>>,
    inner: Tensor<I, D>,
}

impl<I: Backend, C: CheckpointStrategy, const D: usize> Tracked<I, C, D> {
    /// `tensor` and its inner tensor.
    fn of(tensor: &Tensor<Autodiff<I, C>, D>) -> Self {
        let tensor: FloatTensor<Autodiff<I, C>> = tensor.clone().into_primitive().tensor();
        let inner = Tensor::from_primitive(TensorPrimitive::Float(tensor.primitive.clone()));
        Self { tensor, inner }
    }
}

/// `output` as a node whose parents are `parents`' nodes (input, weight and, where there is
/// one, bias) and whose backward is [`ProductBackward`]; untracked when no parent requires a
/// gradient.
fn record<I: HostBackend, C: CheckpointStrategy, const D: usize, const N: usize>(
    parents: [&FloatTensor<Autodiff<I, C>>; N],
    saved: Saved<I, D>,
    output: FloatTensor<I>,
) -> FloatTensor<Autodiff<I, C>> {
    match ProductBackward::<D>
        .prepare::<C>(parents.map(|parent| parent.node.clone()))
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(saved, output),
        OpsKind::UnTracked(prep) => prep.finish(output),
    }
}

/// The backward of one product, `x · weight (+ bias)`.
#[derive(Debug)]
struct ProductBackward<const D: usize>;

/// The forward's operands (the inner backend's tensors: shared buffers, not copies).
#[derive(Debug, Clone)]
struct Saved<I: Backend, const D: usize> {
    /// `[..., in]`
    x: Tensor<I, D>,
    /// `[in, out]`
    weight: Tensor<I, 2>,
}

impl<I: HostBackend, const D: usize, const N: usize> Backward<I, N> for ProductBackward<D> {
    type State = Saved<I, D>;

    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _: &mut Checkpointer) {
        let Saved { x, weight } = ops.state;
        let output_grad =
            Tensor::<I, D>::from_primitive(TensorPrimitive::Float(grads.consume::<I>(&ops.node)));
        let [inputs, outputs] = weight.dims();
        let rows = x.shape().num_elements() / inputs;
        // The parents in order: input, weight, then the bias where there is one.
        let mut parents = ops.parents.into_iter();
        if let Some(node) = parents.next().flatten() {
            let x_grad = product(&output_grad, weight.transpose());
            grads.register::<I>(node.id, x_grad.into_primitive().tensor());
        }
        let output_grad = output_grad.reshape([rows, outputs]);
        if let Some(node) = parents.next().flatten() {
            let x = x.reshape([rows, inputs]);
            let weight_grad = product(&x.transpose(), output_grad.clone());
            grads.register::<I>(node.id, weight_grad.into_primitive().tensor());
        }
        if let Some(node) = parents.next().flatten() {
            let bias_grad = output_grad.sum_dim(0).squeeze_dim::<1>(0);
            grads.register::<I>(node.id, bias_grad.into_primitive().tensor());
        }
    }
}

/// `a · b` on [`products`], or Burn's matmul where they do not take it.
fn product<I: HostBackend, const D: usize>(a: &Tensor<I, D>, b: Tensor<I, 2>) -> Tensor<I, D> {
    match products(a, [(&b, None)], Packing::Never) {
        Some([product]) => product,
        None => a.clone().matmul(b.unsqueeze()),
    }
}
