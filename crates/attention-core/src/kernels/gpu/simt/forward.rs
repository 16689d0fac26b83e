//! The forward pass, and the combine of a pass whose keys were split (flash-decoding).

use cubecl::prelude::*;

use super::{
    Geometry, KeySource, KeyTile, RowsVector, Tiling, UNIT_ROWS, accumulate, in_view, is_visible,
    masked, position_of, scored, store_columns, tile_dots,
};

/// The forward pass: `output` and the per-row log-sum-exp.
///
/// Cube `(x, y, z)`: block `blocks − 1 − x / splits` of the key/value head's (query, query head)
/// pairs (the last, heaviest blocks first) and key split `x % splits`; key/value head `y`;
/// sequence `z`. `O` is the output's float type: the input's, or `f32` for split partials.
///
/// # Shapes
/// - `query`: `[batch, queries, heads · head_dim]`
/// - `key`, `value`: `[batch, key_rows, kv_heads · head_dim]`, the call's keys at rows
///   `key_first ..`
/// - `key_padding`: `[batch, keys]`, `1` = padding (read when `geometry.padded`)
/// - `sinks`: `[heads]` (read when `geometry.with_sinks`)
/// - `output`: `[splits, batch, queries, heads · head_dim]`, each split's output normalized over
///   its own keys
/// - `lse`: `[splits, batch, queries, heads]`, [`masked`] for a row that sees nothing
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn flash_forward<F: Float, O: Float, N: Size>(
    query: &Tensor<Vector<F, N>>,
    key: &Tensor<Vector<F, N>>,
    value: &Tensor<Vector<F, N>>,
    key_padding: &Tensor<F>,
    sinks: &Tensor<F>,
    output: &mut Tensor<Vector<O, N>>,
    lse: &mut Tensor<f32>,
    geometry: Geometry,
    #[comptime] tiling: Tiling,
    #[define(F, O)] _dtypes: [StorageType; 2],
) {
    let n = N::value().comptime() as u32;
    let lanes = comptime!(tiling.lanes);
    let block = comptime!(tiling.block);
    let tile = comptime!(tiling.tile);
    let units = comptime!(tiling.units());
    let vectors = comptime!(tiling.width / n);
    let stride = comptime!(vectors + 1);
    let cols = comptime!(tiling.tile / tiling.lanes);
    let out_vectors = comptime!(tiling.width / n / tiling.lanes);
    let groups = comptime!(tiling.block / UNIT_ROWS);

    let lane = UNIT_POS_X % lanes;
    let row_group = UNIT_POS_X / lanes;
    let kv_head = CUBE_POS_Y;
    let batch = CUBE_POS_Z;
    let group = geometry.heads / geometry.kv_heads;
    let pairs = geometry.queries * group;
    let blocks = pairs.div_ceil(block);
    let split = CUBE_POS_X % geometry.splits;
    let first_pair = (blocks - 1 - CUBE_POS_X / geometry.splits) * block;
    let end_pair = min(first_pair + block, pairs);
    let offset = geometry.keys - geometry.queries;
    let first_position = first_pair / group + offset;
    let last_position = (end_pair - 1) / group + offset;
    let head_vectors = geometry.head_dim / n;
    let row_vectors = geometry.heads * head_vectors;

    // The block's query rows, each pair's own head.
    let mut queries = SharedMemory::<Vector<F, N>>::new(comptime!((block * stride) as usize));
    let mut at = UNIT_POS_X;
    while at < comptime!(block * vectors) {
        let row = at / vectors;
        let vector = at % vectors;
        let pair = first_pair + row;
        let mut x = Vector::<F, N>::new(F::new(0.0));
        if pair < end_pair && vector < head_vectors {
            let head = kv_head * group + pair % group;
            let query_row = batch * geometry.queries + pair / group;
            x = query[(query_row * row_vectors + head * head_vectors + vector) as usize];
        }
        queries[(row * stride + vector) as usize] = x;
        at += units;
    }

    // The keys this block sees: up to the last pair's position, from the first one's window
    // start; a split's own keys only.
    let mut key_start = 0u32;
    if geometry.window > 0 && first_position + 1 > geometry.window {
        key_start = first_position + 1 - geometry.window;
    }
    let mut key_end = last_position + 1;
    if geometry.splits > 1 {
        let split_start = split * geometry.split_len;
        key_start = max(key_start, split_start);
        key_end = min(key_end, split_start + geometry.split_len);
    }

    // The key/value tile: the keys and values the block's queries meet in turn.
    let mut kv = KeyTile::<F, N>::new(tiling);
    let mut weights = SharedMemory::<RowsVector>::new(comptime!((tile * groups) as usize));
    let mut across_lanes = SharedMemory::<f32>::new(comptime!((block * lanes) as usize));

    let mut scores = Array::<f32>::new(comptime!((UNIT_ROWS * cols) as usize));
    let mut acc = Array::<Vector<f32, N>>::new(comptime!((UNIT_ROWS * out_vectors) as usize));
    let mut row_max = Array::<f32>::new(comptime!(UNIT_ROWS as usize));
    // This lane's share of each row's sum.
    let mut row_sum = Array::<f32>::new(comptime!(UNIT_ROWS as usize));
    #[unroll]
    for i in 0..UNIT_ROWS {
        row_max[i as usize] = masked();
        row_sum[i as usize] = 0.0;
        #[unroll]
        for m in 0..out_vectors {
            acc[(i * out_vectors + m) as usize] = Vector::<f32, N>::new(0.0);
        }
    }

    let key_source = KeySource::new(&geometry, batch, kv_head);
    let mut start = key_start;
    while start < key_end {
        kv.load(key, value, key_padding, &key_source, start, key_end, tiling);
        sync_cube();

        // Scores: the unit's rows against its keys `lane + j · lanes`.
        tile_dots::<F, N>(&queries, &kv.keys, &mut scores, row_group, lane, tiling);

        // Masks on an edge tile only; each row's maximum over its lanes.
        let full = geometry.padded == 0
            && start + tile <= key_end
            && start + tile <= first_position + 1
            && (geometry.window == 0 || last_position < start + geometry.window);
        #[unroll]
        for i in 0..UNIT_ROWS {
            let mut most = masked();
            #[unroll]
            for j in 0..cols {
                let (scaled, _) = scored(scores[(i * cols + j) as usize], &geometry);
                let mut score = scaled;
                if !full {
                    let column = lane + j * lanes;
                    let key_index = start + column;
                    let mut visible = key_index < key_end
                        && in_view(
                            key_index,
                            position_of(first_pair, row_group, i, group, offset),
                            &geometry,
                        );
                    if geometry.padded == 1 {
                        visible = visible && kv.padding[column as usize] < 0.5;
                    }
                    score = select(visible, score, masked());
                }
                scores[(i * cols + j) as usize] = score;
                most = max(most, score);
            }
            across_lanes[((row_group * UNIT_ROWS + i) * lanes + lane) as usize] = most;
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
                    across_lanes[((row_group * UNIT_ROWS + i) * lanes + other) as usize],
                );
            }
            let new_max = max(row_max[i as usize], most);
            let correction = f32::exp(row_max[i as usize] - new_max);
            row_max[i as usize] = new_max;
            let mut sum = row_sum[i as usize] * correction;
            #[unroll]
            for m in 0..out_vectors {
                let at = (i * out_vectors + m) as usize;
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
        store_columns(&scores, &mut weights, row_group, lane, tiling);
        sync_cube();

        // The weighted sum: the unit's rows × its vectors of the head.
        accumulate::<F, N>(&weights, &kv.values, &mut acc, row_group, lane, tiling);
        sync_cube();
        start += tile;
    }

    // Each row's sum over its lanes, then the sink and the normalised output.
    #[unroll]
    for i in 0..UNIT_ROWS {
        across_lanes[((row_group * UNIT_ROWS + i) * lanes + lane) as usize] = row_sum[i as usize];
    }
    sync_cube();
    #[unroll]
    for i in 0..UNIT_ROWS {
        let mut sum = 0.0f32;
        #[unroll]
        for other in 0..lanes {
            sum += across_lanes[((row_group * UNIT_ROWS + i) * lanes + other) as usize];
        }
        let pair = first_pair + row_group * UNIT_ROWS + i;
        if pair < end_pair {
            let head = kv_head * group + pair % group;
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
            let out_row = (split * CUBE_COUNT_Z + batch) * geometry.queries + pair / group;
            let out_at = out_row * row_vectors + head * head_vectors;
            #[unroll]
            for m in 0..out_vectors {
                let column = lane + m * lanes;
                if column < head_vectors {
                    let at = (i * out_vectors + m) as usize;
                    output[(out_at + column) as usize] =
                        Vector::<O, N>::cast_from(acc[at] * Vector::<f32, N>::new(inverse));
                }
            }
            if lane == 0 {
                let lse_at = (out_row * geometry.heads + head) as usize;
                lse[lse_at] = select(seen, most + f32::ln(sum), masked());
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
/// `lse` is the log-sum-exp over all splits. A split that saw no key has `lse_s` = [`masked`] and
/// weight 0; a row no split saw gets output 0 and `lse` [`masked`]. One unit per row and vector.
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
            let weight = select(is_visible(part), f32::exp(part - most), 0.0);
            total += weight;
            let from = (split * sizes.rows + row) * sizes.head_vectors + vector;
            sum += partial[from as usize] * Vector::<f32, N>::new(weight);
        }
        let seen = total > 0.0;
        let inverse = select(seen, 1.0 / total, 0.0);
        output[at as usize] = Vector::<F, N>::cast_from(sum * Vector::<f32, N>::new(inverse));
        if vector == 0 {
            lse[row as usize] = select(seen, most + f32::ln(total), masked());
        }
    }
}
