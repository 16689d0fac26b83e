//! The Llama family (`LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM`): RMSNorm,
//! attention with grouped-query heads and rotary positions (a sliding window for Mistral, query,
//! key and value biases for Qwen2), a SwiGLU MLP, a final norm and an LM head.

use attention_core::{KvCache, MultiHeadAttention, MultiHeadAttentionConfig};
use burn::nn::{Embedding, Linear, RmsNorm};
use burn::prelude::*;
use burn::tensor::activation::silu;

use crate::checkpoint::{Checkpoint, LoadError};
use crate::config::LlamaConfig;
use crate::model::{LmInput, ModelError, attend, lm_head};

/// A Llama-family model with its language-model head.
#[derive(Module, Debug)]
pub struct Llama<B: Backend> {
    /// `model.embed_tokens`: `[vocab, hidden]`.
    pub token_embedding: Embedding<B>,
    /// `model.layers.0` … `model.layers.{n − 1}`.
    pub blocks: Vec<LlamaBlock<B>>,
    /// `model.norm`.
    pub final_norm: RmsNorm<B>,
    /// `lm_head`, or `None` when it is tied to the embedding (`tie_word_embeddings`).
    pub lm_head: Option<Linear<B>>,
}

/// `x + self_attn(input_layernorm(x))`, then `x + down(silu(gate(n)) · up(n))` with
/// `n = post_attention_layernorm(x)`.
#[derive(Module, Debug)]
pub struct LlamaBlock<B: Backend> {
    /// `input_layernorm`.
    pub attention_norm: RmsNorm<B>,
    /// `self_attn`: `q_proj`, `k_proj`, `v_proj`, `o_proj` with GQA, RoPE and the layer's window.
    pub attention: MultiHeadAttention<B>,
    /// `post_attention_layernorm`.
    pub mlp_norm: RmsNorm<B>,
    /// `mlp.gate_proj`: `hidden → intermediate`, through SiLU.
    pub gate: Linear<B>,
    /// `mlp.up_proj`: `hidden → intermediate`.
    pub up: Linear<B>,
    /// `mlp.down_proj`: `intermediate → hidden`.
    pub down: Linear<B>,
}

impl LlamaConfig {
    /// The attention layer of block `layer`.
    pub fn attention(&self, layer: usize) -> MultiHeadAttentionConfig {
        MultiHeadAttentionConfig::new(self.width, self.width, self.max_positions, self.num_heads)
            .with_num_kv_heads(Some(self.num_kv_heads))
            .with_head_dim(Some(self.head_dim))
            .with_qkv_bias(self.qkv_bias)
            .with_output_bias(self.output_bias)
            .with_rope(Some(self.rope.clone()))
            .with_sliding_window(self.windows[layer])
    }
}

impl<B: Backend> Llama<B> {
    /// Builds the model from a checkpoint's tensors (named with or without `model.`).
    pub(crate) fn load(
        config: &LlamaConfig,
        checkpoint: &mut Checkpoint,
        device: &B::Device,
    ) -> Result<Self, LoadError> {
        let base = if checkpoint.contains("model.embed_tokens.weight") {
            "model."
        } else {
            ""
        };
        let [width, mlp] = [config.width, config.mlp_width];
        let blocks = (0..config.num_layers)
            .map(|i| {
                let prefix = format!("{base}layers.{i}.");
                let attention = config.attention(i);
                attention.validate().map_err(|e| LoadError::Config {
                    path: "config.json".into(),
                    source: e.into(),
                })?;
                let linear = |checkpoint: &mut Checkpoint, name: &str, shape| {
                    checkpoint.linear(
                        &format!("{prefix}mlp.{name}"),
                        shape,
                        config.mlp_bias,
                        device,
                    )
                };
                Ok(LlamaBlock {
                    attention_norm: checkpoint.rms_norm(
                        &format!("{prefix}input_layernorm"),
                        width,
                        config.rms_norm_eps,
                        device,
                    )?,
                    attention: checkpoint.attention(
                        &format!("{prefix}self_attn."),
                        &attention,
                        device,
                    )?,
                    mlp_norm: checkpoint.rms_norm(
                        &format!("{prefix}post_attention_layernorm"),
                        width,
                        config.rms_norm_eps,
                        device,
                    )?,
                    gate: linear(checkpoint, "gate_proj", [width, mlp])?,
                    up: linear(checkpoint, "up_proj", [width, mlp])?,
                    down: linear(checkpoint, "down_proj", [mlp, width])?,
                })
            })
            .collect::<Result<_, LoadError>>()?;
        let lm_head = checkpoint.lm_head(
            config.tie_word_embeddings,
            [width, config.vocab_size],
            device,
        )?;
        Ok(Self {
            token_embedding: checkpoint.embedding(
                &format!("{base}embed_tokens.weight"),
                [config.vocab_size, width],
                device,
            )?,
            blocks,
            final_norm: checkpoint.rms_norm(
                &format!("{base}norm"),
                width,
                config.rms_norm_eps,
                device,
            )?,
            lm_head,
        })
    }

    /// Logits of every token; with `caches`, of tokens that follow those cached.
    ///
    /// # Shapes
    /// - `input.tokens`, `input.positions`: `[batch, seq]`
    /// - output: `[batch, seq, vocab]`
    pub(crate) fn forward(
        &self,
        input: &LmInput<B>,
        mut caches: Option<&mut [KvCache<B>]>,
    ) -> Result<Tensor<B, 3>, ModelError> {
        let mut x = self.token_embedding.forward(input.tokens.clone());
        for (i, block) in self.blocks.iter().enumerate() {
            let cache = caches.as_deref_mut().map(|caches| &mut caches[i]);
            let attended = attend(
                &block.attention,
                block.attention_norm.forward(x.clone()),
                input,
                cache,
            )?;
            x = x + attended;
            let normed = block.mlp_norm.forward(x.clone());
            let gated = silu(block.gate.forward(normed.clone())) * block.up.forward(normed);
            x = x + block.down.forward(gated);
        }
        let x = self.final_norm.forward(x);
        Ok(lm_head(x, self.lm_head.as_ref(), &self.token_embedding))
    }
}
