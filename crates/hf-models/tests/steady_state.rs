//! A decoding step on the GPU, after the first ones, waits for the device only to read back its
//! ids and compiles nothing: GPT-2 and a Llama with grouped heads from the fixtures, a batch of
//! two, on Burn's fused wgpu (lavapipe in CI). Its own binary: the compile counter is the
//! process's logger, and no other test may compile beside it.

use attention_backends::{Wgpu, compiles};
use hf_models::{CausalLm, GenerateConfig, Prompts};
use test_support::fixture;

#[test]
fn decoding_steps_read_back_only_their_ids_and_compile_nothing() {
    let Some(device) = test_support::wgpu_device_for_test("steady-state decoding") else {
        return;
    };
    compiles::install().expect("the first logger of this binary");
    for model in ["gpt2_tiny_s0", "llama_tiny_s1"] {
        let lm = CausalLm::<Wgpu>::load(fixture(&format!("hf/{model}")), &device).unwrap();
        let prompts = Prompts::left_padded(&[vec![5, 17, 9, 4], vec![12, 3, 8, 2]], 0).unwrap();
        let generate = |new| {
            let config = GenerateConfig {
                eos_token_ids: Vec::new(),
                ..lm.greedy(new)
            };
            let syncs = attention_core::device_syncs();
            let generation = lm.generate(&prompts, &config, &device).unwrap();
            (generation.reads, attention_core::device_syncs() - syncs)
        };
        // The prompt's pass and the first steps compile their kernels.
        let (reads_of_two, syncs_of_two) = generate(2);
        let compiled = compiles::counted();
        let new = 14;
        let (reads, syncs) = generate(new);
        let steady = compiles::counted().total() - compiled.total();
        assert_eq!(syncs, 0, "{model}: the caches waited for the device");
        assert_eq!(syncs_of_two, 0, "{model}");
        let per_token = (reads - reads_of_two) as f64 / (new - 2) as f64;
        assert!(per_token <= 1.0, "{model}: {per_token} read-backs a token");
        assert_eq!(
            steady, 0,
            "{model}: steps 3..{new} compiled or tuned {steady} times"
        );
        // The counter counts: a new shape (a batch of three) compiles.
        let before = compiles::counted().total();
        let three = Prompts::left_padded(&[vec![5], vec![6], vec![7]], 0).unwrap();
        lm.generate(&three, &lm.greedy(2), &device).unwrap();
        assert!(
            compiles::counted().total() > before,
            "{model}: nothing counted"
        );
    }
}
