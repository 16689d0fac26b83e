//! Products of a few rows (a decoding step's tokens, at most eight) with a weight matrix read
//! where it lies, for `products.rs`.
//!
//! Burn's matmul hands a `[rows, in] × [in, out]` product to `gemm` (flex) or `matrixmultiply`
//! (ndarray), which pack the weight matrix into their tile layout on every call: at one to eight
//! rows that packing is most of the work, and the product runs on one thread. Here each weight is read once,
//! in place, by one task per piece of the weight.

use rayon::prelude::*;

use super::host_matrix::Layout;
use super::simd;

/// `x · weight + bias` for a few rows, each task reading its piece of the weight in place.
///
/// # Shapes
/// - `x`: `[rows, k]`, `weight`: `[k, n]` in its `layout`, `bias`: `[n]`, output: `[rows, n]`
pub(super) fn product(
    x: &[f32],
    rows: usize,
    (weight, layout): (&[f32], Layout),
    bias: Option<&[f32]>,
    tasks: usize,
) -> Vec<f32> {
    let k = x.len() / rows;
    let n = weight.len() / k;
    match layout {
        // The bias joins the tasks' partial sums once they are added.
        Layout::RowMajor => with_bias(row_major(x, rows, n, weight, tasks), bias),
        Layout::ColumnMajor => column_major(x, rows, n, weight, bias, tasks),
    }
}

/// `x · weight`, `weight` row-major `[k, n]`: each task streams one contiguous run of the
/// weight's rows (its share of the input features) into partial sums, which are then added.
fn row_major(x: &[f32], rows: usize, n: usize, weight: &[f32], tasks: usize) -> Vec<f32> {
    let per_task = (x.len() / rows).div_ceil(tasks);
    let sum = weight
        .par_chunks(per_task * n)
        .enumerate()
        .map(|(task, weight_rows)| {
            let start = task * per_task;
            let features = start..start + weight_rows.len() / n;
            let mut partial = vec![0.0f32; rows * n];
            simd::rows_times_row_major_f32(x, rows, features, weight_rows, &mut partial);
            partial
        })
        .reduce_with(|mut total, partial| {
            total.iter_mut().zip(&partial).for_each(|(t, p)| *t += p);
            total
        });
    sum.expect("k > 0: at least one task")
}

/// `output + bias` in every row.
fn with_bias(mut output: Vec<f32>, bias: Option<&[f32]>) -> Vec<f32> {
    let Some(bias) = bias else {
        return output;
    };
    for row in output.chunks_exact_mut(bias.len()) {
        row.iter_mut().zip(bias).for_each(|(o, b)| *o += b);
    }
    output
}

/// `x · weight + bias`, `weight` column-major (`[n, k]` row-major): each task computes one
/// contiguous run of output columns, streaming their weights in order (the bias added to each
/// column's sum).
fn column_major(
    x: &[f32],
    rows: usize,
    n: usize,
    weight: &[f32],
    bias: Option<&[f32]>,
    tasks: usize,
) -> Vec<f32> {
    let per_task = n.div_ceil(tasks);
    // The output column by column (`[n, rows]`), so that each task's columns are one piece.
    let mut by_column = vec![0.0f32; n * rows];
    by_column
        .par_chunks_mut(per_task * rows)
        .enumerate()
        .for_each(|(task, out)| {
            let start = task * per_task;
            let columns = start..start + out.len() / rows;
            simd::rows_times_column_major_f32(x, rows, weight, bias, columns, out);
        });
    if rows == 1 {
        return by_column;
    }
    (0..rows * n)
        .map(|i| by_column[(i % n) * rows + i / n])
        .collect()
}
