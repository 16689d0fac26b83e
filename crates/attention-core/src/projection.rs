//! Projections, `x · W (+ b)`, as the layer and the models built on it compute them: a decoding
//! step's few rows on a bare CPU backend read the weight where it lies (the CPU kernel's
//! `matvec.rs`: no packing, every thread busy); everything else is Burn's `Linear` and `matmul`.

use burn::nn::Linear;
use burn::prelude::*;

use crate::kernels::Kernel;
use crate::kernels::cpu::{MAX_PRODUCT_ROWS, rows_times};

/// [`Linear::forward`]: `x · weight + bias`.
///
/// # Shapes
/// - `x`: `[..., in]`
/// - output: `[..., out]`
pub fn linear<B: Backend, const D: usize>(layer: &Linear<B>, x: Tensor<B, D>) -> Tensor<B, D> {
    let bias = layer.bias.as_ref().map(|bias| bias.val());
    match on_few_rows(&x, &layer.weight.val(), bias.as_ref()) {
        Some(output) => output,
        None => layer.forward(x),
    }
}

/// `x · weight`, `weight` in any layout: e.g. an embedding table's transpose, a tied LM head.
///
/// # Shapes
/// - `x`: `[..., in]`, `weight`: `[in, out]`
/// - output: `[..., out]`
pub fn matmul<B: Backend, const D: usize>(x: Tensor<B, D>, weight: Tensor<B, 2>) -> Tensor<B, D> {
    match on_few_rows(&x, &weight, None) {
        Some(output) => output,
        None => x.matmul(weight.unsqueeze()),
    }
}

/// The product on the CPU kernel's few-row path (at most eight rows: a decoding step's tokens,
/// batch included), or `None` where Burn's runs it.
fn on_few_rows<B: Backend, const D: usize>(
    x: &Tensor<B, D>,
    weight: &Tensor<B, 2>,
    bias: Option<&Tensor<B, 1>>,
) -> Option<Tensor<B, D>> {
    let dims = x.dims();
    let rows: usize = dims[..D - 1].iter().product();
    if !Kernel::on_bare_host::<B>() || rows > MAX_PRODUCT_ROWS {
        return None;
    }
    let output = rows_times(&x.clone().reshape([rows, dims[D - 1]]), weight, bias)?;
    let mut output_dims = dims;
    output_dims[D - 1] = weight.dims()[1];
    Some(output.reshape(output_dims))
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

    /// A decoding step's rows (1 and 8, batched) and a prefill's (65) give `Linear::forward`'s
    /// values, the first two through the CPU product, the last through Burn's.
    #[test]
    fn linear_is_burns_linear() {
        let device = Default::default();
        let layer = LinearConfig::new(48, 40).init::<Flex>(&device);
        for dims in [[1, 1, 48], [2, 4, 48], [1, 65, 48]] {
            let x = Tensor::<Flex, 3>::random(dims, Distribution::Normal(0.0, 1.0), &device);
            let difference = max_difference(linear(&layer, x.clone()), layer.forward(x));
            assert!(difference <= 1e-5, "{dims:?}: {difference}");
        }
    }

    /// Nothing is cached between calls: the step after an optimizer's update computes with the
    /// updated weight.
    #[test]
    fn an_optimizer_step_is_seen_by_the_next_call() {
        let device = Default::default();
        let layer = LinearConfig::new(16, 24).init::<Autodiff<Flex>>(&device);
        let x = Tensor::<Flex, 2>::random([1, 16], Distribution::Normal(0.0, 1.0), &device);
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
            "the step moved the output"
        );
        assert!(max_difference(after, layer.forward(x)) <= 1e-5);
    }
}
