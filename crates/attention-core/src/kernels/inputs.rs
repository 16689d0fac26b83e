//! What a kernel is called with.

use burn::prelude::*;
use burn::tensor::Bool;

use crate::documents::Documents;
use crate::score_rule::ScoreRule;

/// The inputs of causal attention with the heads still side by side, as the projections made
/// them.
///
/// # Shapes
/// - `query`: `[batch, queries, heads · head_dim]`
/// - `key`, `value`: `[batch, keys, kv_heads · head_dim]`
/// - `key_padding`: `[batch, keys]`, `true` = padding
/// - `documents`: `[batch, keys]` with `queries == keys`
#[derive(Debug, Clone)]
pub(crate) struct KernelInputs<B: Backend> {
    pub query: Tensor<B, 3>,
    pub key: Tensor<B, 3>,
    pub value: Tensor<B, 3>,
    pub heads: usize,
    pub kv_heads: usize,
    pub window: Option<usize>,
    pub key_padding: Option<Tensor<B, 2, Bool>>,
    /// The documents each sequence is packed from, checked against the shapes.
    pub documents: Option<Documents>,
    pub scores: ScoreRule<B>,
}
