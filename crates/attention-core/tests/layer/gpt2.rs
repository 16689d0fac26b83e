//! GPT-2's layout (fused `c_attn`, `Conv1D` weights `[in, out]`) in and out, against Hugging
//! Face's numbers.
//!
//! The shared fixture `gpt2_s0_b2_t7_d16_h4` was made by calling `GPT2Attention` on its own, which
//! in current transformers applies *no* causal mask (the model passes it in): its attention
//! weights have a non-zero upper triangle. It still pins the import exactly: the test below builds
//! that bidirectional attention from the imported layer's own projections and matches HF's output,
//! weights and gradients (exported back in GPT-2's layout). `gpt2_causal_*` holds the same
//! weights and inputs with causal outputs (made by `fixtures/make_gpt2_causal.py`); the layer
//! itself matches it.

use crate::common;

use attention_backends::compare::assert_close;
use attention_core::weights::{AttentionParams, LayerWeights, StateDict, WeightsLayout};
use attention_core::{MultiHeadAttention, masked_softmax};
use burn::backend::Autodiff;
use burn::prelude::*;
use burn::tensor::Bool;
use common::{ATOL, RTOL};

fn fixture(name: &str) -> StateDict {
    StateDict::load(test_support::fixture(name)).unwrap()
}

/// Bidirectional attention with the layer's projections, as standalone `GPT2Attention` computes.
///
/// # Shapes
/// - `x`: `[batch, seq, d]`; output: `[batch, seq, d]` and weights `[batch, heads, seq, seq]`
fn unmasked<B: Backend>(
    layer: &MultiHeadAttention<B>,
    x: Tensor<B, 3>,
) -> (Tensor<B, 3>, Tensor<B, 4>) {
    let [batch, seq, d] = x.dims();
    let (heads, hd) = (layer.num_heads(), layer.head_dim());
    let shape = [batch, heads, seq, seq];
    let nothing_masked = Tensor::<B, 4, Bool>::from_bool(
        TensorData::new(vec![false; shape.iter().product()], shape),
        &x.device(),
    );
    let split = |t: Tensor<B, 3>| t.reshape([batch, seq, heads, hd]).swap_dims(1, 2);
    let q = split(layer.query_layer.forward(x.clone()));
    let k = split(layer.key_layer.forward(x.clone()));
    let v = split(layer.value_layer.forward(x));
    let weights = masked_softmax(
        q.matmul(k.swap_dims(2, 3)) / (hd as f64).sqrt(),
        nothing_masked,
    );
    let context = weights
        .clone()
        .matmul(v)
        .swap_dims(1, 2)
        .reshape([batch, seq, d]);
    (layer.output_layer.forward(context), weights)
}

/// `grad.x` and the parameter gradients of `sum(y * r)`, in GPT-2's layout, match `reference`.
fn assert_grads<B: Backend>(
    layer: &MultiHeadAttention<Autodiff<B>>,
    x: Tensor<Autodiff<B>, 3>,
    y: Tensor<Autodiff<B>, 3>,
    reference: &StateDict,
    device: &B::Device,
) {
    let r = reference.tensor::<Autodiff<B>, 3>("r", device).unwrap();
    let grads = (y * r).sum().backward();
    assert_close(
        &x.grad(&grads).unwrap().into_data(),
        reference.data("grad.x").unwrap(),
        ATOL,
        RTOL,
        "grad.x",
    );
    let exported = AttentionParams::grads_of(layer, &grads).to_state_dict(WeightsLayout::Gpt2);
    assert_eq!(exported.len(), 4);
    for (key, grad) in exported {
        assert_close(
            &grad,
            reference.data(&format!("grad.{key}")).unwrap(),
            ATOL,
            RTOL,
            &format!("grad.{key}"),
        );
    }
}

fn import_matches_hugging_face<B: Backend>(device: &B::Device) {
    let hf = fixture("gpt2_s0_b2_t7_d16_h4.safetensors");
    for weights in [
        "gpt2_s0_b2_t7_d16_h4.safetensors",
        "gpt2_s0_b2_t7_d16_h4.pt",
    ] {
        let dict = fixture(weights);
        assert_eq!(dict.layout().unwrap(), WeightsLayout::Gpt2);
        let config = dict.infer_config(4, 7).unwrap();
        let layer = dict.to_layer::<Autodiff<B>>(&config, device).unwrap();
        let x = hf
            .tensor::<Autodiff<B>, 3>("x", device)
            .unwrap()
            .require_grad();
        let (y, w) = unmasked(&layer, x.clone());
        assert_close(
            &y.clone().into_data(),
            hf.data("y").unwrap(),
            ATOL,
            RTOL,
            &format!("{weights}: y"),
        );
        assert_close(
            &w.into_data(),
            hf.data("attn_weights").unwrap(),
            ATOL,
            RTOL,
            &format!("{weights}: attn_weights"),
        );
        assert_grads(&layer, x, y, &hf, device);
        // Exported weights are the file's, bit for bit.
        for (key, data) in AttentionParams::of(&layer).to_state_dict(WeightsLayout::Gpt2) {
            assert_eq!(
                data.convert::<f32>(),
                dict.data(&key).unwrap().clone().convert::<f32>(),
                "{key}"
            );
        }
    }
}

fn causal_layer_matches_causal_reference<B: Backend>(device: &B::Device) {
    let reference = fixture("gpt2_causal_s0_b2_t7_d16_h4.safetensors");
    let config = reference.infer_config(4, 7).unwrap();
    let layer = reference.to_layer::<Autodiff<B>>(&config, device).unwrap();
    let x = reference
        .tensor::<Autodiff<B>, 3>("x", device)
        .unwrap()
        .require_grad();
    let trace = layer.forward_traced(x.clone()).unwrap();
    assert_close(
        &trace.output.clone().into_data(),
        reference.data("y").unwrap(),
        ATOL,
        RTOL,
        "y",
    );
    assert_close(
        &trace.weights.into_data(),
        reference.data("attn_weights").unwrap(),
        ATOL,
        RTOL,
        "attn_weights",
    );
    assert_grads(&layer, x, trace.output, &reference, device);
}

test_support::backend_tests!(
    import_matches_hugging_face;
    wgpu_all_cases_only: causal_layer_matches_causal_reference
);
