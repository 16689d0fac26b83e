//! The Llama family (`LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM`) as a
//! [`Decoder`]: RMSNorm, attention with grouped-query heads and rotary positions (a sliding
//! window for Mistral, query, key and value biases for Qwen2), a SwiGLU MLP and an LM head.

use attention_core::MultiHeadAttentionConfig;
use burn::nn::DropoutConfig;
use burn::prelude::*;
use gpt::{Activation, Decoder, DecoderBlock, GatedMlp, Mlp, Norm};

use crate::checkpoint::{Checkpoint, LoadError, Size};
use crate::config::LlamaConfig;

impl LlamaConfig {
    /// The attention layer of block `layer`.
    pub fn attention(&self, layer: usize) -> MultiHeadAttentionConfig {
        MultiHeadAttentionConfig::new(self.width, self.width, self.max_positions, self.num_heads)
            .with_num_kv_heads(Some(self.num_kv_heads))
            .with_head_dim(Some(self.head_dim))
            .with_qkv_bias(self.qkv_bias)
            .with_output_bias(self.output_bias)
            .with_rope(Some(self.rope.clone()))
            .with_sliding_window(self.windows.of_layer(layer))
    }
}

/// Builds a Llama-family model from a checkpoint's tensors (named with or without `model.`).
pub(crate) fn load<B: Backend>(
    config: &LlamaConfig,
    checkpoint: &mut Checkpoint,
    device: &B::Device,
) -> Result<Decoder<B>, LoadError> {
    let base = if checkpoint.contains("model.embed_tokens.weight") {
        "model."
    } else {
        ""
    };
    let [width, mlp] = [config.width, config.mlp_width];
    let size = |field, value, key: &str, dim| Size {
        field,
        value,
        key: format!("{base}{key}"),
        dim,
    };
    let attention = "layers.0.self_attn";
    checkpoint.check_sizes(
        &format!("{base}layers."),
        ("num_hidden_layers", config.num_layers),
        &[
            size(
                "vocab_size",
                Some(config.vocab_size),
                "embed_tokens.weight",
                0,
            ),
            size("hidden_size", Some(width), "embed_tokens.weight", 1),
            size(
                "intermediate_size",
                Some(mlp),
                "layers.0.mlp.gate_proj.weight",
                0,
            ),
            size(
                "num_attention_heads · head_dim",
                config.num_heads.checked_mul(config.head_dim),
                &format!("{attention}.q_proj.weight"),
                0,
            ),
            size(
                "num_key_value_heads · head_dim",
                config.num_kv_heads.checked_mul(config.head_dim),
                &format!("{attention}.k_proj.weight"),
                0,
            ),
        ],
    )?;
    let rms_norm = |checkpoint: &mut Checkpoint, name: &str| {
        let norm = checkpoint.rms_norm(name, width, config.rms_norm_eps, device)?;
        Ok::<_, LoadError>(Norm::Rms(norm))
    };
    let blocks = (0..config.num_layers)
        .map(|i| {
            let prefix = format!("{base}layers.{i}.");
            let attention = config.attention(i);
            attention.validate().map_err(|e| LoadError::Config {
                path: "config.json".into(),
                source: e.into(),
            })?;
            let linear = |checkpoint: &mut Checkpoint, name: &str, shape| {
                let name = format!("{prefix}mlp.{name}");
                checkpoint.linear(&name, shape, config.mlp_bias, device)
            };
            Ok(DecoderBlock::pre_norm(
                rms_norm(checkpoint, &format!("{prefix}input_layernorm"))?,
                checkpoint.attention(&format!("{prefix}self_attn."), &attention, device)?,
                rms_norm(checkpoint, &format!("{prefix}post_attention_layernorm"))?,
                Mlp::Gated(GatedMlp {
                    gate: linear(checkpoint, "gate_proj", [width, mlp])?,
                    up: linear(checkpoint, "up_proj", [width, mlp])?,
                    down: linear(checkpoint, "down_proj", [mlp, width])?,
                    activation: Activation::Silu,
                }),
            ))
        })
        .collect::<Result<_, LoadError>>()?;
    Ok(Decoder {
        token_embedding: checkpoint.embedding(
            &format!("{base}embed_tokens.weight"),
            [config.vocab_size, width],
            device,
        )?,
        position_embedding: None,
        dropout: DropoutConfig::new(0.0).init(),
        blocks,
        final_norm: rms_norm(checkpoint, &format!("{base}norm"))?,
        lm_head: checkpoint.lm_head(
            config.tie_word_embeddings,
            [width, config.vocab_size],
            device,
        )?,
    })
}
