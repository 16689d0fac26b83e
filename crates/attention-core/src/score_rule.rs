//! How the scores are made from `q kᵀ` ([`ScoreRule`]): the one description of the scale, a
//! soft-cap and sinks that the explicit path, Burn's op and both kernels read.

use burn::prelude::*;

/// How the scores are made from `q kᵀ`, and what joins their softmax besides the keys: `s =
/// scale · q kᵀ`, then `c · tanh(s / c)` with a soft-cap `c` (Gemma 2), then the mask; with sinks
/// (gpt-oss, StreamingLLM) each head's softmax has `exp(sink)` in its denominator, a key that
/// takes weight and contributes no value.
#[derive(Debug, Clone)]
pub(crate) struct ScoreRule<B: Backend> {
    /// Multiplies `q kᵀ`; `None`: `1/√head_dim` (which the explicit path applies as a division
    /// by `√head_dim`, rounding as the chapter's code does).
    pub scale: Option<f64>,
    /// The soft-cap, if any.
    pub softcap: Option<f64>,
    /// One logit per query head, `[heads]`, if any.
    pub sinks: Option<Tensor<B, 1>>,
}

impl<B: Backend> ScoreRule<B> {
    /// The factor of `q kᵀ` for heads of `head_dim` features.
    pub fn scale_for(&self, head_dim: usize) -> f64 {
        scale_for(self.scale, head_dim)
    }

    /// `scores` scaled and soft-capped.
    ///
    /// # Shapes
    /// - `scores`: any; output: the same
    pub fn apply<const D: usize>(&self, scores: Tensor<B, D>, head_dim: usize) -> Tensor<B, D> {
        let scaled = match self.scale {
            None => scores / (head_dim as f64).sqrt(),
            Some(scale) => scores * scale,
        };
        match self.softcap {
            None => scaled,
            Some(cap) => (scaled / cap).tanh() * cap,
        }
    }
}

/// `scale`, or `1/√head_dim` without one.
pub(crate) fn scale_for(scale: Option<f64>, head_dim: usize) -> f64 {
    scale.unwrap_or_else(|| (head_dim as f64).sqrt().recip())
}
