//! A pre-norm transformer block.

use attention_core::{KvCache, MultiHeadAttention, MultiHeadAttentionConfig};
use burn::nn::{Dropout, DropoutConfig, LayerNorm, LayerNormConfig};
use burn::prelude::*;

use crate::feed_forward::{FeedForward, FeedForwardConfig};

/// Configuration of a [`TransformerBlock`].
#[derive(Config, Debug)]
pub struct TransformerBlockConfig {
    /// Width of the model.
    pub d_model: usize,
    /// Attention heads.
    pub num_heads: usize,
    /// Longest sequence.
    pub context_length: usize,
    /// Dropout on attention weights and on both residual branches. Default: `0.0`.
    #[config(default = 0.0)]
    pub dropout: f64,
    /// Bias on the Q/K/V projections. Default: `false`.
    #[config(default = false)]
    pub qkv_bias: bool,
}

impl TransformerBlockConfig {
    /// Initializes the block.
    pub fn init<B: Backend>(&self, device: &B::Device) -> TransformerBlock<B> {
        let norm = || {
            LayerNormConfig::new(self.d_model)
                .with_epsilon(1e-5)
                .init(device)
        };
        TransformerBlock {
            attention_norm: norm(),
            attention: MultiHeadAttentionConfig::new(
                self.d_model,
                self.d_model,
                self.context_length,
                self.num_heads,
            )
            .with_dropout(self.dropout)
            .with_qkv_bias(self.qkv_bias)
            .init(device),
            feed_forward_norm: norm(),
            feed_forward: FeedForwardConfig::new(self.d_model, 4 * self.d_model).init(device),
            dropout: DropoutConfig::new(self.dropout).init(),
        }
    }
}

/// `x + dropout(attention(norm(x)))`, then `x + dropout(feed_forward(norm(x)))`.
#[derive(Module, Debug)]
pub struct TransformerBlock<B: Backend> {
    /// Norm before attention (biased variance, eps 1e-5, learnable scale and shift).
    pub attention_norm: LayerNorm<B>,
    /// Causal multi-head self-attention.
    pub attention: MultiHeadAttention<B>,
    /// Norm before the feed-forward.
    pub feed_forward_norm: LayerNorm<B>,
    /// The gated feed-forward.
    pub feed_forward: FeedForward<B>,
    /// Dropout on both residual branches.
    pub dropout: Dropout,
}

impl<B: Backend> TransformerBlock<B> {
    /// # Shapes
    /// - `x`: `[batch, seq, d_model]`
    /// - output: `[batch, seq, d_model]`
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let attended = self
            .attention
            .forward(self.attention_norm.forward(x.clone()));
        self.feed_forward_residual(x + self.dropout.forward(attended))
    }

    /// Like [`forward`](Self::forward) for tokens that follow those in `cache`.
    ///
    /// # Shapes
    /// - `x`: `[batch, new, d_model]`
    /// - output: `[batch, new, d_model]`
    pub fn forward_cached(
        &self,
        x: Tensor<B, 3>,
        cache: &mut KvCache<B>,
    ) -> Result<Tensor<B, 3>, attention_core::AttentionError> {
        let attended = self
            .attention
            .forward_cached(self.attention_norm.forward(x.clone()), cache)?;
        Ok(self.feed_forward_residual(x + self.dropout.forward(attended)))
    }

    fn feed_forward_residual(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let transformed = self
            .feed_forward
            .forward(self.feed_forward_norm.forward(x.clone()));
        x + self.dropout.forward(transformed)
    }
}
