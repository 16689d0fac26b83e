//! Parity with Hugging Face transformers' `LlamaAttention`, `Qwen2Attention` and
//! `MistralAttention` (grouped key/value heads, RoPE, q/k/v biases, a sliding window, shifted
//! positions) on the cases of `fixtures/hf/` (see its README): the output, the attention
//! weights and every gradient, on the explicit, fused and cached paths.

use attention_backends::compare::assert_close;
use attention_core::weights::{AttentionParams, LayerWeights, StateDict, WeightsLayout};
use attention_core::{
    AttentionInput, AttentionPath, MultiHeadAttention, MultiHeadAttentionConfig, RopeConfig,
};
use burn::backend::Autodiff;
use burn::prelude::*;
use burn::tensor::{Int, TensorData};
use test_support::{cases_on, fixture};

/// The layer cases, with the number of query heads and the window their names give.
const CASES: [(&str, usize, Option<usize>); 5] = [
    ("llama_s0_b2_t7_d32_h4_kv2", 4, None),
    ("mistral_s3_b1_t9_d32_h4_kv2_w4", 4, Some(4)),
    ("qwen2_s2_b2_t6_d32_h4_kv2_bias", 4, None),
    ("llama_s1_b1_t5_d16_h4_kv1", 4, None),
    ("llama_s4_b1_t6_d32_h4_kv4_offset5", 4, None),
];

/// The README's tolerance: `atol = 1e-5 · max(1, max |want|)`, `rtol = 1e-4`.
fn assert_matches(found: &TensorData, want: &TensorData, what: &str) {
    let scale = want.iter::<f32>().fold(1.0f32, |max, x| max.max(x.abs()));
    assert_close(found, want, 1e-5 * f64::from(scale), 1e-4, what);
}

struct Case<B: Backend> {
    dict: StateDict,
    layer: MultiHeadAttention<B>,
    x: Tensor<B, 3>,
    positions: Tensor<B, 2, Int>,
}

fn load<B: Backend>(
    name: &'static str,
    heads: usize,
    window: Option<usize>,
    device: &B::Device,
) -> Case<B> {
    let dict = StateDict::load(fixture(&format!("hf/{name}.safetensors"))).unwrap();
    assert_eq!(dict.layout().unwrap(), WeightsLayout::Llama);
    let config: MultiHeadAttentionConfig = dict
        .infer_config(heads, 64)
        .unwrap()
        .with_rope(Some(RopeConfig::new()))
        .with_sliding_window(window);
    let layer = dict.to_layer::<B>(&config, device).unwrap();
    let x = dict.tensor::<B, 3>("x", device).unwrap();
    let positions = Tensor::from_data(dict.data("position_ids").unwrap().clone(), device);
    Case {
        dict,
        layer,
        x,
        positions,
    }
}

/// `y` on the explicit and fused paths, and `attn_weights` from the trace.
fn forward_matches_transformers<B: Backend>(device: &B::Device) {
    for &(name, heads, window) in cases_on::<B, _>(&CASES) {
        let case = load::<B>(name, heads, window, device);
        let want_y = case.dict.data("y").unwrap();
        for path in [AttentionPath::Explicit, AttentionPath::Fused] {
            let input = AttentionInput::new(case.x.clone())
                .positions(case.positions.clone())
                .path(path);
            let y = case.layer.try_forward(input).unwrap();
            assert_matches(&y.into_data(), want_y, &format!("{name}: y ({path:?})"));
        }
        let trace = case
            .layer
            .forward_traced(AttentionInput::new(case.x).positions(case.positions))
            .unwrap();
        assert_matches(
            &trace.weights.into_data(),
            case.dict.data("attn_weights").unwrap(),
            &format!("{name}: attn_weights"),
        );
    }
}

/// `d sum(y ⊙ r)` with respect to `x` and every parameter, in `nn.Linear` layout, on both paths.
fn gradients_match_transformers<B: Backend>(device: &B::Device) {
    for &(name, heads, window) in cases_on::<B, _>(&CASES) {
        let case = load::<Autodiff<B>>(name, heads, window, device);
        for path in [AttentionPath::Explicit, AttentionPath::Fused] {
            let x = case.x.clone().require_grad();
            let input = AttentionInput::new(x.clone())
                .positions(case.positions.clone())
                .path(path);
            let y = case.layer.try_forward(input).unwrap();
            let r = case.dict.tensor::<Autodiff<B>, 3>("r", device).unwrap();
            let grads = (y * r).sum().backward();
            let what = |key: &str| format!("{name}: {key} ({path:?})");
            assert_matches(
                &x.grad(&grads).unwrap().into_data(),
                case.dict.data("grad.x").unwrap(),
                &what("grad.x"),
            );
            let params = AttentionParams::grads_of(&case.layer, &grads);
            for (key, grad) in params.to_state_dict(WeightsLayout::Llama) {
                let want = case
                    .dict
                    .data(&format!("grad.{key}"))
                    .unwrap_or_else(|| panic!("{name}: no grad.{key}"));
                assert_matches(&grad, want, &what(&format!("grad.{key}")));
            }
        }
    }
}

/// A prefill then single steps through the cache, with the fixtures' positions, give `y`; the
/// window case's cache keeps fewer positions than the sequence.
fn cached_decoding_matches_transformers<B: Backend>(device: &B::Device) {
    for &(name, heads, window) in cases_on::<B, _>(&CASES) {
        let case = load::<B>(name, heads, window, device);
        let [batch, seq, _] = case.x.dims();
        for path in [AttentionPath::Explicit, AttentionPath::Fused] {
            let mut cache = case.layer.new_cache();
            let prefill = seq / 2;
            let step = |range: std::ops::Range<usize>, cache: &mut _| {
                let input = AttentionInput::new(case.x.clone().slice([0..batch, range.clone()]))
                    .positions(case.positions.clone().slice([0..batch, range]))
                    .path(path);
                case.layer.forward_cached(input, cache).unwrap()
            };
            let mut outputs = vec![step(0..prefill, &mut cache)];
            for t in prefill..seq {
                outputs.push(step(t..t + 1, &mut cache));
            }
            assert_matches(
                &Tensor::cat(outputs, 1).into_data(),
                case.dict.data("y").unwrap(),
                &format!("{name}: cached y ({path:?})"),
            );
        }
    }
}

test_support::backend_tests!(
    forward_matches_transformers,
    cached_decoding_matches_transformers;
    wgpu_all_cases_only: gradients_match_transformers,
);
