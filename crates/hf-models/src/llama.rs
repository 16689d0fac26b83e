//! The Llama family as a [`Decoder`]: RMSNorm, attention with grouped-query heads and rotary
//! positions, a SwiGLU MLP and an LM head. The other families are Llama with a few fields set
//! ([`LlamaConfig`]): a sliding window (Mistral; Qwen2, Qwen3, SmolLM3 and Gemma per layer),
//! query, key and value biases (Qwen2), query and key RMSNorms (Qwen3 and Gemma 3 per head, OLMo
//! 2 over the width), norms after each branch instead of before (OLMo 2) or as well (Gemma),
//! fused projection tensors and RoPE on part of each head (Phi-3), layers without RoPE
//! (SmolLM3); and Gemma's conventions: `1 + w` RMSNorms, embeddings scaled by `√width`, a
//! tanh-GELU MLP, its own score scale, soft-capped scores (Gemma 2) and logits, RoPE per layer
//! type (Gemma 3).

use attention_core::{MultiHeadAttentionConfig, QkNormConfig, RmsNormConfig};
use burn::nn::DropoutConfig;
use burn::prelude::*;
use gpt::{Decoder, DecoderBlock, GatedMlp, Mlp, Norm};

use crate::checkpoint::{Checkpoint, LoadError, QkvTensors, Size};
use crate::config::{BlockNorms, LlamaConfig};

impl LlamaConfig {
    /// The attention layer of block `layer`.
    pub fn attention(&self, layer: usize) -> MultiHeadAttentionConfig {
        let qk_norm = self.qk_norm.map(|scope| {
            QkNormConfig::new(scope)
                .with_epsilon(self.rms_norm_eps)
                .with_unit_offset(self.unit_offset_norms)
        });
        let window = self.windows.of_layer(layer);
        // Gemma 3's sliding layers (those with a window) have RoPE parameters of their own.
        let rope = match (&self.sliding_rope, window) {
            (Some(sliding), Some(_)) => sliding,
            _ => &self.rope,
        };
        MultiHeadAttentionConfig::new(self.width, self.width, self.max_positions, self.num_heads)
            .with_num_kv_heads(Some(self.num_kv_heads))
            .with_head_dim(Some(self.head_dim))
            .with_qkv_bias(self.qkv_bias)
            .with_output_bias(self.output_bias)
            .with_rope(self.rope_layers.of_layer(layer).then(|| rope.clone()))
            .with_sliding_window(window)
            .with_qk_norm(qk_norm)
            .with_scale(self.attention_scale)
            .with_softcap(self.attention_softcap)
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
    let query_width = config.num_heads.checked_mul(config.head_dim);
    let kv_width = config.num_kv_heads.checked_mul(config.head_dim);
    let mut sizes = vec![
        size(
            "vocab_size",
            Some(config.vocab_size),
            "embed_tokens.weight",
            0,
        ),
        size("hidden_size", Some(width), "embed_tokens.weight", 1),
        size(
            "num_attention_heads · head_dim",
            query_width,
            &format!("{attention}.o_proj.weight"),
            1,
        ),
    ];
    if config.fused_projections {
        sizes.extend([
            size(
                "2 · intermediate_size",
                mlp.checked_mul(2),
                "layers.0.mlp.gate_up_proj.weight",
                0,
            ),
            size(
                "(num_attention_heads + 2 · num_key_value_heads) · head_dim",
                kv_width
                    .and_then(|kv| kv.checked_mul(2))
                    .zip(query_width)
                    .and_then(|(kv, q)| kv.checked_add(q)),
                &format!("{attention}.qkv_proj.weight"),
                0,
            ),
        ]);
    } else {
        sizes.extend([
            size(
                "intermediate_size",
                Some(mlp),
                "layers.0.mlp.gate_proj.weight",
                0,
            ),
            size(
                "num_attention_heads · head_dim",
                query_width,
                &format!("{attention}.q_proj.weight"),
                0,
            ),
            size(
                "num_key_value_heads · head_dim",
                kv_width,
                &format!("{attention}.k_proj.weight"),
                0,
            ),
        ]);
    }
    checkpoint.check_sizes(
        &format!("{base}layers."),
        ("num_hidden_layers", config.num_layers),
        &sizes,
    )?;
    let rms_norm = |checkpoint: &mut Checkpoint, name: &str| {
        // Gemma's `1 + w`: the file's `w` is kept as it is (see `RmsNorm::unit_offset`).
        let norm = RmsNormConfig::new(width)
            .with_epsilon(config.rms_norm_eps)
            .with_unit_offset(config.unit_offset_norms);
        Ok::<_, LoadError>(Norm::Rms(checkpoint.rms_norm(name, &norm, device)?))
    };
    let qkv = if config.fused_projections {
        QkvTensors::Fused
    } else {
        QkvTensors::ByLayout
    };
    let blocks = (0..config.num_layers)
        .map(|i| {
            let prefix = format!("{base}layers.{i}.");
            let attention = config.attention(i);
            attention.validate().map_err(|e| LoadError::Config {
                path: "config.json".into(),
                source: e.into(),
            })?;
            let norm = |checkpoint: &mut Checkpoint, name: &str| {
                rms_norm(checkpoint, &format!("{prefix}{name}")).map(Some)
            };
            let linear = |checkpoint: &mut Checkpoint, name: &str, shape| {
                let name = format!("{prefix}mlp.{name}");
                checkpoint.linear(&name, shape, config.mlp_bias, device)
            };
            // [before attention, after it, before the MLP, after it]
            let [
                attention_norm,
                post_attention_norm,
                feed_forward_norm,
                post_feed_forward_norm,
            ] = match config.norms {
                BlockNorms::Pre => [
                    norm(checkpoint, "input_layernorm")?,
                    None,
                    norm(checkpoint, "post_attention_layernorm")?,
                    None,
                ],
                BlockNorms::Post => [
                    None,
                    norm(checkpoint, "post_attention_layernorm")?,
                    None,
                    norm(checkpoint, "post_feedforward_layernorm")?,
                ],
                BlockNorms::Sandwich => [
                    norm(checkpoint, "input_layernorm")?,
                    norm(checkpoint, "post_attention_layernorm")?,
                    norm(checkpoint, "pre_feedforward_layernorm")?,
                    norm(checkpoint, "post_feedforward_layernorm")?,
                ],
            };
            let attention =
                checkpoint.attention(&format!("{prefix}self_attn."), &attention, qkv, device)?;
            let [gate, up] = if config.fused_projections {
                // Phi-3's `gate_up_proj`: the gate's rows, then the up projection's.
                checkpoint.fused_linears(
                    &format!("{prefix}mlp.gate_up_proj"),
                    width,
                    [mlp; 2],
                    device,
                )?
            } else {
                [
                    linear(checkpoint, "gate_proj", [width, mlp])?,
                    linear(checkpoint, "up_proj", [width, mlp])?,
                ]
            };
            Ok(DecoderBlock {
                attention_norm,
                attention,
                post_attention_norm,
                feed_forward_norm,
                feed_forward: Mlp::Gated(GatedMlp {
                    gate,
                    up,
                    down: linear(checkpoint, "down_proj", [mlp, width])?,
                    activation: config.activation,
                    packed_gate_up: Default::default(),
                    packed_down: Default::default(),
                }),
                post_feed_forward_norm,
                dropout: DropoutConfig::new(0.0).init(),
            })
        })
        .collect::<Result<_, LoadError>>()?;
    Ok(Decoder {
        token_embedding: checkpoint.embedding(
            &format!("{base}embed_tokens.weight"),
            [config.vocab_size, width],
            device,
        )?,
        // transformers' `torch.tensor(hidden_size ** 0.5)`, a float32 scalar: √width rounded
        // to float32 (f32's own square root rounds the same).
        embedding_scale: config
            .scaled_embeddings
            .then(|| f64::from((width as f32).sqrt())),
        position_embedding: None,
        dropout: DropoutConfig::new(0.0).init(),
        blocks,
        final_norm: rms_norm(checkpoint, &format!("{base}norm"))?,
        lm_head: checkpoint.lm_head(
            config.tie_word_embeddings,
            [width, config.vocab_size],
            device,
        )?,
        logit_softcap: config.final_logit_softcap,
        packed_lm_head: Default::default(),
    })
}
