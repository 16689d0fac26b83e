//! Which code computes the attention core, decided once per call: the one place that maps an
//! [`AttentionPath`], the backend and the kind of call to what runs.
//!
//! The backends with a kernel are listed in [`crate::kernels`]: ndarray and flex have the CPU
//! kernel; Burn's GPU backends (wgpu's fused `Wgpu` and plain `CubeBackend` with attention-core's
//! `wgpu` feature, CUDA's with its `cuda` feature) the GPU kernel. "wgpu" in the table stands for
//! both GPU runtimes.
//!
//! | call | backend | `Auto` | `Explicit` | `Fused` |
//! |---|---|---|---|---|
//! | [`try_forward`] | ndarray, flex (± `Autodiff`) | [`Route::CpuKernel`]¹ | [`Route::Explicit`] | [`Route::CpuKernel`] |
//! | [`try_forward`] | wgpu (± `Autodiff`) | [`Route::GpuKernel`]¹ | [`Route::Explicit`] | [`Route::GpuKernel`] |
//! | [`try_forward`] | others | [`Route::BurnOp`]² | [`Route::Explicit`] | [`Route::BurnOp`] |
//! | [`forward_cached`] | ndarray, flex | [`Route::CpuKernel`]³ | [`Route::Explicit`] | [`Route::CpuKernel`] |
//! | [`forward_cached`] | wgpu | [`Route::GpuKernel`]³ | [`Route::Explicit`] | [`Route::GpuKernel`] |
//! | [`forward_cached`] | others, `Autodiff` | [`Route::BurnOp`]⁴ | [`Route::Explicit`] | [`Route::BurnOp`] |
//! | [`forward_traced`] | any | [`Route::Explicit`] | | |
//!
//! [`AttentionPath::BurnOp`] is [`Route::BurnOp`] on every backend and call, for comparisons.
//!
//! 1. [`Route::Explicit`] under `Autodiff` while dropout is active: only the explicit path
//!    applies dropout.
//! 2. [`Route::Explicit`] under `Autodiff`: Burn 0.21 differentiates its attention op through the
//!    same `O(T²)` composite, with an approximate division gradient on some backends.
//! 3. The cache keeps its keys and values in the kernel's own storage, which the kernel reads in
//!    place ([`KvCache`](crate::KvCache)): host memory, head-major (`[batch, kv_heads, len,
//!    head_dim]`), for the CPU kernel; device tensors with the heads side by side (`[batch, len,
//!    kv_heads · head_dim]`) for the GPU kernel.
//! 4. The cache stores keys per head (`[batch, heads, len, head_dim]`), the layout Burn's op
//!    reads. Under `Autodiff` the cache stays in tensors, through which gradients flow, even on
//!    the kernels' backends; [`Route::Explicit`] under `Autodiff` for the reasons of 1, and of 2
//!    on backends without a kernel.
//!
//! On a layer with sinks every [`Route::BurnOp`] of the table is [`Route::Explicit`]: Burn's op
//! has no sinks. A scale or a soft-cap goes to Burn's op (on wgpu it then takes its `O(T²)`
//! fallback) and to the kernels.
//!
//! [`try_forward`]: crate::MultiHeadAttention::try_forward
//! [`forward_cached`]: crate::MultiHeadAttention::forward_cached
//! [`forward_traced`]: crate::MultiHeadAttention::forward_traced

use burn::prelude::*;

use crate::attend::AttentionPath;
use crate::kernels::Kernel;

/// What computes the attention core.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route {
    /// Scores, mask, softmax, dropout and weighted sum as separate tensor ops
    /// ([`crate::attend::explicit`]); materializes `[batch, heads, queries, keys]`.
    Explicit,
    /// This crate's CPU kernel ([`crate::kernels`]), on the projections' side-by-side heads.
    CpuKernel,
    /// This crate's GPU kernel ([`crate::kernels`]), on the projections' side-by-side heads.
    GpuKernel,
    /// Burn's fused `attention` op ([`crate::attend::fused`]).
    BurnOp,
}

/// The kind of forward call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Call {
    /// A whole sequence.
    Full,
    /// New positions after a [`KvCache`](crate::KvCache)'s.
    Cached,
}

/// The route of `path` for a call of kind `call` on backend `B`; `training` says whether
/// autodiff is on, `dropout_active` whether dropout would apply, `sinks` whether the layer has
/// sinks.
pub(crate) fn route<B: Backend>(
    path: AttentionPath,
    call: Call,
    training: bool,
    dropout_active: bool,
    sinks: bool,
) -> Route {
    let backend_kernel = Kernel::of::<B>();
    if backend_kernel.is_none() {
        crate::kernels::warn_if_gpu_without_kernel::<B>();
    }
    let kernel = match call {
        Call::Full => backend_kernel,
        Call::Cached => backend_kernel.filter(|_| Kernel::keeps_cache::<B>()),
    };
    let burn_op = if sinks {
        Route::Explicit
    } else {
        Route::BurnOp
    };
    match (path, kernel) {
        (AttentionPath::Explicit, _) => Route::Explicit,
        (AttentionPath::BurnOp, _) => burn_op,
        (AttentionPath::Fused, Some(kernel)) => kernel.into(),
        (AttentionPath::Fused, None) => burn_op,
        (AttentionPath::Auto, _) if training && dropout_active => Route::Explicit,
        (AttentionPath::Auto, Some(kernel)) => kernel.into(),
        (AttentionPath::Auto, None) if training && backend_kernel.is_none() => Route::Explicit,
        (AttentionPath::Auto, None) => burn_op,
    }
}

impl From<Kernel> for Route {
    fn from(kernel: Kernel) -> Self {
        match kernel {
            Kernel::Cpu => Route::CpuKernel,
            Kernel::Gpu => Route::GpuKernel,
        }
    }
}

impl Route {
    /// Whether one of this crate's kernels computes the core.
    pub(crate) fn is_kernel(self) -> bool {
        matches!(self, Route::CpuKernel | Route::GpuKernel)
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::{Autodiff, NdArray};

    use super::*;

    #[test]
    fn the_table_of_the_module_doc() {
        use AttentionPath::{Auto, Explicit, Fused};
        use Call::{Cached, Full};
        type Ad = Autodiff<NdArray>;
        type AdBalanced =
            Autodiff<NdArray, burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing>;
        assert_eq!(
            route::<NdArray>(Auto, Full, false, false, false),
            Route::CpuKernel
        );
        assert_eq!(
            route::<Ad>(Auto, Full, true, false, false),
            Route::CpuKernel
        );
        assert_eq!(
            route::<AdBalanced>(Auto, Full, true, false, false),
            Route::CpuKernel
        );
        assert_eq!(route::<Ad>(Auto, Full, true, true, false), Route::Explicit);
        assert_eq!(
            route::<Ad>(Fused, Full, true, true, false),
            Route::CpuKernel
        );
        assert_eq!(
            route::<NdArray>(Explicit, Full, false, false, false),
            Route::Explicit
        );
        assert_eq!(
            route::<NdArray>(Auto, Cached, false, false, false),
            Route::CpuKernel
        );
        assert_eq!(
            route::<burn::backend::Flex>(Fused, Cached, false, false, false),
            Route::CpuKernel
        );
        assert_eq!(
            route::<Ad>(Auto, Cached, true, true, false),
            Route::Explicit
        );
        assert_eq!(
            route::<Ad>(Fused, Cached, true, false, false),
            Route::BurnOp
        );
        assert_eq!(route::<Ad>(Auto, Cached, true, false, false), Route::BurnOp);
        // A backend without a kernel (ndarray with 32-bit ints is not in the list): Burn's op, or
        // the explicit path under autodiff.
        type Other = NdArray<f32, i32>;
        type AdOther = Autodiff<Other>;
        assert_eq!(
            route::<AdOther>(Auto, Full, true, false, false),
            Route::Explicit
        );
        assert_eq!(
            route::<AdOther>(Auto, Cached, true, false, false),
            Route::Explicit
        );
        assert_eq!(
            route::<Other>(Auto, Full, false, false, false),
            Route::BurnOp
        );
        assert_eq!(
            route::<Other>(Fused, Full, false, false, true),
            Route::Explicit
        );
        // Sinks: the kernels have them, Burn's op has not.
        assert_eq!(
            route::<NdArray>(Fused, Full, false, false, true),
            Route::CpuKernel
        );
        assert_eq!(route::<Ad>(Auto, Full, true, false, true), Route::CpuKernel);
    }

    #[cfg(feature = "wgpu")]
    #[test]
    fn wgpu_takes_the_gpu_kernel() {
        use AttentionPath::{Auto, Explicit, Fused};
        use Call::{Cached, Full};
        use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
        use burn::backend::wgpu::{CubeBackend, WgpuRuntime};
        type Wgpu = burn::backend::Wgpu;
        type Plain = CubeBackend<WgpuRuntime, f32, i32, u32>;
        assert_eq!(
            route::<Wgpu>(Auto, Full, false, false, false),
            Route::GpuKernel
        );
        assert_eq!(
            route::<Plain>(Fused, Full, false, false, true),
            Route::GpuKernel
        );
        assert_eq!(
            route::<Autodiff<Wgpu>>(Auto, Full, true, false, true),
            Route::GpuKernel
        );
        assert_eq!(
            route::<Autodiff<Plain, BalancedCheckpointing>>(Auto, Full, true, false, false),
            Route::GpuKernel
        );
        assert_eq!(
            route::<Autodiff<Wgpu>>(Auto, Full, true, true, false),
            Route::Explicit
        );
        assert_eq!(
            route::<Wgpu>(Auto, Cached, false, false, true),
            Route::GpuKernel
        );
        assert_eq!(
            route::<Plain>(Explicit, Cached, false, false, false),
            Route::Explicit
        );
        assert_eq!(
            route::<Autodiff<Wgpu>>(Auto, Cached, true, false, false),
            Route::BurnOp
        );
    }
}
