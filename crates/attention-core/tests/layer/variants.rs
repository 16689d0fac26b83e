//! The attention variants of today's small models — q/k RMSNorms per head (Qwen3, Gemma 3) or
//! over the projected width (OLMo2), in the `w` or `1 + w` convention, partial rotary embeddings
//! (Phi-3), a scale of its own and soft-capped scores (Gemma), learned sinks (gpt-oss) — on every
//! path: explicit == fused (the CPU kernel's forward and backward on ndarray and flex, Burn's op
//! with a scale and a soft-cap on wgpu) == cached, alone and combined with grouped heads and a
//! window; the normalized scores and the sinks' weights against the formulas written out; the
//! weights through the Llama layout. The f64 finite-difference checks of every parameter's
//! gradient with these variants are cases of `demo-ndarray gradcheck` (a process of its own:
//! ndarray's f32 and f64 backends share one device).

use crate::common;

use attention_backends::compare::{assert_close, deviation};
use attention_core::weights::{AttentionParams, LayerWeights, StateDict, WeightsLayout};
use attention_core::{
    AttentionInput, AttentionPath, MultiHeadAttention, MultiHeadAttentionConfig, QkNorm,
    QkNormConfig, QkNormScope, RopeConfig, RopeLayout,
};
use burn::backend::Autodiff;
use burn::module::Param;
use burn::nn::Linear;
use burn::prelude::*;
use common::{on_path, output_and_gradients, randn, seeded_layer};
use test_support::cases_on;

const PATHS: [AttentionPath; 2] = [AttentionPath::Explicit, AttentionPath::Fused];

fn close<B: Backend, const D: usize>(found: Tensor<B, D>, want: Tensor<B, D>, what: &str) {
    assert_close(&found.into_data(), &want.into_data(), 1e-5, 1e-4, what);
}

/// 4 query heads of 8 features over `kv` key/value heads, from 10 inputs to 12 outputs, QKV
/// biases, no output bias (the Llama family's shape).
fn base(kv: usize) -> MultiHeadAttentionConfig {
    MultiHeadAttentionConfig::new(10, 12, 256, 4)
        .with_num_kv_heads(Some(kv))
        .with_head_dim(Some(8))
        .with_qkv_bias(true)
        .with_output_bias(false)
}

fn norm(scope: QkNormScope) -> Option<QkNormConfig> {
    Some(QkNormConfig::new(scope).with_epsilon(1e-5))
}

/// RoPE on the first 4 of the 8 features of each head.
fn partial(layout: RopeLayout) -> Option<RopeConfig> {
    Some(
        RopeConfig::new()
            .with_theta(500.0)
            .with_layout(layout)
            .with_rotary_dim(Some(4)),
    )
}

/// `(name, config, seq, seed)`: each variant alone, then combined with grouped heads and a
/// window (70 tokens: two query blocks of the CPU kernel). Seeds are the cases' own, so that a
/// case added later leaves the others' data as it was; wgpu runs the first two.
fn cases() -> Vec<(&'static str, MultiHeadAttentionConfig, usize, u64)> {
    let rope = || Some(RopeConfig::new());
    vec![
        (
            "q/k norm per head, RoPE",
            base(4)
                .with_qk_norm(norm(QkNormScope::Head))
                .with_rope(rope()),
            13,
            0,
        ),
        (
            "scale 0.2, soft-cap 1.5 (on wgpu: Burn's op with both)",
            base(2).with_scale(Some(0.2)).with_softcap(Some(1.5)),
            13,
            6,
        ),
        (
            "q/k norm over the width, 2 kv heads (key norm over 16 features, query norm over 32)",
            base(2)
                .with_qk_norm(norm(QkNormScope::Width))
                .with_rope(rope()),
            13,
            1,
        ),
        (
            "q/k norm per head, 1 + w",
            base(4).with_qk_norm(norm(QkNormScope::Head).map(|n| n.with_unit_offset(true))),
            13,
            2,
        ),
        (
            "rotary_dim = head_dim / 2, theta 500",
            base(4).with_rope(partial(RopeLayout::Half)),
            13,
            3,
        ),
        (
            "all: width norm (1 + w), partial rotary, 1 kv head, window 5",
            base(1)
                .with_qk_norm(norm(QkNormScope::Width).map(|n| n.with_unit_offset(true)))
                .with_rope(partial(RopeLayout::Half))
                .with_sliding_window(Some(5)),
            70,
            4,
        ),
        (
            "all: head norm, partial interleaved rotary, 2 kv heads, window 3",
            base(2)
                .with_qk_norm(norm(QkNormScope::Head))
                .with_rope(partial(RopeLayout::Interleaved))
                .with_sliding_window(Some(3)),
            20,
            5,
        ),
        (
            "sinks, 2 kv heads, window 4, RoPE",
            base(2)
                .with_sinks(true)
                .with_rope(rope())
                .with_sliding_window(Some(4)),
            70,
            7,
        ),
        (
            "Gemma-like and sinks: head norm (1 + w), scale, soft-cap 2, sinks, 1 kv head, window 5",
            base(1)
                .with_qk_norm(norm(QkNormScope::Head).map(|n| n.with_unit_offset(true)))
                .with_rope(rope())
                .with_scale(Some(0.5))
                .with_softcap(Some(2.0))
                .with_sinks(true)
                .with_sliding_window(Some(5)),
            20,
            8,
        ),
    ]
}

/// The layer with norm weights drawn around 0.5 (so that neither convention scales by 1) and
/// sinks drawn around 0.
fn with_random_norms<B: Backend>(
    mut layer: MultiHeadAttention<B>,
    seed: u64,
    device: &B::Device,
) -> MultiHeadAttention<B> {
    for (i, norm) in [&mut layer.query_norm, &mut layer.key_norm]
        .into_iter()
        .enumerate()
    {
        if let Some(norm) = norm {
            let weight = randn::<B, 1>([norm.width()], seed + i as u64, device) * 0.3 + 0.5;
            norm.gamma = Param::from_tensor(weight);
        }
    }
    if let Some(sinks) = &mut layer.sinks {
        let heads = sinks.dims()[0];
        *sinks = Param::from_tensor(randn::<B, 1>([heads], seed + 7, device));
    }
    layer
}

/// Fused == explicit, and a prefill then single steps through the cache == the full forward, on
/// both paths, for every variant; the config comes back from the layer; q/k norms change the
/// output (they are applied at all).
fn variants_agree_on_every_path<B: Backend>(device: &B::Device) {
    let cases = cases();
    for (name, config, seq, i) in cases_on::<B, _>(&cases) {
        let (seq, i) = (*seq, *i);
        let layer = seeded_layer::<B>(config, 100 + i, device);
        let layer = with_random_norms(layer, 200 + 2 * i, device);
        let back = layer.config();
        assert_eq!(back.qk_norm, config.qk_norm, "{name}");
        assert_eq!(back.rope, config.rope, "{name}");
        assert_eq!(
            (back.scale, back.softcap, back.sinks),
            (config.scale, config.softcap, config.sinks),
            "{name}"
        );
        let x = randn::<B, 3>([2, seq, 10], 300 + i, device);
        let explicit = on_path(&layer, x.clone(), AttentionPath::Explicit);
        close(
            on_path(&layer, x.clone(), AttentionPath::Fused),
            explicit.clone(),
            &format!("{name}: fused vs explicit"),
        );
        for path in PATHS {
            let mut cache = layer.new_cache();
            let prefill = seq / 3;
            let mut step = |range: std::ops::Range<usize>| {
                let input = AttentionInput::new(x.clone().slice([0..2, range])).path(path);
                layer.forward_cached(input, &mut cache).unwrap()
            };
            let mut outputs = vec![step(0..prefill)];
            for t in prefill..seq {
                outputs.push(step(t..t + 1));
            }
            close(
                Tensor::cat(outputs, 1),
                explicit.clone(),
                &format!("{name}: cached prefill {prefill} then steps, {path:?}"),
            );
        }
        // Each variant changes the output: without it the layer computes something else.
        let has_variant = config.qk_norm.is_some()
            || config.scale.is_some()
            || config.softcap.is_some()
            || config.sinks;
        if has_variant {
            let plain_config = config
                .clone()
                .with_qk_norm(None)
                .with_scale(None)
                .with_softcap(None)
                .with_sinks(false);
            let mut plain = plain_config.init::<B>(device);
            plain.query_layer = layer.query_layer.clone();
            plain.key_layer = layer.key_layer.clone();
            plain.value_layer = layer.value_layer.clone();
            plain.output_layer = layer.output_layer.clone();
            let without = on_path(&plain, x, AttentionPath::Explicit);
            let moved = deviation(&without.into_data(), &explicit.into_data(), 0.0, 0.0, 1e-3);
            assert!(moved.max_abs > 1e-3, "{name}: the variants change nothing");
        }
    }
}

/// RMSNorm over the last dimension, written out: `x / √(mean(x²) + ε) · w` (or `· (1 + w)`).
fn rms_norm<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    weight: Tensor<B, 1>,
    epsilon: f64,
    unit_offset: bool,
) -> Tensor<B, D> {
    let mean_square = x.clone().powf_scalar(2.0).mean_dim(D - 1);
    let scale = if unit_offset { weight + 1.0 } else { weight };
    x / (mean_square + epsilon).sqrt() * scale.unsqueeze::<D>()
}

/// The explicit path's raw scores are `q kᵀ` of the normalized heads, computed here with plain
/// tensor ops: per head over `head_dim`, or over the projected width before the split — the key
/// norm then over `num_kv_heads · head_dim`, fewer features than the query norm's.
fn normalized_scores_are_the_formula<B: Backend>(device: &B::Device) {
    let cases = [
        (QkNormScope::Width, false),
        (QkNormScope::Head, true),
        (QkNormScope::Head, false),
        (QkNormScope::Width, true),
    ];
    for &(scope, unit_offset) in cases_on::<B, _>(&cases) {
        let epsilon = 1e-3;
        let config = MultiHeadAttentionConfig::new(6, 8, 16, 4)
            .with_num_kv_heads(Some(2))
            .with_head_dim(Some(4))
            .with_qkv_bias(true)
            .with_qk_norm(Some(
                QkNormConfig::new(scope)
                    .with_epsilon(epsilon)
                    .with_unit_offset(unit_offset),
            ));
        let layer = with_random_norms(seeded_layer::<B>(&config, 20, device), 21, device);
        let (query_width, key_width) = match scope {
            QkNormScope::Head => (4, 4),
            QkNormScope::Width => (16, 8),
        };
        let widths = [&layer.query_norm, &layer.key_norm].map(|n| n.as_ref().unwrap().width());
        assert_eq!(widths, [query_width, key_width], "{scope:?}");
        let x = randn::<B, 3>([2, 5, 6], 22, device);
        // [batch, heads, seq, head_dim]
        let heads = |linear: &Linear<B>, norm: &Option<QkNorm<B>>, count: usize| {
            let projected = linear.forward(x.clone());
            let weight = norm.as_ref().unwrap().gamma.val();
            let split = match scope {
                QkNormScope::Width => {
                    rms_norm(projected, weight, epsilon, unit_offset).reshape([2, 5, count, 4])
                }
                QkNormScope::Head => rms_norm(
                    projected.reshape([2, 5, count, 4]),
                    weight,
                    epsilon,
                    unit_offset,
                ),
            };
            split.swap_dims(1, 2)
        };
        let q = heads(&layer.query_layer, &layer.query_norm, 4);
        // Query head i reads key head i / 2.
        let k = heads(&layer.key_layer, &layer.key_norm, 2)
            .reshape([2, 2, 1, 5, 4])
            .expand([2, 2, 2, 5, 4])
            .reshape([2, 4, 5, 4]);
        let scores = q.matmul(k.swap_dims(2, 3));
        let trace = layer.forward_traced(x.clone()).unwrap();
        close(
            trace.scores,
            scores,
            &format!("{scope:?}, unit_offset {unit_offset}"),
        );
    }
}

/// The explicit path's weights with a scale, a soft-cap and sinks, against the formula written
/// out from its raw scores: `softmax([c · tanh(scale · s / c) masked, sink])` without the sink's
/// column. With a window of 2 and sinks the rows sum to less than 1.
fn scored_weights_are_the_formula<B: Backend>(device: &B::Device) {
    let (scale, cap) = (0.7, 1.2);
    let config = MultiHeadAttentionConfig::new(6, 8, 16, 4)
        .with_num_kv_heads(Some(2))
        .with_head_dim(Some(4))
        .with_scale(Some(scale))
        .with_softcap(Some(cap))
        .with_sinks(true)
        .with_sliding_window(Some(2));
    let layer = with_random_norms(seeded_layer::<B>(&config, 30, device), 31, device);
    let x = randn::<B, 3>([2, 5, 6], 32, device) * 3.0;
    let trace = layer.forward_traced(x).unwrap();
    // [batch, heads, queries, keys]: j ≤ i and i − j < 2.
    let visible = Tensor::<B, 2, Int>::from_data(
        TensorData::new(
            (0..25)
                .map(|n| {
                    let (i, j) = (n / 5, n % 5);
                    i64::from(j <= i && i - j < 2)
                })
                .collect::<Vec<_>>(),
            [5, 5],
        ),
        device,
    )
    .float()
    .reshape([1, 1, 5, 5]);
    let capped = (trace.scores * (scale / cap)).tanh() * cap;
    let exp = capped.exp() * visible;
    let sinks = layer
        .sinks
        .as_ref()
        .unwrap()
        .val()
        .reshape([1, 4, 1, 1])
        .exp();
    let want = exp.clone() / (exp.sum_dim(3) + sinks);
    close(trace.weights.clone(), want, "weights");
    let rows = trace.weights.sum_dim(3).into_data();
    let rows: Vec<f32> = rows.into_vec().unwrap();
    assert!(
        rows.iter().all(|&sum| sum < 1.0 - 1e-3),
        "the sinks take a share of every row: {rows:?}"
    );
}

/// Under autodiff the fused path (on ndarray and flex the CPU kernel with its own backward) gives
/// the explicit path's gradients for the input, the projections, the q/k norms' weights and the
/// sinks.
fn variant_gradients_fused_equal_explicit<B: Backend>(device: &B::Device) {
    let cases = [
        (
            base(2)
                .with_qk_norm(norm(QkNormScope::Head).map(|n| n.with_unit_offset(true)))
                .with_rope(Some(RopeConfig::new()))
                .with_scale(Some(0.3))
                .with_softcap(Some(1.5))
                .with_sinks(true)
                .with_sliding_window(Some(6)),
            70,
        ),
        (
            base(1)
                .with_qk_norm(norm(QkNormScope::Width).map(|n| n.with_unit_offset(true)))
                .with_rope(partial(RopeLayout::Half))
                .with_sliding_window(Some(4)),
            9,
        ),
        (
            base(2)
                .with_qk_norm(norm(QkNormScope::Head))
                .with_rope(Some(RopeConfig::new())),
            70,
        ),
        (
            base(2)
                .with_qk_norm(norm(QkNormScope::Width))
                .with_rope(partial(RopeLayout::Interleaved)),
            7,
        ),
    ];
    for (i, (config, seq)) in cases_on::<B, _>(&cases).iter().enumerate() {
        let layer = seeded_layer::<Autodiff<B>>(config, 400 + i as u64, device);
        let layer = with_random_norms(layer, 410 + 2 * i as u64, device);
        let x = randn::<Autodiff<B>, 3>([2, *seq, 10], 420 + i as u64, device).require_grad();
        let r = randn::<Autodiff<B>, 3>([2, *seq, 12], 430 + i as u64, device);
        let run = |path: AttentionPath| {
            let input = AttentionInput::new(x.clone()).path(path);
            output_and_gradients(&layer, input, &x, r.clone())
        };
        let (fused, explicit) = (run(AttentionPath::Fused), run(AttentionPath::Explicit));
        let names: Vec<&str> = fused.iter().map(|(name, _)| name.as_str()).collect();
        for norm in ["query_norm.weight", "key_norm.weight"] {
            assert!(names.contains(&norm), "case {i}: no gradient of {norm}");
        }
        if config.sinks {
            assert!(
                names.contains(&"sinks"),
                "case {i}: no gradient of the sinks"
            );
        }
        for ((name, fused), (_, explicit)) in fused.iter().zip(&explicit) {
            let what = format!("case {i}: fused vs explicit, {name}");
            assert_close(fused, explicit, 1e-5, 1e-4, &what);
        }
    }
}

test_support::backend_tests!(
    variants_agree_on_every_path,
    normalized_scores_are_the_formula,
    scored_weights_are_the_formula;
    wgpu_all_cases_only: variant_gradients_fused_equal_explicit,
);

/// q/k norm weights go through the Llama layout (`q_norm.weight`, `k_norm.weight`) and come back:
/// the scope inferred from their shapes, the same layer.
#[test]
fn qk_norms_round_trip_through_the_llama_layout() {
    type B = attention_backends::NdArray;
    let device = Default::default();
    for (kv, scope) in [
        (2, QkNormScope::Head),
        (2, QkNormScope::Width),
        (1, QkNormScope::Width),
    ] {
        let config = base(kv)
            .with_qk_norm(Some(QkNormConfig::new(scope)))
            .with_rope(partial(RopeLayout::Half));
        let layer = with_random_norms(seeded_layer::<B>(&config, 50, &device), 51, &device);
        let dict = StateDict::from_tensors(
            AttentionParams::of(&layer).to_state_dict(WeightsLayout::Llama),
        );
        let widths = match scope {
            QkNormScope::Head => [8, 8],
            QkNormScope::Width => [32, 8 * kv],
        };
        assert_eq!(dict.shape("q_norm.weight"), Some(&widths[..1]), "{scope:?}");
        assert_eq!(dict.shape("k_norm.weight"), Some(&widths[1..]), "{scope:?}");
        let inferred = dict.infer_config(4, 256).unwrap();
        assert_eq!(
            inferred.qk_norm,
            Some(QkNormConfig::new(scope)),
            "{kv}, {scope:?}"
        );
        let inferred = inferred.with_rope(config.rope.clone());
        let loaded = dict.to_layer::<B>(&inferred, &device).unwrap();
        let x = randn::<B, 3>([2, 6, 10], 52, &device);
        for path in PATHS {
            close(
                on_path(&loaded, x.clone(), path),
                on_path(&layer, x.clone(), path),
                &format!("{kv}, {scope:?}, {path:?}"),
            );
        }
    }
}

/// Sinks go through both layouts as `sinks` `[num_heads]` and come back (inferred from the key);
/// a config with sinks and a file without them, or the other way round, is an error naming the
/// key.
#[test]
fn sinks_round_trip_and_are_checked() {
    type B = attention_backends::NdArray;
    let device = Default::default();
    let config = base(2).with_sinks(true).with_rope(Some(RopeConfig::new()));
    let layer = with_random_norms(seeded_layer::<B>(&config, 60, &device), 61, &device);
    let x = randn::<B, 3>([2, 6, 10], 62, &device);
    for layout in [WeightsLayout::Chapter, WeightsLayout::Llama] {
        let tensors = AttentionParams::of(&layer).to_state_dict(layout);
        let dict = StateDict::from_tensors(tensors.clone());
        assert_eq!(dict.shape("sinks"), Some(&[4][..]), "{layout:?}");
        let inferred = dict.infer_config(4, 256).unwrap();
        assert!(inferred.sinks, "{layout:?}");
        let loaded = dict
            .to_layer::<B>(&inferred.with_rope(config.rope.clone()), &device)
            .unwrap();
        for path in PATHS {
            close(
                on_path(&loaded, x.clone(), path),
                on_path(&layer, x.clone(), path),
                &format!("{layout:?}, {path:?}"),
            );
        }
        let without = StateDict::from_tensors(
            tensors
                .iter()
                .filter(|(key, _)| key != "sinks")
                .cloned()
                .collect::<Vec<_>>(),
        );
        let missing = without.to_layer::<B>(&config, &device).unwrap_err();
        assert!(missing.to_string().contains("`sinks`"), "{missing}");
        let unexpected = dict
            .to_layer::<B>(&config.clone().with_sinks(false), &device)
            .unwrap_err();
        assert!(
            unexpected.to_string().contains("sinks = false"),
            "{unexpected}"
        );
    }
}
