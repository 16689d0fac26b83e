//! The attention core, `softmax(mask(q kᵀ) / √head_dim) v`, on its two paths, with what the
//! layer's config may change in it: the scale, a soft-cap and sinks ([`ScoreRule`]).

use burn::nn::Dropout;
use burn::prelude::*;
use burn::tensor::Bool;
use burn::tensor::module::attention;
use burn::tensor::ops::AttentionModuleOptions;

use crate::error::AttentionError;
use crate::kernels::{Kernel, KernelInputs};
use crate::mask::attention_mask;

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

/// How the scores are made from `q kᵀ`, and what joins their softmax besides the keys: `s =
/// scale · q kᵀ`, then `c · tanh(s / c)` with a soft-cap `c` (Gemma 2), then the mask; with sinks
/// (gpt-oss, StreamingLLM) each head's softmax has `exp(sink)` in its denominator, a key that
/// takes weight and contributes no value.
#[derive(Debug, Clone)]
pub(crate) struct ScoreRule<B: Backend> {
    /// Multiplies `q kᵀ`; `None`: `1/√head_dim` (which the explicit path applies as a division
    /// by `√head_dim`, rounding as the chapter's code does).
    pub scale: Option<f64>,
    /// The soft-cap, if any.
    pub softcap: Option<f64>,
    /// One logit per query head, `[heads]`, if any.
    pub sinks: Option<Tensor<B, 1>>,
}

impl<B: Backend> ScoreRule<B> {
    /// The factor of `q kᵀ` for heads of `head_dim` features.
    pub fn scale_for(&self, head_dim: usize) -> f64 {
        scale_for(self.scale, head_dim)
    }

    /// `scores` scaled and soft-capped.
    ///
    /// # Shapes
    /// - `scores`: any; output: the same
    fn apply<const D: usize>(&self, scores: Tensor<B, D>, head_dim: usize) -> Tensor<B, D> {
        let scaled = match self.scale {
            None => scores / (head_dim as f64).sqrt(),
            Some(scale) => scores * scale,
        };
        match self.softcap {
            None => scaled,
            Some(cap) => (scaled / cap).tanh() * cap,
        }
    }
}

/// `scale`, or `1/√head_dim` without one.
pub(crate) fn scale_for(scale: Option<f64>, head_dim: usize) -> f64 {
    scale.unwrap_or_else(|| (head_dim as f64).sqrt().recip())
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

/// The mask of queries `q` that follow `past` cached positions, with optional key padding and
/// sliding window.
///
/// # Shapes
/// - `q`: `[batch, heads, queries, head_dim]`; `key_padding`: `[batch, past + queries]`
/// - output: `[batch, heads, queries, past + queries]`
pub(crate) fn mask_for<B: Backend>(
    q: &Tensor<B, 4>,
    past: usize,
    key_padding: Option<Tensor<B, 2, Bool>>,
    window: Option<usize>,
) -> Tensor<B, 4, Bool> {
    let [batch, heads, queries, _] = q.dims();
    attention_mask(
        [batch, heads, queries, past],
        key_padding,
        window,
        &q.device(),
    )
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
pub fn masked_softmax<B: Backend>(scaled: Tensor<B, 4>, mask: Tensor<B, 4, Bool>) -> Tensor<B, 4> {
    let masked = scaled.clone().detach().mask_fill(mask, f32::NEG_INFINITY);
    softmax_of_masked(masked, || scaled)
}

/// [`masked_softmax`] given `x`, the detached scaled scores with `-inf` where masked; `scaled`
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
/// the queries are the last positions), an optional key-padding mask and an optional sliding
/// window. Scale left at its default `1/√head_dim`: passing it explicitly sends cubecl to its
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
    rule: &ScoreRule<B>,
) -> Tensor<B, 4> {
    debug_assert!(rule.sinks.is_none(), "Burn's attention op has no sinks");
    let [batch, heads, queries, head_dim] = q.dims();
    let keys = k.dims()[2];
    let window = window.filter(|&window| window < keys);
    let square = queries == keys;
    let (mask, is_causal) = if window.is_some() || (!square && queries > 1) {
        (
            Some(mask_for(&q, keys - queries, key_padding, window)),
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

/// Causal attention of `query` over `key` and `value` as projections make them, the heads side
/// by side: `softmax(q kᵀ / √head_dim) v` per head, query `i` seeing the keys up to position
/// `i + keys − queries`; query head `h` reads key/value head `h / (heads / kv_heads)` (grouped
/// heads); with a `window`, query position `p` sees only keys `j` with `p − j < window`. The
/// layer's attention core alone, for a model that makes its own projections.
///
/// On a backend with a kernel of this crate's own ([`Kernel::of`]) the kernel computes it, with
/// its own backward under `Autodiff`; elsewhere Burn's fused attention op does, on the heads
/// split apart.
///
/// # Shapes
/// - `query`: `[batch, queries, heads · head_dim]`
/// - `key`, `value`: `[batch, keys, kv_heads · head_dim]`, `keys ≥ queries`
/// - output: `[batch, queries, heads · head_dim]`
///
/// # Errors
/// [`AttentionError::CoreShapes`] when the shapes do not fit together, and
/// [`AttentionError::ZeroSize`] for zero heads or a window of zero keys.
///
/// ```
/// use attention_core::causal_attention;
/// use burn::backend::NdArray;
/// use burn::prelude::*;
///
/// let device = Default::default();
/// let q = Tensor::<NdArray, 3>::ones([1, 5, 8], &device);
/// let kv = Tensor::<NdArray, 3>::ones([1, 5, 4], &device);
/// // 2 query heads of 4 features over 1 key/value head.
/// let context = causal_attention(q, kv.clone(), kv, 2, None).unwrap();
/// assert_eq!(context.dims(), [1, 5, 8]);
/// ```
pub fn causal_attention<B: Backend>(
    query: Tensor<B, 3>,
    key: Tensor<B, 3>,
    value: Tensor<B, 3>,
    heads: usize,
    window: Option<usize>,
) -> Result<Tensor<B, 3>, AttentionError> {
    if heads == 0 {
        return Err(AttentionError::ZeroSize { name: "heads" });
    }
    if window == Some(0) {
        return Err(AttentionError::ZeroSize { name: "window" });
    }
    let [batch, queries, width] = query.dims();
    let [key_batch, keys, kv_width] = key.dims();
    let shapes_fit = width.is_multiple_of(heads)
        && width > 0
        && kv_width.is_multiple_of(width / heads)
        && kv_width > 0
        && heads.is_multiple_of(kv_width / (width / heads))
        && key_batch == batch
        && value.dims() == key.dims()
        && keys >= queries
        && queries > 0;
    if !shapes_fit {
        return Err(AttentionError::CoreShapes {
            query: query.dims(),
            key: key.dims(),
            value: value.dims(),
            heads,
        });
    }
    let head_dim = width / heads;
    let kv_heads = kv_width / head_dim;
    let rule = ScoreRule {
        scale: None,
        softcap: None,
        sinks: None,
    };
    if Kernel::of::<B>().is_some() {
        return Ok(crate::kernels::attention(KernelInputs {
            query,
            key,
            value,
            heads,
            kv_heads,
            window,
            key_padding: None,
            scores: rule,
        }));
    }
    let split = |tensor: Tensor<B, 3>, heads: usize| {
        let [batch, seq, _] = tensor.dims();
        tensor
            .reshape([batch, seq, heads, head_dim])
            .swap_dims(1, 2)
    };
    let repeated = |tensor: Tensor<B, 3>| {
        let split = split(tensor, kv_heads);
        let group = heads / kv_heads;
        split
            .reshape([batch, kv_heads, 1, keys, head_dim])
            .expand([batch, kv_heads, group, keys, head_dim])
            .reshape([batch, heads, keys, head_dim])
    };
    let context = fused(
        split(query, heads),
        repeated(key),
        repeated(value),
        None,
        window,
        &rule,
    );
    Ok(context.swap_dims(1, 2).reshape([batch, queries, width]))
}
