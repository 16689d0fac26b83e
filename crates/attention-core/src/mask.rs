//! The masks attention applies: causal and key padding. `true` means *masked* (not attended to),
//! the convention of PyTorch's `masked_fill` and of [`burn::tensor::module::attention`].

use burn::prelude::*;
use burn::tensor::Bool;

/// The causal mask of `queries` new positions that follow `past` earlier ones.
///
/// Query `i` (absolute position `past + i`) may attend to keys `0..=past + i`: the mask is
/// aligned bottom-right, as the fused attention op aligns its own causal mask. With `past = 0` it
/// is the chapter's `triu(ones(t, t), diagonal = 1)`.
///
/// # Shapes
/// - output: `[queries, past + queries]`, `true` above the (shifted) diagonal
pub fn causal_mask<B: Backend>(
    queries: usize,
    past: usize,
    device: &B::Device,
) -> Tensor<B, 2, Bool> {
    causal_window_mask(queries, past, None, device)
}

/// The causal mask of [`causal_mask`], with a sliding window: query `i` (absolute position
/// `p = past + i`) sees key `j` iff `j ≤ p` and `p − j < window` — at most `window` keys, its own
/// included (Hugging Face's `sliding_window_causal_mask_function`).
///
/// # Shapes
/// - output: `[queries, past + queries]`, `true` = masked
pub fn causal_window_mask<B: Backend>(
    queries: usize,
    past: usize,
    window: Option<usize>,
    device: &B::Device,
) -> Tensor<B, 2, Bool> {
    let shape = [queries, past + queries];
    // `tril_mask` is `true` where column > row + offset, i.e. outside the lower triangle.
    let causal = Tensor::tril_mask(shape, past as i64, device);
    match window {
        // `triu_mask` is `true` where column < row + offset: keys older than the window.
        Some(window) if window <= past + queries => {
            let too_old = Tensor::triu_mask(shape, past as i64 + 1 - window as i64, device);
            causal.bool_or(too_old)
        }
        _ => causal,
    }
}

/// The causal (and window) mask combined with an optional key-padding mask, broadcast to every
/// head.
///
/// # Shapes
/// - `key_padding`: `[batch, keys]`, `true` = padding token (never attended to)
/// - output: `[batch, heads, queries, keys]` where `keys = past + queries`
pub fn attention_mask<B: Backend>(
    [batch, heads, queries, past]: [usize; 4],
    key_padding: Option<Tensor<B, 2, Bool>>,
    window: Option<usize>,
    device: &B::Device,
) -> Tensor<B, 4, Bool> {
    let keys = past + queries;
    let causal = causal_window_mask::<B>(queries, past, window, device)
        .reshape([1, 1, queries, keys])
        .expand([batch, 1, queries, keys]);
    let mask = match key_padding {
        Some(padding) => {
            let padding = padding
                .reshape([batch, 1, 1, keys])
                .expand([batch, 1, queries, keys]);
            causal.bool_or(padding)
        }
        None => causal,
    };
    mask.expand([batch, heads, queries, keys])
}
