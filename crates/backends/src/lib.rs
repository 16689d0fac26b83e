//! The backends this workspace runs on, named in one place, and a probe that tells whether wgpu
//! has an adapter *before* Burn's wgpu runtime would panic for the lack of one.
//!
//! - [`BackendName`]: the list, as every binary's `--backend` flag takes it.
//! - [`dispatch`]: runs code generic over the backend ([`OnBackend`]) on the one a name picks.
//! - [`backend_tests!`]: instantiates generic test bodies on every backend.
//! - [`compiles`]: what cubecl compiles and tunes, counted from its log.
//!
//! Adding a backend: a variant of [`BackendName`], its arm in [`dispatch`], its module in
//! [`backend_tests!`] — and, where one of attention-core's kernels runs on it, its line in the
//! kernel list of `attention-core/src/kernels/backends.rs` (a test of attention-core's checks the two
//! lists against each other).
#![warn(missing_docs)]

pub mod compare;
pub mod compiles;

use thiserror::Error;

/// Burn's ndarray CPU backend, `f32`.
pub type NdArray = burn::backend::NdArray<f32>;
/// Burn's ndarray CPU backend in `f64`, for finite-difference gradient checks.
pub type NdArray64 = burn::backend::NdArray<f64>;
/// burn-flex, Burn's fast CPU backend, `f32`.
pub type Flex = burn::backend::Flex;
/// Burn's wgpu backend (Vulkan on Linux), `f32`.
pub type Wgpu = burn::backend::Wgpu;
/// Burn's autodiff decorator.
pub use burn::backend::Autodiff;
/// The device type of [`Wgpu`].
pub use burn::backend::wgpu::WgpuDevice;

/// A backend every binary of the workspace can run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendName {
    /// [`NdArray`], f32.
    Ndarray,
    /// [`Flex`], f32.
    Flex,
    /// [`Wgpu`], f32, on the default adapter.
    Wgpu,
}

impl BackendName {
    /// Every backend, in the order tables list them.
    pub const ALL: [Self; 3] = [Self::Ndarray, Self::Flex, Self::Wgpu];

    /// The shader compiler the backend's kernels go through, for results: `wgsl` for wgpu (this
    /// workspace builds Burn without its `vulkan` feature, so cubecl compiles WGSL on every
    /// adapter); `None` on the CPU backends.
    pub fn compiler(self) -> Option<&'static str> {
        match self {
            Self::Ndarray | Self::Flex => None,
            Self::Wgpu => Some("wgsl"),
        }
    }

    /// The name on the command line and in results.
    pub fn name(self) -> &'static str {
        match self {
            Self::Ndarray => "ndarray",
            Self::Flex => "flex",
            Self::Wgpu => "wgpu",
        }
    }
}

/// The float type a backend computes in (its tensors' and its kernels').
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum FloatType {
    /// `f32`: every backend.
    #[default]
    F32,
    /// `f16`: wgpu (on adapters with `SHADER_F16`).
    F16,
    /// `bf16`: none of this workspace's default backends (WGSL has no bf16).
    Bf16,
}

impl FloatType {
    /// The name on the command line and in results.
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::F16 => "f16",
            Self::Bf16 => "bf16",
        }
    }
}

/// Burn's wgpu backend computing in `f16`.
pub type WgpuF16 = burn::backend::Wgpu<burn::tensor::f16>;

/// Code generic over the backend, for [`dispatch`]: Rust closures cannot be generic, so the
/// code is a type with one generic method.
pub trait OnBackend {
    /// What the code returns.
    type Output;
    /// Runs on backend `B`, named `name`, on `device`.
    fn run<B: burn::tensor::backend::Backend>(
        self,
        name: &'static str,
        device: B::Device,
    ) -> Self::Output;
}

/// Runs `code` on the backend `backend` names, on its default device (after checking that wgpu
/// has an adapter).
pub fn dispatch<C: OnBackend>(backend: BackendName, code: C) -> Result<C::Output, NoAdapter> {
    let name = backend.name();
    Ok(match backend {
        BackendName::Ndarray => code.run::<NdArray>(name, Default::default()),
        BackendName::Flex => code.run::<Flex>(name, Default::default()),
        BackendName::Wgpu => code.run::<Wgpu>(name, wgpu_device()?),
    })
}

/// Why [`dispatch_in`] could not run the code.
#[derive(Debug, Clone, Error)]
pub enum DispatchError {
    /// wgpu found no adapter.
    #[error(transparent)]
    NoAdapter(#[from] NoAdapter),
    /// The backend does not compute in that float type.
    #[error("--backend {backend} does not compute in {float} (it takes: {takes})")]
    NoSuchType {
        /// The backend's name.
        backend: &'static str,
        /// The float type asked for.
        float: &'static str,
        /// The float types it takes.
        takes: &'static str,
    },
}

/// [`dispatch`] computing in `float`: `code` runs on the backend type of that float type.
pub fn dispatch_in<C: OnBackend>(
    backend: BackendName,
    float: FloatType,
    code: C,
) -> Result<C::Output, DispatchError> {
    let name = backend.name();
    match (backend, float) {
        (_, FloatType::F32) => Ok(dispatch(backend, code)?),
        (BackendName::Wgpu, FloatType::F16) => Ok(code.run::<WgpuF16>(name, wgpu_device()?)),
        (BackendName::Wgpu, _) => Err(DispatchError::NoSuchType {
            backend: name,
            float: float.name(),
            takes: "f32, f16",
        }),
        (BackendName::Ndarray | BackendName::Flex, _) => Err(DispatchError::NoSuchType {
            backend: name,
            float: float.name(),
            takes: "f32",
        }),
    }
}

/// The environment variable under which a missing wgpu adapter is a failure, not a skip
/// (set by `.ci/run`).
pub const REQUIRE_WGPU: &str = "REQUIRE_WGPU";

/// wgpu found no adapter to run on.
#[derive(Debug, Clone, Error)]
#[error(
    "no wgpu adapter found ({reason}); on Debian/Ubuntu install a software Vulkan driver with \
     `apt-get install -y mesa-vulkan-drivers libvulkan1`, or run on a machine with a GPU"
)]
pub struct NoAdapter {
    /// What wgpu said.
    pub reason: String,
}

/// The default wgpu device, after checking that wgpu has an adapter for it: Burn's wgpu runtime
/// panics on its first use when there is none.
pub fn wgpu_device() -> Result<WgpuDevice, NoAdapter> {
    let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
        backends: wgpu::Backends::PRIMARY,
        ..wgpu::InstanceDescriptor::new_without_display_handle()
    });
    let adapter =
        futures_lite::future::block_on(instance.request_adapter(&wgpu::RequestAdapterOptions {
            power_preference: wgpu::PowerPreference::HighPerformance,
            force_fallback_adapter: false,
            compatible_surface: None,
        }));
    match adapter {
        Ok(_) => Ok(WgpuDevice::default()),
        Err(error) => Err(NoAdapter {
            reason: error.to_string(),
        }),
    }
}

/// The wgpu device for a test, or `None` (after saying why on stderr) when there is no adapter
/// and [`REQUIRE_WGPU`] is not set.
///
/// # Panics
/// When there is no adapter and [`REQUIRE_WGPU`] is set to anything but `0` or empty.
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
/// attention_backends::backend_tests!(rows_sum_to_one; wgpu_all_cases_only: long_gradients);
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
