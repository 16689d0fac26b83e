//! Causal flash attention on the CPU over plain slices: forward with an online softmax over key
//! blocks, backward recomputing each block from the saved log-sum-exp (FlashAttention-2's
//! scheme). Key blocks wholly above the causal diagonal, or wholly before a sliding window, are
//! never touched, and no `[queries, keys]` matrix larger than one block ever exists.
//!
//! Tensors are row-major `[batch, seq, heads, head_dim]` — the projections' `[batch, seq,
//! width]` output as it is, so that neither the head split nor the merge copies anything. Keys
//! and values may have fewer heads than queries (grouped-query attention): query head `i` reads
//! key/value head `i / (heads / kv_heads)`. A group's query heads are stacked into one matrix,
//! so each block of their shared keys and values enters one product for the whole group; the
//! backward pass sums a group's key and value gradients into that head's one buffer, and deals
//! a pair's key blocks to several tasks when the (sequence, key/value head) pairs are fewer than
//! the threads. The block products and the softmax loops run at the CPU's full vector width
//! ([`simd`](super::simd), picked at run time).
//!
//! - this file: the float types, the shapes and masks ([`Dims`]), the score rule, the inputs
//! - `forward.rs`: [`forward`], blocks of queries, or heads and key splits when decoding
//! - `backward.rs`: [`backward`], per (sequence, key/value head) group over key blocks
//! - `tests.rs`: the kernel against the formula computed densely in `f64`

use ndarray::{ArrayView2, ArrayViewMut2, Axis, ShapeBuilder, Slice};

use cpu_linalg::simd::{self, mat_mul};
use half::{bf16, f16};

mod backward;
mod forward;
#[cfg(test)]
mod stored_tests;
#[cfg(test)]
mod tests;

pub use backward::backward;
pub use forward::forward;

/// Queries per block: the unit of parallel work in the forward pass.
pub(super) const QUERY_BLOCK: usize = 64;
/// Keys per block. With 64-wide heads a `64 × 128` block of scores (32 KiB in `f32`) and the
/// block's keys and values stay in a core's L2 cache.
pub(super) const KEY_BLOCK: usize = 128;

/// The float types the kernel computes in.
pub trait KernelFloat:
    num_traits::Float + ndarray::LinalgScalar + Send + Sync + std::fmt::Debug + 'static
{
    /// The largest element, `-inf` for none.
    fn max_of(xs: &[Self]) -> Self;

    /// `x ← exp(x − shift)` for every element; returns their sum.
    fn exp_shifted_sum(xs: &mut [Self], shift: Self) -> Self;

    /// `to[i] = from[i]`, for equal lengths.
    fn widen_f16(from: &[f16], to: &mut [Self]);

    /// `to[i] = from[i]`, for equal lengths.
    fn widen_bf16(from: &[bf16], to: &mut [Self]);

    /// `to[i] = from[i]`, for equal lengths.
    fn widen_i8(from: &[i8], to: &mut [Self]);

    /// `x` (a stored row's scale) in this type.
    fn from_scale(x: f32) -> Self;

    /// Whether [`stored_scores`](Self::stored_scores) and
    /// [`stored_weighted`](Self::stored_weighted) read stored blocks in place (else a stored
    /// block is widened into scratch first).
    const READS_STORED: bool;

    /// `scores = query · blockᵀ`, `query` `[rows, head_dim]`, `scores` `[rows, cols]`.
    fn stored_scores(query: &[Self], block: StoredBlock<'_>, head_dim: usize, scores: &mut [Self]);

    /// `out += weights · block`, `weights` `[rows, cols]`, `out` `[rows, head_dim]`.
    fn stored_weighted(weights: &[Self], block: StoredBlock<'_>, head_dim: usize, out: &mut [Self]);
}

impl KernelFloat for f64 {
    fn max_of(xs: &[Self]) -> Self {
        xs.iter().copied().fold(Self::NEG_INFINITY, Self::max)
    }

    fn exp_shifted_sum(xs: &mut [Self], shift: Self) -> Self {
        // The f64 path serves gradient checks against finite differences: full precision.
        xs.iter_mut().fold(0.0, |sum, x| {
            *x = (*x - shift).exp();
            sum + *x
        })
    }

    fn widen_f16(from: &[f16], to: &mut [Self]) {
        to.iter_mut()
            .zip(from)
            .for_each(|(to, from)| *to = from.to_f64());
    }

    fn widen_bf16(from: &[bf16], to: &mut [Self]) {
        to.iter_mut()
            .zip(from)
            .for_each(|(to, from)| *to = from.to_f64());
    }

    fn widen_i8(from: &[i8], to: &mut [Self]) {
        to.iter_mut()
            .zip(from)
            .for_each(|(to, &from)| *to = from.into());
    }

    fn from_scale(x: f32) -> Self {
        x.into()
    }

    // Stored caches compute in `f32`: the `f64` kernel never reads one in place.
    const READS_STORED: bool = false;

    fn stored_scores(_: &[Self], _: StoredBlock<'_>, _: usize, _: &mut [Self]) {
        unreachable!("stored blocks are read in place in f32 only")
    }

    fn stored_weighted(_: &[Self], _: StoredBlock<'_>, _: usize, _: &mut [Self]) {
        unreachable!("stored blocks are read in place in f32 only")
    }
}

impl KernelFloat for f32 {
    fn max_of(xs: &[Self]) -> Self {
        simd::max_f32(xs)
    }

    fn exp_shifted_sum(xs: &mut [Self], shift: Self) -> Self {
        simd::exp_shifted_sum_f32(xs, shift)
    }

    fn widen_f16(from: &[f16], to: &mut [Self]) {
        simd::widen_f16_f32(from, to);
    }

    fn widen_bf16(from: &[bf16], to: &mut [Self]) {
        simd::widen_bf16_f32(from, to);
    }

    fn widen_i8(from: &[i8], to: &mut [Self]) {
        simd::widen_i8_f32(from, to);
    }

    fn from_scale(x: f32) -> Self {
        x
    }

    const READS_STORED: bool = true;

    fn stored_scores(query: &[Self], block: StoredBlock<'_>, head_dim: usize, scores: &mut [Self]) {
        match block {
            StoredBlock::F16(keys) => simd::rows_by_stored_keys_f16(query, keys, head_dim, scores),
            StoredBlock::Bf16(keys) => {
                simd::rows_by_stored_keys_bf16(query, keys, head_dim, scores)
            }
            StoredBlock::Int8(keys) => simd::rows_by_stored_keys_i8(query, keys, head_dim, scores),
        }
    }

    fn stored_weighted(
        weights: &[Self],
        block: StoredBlock<'_>,
        head_dim: usize,
        out: &mut [Self],
    ) {
        match block {
            StoredBlock::F16(values) => {
                simd::weights_by_stored_values_f16(weights, values, head_dim, out)
            }
            StoredBlock::Bf16(values) => {
                simd::weights_by_stored_values_bf16(weights, values, head_dim, out)
            }
            StoredBlock::Int8(values) => {
                simd::weights_by_stored_values_i8(weights, values, head_dim, out)
            }
        }
    }
}

/// Query rows per product up to which a stored block is read in place by the few-row products
/// ([`KernelFloat::stored_scores`]); above it, widening the block once into scratch for the
/// block products costs less than widening it in registers for every row.
pub(super) const STORED_IN_PLACE_ROWS: usize = 8;

/// A block of stored keys or values, read in place.
#[derive(Debug, Clone, Copy)]
pub enum StoredBlock<'a> {
    /// IEEE half precision.
    F16(&'a [f16]),
    /// bfloat16.
    Bf16(&'a [bf16]),
    /// int8, without its scales.
    Int8(&'a [i8]),
}

/// A block of keys or values as the products read it.
#[derive(Debug, Clone)]
pub(super) enum Block<'a, E> {
    /// In the compute type (widened into scratch if it was stored).
    Floats(ArrayView2<'a, E>),
    /// Stored, read in place.
    Stored(StoredBlock<'a>),
}

/// The sizes of one attention call.
///
/// Query `i` (counted from the first new query) is the position `p = i + keys − queries` of the
/// sequence and sees keys `0 ..= p` (the causal mask aligned bottom-right), and with a window
/// only the last `window` of them, `p + 1 − window ..= p`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dims {
    /// Sequences in the batch.
    pub batch: usize,
    /// Query heads.
    pub heads: usize,
    /// Key and value heads; divides `heads`.
    pub kv_heads: usize,
    /// Query positions (the last `queries` of the sequence).
    pub queries: usize,
    /// Key (and value) positions.
    pub keys: usize,
    /// Features per head.
    pub head_dim: usize,
    /// Keys each query sees at most, its own included; `None`: every earlier one.
    pub window: Option<usize>,
}

impl Dims {
    fn width(&self) -> usize {
        self.heads * self.head_dim
    }

    fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Query heads per key/value head.
    fn group(&self) -> usize {
        self.heads / self.kv_heads
    }

    /// How many keys precede the first query.
    fn offset(&self) -> usize {
        self.keys - self.queries
    }

    /// Elements of a `[batch, queries, heads, head_dim]` tensor.
    pub fn query_len(&self) -> usize {
        self.batch * self.queries * self.width()
    }

    /// Elements of a `[batch, keys, kv_heads, head_dim]` tensor.
    pub fn key_len(&self) -> usize {
        self.batch * self.keys * self.kv_width()
    }

    /// The exclusive end of the keys that queries `..end` see.
    fn visible_keys(&self, end: usize) -> usize {
        end + self.offset()
    }

    /// The first key that query `row` sees by the window (0 without one).
    fn window_start(&self, row: usize) -> usize {
        self.window
            .map_or(0, |window| (row + self.offset() + 1).saturating_sub(window))
    }

    /// The exclusive end of the queries whose window reaches a key before `end` (all without a
    /// window).
    fn window_end(&self, end: usize) -> usize {
        self.window.map_or(self.queries, |window| {
            (end + window - 1)
                .saturating_sub(self.offset())
                .min(self.queries)
        })
    }

    /// Copies the query heads that read key/value head `kv_head` (its group), at query
    /// positions `positions` of sequence `batch`, out of a `[batch, queries, heads, head_dim]`
    /// tensor into `stacked`, position-major: row `t · group + m` is the group's `m`-th head at
    /// position `positions.start + t`. At one position a group's heads are adjacent, so each
    /// position is one contiguous copy.
    ///
    /// # Shapes
    /// - `stacked`: `[positions.len() · group, head_dim]`, row-major
    fn gather_group<E: Copy>(
        &self,
        data: &[E],
        batch: usize,
        kv_head: usize,
        positions: std::ops::Range<usize>,
        stacked: &mut [E],
    ) {
        let span = self.group() * self.head_dim;
        for (position, rows) in positions.zip(stacked.chunks_mut(span)) {
            let start = (batch * self.queries + position) * self.width() + kv_head * span;
            rows.copy_from_slice(&data[start..start + span]);
        }
    }

    /// The inverse of [`Dims::gather_group`] for a stretch of positions: writes stacked rows
    /// back into `data`, a `[positions, heads, head_dim]` stretch, from element `offset` of each
    /// position on (`first head of the group · head_dim`).
    fn scatter_group<E: Copy>(&self, stacked: &[E], offset: usize, data: &mut [E]) {
        let span = self.group() * self.head_dim;
        for (rows, position) in stacked.chunks(span).zip(data.chunks_mut(self.width())) {
            position[offset..offset + span].copy_from_slice(rows);
        }
    }

    /// Query positions per block product: a group's heads are stacked, so a product takes
    /// `QUERY_BLOCK / group` positions (at least one), which keeps every product of the kernel
    /// as small as a `QUERY_BLOCK × KEY_BLOCK` one, whatever the group size.
    fn positions_per_product(&self) -> usize {
        (QUERY_BLOCK / self.group()).max(1)
    }
}

/// How a head's scores are made from `q · k`, and what joins their softmax besides the keys.
///
/// `s = scale · q · k`, then `c · tanh(s / c)` with a soft-cap `c` (Gemma 2), then the mask; the
/// softmax's denominator is `Σ exp(s) + exp(sink)` with a sink (gpt-oss, StreamingLLM): the sink
/// takes a share of the weight and contributes no value.
#[derive(Debug, Clone, Copy)]
pub struct Scoring<'a, E> {
    /// Multiplies `q · k`.
    pub scale: E,
    /// The soft-cap `c > 0` of the scaled scores, if any.
    pub softcap: Option<E>,
    /// One logit per query head: `[heads]`.
    pub sinks: Option<&'a [E]>,
}

impl<E: KernelFloat> Scoring<'_, E> {
    /// `1 / √head_dim`, no soft-cap, no sinks: the chapter's attention.
    pub fn plain(head_dim: usize) -> Self {
        Self {
            scale: E::from(head_dim).expect("a small integer").sqrt().recip(),
            softcap: None,
            sinks: None,
        }
    }
}

/// What the forward pass returns.
#[derive(Debug, Clone)]
pub struct Forward<E> {
    /// `[batch, queries, heads, head_dim]`
    pub output: Vec<E>,
    /// `log Σ exp(scores)` per query and head (the sink's term included), `-inf` where every
    /// key is masked and there is no sink: `[batch, queries, heads]`. The backward pass rebuilds
    /// the weights from it.
    pub log_sum_exp: Vec<E>,
}

/// Gradients of the three inputs.
#[derive(Debug, Clone)]
pub struct Gradients<E> {
    /// `[batch, queries, heads, head_dim]`
    pub query: Vec<E>,
    /// `[batch, keys, kv_heads, head_dim]`
    pub key: Vec<E>,
    /// `[batch, keys, kv_heads, head_dim]`
    pub value: Vec<E>,
    /// The sinks' gradient, if the call has sinks: `[heads]`.
    pub sinks: Option<Vec<E>>,
}

/// Where each sequence's keys (and values) lie in the key and value buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyRows<'a> {
    /// Rows `first .. first + keys` of the sequence's `per_sequence` rows, each row's heads side
    /// by side (a call's own keys) or each head's rows (a cache's storage). A cache's storage
    /// holds more positions than one call reads.
    Rows {
        /// The first row read.
        first: usize,
        /// Rows per sequence in the buffers.
        per_sequence: usize,
        /// The buffers' order: `[batch, per_sequence, kv_heads, head_dim]` when `false`,
        /// `[batch, kv_heads, per_sequence, head_dim]` when `true` (one head's keys then lie side
        /// by side, and a decoding step's products over them stream through memory).
        head_major: bool,
    },
    /// Pages of a pool (see [`Pages`]): key `j` of a sequence lies in the page its table names
    /// at `j / size`.
    Pages(Pages<'a>),
}

/// A page pool's keys or values and the tables that map each sequence's positions to its pages.
///
/// The buffers are `[kv_heads, pages, size, head_dim]`: each head's pages lie side by side, so
/// a decoding task, which reads one head, streams through consecutive pages as through a dense
/// cache's head-major rows. A block of keys never spans two pages ([`Inputs::key_blocks`]), so
/// each block is one contiguous `[cols, head_dim]` matrix.
///
/// # Shapes
/// - `tables`: `[batch, per_sequence]` page ids, of which the first `ceil(keys / size)` are read
///   (those wholly before every query's window may be anything)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pages<'a> {
    /// Each sequence's page ids.
    pub tables: &'a [u32],
    /// Entries per sequence in `tables`.
    pub per_sequence: usize,
    /// Positions per page.
    pub size: usize,
    /// Pages in the pool.
    pub count: usize,
}

impl KeyRows<'_> {
    /// Exactly `keys` rows per sequence, all read, each row's heads side by side.
    pub fn packed(dims: &Dims) -> Self {
        Self::Rows {
            first: 0,
            per_sequence: dims.keys,
            head_major: false,
        }
    }
}

/// A buffer of keys or values, in the type the kernel computes in or stored in fewer bytes (a
/// cache's choice, [`crate::KvDtype`]). A stored buffer is read a block at a time into scratch
/// in the compute type; an `Int8` row's scale is folded into the block's scores (keys) or
/// weights (values) instead of into every element.
///
/// # Shapes
/// - every variant: the elements of [`Inputs::key`]'s shape; `Int8`'s `scales`: one per row of
///   `head_dim` elements (a position of one key/value head)
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KvBuffer<'a, E> {
    /// In the compute type.
    Float(&'a [E]),
    /// IEEE half precision.
    F16(&'a [f16]),
    /// bfloat16.
    Bf16(&'a [bf16]),
    /// Symmetric int8: row `r` stands for `scales[r] · values[r]`.
    Int8 {
        /// The rounded multiples of each row's scale.
        values: &'a [i8],
        /// One per row.
        scales: &'a [f32],
    },
}

impl<'a, E: KernelFloat> KvBuffer<'a, E> {
    /// Elements in the buffer.
    pub(crate) fn len(&self) -> usize {
        match self {
            Self::Float(data) => data.len(),
            Self::F16(data) => data.len(),
            Self::Bf16(data) => data.len(),
            Self::Int8 { values, .. } => values.len(),
        }
    }

    /// Rows `rows` (`head_dim` elements each) of a stored buffer as they lie, with their scales
    /// where the rows have them; `None` for a buffer in the compute type.
    fn stored_rows(
        &self,
        rows: std::ops::Range<usize>,
        head_dim: usize,
    ) -> Option<(StoredBlock<'a>, Option<&'a [f32]>)> {
        let elements = rows.start * head_dim..rows.end * head_dim;
        match *self {
            Self::Float(_) => None,
            Self::F16(data) => Some((StoredBlock::F16(&data[elements]), None)),
            Self::Bf16(data) => Some((StoredBlock::Bf16(&data[elements]), None)),
            Self::Int8 { values, scales } => {
                Some((StoredBlock::Int8(&values[elements]), Some(&scales[rows])))
            }
        }
    }

    /// The buffer in the compute type: what the backward pass reads, which only runs on a
    /// call's own keys and values.
    fn floats(&self) -> &'a [E] {
        match self {
            Self::Float(data) => data,
            _ => unreachable!("a stored cache is read by the forward pass only"),
        }
    }

    /// Rows `rows` (`head_dim` elements each) in the compute type, widened into `scratch` unless
    /// the buffer is in it already, with their scales where the rows have them.
    pub(crate) fn rows<'s>(
        &self,
        rows: std::ops::Range<usize>,
        head_dim: usize,
        scratch: &'s mut [E],
    ) -> (&'s [E], Option<&'a [f32]>)
    where
        'a: 's,
    {
        let Some((block, scales)) = self.stored_rows(rows.clone(), head_dim) else {
            return (
                &self.floats()[rows.start * head_dim..rows.end * head_dim],
                None,
            );
        };
        let to = &mut scratch[..rows.len() * head_dim];
        match block {
            StoredBlock::F16(data) => E::widen_f16(data, to),
            StoredBlock::Bf16(data) => E::widen_bf16(data, to),
            StoredBlock::Int8(data) => E::widen_i8(data, to),
        }
        (to, scales)
    }
}

impl<'a, E> From<&'a [E]> for KvBuffer<'a, E> {
    fn from(data: &'a [E]) -> Self {
        Self::Float(data)
    }
}

impl<'a, E> From<&'a Vec<E>> for KvBuffer<'a, E> {
    fn from(data: &'a Vec<E>) -> Self {
        Self::Float(data)
    }
}

/// The inputs of one attention call.
///
/// # Shapes
/// - `query`: `[batch, queries, heads, head_dim]`
/// - `key`, `value`: `[batch, per_sequence, kv_heads, head_dim]` (or `[batch, kv_heads,
///   per_sequence, head_dim]`), of which rows `first ..` are the call's `keys`; or a page
///   pool's `[kv_heads, pages, size, head_dim]` (see [`KeyRows`])
/// - `key_padding`: `[batch, keys]`, `true` = padding (never attended to)
/// - `documents`: `[batch, keys, 2]`
#[derive(Debug, Clone, Copy)]
pub struct Inputs<'a, E> {
    /// Sizes.
    pub dims: Dims,
    /// Queries.
    pub query: &'a [E],
    /// Keys.
    pub key: KvBuffer<'a, E>,
    /// Values.
    pub value: KvBuffer<'a, E>,
    /// Where the keys and values of each sequence lie in `key` and `value`.
    pub key_rows: KeyRows<'a>,
    /// Keys never attended to.
    pub key_padding: Option<&'a [bool]>,
    /// Each position's document, `[start, end)` within its sequence, when the sequences are
    /// packed documents (then `queries == keys`): a query sees the keys of its own document only.
    pub documents: Option<&'a [u32]>,
    /// Scale, soft-cap and sinks.
    pub scoring: Scoring<'a, E>,
}

impl<'a, E: KernelFloat> Inputs<'a, E> {
    /// The inputs of a call whose key and value buffers hold exactly its `keys` rows per
    /// sequence.
    pub fn packed(
        dims: Dims,
        [query, key, value]: [&'a [E]; 3],
        key_padding: Option<&'a [bool]>,
    ) -> Self {
        Self {
            dims,
            query,
            key: KvBuffer::Float(key),
            value: KvBuffer::Float(value),
            key_rows: KeyRows::packed(&dims),
            key_padding,
            documents: None,
            scoring: Scoring::plain(dims.head_dim),
        }
    }

    /// These inputs with `scoring` instead of the chapter's.
    pub fn with_scoring(self, scoring: Scoring<'a, E>) -> Self {
        Self { scoring, ..self }
    }

    /// These inputs with each sequence packed from documents: `spans` is each position's
    /// `[start, end)`, `[batch, keys, 2]`.
    pub fn with_documents(self, spans: Option<&'a [u32]>) -> Self {
        Self {
            documents: spans,
            ..self
        }
    }

    /// The first key that query `row` of sequence `batch` sees: its window's first, or its
    /// document's.
    fn first_visible_key(&self, batch: usize, row: usize) -> usize {
        let window_start = self.dims.window_start(row);
        match self.documents {
            Some(spans) => window_start.max(spans[2 * (batch * self.dims.keys + row)] as usize),
            None => window_start,
        }
    }

    /// `range` of sequence `batch`'s positions cut into blocks of at most `size`, and at every
    /// document's end: no block spans two documents, so none computes scores that are all
    /// masked across a boundary.
    fn blocks(
        &self,
        batch: usize,
        range: std::ops::Range<usize>,
        size: usize,
    ) -> impl Iterator<Item = std::ops::Range<usize>> + '_ {
        let end = range.end;
        std::iter::successors(Some(range.start..range.start), move |last| {
            let start = last.end;
            (start < end).then(|| {
                let document_end = self.documents.map_or(end, |spans| {
                    spans[2 * (batch * self.dims.keys + start) + 1] as usize
                });
                start..(start + size).min(end).min(document_end)
            })
        })
        .skip(1)
    }

    /// The exclusive end of the queries of sequence `batch` that see some key of `keys`: those
    /// whose window reaches back to the last key, up to the end of its document.
    fn queries_seeing(&self, batch: usize, keys: &std::ops::Range<usize>) -> usize {
        let window_end = self.dims.window_end(keys.end);
        match self.documents {
            Some(spans) => {
                let last = batch * self.dims.keys + keys.end - 1;
                window_end.min(spans[2 * last + 1] as usize)
            }
            None => window_end,
        }
    }

    /// Checks that every buffer has the length its shape says.
    fn check(&self) {
        let dims = self.dims;
        assert!(
            dims.queries <= dims.keys,
            "more queries than keys: {dims:?}"
        );
        assert!(
            dims.kv_heads > 0 && dims.heads.is_multiple_of(dims.kv_heads),
            "kv heads must divide heads: {dims:?}"
        );
        assert!(dims.window != Some(0), "a window of 0 keys: {dims:?}");
        assert_eq!(
            self.query.len(),
            dims.query_len(),
            "query buffer for {dims:?}"
        );
        let rows = self.key_rows;
        let key_len = match rows {
            KeyRows::Rows {
                first,
                per_sequence,
                ..
            } => {
                assert!(
                    first + dims.keys <= per_sequence,
                    "keys past the buffers' rows: {rows:?}, {dims:?}"
                );
                dims.batch * per_sequence * dims.kv_width()
            }
            KeyRows::Pages(pages) => {
                assert!(
                    dims.keys.div_ceil(pages.size) <= pages.per_sequence
                        && pages.tables.len() == dims.batch * pages.per_sequence,
                    "tables too short for {dims:?}"
                );
                assert!(
                    pages
                        .tables
                        .iter()
                        .all(|&page| (page as usize) < pages.count),
                    "a page id past the pool"
                );
                pages.count * pages.size * dims.kv_width()
            }
        };
        for (name, buffer) in [("key", self.key), ("value", self.value)] {
            assert_eq!(
                buffer.len(),
                key_len,
                "{name} buffer for {dims:?}, {rows:?}"
            );
            if let KvBuffer::Int8 { scales, .. } = buffer {
                assert_eq!(scales.len() * dims.head_dim, key_len, "{name} scales");
            }
            if !matches!(buffer, KvBuffer::Float(_)) {
                assert!(
                    !matches!(
                        rows,
                        KeyRows::Rows {
                            head_major: false,
                            ..
                        }
                    ),
                    "a stored {name} buffer keeps each head's rows side by side"
                );
            }
        }
        if let Some(padding) = self.key_padding {
            assert_eq!(
                padding.len(),
                dims.batch * dims.keys,
                "padding for {dims:?}"
            );
        }
        if let Some(sinks) = self.scoring.sinks {
            assert_eq!(sinks.len(), dims.heads, "sinks for {dims:?}");
        }
        if let Some(spans) = self.documents {
            assert_eq!(
                dims.queries, dims.keys,
                "documents of a cached call: {dims:?}"
            );
            assert_eq!(
                spans.len(),
                2 * dims.batch * dims.keys,
                "documents for {dims:?}"
            );
        }
    }

    /// The `[keys, head_dim]` view of key/value head `kv_head` of sequence `batch` in `data`
    /// (the key or the value buffer), all of the call's keys: rows only, never pages.
    fn key_view<'d>(&self, data: &'d [E], batch: usize, kv_head: usize) -> ArrayView2<'d, E> {
        let dims = self.dims;
        let KeyRows::Rows {
            first,
            per_sequence,
            head_major,
        } = self.key_rows
        else {
            unreachable!("paged keys are read a block at a time, by the forward pass only")
        };
        let (start, row_stride) = match head_major {
            true => {
                let head = batch * dims.kv_heads + kv_head;
                (head * per_sequence + first, 1)
            }
            false => {
                let row = batch * per_sequence + first;
                (row * dims.kv_heads + kv_head, dims.kv_heads)
            }
        };
        let shape = (dims.keys, dims.head_dim).strides((row_stride * dims.head_dim, 1));
        ArrayView2::from_shape(shape, &data[start * dims.head_dim..])
            .expect("the buffer holds the tensor")
    }

    /// The `[cols.len(), head_dim]` block of keys `cols` of key/value head `kv_head` of sequence
    /// `batch` in `data` (the key or the value buffer), with each key's scale where the buffer
    /// has them: a stored block read in place where `in_place`, else in the compute type —
    /// widened into `scratch` (`[KEY_BLOCK, head_dim]` at least) from a stored buffer. With
    /// pages, `cols` lie in one page.
    pub(super) fn key_block<'d>(
        &self,
        data: KvBuffer<'d, E>,
        (batch, kv_head): (usize, usize),
        cols: std::ops::Range<usize>,
        scratch: &'d mut [E],
        in_place: bool,
    ) -> (Block<'d, E>, Option<&'d [f32]>) {
        let head_dim = self.dims.head_dim;
        let first = match self.key_rows {
            KeyRows::Pages(pages) => {
                let (index, slot) = (cols.start / pages.size, cols.start % pages.size);
                debug_assert!(slot + cols.len() <= pages.size, "a block spans two pages");
                let page = pages.tables[batch * pages.per_sequence + index] as usize;
                (kv_head * pages.count + page) * pages.size + slot
            }
            KeyRows::Rows {
                first,
                per_sequence,
                head_major: true,
            } => (batch * self.dims.kv_heads + kv_head) * per_sequence + first + cols.start,
            KeyRows::Rows { .. } => {
                let view = self
                    .key_view(data.floats(), batch, kv_head)
                    .slice_axis_move(Axis(0), Slice::from(cols));
                return (Block::Floats(view), None);
            }
        };
        let rows = first..first + cols.len();
        if in_place && let Some((block, scales)) = data.stored_rows(rows.clone(), head_dim) {
            return (Block::Stored(block), scales);
        }
        let (rows, scales) = data.rows(rows, head_dim, scratch);
        let view = ArrayView2::from_shape((cols.len(), head_dim), rows)
            .expect("the buffer holds the block");
        (Block::Floats(view), scales)
    }

    /// `keys` cut into blocks of at most [`KEY_BLOCK`], and at every page's end.
    fn key_blocks(
        &self,
        keys: std::ops::Range<usize>,
    ) -> impl Iterator<Item = std::ops::Range<usize>> + use<E> {
        let page = match self.key_rows {
            KeyRows::Pages(pages) => pages.size,
            KeyRows::Rows { .. } => usize::MAX,
        };
        let end = keys.end;
        std::iter::successors(Some(keys.start..keys.start), move |last| {
            let start = last.end;
            let page_end = (start / page + 1).saturating_mul(page);
            (start < end).then(|| start..(start + KEY_BLOCK).min(end).min(page_end))
        })
        .skip(1)
    }

    /// `scale · q kᵀ` (soft-capped, with a soft-cap) for a block of stacked query rows and key
    /// columns `cols` of one key/value head, with masked entries (above the diagonal, before the
    /// window or the query's document, or padding) set to `-inf`.
    ///
    /// The query rows are a group's heads stacked position-major (see [`Dims::gather_group`]):
    /// row `r` is query position `first_row + r / group`.
    ///
    /// # Shapes
    /// - `query`: `[positions · group, head_dim]`, `key_block`: `[cols.len(), head_dim]`
    /// - `scores`: `[positions · group, cols.len()]`, overwritten
    fn masked_scores(
        &self,
        batch: usize,
        query: &ArrayView2<E>,
        (key_block, key_scales): (&Block<E>, Option<&[f32]>),
        first_row: usize,
        cols: std::ops::Range<usize>,
        scores: &mut ArrayViewMut2<E>,
    ) {
        let dims = self.dims;
        match key_block {
            Block::Floats(key_block) => {
                mat_mul(self.scoring.scale, query, &key_block.t(), E::zero(), scores);
            }
            Block::Stored(block) => {
                let query = query.as_slice().expect("the query rows are row-major");
                let scores = scores.as_slice_mut().expect("scores are row-major");
                E::stored_scores(query, *block, dims.head_dim, scores);
                scores.iter_mut().for_each(|s| *s = *s * self.scoring.scale);
            }
        }
        if let Some(key_scales) = key_scales {
            scale_columns(scores, key_scales);
        }
        if let Some(cap) = self.scoring.softcap {
            let inverse = cap.recip();
            scores.mapv_inplace(|s| cap * (s * inverse).tanh());
        }
        let padding = self
            .key_padding
            .map(|padding| &padding[batch * dims.keys + cols.start..batch * dims.keys + cols.end]);
        for (r, mut scores) in scores.rows_mut().into_iter().enumerate() {
            let row = first_row + r / dims.group();
            // Keys from `first_hidden` on lie above the diagonal for this query.
            let first_hidden = dims.visible_keys(row + 1).saturating_sub(cols.start);
            let row_scores = scores.as_slice_mut().expect("scores are row-major");
            if first_hidden < row_scores.len() {
                row_scores[first_hidden..].fill(E::neg_infinity());
            }
            // Keys before `first_visible` have left this query's window or its document.
            let first_visible = self
                .first_visible_key(batch, row)
                .saturating_sub(cols.start);
            let too_old = first_visible.min(row_scores.len());
            row_scores[..too_old].fill(E::neg_infinity());
            if let Some(padding) = padding {
                for (score, &padded) in row_scores.iter_mut().zip(padding) {
                    if padded {
                        *score = E::neg_infinity();
                    }
                }
            }
        }
    }
}

/// Multiplies column `j` of `matrix` by `scales[j]`: a block of int8 keys' scales folded into
/// their scores, or of int8 values' into their weights.
pub(super) fn scale_columns<E: KernelFloat>(matrix: &mut ArrayViewMut2<E>, scales: &[f32]) {
    for mut row in matrix.rows_mut() {
        for (x, &scale) in row.iter_mut().zip(scales) {
            *x = *x * E::from_scale(scale);
        }
    }
}

/// A row-major `[rows, cols]` matrix over the front of a scratch buffer.
pub(super) fn block_matrix<E>(buffer: &mut [E], rows: usize, cols: usize) -> ArrayViewMut2<'_, E> {
    ArrayViewMut2::from_shape((rows, cols), &mut buffer[..rows * cols])
        .expect("the scratch buffer holds one block")
}
