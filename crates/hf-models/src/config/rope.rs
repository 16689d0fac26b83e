//! Rotary embeddings as `config.json` gives them: theta, scaling, partial rotation, and the
//! layers that rotate ([`RopeLayers`]).

use super::*;

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

/// The rotary embedding: transformers 5's `rope_parameters` (`rope_type`, `rope_theta`, scaling
/// keys, `partial_rotary_factor`), or 4.x's `rope_scaling`, `rope_theta` and
/// `partial_rotary_factor`, combined as transformers does (`convert_rope_params_to_dict`): a
/// non-empty `rope_scaling` replaces `rope_parameters`, and a value inside the object wins over
/// the top-level one. Phi-3 takes only the default type, with `partial_rotary_factor` as the
/// rotary width; every other family rotates the whole head. (Gemma 3's, per layer type, is
/// [`read_layer_type_ropes`].)
pub(super) fn read_rope(
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
pub(super) const LAYER_TYPES: [&str; 2] = ["full_attention", "sliding_attention"];

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
pub(super) fn read_layer_type_ropes(
    fields: &Fields,
    head_dim: usize,
) -> Result<[RopeConfig; 2], ConfigError> {
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
pub(super) fn rope_from(
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
pub(super) fn rotary_dim(
    field: String,
    factor: f64,
    head_dim: usize,
) -> Result<Option<usize>, ConfigError> {
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
pub(super) fn read_rope_layers(
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
