//! Sliding windows as `config.json` gives them: one for every layer, per layer type, or none
//! ([`Windows`]).

use super::*;

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

/// Each layer's window, as transformers builds them: Mistral's and Phi-3's `sliding_window` on
/// every layer; Qwen2's and Qwen3's on the layers that `layer_types` marks `sliding_attention`
/// (or, without `layer_types`, from `max_window_layers`, default 28, on), when
/// `use_sliding_window` is true; SmolLM3's the same, its default sliding layers being those
/// without RoPE; Gemma's (default 4096; `null`, none) on the `sliding_attention` layers (without
/// `layer_types`, all but every 2nd in Gemma 2, all but every `sliding_window_pattern`-th,
/// default 6, in Gemma 3). Llama and OLMo 2 have no windows (transformers ignores their
/// `sliding_window`).
pub(super) fn read_windows(
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
