//! GPT-2's `config.json` ([`Gpt2Config`]).

use super::*;

/// GPT-2's hyper-parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct Gpt2Config {
    /// `vocab_size`
    pub vocab_size: usize,
    /// `n_embd`: the width.
    pub width: usize,
    /// `n_head`
    pub num_heads: usize,
    /// `n_layer`
    pub num_layers: usize,
    /// `n_positions`: the learned positions, and so the longest sequence.
    pub max_positions: usize,
    /// `n_inner`, or `4 · n_embd` when `null`.
    pub mlp_width: usize,
    /// `layer_norm_epsilon`
    pub layer_norm_eps: f64,
    /// `activation_function`: the tanh approximation (`gelu_new`,
    /// [`Activation::GeluTanh`]) or the exact GELU ([`Activation::Gelu`]).
    pub activation: Activation,
    /// `tie_word_embeddings`: the LM head is the token embedding.
    pub tie_word_embeddings: bool,
}

impl Gpt2Config {
    pub(super) fn read(fields: &Fields) -> Result<Self, ConfigError> {
        fields.require_eq(
            "scale_attn_weights",
            true,
            "attention scores are always scaled by 1/√head_dim",
        )?;
        fields.require_eq(
            "scale_attn_by_inverse_layer_idx",
            false,
            "no extra 1/(layer + 1) score scaling",
        )?;
        fields.require_eq("add_cross_attention", false, "decoder-only models")?;
        let width = fields.required("n_embd")?;
        let activation = match fields.string("activation_function")?.as_deref() {
            None | Some("gelu_new" | "gelu_pytorch_tanh" | "gelu_fast") => Activation::GeluTanh,
            Some("gelu") => Activation::Gelu,
            Some(other) => {
                return Err(ConfigError::Unsupported {
                    field: "activation_function".into(),
                    value: format!("{other:?}"),
                    supported: "gelu_new, gelu_pytorch_tanh, gelu_fast, gelu",
                });
            }
        };
        Ok(Self {
            vocab_size: fields.required("vocab_size")?,
            width,
            num_heads: fields.required("n_head")?,
            num_layers: fields.required("n_layer")?,
            max_positions: fields.required("n_positions")?,
            mlp_width: match fields.usize("n_inner")? {
                Some(n_inner) => n_inner,
                None => width.checked_mul(4).ok_or(ConfigError::Type {
                    field: "n_embd".into(),
                    expected: "a width whose 4 · n_embd (the default n_inner) is addressable",
                    found: width.to_string(),
                })?,
            },
            layer_norm_eps: fields.positive("layer_norm_epsilon")?.unwrap_or(1e-5),
            activation,
            tie_word_embeddings: fields.bool("tie_word_embeddings")?.unwrap_or(true),
        })
    }
}
