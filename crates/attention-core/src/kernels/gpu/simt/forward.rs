//! The forward pass, and the combine of a pass whose keys were split (flash-decoding).

use cubecl::prelude::*;

use super::{
    Geometry, KeySource, KeyTile, PairBlock, RowsVector, Tiling, UNIT_ROWS, Unit, WORK_COLUMNS,
    accumulate_tile, is_visible, load_pairs, masked, scored, store_row, tile_dots, unit_scores,
    zeroed_rows,
};

/// The forward pass: `output` and the per-row log-sum-exp.
///
/// Cube `(x, y, z)`: block `blocks − 1 − x / splits` of the key/value head's (query, query head)
/// pairs (the last, heaviest blocks first) and key split `x % splits`; key/value head `y`;
/// sequence `z`; in a ragged step, cube `(x, y)` does row `x` of the work list for key/value head
/// `y`. `O` is the output's float type: the input's, or `f32` for split partials.
///
/// # Shapes
/// - `query`: `[batch, queries, heads · head_dim]`
/// - `key`, `value`: `[batch, key_rows, kv_heads · head_dim]`, the call's keys at rows
///   `key_first ..`, in `S`: the query's type `F`, or a cache's narrower float type
/// - `key_words`, `value_words`, `key_scales`, `value_scales`: with `int8`, the keys and values
///   instead, an int8 cache's `[batch, key_rows, kv_heads · ⌈head_dim / 4⌉]` words and `[batch,
///   key_rows, kv_heads]` scales (see [`super::int8_vector`]; `key` and `value` are not read)
/// - `key_padding`: `[batch, keys]`, `1` = padding (read when `geometry.padded`)
/// - `documents`: `[batch, keys, 2]`, each position's document (read when `geometry.packed`)
/// - `tables`: a ragged step's `[batch, table_len]` (each sequence's first query row, queries,
///   keys, then page ids; read when `geometry.page_size > 0`): then `query` is `[1, tokens,
///   heads · head_dim]`, every sequence's queries one after another, `key` and `value` a page
///   pool `[1, pages · page_size, kv_heads · head_dim]`, and `output` and `lse` have `tokens`
///   rows per split
/// - `work`: a ragged step's `[cubes, WORK_COLUMNS]`, each cube's sequence, block of its pairs,
///   split of its keys and count of splits (read when `geometry.page_size > 0`)
/// - `sinks`: `[heads]` (read when `geometry.with_sinks`)
/// - `output`: `[splits, batch, queries, heads · head_dim]`, each split's output normalized over
///   its own keys
/// - `lse`: `[splits, batch, queries, heads]`, [`masked`] for a row that sees nothing
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn flash_forward<F: Float, O: Float, S: Float, N: Size>(
    query: &Tensor<Vector<F, N>>,
    key: &Tensor<Vector<S, N>>,
    value: &Tensor<Vector<S, N>>,
    key_words: &Tensor<u32>,
    value_words: &Tensor<u32>,
    key_scales: &Tensor<f32>,
    value_scales: &Tensor<f32>,
    key_padding: &Tensor<F>,
    documents: &Tensor<f32>,
    tables: &Tensor<u32>,
    work: &Tensor<u32>,
    sinks: &Tensor<F>,
    output: &mut Tensor<Vector<O, N>>,
    lse: &mut Tensor<f32>,
    geometry: Geometry,
    #[comptime] tiling: Tiling,
    #[comptime] int8: bool,
    #[define(F, O, S)] _dtypes: [StorageType; 3],
) {
    let n = N::value().comptime() as u32;
    let sizes = comptime!(tiling.sizes(n));
    // Each split's outputs are rows of all of the call's queries.
    let mut split_rows = CUBE_COUNT_Z * geometry.queries;
    let mut geometry = geometry;
    let mut sequence = CUBE_POS_Z;
    let mut query_base = CUBE_POS_Z * geometry.queries;
    let mut from_last = CUBE_POS_X / geometry.splits;
    let mut split = CUBE_POS_X % geometry.splits;
    // The splits of this cube's sequence: the launch's, but in a ragged step.
    let mut own_splits = geometry.splits;
    if geometry.page_size > 0 {
        // A ragged step: the work list names this cube's sequence, block and split; the
        // sequence's queries and keys lead its row of the tables, and the launch's `queries`
        // counts every sequence's together.
        let item = CUBE_POS_X * WORK_COLUMNS;
        sequence = work[item as usize];
        let row = sequence * geometry.table_len;
        split_rows = geometry.queries;
        query_base = tables[row as usize];
        geometry.queries = tables[(row + 1) as usize];
        geometry.keys = tables[(row + 2) as usize];
        split = work[(item + 2) as usize];
        own_splits = work[(item + 3) as usize];
        geometry.split_len = geometry.keys.div_ceil(own_splits);
        let pairs = geometry.queries * (geometry.heads / geometry.kv_heads);
        from_last = pairs.div_ceil(sizes.block) - 1 - work[(item + 1) as usize];
    }
    let mut unit = Unit::new(&geometry, sizes);
    unit.batch = sequence;
    unit.query_base = query_base;
    let block = PairBlock::new(from_last, documents, &unit, &geometry, sizes.block);
    let first_keys = block.document_starts(documents, &unit, &geometry);
    let (lanes, cols) = comptime!((sizes.lanes, sizes.cols));

    // The block's query rows.
    let mut queries =
        SharedMemory::<Vector<F, N>>::new(comptime!((sizes.block * sizes.stride) as usize));
    load_pairs::<F, N>(query, &mut queries, &block, &unit, sizes);

    // A split's own keys only.
    let mut key_start = block.key_start;
    let mut key_end = block.key_end;
    if own_splits > 1 {
        let split_start = split * geometry.split_len;
        key_start = max(key_start, split_start);
        key_end = min(key_end, split_start + geometry.split_len);
    }

    // The key/value tile: the keys and values the block's queries meet in turn.
    let mut kv = KeyTile::<F, N>::new(sizes);
    let mut weights =
        SharedMemory::<RowsVector>::new(comptime!((sizes.tile * sizes.groups) as usize));
    let mut across_lanes =
        SharedMemory::<f32>::new(comptime!((sizes.block * sizes.lanes) as usize));

    let mut scores = unit_scores(sizes);
    let mut acc = zeroed_rows::<N>(sizes);
    let mut row_max = Array::<f32>::new(comptime!(UNIT_ROWS as usize));
    // This lane's share of each row's sum.
    let mut row_sum = Array::<f32>::new(comptime!(UNIT_ROWS as usize));
    #[unroll]
    for i in 0..UNIT_ROWS {
        row_max[i as usize] = masked();
        row_sum[i as usize] = 0.0;
    }

    let key_source = KeySource::new(&geometry, &unit);
    let mut start = key_start;
    while start < key_end {
        // One compiled loop per row mapping: a table lookup in the dense loop costs registers.
        if geometry.page_size > 0 {
            kv.load_stored::<S>(
                key,
                value,
                key_words,
                value_words,
                key_scales,
                value_scales,
                key_padding,
                tables,
                &key_source,
                start,
                key_end,
                sizes,
                int8,
                true,
            );
        } else {
            kv.load_stored::<S>(
                key,
                value,
                key_words,
                value_words,
                key_scales,
                value_scales,
                key_padding,
                tables,
                &key_source,
                start,
                key_end,
                sizes,
                int8,
                false,
            );
        }
        sync_cube();

        // Scores: the unit's rows against its keys `lane + j · lanes`.
        tile_dots::<F, N>(&queries, &kv.keys, &mut scores, &unit, sizes);

        // Masks on an edge tile only; each row's maximum over its lanes.
        let full = block.sees_whole_tile(start, key_end, &geometry, sizes.tile);
        #[unroll]
        for i in 0..UNIT_ROWS {
            let mut most = masked();
            #[unroll]
            for j in 0..cols {
                let (scaled, _) = scored(scores[(i * cols + j) as usize], &geometry);
                let mut score = scaled;
                if !full {
                    let column = unit.lane + j * lanes;
                    let position = block.position(&unit, i);
                    let first_key = first_keys[i as usize];
                    let visible = kv.sees(column, start, key_end, position, first_key, &geometry);
                    score = select(visible, score, masked());
                }
                scores[(i * cols + j) as usize] = score;
                most = max(most, score);
            }
            across_lanes[((unit.row_group * UNIT_ROWS + i) * lanes + unit.lane) as usize] = most;
        }
        sync_cube();

        // The online softmax: new maxima, rescaled sums and accumulators, this tile's weights.
        #[unroll]
        for i in 0..UNIT_ROWS {
            let mut most = masked();
            #[unroll]
            for other in 0..lanes {
                most = max(
                    most,
                    across_lanes[((unit.row_group * UNIT_ROWS + i) * lanes + other) as usize],
                );
            }
            let new_max = max(row_max[i as usize], most);
            let correction = f32::exp(row_max[i as usize] - new_max);
            row_max[i as usize] = new_max;
            let mut sum = row_sum[i as usize] * correction;
            #[unroll]
            for m in 0..sizes.out_vectors {
                let at = (i * sizes.out_vectors + m) as usize;
                acc[at] = acc[at] * Vector::<f32, N>::new(correction);
            }
            #[unroll]
            for j in 0..cols {
                let score = scores[(i * cols + j) as usize];
                let weight = select(is_visible(score), f32::exp(score - new_max), 0.0);
                sum += weight;
                scores[(i * cols + j) as usize] = weight;
            }
            row_sum[i as usize] = sum;
        }

        // The weighted sum: the unit's rows × its vectors of the head.
        accumulate_tile::<F, N>(&scores, &mut weights, &kv.values, &mut acc, &unit, sizes);
        start += sizes.tile;
    }

    // Each row's sum over its lanes, then the sink and the normalised output.
    #[unroll]
    for i in 0..UNIT_ROWS {
        across_lanes[((unit.row_group * UNIT_ROWS + i) * lanes + unit.lane) as usize] =
            row_sum[i as usize];
    }
    sync_cube();
    #[unroll]
    for i in 0..UNIT_ROWS {
        let mut sum = 0.0f32;
        #[unroll]
        for other in 0..lanes {
            sum += across_lanes[((unit.row_group * UNIT_ROWS + i) * lanes + other) as usize];
        }
        let pair = block.pair(&unit, i);
        if pair < block.end_pair {
            let head = unit.head(pair);
            let mut most = row_max[i as usize];
            let mut rescale = 1.0f32;
            if geometry.with_sinks == 1 && split == 0 {
                let sink = f32::cast_from(sinks[head as usize]);
                let new_max = max(most, sink);
                rescale = f32::exp(most - new_max);
                sum = sum * rescale + f32::exp(sink - new_max);
                most = new_max;
            }
            let seen = sum > 0.0;
            let inverse = select(seen, rescale / sum, 0.0);
            // A split's partial results are the `split`-th of `splits` stacked outputs.
            let out_row = split * split_rows + unit.query_row(pair);
            let out_at = out_row * unit.row_vectors + head * unit.head_vectors;
            store_row::<O, N>(output, &acc, inverse, out_at, &unit, i, sizes);
            if unit.lane == 0 {
                let lse_at = (out_row * geometry.heads + head) as usize;
                lse[lse_at] = select(seen, most + f32::ln(sum), masked());
                // The launch's splits past the sequence's own have no cube: the first split
                // marks them empty for the combine.
                if split == 0 {
                    for unused in own_splits..geometry.splits {
                        let row = unused * split_rows + unit.query_row(pair);
                        lse[(row * geometry.heads + head) as usize] = masked();
                    }
                }
            }
        }
    }
}

/// The sizes of a combine.
#[derive(CubeType, CubeLaunch, Clone, Copy)]
pub struct Splits {
    /// Rows, `batch · queries · heads`, each `head_vectors` vectors wide.
    pub rows: u32,
    pub head_vectors: u32,
    pub splits: u32,
}

/// Flash-decoding's combine: each row's split outputs weighted by `exp(lse_s − lse)`, where
/// `lse` is the log-sum-exp over all splits. A split that saw no key (or that the row's sequence
/// does not have) has `lse_s` = [`masked`] and is not read; a row no split saw gets output 0 and
/// `lse` [`masked`]. One unit per row and vector.
///
/// # Shapes
/// - `partial`: `[splits, rows · head_vectors]` vectors (`f32`); `partial_lse`: `[splits, rows]`
/// - `output`: `[rows · head_vectors]` vectors; `lse`: `[rows]`
#[cube(launch)]
pub fn flash_combine<F: Float, N: Size>(
    partial: &Tensor<Vector<f32, N>>,
    partial_lse: &Tensor<f32>,
    output: &mut Tensor<Vector<F, N>>,
    lse: &mut Tensor<f32>,
    sizes: Splits,
    #[define(F)] _dtype: StorageType,
) {
    let at = CUBE_POS_X * CUBE_DIM_X + UNIT_POS_X;
    if at < sizes.rows * sizes.head_vectors {
        let row = at / sizes.head_vectors;
        let vector = at % sizes.head_vectors;
        let mut most = masked();
        for split in 0..sizes.splits {
            most = max(most, partial_lse[(split * sizes.rows + row) as usize]);
        }
        let mut total = 0.0f32;
        let mut sum = Vector::<f32, N>::new(0.0);
        for split in 0..sizes.splits {
            let part = partial_lse[(split * sizes.rows + row) as usize];
            // An empty split's partial output may never have been written: it is not read.
            if is_visible(part) {
                let weight = f32::exp(part - most);
                total += weight;
                let from = (split * sizes.rows + row) * sizes.head_vectors + vector;
                sum += partial[from as usize] * Vector::<f32, N>::new(weight);
            }
        }
        let seen = total > 0.0;
        let inverse = select(seen, 1.0 / total, 0.0);
        output[at as usize] = Vector::<F, N>::cast_from(sum * Vector::<f32, N>::new(inverse));
        if vector == 0 {
            lse[row as usize] = select(seen, most + f32::ln(total), masked());
        }
    }
}
