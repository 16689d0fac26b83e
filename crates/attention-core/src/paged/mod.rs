//! Ragged batches over a paged key/value cache: sequences at their own lengths in one call, their
//! keys and values in fixed-size pages that sequences with a common prefix share.
//!
//! - [`PagePool`] (`pool.rs`): the pages, who holds each, and each sequence's [`PageTable`], one
//!   per attention kind (global, and each sliding window a model uses)
//! - [`RaggedStep`] (`step.rs`): one step of one attention kind, reserved before any layer
//!   runs: the sequences' cached and new lengths, their tables, the pages to copy
//! - [`LayerPages`] (this file): one layer's keys and values for every page of the pool, in its
//!   kernel's layout
//!
//! A step goes: the scheduler asks the pool for a [`RaggedStep`] of its sequences' tables and
//! new token counts (pages are reserved, or [`AttentionError::OutOfPages`] and nothing
//! changes); each layer of that kind then runs
//! [`MultiHeadAttention::forward_paged`](crate::MultiHeadAttention::forward_paged) with its own
//! [`LayerPages`] and that step.

use burn::prelude::*;

use crate::error::AttentionError;
use crate::kernels::PagedStorage;

mod pool;
mod step;

pub use pool::{PagePool, PageTable};
pub(crate) use step::StepUpload;
pub use step::{PageCopy, RaggedStep, SequenceStep};

/// One layer's keys and values for every page of a [`PagePool`]: made once, at the pool's size,
/// by [`MultiHeadAttention::new_pages`](crate::MultiHeadAttention::new_pages); a step writes
/// its new positions into the pages the pool reserved for them and never allocates.
///
/// Where the backend has the CPU kernel (ndarray, burn-flex) the pages are host memory the
/// kernel reads in place; elsewhere Burn tensors, which the GPU kernel reads in place (wgpu,
/// CUDA) and other backends gather each sequence's pages from.
///
/// # Shapes
/// - keys, values: `[kv_heads, pages · page_size, head_dim]` (host memory) or `[pages,
///   page_size, kv_heads · head_dim]` (tensors)
#[derive(Debug, Clone)]
pub struct LayerPages<B: Backend> {
    kv_heads: usize,
    head_dim: usize,
    page_size: usize,
    pages: usize,
    pub(crate) storage: PagedStorage<B>,
}

impl<B: Backend> LayerPages<B> {
    pub(crate) fn new(
        [pages, page_size, kv_heads, head_dim]: [usize; 4],
        device: &B::Device,
        (dtype, kv_dtype): (burn::tensor::DType, crate::KvDtype),
    ) -> Result<Self, AttentionError> {
        let shape = [pages, page_size, kv_heads, head_dim];
        Ok(Self {
            kv_heads,
            head_dim,
            page_size,
            pages,
            storage: PagedStorage::zeros(shape, device, dtype, kv_dtype)?,
        })
    }

    /// Bytes of keys and values one cached position takes in this layer: `2 · kv_heads` rows
    /// of `head_dim` elements, with their scales where the pool's [`KvDtype`](crate::KvDtype)
    /// has them.
    pub fn bytes_per_position(&self) -> usize {
        let row = match &self.storage {
            PagedStorage::CpuHost(host) => host.row_bytes(),
            PagedStorage::Tensors { keys, .. } => keys.row_bytes(self.head_dim),
        };
        2 * self.kv_heads * row
    }

    /// Bytes of keys and values the storage holds for the whole pool.
    pub fn bytes(&self) -> usize {
        self.bytes_per_position() * self.pages * self.page_size
    }

    /// Checks that this storage and `step` fit a layer of `kv_heads` heads of `head_dim` with a
    /// sliding window of `window`.
    pub(crate) fn check(
        &self,
        step: &RaggedStep,
        [kv_heads, head_dim]: [usize; 2],
        window: Option<usize>,
    ) -> Result<(), AttentionError> {
        let expected = (
            kv_heads,
            head_dim,
            step.pool_pages(),
            step.page_size(),
            window,
        );
        let found = (
            self.kv_heads,
            self.head_dim,
            self.pages,
            self.page_size,
            step.window(),
        );
        if expected != found {
            let describe =
                |(heads, dim, pages, size, window): (usize, usize, usize, usize, Option<usize>)| {
                    format!("{heads} × {dim}, {pages} pages × {size}, window {window:?}")
                };
            return Err(AttentionError::PagesLayout {
                expected: describe(expected),
                found: describe(found),
            });
        }
        Ok(())
    }
}
