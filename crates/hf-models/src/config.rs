//! `config.json` as `save_pretrained` writes it, read into the architecture it names.
//!
//! Every field that changes what the model computes is read; one set to a value this crate does
//! not implement is an error naming it ([`ConfigError::Unsupported`]), never a silent default.
//! Fields that do not change the computation (dropout rates at inference, `summary_*`,
//! `initializer_range`, token ids, …) and `null`s are accepted.

use attention_core::{AttentionError, Llama3Scaling, QkNormScope, RopeConfig, RopeScaling};
use gpt::Activation;
use serde_json::{Map, Value};
use thiserror::Error;

/// What is wrong with a `config.json`.
#[derive(Debug, Error)]
pub enum ConfigError {
    /// Not a JSON object.
    #[error("config.json is not a JSON object: {0}")]
    Json(String),
    /// `model_type` names an architecture this crate does not build.
    #[error(
        "model_type `{0}` is not supported (supported: gpt2, llama, mistral, qwen2, qwen3, gemma2, \
         gemma3_text, phi3, olmo2, smollm3)"
    )]
    UnknownModelType(String),
    /// A field the architecture needs is absent or `null`.
    #[error("config.json has no `{0}`")]
    Missing(&'static str),
    /// A field holds the wrong kind of value.
    #[error("config.json: `{field}` must be {expected}, found {found}")]
    Type {
        /// The field.
        field: String,
        /// What it must be.
        expected: &'static str,
        /// What it is.
        found: String,
    },
    /// A field is set to a value that changes the computation in a way not implemented here.
    #[error("config.json: `{field}` = {value} is not supported ({supported})")]
    Unsupported {
        /// The field.
        field: String,
        /// Its value, as JSON.
        value: String,
        /// What is supported.
        supported: &'static str,
    },
    /// A size the checkpoint's tensors contradict (checked before anything is allocated from
    /// it: a `num_hidden_layers` in the billions is this error, not an abort).
    #[error("config.json: `{field}` = {value} does not fit the weights: {found}")]
    Weights {
        /// The field.
        field: &'static str,
        /// Its value (a product of fields, as `num_attention_heads · head_dim`, when it is one).
        value: String,
        /// What the weights hold instead.
        found: String,
    },
    /// The sizes do not make a valid attention layer (heads that do not divide, …).
    #[error("config.json: {0}")]
    Attention(#[from] AttentionError),
    /// The RoPE scaling's `rope_type` (or `type`) names a scaling not implemented here.
    #[error("rope_type `{0}` is not supported (supported: default, linear, llama3)")]
    RopeType(String),
    /// A field of the RoPE scaling is absent or holds the wrong kind of value.
    #[error("rope scaling: `{field}` must be {expected}, found {found}")]
    RopeScaling {
        /// The field (`rope_scaling` for the whole value).
        field: &'static str,
        /// What it must be.
        expected: &'static str,
        /// What it is, as JSON (`nothing` when absent).
        found: String,
    },
}

/// The architecture and sizes of a causal language model.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelConfig {
    /// `GPT2LMHeadModel`.
    Gpt2(Gpt2Config),
    /// `LlamaForCausalLM` and the families that differ from it in a few fields
    /// ([`LlamaFamily`]).
    Llama(Box<LlamaConfig>),
}

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
    fn of_model_type(model_type: &str) -> Option<Self> {
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
    fn default_rms_norm_eps(self) -> f64 {
        match self {
            Self::Phi3 | Self::Olmo2 => 1e-5,
            _ => 1e-6,
        }
    }

    /// `rope_theta` when the config has none (Gemma 3: of its full-attention layers).
    fn default_rope_theta(self) -> f64 {
        match self {
            Self::SmolLm3 => 2_000_000.0,
            Self::Gemma3 => 1_000_000.0,
            _ => 10_000.0,
        }
    }

    /// Gemma 2 and 3: the families of Gemma's conventions (`1 + w` norms, scaled embeddings,
    /// `hidden_activation`, `query_pre_attn_scalar`).
    fn is_gemma(self) -> bool {
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

/// Which layers rotate their queries and keys, kept as a rule where `config.json` gives one (see
/// [`Windows`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RopeLayers {
    /// Every layer.
    All,
    /// Every layer but each `n`-th (layers `n − 1`, `2n − 1`, …): SmolLM3's
    /// `no_rope_layer_interval` when it has no `no_rope_layers`.
    AllButEvery(usize),
    /// One entry per layer (SmolLM3's `no_rope_layers`, where 1 is a layer with RoPE).
    PerLayer(Vec<bool>),
}

impl RopeLayers {
    /// Whether layer `layer` has RoPE.
    pub fn of_layer(&self, layer: usize) -> bool {
        match self {
            Self::All => true,
            Self::AllButEvery(n) => !(layer + 1).is_multiple_of(*n),
            Self::PerLayer(layers) => layers.get(layer).copied().unwrap_or(true),
        }
    }
}

/// Which layers of a model attend through a sliding window, as `config.json` says it: a rule
/// for every layer, or a list of one entry per layer. A rule is kept as a rule, so that a
/// `num_hidden_layers` far larger than the checkpoint allocates nothing before the weights
/// refute it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Windows {
    /// The same for every layer: `None` is full causal attention.
    All(Option<usize>),
    /// Full attention below layer `first`, `window` from it on (Qwen2's `max_window_layers`).
    From {
        /// The first windowed layer.
        first: usize,
        /// The window.
        window: usize,
    },
    /// `window` on every layer but each `every`-th (layers `every − 1`, `2 · every − 1`, …),
    /// which attend in full: Gemma's `layer_types` when it has none (every 2nd layer full in
    /// Gemma 2; every `sliding_window_pattern`-th, default 6, in Gemma 3).
    AllButEvery {
        /// The period of the full-attention layers.
        every: usize,
        /// The window.
        window: usize,
    },
    /// One entry per layer (`layer_types`).
    PerLayer(Vec<Option<usize>>),
}

impl Windows {
    /// The window of layer `layer` (`None`: full causal attention).
    pub fn of_layer(&self, layer: usize) -> Option<usize> {
        match self {
            Self::All(window) => *window,
            Self::From { first, window } => (layer >= *first).then_some(*window),
            Self::AllButEvery { every, window } => {
                (!(layer + 1).is_multiple_of(*every)).then_some(*window)
            }
            Self::PerLayer(windows) => windows.get(layer).copied().flatten(),
        }
    }
}

impl ModelConfig {
    /// Reads a `config.json`'s text.
    pub fn from_json(text: &str) -> Result<Self, ConfigError> {
        let value: Value =
            serde_json::from_str(text).map_err(|e| ConfigError::Json(e.to_string()))?;
        let Value::Object(map) = value else {
            return Err(ConfigError::Json("the top level is not an object".into()));
        };
        let fields = Fields(map);
        let model_type = fields
            .string("model_type")?
            .ok_or(ConfigError::Missing("model_type"))?;
        let family = match model_type.as_str() {
            "gpt2" => None,
            "gemma3" => {
                return Err(ConfigError::Unsupported {
                    field: "model_type".into(),
                    value: "\"gemma3\"".into(),
                    supported: "gemma3_text, Gemma 3's language model alone (the multimodal \
                                model's vision tower is not implemented)",
                });
            }
            other => Some(
                LlamaFamily::of_model_type(other)
                    .ok_or_else(|| ConfigError::UnknownModelType(other.to_string()))?,
            ),
        };
        check_storage(&fields)?;
        if let Some(value) = fields.get("vision_config") {
            return Err(ConfigError::Unsupported {
                field: "vision_config".into(),
                value: abbreviated(value),
                supported: "text-only models (a vision tower is not implemented)",
            });
        }
        Ok(match family {
            None => Self::Gpt2(Gpt2Config::read(&fields)?),
            Some(family) => Self::Llama(Box::new(LlamaConfig::read(&fields, family)?)),
        })
    }

    /// The architecture's name in messages.
    pub fn architecture(&self) -> &'static str {
        match self {
            Self::Gpt2(_) => "GPT-2",
            Self::Llama(config) => config.family.name(),
        }
    }

    /// The vocabulary size.
    pub fn vocab_size(&self) -> usize {
        match self {
            Self::Gpt2(config) => config.vocab_size,
            Self::Llama(config) => config.vocab_size,
        }
    }

    /// The longest sequence (prompt and generated tokens together).
    pub fn max_positions(&self) -> usize {
        match self {
            Self::Gpt2(config) => config.max_positions,
            Self::Llama(config) => config.max_positions,
        }
    }
}

/// The dtypes a checkpoint's weights may be stored in, as `config.json` names them.
const WEIGHT_DTYPES: [&str; 4] = ["float32", "bfloat16", "float16", "float64"];

/// How the weights are stored: `dtype` (transformers 5; it wins over 4.x's `torch_dtype`, as in
/// transformers) must be a float type — the model computes in the backend's float type whatever
/// its weights are stored in — and a `quantization_config` (quantized weights) is not
/// implemented.
fn check_storage(fields: &Fields) -> Result<(), ConfigError> {
    if let Some(value) = fields.get("quantization_config") {
        return Err(ConfigError::Unsupported {
            field: "quantization_config".into(),
            value: abbreviated(value),
            supported: "unquantized weights",
        });
    }
    let field = if fields.get("dtype").is_some() {
        "dtype"
    } else {
        "torch_dtype"
    };
    match fields.string(field)? {
        Some(dtype) if !WEIGHT_DTYPES.contains(&dtype.as_str()) => Err(ConfigError::Unsupported {
            field: field.into(),
            value: format!("{dtype:?}"),
            supported: "float32, bfloat16, float16, float64",
        }),
        _ => Ok(()),
    }
}

/// A JSON value for a message: its first 100 characters when it is long.
fn abbreviated(value: &Value) -> String {
    let value = value.to_string();
    if value.len() > 120 {
        value.chars().take(100).chain("…".chars()).collect()
    } else {
        value
    }
}

impl Gpt2Config {
    fn read(fields: &Fields) -> Result<Self, ConfigError> {
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

impl LlamaConfig {
    fn read(fields: &Fields, family: LlamaFamily) -> Result<Self, ConfigError> {
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
fn read_hidden_activation(fields: &Fields) -> Result<Activation, ConfigError> {
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

/// The rotary embedding: transformers 5's `rope_parameters` (`rope_type`, `rope_theta`, scaling
/// keys, `partial_rotary_factor`), or 4.x's `rope_scaling`, `rope_theta` and
/// `partial_rotary_factor`, combined as transformers does (`convert_rope_params_to_dict`): a
/// non-empty `rope_scaling` replaces `rope_parameters`, and a value inside the object wins over
/// the top-level one. Phi-3 takes only the default type, with `partial_rotary_factor` as the
/// rotary width; every other family rotates the whole head. (Gemma 3's, per layer type, is
/// [`read_layer_type_ropes`].)
fn read_rope(
    fields: &Fields,
    family: LlamaFamily,
    head_dim: usize,
) -> Result<RopeConfig, ConfigError> {
    let object = |field: &str| match fields.get(field) {
        Some(Value::Object(map)) => Ok(Some(map.clone())),
        Some(other) => Err(fields.type_error(field, "an object", other)),
        None => Ok(None),
    };
    let parameters = object("rope_parameters")?;
    let scaling = object("rope_scaling")?;
    let (name, map) = match (scaling, parameters) {
        (Some(map), _) if !map.is_empty() => ("rope_scaling", map),
        (_, Some(map)) => ("rope_parameters", map),
        (Some(map), None) => ("rope_scaling", map),
        (None, None) => ("rope_parameters", Map::new()),
    };
    if let Some(key) = LAYER_TYPES.into_iter().find(|key| map.contains_key(*key)) {
        return Err(ConfigError::Unsupported {
            field: name.into(),
            value: format!("an object keyed by layer type ({key:?}, …)"),
            supported: "one set of RoPE parameters for every layer (RoPE per layer type is \
                        Gemma 3's)",
        });
    }
    rope_from(
        name,
        map,
        fields,
        family,
        head_dim,
        ("rope_theta", family.default_rope_theta()),
    )
}

/// The layer types of `layer_types`, which also key Gemma 3's `rope_parameters`.
const LAYER_TYPES: [&str; 2] = ["full_attention", "sliding_attention"];

/// Gemma 3's two rotary embeddings, `[full_attention, sliding_attention]`: of its full-attention
/// layers and of its sliding ones, from `rope_parameters.full_attention` and
/// `rope_parameters.sliding_attention`, completed as transformers'
/// `Gemma3TextConfig.convert_rope_params_to_dict` completes them. A 4.x `rope_scaling` goes
/// into the full-attention layers' only (over their own keys); a missing (or `null`) object is
/// the default type; a missing θ is 4.x's top-level `rope_theta` (default 1 000 000) for the
/// full-attention layers, `rope_local_base_freq` (default 10 000) for the sliding ones. Any
/// other key of `rope_parameters` is refused: transformers would ignore it (a flat
/// `{"rope_theta": …}` does not reach any layer), so a file that has one says something the
/// model does not do.
fn read_layer_type_ropes(fields: &Fields, head_dim: usize) -> Result<[RopeConfig; 2], ConfigError> {
    let object = |field: &str| match fields.get(field) {
        Some(Value::Object(map)) => Ok(map.clone()),
        Some(other) => Err(fields.type_error(field, "an object", other)),
        None => Ok(Map::new()),
    };
    let parameters = object("rope_parameters")?;
    let scaling = object("rope_scaling")?;
    if let Some((key, value)) = parameters
        .iter()
        .find(|(key, _)| !LAYER_TYPES.contains(&key.as_str()))
    {
        return Err(ConfigError::Unsupported {
            field: format!("rope_parameters.{key}"),
            value: abbreviated(value),
            supported: "Gemma 3's RoPE parameters by layer type: `full_attention` and \
                        `sliding_attention` objects",
        });
    }
    let rope = |layer_type: &str, over: &Map<String, Value>, theta: (&str, f64)| {
        let name = format!("rope_parameters.{layer_type}");
        let mut map = match parameters.get(layer_type) {
            Some(Value::Object(map)) => map.clone(),
            None | Some(Value::Null) => Map::new(),
            Some(other) => return Err(fields.type_error(&name, "an object", other)),
        };
        map.extend(over.clone());
        rope_from(&name, map, fields, LlamaFamily::Gemma3, head_dim, theta)
    };
    Ok([
        rope(
            "full_attention",
            &scaling,
            ("rope_theta", LlamaFamily::Gemma3.default_rope_theta()),
        )?,
        rope(
            "sliding_attention",
            &Map::new(),
            ("rope_local_base_freq", 10_000.0),
        )?,
    ])
}

/// One rotary embedding from the object `map` (named `name` in messages): its `rope_theta`, or
/// else the top-level field `theta.0`, or else `theta.1`; its `partial_rotary_factor`, or else
/// the top-level one (Phi-3's rotary width; 1 in every other family); its scaling
/// ([`rope_scaling`]). Phi-3 takes only the default type.
fn rope_from(
    name: &str,
    map: Map<String, Value>,
    fields: &Fields,
    family: LlamaFamily,
    head_dim: usize,
    (theta_field, default_theta): (&str, f64),
) -> Result<RopeConfig, ConfigError> {
    if family == LlamaFamily::Phi3
        && let Some(kind) = map.get("rope_type").or_else(|| map.get("type"))
        && kind.as_str() != Some("default")
    {
        return Err(ConfigError::Unsupported {
            field: format!("{name}.rope_type"),
            value: kind.to_string(),
            supported: "default (Phi-3's longrope, written su or yarn by older configs, is not \
                        implemented)",
        });
    }
    let inner = Fields(map);
    let theta = match inner.number("rope_theta")? {
        Some(theta) => theta,
        None => fields.number(theta_field)?.unwrap_or(default_theta),
    };
    let partial = match inner.number("partial_rotary_factor")? {
        Some(factor) => Some((format!("{name}.partial_rotary_factor"), factor)),
        None => fields
            .number("partial_rotary_factor")?
            .map(|factor| ("partial_rotary_factor".to_string(), factor)),
    };
    let rotary_dim = match partial {
        Some((field, factor)) if family == LlamaFamily::Phi3 => {
            rotary_dim(field, factor, head_dim)?
        }
        Some((field, factor)) if factor != 1.0 => {
            return Err(ConfigError::Unsupported {
                field,
                value: factor.to_string(),
                supported: "1.0: RoPE over the whole head (only Phi-3 rotates part of it)",
            });
        }
        _ => None,
    };
    let scaling = rope_scaling(&Value::Object(inner.0))?;
    Ok(RopeConfig::new()
        .with_theta(theta)
        .with_scaling(scaling)
        .with_rotary_dim(rotary_dim))
}

/// Phi-3's rotary width, `int(head_dim · partial_rotary_factor)` (transformers truncates):
/// `None` for the whole head. A factor outside `(0, 1]`, or one that leaves an odd or empty
/// width, is refused.
fn rotary_dim(field: String, factor: f64, head_dim: usize) -> Result<Option<usize>, ConfigError> {
    // `as` saturates; the factor is at most 1, so the product is at most head_dim.
    let dim = (head_dim as f64 * factor) as usize;
    if !(factor > 0.0 && factor <= 1.0) || dim == 0 || !dim.is_multiple_of(2) {
        return Err(ConfigError::Unsupported {
            field,
            value: factor.to_string(),
            supported: "a factor in (0, 1] that leaves an even number of rotated features \
                        (int(head_dim · factor))",
        });
    }
    Ok((dim < head_dim).then_some(dim))
}

/// Which layers have RoPE: all of them, except in SmolLM3, whose `no_rope_layers` holds 1 for a
/// layer with RoPE and 0 for one without (without the list, every `no_rope_layer_interval`-th
/// layer, default 4, has none).
fn read_rope_layers(
    fields: &Fields,
    family: LlamaFamily,
    num_layers: usize,
) -> Result<RopeLayers, ConfigError> {
    if family != LlamaFamily::SmolLm3 {
        return Ok(RopeLayers::All);
    }
    match fields.get("no_rope_layers") {
        Some(Value::Array(flags)) => {
            // transformers only indexes the list: a longer one is read as far as the layers go.
            if flags.len() < num_layers {
                return Err(ConfigError::Type {
                    field: "no_rope_layers".into(),
                    expected: "at least one entry per layer (`num_hidden_layers`)",
                    found: format!("{} entries", flags.len()),
                });
            }
            flags[..num_layers]
                .iter()
                .enumerate()
                .map(|(i, flag)| match flag.as_u64() {
                    Some(0) => Ok(false),
                    Some(1) => Ok(true),
                    _ => Err(ConfigError::Unsupported {
                        field: format!("no_rope_layers[{i}]"),
                        value: flag.to_string(),
                        supported: "1 (the layer has RoPE) or 0 (it has none)",
                    }),
                })
                .collect::<Result<_, _>>()
                .map(RopeLayers::PerLayer)
        }
        Some(other) => Err(fields.type_error("no_rope_layers", "a list", other)),
        None => match fields.usize("no_rope_layer_interval")?.unwrap_or(4) {
            0 => Err(fields.type_error(
                "no_rope_layer_interval",
                "a positive whole number",
                &Value::from(0),
            )),
            interval => Ok(RopeLayers::AllButEvery(interval)),
        },
    }
}

/// Hugging Face's RoPE scaling, the object of 4.x's `rope_scaling` or of 5's `rope_parameters`
/// (`{"rope_type": "llama3", "factor": 8.0, …}`; `"type"` is accepted for `"rope_type"`, as
/// transformers 4 wrote it). A missing or `"default"` type is no scaling, `"linear"` and
/// `"llama3"` read their parameters, any other type is an error naming it; other keys
/// (`rope_theta`, …) are left to the caller.
pub fn rope_scaling(value: &Value) -> Result<RopeScaling, ConfigError> {
    let wrong = |field, expected, found: Option<&Value>| ConfigError::RopeScaling {
        field,
        expected,
        found: found.map_or_else(|| "nothing".to_string(), Value::to_string),
    };
    let Value::Object(object) = value else {
        return Err(wrong("rope_scaling", "an object", Some(value)));
    };
    let number = |field: &'static str| {
        let value = object.get(field);
        value
            .and_then(Value::as_f64)
            .ok_or_else(|| wrong(field, "a number", value))
    };
    let kind = match object.get("rope_type").or_else(|| object.get("type")) {
        None => "default",
        Some(Value::String(kind)) => kind.as_str(),
        Some(other) => return Err(wrong("rope_type", "a string", Some(other))),
    };
    match kind {
        "default" => Ok(RopeScaling::None),
        "linear" => Ok(RopeScaling::Linear {
            factor: number("factor")?,
        }),
        "llama3" => {
            let field = "original_max_position_embeddings";
            let original = object.get(field);
            Ok(RopeScaling::Llama3(Llama3Scaling {
                factor: number("factor")?,
                low_freq_factor: number("low_freq_factor")?,
                high_freq_factor: number("high_freq_factor")?,
                original_max_position_embeddings: original
                    .and_then(Value::as_u64)
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| wrong(field, "a whole number", original))?,
            }))
        }
        other => Err(ConfigError::RopeType(other.to_string())),
    }
}

/// Each layer's window, as transformers builds them: Mistral's and Phi-3's `sliding_window` on
/// every layer; Qwen2's and Qwen3's on the layers that `layer_types` marks `sliding_attention`
/// (or, without `layer_types`, from `max_window_layers`, default 28, on), when
/// `use_sliding_window` is true; SmolLM3's the same, its default sliding layers being those
/// without RoPE; Gemma's (default 4096; `null`, none) on the `sliding_attention` layers (without
/// `layer_types`, all but every 2nd in Gemma 2, all but every `sliding_window_pattern`-th,
/// default 6, in Gemma 3). Llama and OLMo 2 have no windows (transformers ignores their
/// `sliding_window`).
fn read_windows(
    fields: &Fields,
    family: LlamaFamily,
    num_layers: usize,
    rope_layers: &RopeLayers,
) -> Result<Windows, ConfigError> {
    use LlamaFamily::{Gemma2, Gemma3, Llama, Mistral, Olmo2, Phi3, Qwen2, Qwen3, SmolLm3};
    let window = fields.usize("sliding_window")?;
    let window = match family {
        Llama | Olmo2 => None,
        Mistral | Phi3 => window,
        // Gemma's dataclass default, when the field is absent (not when it is `null`).
        Gemma2 | Gemma3 if !fields.0.contains_key("sliding_window") => Some(4096),
        Gemma2 | Gemma3 => window,
        Qwen2 | Qwen3 | SmolLm3 => {
            window.filter(|_| fields.bool("use_sliding_window").ok().flatten() == Some(true))
        }
    };
    let sliding = |field: &str| {
        window.ok_or_else(|| ConfigError::Unsupported {
            field: field.into(),
            value: "\"sliding_attention\"".into(),
            supported: "sliding layers need `sliding_window` (and, in Qwen2, Qwen3 and \
                        SmolLM3, `use_sliding_window`)",
        })
    };
    match fields.get("layer_types") {
        Some(Value::Array(types)) => {
            if types.len() != num_layers {
                return Err(ConfigError::Type {
                    field: "layer_types".into(),
                    expected: "one entry per layer (`num_hidden_layers`)",
                    found: format!("{} entries", types.len()),
                });
            }
            types
                .iter()
                .enumerate()
                .map(|(i, kind)| match kind.as_str() {
                    Some("full_attention") => Ok(None),
                    Some("sliding_attention") => sliding(&format!("layer_types[{i}]")).map(Some),
                    _ => Err(ConfigError::Unsupported {
                        field: format!("layer_types[{i}]"),
                        value: kind.to_string(),
                        supported: "full_attention, sliding_attention",
                    }),
                })
                .collect::<Result<_, _>>()
                .map(Windows::PerLayer)
        }
        Some(other) => Err(fields.type_error("layer_types", "a list", other)),
        None => match (family, window) {
            (Gemma2 | Gemma3, window) => {
                let every = match family {
                    Gemma2 => 2,
                    _ => match fields.usize("sliding_window_pattern")?.unwrap_or(6) {
                        0 => {
                            return Err(fields.type_error(
                                "sliding_window_pattern",
                                "a positive whole number",
                                &Value::from(0),
                            ));
                        }
                        every => every,
                    },
                };
                match window {
                    // Every layer is a full-attention layer.
                    _ if every == 1 => Ok(Windows::All(None)),
                    Some(window) => Ok(Windows::AllButEvery { every, window }),
                    None => Err(ConfigError::Unsupported {
                        field: "sliding_window".into(),
                        value: "null".into(),
                        supported: "a window: without `layer_types`, Gemma's layers are \
                                    `sliding_attention` but for every 2nd (Gemma 2) or \
                                    `sliding_window_pattern`-th (Gemma 3)",
                    }),
                }
            }
            (Qwen2 | Qwen3, Some(window)) => {
                match fields.usize("max_window_layers")?.unwrap_or(28) {
                    0 => Ok(Windows::All(Some(window))),
                    first => Ok(Windows::From { first, window }),
                }
            }
            (SmolLm3, Some(window)) => match rope_layers {
                RopeLayers::PerLayer(has_rope) => Ok(Windows::PerLayer(
                    has_rope
                        .iter()
                        .map(|&has_rope| (!has_rope).then_some(window))
                        .collect(),
                )),
                _ => Err(ConfigError::Unsupported {
                    field: "use_sliding_window".into(),
                    value: "true".into(),
                    supported: "SmolLM3 windows given by `layer_types` or `no_rope_layers`",
                }),
            },
            (_, window) => Ok(Windows::All(window)),
        },
    }
}

/// A config's fields, `null`s read as absent.
struct Fields(Map<String, Value>);

impl Fields {
    fn get(&self, field: &str) -> Option<&Value> {
        self.0.get(field).filter(|value| !value.is_null())
    }

    fn type_error(&self, field: &str, expected: &'static str, found: &Value) -> ConfigError {
        ConfigError::Type {
            field: field.into(),
            expected,
            found: found.to_string(),
        }
    }

    fn usize(&self, field: &str) -> Result<Option<usize>, ConfigError> {
        self.get(field)
            .map(|value| {
                value
                    .as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| self.type_error(field, "a whole number", value))
            })
            .transpose()
    }

    fn required(&self, field: &'static str) -> Result<usize, ConfigError> {
        match self.usize(field)? {
            Some(0) => Err(self.type_error(field, "a positive whole number", &Value::from(0))),
            Some(n) => Ok(n),
            None => Err(ConfigError::Missing(field)),
        }
    }

    fn number(&self, field: &str) -> Result<Option<f64>, ConfigError> {
        self.get(field)
            .map(|value| {
                value
                    .as_f64()
                    .ok_or_else(|| self.type_error(field, "a number", value))
            })
            .transpose()
    }

    fn positive(&self, field: &str) -> Result<Option<f64>, ConfigError> {
        match self.number(field)? {
            Some(x) if !(x.is_finite() && x > 0.0) => {
                Err(self.type_error(field, "a positive number", &Value::from(x)))
            }
            other => Ok(other),
        }
    }

    /// A soft-cap: `default` when the field is absent, none when it is `null`, else a positive
    /// number that float32 holds as a normal number (a cap the backend's float32 holds as 0 or
    /// infinity would make the logits NaN).
    fn softcap(&self, field: &str, default: Option<f64>) -> Result<Option<f64>, ConfigError> {
        if !self.0.contains_key(field) {
            return Ok(default);
        }
        match self.positive(field)? {
            Some(cap) if !(cap as f32).is_normal() => Err(self.type_error(
                field,
                "a positive number within float32's normal range",
                &Value::from(cap),
            )),
            cap => Ok(cap),
        }
    }

    fn bool(&self, field: &str) -> Result<Option<bool>, ConfigError> {
        self.get(field)
            .map(|value| {
                value
                    .as_bool()
                    .ok_or_else(|| self.type_error(field, "true or false", value))
            })
            .transpose()
    }

    fn string(&self, field: &str) -> Result<Option<String>, ConfigError> {
        self.get(field)
            .map(|value| {
                value
                    .as_str()
                    .map(str::to_string)
                    .ok_or_else(|| self.type_error(field, "a string", value))
            })
            .transpose()
    }

    /// Errors when `field` is present with a value other than `supported`.
    fn require_eq(
        &self,
        field: &str,
        supported: bool,
        what: &'static str,
    ) -> Result<(), ConfigError> {
        match self.bool(field)? {
            Some(value) if value != supported => Err(ConfigError::Unsupported {
                field: field.into(),
                value: value.to_string(),
                supported: what,
            }),
            _ => Ok(()),
        }
    }
}

/// The token ids generation needs: `eos_token_id` (one id or a list) and `pad_token_id`, from
/// `config.json` and, overriding it, `generation_config.json`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    /// Ids that end a sequence.
    pub eos: Vec<u32>,
    /// The padding id, if the checkpoint names one.
    pub pad: Option<u32>,
}

impl SpecialTokens {
    /// The pad id: `pad_token_id`, else the first end-of-sequence id (what transformers'
    /// `generate` falls back to), else 0.
    pub fn pad(&self) -> u32 {
        self.pad.or(self.eos.first().copied()).unwrap_or(0)
    }

    /// Reads the ids of a config file's text over `self` (fields it does not set are kept).
    pub fn update_from_json(&mut self, text: &str) -> Result<(), ConfigError> {
        let value: Value =
            serde_json::from_str(text).map_err(|e| ConfigError::Json(e.to_string()))?;
        let Value::Object(map) = value else {
            return Err(ConfigError::Json("the top level is not an object".into()));
        };
        let fields = Fields(map);
        let id = |value: &Value, field: &str| {
            value
                .as_u64()
                .and_then(|id| u32::try_from(id).ok())
                .ok_or_else(|| fields.type_error(field, "a token id or a list of them", value))
        };
        match fields.get("eos_token_id") {
            Some(Value::Array(ids)) => {
                self.eos = ids
                    .iter()
                    .map(|v| id(v, "eos_token_id"))
                    .collect::<Result<_, _>>()?;
            }
            Some(value) => self.eos = vec![id(value, "eos_token_id")?],
            None => {}
        }
        if let Some(value) = fields.get("pad_token_id") {
            self.pad = Some(id(value, "pad_token_id")?);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn rope_scaling_reads_default_linear_and_llama3() {
        assert_eq!(rope_scaling(&json!({})).unwrap(), RopeScaling::None);
        assert_eq!(
            rope_scaling(&json!({"rope_type": "default", "rope_theta": 10000.0})).unwrap(),
            RopeScaling::None
        );
        // transformers 4 wrote `type`.
        assert_eq!(
            rope_scaling(&json!({"type": "linear", "factor": 2.0})).unwrap(),
            RopeScaling::Linear { factor: 2.0 }
        );
        let llama3 = json!({
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192
        });
        assert_eq!(
            rope_scaling(&llama3).unwrap(),
            RopeScaling::Llama3(Llama3Scaling {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192,
            })
        );
    }

    /// A minimal config of `model_type` with `extra` fields, read into a Llama-family config.
    fn llama_family(model_type: &str, extra: Value) -> Result<LlamaConfig, ConfigError> {
        let mut config = json!({
            "model_type": model_type,
            "vocab_size": 100,
            "hidden_size": 32,
            "num_attention_heads": 4,
            "num_hidden_layers": 8,
            "intermediate_size": 64,
            "max_position_embeddings": 128
        });
        for (key, value) in extra.as_object().unwrap() {
            config[key] = value.clone();
        }
        match ModelConfig::from_json(&config.to_string())? {
            ModelConfig::Llama(config) => Ok(*config),
            other => panic!("{other:?}"),
        }
    }

    /// What each family takes when `config.json` leaves a field out: transformers 5.24's
    /// dataclass defaults (`configuration_<family>.py`).
    #[test]
    fn families_take_transformers_defaults() {
        let qwen3 = llama_family("qwen3", json!({})).unwrap();
        assert_eq!(qwen3.head_dim, 128);
        assert_eq!(qwen3.qk_norm, Some(QkNormScope::Head));
        assert_eq!(qwen3.rms_norm_eps, 1e-6);
        assert!(!qwen3.tie_word_embeddings);
        let phi3 = llama_family("phi3", json!({})).unwrap();
        assert_eq!((phi3.head_dim, phi3.rms_norm_eps), (8, 1e-5));
        assert_eq!(phi3.rope.rotary_dim, None);
        assert!(phi3.fused_projections && !phi3.qkv_bias);
        let olmo2 = llama_family("olmo2", json!({"sliding_window": 4})).unwrap();
        assert_eq!(olmo2.norms, BlockNorms::Post);
        assert_eq!(olmo2.qk_norm, Some(QkNormScope::Width));
        assert_eq!(olmo2.rms_norm_eps, 1e-5);
        // transformers ignores OLMo 2's `sliding_window`.
        assert_eq!(olmo2.windows, Windows::All(None));
        let smollm3 = llama_family("smollm3", json!({})).unwrap();
        assert_eq!(smollm3.rope.theta, 2_000_000.0);
        assert!(smollm3.tie_word_embeddings);
        // Every 4th layer without RoPE: layers 3 and 7 of 8.
        let nope: Vec<usize> = (0..8)
            .filter(|&i| !smollm3.rope_layers.of_layer(i))
            .collect();
        assert_eq!(nope, [3, 7]);
        // With windows on and no `layer_types`, SmolLM3's sliding layers are its NoPE layers.
        let windowed = llama_family(
            "smollm3",
            json!({"use_sliding_window": true, "sliding_window": 16,
                   "no_rope_layers": [1, 1, 1, 0, 1, 1, 1, 0]}),
        )
        .unwrap();
        let windows: Vec<Option<usize>> = (0..8).map(|i| windowed.windows.of_layer(i)).collect();
        assert_eq!(windows[3], Some(16));
        assert_eq!(windows.iter().flatten().count(), 2);
        // Qwen2 and Qwen3 window layers from `max_window_layers` (default 28) on.
        let qwen3 = llama_family(
            "qwen3",
            json!({"use_sliding_window": true, "sliding_window": 16, "max_window_layers": 6}),
        )
        .unwrap();
        assert_eq!(
            qwen3.windows,
            Windows::From {
                first: 6,
                window: 16
            }
        );
    }

    /// Gemma 2's and Gemma 3's defaults (`configuration_gemma2.py`, `configuration_gemma3.py`
    /// of transformers 5.24), and what `null` turns off.
    #[test]
    fn gemma_takes_transformers_defaults() {
        let gemma2 = llama_family("gemma2", json!({})).unwrap();
        assert_eq!((gemma2.head_dim, gemma2.num_kv_heads), (256, 4));
        assert_eq!(gemma2.attention_scale, Some(256f64.powf(-0.5)));
        assert_eq!(gemma2.attention_softcap, Some(50.0));
        assert_eq!(gemma2.final_logit_softcap, Some(30.0));
        assert_eq!(gemma2.activation, Activation::GeluTanh);
        assert_eq!(gemma2.norms, BlockNorms::Sandwich);
        assert_eq!(gemma2.qk_norm, None);
        assert!(gemma2.unit_offset_norms && gemma2.scaled_embeddings);
        assert!(gemma2.tie_word_embeddings);
        // Without `layer_types`: sliding on even layers, window 4096.
        assert_eq!(
            gemma2.windows,
            Windows::AllButEvery {
                every: 2,
                window: 4096
            }
        );
        assert_eq!(gemma2.windows.of_layer(0), Some(4096));
        assert_eq!(gemma2.windows.of_layer(1), None);
        let uncapped = llama_family(
            "gemma2",
            json!({"attn_logit_softcapping": null, "final_logit_softcapping": null,
                   "hidden_act": "relu", "hidden_activation": "gelu"}),
        )
        .unwrap();
        assert_eq!(uncapped.attention_softcap, None);
        assert_eq!(uncapped.final_logit_softcap, None);
        // Gemma reads `hidden_activation`; `hidden_act` is ignored, as in transformers.
        assert_eq!(uncapped.activation, Activation::Gelu);
        let gemma3 = llama_family("gemma3_text", json!({})).unwrap();
        assert_eq!(gemma3.attention_softcap, None);
        assert_eq!(gemma3.final_logit_softcap, None);
        assert_eq!(gemma3.qk_norm, Some(QkNormScope::Head));
        assert_eq!(gemma3.rope.theta, 1_000_000.0);
        assert_eq!(
            gemma3.sliding_rope.as_ref().map(|r| r.theta),
            Some(10_000.0)
        );
        let windowed: Vec<usize> = (0..8)
            .filter(|&i| gemma3.windows.of_layer(i).is_some())
            .collect();
        assert_eq!(windowed, [0, 1, 2, 3, 4, 6, 7]);
        // transformers 5.24 stores Gemma 3's `attn_logit_softcapping` but never applies it.
        let ignored = llama_family("gemma3_text", json!({"attn_logit_softcapping": 50.0})).unwrap();
        assert_eq!(ignored.attention_softcap, None);
        // 4.x spelling: `rope_scaling` on the full-attention layers only, their θ from
        // `rope_theta`, the sliding layers' from `rope_local_base_freq`.
        let old = llama_family(
            "gemma3_text",
            json!({"rope_theta": 2e6, "rope_local_base_freq": 5e4,
                   "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                   "sliding_window_pattern": 4, "sliding_window": 16}),
        )
        .unwrap();
        assert_eq!(old.rope.theta, 2e6);
        assert_eq!(old.rope.scaling, RopeScaling::Linear { factor: 8.0 });
        let sliding = old.sliding_rope.clone().unwrap();
        assert_eq!((sliding.theta, sliding.scaling), (5e4, RopeScaling::None));
        let windows: Vec<Option<usize>> = (0..4).map(|i| old.windows.of_layer(i)).collect();
        assert_eq!(windows, [Some(16), Some(16), Some(16), None]);
        // Each layer takes the RoPE of its type.
        assert_eq!(old.attention(0).rope.map(|r| r.theta), Some(5e4));
        assert_eq!(old.attention(3).rope.map(|r| r.theta), Some(2e6));
    }

    /// transformers' `convert_rope_params_to_dict`: a non-empty `rope_scaling` replaces
    /// `rope_parameters`; a value inside the object wins over the top-level one.
    #[test]
    fn rope_settings_combine_as_transformers_combines_them() {
        let llama = llama_family(
            "llama",
            json!({"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
                   "rope_scaling": {"rope_type": "linear", "factor": 2.0},
                   "rope_theta": 20000.0}),
        )
        .unwrap();
        assert_eq!(llama.rope.scaling, RopeScaling::Linear { factor: 2.0 });
        assert_eq!(llama.rope.theta, 20000.0);
        let phi3 = llama_family(
            "phi3",
            json!({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.75},
                   "partial_rotary_factor": 0.5}),
        )
        .unwrap();
        // int(8 · 0.75) = 6 of 8 features turn.
        assert_eq!(phi3.rope.rotary_dim, Some(6));
        let error = llama_family(
            "phi3",
            json!({"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0]}}),
        )
        .unwrap_err();
        assert!(
            error
                .to_string()
                .contains("`rope_parameters.rope_type` = \"longrope\""),
            "{error}"
        );
    }

    #[test]
    fn rope_scaling_names_what_is_wrong() {
        let error = |value: Value| rope_scaling(&value).unwrap_err();
        let yarn = error(json!({"rope_type": "yarn", "factor": 4.0}));
        assert!(matches!(&yarn, ConfigError::RopeType(kind) if kind == "yarn"));
        assert!(
            yarn.to_string()
                .contains("rope_type `yarn` is not supported"),
            "{yarn}"
        );
        assert!(matches!(
            error(json!({"rope_type": "linear"})),
            ConfigError::RopeScaling { field: "factor", found, .. } if found == "nothing"
        ));
        assert!(matches!(
            error(json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": -1})),
            ConfigError::RopeScaling { field: "original_max_position_embeddings", found, .. }
                if found == "-1"
        ));
        assert!(matches!(
            error(json!({"rope_type": 3})),
            ConfigError::RopeScaling {
                field: "rope_type",
                ..
            }
        ));
        assert!(matches!(
            error(json!([1.0])),
            ConfigError::RopeScaling {
                field: "rope_scaling",
                ..
            }
        ));
    }
}
