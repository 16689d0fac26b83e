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
//! ([`Tiling`], and what each kernel derives from it first, [`KernelSizes`]), so the loops over
//! a unit's share unroll and its accumulators are registers; the head width is padded up to one
//! of a few compiled widths (`tiling.rs`), the columns past the call's own width read as zero. The loops over the head width and over a tile's keys stay
//! loops: each step reads vectors of the block and of the tile from shared memory (rows padded
//! by one vector against bank conflicts), each used for `UNIT_ROWS` or more FMAs.
//!
//! Each kernel begins alike: its [`KernelSizes`], its [`Unit`] (where the unit works), and, in
//! the forward pass and the query gradient, its [`PairBlock`] (the rows it computes).
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
//! (`window = 0`: no window), key `j` is not padding, and, in a sequence packed from documents,
//! `j` is not before the start of `p`'s document. Documents only move forward along a sequence,
//! so a block's first query has its earliest first key and a key block's last key the latest
//! end of the queries that see it: the key range of a block of queries starts at its first
//! query's document, and the query range of a block of keys ends with its last key's. A tile is *skipped* when no row of the
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

    /// Every size a kernel of this tiling is compiled with, for loads of `vector` elements.
    pub fn sizes(&self, vector: u32) -> KernelSizes {
        let vectors = self.width / vector;
        KernelSizes {
            vector,
            block: self.block,
            tile: self.tile,
            lanes: self.lanes,
            units: self.units(),
            vectors,
            stride: vectors + 1,
            groups: self.block / UNIT_ROWS,
            cols: self.tile / self.lanes,
            out_vectors: vectors / self.lanes,
        }
    }
}

/// Every compile-time size of one kernel ([`Tiling::sizes`]): what its loops run over and its
/// shared memory and registers hold. Each kernel builds it once, first, and hands it on to the
/// functions it calls, so that no size is derived in two places.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KernelSizes {
    /// Elements per load.
    pub vector: u32,
    /// The tiling's block, tile and lanes.
    pub block: u32,
    pub tile: u32,
    pub lanes: u32,
    /// Units of a cube.
    pub units: u32,
    /// Vectors of a row at the compiled width, and a row's stride in shared memory: one vector
    /// more, against bank conflicts.
    pub vectors: u32,
    pub stride: u32,
    /// Row groups of a block: the units over one lane.
    pub groups: u32,
    /// A unit's share: its columns of a tile and its vectors of the head.
    pub cols: u32,
    pub out_vectors: u32,
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

/// The columns before a ragged step's page ids in each sequence's row of the tables: its first
/// query's row among the step's queries, its count of queries, its count of keys.
pub const SEQUENCE_COLUMNS: u32 = 3;

/// The columns of each cube's row of a ragged step's work list: its sequence, its block of the
/// sequence's pairs (counted from the first), its split of the keys, the sequence's splits.
pub const WORK_COLUMNS: u32 = 4;

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
    /// 1 when each sequence is packed from documents (then `queries == keys` and the documents
    /// tensor holds each position's `[start, end)`), else the documents tensor is not read.
    pub packed: u32,
    /// Flash-decoding (forward pass only): the keys are dealt to `splits` cubes per block,
    /// `split_len` keys each, whose partial outputs and log-sum-exps are combined after; 1 and
    /// `keys` without.
    pub splits: u32,
    pub split_len: u32,
    /// Positions per page when the call is a ragged step over a page pool; 0 when the keys and
    /// values are rows of their tensors, and the tables and work list are not read. A ragged
    /// step's sequence `s` has row `s` of the tables, `table_len` wide: [`SEQUENCE_COLUMNS`] (its
    /// first query's row, its queries, its keys), then its page ids. `queries` and `keys` are
    /// then the launch's (its every sequence's queries; the most keys) until a cube reads its
    /// sequence's.
    pub page_size: u32,
    pub table_len: u32,
}

/// Where a unit works, and the sizes of the call it indexes by: what every kernel of this tier
/// computes first, from its [`Geometry`] and the unit's and cube's places.
#[derive(CubeType, Clone, Copy)]
pub struct Unit {
    /// The unit's lane over a row, and its row group: it owns rows `row_group · UNIT_ROWS ..` of
    /// the block.
    pub lane: u32,
    pub row_group: u32,
    /// The cube's key/value head and sequence.
    pub kv_head: u32,
    pub batch: u32,
    /// Query heads per key/value head.
    pub group: u32,
    /// Keys before the first query's position.
    pub offset: u32,
    /// Vectors of one head, and of a query row (every head's).
    pub head_vectors: u32,
    pub row_vectors: u32,
    /// The row of the sequence's first query among every sequence's queries.
    pub query_base: u32,
}

#[cube]
impl Unit {
    /// This unit of this cube, for a call of `geometry`.
    pub fn new(geometry: &Geometry, #[comptime] sizes: KernelSizes) -> Unit {
        let head_vectors = geometry.head_dim / sizes.vector;
        Unit {
            lane: UNIT_POS_X % sizes.lanes,
            row_group: UNIT_POS_X / sizes.lanes,
            kv_head: CUBE_POS_Y,
            batch: CUBE_POS_Z,
            group: geometry.heads / geometry.kv_heads,
            offset: geometry.keys - geometry.queries,
            head_vectors,
            row_vectors: geometry.heads * head_vectors,
            query_base: CUBE_POS_Z * geometry.queries,
        }
    }

    /// The query head of the cube's (query, query head) pair `pair`.
    pub fn head(&self, pair: u32) -> u32 {
        self.kv_head * self.group + pair % self.group
    }

    /// The row of pair `pair`'s query among every sequence's queries.
    pub fn query_row(&self, pair: u32) -> u32 {
        self.query_base + pair / self.group
    }
}

/// The block of (query, query head) pairs a cube of the forward pass or of the query gradient
/// computes: its pairs, their queries' positions, and the keys some pair of it sees.
#[derive(CubeType, Clone, Copy)]
pub struct PairBlock {
    /// Pairs `first_pair .. end_pair` of the key/value head's (fewer in the last block).
    pub first_pair: u32,
    pub end_pair: u32,
    /// The positions of the first and the last pair's queries.
    pub first_position: u32,
    pub last_position: u32,
    /// Keys `key_start .. key_end`: from the first query's window or document start to the last
    /// query's own position.
    pub key_start: u32,
    pub key_end: u32,
    /// The start of the last query's document (0 unpacked): no row sees a key before it.
    pub last_document_start: u32,
}

#[cube]
impl PairBlock {
    /// The block `from_last` blocks before the last of `unit`'s key/value head (the last blocks,
    /// which see the most keys, are the first cubes).
    pub fn new(
        from_last: u32,
        documents: &Tensor<f32>,
        unit: &Unit,
        geometry: &Geometry,
        #[comptime] block: u32,
    ) -> PairBlock {
        let pairs = geometry.queries * unit.group;
        let first_pair = (pairs.div_ceil(block) - 1 - from_last) * block;
        let end_pair = min(first_pair + block, pairs);
        let first_position = first_pair / unit.group + unit.offset;
        let last_position = (end_pair - 1) / unit.group + unit.offset;
        let mut key_start = 0u32;
        if geometry.window > 0 && first_position + 1 > geometry.window {
            key_start = first_position + 1 - geometry.window;
        }
        key_start = max(
            key_start,
            document_start(documents, unit.batch, first_position, geometry),
        );
        PairBlock {
            first_pair,
            end_pair,
            first_position,
            last_position,
            key_start,
            key_end: last_position + 1,
            last_document_start: document_start(documents, unit.batch, last_position, geometry),
        }
    }

    /// The first key of the document of the unit's rows' queries (0 unpacked; 0 for rows past
    /// the block's last pair, which are not written).
    pub fn document_starts(
        &self,
        documents: &Tensor<f32>,
        unit: &Unit,
        geometry: &Geometry,
    ) -> Array<u32> {
        let mut starts = Array::<u32>::new(comptime!(UNIT_ROWS as usize));
        #[unroll]
        for i in 0..UNIT_ROWS {
            let mut start = 0u32;
            if self.pair(unit, i) < self.end_pair {
                start = document_start(documents, unit.batch, self.position(unit, i), geometry);
            }
            starts[i as usize] = start;
        }
        starts
    }

    /// The pair of the unit's row `i` (rows past `end_pair` compute on zeros and are not
    /// written).
    pub fn pair(&self, unit: &Unit, #[comptime] i: u32) -> u32 {
        self.first_pair + unit.row_group * UNIT_ROWS + i
    }

    /// The position of the query of the unit's row `i`.
    pub fn position(&self, unit: &Unit, #[comptime] i: u32) -> u32 {
        self.pair(unit, i) / unit.group + unit.offset
    }

    /// Whether every row of the block sees every key of the tile from `start` (keys up to `end`):
    /// then no mask is computed.
    pub fn sees_whole_tile(
        &self,
        start: u32,
        end: u32,
        geometry: &Geometry,
        #[comptime] tile: u32,
    ) -> bool {
        geometry.padded == 0
            && start + tile <= end
            && start + tile <= self.first_position + 1
            && (geometry.window == 0 || self.last_position < start + geometry.window)
            && start >= self.last_document_start
    }
}

/// The first position of the document that position `position` of sequence `batch` lies in; 0
/// when the sequences are not packed.
#[cube]
pub fn document_start(
    documents: &Tensor<f32>,
    batch: u32,
    position: u32,
    geometry: &Geometry,
) -> u32 {
    let mut start = 0u32;
    if geometry.packed == 1 {
        start = u32::cast_from(documents[((batch * geometry.keys + position) * 2) as usize]);
    }
    start
}

/// The end (exclusive) of the document that position `position` of sequence `batch` lies in;
/// `geometry.keys` when the sequences are not packed.
#[cube]
pub fn document_end(
    documents: &Tensor<f32>,
    batch: u32,
    position: u32,
    geometry: &Geometry,
) -> u32 {
    let mut end = geometry.keys;
    if geometry.packed == 1 {
        end = u32::cast_from(documents[((batch * geometry.keys + position) * 2 + 1) as usize]);
    }
    end
}

/// Loads the block's rows of `source` (`[batch, queries, heads · head_dim]`, each pair's own
/// head) into `rows` (rows padded by one vector, zero past the call's width and the block's
/// last pair), all units of the cube together.
#[cube]
pub fn load_pairs<F: Float, N: Size>(
    source: &Tensor<Vector<F, N>>,
    rows: &mut SharedMemory<Vector<F, N>>,
    block: &PairBlock,
    unit: &Unit,
    #[comptime] sizes: KernelSizes,
) {
    let mut at = UNIT_POS_X;
    while at < comptime!(sizes.block * sizes.vectors) {
        let row = at / sizes.vectors;
        let vector = at % sizes.vectors;
        let pair = block.first_pair + row;
        let mut value = Vector::<F, N>::new(F::new(0.0));
        if pair < block.end_pair && vector < unit.head_vectors {
            let query_row = unit.query_row(pair);
            let from = query_row * unit.row_vectors + unit.head(pair) * unit.head_vectors + vector;
            value = source[from as usize];
        }
        rows[(row * sizes.stride + vector) as usize] = value;
        at += sizes.units;
    }
}

/// Whether query position `position`, whose document starts at `first_key`, sees key `key`
/// (padding aside).
#[cube]
pub fn in_view(key: u32, position: u32, first_key: u32, geometry: &Geometry) -> bool {
    key <= position
        && key < geometry.keys
        && key >= first_key
        && (geometry.window == 0 || key + geometry.window > position)
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

/// A score's gradient `dS = P (dP − D)` from its weight `P`, `dP` (`dO · v`) and its row's `D`,
/// through the soft-cap's `1 − tanh²` where there is one.
#[cube]
pub fn score_grad(weight: f32, d_weight: f32, delta: f32, tanh: f32, geometry: &Geometry) -> f32 {
    let mut d_score = weight * (d_weight - delta);
    if geometry.softcap > 0.0 {
        d_score *= 1.0 - tanh * tanh;
    }
    d_score
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

/// Loads `from`'s rows of `source` into `tile` (`rows` rows of `sizes.stride` vectors, the
/// head's vectors first, zero past `head_vectors` and for rows past `count`), all units of the
/// cube together.
#[cube]
pub fn load_rows<F: Float, N: Size>(
    source: &Tensor<Vector<F, N>>,
    tile: &mut SharedMemory<Vector<F, N>>,
    from: &HeadRows,
    #[comptime] rows: u32,
    #[comptime] sizes: KernelSizes,
) {
    let total = comptime!(rows * sizes.vectors);
    let mut at = UNIT_POS_X;
    while at < total {
        let row = at / sizes.vectors;
        let vector = at % sizes.vectors;
        let mut value = Vector::<F, N>::new(F::new(0.0));
        if row < from.count && vector < from.head_vectors {
            value =
                source[((from.first_row + row) * from.row_vectors + from.column + vector) as usize];
        }
        tile[(row * sizes.stride + vector) as usize] = value;
        at += sizes.units;
    }
}

/// Where a tile's keys lie in storage: from row `first_row` on (a plain call, or a cache's rows),
/// or, in a ragged step over a page pool, key `j` at row `j % page_size` of the page its
/// sequence's table names at `j / page_size`. A tile spans at most two pages (a page holds at
/// least a tile), so its table is read once per tile, not per row. `paged` is a compile-time
/// choice (the caller branches once, outside its loop), so that the dense path's loop carries no
/// table lookup.
#[derive(CubeType, Clone, Copy)]
pub struct TileStorage {
    /// The tile's first key, and its storage row where the keys are rows.
    pub start: u32,
    pub first_row: u32,
    pub page_size: u32,
    /// A paged tile's first page, the first key past it, and the page after (the first again
    /// where the tile ends within it).
    pub page: u32,
    pub page_end: u32,
    pub next_page: u32,
}

#[cube]
impl TileStorage {
    /// The tile of `from.count` keys from `start` of `source`'s sequence, whose keys from
    /// `start` lie from row `from.first_row` where they are not paged.
    pub fn new(
        tables: &Tensor<u32>,
        source: &KeySource,
        start: u32,
        from: &HeadRows,
        #[comptime] paged: bool,
    ) -> TileStorage {
        let geometry = source.geometry;
        let mut rows = TileStorage {
            start,
            first_row: from.first_row,
            page_size: geometry.page_size,
            page: 0,
            page_end: 0,
            next_page: 0,
        };
        if comptime!(paged) {
            let table = source.batch * geometry.table_len + SEQUENCE_COLUMNS;
            let index = start / geometry.page_size;
            rows.page = tables[(table + index) as usize];
            rows.page_end = (index + 1) * geometry.page_size;
            rows.next_page = rows.page;
            if start + from.count > rows.page_end {
                rows.next_page = tables[(table + index + 1) as usize];
            }
        }
        rows
    }

    /// The storage row of the tile's key `key` (`start ≤ key < start + count`).
    pub fn row(&self, key: u32, #[comptime] paged: bool) -> u32 {
        let mut row = self.first_row + key - self.start;
        if comptime!(paged) {
            let page = select(key < self.page_end, self.page, self.next_page);
            row = page * self.page_size + key % self.page_size;
        }
        row
    }
}

/// Vector `vector` of `head`'s row `row` of an int8 cache, unpacked and scaled into `F`: `words`
/// `[rows, kv_heads · ⌈head_dim / 4⌉]`, four values a word (the first in the low byte, two's
/// complement), `scales` `[rows, kv_heads]`.
#[cube]
pub fn int8_vector<F: Float, N: Size>(
    words: &Tensor<u32>,
    scales: &Tensor<f32>,
    row: u32,
    head: u32,
    vector: u32,
    geometry: &Geometry,
    #[comptime] sizes: KernelSizes,
) -> Vector<F, N> {
    let head_words = geometry.head_dim.div_ceil(4u32);
    let at = row * geometry.kv_heads + head;
    let scale = scales[at as usize];
    let mut unpacked = Vector::<F, N>::empty();
    #[unroll]
    for l in 0..sizes.vector {
        let element = vector * sizes.vector + l;
        let word = words[(at * head_words + element / 4) as usize];
        let byte = (word >> ((element % 4) * 8)) & 255u32;
        let signed = f32::cast_from(byte) - select(byte >= 128u32, 256.0f32, 0.0f32);
        unpacked[l as usize] = F::cast_from(signed * scale);
    }
    unpacked
}

/// Loads keys `start ..` (`from.count` of them) of `source`'s head into `tile` from a cache's
/// storage in any of its types, all units of the cube together: `stored` in a float type (the
/// query's, or f16), cast as it is loaded; with `int8`, `words` and `scales` unpacked
/// ([`int8_vector`]) instead. Rows are found by [`TileStorage::row`].
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn load_stored_rows<F: Float, S: Float, N: Size>(
    stored: &Tensor<Vector<S, N>>,
    words: &Tensor<u32>,
    scales: &Tensor<f32>,
    tile: &mut SharedMemory<Vector<F, N>>,
    rows: &TileStorage,
    source: &KeySource,
    from: &HeadRows,
    #[comptime] sizes: KernelSizes,
    #[comptime] int8: bool,
    #[comptime] paged: bool,
) {
    let total = comptime!(sizes.tile * sizes.vectors);
    let mut at = UNIT_POS_X;
    while at < total {
        let row = at / sizes.vectors;
        let vector = at % sizes.vectors;
        let mut value = Vector::<F, N>::new(F::new(0.0));
        if row < from.count && vector < from.head_vectors {
            let stored_row = rows.row(rows.start + row, paged);
            if comptime!(int8) {
                value = int8_vector::<F, N>(
                    words,
                    scales,
                    stored_row,
                    source.kv_head,
                    vector,
                    &source.geometry,
                    sizes,
                );
            } else {
                value = Vector::<F, N>::cast_from(
                    stored[(stored_row * from.row_vectors + from.column + vector) as usize],
                );
            }
        }
        tile[(row * sizes.stride + vector) as usize] = value;
        at += sizes.units;
    }
}

/// One sequence's key/value head: the keys a [`KeyTile`] loads.
#[derive(CubeType, Clone, Copy)]
pub struct KeySource {
    pub geometry: Geometry,
    pub batch: u32,
    pub kv_head: u32,
}

#[cube]
impl KeySource {
    /// The sequence and key/value head of `unit`'s cube.
    pub fn new(geometry: &Geometry, unit: &Unit) -> KeySource {
        KeySource {
            geometry: *geometry,
            batch: unit.batch,
            kv_head: unit.kv_head,
        }
    }

    /// This head's rows of a tile of keys `start ..` (up to `end`) in a call's key and value
    /// tensors, the sequence's keys lying from row `key_first` of its `key_rows`.
    pub fn tile_rows(&self, start: u32, end: u32, #[comptime] sizes: KernelSizes) -> HeadRows {
        let geometry = self.geometry;
        let first_row = self.batch * geometry.key_rows + geometry.key_first + start;
        self.rows(first_row, start, end, sizes)
    }

    /// This head's rows of keys `start ..` (a tile's at most, up to `end`), the first at storage
    /// row `first_row`.
    pub fn rows(
        &self,
        first_row: u32,
        start: u32,
        end: u32,
        #[comptime] sizes: KernelSizes,
    ) -> HeadRows {
        let head_vectors = self.geometry.head_dim / sizes.vector;
        HeadRows {
            first_row,
            count: min(comptime!(sizes.tile), end - start),
            row_vectors: self.geometry.kv_heads * head_vectors,
            column: self.kv_head * head_vectors,
            head_vectors,
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
    /// Shared memory for `sizes.tile` keys.
    pub fn new(#[comptime] sizes: KernelSizes) -> Self {
        let rows = comptime!((sizes.tile * sizes.stride) as usize);
        KeyTile::<F, N> {
            keys: SharedMemory::<Vector<F, N>>::new(rows),
            values: SharedMemory::<Vector<F, N>>::new(rows),
            padding: SharedMemory::<f32>::new(comptime!(sizes.tile as usize)),
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
        #[comptime] sizes: KernelSizes,
    ) {
        let tile = comptime!(sizes.tile);
        let from = source.tile_rows(start, end, sizes);
        load_rows::<F, N>(key, &mut self.keys, &from, tile, sizes);
        load_rows::<F, N>(value, &mut self.values, &from, tile, sizes);
        self.load_padding(key_padding, source, start, from.count, sizes);
    }

    /// The padding flags of the tile's `count` keys from `start`, where the call has padding.
    pub fn load_padding(
        &mut self,
        key_padding: &Tensor<F>,
        source: &KeySource,
        start: u32,
        count: u32,
        #[comptime] sizes: KernelSizes,
    ) {
        if source.geometry.padded == 1 {
            let first = source.batch * source.geometry.keys + start;
            load_scalars::<F>(
                key_padding,
                &mut self.padding,
                first,
                count,
                comptime!(sizes.tile),
                sizes.units,
            );
        }
    }

    /// [`load`](Self::load) for the forward pass, whose keys and values may be a cache's storage
    /// in a narrower type (see [`load_stored_rows`]), and in a ragged step a page pool: key `j` of
    /// the sequence lies at row `j % page_size` of the page that its table names at `j /
    /// page_size` ([`TileStorage`]: one table read per tile).
    /// A paged call has no padding; `paged` says whether this is one, at compile time.
    #[allow(clippy::too_many_arguments)]
    pub fn load_stored<S: Float>(
        &mut self,
        key: &Tensor<Vector<S, N>>,
        value: &Tensor<Vector<S, N>>,
        key_words: &Tensor<u32>,
        value_words: &Tensor<u32>,
        key_scales: &Tensor<f32>,
        value_scales: &Tensor<f32>,
        key_padding: &Tensor<F>,
        tables: &Tensor<u32>,
        source: &KeySource,
        start: u32,
        end: u32,
        #[comptime] sizes: KernelSizes,
        #[comptime] int8: bool,
        #[comptime] paged: bool,
    ) {
        let from = source.tile_rows(start, end, sizes);
        let rows = TileStorage::new(tables, source, start, &from, paged);
        load_stored_rows::<F, S, N>(
            key,
            key_words,
            key_scales,
            &mut self.keys,
            &rows,
            source,
            &from,
            sizes,
            int8,
            paged,
        );
        load_stored_rows::<F, S, N>(
            value,
            value_words,
            value_scales,
            &mut self.values,
            &rows,
            source,
            &from,
            sizes,
            int8,
            paged,
        );
        self.load_padding(key_padding, source, start, from.count, sizes);
    }

    /// Whether a query at `position`, whose document starts at `first_key`, sees key `column` of
    /// this tile, loaded from key `start` (keys from `end` on are not the block's), its padding
    /// included.
    #[allow(clippy::too_many_arguments)]
    pub fn sees(
        &self,
        column: u32,
        start: u32,
        end: u32,
        position: u32,
        first_key: u32,
        geometry: &Geometry,
    ) -> bool {
        let key = start + column;
        let mut visible = key < end && in_view(key, position, first_key, geometry);
        if geometry.padded == 1 {
            visible = visible && self.padding[column as usize] < 0.5;
        }
        visible
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

/// A unit's scores of a tile (its rows by its tile columns, as [`tile_dots`] leaves them).
#[cube]
pub fn unit_scores(#[comptime] sizes: KernelSizes) -> Array<f32> {
    Array::<f32>::new(comptime!((UNIT_ROWS * sizes.cols) as usize))
}

/// A unit's accumulator of its rows by its vectors of the head, zeroed.
#[cube]
pub fn zeroed_rows<N: Size>(#[comptime] sizes: KernelSizes) -> Array<Vector<f32, N>> {
    let mut acc = Array::<Vector<f32, N>>::new(comptime!((UNIT_ROWS * sizes.out_vectors) as usize));
    #[unroll]
    for x in 0..comptime!(UNIT_ROWS * sizes.out_vectors) {
        acc[x as usize] = Vector::<f32, N>::new(0.0);
    }
    acc
}

/// The unit's dot products of a tile: `dots[i · cols + j] = block[r_i] · tile[c_j]` over the
/// compiled width, for its rows `r_i = row_group · UNIT_ROWS + i` and its tile columns `c_j =
/// lane + j · lanes` (both shared memory of rows padded by one vector).
#[cube]
pub fn tile_dots<F: Float, N: Size>(
    block: &SharedMemory<Vector<F, N>>,
    tile: &SharedMemory<Vector<F, N>>,
    dots: &mut Array<f32>,
    unit: &Unit,
    #[comptime] sizes: KernelSizes,
) {
    let cols = comptime!(sizes.cols);
    let mut rows = Array::<Vector<f32, N>>::new(comptime!(UNIT_ROWS as usize));
    #[unroll]
    for x in 0..comptime!(UNIT_ROWS * cols) {
        dots[x as usize] = 0.0;
    }
    for vector in 0..sizes.vectors {
        #[unroll]
        for i in 0..UNIT_ROWS {
            let at = ((unit.row_group * UNIT_ROWS + i) * sizes.stride + vector) as usize;
            rows[i as usize] = Vector::<f32, N>::cast_from(block[at]);
        }
        #[unroll]
        for j in 0..cols {
            let at = ((unit.lane + j * sizes.lanes) * sizes.stride + vector) as usize;
            let column = Vector::<f32, N>::cast_from(tile[at]);
            #[unroll]
            for i in 0..UNIT_ROWS {
                let row = rows[i as usize];
                #[unroll]
                for l in 0..sizes.vector {
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
    unit: &Unit,
    #[comptime] sizes: KernelSizes,
) {
    let cols = comptime!(sizes.cols);
    #[unroll]
    for j in 0..cols {
        let mut column = RowsVector::empty();
        #[unroll]
        for i in 0..UNIT_ROWS {
            column[i as usize] = values[(i * cols + j) as usize];
        }
        weights[((unit.lane + j * sizes.lanes) * sizes.groups + unit.row_group) as usize] = column;
    }
}

/// `acc[i · out_vectors + m] += Σ_c weights[c][r_i] · rows[c][lane + m · lanes]` over the tile's
/// rows `c`: the unit's rows of the block times its vectors of the head.
#[cube]
pub fn accumulate<F: Float, N: Size>(
    weights: &SharedMemory<RowsVector>,
    rows: &SharedMemory<Vector<F, N>>,
    acc: &mut Array<Vector<f32, N>>,
    unit: &Unit,
    #[comptime] sizes: KernelSizes,
) {
    let out_vectors = comptime!(sizes.out_vectors);
    for column in 0..sizes.tile {
        let weight = weights[(column * sizes.groups + unit.row_group) as usize];
        #[unroll]
        for m in 0..out_vectors {
            let at = (column * sizes.stride + unit.lane + m * sizes.lanes) as usize;
            let row = Vector::<f32, N>::cast_from(rows[at]);
            #[unroll]
            for i in 0..UNIT_ROWS {
                let at = (i * out_vectors + m) as usize;
                acc[at] += Vector::<f32, N>::new(weight[i as usize]) * row;
            }
        }
    }
}

/// `acc += weights · rows` over a tile, for the unit's weights `values` (its rows by its tile
/// columns): shared with the cube's other units through `weights` first, as each unit reads
/// every tile column of its rows. The cube is synced after each step, so that the caller may
/// overwrite the tile next.
#[cube]
pub fn accumulate_tile<F: Float, N: Size>(
    values: &Array<f32>,
    weights: &mut SharedMemory<RowsVector>,
    rows: &SharedMemory<Vector<F, N>>,
    acc: &mut Array<Vector<f32, N>>,
    unit: &Unit,
    #[comptime] sizes: KernelSizes,
) {
    store_columns(values, weights, unit, sizes);
    sync_cube();
    accumulate::<F, N>(weights, rows, acc, unit, sizes);
    sync_cube();
}

/// Writes the unit's row `i` of `acc` times `factor` to `output` from vector `out_at`: its
/// vectors of the head, those within the call's width.
#[cube]
pub fn store_row<O: Float, N: Size>(
    output: &mut Tensor<Vector<O, N>>,
    acc: &Array<Vector<f32, N>>,
    factor: f32,
    out_at: u32,
    unit: &Unit,
    #[comptime] i: u32,
    #[comptime] sizes: KernelSizes,
) {
    #[unroll]
    for m in 0..sizes.out_vectors {
        let column = unit.lane + m * sizes.lanes;
        if column < unit.head_vectors {
            let at = (i * sizes.out_vectors + m) as usize;
            output[(out_at + column) as usize] =
                Vector::<O, N>::cast_from(acc[at] * Vector::<f32, N>::new(factor));
        }
    }
}
