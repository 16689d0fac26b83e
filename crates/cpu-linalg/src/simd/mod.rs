//! The inner loops at the CPU's full vector width, of this crate and of attention-core's CPU
//! attention kernel: block products on `gemm`'s microkernels (AVX-512 where the CPU has it, chosen
//! at run time), the `f32` softmax loops (`max`, `exp(x − shift)` and its sum), the few-row and
//! panel products of `matvec.rs` and `packed.rs`, the nonlinearities, compiled once per
//! instruction set and picked at run time.
//!
//! Safe Rust here is compiled for baseline x86-64 (SSE2), and `matrixmultiply`'s `sgemm` stops
//! at AVX2: on a CPU with two AVX-512 FMA ports both leave half the machine idle. This is the
//! one module of the workspace that opts into `unsafe` (CONTRIBUTING.md): its public items
//! take ndarray views and slices, check what the unsafe calls rely on, and are tested against
//! the safe reference on sizes that are not multiples of the vector width.

#![allow(unsafe_code)]

use std::any::TypeId;
use std::ops::Range;

use ndarray::linalg::general_mat_mul;
use ndarray::{ArrayBase, Data, DataMut, Ix2, LinalgScalar};

/// `out ← alpha · lhs · rhs + beta · out`, as [`general_mat_mul`] (which it replaces in the
/// kernel), on `gemm` for `f32` and `f64`, single-threaded (the kernel's tasks are the
/// parallelism). `beta = 0` never reads `out`.
///
/// # Shapes
/// - `lhs`: `[m, k]`, `rhs`: `[k, n]`, `out`: `[m, n]`, any strides
///
/// # Panics
/// When the shapes do not agree.
pub fn mat_mul<E: LinalgScalar + PartialEq>(
    alpha: E,
    lhs: &ArrayBase<impl Data<Elem = E>, Ix2>,
    rhs: &ArrayBase<impl Data<Elem = E>, Ix2>,
    beta: E,
    out: &mut ArrayBase<impl DataMut<Elem = E>, Ix2>,
) {
    let ([m, k], [k_rhs, n]) = (lhs.dim().into(), rhs.dim().into());
    assert!(
        k == k_rhs && out.dim() == (m, n),
        "mat_mul of [{m}, {k}] by [{k_rhs}, {n}] into {:?}",
        out.dim()
    );
    let is_gemm_float =
        TypeId::of::<E>() == TypeId::of::<f32>() || TypeId::of::<E>() == TypeId::of::<f64>();
    if !is_gemm_float || m == 0 || n == 0 || k == 0 {
        // Empty products are ndarray's (gemm's handling of `k = 0` is not documented).
        general_mat_mul(alpha, lhs, rhs, beta, out);
        return;
    }
    let [lhs_rs, lhs_cs] = [lhs.strides()[0], lhs.strides()[1]];
    let [rhs_rs, rhs_cs] = [rhs.strides()[0], rhs.strides()[1]];
    let [out_rs, out_cs] = [out.strides()[0], out.strides()[1]];
    let read_out = beta != E::zero();
    // SAFETY: `gemm` reads `lhs[i, j]` at `lhs + i·lhs_rs + j·lhs_cs` for `i < m, j < k`, `rhs`
    // likewise for `i < k, j < n`, and reads and writes `out` for `i < m, j < n`: exactly the
    // elements of the three views, whose pointers and strides these are and whose shapes were
    // checked to agree above; ndarray guarantees every element of a view lies in its buffer.
    // `out` is a unique borrow, so it aliases neither input. `E` is `f32` or `f64` (checked
    // above), types gemm implements. Parallelism::None: no thread outlives the call.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            out_cs,
            out_rs,
            read_out,
            lhs.as_ptr(),
            lhs_cs,
            lhs_rs,
            rhs.as_ptr(),
            rhs_cs,
            rhs_rs,
            beta,
            alpha,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// Runs `$body` (an expression over the arguments) compiled for the best instruction set the
/// CPU has: AVX-512F, AVX2 + FMA, or baseline.
macro_rules! dispatch {
    ($(#[$doc:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),*) -> $out:ty = $body:path) => {
        $(#[$doc])*
        $vis fn $name($($arg: $ty),*) -> $out {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f")]
                fn avx512($($arg: $ty),*) -> $out {
                    $body($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                fn avx2($($arg: $ty),*) -> $out {
                    $body($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: `avx512` needs AVX-512F, which the CPU has (detected just above).
                    return unsafe { avx512($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: `avx2` needs AVX2 and FMA, which the CPU has (detected just above).
                    return unsafe { avx2($($arg),*) };
                }
            }
            $body($($arg),*)
        }
    };
}

mod widen;
pub use widen::{
    rows_by_stored_keys_bf16, rows_by_stored_keys_f16, rows_by_stored_keys_i8,
    weights_by_stored_values_bf16, weights_by_stored_values_f16, weights_by_stored_values_i8,
    widen_bf16_f32, widen_f16_f32, widen_i8_f32,
};

dispatch!(
    /// The largest element of `xs` (`-inf` for none).
    pub fn max_f32(xs: &[f32]) -> f32 = portable::max);
dispatch!(
    /// Each `x` of `xs` replaced by `exp(x − shift)`, and their sum.
    pub fn exp_shifted_sum_f32(xs: &mut [f32], shift: f32) -> f32 = portable::exp_shifted_sum);
dispatch!(pub(crate) fn rows_times_row_major_f32(
    x: &[f32], rows: usize, features: Range<usize>, weight_rows: &[f32], out: &mut [f32]
) -> () = portable::rows_times_row_major);
dispatch!(pub(crate) fn rows_times_column_major_f32(
    x: &[f32], rows: usize, weight: &[f32], bias: Option<&[f32]>, columns: Range<usize>,
    out: &mut [f32]
) -> () = portable::rows_times_column_major);

/// `out = x · panels` over a range of the features (see `portable::rows_times_panels`) on the
/// CPU's widest fused multiply-add: written with intrinsics, because the compiler vectorizes the
/// portable body's `rows × PANEL` sums across rows, with gathers, and spills them.
///
/// # Panics
/// When `rows` is 0 or over [`rows_per_panel_pass`], `features` is not within the `k` features,
/// or the slices are shorter than the shapes say.
pub(super) fn rows_times_panels_f32(
    x_by_feature: &[f32],
    rows: usize,
    panels: &[f32],
    features: Range<usize>,
    out: &mut [f32],
) {
    assert!(
        (1..=rows_per_panel_pass()).contains(&rows),
        "{rows} rows in one pass"
    );
    let k = x_by_feature.len() / rows;
    let count = panels.len() / (k * PANEL).max(1);
    assert!(
        x_by_feature.len() == k * rows
            && panels.len() == count * k * PANEL
            && out.len() == count * rows * PANEL
            && features.start <= features.end
            && features.end <= k,
        "{rows} rows of {k} features, {} panel weights, {} outputs, features {features:?}",
        panels.len(),
        out.len()
    );
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F (detected just above); the shapes were checked.
            return unsafe { x86::panels_avx512(x_by_feature, rows, panels, features, out) };
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU has AVX2 and FMA (detected just above); the shapes were checked.
            return unsafe { x86::panels_avx2(x_by_feature, rows, panels, features, out) };
        }
    }
    portable::rows_times_panels(x_by_feature, rows, panels, features, out);
}

/// [`rows_times_panels_f32`]'s bodies: each panel's sums in `rows × 2` AVX-512 or `rows × 4`
/// AVX2 registers, one fused multiply-add per weight vector and row.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;
    use std::ops::Range;

    use super::{AVX2_PANEL_ROWS, AVX512_PANEL_ROWS, PANEL};

    /// `$body::<R>$args` for the `R` among `$counts` that equals `$rows`.
    macro_rules! by_rows {
        ($body:ident, $rows:expr, $args:tt, [$($counts:literal)*]) => {
            match $rows {
                $($counts => $body::<$counts> $args,)*
                rows => unreachable!("{rows} rows: checked by the caller"),
            }
        };
    }

    /// # Safety
    /// The CPU has AVX-512F; `x_by_feature` is `[k, rows]`, `panels` `[count, k, PANEL]`,
    /// `out` `[count, rows, PANEL]`, `rows` from 1 to [`AVX512_PANEL_ROWS`], `features` within
    /// `0..k`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn panels_avx512(
        x_by_feature: &[f32],
        rows: usize,
        panels: &[f32],
        features: Range<usize>,
        out: &mut [f32],
    ) {
        const _: () = assert!(AVX512_PANEL_ROWS == 14);
        // SAFETY: the caller's contract, passed on.
        unsafe {
            by_rows!(
                avx512,
                rows,
                (x_by_feature, panels, features, out),
                [1 2 3 4 5 6 7 8 9 10 11 12 13 14]
            )
        }
    }

    /// # Safety
    /// The CPU has AVX2 and FMA; the shapes as [`panels_avx512`]'s, `rows` from 1 to
    /// [`AVX2_PANEL_ROWS`].
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn panels_avx2(
        x_by_feature: &[f32],
        rows: usize,
        panels: &[f32],
        features: Range<usize>,
        out: &mut [f32],
    ) {
        const _: () = assert!(AVX2_PANEL_ROWS == 3);
        // SAFETY: the caller's contract, passed on.
        unsafe { by_rows!(avx2, rows, (x_by_feature, panels, features, out), [1 2 3]) }
    }

    /// One instruction set's panel product, `R` rows: `$vector` registers of `$lanes` floats,
    /// `PANEL / $lanes` of them per row.
    macro_rules! panel_product {
        ($name:ident, $feature:literal, $vector:ty, $lanes:literal,
         $zero:ident, $load:ident, $splat:ident, $fmadd:ident, $store:ident) => {
            /// # Safety
            /// The CPU has the instruction set; `x_by_feature` is `[k, R]`, `panels`
            /// `[count, k, PANEL]`, `out` `[count, R, PANEL]`, `features` within `0..k`.
            #[target_feature(enable = $feature)]
            unsafe fn $name<const R: usize>(
                x_by_feature: &[f32],
                panels: &[f32],
                features: Range<usize>,
                out: &mut [f32],
            ) {
                const VECTORS: usize = PANEL / $lanes;
                let k = x_by_feature.len() / R;
                let x_by_feature = &x_by_feature[features.start * R..features.end * R];
                for (panel, out) in panels
                    .chunks_exact(k * PANEL)
                    .zip(out.chunks_exact_mut(R * PANEL))
                {
                    let panel = &panel[features.start * PANEL..features.end * PANEL];
                    let mut sums: [[$vector; VECTORS]; R] = [[$zero(); VECTORS]; R];
                    if features.start > 0 {
                        for (sums, out) in sums.iter_mut().zip(out.chunks_exact(PANEL)) {
                            for (i, sum) in sums.iter_mut().enumerate() {
                                // SAFETY: `out` is PANEL = VECTORS · $lanes elements.
                                *sum = unsafe { $load(out.as_ptr().add($lanes * i)) };
                            }
                        }
                    }
                    for (xs, weights) in x_by_feature.chunks_exact(R).zip(panel.chunks_exact(PANEL))
                    {
                        let mut vectors: [$vector; VECTORS] = [$zero(); VECTORS];
                        for (i, vector) in vectors.iter_mut().enumerate() {
                            // SAFETY: `weights` is PANEL = VECTORS · $lanes elements.
                            *vector = unsafe { $load(weights.as_ptr().add($lanes * i)) };
                        }
                        for (sums, &x) in sums.iter_mut().zip(xs) {
                            let x = $splat(x);
                            for (sum, &weights) in sums.iter_mut().zip(&vectors) {
                                *sum = $fmadd(x, weights, *sum);
                            }
                        }
                    }
                    for (out, sums) in out.chunks_exact_mut(PANEL).zip(&sums) {
                        for (i, &sum) in sums.iter().enumerate() {
                            // SAFETY: `out` is PANEL = VECTORS · $lanes elements.
                            unsafe { $store(out.as_mut_ptr().add($lanes * i), sum) };
                        }
                    }
                }
            }
        };
    }

    panel_product!(
        avx512,
        "avx512f",
        __m512,
        16,
        _mm512_setzero_ps,
        _mm512_loadu_ps,
        _mm512_set1_ps,
        _mm512_fmadd_ps,
        _mm512_storeu_ps
    );
    panel_product!(
        avx2,
        "avx2,fma",
        __m256,
        8,
        _mm256_setzero_ps,
        _mm256_loadu_ps,
        _mm256_set1_ps,
        _mm256_fmadd_ps,
        _mm256_storeu_ps
    );
}

dispatch!(pub(crate) fn silu_f32(xs: &mut [f32]) -> () = portable::silu);
dispatch!(pub(crate) fn gelu_tanh_f32(xs: &mut [f32]) -> () = portable::gelu_tanh);

/// The most rows [`rows_times_row_major_f32`] and [`rows_times_column_major_f32`] take: each row
/// count is its own unrolled loop, the accumulators of all rows held at once.
pub(crate) const MAX_PRODUCT_ROWS: usize = 8;

/// The output columns of one panel of a packed weight (`packed.rs`): two AVX-512 vectors.
pub(super) const PANEL: usize = 32;

/// The rows one pass of [`rows_times_panels_f32`] takes on a CPU with AVX-512: their
/// `rows × 2` sums, the panel's 2 weight vectors and a broadcast fill its 32 vector registers.
pub(crate) const AVX512_PANEL_ROWS: usize = 14;

/// The rows of a pass with AVX2: `rows × 4` sums and 4 weight vectors in its 16 registers.
const AVX2_PANEL_ROWS: usize = 3;

/// The most rows one pass of [`rows_times_panels_f32`] takes on this CPU: their `rows × PANEL`
/// sums stay in vector registers.
pub(super) fn rows_per_panel_pass() -> usize {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        return AVX512_PANEL_ROWS;
    }
    AVX2_PANEL_ROWS
}

/// The bodies, written so that the compiler vectorizes them at whatever width the instruction
/// set of the function they are inlined into allows (16 independent lanes, so that neither the
/// max nor the sum is a serial chain).
mod portable {
    use std::ops::Range;

    use super::PANEL;

    const LANES: usize = 16;

    /// `out += x[.., features] · weight_rows`: the weight rows of `features` (one contiguous
    /// piece of a row-major weight, streamed in order) times those features of every row.
    ///
    /// # Shapes
    /// - `x`: `[rows, k]`, row-major; `weight_rows`: `[features.len(), n]`, row-major
    /// - `out`: `[rows, n]`
    ///
    /// # Panics
    /// When `rows` is 0 or over 8, or the slices are shorter than the shapes say.
    #[inline(always)]
    pub fn rows_times_row_major(
        x: &[f32],
        rows: usize,
        features: Range<usize>,
        weight_rows: &[f32],
        out: &mut [f32],
    ) {
        match rows {
            1 => row_major::<1>(x, features, weight_rows, out),
            2 => row_major::<2>(x, features, weight_rows, out),
            3 => row_major::<3>(x, features, weight_rows, out),
            4 => row_major::<4>(x, features, weight_rows, out),
            5 => row_major::<5>(x, features, weight_rows, out),
            6 => row_major::<6>(x, features, weight_rows, out),
            7 => row_major::<7>(x, features, weight_rows, out),
            8 => row_major::<8>(x, features, weight_rows, out),
            _ => panic!("{rows} rows: a product takes 1 to 8"),
        }
    }

    /// Columns `columns` of `x · weight + bias`, `weight` column-major: `[n, k]` row-major, each
    /// output column's weights contiguous (the transpose of an embedding table, a tied LM head),
    /// so that a range of columns is one contiguous piece, streamed in order.
    ///
    /// # Shapes
    /// - `x`: `[rows, k]`, row-major; `weight`: `[n, k]`, row-major; `bias`: `[n]`
    /// - `out`: `[columns.len(), rows]`, column by column (a task's columns are one piece of the
    ///   whole output)
    ///
    /// # Panics
    /// When `rows` is 0 or over 8, or the slices are shorter than the shapes say.
    #[inline(always)]
    pub fn rows_times_column_major(
        x: &[f32],
        rows: usize,
        weight: &[f32],
        bias: Option<&[f32]>,
        columns: Range<usize>,
        out: &mut [f32],
    ) {
        match rows {
            1 => column_major::<1>(x, weight, bias, columns, out),
            2 => column_major::<2>(x, weight, bias, columns, out),
            3 => column_major::<3>(x, weight, bias, columns, out),
            4 => column_major::<4>(x, weight, bias, columns, out),
            5 => column_major::<5>(x, weight, bias, columns, out),
            6 => column_major::<6>(x, weight, bias, columns, out),
            7 => column_major::<7>(x, weight, bias, columns, out),
            8 => column_major::<8>(x, weight, bias, columns, out),
            _ => panic!("{rows} rows: a product takes 1 to 8"),
        }
    }

    /// `out = x · panels`, each panel's `rows × PANEL` sums over `features`, added to the sums
    /// over the features before them that `out` holds (unread when `features` starts at 0):
    /// a product taken over a few hundred features at a time keeps its operands in the core's
    /// first-level cache.
    ///
    /// # Shapes
    /// - `x_by_feature`: `[k, rows]` (the input transposed: one feature of every row together)
    /// - `panels`: `[panels, k, PANEL]`; `out`: `[panels, rows, PANEL]`
    ///
    /// # Panics
    /// When `rows` is 0 or over 14, or the slices are shorter than the shapes say.
    #[inline(always)]
    pub fn rows_times_panels(
        x_by_feature: &[f32],
        rows: usize,
        panels: &[f32],
        features: Range<usize>,
        out: &mut [f32],
    ) {
        let args = (x_by_feature, panels, features, out);
        match rows {
            1 => panels_of::<1>(args),
            2 => panels_of::<2>(args),
            3 => panels_of::<3>(args),
            4 => panels_of::<4>(args),
            5 => panels_of::<5>(args),
            6 => panels_of::<6>(args),
            7 => panels_of::<7>(args),
            8 => panels_of::<8>(args),
            9 => panels_of::<9>(args),
            10 => panels_of::<10>(args),
            11 => panels_of::<11>(args),
            12 => panels_of::<12>(args),
            13 => panels_of::<13>(args),
            14 => panels_of::<14>(args),
            _ => panic!("{rows} rows: a panel product takes 1 to 14"),
        }
    }

    #[inline(always)]
    fn panels_of<const R: usize>(
        (x_by_feature, panels, features, out): (&[f32], &[f32], Range<usize>, &mut [f32]),
    ) {
        let k = x_by_feature.len() / R;
        let x_by_feature = &x_by_feature[features.start * R..features.end * R];
        let by_feature = x_by_feature
            .chunks_exact(R)
            .map(|x| -> &[f32; R] { x.try_into().expect("R features") });
        for (panel, out) in panels
            .chunks_exact(k * PANEL)
            .zip(out.chunks_exact_mut(R * PANEL))
        {
            let panel = &panel[features.start * PANEL..features.end * PANEL];
            let mut sums = [[0.0f32; PANEL]; R];
            if features.start > 0 {
                for (sums, out) in sums.iter_mut().zip(out.chunks_exact(PANEL)) {
                    sums.copy_from_slice(out);
                }
            }
            for (xs, weights) in by_feature.clone().zip(panel.chunks_exact(PANEL)) {
                let weights: &[f32; PANEL] = weights.try_into().expect("PANEL weights");
                for (sums, &x) in sums.iter_mut().zip(xs) {
                    for (sum, &w) in sums.iter_mut().zip(weights) {
                        *sum += x * w;
                    }
                }
            }
            for (out, sums) in out.chunks_exact_mut(PANEL).zip(&sums) {
                out.copy_from_slice(sums);
            }
        }
    }

    /// `R` rows of `x`, one slice each.
    #[inline(always)]
    fn row_slices<const R: usize>(x: &[f32]) -> [&[f32]; R] {
        let k = x.len() / R;
        std::array::from_fn(|r| &x[r * k..(r + 1) * k])
    }

    /// One weight row at a time, read once: its product with each row's feature added into that
    /// row's outputs (which stay in the first-level cache).
    #[inline(always)]
    fn row_major<const R: usize>(
        x: &[f32],
        features: Range<usize>,
        weight_rows: &[f32],
        out: &mut [f32],
    ) {
        let rows = row_slices::<R>(x);
        let n = out.len() / R;
        let mut outs: [&mut [f32]; R] = {
            let mut chunks = out.chunks_exact_mut(n);
            std::array::from_fn(|_| chunks.next().expect("R rows of n outputs"))
        };
        for (feature, weights) in features.zip(weight_rows.chunks_exact(n)) {
            for (out, row) in outs.iter_mut().zip(&rows) {
                let x = row[feature];
                for (o, &w) in out.iter_mut().zip(weights) {
                    *o += x * w;
                }
            }
        }
    }

    /// One output column at a time: its contiguous weights against every row, 16 lanes each.
    #[inline(always)]
    fn column_major<const R: usize>(
        x: &[f32],
        weight: &[f32],
        bias: Option<&[f32]>,
        columns: Range<usize>,
        out: &mut [f32],
    ) {
        let rows = row_slices::<R>(x);
        let k = rows[0].len();
        let tail = k - k % LANES;
        for (column, out) in columns.zip(out.chunks_exact_mut(R)) {
            let weights = &weight[column * k..(column + 1) * k];
            let mut lanes = [[0.0f32; LANES]; R];
            for (chunk, weights) in weights.chunks_exact(LANES).enumerate() {
                for (lanes, row) in lanes.iter_mut().zip(&rows) {
                    let row = &row[chunk * LANES..(chunk + 1) * LANES];
                    for ((lane, &x), &w) in lanes.iter_mut().zip(row).zip(weights) {
                        *lane += x * w;
                    }
                }
            }
            for ((out, lanes), row) in out.iter_mut().zip(&lanes).zip(&rows) {
                let rest: f32 = row[tail..]
                    .iter()
                    .zip(&weights[tail..])
                    .map(|(&x, &w)| x * w)
                    .sum();
                *out = lanes.iter().sum::<f32>() + rest + bias.map_or(0.0, |bias| bias[column]);
            }
        }
    }

    /// The largest element, `-inf` for none. NaN is not expected (scores are finite or `-inf`).
    #[inline(always)]
    pub fn max(xs: &[f32]) -> f32 {
        let mut lanes = [f32::NEG_INFINITY; LANES];
        let chunks = xs.chunks_exact(LANES);
        let rest = chunks.remainder();
        for chunk in chunks {
            for (lane, &x) in lanes.iter_mut().zip(chunk) {
                *lane = if x > *lane { x } else { *lane };
            }
        }
        for (lane, &x) in lanes.iter_mut().zip(rest) {
            *lane = if x > *lane { x } else { *lane };
        }
        lanes.into_iter().fold(f32::NEG_INFINITY, f32::max)
    }

    /// `x ← exp(x − shift)` for every element; returns their sum.
    #[inline(always)]
    pub fn exp_shifted_sum(xs: &mut [f32], shift: f32) -> f32 {
        let mut lanes = [0.0f32; LANES];
        let mut chunks = xs.chunks_exact_mut(LANES);
        for chunk in &mut chunks {
            for (lane, x) in lanes.iter_mut().zip(chunk) {
                *x = exp(*x - shift);
                *lane += *x;
            }
        }
        for (lane, x) in lanes.iter_mut().zip(chunks.into_remainder()) {
            *x = exp(*x - shift);
            *lane += *x;
        }
        lanes.into_iter().sum()
    }

    /// `x ← x σ(x) = x / (1 + exp(−x))` for every element (SiLU).
    #[inline(always)]
    pub fn silu(xs: &mut [f32]) {
        for x in xs {
            *x /= 1.0 + exp(-*x);
        }
    }

    /// `x ← 0.5 x (1 + tanh(u)) = x / (1 + exp(−2u))`, `u = √(2/π) (x + 0.044715 x³)`, for every
    /// element (the tanh GELU).
    #[inline(always)]
    pub fn gelu_tanh(xs: &mut [f32]) {
        const TWO_SQRT_2_OVER_PI: f32 =
            (2.0 * std::f64::consts::FRAC_2_SQRT_PI * std::f64::consts::FRAC_1_SQRT_2) as f32;
        for x in xs {
            let twice_u = TWO_SQRT_2_OVER_PI * (*x + 0.044_715 * *x * *x * *x);
            *x /= 1.0 + exp(-twice_u);
        }
    }

    /// `exp(x)` within 2 ulp of libm (Cephes' `expf` polynomial; tested), branch-free so that
    /// it vectorizes; `std`'s `exp` is a scalar libm call, which would cost more than the block
    /// products. Inputs below −87 (where `exp` leaves the normal range), `-inf` among them,
    /// give 0.
    #[inline(always)]
    pub fn exp(x: f32) -> f32 {
        const LN2_HI: f32 = 0.693_359_4;
        const LN2_LO: f32 = -2.121_944_4e-4;
        // 1.5 · 2²³: adding it rounds to an integer held in the low bits of the mantissa.
        const SHIFTER: f32 = 12_582_912.0;
        let clamped = x.clamp(-87.0, 88.0);
        let shifted = clamped * std::f32::consts::LOG2_E + SHIFTER;
        let n = shifted - SHIFTER;
        let exponent = shifted.to_bits().wrapping_sub(SHIFTER.to_bits()) as i32;
        let r = clamped - n * LN2_HI - n * LN2_LO;
        let poly =
            ((((1.987_569_2e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
                + 1.666_666_5e-1)
                * r
                + 0.5;
        let y = (poly * r * r + r + 1.0) * f32::from_bits(((exponent + 127) << 23) as u32);
        if x < -87.0 { 0.0 } else { y }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::{Array2, ShapeBuilder};

    /// Deterministic values in [-4, 4).
    fn values(len: usize, seed: u32) -> Vec<f32> {
        test_support::values(len, seed.into())
            .into_iter()
            .map(|x| (4.0 * x) as f32)
            .collect()
    }

    /// Every length from 0 to 3 vector widths and a few beyond, so that every remainder of a
    /// 16-lane loop is run, on the dispatched path and the portable one.
    const LENGTHS: [usize; 8] = [0, 1, 7, 15, 16, 17, 47, 130];

    #[test]
    fn max_is_the_largest_element_at_every_length() {
        for len in LENGTHS {
            let mut xs = values(len, len as u32);
            if len > 3 {
                xs[len / 2] = f32::NEG_INFINITY;
            }
            let expected = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(max_f32(&xs), expected, "length {len}");
            assert_eq!(portable::max(&xs), expected, "length {len}");
        }
    }

    #[test]
    fn exp_shifted_sum_matches_libm_at_every_length() {
        for len in LENGTHS {
            let xs = values(len, 7 + len as u32);
            let shift = 1.5;
            let mut dispatched = xs.clone();
            let sum = exp_shifted_sum_f32(&mut dispatched, shift);
            let mut portable_xs = xs.clone();
            let portable_sum = portable::exp_shifted_sum(&mut portable_xs, shift);
            let mut expected_sum = 0.0f64;
            for ((&x, &got), &portable) in xs.iter().zip(&dispatched).zip(&portable_xs) {
                let expected = (x - shift).exp();
                expected_sum += expected as f64;
                assert!(
                    (got - expected).abs() <= 2.0 * f32::EPSILON * expected,
                    "{x}: {got}"
                );
                assert_eq!(
                    got, portable,
                    "the dispatched and portable bodies round alike"
                );
            }
            assert!(
                (sum as f64 - expected_sum).abs() <= 1e-5 * expected_sum.max(1.0),
                "sum at {len}"
            );
            assert!((portable_sum - sum).abs() <= 1e-5 * sum.max(1.0));
        }
    }

    #[test]
    fn fast_exp_is_within_two_ulp_of_libm() {
        let mut x = -87.0f32;
        while x < 88.0 {
            let (fast, exact) = (portable::exp(x), (x as f64).exp());
            let ulp = (exact as f32).to_bits().abs_diff(fast.to_bits());
            assert!(ulp <= 2, "exp({x}) = {fast}, libm {exact} ({ulp} ulp)");
            x += 0.0137;
        }
        assert_eq!(portable::exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(portable::exp(-100.0), 0.0);
        assert_eq!(portable::exp(0.0), 1.0);
    }

    #[test]
    fn exp_of_masked_scores_is_zero() {
        let mut xs = vec![f32::NEG_INFINITY, -100.0, -87.5, 0.0];
        let sum = exp_shifted_sum_f32(&mut xs, 0.0);
        assert_eq!(&xs[..3], &[0.0; 3]);
        assert_eq!((xs[3], sum), (1.0, 1.0));
    }

    /// The dispatched few-row products round exactly as their portable bodies (the same sums in
    /// the same order, only wider), for every row count and both layouts, on a feature range
    /// and a column range that start inside the weight.
    #[test]
    fn few_row_products_are_their_portable_bodies() {
        let (k, n) = (37, 70);
        let weight = values(k * n, 11);
        let bias = values(n, 12);
        for rows in 1..=MAX_PRODUCT_ROWS {
            let x = values(rows * k, rows as u32);
            let features = 5..k;
            let weight_rows = &weight[5 * n..];
            let mut expected = values(rows * n, 13);
            let mut got = expected.clone();
            portable::rows_times_row_major(&x, rows, features.clone(), weight_rows, &mut expected);
            rows_times_row_major_f32(&x, rows, features.clone(), weight_rows, &mut got);
            assert_eq!(got, expected, "row-major, {rows} rows");
            let columns = 3..n;
            let mut expected = vec![0.0; columns.len() * rows];
            let mut got = expected.clone();
            portable::rows_times_column_major(
                &x,
                rows,
                &weight,
                Some(&bias),
                columns.clone(),
                &mut expected,
            );
            rows_times_column_major_f32(&x, rows, &weight, Some(&bias), columns.clone(), &mut got);
            assert_eq!(got, expected, "column-major, {rows} rows");
            // The first output against a plain sum: `x[0] · weight[.., 3] + bias[3]`.
            let plain: f32 = (0..k).map(|i| x[i] * weight[3 * k + i]).sum::<f32>() + bias[3];
            assert!((got[0] - plain).abs() <= 1e-5 * (1.0 + plain.abs()));
        }
    }

    /// The dispatched panel products against their portable body (which rounds each product
    /// and sum apart), for every row count a pass takes, in passes of the rows this CPU's
    /// registers hold; and taken over two runs of features, the same bits as over all at once.
    #[test]
    fn panel_products_are_their_portable_bodies() {
        let k = 37;
        // `weight` as 2 panels of `[k, PANEL]` (the packed layout).
        let weight = values(2 * k * PANEL, 11);
        let panels = weight.as_slice();
        for rows in 1..=AVX512_PANEL_ROWS {
            let x = values(rows * k, rows as u32);
            // All rows' features side by side.
            let x_by_feature: Vec<f32> = (0..k * rows)
                .map(|i| x[(i % rows) * k + i / rows])
                .collect();
            let mut expected = vec![0.0; 2 * rows * PANEL];
            portable::rows_times_panels(&x_by_feature, rows, panels, 0..k, &mut expected);
            // The dispatched panels fuse each multiply-add (one rounding, not two), in passes
            // of the rows the registers hold, and in two runs of features.
            let pass = rows_per_panel_pass().min(rows);
            let rows_of = |xs: &[f32], first: usize, count: usize| -> Vec<f32> {
                xs.chunks_exact(rows)
                    .flat_map(|features| &features[first..first + count])
                    .copied()
                    .collect()
            };
            for first in (0..rows).step_by(pass) {
                let count = pass.min(rows - first);
                let x_by_feature = rows_of(&x_by_feature, first, count);
                let mut got = vec![f32::NAN; 2 * count * PANEL];
                rows_times_panels_f32(&x_by_feature, count, panels, 0..k, &mut got);
                let mut in_two_runs = vec![f32::NAN; 2 * count * PANEL];
                rows_times_panels_f32(&x_by_feature, count, panels, 0..20, &mut in_two_runs);
                rows_times_panels_f32(&x_by_feature, count, panels, 20..k, &mut in_two_runs);
                assert_eq!(
                    in_two_runs, got,
                    "panels in two runs of features, {rows} rows"
                );
                for (panel, got) in got.chunks_exact(count * PANEL).enumerate() {
                    let expected = &expected[(panel * rows + first) * PANEL..][..count * PANEL];
                    for (got, expected) in got.iter().zip(expected) {
                        let scale = 1.0 + expected.abs();
                        assert!(
                            (got - expected).abs() <= 1e-5 * scale,
                            "panels, {rows} rows"
                        );
                    }
                }
            }
            // Row 0's first column: `x[0] · panels[0][.., 0]`.
            let plain: f32 = (0..k).map(|i| x[i] * panels[i * PANEL]).sum();
            assert!((expected[0] - plain).abs() <= 1e-5 * (1.0 + plain.abs()));
        }
    }

    /// `mat_mul` against ndarray's `general_mat_mul` on odd sizes, row- and column-major and
    /// strided views, for `beta` 0 (the output's old values, NaN here, are not read) and 1.
    #[test]
    fn mat_mul_matches_general_mat_mul_on_every_layout() {
        for (m, k, n) in [
            (1, 1, 1),
            (3, 5, 7),
            (17, 64, 33),
            (64, 64, 128),
            (65, 19, 130),
        ] {
            let lhs = Array2::from_shape_vec((m, k), values(m * k, 1)).unwrap();
            let rhs_t = Array2::from_shape_vec((n, k), values(n * k, 2)).unwrap();
            // A wider buffer viewed by columns: strided rows, as the kernel's key blocks are.
            let wide = Array2::from_shape_vec((k, 2 * n).f(), values(2 * n * k, 3)).unwrap();
            let rhs_strided = wide.slice(ndarray::s![.., ..;2]);
            for rhs in [rhs_t.t(), rhs_strided] {
                for beta in [0.0f32, 1.0] {
                    let start = if beta == 0.0 { f32::NAN } else { 0.5 };
                    let mut expected = Array2::from_elem((m, n), 0.5f32);
                    general_mat_mul(0.25, &lhs.view(), &rhs, beta, &mut expected);
                    let mut got = Array2::from_elem((m, n), start);
                    mat_mul(0.25, &lhs.view(), &rhs, beta, &mut got.view_mut());
                    for (g, e) in got.iter().zip(&expected) {
                        assert!(
                            (g - e).abs() <= 1e-5 * (1.0 + e.abs()),
                            "{m}x{k}x{n}: {g} vs {e}"
                        );
                    }
                }
            }
        }
    }
}
