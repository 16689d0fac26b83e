//! A layer's parameter gradients after `backward`, as [`AttentionParams`] (and so in any
//! PyTorch layout, the q/k norms' under their weights' names, the sinks' as `sinks`).

use burn::module::Param;
use burn::nn::Linear;
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;

use super::{AttentionParams, LinearParams};
use crate::mha::MultiHeadAttention;
use crate::qk_norm::QkNorm;

impl<B: AutodiffBackend> AttentionParams<B> {
    /// The gradients of the layer's parameters after `loss.backward()`; a parameter that did not
    /// take part in the loss gets zeros.
    pub fn grads_of(
        layer: &MultiHeadAttention<B>,
        grads: &B::Gradients,
    ) -> AttentionParams<B::InnerBackend> {
        let grad_2 = |param: &Param<Tensor<B, 2>>| {
            param
                .grad(grads)
                .unwrap_or_else(|| param.val().inner().zeros_like())
        };
        let linear = |layer: &Linear<B>| LinearParams {
            weight: grad_2(&layer.weight),
            bias: layer.bias.as_ref().map(|bias| {
                bias.grad(grads)
                    .unwrap_or_else(|| bias.val().inner().zeros_like())
            }),
        };
        let grad_1 = |param: &Param<Tensor<B, 1>>| {
            param
                .grad(grads)
                .unwrap_or_else(|| param.val().inner().zeros_like())
        };
        let norm = |norm: &Option<QkNorm<B>>| norm.as_ref().map(|norm| grad_1(&norm.gamma));
        AttentionParams {
            query: linear(&layer.query_layer),
            key: linear(&layer.key_layer),
            value: linear(&layer.value_layer),
            output: linear(&layer.output_layer),
            query_norm: norm(&layer.query_norm),
            key_norm: norm(&layer.key_norm),
            sinks: layer.sinks.as_ref().map(grad_1),
        }
    }
}
