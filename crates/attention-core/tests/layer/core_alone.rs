//! [`causal_attention`], the attention core alone: equal to the chapter's formula written out in
//! tensor ops (`softmax(mask(q kᵀ) / √d) v` per head, the key/value heads repeated over their
//! groups), with grouped heads, a window and more keys than queries, on every backend; and its
//! shape errors.

use attention_core::mask::attention_mask;
use attention_core::{AttentionError, causal_attention, masked_softmax};
use burn::prelude::*;
use burn::tensor::Distribution;

/// The core written out: heads split, key/value heads repeated, scores, mask, softmax, sum.
///
/// # Shapes
/// - `q`: `[batch, queries, heads · d]`; `k`, `v`: `[batch, keys, kv_heads · d]`
fn written_out<B: Backend>(
    q: Tensor<B, 3>,
    k: Tensor<B, 3>,
    v: Tensor<B, 3>,
    heads: usize,
    window: Option<usize>,
) -> Tensor<B, 3> {
    let [batch, queries, width] = q.dims();
    let [_, keys, kv_width] = k.dims();
    let d = width / heads;
    let kv_heads = kv_width / d;
    let split = |x: Tensor<B, 3>, n: usize| {
        let seq = x.dims()[1];
        x.reshape([batch, seq, n, d]).swap_dims(1, 2)
    };
    let repeated = |x: Tensor<B, 3>| {
        let x = split(x, kv_heads);
        Tensor::cat(
            (0..heads)
                .map(|h| x.clone().narrow(1, h / (heads / kv_heads), 1))
                .collect(),
            1,
        )
    };
    let scores = split(q, heads).matmul(repeated(k).swap_dims(2, 3)) / (d as f64).sqrt();
    let mask = attention_mask(
        [batch, heads, queries, keys - queries],
        None,
        window,
        &scores.device(),
    );
    masked_softmax(scores, mask)
        .matmul(repeated(v))
        .swap_dims(1, 2)
        .reshape([batch, queries, width])
}

fn core_equals_the_written_out_formula<B: Backend>(device: &B::Device) {
    // 6 query heads over 2 key/value heads of 16; 9 queries after 5 earlier keys.
    let random =
        |dims: [usize; 3]| Tensor::<B, 3>::random(dims, Distribution::Normal(0.0, 1.0), device);
    let (q, k, v) = (random([2, 9, 96]), random([2, 14, 32]), random([2, 14, 32]));
    for window in [None, Some(4)] {
        let found = causal_attention(q.clone(), k.clone(), v.clone(), 6, window, None).unwrap();
        let want = written_out(q.clone(), k.clone(), v.clone(), 6, window);
        found
            .into_data()
            .assert_approx_eq::<f32>(&want.into_data(), burn::tensor::Tolerance::absolute(2e-5));
    }
}

fn core_refuses_shapes_that_do_not_fit<B: Backend>(device: &B::Device) {
    let zeros = |dims: [usize; 3]| Tensor::<B, 3>::zeros(dims, device);
    // 4 heads of 6 do not divide a key width of 8; fewer keys than queries; another batch.
    for (q, k) in [
        (zeros([1, 3, 24]), zeros([1, 3, 8])),
        (zeros([1, 5, 24]), zeros([1, 3, 12])),
        (zeros([2, 3, 24]), zeros([1, 3, 12])),
    ] {
        let error = causal_attention(q, k.clone(), k, 4, None, None).unwrap_err();
        assert!(
            matches!(error, AttentionError::CoreShapes { .. }),
            "{error}"
        );
    }
    let error = causal_attention(
        zeros([1, 3, 24]),
        zeros([1, 3, 12]),
        zeros([1, 3, 12]),
        0,
        None,
        None,
    )
    .unwrap_err();
    assert!(
        matches!(error, AttentionError::ZeroSize { name: "heads" }),
        "{error}"
    );
}

test_support::backend_tests!(
    core_equals_the_written_out_formula,
    core_refuses_shapes_that_do_not_fit
);
