//! The key/value cache for incremental decoding.

use burn::prelude::*;

use crate::error::AttentionError;

/// Keys and values of every position a layer has seen so far, for
/// [`MultiHeadAttention::forward_cached`](crate::MultiHeadAttention::forward_cached).
///
/// Storage grows on demand, doubling (at least [`MIN_POSITIONS`](Self::MIN_POSITIONS), at most
/// `capacity` positions), from the first step on (whose batch size the cache then keeps); each
/// step writes its keys and values into it in place, so a step costs attention over the cached
/// positions, not a copy of the cache. A layer with a huge `context_length` therefore costs
/// memory only for the positions it actually sees. Made by
/// [`MultiHeadAttention::new_cache`](crate::MultiHeadAttention::new_cache).
///
/// # Shapes
/// - keys, values: `[batch, heads, allocated, head_dim]` with `len ≤ allocated ≤ capacity`, the
///   first [`len`](Self::len) positions filled
#[derive(Debug, Clone)]
pub struct KvCache<B: Backend> {
    heads: usize,
    head_dim: usize,
    capacity: usize,
    len: usize,
    /// `(keys, values)`, allocated at the first step and grown as needed.
    storage: Option<(Tensor<B, 4>, Tensor<B, 4>)>,
}

impl<B: Backend> KvCache<B> {
    /// The fewest positions allocated at once.
    pub const MIN_POSITIONS: usize = 64;

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

    /// Positions the storage has room for now.
    pub fn allocated(&self) -> usize {
        self.storage.as_ref().map_or(0, |(keys, _)| keys.dims()[2])
    }

    /// Checks that `new` more positions of a batch of `batch` can be stored, and returns how many
    /// positions the storage must then have. Changes nothing.
    pub(crate) fn plan(&self, batch: usize, new: usize) -> Result<usize, AttentionError> {
        let needed = self.len + new;
        let allocated = self.allocated();
        if needed <= allocated {
            return Ok(allocated);
        }
        let grown = needed
            .max(allocated.saturating_mul(2))
            .max(Self::MIN_POSITIONS)
            .min(self.capacity);
        let too_large = AttentionError::CacheTooLarge {
            batch,
            heads: self.heads,
            head_dim: self.head_dim,
            positions: grown,
        };
        // Two tensors of up to 8-byte elements must stay addressable.
        [batch, self.heads, grown, self.head_dim, 16]
            .iter()
            .try_fold(1usize, |bytes, &n| bytes.checked_mul(n))
            .filter(|&bytes| bytes <= isize::MAX as usize)
            .ok_or(too_large)?;
        Ok(grown)
    }

    /// Writes the new positions' keys and values after the cached ones and returns all of them.
    /// The caller has checked that they fit ([`plan`](Self::plan)).
    ///
    /// # Shapes
    /// - `keys`, `values`: `[batch, heads, new, head_dim]`
    /// - output: two `[batch, heads, len + new, head_dim]`
    pub(crate) fn append(
        &mut self,
        keys: Tensor<B, 4>,
        values: Tensor<B, 4>,
        allocate: usize,
    ) -> (Tensor<B, 4>, Tensor<B, 4>) {
        let [batch, heads, new, head_dim] = keys.dims();
        let (start, end) = (self.len, self.len + new);
        let grow = |old: Option<Tensor<B, 4>>| {
            let device = keys.device();
            let storage = Tensor::zeros([batch, heads, allocate, head_dim], &device);
            match old {
                Some(old) if start > 0 => storage.slice_assign(
                    [0..batch, 0..heads, 0..start, 0..head_dim],
                    old.narrow(2, 0, start),
                ),
                _ => storage,
            }
        };
        let (all_keys, all_values) = match self.storage.take() {
            Some((keys, values)) if keys.dims()[2] >= allocate => (keys, values),
            Some((keys, values)) => (grow(Some(keys)), grow(Some(values))),
            None => (grow(None), grow(None)),
        };
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
