//! The decoder over a page pool: a ragged step of any number of sequences, each at its own
//! length, through every block — what a continuous-batching scheduler calls.
//!
//! A model's attention kinds are its blocks' sliding windows (`None` for global attention):
//! Gemma 2/3, Qwen2/3 and SmolLM3 window some layers only. Each kind has its own page table
//! per sequence ([`SequencePages`]), since a windowed kind lets go of pages a global one keeps,
//! and its own [`RaggedStep`] per step; each block has its own [`LayerPages`].

use attention_core::{AttentionError, LayerPages, PagePool, PageTable, RaggedStep};
use burn::prelude::*;
use burn::tensor::TensorData;

use crate::block::per_token;
use crate::decoder::{Decoder, DecoderError};
use crate::input::Logits;

/// One sequence's page tables, one per attention kind of a model ([`Decoder::attention_kinds`]).
#[derive(Debug)]
pub struct SequencePages {
    tables: Vec<PageTable>,
}

impl SequencePages {
    /// Positions stored so far (the next token's position).
    pub fn len(&self) -> usize {
        self.tables.first().map_or(0, PageTable::len)
    }

    /// Whether nothing is stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Pages held, over every attention kind.
    pub fn pages_held(&self) -> usize {
        self.tables.iter().map(PageTable::pages_held).sum()
    }

    /// A new sequence that starts with this one's first `positions` positions, sharing their
    /// pages in every attention kind (see [`PagePool::share`]).
    pub fn share(&self, pool: &mut PagePool, positions: usize) -> Result<Self, AttentionError> {
        let mut tables = Vec::with_capacity(self.tables.len());
        for table in &self.tables {
            match pool.share(table, positions) {
                Ok(shared) => tables.push(shared),
                Err(error) => {
                    for mut shared in tables {
                        pool.release(&mut shared);
                    }
                    return Err(error);
                }
            }
        }
        Ok(Self { tables })
    }

    /// Lets go of every page, in every attention kind; the sequence is empty afterwards.
    pub fn release(&mut self, pool: &mut PagePool) {
        for table in &mut self.tables {
            pool.release(table);
        }
    }
}

impl<B: Backend> Decoder<B> {
    /// The model's attention kinds: its blocks' distinct sliding windows, in the order they
    /// first appear (`None` for global attention).
    pub fn attention_kinds(&self) -> Vec<Option<usize>> {
        let mut kinds = Vec::new();
        for block in &self.blocks {
            let window = block.attention.sliding_window();
            if !kinds.contains(&window) {
                kinds.push(window);
            }
        }
        kinds
    }

    /// Each block's keys and values for every page of `pool` (see
    /// [`MultiHeadAttention::new_pages`](attention_core::MultiHeadAttention::new_pages)).
    pub fn new_pages(&self, pool: &PagePool) -> Result<Vec<LayerPages<B>>, AttentionError> {
        self.blocks
            .iter()
            .map(|block| block.attention.new_pages(pool))
            .collect()
    }

    /// Empty page tables for a new sequence, one per attention kind.
    pub fn new_sequence(&self) -> SequencePages {
        let capacity = self.context_length();
        SequencePages {
            tables: self
                .attention_kinds()
                .into_iter()
                .map(|window| PageTable::new(capacity, window))
                .collect(),
        }
    }

    /// The free pages a step of `new` tokens for each sequence takes, over every attention
    /// kind, net of the pages windowed kinds give back: what [`reserve`](Self::reserve) needs
    /// free.
    ///
    /// # Errors
    /// When a sequence's tables are not one per attention kind of this model.
    pub fn pages_needed(
        &self,
        pool: &PagePool,
        sequences: &[(&SequencePages, usize)],
    ) -> Result<usize, DecoderError> {
        let kinds = self.attention_kinds().len();
        if let Some((sequence, _)) = sequences.iter().find(|(s, _)| s.tables.len() != kinds) {
            return Err(DecoderError::AttentionKinds {
                found: sequence.tables.len(),
                kinds,
            });
        }
        Ok((0..kinds)
            .map(|kind| {
                let tables: Vec<(&PageTable, usize)> = sequences
                    .iter()
                    .map(|(sequence, new)| (&sequence.tables[kind], *new))
                    .collect();
                pool.pages_needed(&tables)
            })
            .sum())
    }

    /// Reserves a step of `new` tokens for each sequence in every attention kind: the steps
    /// [`forward_paged`](Self::forward_paged) runs on, one per kind. Checks that the pool has
    /// the pages for all kinds together before reserving any: out of pages, or any other
    /// refusal, changes nothing.
    pub fn reserve(
        &self,
        pool: &mut PagePool,
        sequences: &mut [(&mut SequencePages, usize)],
    ) -> Result<Vec<RaggedStep>, DecoderError> {
        let kinds = self.attention_kinds().len();
        let views: Vec<(&SequencePages, usize)> =
            sequences.iter().map(|(s, n)| (&**s, *n)).collect();
        let needed = self.pages_needed(pool, &views)?;
        if needed > pool.free_pages() {
            return Err(AttentionError::OutOfPages {
                needed,
                free: pool.free_pages(),
            }
            .into());
        }
        let mut steps = Vec::with_capacity(kinds);
        for kind in 0..kinds {
            let mut tables: Vec<(&mut PageTable, usize)> = sequences
                .iter_mut()
                .map(|(sequence, new)| (&mut sequence.tables[kind], *new))
                .collect();
            steps.push(pool.step(&mut tables)?);
        }
        Ok(steps)
    }

    /// Logits of a ragged step's tokens: every sequence's new tokens packed one after another
    /// (`steps[0].offsets()`), each at its own position, through every block over its pages.
    /// With [`Logits::Last`], each sequence's last token's only: what picking its next token
    /// needs.
    ///
    /// Token ids must lie within the vocabulary (the caller checks them, as for
    /// [`try_forward`](Self::try_forward)).
    ///
    /// # Shapes
    /// - `tokens`: `[1, tokens]`
    /// - output: `[1, tokens, vocab]`, or `[1, sequences, vocab]` with `Logits::Last`
    ///
    /// # Errors
    /// When `steps` are not one per attention kind of one step, `pages` not one per block, or
    /// what the attention layers refuse.
    pub fn forward_paged(
        &self,
        tokens: Tensor<B, 2, Int>,
        steps: &[RaggedStep],
        pages: &mut [LayerPages<B>],
        logits: Logits,
    ) -> Result<Tensor<B, 3>, DecoderError> {
        let kinds = self.attention_kinds();
        if pages.len() != self.blocks.len() {
            return Err(DecoderError::Caches {
                found: pages.len(),
                layers: self.blocks.len(),
            });
        }
        if steps.len() != kinds.len() {
            return Err(DecoderError::AttentionKinds {
                found: steps.len(),
                kinds: kinds.len(),
            });
        }
        let step = &steps[0];
        let device = tokens.device();
        // [1, tokens, width]
        let mut x = self.token_embedding.forward(tokens);
        if let Some(scale) = self.embedding_scale {
            x = x.mul_scalar(scale);
        }
        if let Some(positions) = &self.position_embedding {
            let longest = step.sequences().iter().map(|s| s.keys()).max().unwrap_or(0);
            if longest > self.context_length() {
                return Err(AttentionError::ContextOverflow {
                    seq: longest,
                    context_length: self.context_length(),
                }
                .into());
            }
            x = x + positions.forward(step.positions(&device));
        }
        for (block, pages) in self.blocks.iter().zip(pages.iter_mut()) {
            let kind = kinds
                .iter()
                .position(|&window| window == block.attention.sliding_window())
                .expect("every block's window is a kind");
            x = block.forward_paged(x, &steps[kind], pages)?;
        }
        if logits == Logits::Last {
            let last: Vec<i64> = step.offsets()[1..]
                .iter()
                .map(|&end| end as i64 - 1)
                .collect();
            let count = last.len();
            let last = Tensor::<B, 1, Int>::from_data(TensorData::new(last, [count]), &device);
            x = x.select(1, last);
        }
        Ok(per_token(x, |rows| {
            self.lm_head(self.final_norm.forward(rows))
        }))
    }
}
