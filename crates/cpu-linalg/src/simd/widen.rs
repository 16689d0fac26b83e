//! Stored keys and values widened to `f32`: attention-core's CPU kernel reads a cache kept in
//! `f16`, `bf16` or `int8` one block at a time into an `f32` scratch block, which its block
//! products then take as they take an `f32` cache.
//!
//! A decoding step's few query rows take the stored block directly instead
//! ([`rows_by_stored_keys_i8`], [`weights_by_stored_values_i8`] and their `f16` and `bf16`
//! twins): each stored row is widened in registers as the products read it, so the block is
//! read once, in its own bytes, and no scratch is written — at a few rows the widening into
//! scratch would cost as much as the products.
//!
//! `int8` and `bf16` are portable loops that the compiler vectorizes inside [`dispatch!`]'s
//! copies (a sign extension and a conversion; a shift). A block of `f16` is widened by the CPU's
//! half-precision conversion, which no portable Rust reaches: AVX-512F's 16-wide `vcvtph2ps`,
//! else F16C's 8-wide one (its own feature, on AVX2 machines), else `half`'s scalar conversion;
//! the products widen `f16` with integer operations and a select that vectorize like the others
//! (exact, subnormals and non-finite values included, with no subnormal arithmetic).

use half::{bf16, f16};

dispatch!(
    /// `to[i] = from[i]` as `f32`, for the shorter of the two lengths.
    pub fn widen_i8_f32(from: &[i8], to: &mut [f32]) -> () = portable::widen_i8);
dispatch!(
    /// `to[i] = from[i]` as `f32` (exact), for the shorter of the two lengths.
    pub fn widen_bf16_f32(from: &[bf16], to: &mut [f32]) -> () = portable::widen_bf16);

macro_rules! stored_products {
    ($t:ty, $dot:ident, $weighted:ident, $name:literal, $portable_dot:ident, $portable_weighted:ident, $x86_dot:ident, $x86_weighted:ident) => {
        dispatch!(fn $portable_dot(query: &[f32], keys: &[$t], head_dim: usize, scores: &mut [f32]) -> () = portable::rows_by_stored_keys::<$t>);
        dispatch!(fn $portable_weighted(weights: &[f32], values: &[$t], head_dim: usize, out: &mut [f32]) -> () = portable::weights_by_stored_values::<$t>);

        #[doc = concat!("`scores[r][j] = query[r] · keys[j]` for `", $name, "` keys: `query` `[rows, head_dim]`, `keys` `[cols, head_dim]`, `scores` `[rows, cols]` (overwritten), all row-major.")]
        ///
        /// # Panics
        /// When the lengths do not agree.
        pub fn $dot(query: &[f32], keys: &[$t], head_dim: usize, scores: &mut [f32]) {
            let (rows, cols) = (query.len() / head_dim.max(1), keys.len() / head_dim.max(1));
            assert!(
                head_dim > 0
                    && query.len() == rows * head_dim
                    && keys.len() == cols * head_dim
                    && scores.len() == rows * cols,
                "scores of [{}] by [{}] keys of {head_dim} into [{}]",
                query.len(),
                keys.len(),
                scores.len()
            );
            #[cfg(target_arch = "x86_64")]
            if head_dim % 16 == 0 && std::arch::is_x86_feature_detected!("avx512f") {
                // SAFETY: the CPU has AVX-512F (detected just above); `head_dim` is a positive
                // multiple of 16 and the three lengths are `rows`, `cols` and `rows · cols`
                // rows of it (asserted above), as the function requires.
                unsafe { x86::$x86_dot(query, keys, head_dim, scores) };
                return;
            }
            $portable_dot(query, keys, head_dim, scores);
        }

        #[doc = concat!("`out[r] += Σ_j weights[r][j] · values[j]` for `", $name, "` values: `weights` `[rows, cols]`, `values` `[cols, head_dim]`, `out` `[rows, head_dim]`, all row-major.")]
        ///
        /// # Panics
        /// When the lengths do not agree.
        pub fn $weighted(weights: &[f32], values: &[$t], head_dim: usize, out: &mut [f32]) {
            let (rows, cols) = (out.len() / head_dim.max(1), values.len() / head_dim.max(1));
            assert!(
                head_dim > 0
                    && out.len() == rows * head_dim
                    && values.len() == cols * head_dim
                    && weights.len() == rows * cols,
                "weights [{}] by [{}] values of {head_dim} into [{}]",
                weights.len(),
                values.len(),
                out.len()
            );
            #[cfg(target_arch = "x86_64")]
            if head_dim % 16 == 0
                && head_dim <= x86::MAX_HEAD_DIM
                && std::arch::is_x86_feature_detected!("avx512f")
            {
                // SAFETY: the CPU has AVX-512F (detected just above); `head_dim` is a positive
                // multiple of 16 of at most `MAX_HEAD_DIM`, and the three lengths are `rows ·
                // cols`, `cols` and `rows` rows of it (asserted above), as the function requires.
                unsafe { x86::$x86_weighted(weights, values, head_dim, out) };
                return;
            }
            $portable_weighted(weights, values, head_dim, out);
        }
    };
}
stored_products!(
    i8,
    rows_by_stored_keys_i8,
    weights_by_stored_values_i8,
    "int8",
    portable_dot_i8,
    portable_weighted_i8,
    dot_i8,
    weighted_i8
);
stored_products!(
    f16,
    rows_by_stored_keys_f16,
    weights_by_stored_values_f16,
    "f16",
    portable_dot_f16,
    portable_weighted_f16,
    dot_f16,
    weighted_f16
);
stored_products!(
    bf16,
    rows_by_stored_keys_bf16,
    weights_by_stored_values_bf16,
    "bf16",
    portable_dot_bf16,
    portable_weighted_bf16,
    dot_bf16,
    weighted_bf16
);

/// `to[i] = from[i]` as `f32` (exact).
///
/// # Panics
/// When the lengths differ.
pub fn widen_f16_f32(from: &[f16], to: &mut [f32]) {
    assert_eq!(from.len(), to.len(), "widening {} halves", from.len());
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: `f16_avx512` needs AVX-512F, which the CPU has (detected just above), and
            // slices of equal length (asserted above).
            unsafe { x86::f16_avx512(from, to) };
            return;
        }
        if std::arch::is_x86_feature_detected!("f16c") && std::arch::is_x86_feature_detected!("avx")
        {
            // SAFETY: `f16_f16c` needs F16C and AVX, which the CPU has (detected just above), and
            // slices of equal length (asserted above).
            unsafe { x86::f16_f16c(from, to) };
            return;
        }
    }
    portable::widen_f16(from, to);
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use half::{bf16, f16};

    /// The widest head the weighted sums hold in registers: 8 vectors of sums.
    pub(super) const MAX_HEAD_DIM: usize = 128;

    /// Products that widen 16 stored elements at a time in registers. `$widen` (compiled for
    /// the same features, so inlined) loads the 16 elements at a pointer and widens them; the
    /// products call it only where 16 lie there.
    macro_rules! stored_products_avx512 {
        ($t:ty, $dot:ident, $weighted:ident, $widen:ident) => {
            /// `scores[r][j] = query[r] · keys[j]`, four keys at a time.
            ///
            /// # Safety
            /// The CPU has AVX-512F; `head_dim` is a positive multiple of 16; `query`, `keys`
            /// and `scores` hold `rows`, `cols` and `rows · cols` rows of `head_dim`,
            /// `cols`-wide and `head_dim`-wide as the names say.
            #[target_feature(enable = "avx512f")]
            pub(super) unsafe fn $dot(
                query: &[f32],
                keys: &[$t],
                head_dim: usize,
                scores: &mut [f32],
            ) {
                let cols = keys.len() / head_dim;
                for (query, scores) in query
                    .chunks_exact(head_dim)
                    .zip(scores.chunks_exact_mut(cols))
                {
                    let mut j = 0;
                    while j < cols {
                        let block = (cols - j).min(4);
                        let mut sums = [_mm512_setzero_ps(); 4];
                        for at in (0..head_dim).step_by(16) {
                            // SAFETY: `at + 16 ≤ head_dim`: the query row's floats `at .. at
                            // + 16` and key `j + k`'s elements `at .. at + 16` (`j + k < cols`)
                            // lie in their slices; unaligned loads.
                            let q = unsafe { _mm512_loadu_ps(query.as_ptr().add(at)) };
                            for (k, sum) in sums.iter_mut().enumerate().take(block) {
                                let from = keys.as_ptr().wrapping_add((j + k) * head_dim + at);
                                // SAFETY: as the query's load above, for key `j + k`.
                                let key = unsafe { $widen(from) };
                                *sum = _mm512_fmadd_ps(q, key, *sum);
                            }
                        }
                        for (k, sum) in sums.iter().enumerate().take(block) {
                            scores[j + k] = _mm512_reduce_add_ps(*sum);
                        }
                        j += block;
                    }
                }
            }

            /// `out[r] += Σ_j weights[r][j] · values[j]`, a row's sums in registers.
            ///
            /// # Safety
            /// The CPU has AVX-512F; `head_dim` is a positive multiple of 16 of at most
            /// [`MAX_HEAD_DIM`]; `weights`, `values` and `out` hold `rows · cols`, `cols` and
            /// `rows` rows as the names say.
            #[target_feature(enable = "avx512f")]
            pub(super) unsafe fn $weighted(
                weights: &[f32],
                values: &[$t],
                head_dim: usize,
                out: &mut [f32],
            ) {
                let (cols, vectors) = (values.len() / head_dim, head_dim / 16);
                for (weights, out) in weights
                    .chunks_exact(cols)
                    .zip(out.chunks_exact_mut(head_dim))
                {
                    let mut sums = [_mm512_setzero_ps(); MAX_HEAD_DIM / 16];
                    for (v, sum) in sums.iter_mut().enumerate().take(vectors) {
                        // SAFETY: `16 v + 16 ≤ head_dim = out.len()`; an unaligned load.
                        *sum = unsafe { _mm512_loadu_ps(out.as_ptr().add(16 * v)) };
                    }
                    for (j, &weight) in weights.iter().enumerate() {
                        let weight = _mm512_set1_ps(weight);
                        for (v, sum) in sums.iter_mut().enumerate().take(vectors) {
                            let from = values.as_ptr().wrapping_add(j * head_dim + 16 * v);
                            // SAFETY: value `j < cols`'s elements `16 v .. 16 v + 16` (`16 v +
                            // 16 ≤ head_dim`) lie in `values`; `$widen` reads those 16.
                            let value = unsafe { $widen(from) };
                            *sum = _mm512_fmadd_ps(weight, value, *sum);
                        }
                    }
                    for (v, sum) in sums.iter().enumerate().take(vectors) {
                        // SAFETY: as the loads above; an unaligned store.
                        unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(16 * v), *sum) };
                    }
                }
            }
        };
    }

    /// 16 int8 at `at`, sign-extended and converted.
    ///
    /// # Safety
    /// The CPU has AVX-512F; 16 elements lie at `at`.
    #[target_feature(enable = "avx512f")]
    unsafe fn widen_i8(at: *const i8) -> __m512 {
        // SAFETY: 16 bytes at `at` (the caller's promise); an unaligned load.
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(unsafe { _mm_loadu_si128(at.cast()) }))
    }

    /// 16 halves at `at`, converted.
    ///
    /// # Safety
    /// The CPU has AVX-512F; 16 elements lie at `at`.
    #[target_feature(enable = "avx512f")]
    unsafe fn widen_f16(at: *const f16) -> __m512 {
        // SAFETY: 32 bytes at `at` (the caller's promise); an unaligned load.
        _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(at.cast()) })
    }

    /// 16 bfloats at `at`, each the top half of its `f32`.
    ///
    /// # Safety
    /// The CPU has AVX-512F; 16 elements lie at `at`.
    #[target_feature(enable = "avx512f")]
    unsafe fn widen_bf16(at: *const bf16) -> __m512 {
        // SAFETY: 32 bytes at `at` (the caller's promise); an unaligned load.
        let halves = _mm512_cvtepu16_epi32(unsafe { _mm256_loadu_si256(at.cast()) });
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(halves))
    }

    stored_products_avx512!(i8, dot_i8, weighted_i8, widen_i8);
    stored_products_avx512!(f16, dot_f16, weighted_f16, widen_f16);
    stored_products_avx512!(bf16, dot_bf16, weighted_bf16, widen_bf16);

    /// [`super::widen_f16_f32`] 16 at a time.
    ///
    /// # Safety
    /// The CPU has AVX-512F; `from` and `to` have the same length.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn f16_avx512(from: &[f16], to: &mut [f32]) {
        let whole = from.len() / 16 * 16;
        for at in (0..whole).step_by(16) {
            // SAFETY: `at + 16 ≤ whole ≤ len` for both slices (equal lengths, the caller's
            // promise): the 32-byte load reads halves `at .. at + 16` of `from` and the 64-byte
            // store writes floats `at .. at + 16` of `to`; both are unaligned accesses.
            unsafe {
                let halves = _mm256_loadu_si256(from.as_ptr().add(at).cast());
                _mm512_storeu_ps(to.as_mut_ptr().add(at), _mm512_cvtph_ps(halves));
            }
        }
        super::portable::widen_f16(&from[whole..], &mut to[whole..]);
    }

    /// [`super::widen_f16_f32`] 8 at a time.
    ///
    /// # Safety
    /// The CPU has F16C and AVX; `from` and `to` have the same length.
    #[target_feature(enable = "f16c,avx")]
    pub(super) unsafe fn f16_f16c(from: &[f16], to: &mut [f32]) {
        let whole = from.len() / 8 * 8;
        for at in (0..whole).step_by(8) {
            // SAFETY: `at + 8 ≤ whole ≤ len` for both slices (equal lengths, the caller's
            // promise): the 16-byte load reads halves `at .. at + 8` of `from` and the 32-byte
            // store writes floats `at .. at + 8` of `to`; both are unaligned accesses.
            unsafe {
                let halves = _mm_loadu_si128(from.as_ptr().add(at).cast());
                _mm256_storeu_ps(to.as_mut_ptr().add(at), _mm256_cvtph_ps(halves));
            }
        }
        super::portable::widen_f16(&from[whole..], &mut to[whole..]);
    }
}

mod portable {
    use half::{bf16, f16};

    const LANES: usize = 16;

    /// A stored element widened in registers.
    pub trait Widen: Copy {
        fn widen(self) -> f32;
    }

    impl Widen for i8 {
        #[inline(always)]
        fn widen(self) -> f32 {
            f32::from(self)
        }
    }

    impl Widen for bf16 {
        #[inline(always)]
        fn widen(self) -> f32 {
            f32::from_bits(u32::from(self.to_bits()) << 16)
        }
    }

    impl Widen for f16 {
        /// Branch-free, so that it vectorizes: a normal half is its bits moved into place and
        /// rebiased; a subnormal one its mantissa times 2⁻²⁴ (an integer conversion, no subnormal
        /// arithmetic); an infinity or NaN keeps its mantissa under an all-ones exponent.
        #[inline(always)]
        fn widen(self) -> f32 {
            let bits = u32::from(self.to_bits());
            let magnitude = bits & 0x7fff;
            let exponent = magnitude >> 10;
            let normal = f32::from_bits((magnitude << 13) + ((127 - 15) << 23));
            let subnormal = magnitude as f32 * f32::from_bits((127 - 24) << 23);
            let special = f32::from_bits((magnitude << 13) | 0x7f80_0000);
            let value = if exponent == 0 {
                subnormal
            } else if exponent == 0x1f {
                special
            } else {
                normal
            };
            f32::from_bits(value.to_bits() | ((bits & 0x8000) << 16))
        }
    }

    /// The sum of 16 lanes as a tree of constant widths, which the compiler unrolls into
    /// vector adds (a loop over the widths stayed scalar, 15 dependent adds per key).
    #[inline(always)]
    fn sum_lanes(mut lanes: [f32; LANES]) -> f32 {
        for i in 0..8 {
            lanes[i] += lanes[i + 8];
        }
        for i in 0..4 {
            lanes[i] += lanes[i + 4];
        }
        for i in 0..2 {
            lanes[i] += lanes[i + 2];
        }
        lanes[0] + lanes[1]
    }

    /// `query · key` over `D` features, `D` a multiple of the lanes: fixed-size arrays, which
    /// the compiler widens and multiplies a whole vector at a time (over slices it widened two
    /// bytes at a time).
    #[inline(always)]
    fn dot_fixed<T: Widen, const D: usize>(query: &[f32; D], key: &[T; D]) -> f32 {
        let mut lanes = [0.0f32; LANES];
        for (query, key) in query.chunks_exact(LANES).zip(key.chunks_exact(LANES)) {
            let (query, key): (&[f32; LANES], &[T; LANES]) = (
                query.try_into().expect("a chunk"),
                key.try_into().expect("a chunk"),
            );
            for (lane, sum) in lanes.iter_mut().enumerate() {
                *sum += query[lane] * key[lane].widen();
            }
        }
        sum_lanes(lanes)
    }

    #[inline(always)]
    fn dot<T: Widen>(query: &[f32], key: &[T]) -> f32 {
        query.iter().zip(key).map(|(&q, &k)| q * k.widen()).sum()
    }

    #[inline(always)]
    fn rows_by_keys<T: Widen, const D: usize>(query: &[f32], keys: &[T], scores: &mut [f32]) {
        let cols = keys.len() / D;
        for (query, scores) in query.chunks_exact(D).zip(scores.chunks_exact_mut(cols)) {
            let query: &[f32; D] = query.try_into().expect("a row of D");
            for (score, key) in scores.iter_mut().zip(keys.chunks_exact(D)) {
                *score = dot_fixed(query, key.try_into().expect("a row of D"));
            }
        }
    }

    #[inline(always)]
    pub fn rows_by_stored_keys<T: Widen>(
        query: &[f32],
        keys: &[T],
        head_dim: usize,
        scores: &mut [f32],
    ) {
        match head_dim {
            64 => rows_by_keys::<T, 64>(query, keys, scores),
            128 => rows_by_keys::<T, 128>(query, keys, scores),
            _ => {
                let cols = keys.len() / head_dim;
                for (query, scores) in query
                    .chunks_exact(head_dim)
                    .zip(scores.chunks_exact_mut(cols))
                {
                    for (score, key) in scores.iter_mut().zip(keys.chunks_exact(head_dim)) {
                        *score = dot(query, key);
                    }
                }
            }
        }
    }

    /// One row's weighted sum with its `D` features held in registers.
    #[inline(always)]
    fn weighted_row<T: Widen, const D: usize>(weights: &[f32], values: &[T], out: &mut [f32]) {
        let mut sum = [0.0f32; D];
        sum.copy_from_slice(out);
        for (&weight, value) in weights.iter().zip(values.chunks_exact(D)) {
            let value: &[T; D] = value.try_into().expect("a row of D");
            for (at, sum) in sum.iter_mut().enumerate() {
                *sum += weight * value[at].widen();
            }
        }
        out.copy_from_slice(&sum);
    }

    #[inline(always)]
    pub fn weights_by_stored_values<T: Widen>(
        weights: &[f32],
        values: &[T],
        head_dim: usize,
        out: &mut [f32],
    ) {
        let cols = values.len() / head_dim;
        for (weights, out) in weights
            .chunks_exact(cols)
            .zip(out.chunks_exact_mut(head_dim))
        {
            match head_dim {
                64 => weighted_row::<T, 64>(weights, values, out),
                128 => weighted_row::<T, 128>(weights, values, out),
                _ => {
                    for (&weight, value) in weights.iter().zip(values.chunks_exact(head_dim)) {
                        for (o, &v) in out.iter_mut().zip(value) {
                            *o += weight * v.widen();
                        }
                    }
                }
            }
        }
    }

    #[inline(always)]
    pub fn widen_i8(from: &[i8], to: &mut [f32]) {
        for (to, &from) in to.iter_mut().zip(from) {
            *to = f32::from(from);
        }
    }

    #[inline(always)]
    pub fn widen_bf16(from: &[bf16], to: &mut [f32]) {
        for (to, &from) in to.iter_mut().zip(from) {
            // A bf16 is the top half of the f32 it stands for.
            *to = f32::from_bits(u32::from(from.to_bits()) << 16);
        }
    }

    #[inline(always)]
    pub fn widen_f16(from: &[f16], to: &mut [f32]) {
        for (to, &from) in to.iter_mut().zip(from) {
            *to = from.to_f32();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::portable::Widen;
    use super::*;

    #[test]
    fn halves_widen_in_registers_as_half_does() {
        for bits in 0..=u16::MAX {
            let half = f16::from_bits(bits);
            let (found, want) = (half.widen(), half.to_f32());
            assert!(
                found.to_bits() == want.to_bits() || (found.is_nan() && want.is_nan()),
                "{bits:#06x}: {found} for {want}"
            );
        }
    }

    /// The stored products against the same products over the widened blocks, at head widths
    /// that take each path (64 and 128 in registers, 40 not) and rows and keys that are not
    /// multiples of the lanes.
    #[test]
    fn stored_products_are_the_widened_products() {
        fn check<T: Widen + Copy>(
            stored: fn(f32) -> T,
            dot: fn(&[f32], &[T], usize, &mut [f32]),
            weighted: fn(&[f32], &[T], usize, &mut [f32]),
        ) {
            for (rows, cols, head_dim) in [(1, 7, 64), (3, 33, 128), (2, 5, 40)] {
                let query: Vec<f32> = (0..rows * head_dim)
                    .map(|i| (i as f32 * 0.37).sin())
                    .collect();
                let block: Vec<T> = (0..cols * head_dim)
                    .map(|i| stored((i as f32 * 0.91).cos() * 50.0))
                    .collect();
                let widened: Vec<f32> = block.iter().map(|x| x.widen()).collect();
                let mut scores = vec![f32::NAN; rows * cols];
                dot(&query, &block, head_dim, &mut scores);
                for r in 0..rows {
                    for j in 0..cols {
                        let want: f32 = (0..head_dim)
                            .map(|d| query[r * head_dim + d] * widened[j * head_dim + d])
                            .sum();
                        let found = scores[r * cols + j];
                        assert!(
                            (found - want).abs() <= 1e-4 * want.abs().max(1.0),
                            "{rows}×{cols}×{head_dim}"
                        );
                    }
                }
                let weights: Vec<f32> = (0..rows * cols).map(|i| (i as f32 * 0.13).cos()).collect();
                let mut out: Vec<f32> = (0..rows * head_dim).map(|i| i as f32).collect();
                let before = out.clone();
                weighted(&weights, &block, head_dim, &mut out);
                for r in 0..rows {
                    for d in 0..head_dim {
                        let want = before[r * head_dim + d]
                            + (0..cols)
                                .map(|j| weights[r * cols + j] * widened[j * head_dim + d])
                                .sum::<f32>();
                        let found = out[r * head_dim + d];
                        assert!(
                            (found - want).abs() <= 1e-4 * want.abs().max(1.0),
                            "{rows}×{cols}×{head_dim}"
                        );
                    }
                }
            }
        }
        // The entry points (AVX-512 intrinsics where the CPU has them) and the portable bodies.
        let int8 = |x: f32| x as i8;
        check(int8, rows_by_stored_keys_i8, weights_by_stored_values_i8);
        check(int8, portable_dot_i8, portable_weighted_i8);
        check(
            f16::from_f32,
            rows_by_stored_keys_f16,
            weights_by_stored_values_f16,
        );
        check(f16::from_f32, portable_dot_f16, portable_weighted_f16);
        check(
            bf16::from_f32,
            rows_by_stored_keys_bf16,
            weights_by_stored_values_bf16,
        );
        check(bf16::from_f32, portable_dot_bf16, portable_weighted_bf16);
    }

    /// Every remainder of a 16- and an 8-lane loop, on the dispatched path and the portable one.
    const LENGTHS: [usize; 8] = [0, 1, 7, 8, 15, 16, 17, 130];

    #[test]
    fn every_int8_widens_exactly_at_every_length() {
        for len in LENGTHS {
            let from: Vec<i8> = (0..len)
                .map(|i| (i as i32 * 37 % 256 - 128) as i8)
                .collect();
            let expected: Vec<f32> = from.iter().map(|&x| f32::from(x)).collect();
            let mut to = vec![f32::NAN; len];
            widen_i8_f32(&from, &mut to);
            assert_eq!(to, expected, "length {len}");
        }
        let all: Vec<i8> = (i8::MIN..=i8::MAX).collect();
        let mut to = vec![0.0; all.len()];
        widen_i8_f32(&all, &mut to);
        assert_eq!((to[0], to[255]), (-128.0, 127.0));
    }

    /// Halves and bfloats of every kind: normal, subnormal, signed zeros, infinities, the
    /// largest finite ones.
    fn floats(len: usize) -> Vec<f32> {
        let special = [
            0.0,
            -0.0,
            1.0,
            -2.5,
            65_504.0,
            -65_504.0,
            6.0e-8,
            -3.0e-5,
            f32::INFINITY,
            f32::NEG_INFINITY,
            1.0e30,
        ];
        (0..len)
            .map(|i| match i % 3 {
                0 => special[i % special.len()],
                _ => (i as f32 * 0.731).sin() * 100.0,
            })
            .collect()
    }

    #[test]
    fn every_half_widens_exactly_at_every_length() {
        for len in LENGTHS {
            let from: Vec<f16> = floats(len).into_iter().map(f16::from_f32).collect();
            let expected: Vec<u32> = from.iter().map(|x| x.to_f32().to_bits()).collect();
            let mut to = vec![f32::NAN; len];
            widen_f16_f32(&from, &mut to);
            assert_eq!(to.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), expected);
            let mut portable_to = vec![f32::NAN; len];
            portable::widen_f16(&from, &mut portable_to);
            assert_eq!(
                portable_to.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                expected
            );
        }
        let mut nan = [0.0];
        widen_f16_f32(&[f16::NAN], &mut nan);
        assert!(nan[0].is_nan());
    }

    #[test]
    fn every_bfloat_widens_exactly_at_every_length() {
        for len in LENGTHS {
            let from: Vec<bf16> = floats(len).into_iter().map(bf16::from_f32).collect();
            let expected: Vec<u32> = from.iter().map(|x| x.to_f32().to_bits()).collect();
            let mut to = vec![f32::NAN; len];
            widen_bf16_f32(&from, &mut to);
            assert_eq!(to.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), expected);
        }
    }
}
