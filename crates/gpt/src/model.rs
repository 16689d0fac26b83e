//! The model: embeddings, blocks, final norm, language-model head.

use attention_core::{AttentionError, KvCache};
use burn::nn::{
    Dropout, DropoutConfig, Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig, Linear,
    LinearConfig,
};
use burn::prelude::*;

use crate::block::{TransformerBlock, TransformerBlockConfig};

/// Configuration of a [`GptModel`].
#[derive(Config, Debug)]
pub struct GptConfig {
    /// Number of distinct tokens.
    pub vocab_size: usize,
    /// Longest sequence (learned positions).
    pub context_length: usize,
    /// Width of the model.
    pub d_model: usize,
    /// Attention heads per block.
    pub num_heads: usize,
    /// Number of transformer blocks.
    pub num_layers: usize,
    /// Dropout on embeddings, attention weights and residual branches. Default: `0.0`.
    #[config(default = 0.0)]
    pub dropout: f64,
    /// Bias on the Q/K/V projections. Default: `false`.
    #[config(default = false)]
    pub qkv_bias: bool,
}

impl GptConfig {
    /// Initializes the model.
    pub fn init<B: Backend>(&self, device: &B::Device) -> GptModel<B> {
        let block = TransformerBlockConfig::new(self.d_model, self.num_heads, self.context_length)
            .with_dropout(self.dropout)
            .with_qkv_bias(self.qkv_bias);
        GptModel {
            token_embedding: EmbeddingConfig::new(self.vocab_size, self.d_model).init(device),
            position_embedding: EmbeddingConfig::new(self.context_length, self.d_model)
                .init(device),
            dropout: DropoutConfig::new(self.dropout).init(),
            blocks: (0..self.num_layers).map(|_| block.init(device)).collect(),
            final_norm: LayerNormConfig::new(self.d_model)
                .with_epsilon(1e-5)
                .init(device),
            lm_head: LinearConfig::new(self.d_model, self.vocab_size)
                .with_bias(false)
                .init(device),
        }
    }
}

/// A GPT: `lm_head(norm(blocks(dropout(token_embedding + position_embedding))))`.
#[derive(Module, Debug)]
pub struct GptModel<B: Backend> {
    /// Token embeddings, `[vocab_size, d_model]`.
    pub token_embedding: Embedding<B>,
    /// Learned position embeddings, `[context_length, d_model]`.
    pub position_embedding: Embedding<B>,
    /// Dropout on the summed embeddings.
    pub dropout: Dropout,
    /// The transformer blocks.
    pub blocks: Vec<TransformerBlock<B>>,
    /// Norm after the last block.
    pub final_norm: LayerNorm<B>,
    /// `d_model → vocab_size`, no bias.
    pub lm_head: Linear<B>,
}

impl<B: Backend> GptModel<B> {
    /// The longest sequence the model accepts.
    pub fn context_length(&self) -> usize {
        self.position_embedding.weight.dims()[0]
    }

    /// The number of distinct tokens.
    pub fn vocab_size(&self) -> usize {
        self.token_embedding.weight.dims()[0]
    }

    /// Next-token logits at every position.
    ///
    /// # Shapes
    /// - `tokens`: `[batch, seq]` with `seq ≤ context_length`
    /// - output: `[batch, seq, vocab_size]`
    ///
    /// # Panics
    /// When `seq` exceeds `context_length`.
    pub fn forward(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let mut x = self.embed(tokens, 0).unwrap_or_else(|e| panic!("{e}"));
        for block in &self.blocks {
            x = block.forward(x);
        }
        self.lm_head.forward(self.final_norm.forward(x))
    }

    /// One empty cache per block, for [`forward_cached`](Self::forward_cached).
    pub fn new_caches(&self) -> Vec<KvCache<B>> {
        self.blocks
            .iter()
            .map(|block| block.attention.new_cache())
            .collect()
    }

    /// Logits for tokens that follow those already in `caches` (one per block).
    ///
    /// # Shapes
    /// - `tokens`: `[batch, new]`
    /// - output: `[batch, new, vocab_size]`
    pub fn forward_cached(
        &self,
        tokens: Tensor<B, 2, Int>,
        caches: &mut [KvCache<B>],
    ) -> Result<Tensor<B, 3>, AttentionError> {
        let past = caches.first().map_or(0, KvCache::len);
        let mut x = self.embed(tokens, past)?;
        for (block, cache) in self.blocks.iter().zip(caches.iter_mut()) {
            x = block.forward_cached(x, cache)?;
        }
        Ok(self.lm_head.forward(self.final_norm.forward(x)))
    }

    /// Token plus position embeddings for tokens at positions `past..past + seq`.
    fn embed(
        &self,
        tokens: Tensor<B, 2, Int>,
        past: usize,
    ) -> Result<Tensor<B, 3>, AttentionError> {
        let [batch, seq] = tokens.dims();
        let context_length = self.context_length();
        if past + seq > context_length {
            return Err(AttentionError::ContextOverflow {
                seq: past + seq,
                context_length,
            });
        }
        let device = tokens.device();
        let positions = Tensor::<B, 1, Int>::arange(past as i64..(past + seq) as i64, &device)
            .reshape([1, seq])
            .expand([batch, seq]);
        let x = self.token_embedding.forward(tokens) + self.position_embedding.forward(positions);
        Ok(self.dropout.forward(x))
    }
}
