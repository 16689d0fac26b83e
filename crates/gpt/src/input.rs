//! What a forward pass of the [`Decoder`](crate::Decoder) takes, and which positions it projects
//! onto the vocabulary.

use attention_core::{AttentionError, Documents};
use burn::prelude::*;
use burn::tensor::Bool;

/// Tokens to run, with their positions, the padding of every key they attend to, and the
/// documents each row is packed from.
///
/// # Shapes
/// - `tokens`, `positions`: `[batch, seq]`
/// - `key_padding`: `[batch, cached + seq]`, `true` = padding (a left-padded prompt's pads)
/// - `documents`: `[batch, seq]` ([`Documents::shape`])
#[derive(Debug, Clone)]
pub struct LmInput<B: Backend> {
    /// Token ids.
    pub tokens: Tensor<B, 2, Int>,
    /// Each token's position: RoPE's angle, the learned position's row.
    pub positions: Tensor<B, 2, Int>,
    /// Keys no query may attend to; `None` when there are none.
    pub key_padding: Option<Tensor<B, 2, Bool>>,
    /// The documents each row is packed from: a token attends only within its own document, and
    /// a document's last token has no next-token label
    /// ([`Labels::within_rows`](crate::Labels::within_rows)). `None`: every row is one sequence.
    /// Whole sequences only (a cached forward pass with documents is refused).
    pub documents: Option<Documents>,
}

impl<B: Backend> LmInput<B> {
    /// Tokens that follow `past` earlier ones in every row: positions `past, past + 1, …`, no
    /// padding, one sequence per row.
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
            documents: None,
        }
    }

    /// Rows packed from `documents`: each token's position counted from its own document's
    /// first token (what the document would have alone, learned or rotary), no padding.
    ///
    /// # Shapes
    /// - `tokens`: `[batch, seq]`, the shape of `documents`
    ///
    /// # Errors
    /// [`AttentionError::DocumentsShape`] when the documents do not cover `tokens`' shape.
    pub fn packed(tokens: Tensor<B, 2, Int>, documents: Documents) -> Result<Self, AttentionError> {
        Self::after(tokens, 0).with_documents(documents)
    }

    /// These tokens packed from `documents`, with each token's position replaced by its position
    /// within its document (set the `positions` field after this call to give others).
    ///
    /// # Shapes
    /// - `documents`: `[batch, seq]` of `tokens`
    ///
    /// # Errors
    /// [`AttentionError::DocumentsShape`] when the documents do not cover `tokens`' shape.
    pub fn with_documents(mut self, documents: Documents) -> Result<Self, AttentionError> {
        documents.check_shape(self.tokens.dims())?;
        self.positions = documents.position_tensor(&self.tokens.device());
        self.documents = Some(documents);
        Ok(self)
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
