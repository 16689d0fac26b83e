//! Documents packed into the rows of a batch ([`Documents`]): where each starts, checked once on
//! the host, and what every attention core and the model read of them.

use burn::prelude::*;
use burn::tensor::{Bool, Int, TensorData};

use crate::error::AttentionError;

/// Where the documents of each row of a packed batch begin and end: a query sees only the keys
/// of its own document (at or before its position, and within a window where the layer has one).
///
/// Training packs documents of every length into rows of one length; without this, a document
/// would attend to the one before it. The kernels skip every block of queries and keys that lies
/// across documents, so a packed row costs the sum of its documents' attention, not the row's.
/// Rows may pack differently; every row's documents fill it exactly (a row's unused tail is a
/// document of its own, marked as padding where it should not count, see
/// [`AttentionInput::key_padding`](crate::AttentionInput::key_padding)).
///
/// Built once per batch on the host, from each row's document lengths (a packer's output) or
/// from segment ids (one id per token, as `segment_ids` files and FlexAttention's document masks
/// have them). FlashAttention's `cu_seqlens` are each row's running sums of the lengths.
///
/// ```
/// use attention_core::Documents;
///
/// // Two rows of 6 tokens: documents of 2 and 4 tokens, and one of 6.
/// let documents = Documents::from_lengths(&[vec![2, 4], vec![6]]).unwrap();
/// assert_eq!(documents.shape(), [2, 6]);
/// // Positions restart in every document.
/// assert_eq!(documents.positions(), vec![0, 1, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5]);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Documents {
    seq: usize,
    /// Per row, its documents' lengths in order: each at least 1, summing to `seq`.
    lengths: Vec<Vec<usize>>,
}

impl Documents {
    /// Documents of the given lengths, row by row, in order.
    ///
    /// # Errors
    /// [`AttentionError::EmptyBatch`] without rows, [`AttentionError::EmptyDocument`] for a
    /// length of 0, and [`AttentionError::DocumentsDoNotFill`] when a row's lengths do not sum to
    /// the first row's.
    pub fn from_lengths(rows: &[Vec<usize>]) -> Result<Self, AttentionError> {
        let seq = rows
            .first()
            .ok_or(AttentionError::EmptyBatch)?
            .iter()
            .sum::<usize>();
        for (row, lengths) in rows.iter().enumerate() {
            if let Some(document) = lengths.iter().position(|&length| length == 0) {
                return Err(AttentionError::EmptyDocument { row, document });
            }
            let sum = lengths.iter().sum::<usize>();
            if sum != seq || seq == 0 {
                return Err(AttentionError::DocumentsDoNotFill { row, sum, seq });
            }
        }
        Ok(Self {
            seq,
            lengths: rows.to_vec(),
        })
    }

    /// Every row one document of `seq` tokens: what an unpacked batch is.
    ///
    /// # Panics
    /// When `batch` or `seq` is 0.
    pub fn whole_rows(batch: usize, seq: usize) -> Self {
        assert!(batch > 0 && seq > 0, "a batch of {batch} rows of {seq}");
        Self {
            seq,
            lengths: vec![vec![seq]; batch],
        }
    }

    /// The documents that segment ids `[batch, seq]` describe: a document is a run of equal ids
    /// (ids need not be consecutive). Reads the ids to the host (one device sync).
    ///
    /// # Errors
    /// [`AttentionError::SegmentIds`] for a negative id or one smaller than the id before it, and
    /// the errors of [`Documents::from_segment_id_rows`].
    pub fn from_segment_ids<B: Backend>(ids: Tensor<B, 2, Int>) -> Result<Self, AttentionError> {
        let [batch, seq] = ids.dims();
        let data = ids.into_data().convert::<i64>();
        let ids = data.as_slice::<i64>().expect("converted to i64");
        Self::from_segment_id_rows(ids, [batch, seq])
    }

    /// [`Documents::from_segment_ids`] on host data: `ids` is `[batch, seq]`, row-major.
    ///
    /// # Errors
    /// [`AttentionError::EmptyBatch`] / [`AttentionError::EmptySequence`] for a zero size,
    /// [`AttentionError::SegmentIds`] for a negative id or one smaller than the id before it.
    ///
    /// # Panics
    /// When `ids` does not hold `batch · seq` elements.
    pub fn from_segment_id_rows(
        ids: &[i64],
        [batch, seq]: [usize; 2],
    ) -> Result<Self, AttentionError> {
        assert_eq!(ids.len(), batch * seq, "segment ids of [{batch}, {seq}]");
        if batch == 0 {
            return Err(AttentionError::EmptyBatch);
        }
        if seq == 0 {
            return Err(AttentionError::EmptySequence);
        }
        let mut lengths = Vec::with_capacity(batch);
        for (row, ids) in ids.chunks(seq).enumerate() {
            let mut row_lengths = vec![0];
            for (position, &id) in ids.iter().enumerate() {
                let problem = if id < 0 {
                    Some("is negative")
                } else if position > 0 && id < ids[position - 1] {
                    Some("is smaller than the one before it (ids must not decrease along a row)")
                } else {
                    None
                };
                if let Some(problem) = problem {
                    return Err(AttentionError::SegmentIds {
                        row,
                        position,
                        id,
                        problem,
                    });
                }
                if position > 0 && id != ids[position - 1] {
                    row_lengths.push(0);
                }
                *row_lengths.last_mut().expect("one document at least") += 1;
            }
            lengths.push(row_lengths);
        }
        Ok(Self { seq, lengths })
    }

    /// `[batch, seq]`.
    pub fn shape(&self) -> [usize; 2] {
        [self.lengths.len(), self.seq]
    }

    /// The lengths of row `row`'s documents, in order.
    pub fn lengths(&self, row: usize) -> &[usize] {
        &self.lengths[row]
    }

    /// Every token's position within its own document, row-major `[batch, seq]`: what a model's
    /// positions are when each document is a sequence of its own.
    pub fn positions(&self) -> Vec<i64> {
        self.per_token(|_, start, position| (position - start) as i64)
    }

    /// [`Documents::positions`] as a tensor on `device`, as
    /// [`AttentionInput::positions`](crate::AttentionInput::positions) takes them.
    ///
    /// # Shapes
    /// - output: `[batch, seq]`
    pub fn position_tensor<B: Backend>(&self, device: &B::Device) -> Tensor<B, 2, Int> {
        Tensor::from_data(TensorData::new(self.positions(), self.shape()), device)
    }

    /// Whether each token is the last of its document, row-major `[batch, seq]`: the tokens whose
    /// next-token label would cross into another document.
    pub fn last_tokens(&self) -> Vec<bool> {
        self.per_token(|end, _, position| position + 1 == end)
    }

    /// Each token's document, numbered from 0 in every row, row-major `[batch, seq]`.
    pub fn segment_ids(&self) -> Vec<i64> {
        let mut ids = Vec::with_capacity(self.lengths.len() * self.seq);
        for row in &self.lengths {
            for (document, &length) in row.iter().enumerate() {
                ids.extend(std::iter::repeat_n(document as i64, length));
            }
        }
        ids
    }

    /// Whether every row is one document: then the documents change nothing.
    pub fn is_whole_rows(&self) -> bool {
        self.lengths.iter().all(|row| row.len() == 1)
    }

    /// The key/query pairs across documents, `true` where query `i` and key `j` of a row lie in
    /// different documents: the explicit path's document mask.
    ///
    /// # Shapes
    /// - output: `[batch, seq, seq]`, `true` = masked
    pub fn mask<B: Backend>(&self, device: &B::Device) -> Tensor<B, 3, Bool> {
        let [batch, seq] = self.shape();
        let ids = Tensor::<B, 2, Int>::from_data(
            TensorData::new(self.segment_ids(), [batch, seq]),
            device,
        );
        let queries = ids
            .clone()
            .reshape([batch, seq, 1])
            .expand([batch, seq, seq]);
        let keys = ids.reshape([batch, 1, seq]).expand([batch, seq, seq]);
        queries.not_equal(keys)
    }

    /// Each token's document as `[start, end)`, row-major `[batch, seq, 2]`, the start and end
    /// counted within the row: what the kernels read to skip and mask.
    pub(crate) fn spans(&self) -> Vec<u32> {
        let mut spans = Vec::with_capacity(self.lengths.len() * self.seq * 2);
        for row in &self.lengths {
            let mut start = 0;
            for &length in row {
                for _ in 0..length {
                    spans.extend([start as u32, (start + length) as u32]);
                }
                start += length;
            }
        }
        spans
    }

    /// Checks that these documents cover tokens of shape `[batch, seq]`.
    ///
    /// # Errors
    /// [`AttentionError::DocumentsShape`] when they cover another shape.
    pub fn check_shape(&self, expected: [usize; 2]) -> Result<(), AttentionError> {
        if self.shape() == expected {
            Ok(())
        } else {
            Err(AttentionError::DocumentsShape {
                expected,
                found: self.shape(),
            })
        }
    }

    /// Checks these documents against a call's `[batch, seq]` and its key padding: a document is
    /// all padding or has none.
    pub(crate) fn check(
        &self,
        expected: [usize; 2],
        key_padding: Option<&[bool]>,
    ) -> Result<(), AttentionError> {
        self.check_shape(expected)?;
        let Some(padding) = key_padding else {
            return Ok(());
        };
        for (row, (lengths, padding)) in self
            .lengths
            .iter()
            .zip(padding.chunks(self.seq))
            .enumerate()
        {
            let mut start = 0;
            for (document, &length) in lengths.iter().enumerate() {
                let tokens = &padding[start..start + length];
                if tokens.iter().any(|&padded| padded != tokens[0]) {
                    return Err(AttentionError::PaddingSplitsDocument { row, document });
                }
                start += length;
            }
        }
        Ok(())
    }

    /// `value(end, start, position)` for every token, row-major, with its document's bounds.
    fn per_token<T>(&self, value: impl Fn(usize, usize, usize) -> T) -> Vec<T> {
        let mut values = Vec::with_capacity(self.lengths.len() * self.seq);
        for row in &self.lengths {
            let mut start = 0;
            for &length in row {
                values.extend(
                    (start..start + length).map(|position| value(start + length, start, position)),
                );
                start += length;
            }
        }
        values
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segment_ids_and_lengths_describe_the_same_documents() {
        let ids = [3, 3, 7, 7, 7, 9, 0, 0, 0, 0, 0, 0];
        let from_ids = Documents::from_segment_id_rows(&ids, [2, 6]).unwrap();
        let from_lengths = Documents::from_lengths(&[vec![2, 3, 1], vec![6]]).unwrap();
        assert_eq!(from_ids, from_lengths);
        assert_eq!(from_ids.segment_ids(), [0, 0, 1, 1, 1, 2, 0, 0, 0, 0, 0, 0]);
        assert_eq!(from_ids.positions(), [0, 1, 0, 1, 2, 0, 0, 1, 2, 3, 4, 5]);
        let last = [false, true, false, false, true, true];
        assert_eq!(&from_ids.last_tokens()[..6], last);
        assert_eq!(
            &from_ids.spans()[..12],
            [0, 2, 0, 2, 2, 5, 2, 5, 2, 5, 5, 6]
        );
        assert!(!from_ids.is_whole_rows());
        assert!(Documents::whole_rows(2, 6).is_whole_rows());
    }

    #[test]
    fn bad_ids_and_lengths_name_what_is_wrong() {
        let error = Documents::from_segment_id_rows(&[0, 1, 0], [1, 3]).unwrap_err();
        assert!(matches!(
            error,
            AttentionError::SegmentIds {
                row: 0,
                position: 2,
                id: 0,
                ..
            }
        ));
        let error = Documents::from_segment_id_rows(&[0, 0, 0, 0, -1, -1], [2, 3]).unwrap_err();
        assert!(matches!(
            error,
            AttentionError::SegmentIds {
                row: 1,
                position: 1,
                id: -1,
                ..
            }
        ));
        assert_eq!(
            Documents::from_lengths(&[vec![2, 0, 1]]),
            Err(AttentionError::EmptyDocument {
                row: 0,
                document: 1
            })
        );
        assert_eq!(
            Documents::from_lengths(&[vec![2, 1], vec![2]]),
            Err(AttentionError::DocumentsDoNotFill {
                row: 1,
                sum: 2,
                seq: 3
            })
        );
        assert_eq!(
            Documents::from_lengths(&[]),
            Err(AttentionError::EmptyBatch)
        );
    }

    #[test]
    fn padding_must_cover_whole_documents() {
        let documents = Documents::from_lengths(&[vec![2, 2]]).unwrap();
        assert_eq!(
            documents.check([1, 4], Some(&[false, false, true, true])),
            Ok(())
        );
        assert_eq!(
            documents.check([1, 4], Some(&[false, true, true, true])),
            Err(AttentionError::PaddingSplitsDocument {
                row: 0,
                document: 0
            })
        );
        assert_eq!(
            documents.check([2, 4], None),
            Err(AttentionError::DocumentsShape {
                expected: [2, 4],
                found: [1, 4]
            })
        );
    }
}
