//! Rows packed from documents: a packed row's outputs and every gradient equal, document by
//! document, those of each document run alone — through the layer (every parameter, sinks
//! included) and through the attention core alone (query, key, value) — on the kernels' path and
//! on the explicit path, whose mask is the reference; and bad boundaries are typed errors.

use crate::common::{randn, seeded_layer};

use attention_core::weights::{AttentionParams, WeightsLayout};
use attention_core::{
    AttentionError, AttentionInput, AttentionPath, Documents, MultiHeadAttention,
    MultiHeadAttentionConfig, RopeConfig, causal_attention,
};
use burn::backend::Autodiff;
use burn::prelude::*;
use burn::tensor::{Bool, Int};

/// Relative to each tensor's largest magnitude.
const RTOL: f64 = 1e-5;
/// For gradients that are zero but for rounding (a key bias's: a shift of every score of a row
/// leaves its softmax as it is).
const ATOL: f64 = 1e-5;

/// Each row's documents: boundaries on and off the CPU kernel's 64-query and 128-key block edges
/// and the GPU kernel's tiles, one-token documents, rows that pack differently, and a row that is
/// one document.
const ROWS: [&[usize]; 3] = [&[1, 63, 64, 22], &[37, 1, 112], &[150]];
const SEQ: usize = 150;

/// `found` within [`RTOL`] of `want`, relative to `want`'s largest magnitude, and [`ATOL`].
fn assert_close(found: TensorData, want: TensorData, what: &str) {
    assert_eq!(found.shape, want.shape, "{what}: shapes");
    let [found, want] = [found, want].map(|data| data.convert::<f64>().to_vec::<f64>().unwrap());
    let scale = want.iter().fold(0.0f64, |most, x| most.max(x.abs()));
    let (at, error) = found
        .iter()
        .zip(&want)
        .map(|(f, w)| (f - w).abs())
        .enumerate()
        .fold(
            (0, 0.0f64),
            |most, (at, error)| if error > most.1 { (at, error) } else { most },
        );
    assert!(
        error <= RTOL * scale + ATOL,
        "{what}: off by {error:e} at element {at}: {} against {} (largest magnitude {scale:e})",
        found[at],
        want[at]
    );
}

/// [`ROWS`] without one-token documents, for the layer with sinks: on wgpu under `Autodiff`, a
/// one-token sequence's input gradient through a layer with sinks is off (on every path, with or
/// without documents), so such a document alone is no reference there. The kernels' and the
/// core's tests keep one-token documents with sinks.
const ROWS_OF_TWO_OR_MORE: [&[usize]; 3] = [&[2, 62, 64, 22], &[37, 2, 111], &[150]];

/// `(start, length)` of every document of row `row` of `rows`.
fn spans(rows: &[&[usize]], row: usize) -> Vec<(usize, usize)> {
    rows[row]
        .iter()
        .scan(0, |start, &length| {
            let span = (*start, length);
            *start += length;
            Some(span)
        })
        .collect()
}

/// The configs a packed row is checked with, and their rows: the chapter's layer, and one with
/// grouped heads, rotary positions (restarted in every document), a window, a soft-cap and sinks.
fn configs() -> [(MultiHeadAttentionConfig, [&'static [usize]; 3]); 2] {
    [
        (
            MultiHeadAttentionConfig::new(16, 16, SEQ, 2).with_qkv_bias(true),
            ROWS,
        ),
        (
            MultiHeadAttentionConfig::new(16, 16, SEQ, 4)
                .with_num_kv_heads(Some(2))
                .with_rope(Some(RopeConfig::new()))
                .with_sliding_window(Some(40))
                .with_softcap(Some(3.0))
                .with_sinks(true),
            ROWS_OF_TWO_OR_MORE,
        ),
    ]
}

/// `loss = Σ y · r` for `y = forward(x)` on a fresh leaf `x` (its own graph): `y`, `x`'s
/// gradient, and each parameter's gradient (named as the chapter's state dict names them).
fn gradients<B: Backend>(
    layer: &MultiHeadAttention<Autodiff<B>>,
    x: TensorData,
    r: TensorData,
    forward: impl FnOnce(Tensor<Autodiff<B>, 3>) -> Tensor<Autodiff<B>, 3>,
    device: &B::Device,
) -> (TensorData, TensorData, Vec<(String, TensorData)>) {
    let x = Tensor::<Autodiff<B>, 3>::from_data(x, device).require_grad();
    let y = forward(x.clone());
    let grads = (y.clone() * Tensor::from_data(r, device)).sum().backward();
    let params = AttentionParams::grads_of(layer, &grads).to_state_dict(WeightsLayout::Chapter);
    (y.into_data(), x.grad(&grads).unwrap().into_data(), params)
}

/// `[start, start + length)` of row `row` of a `[batch, seq, width]` tensor's data.
fn document_of(data: &TensorData, row: usize, (start, length): (usize, usize)) -> TensorData {
    let [_, seq, width] = data.shape.dims();
    let values = data.to_vec::<f32>().unwrap();
    let from = (row * seq + start) * width;
    TensorData::new(
        values[from..from + length * width].to_vec(),
        [1, length, width],
    )
}

/// Rows of documents' data `[1, length, width]`, put back in place: `[batch, seq, width]`.
fn assembled(documents: Vec<Vec<TensorData>>) -> TensorData {
    let batch = documents.len();
    let width = documents[0][0].shape[2];
    let values: Vec<f32> = documents
        .into_iter()
        .flatten()
        .flat_map(|data| data.convert::<f32>().to_vec::<f32>().unwrap())
        .collect();
    let seq = values.len() / (batch * width);
    TensorData::new(values, [batch, seq, width])
}

/// Element-wise sums of several documents' gradients of the same parameters.
fn summed(parts: Vec<Vec<(String, TensorData)>>) -> Vec<(String, TensorData)> {
    let mut parts = parts.into_iter();
    let first = parts.next().expect("one document at least");
    let mut sums: Vec<(String, Vec<f64>, Vec<usize>)> = first
        .into_iter()
        .map(|(name, data)| {
            let shape = data.shape.as_slice().to_vec();
            (name, data.convert::<f64>().to_vec().unwrap(), shape)
        })
        .collect();
    for part in parts {
        for ((_, sum, _), (_, data)) in sums.iter_mut().zip(part) {
            let data = data.convert::<f64>().to_vec::<f64>().unwrap();
            sum.iter_mut().zip(data).for_each(|(s, x)| *s += x);
        }
    }
    sums.into_iter()
        .map(|(name, sum, shape)| (name, TensorData::new(sum, shape)))
        .collect()
}

/// Through the layer: the packed rows on `path` against every document run alone (its own
/// sequence, positions from 0, its own graph) on the fused path; the loss `Σ y · r` is the sum of
/// the documents' losses, so the parameters' gradients are the sums of theirs.
fn packed_rows_equal_each_document_alone<B: Backend>(device: &B::Device) {
    for (i, (config, rows)) in configs().iter().enumerate() {
        let documents = Documents::from_lengths(&rows.map(<[usize]>::to_vec)).unwrap();
        let layer = seeded_layer::<Autodiff<B>>(config, 70 + i as u64, device);
        let x = randn::<B, 3>([ROWS.len(), SEQ, 16], 80 + i as u64, device).into_data();
        let r = randn::<B, 3>([ROWS.len(), SEQ, 16], 90 + i as u64, device).into_data();
        let (mut outputs, mut x_grads, mut param_grads) = (Vec::new(), Vec::new(), Vec::new());
        for row in 0..ROWS.len() {
            let (mut row_outputs, mut row_x_grads) = (Vec::new(), Vec::new());
            for span in spans(rows, row) {
                let (y, x_grad, params) = gradients(
                    &layer,
                    document_of(&x, row, span),
                    document_of(&r, row, span),
                    |x| {
                        let input = AttentionInput::new(x).path(AttentionPath::Fused);
                        layer.try_forward(input).unwrap()
                    },
                    device,
                );
                row_outputs.push(y);
                row_x_grads.push(x_grad);
                param_grads.push(params);
            }
            outputs.push(row_outputs);
            x_grads.push(row_x_grads);
        }
        let mut alone = vec![
            ("y".to_string(), assembled(outputs)),
            ("grad.x".to_string(), assembled(x_grads)),
        ];
        alone.extend(summed(param_grads));
        for path in [AttentionPath::Explicit, AttentionPath::Fused] {
            let (y, x_grad, params) = gradients(
                &layer,
                x.clone(),
                r.clone(),
                |x| {
                    let input = AttentionInput::new(x)
                        .documents(documents.clone())
                        .path(path);
                    layer.try_forward(input).unwrap()
                },
                device,
            );
            let mut packed = vec![("y".to_string(), y), ("grad.x".to_string(), x_grad)];
            packed.extend(params);
            assert_eq!(packed.len(), alone.len());
            for ((name, found), (_, want)) in packed.into_iter().zip(alone.iter().cloned()) {
                assert_close(found, want, &format!("config {i}, {path:?}: {name}"));
            }
        }
    }
}

/// The attention core alone (`causal_attention`), grouped heads and a window: the packed rows'
/// outputs and query, key and value gradients against each document's alone (its own graph).
fn packed_core_equals_each_document_alone<B: Backend>(device: &B::Device) {
    let documents = Documents::from_lengths(&ROWS.map(<[usize]>::to_vec)).unwrap();
    let (heads, kv_heads, head_dim) = (4, 2, 8);
    let batch = ROWS.len();
    let data =
        |width: usize, seed: u64| randn::<B, 3>([batch, SEQ, width], seed, device).into_data();
    let [q, k, v, r] = [
        data(heads * head_dim, 100),
        data(kv_heads * head_dim, 101),
        data(kv_heads * head_dim, 102),
        data(heads * head_dim, 103),
    ];
    // The output and the query, key and value gradients of `loss = Σ output · r`.
    let run = |[q, k, v, r]: [TensorData; 4], window, documents: Option<&Documents>| {
        let [q, k, v] =
            [q, k, v].map(|data| Tensor::<Autodiff<B>, 3>::from_data(data, device).require_grad());
        let output =
            causal_attention(q.clone(), k.clone(), v.clone(), heads, window, documents).unwrap();
        let grads = (output.clone() * Tensor::from_data(r, device))
            .sum()
            .backward();
        [
            output.into_data(),
            q.grad(&grads).unwrap().into_data(),
            k.grad(&grads).unwrap().into_data(),
            v.grad(&grads).unwrap().into_data(),
        ]
    };
    for window in [None, Some(50)] {
        let found = run(
            [q.clone(), k.clone(), v.clone(), r.clone()],
            window,
            Some(&documents),
        );
        let mut rows: [Vec<Vec<TensorData>>; 4] = Default::default();
        for row in 0..batch {
            let mut documents: [Vec<TensorData>; 4] = Default::default();
            for span in spans(&ROWS, row) {
                let inputs = [&q, &k, &v, &r].map(|data| document_of(data, row, span));
                for (all, one) in documents.iter_mut().zip(run(inputs, window, None)) {
                    all.push(one);
                }
            }
            for (all, one) in rows.iter_mut().zip(documents) {
                all.push(one);
            }
        }
        let want = rows.map(assembled);
        let names = ["output", "query grad", "key grad", "value grad"];
        for ((name, found), want) in names.into_iter().zip(found).zip(want) {
            assert_close(found, want, &format!("window {window:?}: {name}"));
        }
    }
}

/// Boundaries that do not describe documents of the input are typed errors, and a cached call
/// refuses them.
fn bad_documents_are_errors<B: Backend>(device: &B::Device) {
    let config = MultiHeadAttentionConfig::new(8, 8, 6, 2);
    let layer = seeded_layer::<B>(&config, 1, device);
    let x = randn::<B, 3>([2, 6, 8], 2, device);
    let ids = |rows: [[i64; 6]; 2]| Tensor::<B, 2, Int>::from_data(TensorData::from(rows), device);
    let decreasing = Documents::from_segment_ids(ids([[0, 0, 1, 1, 2, 2], [0, 1, 1, 0, 2, 2]]));
    assert!(
        matches!(
            decreasing,
            Err(AttentionError::SegmentIds {
                row: 1,
                position: 3,
                ..
            })
        ),
        "{decreasing:?}"
    );
    let negative = Documents::from_segment_ids(ids([[-1, 0, 0, 0, 0, 0], [0; 6]]));
    assert!(
        matches!(
            negative,
            Err(AttentionError::SegmentIds {
                row: 0,
                position: 0,
                id: -1,
                ..
            })
        ),
        "{negative:?}"
    );
    let forward = |documents: Documents, padding: Option<[[bool; 6]; 2]>| {
        let mut input = AttentionInput::new(x.clone()).documents(documents);
        if let Some(padding) = padding {
            input = input.key_padding(Tensor::<B, 2, Bool>::from_data(
                TensorData::from(padding),
                device,
            ));
        }
        layer.try_forward(input).map(|_| ())
    };
    let shorter = Documents::from_lengths(&[vec![2, 3], vec![5]]).unwrap();
    assert_eq!(
        forward(shorter, None),
        Err(AttentionError::DocumentsShape {
            expected: [2, 6],
            found: [2, 5]
        })
    );
    let documents = Documents::from_lengths(&[vec![2, 4], vec![3, 3]]).unwrap();
    let pads_whole_documents = [[false; 6], [false, false, false, true, true, true]];
    assert_eq!(
        forward(documents.clone(), Some(pads_whole_documents)),
        Ok(())
    );
    let pads_half_a_document = [[false; 6], [false, false, false, false, true, true]];
    assert_eq!(
        forward(documents.clone(), Some(pads_half_a_document)),
        Err(AttentionError::PaddingSplitsDocument {
            row: 1,
            document: 1
        })
    );
    let mut cache = layer.new_cache();
    let cached = layer.forward_cached(
        AttentionInput::new(x.clone()).documents(documents),
        &mut cache,
    );
    assert_eq!(cached.unwrap_err(), AttentionError::DocumentsWithCache);
    assert!(
        cache.is_empty(),
        "a refused call leaves the cache as it was"
    );
}

test_support::backend_tests!(
    packed_rows_equal_each_document_alone,
    packed_core_equals_each_document_alone,
    bad_documents_are_errors,
);
