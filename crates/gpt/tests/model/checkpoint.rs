//! Checkpoints: a round trip, every way a config can disagree with its weights (each an error
//! naming the field, before anything is allocated), and mutated files that never panic the
//! loader. `FUZZ_CASES` sets the number of mutations (default 500: each loads a small model).

use std::path::{Path, PathBuf};

use attention_backends::NdArray;
use burn::prelude::*;
use gpt::checkpoint::{self, CheckpointError};
use gpt::{GptConfig, GptModel, named_parameters, parameter_shapes};
use proptest::prelude::*;

fn config() -> GptConfig {
    GptConfig::new(20, 8, 8, 2, 2).with_qkv_bias(true)
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("gpt-checkpoint-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A saved checkpoint of a seeded model, in `dir/ckpt`.
fn saved(dir: &Path, config: &GptConfig) -> (PathBuf, GptModel<NdArray>) {
    let device = Default::default();
    NdArray::seed(&device, 3);
    let model = config.init::<NdArray>(&device);
    let path = dir.join("ckpt");
    let output = checkpoint::output_dir("--out", &path, &[]).unwrap();
    checkpoint::save(&output, &model, config, |_| Ok(())).unwrap();
    (path, model)
}

fn load(dir: &Path) -> Result<GptModel<NdArray>, CheckpointError> {
    checkpoint::load::<NdArray>(dir, &Default::default())
}

fn edit_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join(checkpoint::CONFIG_FILE);
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut json);
    std::fs::write(path, json.to_string()).unwrap();
}

#[test]
fn a_checkpoint_loads_the_same_parameters() {
    let dir = scratch("round-trip");
    let (path, model) = saved(&dir, &config());
    let loaded = load(&path).unwrap();
    let before = named_parameters(&model);
    let after = named_parameters(&loaded);
    assert_eq!(before.len(), after.len());
    for ((key, a), (key_b, b)) in before.iter().zip(&after) {
        assert_eq!(key, key_b);
        assert_eq!(a, b, "{key}");
    }
}

#[test]
fn the_config_alone_predicts_every_parameter() {
    for config in [
        config(),
        config().with_qkv_bias(false),
        GptConfig::new(7, 5, 6, 3, 3),
    ] {
        let model = config.init::<NdArray>(&Default::default());
        let actual = parameter_shapes(&model);
        let predicted: Vec<(String, Vec<usize>)> = config
            .parameter_shapes()
            .into_iter()
            .map(|(key, shape, _)| (key, shape))
            .collect();
        assert_eq!(actual, predicted);
        let count: usize = actual
            .iter()
            .map(|(_, s)| s.iter().product::<usize>())
            .sum();
        assert_eq!(config.parameter_count(), Some(count));
    }
}

/// The names checkpoints have been written with since tiny-gpt's first: a model whose norms and
/// feed-forward became enum variants of the shared decoder still names its parameters this way,
/// so earlier checkpoints load.
#[test]
fn parameter_paths_are_those_of_earlier_checkpoints() {
    let model = GptConfig::new(20, 8, 8, 2, 1).init::<NdArray>(&Default::default());
    let paths: Vec<String> = parameter_shapes(&model)
        .into_iter()
        .map(|(path, _)| path)
        .collect();
    let expected = [
        "token_embedding.weight",
        "position_embedding.weight",
        "blocks.0.attention_norm.gamma",
        "blocks.0.attention_norm.beta",
        "blocks.0.attention.query_layer.weight",
        "blocks.0.attention.key_layer.weight",
        "blocks.0.attention.value_layer.weight",
        "blocks.0.attention.output_layer.weight",
        "blocks.0.attention.output_layer.bias",
        "blocks.0.feed_forward_norm.gamma",
        "blocks.0.feed_forward_norm.beta",
        "blocks.0.feed_forward.gate.weight",
        "blocks.0.feed_forward.up.weight",
        "blocks.0.feed_forward.down.weight",
        "final_norm.gamma",
        "final_norm.beta",
        "lm_head.weight",
    ];
    assert_eq!(paths, expected);
}

#[test]
fn a_config_that_disagrees_with_its_weights_names_the_field() {
    type Edit = fn(&mut serde_json::Value);
    let cases: [(&str, Edit, &str); 7] = [
        (
            "num_heads 0",
            |c| c["num_heads"] = 0.into(),
            "`num_heads` must be at least 1",
        ),
        (
            "heads do not divide",
            |c| c["num_heads"] = 3.into(),
            "must divide `d_model`",
        ),
        (
            "more layers than the weights",
            |c| c["num_layers"] = 3.into(),
            "holds",
        ),
        (
            "d_model of 1e9",
            |c| c["d_model"] = 1_000_000_000.into(),
            "token_embedding.weight",
        ),
        (
            "context of 1e12",
            |c| c["context_length"] = 1_000_000_000_000u64.into(),
            "position_embedding.weight",
        ),
        (
            "no QKV bias",
            |c| c["qkv_bias"] = false.into(),
            "has no place",
        ),
        (
            "a string for a size",
            |c| c["d_model"] = "wide".into(),
            "invalid type",
        ),
    ];
    for (what, edit, needle) in cases {
        let dir = scratch("disagree");
        let (path, _) = saved(&dir, &config());
        edit_config(&path, edit);
        let message = load(&path).map(drop).unwrap_err().to_string();
        assert!(message.contains(needle), "{what}: {message}");
    }
}

#[test]
fn a_directory_of_other_files_is_never_replaced() {
    let dir = scratch("foreign");
    let target = dir.join("notes");
    std::fs::create_dir(&target).unwrap();
    std::fs::write(target.join("thesis.txt"), "years of work").unwrap();
    let error = checkpoint::output_dir("--out", &target, &[]).unwrap_err();
    assert!(error.to_string().contains("thesis.txt"), "{error}");
    let file = dir.join("file");
    std::fs::write(&file, "data").unwrap();
    assert!(checkpoint::output_dir("--out", &file, &[]).is_err());
    assert_eq!(
        std::fs::read_to_string(target.join("thesis.txt")).unwrap(),
        "years of work"
    );
}

#[test]
fn saving_over_a_checkpoint_replaces_it_whole() {
    let dir = scratch("replace");
    let (path, _) = saved(&dir, &config());
    let bigger = GptConfig::new(20, 8, 8, 2, 3);
    let (again, model) = saved(&dir, &bigger);
    assert_eq!(path, again);
    let loaded = load(&path).unwrap();
    assert_eq!(loaded.blocks.len(), 3);
    assert_eq!(
        named_parameters(&loaded).len(),
        named_parameters(&model).len()
    );
    let leftovers: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(
        leftovers,
        vec![std::ffi::OsString::from("ckpt")],
        "no staging left behind"
    );
}

fn fuzz_cases() -> u32 {
    std::env::var("FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(500)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(fuzz_cases()))]

    #[test]
    fn mutated_checkpoints_never_panic(
        file in prop_oneof![Just(checkpoint::CONFIG_FILE), Just(checkpoint::WEIGHTS_FILE)],
        edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..4),
        truncate in proptest::option::of(any::<usize>()),
    ) {
        let dir = scratch("fuzz");
        let (path, _) = saved(&dir, &config());
        let target = path.join(file);
        let mut bytes = std::fs::read(&target).unwrap();
        for (at, value) in edits {
            let len = bytes.len();
            bytes[at % len] = value;
        }
        if let Some(at) = truncate {
            let len = bytes.len();
            bytes.truncate(at % len);
        }
        std::fs::write(&target, bytes).unwrap();
        let _ = load(&path);
    }
}
