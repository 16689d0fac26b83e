//! Packed documents train as one document per row to the last bit in `f64`: the check of
//! `model/packed.rs` on `NdArray<f64>`, in a test binary of its own — Burn 0.21 keeps one default
//! float type per device for the whole process, set by the first backend that uses it, so beside
//! the `f32` tests the "f64" models would be made in `f32`.

#[path = "model/packed.rs"]
mod packed;

use burn::backend::NdArray;
use burn::tensor::DType;

use packed::*;

/// Far below `f32`'s rounding; above `f64`'s (the layouts sum in other orders).
const F64_TOLERANCE: f64 = 1e-12;

#[test]
fn packed_rows_train_as_one_document_per_row_to_the_last_bit_in_f64() {
    type F64 = NdArray<f64>;
    let device = Default::default();
    // What the check would not see: models made in another float type than asked.
    let probe = burn::tensor::Tensor::<F64, 1>::zeros([1], &device);
    assert_eq!(
        probe.dtype(),
        DType::F64,
        "this process's ndarray device makes f64"
    );
    packed_rows_train_as_one_document_per_row::<F64>(
        "ndarray f64",
        learned_positions,
        F64_TOLERANCE,
    );
    packed_rows_train_as_one_document_per_row::<F64>(
        "ndarray f64",
        rotary_positions,
        F64_TOLERANCE,
    );
}
