//! The attention core, `softmax(mask(q kᵀ) / √head_dim) v`, as tensor ops: the explicit path
//! (the chapter's steps) and Burn's fused op, with the scale, soft-cap and sinks of a
//! [`ScoreRule`]. The kernels of this crate's own are behind `kernels/`.

use burn::nn::Dropout;
use burn::prelude::*;
use burn::tensor::Bool;
use burn::tensor::module::attention;
use burn::tensor::ops::AttentionModuleOptions;

use crate::documents::Documents;
use crate::mask::attention_mask;
use crate::score_rule::ScoreRule;

/// How the attention core is computed. Both paths give the same result (to float rounding);
/// they differ in speed, memory and what they can do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttentionPath {
    /// `Fused` for inference. Under autodiff: `Explicit` while dropout is active (only it applies
    /// dropout); otherwise `Fused` on the backends with a kernel of this crate's (ndarray and
    /// burn-flex: the CPU kernel; wgpu: the GPU kernel), each with an exact backward pass of its
    /// own, and `Explicit` elsewhere (Burn 0.21 differentiates its fused op through the same
    /// `O(T²)` composite, with an approximate division gradient on some backends).
    #[default]
    Auto,
    /// Scores, mask, softmax, dropout and the weighted sum as separate tensor ops, as the source
    /// chapter writes them. Materializes `[batch, heads, seq, seq]`; the only path with dropout.
    Explicit,
    /// One attention op that never materializes `[seq, seq]` and never applies dropout. On
    /// ndarray and burn-flex (with or without `Autodiff`): this crate's CPU kernel — blockwise,
    /// skipping the masked half, FlashAttention's backward. On wgpu: this crate's GPU kernel
    /// (CubeCL, the same scheme). Elsewhere: Burn's fused [`attention`] op with `is_causal`. The
    /// cached path takes the kernels without `Autodiff`, Burn's op elsewhere.
    Fused,
    /// Burn's fused [`attention`] op, even where a kernel of this crate's runs: to compare the
    /// two. Under autodiff Burn differentiates it through its `O(T²)` composite; on a layer with
    /// sinks (which Burn's op has not) the explicit path.
    BurnOp,
}

/// What the explicit path computes on its way.
pub(crate) struct AttentionScores<B: Backend> {
    /// `[batch, heads, queries, head_dim]`
    pub context: Tensor<B, 4>,
    /// `q kᵀ`: `[batch, heads, queries, keys]`
    pub scores: Tensor<B, 4>,
    /// The scores with `-inf` where masked.
    pub masked_scores: Tensor<B, 4>,
    /// Softmax of the scaled (and soft-capped), masked scores, before dropout; without the
    /// sinks' share.
    pub weights: Tensor<B, 4>,
}

/// The mask of queries `q` that follow `past` cached positions, with optional key padding,
/// sliding window and documents (these with `past = 0`).
///
/// # Shapes
/// - `q`: `[batch, heads, queries, head_dim]`; `key_padding`: `[batch, past + queries]`
/// - output: `[batch, heads, queries, past + queries]`
pub(crate) fn mask_for<B: Backend>(
    q: &Tensor<B, 4>,
    past: usize,
    key_padding: Option<Tensor<B, 2, Bool>>,
    window: Option<usize>,
    documents: Option<&Documents>,
) -> Tensor<B, 4, Bool> {
    let [batch, heads, queries, _] = q.dims();
    let device = q.device();
    let mask = attention_mask([batch, heads, queries, past], key_padding, window, &device);
    match documents {
        Some(documents) => {
            let keys = past + queries;
            let across = documents
                .mask::<B>(&device)
                .reshape([batch, 1, queries, keys])
                .expand([batch, heads, queries, keys]);
            mask.bool_or(across)
        }
        None => mask,
    }
}

/// The chapter's attention: `dropout(softmax(masked_fill(q kᵀ, mask, -inf) / √head_dim)) v`, with
/// the scale, soft-cap and sinks of `rule`.
///
/// Rows whose keys are all masked get weights 0 (the chapter's softmax would give NaN).
///
/// # Shapes
/// - `q`: `[batch, heads, queries, head_dim]`; `k`, `v`: `[batch, heads, keys, head_dim]`
/// - `mask`: `[batch, heads, queries, keys]`, `true` = masked
pub(crate) fn explicit<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    mask: Tensor<B, 4, Bool>,
    rule: &ScoreRule<B>,
    dropout: &Dropout,
) -> AttentionScores<B> {
    let head_dim = q.dims()[3];
    let scores = q.matmul(k.swap_dims(2, 3)); // [batch, heads, queries, keys]
    // Without a soft-cap, scaling the masked scores gives the same values as masking the scaled
    // ones (−inf / √hd = −inf) and spares a second pass over the broadcast mask. With one, the
    // cap goes first: tanh(−inf) is −1.
    let capped_and_masked = rule.softcap.map(|_| {
        rule.apply(scores.clone().detach(), head_dim)
            .mask_fill(mask.clone(), f32::NEG_INFINITY)
    });
    let masked_scores = scores.clone().mask_fill(mask, f32::NEG_INFINITY);
    let masked_scaled =
        capped_and_masked.unwrap_or_else(|| rule.apply(masked_scores.clone().detach(), head_dim));
    let scaled = || rule.apply(scores.clone(), head_dim);
    let weights = match &rule.sinks {
        None => softmax_of_masked(masked_scaled, scaled),
        Some(sinks) => softmax_with_sinks(masked_scaled, scaled, sinks.clone()),
    };
    let context = dropout.forward(weights.clone()).matmul(v);
    AttentionScores {
        context,
        scores,
        masked_scores,
        weights,
    }
}

/// `softmax(masked_fill(scaled, mask, -inf))` over the last dimension, as PyTorch computes it
/// forward and backward; a row whose keys are all masked gets zeros instead of NaN.
///
/// The value is `exp(x - max) / sum`, rounded as `torch.softmax` rounds it. The gradient is
/// PyTorch's `w ⊙ (g - Σ g ⊙ w)`, attached through a term that is exactly zero in value:
/// `w + w ⊙ (δ - Σ w ⊙ δ)` with `δ = scaled - detach(scaled)`. Differentiating the division
/// instead would go through burn-ndarray 0.21's approximate SIMD reciprocal (about 12 bits),
/// which costs up to 1e-3 relative gradient error.
///
/// # Shapes
/// - `scaled`: `[batch, heads, queries, keys]`, finite; `mask`: the same, `true` = masked
/// - output: `[batch, heads, queries, keys]`
#[cfg(feature = "test-hooks")]
pub fn masked_softmax<B: Backend>(scaled: Tensor<B, 4>, mask: Tensor<B, 4, Bool>) -> Tensor<B, 4> {
    let masked = scaled.clone().detach().mask_fill(mask, f32::NEG_INFINITY);
    softmax_of_masked(masked, || scaled)
}

/// `masked_softmax` given `x`, the detached scaled scores with `-inf` where masked; `scaled`
/// (the tracked scores, without the mask) is only asked for under autodiff.
///
/// # Shapes
/// - `x`, `scaled()`: `[batch, heads, queries, keys]`
fn softmax_of_masked<B: Backend>(
    x: Tensor<B, 4>,
    scaled: impl FnOnce() -> Tensor<B, 4>,
) -> Tensor<B, 4> {
    // A row of -inf has max -inf; clamping keeps `x - max` at -inf (exp = 0) rather than NaN.
    let max = x.clone().max_dim(3).clamp_min(f32::MIN);
    let exp = (x - max).exp();
    // A sum of at least 1 (every row with a finite entry) is left as it is.
    let sum = exp.clone().sum_dim(3).clamp_min(f32::MIN_POSITIVE);
    let weights = exp / sum;
    if !B::ad_enabled(&weights.device()) {
        return weights;
    }
    let scaled = scaled();
    let delta = scaled.clone() - scaled.detach(); // 0, carrying the gradient of `scaled`
    let centered = delta.clone() - (weights.clone() * delta).sum_dim(3);
    weights.clone() + weights * centered
}

/// [`softmax_of_masked`] with each head's sink as one more column of the softmax, dropped from the
/// weights it returns: their rows sum to `1 − sink's share`.
///
/// # Shapes
/// - `x`, `scaled()`: `[batch, heads, queries, keys]`; `sinks`: `[heads]`
/// - output: `[batch, heads, queries, keys]`
fn softmax_with_sinks<B: Backend>(
    x: Tensor<B, 4>,
    scaled: impl FnOnce() -> Tensor<B, 4>,
    sinks: Tensor<B, 1>,
) -> Tensor<B, 4> {
    let [batch, heads, queries, keys] = x.dims();
    let column = sinks
        .reshape([1, heads, 1, 1])
        .expand([batch, heads, queries, 1]);
    let with_sink = |scores: Tensor<B, 4>, sinks: Tensor<B, 4>| Tensor::cat(vec![scores, sinks], 3);
    let weights = softmax_of_masked(with_sink(x, column.clone().detach()), || {
        with_sink(scaled(), column)
    });
    weights.narrow(3, 0, keys)
}

/// Burn's fused attention op, with the causal mask aligned bottom-right (`queries < keys` means
/// the queries are the last positions), an optional key-padding mask, an optional sliding
/// window and optional documents (which travel in the mask: Burn's op has no document mask). Scale left at its default `1/√head_dim`: passing it explicitly sends cubecl to its
/// slow fallback.
///
/// Burn 0.21 workaround. Burn 0.21's op has two causal conventions: its fallback aligns the mask bottom-right, cubek's
/// flash kernels (which wgpu's autotune may pick) top-left. The op's `is_causal` is therefore
/// used only where they agree, `queries == keys`; otherwise the causal part travels in the mask,
/// except for one query after its keys, which sees them all. A scale or soft-cap of `rule` goes to
/// the op (on wgpu, Burn then takes its `O(T²)` fallback); sinks are not the op's, and the route
/// never sends a layer with sinks here.
///
/// # Shapes
/// - `q`: `[batch, heads, queries, head_dim]`; `k`, `v`: `[batch, heads, keys, head_dim]`
/// - `key_padding`: `[batch, keys]`, `true` = padding
/// - output: `[batch, heads, queries, head_dim]`
pub(crate) fn fused<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    key_padding: Option<Tensor<B, 2, Bool>>,
    window: Option<usize>,
    documents: Option<&Documents>,
    rule: &ScoreRule<B>,
) -> Tensor<B, 4> {
    debug_assert!(rule.sinks.is_none(), "Burn's attention op has no sinks");
    let [batch, heads, queries, head_dim] = q.dims();
    let keys = k.dims()[2];
    let window = window.filter(|&window| window < keys);
    let square = queries == keys;
    let (mask, is_causal) = if window.is_some() || documents.is_some() || (!square && queries > 1) {
        (
            Some(mask_for(&q, keys - queries, key_padding, window, documents)),
            square,
        )
    } else {
        let padding = key_padding.map(|mask| {
            mask.reshape([batch, 1, 1, keys])
                .expand([batch, heads, queries, keys])
        });
        (padding, square)
    };
    let options = AttentionModuleOptions {
        scale: rule.scale.map(|_| rule.scale_for(head_dim)),
        softcap: rule.softcap,
        is_causal,
    };
    attention(q, k, v, mask, None, options)
}
