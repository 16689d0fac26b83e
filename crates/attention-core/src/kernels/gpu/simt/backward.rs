//! The backward pass: the query gradient per block of queries, the key and value gradients per
//! block of keys, each tile's weights recomputed from the forward pass's log-sum-exp — `O(seq)`
//! memory and no float atomics.
//!
//! With `Pᵢⱼ = exp(sᵢⱼ − lseᵢ)` and `Dᵢ = dOᵢ · Oᵢ`: `dSᵢⱼ = Pᵢⱼ (dOᵢ · vⱼ − Dᵢ)` (times
//! `1 − tanh²` under a soft-cap), `dQᵢ = scale · Σⱼ dSᵢⱼ kⱼ`, `dKⱼ = scale · Σᵢ dSᵢⱼ qᵢ`,
//! `dVⱼ = Σᵢ Pᵢⱼ dOᵢ`.

use cubecl::prelude::*;

use super::{
    Geometry, HeadRows, KeySource, KeyTile, RowsVector, Tiling, UNIT_ROWS, accumulate, in_view,
    is_visible, load_rows, masked, position_of, scored, store_columns, tile_dots,
};

/// The query gradient.
///
/// Cube `(x, y, z)`: block `blocks − 1 − x` of the key/value head's (query, query head) pairs
/// (as the forward pass's), key/value head `y`, sequence `z`.
///
/// # Shapes
/// - `query`, `output_grad`, `query_grad`: `[batch, queries, heads · head_dim]`
/// - `key`, `value`: `[batch, keys, kv_heads · head_dim]`
/// - `key_padding`: `[batch, keys]` (read when `geometry.padded`)
/// - `lse`, `delta` (`Dᵢ = dOᵢ · Oᵢ`): `[batch, queries, heads]`
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn flash_query_grad<F: Float, N: Size>(
    query: &Tensor<Vector<F, N>>,
    key: &Tensor<Vector<F, N>>,
    value: &Tensor<Vector<F, N>>,
    key_padding: &Tensor<F>,
    output_grad: &Tensor<Vector<F, N>>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    query_grad: &mut Tensor<Vector<F, N>>,
    geometry: Geometry,
    #[comptime] tiling: Tiling,
    #[define(F)] _dtype: StorageType,
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
    let first_pair = (blocks - 1 - CUBE_POS_X) * block;
    let end_pair = min(first_pair + block, pairs);
    let offset = geometry.keys - geometry.queries;
    let first_position = first_pair / group + offset;
    let last_position = (end_pair - 1) / group + offset;
    let head_vectors = geometry.head_dim / n;
    let row_vectors = geometry.heads * head_vectors;

    // The block's queries and output gradients, each pair's own head.
    let mut queries = SharedMemory::<Vector<F, N>>::new(comptime!((block * stride) as usize));
    let mut d_outs = SharedMemory::<Vector<F, N>>::new(comptime!((block * stride) as usize));
    let mut at = UNIT_POS_X;
    while at < comptime!(block * vectors) {
        let row = at / vectors;
        let vector = at % vectors;
        let pair = first_pair + row;
        let mut x = Vector::<F, N>::new(F::new(0.0));
        let mut d_out = Vector::<F, N>::new(F::new(0.0));
        if pair < end_pair && vector < head_vectors {
            let head = kv_head * group + pair % group;
            let query_row = batch * geometry.queries + pair / group;
            let from = (query_row * row_vectors + head * head_vectors + vector) as usize;
            x = query[from];
            d_out = output_grad[from];
        }
        queries[(row * stride + vector) as usize] = x;
        d_outs[(row * stride + vector) as usize] = d_out;
        at += units;
    }

    // This unit's rows: log-sum-exps and `D`s (rows past the last pair: a masked log-sum-exp, so
    // that they weigh nothing). Their positions are computed where a mask needs them, in edge
    // tiles only: a register less each.
    let mut row_lse = Array::<f32>::new(comptime!(UNIT_ROWS as usize));
    let mut row_delta = Array::<f32>::new(comptime!(UNIT_ROWS as usize));
    #[unroll]
    for i in 0..UNIT_ROWS {
        let pair = first_pair + row_group * UNIT_ROWS + i;
        let mut l = masked();
        let mut d = 0.0f32;
        if pair < end_pair {
            let head = kv_head * group + pair % group;
            let at = ((batch * geometry.queries + pair / group) * geometry.heads + head) as usize;
            l = lse[at];
            d = delta[at];
        }
        row_lse[i as usize] = l;
        row_delta[i as usize] = d;
    }

    let mut key_start = 0u32;
    if geometry.window > 0 && first_position + 1 > geometry.window {
        key_start = first_position + 1 - geometry.window;
    }
    let key_end = last_position + 1;

    // The key/value tile: the keys and values the block's queries meet in turn.
    let mut kv = KeyTile::<F, N>::new(tiling);
    let mut d_scores = SharedMemory::<RowsVector>::new(comptime!((tile * groups) as usize));

    let mut scores = Array::<f32>::new(comptime!((UNIT_ROWS * cols) as usize));
    let mut d_weights = Array::<f32>::new(comptime!((UNIT_ROWS * cols) as usize));
    let mut acc = Array::<Vector<f32, N>>::new(comptime!((UNIT_ROWS * out_vectors) as usize));
    #[unroll]
    for x in 0..comptime!(UNIT_ROWS * out_vectors) {
        acc[x as usize] = Vector::<f32, N>::new(0.0);
    }

    let key_source = KeySource::new(&geometry, batch, kv_head);
    let mut start = key_start;
    while start < key_end {
        kv.load(key, value, key_padding, &key_source, start, key_end, tiling);
        sync_cube();

        // Scores and `dOᵢ · vⱼ` for the unit's rows and its keys `lane + j · lanes`.
        tile_dots::<F, N>(&queries, &kv.keys, &mut scores, row_group, lane, tiling);
        tile_dots::<F, N>(&d_outs, &kv.values, &mut d_weights, row_group, lane, tiling);

        let full = geometry.padded == 0
            && start + tile <= key_end
            && start + tile <= first_position + 1
            && (geometry.window == 0 || last_position < start + geometry.window);
        #[unroll]
        for j in 0..cols {
            let column = lane + j * lanes;
            let key_index = start + column;
            #[unroll]
            for i in 0..UNIT_ROWS {
                let at = (i * cols + j) as usize;
                let (score, tanh) = scored(scores[at], &geometry);
                let mut visible = is_visible(row_lse[i as usize]);
                if !full {
                    visible = visible
                        && key_index < key_end
                        && in_view(
                            key_index,
                            position_of(first_pair, row_group, i, group, offset),
                            &geometry,
                        );
                    if geometry.padded == 1 {
                        visible = visible && kv.padding[column as usize] < 0.5;
                    }
                }
                let weight = select(visible, f32::exp(score - row_lse[i as usize]), 0.0);
                let mut d_score = weight * (d_weights[at] - row_delta[i as usize]);
                if geometry.softcap > 0.0 {
                    d_score *= 1.0 - tanh * tanh;
                }
                scores[at] = d_score;
            }
        }
        store_columns(&scores, &mut d_scores, row_group, lane, tiling);
        sync_cube();

        accumulate::<F, N>(&d_scores, &kv.keys, &mut acc, row_group, lane, tiling);
        sync_cube();
        start += tile;
    }

    #[unroll]
    for i in 0..UNIT_ROWS {
        let pair = first_pair + row_group * UNIT_ROWS + i;
        if pair < end_pair {
            let head = kv_head * group + pair % group;
            let query_row = batch * geometry.queries + pair / group;
            let out_at = query_row * row_vectors + head * head_vectors;
            #[unroll]
            for m in 0..out_vectors {
                let column = lane + m * lanes;
                if column < head_vectors {
                    let at = (i * out_vectors + m) as usize;
                    query_grad[(out_at + column) as usize] =
                        Vector::<F, N>::cast_from(acc[at] * Vector::<f32, N>::new(geometry.scale));
                }
            }
        }
    }
}

/// The key and value gradients of one key/value head, its group's query heads summed.
///
/// Cube `(x, y, z)`: block `x` of keys (the first, most seen, first), key/value head `y`,
/// sequence `z`. The block's keys and values stay in shared memory; each query head of the group
/// streams its queries, output gradients, log-sum-exps and `D`s by in tiles.
///
/// # Shapes
/// - `query`, `output_grad`: `[batch, queries, heads · head_dim]`
/// - `key`, `value`, `key_grad`, `value_grad`: `[batch, keys, kv_heads · head_dim]`
/// - `key_padding`: `[batch, keys]` (read when `geometry.padded`)
/// - `lse`, `delta`: `[batch, queries, heads]`
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn flash_key_value_grad<F: Float, N: Size>(
    query: &Tensor<Vector<F, N>>,
    key: &Tensor<Vector<F, N>>,
    value: &Tensor<Vector<F, N>>,
    key_padding: &Tensor<F>,
    output_grad: &Tensor<Vector<F, N>>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    key_grad: &mut Tensor<Vector<F, N>>,
    value_grad: &mut Tensor<Vector<F, N>>,
    geometry: Geometry,
    #[comptime] tiling: Tiling,
    #[define(F)] _dtype: StorageType,
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
    let offset = geometry.keys - geometry.queries;
    let first_key = CUBE_POS_X * block;
    let last_key = min(first_key + block, geometry.keys) - 1;
    let head_vectors = geometry.head_dim / n;
    let row_vectors = geometry.heads * head_vectors;
    let kv_row_vectors = geometry.kv_heads * head_vectors;

    let mut keys = SharedMemory::<Vector<F, N>>::new(comptime!((block * stride) as usize));
    let mut values = SharedMemory::<Vector<F, N>>::new(comptime!((block * stride) as usize));
    let key_first = batch * geometry.key_rows + geometry.key_first;
    let kv_column = kv_head * head_vectors;
    let count = last_key + 1 - first_key;
    let from = HeadRows {
        first_row: key_first + first_key,
        count,
        row_vectors: kv_row_vectors,
        column: kv_column,
        head_vectors,
    };
    load_rows::<F, N>(key, &mut keys, &from, block, tiling.width, units);
    load_rows::<F, N>(value, &mut values, &from, block, tiling.width, units);

    // This unit's keys: their indices and whether they are padding.
    let mut key_index = Array::<u32>::new(comptime!(UNIT_ROWS as usize));
    let mut key_padded = Array::<u32>::new(comptime!(UNIT_ROWS as usize));
    #[unroll]
    for i in 0..UNIT_ROWS {
        let index = first_key + row_group * UNIT_ROWS + i;
        key_index[i as usize] = index;
        let mut padded = 0u32;
        if geometry.padded == 1 && index < geometry.keys {
            let flag = f32::cast_from(key_padding[(batch * geometry.keys + index) as usize]);
            padded = select(flag > 0.5, 1u32, 0u32);
        }
        key_padded[i as usize] = padded;
    }

    // The queries that see some key of this block: from the first key's position on, until the
    // last key leaves their window.
    let mut query_start = 0u32;
    if first_key > offset {
        query_start = first_key - offset;
    }
    let mut query_end = geometry.queries;
    if geometry.window > 0 {
        let reach = last_key + geometry.window;
        query_end = select(reach > offset, min(query_end, reach - offset), 0u32);
    }

    let mut queries = SharedMemory::<Vector<F, N>>::new(comptime!((tile * stride) as usize));
    let mut d_outs = SharedMemory::<Vector<F, N>>::new(comptime!((tile * stride) as usize));
    let mut lses = SharedMemory::<f32>::new(comptime!(tile as usize));
    let mut deltas = SharedMemory::<f32>::new(comptime!(tile as usize));
    let mut weights = SharedMemory::<RowsVector>::new(comptime!((tile * groups) as usize));
    let mut d_scores = SharedMemory::<RowsVector>::new(comptime!((tile * groups) as usize));

    let mut scores = Array::<f32>::new(comptime!((UNIT_ROWS * cols) as usize));
    let mut d_weights = Array::<f32>::new(comptime!((UNIT_ROWS * cols) as usize));
    let mut d_key = Array::<Vector<f32, N>>::new(comptime!((UNIT_ROWS * out_vectors) as usize));
    let mut d_value = Array::<Vector<f32, N>>::new(comptime!((UNIT_ROWS * out_vectors) as usize));
    #[unroll]
    for x in 0..comptime!(UNIT_ROWS * out_vectors) {
        d_key[x as usize] = Vector::<f32, N>::new(0.0);
        d_value[x as usize] = Vector::<f32, N>::new(0.0);
    }

    let query_first = batch * geometry.queries;
    for member in 0..group {
        let head = kv_head * group + member;
        let column = head * head_vectors;
        let mut start = query_start;
        while start < query_end {
            let count = min(tile, query_end - start);
            let from = HeadRows {
                first_row: query_first + start,
                count,
                row_vectors,
                column,
                head_vectors,
            };
            load_rows::<F, N>(query, &mut queries, &from, tile, tiling.width, units);
            load_rows::<F, N>(output_grad, &mut d_outs, &from, tile, tiling.width, units);
            let mut at = UNIT_POS_X;
            while at < tile {
                let mut l = masked();
                let mut d = 0.0f32;
                if at < count {
                    let from = ((query_first + start + at) * geometry.heads + head) as usize;
                    l = lse[from];
                    d = delta[from];
                }
                lses[at as usize] = l;
                deltas[at as usize] = d;
                at += units;
            }
            sync_cube();

            // Scores and `dOⱼ · vᵢ` for the unit's keys and its queries `lane + j · lanes`.
            tile_dots::<F, N>(&keys, &queries, &mut scores, row_group, lane, tiling);
            tile_dots::<F, N>(&values, &d_outs, &mut d_weights, row_group, lane, tiling);

            let full = geometry.padded == 0
                && start + tile <= query_end
                && first_key + block <= geometry.keys
                && start + offset >= first_key + block - 1
                && (geometry.window == 0
                    || start + tile - 1 + offset < first_key + geometry.window);
            #[unroll]
            for j in 0..cols {
                let column = lane + j * lanes;
                let query_index = start + column;
                let row_lse = lses[column as usize];
                let row_delta = deltas[column as usize];
                #[unroll]
                for i in 0..UNIT_ROWS {
                    let at = (i * cols + j) as usize;
                    let (score, tanh) = scored(scores[at], &geometry);
                    let mut visible = true;
                    if !full {
                        visible = query_index < query_end
                            && key_padded[i as usize] == 0
                            && in_view(key_index[i as usize], query_index + offset, &geometry);
                    }
                    let weight = select(visible, f32::exp(score - row_lse), 0.0);
                    let mut d_score = weight * (d_weights[at] - row_delta);
                    if geometry.softcap > 0.0 {
                        d_score *= 1.0 - tanh * tanh;
                    }
                    scores[at] = weight;
                    d_weights[at] = d_score;
                }
            }
            store_columns(&scores, &mut weights, row_group, lane, tiling);
            store_columns(&d_weights, &mut d_scores, row_group, lane, tiling);
            sync_cube();

            accumulate::<F, N>(&weights, &d_outs, &mut d_value, row_group, lane, tiling);
            accumulate::<F, N>(&d_scores, &queries, &mut d_key, row_group, lane, tiling);
            sync_cube();
            start += tile;
        }
    }

    #[unroll]
    for i in 0..UNIT_ROWS {
        let index = key_index[i as usize];
        if index < geometry.keys {
            let out_at = (batch * geometry.keys + index) * kv_row_vectors + kv_column;
            #[unroll]
            for m in 0..out_vectors {
                let column = lane + m * lanes;
                if column < head_vectors {
                    let at = (i * out_vectors + m) as usize;
                    key_grad[(out_at + column) as usize] = Vector::<F, N>::cast_from(
                        d_key[at] * Vector::<f32, N>::new(geometry.scale),
                    );
                    value_grad[(out_at + column) as usize] = Vector::<F, N>::cast_from(d_value[at]);
                }
            }
        }
    }
}
