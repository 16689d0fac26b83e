//! Weights packed once, in panels of [`PANEL`] output columns, for `products.rs`: a decoding
//! step's products and a prefill's.
//!
//! At one to eight rows a product is a stream of its weights: read in place (`matvec.rs`), a
//! row-major weight gives each task whole weight rows, whose sums for every output column go
//! through memory once per weight row. Packed, each panel is `k` runs of `PANEL` weights in the
//! order they are used: a task holds one panel's `rows × PANEL` sums in registers while the
//! panel streams by once, and the tasks split the output columns, so they share no sums. A
//! prefill's rows take the same panel product in blocks of rows, one block per task, so that no
//! call packs its operands as `gemm` does in each. The weights of one call (a layer's queries,
//! keys and values) are packed side by side, as one `[in, q + 2·kv]` matrix, and multiplied as
//! one.
//!
//! Packing is done once per weight buffer, not per call: a packed matrix holds its sources'
//! buffers (a clone of each tensor), so that while it is in the cache no buffer can be freed
//! (its address reused by another tensor) or written in place (Burn's CPU backends write in place
//! only what one tensor alone holds, and copy the rest). A buffer's address then names its
//! contents: an optimizer step makes new parameter buffers, whose first product packs them anew,
//! and packed matrices whose sources only the cache still holds are dropped at the next packing.
//! [`release`] drops them all.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use rayon::prelude::*;

use super::products::{HostMatrix, Layout};
use super::simd::{self, MAX_PRODUCT_ROWS, PANEL};

/// Weights side by side, in panels of `PANEL` columns.
pub(super) struct PackedWeights {
    /// `[panels, k, PANEL]`: panel `p` holds the concatenated columns `p·PANEL ..` of every
    /// input feature, zero past the last column.
    panels: Vec<f32>,
    k: usize,
    /// The number of columns of each weight, in order.
    widths: Vec<usize>,
    /// Per panel, the runs of its lanes that are columns of one weight.
    segments: Vec<Vec<Segment>>,
    /// The packed tensors' buffers, held while packed (see the module's docs).
    sources: Vec<HostMatrix>,
}

/// Identifies a weight buffer while a packed matrix holds it: its address and length, its
/// layout and its number of columns.
type Key = Vec<(usize, usize, Layout, usize)>;

static CACHE: Mutex<Option<HashMap<Key, Arc<PackedWeights>>>> = Mutex::new(None);

/// The weights packed side by side, from the cache or packed now; `None` where a buffer's
/// lifetime cannot be followed (see [`HostMatrix::sole_holder`]): read in place then.
///
/// # Shapes
/// - each weight: `[k, n_i]`
pub(super) fn packed(weights: &[&HostMatrix]) -> Option<Arc<PackedWeights>> {
    if weights.iter().any(|weight| weight.sole_holder().is_none()) {
        return None;
    }
    let key: Key = weights.iter().map(|weight| weight.key()).collect();
    if let Some(packed) = cache().as_ref().and_then(|cache| cache.get(&key)) {
        return Some(packed.clone());
    }
    let packed = Arc::new(PackedWeights::pack(weights));
    let mut cache = cache();
    let cache = cache.get_or_insert_with(HashMap::new);
    // Matrices whose sources only the cache holds now: their parameters have moved on.
    cache.retain(|_, packed| {
        !packed
            .sources
            .iter()
            .any(|source| source.sole_holder() == Some(true))
    });
    Some(cache.entry(key).or_insert(packed).clone())
}

/// Drops every packed matrix (and its hold on the weights' buffers).
pub(crate) fn release() {
    *cache() = None;
}

/// Whether a packed matrix holds the buffer `key` names.
#[cfg(test)]
fn holds(key: (usize, usize, Layout, usize)) -> bool {
    cache()
        .as_ref()
        .is_some_and(|cache| cache.keys().any(|packed| packed.contains(&key)))
}

fn cache() -> std::sync::MutexGuard<'static, Option<HashMap<Key, Arc<PackedWeights>>>> {
    // A panic while the lock was held left the map whole (every change is one call).
    CACHE.lock().unwrap_or_else(PoisonError::into_inner)
}

impl PackedWeights {
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
        let mut panels = vec![0.0f32; columns.len().div_ceil(PANEL) * k * PANEL];
        panels
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
            panels,
            k,
            segments: segments(&widths),
            widths,
            sources: weights.iter().map(|&weight| weight.clone()).collect(),
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
        let passes = Pass::all(x, self.k, pass);
        let panels = self.panels.len() / (self.k * PANEL);
        let tasks = 4 * rayon::current_num_threads().max(1);
        let per_task = panels.div_ceil(tasks);
        // `[panels, rows, PANEL]`: each task's panels are one piece.
        let mut by_panel = vec![0.0f32; panels * rows * PANEL];
        by_panel
            .par_chunks_mut(per_task * rows * PANEL)
            .zip(self.panels.par_chunks(per_task * self.k * PANEL))
            .for_each(|(out, panels)| {
                if let [pass] = passes.as_slice() {
                    simd::rows_times_panels_f32(&pass.x_by_feature, rows, panels, out);
                    return;
                }
                // Rows in passes that fit the registers, each over the same panels.
                let mut part = Vec::new();
                for pass in &passes {
                    let (first, count) = (pass.first, pass.rows);
                    part.resize(out.len() / rows * count, 0.0);
                    simd::rows_times_panels_f32(&pass.x_by_feature, count, panels, &mut part);
                    for (out, part) in out
                        .chunks_exact_mut(rows * PANEL)
                        .zip(part.chunks_exact(count * PANEL))
                    {
                        out[first * PANEL..(first + count) * PANEL].copy_from_slice(part);
                    }
                }
            });
        let mut outputs: Vec<Vec<f32>> = self.widths.iter().map(|&n| vec![0.0; rows * n]).collect();
        let mut rows_of_outputs: Vec<&mut [f32]> =
            outputs.iter_mut().map(Vec::as_mut_slice).collect();
        for (sums, segments) in by_panel.chunks_exact(rows * PANEL).zip(&self.segments) {
            self.write_rows(sums, 0, segments, biases, &mut rows_of_outputs);
        }
        outputs
    }

    /// A prefill's products, `x · weight_i + bias_i` for every packed weight: one task per block
    /// of rows, which multiplies its rows (in passes that fit the registers) by every panel, a
    /// few panels at a time, so that each few streams from memory once per block and from the
    /// core's cache for each pass; the sums go straight to the outputs' rows.
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
        let pass = simd::rows_per_panel_pass();
        let threads = rayon::current_num_threads().max(1);
        let block = rows
            .div_ceil(2 * threads)
            .min(MAX_BLOCK_ROWS)
            .next_multiple_of(pass);
        let panels_at_once = (CACHED_PANEL_BYTES / (k * PANEL * size_of::<f32>())).max(1);
        let mut outputs: Vec<Vec<f32>> = self.widths.iter().map(|&n| vec![0.0; rows * n]).collect();
        // Each task's rows of every output.
        let mut blocks: Vec<Vec<&mut [f32]>> =
            (0..rows.div_ceil(block)).map(|_| Vec::new()).collect();
        for (output, &n) in outputs.iter_mut().zip(&self.widths) {
            for (block, rows) in blocks.iter_mut().zip(output.chunks_mut(block * n)) {
                block.push(rows);
            }
        }
        blocks
            .into_par_iter()
            .zip(x.par_chunks(block * k))
            .for_each(|(mut outputs, x)| {
                let passes = Pass::all(x, k, pass);
                let mut sums = Vec::new();
                for (group, panels) in self.panels.chunks(panels_at_once * k * PANEL).enumerate() {
                    let segments = &self.segments[group * panels_at_once..];
                    for pass in &passes {
                        sums.resize(panels.len() / k * pass.rows, 0.0);
                        simd::rows_times_panels_f32(
                            &pass.x_by_feature,
                            pass.rows,
                            panels,
                            &mut sums,
                        );
                        for (sums, segments) in sums.chunks_exact(pass.rows * PANEL).zip(segments) {
                            self.write_rows(sums, pass.first, segments, biases, &mut outputs);
                        }
                    }
                }
            });
        outputs
    }

    /// One panel's sums for a pass of rows (`[rows, PANEL]`, the first `first_row`), plus the
    /// biases, into the outputs' rows (each output a run of whole rows of `[rows, n_i]`).
    fn write_rows(
        &self,
        sums: &[f32],
        first_row: usize,
        segments: &[Segment],
        biases: &[Option<&[f32]>],
        outputs: &mut [&mut [f32]],
    ) {
        for segment in segments {
            let n = self.widths[segment.weight];
            let bias = biases[segment.weight].map(|bias| &bias[segment.columns.clone()]);
            for (row, sums) in sums.chunks_exact(PANEL).enumerate() {
                let start = (first_row + row) * n + segment.columns.start;
                let out = &mut outputs[segment.weight][start..][..segment.columns.len()];
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

/// The most rows one task of [`PackedWeights::product_of_many_rows`] takes: its inputs, by
/// feature, stay in the core's cache beside the panels.
const MAX_BLOCK_ROWS: usize = 128;

/// The bytes of panels one task multiplies its rows by before it moves on: a part of a core's
/// second-level cache.
const CACHED_PANEL_BYTES: usize = 384 * 1024;

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
    /// `x`'s rows in passes of at most `rows` each.
    ///
    /// # Shapes
    /// - `x`: `[rows_of_x, k]` row-major
    fn all(x: &[f32], k: usize, rows: usize) -> Vec<Self> {
        let rows_of_x = x.len() / k;
        (0..rows_of_x)
            .step_by(rows)
            .map(|first| {
                let count = rows.min(rows_of_x - first);
                let mut x_by_feature = vec![0.0f32; k * count];
                for (row, x) in x.chunks_exact(k).skip(first).take(count).enumerate() {
                    for (feature, &x) in x.iter().enumerate() {
                        x_by_feature[feature * count + row] = x;
                    }
                }
                Self {
                    first,
                    rows: count,
                    x_by_feature,
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::{Flex, NdArray};
    use burn::prelude::*;
    use burn::tensor::Distribution;

    use super::super::products::Reuse;
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

    /// A weight packed for one call is packed with it held; once every tensor of it is dropped,
    /// the next packing drops its packed copy (and the buffer with it).
    fn a_dropped_weight_is_unpacked_at_the_next_packing<B: Backend>() {
        let device = Default::default();
        let normal = Distribution::Normal(0.0, 1.0);
        // Sizes no other test uses, so that no other weight has this key.
        let x = Tensor::<B, 2>::random([2, 211], normal, &device);
        let weight = Tensor::<B, 2>::random([211, 97], normal, &device);
        let key = HostMatrix::of(&weight).expect("a bare CPU backend").key();
        crate::kernels::cpu::products(&x, [(&weight, None)], Reuse::Inference)
            .expect("a bare CPU backend");
        assert!(holds(key), "packed at its first product");
        drop(weight);
        let other = Tensor::<B, 2>::random([211, 98], normal, &device);
        crate::kernels::cpu::products(&x, [(&other, None)], Reuse::Inference)
            .expect("a bare CPU backend");
        assert!(!holds(key), "dropped at the next packing");
    }

    /// A prefill's product packs its weights where they are parameters at inference, and reads
    /// them in place (`gemm`) where an optimizer replaces them or they serve this product alone.
    fn a_prefill_packs_only_parameters_at_inference<B: Backend>() {
        let device = Default::default();
        let normal = Distribution::Normal(0.0, 1.0);
        // Sizes no other test uses, so that no other weight has this key.
        let x = Tensor::<B, 2>::random([65, 213], normal, &device);
        let weight = Tensor::<B, 2>::random([213, 99], normal, &device);
        let key = HostMatrix::of(&weight).expect("a bare CPU backend").key();
        for reuse in [Reuse::Training, Reuse::Once, Reuse::Inference] {
            crate::kernels::cpu::products(&x, [(&weight, None)], reuse)
                .expect("a bare CPU backend");
            assert_eq!(holds(key), reuse == Reuse::Inference, "{reuse:?}");
        }
    }

    #[test]
    fn a_prefill_packs_only_parameters_at_inference_on_flex() {
        a_prefill_packs_only_parameters_at_inference::<Flex>();
    }

    #[test]
    fn a_prefill_packs_only_parameters_at_inference_on_ndarray() {
        a_prefill_packs_only_parameters_at_inference::<NdArray>();
    }

    #[test]
    fn a_dropped_weight_is_unpacked_at_the_next_packing_on_flex() {
        a_dropped_weight_is_unpacked_at_the_next_packing::<Flex>();
    }

    #[test]
    fn a_dropped_weight_is_unpacked_at_the_next_packing_on_ndarray() {
        a_dropped_weight_is_unpacked_at_the_next_packing::<NdArray>();
    }
}
