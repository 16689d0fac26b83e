//! Projections, `x · W (+ b)`, as the attention layer and the models built on it compute them: on
//! a CPU backend in `f32`, this crate's products (`products.rs`: the weights packed once, a
//! decoding step's few rows on every thread, a prefill's in blocks of rows, the bias in the same
//! pass), under `Autodiff` with a backward of the same products (`products_op.rs`: a training
//! step's larger products on `gemm`, the weights read in place); everywhere else, Burn's `Linear`
//! and `matmul`.
//!
//! The packed weights are kept by the module that makes the call, in a [`PackedWeightsCache`]
//! beside its `Linear`s: about one more copy of the weights in memory while a model runs,
//! dropped with the model ([`PackedWeightsCache::clear`] frees it sooner). On other backends the
//! cache stays empty.

use burn::nn::Linear;
use burn::prelude::*;

use crate::backends;
pub use crate::packed::PackedWeightsCache;

/// [`Linear::forward`]: `x · weight + bias`, its weight packed in `packed` on a CPU backend.
///
/// # Shapes
/// - `x`: `[..., in]`
/// - output: `[..., out]`
pub fn linear<B: Backend, const D: usize>(
    layer: &Linear<B>,
    x: Tensor<B, D>,
    packed: &PackedWeightsCache,
) -> Tensor<B, D> {
    match linears_on_host([layer], &x, packed) {
        Some([output]) => output,
        None => layer.forward(x),
    }
}

/// `N` [`linear`]s of one input (a layer's queries, keys and values; a gated MLP's gate and up
/// projections) as one call on a CPU backend (bare or under `Autodiff`), or `None` where each is
/// Burn's: call [`linear`] for each then, as it is needed. The weights are packed side by side
/// in `packed`.
///
/// # Shapes
/// - `x`: `[..., in]`
/// - outputs: `[..., out_i]`
pub fn linears_on_host<B: Backend, const D: usize, const N: usize>(
    layers: [&Linear<B>; N],
    x: &Tensor<B, D>,
    packed: &PackedWeightsCache,
) -> Option<[Tensor<B, D>; N]> {
    let weights = layers.map(|layer| layer.weight.val());
    let biases = layers.map(|layer| layer.bias.as_ref().map(|bias| bias.val()));
    let mut pairs = weights.iter().zip(&biases);
    let pairs = std::array::from_fn(|_| {
        let (weight, bias) = pairs.next().expect("N weights");
        (weight, bias.as_ref())
    });
    on_host(x, pairs, packed)
}

/// `x · weight`, `weight` in any layout: e.g. an embedding table's transpose, a tied LM head;
/// packed in `packed` on a CPU backend.
///
/// # Shapes
/// - `x`: `[..., in]`, `weight`: `[in, out]`
/// - output: `[..., out]`
pub fn matmul<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    weight: Tensor<B, 2>,
    packed: &PackedWeightsCache,
) -> Tensor<B, D> {
    match on_host(&x, [(&weight, None)], packed) {
        Some([output]) => output,
        None => x.matmul(weight.unsqueeze()),
    }
}

/// The products on the CPU kernel (under `Autodiff` with their own backward), or `None` where
/// Burn's run them.
fn on_host<B: Backend, const D: usize, const N: usize>(
    x: &Tensor<B, D>,
    weights: [(&Tensor<B, 2>, Option<&Tensor<B, 1>>); N],
    packed: &PackedWeightsCache,
) -> Option<[Tensor<B, D>; N]> {
    backends::host_products(x, weights, packed)
}

#[cfg(test)]
mod tests {
    use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
    use burn::backend::{Autodiff, Flex, NdArray};
    use burn::module::AutodiffModule;
    use burn::nn::LinearConfig;
    use burn::optim::{GradientsParams, Optimizer, SgdConfig};
    use burn::tensor::Distribution;
    use burn::tensor::backend::AutodiffBackend;

    use super::*;

    fn max_difference<const D: usize>(a: Tensor<Flex, D>, b: Tensor<Flex, D>) -> f32 {
        (a - b).abs().max().into_scalar()
    }

    /// A decoding step's rows (1 and 8, batched) and a prefill's (65, and 8 × 65 batched) give
    /// `Linear::forward`'s values through the CPU products, alone and side by side.
    #[test]
    fn linear_is_burns_linear() {
        let device = Default::default();
        let layers = [48, 40, 7].map(|width| LinearConfig::new(48, width).init::<Flex>(&device));
        let (alone, together_packed) = (PackedWeightsCache::default(), Default::default());
        for dims in [[1, 1, 48], [2, 4, 48], [1, 65, 48], [8, 65, 48]] {
            let x = Tensor::<Flex, 3>::random(dims, Distribution::Normal(0.0, 1.0), &device);
            let together =
                linears_on_host(layers.each_ref(), &x, &together_packed).expect("bare flex");
            for (layer, together) in layers.iter().zip(together) {
                let burns = layer.forward(x.clone());
                let difference = max_difference(linear(layer, x.clone(), &alone), burns.clone());
                assert!(difference <= 1e-5, "{dims:?}: {difference}");
                let difference = max_difference(together, burns);
                assert!(difference <= 1e-5, "{dims:?} together: {difference}");
            }
        }
    }

    /// The largest difference between two tensors, relative to the larger of 1 and the largest
    /// magnitude of `expected`.
    fn relative_error<B: Backend, const D: usize>(
        ours: Tensor<B, D>,
        expected: Tensor<B, D>,
    ) -> f32 {
        let scale = expected
            .clone()
            .abs()
            .max()
            .into_scalar()
            .elem::<f32>()
            .max(1.0);
        (ours - expected).abs().max().into_scalar().elem::<f32>() / scale
    }

    /// Under `Autodiff`, [`linears_on_host`] records the products with their own backward: the
    /// outputs and the input's, weights' and biases' gradients are Burn's `Linear`'s, at a
    /// prefill's rows (batched) and a decoding step's, with and without a bias, the input tracked
    /// or not.
    fn gradients_are_burns<B: AutodiffBackend>() {
        let device = Default::default();
        let normal = Distribution::Normal(0.0, 1.0);
        let layers = [(48, true), (40, false), (7, true)].map(|(width, bias)| {
            LinearConfig::new(33, width)
                .with_bias(bias)
                .init::<B>(&device)
        });
        for dims in [[2, 65, 33], [1, 3, 33]] {
            for x_tracked in [true, false] {
                let x = Tensor::<B, 3>::random(dims, normal, &device);
                let x = if x_tracked { x.require_grad() } else { x };
                // Weighs each output element differently.
                let upstream = layers.each_ref().map(|layer| {
                    let width = layer.weight.dims()[1];
                    Tensor::<B, 3>::random([dims[0], dims[1], width], normal, &device)
                });
                let loss = |outputs: [Tensor<B, 3>; 3]| {
                    let mut upstream = upstream.iter();
                    outputs
                        .map(|output| (output * upstream.next().expect("3").clone()).sum())
                        .into_iter()
                        .reduce(|a, b| a + b)
                        .expect("3 outputs")
                };
                // One graph at a time: a backward pass frees the graph it shares parameters with.
                let packed = PackedWeightsCache::default();
                let ours = linears_on_host(layers.each_ref(), &x, &packed).expect("a CPU backend");
                let our_outputs = ours.clone().map(|output| output.inner());
                let ours = loss(ours).backward();
                let burns = layers.each_ref().map(|layer| layer.forward(x.clone()));
                for (ours, burns) in our_outputs.into_iter().zip(&burns) {
                    let error = relative_error(ours, burns.clone().inner());
                    assert!(error <= 1e-6, "{dims:?} output: {error}");
                }
                let burns = loss(burns).backward();
                if x_tracked {
                    let gradient = |grads| x.grad(grads).expect("x is tracked");
                    let error = relative_error(gradient(&ours), gradient(&burns));
                    assert!(error <= 1e-6, "{dims:?} x: {error}");
                }
                for (layer, upstream) in layers.iter().zip(&upstream) {
                    let gradient = |grads| layer.weight.grad(grads).expect("a parameter");
                    let error = relative_error(gradient(&ours), gradient(&burns));
                    assert!(error <= 1e-6, "{dims:?} weight: {error}");
                    if let Some(bias) = &layer.bias {
                        let gradient = |grads| bias.grad(grads).expect("a parameter");
                        // A bias's gradient sums its column of `upstream` over every row, in
                        // another order than Burn's: the rounding scales with the terms' sum of
                        // magnitudes, not with the (cancelling) sum itself.
                        let terms = upstream.clone().inner().abs().sum_dim(0).sum_dim(1);
                        let scale = terms.max().into_scalar().elem::<f32>().max(1.0);
                        let difference = (gradient(&ours) - gradient(&burns)).abs().max();
                        let error = difference.into_scalar().elem::<f32>() / scale;
                        assert!(error <= 1e-6, "{dims:?} bias: {error}");
                    }
                }
            }
        }
    }

    #[test]
    fn gradients_are_burns_on_flex() {
        gradients_are_burns::<Autodiff<Flex>>();
    }

    #[test]
    fn gradients_are_burns_on_ndarray() {
        gradients_are_burns::<Autodiff<NdArray>>();
    }

    #[test]
    fn gradients_are_burns_with_checkpointing() {
        gradients_are_burns::<Autodiff<Flex, BalancedCheckpointing>>();
    }

    /// No product is stale: the call after an optimizer's update computes with the updated
    /// weight, at a decoding step's rows and a prefill's (both on weights packed before the step).
    fn an_optimizer_step_is_seen_by_the_next_call<B: AutodiffBackend>() {
        let device = Default::default();
        for rows in [1, 7, 65] {
            let layer = LinearConfig::new(16, 40).init::<B>(&device);
            let normal = Distribution::Normal(0.0, 1.0);
            let x = Tensor::<B::InnerBackend, 2>::random([rows, 16], normal, &device);
            // One cache for the layer throughout, as a module would keep it.
            let packed = PackedWeightsCache::default();
            let before = linear(&layer.valid(), x.clone(), &packed);
            // The training step's products are the CPU products too.
            let loss = linear(&layer, Tensor::from_inner(x.clone()), &packed)
                .powi_scalar(2)
                .sum();
            let gradients = GradientsParams::from_grads(loss.backward(), &layer);
            let layer = SgdConfig::new().init().step(0.5, layer, gradients).valid();
            let after = linear(&layer, x.clone(), &packed);
            assert!(
                relative_error(after.clone(), before) > 1e-3,
                "{rows} rows: the step moved the output"
            );
            let error = relative_error(after, layer.forward(x));
            assert!(error <= 1e-6, "{rows} rows: {error}");
        }
    }

    #[test]
    fn an_optimizer_step_is_seen_by_the_next_call_on_flex() {
        an_optimizer_step_is_seen_by_the_next_call::<Autodiff<Flex>>();
    }

    #[test]
    fn an_optimizer_step_is_seen_by_the_next_call_on_ndarray() {
        an_optimizer_step_is_seen_by_the_next_call::<Autodiff<NdArray>>();
    }
}
