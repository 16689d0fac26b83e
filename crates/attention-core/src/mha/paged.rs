//! The layer on a ragged batch over pages: [`MultiHeadAttention::new_pages`] and
//! [`MultiHeadAttention::forward_paged`].

use burn::prelude::*;

use super::MultiHeadAttention;
use super::project::HeadLayout;
use crate::attend;
use crate::error::AttentionError;
use crate::heads::merge_heads;
use crate::kernels::{self, Kernel, PagedInputs};
use crate::paged::{LayerPages, PagePool, RaggedStep};
use crate::rope::Positions;

impl<B: Backend> MultiHeadAttention<B> {
    /// This layer's keys and values for every page of `pool`, zeroed: the storage each call of
    /// [`forward_paged`](Self::forward_paged) on a step of that pool writes and reads. Its
    /// memory is the pool's whole size, allocated here once.
    ///
    /// Errors when the storage would not be addressable ([`AttentionError::CacheTooLarge`]), or
    /// when the pool's [`KvDtype`](crate::KvDtype) is narrow and no kernel on the backend reads
    /// it ([`AttentionError::KvDtypeUnsupported`]).
    pub fn new_pages(&self, pool: &PagePool) -> Result<LayerPages<B>, AttentionError> {
        let positions = pool.pages() * pool.page_size();
        [positions, self.num_kv_heads, self.head_dim, 16]
            .iter()
            .try_fold(1usize, |bytes, &n| bytes.checked_mul(n))
            .filter(|&bytes| bytes <= isize::MAX as usize)
            .ok_or(AttentionError::CacheTooLarge {
                batch: 1,
                heads: self.num_kv_heads,
                head_dim: self.head_dim,
                positions,
            })?;
        let weight = self.output_layer.weight.val();
        LayerPages::new(
            [
                pool.pages(),
                pool.page_size(),
                self.num_kv_heads,
                self.head_dim,
            ],
            &weight.device(),
            (weight.dtype(), pool.kv_dtype()),
        )
    }

    /// Attention for a ragged step: any number of sequences, each with its own new tokens (one
    /// for a decoding step, a chunk of a prompt, a whole prompt) after its own cached positions,
    /// their tokens packed along one axis with no padding. Each sequence's new keys and values
    /// are written into the pages `step` reserved for them in `pages`; each new token attends
    /// to its own sequence's positions up to itself, read where they lie in the pages (by either
    /// kernel; on a backend without one each sequence's pages are gathered first, and the first
    /// call says so on stderr). Sequence by sequence the output is what [`forward_cached`](Self::forward_cached)
    /// gives for that sequence alone.
    ///
    /// Rotary positions are each token's position in its sequence. Inference only: under
    /// `Autodiff` it is [`AttentionError::PagedWithAutodiff`].
    ///
    /// Errors, with `pages` unchanged, when `x` is not the step's tokens, or `pages` or `step`
    /// belong to another layer shape, pool or window.
    ///
    /// # Shapes
    /// - `x`: `[1, tokens, input_dim]`, sequence `s`'s new tokens at `step.offsets()[s] ..
    ///   step.offsets()[s + 1]`
    /// - output: `[1, tokens, output_dim]`
    pub fn forward_paged(
        &self,
        x: Tensor<B, 3>,
        step: &RaggedStep,
        pages: &mut LayerPages<B>,
    ) -> Result<Tensor<B, 3>, AttentionError> {
        if B::ad_enabled(&x.device()) {
            return Err(AttentionError::PagedWithAutodiff);
        }
        let [batch, tokens, features] = x.dims();
        if batch != 1 || tokens != step.tokens() {
            return Err(AttentionError::RaggedShape {
                tokens: step.tokens(),
                found: x.dims(),
            });
        }
        if features != self.input_dim() {
            return Err(AttentionError::InputDim {
                expected: self.input_dim(),
                found: features,
            });
        }
        pages.check(
            step,
            [self.num_kv_heads, self.head_dim],
            self.sliding_window,
        )?;
        if let Some(longest) = step.sequences().iter().map(|s| s.keys()).max()
            && longest > self.context_length
        {
            return Err(AttentionError::ContextOverflow {
                seq: longest,
                context_length: self.context_length,
            });
        }
        let positions = Positions::Given(step.positions(&x.device()));
        // [1, tokens, heads · head_dim]
        let context = if Kernel::reads_pages::<B>() {
            let [q, k, v] = self.project_side_by_side(x, &positions);
            pages.storage.check_storable(step, &k, &v)?;
            pages.storage.copy_pages(step.copies(), step.page_size());
            pages.storage.write(step, k, v);
            kernels::paged_attention(PagedInputs {
                query: q,
                pages: &pages.storage,
                step,
                heads: self.num_heads,
                scores: self.score_rule(),
            })
        } else {
            kernels::warn_gathering_pages::<B>();
            let [q, k, v] = self.project(x, &positions, HeadLayout::Split);
            let side_by_side = |t: Tensor<B, 4>| {
                let [_, heads, tokens, head_dim] = t.dims();
                t.swap_dims(1, 2).reshape([1, tokens, heads * head_dim])
            };
            pages.storage.copy_pages(step.copies(), step.page_size());
            pages.storage.write(step, side_by_side(k), side_by_side(v));
            // Burn's op has no sinks: the explicit path where the layer has them.
            let explicit = self.sinks.is_some();
            let contexts = step
                .sequences()
                .iter()
                .enumerate()
                .map(|(index, sequence)| {
                    let first = step.first_page_key(index);
                    let (keys, values) =
                        pages
                            .storage
                            .gathered(step, index, first, self.num_kv_heads);
                    let [keys, values] = [keys, values].map(|t| self.repeat_kv(t));
                    let q = q.clone().narrow(2, step.offsets()[index], sequence.new);
                    let context = if explicit {
                        let past_seen = sequence.past - first;
                        let mask = attend::mask_for(&q, past_seen, None, self.sliding_window, None);
                        attend::explicit(q, keys, values, mask, &self.score_rule(), &self.dropout)
                            .context
                    } else {
                        attend::fused(
                            q,
                            keys,
                            values,
                            None,
                            self.sliding_window,
                            None,
                            &self.score_rule(),
                        )
                    };
                    merge_heads(context)
                });
            Tensor::cat(contexts.collect(), 1)
        };
        let output = self.project_output(context);
        pages.storage.end_step()?;
        Ok(output)
    }
}
