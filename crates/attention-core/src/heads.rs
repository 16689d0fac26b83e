//! The head split, its inverse and grouped heads' repetition: how `[batch, seq, heads · head_dim]`
//! projections become the `[batch, heads, seq, head_dim]` tensors that the explicit path and Burn's
//! op read, and back.

use burn::prelude::*;

/// `view(b, t, h, hd).transpose(1, 2)`: head `j` owns features `[j·hd, (j+1)·hd)`.
///
/// # Shapes
/// - `x`: `[batch, seq, heads · head_dim]`
/// - output: `[batch, heads, seq, head_dim]`
pub(crate) fn split_heads<B: Backend>(x: Tensor<B, 3>, heads: usize) -> Tensor<B, 4> {
    let [batch, seq, width] = x.dims();
    x.reshape([batch, seq, heads, width / heads])
        .swap_dims(1, 2)
}

/// The inverse of [`split_heads`]: `transpose(1, 2).reshape(b, t, h·hd)`.
///
/// # Shapes
/// - `x`: `[batch, heads, seq, head_dim]`
/// - output: `[batch, seq, heads · head_dim]`
pub(crate) fn merge_heads<B: Backend>(x: Tensor<B, 4>) -> Tensor<B, 3> {
    let [batch, heads, seq, head_dim] = x.dims();
    x.swap_dims(1, 2).reshape([batch, seq, heads * head_dim])
}

/// Each key/value head repeated for the `group` query heads that read it (Hugging Face's
/// `repeat_kv`), for the paths whose attention needs equal head counts.
///
/// # Shapes
/// - `x`: `[batch, kv_heads, keys, head_dim]`
/// - output: `[batch, kv_heads · group, keys, head_dim]`
pub(crate) fn repeat_kv<B: Backend>(x: Tensor<B, 4>, group: usize) -> Tensor<B, 4> {
    if group == 1 {
        return x;
    }
    let [batch, kv_heads, keys, head_dim] = x.dims();
    x.reshape([batch, kv_heads, 1, keys, head_dim])
        .expand([batch, kv_heads, group, keys, head_dim])
        .reshape([batch, kv_heads * group, keys, head_dim])
}
