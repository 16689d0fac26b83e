//! Which backends have a kernel of this crate's own, in one list, recognised by type (Burn has no
//! specialization), bare and under `Autodiff` with either checkpointing strategy.

use std::any::TypeId;
use std::cell::Cell;

use burn::prelude::*;

#[cfg(any(feature = "wgpu", feature = "cuda"))]
use super::gpu;
use super::inputs::KernelInputs;
use super::{CachedInputs, PagedInputs, cpu};

/// An attention kernel of this crate's own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    /// The CPU kernel: FlashAttention-2's blocks on host memory, with its own backward.
    Cpu,
    /// The GPU kernel: FlashAttention-2's tiles in CubeCL, with its own backward.
    Gpu,
}

impl Kernel {
    /// The kernel that computes attention on backend `B` (bare, or under `Autodiff` with either
    /// checkpointing strategy), or `None` where the layer uses Burn's attention op.
    ///
    /// ```
    /// use attention_core::Kernel;
    /// # #[cfg(feature = "ndarray")]
    /// assert_eq!(Kernel::of::<burn::backend::NdArray>(), Some(Kernel::Cpu));
    /// ```
    pub fn of<B: Backend>() -> Option<Self> {
        entry_points::<B>().map(|entry| entry.kernel)
    }

    /// Whether decoding on `B` keeps its key/value cache in this kernel's own storage (bare
    /// backends: under `Autodiff` the cache stays in tensors, through which gradients flow).
    pub fn keeps_cache<B: Backend>() -> bool {
        entry_points::<B>().is_some_and(|entry| entry.keeps_cache)
    }

    /// Whether a ragged step on `B` reads a page pool's keys and values in place, through the
    /// tables (either kernel, on a bare backend); elsewhere the layer gathers each sequence's
    /// pages and runs Burn's op or the explicit path.
    pub fn reads_pages<B: Backend>() -> bool {
        Self::keeps_cache::<B>()
    }

    /// How many attention calls (whole sequences and decoding steps) this kernel has computed on
    /// the calling thread: lets a test or a benchmark see which code ran (per thread, so that
    /// tests running side by side do not count each other's calls). Behind the `test-hooks`
    /// feature.
    #[cfg(feature = "test-hooks")]
    pub fn calls(self) -> u64 {
        CALLS.with(|calls| calls[self as usize].get())
    }

    pub(super) fn count_call(self) {
        CALLS.with(|calls| {
            let count = &calls[self as usize];
            count.set(count.get() + 1);
        });
    }
}

thread_local! {
    /// [`Kernel::calls`], by kernel.
    static CALLS: [Cell<u64>; 2] = const { [Cell::new(0), Cell::new(0)] };
}

/// The backends the kernels run on, each with its kernel's module and [`Kernel`] variant:
/// adding a backend is one line here.
macro_rules! for_each_kernel_backend {
    ($action:ident) => {
        #[cfg(feature = "ndarray")]
        $action!(burn::backend::NdArray<f32>, cpu, Kernel::Cpu);
        #[cfg(feature = "ndarray")]
        $action!(burn::backend::NdArray<f64>, cpu, Kernel::Cpu);
        #[cfg(feature = "flex")]
        $action!(burn::backend::Flex, cpu, Kernel::Cpu);
        // Burn's default wgpu backend (fused) and the plain one, in f32 and (on adapters with
        // `SHADER_F16`) f16.
        #[cfg(feature = "wgpu")]
        $action!(burn::backend::Wgpu, gpu, Kernel::Gpu);
        #[cfg(feature = "wgpu")]
        $action!(
            burn::backend::wgpu::CubeBackend<burn::backend::wgpu::WgpuRuntime, f32, i32, u32>,
            gpu,
            Kernel::Gpu
        );
        #[cfg(feature = "wgpu")]
        $action!(burn::backend::Wgpu<burn::tensor::f16>, gpu, Kernel::Gpu);
        #[cfg(feature = "wgpu")]
        $action!(
            burn::backend::wgpu::CubeBackend<
                burn::backend::wgpu::WgpuRuntime,
                burn::tensor::f16,
                i32,
                u32,
            >,
            gpu,
            Kernel::Gpu
        );
        // Burn's CUDA backend, fused and plain, in f32, f16 and bf16 (which wgpu lacks).
        #[cfg(feature = "cuda")]
        $action!(burn::backend::Cuda, gpu, Kernel::Gpu);
        #[cfg(feature = "cuda")]
        $action!(burn::backend::Cuda<burn::tensor::f16>, gpu, Kernel::Gpu);
        #[cfg(feature = "cuda")]
        $action!(burn::backend::Cuda<burn::tensor::bf16>, gpu, Kernel::Gpu);
        #[cfg(feature = "cuda")]
        $action!(
            burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>,
            gpu,
            Kernel::Gpu
        );
    };
}

/// The kernel of backend `B` and the functions that call it on `B`.
pub(super) struct EntryPoints<B: Backend> {
    pub(super) kernel: Kernel,
    /// The kernel's forward pass on `B`, recording the kernel's backward under `Autodiff`.
    pub(super) forward: fn(KernelInputs<B>) -> Tensor<B, 3>,
    /// A decoding step over a cache in the kernel's storage (bare backends only).
    pub(super) cached: fn(CachedInputs<'_, B>) -> Tensor<B, 3>,
    /// A ragged step over a page pool in the kernel's storage (bare backends only).
    pub(super) paged: fn(PagedInputs<'_, B>) -> Tensor<B, 3>,
    /// Ends a layer's decoding step on the device's queue, without waiting for the device.
    pub(super) end_step: fn(&B::Device),
    /// Whether `B` is a bare backend, whose cache the kernel keeps in its own storage.
    keeps_cache: bool,
}

/// `B`'s kernel and how to call it, or `None` when no kernel runs on `B`.
pub(super) fn entry_points<B: Backend>() -> Option<EntryPoints<B>> {
    use burn::backend::Autodiff;
    use burn::backend::autodiff::checkpoint::strategy::{BalancedCheckpointing, NoCheckpointing};
    macro_rules! recognise {
        ($inner:ty, $module:ident, $kernel:expr) => {
            let id = TypeId::of::<B>();
            if id == TypeId::of::<$inner>() {
                return Some(EntryPoints {
                    kernel: $kernel,
                    forward: $module::forward::<B, $inner>,
                    cached: $module::cached::<B, $inner>,
                    paged: $module::paged::<B, $inner>,
                    end_step: $module::end_step::<B, $inner>,
                    keeps_cache: true,
                });
            }
            if id == TypeId::of::<Autodiff<$inner, NoCheckpointing>>() {
                return Some(EntryPoints {
                    kernel: $kernel,
                    forward: $module::on_autodiff::<B, $inner, NoCheckpointing>,
                    cached: uncached::<B>,
                    paged: unpaged::<B>,
                    end_step: $module::end_step::<B, $inner>,
                    keeps_cache: false,
                });
            }
            if id == TypeId::of::<Autodiff<$inner, BalancedCheckpointing>>() {
                return Some(EntryPoints {
                    kernel: $kernel,
                    forward: $module::on_autodiff::<B, $inner, BalancedCheckpointing>,
                    cached: uncached::<B>,
                    paged: unpaged::<B>,
                    end_step: $module::end_step::<B, $inner>,
                    keeps_cache: false,
                });
            }
        };
    }
    for_each_kernel_backend!(recognise);
    None
}

/// Says once per process, on stderr, that the layer runs on a GPU backend (wgpu or CUDA, bare or
/// under `Autodiff`) whose kernel attention-core was built without: the attention core then
/// takes Burn's op or the `O(T²)` explicit path, silently otherwise. Called by the route where
/// `B` has no kernel.
pub(crate) fn warn_if_gpu_without_kernel<B: Backend>() {
    use std::sync::atomic::{AtomicBool, Ordering};
    // Process-wide on purpose: a warning the process prints once, not a value any call reads.
    static WARNED: AtomicBool = AtomicBool::new(false);
    let built = GpuFeatures {
        wgpu: cfg!(feature = "wgpu"),
        cuda: cfg!(feature = "cuda"),
    };
    if let Some(feature) = missing_gpu_feature(std::any::type_name::<B>(), built)
        && !WARNED.swap(true, Ordering::Relaxed)
    {
        eprintln!(
            "warning: attention-core runs on {} without its GPU kernel: enable attention-core's \
             `{feature}` feature (the layer falls back to Burn's attention op, or under Autodiff to \
             the explicit path, whose memory grows with the square of the sequence)",
            std::any::type_name::<B>()
        );
    }
}

/// Says once per process, on stderr, that a ragged step on `B` gathers each sequence's pages
/// into tensors before attending: only the CPU kernel reads pages in place.
pub(crate) fn warn_gathering_pages<B: Backend>() {
    use std::sync::atomic::{AtomicBool, Ordering};
    // Process-wide on purpose: a warning the process prints once, not a value any call reads.
    static WARNED: AtomicBool = AtomicBool::new(false);
    if !WARNED.swap(true, Ordering::Relaxed) {
        eprintln!(
            "note: attention-core reads a page pool in place on its own kernels only: on {} each \
             sequence's pages are gathered into tensors for Burn's attention op (or the explicit \
             path) at every step",
            std::any::type_name::<B>()
        );
    }
}

/// Which of attention-core's GPU kernel features (`wgpu`, `cuda`) this build has.
#[derive(Debug, Clone, Copy)]
struct GpuFeatures {
    wgpu: bool,
    cuda: bool,
}

/// The attention-core feature that has a GPU kernel for the backend named `type_name`, where
/// that backend is a GPU runtime of Burn's and the feature is not `built`.
fn missing_gpu_feature(type_name: &str, built: GpuFeatures) -> Option<&'static str> {
    if type_name.contains("WgpuRuntime") && !built.wgpu {
        return Some("wgpu");
    }
    if type_name.contains("CudaRuntime") && !built.cuda {
        return Some("cuda");
    }
    None
}

/// The `cached` entry of a backend that keeps no cache of a kernel's (`Autodiff`: the route
/// never asks it).
fn uncached<B: Backend>(_: CachedInputs<'_, B>) -> Tensor<B, 3> {
    unreachable!("under Autodiff the cache stays in tensors")
}

/// The paged entry under `Autodiff`, never called: the layer refuses a paged call there.
fn unpaged<B: Backend>(_: PagedInputs<'_, B>) -> Tensor<B, 3> {
    unreachable!("under Autodiff the paged path is refused")
}

#[cfg(test)]
mod tests {
    use super::{GpuFeatures, missing_gpu_feature};

    #[test]
    fn a_gpu_runtime_without_its_feature_is_named() {
        let wgpu = "burn_autodiff::Autodiff<burn_fusion::Fusion<burn_cubecl::CubeBackend<\
                    cubecl_wgpu::runtime::WgpuRuntime, f32, i32, u32>>>";
        let cuda = "burn_fusion::Fusion<burn_cubecl::CubeBackend<\
                    cubecl_cuda::runtime::CudaRuntime, f32, i32, u8>>";
        let none = GpuFeatures {
            wgpu: false,
            cuda: false,
        };
        let both = GpuFeatures {
            wgpu: true,
            cuda: true,
        };
        assert_eq!(missing_gpu_feature(wgpu, none), Some("wgpu"));
        assert_eq!(missing_gpu_feature(cuda, none), Some("cuda"));
        assert_eq!(missing_gpu_feature(wgpu, both), None);
        assert_eq!(missing_gpu_feature(cuda, both), None);
        assert_eq!(missing_gpu_feature("burn_flex::Flex", none), None);
    }
}
