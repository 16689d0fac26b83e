//! The models' elementwise nonlinearities on a bare CPU backend: one pass over an `f32` buffer
//! with the kernel's vectorized `exp`, in place when the tensor alone holds its buffer.
//!
//! burn-flex's and burn-ndarray's `sigmoid` call libm's scalar `expf` once per element, and a
//! nonlinearity composed of tensor ops makes one pass, and one new buffer, per op.

use burn::prelude::*;
use burn::tensor::{DType, TensorData};
use rayon::prelude::*;

use super::simd;
use crate::Kernel;

/// A nonlinearity that [`in_place`] computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Nonlinearity {
    /// `x σ(x)`.
    Silu,
    /// `x σ(2u)`, `u = √(2/π) (x + 0.044715 x³)`.
    GeluTanh,
}

/// Elements per task: enough that a task outweighs its dispatch (a decoding step's row is one).
const CHUNK: usize = 1 << 14;

/// `nonlinearity(x)` computed here, or `Err(x)`, untouched, where Burn's ops should compute it: a
/// backend other than bare ndarray or flex (under `Autodiff` the graph needs Burn's ops), or a
/// dtype other than `f32`.
///
/// # Shapes
/// - `x`, output: any shape
pub(crate) fn in_place<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    nonlinearity: Nonlinearity,
) -> Result<Tensor<B, D>, Tensor<B, D>> {
    if !Kernel::on_bare_host::<B>() || x.dtype() != DType::F32 {
        return Err(x);
    }
    let pass = match nonlinearity {
        Nonlinearity::Silu => simd::silu_f32,
        Nonlinearity::GeluTanh => simd::gelu_tanh_f32,
    };
    let apply = |values: &mut [f32]| match values.len() {
        0..=CHUNK => pass(values),
        _ => values.par_chunks_mut(CHUNK).for_each(pass),
    };
    let device = x.device();
    // burn-flex hands over a buffer that this tensor alone holds without copying it; a shared
    // one (a clone alive elsewhere) is copied first, so its other holders never see the change.
    let mut data = x.into_data();
    if data.as_mut_slice::<f32>().is_ok() {
        apply(data.as_mut_slice::<f32>().expect("checked just above"));
    } else {
        // Bytes not aligned for f32 (none that Burn's CPU backends make): a copy that is.
        let mut values = data
            .to_vec::<f32>()
            .expect("an f32 tensor's data holds f32");
        apply(&mut values);
        data = TensorData::new(values, data.shape.clone());
    }
    Ok(Tensor::from_data(data, &device))
}
