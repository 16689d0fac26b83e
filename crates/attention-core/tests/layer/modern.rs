//! Grouped-query heads, rotary positions and sliding windows: equivalences that hold on every
//! path (the Hugging Face parity cases are in `hugging_face.rs`; the f64 finite-difference check
//! through RoPE, grouped heads and a window is the demo's `gradcheck`, in a process of its own:
//! ndarray's f32 and f64 backends share one device, whose default float type the first test to
//! run would decide).

use crate::common;

use attention_backends::compare::assert_close;
use attention_core::{
    AttentionInput, AttentionPath, KvCache, MultiHeadAttentionConfig, RopeConfig,
};
use burn::module::Param;
use burn::prelude::*;
use burn::tensor::{Bool, Int};
use common::{on_path, randn, seeded_layer};
use test_support::cases_on;

const PATHS: [AttentionPath; 2] = [AttentionPath::Explicit, AttentionPath::Fused];

fn close<B: Backend>(found: Tensor<B, 3>, want: Tensor<B, 3>, what: &str) {
    assert_close(&found.into_data(), &want.into_data(), 1e-5, 1e-4, what);
}

/// A Llama-style config: 4 query heads over `kv` key/value heads of 6 features, RoPE.
fn llama(kv: usize, window: Option<usize>) -> MultiHeadAttentionConfig {
    MultiHeadAttentionConfig::new(10, 12, 512, 4)
        .with_num_kv_heads(Some(kv))
        .with_head_dim(Some(6))
        .with_qkv_bias(true)
        .with_output_bias(false)
        .with_rope(Some(RopeConfig::new()))
        .with_sliding_window(window)
}

/// `num_kv_heads = num_heads` is the layer without grouping, bit for bit.
fn full_kv_heads_are_plain_attention<B: Backend>(device: &B::Device) {
    let plain = MultiHeadAttentionConfig::new(8, 8, 16, 2).with_qkv_bias(true);
    let layer = seeded_layer::<B>(&plain, 3, device);
    // The same parameters (seeding twice is not enough: tests running in parallel share the
    // backend's generator).
    let grouped = attention_core::weights::AttentionParams::of(&layer)
        .into_layer(&plain.clone().with_num_kv_heads(Some(2)))
        .unwrap();
    let x = randn::<B, 3>([2, 9, 8], 4, device);
    for path in PATHS {
        let (a, b) = (
            on_path(&layer, x.clone(), path),
            on_path(&grouped, x.clone(), path),
        );
        assert_eq!(a.into_data(), b.into_data(), "{path:?}");
    }
}

/// Grouped heads equal multi-head attention whose key and value weights repeat each key/value
/// head for its group (what `repeat_kv` means), with RoPE and with a window, on every path.
fn grouped_heads_equal_repeated_key_value_weights<B: Backend>(device: &B::Device) {
    for (kv, window) in [(2, None), (1, Some(3))] {
        let grouped = seeded_layer::<B>(&llama(kv, window), 5, device);
        let mut plain = seeded_layer::<B>(&llama(4, window), 6, device);
        plain.query_layer = grouped.query_layer.clone();
        plain.output_layer = grouped.output_layer.clone();
        let repeat = |linear: &burn::nn::Linear<B>| {
            // [in, kv · 6] → [in, 4 · 6]: each head's columns repeated 4 / kv times.
            let weight = linear.weight.val();
            let [input, _] = weight.dims();
            let weight = weight
                .reshape([input, kv, 1, 6])
                .expand([input, kv, 4 / kv, 6])
                .reshape([input, 24]);
            let bias = linear.bias.as_ref().unwrap().val();
            let bias = bias
                .reshape([kv, 1, 6])
                .expand([kv, 4 / kv, 6])
                .reshape([24]);
            (Param::from_tensor(weight), Some(Param::from_tensor(bias)))
        };
        (plain.key_layer.weight, plain.key_layer.bias) = repeat(&grouped.key_layer);
        (plain.value_layer.weight, plain.value_layer.bias) = repeat(&grouped.value_layer);
        let x = randn::<B, 3>([2, 11, 10], 7, device);
        for path in PATHS {
            close(
                on_path(&grouped, x.clone(), path),
                on_path(&plain, x.clone(), path),
                &format!("kv {kv}, window {window:?}, {path:?}"),
            );
        }
    }
}

/// Prefill then single steps through the cache equal the full forward with RoPE, grouped heads
/// and a window; over 200 positions a window cache keeps its memory bounded (it moves what it
/// keeps instead of growing).
fn cached_decoding_with_rope_and_window_equals_full_forward<B: Backend>(device: &B::Device) {
    let cases = [(2, Some(5), 200), (1, None, 70), (4, Some(1), 12)];
    for &(kv, window, seq) in cases_on::<B, _>(&cases) {
        let layer = seeded_layer::<B>(&llama(kv, window), 8, device);
        let x = randn::<B, 3>([2, seq, 10], 9, device);
        let full = layer.forward(x.clone());
        for path in PATHS {
            let mut cache: KvCache<B> = layer.new_cache();
            let mut outputs = vec![];
            let prefill = seq / 3;
            let mut step = |range: std::ops::Range<usize>| {
                let input = AttentionInput::new(x.clone().slice([0..2, range])).path(path);
                outputs.push(layer.forward_cached(input, &mut cache).unwrap());
            };
            step(0..prefill);
            for t in prefill..seq {
                step(t..t + 1);
            }
            assert_eq!(cache.len(), seq);
            if let Some(window) = window {
                let bound = (window + prefill).max(KvCache::<B>::MIN_POSITIONS) + window;
                assert!(
                    cache.allocated() <= bound,
                    "{} > {bound}",
                    cache.allocated()
                );
            }
            close(
                Tensor::cat(outputs, 1),
                full.clone(),
                &format!("kv {kv}, window {window:?}, {path:?}"),
            );
        }
    }
}

/// A row left-padded by 3 tokens, with positions counted from its first real token (as Hugging
/// Face derives them from the attention mask) and the pads masked, gives the unpadded row's
/// outputs — in one forward pass and through the cache.
fn left_padded_rows_with_positions_equal_unpadded_rows<B: Backend>(device: &B::Device) {
    let layer = seeded_layer::<B>(&llama(2, Some(4)), 10, device);
    let (pads, real) = (3, 6);
    let row = randn::<B, 3>([1, real, 10], 11, device);
    let alone = layer.forward(row.clone());
    let padded = Tensor::cat(
        vec![randn::<B, 3>([1, pads, 10], 12, device) * 50.0, row],
        1,
    );
    let padding = Tensor::<B, 2, Bool>::from_data(
        TensorData::new(
            (0..pads + real).map(|i| i < pads).collect::<Vec<_>>(),
            [1, pads + real],
        ),
        device,
    );
    let positions: Vec<i64> = (0..pads + real)
        .map(|i| i.saturating_sub(pads) as i64)
        .collect();
    let positions =
        Tensor::<B, 2, Int>::from_data(TensorData::new(positions, [1, pads + real]), device);
    for path in PATHS {
        let input = AttentionInput::new(padded.clone())
            .key_padding(padding.clone())
            .positions(positions.clone())
            .path(path);
        let y = layer.try_forward(input).unwrap();
        close(
            y.slice([0..1, pads..pads + real]),
            alone.clone(),
            &format!("one pass, {path:?}"),
        );
        let mut cache = layer.new_cache();
        let mut outputs = vec![];
        for t in 0..pads + real {
            let input = AttentionInput::new(padded.clone().slice([0..1, t..t + 1]))
                .key_padding(padding.clone().slice([0..1, 0..t + 1]))
                .positions(positions.clone().slice([0..1, t..t + 1]))
                .path(path);
            outputs.push(layer.forward_cached(input, &mut cache).unwrap());
        }
        close(
            Tensor::cat(outputs, 1).slice([0..1, pads..pads + real]),
            alone.clone(),
            &format!("cached, {path:?}"),
        );
    }
}

test_support::backend_tests!(
    full_kv_heads_are_plain_attention,
    cached_decoding_with_rope_and_window_equals_full_forward,
    left_padded_rows_with_positions_equal_unpadded_rows;
    wgpu_all_cases_only: grouped_heads_equal_repeated_key_value_weights,
);
