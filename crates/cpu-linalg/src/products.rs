//! Projections, `x · weight + bias`, on the bare CPU backends: on weights packed once in
//! panels (`packed.rs`), the weights of one input packed side by side and multiplied as one —
//! a decoding step's few rows split over the panels, a prefill's rows in blocks, one per task;
//! where packing does not pay ([`Packing`]) or a buffer's lifetime cannot be followed, a decoding
//! step's rows on `matvec.rs`'s loops over the weights in place and more rows on `gemm` over the
//! whole `[rows, in]` buffer (batch and sequence as one dimension, one block of rows or columns
//! per thread, the bias added in the same pass), every operand read where it lies.
//!
//! Burn's `Linear` on burn-flex runs a `[batch, seq, in]` input as one `gemm` per batch row
//! (on one thread each, in parallel over the batch) and adds the bias in a second, broadcasting
//! pass; burn-ndarray's `matrixmultiply` stops at AVX2; both pack the weight inside every call,
//! which at a decoding step's few rows is most of the work. A packed weight is never stale: it
//! is found by its buffer, which it holds unchanged (`packed.rs`), and an optimizer step's new
//! parameters are new buffers.

use burn::prelude::*;
use burn::tensor::{DType, TensorData};
use ndarray::{ArrayViewMut2, Axis, s};
use rayon::prelude::*;

use crate::host_matrix::{HostBackend, HostMatrix, Layout};
use crate::matvec;
use crate::packed::{self, PackedWeightsCache};
use crate::simd::{self, MAX_PRODUCT_ROWS};

/// The products of one input with `N` weights (and their biases), `x · weight + bias` each,
/// computed here, or `None` (nothing consumed) where Burn's matmul should run them: a dtype
/// other than `f32`, an empty product, or a weight that is a view neither row- nor column-major.
/// The backend is known by the type (`backends.rs` chose it); the dtype is checked here, once,
/// before any operand is read. At a decoding step's few rows their tasks run side by side, so
/// that a layer's three projections are one parallel pass over the three weights.
///
/// The outputs are made in their shape, not reshaped from `[rows, out_i]`: burn-ndarray would
/// give a reshape's axes of length 1 strides its own ops do not take for contiguous, and copy
/// the tensor element by element in each of them (`into_data` among them).
///
/// # Shapes
/// - `x`: `[..., in]`; each weight `[in, out_i]` (any layout), each bias `[out_i]`
/// - outputs: `[..., out_i]`
pub(crate) fn products<B: HostBackend, const D: usize, const N: usize>(
    x: &Tensor<B, D>,
    weights: [(&Tensor<B, 2>, Option<&Tensor<B, 1>>); N],
    packing: Packing,
) -> Option<[Tensor<B, D>; N]> {
    let dims = x.dims();
    let k = dims[D - 1];
    let rows: usize = dims[..D - 1].iter().product();
    let takes = |(weight, bias): &(&Tensor<B, 2>, Option<&Tensor<B, 1>>)| {
        let [k_weight, n] = weight.dims();
        k_weight == k
            && n > 0
            && weight.dtype() == DType::F32
            && bias.is_none_or(|bias| bias.dtype() == DType::F32)
    };
    if rows == 0 || k == 0 || x.dtype() != DType::F32 || !weights.iter().all(takes) {
        return None;
    }
    let mut operands = Vec::with_capacity(N);
    for (weight, bias) in weights {
        let bias = match bias {
            Some(bias) => Some(floats(bias.clone().into_data())?),
            None => None,
        };
        operands.push((HostMatrix::of(weight)?, bias));
    }
    let device = x.device();
    let x = &x.clone().reshape([rows, k]);
    // The input in place where it is one row-major piece (a layer's input usually is), or, for
    // `gemm`, a transposed one (a weight's gradient, `xᵀ · dy`).
    let x_in_place =
        HostMatrix::of(x).filter(|x| x.layout == Layout::RowMajor || rows > MAX_PRODUCT_ROWS);
    let x_copy;
    let (x, x_layout): (&[f32], Layout) = match &x_in_place {
        Some(x) => (x.floats(), x.layout),
        None => {
            x_copy = floats(x.clone().into_data())?;
            (&x_copy, Layout::RowMajor)
        }
    };
    let packed_weights = |cache| {
        let weights: Vec<&HostMatrix> = operands.iter().map(|(weight, _)| weight).collect();
        packed::packed(&weights, cache)
    };
    let biases: Vec<Option<&[f32]>> = operands.iter().map(|(_, bias)| bias.as_deref()).collect();
    let outputs: Vec<Vec<f32>> = if rows <= MAX_PRODUCT_ROWS {
        match packing {
            Packing::Always(cache) | Packing::FewRowsOnly(cache) => packed_weights(cache),
            Packing::Never => None,
        }
        .map(|packed| packed.product(x, rows, &biases))
        .unwrap_or_else(|| in_place(x, rows, &operands))
    } else if let Some(packed) = match packing {
        Packing::Always(cache) if x_layout == Layout::RowMajor => packed_weights(cache),
        _ => None,
    } {
        packed.product_of_many_rows(x, rows, &biases)
    } else {
        // Each product is parallel already: one block of rows or columns per thread.
        operands
            .iter()
            .map(|(weight, bias)| many_rows((x, x_layout), rows, weight, bias.as_deref()))
            .collect()
    };
    let mut outputs = outputs.into_iter().zip(&operands);
    Some(std::array::from_fn(|_| {
        let (output, (weight, _)) = outputs.next().expect("one output per weight");
        let mut shape = dims;
        shape[D - 1] = weight.columns;
        Tensor::from_data(TensorData::new(output, shape), &device)
    }))
}

/// A weight and its bias, where there is one, as `B`'s tensors: an operand of [`products`].
pub(crate) type WeightAndBias<'a, B> = (&'a Tensor<B, 2>, Option<&'a Tensor<B, 1>>);

/// Whether a product packs its weights (`packed.rs`), at which row counts, and the module's cache
/// that keeps them packed: what packing buys depends on how long the weights stay as they are.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Packing<'a> {
    /// At every row count, packed once: parameters that many calls use as they are (a model
    /// that prefills and decodes).
    Always(&'a PackedWeightsCache),
    /// At a decoding step's few rows only, where reading the weights in place is slowest:
    /// parameters an optimizer step replaces. More rows run on `gemm`, which packs per call what
    /// a training step would pack anyway, and leaves the optimizer the only holder of its
    /// buffers.
    FewRowsOnly(&'a PackedWeightsCache),
    /// Never, every operand read in place: operands of this product alone (a backward's gradient
    /// or transposed weight).
    Never,
}

/// A decoding step's products on each weight in place (`matvec.rs`'s loops), side by side.
///
/// # Shapes
/// - `x`: `[rows, k]` row-major; each weight `[k, n_i]`, its bias `[n_i]`
/// - outputs: `[rows, n_i]`
fn in_place(x: &[f32], rows: usize, operands: &[(HostMatrix, Option<Vec<f32>>)]) -> Vec<Vec<f32>> {
    let tasks = 4 * rayon::current_num_threads().max(1);
    operands
        .par_iter()
        .map(|(weight, bias)| {
            let weight = (weight.floats(), weight.layout);
            matvec::product(x, rows, weight, bias.as_deref(), tasks)
        })
        .collect()
}

/// A prefill's product: the output starts as the bias in every row, and `gemm` adds
/// `x · weight` to it in one task per thread, each a block of the output's rows (when there are
/// more rows than columns) or of its columns (a weight streamed by one thread only), so that no
/// task waits on another.
///
/// # Shapes
/// - `x`: `[rows, k]` (either layout), `bias`: `[n]`, output: `[rows, n]`
fn many_rows(
    (x, x_layout): (&[f32], Layout),
    rows: usize,
    weight: &HostMatrix,
    bias: Option<&[f32]>,
) -> Vec<f32> {
    let k = x.len() / rows;
    let n = weight.columns;
    let mut output = match bias {
        Some(bias) => bias.repeat(rows),
        None => vec![0.0; rows * n],
    };
    let x = x_layout
        .view(rows, k, x)
        .expect("x holds rows · k elements");
    let weight = weight
        .layout
        .view(k, n, weight.floats())
        .expect("the weight holds k · n elements");
    let mut out = ArrayViewMut2::from_shape((rows, n), &mut output).expect("rows · n elements");
    let keep = if bias.is_some() { 1.0 } else { 0.0 };
    let threads = rayon::current_num_threads().max(1);
    if rows >= n {
        let block = rows.div_ceil(threads);
        let blocks: Vec<_> = out.axis_chunks_iter_mut(Axis(0), block).collect();
        blocks.into_par_iter().enumerate().for_each(|(i, mut out)| {
            let x = x.slice(s![i * block..i * block + out.nrows(), ..]);
            simd::mat_mul(1.0, &x, &weight, keep, &mut out);
        });
    } else {
        // Whole vectors of columns per block.
        let block = n.div_ceil(threads).next_multiple_of(16);
        let blocks: Vec<_> = out.axis_chunks_iter_mut(Axis(1), block).collect();
        blocks.into_par_iter().enumerate().for_each(|(i, mut out)| {
            let weight = weight.slice(s![.., i * block..i * block + out.ncols()]);
            simd::mat_mul(1.0, &x, &weight, keep, &mut out);
        });
    }
    output
}

/// A tensor's elements as `f32`, `None` for another dtype.
fn floats(data: TensorData) -> Option<Vec<f32>> {
    data.into_vec::<f32>().ok()
}

#[cfg(test)]
mod tests {
    use burn::backend::{Flex, NdArray};
    use burn::tensor::{Distribution, TensorPrimitive};

    use super::*;

    /// One product on the CPU kernel.
    fn product<B: HostBackend>(
        x: &Tensor<B, 2>,
        weight: &Tensor<B, 2>,
        bias: Option<&Tensor<B, 1>>,
        packing: Packing,
    ) -> Option<Tensor<B, 2>> {
        let [output] = products(x, [(weight, bias)], packing)?;
        Some(output)
    }

    /// Every way of reading the weights: packed at every row count, packed for a decoding
    /// step's rows only (`gemm` for more), in place; each of the first two keeps its packed
    /// weights in a cache of its own, which each new weight packs anew.
    fn packings(caches: &[PackedWeightsCache; 2]) -> [Packing<'_>; 3] {
        [
            Packing::Always(&caches[0]),
            Packing::FewRowsOnly(&caches[1]),
            Packing::Never,
        ]
    }

    /// Burn's `x · weight + bias`.
    fn burns<B: Backend>(
        x: &Tensor<B, 2>,
        weight: &Tensor<B, 2>,
        bias: Option<&Tensor<B, 1>>,
    ) -> Tensor<B, 2> {
        let product = x.clone().matmul(weight.clone());
        match bias {
            Some(bias) => product + bias.clone().unsqueeze(),
            None => product,
        }
    }

    /// The largest difference from Burn's product, relative to the magnitude of the terms
    /// (float32 rounding of a k-term sum).
    fn error<B: Backend>(
        ours: Tensor<B, 2>,
        x: &Tensor<B, 2>,
        weight: &Tensor<B, 2>,
        bias: Option<&Tensor<B, 1>>,
    ) -> f32 {
        let magnitude = x.clone().abs().matmul(weight.clone().abs()).add_scalar(1.0);
        let error = (ours - burns(x, weight, bias)).abs().div(magnitude).max();
        error.into_scalar().elem()
    }

    /// [`product`] against Burn's matmul (plus bias), every [`Packing`]: a decoding step's row
    /// counts (1 to 8) and a prefill's (9, 33, 40, 65, 130: several blocks of rows), widths that are
    /// not multiples of the 16 lanes nor the packed panels, both weight layouts, with and without
    /// a bias, and inputs and outputs wide enough that a prefill takes its features and its
    /// panels a few at a time.
    fn equals_burns_product<B: HostBackend>() {
        let device = Default::default();
        let caches = Default::default();
        for (rows, k, n) in [
            (1, 1, 1),
            (1, 19, 33),
            (7, 64, 130),
            (8, 33, 7),
            (3, 100, 96),
            (9, 40, 17),
            (65, 100, 130),
            (130, 48, 200),
            (33, 1000, 130),
            (40, 300, 300),
        ] {
            let x = Tensor::<B, 2>::random([rows, k], Distribution::Normal(0.0, 1.0), &device);
            let row_major = Tensor::<B, 2>::random([k, n], Distribution::Normal(0.0, 1.0), &device);
            // `[n, k]` viewed as `[k, n]`: an embedding table as a tied head.
            let column_major =
                Tensor::<B, 2>::random([n, k], Distribution::Normal(0.0, 1.0), &device).transpose();
            let bias = Tensor::<B, 1>::random([n], Distribution::Normal(0.0, 1.0), &device);
            for weight in [row_major, column_major] {
                for bias in [None, Some(&bias)] {
                    for packing in packings(&caches) {
                        let ours = product(&x, &weight, bias, packing).expect("a bare CPU backend");
                        let error = error(ours, &x, &weight, bias);
                        assert!(error <= 1e-6, "{rows}x{k}x{n} {packing:?}: {error}");
                    }
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

    /// Several weights of one input (queries, keys, values of different widths, one without a
    /// bias: packed side by side, panels hold columns of two or three of them), at a decoding
    /// step's rows and a prefill's, every [`Packing`], and an input that is a transposed view.
    fn several_weights_equal_burns<B: HostBackend>() {
        let device = Default::default();
        let caches = Default::default();
        let normal = Distribution::Normal(0.0, 1.0);
        let k = 37;
        let weights = [48, 17, 17].map(|n| Tensor::<B, 2>::random([k, n], normal, &device));
        let biases = [48, 17].map(|n| Tensor::<B, 1>::random([n], normal, &device));
        for rows in [1, 7, 65] {
            let contiguous = Tensor::<B, 2>::random([rows, k], normal, &device);
            let transposed = Tensor::<B, 2>::random([k, rows], normal, &device).transpose();
            for x in [contiguous, transposed] {
                let pairs = [
                    (&weights[0], Some(&biases[0])),
                    (&weights[1], Some(&biases[1])),
                    (&weights[2], None),
                ];
                for packing in packings(&caches) {
                    let outputs = products(&x, pairs, packing).expect("a bare CPU backend");
                    for (ours, (weight, bias)) in outputs.into_iter().zip(pairs) {
                        let error = error(ours, &x, weight, bias);
                        assert!(error <= 1e-6, "{rows} rows {packing:?}: {error}");
                    }
                }
            }
        }
    }

    #[test]
    fn several_weights_equal_burns_on_ndarray() {
        several_weights_equal_burns::<NdArray>();
    }

    #[test]
    fn several_weights_equal_burns_on_flex() {
        several_weights_equal_burns::<Flex>();
    }

    /// The outputs have the strides of a tensor burn-ndarray makes itself, axes of length 1
    /// included (a reshaped `[rows, out]` would not, and burn-ndarray's own ops then copy it
    /// element by element): a prefill of one sequence, a decoding step's rows, batched.
    #[test]
    fn outputs_are_contiguous_as_burn_ndarray_sees_them() {
        fn strides<const D: usize>(tensor: Tensor<NdArray, D>) -> Vec<isize> {
            match tensor.into_primitive() {
                TensorPrimitive::Float(burn::backend::ndarray::NdArrayTensor::F32(storage)) => {
                    storage.view().strides().to_vec()
                }
                _ => unreachable!("an f32 tensor"),
            }
        }
        let device = Default::default();
        let weight = Tensor::<NdArray, 2>::ones([16, 24], &device);
        for dims in [[1, 20, 16], [1, 1, 16], [3, 1, 16], [2, 9, 16]] {
            let x = Tensor::<NdArray, 3>::ones(dims, &device);
            let cache = PackedWeightsCache::default();
            let [output] =
                products(&x, [(&weight, None)], Packing::Always(&cache)).expect("bare ndarray");
            let made = Tensor::<NdArray, 3>::zeros([dims[0], dims[1], 24], &device);
            assert_eq!(strides(output), strides(made), "{dims:?}");
        }
    }

    /// Other float types and mismatched widths are Burn's to compute. (`Autodiff` tensors never
    /// reach [`products`], whose bound takes a bare backend's only: `backends.rs` hands their inner
    /// tensors to `products_op.rs`.)
    #[test]
    fn leaves_what_it_does_not_take_to_burn() {
        fn taken<B: HostBackend>(rows: usize, dtype: DType) -> bool {
            let device = Default::default();
            let x = Tensor::<B, 2>::ones([rows, 4], (&device, dtype));
            let weight = Tensor::ones([4, 3], (&device, dtype));
            product(&x, &weight, None, Packing::Always(&Default::default())).is_some()
        }
        assert!(taken::<Flex>(MAX_PRODUCT_ROWS, DType::F32));
        assert!(taken::<Flex>(MAX_PRODUCT_ROWS + 1, DType::F32));
        assert!(taken::<NdArray>(1, DType::F32));
        assert!(taken::<NdArray>(100, DType::F32));
        assert!(!taken::<NdArray<f64>>(1, DType::F64));
        assert!(!taken::<Flex>(1, DType::F64));
        let device = Default::default();
        let x = Tensor::<Flex, 2>::ones([2, 4], &device);
        let narrow = Tensor::<Flex, 2>::ones([3, 5], &device);
        let cache = PackedWeightsCache::default();
        assert!(product(&x, &narrow, None, Packing::Always(&cache)).is_none());
    }

    /// A cache holds the weights of its last product, packed, and their buffers: a product with
    /// another weight packs that one in place of the first, and once the cache is dropped (with
    /// the module that owns it) the weight is again the sole holder of its buffer.
    fn a_cache_holds_its_last_weights_until_dropped<B: HostBackend>() {
        let device = Default::default();
        let normal = Distribution::Normal(0.0, 1.0);
        let x = Tensor::<B, 2>::random([2, 211], normal, &device);
        let first = Tensor::<B, 2>::random([211, 97], normal, &device);
        let second = Tensor::<B, 2>::random([211, 98], normal, &device);
        let cache = PackedWeightsCache::default();
        let product = |weight: Tensor<B, 2>| {
            // The weight's buffer, held here only: once the tensor is dropped, whether anything
            // else holds it says whether the cache does.
            let host = HostMatrix::of(&weight).expect("a bare CPU backend");
            products(&x, [(&weight, None)], Packing::Always(&cache)).expect("a bare CPU backend");
            host
        };
        let first = product(first);
        assert!(cache.holds(first.key()), "packed at its first product");
        assert_eq!(first.sole_holder(), Some(false), "its buffer held");
        let second = product(second);
        assert!(cache.holds(second.key()), "the second weight packed");
        assert!(!cache.holds(first.key()), "in place of the first");
        assert_eq!(first.sole_holder(), Some(true), "the first let go");
        let clone = cache.clone();
        drop(cache);
        assert!(clone.is_packed(), "a clone shares the packed copy");
        assert_eq!(second.sole_holder(), Some(false), "held by the clone");
        drop(clone);
        assert_eq!(second.sole_holder(), Some(true), "let go with the cache");
    }

    /// A prefill's product packs its weights where they are parameters at inference, and reads
    /// them in place (`gemm`) where an optimizer replaces them or they serve this product alone.
    fn a_prefill_packs_only_parameters_at_inference<B: HostBackend>() {
        let device = Default::default();
        let normal = Distribution::Normal(0.0, 1.0);
        let x = Tensor::<B, 2>::random([65, 213], normal, &device);
        let weight = Tensor::<B, 2>::random([213, 99], normal, &device);
        let key = HostMatrix::of(&weight).expect("a bare CPU backend").key();
        let cache = PackedWeightsCache::default();
        for packing in [
            Packing::FewRowsOnly(&cache),
            Packing::Never,
            Packing::Always(&cache),
        ] {
            products(&x, [(&weight, None)], packing).expect("a bare CPU backend");
            let packed_at_any_rows = matches!(packing, Packing::Always(_));
            assert_eq!(cache.holds(key), packed_at_any_rows, "{packing:?}");
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
    fn a_cache_holds_its_last_weights_until_dropped_on_flex() {
        a_cache_holds_its_last_weights_until_dropped::<Flex>();
    }

    #[test]
    fn a_cache_holds_its_last_weights_until_dropped_on_ndarray() {
        a_cache_holds_its_last_weights_until_dropped::<NdArray>();
    }
}
