//! A layer's parameter gradients after `backward`, as [`AttentionParams`] (and so in any
//! PyTorch layout, the q/k norms' under their weights' names, the sinks' as `sinks`).

use burn::module::Param;
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;

use super::AttentionParams;
use crate::mha::MultiHeadAttention;

impl<B: AutodiffBackend> AttentionParams<B> {
    /// The gradients of the layer's parameters after `loss.backward()`; a parameter that did not
    /// take part in the loss gets zeros.
    pub fn grads_of(
        layer: &MultiHeadAttention<B>,
        grads: &B::Gradients,
    ) -> AttentionParams<B::InnerBackend> {
        AttentionParams::read(
            layer,
            |param| grad_or_zeros(param, grads),
            |param| grad_or_zeros(param, grads),
        )
    }
}

/// `param`'s gradient in `grads`, or zeros of its shape when it has none.
fn grad_or_zeros<B: AutodiffBackend, const D: usize>(
    param: &Param<Tensor<B, D>>,
    grads: &B::Gradients,
) -> Tensor<B::InnerBackend, D> {
    param
        .grad(grads)
        .unwrap_or_else(|| param.val().inner().zeros_like())
}
