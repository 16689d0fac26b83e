//! `config.json` as `save_pretrained` writes it, read into the architecture it names.
//!
//! Every field that changes what the model computes is read; one set to a value this crate does
//! not implement is an error naming it ([`ConfigError::Unsupported`]), never a silent default.
//! Fields that do not change the computation (dropout rates at inference, `summary_*`,
//! `initializer_range`, token ids, …) and `null`s are accepted.

use attention_core::{AttentionError, Llama3Scaling, RopeConfig, RopeScaling};
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
    #[error("model_type `{0}` is not supported (supported: gpt2, llama, mistral, qwen2)")]
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
    /// `LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM`.
    Llama(LlamaConfig),
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

/// Which member of the Llama family (they differ only in biases and windows, read into
/// [`LlamaConfig`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LlamaFamily {
    /// `model_type: "llama"`
    Llama,
    /// `model_type: "mistral"`
    Mistral,
    /// `model_type: "qwen2"`
    Qwen2,
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
    /// `num_key_value_heads` (default: `num_attention_heads`).
    pub num_kv_heads: usize,
    /// `head_dim` (default: `hidden_size / num_attention_heads`).
    pub head_dim: usize,
    /// `num_hidden_layers`
    pub num_layers: usize,
    /// `intermediate_size`: the SwiGLU MLP's hidden width.
    pub mlp_width: usize,
    /// `max_position_embeddings`: the longest sequence.
    pub max_positions: usize,
    /// `rms_norm_eps`
    pub rms_norm_eps: f64,
    /// Biases on the query, key and value projections (Qwen2; Llama's `attention_bias`).
    pub qkv_bias: bool,
    /// A bias on the output projection (Llama's `attention_bias`).
    pub output_bias: bool,
    /// `mlp_bias` (Llama).
    pub mlp_bias: bool,
    /// `rope_parameters`, or `rope_theta` and `rope_scaling`.
    pub rope: RopeConfig,
    /// Which layers attend through a sliding window.
    pub windows: Windows,
    /// `tie_word_embeddings`: the LM head is the token embedding.
    pub tie_word_embeddings: bool,
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
    /// One entry per layer (`layer_types`).
    PerLayer(Vec<Option<usize>>),
}

impl Windows {
    /// The window of layer `layer` (`None`: full causal attention).
    pub fn of_layer(&self, layer: usize) -> Option<usize> {
        match self {
            Self::All(window) => *window,
            Self::From { first, window } => (layer >= *first).then_some(*window),
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
        let config = match model_type.as_str() {
            "gpt2" => Self::Gpt2(Gpt2Config::read(&fields)?),
            "llama" => Self::Llama(LlamaConfig::read(&fields, LlamaFamily::Llama)?),
            "mistral" => Self::Llama(LlamaConfig::read(&fields, LlamaFamily::Mistral)?),
            "qwen2" => Self::Llama(LlamaConfig::read(&fields, LlamaFamily::Qwen2)?),
            other => return Err(ConfigError::UnknownModelType(other.to_string())),
        };
        Ok(config)
    }

    /// The architecture's name in messages.
    pub fn architecture(&self) -> &'static str {
        match self {
            Self::Gpt2(_) => "GPT-2",
            Self::Llama(_) => "Llama-family",
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
        if let Some(act) = fields.string("hidden_act")?
            && act != "silu"
        {
            return Err(ConfigError::Unsupported {
                field: "hidden_act".into(),
                value: format!("{act:?}"),
                supported: "silu",
            });
        }
        if let Some(factor) = fields.number("partial_rotary_factor")?
            && factor != 1.0
        {
            return Err(ConfigError::Unsupported {
                field: "partial_rotary_factor".into(),
                value: factor.to_string(),
                supported: "1.0: RoPE over the whole head",
            });
        }
        let width = fields.required("hidden_size")?;
        let num_heads = fields.required("num_attention_heads")?;
        let num_layers = fields.required("num_hidden_layers")?;
        let attention_bias = fields.bool("attention_bias")?.unwrap_or(false);
        let (qkv_bias, output_bias, mlp_bias) = match family {
            LlamaFamily::Llama => (
                attention_bias,
                attention_bias,
                fields.bool("mlp_bias")?.unwrap_or(false),
            ),
            LlamaFamily::Qwen2 => (true, false, false),
            LlamaFamily::Mistral => (false, false, false),
        };
        let head_dim = match fields.usize("head_dim")? {
            Some(head_dim) => head_dim,
            None if width.is_multiple_of(num_heads.max(1)) => width / num_heads.max(1),
            None => {
                return Err(AttentionError::HeadsDoNotDivide {
                    output_dim: width,
                    num_heads,
                }
                .into());
            }
        };
        let rope = read_rope(fields)?;
        rope.validate(head_dim)?;
        Ok(Self {
            family,
            vocab_size: fields.required("vocab_size")?,
            width,
            num_heads,
            num_kv_heads: fields.usize("num_key_value_heads")?.unwrap_or(num_heads),
            head_dim,
            num_layers,
            mlp_width: fields.required("intermediate_size")?,
            max_positions: fields.required("max_position_embeddings")?,
            rms_norm_eps: fields.positive("rms_norm_eps")?.unwrap_or(1e-6),
            qkv_bias,
            output_bias,
            mlp_bias,
            rope,
            windows: read_windows(fields, family, num_layers)?,
            tie_word_embeddings: fields.bool("tie_word_embeddings")?.unwrap_or(false),
        })
    }
}

/// transformers 5's `rope_parameters` (`rope_type`, `rope_theta`, scaling keys), or 4.x's
/// `rope_theta` and `rope_scaling`.
fn read_rope(fields: &Fields) -> Result<RopeConfig, ConfigError> {
    let parameters = match fields.get("rope_parameters") {
        Some(Value::Object(map)) => Some(map.clone()),
        Some(other) => return Err(fields.type_error("rope_parameters", "an object", other)),
        None => None,
    };
    let theta = match &parameters {
        Some(map) => Fields(map.clone()).number("rope_theta")?,
        None => fields.number("rope_theta")?,
    }
    .unwrap_or(10000.0);
    let scaling = match parameters.or_else(|| match fields.get("rope_scaling") {
        Some(Value::Object(map)) => Some(map.clone()),
        _ => None,
    }) {
        Some(map) => rope_scaling(&Value::Object(map))?,
        None => {
            if let Some(other) = fields.get("rope_scaling") {
                return Err(fields.type_error("rope_scaling", "an object or null", other));
            }
            RopeScaling::None
        }
    };
    Ok(RopeConfig::new().with_theta(theta).with_scaling(scaling))
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

/// Each layer's window: Mistral's `sliding_window` on every layer; Qwen2's on the layers that
/// `layer_types` marks `sliding_attention` (or, without `layer_types`, from `max_window_layers`
/// on, when `use_sliding_window` is true), as transformers builds them.
fn read_windows(
    fields: &Fields,
    family: LlamaFamily,
    num_layers: usize,
) -> Result<Windows, ConfigError> {
    let window = fields.usize("sliding_window")?;
    let window = match family {
        LlamaFamily::Llama => None,
        LlamaFamily::Mistral => window,
        LlamaFamily::Qwen2 => {
            window.filter(|_| fields.bool("use_sliding_window").ok().flatten() == Some(true))
        }
    };
    let sliding = |field: &str| {
        window.ok_or_else(|| ConfigError::Unsupported {
            field: field.into(),
            value: "\"sliding_attention\"".into(),
            supported: "sliding layers need `sliding_window` (and Qwen2's `use_sliding_window`)",
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
        None => {
            let first_sliding = match family {
                LlamaFamily::Qwen2 => fields.usize("max_window_layers")?.unwrap_or(0),
                _ => 0,
            };
            Ok(match window {
                Some(window) if first_sliding > 0 => Windows::From {
                    first: first_sliding,
                    window,
                },
                window => Windows::All(window),
            })
        }
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
