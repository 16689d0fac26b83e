//! Models in half precision on the GPU backend (Burn's fused wgpu in f16; lavapipe has
//! `SHADER_F16`) against transformers' float32 fixtures.
//!
//! Its own binary, on purpose: in a process where a model had run in f16 on the wgpu device, the
//! fixture tests of f32 models on that device then failed their 1e-4 bound by errors of about
//! 1e-3 (f16's size) — even when the f16 model ran on the unfused backend, and not when the f16
//! model came after. Some cache of the device's runtime carries what the f16 run chose over to
//! the f32 one; not yet found (BENCHMARKS / docs/precision.md say so).

use burn::prelude::*;
use hf_models::{CausalLm, GenerateConfig, Prompts};
use tensor_files::Tensors;
use test_support::fixture;

/// The fixture directories this test loads.
const MODELS: [&str; 2] = ["llama_tiny_s1", "gpt2_tiny_s0"];

struct Expected {
    tensors: Tensors,
}

impl Expected {
    fn read(model: &str) -> Self {
        let path = fixture(&format!("hf/{model}/expected.safetensors"));
        Self {
            tensors: tensor_files::read(&path).unwrap(),
        }
    }

    fn ints(&self, key: &str) -> (Vec<i64>, Vec<usize>) {
        let raw = &self.tensors[key];
        (raw.to_i64().expect("int64"), raw.shape.clone())
    }

    fn floats(&self, key: &str) -> (Vec<f32>, Vec<usize>) {
        let raw = &self.tensors[key];
        (raw.to_f32().expect("f32"), raw.shape.clone())
    }

    fn prompts(&self) -> Prompts {
        let (ids, shape) = self.ints("input_ids");
        let (mask, _) = self.ints("attention_mask");
        Prompts::from_padded(&ids, &mask, [shape[0], shape[1]]).unwrap()
    }
}

fn host<B: Backend>(tensor: Tensor<B, 3>) -> Vec<f32> {
    tensor.into_data().convert::<f32>().into_vec().unwrap()
}

/// The bound of half-precision logits, relative to `max(1, max |logit|)` of transformers'
/// float32 logits: a model computed in f16 (weights rounded to it, every activation stored in
/// it, sums in f32 inside the attention kernel) drifts from float32 by a few of f16's unit
/// roundoffs (`2⁻¹¹ ≈ 4.9e-4`) through a model's blocks; the tiny fixtures came within 2.4e-3
/// on lavapipe, and the bound leaves four times that.
const HALF_PRECISION_BOUND: f32 = 1e-2;

/// Burn's fused wgpu in f16 (lavapipe has `SHADER_F16`): the first two fixture models' prompt
/// logits within [`HALF_PRECISION_BOUND`] of transformers' float32 ones, and each greedy token
/// equal to transformers' wherever its logits' top two differ by more than twice the bound (a
/// closer pair may swap in half precision).
#[test]
fn half_precision_logits_are_within_the_bound_of_float32() {
    type Half = burn::backend::Wgpu<burn::tensor::f16>;
    let Some(device) = test_support::wgpu_device_for_test("models in f16") else {
        return;
    };
    for model in MODELS {
        let lm = CausalLm::<Half>::load(fixture(&format!("hf/{model}")), &device).unwrap();
        let expected = Expected::read(model);
        let new = expected.ints("generated").1[1] - expected.prompts().dims()[1];
        let config = GenerateConfig {
            prompt_logits: true,
            step_logits: true,
            ..lm.greedy(new)
        };
        let generation = lm.generate(&expected.prompts(), &config, &device).unwrap();
        let (mask, _) = expected.ints("attention_mask");
        let (want, shape) = expected.floats("logits_with_position_ids");
        let [batch, len, vocab] = [shape[0], shape[1], shape[2]];
        let got = host(generation.prompt_logits.expect("asked for"));
        let scale = want.iter().fold(1f32, |m, w| m.max(w.abs()));
        let mut worst = 0f32;
        for (i, (got, want)) in got.iter().zip(&want).enumerate() {
            let (row, column) = (i / (len * vocab), i / vocab % len);
            if mask[row * len + column] == 1 {
                worst = worst.max((got - want).abs() / scale);
            }
        }
        assert!(
            worst <= HALF_PRECISION_BOUND,
            "{model}: f16 prompt logits off by {worst} of max(1, |logit|)"
        );
        // Greedy tokens where transformers' step logits leave a clear winner.
        let (step, step_shape) = expected.floats("step_logits");
        let (tokens, token_shape) = expected.ints("generated");
        let (steps, prompt_len) = (step_shape[1], token_shape[1] - step_shape[1]);
        let mut compared = 0;
        for row in 0..batch {
            for s in 0..steps {
                let logits = &step[(row * steps + s) * vocab..][..vocab];
                let mut sorted = logits.to_vec();
                sorted.sort_by(|a, b| b.total_cmp(a));
                let step_scale = logits.iter().fold(1f32, |m, w| m.max(w.abs()));
                // Earlier tokens decide later logits: compare up to the first close call.
                if sorted[0] - sorted[1] <= 2.0 * HALF_PRECISION_BOUND * step_scale {
                    break;
                }
                let at = row * token_shape[1] + prompt_len + s;
                assert_eq!(
                    i64::from(generation.tokens[row][prompt_len + s]),
                    tokens[at],
                    "{model}: row {row}, step {s}"
                );
                compared += 1;
            }
        }
        assert!(compared > 0, "{model}: no step had a clear winner");
    }
}
