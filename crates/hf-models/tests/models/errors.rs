//! A checkpoint directory or a request that does not fit is an error naming what is wrong, never
//! a model with silently wrong numbers.

use std::path::{Path, PathBuf};

use attention_backends::NdArray;
use burn::tensor::f16;
use hf_models::{
    CausalLm, GenerateConfig, GenerateError, LoadError, ModelConfig, Prompts, Sampling,
};
use serde_json::{Value, json};
use tensor_files::{Dtype, RawTensor, Tensors};
use test_support::fixture;

/// A copy of fixture model `name` in a temporary directory, its config changed by `edit`.
fn copy_with(name: &str, edit: impl FnOnce(&mut Value)) -> (tempfile::TempDir, PathBuf) {
    let source = fixture(&format!("hf/{name}"));
    let dir = tempfile::tempdir().unwrap();
    for file in ["config.json", "model.safetensors", "generation_config.json"] {
        std::fs::copy(source.join(file), dir.path().join(file)).unwrap();
    }
    let path = dir.path().join("config.json");
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(&path, config.to_string()).unwrap();
    let dir_path = dir.path().to_path_buf();
    (dir, dir_path)
}

fn load(dir: &Path) -> Result<CausalLm<NdArray>, LoadError> {
    CausalLm::<NdArray>::load(dir, &Default::default())
}

fn load_error(name: &str, edit: impl FnOnce(&mut Value)) -> String {
    let (_keep, dir) = copy_with(name, edit);
    load(&dir).unwrap_err().to_string()
}

/// Rewrites the weights of `dir` through `edit`.
fn edit_weights(dir: &Path, edit: impl FnOnce(&mut Tensors)) {
    let path = dir.join("model.safetensors");
    let mut tensors = tensor_files::read(&path).unwrap();
    edit(&mut tensors);
    std::fs::write(
        &path,
        tensor_files::safetensors::serialize(&tensors).unwrap(),
    )
    .unwrap();
}

/// A fixture model, an edit of its config, and what the error must name.
type ConfigCase = (&'static str, fn(&mut Value), &'static str);

/// An edit of a checkpoint's tensors, and what the error must name.
type TensorCase = (fn(&mut Tensors), &'static str);

/// A fixture model, an edit of its tensors, and what the error must name.
type FamilyTensorCase = (&'static str, fn(&mut Tensors), &'static str);

#[test]
fn config_values_that_change_the_computation_are_refused_by_name() {
    let cases: [ConfigCase; 35] = [
        (
            "llama_tiny_s1",
            |c| c["model_type"] = json!("falcon"),
            "model_type `falcon`",
        ),
        (
            "llama_tiny_s1",
            |c| c["hidden_act"] = json!("gelu"),
            "`hidden_act`",
        ),
        (
            "llama_tiny_s1",
            |c| c["partial_rotary_factor"] = json!(0.5),
            "`partial_rotary_factor`",
        ),
        (
            "llama_tiny_s1",
            |c| c["rope_parameters"]["rope_type"] = json!("yarn"),
            "yarn",
        ),
        (
            "llama_tiny_s1",
            |c| c["num_key_value_heads"] = json!(3),
            "3",
        ),
        (
            "llama_tiny_s1",
            |c| {
                c.as_object_mut().unwrap().remove("hidden_size");
            },
            "`hidden_size`",
        ),
        (
            "gpt2_tiny_s0",
            |c| c["scale_attn_by_inverse_layer_idx"] = json!(true),
            "`scale_attn_by_inverse_layer_idx`",
        ),
        (
            "gpt2_tiny_s0",
            |c| c["activation_function"] = json!("relu"),
            "`activation_function`",
        ),
        (
            "qwen2_tiny_s2",
            |c| c["layer_types"] = json!(["full_attention", "sliding_attention"]),
            "layer_types[1]",
        ),
        // Families not built here are named, not approximated: the multimodal Gemma 3.
        (
            "gemma3_s22",
            |c| c["model_type"] = json!("gemma3"),
            "`model_type` = \"gemma3\"",
        ),
        (
            "gemma3_s22",
            |c| c["vision_config"] = json!({"model_type": "siglip_vision_model"}),
            "`vision_config`",
        ),
        // Gemma reads `hidden_activation` (not `hidden_act`).
        (
            "gemma2_s21",
            |c| c["hidden_activation"] = json!("relu"),
            "`hidden_activation`",
        ),
        (
            "gemma2_s21",
            |c| c["use_bidirectional_attention"] = json!(true),
            "`use_bidirectional_attention`",
        ),
        (
            "gemma3_s22",
            |c| c["use_bidirectional_attention"] = json!(true),
            "`use_bidirectional_attention`",
        ),
        // A soft-cap or score scale the backend's float32 holds as 0 or infinity.
        (
            "gemma2_s21",
            |c| c["attn_logit_softcapping"] = json!(1e300),
            "`attn_logit_softcapping`",
        ),
        (
            "gemma2_s21",
            |c| c["final_logit_softcapping"] = json!(0),
            "`final_logit_softcapping`",
        ),
        (
            "gemma2_s21",
            |c| c["query_pre_attn_scalar"] = json!(1e-300),
            "`query_pre_attn_scalar`",
        ),
        // Gemma 3's RoPE per layer type: each one's type is checked, and keys that are not a
        // layer type (which transformers would ignore) are refused.
        (
            "gemma3_s22",
            |c| c["rope_parameters"]["full_attention"]["rope_type"] = json!("yarn"),
            "yarn",
        ),
        (
            "gemma3_s22",
            |c| c["rope_parameters"] = json!({"rope_theta": 10000.0}),
            "`rope_parameters.rope_theta`",
        ),
        (
            "gemma3_s22",
            |c| c["rope_parameters"]["sliding_attention"]["partial_rotary_factor"] = json!(0.5),
            "rope_parameters.sliding_attention.partial_rotary_factor",
        ),
        // Sliding layers need a window.
        (
            "gemma2_s21",
            |c| c["sliding_window"] = Value::Null,
            "layer_types[0]",
        ),
        (
            "gemma3_s22",
            |c| {
                c.as_object_mut().unwrap().remove("layer_types");
                c["sliding_window_pattern"] = json!(0);
            },
            "`sliding_window_pattern`",
        ),
        // Phi-3's long-context RoPE (and the names older configs gave it).
        (
            "phi3_s23",
            |c| c["rope_parameters"]["rope_type"] = json!("longrope"),
            "longrope",
        ),
        (
            "phi3_s23",
            |c| {
                c.as_object_mut().unwrap().remove("rope_parameters");
                c["rope_scaling"] =
                    json!({"type": "su", "short_factor": [1.0], "long_factor": [1.0]});
            },
            "rope_scaling.rope_type",
        ),
        (
            "phi3_s23",
            |c| c["rope_parameters"]["rope_type"] = json!("linear"),
            "rope_parameters.rope_type",
        ),
        // int(8 · 0.375) = 3 rotated features: not pairs.
        (
            "phi3_s23",
            |c| c["rope_parameters"]["partial_rotary_factor"] = json!(0.375),
            "partial_rotary_factor",
        ),
        // Only Phi-3 rotates part of a head; transformers 5 keeps the factor in rope_parameters.
        (
            "llama_tiny_s1",
            |c| c["rope_parameters"]["partial_rotary_factor"] = json!(0.5),
            "rope_parameters.partial_rotary_factor",
        ),
        (
            "olmo2_s24",
            |c| c["partial_rotary_factor"] = json!(0.5),
            "`partial_rotary_factor`",
        ),
        // RoPE per layer type is Gemma 3's alone.
        (
            "qwen3_s20",
            |c| {
                c["rope_parameters"] = json!({
                    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}
                });
            },
            "`rope_parameters`",
        ),
        // A sliding layer needs Qwen3's `use_sliding_window`, as transformers does.
        (
            "qwen3_s20",
            |c| c["layer_types"] = json!(["sliding_attention", "full_attention"]),
            "layer_types[0]",
        ),
        (
            "smollm3_s25",
            |c| c["no_rope_layers"] = json!([1, 0]),
            "`no_rope_layers`",
        ),
        (
            "smollm3_s25",
            |c| c["no_rope_layers"] = json!([1, 2, 1]),
            "no_rope_layers[1]",
        ),
        // How the weights are stored.
        (
            "llama_tiny_s1",
            |c| c["dtype"] = json!("int8"),
            "`dtype` = \"int8\"",
        ),
        (
            "llama_tiny_s1",
            |c| {
                c.as_object_mut().unwrap().remove("dtype");
                c["torch_dtype"] = json!("bool");
            },
            "`torch_dtype` = \"bool\"",
        ),
        (
            "qwen3_s20",
            |c| {
                c["quantization_config"] =
                    json!({"quant_method": "bitsandbytes", "load_in_4bit": true});
            },
            "`quantization_config`",
        ),
    ];
    for (name, edit, expected) in cases {
        let message = load_error(name, edit);
        assert!(
            message.contains(expected),
            "{name}: {message:?} should name {expected}"
        );
    }
}

#[test]
fn fields_that_do_not_change_the_computation_and_nulls_are_accepted() {
    let (_keep, dir) = copy_with("qwen2_tiny_s2", |c| {
        c["summary_type"] = json!("cls_index");
        c["bos_token_id"] = Value::Null;
        c["max_window_layers"] = json!(28);
        c["use_sliding_window"] = json!(false);
        c["sliding_window"] = json!(4096);
        c["attention_dropout"] = json!(0.1);
    });
    load(&dir).unwrap();
    // transformers 4.x spelling of the rotary settings.
    let (_keep, dir) = copy_with("llama_tiny_s1", |c| {
        c.as_object_mut().unwrap().remove("rope_parameters");
        c["rope_theta"] = json!(10000.0);
        c["rope_scaling"] = Value::Null;
    });
    load(&dir).unwrap();
    // `dtype` wins over `torch_dtype`, as in transformers; a checkpoint in bfloat16 says so.
    let (_keep, dir) = copy_with("qwen3_s20", |c| {
        c["dtype"] = json!("bfloat16");
        c["torch_dtype"] = json!("int8");
    });
    load(&dir).unwrap();
    // Phi-3's partial rotary factor at the top level (transformers 4.x, Phi-4-mini), and
    // SmolLM3's layers without RoPE as a rule instead of a list: the same models.
    let (_keep, dir) = copy_with("phi3_s23", |c| {
        c.as_object_mut().unwrap().remove("rope_parameters");
        c["rope_theta"] = json!(10000.0);
        c["partial_rotary_factor"] = json!(0.5);
    });
    let (_keep, rule) = copy_with("smollm3_s25", |c| {
        // Every 2nd layer (layer 1 of 3) without RoPE, as [1, 0, 1] says.
        c.as_object_mut().unwrap().remove("no_rope_layers");
        c["no_rope_layer_interval"] = json!(2);
    });
    // Gemma's layer types as its defaults give them (Gemma 2: sliding on even layers; Gemma 3:
    // every `sliding_window_pattern`-th layer full), Gemma 3's RoPE in 4.x's spelling, and
    // fields transformers 5.24 reads but does not apply (Gemma's `hidden_act`, Gemma 3's
    // `attn_logit_softcapping`).
    let (_keep, gemma2) = copy_with("gemma2_s21", |c| {
        c.as_object_mut().unwrap().remove("layer_types");
        c["hidden_act"] = json!("silu");
    });
    let (_keep, gemma3) = copy_with("gemma3_s22", |c| {
        let object = c.as_object_mut().unwrap();
        object.remove("layer_types");
        object.remove("rope_parameters");
        c["sliding_window_pattern"] = json!(3);
        c["rope_theta"] = json!(1_000_000.0);
        c["rope_local_base_freq"] = json!(10_000.0);
        c["attn_logit_softcapping"] = json!(50.0);
    });
    for (changed, original) in [
        (dir, "phi3_s23"),
        (rule, "smollm3_s25"),
        (gemma2, "gemma2_s21"),
        (gemma3, "gemma3_s22"),
    ] {
        let changed = greedy(&load(&changed).unwrap());
        let model = greedy(&load(&fixture(&format!("hf/{original}"))).unwrap());
        assert_same(changed, model, original);
    }
    let phi3 = load(&fixture("hf/phi3_s23")).unwrap();
    let ModelConfig::Llama(config) = phi3.config() else {
        panic!("Phi-3 is a Llama-family config");
    };
    assert_eq!(config.rope.rotary_dim, Some(4));
}

/// A few greedy tokens of a left-padded batch of two, and their step logits.
fn greedy(model: &CausalLm<NdArray>) -> (Vec<Vec<u32>>, Vec<f32>) {
    let prompts =
        Prompts::left_padded(&[vec![5, 17, 9], vec![12]], model.special_tokens().pad()).unwrap();
    let config = GenerateConfig {
        step_logits: true,
        ..model.greedy(4)
    };
    let generation = model
        .generate(&prompts, &config, &Default::default())
        .unwrap();
    let logits = generation
        .step_logits
        .expect("asked for")
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .unwrap();
    (generation.tokens, logits)
}

/// Two runs of [`greedy`] give the same tokens and, to 1e-6, the same logits.
fn assert_same(
    (tokens, logits): (Vec<Vec<u32>>, Vec<f32>),
    (want_tokens, want_logits): (Vec<Vec<u32>>, Vec<f32>),
    what: &str,
) {
    assert_eq!(tokens, want_tokens, "{what}: tokens");
    assert_eq!(logits.len(), want_logits.len(), "{what}: logits");
    let worst = logits
        .iter()
        .zip(&want_logits)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(worst <= 1e-6, "{what}: logits differ by {worst}");
}

/// Weights stored in float16 load as the values they hold (converted exactly, computed in the
/// backend's float type): a checkpoint in f16 gives what the same values stored in f32 give.
/// (`llama_bf16_s26`, stored in bfloat16, is checked against transformers in `fixtures.rs`.)
#[test]
fn half_precision_weights_load_as_the_values_they_hold() {
    let (_keep_half, half) = copy_with("llama_tiny_s1", |c| c["dtype"] = json!("float16"));
    let (_keep_full, full) = copy_with("llama_tiny_s1", |_| {});
    edit_weights(&half, |tensors| {
        for tensor in tensors.values_mut() {
            let bytes = tensor
                .to_f32()
                .unwrap()
                .into_iter()
                .flat_map(|v| f16::from_f32(v).to_le_bytes())
                .collect();
            *tensor = RawTensor::new(Dtype::F16, tensor.shape.clone(), bytes).unwrap();
        }
    });
    edit_weights(&full, |tensors| {
        for tensor in tensors.values_mut() {
            let values: Vec<f32> = tensor
                .to_f32()
                .unwrap()
                .into_iter()
                .map(|v| f16::from_f32(v).to_f32())
                .collect();
            *tensor = RawTensor::from_f32(tensor.shape.clone(), &values);
        }
    });
    // (Rounding the weights to f16 moves the logits by far more than `assert_same` allows.)
    assert_same(
        greedy(&load(&half).unwrap()),
        greedy(&load(&full).unwrap()),
        "f16 and f32 storage of the same values",
    );
}

#[test]
fn missing_misshaped_and_extra_tensors_are_named() {
    let cases: [TensorCase; 6] = [
        (
            |t| {
                t.remove("model.layers.1.mlp.up_proj.weight");
            },
            "model.layers.1.mlp.up_proj.weight",
        ),
        (
            |t| {
                t.remove("model.layers.0.self_attn.k_proj.weight");
            },
            "model.layers.0.self_attn.k_proj.weight",
        ),
        (
            |t| {
                let wrong = RawTensor::from_f32(vec![32, 16], &[0.0; 512]);
                t.insert("model.layers.0.self_attn.k_proj.weight".into(), wrong);
            },
            "model.layers.0.self_attn.k_proj.weight",
        ),
        (
            |t| {
                let extra = RawTensor::from_f32(vec![8], &[1.0; 8]);
                t.insert("model.layers.0.self_attn.q_norm.weight".into(), extra);
            },
            "q_norm",
        ),
        // Weights must be floats: an int or bool tensor is named.
        (
            |t| {
                let ints = RawTensor::new(Dtype::I32, vec![32], vec![0; 128]).unwrap();
                t.insert("model.norm.weight".into(), ints);
            },
            "`model.norm.weight` has dtype",
        ),
        (
            |t| {
                let bools = RawTensor::new(Dtype::Bool, vec![32], vec![1; 32]).unwrap();
                t.insert("model.layers.0.input_layernorm.weight".into(), bools);
            },
            "`model.layers.0.input_layernorm.weight` has dtype",
        ),
    ];
    for (edit, expected) in cases {
        let (_keep, dir) = copy_with("llama_tiny_s1", |_| {});
        edit_weights(&dir, edit);
        let message = load(&dir).unwrap_err().to_string();
        assert!(
            message.contains(expected),
            "{message:?} should name {expected}"
        );
    }
    // Each family's own tensors: a missing q/k norm or fused tensor, a norm where the family
    // has none, a bias the family does not have.
    let cases: [FamilyTensorCase; 7] = [
        (
            "qwen3_s20",
            |t| {
                t.remove("model.layers.1.self_attn.k_norm.weight");
            },
            "model.layers.1.self_attn.k_norm.weight",
        ),
        (
            "phi3_s23",
            |t| {
                t.remove("model.layers.0.mlp.gate_up_proj.weight");
            },
            "model.layers.0.mlp.gate_up_proj.weight",
        ),
        (
            "phi3_s23",
            |t| {
                let bias = RawTensor::from_f32(vec![64], &[0.0; 64]);
                t.insert("model.layers.0.self_attn.qkv_proj.bias".into(), bias);
            },
            "model.layers.0.self_attn.qkv_proj.bias",
        ),
        (
            "olmo2_s24",
            |t| {
                let norm = RawTensor::from_f32(vec![32], &[1.0; 32]);
                t.insert("model.layers.0.input_layernorm.weight".into(), norm);
            },
            "model.layers.0.input_layernorm.weight",
        ),
        // Gemma's four norms a block, Gemma 3's q/k norms, none in Gemma 2.
        (
            "gemma2_s21",
            |t| {
                t.remove("model.layers.2.pre_feedforward_layernorm.weight");
            },
            "model.layers.2.pre_feedforward_layernorm.weight",
        ),
        (
            "gemma3_s22",
            |t| {
                t.remove("model.layers.0.self_attn.q_norm.weight");
            },
            "model.layers.0.self_attn.q_norm.weight",
        ),
        (
            "gemma2_s21",
            |t| {
                let norm = RawTensor::from_f32(vec![16], &[0.0; 16]);
                t.insert("model.layers.0.self_attn.k_norm.weight".into(), norm);
            },
            "model.layers.0.self_attn.k_norm.weight",
        ),
    ];
    for (name, edit, expected) in cases {
        let (_keep, dir) = copy_with(name, |_| {});
        edit_weights(&dir, edit);
        let message = load(&dir).unwrap_err().to_string();
        assert!(
            message.contains(expected),
            "{name}: {message:?} should name {expected}"
        );
    }
    let (_keep, dir) = copy_with("llama_tiny_s1", |_| {});
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    assert!(matches!(load(&dir), Err(LoadError::NoWeights { .. })));
}

#[test]
fn sharded_checkpoints_load_as_the_single_file_does() {
    let (_keep, dir) = copy_with("gpt2_tiny_s0", |_| {});
    let tensors = tensor_files::read(&dir.join("model.safetensors")).unwrap();
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    let mut map = serde_json::Map::new();
    let (mut first, mut second) = (Tensors::new(), Tensors::new());
    for (i, (key, tensor)) in tensors.into_iter().enumerate() {
        if i % 2 == 0 { &mut first } else { &mut second }.insert(key, tensor);
    }
    for (file, part) in [
        ("model-00001-of-00002.safetensors", &first),
        ("model-00002-of-00002.safetensors", &second),
    ] {
        std::fs::write(
            dir.join(file),
            tensor_files::safetensors::serialize(part).unwrap(),
        )
        .unwrap();
        for key in part.keys() {
            map.insert(key.clone(), json!(file));
        }
    }
    let index = json!({"metadata": {}, "weight_map": map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    let sharded = load(&dir).unwrap();
    let single = load(&fixture("hf/gpt2_tiny_s0")).unwrap();
    let prompts = Prompts::left_padded(&[vec![1, 2, 3]], 0).unwrap();
    let device = Default::default();
    let run = |model: &CausalLm<NdArray>| {
        model
            .generate(&prompts, &model.greedy(3), &device)
            .unwrap()
            .tokens
    };
    assert_eq!(run(&sharded), run(&single));
    // An index that points outside the directory is refused.
    let index = json!({"weight_map": {"transformer.wte.weight": "../model.safetensors"}});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    assert!(
        load(&dir)
            .unwrap_err()
            .to_string()
            .contains("../model.safetensors")
    );
}

#[test]
fn bad_generation_requests_are_refused_before_any_work() {
    let model = load(&fixture("hf/llama_tiny_s1")).unwrap();
    let device = Default::default();
    let generate = |prompts: &Prompts, config: &GenerateConfig| {
        model.generate(prompts, config, &device).unwrap_err()
    };
    let greedy = model.greedy(4);
    let out_of_vocabulary = Prompts::left_padded(&[vec![1, 103]], 0).unwrap();
    assert!(matches!(
        generate(&out_of_vocabulary, &greedy),
        GenerateError::TokenOutOfRange {
            row: 0,
            column: 1,
            token: 103,
            vocab_size: 103
        }
    ));
    let prompts = Prompts::left_padded(&[vec![1; 61]], 0).unwrap();
    assert!(matches!(
        generate(&prompts, &greedy),
        GenerateError::TooLong {
            prompt: 61,
            new: 4,
            max_positions: 64
        }
    ));
    let hot = GenerateConfig {
        sampling: Sampling::Sample {
            temperature: -1.0,
            top_k: None,
            top_p: None,
            seed: 0,
        },
        ..greedy.clone()
    };
    assert!(
        generate(&Prompts::left_padded(&[vec![1]], 0).unwrap(), &hot)
            .to_string()
            .contains("temperature")
    );
    let right_padded = Prompts::from_padded(&[1, 2, 0], &[1, 1, 0], [1, 3]).unwrap_err();
    assert!(
        right_padded.to_string().contains("only left padding"),
        "{right_padded}"
    );
    let empty_row = Prompts::from_padded(&[0, 0], &[0, 0], [1, 2]).unwrap_err();
    assert!(empty_row.to_string().contains("all padding"), "{empty_row}");
    let negative = Prompts::from_padded(&[-5], &[1], [1, 1]).unwrap_err();
    assert!(
        negative
            .to_string()
            .contains("row 0, column 0 holds -5, which is no token id"),
        "{negative}"
    );
}

#[test]
fn sampling_with_a_seed_is_reproducible_and_differs_from_greedy() {
    let model = load(&fixture("hf/qwen2_tiny_s2")).unwrap();
    let device = Default::default();
    let prompts =
        Prompts::left_padded(&[vec![3, 4, 5], vec![9]], model.special_tokens().pad()).unwrap();
    let sample = |seed| {
        let config = GenerateConfig {
            sampling: Sampling::Sample {
                temperature: 1.5,
                top_k: Some(20),
                top_p: Some(0.95),
                seed,
            },
            ..model.greedy(12)
        };
        model.generate(&prompts, &config, &device).unwrap().tokens
    };
    assert_eq!(sample(1), sample(1));
    assert_ne!(sample(1), sample(2));
    let greedy = model
        .generate(&prompts, &model.greedy(12), &device)
        .unwrap()
        .tokens;
    assert_ne!(sample(1), greedy);
}

#[test]
fn a_row_that_ends_continues_with_the_pad_id() {
    let model = load(&fixture("hf/gpt2_tiny_s0")).unwrap();
    let device = Default::default();
    let prompts = Prompts::left_padded(&[vec![5, 6, 7, 8, 9], vec![1, 2]], 100).unwrap();
    let greedy = model.generate(&prompts, &model.greedy(4), &device).unwrap();
    // Row 0 continues with 82 (see the ndarray run of the fixtures): make 82 its end.
    let first_new = greedy.tokens[0][5];
    let mut eos_token_ids = model.special_tokens().eos.clone();
    eos_token_ids.push(first_new);
    let config = GenerateConfig {
        eos_token_ids,
        pad_token_id: 99,
        ..model.greedy(4)
    };
    let ended = model.generate(&prompts, &config, &device).unwrap();
    assert_eq!(ended.tokens[0][5..], [first_new, 99, 99, 99]);
    // Every row: after its first end id, only pads.
    for row in &ended.tokens {
        if let Some(end) = row[5..]
            .iter()
            .position(|t| config.eos_token_ids.contains(t))
        {
            assert!(row[5 + end + 1..].iter().all(|&t| t == 99), "{row:?}");
        }
    }
}
