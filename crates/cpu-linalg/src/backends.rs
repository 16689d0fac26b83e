//! The backends whose host buffers this crate reads and writes in place, in one list, recognised
//! by type (Burn has no specialization): bare for the products and passes, and under `Autodiff`
//! with either checkpointing strategy for the products with their own backward.
//!
//! A projection's backend is decided here, once per call: [`host_products`] compares it with the
//! list and hands the tensors, as that backend's, to the products written for it (`products.rs`
//! bare, `products_op.rs` under `Autodiff`), which read their buffers without asking again.

use std::any::TypeId;

use burn::prelude::*;

use crate::known_type::into_known_type;
use crate::packed::PackedWeightsCache;
use crate::products::{Packing, WeightAndBias, products};
use crate::products_op::tracked_products;

/// The bare CPU backends of the list: adding one is a line here (and, in `host_matrix.rs`, its
/// `host_backend!` line and how its buffers are read).
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
    let id = TypeId::of::<B>();
    macro_rules! tracked {
        ($backend:ty, $strategy:ty) => {
            if id == TypeId::of::<Autodiff<$backend, $strategy>>() {
                return as_known::<B, Autodiff<$backend, $strategy>, D, N>(x, weights, |x, w| {
                    tracked_products(x, w, cache)
                });
            }
        };
    }
    macro_rules! on_host {
        ($backend:ty) => {
            if id == TypeId::of::<$backend>() {
                return as_known::<B, $backend, D, N>(x, weights, |x, w| {
                    products(x, w, Packing::Always(cache))
                });
            }
            tracked!($backend, NoCheckpointing);
            tracked!($backend, BalancedCheckpointing);
        };
    }
    for_each_host_backend!(on_host);
    None
}

/// `compute` on the operands as `K`'s tensors, `K` being `B` (the caller compared their
/// `TypeId`s), and its outputs as `B`'s again.
fn as_known<B: Backend, K: Backend, const D: usize, const N: usize>(
    x: &Tensor<B, D>,
    weights: [(&Tensor<B, 2>, Option<&Tensor<B, 1>>); N],
    compute: impl FnOnce(&Tensor<K, D>, [WeightAndBias<'_, K>; N]) -> Option<[Tensor<K, D>; N]>,
) -> Option<[Tensor<B, D>; N]> {
    let x = into_known_type::<_, Tensor<K, D>>(x.clone());
    let weights = weights.map(|(weight, bias)| {
        let weight = into_known_type::<_, Tensor<K, 2>>(weight.clone());
        let bias = bias.map(|bias| into_known_type::<_, Tensor<K, 1>>(bias.clone()));
        (weight, bias)
    });
    let outputs = compute(
        &x,
        weights
            .each_ref()
            .map(|(weight, bias)| (weight, bias.as_ref())),
    )?;
    Some(into_known_type::<_, [Tensor<B, D>; N]>(outputs))
}
