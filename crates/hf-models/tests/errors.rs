//! A checkpoint directory or a request that does not fit is an error naming what is wrong, never
//! a model with silently wrong numbers.

use std::path::{Path, PathBuf};

use attention_backends::{NdArray, fixture};
use hf_models::{CausalLm, GenerateConfig, GenerateError, LoadError, Prompts, Sampling};
use serde_json::{Value, json};
use tensor_files::{RawTensor, Tensors};

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

#[test]
fn config_values_that_change_the_computation_are_refused_by_name() {
    let cases: [ConfigCase; 9] = [
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
}

#[test]
fn missing_misshaped_and_extra_tensors_are_named() {
    let cases: [TensorCase; 4] = [
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
            .generate(&prompts, &GenerateConfig::greedy(model, 3), &device)
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
    let greedy = GenerateConfig::greedy(&model, 4);
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
            ..GenerateConfig::greedy(&model, 12)
        };
        model.generate(&prompts, &config, &device).unwrap().tokens
    };
    assert_eq!(sample(1), sample(1));
    assert_ne!(sample(1), sample(2));
    let greedy = model
        .generate(&prompts, &GenerateConfig::greedy(&model, 12), &device)
        .unwrap()
        .tokens;
    assert_ne!(sample(1), greedy);
}

#[test]
fn a_row_that_ends_continues_with_the_pad_id() {
    let model = load(&fixture("hf/gpt2_tiny_s0")).unwrap();
    let device = Default::default();
    let prompts = Prompts::left_padded(&[vec![5, 6, 7, 8, 9], vec![1, 2]], 100).unwrap();
    let greedy = model
        .generate(&prompts, &GenerateConfig::greedy(&model, 4), &device)
        .unwrap();
    // Row 0 continues with 82 (see the ndarray run of the fixtures): make 82 its end.
    let first_new = greedy.tokens[0][5];
    let mut eos_token_ids = model.special_tokens().eos.clone();
    eos_token_ids.push(first_new);
    let config = GenerateConfig {
        eos_token_ids,
        pad_token_id: 99,
        ..GenerateConfig::greedy(&model, 4)
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
