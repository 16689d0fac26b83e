//! Next-token cross-entropy over the labels that exist ([`Labels`]): a row's last token, a packed
//! document's last token, padding and the token before padding have none.

use attention_core::AttentionError;
use burn::prelude::*;
use burn::tensor::activation::log_softmax;
use burn::tensor::{Bool, TensorData};

use crate::decoder::{Decoder, DecoderError};
use crate::input::{LmInput, Logits};

/// Each position's next-token label in a batch of rows, and which positions have none.
///
/// A position predicts the token after it in its row. It has no label — the loss leaves it out
/// and no gradient flows from it — at a row's last token (its next token is not in the batch),
/// at a document's last token in a packed row (the token after it begins another document:
/// learning it would teach the model to guess across unrelated texts), at padding, and at the
/// token before padding. A document of `L` tokens thus has `L − 1` labels, packed or alone in a
/// right-padded row.
///
/// # Shapes
/// - `targets`, `ignored`: `[batch, seq]`
#[derive(Debug, Clone)]
pub struct Labels<B: Backend> {
    /// The token each position predicts (a placeholder, token 0, where it has no label).
    pub targets: Tensor<B, 2, Int>,
    /// `true` where the position has no label.
    pub ignored: Tensor<B, 2, Bool>,
}

impl<B: Backend> Labels<B> {
    /// The labels within `input`'s rows: each token's successor in its row, ignored where
    /// [`Labels`] says. Made on the device from the tokens and the padding (no device sync), and
    /// from the documents' bounds on the host.
    ///
    /// # Shapes
    /// - `input.tokens`, `input.documents`, `input.key_padding`: `[batch, seq]` (whole rows: no
    ///   cached keys)
    ///
    /// # Errors
    /// [`AttentionError::DocumentsShape`] for documents and [`AttentionError::PaddingShape`] for
    /// a padding mask that do not cover the tokens.
    pub fn within_rows(input: &LmInput<B>) -> Result<Self, AttentionError> {
        let [batch, seq] = input.tokens.dims();
        let device = input.tokens.device();
        // Documents fill their rows, so each row's last token is its last document's last.
        let ends = match &input.documents {
            Some(documents) => {
                documents.check_shape([batch, seq])?;
                documents.last_tokens()
            }
            None => (0..batch * seq).map(|i| i % seq == seq - 1).collect(),
        };
        let mut ignored =
            Tensor::<B, 2, Bool>::from_data(TensorData::new(ends, [batch, seq]), &device);
        if let Some(padding) = &input.key_padding
            && padding.dims() != [batch, seq]
        {
            return Err(AttentionError::PaddingShape {
                expected: [batch, seq],
                found: padding.dims(),
            });
        }
        if seq == 1 {
            // Each token is the last of its row: no labels at all.
            let targets = Tensor::<B, 2, Int>::zeros([batch, 1], &device);
            return Ok(Self { targets, ignored });
        }
        let targets = Tensor::cat(
            vec![
                input.tokens.clone().narrow(1, 1, seq - 1),
                Tensor::<B, 2, Int>::zeros([batch, 1], &device),
            ],
            1,
        );
        if let Some(padding) = &input.key_padding {
            // Whether the token after each one is padding; the last column, whose label is
            // ignored already, repeats its own.
            let next_is_padding = Tensor::cat(
                vec![
                    padding.clone().narrow(1, 1, seq - 1),
                    padding.clone().narrow(1, seq - 1, 1),
                ],
                1,
            );
            ignored = ignored.bool_or(padding.clone()).bool_or(next_is_padding);
        }
        Ok(Self { targets, ignored })
    }

    /// How many positions have a label.
    ///
    /// # Shapes
    /// - output: `[1]`
    pub fn count(&self) -> Tensor<B, 1, Int> {
        self.ignored.clone().bool_not().int().sum()
    }

    /// The next-token cross-entropy of `logits` (nats) summed over the positions that have a
    /// label. A sum, so that rows laid out differently (packed or one document per row) and
    /// batches split among replicas can be averaged over the same labels: divide by the count
    /// of the labels averaged over.
    ///
    /// # Shapes
    /// - `logits`: `[batch, seq, vocab]`
    /// - output: `[1]`
    pub fn cross_entropy_sum(&self, logits: Tensor<B, 3>) -> Tensor<B, 1> {
        let [batch, seq, vocab] = logits.dims();
        let log_probs = log_softmax(logits.reshape([batch * seq, vocab]), 1);
        let picked = log_probs.gather(1, self.targets.clone().reshape([batch * seq, 1]));
        // Filled, not multiplied: a position without a label then gives no gradient at all.
        picked
            .mask_fill(self.ignored.clone().reshape([batch * seq, 1]), 0.0)
            .sum()
            .neg()
    }

    /// The mean next-token cross-entropy of `logits` (nats) over the positions that have a label
    /// ([`cross_entropy_sum`](Self::cross_entropy_sum) over [`count`](Self::count)); NaN when no
    /// position has one.
    ///
    /// # Shapes
    /// - `logits`: `[batch, seq, vocab]`
    /// - output: `[1]`
    pub fn cross_entropy(&self, logits: Tensor<B, 3>) -> Tensor<B, 1> {
        self.cross_entropy_sum(logits) / self.count().float()
    }
}

impl<B: Backend> Decoder<B> {
    /// The mean next-token cross-entropy (nats) of `input`'s rows over the labels within them
    /// ([`Labels::within_rows`]): a packed document's last token, padding and each row's last
    /// token have none.
    ///
    /// # Shapes
    /// - `input`: whole rows, `[batch, seq]` (see [`LmInput`])
    /// - output: `[1]`
    ///
    /// # Errors
    /// What [`Labels::within_rows`] and [`try_forward`](Self::try_forward) refuse.
    pub fn next_token_loss(&self, input: &LmInput<B>) -> Result<Tensor<B, 1>, DecoderError> {
        let labels = Labels::within_rows(input)?;
        let logits = self.try_forward(input, None, Logits::All)?;
        Ok(labels.cross_entropy(logits))
    }
}
