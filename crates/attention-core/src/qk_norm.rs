//! RMSNorm of the queries and keys with learned weights, after the projections and before RoPE:
//! per head (Qwen3, Gemma 3) or over the whole projected width (OLMo2).
//!
//! `norm(x) = x · rsqrt(mean(x², last) + eps) · w`, or `· (1 + w)` in Gemma's convention
//! ([`QkNormConfig::unit_offset`]). [`MultiHeadAttention`](crate::MultiHeadAttention) applies it in
//! its one projection step, so every path (explicit, the kernels' forward and backward, cached)
//! sees the normalized heads, and the weights' gradients flow through Burn's own ops.

use burn::module::{Initializer, Param};
use burn::prelude::*;

use crate::error::AttentionError;

/// Over which features the query and key norms take their mean square.
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum QkNormScope {
    /// Over each head's `head_dim` features, after the head split (Qwen3, Gemma 3): both norms
    /// have `head_dim` weights, shared by every head.
    Head,
    /// Over the whole projected width before the head split (OLMo2): the query norm over
    /// `num_heads · head_dim` features, the key norm over `num_kv_heads · head_dim`.
    Width,
}

/// Query and key RMSNorms of a [`MultiHeadAttention`](crate::MultiHeadAttention).
///
/// ```
/// # use attention_core::{MultiHeadAttentionConfig, QkNormConfig, QkNormScope};
/// // Qwen3: per-head norms with the model's `rms_norm_eps`.
/// let config = MultiHeadAttentionConfig::new(32, 32, 128, 4)
///     .with_head_dim(Some(16))
///     .with_qk_norm(Some(QkNormConfig::new(QkNormScope::Head).with_epsilon(1e-6)));
/// assert!(config.validate().is_ok());
/// ```
#[derive(Config, Debug, PartialEq)]
pub struct QkNormConfig {
    /// Over which features the norms take their mean square.
    pub scope: QkNormScope,
    /// Added to the mean square before the root; must be finite and positive. Default: `1e-6`.
    #[config(default = 1e-6)]
    pub epsilon: f64,
    /// Gemma's convention: the normalized features are multiplied by `1 + w`, and the weights
    /// start at 0. Otherwise by `w`, starting at 1. Default: `false`.
    #[config(default = false)]
    pub unit_offset: bool,
}

impl QkNormConfig {
    /// Checks the config: a finite, positive `epsilon`.
    pub fn validate(&self) -> Result<(), AttentionError> {
        // Written so that NaN fails too.
        if self.epsilon.is_finite() && self.epsilon > 0.0 {
            Ok(())
        } else {
            Err(AttentionError::QkNormEpsilon(self.epsilon))
        }
    }

    /// A norm over `width` features: weights of 1 (or of 0 with
    /// [`unit_offset`](Self::unit_offset)), so that a new norm scales by 1.
    pub fn init<B: Backend>(&self, width: usize, device: &B::Device) -> QkNorm<B> {
        let initializer = if self.unit_offset {
            Initializer::Zeros
        } else {
            Initializer::Ones
        };
        QkNorm {
            weight: initializer.init([width], device),
            epsilon: self.epsilon,
            unit_offset: self.unit_offset,
        }
    }
}

/// RMSNorm over the last dimension with a learned weight per feature: the query or key norm of a
/// [`MultiHeadAttention`](crate::MultiHeadAttention).
#[derive(Module, Debug)]
pub struct QkNorm<B: Backend> {
    /// One weight per normalized feature (`w`, or the offset from 1 with `unit_offset`).
    pub weight: Param<Tensor<B, 1>>,
    #[module(skip)]
    epsilon: f64,
    #[module(skip)]
    unit_offset: bool,
}

impl<B: Backend> QkNorm<B> {
    /// `x · rsqrt(mean(x², last) + epsilon) · w` (or `· (1 + w)` with `unit_offset`), in the
    /// input's float type.
    ///
    /// # Shapes
    /// - `x`: `[..., width]`, `width` the weight's length
    /// - output: `[..., width]`
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        // `powf(-½)`, not `sqrt().recip()`: burn-ndarray 0.21's SIMD reciprocal is approximate
        // (about 12 bits), which moved cached outputs by 2e-5 against uncached ones.
        let inverse_rms = x
            .clone()
            .square()
            .mean_dim(D - 1)
            .add_scalar(self.epsilon)
            .powf_scalar(-0.5);
        let weight = if self.unit_offset {
            self.weight.val().add_scalar(1.0)
        } else {
            self.weight.val()
        };
        x * inverse_rms * weight.unsqueeze::<D>()
    }

    /// Added to the mean square before the root.
    pub fn epsilon(&self) -> f64 {
        self.epsilon
    }

    /// Whether the features are multiplied by `1 + w` (Gemma) instead of `w`.
    pub fn unit_offset(&self) -> bool {
        self.unit_offset
    }

    /// The number of features normalized together (the weight's length).
    pub fn width(&self) -> usize {
        self.weight.dims()[0]
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::NdArray;

    use super::*;

    /// The norm against the formula written out element by element.
    #[test]
    fn forward_is_the_formula() {
        let device = Default::default();
        let x = [[1.0f32, -2.0, 0.5], [3.0, 0.0, -1.0]];
        let w = [0.5f32, 2.0, -1.0];
        for unit_offset in [false, true] {
            let config = QkNormConfig::new(QkNormScope::Head)
                .with_epsilon(1e-2)
                .with_unit_offset(unit_offset);
            let mut norm = config.init::<NdArray>(3, &device);
            norm.weight = Param::from_tensor(Tensor::from_data(TensorData::from(w), &device));
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
            let norm = QkNormConfig::new(QkNormScope::Width)
                .with_unit_offset(unit_offset)
                .init::<NdArray>(4, &device);
            let weight = norm.weight.val().into_data().to_vec::<f32>().unwrap();
            let expected = if unit_offset { 0.0 } else { 1.0 };
            assert_eq!(weight, [expected; 4]);
            assert_eq!(norm.width(), 4);
        }
    }
}
