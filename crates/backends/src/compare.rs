//! Comparing tensors against a reference: the numbers every parity test and gradient check
//! reports.

use burn::tensor::TensorData;

/// How far `actual` is from `expected`, element by element.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Deviation {
    /// `max |a - e|`.
    pub max_abs: f64,
    /// `max |a - e| / max(|e|, floor)`: relative error, with magnitudes below `floor` counted as
    /// `floor` so that near-zero references do not dominate.
    pub max_rel: f64,
    /// `max (|a - e| - atol - rtol·|e|)`: positive when some element is outside `allclose`
    /// tolerance (computed for the tolerance passed to [`deviation`]).
    pub worst_excess: f64,
}

impl Deviation {
    /// Whether every element satisfies `|a - e| ≤ atol + rtol·|e|` (NumPy's `allclose`).
    pub fn is_close(&self) -> bool {
        self.worst_excess <= 0.0
    }
}

/// The [`Deviation`] of `actual` from `expected` under `allclose(atol, rtol)`, with relative
/// errors floored at `rel_floor`. Shapes must agree; any NaN counts as infinitely far.
///
/// # Panics
/// When the shapes differ.
pub fn deviation(
    actual: &TensorData,
    expected: &TensorData,
    atol: f64,
    rtol: f64,
    rel_floor: f64,
) -> Deviation {
    assert_eq!(actual.shape, expected.shape, "shapes differ");
    let a = actual.clone().convert::<f64>().into_vec::<f64>().unwrap();
    let e = expected.clone().convert::<f64>().into_vec::<f64>().unwrap();
    let mut result = Deviation {
        max_abs: 0.0,
        max_rel: 0.0,
        worst_excess: f64::NEG_INFINITY,
    };
    for (&a, &e) in a.iter().zip(&e) {
        let diff = if a == e { 0.0 } else { (a - e).abs() };
        let diff = if diff.is_nan() { f64::INFINITY } else { diff };
        result.max_abs = result.max_abs.max(diff);
        result.max_rel = result.max_rel.max(diff / e.abs().max(rel_floor));
        result.worst_excess = result.worst_excess.max(diff - atol - rtol * e.abs());
    }
    result
}

/// Asserts NumPy's `allclose(actual, expected, atol, rtol)`, naming `what` and the worst errors.
///
/// # Panics
/// When some element is outside tolerance, or the shapes differ.
#[track_caller]
pub fn assert_close(actual: &TensorData, expected: &TensorData, atol: f64, rtol: f64, what: &str) {
    assert_eq!(
        actual.shape, expected.shape,
        "{what}: shape {:?}, expected {:?}",
        actual.shape, expected.shape
    );
    let dev = deviation(actual, expected, atol, rtol, 1e-3);
    assert!(
        dev.is_close(),
        "{what}: not close (atol {atol:e}, rtol {rtol:e}): max abs error {:e}, max rel error {:e}",
        dev.max_abs,
        dev.max_rel
    );
}
