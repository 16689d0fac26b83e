//! The decoder-only transformer every model here is: token embeddings (plus learned positions
//! where a family has them), the blocks, a final norm and the LM head, with and without the
//! blocks' KV caches.

use attention_core::{AttentionError, KvCache, KvDtype};
use burn::nn::{Dropout, Embedding, Linear};
use burn::prelude::*;
use cpu_linalg::projection::{self, PackedWeightsCache};
use thiserror::Error;

use crate::block::{DecoderBlock, per_token};
use crate::input::{LmInput, Logits};
use crate::norm::Norm;

/// Why a forward pass of a [`Decoder`] could not run.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum DecoderError {
    /// The attention layers refused the input (context overflow, mismatched cache, shapes).
    #[error(transparent)]
    Attention(#[from] AttentionError),
    /// A ragged step's tables or steps are not one per attention kind of the model (a
    /// sequence or a step of another model).
    #[error("{found} page tables or steps for a model of {kinds} attention kinds")]
    AttentionKinds {
        /// The tables or steps given.
        found: usize,
        /// The model's attention kinds ([`Decoder::attention_kinds`]).
        kinds: usize,
    },
    /// The caches (or page storages) are not one per block.
    #[error("{found} caches for {layers} layers")]
    Caches {
        /// The caches given.
        found: usize,
        /// The blocks.
        layers: usize,
    },
}

/// A decoder-only language model:
/// `softcap(lm_head(final_norm(blocks(dropout(scale · token_embedding + position_embedding)))))`.
///
/// Families differ in its parts, not in its code: learned positions (GPT-2, the book's GPT) or
/// rotary ones inside the attention (the Llama family), which [`Norm`] and
/// [`Mlp`](crate::Mlp), where a block puts its norms, a separate or a tied LM head, scaled
/// embeddings and soft-capped logits (Gemma).
#[derive(Module, Debug)]
pub struct Decoder<B: Backend> {
    /// Token embeddings, `[vocab, width]` (GPT-2's `wte`, the Llama family's `embed_tokens`).
    pub token_embedding: Embedding<B>,
    /// Multiplies the looked-up token embeddings (not the tied LM head's): Gemma's `√width`,
    /// rounded to float32 as transformers computes it. `None`: no scaling.
    #[module(skip)]
    pub embedding_scale: Option<f64>,
    /// Learned positions, `[positions, width]` (GPT-2's `wpe`); `None` where the attention
    /// rotates by position instead (the Llama family).
    pub position_embedding: Option<Embedding<B>>,
    /// Dropout on the summed embeddings: active only while training (under autodiff).
    pub dropout: Dropout,
    /// The blocks, in order.
    pub blocks: Vec<DecoderBlock<B>>,
    /// Norm after the last block (GPT-2's `ln_f`, the Llama family's `norm`).
    pub final_norm: Norm<B>,
    /// `width → vocab` (`lm_head`), or `None` when it is tied to the token embedding.
    pub lm_head: Option<Linear<B>>,
    /// Soft-capping of the logits, `c · tanh(logits / c)` (Gemma 2's
    /// `final_logit_softcapping`); must be finite and positive. `None`: the LM head's logits as
    /// they are.
    #[module(skip)]
    pub logit_softcap: Option<f64>,
    /// The LM head's weight (or the tied embedding's) packed for the CPU products
    /// (`Default::default()` when built by hand).
    #[module(skip)]
    pub packed_lm_head: PackedWeightsCache,
}

impl<B: Backend> Decoder<B> {
    /// The number of distinct tokens.
    pub fn vocab_size(&self) -> usize {
        self.token_embedding.weight.dims()[0]
    }

    /// The longest sequence the model accepts: its learned positions, or its attention layers'
    /// `context_length` (`usize::MAX` for a model with neither).
    pub fn context_length(&self) -> usize {
        match (&self.position_embedding, self.blocks.first()) {
            (Some(positions), _) => positions.weight.dims()[0],
            (None, Some(block)) => block.attention.context_length(),
            (None, None) => usize::MAX,
        }
    }

    /// One empty KV cache per block, for [`forward_cached`](Self::forward_cached) and
    /// [`try_forward`](Self::try_forward).
    pub fn new_caches(&self) -> Vec<KvCache<B>> {
        self.new_caches_of(KvDtype::Model)
    }

    /// [`new_caches`](Self::new_caches) storing keys and values as `kv_dtype` (see
    /// [`KvDtype`]).
    pub fn new_caches_of(&self, kv_dtype: KvDtype) -> Vec<KvCache<B>> {
        self.blocks
            .iter()
            .map(|block| block.attention.new_cache().with_kv_dtype(kv_dtype))
            .collect()
    }

    /// Next-token logits at every position of sequences that start at position 0.
    ///
    /// # Shapes
    /// - `tokens`: `[batch, seq]` with `seq ≤ context_length`
    /// - output: `[batch, seq, vocab]`
    ///
    /// # Panics
    /// When `seq` exceeds `context_length`.
    pub fn forward(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        self.forward_tokens(tokens, None, Logits::All)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// Logits for tokens that follow those already in `caches` (one per block, from
    /// [`new_caches`](Self::new_caches)), at the positions after them.
    ///
    /// # Shapes
    /// - `tokens`: `[batch, new]`
    /// - output: `[batch, new, vocab]`
    pub fn forward_cached(
        &self,
        tokens: Tensor<B, 2, Int>,
        caches: &mut [KvCache<B>],
    ) -> Result<Tensor<B, 3>, DecoderError> {
        self.forward_tokens(tokens, Some(caches), Logits::All)
    }

    /// Tokens at the positions after those cached (after none without caches), checked against
    /// the context first: a learned position past the last would read outside its table.
    ///
    /// # Shapes
    /// - `tokens`: `[batch, seq]`
    /// - output: `[batch, seq, vocab]`, or `[batch, 1, vocab]` with `Logits::Last`
    pub(crate) fn forward_tokens(
        &self,
        tokens: Tensor<B, 2, Int>,
        caches: Option<&mut [KvCache<B>]>,
        logits: Logits,
    ) -> Result<Tensor<B, 3>, DecoderError> {
        let past = caches
            .as_deref()
            .and_then(|caches| caches.first())
            .map_or(0, KvCache::len);
        let seq = tokens.dims()[1];
        let context_length = self.context_length();
        if past + seq > context_length {
            return Err(AttentionError::ContextOverflow {
                seq: past + seq,
                context_length,
            }
            .into());
        }
        self.try_forward(&LmInput::after(tokens, past), caches, logits)
    }

    /// Logits of every token of `input` (of the last one only with [`Logits::Last`]); with
    /// `caches` (one per block), of tokens that follow those cached, whose keys and values are
    /// appended.
    ///
    /// Token ids and positions must lie within the vocabulary and the learned positions: the
    /// caller checks them (an embedding lookup out of range reads another row or fails on the
    /// device).
    ///
    /// Rows packed from `input.documents` run as if each document were a sequence of its own:
    /// every block's attention keeps a token within its document, and the positions (learned and
    /// rotary alike) are `input.positions`, which [`LmInput::packed`] counts from each document's
    /// start.
    ///
    /// # Shapes
    /// - `input.tokens`, `input.positions`, `input.documents`: `[batch, seq]`;
    ///   `input.key_padding`: `[batch, cached + seq]`
    /// - output: `[batch, seq, vocab]`, or `[batch, 1, vocab]` with `Logits::Last`
    ///
    /// # Errors
    /// [`DecoderError::Caches`] for caches that are not one per block;
    /// [`AttentionError::DocumentsShape`] for documents that do not cover the tokens and
    /// [`AttentionError::DocumentsWithCache`] for documents with caches (both before any work);
    /// what the attention layers refuse.
    pub fn try_forward(
        &self,
        input: &LmInput<B>,
        caches: Option<&mut [KvCache<B>]>,
        logits: Logits,
    ) -> Result<Tensor<B, 3>, DecoderError> {
        if let Some(caches) = &caches
            && caches.len() != self.blocks.len()
        {
            return Err(DecoderError::Caches {
                found: caches.len(),
                layers: self.blocks.len(),
            });
        }
        if let Some(documents) = &input.documents {
            // The layers would refuse these too, but only after the embeddings were computed.
            documents.check_shape(input.tokens.dims())?;
            if caches.is_some() {
                return Err(AttentionError::DocumentsWithCache.into());
            }
        }
        // [batch, seq, width]
        let mut x = self.token_embedding.forward(input.tokens.clone());
        if let Some(scale) = self.embedding_scale {
            x = x.mul_scalar(scale);
        }
        if let Some(positions) = &self.position_embedding {
            x = x + positions.forward(input.positions.clone());
        }
        x = self.dropout.forward(x);
        match caches {
            Some(caches) => {
                for (block, cache) in self.blocks.iter().zip(caches.iter_mut()) {
                    x = block.forward(x, input, Some(cache))?;
                }
            }
            None => {
                for block in &self.blocks {
                    x = block.forward(x, input, None)?;
                }
            }
        }
        if logits == Logits::Last {
            let seq = x.dims()[1];
            x = x.narrow(1, seq - 1, 1);
        }
        Ok(per_token(x, |rows| {
            self.lm_head(self.final_norm.forward(rows))
        }))
    }

    /// The LM head: `lm_head`, or the token embedding's transpose when tied (`h · Eᵀ`), then
    /// the soft-cap if there is one (`logits / c`, `tanh`, `· c`, in transformers' order).
    ///
    /// # Shapes
    /// - `rows`: `[tokens, width]`
    /// - output: `[tokens, vocab]`
    pub(crate) fn lm_head(&self, rows: Tensor<B, 2>) -> Tensor<B, 2> {
        let logits = match &self.lm_head {
            Some(head) => projection::linear(head, rows, &self.packed_lm_head),
            // `[vocab, width]`, read in place as `[width, vocab]`
            None => {
                let tied = self.token_embedding.weight.val().transpose();
                projection::matmul(rows, tied, &self.packed_lm_head)
            }
        };
        match self.logit_softcap {
            Some(cap) => logits.div_scalar(cap).tanh().mul_scalar(cap),
            None => logits,
        }
    }
}
