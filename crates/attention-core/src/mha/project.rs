//! The layer's projections: queries, keys and values in (normed and rotated as the config says,
//! in the layout the attention core reads), and the heads merged and projected out.

use super::*;
use crate::heads::repeat_kv;

impl<B: Backend> MultiHeadAttention<B> {
    /// The one projection step of every path: queries, keys and values from `x`, queries and keys
    /// normalized (with q/k norms: over the projection's width before the head split, or per head
    /// after it) and then turned by their positions (with RoPE), each split into heads in `layout`
    /// as soon as it is made. Keys and values keep their `num_kv_heads` heads. Every attention
    /// core reads what this makes, so each variant here holds on every path.
    ///
    /// # Shapes
    /// - `x`: `[batch, seq, input_dim]`
    /// - output: `[batch, seq, heads, head_dim]` ([`HeadLayout::SideBySide`]) or
    ///   `[batch, heads, seq, head_dim]` ([`HeadLayout::Split`]), with `num_heads` heads for the
    ///   queries and `num_kv_heads` for keys and values
    ///
    /// Burn 0.21 workaround. Splitting each projection as soon as it is made matters: projecting
    /// all three first and splitting afterwards gives wrong `output_layer` weight gradients on
    /// Burn 0.21's wgpu (fusion) backend for a one-token sequence (`tests/layer/parity.rs`,
    /// `book_s0_b1_t1_i4_o4_h1_bias`).
    pub(super) fn project(
        &self,
        x: Tensor<B, 3>,
        positions: &Positions<B>,
        layout: HeadLayout,
    ) -> [Tensor<B, 4>; 3] {
        let [batch, seq, _] = x.dims();
        // One set of angles for the queries and the keys.
        let angles = self.rotary.as_ref().map(|rotary| {
            (
                rotary,
                rotary.angles(positions, seq, x.dtype(), &x.device()),
            )
        });
        let scope = self.qk_norm.as_ref().map(|config| config.scope);
        let layers = [
            (
                &self.query_layer,
                self.num_heads,
                self.query_norm.as_ref(),
                angles.as_ref(),
            ),
            (
                &self.key_layer,
                self.num_kv_heads,
                self.key_norm.as_ref(),
                angles.as_ref(),
            ),
            (&self.value_layer, self.num_kv_heads, None, None),
        ];
        // On a bare CPU backend the three products are one call; elsewhere each is made when
        // its turn comes (see above).
        let mut on_host =
            projection::linears_on_host(layers.map(|(layer, ..)| layer), &x, &self.packed_inputs)
                .map(IntoIterator::into_iter);
        layers.map(|(layer, heads, norm, angles)| {
            let norm_at = |at: QkNormScope| norm.filter(|_| scope == Some(at));
            // [batch, seq, heads · head_dim]
            let projected = match on_host.as_mut().and_then(Iterator::next) {
                Some(projected) => projected,
                None => projection::linear(layer, x.clone(), &self.packed_inputs),
            };
            let projected = match norm_at(QkNormScope::Width) {
                Some(norm) => norm.forward(projected),
                None => projected,
            };
            let side_by_side = projected.reshape([batch, seq, heads, self.head_dim]);
            let side_by_side = match norm_at(QkNormScope::Head) {
                Some(norm) => norm.forward(side_by_side),
                None => side_by_side,
            };
            let side_by_side = match angles {
                Some((rotary, angles)) => rotary.apply(side_by_side, angles),
                None => side_by_side,
            };
            match layout {
                HeadLayout::SideBySide => side_by_side,
                // `view(b, t, h, hd).transpose(1, 2)`: head `j` owns features `[j·hd, (j+1)·hd)`.
                HeadLayout::Split => side_by_side.swap_dims(1, 2),
            }
        })
    }

    /// [`project`](Self::project) for a kernel: the heads side by side in one feature dimension,
    /// as the projections made them.
    ///
    /// # Shapes
    /// - `x`: `[batch, seq, input_dim]`
    /// - output: `[batch, seq, heads · head_dim]`, with `num_heads` heads for the queries and
    ///   `num_kv_heads` for keys and values
    pub(super) fn project_side_by_side(
        &self,
        x: Tensor<B, 3>,
        positions: &Positions<B>,
    ) -> [Tensor<B, 3>; 3] {
        self.project(x, positions, HeadLayout::SideBySide).map(|t| {
            let [batch, seq, heads, head_dim] = t.dims();
            t.reshape([batch, seq, heads * head_dim])
        })
    }

    /// Each key/value head repeated for the query heads of its group, for the paths whose
    /// attention needs equal head counts.
    ///
    /// # Shapes
    /// - `x`: `[batch, kv_heads, keys, head_dim]`
    /// - output: `[batch, heads, keys, head_dim]`
    pub(super) fn repeat_kv(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        repeat_kv(x, self.num_heads / self.num_kv_heads)
    }

    /// The output projection of the heads' merged contexts: the last step of every entry point.
    ///
    /// # Shapes
    /// - `context`: `[batch, seq, heads · head_dim]`
    /// - output: `[batch, seq, output_dim]`
    pub(super) fn project_output(&self, context: Tensor<B, 3>) -> Tensor<B, 3> {
        projection::linear(&self.output_layer, context, &self.packed_output)
    }
}

/// How [`MultiHeadAttention::project`] lays out the heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum HeadLayout {
    /// `[batch, seq, heads, head_dim]`: the projection's memory as it is (the CPU kernel's).
    SideBySide,
    /// `[batch, heads, seq, head_dim]`: PyTorch's `transpose(1, 2)` (the tensor ops' layout).
    Split,
}
