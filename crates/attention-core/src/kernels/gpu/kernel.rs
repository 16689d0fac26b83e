//! Causal flash attention as CubeCL kernels (FlashAttention-2's scheme), forward and backward.
//!
//! Every kernel gives one unit a row — a query in the forward pass and in the query gradient, a
//! key in the key/value gradients — and streams the other side through shared memory in tiles
//! of `tile` rows, loaded by all units of the cube together. A unit keeps its row's vectors and
//! accumulators in its own registers, in `f32` whatever the input type. Tiles wholly above the
//! causal diagonal or before a sliding window are never loaded.
//!
//! Tensors are row-major `[batch, seq, heads · head_dim]`: the projections' output as it is, the
//! heads side by side. Keys and values may have fewer heads than queries (grouped-query
//! attention): query head `h` reads key/value head `h / (heads / kv_heads)` in place, and the
//! key/value gradient kernel sums a group's query heads into that head.
//!
//! Query `i` is position `p = i + keys − queries` and sees key `j` iff `j ≤ p`, `p − j < window`
//! (`window = 0`: no window) and key `j` is not padding. A masked score is [`masked`], not `-inf`:
//! WGSL has no infinite literals.
//!
//! Each score may be soft-capped (`c · tanh(s / c)`, after the scale, before the mask). Sinks
//! (one logit per head in the softmax's denominator) enter the forward pass's normalisation; the
//! log-sum-exp it saves includes them, so the backward kernels need nothing else of them.

use cubecl::prelude::*;

/// A masked score, and the log-sum-exp of a row that sees no key.
#[cube]
fn masked() -> f32 {
    f32::new(-1.0e30_f32)
}

/// Whether `score` is a real score: a masked one is [`masked`].
#[cube]
fn is_visible(score: f32) -> bool {
    let threshold = -1.0e29f32;
    score > threshold
}

/// The sizes and score rule of one call, as the kernels take them.
#[derive(CubeType, CubeLaunch, Clone, Copy)]
pub struct Geometry {
    /// Query heads and key/value heads, and the width of each.
    pub heads: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    /// Query rows (the last `queries` positions) and key positions seen.
    pub queries: u32,
    pub keys: u32,
    /// The storage row of key 0 within its sequence, and the rows each sequence has (a cache's
    /// allocated length; `keys` for a plain call).
    pub key_first: u32,
    pub key_rows: u32,
    /// Keys a query sees at most, its own included; 0: no window.
    pub window: u32,
    pub scale: f32,
    /// The soft-cap `c`; 0: none.
    pub softcap: f32,
    /// 1 when the call has key padding (else the padding tensor is not read), and 1 when it has
    /// sinks: runtime flags, uniform over the cubes, rather than compile-time variants — a
    /// software adapter takes seconds to compile each variant.
    pub padded: u32,
    pub with_sinks: u32,
    /// Flash-decoding (forward pass only): the cached keys are dealt to `splits` cubes per query
    /// block, `split_len` keys each, whose partial outputs and log-sum-exps are combined after;
    /// 1 and 0 without.
    pub splits: u32,
    pub split_len: u32,
}

/// Whether query position `position` sees key `key` (padding aside).
#[cube]
fn in_view(key: u32, position: u32, geometry: &Geometry) -> bool {
    key <= position
        && key < geometry.keys
        && (geometry.window == 0 || key + geometry.window > position)
}

/// Whether key `key` of sequence `batch` is padding.
#[cube]
fn is_padding<F: Float>(
    key_padding: &Tensor<F>,
    batch: u32,
    key: u32,
    geometry: &Geometry,
) -> bool {
    let mut padded = false;
    if geometry.padded == 1 {
        padded = f32::cast_from(key_padding[(batch * geometry.keys + key) as usize]) > 0.5;
    }
    padded
}

/// The score and, with a soft-cap, `tanh(s / c)` (for the backward pass's `1 − tanh²`).
#[cube]
fn scored(dot: f32, geometry: &Geometry) -> (f32, f32) {
    let scaled = dot * geometry.scale;
    let mut score = scaled;
    let mut tanh = 0.0f32;
    if geometry.softcap > 0.0 {
        tanh = f32::tanh(scaled / geometry.softcap);
        score = geometry.softcap * tanh;
    }
    (score, tanh)
}

/// Loads rows `start ..` of one head of `source` into `tile` (`tile_rows × head_dim`, row after
/// row), every unit of the cube taking its share; rows at or past `end` are left as they were
/// (never read).
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_tile<F: Float>(
    source: &Tensor<F>,
    tile: &mut SharedMemory<F>,
    first_row: u32,
    start: u32,
    end: u32,
    row_width: u32,
    column: u32,
    head_dim: u32,
    #[comptime] tile_rows: u32,
) {
    let len = tile_rows * head_dim;
    let mut at = UNIT_POS_X;
    while at < len {
        let row = at / head_dim;
        if start + row < end {
            let from = (first_row + start + row) * row_width + column + at % head_dim;
            tile[at as usize] = source[from as usize];
        }
        at += CUBE_DIM_X;
    }
}

/// The forward pass: `output` and the per-row log-sum-exp.
///
/// Cube `(x, y, z)`: query block `x / splits` (one query a unit) and key split `x % splits`,
/// head `y`, sequence `z`.
///
/// # Shapes
/// - `query`: `[batch, queries, heads · head_dim]`
/// - `output`: `[splits, batch, queries, heads · head_dim]`, each split's output normalized over
///   its own keys
/// - `key`, `value`: `[batch, key_rows, kv_heads · head_dim]`, the call's keys at rows
///   `key_first ..`
/// - `key_padding`: `[batch, keys]`, `1` = padding (read when `geometry.padded`)
/// - `sinks`: `[heads]` (read when `geometry.with_sinks`)
/// - `lse`: `[splits, batch, queries, heads]`, [`masked`] for a row that sees nothing
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn flash_forward<F: Float>(
    query: &Tensor<F>,
    key: &Tensor<F>,
    value: &Tensor<F>,
    key_padding: &Tensor<F>,
    sinks: &Tensor<F>,
    output: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    geometry: Geometry,
    #[comptime] head_capacity: u32,
    #[comptime] tile_rows: u32,
    #[define(F)] _dtype: StorageType,
) {
    let head_dim = geometry.head_dim;
    let head = CUBE_POS_Y;
    let batch = CUBE_POS_Z;
    let kv_head = head / (geometry.heads / geometry.kv_heads);
    let offset = geometry.keys - geometry.queries;
    let split = CUBE_POS_X % geometry.splits;
    let first_query = (CUBE_POS_X / geometry.splits) * CUBE_DIM_X;
    let row = first_query + UNIT_POS_X;
    let active = row < geometry.queries;
    let position = row + offset;
    let width = geometry.heads * head_dim;
    let kv_width = geometry.kv_heads * head_dim;
    let row_at = (batch * geometry.queries + row) * width + head * head_dim;
    // A split's partial results are the `split`-th of `splits` stacked outputs.
    let out_row = (split * CUBE_COUNT_Z + batch) * geometry.queries + row;

    let mut q = Array::<f32>::new(head_capacity as usize);
    let mut acc = Array::<f32>::new(head_capacity as usize);
    for c in 0..head_dim {
        q[c as usize] = 0.0;
        acc[c as usize] = 0.0;
    }
    if active {
        for c in 0..head_dim {
            q[c as usize] = f32::cast_from(query[(row_at + c) as usize]);
        }
    }

    // The keys this block's queries see: up to the last query's position, from the first
    // query's window start.
    let last_query = min(first_query + CUBE_DIM_X, geometry.queries) - 1;
    let mut key_end = last_query + offset + 1;
    let mut key_start = 0u32;
    if geometry.window > 0 && first_query + offset + 1 > geometry.window {
        key_start = first_query + offset + 1 - geometry.window;
    }
    if geometry.splits > 1 {
        let split_start = split * geometry.split_len;
        key_start = max(key_start, split_start);
        key_end = min(key_end, split_start + geometry.split_len);
    }

    let mut keys = SharedMemory::<F>::new((tile_rows * head_capacity) as usize);
    let mut values = SharedMemory::<F>::new((tile_rows * head_capacity) as usize);
    let mut scores = Array::<f32>::new(tile_rows as usize);
    let mut row_max = masked();
    let mut sum = 0.0f32;
    let key_first = batch * geometry.key_rows + geometry.key_first;
    let column = kv_head * head_dim;

    let mut start = key_start;
    while start < key_end {
        load_tile::<F>(
            key, &mut keys, key_first, start, key_end, kv_width, column, head_dim, tile_rows,
        );
        load_tile::<F>(
            value,
            &mut values,
            key_first,
            start,
            key_end,
            kv_width,
            column,
            head_dim,
            tile_rows,
        );
        sync_cube();
        if active {
            let mut tile_max = masked();
            for j in 0..tile_rows {
                let key_index = start + j;
                let mut score = masked();
                // `key_end` bounds a key split's last tile (the next split's keys are in view).
                if key_index < key_end
                    && in_view(key_index, position, &geometry)
                    && !is_padding::<F>(key_padding, batch, key_index, &geometry)
                {
                    let mut dot = 0.0f32;
                    for c in 0..head_dim {
                        dot += q[c as usize] * f32::cast_from(keys[(j * head_dim + c) as usize]);
                    }
                    let (s, _) = scored(dot, &geometry);
                    score = s;
                    tile_max = max(tile_max, score);
                }
                scores[j as usize] = score;
            }
            if is_visible(tile_max) {
                let new_max = max(row_max, tile_max);
                let correction = f32::exp(row_max - new_max);
                sum *= correction;
                for c in 0..head_dim {
                    acc[c as usize] *= correction;
                }
                for j in 0..tile_rows {
                    let score = scores[j as usize];
                    if is_visible(score) {
                        let p = f32::exp(score - new_max);
                        sum += p;
                        for c in 0..head_dim {
                            acc[c as usize] +=
                                p * f32::cast_from(values[(j * head_dim + c) as usize]);
                        }
                    }
                }
                row_max = new_max;
            }
        }
        sync_cube();
        start += tile_rows;
    }

    if active {
        if geometry.with_sinks == 1 && split == 0 {
            let sink = f32::cast_from(sinks[head as usize]);
            let new_max = max(row_max, sink);
            let correction = f32::exp(row_max - new_max);
            sum = sum * correction + f32::exp(sink - new_max);
            for c in 0..head_dim {
                acc[c as usize] *= correction;
            }
            row_max = new_max;
        }
        let lse_at = (out_row * geometry.heads + head) as usize;
        let out_at = out_row * width + head * head_dim;
        if sum > 0.0 {
            let inverse = 1.0 / sum;
            for c in 0..head_dim {
                output[(out_at + c) as usize] = F::cast_from(acc[c as usize] * inverse);
            }
            lse[lse_at] = row_max + f32::ln(sum);
        } else {
            for c in 0..head_dim {
                output[(out_at + c) as usize] = F::cast_from(0.0f32);
            }
            lse[lse_at] = masked();
        }
    }
}

/// The query gradient, recomputing each tile's weights from the saved log-sum-exp:
/// `dQ = scale · Σⱼ dSᵢⱼ kⱼ` with `dSᵢⱼ = Pᵢⱼ (dOᵢ · vⱼ − Dᵢ)` (times `1 − tanh²` under a cap).
///
/// Cube `(x, y, z)`: query block `x` (one query a unit), head `y`, sequence `z`.
///
/// # Shapes
/// - `query`, `output_grad`, `query_grad`: `[batch, queries, heads · head_dim]`
/// - `key`, `value`: `[batch, keys, kv_heads · head_dim]`
/// - `lse`, `delta` (`Dᵢ = dOᵢ · Oᵢ`): `[batch, queries, heads]`
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn flash_query_grad<F: Float>(
    query: &Tensor<F>,
    key: &Tensor<F>,
    value: &Tensor<F>,
    key_padding: &Tensor<F>,
    output_grad: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    query_grad: &mut Tensor<F>,
    geometry: Geometry,
    #[comptime] head_capacity: u32,
    #[comptime] tile_rows: u32,
    #[define(F)] _dtype: StorageType,
) {
    let head_dim = geometry.head_dim;
    let head = CUBE_POS_Y;
    let batch = CUBE_POS_Z;
    let kv_head = head / (geometry.heads / geometry.kv_heads);
    let offset = geometry.keys - geometry.queries;
    let first_query = CUBE_POS_X * CUBE_DIM_X;
    let row = first_query + UNIT_POS_X;
    let active = row < geometry.queries;
    let position = row + offset;
    let width = geometry.heads * head_dim;
    let kv_width = geometry.kv_heads * head_dim;
    let row_at = (batch * geometry.queries + row) * width + head * head_dim;

    let mut q = Array::<f32>::new(head_capacity as usize);
    let mut d_out = Array::<f32>::new(head_capacity as usize);
    let mut d_q = Array::<f32>::new(head_capacity as usize);
    for c in 0..head_dim {
        q[c as usize] = 0.0;
        d_out[c as usize] = 0.0;
        d_q[c as usize] = 0.0;
    }
    let mut row_lse = masked();
    let mut row_delta = 0.0f32;
    if active {
        for c in 0..head_dim {
            q[c as usize] = f32::cast_from(query[(row_at + c) as usize]);
            d_out[c as usize] = f32::cast_from(output_grad[(row_at + c) as usize]);
        }
        let lse_at = ((batch * geometry.queries + row) * geometry.heads + head) as usize;
        row_lse = lse[lse_at];
        row_delta = delta[lse_at];
    }

    let last_query = min(first_query + CUBE_DIM_X, geometry.queries) - 1;
    let key_end = last_query + offset + 1;
    let mut key_start = 0u32;
    if geometry.window > 0 && first_query + offset + 1 > geometry.window {
        key_start = first_query + offset + 1 - geometry.window;
    }

    let mut keys = SharedMemory::<F>::new((tile_rows * head_capacity) as usize);
    let mut values = SharedMemory::<F>::new((tile_rows * head_capacity) as usize);
    let key_first = batch * geometry.key_rows + geometry.key_first;
    let column = kv_head * head_dim;

    let mut start = key_start;
    while start < key_end {
        load_tile::<F>(
            key, &mut keys, key_first, start, key_end, kv_width, column, head_dim, tile_rows,
        );
        load_tile::<F>(
            value,
            &mut values,
            key_first,
            start,
            key_end,
            kv_width,
            column,
            head_dim,
            tile_rows,
        );
        sync_cube();
        if active && is_visible(row_lse) {
            for j in 0..tile_rows {
                let key_index = start + j;
                if in_view(key_index, position, &geometry)
                    && !is_padding::<F>(key_padding, batch, key_index, &geometry)
                {
                    let mut dot = 0.0f32;
                    let mut d_weight = 0.0f32;
                    for c in 0..head_dim {
                        let at = (j * head_dim + c) as usize;
                        dot += q[c as usize] * f32::cast_from(keys[at]);
                        d_weight += d_out[c as usize] * f32::cast_from(values[at]);
                    }
                    let (score, tanh) = scored(dot, &geometry);
                    let weight = f32::exp(score - row_lse);
                    let mut d_score = weight * (d_weight - row_delta);
                    if geometry.softcap > 0.0 {
                        d_score *= 1.0 - tanh * tanh;
                    }
                    for c in 0..head_dim {
                        d_q[c as usize] +=
                            d_score * f32::cast_from(keys[(j * head_dim + c) as usize]);
                    }
                }
            }
        }
        sync_cube();
        start += tile_rows;
    }

    if active {
        for c in 0..head_dim {
            query_grad[(row_at + c) as usize] = F::cast_from(d_q[c as usize] * geometry.scale);
        }
    }
}

/// The key and value gradients of one key/value head, its group's query heads summed:
/// `dV = Σᵢ Pᵢⱼ dOᵢ`, `dK = scale · Σᵢ dSᵢⱼ qᵢ`.
///
/// Cube `(x, y, z)`: key block `x` (one key a unit), key/value head `y`, sequence `z`.
///
/// # Shapes
/// - `query`, `output_grad`: `[batch, queries, heads · head_dim]`
/// - `key`, `value`, `key_grad`, `value_grad`: `[batch, keys, kv_heads · head_dim]`
/// - `lse`, `delta`: `[batch, queries, heads]`
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn flash_key_value_grad<F: Float>(
    query: &Tensor<F>,
    key: &Tensor<F>,
    value: &Tensor<F>,
    key_padding: &Tensor<F>,
    output_grad: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    key_grad: &mut Tensor<F>,
    value_grad: &mut Tensor<F>,
    geometry: Geometry,
    #[comptime] head_capacity: u32,
    #[comptime] tile_rows: u32,
    #[define(F)] _dtype: StorageType,
) {
    let head_dim = geometry.head_dim;
    let kv_head = CUBE_POS_Y;
    let batch = CUBE_POS_Z;
    let group = geometry.heads / geometry.kv_heads;
    let offset = geometry.keys - geometry.queries;
    let first_key = CUBE_POS_X * CUBE_DIM_X;
    let key_index = first_key + UNIT_POS_X;
    let width = geometry.heads * head_dim;
    let kv_width = geometry.kv_heads * head_dim;
    let key_at = (batch * geometry.keys + key_index) * kv_width + kv_head * head_dim;
    let live =
        key_index < geometry.keys && !is_padding::<F>(key_padding, batch, key_index, &geometry);

    let mut k = Array::<f32>::new(head_capacity as usize);
    let mut v = Array::<f32>::new(head_capacity as usize);
    let mut d_k = Array::<f32>::new(head_capacity as usize);
    let mut d_v = Array::<f32>::new(head_capacity as usize);
    for c in 0..head_dim {
        k[c as usize] = 0.0;
        v[c as usize] = 0.0;
        d_k[c as usize] = 0.0;
        d_v[c as usize] = 0.0;
    }
    if live {
        for c in 0..head_dim {
            k[c as usize] = f32::cast_from(key[(key_at + c) as usize]);
            v[c as usize] = f32::cast_from(value[(key_at + c) as usize]);
        }
    }

    // The queries that see some key of this block: from the first key's position on, until the
    // last key leaves their window.
    let last_key = min(first_key + CUBE_DIM_X, geometry.keys) - 1;
    let mut query_start = 0u32;
    if first_key > offset {
        query_start = first_key - offset;
    }
    let mut query_end = geometry.queries;
    if geometry.window > 0 {
        query_end = min(query_end, last_key + geometry.window - offset);
    }

    let mut queries = SharedMemory::<F>::new((tile_rows * head_capacity) as usize);
    let mut d_outs = SharedMemory::<F>::new((tile_rows * head_capacity) as usize);
    let mut lses = SharedMemory::<f32>::new(tile_rows as usize);
    let mut deltas = SharedMemory::<f32>::new(tile_rows as usize);
    let query_first = batch * geometry.queries;

    for member in 0..group {
        let head = kv_head * group + member;
        let column = head * head_dim;
        let mut start = query_start;
        while start < query_end {
            load_tile::<F>(
                query,
                &mut queries,
                query_first,
                start,
                query_end,
                width,
                column,
                head_dim,
                tile_rows,
            );
            load_tile::<F>(
                output_grad,
                &mut d_outs,
                query_first,
                start,
                query_end,
                width,
                column,
                head_dim,
                tile_rows,
            );
            if UNIT_POS_X < tile_rows && start + UNIT_POS_X < query_end {
                let at = ((query_first + start + UNIT_POS_X) * geometry.heads + head) as usize;
                lses[UNIT_POS_X as usize] = lse[at];
                deltas[UNIT_POS_X as usize] = delta[at];
            }
            sync_cube();
            if live {
                for i in 0..tile_rows {
                    let row = start + i;
                    if row < query_end && in_view(key_index, row + offset, &geometry) {
                        let mut dot = 0.0f32;
                        let mut d_weight = 0.0f32;
                        for c in 0..head_dim {
                            let at = (i * head_dim + c) as usize;
                            dot += f32::cast_from(queries[at]) * k[c as usize];
                            d_weight += f32::cast_from(d_outs[at]) * v[c as usize];
                        }
                        let (score, tanh) = scored(dot, &geometry);
                        let weight = f32::exp(score - lses[i as usize]);
                        let mut d_score = weight * (d_weight - deltas[i as usize]);
                        if geometry.softcap > 0.0 {
                            d_score *= 1.0 - tanh * tanh;
                        }
                        for c in 0..head_dim {
                            let at = (i * head_dim + c) as usize;
                            d_v[c as usize] += weight * f32::cast_from(d_outs[at]);
                            d_k[c as usize] += d_score * f32::cast_from(queries[at]);
                        }
                    }
                }
            }
            sync_cube();
            start += tile_rows;
        }
    }

    if key_index < geometry.keys {
        for c in 0..head_dim {
            key_grad[(key_at + c) as usize] = F::cast_from(d_k[c as usize] * geometry.scale);
            value_grad[(key_at + c) as usize] = F::cast_from(d_v[c as usize]);
        }
    }
}
