//! A valid `config.json` mutated at random — numbers to extremes, types swapped, fields removed
//! — loads or is refused, never panics or aborts; and what loads computes finite logits.
//! `FUZZ_CASES=N` runs more cases than the default.

use std::sync::atomic::{AtomicUsize, Ordering};

use attention_backends::NdArray;
use attention_core::weights::StateDict;
use burn::prelude::*;
use hf_models::{CausalLm, LmInput, ModelConfig};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use serde_json::{Value, json};
use test_support::fixture;

use crate::MODELS;

/// What a mutation puts in a field's place (`None`: the field is removed).
fn replacement() -> impl Strategy<Value = Option<Value>> {
    prop_oneof![
        Just(None),
        Just(Some(Value::Null)),
        Just(Some(json!(0))),
        Just(Some(json!(1))),
        Just(Some(json!(-1))),
        Just(Some(json!(3))),
        Just(Some(json!(u64::MAX))),
        Just(Some(json!(1u64 << 40))),
        Just(Some(json!(i64::MIN))),
        Just(Some(json!(1e308))),
        Just(Some(json!(-1e308))),
        Just(Some(json!(1e-308))),
        Just(Some(json!(0.5))),
        Just(Some(json!("x"))),
        Just(Some(json!(true))),
        Just(Some(json!([]))),
        Just(Some(json!(["sliding_attention", "full_attention"]))),
        Just(Some(json!({}))),
        Just(Some(json!({"rope_type": "llama3", "factor": 0.0}))),
        (0u64..200).prop_map(|n| Some(json!(n))),
    ]
}

/// Sets (or removes) field number `pick` (modulo the fields there are) of `config`, or of its
/// `rope_parameters` when `nested`.
fn mutate(config: &mut Value, pick: usize, nested: bool, value: Option<Value>) {
    let object = match config.get_mut("rope_parameters") {
        Some(Value::Object(inner)) if nested => inner,
        _ => config.as_object_mut().unwrap(),
    };
    let keys: Vec<String> = object.keys().cloned().collect();
    if keys.is_empty() {
        return;
    }
    let key = keys[pick % keys.len()].clone();
    match value {
        Some(value) => object.insert(key, value),
        None => object.remove(&key),
    };
}

/// The model of `text` with `weights`, and, when it loads, logits of a short prompt; counts
/// the configs that loaded in `loaded`.
fn load_and_run(
    text: &str,
    weights: &StateDict,
    loaded: &AtomicUsize,
) -> Result<(), TestCaseError> {
    let device = Default::default();
    let Ok(config) = ModelConfig::from_json(text) else {
        return Ok(());
    };
    let Ok(model) = CausalLm::<NdArray>::from_weights(config, weights.clone(), &device) else {
        return Ok(());
    };
    loaded.fetch_add(1, Ordering::Relaxed);
    let tokens = [1i64, 2, 3, 4];
    let input = LmInput {
        tokens: Tensor::from_data(TensorData::new(tokens.to_vec(), [1, 4]), &device),
        positions: Tensor::from_data(TensorData::new(vec![0i64, 1, 2, 3], [1, 4]), &device),
        key_padding: None,
        documents: None,
    };
    if let Ok(logits) = model.forward(&input) {
        let values = logits
            .into_data()
            .convert::<f32>()
            .into_vec::<f32>()
            .unwrap();
        prop_assert!(
            values.iter().all(|x| x.is_finite()),
            "a config that loads gave non-finite logits: {text}"
        );
    }
    Ok(())
}

#[test]
fn mutated_configs_load_or_are_refused_never_panic() {
    let cases = std::env::var("FUZZ_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(500);
    // The bf16 Llama's config is the f32 one's but for its dtype.
    for name in MODELS.iter().filter(|name| !name.contains("bf16")) {
        let dir = fixture(&format!("hf/{name}"));
        let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
        let config: Value = serde_json::from_str(&text).unwrap();
        let weights = StateDict::load(dir.join("model.safetensors")).unwrap();
        let mutations =
            proptest::collection::vec((any::<usize>(), any::<bool>(), replacement()), 1..4);
        let mut runner = TestRunner::new(Config {
            cases,
            failure_persistence: None,
            ..Config::default()
        });
        let loaded = AtomicUsize::new(0);
        runner
            .run(&mutations, |mutations| {
                let mut mutated = config.clone();
                for (pick, nested, value) in mutations {
                    mutate(&mut mutated, pick, nested, value);
                }
                load_and_run(&mutated.to_string(), &weights, &loaded)
            })
            .unwrap_or_else(|failure| panic!("{name}: {failure}"));
        // Mutations of fields that do not change the computation load: the forward pass and its
        // finiteness check really run.
        let loaded = loaded.into_inner();
        eprintln!("{name}: {loaded} of {cases} mutated configs loaded");
        assert!(loaded > 0, "{name}: no mutated config loaded");
    }
}
