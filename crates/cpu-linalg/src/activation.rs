//! The nonlinearities of the models built on the layer, SiLU and the tanh GELU. On a bare CPU
//! backend an `f32` tensor takes one vectorized pass over its buffer (the CPU kernel's
//! `elementwise.rs`), where burn-flex and burn-ndarray call libm's scalar `expf` per element and a
//! composed formula makes a pass per op; everywhere else — under `Autodiff`, on the GPU, in
//! other dtypes — Burn's tensor ops compute the same function.

use burn::prelude::*;
use burn::tensor::activation::sigmoid;

use crate::elementwise::{Nonlinearity, in_place};

/// `x σ(x)` (SiLU, swish): the Llama family's `silu`.
///
/// # Shapes
/// - `x`, output: any shape
pub fn silu<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    in_place(x, Nonlinearity::Silu).unwrap_or_else(burn::tensor::activation::silu)
}

/// `0.5 x (1 + tanh(u))`, `u = √(2/π) (x + 0.044715 x³)`: transformers' `gelu_new`,
/// `gelu_pytorch_tanh`, `gelu_fast` (GPT-2, Gemma). Computed as the same function `x σ(2u)` with
/// `x · x · x`: Burn's `gelu_approximate` takes `powf` and `tanh`, which the CPU backends compute
/// element by element through libm (about a fifth of GPT-2 small's prefill on flex,
/// BENCHMARKS.md).
///
/// # Shapes
/// - `x`, output: any shape
pub fn gelu_tanh<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    in_place(x, Nonlinearity::GeluTanh).unwrap_or_else(|x| {
        // 2 √(2/π)
        const TWO_SQRT_2_OVER_PI: f64 =
            2.0 * core::f64::consts::FRAC_2_SQRT_PI * core::f64::consts::FRAC_1_SQRT_2;
        let cube = x.clone() * x.clone() * x.clone();
        let twice_u = (x.clone() + cube * 0.044715) * TWO_SQRT_2_OVER_PI;
        x * sigmoid(twice_u)
    })
}

#[cfg(test)]
mod tests {
    use burn::backend::{Autodiff, Flex, NdArray};
    use burn::tensor::activation::gelu_approximate;

    use super::*;

    /// From the flat negative tails through 0 to large values, and enough of them (odd in
    /// number) that the host pass splits them into tasks with a remainder.
    fn values() -> Vec<f32> {
        let mut values: Vec<f32> = (-400..=400).map(|i| i as f32 * 0.025).collect();
        values.extend([
            -1e4, -100.0, -88.5, -87.5, -60.0, -12.0, 12.0, 60.0, 87.5, 88.5, 100.0,
        ]);
        values.extend([1e4, 1e-20, -1e-20, 0.0]);
        let spread = (0..40_001).map(|i| (i as f32 * 0.618_034).sin() * 30.0);
        values.extend(spread);
        values
    }

    /// `ours` is `burns` to float32 rounding at every value, and finite.
    fn assert_is_burns<B: Backend>(
        ours: fn(Tensor<B, 1>) -> Tensor<B, 1>,
        burns: fn(Tensor<B, 1>) -> Tensor<B, 1>,
        what: &str,
    ) {
        let values = values();
        let x = Tensor::<B, 1>::from_data(
            TensorData::new(values.clone(), [values.len()]),
            &Default::default(),
        );
        let ours: Vec<f32> = ours(x.clone()).into_data().to_vec().unwrap();
        let burns: Vec<f32> = burns(x).into_data().to_vec().unwrap();
        for ((x, ours), burns) in values.iter().zip(&ours).zip(&burns) {
            assert!(ours.is_finite(), "{what}({x}) = {ours}");
            let error = (ours - burns).abs();
            assert!(
                error <= 2e-6 * burns.abs().max(1.0),
                "{what}({x}): {ours} vs Burn's {burns}"
            );
        }
    }

    #[test]
    fn host_passes_are_burns_functions() {
        assert_is_burns::<Flex>(silu, burn::tensor::activation::silu, "silu");
        assert_is_burns::<NdArray>(silu, burn::tensor::activation::silu, "silu");
        assert_is_burns::<Flex>(gelu_tanh, gelu_approximate, "gelu_tanh");
        assert_is_burns::<NdArray>(gelu_tanh, gelu_approximate, "gelu_tanh");
    }

    /// The host pass takes bare ndarray and flex in `f32`, and leaves `Autodiff` and `f64` to
    /// Burn's ops.
    #[test]
    fn the_host_pass_runs_where_it_can() {
        fn taken<B: Backend>(dtype: burn::tensor::DType) -> bool {
            let x = Tensor::<B, 2>::zeros([2, 3], (&Default::default(), dtype));
            in_place(x, Nonlinearity::Silu).is_ok()
        }
        use burn::tensor::DType::{F32, F64};
        assert!(taken::<Flex>(F32) && taken::<NdArray>(F32));
        assert!(!taken::<Autodiff<Flex>>(F32) && !taken::<Autodiff<NdArray>>(F32));
        assert!(!taken::<Flex>(F64) && !taken::<burn::backend::NdArray<f64>>(F64));
    }

    /// Under `Autodiff` the graph is Burn's: gradients reach the input (`σ(x)(1 + x(1 − σ(x)))`
    /// for SiLU), and the tanh GELU's formula is `gelu_approximate`'s.
    #[test]
    fn autodiff_takes_burns_ops() {
        type B = Autodiff<Flex>;
        assert_is_burns::<B>(gelu_tanh, gelu_approximate, "gelu_tanh");
        let values = [-3.0f32, -0.5, 0.0, 0.7, 4.0];
        let x = Tensor::<B, 1>::from_data(values, &Default::default()).require_grad();
        let gradients = silu(x.clone()).sum().backward();
        let gradient: Vec<f32> = x.grad(&gradients).unwrap().into_data().to_vec().unwrap();
        for (x, gradient) in values.iter().zip(gradient) {
            let sigma = 1.0 / (1.0 + (-x).exp());
            let want = sigma * (1.0 + x * (1.0 - sigma));
            assert!(
                (gradient - want).abs() <= 1e-6,
                "silu'({x}) = {gradient}, not {want}"
            );
        }
    }

    /// A tensor whose buffer is shared with a clone is computed into a copy: the clone keeps
    /// its values.
    #[test]
    fn a_shared_buffer_is_left_as_it_was() {
        let values = values();
        let x = Tensor::<Flex, 1>::from_data(
            TensorData::new(values.clone(), [values.len()]),
            &Default::default(),
        );
        let kept = x.clone();
        let _ = silu(x);
        assert_eq!(kept.into_data().to_vec::<f32>().unwrap(), values);
    }
}
