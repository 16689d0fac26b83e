//! The backends this workspace runs on, named in one place, and a probe that tells whether wgpu
//! has an adapter *before* Burn's wgpu runtime would panic for the lack of one.
//!
//! - [`BackendName`]: the list, as every binary's `--backend` flag takes it.
//! - [`dispatch`]: runs code generic over the backend ([`OnBackend`]) on the one a name picks.
//! - [`compiles`]: what cubecl compiles and tunes, counted from its log.
//! - [`compare`]: tensors compared as the gradient check and the tests compare them.
//!
//! The tests' own support (generic test bodies on every backend, fixture paths) is the
//! `test-support` crate, a dev-dependency only.
//!
//! Adding a backend: a variant of [`BackendName`], its arm in [`dispatch`], its module in
//! `test_support::backend_tests!` — and, where one of attention-core's kernels runs on it, its line in the
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
