//! The models' elementwise passes on a bare CPU backend: the nonlinearities with the kernel's
//! vectorized `exp`, and rotary embeddings' turn of every head, one pass over an `f32` buffer,
//! in place when the tensor alone holds its buffer.
//!
//! burn-flex's and burn-ndarray's `sigmoid` call libm's scalar `expf` once per element, and a
//! pass composed of tensor ops makes one pass, and one new buffer, per op: rotary embeddings'
//! six products and sums of strided halves went through burn-flex's strided iterator, a large
//! part of a Llama-shaped prefill's profile.

use burn::prelude::*;
use burn::tensor::{DType, TensorData};
use rayon::prelude::*;

use crate::backends::is_bare_host;
use crate::simd;

/// Which features of a head form the rotated pairs (of its first `rotary_dim` features, with
/// partial rotary embeddings).
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum RopeLayout {
    /// Feature `i` with feature `i + rotary_dim / 2` (Hugging Face's `rotate_half`): what Hugging
    /// Face checkpoints of Llama, Qwen2, Mistral and Phi-3 need.
    Half,
    /// Features `2i` and `2i + 1` (Meta's original Llama, GPT-J, Burn's `RotaryEncoding`).
    Interleaved,
}

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
    if !is_bare_host::<B>() || x.dtype() != DType::F32 {
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
    Ok(with_values(x, apply))
}

/// `x` after `change` on its elements, in row-major order: burn-flex hands over a buffer that
/// this tensor alone holds without copying it; a shared one (a clone alive elsewhere) is copied
/// first, so its other holders never see the change.
fn with_values<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    change: impl FnOnce(&mut [f32]),
) -> Tensor<B, D> {
    let device = x.device();
    let mut data = x.into_data();
    if data.as_mut_slice::<f32>().is_ok() {
        change(data.as_mut_slice::<f32>().expect("checked just above"));
    } else {
        // Bytes not aligned for f32 (none that Burn's CPU backends make): a copy that is.
        let mut values = data
            .to_vec::<f32>()
            .expect("an f32 tensor's data holds f32");
        change(&mut values);
        data = TensorData::new(values, data.shape.clone());
    }
    Tensor::from_data(data, &device)
}

/// Every head of `x` turned by its position's angles, computed here: each pair `(a, b)` becomes
/// `(a cos − b sin, b cos + a sin)`, rounded as Burn's ops round it (each product, then the
/// sum); or `Err(x)`, untouched, where Burn's ops should compute it (a backend other than bare
/// flex or ndarray, another float type, an odd width, or angles not of the shape below).
///
/// # Shapes
/// - `x`, output: `[batch, seq, heads, width]`
/// - `cos`, `sin`: `[batch or 1, seq, 1, width / 2]`
pub fn rotated_in_place<B: Backend>(
    x: Tensor<B, 4>,
    cos: &Tensor<B, 4>,
    sin: &Tensor<B, 4>,
    layout: RopeLayout,
) -> Result<Tensor<B, 4>, Tensor<B, 4>> {
    let [batch, seq, heads, width] = x.dims();
    let half = width / 2;
    let angles_batch = cos.dims()[0];
    let fits = |angles: &Tensor<B, 4>| {
        angles.dims() == [angles_batch, seq, 1, half] && angles.dtype() == DType::F32
    };
    if !is_bare_host::<B>()
        || x.dtype() != DType::F32
        || width % 2 != 0
        || heads * width == 0
        || !(angles_batch == 1 || angles_batch == batch)
        || !fits(cos)
        || !fits(sin)
    {
        return Err(x);
    }
    let values = |angles: &Tensor<B, 4>| angles.to_data().into_vec::<f32>();
    let (Ok(cos), Ok(sin)) = (values(cos), values(sin)) else {
        return Err(x);
    };
    let turn = |(position, heads_here): (usize, &mut [f32])| {
        // The angles of this row's position: `[half]`.
        let at = if angles_batch == 1 {
            position % seq
        } else {
            position
        } * half;
        let (cos, sin) = (&cos[at..at + half], &sin[at..at + half]);
        for head in heads_here.chunks_exact_mut(width) {
            match layout {
                RopeLayout::Half => {
                    let (first, second) = head.split_at_mut(half);
                    for (((a, b), &cos), &sin) in first.iter_mut().zip(second).zip(cos).zip(sin) {
                        (*a, *b) = (*a * cos - *b * sin, *b * cos + *a * sin);
                    }
                }
                RopeLayout::Interleaved => {
                    for ((pair, &cos), &sin) in head.chunks_exact_mut(2).zip(cos).zip(sin) {
                        let (a, b) = (pair[0], pair[1]);
                        (pair[0], pair[1]) = (a * cos - b * sin, b * cos + a * sin);
                    }
                }
            }
        }
    };
    Ok(with_values(x, |values| {
        let row = heads * width;
        if values.len() <= CHUNK {
            values.chunks_exact_mut(row).enumerate().for_each(turn);
        } else {
            values.par_chunks_exact_mut(row).enumerate().for_each(turn);
        }
    }))
}
