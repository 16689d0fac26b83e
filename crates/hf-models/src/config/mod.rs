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

mod fields;
mod gpt2;
mod llama;
mod rope;
mod special_tokens;
#[cfg(test)]
mod tests;
mod windows;

use fields::Fields;
pub use gpt2::Gpt2Config;
pub use llama::{BlockNorms, LlamaConfig, LlamaFamily};
pub use rope::{RopeLayers, rope_scaling};
use rope::{read_layer_type_ropes, read_rope, read_rope_layers};
pub use special_tokens::SpecialTokens;
pub use windows::Windows;
use windows::read_windows;

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
