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
