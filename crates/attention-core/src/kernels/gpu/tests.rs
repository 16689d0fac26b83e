//! The SIMT kernels against attention computed in `f64` on the host, every variant forced
//! directly: blocks and tiles of several sizes (not only those the rule picks for a shape), head
//! widths 64 and 128, a padded width (72 in 80's kernel, four lanes) and a width loaded in
//! vectors of 2; grouped heads packed into blocks, windows, padding, a scale, a soft-cap and
//! sinks; sequences packed from documents; a decoding step over a cache's storage rows, whole and split; and the stand-ins for
//! the tilings larger devices get, cubes of 128 units among them, in f32 and f16. Forward: output
//! and log-sum-exp; backward: the query, key and value gradients. The forced blocks and tiles
//! are `forced.rs`'s, which the kernel report reads too.
//!
//! On Burn's plain wgpu `CubeBackend` (the fused backend reaches the same launches through its
//! stream: the layer's tests cover it).

use burn::backend::wgpu::{CubeBackend, WgpuDevice, WgpuRuntime};
use burn::prelude::*;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, TensorPrimitive, f16};

use super::forced::{self, Forced};
use super::tiling::{Pass, TileRule};
use super::{FlashBackend, FlashCall, FlashGradInputs, FlashTensors, KvTensors};

/// The kernels' backend; the tensors of each call are in the float type the case asks for.
type Plain = CubeBackend<WgpuRuntime, f32, i32, u32>;

/// The largest error allowed, relative to the largest magnitude of the compared tensor, in f32:
/// the rounding of the kernels' sums.
const TOL: f64 = 1e-5;
/// The same in f16, whose inputs the reference reads rounded as the kernels do: above all the
/// rounding of each output to f16.
const HALF_TOL: f64 = 1e-3;

/// The error allowed in `dtype`.
fn tolerance(dtype: DType) -> f64 {
    if dtype == DType::F16 { HALF_TOL } else { TOL }
}

/// One kernel call's shape and score rule.
#[derive(Debug, Clone, Copy)]
struct Case {
    batch: usize,
    queries: usize,
    keys: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    window: Option<usize>,
    padded: bool,
    /// Scale 0.3 (else `1/√d`), soft-cap 5 and sinks.
    scored: bool,
    /// The keys sit at storage rows `key_first ..` of `key_rows` per sequence (a cache's).
    key_first: usize,
    key_rows: usize,
    /// Each sequence's documents' lengths, when the sequences are packed from documents.
    documents: Option<&'static [&'static [usize]]>,
}

impl Case {
    const fn new(batch: usize, seq: usize, heads: usize, kv_heads: usize, head_dim: usize) -> Self {
        Self {
            batch,
            queries: seq,
            keys: seq,
            heads,
            kv_heads,
            head_dim,
            window: None,
            padded: false,
            scored: false,
            key_first: 0,
            key_rows: seq,
            documents: None,
        }
    }

    fn call(&self, key_splits: usize, tiles: TileRule) -> FlashCall {
        FlashCall {
            batch: self.batch,
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            queries: self.queries,
            keys: self.keys,
            key_first: self.key_first,
            key_rows: self.key_rows,
            window: self.window,
            scale: self.scale() as f32,
            softcap: self.scored.then_some(5.0),
            key_splits,
            page_size: 0,
            tiles,
        }
    }

    fn scale(&self) -> f64 {
        if self.scored {
            0.3
        } else {
            1.0 / (self.head_dim as f64).sqrt()
        }
    }

    /// Each position's document `[start, end)`, `[batch, keys, 2]`, as the kernels read them.
    fn spans(&self) -> Option<Vec<f32>> {
        let rows = self.documents?;
        assert_eq!(rows.len(), self.batch, "documents of {self:?}");
        let mut spans = Vec::with_capacity(2 * self.batch * self.keys);
        for row in rows {
            assert_eq!(
                row.iter().sum::<usize>(),
                self.keys,
                "documents of {self:?}"
            );
            let mut start = 0;
            for &length in *row {
                for _ in 0..length {
                    spans.extend([start as f32, (start + length) as f32]);
                }
                start += length;
            }
        }
        Some(spans)
    }

    /// The first key of the document of position `position` of sequence `batch` (0 unpacked).
    fn document_start(&self, batch: usize, position: usize) -> usize {
        self.documents.map_or(0, |rows| {
            let mut start = 0;
            for &length in rows[batch] {
                if position < start + length {
                    break;
                }
                start += length;
            }
            start
        })
    }

    /// Sequence 0 left-padded by 2, the last right-padded by 3.
    fn is_padding(&self, batch: usize, key: usize) -> bool {
        self.padded
            && match batch {
                0 => key < 2,
                b if b == self.batch - 1 => key + 3 >= self.keys,
                _ => false,
            }
    }
}

/// Deterministic values in `[-1, 1)`.
fn values(len: usize, seed: u64) -> Vec<f32> {
    test_support::values(len, seed)
        .into_iter()
        .map(|x| x as f32)
        .collect()
}

/// The host inputs of a case.
struct Inputs {
    query: Vec<f32>,
    key: Vec<f32>,
    value: Vec<f32>,
    sinks: Vec<f32>,
    output_grad: Vec<f32>,
}

impl Inputs {
    /// The inputs as the kernels read them in `dtype` (rounded to it), so that the reference
    /// computes on the same values.
    fn new(case: &Case, seed: u64, dtype: DType) -> Self {
        let q = case.batch * case.queries * case.heads * case.head_dim;
        let kv = case.batch * case.key_rows * case.kv_heads * case.head_dim;
        let rounded = |v: Vec<f32>| -> Vec<f32> {
            match dtype {
                DType::F16 => v.into_iter().map(|x| f16::from_f32(x).to_f32()).collect(),
                _ => v,
            }
        };
        // Larger scores than unit vectors give, so that the softmax is not nearly flat.
        let scaled = |v: Vec<f32>| rounded(v.into_iter().map(|x| 2.0 * x).collect());
        Self {
            query: scaled(values(q, seed)),
            key: scaled(values(kv, seed + 1)),
            value: rounded(values(kv, seed + 2)),
            sinks: rounded(values(case.heads, seed + 3)),
            output_grad: rounded(values(q, seed + 4)),
        }
    }
}

/// Attention in `f64`: per (sequence, query, head) the weights over the keys (and the sink's),
/// the output, the log-sum-exp; and the gradients for `output_grad`.
struct Reference {
    output: Vec<f64>,
    lse: Vec<f64>,
    query_grad: Vec<f64>,
    key_grad: Vec<f64>,
    value_grad: Vec<f64>,
}

fn reference(case: &Case, inputs: &Inputs) -> Reference {
    let (d, h, kvh) = (case.head_dim, case.heads, case.kv_heads);
    let group = h / kvh;
    let q_at = |b: usize, i: usize, head: usize| ((b * case.queries + i) * h + head) * d;
    let k_at =
        |b: usize, j: usize, kv: usize| ((b * case.key_rows + case.key_first + j) * kvh + kv) * d;
    let dot =
        |a: &[f32], b: &[f32]| -> f64 { a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum() };
    let mut r = Reference {
        output: vec![0.0; case.batch * case.queries * h * d],
        lse: vec![0.0; case.batch * case.queries * h],
        query_grad: vec![0.0; case.batch * case.queries * h * d],
        key_grad: vec![0.0; case.batch * case.key_rows * kvh * d],
        value_grad: vec![0.0; case.batch * case.key_rows * kvh * d],
    };
    for b in 0..case.batch {
        for i in 0..case.queries {
            let position = i + case.keys - case.queries;
            for head in 0..h {
                let kv = head / group;
                let q = &inputs.query[q_at(b, i, head)..][..d];
                let d_o = &inputs.output_grad[q_at(b, i, head)..][..d];
                // (key, score, tanh) for every visible key.
                let seen: Vec<(usize, f64, f64)> = (0..case.keys)
                    .filter(|&j| {
                        j <= position
                            && case.window.is_none_or(|w| position - j < w)
                            && !case.is_padding(b, j)
                            && j >= case.document_start(b, position)
                    })
                    .map(|j| {
                        let s = dot(q, &inputs.key[k_at(b, j, kv)..][..d]) * case.scale();
                        if case.scored {
                            let t = (s / 5.0).tanh();
                            (j, 5.0 * t, t)
                        } else {
                            (j, s, 0.0)
                        }
                    })
                    .collect();
                let sink = case.scored.then(|| inputs.sinks[head] as f64);
                let most = seen
                    .iter()
                    .map(|&(_, s, _)| s)
                    .chain(sink)
                    .fold(f64::NEG_INFINITY, f64::max);
                let total: f64 = seen
                    .iter()
                    .map(|&(_, s, _)| (s - most).exp())
                    .chain(sink.map(|s| (s - most).exp()))
                    .sum();
                let row = (b * case.queries + i) * h + head;
                if total == 0.0 {
                    r.lse[row] = -1e30;
                    continue;
                }
                let lse = most + total.ln();
                r.lse[row] = lse;
                let out = &mut r.output[q_at(b, i, head)..][..d];
                for &(j, s, _) in &seen {
                    let p = (s - lse).exp();
                    let v = &inputs.value[k_at(b, j, kv)..][..d];
                    out.iter_mut().zip(v).for_each(|(o, &v)| *o += p * v as f64);
                }
                let delta: f64 = out.iter().zip(d_o).map(|(&o, &g)| o * g as f64).sum();
                for &(j, s, t) in &seen {
                    let p = (s - lse).exp();
                    let (k, v) = (k_at(b, j, kv), k_at(b, j, kv));
                    let mut d_s = p * (dot(d_o, &inputs.value[v..][..d]) - delta);
                    if case.scored {
                        d_s *= 1.0 - t * t;
                    }
                    for c in 0..d {
                        r.query_grad[q_at(b, i, head) + c] +=
                            case.scale() * d_s * inputs.key[k + c] as f64;
                        r.key_grad[k + c] += case.scale() * d_s * q[c] as f64;
                        r.value_grad[v + c] += p * d_o[c] as f64;
                    }
                }
            }
        }
    }
    r
}

fn device() -> Option<WgpuDevice> {
    test_support::wgpu_device_for_test("gpu kernel variants")
}

/// Whether `device`'s adapter computes in f16 (wgpu's `SHADER_F16`).
fn has_f16(device: &WgpuDevice) -> bool {
    use cubecl::Runtime;
    WgpuRuntime::client(device)
        .properties()
        .supports_type(cubecl::ir::FloatKind::F16)
}

/// `data` as a tensor of `shape` in `dtype`.
fn tensor<const D: usize>(
    data: &[f32],
    shape: [usize; D],
    dtype: DType,
    device: &WgpuDevice,
) -> FloatTensor<Plain> {
    Tensor::<Plain, D>::from_data(TensorData::new(data.to_vec(), shape), (device, dtype))
        .into_primitive()
        .tensor()
}

fn host(tensor: FloatTensor<Plain>) -> Vec<f64> {
    Tensor::<Plain, 1>::from_primitive(TensorPrimitive::Float(tensor))
        .into_data()
        .convert::<f64>()
        .to_vec()
        .expect("f64")
}

fn flat(tensor: FloatTensor<Plain>) -> FloatTensor<Plain> {
    let numel = tensor.meta.shape().num_elements();
    burn_cubecl::ops::reshape(tensor, burn::tensor::Shape::new([numel]))
}

/// `found` within `tolerance` of `want` relative to `want`'s largest magnitude; rows of `lse`
/// that see nothing are compared as equal masks.
fn assert_close(found: &[f64], want: &[f64], tolerance: f64, what: &str) {
    assert_eq!(found.len(), want.len(), "{what}: lengths");
    let scale = want
        .iter()
        .filter(|&&x| x > -1e29)
        .fold(0.0f64, |m, x| m.max(x.abs()))
        .max(1e-30);
    for (at, (&f, &w)) in found.iter().zip(want).enumerate() {
        let masked = w <= -1e29 && f <= -1e29;
        assert!(
            masked || (f - w).abs() <= tolerance * scale,
            "{what}: element {at}: {f} against {w} (largest magnitude {scale})"
        );
    }
}

/// The kernels' inputs of `case` in `dtype`.
fn tensors(case: &Case, inputs: &Inputs, dtype: DType, device: &WgpuDevice) -> FlashTensors<Plain> {
    let (d, b) = (case.head_dim, case.batch);
    let padding: Vec<f32> = (0..b * case.keys)
        .map(|n| f32::from(u8::from(case.is_padding(n / case.keys, n % case.keys))))
        .collect();
    let per_head =
        |data: &[f32], rows: usize, heads: usize| tensor(data, [b, rows, heads * d], dtype, device);
    FlashTensors {
        query: per_head(&inputs.query, case.queries, case.heads),
        kv: KvTensors::Float {
            key: per_head(&inputs.key, case.key_rows, case.kv_heads),
            value: per_head(&inputs.value, case.key_rows, case.kv_heads),
        },
        key_padding: case
            .padded
            .then(|| tensor(&padding, [b, case.keys], dtype, device)),
        documents: case
            .spans()
            .map(|spans| tensor(&spans, [b, case.keys, 2], DType::F32, device)),
        pages: None,
    }
}

/// The forward pass of `case` in `dtype` with `splits` and `tiles` against the reference.
fn assert_forward(
    case: &Case,
    splits: usize,
    tiles: TileRule,
    dtype: DType,
    seed: u64,
    device: &WgpuDevice,
) {
    let inputs = Inputs::new(case, seed, dtype);
    let what = format!("{case:?} in {dtype:?}, {splits} splits, {tiles:?}");
    let tensors = tensors(case, &inputs, dtype, device);
    assert_forward_of(
        case,
        &inputs,
        tensors,
        case.call(splits, tiles),
        dtype,
        &what,
    );
}

/// The forward pass of `call` on `tensors` (`inputs` of `case` in `dtype`) against the
/// reference on `inputs`: output and log-sum-exp.
fn assert_forward_of(
    case: &Case,
    inputs: &Inputs,
    tensors: FlashTensors<Plain>,
    call: FlashCall,
    dtype: DType,
    what: &str,
) {
    let want = reference(case, inputs);
    let device = tensors.query.device.clone();
    let sinks = case
        .scored
        .then(|| tensor(&inputs.sinks, [case.heads], dtype, &device));
    let [output, lse] = Plain::flash_forward(tensors, sinks, call);
    let allowed = tolerance(dtype);
    let [output, lse] = [output, lse].map(|tensor| host(flat(tensor)));
    assert_close(&output, &want.output, allowed, &format!("{what}: output"));
    assert_close(&lse, &want.lse, allowed, &format!("{what}: lse"));
}

/// 3 new queries after 147 cached keys stored from row 5 of 200; a group of 3 heads; padding,
/// scores and sinks.
const DECODING: Case = Case {
    queries: 3,
    keys: 150,
    key_first: 5,
    key_rows: 200,
    padded: true,
    scored: true,
    ..Case::new(2, 150, 6, 2, 64)
};

/// The backward pass of `case` in `dtype` with `tiles` (the log-sum-exp and `D` of the
/// reference) against the reference.
fn assert_backward(case: &Case, tiles: TileRule, dtype: DType, seed: u64, device: &WgpuDevice) {
    let inputs = Inputs::new(case, seed, dtype);
    let want = reference(case, &inputs);
    let d = case.head_dim;
    let rows = case.batch * case.queries * case.heads;
    let delta: Vec<f32> = (0..rows)
        .map(|row| {
            let o = &want.output[row * d..][..d];
            let g = &inputs.output_grad[row * d..][..d];
            o.iter().zip(g).map(|(&o, &g)| o * g as f64).sum::<f64>() as f32
        })
        .collect();
    let lse: Vec<f32> = want.lse.iter().map(|&x| x as f32).collect();
    let shape = [case.batch, case.queries, case.heads];
    let output_grad_shape = [case.batch, case.queries, case.heads * d];
    // The log-sum-exp and `D` are `f32` whatever the inputs' float type.
    let grads = FlashGradInputs {
        output_grad: tensor(&inputs.output_grad, output_grad_shape, dtype, device),
        lse: tensor(&lse, shape, DType::F32, device),
        delta: tensor(&delta, shape, DType::F32, device),
    };
    let [query_grad, key_grad, value_grad] = Plain::flash_backward(
        tensors(case, &inputs, dtype, device),
        grads,
        case.call(1, tiles),
    );
    let what = format!("{case:?} in {dtype:?}, {tiles:?}");
    for (name, found, want) in [
        ("query grad", query_grad, &want.query_grad),
        ("key grad", key_grad, &want.key_grad),
        ("value grad", value_grad, &want.value_grad),
    ] {
        let what = format!("{what}: {name}");
        assert_close(&host(flat(found)), want, tolerance(dtype), &what);
    }
}

/// `variant` on `case` (at the variant's head width): the forward pass and the gradients, as far
/// as it is forced on them, from `seeds`.
fn assert_forced(case: &Case, variant: &Forced, seeds: [u64; 2], device: &WgpuDevice) {
    assert_eq!(case.head_dim, variant.head_dim, "{variant:?} on {case:?}");
    if variant.kernels.runs(Pass::Forward) {
        assert_forward(case, 1, variant.rule(), variant.dtype, seeds[0], device);
    }
    if variant.kernels.runs(Pass::QueryGrad) {
        assert_backward(case, variant.rule(), variant.dtype, seeds[1], device);
    }
}

#[test]
fn every_variant_at_width_64_with_grouped_heads() {
    let Some(device) = device() else { return };
    // 70 queries by 2 groups of 2 heads: blocks end inside the pairs; full, edge and skipped
    // tiles. The rule's own choice, then the blocks and tiles forced.
    let case = Case::new(2, 70, 4, 2, 64);
    assert_forward(&case, 1, TileRule::Auto, DType::F32, 10, &device);
    assert_backward(&case, TileRule::Auto, DType::F32, 20, &device);
    for (i, variant) in forced::GROUPED_WIDTH_64.iter().enumerate() {
        assert_forced(&case, variant, [11 + i as u64, 21 + i as u64], &device);
    }
}

#[test]
fn width_128_with_a_window_padding_and_scores() {
    let Some(device) = device() else { return };
    let case = Case {
        window: Some(9),
        padded: true,
        scored: true,
        ..Case::new(2, 41, 2, 1, 128)
    };
    assert_forward(&case, 1, TileRule::Auto, DType::F32, 30, &device);
    assert_backward(&case, TileRule::Auto, DType::F32, 40, &device);
    assert_forced(&case, &forced::SCORED_WIDTH_128, [31, 41], &device);
}

#[test]
fn padded_widths_and_narrow_vectors() {
    let Some(device) = device() else { return };
    // 72 in the width-80 kernels (four lanes), a window and padding; 30 in vectors of 2, a group
    // of 3 heads.
    let cases = [
        Case {
            window: Some(7),
            padded: true,
            ..Case::new(2, 45, 4, 1, 72)
        },
        Case {
            scored: true,
            ..Case::new(1, 20, 3, 1, 30)
        },
    ];
    for (i, case) in cases.iter().enumerate() {
        assert_forward(case, 1, TileRule::Auto, DType::F32, 50 + i as u64, &device);
        assert_backward(case, TileRule::Auto, DType::F32, 60 + i as u64, &device);
    }
}

#[test]
fn sequences_packed_from_documents() {
    let Some(device) = device() else { return };
    // Boundaries inside and on the blocks' and tiles' edges, one-token documents, sequences that
    // pack differently; the rule's own tiling, then every forced one of width 64.
    let grouped = Case {
        documents: Some(&[&[1, 31, 38], &[16, 16, 37, 1]]),
        ..Case::new(2, 70, 4, 2, 64)
    };
    assert_forward(&grouped, 1, TileRule::Auto, DType::F32, 90, &device);
    assert_backward(&grouped, TileRule::Auto, DType::F32, 91, &device);
    for (i, variant) in forced::GROUPED_WIDTH_64.iter().enumerate() {
        assert_forced(&grouped, variant, [92 + i as u64, 112 + i as u64], &device);
    }
    // With a window, padding and scores, at width 128; one sequence is one
    // document.
    let scored = Case {
        window: Some(9),
        padded: true,
        scored: true,
        documents: Some(&[&[2, 20, 19], &[41]]),
        ..Case::new(2, 41, 2, 1, 128)
    };
    assert_forward(&scored, 1, TileRule::Auto, DType::F32, 130, &device);
    assert_backward(&scored, TileRule::Auto, DType::F32, 131, &device);
    assert_forced(&scored, &forced::SCORED_WIDTH_128, [132, 133], &device);
}

#[test]
fn decoding_over_a_cache_whole_and_split() {
    let Some(device) = device() else { return };
    let case = DECODING;
    for (i, splits) in [1, 4, 7].into_iter().enumerate() {
        assert_forward(
            &case,
            splits,
            TileRule::Auto,
            DType::F32,
            70 + i as u64,
            &device,
        );
    }
    let windowed = Case {
        window: Some(40),
        ..case
    };
    let split = forced::SPLIT_DECODING;
    assert_eq!(split.head_dim, windowed.head_dim);
    assert_forward(&windowed, 3, split.rule(), split.dtype, 80, &device);
}

/// The stand-ins for the tilings larger devices get (`forced::STAND_INS`), cubes of 128 units
/// among them, each in its float type on the kernels it is forced on: 70 queries by a group of 2
/// heads (blocks end inside the pairs; several tiles of keys, and of queries for the key/value
/// gradients), plain, then with a window, padding and scores. The f16 ones are skipped, saying
/// so, on adapters without f16.
#[test]
fn the_stand_ins_for_larger_devices_tilings() {
    let Some(device) = device() else { return };
    let with_f16 = has_f16(&device);
    if !with_f16 {
        eprintln!("gpu kernel variants: the f16 stand-ins skipped: the adapter has no SHADER_F16");
    }
    for (i, variant) in forced::STAND_INS.iter().enumerate() {
        if variant.dtype == DType::F16 && !with_f16 {
            continue;
        }
        let plain = Case::new(2, 70, 2, 1, variant.head_dim);
        let scored = Case {
            window: Some(40),
            padded: true,
            scored: true,
            ..plain
        };
        let packed = Case {
            documents: Some(&[&[5, 64, 1], &[33, 37]]),
            ..plain
        };
        for (j, case) in [plain, scored, packed].iter().enumerate() {
            let seed = 200 + 10 * i as u64 + 2 * j as u64;
            assert_forced(case, variant, [seed, seed + 1], &device);
        }
    }
}

/// The forward pass over a cache stored in `kv_dtype` (f16 or int8, encoded on the device as the
/// cache encodes a step's keys and values) against the reference over the values that storage
/// stands for: the kernel's reading in place, isolated from the rounding.
fn assert_forward_stored(case: &Case, splits: usize, kv_dtype: crate::KvDtype, seed: u64) {
    use crate::kernels::device_kv::DeviceKv;
    let Some(device) = device() else { return };
    let mut inputs = Inputs::new(case, seed, DType::F32);
    let rows = |data: &[f32]| {
        let shape = [case.batch, case.key_rows, case.kv_heads * case.head_dim];
        let tensor = Tensor::<Plain, 3>::from_data(TensorData::new(data.to_vec(), shape), &device);
        DeviceKv::encoded(tensor, case.kv_heads, kv_dtype)
    };
    let [keys, values] = [&inputs.key, &inputs.value].map(|data| rows(data));
    let stored = |rows: &DeviceKv<Plain>| -> Vec<f32> {
        let decoded = rows.clone().decoded(case.kv_heads, case.head_dim);
        decoded.into_data().convert::<f32>().to_vec().expect("f32")
    };
    inputs.key = stored(&keys);
    inputs.value = stored(&values);
    let mut tensors = tensors(case, &inputs, DType::F32, &device);
    tensors.kv = KvTensors::stored(keys, values);
    let call = case.call(splits, TileRule::Auto);
    let what = format!("{case:?} over {kv_dtype}, {splits} splits");
    assert_forward_of(case, &inputs, tensors, call, DType::F32, &what);
}

#[test]
fn decoding_over_f16_and_int8_storage() {
    let Some(device) = device() else { return };
    // `DECODING`; then with a window; then a width that is no multiple of four (int8's last word
    // of each head half empty) in vectors of 2.
    let case = DECODING;
    let windowed = Case {
        window: Some(40),
        ..case
    };
    let narrow = Case {
        queries: 2,
        keys: 70,
        key_first: 0,
        key_rows: 70,
        ..Case::new(1, 70, 3, 1, 30)
    };
    let mut kv_dtypes = vec![crate::KvDtype::Int8];
    if has_f16(&device) {
        kv_dtypes.push(crate::KvDtype::F16);
    } else {
        eprintln!("gpu kernel variants: the f16 cache skipped: the adapter has no SHADER_F16");
    }
    for (i, kv_dtype) in kv_dtypes.into_iter().enumerate() {
        let seed = 300 + 10 * i as u64;
        for splits in [1, 4] {
            assert_forward_stored(&case, splits, kv_dtype, seed + splits as u64);
        }
        assert_forward_stored(&windowed, 3, kv_dtype, seed + 5);
        assert_forward_stored(&narrow, 1, kv_dtype, seed + 6);
    }
}

/// An int8 row's layout, which the kernel's unpacking assumes: value `4w + b` of a head in byte
/// `b` of its word `w`, two's complement, the scale `max |x| / 127`; a head's last word padded with
/// zeros, and a row of zeros scale 0.
#[test]
fn int8_rows_are_packed_low_byte_first() {
    use crate::kernels::device_kv::DeviceKv;
    let Some(device) = device() else { return };
    // Two heads of 5: [127, −127, 1, −1, 64] · 0.5, then zeros.
    let row = [63.5, -63.5, 0.5, -0.5, 32.0, 0.0, 0.0, 0.0, 0.0, 0.0];
    let tensor = Tensor::<Plain, 3>::from_data(TensorData::new(row.to_vec(), [1, 1, 10]), &device);
    let DeviceKv::Int8 { words, scales } = DeviceKv::encoded(tensor, 2, crate::KvDtype::Int8)
    else {
        unreachable!("an int8 encoding")
    };
    let words: Vec<i64> = words.into_data().convert::<i64>().to_vec().unwrap();
    let scales: Vec<f32> = scales.into_data().convert::<f32>().to_vec().unwrap();
    assert_eq!(
        words,
        [i64::from(0xff01_817f_u32 as i32), 64, 0, 0],
        "bytes 0x7f, 0x81, 0x01, 0xff, then 64 and three zero bytes; the second head zeros"
    );
    assert_eq!(scales, [0.5, 0.0]);
}

/// A decoding step of 12 heads of 64 over 1 000 cached positions of Gaussian keys and values
/// (with `outliers`, four key features 10× the rest, as real keys have), over a cache stored in
/// `kv_dtype` against the f32 cache: the relative L2 of the outputs. As the CPU kernel's
/// `a_decoding_step_loses_what_each_type_promises`, whose scales these are.
fn decode_error(kv_dtype: crate::KvDtype, outliers: bool, device: &WgpuDevice) -> f64 {
    use crate::kernels::device_kv::DeviceKv;
    let case = Case {
        queries: 1,
        ..Case::new(1, 1000, 12, 12, 64)
    };
    let gaussian = |len, seed| -> Vec<f32> {
        let values = test_support::gaussian(len, seed);
        values.into_iter().map(|x| x as f32).collect()
    };
    let query = gaussian(12 * 64, 11);
    let mut keys = gaussian(1000 * 12 * 64, 12);
    if outliers {
        for row in keys.chunks_exact_mut(64) {
            for feature in [3, 17, 40, 61] {
                row[feature] *= 10.0;
            }
        }
    }
    let values = gaussian(1000 * 12 * 64, 13);
    let call = FlashCall {
        scale: if outliers { 0.02 } else { 0.125 },
        ..case.call(1, TileRule::Auto)
    };
    let rows = |data: &[f32]| tensor(data, [1, 1000, 12 * 64], DType::F32, device);
    let run = |kv: KvTensors<Plain>| {
        let tensors = FlashTensors {
            query: tensor(&query, [1, 1, 12 * 64], DType::F32, device),
            kv,
            key_padding: None,
            documents: None,
            pages: None,
        };
        let [output, _] = Plain::flash_forward(tensors, None, call);
        host(flat(output))
    };
    let exact = run(KvTensors::Float {
        key: rows(&keys),
        value: rows(&values),
    });
    let stored = |data: &[f32]| {
        let tensor = Tensor::<Plain, 3>::from_primitive(TensorPrimitive::Float(rows(data)));
        DeviceKv::encoded(tensor, 12, kv_dtype)
    };
    let kv = KvTensors::stored(stored(&keys), stored(&values));
    test_support::relative_l2(&run(kv), &exact)
}

#[test]
fn a_decoding_step_loses_what_each_type_promises() {
    let Some(device) = device() else { return };
    let int8 = decode_error(crate::KvDtype::Int8, false, &device);
    let outliers = decode_error(crate::KvDtype::Int8, true, &device);
    eprintln!("gpu kernel, relative L2: int8 {int8:e} (outliers {outliers:e})");
    assert!(
        int8 <= 0.015 && int8 > 1e-4,
        "int8 on Gaussian keys: {int8:e}"
    );
    assert!(outliers <= 0.03, "int8 with outlier channels: {outliers:e}");
    if has_f16(&device) {
        let f16 = decode_error(crate::KvDtype::F16, false, &device);
        eprintln!("gpu kernel, relative L2: f16 {f16:e}");
        assert!(f16 <= 1e-3 && f16 > 1e-6, "f16: {f16:e}");
    }
}
