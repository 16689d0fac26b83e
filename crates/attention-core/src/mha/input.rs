//! What a forward pass takes beyond the tokens ([`AttentionInput`]) and what a traced one shows
//! ([`AttentionTrace`]).

use super::*;

/// A forward pass's input beyond the tokens: an optional key-padding mask, the tokens' positions
/// (for rotary embeddings), the documents each row is packed from, and the path to take.
///
/// ```
/// # use attention_core::{AttentionInput, AttentionPath};
/// # use burn::backend::NdArray;
/// # use burn::prelude::*;
/// # let device = Default::default();
/// let x = Tensor::<NdArray, 3>::zeros([2, 3, 4], &device);
/// // The first sequence is left-padded by one token.
/// let padding = Tensor::<NdArray, 2, Bool>::from_bool(
///     TensorData::from([[true, false, false], [false, false, false]]),
///     &device,
/// );
/// let input = AttentionInput::new(x).key_padding(padding).path(AttentionPath::Explicit);
/// ```
///
/// Every forward pass of [`MultiHeadAttention`] takes an input or a bare tensor alike
/// (`impl Into<AttentionInput<B>>`): a tensor is [`AttentionInput::new`] of it.
#[derive(Debug, Clone)]
pub struct AttentionInput<B: Backend> {
    pub(super) x: Tensor<B, 3>,
    pub(super) key_padding: Option<Tensor<B, 2, Bool>>,
    pub(super) positions: Option<Tensor<B, 2, Int>>,
    pub(super) documents: Option<Documents>,
    pub(super) path: AttentionPath,
}

impl<B: Backend> AttentionInput<B> {
    /// Tokens `x` of shape `[batch, seq, input_dim]`, no padding, positions counted from the
    /// first token (or from the cache's length), [`AttentionPath::Auto`].
    pub fn new(x: Tensor<B, 3>) -> Self {
        Self {
            x,
            key_padding: None,
            positions: None,
            documents: None,
            path: AttentionPath::Auto,
        }
    }

    /// Marks padding tokens, which no query attends to. With a cache, the mask covers the cached
    /// positions too (as Hugging Face's `attention_mask` does).
    ///
    /// # Shapes
    /// - `mask`: `[batch, seq]`, or `[batch, cached + seq]` with a cache; `true` = padding
    pub fn key_padding(mut self, mask: Tensor<B, 2, Bool>) -> Self {
        self.key_padding = Some(mask);
        self
    }

    /// The rotary positions of every token, per row: a left-padded row counts its positions from
    /// its first real token (Hugging Face's `cumsum(attention_mask) − 1`). Without them, row
    /// positions are `cached, cached + 1, …`. Ignored by a layer without RoPE.
    ///
    /// # Shapes
    /// - `positions`: `[batch, seq]`
    pub fn positions(mut self, positions: Tensor<B, 2, Int>) -> Self {
        self.positions = Some(positions);
        self
    }

    /// Packs each row from several documents: a token attends only to the tokens of its own
    /// document (at or before it, and within the layer's window). Without explicit
    /// [`positions`](Self::positions), a layer with rotary embeddings counts each document's
    /// positions from 0, as if it ran alone. Whole sequences only: a cached call with documents
    /// is [`AttentionError::DocumentsWithCache`].
    ///
    /// ```
    /// # use attention_core::{AttentionInput, Documents};
    /// # use burn::backend::NdArray;
    /// # use burn::prelude::*;
    /// # let device = Default::default();
    /// let x = Tensor::<NdArray, 3>::zeros([1, 5, 4], &device);
    /// // Documents of 2 and 3 tokens in one row.
    /// let documents = Documents::from_lengths(&[vec![2, 3]]).unwrap();
    /// let input = AttentionInput::new(x).documents(documents);
    /// ```
    ///
    /// # Shapes
    /// - `documents`: `[batch, seq]` of the input ([`Documents::shape`])
    pub fn documents(mut self, documents: Documents) -> Self {
        self.documents = Some(documents);
        self
    }

    /// Chooses how the attention core is computed.
    pub fn path(mut self, path: AttentionPath) -> Self {
        self.path = path;
        self
    }
}

impl<B: Backend> From<Tensor<B, 3>> for AttentionInput<B> {
    fn from(x: Tensor<B, 3>) -> Self {
        Self::new(x)
    }
}

/// What the source chapter prints during a forward pass, with the output.
#[derive(Debug, Clone)]
pub struct AttentionTrace<B: Backend> {
    /// The layer's output, `[batch, seq, output_dim]`.
    pub output: Tensor<B, 3>,
    /// `q kᵀ` per head, before scaling: `[batch, heads, seq, seq]`.
    pub scores: Tensor<B, 4>,
    /// The scores with `-inf` above the diagonal: `[batch, heads, seq, seq]`.
    pub masked_scores: Tensor<B, 4>,
    /// `softmax(masked_scores / √head_dim)` before dropout: `[batch, heads, seq, seq]`; rows sum
    /// to 1 and the upper triangle is exactly 0.
    pub weights: Tensor<B, 4>,
}
