//! The backward pass: the query gradient per block of queries, the key and value gradients per
//! block of keys, each tile's weights recomputed from the forward pass's log-sum-exp — `O(seq)`
//! memory and no float atomics.
//!
//! With `Pᵢⱼ = exp(sᵢⱼ − lseᵢ)` and `Dᵢ = dOᵢ · Oᵢ`: `dSᵢⱼ = Pᵢⱼ (dOᵢ · vⱼ − Dᵢ)` (times
//! `1 − tanh²` under a soft-cap), `dQᵢ = scale · Σⱼ dSᵢⱼ kⱼ`, `dKⱼ = scale · Σᵢ dSᵢⱼ qᵢ`,
//! `dVⱼ = Σᵢ Pᵢⱼ dOᵢ`.

use cubecl::prelude::*;

use super::{
    Geometry, HeadRows, KeySource, KeyTile, PairBlock, RowsVector, Tiling, UNIT_ROWS, Unit,
    accumulate, accumulate_tile, document_end, in_view, is_visible, load_pairs, load_rows, masked,
    score_grad, scored, store_columns, store_row, tile_dots, unit_scores, zeroed_rows,
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
/// - `documents`: `[batch, keys, 2]` (read when `geometry.packed`)
/// - `lse`, `delta` (`Dᵢ = dOᵢ · Oᵢ`): `[batch, queries, heads]`
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn flash_query_grad<F: Float, N: Size>(
    query: &Tensor<Vector<F, N>>,
    key: &Tensor<Vector<F, N>>,
    value: &Tensor<Vector<F, N>>,
    key_padding: &Tensor<F>,
    documents: &Tensor<f32>,
    output_grad: &Tensor<Vector<F, N>>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    query_grad: &mut Tensor<Vector<F, N>>,
    geometry: Geometry,
    #[comptime] tiling: Tiling,
    #[define(F)] _dtype: StorageType,
) {
    let n = N::value().comptime() as u32;
    let sizes = comptime!(tiling.sizes(n));
    let unit = Unit::new(&geometry, sizes);
    let block = PairBlock::new(CUBE_POS_X, documents, &unit, &geometry, sizes.block);
    let first_keys = block.document_starts(documents, &unit, &geometry);
    let (lanes, cols) = comptime!((sizes.lanes, sizes.cols));

    // The block's queries and output gradients.
    let rows = comptime!((sizes.block * sizes.stride) as usize);
    let mut queries = SharedMemory::<Vector<F, N>>::new(rows);
    let mut d_outs = SharedMemory::<Vector<F, N>>::new(rows);
    load_pairs::<F, N>(query, &mut queries, &block, &unit, sizes);
    load_pairs::<F, N>(output_grad, &mut d_outs, &block, &unit, sizes);

    // This unit's rows: log-sum-exps and `D`s (rows past the last pair: a masked log-sum-exp, so
    // that they weigh nothing). Their positions are computed where a mask needs them, in edge
    // tiles only: a register less each.
    let mut row_lse = Array::<f32>::new(comptime!(UNIT_ROWS as usize));
    let mut row_delta = Array::<f32>::new(comptime!(UNIT_ROWS as usize));
    #[unroll]
    for i in 0..UNIT_ROWS {
        let pair = block.pair(&unit, i);
        let mut l = masked();
        let mut d = 0.0f32;
        if pair < block.end_pair {
            let at = (unit.query_row(pair) * geometry.heads + unit.head(pair)) as usize;
            l = lse[at];
            d = delta[at];
        }
        row_lse[i as usize] = l;
        row_delta[i as usize] = d;
    }

    // The key/value tile: the keys and values the block's queries meet in turn.
    let mut kv = KeyTile::<F, N>::new(sizes);
    let mut d_scores =
        SharedMemory::<RowsVector>::new(comptime!((sizes.tile * sizes.groups) as usize));

    let mut scores = unit_scores(sizes);
    let mut d_weights = unit_scores(sizes);
    let mut acc = zeroed_rows::<N>(sizes);

    let key_source = KeySource::new(&geometry, &unit);
    let key_end = block.key_end;
    let mut start = block.key_start;
    while start < key_end {
        kv.load(key, value, key_padding, &key_source, start, key_end, sizes);
        sync_cube();

        // Scores and `dOᵢ · vⱼ` for the unit's rows and its keys `lane + j · lanes`.
        tile_dots::<F, N>(&queries, &kv.keys, &mut scores, &unit, sizes);
        tile_dots::<F, N>(&d_outs, &kv.values, &mut d_weights, &unit, sizes);

        let full = block.sees_whole_tile(start, key_end, &geometry, sizes.tile);
        #[unroll]
        for j in 0..cols {
            let column = unit.lane + j * lanes;
            #[unroll]
            for i in 0..UNIT_ROWS {
                let at = (i * cols + j) as usize;
                let (score, tanh) = scored(scores[at], &geometry);
                let mut visible = is_visible(row_lse[i as usize]);
                if !full {
                    let position = block.position(&unit, i);
                    let first_key = first_keys[i as usize];
                    visible =
                        visible && kv.sees(column, start, key_end, position, first_key, &geometry);
                }
                let weight = select(visible, f32::exp(score - row_lse[i as usize]), 0.0);
                scores[at] = score_grad(
                    weight,
                    d_weights[at],
                    row_delta[i as usize],
                    tanh,
                    &geometry,
                );
            }
        }
        accumulate_tile::<F, N>(&scores, &mut d_scores, &kv.keys, &mut acc, &unit, sizes);
        start += sizes.tile;
    }

    #[unroll]
    for i in 0..UNIT_ROWS {
        let pair = block.pair(&unit, i);
        if pair < block.end_pair {
            let query_row = unit.query_row(pair);
            let out_at = query_row * unit.row_vectors + unit.head(pair) * unit.head_vectors;
            store_row::<F, N>(query_grad, &acc, geometry.scale, out_at, &unit, i, sizes);
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
/// - `documents`: `[batch, keys, 2]` (read when `geometry.packed`)
/// - `lse`, `delta`: `[batch, queries, heads]`
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn flash_key_value_grad<F: Float, N: Size>(
    query: &Tensor<Vector<F, N>>,
    key: &Tensor<Vector<F, N>>,
    value: &Tensor<Vector<F, N>>,
    key_padding: &Tensor<F>,
    documents: &Tensor<f32>,
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
    let sizes = comptime!(tiling.sizes(n));
    let unit = Unit::new(&geometry, sizes);
    let (block, tile, lanes, cols) = comptime!((sizes.block, sizes.tile, sizes.lanes, sizes.cols));
    let first_key = CUBE_POS_X * block;
    let last_key = min(first_key + block, geometry.keys) - 1;
    let kv_row_vectors = geometry.kv_heads * unit.head_vectors;

    let rows = comptime!((block * sizes.stride) as usize);
    let mut keys = SharedMemory::<Vector<F, N>>::new(rows);
    let mut values = SharedMemory::<Vector<F, N>>::new(rows);
    let key_first = unit.batch * geometry.key_rows + geometry.key_first;
    let kv_column = unit.kv_head * unit.head_vectors;
    let from = HeadRows {
        first_row: key_first + first_key,
        count: last_key + 1 - first_key,
        row_vectors: kv_row_vectors,
        column: kv_column,
        head_vectors: unit.head_vectors,
    };
    load_rows::<F, N>(key, &mut keys, &from, block, sizes);
    load_rows::<F, N>(value, &mut values, &from, block, sizes);

    // This unit's keys: their indices, whether they are padding, and where their documents end
    // (a query sees a key at or before it iff it lies before that end).
    let mut key_index = Array::<u32>::new(comptime!(UNIT_ROWS as usize));
    let mut key_padded = Array::<u32>::new(comptime!(UNIT_ROWS as usize));
    let mut key_document_end = Array::<u32>::new(comptime!(UNIT_ROWS as usize));
    #[unroll]
    for i in 0..UNIT_ROWS {
        let index = first_key + unit.row_group * UNIT_ROWS + i;
        key_index[i as usize] = index;
        let mut end = geometry.keys;
        if index < geometry.keys {
            end = document_end(documents, unit.batch, index, &geometry);
        }
        key_document_end[i as usize] = end;
        let mut padded = 0u32;
        if geometry.padded == 1 && index < geometry.keys {
            let flag = f32::cast_from(key_padding[(unit.batch * geometry.keys + index) as usize]);
            padded = select(flag > 0.5, 1u32, 0u32);
        }
        key_padded[i as usize] = padded;
    }

    // The queries that see some key of this block: from the first key's position on, until the
    // last key leaves their window or its document ends.
    let offset = unit.offset;
    let mut query_start = 0u32;
    if first_key > offset {
        query_start = first_key - offset;
    }
    let mut query_end = geometry.queries;
    if geometry.window > 0 {
        let reach = last_key + geometry.window;
        query_end = select(reach > offset, min(query_end, reach - offset), 0u32);
    }
    // Packed sequences have no cached keys (`offset` is 0).
    query_end = min(
        query_end,
        document_end(documents, unit.batch, last_key, &geometry),
    );
    // Every key of the block is seen by the queries before the first key's document ends.
    let first_document_end = document_end(documents, unit.batch, first_key, &geometry);

    let tile_rows = comptime!((tile * sizes.stride) as usize);
    let mut queries = SharedMemory::<Vector<F, N>>::new(tile_rows);
    let mut d_outs = SharedMemory::<Vector<F, N>>::new(tile_rows);
    let mut lses = SharedMemory::<f32>::new(comptime!(tile as usize));
    let mut deltas = SharedMemory::<f32>::new(comptime!(tile as usize));
    let weight_columns = comptime!((tile * sizes.groups) as usize);
    let mut weights = SharedMemory::<RowsVector>::new(weight_columns);
    let mut d_scores = SharedMemory::<RowsVector>::new(weight_columns);

    let mut scores = unit_scores(sizes);
    let mut d_weights = unit_scores(sizes);
    let mut d_key = zeroed_rows::<N>(sizes);
    let mut d_value = zeroed_rows::<N>(sizes);

    let query_first = unit.batch * geometry.queries;
    for member in 0..unit.group {
        let head = unit.kv_head * unit.group + member;
        let column = head * unit.head_vectors;
        let mut start = query_start;
        while start < query_end {
            let count = min(tile, query_end - start);
            let from = HeadRows {
                first_row: query_first + start,
                count,
                row_vectors: unit.row_vectors,
                column,
                head_vectors: unit.head_vectors,
            };
            load_rows::<F, N>(query, &mut queries, &from, tile, sizes);
            load_rows::<F, N>(output_grad, &mut d_outs, &from, tile, sizes);
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
                at += sizes.units;
            }
            sync_cube();

            // Scores and `dOⱼ · vᵢ` for the unit's keys and its queries `lane + j · lanes`.
            tile_dots::<F, N>(&keys, &queries, &mut scores, &unit, sizes);
            tile_dots::<F, N>(&values, &d_outs, &mut d_weights, &unit, sizes);

            let full = geometry.padded == 0
                && start + tile <= query_end
                && first_key + block <= geometry.keys
                && start + offset >= first_key + block - 1
                && (geometry.window == 0
                    || start + tile - 1 + offset < first_key + geometry.window)
                && start + tile <= first_document_end;
            #[unroll]
            for j in 0..cols {
                let column = unit.lane + j * lanes;
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
                            && query_index < key_document_end[i as usize]
                            && in_view(key_index[i as usize], query_index + offset, 0, &geometry);
                    }
                    let weight = select(visible, f32::exp(score - row_lse), 0.0);
                    scores[at] = weight;
                    d_weights[at] = score_grad(weight, d_weights[at], row_delta, tanh, &geometry);
                }
            }
            store_columns(&scores, &mut weights, &unit, sizes);
            store_columns(&d_weights, &mut d_scores, &unit, sizes);
            sync_cube();

            accumulate::<F, N>(&weights, &d_outs, &mut d_value, &unit, sizes);
            accumulate::<F, N>(&d_scores, &queries, &mut d_key, &unit, sizes);
            sync_cube();
            start += tile;
        }
    }

    #[unroll]
    for i in 0..UNIT_ROWS {
        let index = key_index[i as usize];
        if index < geometry.keys {
            let out_at = (unit.batch * geometry.keys + index) * kv_row_vectors + kv_column;
            store_row::<F, N>(key_grad, &d_key, geometry.scale, out_at, &unit, i, sizes);
            store_row::<F, N>(value_grad, &d_value, 1.0f32, out_at, &unit, i, sizes);
        }
    }
}
