//! Keys or values in the GPU kernel's device layout, stored in a cache's [`KvDtype`]: a float
//! tensor (the model's type, or f16), or int8 packed four to a 32-bit word with one scale per row
//! and head (WGSL has no 8-bit type). What a dense cache (`storage.rs`) and a page pool
//! (`pages.rs`) keep on a GPU; the kernel reads it where it lies and unpacks it in its tile load
//! (`gpu/simt`). Encoding runs on the device, in Burn's tensor ops: a step's new rows never
//! visit the host.

use std::ops::Range;

use burn::prelude::*;
use burn::tensor::{DType, IntDType};

use crate::KvDtype;

/// Values a 32-bit word of an int8 cache holds.
pub(crate) const INT8_PER_WORD: usize = 4;

/// Keys or values of `n` sequences (or pages) of `rows` positions each, every position's
/// key/value heads side by side.
///
/// # Shapes
/// - `Float`: `[n, rows, kv_heads · head_dim]`
/// - `Int8`: `words` `[n, rows, kv_heads · ⌈head_dim / 4⌉]` (`i32`; value `4w + b` of a head's
///   row in byte `b` of its word `w`, the low byte first, two's complement; a head's last word
///   padded with zeros), `scales` `[n, rows, kv_heads]` (`f32`): value = byte · scale
#[derive(Debug, Clone)]
pub(crate) enum DeviceKv<B: Backend> {
    Float(Tensor<B, 3>),
    Int8 {
        words: Tensor<B, 3, Int>,
        scales: Tensor<B, 3>,
    },
}

impl<B: Backend> DeviceKv<B> {
    /// Zeros for `n` sequences of `rows` positions of `kv_heads` heads of `head_dim`, in
    /// `kv_dtype` (`dtype`: the model's float type).
    pub(crate) fn zeros(
        [n, rows, kv_heads, head_dim]: [usize; 4],
        device: &B::Device,
        dtype: DType,
        kv_dtype: KvDtype,
    ) -> Self {
        match kv_dtype {
            KvDtype::Model => Self::Float(Tensor::zeros(
                [n, rows, kv_heads * head_dim],
                (device, dtype),
            )),
            KvDtype::F16 => Self::Float(Tensor::zeros(
                [n, rows, kv_heads * head_dim],
                (device, DType::F16),
            )),
            KvDtype::Int8 => Self::Int8 {
                words: Tensor::zeros(
                    [n, rows, kv_heads * head_dim.div_ceil(INT8_PER_WORD)],
                    (device, DType::I32),
                ),
                scales: Tensor::zeros([n, rows, kv_heads], (device, DType::F32)),
            },
            KvDtype::Bf16 => unreachable!("the caller refused a bf16 cache on the device"),
        }
    }

    /// `new` (`[n, rows, kv_heads · head_dim]`, the model's float type) encoded in `kv_dtype`:
    /// f16 saturates finite values past ±65 504 (as the CPU kernel's cache), int8 takes each
    /// row and head's `max |x| / 127` as its scale and rounds `x / scale` (a row of zeros has
    /// scale 0). The caller has checked int8's values finite.
    pub(crate) fn encoded(new: Tensor<B, 3>, kv_heads: usize, kv_dtype: KvDtype) -> Self {
        match kv_dtype {
            KvDtype::Model => Self::Float(new),
            KvDtype::F16 => {
                let largest = f64::from(half::f16::MAX.to_f32());
                let kept = new.clone().is_nan().bool_or(new.clone().is_inf());
                let saturated = new.clone().clamp(-largest, largest).mask_where(kept, new);
                Self::Float(saturated.cast(DType::F16))
            }
            KvDtype::Int8 => int8_encoded(new, kv_heads),
            KvDtype::Bf16 => unreachable!("the caller refused a bf16 cache on the device"),
        }
    }

    /// `new` (`[n, rows, kv_heads · head_dim]`, the model's float type) encoded in the type of
    /// these rows (see [`encoded`](Self::encoded)).
    pub(crate) fn encode_like(&self, new: Tensor<B, 3>) -> Self {
        match self {
            Self::Float(tensor) if tensor.dtype() == new.dtype() => Self::Float(new),
            Self::Float(tensor) => {
                debug_assert_eq!(
                    tensor.dtype(),
                    DType::F16,
                    "a float cache is f16 or the model's"
                );
                Self::encoded(new, 1, KvDtype::F16)
            }
            Self::Int8 { scales, .. } => Self::encoded(new, scales.dims()[2], KvDtype::Int8),
        }
    }

    /// Zeros of these rows' type and width, `rows` positions for each of their sequences.
    pub(crate) fn zeroed(&self, rows: usize) -> Self {
        let zeros_like = |[n, _, width]: [usize; 3], device, dtype| {
            Tensor::<B, 3>::zeros([n, rows, width], (device, dtype))
        };
        match self {
            Self::Float(tensor) => {
                Self::Float(zeros_like(tensor.dims(), &tensor.device(), tensor.dtype()))
            }
            Self::Int8 { words, scales } => {
                let [n, _, width] = words.dims();
                Self::Int8 {
                    words: Tensor::zeros([n, rows, width], (&words.device(), DType::I32)),
                    scales: zeros_like(scales.dims(), &scales.device(), DType::F32),
                }
            }
        }
    }

    /// The values these rows stand for, in `f32` (int8 unpacked and scaled; floats cast).
    ///
    /// # Shapes
    /// - output: `[n, rows, kv_heads · head_dim]`
    #[cfg(all(test, feature = "wgpu"))]
    pub(crate) fn decoded(self, kv_heads: usize, head_dim: usize) -> Tensor<B, 3> {
        match self {
            Self::Float(tensor) => tensor.cast(DType::F32),
            Self::Int8 { words, scales } => {
                let [n, rows, width] = words.dims();
                let per_head = width / kv_heads;
                let words = words.reshape([n, rows, kv_heads, per_head, 1]);
                use burn::tensor::ElementConversion;
                let bytes: Vec<_> = (0..INT8_PER_WORD)
                    .map(|b| {
                        words
                            .clone()
                            .bitwise_right_shift_scalar((8 * b as i64).elem())
                            .bitwise_and_scalar(0xff.elem())
                    })
                    .collect();
                let bytes = Tensor::cat(bytes, 4).float().cast(DType::F32);
                let signed = bytes.clone() - bytes.greater_equal_elem(128.0).float() * 256.0;
                let values = signed
                    .reshape([n, rows, kv_heads, per_head * INT8_PER_WORD])
                    .narrow(3, 0, head_dim);
                (values * scales.reshape([n, rows, kv_heads, 1])).reshape([
                    n,
                    rows,
                    kv_heads * head_dim,
                ])
            }
        }
    }

    /// `[n, rows]`.
    pub(crate) fn dims(&self) -> [usize; 2] {
        let [n, rows, _] = match self {
            Self::Float(tensor) => tensor.dims(),
            Self::Int8 { scales, .. } => scales.dims(),
        };
        [n, rows]
    }

    /// The device the rows are on.
    pub(crate) fn device(&self) -> B::Device {
        match self {
            Self::Float(tensor) => tensor.device(),
            Self::Int8 { scales, .. } => scales.device(),
        }
    }

    /// Rows `start .. start + len` along `dim` (0: sequences or pages, 1: positions).
    pub(crate) fn narrow(self, dim: usize, start: usize, len: usize) -> Self {
        match self {
            Self::Float(tensor) => Self::Float(tensor.narrow(dim, start, len)),
            Self::Int8 { words, scales } => Self::Int8 {
                words: words.narrow(dim, start, len),
                scales: scales.narrow(dim, start, len),
            },
        }
    }

    /// These rows with `new` (encoded alike) written at sequences `n` and positions `rows`.
    pub(crate) fn assigned(self, [n, rows]: [Range<usize>; 2], new: Self) -> Self {
        match (self, new) {
            (Self::Float(tensor), Self::Float(new)) => {
                let width = tensor.dims()[2];
                Self::Float(tensor.slice_assign([n, rows, 0..width], new))
            }
            (
                Self::Int8 { words, scales },
                Self::Int8 {
                    words: w,
                    scales: s,
                },
            ) => {
                let [word_width, heads] = [words.dims()[2], scales.dims()[2]];
                Self::Int8 {
                    words: words.slice_assign([n.clone(), rows.clone(), 0..word_width], w),
                    scales: scales.slice_assign([n, rows, 0..heads], s),
                }
            }
            _ => unreachable!("a cache's rows are written in its own type"),
        }
    }

    /// `n` sequences of `rows` as one of `n · rows` (a page pool as the kernel reads it).
    pub(crate) fn merged(self) -> Self {
        let merge = |[n, rows, width]: [usize; 3]| [1, n * rows, width];
        match self {
            Self::Float(tensor) => {
                let shape = merge(tensor.dims());
                Self::Float(tensor.reshape(shape))
            }
            Self::Int8 { words, scales } => {
                let [word_shape, scale_shape] = [merge(words.dims()), merge(scales.dims())];
                Self::Int8 {
                    words: words.reshape(word_shape),
                    scales: scales.reshape(scale_shape),
                }
            }
        }
    }

    /// Bytes one position of one head takes, for keys or for values (with its scale).
    pub(crate) fn row_bytes(&self, head_dim: usize) -> usize {
        match self {
            Self::Float(tensor) => head_dim * tensor.dtype().size(),
            Self::Int8 { .. } => head_dim.div_ceil(INT8_PER_WORD) * 4 + 4,
        }
    }
}

/// [`DeviceKv::encoded`] in int8.
fn int8_encoded<B: Backend>(new: Tensor<B, 3>, kv_heads: usize) -> DeviceKv<B> {
    let [n, rows, width] = new.dims();
    let head_dim = width / kv_heads;
    let words = head_dim.div_ceil(INT8_PER_WORD);
    let padded = words * INT8_PER_WORD;
    let device = new.device();
    let mut x = new.cast(DType::F32).reshape([n, rows, kv_heads, head_dim]);
    if padded > head_dim {
        let zeros = Tensor::zeros([n, rows, kv_heads, padded - head_dim], &device);
        x = Tensor::cat(vec![x, zeros], 3);
    }
    let largest = x.clone().abs().max_dim(3);
    let inverse = (largest.clone().recip() * 127.0).mask_fill(largest.clone().equal_elem(0.0), 0.0);
    let q = (x * inverse).round().clamp(-127.0, 127.0);
    // Bytes 0..3 unsigned, in f32 (exact: their sum is below 2²⁴); byte 3 signed, so that the
    // word as an i32 is `low + q₃ · 2²⁴` without overflow.
    let unsigned = q.clone() + q.clone().lower_elem(0.0).float() * 256.0;
    let split = |t: Tensor<B, 4>| t.reshape([n, rows, kv_heads, words, INT8_PER_WORD]);
    let (unsigned, q) = (split(unsigned), split(q));
    let byte = |b: usize| unsigned.clone().narrow(4, b, 1);
    let low = byte(0) + byte(1) * 256.0 + byte(2) * 65_536.0;
    let high = q
        .narrow(4, 3, 1)
        .int()
        .cast(IntDType::I32)
        .mul_scalar(1 << 24);
    let packed = low.int().cast(IntDType::I32) + high;
    DeviceKv::Int8 {
        words: packed.reshape([n, rows, kv_heads * words]),
        scales: (largest / 127.0).reshape([n, rows, kv_heads]),
    }
}
