//! The forward pass: an online softmax over key blocks, per block of queries (or, decoding,
//! per key/value head and split of the keys).

use ndarray::ArrayView2;
use rayon::prelude::*;

use super::*;
use cpu_linalg::simd::mat_mul;

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
pub(super) fn kv_splits(dims: &Dims, threads: usize) -> usize {
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
pub(super) fn forward_by_head<E: KernelFloat>(
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
pub(super) fn forward_block<E: KernelFloat>(
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
    // A stored cache's blocks, widened to the compute type where a part has more rows than are
    // read in place (none for a cache in the compute type, or for a decoding step's few rows).
    let stored = !matches!(inputs.key, KvBuffer::Float(_));
    let widens = stored && !(E::READS_STORED && most_rows <= STORED_IN_PLACE_ROWS);
    let scratch_len = if widens { KEY_BLOCK * head_dim } else { 0 };
    let (mut key_scratch, mut value_scratch) =
        (vec![E::zero(); scratch_len], vec![E::zero(); scratch_len]);
    for kv_head in kv_heads {
        let first_head = kv_head * group;
        for part in inputs.blocks(batch, rows.clone(), positions) {
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
            // The first row's first key is the part's first: windows and documents only move
            // forward with the rows.
            let visible = inputs.first_visible_key(batch, part.start).max(keys.start)
                ..dims.visible_keys(part.end).min(keys.end);
            // A few rows read a stored block in place; more widen it once for the block products.
            let in_place = stored && E::READS_STORED && stacked <= STORED_IN_PLACE_ROWS;
            for cols in inputs.key_blocks(visible) {
                let pair = (batch, kv_head);
                let (key, key_scales) =
                    inputs.key_block(inputs.key, pair, cols.clone(), &mut key_scratch, in_place);
                let (value, value_scales) = inputs.key_block(
                    inputs.value,
                    pair,
                    cols.clone(),
                    &mut value_scratch,
                    in_place,
                );
                let mut scores = block_matrix(&mut scores_buffer, stacked, cols.len());
                inputs.masked_scores(
                    batch,
                    &query,
                    (&key, key_scales),
                    part.start,
                    cols.clone(),
                    &mut scores,
                );
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
                // The sums above are of the weights; the values' scales join their products.
                if let Some(value_scales) = value_scales {
                    scale_columns(&mut scores, value_scales);
                }
                match value {
                    Block::Floats(value) => mat_mul(E::one(), &scores, &value, E::one(), &mut out),
                    Block::Stored(value) => E::stored_weighted(
                        scores.as_slice().expect("scores are row-major"),
                        value,
                        head_dim,
                        out.as_slice_mut().expect("the output rows are row-major"),
                    ),
                }
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
