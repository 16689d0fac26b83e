//! Properties of causal attention that hold whatever the weights: causality, normalized weights
//! with an exactly-zero upper triangle, determinism without dropout, and dropout after the
//! softmax rescaling the kept weights by 1/(1-p).

use crate::common;

use attention_core::weights::{AttentionParams, LinearParams};
use attention_core::{MultiHeadAttention, MultiHeadAttentionConfig};
use burn::backend::Autodiff;
use burn::prelude::*;
use common::{randn, seeded_layer};

fn config() -> MultiHeadAttentionConfig {
    MultiHeadAttentionConfig::new(8, 12, 16, 3).with_qkv_bias(true)
}

/// Changing tokens after position `i` leaves the outputs at positions `≤ i` unchanged (and does
/// change later ones, so the check is not vacuous).
fn future_tokens_do_not_change_the_past<B: Backend>(device: &B::Device) {
    let layer = seeded_layer::<B>(&config(), 1, device);
    let x = randn::<B, 3>([2, 9, 8], 2, device);
    let y = layer.forward(x.clone());
    for i in [0, 4, 7] {
        let noise = randn::<B, 3>([2, 8 - i, 8], 3 + i as u64, device);
        let changed = x.clone().slice_assign([0..2, i + 1..9, 0..8], noise * 5.0);
        let y_changed = layer.forward(changed);
        let past = |y: &Tensor<B, 3>| y.clone().slice([0..2, 0..i + 1, 0..12]).into_data();
        past(&y_changed)
            .assert_approx_eq::<f32>(&past(&y), burn::tensor::Tolerance::absolute(1e-6));
        let future_moved = (y_changed.slice([0..2, i + 1..9, 0..12])
            - y.clone().slice([0..2, i + 1..9, 0..12]))
        .abs()
        .max()
        .into_scalar()
        .elem::<f32>();
        assert!(
            future_moved > 1e-3,
            "changing tokens after {i} must change later outputs"
        );
    }
}

/// Every row of the weights sums to 1; entries above the diagonal are exactly 0.
fn weights_are_causal_distributions<B: Backend>(device: &B::Device) {
    let layer = seeded_layer::<B>(&config(), 4, device);
    let trace = layer
        .forward_traced(randn::<B, 3>([2, 7, 8], 5, device))
        .unwrap();
    let [batch, heads, seq, _] = trace.weights.dims();
    let sums = trace.weights.clone().sum_dim(3).into_data();
    sums.assert_approx_eq::<f32>(
        &TensorData::ones::<f32, _>([batch, heads, seq, 1]),
        burn::tensor::Tolerance::absolute(1e-6),
    );
    let weights = trace.weights.into_data().to_vec::<f32>().unwrap();
    let masked = trace.masked_scores.into_data().to_vec::<f32>().unwrap();
    for (index, (&w, &m)) in weights.iter().zip(&masked).enumerate() {
        let (row, col) = ((index / seq) % seq, index % seq);
        if col > row {
            assert_eq!(w, 0.0, "weight above the diagonal at ({row}, {col})");
            assert_eq!(
                m,
                f32::NEG_INFINITY,
                "masked score above the diagonal at ({row}, {col})"
            );
        } else {
            assert!(
                w > 0.0 && m.is_finite(),
                "weight on or below the diagonal at ({row}, {col})"
            );
        }
    }
}

/// Without autodiff, dropout is inactive: two calls give identical outputs.
fn inference_is_deterministic<B: Backend>(device: &B::Device) {
    let layer = seeded_layer::<B>(&config().with_dropout(0.5), 6, device);
    let x = randn::<B, 3>([2, 5, 8], 7, device);
    assert_eq!(
        layer.forward(x.clone()).into_data(),
        layer.forward(x).into_data()
    );
}

/// A layer whose output *is* its (dropped-out) attention weights: one head, `x = I`, identity
/// value and output projections, so `y[i, j] = dropout(w)[i, j]`.
fn weights_revealing_layer<B: Backend>(
    seq: usize,
    dropout: f64,
    device: &B::Device,
) -> MultiHeadAttention<B> {
    let config = MultiHeadAttentionConfig::new(seq, seq, seq, 1).with_dropout(dropout);
    let random = seeded_layer::<B>(&config, 8, device);
    let identity = || LinearParams {
        weight: Tensor::eye(seq, device),
        bias: None,
    };
    let mut params = AttentionParams::of(&random);
    params.value = identity();
    params.output = LinearParams {
        bias: Some(Tensor::zeros([seq], device)),
        ..identity()
    };
    params.into_layer(&config).unwrap()
}

/// With dropout p on an autodiff backend each weight is dropped (0) or kept and scaled by
/// 1/(1-p); the dropped fraction is p within 5 standard deviations; calls differ.
fn dropout_drops_weights_after_softmax<B: Backend>(device: &B::Device) {
    let (seq, p, calls) = (16, 0.3, 20);
    let layer = weights_revealing_layer::<Autodiff<B>>(seq, p, device);
    let x = Tensor::<Autodiff<B>, 2>::eye(seq, device).unsqueeze::<3>();
    let weights = layer
        .forward_traced(x.clone())
        .unwrap()
        .weights
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    <Autodiff<B> as Backend>::seed(device, 42);
    let (mut dropped, mut kept) = (0usize, 0usize);
    let mut previous: Option<TensorData> = None;
    for _ in 0..calls {
        let y = layer.forward(x.clone()).into_data();
        for (&out, &w) in y.to_vec::<f32>().unwrap().iter().zip(&weights) {
            if w == 0.0 {
                assert_eq!(out, 0.0, "masked weights stay 0");
            } else if out == 0.0 {
                dropped += 1;
            } else {
                let expected = w / (1.0 - p as f32);
                assert!(
                    (out - expected).abs() <= 1e-6 * expected.max(1.0),
                    "kept weight {out} != {w}/(1-p)"
                );
                kept += 1;
            }
        }
        assert!(
            previous.as_ref() != Some(&y),
            "two calls with dropout gave the same output"
        );
        previous = Some(y);
    }
    let n = (dropped + kept) as f64;
    assert_eq!(n as usize, calls * seq * (seq + 1) / 2);
    let fraction = dropped as f64 / n;
    let sigma = (p * (1.0 - p) / n).sqrt();
    assert!(
        (fraction - p).abs() < 5.0 * sigma,
        "dropped {fraction:.4}, expected {p} ± {:.4}",
        5.0 * sigma
    );
}

/// Dropout 0 under autodiff is deterministic too.
fn zero_dropout_is_deterministic_under_autodiff<B: Backend>(device: &B::Device) {
    let layer = seeded_layer::<Autodiff<B>>(&config(), 9, device);
    let x = randn::<Autodiff<B>, 3>([2, 5, 8], 10, device);
    assert_eq!(
        layer.forward(x.clone()).into_data(),
        layer.forward(x).into_data()
    );
}

test_support::backend_tests!(
    future_tokens_do_not_change_the_past,
    weights_are_causal_distributions,
    inference_is_deterministic,
    dropout_drops_weights_after_softmax,
    zero_dropout_is_deterministic_under_autodiff,
);
