//! The workspace's test support, a dev-dependency only (no binary links it):
//!
//! - [`backend_tests!`]: generic test bodies instantiated on every backend, a module each.
//! - [`cases_on`]: the cases a test runs on a backend (two on a software wgpu adapter, unless
//!   [`WGPU_ALL_CASES`] is set).
//! - [`wgpu_device_for_test`]: the wgpu device, or a skip that says why (a failure under
//!   `REQUIRE_WGPU`, as in CI).
//! - [`fixture`]: the golden files in the workspace's top-level `fixtures/`.
//! - [`values`], [`gaussian`]: deterministic test values, the same for a seed on every machine.
#![warn(missing_docs)]

use attention_backends::{Autodiff, REQUIRE_WGPU, WgpuDevice, wgpu_device};
// The backends `backend_tests!` instantiates its bodies on, reached as `$crate::…`.
#[doc(hidden)]
pub use attention_backends::{Flex, NdArray, Wgpu};

/// The wgpu device for a test, or `None` (after saying why on stderr) when there is no adapter
/// and `REQUIRE_WGPU` is not set.
///
/// # Panics
/// When there is no adapter and `REQUIRE_WGPU` is set to anything but `0` or empty.
pub fn wgpu_device_for_test(test: &str) -> Option<WgpuDevice> {
    match wgpu_device() {
        Ok(device) => Some(device),
        Err(error) => {
            let required = std::env::var(REQUIRE_WGPU).is_ok_and(|v| !v.is_empty() && v != "0");
            if required {
                panic!("{test}: {error} ({REQUIRE_WGPU} is set)");
            }
            eprintln!("SKIPPED {test} on wgpu: {error}");
            None
        }
    }
}

/// Set to run every case of every test on wgpu (see [`cases_on`]).
pub const WGPU_ALL_CASES: &str = "WGPU_ALL_CASES";

/// Whether [`WGPU_ALL_CASES`] is set (to anything but `0` or empty).
pub fn wgpu_all_cases() -> bool {
    std::env::var(WGPU_ALL_CASES).is_ok_and(|v| !v.is_empty() && v != "0")
}

/// The cases of a test to run on backend `B`: all of them on the CPU backends; on wgpu the first
/// two, unless [`WGPU_ALL_CASES`] is set. Each new shape makes Burn's wgpu runtime compile and
/// autotune kernels, which takes seconds on a software adapter (lavapipe, as in CI); two cases
/// check the wgpu path, the CPU backends check the rest of the arithmetic.
pub fn cases_on<B: burn::tensor::backend::Backend, T>(cases: &[T]) -> &[T] {
    use std::any::TypeId;
    let wgpu = [TypeId::of::<Wgpu>(), TypeId::of::<Autodiff<Wgpu>>()].contains(&TypeId::of::<B>());
    if wgpu && !wgpu_all_cases() {
        &cases[..cases.len().min(2)]
    } else {
        cases
    }
}

/// The path of a test fixture: PyTorch's and Hugging Face's golden files, kept once, in
/// the workspace's top-level `fixtures/`.
pub fn fixture(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(name)
}

/// `‖found − want‖ / ‖want‖`, the relative L2 error of `found`, in `f64`.
///
/// # Panics
/// When the lengths differ.
pub fn relative_l2<T: Copy + Into<f64>>(found: &[T], want: &[T]) -> f64 {
    assert_eq!(found.len(), want.len(), "relative L2 of different lengths");
    let (error, norm) = found
        .iter()
        .zip(want)
        .fold((0.0, 0.0), |(error, norm), (&f, &w)| {
            let (f, w): (f64, f64) = (f.into(), w.into());
            (error + (f - w) * (f - w), norm + w * w)
        });
    (error / norm).sqrt()
}

/// `len` deterministic values, uniform in `[-1, 1)`, from `seed` (a xorshift generator: the same
/// values on every machine and run). Tests scale them to the range they need.
pub fn values(len: usize, seed: u64) -> Vec<f64> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 11) as f64 / (1u64 << 52) as f64 - 1.0
        })
        .collect()
}

/// `len` standard normal values from `seed` (Box–Muller on [`values`]).
pub fn gaussian(len: usize, seed: u64) -> Vec<f64> {
    let uniform = values(len + len % 2, seed);
    uniform
        .chunks_exact(2)
        .flat_map(|pair| {
            let (u, v) = ((pair[0] + 1.0) / 2.0, (pair[1] + 1.0) / 2.0);
            let radius = (-2.0 * (1.0 - u).ln()).sqrt();
            let angle = 2.0 * std::f64::consts::PI * v;
            [radius * angle.cos(), radius * angle.sin()]
        })
        .take(len)
        .collect()
}

/// Instantiates generic test bodies `fn name<B: Backend>(device: &B::Device)` on every backend:
/// a module per backend (`ndarray`, `flex`, `wgpu`) with one `#[test]` per body. On wgpu a test
/// is skipped, saying why, when there is no adapter (see [`wgpu_device_for_test`]). Bodies listed
/// after `wgpu_all_cases_only:` run on the CPU backends always and on wgpu only under
/// [`WGPU_ALL_CASES`]: each compiles a minute or more of new kernels on a software adapter (CI's),
/// for arithmetic the CPU backends and the lighter wgpu tests already check.
///
/// ```ignore
/// fn rows_sum_to_one<B: Backend>(device: &B::Device) { /* … */ }
/// fn long_gradients<B: Backend>(device: &B::Device) { /* … */ }
/// test_support::backend_tests!(rows_sum_to_one; wgpu_all_cases_only: long_gradients);
/// ```
#[macro_export]
macro_rules! backend_tests {
    ($($body:ident),+ $(,)?) => {
        $crate::backend_tests!($($body),+ ; wgpu_all_cases_only:);
    };
    ($($body:ident),* ; wgpu_all_cases_only: $($heavy:ident),* $(,)?) => {
        mod ndarray {
            $( #[test] fn $body() { super::$body::<$crate::NdArray>(&Default::default()) } )*
            $( #[test] fn $heavy() { super::$heavy::<$crate::NdArray>(&Default::default()) } )*
        }
        mod flex {
            $( #[test] fn $body() { super::$body::<$crate::Flex>(&Default::default()) } )*
            $( #[test] fn $heavy() { super::$heavy::<$crate::Flex>(&Default::default()) } )*
        }
        mod wgpu {
            $(
                #[test]
                fn $body() {
                    if let Some(device) = $crate::wgpu_device_for_test(stringify!($body)) {
                        super::$body::<$crate::Wgpu>(&device)
                    }
                }
            )*
            $(
                #[test]
                fn $heavy() {
                    if !$crate::wgpu_all_cases() {
                        eprintln!(
                            "{}: skipped on wgpu (set {}=1 to run it)",
                            stringify!($heavy),
                            $crate::WGPU_ALL_CASES
                        );
                        return;
                    }
                    if let Some(device) = $crate::wgpu_device_for_test(stringify!($heavy)) {
                        super::$heavy::<$crate::Wgpu>(&device)
                    }
                }
            )*
        }
    };
}
