//! Which backends have a kernel of this crate's own, in one list, recognised by type (Burn has no
//! specialization), bare and under `Autodiff` with either checkpointing strategy.

use std::any::TypeId;

use burn::prelude::*;

use super::cpu;
use super::inputs::KernelInputs;

/// An attention kernel of this crate's own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    /// The CPU kernel: FlashAttention-2's blocks on host memory, with its own backward.
    Cpu,
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
        entry::<B>().map(|entry| entry.kernel)
    }

    /// Whether decoding on `B` keeps its key/value cache in this kernel's own storage (bare
    /// backends: under `Autodiff` the cache stays in tensors, through which gradients flow).
    pub fn keeps_cache<B: Backend>() -> bool {
        entry::<B>().is_some_and(|entry| entry.keeps_cache)
    }
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
    };
}

/// How backend `B` reaches its kernel.
pub(super) struct Entry<B: Backend> {
    kernel: Kernel,
    /// The kernel's forward pass on `B`, recording the kernel's backward under `Autodiff`.
    pub(super) forward: fn(KernelInputs<B>) -> Tensor<B, 3>,
    /// Whether `B` is a bare backend, whose cache the kernel keeps in its own storage.
    keeps_cache: bool,
}

/// `B`'s kernel entry, or `None` when no kernel runs on `B`.
pub(super) fn entry<B: Backend>() -> Option<Entry<B>> {
    use burn::backend::Autodiff;
    use burn::backend::autodiff::checkpoint::strategy::{BalancedCheckpointing, NoCheckpointing};
    macro_rules! recognise {
        ($inner:ty, $module:ident, $kernel:expr) => {
            let id = TypeId::of::<B>();
            if id == TypeId::of::<$inner>() {
                return Some(Entry {
                    kernel: $kernel,
                    forward: $module::forward::<B>,
                    keeps_cache: true,
                });
            }
            if id == TypeId::of::<Autodiff<$inner, NoCheckpointing>>() {
                return Some(Entry {
                    kernel: $kernel,
                    forward: $module::on_autodiff::<B, $inner, NoCheckpointing>,
                    keeps_cache: false,
                });
            }
            if id == TypeId::of::<Autodiff<$inner, BalancedCheckpointing>>() {
                return Some(Entry {
                    kernel: $kernel,
                    forward: $module::on_autodiff::<B, $inner, BalancedCheckpointing>,
                    keeps_cache: false,
                });
            }
        };
    }
    for_each_kernel_backend!(recognise);
    None
}
