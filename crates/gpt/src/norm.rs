//! A block's normalization: LayerNorm, or the workspace's one [`RmsNorm`], scaled by `w` (Llama)
//! or by `1 + w` (Gemma).

use attention_core::RmsNorm;
use burn::nn::LayerNorm;
use burn::prelude::*;

/// Each token's features normalized on their own.
///
/// The variant is not part of a parameter's path ([`crate::named_parameters`]): a norm's scale in
/// the field `attention_norm` is `attention_norm.gamma` whichever kind it is; which kind a model
/// holds is its configuration's business.
#[derive(Module, Debug)]
pub enum Norm<B: Backend> {
    /// LayerNorm: mean and biased variance, a scale `gamma` and a shift `beta` (GPT-2, the
    /// book's GPT).
    Layer(LayerNorm<B>),
    /// RMSNorm: root mean square, a scale `gamma` (the Llama family) or `1 + gamma` (Gemma 2
    /// and 3, [`RmsNorm::unit_offset`]).
    Rms(RmsNorm<B>),
}

impl<B: Backend> Norm<B> {
    /// Normalizes each token's features.
    ///
    /// # Shapes
    /// - `x`, output: `[..., width]`
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        match self {
            Norm::Layer(norm) => norm.forward(x),
            Norm::Rms(norm) => norm.forward(x),
        }
    }
}

/// `norm(x)`, or `x` where a family puts no norm.
///
/// # Shapes
/// - `x`, output: `[..., width]`
pub(crate) fn optional<B: Backend, const D: usize>(
    norm: Option<&Norm<B>>,
    x: Tensor<B, D>,
) -> Tensor<B, D> {
    match norm {
        Some(norm) => norm.forward(x),
        None => x,
    }
}
