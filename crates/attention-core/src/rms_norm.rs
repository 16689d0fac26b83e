//! RMSNorm over the last dimension, scaled by a learned `w` (Llama) or by `1 + w` (Gemma): the
//! one RMSNorm of the workspace, the layer's query and key norms and a decoder block's norms.

use burn::module::{Initializer, Param};
use burn::prelude::*;
use burn::tensor::DType;

/// An [`RmsNorm`]'s width and convention.
///
/// ```
/// # use attention_core::RmsNormConfig;
/// # use burn::backend::NdArray;
/// // Gemma: `1 + w`, its weights start at 0.
/// let norm = RmsNormConfig::new(64)
///     .with_epsilon(1e-6)
///     .with_unit_offset(true)
///     .init::<NdArray>(&Default::default());
/// assert_eq!(norm.width(), 64);
/// ```
#[derive(Config, Debug, PartialEq)]
pub struct RmsNormConfig {
    /// The number of features normalized together (the last dimension).
    pub width: usize,
    /// Added to the mean square before the root. Default: `1e-5` (Burn's).
    #[config(default = 1e-5)]
    pub epsilon: f64,
    /// Gemma's convention: the normalized features are multiplied by `1 + gamma`, and `gamma`
    /// starts at 0; otherwise by `gamma`, starting at 1. Default: `false`.
    #[config(default = false)]
    pub unit_offset: bool,
}

impl RmsNormConfig {
    /// A norm that scales by 1: `gamma` of ones, or of zeros with
    /// [`unit_offset`](Self::unit_offset).
    pub fn init<B: Backend>(&self, device: &B::Device) -> RmsNorm<B> {
        let initializer = if self.unit_offset {
            Initializer::Zeros
        } else {
            Initializer::Ones
        };
        RmsNorm {
            gamma: initializer.init([self.width], device),
            epsilon: self.epsilon,
            unit_offset: self.unit_offset,
        }
    }
}

/// `x / √(mean(x², last) + epsilon) · scale`, the scale `gamma` or, with
/// [`unit_offset`](Self::unit_offset), `1 + gamma`.
///
/// Burn's [`burn::nn::RmsNorm`] with a unit offset: the same operations in the same order, the
/// mean square of a half-precision input in `f32`. With `unit_offset`, `gamma` holds the
/// checkpoint's own weight `w` and `1 + w` is formed at every call rather than stored once: both
/// compute the same numbers (transformers adds `1.0 + w` in float32 too), but only this way is
/// the parameter a trained or saved model holds the one Gemma defines (a new norm's `w` is 0,
/// weight decay pulls the scale towards 1, a saved `gamma` is the `weight` transformers loads).
#[derive(Module, Debug)]
pub struct RmsNorm<B: Backend> {
    /// One weight per normalized feature, `[width]`: the scale, or its offset from 1.
    pub gamma: Param<Tensor<B, 1>>,
    /// Added to the mean square before the root.
    #[module(skip)]
    pub epsilon: f64,
    /// Whether the features are multiplied by `1 + gamma` (Gemma) instead of `gamma`.
    #[module(skip)]
    pub unit_offset: bool,
}

impl<B: Backend> RmsNorm<B> {
    /// Normalizes each token's features.
    ///
    /// # Shapes
    /// - `x`, output: `[..., width]`
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let dtype = x.dtype();
        // Half-precision inputs take their mean square in `f32`; wider ones in their own type
        // (Burn's norm casts every input to `f32`, which rounds away `f64`'s precision).
        let wide = match dtype {
            DType::F16 | DType::BF16 => DType::F32,
            dtype => dtype,
        };
        let rms = (x.clone().cast(wide).square().mean_dim(D - 1) + self.epsilon).sqrt();
        let scale = if self.unit_offset {
            self.gamma.val().add_scalar(1.0)
        } else {
            self.gamma.val()
        };
        (x / rms.cast(dtype)) * scale.unsqueeze()
    }

    /// The number of features normalized together (`gamma`'s length).
    pub fn width(&self) -> usize {
        self.gamma.dims()[0]
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::NdArray;
    use burn::tensor::{Distribution, Tolerance};

    use super::*;

    /// The norm against the formula written out element by element, in both conventions.
    #[test]
    fn forward_is_the_formula() {
        let device = Default::default();
        let x = [[1.0f32, -2.0, 0.5], [3.0, 0.0, -1.0]];
        let w = [0.5f32, 2.0, -1.0];
        for unit_offset in [false, true] {
            let mut norm = RmsNormConfig::new(3)
                .with_epsilon(1e-2)
                .with_unit_offset(unit_offset)
                .init::<NdArray>(&device);
            norm.gamma = Param::from_tensor(Tensor::from_data(TensorData::from(w), &device));
            let found = norm
                .forward(Tensor::<NdArray, 2>::from_data(
                    TensorData::from(x),
                    &device,
                ))
                .into_data()
                .to_vec::<f32>()
                .unwrap();
            for (row, values) in x.iter().enumerate() {
                let mean_square = values.iter().map(|v| v * v).sum::<f32>() / 3.0;
                let inverse_rms = 1.0 / (mean_square + 1e-2).sqrt();
                for (i, value) in values.iter().enumerate() {
                    let scale = if unit_offset { 1.0 + w[i] } else { w[i] };
                    let expected = value * inverse_rms * scale;
                    let got = found[row * 3 + i];
                    assert!(
                        (got - expected).abs() <= 1e-5,
                        "unit_offset {unit_offset}, [{row}, {i}]: {got} vs {expected}"
                    );
                }
            }
        }
    }

    /// A new norm multiplies by 1 in either convention.
    #[test]
    fn a_new_norm_scales_by_one() {
        let device = Default::default();
        for unit_offset in [false, true] {
            let norm = RmsNormConfig::new(4)
                .with_unit_offset(unit_offset)
                .init::<NdArray>(&device);
            let gamma = norm.gamma.val().into_data().to_vec::<f32>().unwrap();
            let expected = if unit_offset { 0.0 } else { 1.0 };
            assert_eq!(gamma, [expected; 4]);
            assert_eq!(norm.width(), 4);
        }
    }

    /// Without the offset, Burn's RMSNorm bit for bit; with it, Burn's RMSNorm of scale `1 + w`.
    #[test]
    fn is_burns_rms_norm() {
        let device = Default::default();
        let width = 8;
        let w = Tensor::<NdArray, 1>::random([width], Distribution::Normal(0.0, 0.3), &device);
        let x = Tensor::<NdArray, 3>::random([2, 3, width], Distribution::Default, &device);
        let mut burns = burn::nn::RmsNormConfig::new(width)
            .with_epsilon(1e-6)
            .init::<NdArray>(&device);
        for unit_offset in [false, true] {
            let mut ours = RmsNormConfig::new(width)
                .with_epsilon(1e-6)
                .with_unit_offset(unit_offset)
                .init::<NdArray>(&device);
            ours.gamma = Param::from_tensor(w.clone());
            burns.gamma = Param::from_tensor(if unit_offset {
                w.clone().add_scalar(1.0)
            } else {
                w.clone()
            });
            let expected = burns.forward(x.clone()).into_data();
            let got = ours.forward(x.clone()).into_data();
            if unit_offset {
                got.assert_approx_eq::<f32>(&expected, Tolerance::absolute(1e-6));
            } else {
                got.assert_eq(&expected, true);
            }
        }
    }
}
