//! Products of a few rows with a weight matrix read where it lies: a decoding step's projections
//! and LM head on the bare CPU backends.
//!
//! Burn's matmul hands a `[rows, in] × [in, out]` product to `gemm` (flex) or `matrixmultiply`
//! (ndarray), which pack the weight matrix into their tile layout on every call: at one to eight
//! rows that packing is most of the work (BENCHMARKS.md, "Where we stand": 44 % of a flex decode
//! step in `gemm`'s packing), and the product runs on one thread. Here each weight is read once,
//! in place, by one task per block of output columns. Nothing is packed ahead of time, so nothing
//! goes stale when an optimizer step changes a parameter: every call reads the weight's buffer
//! as it is.

use std::any::Any;

use burn::prelude::*;
use burn::tensor::{DType, TensorData, TensorPrimitive};
use rayon::prelude::*;

use super::simd::{self, MAX_PRODUCT_ROWS};

/// `x · weight + bias` computed here, or `None` (nothing consumed) where Burn's matmul should
/// run it: a backend other than bare ndarray or flex, a dtype other than `f32`, more than eight
/// rows, an empty product, or a weight that is a view neither row- nor column-major.
///
/// # Shapes
/// - `x`: `[rows, in]`, `weight`: `[in, out]` (any layout), `bias`: `[out]`
/// - output: `[rows, out]`
pub(crate) fn rows_times<B: Backend>(
    x: &Tensor<B, 2>,
    weight: &Tensor<B, 2>,
    bias: Option<&Tensor<B, 1>>,
) -> Option<Tensor<B, 2>> {
    let ([rows, k], [k_weight, n]) = (x.dims(), weight.dims());
    let fits = (1..=MAX_PRODUCT_ROWS).contains(&rows) && k > 0 && n > 0 && k == k_weight;
    if !fits || x.dtype() != DType::F32 {
        return None;
    }
    let weight = HostWeight::of(weight)?;
    let device = x.device();
    let x = floats(x.clone().into_data())?;
    let bias = match bias {
        Some(bias) => Some(floats(bias.clone().into_data())?),
        None => None,
    };
    let weights = weight.floats();
    let tasks = 4 * rayon::current_num_threads().max(1);
    let output = match weight.layout {
        Layout::RowMajor => row_major(&x, rows, weights, bias.as_deref(), tasks),
        Layout::ColumnMajor => column_major(&x, rows, weights, bias.as_deref(), tasks),
    };
    Some(Tensor::from_data(
        TensorData::new(output, [rows, n]),
        &device,
    ))
}

/// `x · weight + bias`, `weight` row-major `[k, n]`: each task streams one contiguous run of the
/// weight's rows (its share of the input features) into partial sums, which are then added.
///
/// # Shapes
/// - `x`: `[rows, k]`, `bias`: `[n]`, output: `[rows, n]`
fn row_major(
    x: &[f32],
    rows: usize,
    weight: &[f32],
    bias: Option<&[f32]>,
    tasks: usize,
) -> Vec<f32> {
    let k = x.len() / rows;
    let n = weight.len() / k;
    let per_task = k.div_ceil(tasks);
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
    let mut output = sum.expect("k > 0: at least one task");
    if let Some(bias) = bias {
        for row in output.chunks_exact_mut(n) {
            row.iter_mut().zip(bias).for_each(|(o, b)| *o += b);
        }
    }
    output
}

/// `x · weight + bias`, `weight` column-major (`[n, k]` row-major): each task computes one
/// contiguous run of output columns, streaming their weights in order.
///
/// # Shapes
/// - `x`: `[rows, k]`, `bias`: `[n]`, output: `[rows, n]`
fn column_major(
    x: &[f32],
    rows: usize,
    weight: &[f32],
    bias: Option<&[f32]>,
    tasks: usize,
) -> Vec<f32> {
    let k = x.len() / rows;
    let n = weight.len() / k;
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

/// A tensor's elements as `f32`, `None` for another dtype.
fn floats(data: TensorData) -> Option<Vec<f32>> {
    data.into_vec::<f32>().ok()
}

/// How a weight's elements lie in its buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Layout {
    /// `[in, out]` row-major: a `Linear`'s weight.
    RowMajor,
    /// `[out, in]` row-major, viewed transposed: an embedding table as a tied LM head.
    ColumnMajor,
}

/// A weight's buffer on a bare CPU backend, borrowed (the tensor's primitive keeps it alive).
struct HostWeight {
    primitive: Primitive,
    layout: Layout,
}

/// The backends whose float buffers this module reads in place.
enum Primitive {
    #[cfg(feature = "flex")]
    Flex(burn::backend::flex::FlexTensor),
    #[cfg(feature = "ndarray")]
    NdArray(burn::backend::ndarray::NdArrayTensor),
}

impl HostWeight {
    /// `weight`'s `f32` buffer, row- or column-major, or `None` for any other backend (under
    /// `Autodiff` too: a product that needs gradients is Burn's), dtype or layout.
    fn of<B: Backend>(weight: &Tensor<B, 2>) -> Option<Self> {
        let TensorPrimitive::Float(primitive) = weight.clone().into_primitive() else {
            return None;
        };
        let primitive: Box<dyn Any> = Box::new(primitive);
        #[cfg(feature = "flex")]
        let primitive = match primitive.downcast::<burn::backend::flex::FlexTensor>() {
            Ok(tensor) => {
                let (tensor, layout) = match tensor.as_slice::<f32>() {
                    Some(_) => (*tensor, Layout::RowMajor),
                    None => (tensor.transpose(0, 1), Layout::ColumnMajor),
                };
                let weight = Self {
                    primitive: Primitive::Flex(tensor),
                    layout,
                };
                return weight.readable().then_some(weight);
            }
            Err(other) => other,
        };
        #[cfg(feature = "ndarray")]
        if let Ok(tensor) = primitive.downcast::<burn::backend::ndarray::NdArrayTensor>() {
            use burn::backend::ndarray::NdArrayTensor;
            let NdArrayTensor::F32(storage) = &*tensor else {
                return None;
            };
            let layout = match storage.view().to_slice() {
                Some(_) => Layout::RowMajor,
                None => Layout::ColumnMajor,
            };
            let weight = Self {
                primitive: Primitive::NdArray(*tensor),
                layout,
            };
            return weight.readable().then_some(weight);
        }
        #[cfg(not(feature = "ndarray"))]
        let _ = primitive;
        None
    }

    /// Whether [`Self::floats`] can lend the buffer in `layout`.
    fn readable(&self) -> bool {
        self.slice().is_some()
    }

    /// The elements in `layout`'s order.
    fn floats(&self) -> &[f32] {
        self.slice().expect("checked when made")
    }

    fn slice(&self) -> Option<&[f32]> {
        match &self.primitive {
            #[cfg(feature = "flex")]
            Primitive::Flex(tensor) => tensor.as_slice::<f32>(),
            #[cfg(feature = "ndarray")]
            Primitive::NdArray(tensor) => match tensor {
                burn::backend::ndarray::NdArrayTensor::F32(storage) => match self.layout {
                    Layout::RowMajor => storage.view().to_slice(),
                    Layout::ColumnMajor => storage.view().reversed_axes().to_slice(),
                },
                _ => None,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::{Autodiff, Flex, NdArray};
    use burn::tensor::Distribution;

    use super::*;

    /// `rows_times` against Burn's matmul (plus bias): every row count it takes, widths that are
    /// not multiples of the 32-column tile or the 16 lanes, and both weight layouts.
    fn equals_burns_product<B: Backend>() {
        let device = Default::default();
        for (rows, k, n) in [
            (1, 1, 1),
            (1, 19, 33),
            (7, 64, 130),
            (8, 33, 7),
            (3, 100, 96),
        ] {
            let x = Tensor::<B, 2>::random([rows, k], Distribution::Normal(0.0, 1.0), &device);
            let row_major = Tensor::<B, 2>::random([k, n], Distribution::Normal(0.0, 1.0), &device);
            // `[n, k]` viewed as `[k, n]`: an embedding table as a tied head.
            let column_major =
                Tensor::<B, 2>::random([n, k], Distribution::Normal(0.0, 1.0), &device).transpose();
            let bias = Tensor::<B, 1>::random([n], Distribution::Normal(0.0, 1.0), &device);
            for weight in [row_major, column_major] {
                for bias in [None, Some(&bias)] {
                    let ours = rows_times(&x, &weight, bias).expect("a bare CPU backend");
                    let mut burns = x.clone().matmul(weight.clone());
                    if let Some(bias) = bias {
                        burns = burns + bias.clone().unsqueeze();
                    }
                    // Float32 rounding of a k-term sum, relative to the terms' magnitude.
                    let magnitude = x.clone().abs().matmul(weight.clone().abs()).add_scalar(1.0);
                    let error = (ours - burns).abs().div(magnitude).max().into_scalar();
                    let error: f32 = error.elem();
                    assert!(error <= 1e-6, "{rows}x{k}x{n}: {error}");
                }
            }
        }
    }

    #[test]
    fn equals_burns_product_on_ndarray() {
        equals_burns_product::<NdArray>();
    }

    #[test]
    fn equals_burns_product_on_flex() {
        equals_burns_product::<Flex>();
    }

    /// More rows than a decoding step, other float types and `Autodiff` are Burn's to compute.
    #[test]
    fn leaves_what_it_does_not_take_to_burn() {
        fn taken<B: Backend>(rows: usize, dtype: DType) -> bool {
            let device = Default::default();
            let x = Tensor::<B, 2>::ones([rows, 4], (&device, dtype));
            rows_times(&x, &Tensor::ones([4, 3], (&device, dtype)), None).is_some()
        }
        assert!(taken::<Flex>(MAX_PRODUCT_ROWS, DType::F32));
        assert!(taken::<NdArray>(1, DType::F32));
        assert!(!taken::<Flex>(MAX_PRODUCT_ROWS + 1, DType::F32));
        assert!(!taken::<NdArray<f64>>(1, DType::F64));
        assert!(!taken::<Flex>(1, DType::F64));
        assert!(!taken::<Autodiff<Flex>>(1, DType::F32));
    }
}
