//! The key/value cache for incremental decoding.

use std::ops::Range;

use burn::prelude::*;

use crate::KvDtype;
use crate::error::AttentionError;
use crate::kernels::{KvStorage, NewKv};

/// Keys and values of the positions a layer has seen, for
/// [`MultiHeadAttention::forward_cached`](crate::MultiHeadAttention::forward_cached).
///
/// Storage grows on demand, doubling (at least [`MIN_POSITIONS`](Self::MIN_POSITIONS), at most
/// `capacity` positions), from the first step on (whose batch size the cache then keeps); each
/// step writes its keys and values into it in place, so a step costs attention over the cached
/// positions, not a copy of the cache. A layer with a huge `context_length` therefore costs
/// memory only for the positions it actually sees. With a sliding window of `W` keys the cache
/// keeps only what a later query can still see, the last `W − 1` positions: when its storage is
/// full it moves those to the front instead of growing, so its memory stays `O(W)` however long
/// the generation (a move every `W` or more positions). Made by
/// [`MultiHeadAttention::new_cache`](crate::MultiHeadAttention::new_cache).
///
/// Where a backend has a kernel of this crate's own (without `Autodiff`), the fused and default
/// paths keep the keys and values in that kernel's storage, which it reads in place (on ndarray
/// and burn-flex: host memory, each head's positions side by side; on the GPU backends: tensors
/// in the GPU kernel's layout); elsewhere, and on the explicit path, in Burn tensors. A cache
/// moves between the two when a call's path needs the other.
///
/// # Shapes
/// - keys, values: `[batch, kv_heads, allocated, head_dim]` (tensors and host memory) or
///   `[batch, allocated, kv_heads · head_dim]` (the GPU kernel's), slots `0..len − start`
///   holding positions `start..len`
#[derive(Debug, Clone)]
pub struct KvCache<B: Backend> {
    heads: usize,
    head_dim: usize,
    capacity: usize,
    window: Option<usize>,
    kv_dtype: KvDtype,
    len: usize,
    /// The position in storage slot 0 (positions before it were dropped by the window).
    start: usize,
    /// Allocated at the first step and grown as needed.
    storage: Option<KvStorage<B>>,
}

/// How [`KvCache::append`] will store a step, decided (and checked) by [`KvCache::plan`] before
/// anything changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Plan {
    /// Positions the storage will have room for.
    allocate: usize,
    /// Past positions this step's queries see (all cached ones, or the last `window − 1`).
    keep: usize,
    /// Whether the kept positions move to the front of new storage first (a window cache).
    compact: bool,
}

impl Plan {
    /// Keys the step's `new` queries attend over: the kept past and the new positions.
    pub(crate) fn keys_seen(&self, new: usize) -> usize {
        self.keep + new
    }
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
            window: None,
            kv_dtype: KvDtype::Model,
            len: 0,
            start: 0,
            storage: None,
        }
    }

    /// The same cache, keeping only the positions a sliding window of `window` keys can still
    /// reach.
    pub fn with_window(mut self, window: Option<usize>) -> Self {
        self.window = window;
        self
    }

    /// The same cache, storing its keys and values as `kv_dtype` (see [`KvDtype`]: fewer bytes
    /// per position, rounded once when written). Set it before the first step.
    pub fn with_kv_dtype(mut self, kv_dtype: KvDtype) -> Self {
        self.kv_dtype = kv_dtype;
        self
    }

    /// What the cache stores its keys and values as.
    pub fn kv_dtype(&self) -> KvDtype {
        self.kv_dtype
    }

    /// Positions seen so far (the next token's position).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The most positions the cache can see (the layer's `context_length`).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The batch size the cache was filled with, `None` while it has never been used since the
    /// last [`reset`](Self::reset).
    pub fn batch_size(&self) -> Option<usize> {
        self.storage.as_ref().map(KvStorage::batch)
    }

    /// Empties the cache (and forgets its batch size), to start a new sequence.
    pub fn reset(&mut self) {
        self.len = 0;
        self.start = 0;
        self.storage = None;
    }

    /// Forgets every position from `len` on (keeping the storage and the batch size), e.g. to
    /// rewind after a rejected draft. Does nothing when `len` is not below [`len`](Self::len).
    /// A window cache that has already dropped positions a query at `len` would see cannot
    /// rewind there: [`AttentionError::CacheRewind`], and the cache is left as it was.
    pub fn truncate(&mut self, len: usize) -> Result<(), AttentionError> {
        if len >= self.len {
            return Ok(());
        }
        let needed_from = match self.window {
            Some(window) => (len + 1).saturating_sub(window),
            None => 0,
        };
        if needed_from < self.start {
            return Err(AttentionError::CacheRewind {
                to: len,
                kept_from: self.start,
            });
        }
        self.len = len;
        Ok(())
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
        self.storage.as_ref().map_or(0, KvStorage::allocated)
    }

    /// Checks that `new` more positions of a batch of `batch` can be stored, and decides how.
    /// Changes nothing.
    pub(crate) fn plan(&self, batch: usize, new: usize) -> Result<Plan, AttentionError> {
        let stored = self.len - self.start;
        let keep = match self.window {
            Some(window) => stored.min(window - 1),
            None => stored,
        };
        let allocated = self.allocated();
        let plan = if stored + new <= allocated {
            Plan {
                allocate: allocated,
                keep,
                compact: false,
            }
        } else if let Some(window) = self.window {
            // Room for the kept positions, this step and a window's worth of steps after it.
            Plan {
                allocate: (keep + new + window)
                    .max(Self::MIN_POSITIONS)
                    .min(self.capacity),
                keep,
                compact: true,
            }
        } else {
            Plan {
                allocate: (stored + new)
                    .max(allocated.saturating_mul(2))
                    .max(Self::MIN_POSITIONS)
                    .min(self.capacity),
                keep,
                compact: false,
            }
        };
        let too_large = AttentionError::CacheTooLarge {
            batch,
            heads: self.heads,
            head_dim: self.head_dim,
            positions: plan.allocate,
        };
        // Two tensors of up to 8-byte elements must stay addressable.
        [batch, self.heads, plan.allocate, self.head_dim, 16]
            .iter()
            .try_fold(1usize, |bytes, &n| bytes.checked_mul(n))
            .filter(|&bytes| bytes <= isize::MAX as usize)
            .ok_or(too_large)?;
        Ok(plan)
    }

    /// Writes the new positions' keys and values after the cached ones, in the storage their
    /// layout needs (moved there first if the cache was kept elsewhere), and returns the storage
    /// with the slots the new queries see: the kept past positions and the new ones. The caller
    /// has checked that they fit ([`plan`](Self::plan)).
    ///
    /// Errors, with the cache unchanged, when a narrow cache cannot keep the step where its path
    /// keeps it, or an int8 cache is given a non-finite key or value.
    ///
    /// # Shapes
    /// - `new`: see [`NewKv`]
    pub(crate) fn append(
        &mut self,
        new: NewKv<B>,
        plan: Plan,
    ) -> Result<(&KvStorage<B>, Range<usize>), AttentionError> {
        new.check_storable(self.kv_dtype, self.len)?;
        let [_, count] = new.batch_and_len();
        let stored = self.len - self.start;
        // Slots of the positions to carry into new storage: all of them, or the kept ones.
        let carried = if plan.compact {
            stored - plan.keep..stored
        } else {
            0..stored
        };
        let storage = KvStorage::prepared(
            self.storage.take(),
            &new,
            self.heads,
            plan.allocate,
            carried,
            plan.compact,
            self.kv_dtype,
        );
        if plan.compact {
            self.start = self.len - plan.keep;
        }
        let at = self.len - self.start;
        let storage = self.storage.insert(storage.written(at, new));
        self.len += count;
        Ok((storage, at - plan.keep..at + count))
    }

    /// Ends a layer's decoding step (see [`KvStorage::end_step`]).
    pub(crate) fn end_step(&self) -> Result<(), AttentionError> {
        self.storage.as_ref().map_or(Ok(()), KvStorage::end_step)
    }
}
