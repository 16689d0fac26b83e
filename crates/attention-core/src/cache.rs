//! The key/value cache for incremental decoding.

use burn::prelude::*;

use crate::error::AttentionError;

/// Keys and values of every position a layer has seen so far, for
/// [`MultiHeadAttention::forward_cached`](crate::MultiHeadAttention::forward_cached).
///
/// Storage for `context_length` positions is allocated at the first step (whose batch size the
/// cache then keeps) and each step writes its keys and values into it in place, so a step costs
/// attention over the cached positions, not a copy of the cache. Made by
/// [`MultiHeadAttention::new_cache`](crate::MultiHeadAttention::new_cache).
///
/// # Shapes
/// - keys, values: `[batch, heads, context_length, head_dim]`, the first [`len`](Self::len)
///   positions filled
#[derive(Debug, Clone)]
pub struct KvCache<B: Backend> {
    heads: usize,
    head_dim: usize,
    capacity: usize,
    len: usize,
    /// `(keys, values)`, allocated at the first step.
    storage: Option<(Tensor<B, 4>, Tensor<B, 4>)>,
}

impl<B: Backend> KvCache<B> {
    /// An empty cache for `heads` heads of `head_dim` features and up to `capacity` positions.
    pub fn new(heads: usize, head_dim: usize, capacity: usize) -> Self {
        Self {
            heads,
            head_dim,
            capacity,
            len: 0,
            storage: None,
        }
    }

    /// Positions cached so far.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The most positions the cache can hold (the layer's `context_length`).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The batch size the cache was filled with, `None` while it has never been used since the
    /// last [`reset`](Self::reset).
    pub fn batch_size(&self) -> Option<usize> {
        self.storage.as_ref().map(|(keys, _)| keys.dims()[0])
    }

    /// Empties the cache (and forgets its batch size), to start a new sequence.
    pub fn reset(&mut self) {
        self.len = 0;
        self.storage = None;
    }

    /// Forgets every position from `len` on (keeping the storage and the batch size), e.g. to
    /// rewind after a rejected draft. Does nothing when `len` is not below [`len`](Self::len).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    pub(crate) fn check_layout(
        &self,
        heads: usize,
        head_dim: usize,
        context: usize,
    ) -> Result<(), AttentionError> {
        if (self.heads, self.head_dim, self.capacity) != (heads, head_dim, context) {
            return Err(AttentionError::CacheLayout {
                cache_heads: self.heads,
                cache_head_dim: self.head_dim,
                cache_context: self.capacity,
                heads,
                head_dim,
                context,
            });
        }
        Ok(())
    }

    pub(crate) fn check_batch(&self, batch: usize) -> Result<(), AttentionError> {
        match self.batch_size() {
            Some(expected) if expected != batch => Err(AttentionError::CacheBatch {
                expected,
                found: batch,
            }),
            _ => Ok(()),
        }
    }

    /// Writes the new positions' keys and values after the cached ones and returns all of them.
    /// The caller has checked that they fit.
    ///
    /// # Shapes
    /// - `keys`, `values`: `[batch, heads, new, head_dim]`
    /// - output: two `[batch, heads, len + new, head_dim]`
    pub(crate) fn append(
        &mut self,
        keys: Tensor<B, 4>,
        values: Tensor<B, 4>,
    ) -> (Tensor<B, 4>, Tensor<B, 4>) {
        let [batch, heads, new, head_dim] = keys.dims();
        let (all_keys, all_values) = self.storage.take().unwrap_or_else(|| {
            let shape = [batch, heads, self.capacity, head_dim];
            let device = keys.device();
            (Tensor::zeros(shape, &device), Tensor::zeros(shape, &device))
        });
        let (start, end) = (self.len, self.len + new);
        // The storage is uniquely owned here, so backends write the slice in place.
        let all_keys = all_keys.slice_assign([0..batch, 0..heads, start..end, 0..head_dim], keys);
        let all_values =
            all_values.slice_assign([0..batch, 0..heads, start..end, 0..head_dim], values);
        self.len = end;
        let filled = |tensor: &Tensor<B, 4>| tensor.clone().narrow(2, 0, end);
        let seen = (filled(&all_keys), filled(&all_values));
        self.storage = Some((all_keys, all_values));
        seen
    }
}
