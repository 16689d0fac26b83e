//! Weights packed once, in panels of [`PANEL`] output columns, for `products.rs`: a decoding
//! step's products and a prefill's.
//!
//! At one to eight rows a product is a stream of its weights: read in place (`matvec.rs`), a
//! row-major weight gives each task whole weight rows, whose sums for every output column go
//! through memory once per weight row. Packed, each panel is `k` runs of `PANEL` weights in the
//! order they are used: a task holds one panel's `rows × PANEL` sums in registers while the
//! panel streams by once, and the tasks split the output columns, so they share no sums. A
//! prefill's rows take the same panel product in blocks of rows (and, at a few blocks, runs of
//! panels: the cut chosen for the CPU in `prefill_blocking.rs`), one block and run per task, so
//! that no call packs its operands as `gemm` does in each. The weights of one call (a layer's
//! queries, keys and values) are packed side by side, as one `[in, q + 2·kv]` matrix, and
//! multiplied as one.
//!
//! Packing is done once per weight buffer, not per call, and kept by the module that makes the
//! call ([`PackedWeightsCache`]): a packed matrix holds its sources' buffers (a clone of each
//! tensor), so that while it is kept no buffer can be freed (its address reused by another
//! tensor) or written in place (Burn's CPU backends write in place only what one tensor alone
//! holds, and copy the rest). A buffer's address then names its contents: an optimizer step makes
//! new parameter buffers, whose first product packs them anew in place of the old copy.

use std::ops::Range;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use memmap2::MmapMut;
use rayon::prelude::*;

use super::host_matrix::{HostMatrix, Layout};
use super::prefill_blocking::PrefillBlocking;
use super::simd::{self, MAX_PRODUCT_ROWS, PANEL};

/// Weights side by side, in panels of `PANEL` columns.
pub(super) struct PackedWeights {
    /// `[panels, k, PANEL]` floats (see [`zeroed_pages`]): panel `p` holds the concatenated
    /// columns `p·PANEL ..` of every input feature, zero past the last column.
    buffer: MmapMut,
    k: usize,
    /// The number of columns of each weight, in order.
    widths: Vec<usize>,
    /// Per panel, the runs of its lanes that are columns of one weight.
    segments: Vec<Vec<Segment>>,
    /// The packed tensors' buffers, held while packed (see the module's docs).
    sources: Vec<HostMatrix>,
    /// How a prefill's product cuts its work on this CPU.
    blocking: PrefillBlocking,
}

/// Identifies a weight buffer while a packed matrix holds it: its address and length, its
/// layout and its number of columns.
type Key = Vec<(usize, usize, Layout, usize)>;

/// The packed copy of the weights of one call of the CPU products (a layer's queries, keys and
/// values; its output projection; an MLP's gate and up projections), kept by the module that
/// makes the call and dropped with it.
///
/// It holds one packed matrix at a time, for the weights of its call's last product: a product
/// with other weight buffers (an optimizer step's new parameters) packs them in place of the old
/// copy, which lets go of the old buffers. Clones of a module share its copy, as they share its
/// weights' buffers. A module's record holds nothing of it.
#[derive(Clone, Default)]
pub struct PackedWeightsCache {
    slot: Arc<Mutex<Option<Arc<PackedWeights>>>>,
}

impl PackedWeightsCache {
    /// Whether the weights of a product are packed here now.
    pub fn is_packed(&self) -> bool {
        self.lock().is_some()
    }

    /// Frees the packed copy (and its hold on the weights' buffers); the next product packs its
    /// weights again.
    pub fn clear(&self) {
        *self.lock() = None;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Arc<PackedWeights>>> {
        // A panic while the lock was held left the slot whole (every change is one assignment).
        self.slot.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether the packed copy holds the buffer `key` names.
    #[cfg(test)]
    pub(crate) fn holds(&self, key: (usize, usize, Layout, usize)) -> bool {
        self.lock()
            .as_ref()
            .is_some_and(|packed| packed.key().contains(&key))
    }
}

impl std::fmt::Debug for PackedWeightsCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackedWeightsCache")
            .field("packed", &self.is_packed())
            .finish()
    }
}

/// The weights packed side by side, from `cache` or packed now (and kept there); `None` where a
/// buffer's lifetime cannot be followed (see [`HostMatrix::sole_holder`]): read in place then.
///
/// # Shapes
/// - each weight: `[k, n_i]`
pub(super) fn packed(
    weights: &[&HostMatrix],
    cache: &PackedWeightsCache,
) -> Option<Arc<PackedWeights>> {
    if weights.iter().any(|weight| weight.sole_holder().is_none()) {
        return None;
    }
    let key: Key = weights.iter().map(|weight| weight.key()).collect();
    let mut slot = cache.lock();
    if let Some(packed) = slot.as_ref().filter(|packed| packed.key() == key) {
        return Some(packed.clone());
    }
    // The old copy goes first, so that the replaced weights and their copy are not held beside
    // the new one while it is packed.
    *slot = None;
    let packed = Arc::new(PackedWeights::pack(weights));
    *slot = Some(packed.clone());
    Some(packed)
}

impl PackedWeights {
    /// The buffers packed here.
    fn key(&self) -> Key {
        self.sources.iter().map(HostMatrix::key).collect()
    }

    /// `[panels, k, PANEL]`
    fn panels(&self) -> &[f32] {
        bytemuck::cast_slice(&self.buffer)
    }

    fn pack(weights: &[&HostMatrix]) -> Self {
        let k = weights[0].rows();
        let widths: Vec<usize> = weights.iter().map(|weight| weight.columns).collect();
        // Each concatenated column: its weight's elements and the column's index in it.
        let columns: Vec<(&[f32], Layout, usize, usize)> = weights
            .iter()
            .flat_map(|weight| {
                let n = weight.columns;
                (0..n).map(move |column| (weight.floats(), weight.layout, n, column))
            })
            .collect();
        let len = columns.len().div_ceil(PANEL) * k * PANEL;
        let mut buffer = zeroed_pages(len);
        bytemuck::cast_slice_mut::<u8, f32>(&mut buffer)
            .par_chunks_mut(k * PANEL)
            .zip(columns.par_chunks(PANEL))
            .for_each(|(panel, columns)| {
                // Feature by feature, so that a row-major weight is read in runs of columns.
                for (feature, weights) in panel.chunks_exact_mut(PANEL).enumerate() {
                    for (weight, &(elements, layout, n, column)) in weights.iter_mut().zip(columns)
                    {
                        *weight = match layout {
                            Layout::RowMajor => elements[feature * n + column],
                            Layout::ColumnMajor => elements[column * k + feature],
                        };
                    }
                }
            });
        Self {
            buffer,
            k,
            segments: segments(&widths),
            widths,
            sources: weights.iter().map(|&weight| weight.clone()).collect(),
            blocking: PrefillBlocking::for_this_cpu(),
        }
    }

    /// `x · weight_i + bias_i` for every packed weight: one task per run of panels, several per
    /// thread.
    ///
    /// # Shapes
    /// - `x`: `[rows, k]` row-major, `rows` from 1 to 8; `biases[i]`: `[n_i]`
    /// - outputs: `[rows, n_i]`
    pub(super) fn product(
        &self,
        x: &[f32],
        rows: usize,
        biases: &[Option<&[f32]>],
    ) -> Vec<Vec<f32>> {
        self.product_in_passes(x, rows, biases, simd::rows_per_panel_pass())
    }

    /// [`Self::product`], at most `pass` rows over a panel at once.
    fn product_in_passes(
        &self,
        x: &[f32],
        rows: usize,
        biases: &[Option<&[f32]>],
        pass: usize,
    ) -> Vec<Vec<f32>> {
        assert!((1..=MAX_PRODUCT_ROWS).contains(&rows) && x.len() == rows * self.k);
        let passes: Vec<Pass> = Pass::ranges(0..rows, pass)
            .into_iter()
            .map(|rows| Pass::new(x, self.k, rows))
            .collect();
        let panels = self.panels().len() / (self.k * PANEL);
        let tasks = 4 * rayon::current_num_threads().max(1);
        let per_task = panels.div_ceil(tasks);
        // `[panels, rows, PANEL]`: each task's panels are one piece.
        let mut by_panel = vec![0.0f32; panels * rows * PANEL];
        by_panel
            .par_chunks_mut(per_task * rows * PANEL)
            .zip(self.panels().par_chunks(per_task * self.k * PANEL))
            .for_each(|(out, panels)| {
                if let [pass] = passes.as_slice() {
                    simd::rows_times_panels_f32(&pass.x_by_feature, rows, panels, 0..self.k, out);
                    return;
                }
                // Rows in passes that fit the registers, each over the same panels.
                let mut part = Vec::new();
                for pass in &passes {
                    let (first, count) = (pass.first, pass.rows);
                    part.resize(out.len() / rows * count, 0.0);
                    simd::rows_times_panels_f32(
                        &pass.x_by_feature,
                        count,
                        panels,
                        0..self.k,
                        &mut part,
                    );
                    for (out, part) in out
                        .chunks_exact_mut(rows * PANEL)
                        .zip(part.chunks_exact(count * PANEL))
                    {
                        out[first * PANEL..(first + count) * PANEL].copy_from_slice(part);
                    }
                }
            });
        let mut outputs: Vec<Vec<f32>> = self.widths.iter().map(|&n| vec![0.0; rows * n]).collect();
        let mut whole = OutputTile::grid(&mut outputs, &self.widths, &[0], &[0]);
        for (sums, segments) in by_panel.chunks_exact(rows * PANEL).zip(&self.segments) {
            self.write_rows(sums, 0, segments, biases, &mut whole[0]);
        }
        outputs
    }

    /// A prefill's products, `x · weight_i + bias_i` for every packed weight: its rows in blocks
    /// and its panels in runs, one task per block and run, which multiplies its rows (in passes
    /// that fit the registers) by a few panels at a time, a run of features at a time where this
    /// CPU's [`PrefillBlocking`] says so (a panel's part then stays in the first-level cache for
    /// all the block's passes); the block's inputs stay in the second-level cache, and the sums
    /// go to the outputs' rows once all features are added. Few rows are cut in as many blocks
    /// as the blocking asks per thread; where there are still fewer blocks than threads, each
    /// block's panels are cut in runs, one task per thread: each task then reads its part of the
    /// weights, where smaller blocks would each read all of them. Otherwise the blocks that one
    /// piece of rayon's split of the tasks takes in turn are transposed in one set of buffers: a
    /// call holds a few blocks' inputs by feature at once, not all of its rows'.
    ///
    /// # Shapes
    /// - `x`: `[rows, k]` row-major; `biases[i]`: `[n_i]`
    /// - outputs: `[rows, n_i]`
    pub(super) fn product_of_many_rows(
        &self,
        x: &[f32],
        rows: usize,
        biases: &[Option<&[f32]>],
    ) -> Vec<Vec<f32>> {
        let k = self.k;
        assert!(rows > 0 && x.len() == rows * k);
        let panels = self.panels().len() / (k * PANEL);
        let threads = rayon::current_num_threads().max(1);
        let pass = simd::rows_per_panel_pass();
        // Each block's rows in passes.
        let blocks = self.blocking.blocks(rows, threads, pass, MAX_BLOCK_ROWS);
        let blocks: Vec<Vec<Range<usize>>> = even_parts(rows, blocks)
            .into_iter()
            .map(|block| Pass::ranges(block, pass))
            .collect();
        let runs = even_parts(panels, threads.div_ceil(blocks.len()).min(panels));
        // Where a block is cut in runs, the inputs by feature of its passes, made by the first of
        // its tasks to take each.
        let shared: Vec<Vec<OnceLock<Pass>>> = match runs.len() {
            1 => Vec::new(),
            _ => blocks
                .iter()
                .map(|passes| passes.iter().map(|_| OnceLock::new()).collect())
                .collect(),
        };
        let mut outputs: Vec<Vec<f32>> = self.widths.iter().map(|&n| vec![0.0; rows * n]).collect();
        let mut tiles = OutputTile::grid(
            &mut outputs,
            &self.widths,
            &blocks
                .iter()
                .map(|passes| passes[0].start)
                .collect::<Vec<_>>(),
            &runs.iter().map(|run| run.start * PANEL).collect::<Vec<_>>(),
        );
        let blocks_and_runs = (0..blocks.len()).flat_map(|block| {
            let runs = runs.iter().enumerate();
            runs.map(move |(index, run)| (block, index, run.clone()))
        });
        tiles
            .par_iter_mut()
            .zip(blocks_and_runs.collect::<Vec<_>>())
            .for_each_init(Vec::new, |own, (tile, (block, run_index, run))| {
                let passes: Vec<&Pass> = match shared.get(block) {
                    // The block is this task's alone: its inputs go to the buffers of the block
                    // taken before in this piece of the split, mapped and cached already, where
                    // new buffers for each block would be mapped afresh (as large ones are, once
                    // freed).
                    None => {
                        Pass::refill(own, x, k, &blocks[block]);
                        own.iter().collect()
                    }
                    // The tasks of one block start at passes spread over it, so that they make
                    // different passes' inputs at once rather than wait for one another's.
                    Some(passes) => {
                        let first = run_index * passes.len() / runs.len();
                        let ranges = blocks[block][first..].iter().chain(&blocks[block][..first]);
                        let passes = passes[first..].iter().chain(&passes[..first]);
                        passes
                            .zip(ranges)
                            .map(|(pass, rows)| pass.get_or_init(|| Pass::new(x, k, rows.clone())))
                            .collect()
                    }
                };
                self.rows_times_run(&passes, run, biases, tile);
            });
        outputs
    }

    /// One task of [`Self::product_of_many_rows`]: a block of rows (its passes) times a run of
    /// panels, into the tile of the outputs they make.
    fn rows_times_run(
        &self,
        passes: &[&Pass],
        run: Range<usize>,
        biases: &[Option<&[f32]>],
        tile: &mut OutputTile,
    ) {
        let k = self.k;
        let features_at_once = self.blocking.features_at_once.min(k);
        let mut sums: Vec<Vec<f32>> = passes.iter().map(|_| Vec::new()).collect();
        for first in run.clone().step_by(PANELS_AT_ONCE) {
            let group = first..(first + PANELS_AT_ONCE).min(run.end);
            let panels = &self.panels()[group.start * k * PANEL..group.end * k * PANEL];
            for (sums, pass) in sums.iter_mut().zip(passes) {
                sums.resize(group.len() * pass.rows * PANEL, 0.0);
            }
            for start in (0..k).step_by(features_at_once) {
                let features = start..(start + features_at_once).min(k);
                for (panel_index, panel) in panels.chunks_exact(k * PANEL).enumerate() {
                    for (sums, pass) in sums.iter_mut().zip(passes) {
                        let size = pass.rows * PANEL;
                        simd::rows_times_panels_f32(
                            &pass.x_by_feature,
                            pass.rows,
                            panel,
                            features.clone(),
                            &mut sums[panel_index * size..][..size],
                        );
                    }
                }
            }
            for (sums, pass) in sums.iter().zip(passes) {
                let panel_sums = sums.chunks_exact(pass.rows * PANEL);
                for (sums, segments) in panel_sums.zip(&self.segments[group.clone()]) {
                    self.write_rows(sums, pass.first, segments, biases, tile);
                }
            }
        }
    }

    /// One panel's sums for a pass of rows (`[rows, PANEL]`, the first `first_row`), plus the
    /// biases, into the outputs' tile that holds them.
    fn write_rows(
        &self,
        sums: &[f32],
        first_row: usize,
        segments: &[Segment],
        biases: &[Option<&[f32]>],
        tile: &mut OutputTile,
    ) {
        for segment in segments {
            let bias = biases[segment.weight].map(|bias| &bias[segment.columns.clone()]);
            let first_column = tile.first_columns[segment.weight];
            let columns = segment.columns.start - first_column..segment.columns.end - first_column;
            let rows = &mut tile.rows[segment.weight][first_row - tile.first_row..];
            for (sums, row) in sums.chunks_exact(PANEL).zip(rows) {
                let out = &mut row[columns.clone()];
                let sums = &sums[segment.lanes.clone()];
                match bias {
                    Some(bias) => out
                        .iter_mut()
                        .zip(sums.iter().zip(bias))
                        .for_each(|(out, (sum, bias))| *out = sum + bias),
                    None => out.copy_from_slice(sums),
                }
            }
        }
    }
}

/// The part of every output that one task writes: a run of its rows and a run of its columns.
struct OutputTile<'a> {
    /// Per output, the tile's part of each of its rows (empty where the tile's columns are
    /// another output's).
    rows: Vec<Vec<&'a mut [f32]>>,
    /// The first row's index in the outputs.
    first_row: usize,
    /// Per output, the index of the tile's first column.
    first_columns: Vec<usize>,
}

impl<'a> OutputTile<'a> {
    /// The outputs cut in tiles, rows before each of `row_cuts` and the columns of the outputs
    /// side by side before each of `column_cuts` (each list ascending, starting at 0): a tile
    /// per run of rows and run of columns, the column runs of a row run next to each other.
    ///
    /// # Shapes
    /// - `outputs[i]`: `[rows, widths[i]]` row-major
    fn grid(
        outputs: &'a mut [Vec<f32>],
        widths: &[usize],
        row_cuts: &[usize],
        column_cuts: &[usize],
    ) -> Vec<Self> {
        let mut tiles: Vec<Self> = row_cuts
            .iter()
            .flat_map(|&first_row| {
                column_cuts.iter().map(move |_| Self {
                    rows: Vec::new(),
                    first_row,
                    first_columns: Vec::new(),
                })
            })
            .collect();
        let mut first_column_of_output = 0;
        for (output, &n) in outputs.iter_mut().zip(widths) {
            // Each cut of the columns side by side, as a column of this output.
            let columns: Vec<usize> = column_cuts
                .iter()
                .map(|&cut| cut.clamp(first_column_of_output, first_column_of_output + n))
                .map(|cut| cut - first_column_of_output)
                .collect();
            for tile in &mut tiles {
                tile.rows.push(Vec::new());
            }
            for (row, mut rest) in output.chunks_exact_mut(n).enumerate() {
                let row_run = row_cuts.partition_point(|&cut| cut <= row) - 1;
                let tiles = &mut tiles[row_run * column_cuts.len()..][..column_cuts.len()];
                for (tile, (&start, &end)) in tiles
                    .iter_mut()
                    .zip(columns.iter().zip(columns[1..].iter().chain([n].iter())))
                {
                    let (piece, tail) = std::mem::take(&mut rest).split_at_mut(end - start);
                    tile.rows.last_mut().expect("pushed above").push(piece);
                    rest = tail;
                }
            }
            for (tile, &first_column) in tiles.iter_mut().zip(columns.iter().cycle()) {
                tile.first_columns.push(first_column);
            }
            first_column_of_output += n;
        }
        tiles
    }
}

/// `0..len` cut in `parts` runs (at least 1, at most `len`) whose lengths differ by one at most.
fn even_parts(len: usize, parts: usize) -> Vec<Range<usize>> {
    let (least, longer) = (len / parts, len % parts);
    (0..parts)
        .map(|part| {
            let first = part * least + part.min(longer);
            first..first + least + usize::from(part < longer)
        })
        .collect()
}

/// Per panel of weights `widths` columns wide packed side by side, the runs of its lanes that
/// are columns of one weight.
fn segments(widths: &[usize]) -> Vec<Vec<Segment>> {
    let panels = widths.iter().sum::<usize>().div_ceil(PANEL);
    let mut segments = vec![Vec::new(); panels];
    let mut first_column = 0;
    for (weight, &n) in widths.iter().enumerate() {
        let mut column = 0;
        while column < n {
            let (panel, lane) = (
                (first_column + column) / PANEL,
                (first_column + column) % PANEL,
            );
            let len = (PANEL - lane).min(n - column);
            segments[panel].push(Segment {
                weight,
                columns: column..column + len,
                lanes: lane..lane + len,
            });
            column += len;
        }
        first_column += n;
    }
    segments
}

/// The features of a pass's inputs [`Pass::transpose_rows`] writes feature-major at a time.
const FEATURES_TRANSPOSED_AT_ONCE: usize = 256;

/// Zeroed memory for `floats` packed floats: pages of their own, so that the panels start at a
/// cache line (no vector load of a panel's `PANEL` weights spans two) and, on Linux, in 2 MiB
/// pages where the kernel has them to give: a decoding step streams every packed weight once,
/// and over 4 KiB pages it would walk the page tables every 4 KiB.
///
/// # Panics
/// Where the memory cannot be had, as a `Vec`'s allocation would.
fn zeroed_pages(floats: usize) -> MmapMut {
    let memory = MmapMut::map_anon(floats * size_of::<f32>()).expect("memory for packed weights");
    // Advice only: without transparent huge pages, 4 KiB pages serve as well.
    #[cfg(target_os = "linux")]
    let _ = memory.advise(memmap2::Advice::HugePage);
    memory
}

/// The most rows one task of [`PackedWeights::product_of_many_rows`] takes: its inputs, by
/// feature, stay in the core's second-level cache.
const MAX_BLOCK_ROWS: usize = 128;

/// The panels one task of [`PackedWeights::product_of_many_rows`] multiplies its rows by before
/// it writes their sums out: the sums of a block's rows for them stay in the core's cache.
const PANELS_AT_ONCE: usize = 8;

/// Lanes of one panel that are columns of one weight.
#[derive(Debug, Clone)]
struct Segment {
    /// The weight's index among those packed.
    weight: usize,
    /// Its columns.
    columns: std::ops::Range<usize>,
    /// The panel's lanes that hold them.
    lanes: std::ops::Range<usize>,
}

/// Rows taken over the panels at once: their inputs feature by feature.
struct Pass {
    /// The first row's index.
    first: usize,
    rows: usize,
    /// `[k, rows]`
    x_by_feature: Vec<f32>,
}

impl Pass {
    /// `rows` in as few passes of at most `per_pass` rows each as there can be, of sizes that
    /// differ by one at most (a last pass of a few rows would leave most of the registers idle):
    /// each pass's rows.
    fn ranges(rows: Range<usize>, per_pass: usize) -> Vec<Range<usize>> {
        let passes = even_parts(rows.len(), rows.len().div_ceil(per_pass));
        let first = rows.start;
        passes
            .into_iter()
            .map(|pass| first + pass.start..first + pass.end)
            .collect()
    }

    /// The pass of `x`'s `rows`.
    ///
    /// # Shapes
    /// - `x`: `[rows_of_x, k]` row-major
    fn new(x: &[f32], k: usize, rows: Range<usize>) -> Self {
        let mut pass = Self {
            first: rows.start,
            rows: rows.len(),
            x_by_feature: Vec::new(),
        };
        pass.transpose_rows(x, k, rows);
        pass
    }

    /// `passes` refilled with the passes of `x`'s rows in `ranges`, each in the buffer of the
    /// pass it replaces (passes beyond `ranges` dropped, new ones added where there are more).
    fn refill(passes: &mut Vec<Self>, x: &[f32], k: usize, ranges: &[Range<usize>]) {
        passes.truncate(ranges.len());
        for (index, rows) in ranges.iter().enumerate() {
            match passes.get_mut(index) {
                Some(pass) => pass.transpose_rows(x, k, rows.clone()),
                None => passes.push(Self::new(x, k, rows.clone())),
            }
        }
    }

    /// This pass made the pass of `x`'s `rows`: their inputs transposed to feature-major
    /// (`[k, rows]`), in its buffer.
    fn transpose_rows(&mut self, x: &[f32], k: usize, rows: Range<usize>) {
        let count = rows.len();
        (self.first, self.rows) = (rows.start, count);
        let x = &x[rows.start * k..rows.end * k];
        // Every float is written below: the buffer's old values need no clearing.
        let x_by_feature = &mut self.x_by_feature;
        x_by_feature.resize(k * count, 0.0);
        // A run of features at a time, each row's in turn: the run's writes, `count` floats
        // apart, stay in the first-level cache, where a row's whole `k` would not.
        for (run, x_by_feature) in x_by_feature
            .chunks_mut(FEATURES_TRANSPOSED_AT_ONCE * count)
            .enumerate()
        {
            let first = run * FEATURES_TRANSPOSED_AT_ONCE;
            let features = first..first + x_by_feature.len() / count;
            for (row, x) in x.chunks_exact(k).enumerate() {
                for (feature, &x) in x[features.clone()].iter().enumerate() {
                    x_by_feature[feature * count + row] = x;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::Flex;
    use burn::prelude::*;
    use burn::tensor::Distribution;

    use super::*;

    /// A plain `x · weight + bias`, row by row, in `f64`.
    fn reference(x: &[f32], rows: usize, weight: &[f32], n: usize, bias: &[f32]) -> Vec<f64> {
        let k = x.len() / rows;
        let mut out = vec![0.0f64; rows * n];
        for (row, out) in out.chunks_exact_mut(n).enumerate() {
            for (column, out) in out.iter_mut().enumerate() {
                *out = f64::from(bias[column])
                    + (0..k)
                        .map(|i| f64::from(x[row * k + i]) * f64::from(weight[i * n + column]))
                        .sum::<f64>();
            }
        }
        out
    }

    /// Rows in passes of fewer than all of them (as on a CPU without AVX-512) give the same sums
    /// as the passes this CPU takes, and a plain product's, on a width that ends inside a panel.
    #[test]
    fn passes_of_fewer_rows_give_the_same_sums() {
        let device = Default::default();
        let normal = Distribution::Normal(0.0, 1.0);
        let (k, n) = (29, 71);
        let weight = Tensor::<Flex, 2>::random([k, n], normal, &device);
        let host = HostMatrix::of(&weight).expect("bare flex");
        let packed = PackedWeights::pack(&[&host]);
        let bias: Vec<f32> = (0..n).map(|i| i as f32 / 7.0).collect();
        for rows in 1..=MAX_PRODUCT_ROWS {
            let x = Tensor::<Flex, 2>::random([rows, k], normal, &device);
            let x = x.into_data().into_vec::<f32>().expect("f32");
            let one_pass = packed.product(&x, rows, &[Some(&bias)]);
            for pass in [1, 2, 3] {
                let passes = packed.product_in_passes(&x, rows, &[Some(&bias)], pass);
                assert_eq!(passes, one_pass, "{rows} rows in passes of {pass}");
            }
            let expected = reference(&x, rows, host.floats(), n, &bias);
            for (ours, expected) in one_pass[0].iter().zip(expected) {
                assert!((f64::from(*ours) - expected).abs() <= 1e-5 * (1.0 + expected.abs()));
            }
        }
    }

    /// A pass holds its rows' inputs feature by feature, over more features than it transposes
    /// at once, and rows that do not start at the first, made anew or refilled in the buffer of a
    /// pass of other rows.
    #[test]
    fn a_pass_holds_its_rows_by_feature() {
        let k = 2 * FEATURES_TRANSPOSED_AT_ONCE + 37;
        let x: Vec<f32> = (0..9 * k).map(|i| i as f32).collect();
        let mut refilled = vec![Pass::new(&x, k, 0..9), Pass::new(&x, k, 0..2)];
        Pass::refill(&mut refilled, &x, k, std::slice::from_ref(&(3..8)));
        for pass in [Pass::new(&x, k, 3..8), refilled.pop().expect("one pass")] {
            assert_eq!((pass.first, pass.rows), (3, 5));
            assert_eq!(pass.x_by_feature.len(), 5 * k);
            for feature in 0..k {
                for row in 0..5 {
                    let expected = x[(3 + row) * k + feature];
                    assert_eq!(
                        pass.x_by_feature[feature * 5 + row],
                        expected,
                        "{feature}, {row}"
                    );
                }
            }
        }
        assert!(refilled.is_empty(), "the second pass is dropped");
    }

    /// A prefill's products add each output's terms in the order a decoding step's do, whatever
    /// its blocks of rows, runs of panels, passes, groups of panels and runs of features: the same
    /// bits as the rows taken one at a time, for weights packed side by side on widths that end
    /// inside a panel and inside a run of features, on 1 to 3 threads (which cut the work in
    /// other tiles: blocks that are one task's, whose inputs are transposed in the buffers of the
    /// block taken before in the same piece of rayon's split, of as many passes or fewer, and
    /// blocks cut in runs), with either measured [`PrefillBlocking`], whatever this CPU's.
    #[test]
    fn a_prefill_sums_as_a_decoding_step_does() {
        let device = Default::default();
        let normal = Distribution::Normal(0.0, 1.0);
        let features_at_once = PrefillBlocking::READ_WEIGHTS_ONCE.features_at_once;
        let k = 2 * features_at_once + 89;
        let widths = [(PANELS_AT_ONCE + 2) * PANEL + 7, 45, 3 * PANEL];
        let weights: Vec<HostMatrix> = widths
            .iter()
            .map(|&n| Tensor::<Flex, 2>::random([k, n], normal, &device))
            .map(|weight| HostMatrix::of(&weight).expect("bare flex"))
            .collect();
        let mut packed = PackedWeights::pack(&weights.iter().collect::<Vec<_>>());
        let biases: Vec<Vec<f32>> = widths
            .iter()
            .map(|&n| (0..n).map(|i| i as f32 / 7.0).collect())
            .collect();
        let biases: Vec<Option<&[f32]>> = [Some(&biases[0][..]), None, Some(&biases[2][..])].into();
        for rows in [9, 15, 29, 40, MAX_BLOCK_ROWS + 13, MAX_BLOCK_ROWS + 21] {
            let x = Tensor::<Flex, 2>::random([rows, k], normal, &device);
            let x = x.into_data().into_vec::<f32>().expect("f32");
            let mut row_by_row = vec![Vec::new(); widths.len()];
            for row in x.chunks_exact(k) {
                for (all, one) in row_by_row.iter_mut().zip(packed.product(row, 1, &biases)) {
                    all.extend(one);
                }
            }
            for blocking in [
                PrefillBlocking::READ_WEIGHTS_ONCE,
                PrefillBlocking::ROWS_PER_THREAD,
            ] {
                packed.blocking = blocking;
                for threads in 1..=3 {
                    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build();
                    let prefill = pool
                        .expect("a thread pool")
                        .install(|| packed.product_of_many_rows(&x, rows, &biases));
                    assert_eq!(
                        prefill, row_by_row,
                        "{rows} rows, {threads} threads, {blocking:?}"
                    );
                }
            }
        }
    }
}
