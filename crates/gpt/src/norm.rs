//! A block's normalization: LayerNorm or RMSNorm, the latter as `w` scales it (Llama) or as
//! `1 + w` does (Gemma).

use burn::module::Param;
use burn::nn::{LayerNorm, RmsNorm};
use burn::prelude::*;
use burn::tensor::DType;

/// Each token's features normalized on their own.
///
/// The variant is not part of a parameter's path ([`crate::named_parameters`]): a LayerNorm's
/// scale in the field `attention_norm` is `attention_norm.gamma`, as it was before norms had
/// variants; which kind a model holds is its configuration's business.
#[derive(Module, Debug)]
pub enum Norm<B: Backend> {
    /// LayerNorm: mean and biased variance, a scale `gamma` and a shift `beta` (GPT-2, the
    /// book's GPT).
    Layer(LayerNorm<B>),
    /// RMSNorm: root mean square, a scale `gamma` only (the Llama family).
    Rms(RmsNorm<B>),
    /// RMSNorm scaled by `1 + gamma` (Gemma 2 and 3).
    UnitOffsetRms(UnitOffsetRmsNorm<B>),
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
            Norm::UnitOffsetRms(norm) => norm.forward(x),
        }
    }
}

/// RMSNorm in Gemma's convention: `x / √(mean(x²) + epsilon) · (1 + gamma)`.
///
/// `gamma` holds the checkpoint's own weight `w`, and `1 + w` is formed at every call, rather
/// than `1 + w` stored once in a plain [`RmsNorm`] at load time. Both compute the same numbers
/// (transformers adds `1.0 + w` in float32 too), but only this way is the parameter a trained or
/// saved model holds the one Gemma defines: a new norm's `w` is 0, weight decay pulls the scale
/// towards 1, and a saved `gamma` is the `weight` transformers would load. It is also the
/// convention of the attention layer's query and key norms
/// ([`QkNormConfig::unit_offset`](attention_core::QkNormConfig::unit_offset)). The cost is one
/// addition over `width` values per call.
#[derive(Module, Debug)]
pub struct UnitOffsetRmsNorm<B: Backend> {
    /// `w`, `[width]`: the normalized features are scaled by `1 + w`.
    pub gamma: Param<Tensor<B, 1>>,
    /// Added to the mean square before the root.
    #[module(skip)]
    pub epsilon: f64,
}

impl<B: Backend> UnitOffsetRmsNorm<B> {
    /// A norm over `width` features that scales by 1 (`w = 0`).
    pub fn new(width: usize, epsilon: f64, device: &B::Device) -> Self {
        Self {
            gamma: Param::from_tensor(Tensor::zeros([width], device)),
            epsilon,
        }
    }

    /// Normalizes each token's features, the mean square taken in float32 as Burn's
    /// [`RmsNorm`] takes it.
    ///
    /// # Shapes
    /// - `x`, output: `[..., width]`
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let dtype = x.dtype();
        let rms = (x.clone().cast(DType::F32).square().mean_dim(D - 1) + self.epsilon).sqrt();
        let scale = self.gamma.val().add_scalar(1.0);
        (x / rms.cast(dtype)) * scale.unsqueeze()
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

#[cfg(test)]
mod tests {
    use attention_backends::NdArray;
    use burn::nn::RmsNormConfig;
    use burn::tensor::{Distribution, Tolerance};

    use super::*;

    /// Gemma's norm with weight `w` is Burn's RMSNorm with scale `1 + w`.
    #[test]
    fn unit_offset_norm_scales_by_one_plus_its_weight() {
        let device = Default::default();
        let width = 8;
        let w = Tensor::<NdArray, 1>::random([width], Distribution::Normal(0.0, 0.3), &device);
        let mut gemma = UnitOffsetRmsNorm::<NdArray>::new(width, 1e-6, &device);
        gemma.gamma = Param::from_tensor(w.clone());
        let mut llama = RmsNormConfig::new(width)
            .with_epsilon(1e-6)
            .init::<NdArray>(&device);
        llama.gamma = Param::from_tensor(w.add_scalar(1.0));
        let x = Tensor::<NdArray, 3>::random([2, 3, width], Distribution::Default, &device);
        let got = Norm::UnitOffsetRms(gemma).forward(x.clone());
        got.into_data()
            .assert_approx_eq::<f32>(&llama.forward(x).into_data(), Tolerance::absolute(1e-6));
    }
}
