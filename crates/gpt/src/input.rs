//! What a forward pass of the [`Decoder`](crate::Decoder) takes, and which positions it projects
//! onto the vocabulary.

use burn::prelude::*;
use burn::tensor::Bool;

/// Tokens to run, with their positions and the padding of every key they attend to.
///
/// # Shapes
/// - `tokens`, `positions`: `[batch, seq]`
/// - `key_padding`: `[batch, cached + seq]`, `true` = padding (a left-padded prompt's pads)
#[derive(Debug, Clone)]
pub struct LmInput<B: Backend> {
    /// Token ids.
    pub tokens: Tensor<B, 2, Int>,
    /// Each token's position: RoPE's angle, the learned position's row.
    pub positions: Tensor<B, 2, Int>,
    /// Keys no query may attend to; `None` when there are none.
    pub key_padding: Option<Tensor<B, 2, Bool>>,
}

impl<B: Backend> LmInput<B> {
    /// Tokens that follow `past` earlier ones in every row: positions `past, past + 1, …`, no
    /// padding.
    ///
    /// # Shapes
    /// - `tokens`: `[batch, seq]`
    pub fn after(tokens: Tensor<B, 2, Int>, past: usize) -> Self {
        let [batch, seq] = tokens.dims();
        let positions =
            Tensor::<B, 1, Int>::arange(past as i64..(past + seq) as i64, &tokens.device())
                .reshape([1, seq])
                .expand([batch, seq]);
        Self {
            tokens,
            positions,
            key_padding: None,
        }
    }
}

/// Which positions a forward pass projects onto the vocabulary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// Every position.
    All,
    /// The last one: all that generation needs to pick the next token (the projection onto a
    /// large vocabulary is a good part of a long prompt's cost).
    Last,
}
