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

use ndarray::{Array2, ArrayView2, ArrayViewMut2, Axis, ShapeBuilder, Slice};
use rayon::prelude::*;

use super::simd::{self, mat_mul};

/// Queries per block: the unit of parallel work in the forward pass.
const QUERY_BLOCK: usize = 64;
/// Keys per block. With 64-wide heads a `64 × 128` block of scores (32 KiB in `f32`) and the
/// block's keys and values stay in a core's L2 cache.
const KEY_BLOCK: usize = 128;

/// The float types the kernel computes in.
pub trait KernelFloat:
    num_traits::Float + ndarray::LinalgScalar + Send + Sync + std::fmt::Debug + 'static
{
    /// The largest element, `-inf` for none.
    fn max_of(xs: &[Self]) -> Self;

    /// `x ← exp(x − shift)` for every element; returns their sum.
    fn exp_shifted_sum(xs: &mut [Self], shift: Self) -> Self;
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
}

impl KernelFloat for f32 {
    fn max_of(xs: &[Self]) -> Self {
        simd::max_f32(xs)
    }

    fn exp_shifted_sum(xs: &mut [Self], shift: Self) -> Self {
        simd::exp_shifted_sum_f32(xs, shift)
    }
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

    /// The first key that query `row` sees (0 without a window).
    fn first_visible_key(&self, row: usize) -> usize {
        self.window
            .map_or(0, |window| (row + self.offset() + 1).saturating_sub(window))
    }

    /// The exclusive end of the queries that see some key before `end` (all without a window).
    fn queries_seeing_keys_before(&self, end: usize) -> usize {
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

/// Where each sequence's keys (and values) lie in the key and value buffers: rows
/// `first .. first + keys` of the sequence's `per_sequence` rows. A cache's storage holds more
/// positions than one call reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyRows {
    /// The first row read.
    pub first: usize,
    /// Rows per sequence in the buffers.
    pub per_sequence: usize,
}

impl KeyRows {
    /// Exactly `keys` rows per sequence, all read.
    pub fn packed(dims: &Dims) -> Self {
        Self {
            first: 0,
            per_sequence: dims.keys,
        }
    }
}

/// The inputs of one attention call.
///
/// # Shapes
/// - `query`: `[batch, queries, heads, head_dim]`
/// - `key`, `value`: `[batch, key_rows.per_sequence, kv_heads, head_dim]`, of which rows
///   `key_rows.first ..` are the call's `keys`
/// - `key_padding`: `[batch, keys]`, `true` = padding (never attended to)
#[derive(Debug, Clone, Copy)]
pub struct Inputs<'a, E> {
    /// Sizes.
    pub dims: Dims,
    /// Queries.
    pub query: &'a [E],
    /// Keys.
    pub key: &'a [E],
    /// Values.
    pub value: &'a [E],
    /// Where the keys and values of each sequence lie in `key` and `value`.
    pub key_rows: KeyRows,
    /// Keys never attended to.
    pub key_padding: Option<&'a [bool]>,
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
            key,
            value,
            key_rows: KeyRows::packed(&dims),
            key_padding,
            scoring: Scoring::plain(dims.head_dim),
        }
    }

    /// These inputs with `scoring` instead of the chapter's.
    pub fn with_scoring(self, scoring: Scoring<'a, E>) -> Self {
        Self { scoring, ..self }
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
        assert!(
            rows.first + dims.keys <= rows.per_sequence,
            "keys past the buffers' rows: {rows:?}, {dims:?}"
        );
        let key_len = dims.batch * rows.per_sequence * dims.kv_width();
        assert_eq!(self.key.len(), key_len, "key buffer for {dims:?}, {rows:?}");
        assert_eq!(
            self.value.len(),
            key_len,
            "value buffer for {dims:?}, {rows:?}"
        );
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
    }

    /// The `[keys, head_dim]` view of key/value head `kv_head` of sequence `batch` in `data`
    /// (the key or the value buffer).
    fn key_view<'d>(&self, data: &'d [E], batch: usize, kv_head: usize) -> ArrayView2<'d, E> {
        let (dims, rows) = (self.dims, self.key_rows);
        let start =
            ((batch * rows.per_sequence + rows.first) * dims.kv_heads + kv_head) * dims.head_dim;
        let shape = (dims.keys, dims.head_dim).strides((dims.kv_width(), 1));
        ArrayView2::from_shape(shape, &data[start..]).expect("the buffer holds the tensor")
    }

    /// `scale · q kᵀ` (soft-capped, with a soft-cap) for a block of stacked query rows and key
    /// columns `cols` of one key/value head, with masked entries (above the diagonal, before the
    /// window, or padding) set to `-inf`.
    ///
    /// The query rows are a group's heads stacked position-major (see [`Dims::gather_group`]):
    /// row `r` is query position `first_row + r / group`.
    ///
    /// # Shapes
    /// - `query`: `[positions · group, head_dim]`, `key`: `[keys, head_dim]`
    /// - `scores`: `[positions · group, cols.len()]`, overwritten
    fn masked_scores(
        &self,
        batch: usize,
        query: &ArrayView2<E>,
        key: &ArrayView2<E>,
        first_row: usize,
        cols: std::ops::Range<usize>,
        scores: &mut ArrayViewMut2<E>,
    ) {
        let dims = self.dims;
        let key_block = key.slice_axis(Axis(0), Slice::from(cols.clone()));
        mat_mul(self.scoring.scale, query, &key_block.t(), E::zero(), scores);
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
            // Keys before `first_visible` have left this query's window.
            let first_visible = dims.first_visible_key(row).saturating_sub(cols.start);
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

/// Causal attention, `softmax(q kᵀ / √head_dim) v` per head (or as [`Inputs::scoring`] says),
/// with the mask described on [`Dims`] and the key padding. A query whose keys are all masked
/// gets a zero output.
pub fn forward<E: KernelFloat>(inputs: Inputs<E>) -> Forward<E> {
    inputs.check();
    let dims = inputs.dims;
    let width = dims.width();
    let mut output = vec![E::zero(); dims.query_len()];
    let mut log_sum_exp = vec![E::neg_infinity(); dims.batch * dims.queries * dims.heads];
    if dims.query_len() == 0 {
        return Forward {
            output,
            log_sum_exp,
        };
    }
    let blocks = dims.batch * dims.queries.div_ceil(QUERY_BLOCK);
    let threads = rayon::current_num_threads();
    let splits = kv_splits(&dims, threads);
    if blocks < threads && dims.queries <= QUERY_BLOCK && (dims.kv_heads > 1 || splits > 1) {
        forward_by_head(&inputs, splits, &mut output, &mut log_sum_exp);
        return Forward {
            output,
            log_sum_exp,
        };
    }
    // Each task owns the rows of one block of queries of one sequence, all heads: a contiguous
    // stretch of the output and of the log-sum-exp.
    output
        .par_chunks_mut(dims.queries * width)
        .zip(log_sum_exp.par_chunks_mut(dims.queries * dims.heads))
        .enumerate()
        .flat_map(|(batch, (output, log_sum_exp))| {
            output
                .par_chunks_mut(QUERY_BLOCK * width)
                .zip(log_sum_exp.par_chunks_mut(QUERY_BLOCK * dims.heads))
                .enumerate()
                .map(move |(block, chunks)| (batch, block * QUERY_BLOCK, chunks))
        })
        .for_each(|(batch, first_query, (output, log_sum_exp))| {
            forward_block(
                &inputs,
                batch,
                first_query,
                0..dims.kv_heads,
                output,
                log_sum_exp,
            );
        });
    Forward {
        output,
        log_sum_exp,
    }
}

/// How many tasks share the keys of one (sequence, key/value head) pair when decoding: one while
/// the pairs alone give every thread work, else enough for about two tasks per thread, each
/// with at least one key block (flash-decoding's split of the cached length). A function of the
/// shape and the thread count only, so results are reproducible for a given pool.
fn kv_splits(dims: &Dims, threads: usize) -> usize {
    let pairs = dims.batch * dims.kv_heads;
    if pairs >= threads {
        1
    } else {
        (2 * threads)
            .div_ceil(pairs)
            .min(dims.keys.div_ceil(KEY_BLOCK))
            .max(1)
    }
}

/// [`forward`] for fewer blocks of queries than threads, each sequence's queries one block
/// (decoding a token, a short prompt): one task per (sequence, key/value head) and per split of
/// its keys (`splits` stretches of whole key blocks), so that the threads share the reading of
/// long keys and values even at batch 1. Each task fills the group's columns of a scratch
/// `[queries, heads, head_dim]` of its own; a pair's splits are then combined by their
/// log-sum-exps (the sinks join there), and put in place.
///
/// # Shapes
/// - `output`: `[batch, queries, heads, head_dim]`, zeros; `log_sum_exp`: `[batch, queries,
///   heads]`, `-inf`
fn forward_by_head<E: KernelFloat>(
    inputs: &Inputs<E>,
    splits: usize,
    output: &mut [E],
    log_sum_exp: &mut [E],
) {
    let dims = inputs.dims;
    let (width, group) = (dims.width(), dims.group());
    let blocks_per_split = dims.keys.div_ceil(KEY_BLOCK).div_ceil(splits).max(1);
    let parts: Vec<(Vec<E>, Vec<E>)> = (0..dims.batch * dims.kv_heads * splits)
        .into_par_iter()
        .map(|task| {
            let (pair, split) = (task / splits, task % splits);
            let (batch, kv_head) = (pair / dims.kv_heads, pair % dims.kv_heads);
            let first_key = (split * blocks_per_split * KEY_BLOCK).min(dims.keys);
            let keys = first_key..(first_key + blocks_per_split * KEY_BLOCK).min(dims.keys);
            let mut part_output = vec![E::zero(); dims.queries * width];
            let mut part_log_sum_exp = vec![E::neg_infinity(); dims.queries * dims.heads];
            forward_block_over(
                inputs,
                batch,
                0,
                kv_head..kv_head + 1,
                keys,
                splits == 1,
                &mut part_output,
                &mut part_log_sum_exp,
            );
            (part_output, part_log_sum_exp)
        })
        .collect();
    for (pair, parts) in parts.chunks(splits).enumerate() {
        let (batch, kv_head) = (pair / dims.kv_heads, pair % dims.kv_heads);
        let rows = batch * dims.queries..(batch + 1) * dims.queries;
        let output = &mut output[rows.start * width..rows.end * width];
        let log_sum_exp = &mut log_sum_exp[rows.start * dims.heads..rows.end * dims.heads];
        for head in kv_head * group..(kv_head + 1) * group {
            for query in 0..dims.queries {
                let at = query * dims.heads + head;
                // The head's features at this query, in `output` and in each part's.
                let span = query * width + head * dims.head_dim
                    ..query * width + (head + 1) * dims.head_dim;
                let out = &mut output[span.clone()];
                if splits == 1 {
                    out.copy_from_slice(&parts[0].0[span]);
                    log_sum_exp[at] = parts[0].1[at];
                    continue;
                }
                let sink = inputs.scoring.sinks.map(|sinks| sinks[head]);
                let max = parts
                    .iter()
                    .map(|(_, part_log_sum_exp)| part_log_sum_exp[at])
                    .chain(sink)
                    .fold(E::neg_infinity(), E::max);
                if max == E::neg_infinity() {
                    continue; // every key masked, no sink: zeros and -inf, as they are
                }
                // Each split's output is normalized over its own keys: weigh it by its share of
                // the whole denominator.
                let shares: Vec<E> = parts
                    .iter()
                    .map(|(_, part_log_sum_exp)| (part_log_sum_exp[at] - max).exp())
                    .collect();
                let sum = shares.iter().fold(E::zero(), |sum, &share| sum + share)
                    + sink.map_or(E::zero(), |sink| (sink - max).exp());
                for (share, (part_output, _)) in shares.iter().zip(parts) {
                    let weight = *share / sum;
                    if weight != E::zero() {
                        for (o, &p) in out.iter_mut().zip(&part_output[span.clone()]) {
                            *o = *o + weight * p;
                        }
                    }
                }
                log_sum_exp[at] = max + sum.ln();
            }
        }
    }
}

/// One block of queries of one sequence, the query heads of key/value heads `kv_heads`. The
/// query heads of a group are stacked into one matrix, so that each block of their shared keys
/// and values enters one product for the whole group.
///
/// # Shapes
/// - `output`: `[block, heads, head_dim]`, zeros; `log_sum_exp`: `[block, heads]`
fn forward_block<E: KernelFloat>(
    inputs: &Inputs<E>,
    batch: usize,
    first_query: usize,
    kv_heads: std::ops::Range<usize>,
    output: &mut [E],
    log_sum_exp: &mut [E],
) {
    let keys = 0..inputs.dims.keys;
    forward_block_over(
        inputs,
        batch,
        first_query,
        kv_heads,
        keys,
        true,
        output,
        log_sum_exp,
    );
}

/// [`forward_block`] over the keys in `keys` only, the sinks left out unless `with_sinks`: a
/// split's share of a decoding step, normalized over its own keys.
#[allow(clippy::too_many_arguments)]
fn forward_block_over<E: KernelFloat>(
    inputs: &Inputs<E>,
    batch: usize,
    first_query: usize,
    kv_heads: std::ops::Range<usize>,
    keys: std::ops::Range<usize>,
    with_sinks: bool,
    output: &mut [E],
    log_sum_exp: &mut [E],
) {
    let dims = inputs.dims;
    let (group, head_dim) = (dims.group(), dims.head_dim);
    let block = log_sum_exp.len() / dims.heads;
    let rows = first_query..first_query + block;
    let positions = dims.positions_per_product().min(block);
    let most_rows = positions * group;
    let mut scores_buffer = vec![E::zero(); most_rows * KEY_BLOCK];
    let mut query_buffer = vec![E::zero(); most_rows * head_dim];
    let mut out_buffer = vec![E::zero(); most_rows * head_dim];
    let mut row_max = vec![E::neg_infinity(); most_rows];
    let mut row_sum = vec![E::zero(); most_rows];
    for kv_head in kv_heads {
        let key = inputs.key_view(inputs.key, batch, kv_head);
        let value = inputs.key_view(inputs.value, batch, kv_head);
        let first_head = kv_head * group;
        for first in rows.clone().step_by(positions) {
            let part = first..(first + positions).min(rows.end);
            let stacked = part.len() * group;
            let query = &mut query_buffer[..stacked * head_dim];
            dims.gather_group(inputs.query, batch, kv_head, part.clone(), query);
            let query = ArrayView2::from_shape((stacked, head_dim), &*query)
                .expect("the buffer holds the rows");
            let mut out = block_matrix(&mut out_buffer, stacked, head_dim);
            out.fill(E::zero());
            let (row_max, row_sum) = (&mut row_max[..stacked], &mut row_sum[..stacked]);
            row_max.fill(E::neg_infinity());
            row_sum.fill(E::zero());
            let visible = dims.first_visible_key(part.start).max(keys.start)
                ..dims.visible_keys(part.end).min(keys.end);
            for start in visible.clone().step_by(KEY_BLOCK) {
                let cols = start..(start + KEY_BLOCK).min(visible.end);
                let mut scores = block_matrix(&mut scores_buffer, stacked, cols.len());
                inputs.masked_scores(batch, &query, &key, part.start, cols.clone(), &mut scores);
                for (r, mut row) in scores.rows_mut().into_iter().enumerate() {
                    let row = row.as_slice_mut().expect("scores are row-major");
                    let block_max = E::max_of(row);
                    if block_max == E::neg_infinity() {
                        row.fill(E::zero()); // every key of this block is masked for this query
                        continue;
                    }
                    let new_max = row_max[r].max(block_max);
                    let block_sum = E::exp_shifted_sum(row, new_max);
                    let correction = (row_max[r] - new_max).exp(); // 0 when row_max was -inf
                    row_sum[r] = row_sum[r] * correction + block_sum;
                    row_max[r] = new_max;
                    if correction != E::one() {
                        out.row_mut(r).mapv_inplace(|o| o * correction);
                    }
                }
                mat_mul(
                    E::one(),
                    &scores,
                    &value.slice_axis(Axis(0), Slice::from(cols)),
                    E::one(),
                    &mut out,
                );
            }
            // Stacked row `r` is head `first_head + r % group` at position `r / group` of the
            // part: index `r` of the group's stretch of the part's `[positions, heads]`.
            let local = part.start - first_query;
            for (r, mut out_row) in out.rows_mut().into_iter().enumerate() {
                let (position, head) = (local + r / group, first_head + r % group);
                let sink = inputs
                    .scoring
                    .sinks
                    .filter(|_| with_sinks)
                    .map(|sinks| sinks[head]);
                // The denominator, shifted by `max`, and the factor that moves the row's sum
                // (and output) from its own shift `row_max` to `max`.
                let (max, shift) = match sink {
                    Some(sink) if sink > row_max[r] => (sink, (row_max[r] - sink).exp()),
                    _ => (row_max[r], E::one()),
                };
                let sum = row_sum[r] * shift + sink.map_or(E::zero(), |sink| (sink - max).exp());
                if sum > E::zero() {
                    let factor = shift / sum;
                    out_row.mapv_inplace(|o| o * factor);
                    log_sum_exp[position * dims.heads + head] = max + sum.ln();
                }
            }
            let out = out.as_slice().expect("the rows are row-major");
            let part_output =
                &mut output[local * dims.width()..(part.end - first_query) * dims.width()];
            dims.scatter_group(out, first_head * head_dim, part_output);
        }
    }
}

/// The gradients of `sum(output ⊙ output_grad)` with respect to query, key and value, given the
/// forward pass's `output` and `log_sum_exp`.
///
/// # Shapes
/// - `output`, `output_grad`: `[batch, queries, heads, head_dim]`
/// - `log_sum_exp`: `[batch, queries, heads]`
pub fn backward<E: KernelFloat>(
    inputs: Inputs<E>,
    forward: &Forward<E>,
    output_grad: &[E],
) -> Gradients<E> {
    let splits = key_splits(&inputs.dims, rayon::current_num_threads());
    backward_in_splits(inputs, forward, output_grad, splits)
}

/// How many tasks share the keys of one (sequence, key/value head) pair in the backward pass:
/// one while the pairs alone give every thread work, else enough for about two tasks per
/// thread (FlashAttention-2's split over key blocks). The split count is a function of the
/// shape and the thread count only, so results are reproducible for a given pool.
fn key_splits(dims: &Dims, threads: usize) -> usize {
    let pairs = dims.batch * dims.kv_heads;
    let key_blocks = dims.keys.div_ceil(KEY_BLOCK).max(1);
    if pairs >= threads {
        1
    } else {
        (2 * threads).div_ceil(pairs).min(key_blocks)
    }
}

/// [`backward`] with the keys of each (sequence, key/value head) pair dealt to `splits` tasks:
/// task `s` takes key blocks `s, s + splits, …` (interleaved, since under the causal mask later
/// keys are seen by fewer queries). Each task owns its key and value gradient rows and a
/// partial query gradient of the group; the partials are summed in task order.
fn backward_in_splits<E: KernelFloat>(
    inputs: Inputs<E>,
    forward: &Forward<E>,
    output_grad: &[E],
    splits: usize,
) -> Gradients<E> {
    inputs.check();
    let dims = inputs.dims;
    assert_eq!(
        inputs.key_rows,
        KeyRows::packed(&dims),
        "the backward pass reads packed keys"
    );
    assert_eq!(
        output_grad.len(),
        dims.query_len(),
        "output gradient for {dims:?}"
    );
    let per_task: Vec<GroupGradients<E>> = (0..dims.batch * dims.kv_heads * splits)
        .into_par_iter()
        .map(|task| {
            let (pair, split) = (task / splits, task % splits);
            let pair = [pair / dims.kv_heads, pair % dims.kv_heads];
            backward_group(&inputs, forward, output_grad, pair, (split, splits))
        })
        .collect();
    let mut gradients = Gradients {
        query: vec![E::zero(); dims.query_len()],
        key: vec![E::zero(); dims.key_len()],
        value: vec![E::zero(); dims.key_len()],
        sinks: inputs
            .scoring
            .sinks
            .map(|sinks| sink_gradients(&dims, sinks, forward, output_grad)),
    };
    let mut tasks = per_task.into_iter();
    for pair in 0..dims.batch * dims.kv_heads {
        let (batch, kv_head) = (pair / dims.kv_heads, pair % dims.kv_heads);
        // The pair's first task's buffers take the sums: no copy where there is one task.
        let GroupGradients {
            mut query,
            mut key,
            mut value,
        } = tasks.next().expect("one task per split of every pair");
        for task in tasks.by_ref().take(splits - 1) {
            add_in_parallel(&mut query, &task.query);
            add_in_parallel(&mut key, &task.key);
            add_in_parallel(&mut value, &task.value);
        }
        let query_start = batch * dims.queries * dims.width();
        let query_end = query_start + dims.queries * dims.width();
        let first_head = kv_head * dims.group();
        dims.scatter_group(
            query.as_slice().expect("gradients are row-major"),
            first_head * dims.head_dim,
            &mut gradients.query[query_start..query_end],
        );
        let start = batch * dims.keys * dims.kv_width() + kv_head * dims.head_dim;
        for (data, grad) in [(&mut gradients.key, key), (&mut gradients.value, value)] {
            let shape = grad.dim().strides((dims.kv_width(), 1));
            ArrayViewMut2::from_shape(shape, &mut data[start..])
                .expect("the buffer holds the tensor")
                .assign(&grad);
        }
    }
    gradients
}

/// The gradient of each head's sink: `−Σ exp(sink − log Σ exp) · rowsum(dO ⊙ O)` over that
/// head's rows (the sink is a key whose value is zero).
///
/// # Shapes
/// - `sinks`, output: `[heads]`
fn sink_gradients<E: KernelFloat>(
    dims: &Dims,
    sinks: &[E],
    forward: &Forward<E>,
    output_grad: &[E],
) -> Vec<E> {
    let mut gradients = vec![E::zero(); dims.heads];
    let rows = forward
        .output
        .chunks(dims.head_dim)
        .zip(output_grad.chunks(dims.head_dim))
        .zip(&forward.log_sum_exp);
    for (row, ((output, output_grad), &log_sum_exp)) in rows.enumerate() {
        let head = row % dims.heads;
        let dot = output
            .iter()
            .zip(output_grad)
            .fold(E::zero(), |sum, (&o, &g)| sum + o * g);
        gradients[head] = gradients[head] - (sinks[head] - log_sum_exp).exp() * dot;
    }
    gradients
}

/// `total += part`, element by element, split across threads.
fn add_in_parallel<E: KernelFloat>(total: &mut Array2<E>, part: &Array2<E>) {
    const CHUNK: usize = 1 << 14;
    let total = total.as_slice_mut().expect("gradients are row-major");
    let part = part.as_slice().expect("gradients are row-major");
    total
        .par_chunks_mut(CHUNK)
        .zip(part.par_chunks(CHUNK))
        .for_each(|(total, part)| total.iter_mut().zip(part).for_each(|(t, &p)| *t = *t + p));
}

/// One backward task's share of the gradients of one (sequence, key/value head) pair.
struct GroupGradients<E> {
    /// The group's query heads stacked position-major: `[queries · group, head_dim]`.
    query: Array2<E>,
    /// `[keys, head_dim]`
    key: Array2<E>,
    /// `[keys, head_dim]`
    value: Array2<E>,
}

/// The gradients from key blocks `split, split + splits, …` of key/value head `kv_head` of
/// sequence `batch`, for the whole group of query heads that reads it, stacked so that each
/// block product covers the group.
fn backward_group<E: KernelFloat>(
    inputs: &Inputs<E>,
    forward: &Forward<E>,
    output_grad: &[E],
    [batch, kv_head]: [usize; 2],
    (split, splits): (usize, usize),
) -> GroupGradients<E> {
    let dims = inputs.dims;
    let group = dims.group();
    let stacked = dims.queries * group;
    let all_queries = 0..dims.queries;
    let gather = |data: &[E], positions| {
        let mut stacked_rows = Array2::zeros((stacked, dims.head_dim));
        let rows = stacked_rows
            .as_slice_mut()
            .expect("a new array is row-major");
        dims.gather_group(data, batch, kv_head, positions, rows);
        stacked_rows
    };
    let query = gather(inputs.query, all_queries.clone());
    let query_output_grad = gather(output_grad, all_queries);
    let key = inputs.key_view(inputs.key, batch, kv_head);
    let value = inputs.key_view(inputs.value, batch, kv_head);
    // Per stacked row: log Σ exp, and Σ_d dO ⊙ O, the softmax gradient's row term.
    // `[batch, queries, heads, width]` indices of the group at `position`.
    let group_rows = |position: usize, width: usize| {
        let start = ((batch * dims.queries + position) * dims.heads + kv_head * group) * width;
        start..start + group * width
    };
    let log_sum_exp: Vec<E> = (0..dims.queries)
        .flat_map(|position| forward.log_sum_exp[group_rows(position, 1)].iter().copied())
        .collect();
    let row_dot: Vec<E> = (0..dims.queries)
        .flat_map(|position| {
            let rows = group_rows(position, dims.head_dim);
            let (output, output_grad) = (&forward.output[rows.clone()], &output_grad[rows]);
            output
                .chunks(dims.head_dim)
                .zip(output_grad.chunks(dims.head_dim))
                .map(|(o, g)| o.iter().zip(g).fold(E::zero(), |sum, (&o, &g)| sum + o * g))
        })
        .collect();

    let positions = dims.positions_per_product();
    let mut weights_buffer = vec![E::zero(); positions * group * KEY_BLOCK];
    let mut score_grad_buffer = vec![E::zero(); positions * group * KEY_BLOCK];
    // With a soft-cap: the capped scores of the block, for the cap's derivative.
    let softcap = inputs.scoring.softcap;
    let mut capped_buffer = vec![E::zero(); softcap.map_or(0, |_| positions * group * KEY_BLOCK)];
    let mut grads = GroupGradients {
        query: Array2::zeros((stacked, dims.head_dim)),
        key: Array2::zeros((dims.keys, dims.head_dim)),
        value: Array2::zeros((dims.keys, dims.head_dim)),
    };
    for start in (0..dims.keys)
        .step_by(KEY_BLOCK)
        .skip(split)
        .step_by(splits)
    {
        let cols = start..(start + KEY_BLOCK).min(dims.keys);
        let key_block = key.slice_axis(Axis(0), Slice::from(cols.clone()));
        let value_block = value.slice_axis(Axis(0), Slice::from(cols.clone()));
        // The queries that see a key of this block: from the first that sees key `start`
        // (causal) to the last whose window reaches back into the block.
        let first_query = start.saturating_sub(dims.offset());
        let end_query = dims.queries_seeing_keys_before(cols.end);
        for row_start in (first_query..end_query).step_by(positions) {
            let row_end = (row_start + positions).min(end_query);
            let rows = row_start * group..row_end * group;
            let query_block = query.slice_axis(Axis(0), Slice::from(rows.clone()));
            let output_grad_block =
                query_output_grad.slice_axis(Axis(0), Slice::from(rows.clone()));
            // The weights, rebuilt: exp(scores − log Σ exp), 0 where masked.
            let mut weights = block_matrix(&mut weights_buffer, rows.len(), cols.len());
            inputs.masked_scores(
                batch,
                &query_block,
                &key,
                row_start,
                cols.clone(),
                &mut weights,
            );
            if softcap.is_some() {
                block_matrix(&mut capped_buffer, rows.len(), cols.len()).assign(&weights);
            }
            for (mut row, &lse) in weights
                .rows_mut()
                .into_iter()
                .zip(&log_sum_exp[rows.clone()])
            {
                let row = row.as_slice_mut().expect("weights are row-major");
                if lse == E::neg_infinity() {
                    row.fill(E::zero());
                } else {
                    E::exp_shifted_sum(row, lse);
                }
            }
            let mut value_grad_block = grads
                .value
                .slice_axis_mut(Axis(0), Slice::from(cols.clone()));
            mat_mul(
                E::one(),
                &weights.t(),
                &output_grad_block,
                E::one(),
                &mut value_grad_block,
            );
            // dS = P ⊙ (dO vᵀ − rowdot), then dQ += dS k · scale and dK += dSᵀ q · scale.
            let mut score_grad = block_matrix(&mut score_grad_buffer, rows.len(), cols.len());
            mat_mul(
                E::one(),
                &output_grad_block,
                &value_block.t(),
                E::zero(),
                &mut score_grad,
            );
            for ((mut grad_row, weight_row), &dot) in score_grad
                .rows_mut()
                .into_iter()
                .zip(weights.rows())
                .zip(&row_dot[rows.clone()])
            {
                grad_row.zip_mut_with(&weight_row, |g, &w| *g = w * (*g - dot));
            }
            // Through the cap: d(c · tanh(s / c)) / ds = 1 − tanh², where a weight is nonzero.
            if let Some(cap) = softcap {
                let inverse = cap.recip();
                let capped = block_matrix(&mut capped_buffer, rows.len(), cols.len());
                score_grad.zip_mut_with(&capped, |g, &s| {
                    if *g != E::zero() {
                        let tanh = s * inverse;
                        *g = *g * (E::one() - tanh * tanh);
                    }
                });
            }
            let mut query_grad_block = grads.query.slice_axis_mut(Axis(0), Slice::from(rows));
            mat_mul(
                inputs.scoring.scale,
                &score_grad,
                &key_block,
                E::one(),
                &mut query_grad_block,
            );
            let mut key_grad_block = grads.key.slice_axis_mut(Axis(0), Slice::from(cols.clone()));
            mat_mul(
                inputs.scoring.scale,
                &score_grad.t(),
                &query_block,
                E::one(),
                &mut key_grad_block,
            );
        }
    }
    grads
}

/// A row-major `[rows, cols]` matrix over the front of a scratch buffer.
fn block_matrix<E>(buffer: &mut [E], rows: usize, cols: usize) -> ArrayViewMut2<'_, E> {
    ArrayViewMut2::from_shape((rows, cols), &mut buffer[..rows * cols])
        .expect("the scratch buffer holds one block")
}

#[cfg(test)]
mod tests {
    //! The kernel against the textbook formula, computed densely in f64 on the same inputs.

    use super::*;

    /// Deterministic values in [-2, 2).
    fn values(len: usize, seed: u64) -> Vec<f64> {
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 11) as f64 / (1u64 << 53) as f64 * 4.0 - 2.0
            })
            .collect()
    }

    /// Dense causal attention and its gradients for `loss = Σ output ⊙ output_grad`.
    fn reference(inputs: &Inputs<f64>, output_grad: &[f64]) -> (Vec<f64>, Gradients<f64>) {
        let d = inputs.dims;
        let Scoring {
            scale,
            softcap,
            sinks,
        } = inputs.scoring;
        let at = |rows: usize, b: usize, t: usize, h: usize, c: usize| {
            ((b * rows + t) * d.heads + h) * d.head_dim + c
        };
        // Key/value element `c` of the head query head `h` reads.
        let kv = |b: usize, j: usize, h: usize, c: usize| {
            ((b * d.keys + j) * d.kv_heads + h / (d.heads / d.kv_heads)) * d.head_dim + c
        };
        let mut output = vec![0.0; d.query_len()];
        let mut grads = Gradients {
            query: vec![0.0; d.query_len()],
            key: vec![0.0; d.key_len()],
            value: vec![0.0; d.key_len()],
            sinks: sinks.map(|_| vec![0.0; d.heads]),
        };
        for b in 0..d.batch {
            for h in 0..d.heads {
                for i in 0..d.queries {
                    let position = i + d.offset();
                    let visible = |j: usize| {
                        j <= position
                            && d.window.is_none_or(|w| position - j < w)
                            && !inputs.key_padding.is_some_and(|p| p[b * d.keys + j])
                    };
                    let scores: Vec<f64> = (0..d.keys)
                        .map(|j| {
                            (0..d.head_dim)
                                .map(|c| {
                                    inputs.query[at(d.queries, b, i, h, c)]
                                        * inputs.key[kv(b, j, h, c)]
                                })
                                .sum::<f64>()
                                * scale
                        })
                        .map(|s| softcap.map_or(s, |c| c * (s / c).tanh()))
                        .collect();
                    let sink = sinks.map(|sinks| sinks[h]);
                    let max = (0..d.keys)
                        .filter(|&j| visible(j))
                        .map(|j| scores[j])
                        .chain(sink)
                        .fold(f64::NEG_INFINITY, f64::max);
                    if max == f64::NEG_INFINITY {
                        continue;
                    }
                    let exp: Vec<f64> = (0..d.keys)
                        .map(|j| {
                            if visible(j) {
                                (scores[j] - max).exp()
                            } else {
                                0.0
                            }
                        })
                        .collect();
                    let sink_exp = sink.map_or(0.0, |sink| (sink - max).exp());
                    let sum: f64 = exp.iter().sum::<f64>() + sink_exp;
                    let weights: Vec<f64> = exp.iter().map(|e| e / sum).collect();
                    for c in 0..d.head_dim {
                        output[at(d.queries, b, i, h, c)] = (0..d.keys)
                            .map(|j| weights[j] * inputs.value[kv(b, j, h, c)])
                            .sum();
                    }
                    let go = |c: usize| output_grad[at(d.queries, b, i, h, c)];
                    let weight_grad: Vec<f64> = (0..d.keys)
                        .map(|j| {
                            (0..d.head_dim)
                                .map(|c| go(c) * inputs.value[kv(b, j, h, c)])
                                .sum()
                        })
                        .collect();
                    let dot: f64 = (0..d.keys).map(|j| weights[j] * weight_grad[j]).sum();
                    if let Some(sink_grads) = &mut grads.sinks {
                        sink_grads[h] -= sink_exp / sum * dot;
                    }
                    for j in 0..d.keys {
                        let cap_grad = softcap.map_or(1.0, |c| 1.0 - (scores[j] / c).powi(2));
                        let score_grad = weights[j] * (weight_grad[j] - dot) * cap_grad * scale;
                        for c in 0..d.head_dim {
                            grads.value[kv(b, j, h, c)] += weights[j] * go(c);
                            grads.query[at(d.queries, b, i, h, c)] +=
                                score_grad * inputs.key[kv(b, j, h, c)];
                            grads.key[kv(b, j, h, c)] +=
                                score_grad * inputs.query[at(d.queries, b, i, h, c)];
                        }
                    }
                }
            }
        }
        (output, grads)
    }

    fn max_error(found: &[f64], expected: &[f64]) -> f64 {
        assert_eq!(found.len(), expected.len());
        found
            .iter()
            .zip(expected)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max)
    }

    /// Runs the kernel in f64 and f32 against the reference, forward and backward.
    fn check(dims: Dims, key_padding: Option<Vec<bool>>) {
        check_scored(dims, key_padding, &Scored::default());
    }

    /// A check's scale (default `1/√head_dim`), soft-cap and sinks, in f64.
    #[derive(Debug, Clone, Default)]
    struct Scored {
        scale: Option<f64>,
        softcap: Option<f64>,
        sinks: Option<Vec<f64>>,
    }

    impl Scored {
        /// The kernel's scoring in `E`, with `sinks` converted by the caller.
        fn scoring<'a, E: KernelFloat>(
            &self,
            dims: &Dims,
            sinks: Option<&'a [E]>,
        ) -> Scoring<'a, E> {
            let plain = Scoring::<E>::plain(dims.head_dim);
            Scoring {
                scale: self.scale.map_or(plain.scale, |s| E::from(s).unwrap()),
                softcap: self.softcap.map(|c| E::from(c).unwrap()),
                sinks,
            }
        }
    }

    /// [`check`] with a scale, a soft-cap and sinks.
    fn check_scored(dims: Dims, key_padding: Option<Vec<bool>>, scored: &Scored) {
        let data = [
            values(dims.query_len(), 1),
            values(dims.key_len(), 2),
            values(dims.key_len(), 3),
            values(dims.query_len(), 4), // the output's gradient
        ];
        let inputs = Inputs::packed(dims, [&data[0], &data[1], &data[2]], key_padding.as_deref())
            .with_scoring(scored.scoring(&dims, scored.sinks.as_deref()));
        let expected = reference(&inputs, &data[3]);
        let padding = key_padding.as_deref();
        check_in::<f64>(dims, padding, scored, &data, &expected, [1e-12, 1e-12]);
        check_in::<f32>(dims, padding, scored, &data, &expected, [2e-6, 2e-5]);
    }

    /// The kernel in `E` on `data` (query, key, value, output gradient) against the reference's
    /// output and gradients, within `tolerance` (output, gradients).
    fn check_in<E: KernelFloat>(
        dims: Dims,
        key_padding: Option<&[bool]>,
        scored: &Scored,
        data: &[Vec<f64>; 4],
        (expected, expected_grads): &(Vec<f64>, Gradients<f64>),
        [output_tolerance, grad_tolerance]: [f64; 2],
    ) {
        let precision = std::any::type_name::<E>();
        let [query, key, value, output_grad] = data
            .each_ref()
            .map(|xs| xs.iter().map(|&x| E::from(x).unwrap()).collect::<Vec<E>>());
        let widen = |xs: &[E]| xs.iter().map(|x| x.to_f64().unwrap()).collect::<Vec<f64>>();
        let sinks: Option<Vec<E>> = scored
            .sinks
            .as_ref()
            .map(|sinks| sinks.iter().map(|&x| E::from(x).unwrap()).collect());
        let inputs = Inputs::packed(dims, [&query, &key, &value], key_padding)
            .with_scoring(scored.scoring(&dims, sinks.as_deref()));
        let forward = super::forward(inputs);
        let error = max_error(&widen(&forward.output), expected);
        assert!(
            error < output_tolerance,
            "{precision} output off by {error}, {dims:?}"
        );
        // Decoding with the keys split across tasks (combined by their log-sum-exps) gives the
        // unsplit kernel's output to 1e-6 of its scale, and its log-sum-exp.
        if dims.queries <= QUERY_BLOCK {
            let scale = widen(&forward.output)
                .iter()
                .fold(1.0f64, |max, x| max.max(x.abs()));
            for splits in [1, 2, 3] {
                let mut output = vec![E::zero(); dims.query_len()];
                let mut log_sum_exp =
                    vec![E::neg_infinity(); dims.batch * dims.queries * dims.heads];
                forward_by_head(&inputs, splits, &mut output, &mut log_sum_exp);
                let error = max_error(&widen(&output), &widen(&forward.output)) / scale;
                assert!(
                    error < 1e-6,
                    "{precision} {splits} splits: output off by {error} of its scale, {dims:?}"
                );
                let found = widen(&log_sum_exp);
                let unsplit = widen(&forward.log_sum_exp);
                for (found, unsplit) in found.iter().zip(&unsplit) {
                    let same = found == unsplit || (found - unsplit).abs() < 1e-6 * unsplit.abs();
                    assert!(
                        same,
                        "{precision} {splits} splits: log-sum-exp {found} vs {unsplit}"
                    );
                }
            }
        }
        // One task per (sequence, key/value head), and the keys of each dealt to three.
        for splits in [1, 3] {
            let grads = backward_in_splits(inputs, &forward, &output_grad, splits);
            for (name, found, expected) in [
                ("query", &grads.query, &expected_grads.query),
                ("key", &grads.key, &expected_grads.key),
                ("value", &grads.value, &expected_grads.value),
            ] {
                let error = max_error(&widen(found), expected);
                assert!(
                    error < grad_tolerance,
                    "{precision} {name} gradient off by {error}, {splits} splits, {dims:?}"
                );
            }
            match (&grads.sinks, &expected_grads.sinks) {
                (Some(found), Some(expected)) => {
                    let error = max_error(&widen(found), expected);
                    // A sum over every row of its head: a longer sum than the others.
                    assert!(
                        error < 10.0 * grad_tolerance,
                        "{precision} sinks gradient off by {error}, {scored:?}, {dims:?}"
                    );
                }
                (None, None) => {}
                _ => panic!("a sinks gradient iff the call has sinks"),
            }
        }
    }

    fn dims(batch: usize, heads: usize, queries: usize, keys: usize, head_dim: usize) -> Dims {
        Dims {
            batch,
            heads,
            kv_heads: heads,
            queries,
            keys,
            head_dim,
            window: None,
        }
    }

    #[test]
    fn matches_the_formula_within_one_block() {
        check(dims(1, 2, 6, 6, 2), None); // the chapter's shape
        check(dims(2, 3, 5, 5, 4), None);
    }

    #[test]
    fn matches_the_formula_across_blocks_of_uneven_size() {
        // 200 queries: blocks of 64 with a short last one; keys in 128s with a short last one.
        check(dims(2, 2, 200, 200, 8), None);
    }

    #[test]
    fn matches_the_formula_for_queries_after_cached_keys() {
        check(dims(1, 2, 1, 150, 4), None); // one decoding step
        check(dims(2, 1, 70, 300, 4), None);
        // Decoding over 6 key blocks with one key/value head: split across tasks.
        let multi_query = Dims {
            kv_heads: 1,
            ..dims(1, 4, 3, 700, 8)
        };
        check(multi_query, None);
        check(
            Dims {
                window: Some(300),
                ..multi_query
            },
            Some((0..700).map(|j| j < 5).collect()),
        );
    }

    #[test]
    fn matches_the_formula_with_padding_and_fully_masked_rows() {
        let (batch, keys) = (2, 140);
        // Sequence 0 left-padded by 3 (its first queries see only padding), 1 right-padded by 70.
        let padding: Vec<bool> = (0..batch * keys)
            .map(|n| {
                let (b, j) = (n / keys, n % keys);
                if b == 0 { j < 3 } else { j >= keys - 70 }
            })
            .collect();
        check(dims(batch, 2, keys, keys, 4), Some(padding));
    }

    #[test]
    fn matches_the_formula_with_grouped_heads_and_windows() {
        // (kv heads, window, batch, heads, queries, keys, head_dim): multi-query and groups of
        // 2, across blocks; windows inside one block, of 1, across block edges, wider
        // than the sequence, with cached keys and grouped heads.
        let cases = [
            (1, None, 2, 4, 7, 7, 4),
            (2, None, 1, 4, 150, 150, 4),
            (3, None, 1, 6, 1, 140, 2),
            (2, Some(4), 1, 2, 9, 9, 4),
            (1, Some(1), 1, 1, 5, 5, 2),
            (2, Some(70), 2, 2, 300, 300, 4),
            (1, Some(200), 1, 1, 150, 150, 2),
            (1, Some(130), 1, 2, 20, 333, 4),
            // Groups of 3 stack 21 positions per product (63 rows): parts end off the blocks.
            (2, None, 2, 6, 150, 150, 4),
            (2, Some(50), 1, 6, 100, 230, 4),
        ];
        for (kv_heads, window, batch, heads, queries, keys, head_dim) in cases {
            let base = dims(batch, heads, queries, keys, head_dim);
            check(
                Dims {
                    kv_heads,
                    window,
                    ..base
                },
                None,
            );
        }
        let padding: Vec<bool> = (0..2 * 140).map(|n| n % 140 < 5).collect();
        let base = dims(2, 2, 140, 140, 4);
        check(
            Dims {
                window: Some(3),
                kv_heads: 1,
                ..base
            },
            Some(padding),
        );
    }

    #[test]
    fn matches_the_formula_with_a_scale_a_softcap_and_sinks() {
        // Groups of 2 across key blocks, a window across a block edge, and sequence 0 left-padded
        // by 3 (its first queries see only padding: with a sink they give the sink all weight).
        let grouped = Dims {
            kv_heads: 2,
            window: Some(70),
            ..dims(2, 4, 140, 140, 8)
        };
        let padding: Vec<bool> = (0..2 * 140).map(|i| i < 3).collect();
        let decoding = Dims {
            kv_heads: 1,
            ..dims(1, 4, 2, 150, 8)
        };
        let sinks = Some(vec![0.5, -1.0, 2.0, 0.0]);
        // Scores reach ±8 here (8 features in [-2, 2)): a cap of 1.5 bends most of them.
        let cases = [
            Scored {
                scale: Some(0.3),
                ..Scored::default()
            },
            Scored {
                softcap: Some(1.5),
                ..Scored::default()
            },
            Scored {
                sinks: sinks.clone(),
                ..Scored::default()
            },
            Scored {
                scale: Some(0.5),
                softcap: Some(2.0),
                sinks,
            },
        ];
        for scored in &cases {
            check_scored(grouped, Some(padding.clone()), scored);
            check_scored(decoding, None, scored);
        }
    }

    #[test]
    fn decoding_splits_the_keys_only_when_the_pairs_leave_threads_idle() {
        let decode = |kv_heads, keys| Dims {
            kv_heads,
            ..dims(1, 12, 1, keys, 64)
        };
        assert_eq!(kv_splits(&decode(12, 16384), 2), 1); // 12 pairs for 2 threads
        assert_eq!(kv_splits(&decode(1, 16384), 2), 4); // about two tasks per thread
        assert_eq!(kv_splits(&decode(3, 16384), 8), 6);
        assert_eq!(kv_splits(&decode(1, 100), 8), 1); // one key block
        assert_eq!(kv_splits(&decode(1, 300), 8), 3); // a block per split at least
    }

    #[test]
    fn keys_are_split_only_when_the_pairs_leave_threads_idle() {
        let base = dims(1, 12, 4096, 4096, 64);
        assert_eq!(key_splits(&base, 2), 1); // 12 pairs for 2 threads
        assert_eq!(key_splits(&base, 16), 3); // 12 pairs, 36 tasks
        let grouped = Dims {
            kv_heads: 3,
            ..base
        };
        assert_eq!(key_splits(&grouped, 16), 11); // 3 pairs, 33 tasks
        let short = Dims {
            keys: 200,
            queries: 200,
            ..grouped
        };
        assert_eq!(key_splits(&short, 16), 2); // no more tasks than key blocks
    }

    /// Decoding's split, one task per (sequence, key/value head), gives bit for bit what one
    /// task per block over all heads gives, whatever the thread count picks.
    #[test]
    fn tasks_per_head_give_what_tasks_per_block_give() {
        for (dims, padding) in [
            (
                Dims {
                    batch: 1,
                    heads: 4,
                    kv_heads: 4,
                    queries: 1,
                    keys: 300,
                    head_dim: 8,
                    window: None,
                },
                false,
            ),
            (
                Dims {
                    batch: 2,
                    heads: 6,
                    kv_heads: 2,
                    queries: 5,
                    keys: 140,
                    head_dim: 4,
                    window: Some(33),
                },
                true,
            ),
            (
                Dims {
                    batch: 1,
                    heads: 2,
                    kv_heads: 1,
                    queries: 64,
                    keys: 64,
                    head_dim: 16,
                    window: None,
                },
                false,
            ),
        ] {
            let [query, key, value] = [1, 2, 3].map(|seed| {
                let len = if seed == 1 {
                    dims.query_len()
                } else {
                    dims.key_len()
                };
                values(len, seed)
                    .into_iter()
                    .map(|x| x as f32)
                    .collect::<Vec<f32>>()
            });
            let padding: Option<Vec<bool>> =
                padding.then(|| (0..dims.batch * dims.keys).map(|i| i % 7 == 3).collect());
            let inputs = Inputs::packed(dims, [&query, &key, &value], padding.as_deref());
            let mut by_head = [
                vec![0.0; dims.query_len()],
                vec![f32::NEG_INFINITY; dims.batch * dims.queries * dims.heads],
            ];
            let [output, log_sum_exp] = &mut by_head;
            forward_by_head(&inputs, 1, output, log_sum_exp);
            let mut by_block = [
                vec![0.0; dims.query_len()],
                vec![f32::NEG_INFINITY; dims.batch * dims.queries * dims.heads],
            ];
            let [output, log_sum_exp] = &mut by_block;
            for ((batch, output), log_sum_exp) in output
                .chunks_mut(dims.queries * dims.width())
                .enumerate()
                .zip(log_sum_exp.chunks_mut(dims.queries * dims.heads))
            {
                forward_block(&inputs, batch, 0, 0..dims.kv_heads, output, log_sum_exp);
            }
            assert_eq!(by_head, by_block, "{dims:?}");
        }
    }

    /// Keys read from the middle of longer rows (a cache's storage) give what the same keys
    /// packed give.
    #[test]
    fn keys_inside_longer_rows_are_read_where_they_lie() {
        let dims = Dims {
            batch: 2,
            heads: 4,
            kv_heads: 2,
            queries: 3,
            keys: 150,
            head_dim: 8,
            window: None,
        };
        let rows = KeyRows {
            first: 5,
            per_sequence: 170,
        };
        let query: Vec<f64> = values(dims.query_len(), 1);
        let stored: Vec<Vec<f64>> = [2, 3]
            .iter()
            .map(|&seed| values(dims.batch * rows.per_sequence * dims.kv_width(), seed))
            .collect();
        let packed: Vec<Vec<f64>> = stored
            .iter()
            .map(|buffer| {
                buffer
                    .chunks(rows.per_sequence * dims.kv_width())
                    .flat_map(|sequence| {
                        &sequence[rows.first * dims.kv_width()
                            ..(rows.first + dims.keys) * dims.kv_width()]
                    })
                    .copied()
                    .collect()
            })
            .collect();
        let from_rows = forward(Inputs {
            dims,
            query: &query,
            key: &stored[0],
            value: &stored[1],
            key_rows: rows,
            key_padding: None,
            scoring: Scoring::plain(dims.head_dim),
        });
        let from_packed = forward(Inputs::packed(dims, [&query, &packed[0], &packed[1]], None));
        assert_eq!(from_rows.output, from_packed.output);
        assert_eq!(from_rows.log_sum_exp, from_packed.log_sum_exp);
    }
}
