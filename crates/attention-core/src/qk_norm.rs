//! RMSNorm of the queries and keys with learned weights, after the projections and before RoPE:
//! per head (Qwen3, Gemma 3) or over the whole projected width (OLMo2).
//!
//! Each norm is an [`RmsNorm`]: `x / √(mean(x², last) + eps) · w`, or `· (1 + w)` in Gemma's
//! convention ([`QkNormConfig::unit_offset`]). [`MultiHeadAttention`](crate::MultiHeadAttention)
//! applies it in its one projection step, so every path (explicit, the kernels' forward and
//! backward, cached) sees the normalized heads, and the weights' gradients flow through Burn's
//! own ops.

use burn::prelude::*;

use crate::error::AttentionError;
use crate::rms_norm::{RmsNorm, RmsNormConfig};

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
        RmsNormConfig::new(width)
            .with_epsilon(self.epsilon)
            .with_unit_offset(self.unit_offset)
            .init(device)
    }
}

/// The query or key norm of a [`MultiHeadAttention`](crate::MultiHeadAttention): an
/// [`RmsNorm`] over the last dimension (each head's features, or the projected width).
pub type QkNorm<B> = RmsNorm<B>;

#[cfg(test)]
mod tests {
    use burn::backend::NdArray;

    use super::*;

    /// The config's epsilon and convention reach the norm it makes.
    #[test]
    fn init_keeps_the_configs_epsilon_and_convention() {
        for unit_offset in [false, true] {
            let norm = QkNormConfig::new(QkNormScope::Head)
                .with_epsilon(1e-3)
                .with_unit_offset(unit_offset)
                .init::<NdArray>(4, &Default::default());
            assert_eq!(
                (norm.epsilon, norm.unit_offset, norm.width()),
                (1e-3, unit_offset, 4)
            );
        }
    }
}
