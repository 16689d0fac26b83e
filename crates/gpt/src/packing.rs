//! Training rows of one length cut from documents ([`TokenRows`]): packed in order, a row filled
//! before the next, or one document per row, right-padded — the two layouts packed training is
//! measured against.

use attention_core::{AttentionError, Documents};
use burn::prelude::*;
use burn::tensor::{Bool, TensorData};
use thiserror::Error;

use crate::input::LmInput;

/// How [`TokenRows`] lays documents into rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowLayout {
    /// Documents in order, each row filled before the next: a document that does not fit the
    /// rest of a row continues at the start of the next one, as a document of its own there.
    /// Only the last row can have padding. Its batches carry [`Documents`].
    Packed,
    /// One document per row, right-padded; a document longer than a row takes several rows,
    /// one piece each. Its batches carry key padding and no documents: what training without
    /// packing is.
    OnePerRow,
}

/// Why documents could not be laid into rows.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum PackingError {
    /// Rows of no tokens.
    #[error("rows must hold at least 1 token")]
    ZeroLength,
    /// A document without tokens (it would be a document of length 0).
    #[error("document {0} has no tokens")]
    EmptyDocument(usize),
    /// No documents at all.
    #[error("no documents to lay into rows")]
    NoDocuments,
}

/// Rows of `seq` tokens cut from documents, with each row's documents and right padding.
///
/// Every token of every document is kept, in order; a piece of a document that a row boundary
/// (or, in [`RowLayout::OnePerRow`], the row's length) cuts off is a document of its own in its
/// row, so the label of its last token — the next piece's first — is not learned.
///
/// ```
/// use gpt::{RowLayout, TokenRows};
///
/// let documents = [vec![1u32, 2, 3], vec![4], vec![5, 6, 7, 8, 9]];
/// let rows = TokenRows::new(&documents, 4, RowLayout::Packed, 0).unwrap();
/// assert_eq!(rows.len(), 3);
/// assert_eq!(rows.row(0), [1, 2, 3, 4]);
/// assert_eq!(rows.lengths(1), [4]); // the first 4 tokens of the third document
/// assert_eq!((rows.row(2), rows.padding(2)), (&[9, 0, 0, 0][..], 3));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenRows {
    seq: usize,
    layout: RowLayout,
    /// `[rows, seq]`, row-major; padding holds the pad id.
    ids: Vec<u32>,
    /// Per row, the lengths of its documents' pieces, in order (padding left out).
    lengths: Vec<Vec<usize>>,
    /// Per row, its padding tokens, all at its end.
    padding: Vec<usize>,
}

impl TokenRows {
    /// `documents` laid into rows of `seq` tokens as `layout` says; padding tokens hold `pad`
    /// (any token id: no label and no key reads them).
    ///
    /// # Errors
    /// [`PackingError::ZeroLength`] for `seq` 0, [`PackingError::NoDocuments`] without
    /// documents, [`PackingError::EmptyDocument`] for a document of no tokens.
    pub fn new<D: AsRef<[u32]>>(
        documents: &[D],
        seq: usize,
        layout: RowLayout,
        pad: u32,
    ) -> Result<Self, PackingError> {
        if seq == 0 {
            return Err(PackingError::ZeroLength);
        }
        if documents.is_empty() {
            return Err(PackingError::NoDocuments);
        }
        if let Some(empty) = documents.iter().position(|d| d.as_ref().is_empty()) {
            return Err(PackingError::EmptyDocument(empty));
        }
        let mut rows = Self {
            seq,
            layout,
            ids: Vec::new(),
            lengths: Vec::new(),
            padding: Vec::new(),
        };
        match layout {
            RowLayout::Packed => {
                let mut row = Vec::new();
                let mut used = 0;
                for document in documents {
                    let mut rest = document.as_ref();
                    while !rest.is_empty() {
                        let take = rest.len().min(seq - used);
                        rows.ids.extend_from_slice(&rest[..take]);
                        row.push(take);
                        used += take;
                        rest = &rest[take..];
                        if used == seq {
                            rows.lengths.push(std::mem::take(&mut row));
                            rows.padding.push(0);
                            used = 0;
                        }
                    }
                }
                if used > 0 {
                    rows.ids.extend(std::iter::repeat_n(pad, seq - used));
                    rows.lengths.push(row);
                    rows.padding.push(seq - used);
                }
            }
            RowLayout::OnePerRow => {
                for piece in documents.iter().flat_map(|d| d.as_ref().chunks(seq)) {
                    rows.ids.extend_from_slice(piece);
                    rows.ids.extend(std::iter::repeat_n(pad, seq - piece.len()));
                    rows.lengths.push(vec![piece.len()]);
                    rows.padding.push(seq - piece.len());
                }
            }
        }
        Ok(rows)
    }

    /// The number of rows (at least 1).
    pub fn len(&self) -> usize {
        self.lengths.len()
    }

    /// Always `false`: rows come from at least one document of at least one token.
    pub fn is_empty(&self) -> bool {
        self.lengths.is_empty()
    }

    /// Tokens per row.
    pub fn seq(&self) -> usize {
        self.seq
    }

    /// How the documents were laid out.
    pub fn layout(&self) -> RowLayout {
        self.layout
    }

    /// Row `row`'s tokens, its padding included.
    pub fn row(&self, row: usize) -> &[u32] {
        &self.ids[row * self.seq..(row + 1) * self.seq]
    }

    /// The lengths of row `row`'s documents (their pieces in it), in order, padding left out.
    pub fn lengths(&self, row: usize) -> &[usize] {
        &self.lengths[row]
    }

    /// Row `row`'s padding: its last `padding(row)` tokens.
    pub fn padding(&self, row: usize) -> usize {
        self.padding[row]
    }

    /// The tokens of `rows` that are not padding.
    pub fn real_tokens(&self, rows: &[usize]) -> usize {
        rows.iter().map(|&row| self.seq - self.padding[row]).sum()
    }

    /// The next-token labels within the documents of `rows`: `L − 1` for each piece of `L`
    /// tokens, as [`Labels::within_rows`](crate::Labels::within_rows) counts them on
    /// [`input`](Self::input).
    pub fn labels(&self, rows: &[usize]) -> usize {
        rows.iter()
            .flat_map(|&row| &self.lengths[row])
            .map(|length| length - 1)
            .sum()
    }

    /// The documents of `rows`, in that order, padding as a document of its own.
    ///
    /// # Errors
    /// [`AttentionError::EmptyBatch`] when `rows` is empty.
    ///
    /// # Panics
    /// When a row index is out of range.
    pub fn documents(&self, rows: &[usize]) -> Result<Documents, AttentionError> {
        let lengths: Vec<Vec<usize>> = rows
            .iter()
            .map(|&row| {
                let mut lengths = self.lengths[row].clone();
                if self.padding[row] > 0 {
                    lengths.push(self.padding[row]);
                }
                lengths
            })
            .collect();
        Documents::from_lengths(&lengths)
    }

    /// `rows` (indices, in that order) as a model's input: the tokens; with
    /// [`RowLayout::Packed`], their documents and the positions restarted in each
    /// ([`LmInput::packed`]); with [`RowLayout::OnePerRow`], positions from 0; and the key
    /// padding where a row has padding.
    ///
    /// # Shapes
    /// - output: `[rows.len(), seq]`
    ///
    /// # Errors
    /// [`AttentionError::EmptyBatch`] when `rows` is empty.
    ///
    /// # Panics
    /// When a row index is out of range.
    pub fn input<B: Backend>(
        &self,
        rows: &[usize],
        device: &B::Device,
    ) -> Result<LmInput<B>, AttentionError> {
        if rows.is_empty() {
            return Err(AttentionError::EmptyBatch);
        }
        let shape = [rows.len(), self.seq];
        let ids: Vec<i64> = rows
            .iter()
            .flat_map(|&row| self.row(row).iter().map(|&id| i64::from(id)))
            .collect();
        let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, shape), device);
        let mut input = match self.layout {
            RowLayout::Packed => LmInput::packed(tokens, self.documents(rows)?)?,
            RowLayout::OnePerRow => LmInput::after(tokens, 0),
        };
        if rows.iter().any(|&row| self.padding[row] > 0) {
            let padded: Vec<bool> = rows
                .iter()
                .flat_map(|&row| (0..self.seq).map(move |i| i >= self.seq - self.padding[row]))
                .collect();
            input.key_padding = Some(Tensor::<B, 2, Bool>::from_data(
                TensorData::new(padded, shape),
                device,
            ));
        }
        Ok(input)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Documents of varied lengths: 1 token, shorter than a row, exactly a row, longer than two.
    fn documents() -> Vec<Vec<u32>> {
        let lengths = [3, 1, 5, 4, 11, 2];
        let mut next = 0;
        lengths
            .iter()
            .map(|&length| {
                let document = (next..next + length).collect();
                next += length;
                document
            })
            .collect()
    }

    /// Every row's real tokens, concatenated.
    fn real(rows: &TokenRows) -> Vec<u32> {
        (0..rows.len())
            .flat_map(|row| rows.row(row)[..rows.seq() - rows.padding(row)].to_vec())
            .collect()
    }

    #[test]
    fn packed_rows_keep_every_token_in_order_and_fill_each_row_before_the_next() {
        let documents = documents();
        let rows = TokenRows::new(&documents, 4, RowLayout::Packed, 99).unwrap();
        assert_eq!(real(&rows), documents.concat());
        assert_eq!(rows.len(), 7, "26 tokens in rows of 4");
        for row in 0..rows.len() {
            let filled = rows.lengths(row).iter().sum::<usize>() + rows.padding(row);
            assert_eq!(filled, 4, "row {row}");
            if row + 1 < rows.len() {
                assert_eq!(rows.padding(row), 0, "only the last row is padded");
            }
        }
        assert_eq!(rows.row(6), [24, 25, 99, 99]);
        // The rows' pieces, row by row: the 5-token document fills a row and spills into the
        // next, the 11-token one ends a row, then fills two.
        let pieces: Vec<Vec<usize>> = (0..rows.len())
            .map(|row| rows.lengths(row).to_vec())
            .collect();
        let expected = [
            vec![3, 1],
            vec![4],
            vec![1, 3],
            vec![1, 3],
            vec![4],
            vec![4],
            vec![2],
        ];
        assert_eq!(pieces, expected);
        let everything: Vec<usize> = (0..rows.len()).collect();
        // One label less per piece than its tokens: 10 pieces.
        assert_eq!(rows.labels(&everything), 26 - 10);
        assert_eq!(rows.real_tokens(&everything), 26);
        let documents = rows.documents(&[6, 0]).unwrap();
        assert_eq!(documents.shape(), [2, 4]);
        assert_eq!(
            documents.lengths(0),
            [2, 2],
            "padding is a document of its own"
        );
    }

    #[test]
    fn one_document_per_row_pads_each_and_splits_the_long_ones() {
        let documents = documents();
        let rows = TokenRows::new(&documents, 4, RowLayout::OnePerRow, 0).unwrap();
        assert_eq!(real(&rows), documents.concat());
        let pieces: Vec<usize> = (0..rows.len()).map(|row| rows.lengths(row)[0]).collect();
        assert_eq!(pieces, [3, 1, 4, 1, 4, 4, 4, 3, 2]);
        for (row, piece) in pieces.iter().enumerate() {
            assert_eq!(rows.lengths(row).len(), 1);
            assert_eq!(rows.padding(row), 4 - piece);
        }
        assert_eq!(rows.row(1), [3, 0, 0, 0]);
    }

    #[test]
    fn what_cannot_be_laid_out_is_refused() {
        let documents = documents();
        assert_eq!(
            TokenRows::new(&documents, 0, RowLayout::Packed, 0),
            Err(PackingError::ZeroLength)
        );
        assert_eq!(
            TokenRows::new::<Vec<u32>>(&[], 4, RowLayout::Packed, 0),
            Err(PackingError::NoDocuments)
        );
        assert_eq!(
            TokenRows::new(&[vec![1u32], vec![]], 4, RowLayout::OnePerRow, 0),
            Err(PackingError::EmptyDocument(1))
        );
        let rows = TokenRows::new(&documents, 4, RowLayout::Packed, 0).unwrap();
        assert_eq!(rows.documents(&[]), Err(AttentionError::EmptyBatch));
    }
}
