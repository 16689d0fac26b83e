//! The backends whose host buffers this crate reads and writes in place, in one list, recognised
//! by type (Burn has no specialization): bare for the products and passes, and under `Autodiff`
//! with either checkpointing strategy for the products with their own backward.

use std::any::TypeId;

use burn::prelude::*;

use crate::packed::PackedWeightsCache;
use crate::products::{Reuse, products};
use crate::products_op::tracked_products;

/// The bare CPU backends of the list: adding one is a line here (and its buffers in
/// `host_matrix.rs`'s `HostMatrix`).
macro_rules! for_each_host_backend {
    ($action:ident) => {
        #[cfg(feature = "ndarray")]
        $action!(burn::backend::NdArray<f32>);
        #[cfg(feature = "ndarray")]
        $action!(burn::backend::NdArray<f64>);
        #[cfg(feature = "flex")]
        $action!(burn::backend::Flex);
    };
}

/// Whether `B` is a bare CPU backend of the list (ndarray or flex, no `Autodiff`), whose `f32`
/// buffers this crate's loops read and write.
pub fn is_bare_host<B: Backend>() -> bool {
    let id = TypeId::of::<B>();
    macro_rules! matches_bare {
        ($backend:ty) => {
            if id == TypeId::of::<$backend>() {
                return true;
            }
        };
    }
    for_each_host_backend!(matches_bare);
    false
}

/// The products on this crate's loops where `B` is a CPU backend of the list: bare, as they
/// are; under `Autodiff`, recorded with their own backward (`products_op.rs`). `None` (nothing
/// consumed) on every other backend, and where the products do not take the operands (another
/// dtype, a view they cannot read): Burn's matmul runs them then.
///
/// # Shapes
/// - `x`: `[..., in]`; each weight `[in, out_i]`, each bias `[out_i]`
/// - outputs: `[..., out_i]`
pub(crate) fn host_products<B: Backend, const D: usize, const N: usize>(
    x: &Tensor<B, D>,
    weights: [(&Tensor<B, 2>, Option<&Tensor<B, 1>>); N],
    cache: &PackedWeightsCache,
) -> Option<[Tensor<B, D>; N]> {
    use burn::backend::Autodiff;
    use burn::backend::autodiff::checkpoint::strategy::{BalancedCheckpointing, NoCheckpointing};
    if is_bare_host::<B>() {
        return products(x, weights, Reuse::Inference(cache));
    }
    let id = TypeId::of::<B>();
    macro_rules! tracked {
        ($inner:ty) => {
            if id == TypeId::of::<Autodiff<$inner, NoCheckpointing>>() {
                return tracked_products::<B, $inner, NoCheckpointing, D, N>(x, weights, cache);
            }
            if id == TypeId::of::<Autodiff<$inner, BalancedCheckpointing>>() {
                return tracked_products::<B, $inner, BalancedCheckpointing, D, N>(
                    x, weights, cache,
                );
            }
        };
    }
    for_each_host_backend!(tracked);
    None
}
