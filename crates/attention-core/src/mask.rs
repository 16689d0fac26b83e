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
    // `tril_mask` is `true` where column > row + offset, i.e. outside the lower triangle.
    Tensor::tril_mask([queries, past + queries], past as i64, device)
}

/// The causal mask combined with an optional key-padding mask, broadcast to every head.
///
/// # Shapes
/// - `key_padding`: `[batch, keys]`, `true` = padding token (never attended to)
/// - output: `[batch, heads, queries, keys]` where `keys = past + queries`
pub fn attention_mask<B: Backend>(
    [batch, heads, queries, past]: [usize; 4],
    key_padding: Option<Tensor<B, 2, Bool>>,
    device: &B::Device,
) -> Tensor<B, 4, Bool> {
    let keys = past + queries;
    let causal = causal_mask::<B>(queries, past, device)
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
