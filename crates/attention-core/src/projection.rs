//! Projections, `x · W (+ b)`, as the layer and the models built on it compute them: on a bare
//! CPU backend in `f32`, the CPU kernel's products (`kernels/cpu/products.rs`: the weights read in
//! place, a decoding step's few rows on every thread, more rows on `gemm` as one `[rows, in]`
//! product with the bias in the same pass); everywhere else, Burn's `Linear` and `matmul`.

use burn::nn::Linear;
use burn::prelude::*;

use crate::kernels::Kernel;
use crate::kernels::cpu;

/// [`Linear::forward`]: `x · weight + bias`.
///
/// # Shapes
/// - `x`: `[..., in]`
/// - output: `[..., out]`
pub fn linear<B: Backend, const D: usize>(layer: &Linear<B>, x: Tensor<B, D>) -> Tensor<B, D> {
    match linears_on_host([layer], &x) {
        Some([output]) => output,
        None => layer.forward(x),
    }
}

/// `N` [`linear`]s of one input (a layer's queries, keys and values; a gated MLP's gate and up
/// projections) as one call on a bare CPU backend, or `None` where each is Burn's: call
/// [`linear`] for each then, as it is needed.
///
/// # Shapes
/// - `x`: `[..., in]`
/// - outputs: `[..., out_i]`
pub fn linears_on_host<B: Backend, const D: usize, const N: usize>(
    layers: [&Linear<B>; N],
    x: &Tensor<B, D>,
) -> Option<[Tensor<B, D>; N]> {
    let weights = layers.map(|layer| layer.weight.val());
    let biases = layers.map(|layer| layer.bias.as_ref().map(|bias| bias.val()));
    let mut pairs = weights.iter().zip(&biases);
    let pairs = std::array::from_fn(|_| {
        let (weight, bias) = pairs.next().expect("N weights");
        (weight, bias.as_ref())
    });
    on_host(x, pairs)
}

/// `x · weight`, `weight` in any layout: e.g. an embedding table's transpose, a tied LM head.
///
/// # Shapes
/// - `x`: `[..., in]`, `weight`: `[in, out]`
/// - output: `[..., out]`
pub fn matmul<B: Backend, const D: usize>(x: Tensor<B, D>, weight: Tensor<B, 2>) -> Tensor<B, D> {
    match on_host(&x, [(&weight, None)]) {
        Some([output]) => output,
        None => x.matmul(weight.unsqueeze()),
    }
}

/// The products on the CPU kernel, batch and sequence as one dimension of rows, or `None` where
/// Burn's run them.
fn on_host<B: Backend, const D: usize, const N: usize>(
    x: &Tensor<B, D>,
    weights: [(&Tensor<B, 2>, Option<&Tensor<B, 1>>); N],
) -> Option<[Tensor<B, D>; N]> {
    if !Kernel::on_bare_host::<B>() {
        return None;
    }
    let dims = x.dims();
    let rows: usize = dims[..D - 1].iter().product();
    let outputs = cpu::products(&x.clone().reshape([rows, dims[D - 1]]), weights)?;
    Some(outputs.map(|output| {
        let mut output_dims = dims;
        output_dims[D - 1] = output.dims()[1];
        output.reshape(output_dims)
    }))
}

#[cfg(test)]
mod tests {
    use burn::backend::{Autodiff, Flex};
    use burn::module::AutodiffModule;
    use burn::nn::LinearConfig;
    use burn::optim::{GradientsParams, Optimizer, SgdConfig};
    use burn::tensor::Distribution;

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
        for dims in [[1, 1, 48], [2, 4, 48], [1, 65, 48], [8, 65, 48]] {
            let x = Tensor::<Flex, 3>::random(dims, Distribution::Normal(0.0, 1.0), &device);
            let together = linears_on_host(layers.each_ref(), &x).expect("bare flex");
            for (layer, together) in layers.iter().zip(together) {
                let burns = layer.forward(x.clone());
                let difference = max_difference(linear(layer, x.clone()), burns.clone());
                assert!(difference <= 1e-5, "{dims:?}: {difference}");
                let difference = max_difference(together, burns);
                assert!(difference <= 1e-5, "{dims:?} together: {difference}");
            }
        }
    }

    /// Nothing is cached between calls: the step after an optimizer's update computes with the
    /// updated weight, at a decoding step's rows and a prefill's.
    #[test]
    fn an_optimizer_step_is_seen_by_the_next_call() {
        let device = Default::default();
        for rows in [1, 65] {
            let layer = LinearConfig::new(16, 24).init::<Autodiff<Flex>>(&device);
            let x = Tensor::<Flex, 2>::random([rows, 16], Distribution::Normal(0.0, 1.0), &device);
            let before = linear(&layer.valid(), x.clone());
            let loss = layer
                .forward(Tensor::from_inner(x.clone()))
                .powi_scalar(2)
                .sum();
            let gradients = GradientsParams::from_grads(loss.backward(), &layer);
            let layer = SgdConfig::new().init().step(0.5, layer, gradients).valid();
            let after = linear(&layer, x.clone());
            assert!(
                max_difference(after.clone(), before) > 1e-2,
                "{rows} rows: the step moved the output"
            );
            assert!(max_difference(after, layer.forward(x)) <= 1e-5);
        }
    }
}
