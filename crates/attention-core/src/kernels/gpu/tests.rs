//! The SIMT kernels against attention computed in `f64` on the host, every variant forced
//! directly: blocks and tiles of several sizes (not only those the rule picks for a shape), head
//! widths 64 and 128, a padded width (72 in 80's kernel, four lanes) and a width loaded in
//! vectors of 2; grouped heads packed into blocks, windows, padding, a scale, a soft-cap and
//! sinks; a decoding step over a cache's storage rows, whole and split. Forward: output and
//! log-sum-exp; backward: the query, key and value gradients.
//!
//! On Burn's plain wgpu `CubeBackend` (the fused backend reaches the same launches through its
//! stream: the layer's tests cover it).

use burn::backend::wgpu::{CubeBackend, WgpuRuntime};
use burn::prelude::*;
use burn::tensor::TensorPrimitive;
use burn::tensor::ops::FloatTensor;

use super::tiling::TileRule;
use super::{FlashBackend, FlashCall, FlashGradInputs, FlashTensors};

type Plain = CubeBackend<WgpuRuntime, f32, i32, u32>;

/// The largest error allowed, relative to the largest magnitude of the compared tensor.
const TOL: f64 = 1e-5;

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
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f64 / (1u64 << 24) as f64 * 2.0 - 1.0) as f32
        })
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
    fn new(case: &Case, seed: u64) -> Self {
        let q = case.batch * case.queries * case.heads * case.head_dim;
        let kv = case.batch * case.key_rows * case.kv_heads * case.head_dim;
        // Larger scores than unit vectors give, so that the softmax is not nearly flat.
        let scaled = |v: Vec<f32>| v.into_iter().map(|x| 2.0 * x).collect();
        Self {
            query: scaled(values(q, seed)),
            key: scaled(values(kv, seed + 1)),
            value: values(kv, seed + 2),
            sinks: values(case.heads, seed + 3),
            output_grad: values(q, seed + 4),
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

fn device() -> Option<burn::backend::wgpu::WgpuDevice> {
    test_support::wgpu_device_for_test("gpu kernel variants")
}

fn tensor<const D: usize>(
    data: &[f32],
    shape: [usize; D],
    device: &burn::backend::wgpu::WgpuDevice,
) -> FloatTensor<Plain> {
    Tensor::<Plain, D>::from_data(TensorData::new(data.to_vec(), shape), device)
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

/// `found` within [`TOL`] of `want` relative to `want`'s largest magnitude; rows of `lse` that
/// see nothing are compared as equal masks.
fn assert_close(found: &[f64], want: &[f64], what: &str) {
    assert_eq!(found.len(), want.len(), "{what}: lengths");
    let scale = want
        .iter()
        .filter(|&&x| x > -1e29)
        .fold(0.0f64, |m, x| m.max(x.abs()))
        .max(1e-30);
    for (at, (&f, &w)) in found.iter().zip(want).enumerate() {
        let masked = w <= -1e29 && f <= -1e29;
        assert!(
            masked || (f - w).abs() <= TOL * scale,
            "{what}: element {at}: {f} against {w} (largest magnitude {scale})"
        );
    }
}

fn tensors(
    case: &Case,
    inputs: &Inputs,
    device: &burn::backend::wgpu::WgpuDevice,
) -> FlashTensors<Plain> {
    let (d, b) = (case.head_dim, case.batch);
    let padding: Vec<f32> = (0..b * case.keys)
        .map(|n| f32::from(u8::from(case.is_padding(n / case.keys, n % case.keys))))
        .collect();
    FlashTensors {
        query: tensor(&inputs.query, [b, case.queries, case.heads * d], device),
        key: tensor(&inputs.key, [b, case.key_rows, case.kv_heads * d], device),
        value: tensor(&inputs.value, [b, case.key_rows, case.kv_heads * d], device),
        key_padding: case
            .padded
            .then(|| tensor(&padding, [b, case.keys], device)),
    }
}

/// The forward pass of `case` with `splits` and `tiles` against the reference.
fn assert_forward(
    case: &Case,
    splits: usize,
    tiles: TileRule,
    seed: u64,
    device: &burn::backend::wgpu::WgpuDevice,
) {
    let inputs = Inputs::new(case, seed);
    let want = reference(case, &inputs);
    let sinks = case
        .scored
        .then(|| tensor(&inputs.sinks, [case.heads], device));
    let [output, lse] = Plain::flash_forward(
        tensors(case, &inputs, device),
        sinks,
        case.call(splits, tiles),
    );
    let what = format!("{case:?}, {splits} splits, {tiles:?}");
    assert_close(
        &host(flat(output)),
        &want.output,
        &format!("{what}: output"),
    );
    assert_close(&host(flat(lse)), &want.lse, &format!("{what}: lse"));
}

/// The backward pass of `case` with `tiles` (the log-sum-exp and `D` of the reference) against
/// the reference.
fn assert_backward(
    case: &Case,
    tiles: TileRule,
    seed: u64,
    device: &burn::backend::wgpu::WgpuDevice,
) {
    let inputs = Inputs::new(case, seed);
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
    let grads = FlashGradInputs {
        output_grad: tensor(
            &inputs.output_grad,
            [case.batch, case.queries, case.heads * d],
            device,
        ),
        lse: tensor(&lse, shape, device),
        delta: tensor(&delta, shape, device),
    };
    let [query_grad, key_grad, value_grad] =
        Plain::flash_backward(tensors(case, &inputs, device), grads, case.call(1, tiles));
    let what = format!("{case:?}, {tiles:?}");
    assert_close(
        &host(flat(query_grad)),
        &want.query_grad,
        &format!("{what}: query grad"),
    );
    assert_close(
        &host(flat(key_grad)),
        &want.key_grad,
        &format!("{what}: key grad"),
    );
    assert_close(
        &host(flat(value_grad)),
        &want.value_grad,
        &format!("{what}: value grad"),
    );
}

/// Blocks and tiles every pass fits in 32 KiB of shared memory at width 64 (lavapipe's), and the
/// rule's own choice.
const VARIANTS_64: [TileRule; 5] = [
    TileRule::Auto,
    TileRule::Fixed {
        block: 32,
        tile: 16,
    },
    TileRule::Fixed {
        block: 16,
        tile: 32,
    },
    TileRule::Fixed { block: 8, tile: 8 },
    TileRule::Fixed { block: 4, tile: 16 },
];

#[test]
fn every_variant_at_width_64_with_grouped_heads() {
    let Some(device) = device() else { return };
    // 70 queries by 2 groups of 2 heads: blocks end inside the pairs; full, edge and skipped
    // tiles.
    let case = Case::new(2, 70, 4, 2, 64);
    for (i, tiles) in VARIANTS_64.into_iter().enumerate() {
        assert_forward(&case, 1, tiles, 10 + i as u64, &device);
        assert_backward(&case, tiles, 20 + i as u64, &device);
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
    for (i, tiles) in [TileRule::Auto, TileRule::Fixed { block: 8, tile: 8 }]
        .into_iter()
        .enumerate()
    {
        assert_forward(&case, 1, tiles, 30 + i as u64, &device);
        assert_backward(&case, tiles, 40 + i as u64, &device);
    }
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
        assert_forward(case, 1, TileRule::Auto, 50 + i as u64, &device);
        assert_backward(case, TileRule::Auto, 60 + i as u64, &device);
    }
}

#[test]
fn decoding_over_a_cache_whole_and_split() {
    let Some(device) = device() else { return };
    // 3 new queries after 147 cached keys stored from row 5 of 200; a group of 3 heads.
    let case = Case {
        queries: 3,
        keys: 150,
        key_first: 5,
        key_rows: 200,
        padded: true,
        scored: true,
        ..Case::new(2, 150, 6, 2, 64)
    };
    for (i, splits) in [1, 4, 7].into_iter().enumerate() {
        assert_forward(&case, splits, TileRule::Auto, 70 + i as u64, &device);
    }
    let windowed = Case {
        window: Some(40),
        ..case
    };
    assert_forward(
        &windowed,
        3,
        TileRule::Fixed { block: 8, tile: 16 },
        80,
        &device,
    );
}
