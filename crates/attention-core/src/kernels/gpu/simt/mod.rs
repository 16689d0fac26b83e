//! The SIMT tier of the GPU kernel: FlashAttention-2's scheme in CubeCL on plain FMA units,
//! forward (with flash-decoding's split keys and their combine) and backward, tiled so that each
//! unit's share of the work sits in registers.
//!
//! - `forward.rs`: the forward pass and the combine of split keys
//! - `backward.rs`: the query gradient and the key/value gradients
//!
//! # The tiling
//! A cube computes one *block* of rows (query rows in the forward pass and the query gradient,
//! key rows in the key/value gradients) against the other side streamed through shared memory in
//! *tiles*. Its units form a grid of `block / UNIT_ROWS` row groups by `lanes` lanes: a unit owns
//! [`UNIT_ROWS`] rows of the block, and of each tile the columns `lane, lane + lanes, …` (its
//! scores, `UNIT_ROWS × tile / lanes`) and of the head the vectors `lane, lane + lanes, …` (its
//! share of the outputs, `UNIT_ROWS × width / lanes`). Every size is a compile-time value
//! ([`Tiling`]), so the loops over a unit's share unroll and its accumulators are registers; the
//! head width is padded up to one of a few compiled widths (`tiling.rs`), the columns past the
//! call's own width read as zero. The loops over the head width and over a tile's keys stay
//! loops: each step reads vectors of the block and of the tile from shared memory (rows padded
//! by one vector against bank conflicts), each used for `UNIT_ROWS` or more FMAs.
//!
//! A row's maximum is reduced over its lanes through shared memory (the adapters this runs on
//! in CI have no plane operations); its running sum stays per lane until the end.
//!
//! # Rows, heads and positions
//! Tensors are row-major `[batch, seq, heads · head_dim]`, the heads side by side. A cube works
//! for one key/value head: its rows are the (query, query head) pairs of that head's group,
//! query-major (`pair = query · group + member`), so that a group's query heads read each key
//! and value tile once, and a decoding step's few queries and heads fill a block together.
//!
//! Query `i` is position `p = i + keys − queries` and sees key `j` iff `j ≤ p`, `p − j < window`
//! (`window = 0`: no window) and key `j` is not padding. A tile is *skipped* when no row of the
//! block sees any of its keys (it is never loaded), *full* when every row sees every key (no mask
//! is computed), an *edge* otherwise. A masked score is [`masked`], not `-inf`: WGSL has no
//! infinite literals. Each score may be soft-capped (`c · tanh(s / c)`, after the scale, before
//! the mask); sinks (one logit per head in the softmax's denominator) enter the forward pass's
//! normalisation, and the log-sum-exp it saves includes them, so the backward kernels need
//! nothing else of them.

mod backward;
mod forward;

pub use backward::{flash_key_value_grad, flash_query_grad};
#[cfg(feature = "kernel-report")]
pub use forward::SplitsCompilationArg;
pub use forward::{SplitsLaunch, flash_combine, flash_forward};

use cubecl::prelude::*;

/// Rows of the block each unit owns.
pub const UNIT_ROWS: u32 = 4;

/// The compile-time shape of one kernel: every kernel of this tier is compiled per tiling (and
/// per float type and vector size).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Tiling {
    /// The head width compiled for: the call's `head_dim` or more (the rest reads as zero).
    pub width: u32,
    /// Rows a cube computes, a multiple of [`UNIT_ROWS`].
    pub block: u32,
    /// Rows of a streamed tile, a multiple of `lanes`.
    pub tile: u32,
    /// Units side by side over a row: they split its tile columns and its head vectors.
    pub lanes: u32,
}

impl Tiling {
    /// Units a cube of this tiling has.
    pub fn units(&self) -> u32 {
        self.block / UNIT_ROWS * self.lanes
    }
}

/// A masked score, and the log-sum-exp of a row that sees no key.
#[cube]
pub fn masked() -> f32 {
    f32::new(-1.0e30_f32)
}

/// Whether `score` is a real score: a masked one is [`masked`].
#[cube]
pub fn is_visible(score: f32) -> bool {
    let threshold = -1.0e29f32;
    score > threshold
}

/// The sizes and score rule of one call, as the kernels take them (uniform over the cubes).
#[derive(CubeType, CubeLaunch, Clone, Copy)]
pub struct Geometry {
    /// Query heads and key/value heads, and the width of each (`head_dim ≤ tiling.width`).
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
    /// sinks: runtime flags, uniform over the cubes, rather than compile-time variants (each
    /// variant is one more compilation).
    pub padded: u32,
    pub with_sinks: u32,
    /// Flash-decoding (forward pass only): the keys are dealt to `splits` cubes per block,
    /// `split_len` keys each, whose partial outputs and log-sum-exps are combined after; 1 and
    /// `keys` without.
    pub splits: u32,
    pub split_len: u32,
}

/// Whether query position `position` sees key `key` (padding aside).
#[cube]
pub fn in_view(key: u32, position: u32, geometry: &Geometry) -> bool {
    key <= position
        && key < geometry.keys
        && (geometry.window == 0 || key + geometry.window > position)
}

/// The position of row `UNIT_ROWS · row_group + i` of a block of (query, query head) pairs from
/// `first_pair`, in groups of `group` heads, the queries after `offset` earlier keys (rows past
/// the last pair compute on zeros and are not written).
#[cube]
pub fn position_of(
    first_pair: u32,
    row_group: u32,
    #[comptime] i: u32,
    group: u32,
    offset: u32,
) -> u32 {
    (first_pair + row_group * UNIT_ROWS + i) / group + offset
}

/// The score of a dot product and, with a soft-cap, `tanh(s / c)` (for the backward pass's
/// `1 − tanh²`).
#[cube]
pub fn scored(dot: f32, geometry: &Geometry) -> (f32, f32) {
    let scaled = dot * geometry.scale;
    let mut score = scaled;
    let mut tanh = 0.0f32;
    if geometry.softcap > 0.0 {
        tanh = f32::tanh(scaled / geometry.softcap);
        score = geometry.softcap * tanh;
    }
    (score, tanh)
}

/// Which rows of one head [`load_rows`] reads: storage rows `first_row ..` (`count` of them) of
/// a tensor whose rows are `row_vectors` vectors wide, the head's `head_vectors` vectors
/// starting at vector `column`.
#[derive(CubeType, Clone, Copy)]
pub struct HeadRows {
    pub first_row: u32,
    pub count: u32,
    pub row_vectors: u32,
    pub column: u32,
    pub head_vectors: u32,
}

/// Loads `from`'s rows of `source` into `tile` (`rows` rows of `width / N + 1` vectors, the
/// head's vectors first, zero past `head_vectors` and for rows past `count`), all units of the
/// cube together.
#[cube]
pub fn load_rows<F: Float, N: Size>(
    source: &Tensor<Vector<F, N>>,
    tile: &mut SharedMemory<Vector<F, N>>,
    from: &HeadRows,
    #[comptime] rows: u32,
    #[comptime] width: u32,
    #[comptime] units: u32,
) {
    let n = N::value().comptime() as u32;
    let vectors = comptime!(width / n);
    let total = comptime!(rows * width / n);
    let mut at = UNIT_POS_X;
    while at < total {
        let row = at / vectors;
        let vector = at % vectors;
        let mut value = Vector::<F, N>::new(F::new(0.0));
        if row < from.count && vector < from.head_vectors {
            value =
                source[((from.first_row + row) * from.row_vectors + from.column + vector) as usize];
        }
        tile[(row * comptime!(vectors + 1) + vector) as usize] = value;
        at += units;
    }
}

/// One sequence's key/value head: the keys a [`KeyTile`] loads.
#[derive(CubeType, Clone, Copy)]
pub struct KeySource {
    geometry: Geometry,
    batch: u32,
    kv_head: u32,
}

#[cube]
impl KeySource {
    /// Sequence `batch`'s key/value head `kv_head`.
    pub fn new(geometry: &Geometry, batch: u32, kv_head: u32) -> KeySource {
        KeySource {
            geometry: *geometry,
            batch,
            kv_head,
        }
    }
}

/// A tile of keys and values in shared memory (rows padded by one vector, as [`load_rows`]
/// leaves them) and their padding flags: what the forward pass and the query gradient hold of
/// the keys while their block of queries stays put.
#[derive(CubeType)]
pub struct KeyTile<F: Float, N: Size> {
    /// `[tile, width / N + 1]` vectors.
    pub keys: SharedMemory<Vector<F, N>>,
    /// `[tile, width / N + 1]` vectors.
    pub values: SharedMemory<Vector<F, N>>,
    /// `[tile]`: 1 for a padding key.
    pub padding: SharedMemory<f32>,
}

#[cube]
impl<F: Float, N: Size> KeyTile<F, N> {
    /// Shared memory for `tiling.tile` keys.
    pub fn new(#[comptime] tiling: Tiling) -> Self {
        let n = N::value().comptime() as u32;
        let rows = comptime!(tiling.tile * (tiling.width / n + 1));
        KeyTile::<F, N> {
            keys: SharedMemory::<Vector<F, N>>::new(rows as usize),
            values: SharedMemory::<Vector<F, N>>::new(rows as usize),
            padding: SharedMemory::<f32>::new(comptime!(tiling.tile as usize)),
        }
    }

    /// Loads keys `start .. min(start + tile, end)` of `source`, all units of the cube together
    /// (zeros past `end`); the caller syncs the cube before reading them.
    #[allow(clippy::too_many_arguments)]
    pub fn load(
        &mut self,
        key: &Tensor<Vector<F, N>>,
        value: &Tensor<Vector<F, N>>,
        key_padding: &Tensor<F>,
        source: &KeySource,
        start: u32,
        end: u32,
        #[comptime] tiling: Tiling,
    ) {
        let (tile, units) = comptime!((tiling.tile, tiling.units()));
        let count = min(tile, end - start);
        let geometry = source.geometry;
        let head_vectors = geometry.head_dim / N::value().comptime() as u32;
        let from = HeadRows {
            first_row: source.batch * geometry.key_rows + geometry.key_first + start,
            count,
            row_vectors: geometry.kv_heads * head_vectors,
            column: source.kv_head * head_vectors,
            head_vectors,
        };
        load_rows::<F, N>(key, &mut self.keys, &from, tile, tiling.width, units);
        load_rows::<F, N>(value, &mut self.values, &from, tile, tiling.width, units);
        if geometry.padded == 1 {
            let first = source.batch * geometry.keys + start;
            load_scalars::<F>(key_padding, &mut self.padding, first, count, tile, units);
        }
    }
}

/// Loads `count` scalars `source[first ..]` into `tile[0 ..]` (zero past `count`), all units
/// together.
#[cube]
pub fn load_scalars<F: Float>(
    source: &Tensor<F>,
    tile: &mut SharedMemory<f32>,
    first: u32,
    count: u32,
    #[comptime] len: u32,
    #[comptime] units: u32,
) {
    let mut at = UNIT_POS_X;
    while at < len {
        let mut value = 0.0f32;
        if at < count {
            value = f32::cast_from(source[(first + at) as usize]);
        }
        tile[at as usize] = value;
        at += units;
    }
}

/// A unit's rows of the block, as one vector of shared memory: a column of a weights tile
/// (`[tile, block / UNIT_ROWS]` of these, so that each unit reads its rows' weights of a key in
/// one load).
pub type RowsVector = Vector<f32, Const<4>>;

/// The unit's dot products of a tile: `dots[i · cols + j] = block[r_i] · tile[c_j]` over the
/// compiled width, for its rows `r_i = row_group · UNIT_ROWS + i` and its tile columns `c_j =
/// lane + j · lanes` (both shared memory of rows padded by one vector).
#[cube]
pub fn tile_dots<F: Float, N: Size>(
    block: &SharedMemory<Vector<F, N>>,
    tile: &SharedMemory<Vector<F, N>>,
    dots: &mut Array<f32>,
    row_group: u32,
    lane: u32,
    #[comptime] tiling: Tiling,
) {
    let n = N::value().comptime() as u32;
    let vectors = comptime!(tiling.width / n);
    let stride = comptime!(vectors + 1);
    let cols = comptime!(tiling.tile / tiling.lanes);
    let mut rows = Array::<Vector<f32, N>>::new(comptime!(UNIT_ROWS as usize));
    #[unroll]
    for x in 0..comptime!(UNIT_ROWS * cols) {
        dots[x as usize] = 0.0;
    }
    for vector in 0..vectors {
        #[unroll]
        for i in 0..UNIT_ROWS {
            let at = ((row_group * UNIT_ROWS + i) * stride + vector) as usize;
            rows[i as usize] = Vector::<f32, N>::cast_from(block[at]);
        }
        #[unroll]
        for j in 0..cols {
            let at = ((lane + j * tiling.lanes) * stride + vector) as usize;
            let column = Vector::<f32, N>::cast_from(tile[at]);
            #[unroll]
            for i in 0..UNIT_ROWS {
                let row = rows[i as usize];
                #[unroll]
                for l in 0..n {
                    dots[(i * cols + j) as usize] += row[l as usize] * column[l as usize];
                }
            }
        }
    }
}

/// Writes the unit's `values[i · cols + j]` (its rows by its tile columns, as [`tile_dots`]) to
/// `weights`, one [`RowsVector`] per tile column.
#[cube]
pub fn store_columns(
    values: &Array<f32>,
    weights: &mut SharedMemory<RowsVector>,
    row_group: u32,
    lane: u32,
    #[comptime] tiling: Tiling,
) {
    let cols = comptime!(tiling.tile / tiling.lanes);
    let groups = comptime!(tiling.block / UNIT_ROWS);
    #[unroll]
    for j in 0..cols {
        let mut column = RowsVector::empty();
        #[unroll]
        for i in 0..UNIT_ROWS {
            column[i as usize] = values[(i * cols + j) as usize];
        }
        weights[((lane + j * tiling.lanes) * groups + row_group) as usize] = column;
    }
}

/// `acc[i · out_vectors + m] += Σ_c weights[c][r_i] · rows[c][lane + m · lanes]` over the tile's
/// rows `c`: the unit's rows of the block times its vectors of the head.
#[cube]
pub fn accumulate<F: Float, N: Size>(
    weights: &SharedMemory<RowsVector>,
    rows: &SharedMemory<Vector<F, N>>,
    acc: &mut Array<Vector<f32, N>>,
    row_group: u32,
    lane: u32,
    #[comptime] tiling: Tiling,
) {
    let n = N::value().comptime() as u32;
    let stride = comptime!(tiling.width / n + 1);
    let out_vectors = comptime!(tiling.width / n / tiling.lanes);
    let groups = comptime!(tiling.block / UNIT_ROWS);
    for column in 0..tiling.tile {
        let weight = weights[(column * groups + row_group) as usize];
        #[unroll]
        for m in 0..out_vectors {
            let at = (column * stride + lane + m * tiling.lanes) as usize;
            let row = Vector::<f32, N>::cast_from(rows[at]);
            #[unroll]
            for i in 0..UNIT_ROWS {
                let at = (i * out_vectors + m) as usize;
                acc[at] += Vector::<f32, N>::new(weight[i as usize]) * row;
            }
        }
    }
}
