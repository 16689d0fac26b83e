//! The book's GPT as a configuration of the [`Decoder`]: learned positions, LayerNorm
//! (eps 1e-5), the gated-GELU feed-forward of hidden width `4 · d_model` without biases, a
//! bias-free LM head of its own, and dropout on the embeddings, the attention weights and both
//! residual branches; checked before anything is allocated, and its parameters' names and
//! shapes computed from it alone.

use attention_core::MultiHeadAttentionConfig;
use burn::nn::{DropoutConfig, EmbeddingConfig, LayerNormConfig, LinearConfig};
use burn::prelude::*;

use crate::block::DecoderBlock;
use crate::decoder::Decoder;
use crate::mlp::{Activation, GatedMlp, Mlp};
use crate::norm::Norm;

/// The book's GPT: a [`Decoder`] as [`GptConfig::init`] builds it.
pub type GptModel<B> = Decoder<B>;

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

/// What is wrong with a [`GptConfig`].
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GptConfigError {
    /// A size is zero.
    #[error("`{0}` must be at least 1, got 0")]
    ZeroSize(&'static str),
    /// The width does not split into the heads.
    #[error("`num_heads` ({num_heads}) must divide `d_model` ({d_model})")]
    HeadsDoNotDivide {
        /// The width.
        d_model: usize,
        /// The heads.
        num_heads: usize,
    },
    /// The dropout probability is outside `[0, 1)`.
    #[error("`dropout` must be in [0, 1), got {0}")]
    Dropout(f64),
    /// The parameter count does not fit in memory addresses.
    #[error(
        "the model's parameter count overflows (vocab_size, context_length or d_model too large)"
    )]
    Overflow,
}

impl GptConfig {
    /// Checks the config without allocating anything: sizes at least 1, `num_heads` divides
    /// `d_model`, dropout in `[0, 1)`, a parameter count that can be addressed.
    pub fn validate(&self) -> Result<(), GptConfigError> {
        for (name, value) in [
            ("vocab_size", self.vocab_size),
            ("context_length", self.context_length),
            ("d_model", self.d_model),
            ("num_heads", self.num_heads),
            ("num_layers", self.num_layers),
        ] {
            if value == 0 {
                return Err(GptConfigError::ZeroSize(name));
            }
        }
        if !self.d_model.is_multiple_of(self.num_heads) {
            return Err(GptConfigError::HeadsDoNotDivide {
                d_model: self.d_model,
                num_heads: self.num_heads,
            });
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(GptConfigError::Dropout(self.dropout));
        }
        self.parameter_count().ok_or(GptConfigError::Overflow)?;
        Ok(())
    }

    /// Every parameter's path (as [`crate::named_parameters`] names it), shape, and the config
    /// fields its shape comes from, computed from the config alone.
    pub fn parameter_shapes(&self) -> Vec<(String, Vec<usize>, &'static str)> {
        let (d, v, c) = (self.d_model, self.vocab_size, self.context_length);
        let hidden = 4 * d;
        let mut shapes = vec![
            (
                "token_embedding.weight".to_string(),
                vec![v, d],
                "[vocab_size, d_model]",
            ),
            (
                "position_embedding.weight".to_string(),
                vec![c, d],
                "[context_length, d_model]",
            ),
        ];
        for layer in 0..self.num_layers {
            let mut add = |name: &str, shape: Vec<usize>, fields: &'static str| {
                shapes.push((format!("blocks.{layer}.{name}"), shape, fields));
            };
            add("attention_norm.gamma", vec![d], "[d_model]");
            add("attention_norm.beta", vec![d], "[d_model]");
            for projection in ["query_layer", "key_layer", "value_layer"] {
                add(
                    &format!("attention.{projection}.weight"),
                    vec![d, d],
                    "[d_model, d_model]",
                );
                if self.qkv_bias {
                    add(
                        &format!("attention.{projection}.bias"),
                        vec![d],
                        "[d_model] (qkv_bias)",
                    );
                }
            }
            add(
                "attention.output_layer.weight",
                vec![d, d],
                "[d_model, d_model]",
            );
            add("attention.output_layer.bias", vec![d], "[d_model]");
            add("feed_forward_norm.gamma", vec![d], "[d_model]");
            add("feed_forward_norm.beta", vec![d], "[d_model]");
            add(
                "feed_forward.gate.weight",
                vec![d, hidden],
                "[d_model, 4 · d_model]",
            );
            add(
                "feed_forward.up.weight",
                vec![d, hidden],
                "[d_model, 4 · d_model]",
            );
            add(
                "feed_forward.down.weight",
                vec![hidden, d],
                "[4 · d_model, d_model]",
            );
        }
        shapes.push(("final_norm.gamma".into(), vec![d], "[d_model]"));
        shapes.push(("final_norm.beta".into(), vec![d], "[d_model]"));
        shapes.push(("lm_head.weight".into(), vec![d, v], "[d_model, vocab_size]"));
        shapes
    }

    /// The number of parameters, `None` if it overflows.
    pub fn parameter_count(&self) -> Option<usize> {
        let (d, v, c) = (self.d_model, self.vocab_size, self.context_length);
        let per_layer = d
            .checked_mul(d)?
            .checked_mul(16)? // q, k, v, output: 4 d²; gate, up (d × 4d), down (4d × d): 12 d²
            .checked_add(d.checked_mul(if self.qkv_bias { 8 } else { 5 })?)?;
        v.checked_mul(d)?
            .checked_mul(2)?
            .checked_add(c.checked_mul(d)?)?
            .checked_add(per_layer.checked_mul(self.num_layers)?)?
            .checked_add(d.checked_mul(2)?)
    }

    /// Initializes the model after [`validate`](Self::validate).
    pub fn try_init<B: Backend>(&self, device: &B::Device) -> Result<GptModel<B>, GptConfigError> {
        self.validate()?;
        Ok(self.init(device))
    }

    /// Initializes the model.
    ///
    /// # Panics
    /// When the config is invalid (see [`validate`](Self::validate)).
    pub fn init<B: Backend>(&self, device: &B::Device) -> GptModel<B> {
        let (d, hidden) = (self.d_model, 4 * self.d_model);
        let layer_norm = || Norm::Layer(LayerNormConfig::new(d).with_epsilon(1e-5).init(device));
        let linear = |i, o| LinearConfig::new(i, o).with_bias(false).init(device);
        let attention = MultiHeadAttentionConfig::new(d, d, self.context_length, self.num_heads)
            .with_dropout(self.dropout)
            .with_qkv_bias(self.qkv_bias);
        let block = || DecoderBlock {
            dropout: DropoutConfig::new(self.dropout).init(),
            ..DecoderBlock::pre_norm(
                layer_norm(),
                attention.init(device),
                layer_norm(),
                Mlp::Gated(GatedMlp {
                    gate: linear(d, hidden),
                    up: linear(d, hidden),
                    down: linear(hidden, d),
                    activation: Activation::Gelu,
                    packed_gate_up: Default::default(),
                    packed_down: Default::default(),
                }),
            )
        };
        Decoder {
            token_embedding: EmbeddingConfig::new(self.vocab_size, d).init(device),
            embedding_scale: None,
            position_embedding: Some(EmbeddingConfig::new(self.context_length, d).init(device)),
            dropout: DropoutConfig::new(self.dropout).init(),
            blocks: (0..self.num_layers).map(|_| block()).collect(),
            final_norm: layer_norm(),
            lm_head: Some(linear(d, self.vocab_size)),
            logit_softcap: None,
            packed_lm_head: Default::default(),
        }
    }
}
