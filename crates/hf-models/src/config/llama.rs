//! The Llama family's `config.json` ([`LlamaConfig`]): Llama, Mistral, Qwen2/3, Gemma 2/3,
//! Phi-3, OLMo2, SmolLM3, and what each names differently.

use super::*;

/// Which member of the Llama family: Llama itself, or a family that differs from it in a few
/// fields of [`LlamaConfig`] (biases, windows, q/k norms, norm placement and convention, fused
/// tensors, which layers have RoPE, score scale and soft-caps), as transformers' modular files
/// state each as a difference from Llama (Gemma's through Gemma's own).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LlamaFamily {
    /// `model_type: "llama"`
    Llama,
    /// `model_type: "mistral"`: a sliding window on every layer.
    Mistral,
    /// `model_type: "qwen2"`: query, key and value biases; windows from `layer_types`.
    Qwen2,
    /// `model_type: "qwen3"`: RMSNorm on each query and key head; `head_dim` 128 by default.
    Qwen3,
    /// `model_type: "gemma2"`: Gemma's `1 + w` RMSNorms, before and after attention and the MLP;
    /// embeddings scaled by `√hidden_size`; a tanh-GELU MLP; scores scaled by
    /// `query_pre_attn_scalar^-0.5` and soft-capped; soft-capped logits; windows on alternate
    /// layers.
    Gemma2,
    /// `model_type: "gemma3_text"`: Gemma 2 without the score soft-cap, with `1 + w` RMSNorms on
    /// each query and key head and RoPE parameters per layer type.
    Gemma3,
    /// `model_type: "phi3"`: fused `qkv_proj` and `gate_up_proj` tensors; RoPE on part of each
    /// head (`partial_rotary_factor`).
    Phi3,
    /// `model_type: "olmo2"`: RMSNorm over the whole projected query and key; norms after
    /// attention and MLP, none before.
    Olmo2,
    /// `model_type: "smollm3"`: no RoPE on the layers `no_rope_layers` marks 0.
    SmolLm3,
}

impl LlamaFamily {
    /// The family's `model_type`.
    pub fn model_type(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Mistral => "mistral",
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
            Self::Gemma2 => "gemma2",
            Self::Gemma3 => "gemma3_text",
            Self::Phi3 => "phi3",
            Self::Olmo2 => "olmo2",
            Self::SmolLm3 => "smollm3",
        }
    }

    /// The family's name in messages.
    pub fn name(self) -> &'static str {
        match self {
            Self::Llama => "Llama",
            Self::Mistral => "Mistral",
            Self::Qwen2 => "Qwen2",
            Self::Qwen3 => "Qwen3",
            Self::Gemma2 => "Gemma 2",
            Self::Gemma3 => "Gemma 3",
            Self::Phi3 => "Phi-3",
            Self::Olmo2 => "OLMo 2",
            Self::SmolLm3 => "SmolLM3",
        }
    }

    /// The family of a `model_type`, if this crate builds it.
    pub(super) fn of_model_type(model_type: &str) -> Option<Self> {
        [
            Self::Llama,
            Self::Mistral,
            Self::Qwen2,
            Self::Qwen3,
            Self::Gemma2,
            Self::Gemma3,
            Self::Phi3,
            Self::Olmo2,
            Self::SmolLm3,
        ]
        .into_iter()
        .find(|family| family.model_type() == model_type)
    }

    /// `rms_norm_eps` when the config has none (transformers' dataclass defaults).
    pub(super) fn default_rms_norm_eps(self) -> f64 {
        match self {
            Self::Phi3 | Self::Olmo2 => 1e-5,
            _ => 1e-6,
        }
    }

    /// `rope_theta` when the config has none (Gemma 3: of its full-attention layers).
    pub(super) fn default_rope_theta(self) -> f64 {
        match self {
            Self::SmolLm3 => 2_000_000.0,
            Self::Gemma3 => 1_000_000.0,
            _ => 10_000.0,
        }
    }

    /// Gemma 2 and 3: the families of Gemma's conventions (`1 + w` norms, scaled embeddings,
    /// `hidden_activation`, `query_pre_attn_scalar`).
    pub(super) fn is_gemma(self) -> bool {
        matches!(self, Self::Gemma2 | Self::Gemma3)
    }
}

/// The Llama family's hyper-parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// Which `model_type` it came from.
    pub family: LlamaFamily,
    /// `vocab_size`
    pub vocab_size: usize,
    /// `hidden_size`
    pub width: usize,
    /// `num_attention_heads`
    pub num_heads: usize,
    /// `num_key_value_heads` (default: 4 for Gemma, transformers' dataclass default; else
    /// `num_attention_heads`).
    pub num_kv_heads: usize,
    /// `head_dim` (default: 128 for Qwen3, 256 for Gemma, else
    /// `hidden_size / num_attention_heads`).
    pub head_dim: usize,
    /// `num_hidden_layers`
    pub num_layers: usize,
    /// `intermediate_size`: the gated MLP's hidden width.
    pub mlp_width: usize,
    /// The gated MLP's nonlinearity: SiLU (`hidden_act`, which must be `silu`), or Gemma's
    /// `hidden_activation` (tanh-GELU by default).
    pub activation: Activation,
    /// `max_position_embeddings`: the longest sequence.
    pub max_positions: usize,
    /// `rms_norm_eps` (default: 1e-5 for Phi-3 and OLMo 2, else 1e-6), for every norm, the
    /// query and key norms included.
    pub rms_norm_eps: f64,
    /// Gemma's RMSNorm convention, `x · (1 + w)`, for every norm, the query and key norms
    /// included (else `x · w`).
    pub unit_offset_norms: bool,
    /// Biases on the query, key and value projections (Qwen2; `attention_bias` of Llama,
    /// Qwen3, Gemma, OLMo 2 and SmolLM3).
    pub qkv_bias: bool,
    /// A bias on the output projection (`attention_bias` of Llama, Qwen3, Gemma, OLMo 2 and
    /// SmolLM3).
    pub output_bias: bool,
    /// `mlp_bias` (Llama, SmolLM3).
    pub mlp_bias: bool,
    /// `rope_parameters`, or `rope_theta` and `rope_scaling`; Phi-3's `partial_rotary_factor`
    /// as its `rotary_dim`. Gemma 3: the RoPE of its full-attention layers
    /// (`rope_parameters.full_attention`).
    pub rope: RopeConfig,
    /// The RoPE of the layers with a window, where it is not [`rope`](Self::rope): Gemma 3's
    /// `rope_parameters.sliding_attention` (its sliding layers are exactly those with a
    /// window: a sliding layer without one is refused).
    pub sliding_rope: Option<RopeConfig>,
    /// Which layers rotate their queries and keys (SmolLM3's `no_rope_layers`).
    pub rope_layers: RopeLayers,
    /// Which layers attend through a sliding window.
    pub windows: Windows,
    /// RMSNorm of the queries and keys, with `rms_norm_eps`, before RoPE: per head (Qwen3's and
    /// Gemma 3's `q_norm`, `k_norm` of `head_dim`) or over the projected width (OLMo 2).
    pub qk_norm: Option<QkNormScope>,
    /// Where a block's norms sit.
    pub norms: BlockNorms,
    /// What multiplies `q · kᵀ`: Gemma's `query_pre_attn_scalar^-0.5`; `None` is
    /// `head_dim^-0.5`.
    pub attention_scale: Option<f64>,
    /// Soft-capping of the scaled scores before the mask, `c · tanh(s / c)`: Gemma 2's
    /// `attn_logit_softcapping` (50 when absent, `null` for none). transformers 5.24 reads Gemma
    /// 3's but never applies it, so neither does this crate.
    pub attention_softcap: Option<f64>,
    /// Soft-capping of the logits, `c · tanh(logits / c)`: Gemma's `final_logit_softcapping`
    /// (when absent, 30 for Gemma 2, none for Gemma 3; `null` for none).
    pub final_logit_softcap: Option<f64>,
    /// Gemma's token embeddings multiplied by `√hidden_size` (rounded to float32, as
    /// transformers does); the tied LM head reads them unscaled.
    pub scaled_embeddings: bool,
    /// Phi-3's fused tensors: `qkv_proj` (rows: queries, keys, values) and `gate_up_proj` (rows:
    /// gate, then up).
    pub fused_projections: bool,
    /// `tie_word_embeddings`: the LM head is the token embedding (default: true for SmolLM3 and
    /// Gemma).
    pub tie_word_embeddings: bool,
}

/// Where a block's RMSNorms sit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockNorms {
    /// Before attention (`input_layernorm`) and before the MLP (`post_attention_layernorm`).
    Pre,
    /// After attention (`post_attention_layernorm`) and after the MLP
    /// (`post_feedforward_layernorm`), none before (OLMo 2).
    Post,
    /// Before and after each: `input_layernorm`, `post_attention_layernorm`,
    /// `pre_feedforward_layernorm`, `post_feedforward_layernorm` (Gemma's sandwich).
    Sandwich,
}

impl LlamaConfig {
    pub(super) fn read(fields: &Fields, family: LlamaFamily) -> Result<Self, ConfigError> {
        use LlamaFamily::{Gemma2, Gemma3, Llama, Mistral, Olmo2, Phi3, Qwen2, Qwen3, SmolLm3};
        let gemma = family.is_gemma();
        let activation = if gemma {
            // Gemma reads `hidden_activation`; a `hidden_act` beside it (older hub configs
            // carry both) is ignored by transformers.
            read_hidden_activation(fields)?
        } else {
            if let Some(act) = fields.string("hidden_act")?
                && act != "silu"
            {
                return Err(ConfigError::Unsupported {
                    field: "hidden_act".into(),
                    value: format!("{act:?}"),
                    supported: "silu",
                });
            }
            Activation::Silu
        };
        if gemma {
            // transformers then attends both ways (and halves Gemma 3's window).
            fields.require_eq(
                "use_bidirectional_attention",
                false,
                "causal attention (a bidirectional mask is not implemented)",
            )?;
        }
        let width = fields.required("hidden_size")?;
        let num_heads = fields.required("num_attention_heads")?;
        let num_layers = fields.required("num_hidden_layers")?;
        let attention_bias = fields.bool("attention_bias")?.unwrap_or(false);
        let (qkv_bias, output_bias, mlp_bias) = match family {
            Llama | SmolLm3 => (
                attention_bias,
                attention_bias,
                fields.bool("mlp_bias")?.unwrap_or(false),
            ),
            Qwen3 | Gemma2 | Gemma3 | Olmo2 => (attention_bias, attention_bias, false),
            Qwen2 => (true, false, false),
            // Phi-3's projections never have biases (it has no `attention_bias`).
            Mistral | Phi3 => (false, false, false),
        };
        let head_dim = match fields.usize("head_dim")? {
            Some(head_dim) => head_dim,
            // Qwen3Config's and Gemma's dataclass defaults, which their attention then reads.
            None if family == Qwen3 => 128,
            None if gemma => 256,
            None if width.is_multiple_of(num_heads) => width / num_heads,
            None => {
                return Err(AttentionError::HeadsDoNotDivide {
                    output_dim: width,
                    num_heads,
                }
                .into());
            }
        };
        let (rope, sliding_rope) = if family == Gemma3 {
            let [full, sliding] = read_layer_type_ropes(fields, head_dim)?;
            sliding.validate(head_dim)?;
            (full, Some(sliding))
        } else {
            (read_rope(fields, family, head_dim)?, None)
        };
        rope.validate(head_dim)?;
        let rope_layers = read_rope_layers(fields, family, num_layers)?;
        let windows = read_windows(fields, family, num_layers, &rope_layers)?;
        let attention_scale = if gemma {
            let field = "query_pre_attn_scalar";
            let scalar = fields.positive(field)?.unwrap_or(256.0);
            let scale = scalar.powf(-0.5);
            if !(scale as f32).is_normal() {
                return Err(fields.type_error(
                    field,
                    "a positive number whose inverse square root float32 holds",
                    &Value::from(scalar),
                ));
            }
            Some(scale)
        } else {
            None
        };
        Ok(Self {
            family,
            vocab_size: fields.required("vocab_size")?,
            width,
            num_heads,
            num_kv_heads: fields.usize("num_key_value_heads")?.unwrap_or(if gemma {
                4
            } else {
                num_heads
            }),
            head_dim,
            num_layers,
            mlp_width: fields.required("intermediate_size")?,
            activation,
            max_positions: fields.required("max_position_embeddings")?,
            rms_norm_eps: fields
                .positive("rms_norm_eps")?
                .unwrap_or(family.default_rms_norm_eps()),
            unit_offset_norms: gemma,
            qkv_bias,
            output_bias,
            mlp_bias,
            rope,
            sliding_rope,
            rope_layers,
            windows,
            qk_norm: match family {
                Qwen3 | Gemma3 => Some(QkNormScope::Head),
                Olmo2 => Some(QkNormScope::Width),
                _ => None,
            },
            norms: match family {
                Olmo2 => BlockNorms::Post,
                Gemma2 | Gemma3 => BlockNorms::Sandwich,
                _ => BlockNorms::Pre,
            },
            attention_scale,
            // Gemma 3's `attn_logit_softcapping` is stored by transformers 5.24's attention but
            // never passed to the attention function: it changes nothing, and is not read.
            attention_softcap: match family {
                Gemma2 => fields.softcap("attn_logit_softcapping", Some(50.0))?,
                _ => None,
            },
            final_logit_softcap: match family {
                Gemma2 => fields.softcap("final_logit_softcapping", Some(30.0))?,
                Gemma3 => fields.softcap("final_logit_softcapping", None)?,
                _ => None,
            },
            scaled_embeddings: gemma,
            fused_projections: family == Phi3,
            tie_word_embeddings: fields
                .bool("tie_word_embeddings")?
                .unwrap_or(family == SmolLm3 || gemma),
        })
    }
}

/// Gemma's `hidden_activation` (default `gelu_pytorch_tanh`): the tanh GELU (`gelu_pytorch_tanh`,
/// `gelu_new`, `gelu_fast`: one formula) or the exact one (`gelu`).
pub(super) fn read_hidden_activation(fields: &Fields) -> Result<Activation, ConfigError> {
    match fields.string("hidden_activation")?.as_deref() {
        None | Some("gelu_pytorch_tanh" | "gelu_new" | "gelu_fast") => Ok(Activation::GeluTanh),
        Some("gelu") => Ok(Activation::Gelu),
        Some(other) => Err(ConfigError::Unsupported {
            field: "hidden_activation".into(),
            value: format!("{other:?}"),
            supported: "gelu_pytorch_tanh, gelu_new, gelu_fast, gelu",
        }),
    }
}
