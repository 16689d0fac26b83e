//! The kernel over keys and values stored in fewer bytes (`f16`, `bf16`, `int8`): it equals the
//! kernel over the same stored values widened to `f32` beforehand — whatever the reading
//! (head-major rows of a cache, pages, decoding splits, prefill chunks) and the variant (grouped
//! heads, windows, sinks, soft-cap) — and the rounding costs what the cache types promise.

use super::*;
use crate::kernels::cpu::host_cache::Stored;

/// `len` standard normal values.
fn gaussian(len: usize, seed: u64) -> Vec<f32> {
    let values = test_support::gaussian(len, seed);
    values.into_iter().map(|x| x as f32).collect()
}

/// A buffer of `rows` rows of `head_dim`, stored as `S`, and the same rows widened back to `f32`
/// with their scales applied (what the stored buffer stands for).
struct StoredRows<S> {
    data: Vec<S>,
    scales: Vec<f32>,
    widened: Vec<f32>,
}

/// The kernel's view of the stored rows.
fn buffer<S: Stored>(rows: &StoredRows<S>) -> KvBuffer<'_, S::Compute> {
    S::buffer(&rows.data, &rows.scales)
}

fn store<S: Stored<Compute = f32>>(rows: &[f32], head_dim: usize) -> StoredRows<S> {
    let mut data = vec![S::ZERO; rows.len()];
    let scales: Vec<f32> = rows
        .chunks_exact(head_dim)
        .zip(data.chunks_exact_mut(head_dim))
        .map(|(row, to)| S::encode(row, to))
        .collect();
    let scales = if S::SCALED { scales } else { Vec::new() };
    let mut scratch = vec![0.0; rows.len()];
    let buffer = S::buffer(&data, &scales);
    let (widened, row_scales) = buffer.rows(0..rows.len() / head_dim, head_dim, &mut scratch);
    let mut widened = widened.to_vec();
    if let Some(row_scales) = row_scales {
        for (row, &scale) in widened.chunks_exact_mut(head_dim).zip(row_scales) {
            row.iter_mut().for_each(|x| *x *= scale);
        }
    }
    StoredRows {
        data,
        scales,
        widened,
    }
}

/// The largest difference relative to the largest magnitude of `want`.
fn relative_max(found: &[f32], want: &[f32]) -> f32 {
    let scale = want.iter().fold(1e-6f32, |most, x| most.max(x.abs()));
    let error = found
        .iter()
        .zip(want)
        .fold(0.0f32, |most, (f, w)| most.max((f - w).abs()));
    error / scale
}

/// One stored type against its widened values, over every reading and variant.
fn stored_equals_widened<S: Stored<Compute = f32>>(name: &str) {
    let sinks = [0.5f32, -1.0, 2.0, 0.0];
    let cases = [
        // (queries, window, kv_heads, soft-cap and sinks, page size)
        (1, None, 1, false, None),
        (1, Some(70), 2, true, None),
        (40, None, 2, false, None),
        (40, Some(50), 1, true, None),
        (1, None, 2, true, Some(64)),
        (40, Some(90), 1, false, Some(32)),
    ];
    for (queries, window, kv_heads, variants, page) in cases {
        let dims = Dims {
            batch: 2,
            heads: 4,
            kv_heads,
            queries,
            keys: 300,
            head_dim: 16,
            window,
        };
        let query = gaussian(dims.query_len(), 1);
        // A cache's head-major rows, room for more than the call reads, the call's from row 5;
        // or a pool of pages, sequence b's page i at `2i + b`.
        let (allocated, first) = (320, 5);
        let rows_of = |seed| {
            let mut rows = gaussian(dims.batch * kv_heads * allocated * dims.head_dim, seed);
            // A row the call reads is zeros: scale 0.
            rows[first * dims.head_dim..(first + 1) * dims.head_dim].fill(0.0);
            rows
        };
        let (stored_keys, stored_values) =
            (store::<S>(&rows_of(2), 16), store::<S>(&rows_of(3), 16));
        let (key_rows, tables);
        match page {
            None => {
                key_rows = KeyRows::Rows {
                    first,
                    per_sequence: allocated,
                    head_major: true,
                };
            }
            Some(size) => {
                // `allocated · batch` positions per head are `count` pages.
                let count = allocated * dims.batch / size;
                let per_sequence = dims.keys.div_ceil(size);
                tables = (0..dims.batch)
                    .flat_map(|b| (0..per_sequence).map(move |i| (2 * i + b) as u32))
                    .collect::<Vec<u32>>();
                assert!(tables.iter().all(|&page| (page as usize) < count));
                key_rows = KeyRows::Pages(Pages {
                    tables: &tables,
                    per_sequence,
                    size,
                    count,
                });
            }
        }
        let scoring = Scoring {
            softcap: variants.then_some(5.0),
            sinks: variants.then_some(&sinks[..]),
            ..Scoring::plain(dims.head_dim)
        };
        let inputs = |key, value| Inputs {
            dims,
            query: &query,
            key,
            value,
            key_rows,
            key_padding: None,
            documents: None,
            scoring,
        };
        let found = forward(inputs(buffer(&stored_keys), buffer(&stored_values)));
        let want = forward(inputs(
            KvBuffer::Float(&stored_keys.widened),
            KvBuffer::Float(&stored_values.widened),
        ));
        let error = relative_max(&found.output, &want.output);
        let case = format!(
            "{name}: {queries} queries, window {window:?}, {kv_heads} kv heads, pages {page:?}"
        );
        assert!(error <= 1e-5, "{case}: off by {error:e}");
        assert!(found.output.iter().all(|x| x.is_finite()), "{case}");
    }
}

#[test]
fn stored_keys_equal_their_widened_values_in_every_reading() {
    stored_equals_widened::<half::f16>("f16");
    stored_equals_widened::<half::bf16>("bf16");
    stored_equals_widened::<i8>("int8");
}

/// A decoding step of 12 heads of 64 over 1 000 cached positions, stored narrow against `f32`:
/// relative L2 of the outputs. `outliers`: four key features 10× the rest, as real keys have.
fn decode_error<S: Stored<Compute = f32>>(outliers: bool) -> f64 {
    let dims = Dims {
        batch: 1,
        heads: 12,
        kv_heads: 12,
        queries: 1,
        keys: 1000,
        head_dim: 64,
        window: None,
    };
    let query = gaussian(dims.query_len(), 11);
    let mut keys = gaussian(dims.key_len(), 12);
    if outliers {
        for row in keys.chunks_exact_mut(dims.head_dim) {
            for feature in [3, 17, 40, 61] {
                row[feature] *= 10.0;
            }
        }
    }
    let values = gaussian(dims.key_len(), 13);
    let rows = KeyRows::Rows {
        first: 0,
        per_sequence: dims.keys,
        head_major: true,
    };
    let (stored_keys, stored_values) = (store::<S>(&keys, 64), store::<S>(&values, 64));
    let inputs = |key, value| Inputs {
        dims,
        query: &query,
        key,
        value,
        key_rows: rows,
        key_padding: None,
        documents: None,
        // Scores of about unit size, as a trained model's: the test is of the cache, not of a
        // softmax saturated by 8σ scores.
        scoring: Scoring {
            scale: if outliers { 0.02 } else { 0.125 },
            ..Scoring::plain(dims.head_dim)
        },
    };
    let exact = forward(inputs(KvBuffer::Float(&keys), KvBuffer::Float(&values)));
    let stored = forward(inputs(buffer(&stored_keys), buffer(&stored_values)));
    test_support::relative_l2(&stored.output, &exact.output)
}

#[test]
fn a_decoding_step_loses_what_each_type_promises() {
    let gaussian_int8 = decode_error::<i8>(false);
    let outlier_int8 = decode_error::<i8>(true);
    let gaussian_f16 = decode_error::<half::f16>(false);
    let gaussian_bf16 = decode_error::<half::bf16>(false);
    eprintln!(
        "relative L2: int8 {gaussian_int8:e} (outliers {outlier_int8:e}), f16 {gaussian_f16:e}, bf16 {gaussian_bf16:e}"
    );
    assert!(
        gaussian_int8 <= 0.015,
        "int8 on Gaussian keys: {gaussian_int8:e}"
    );
    assert!(
        outlier_int8 <= 0.03,
        "int8 with outlier channels: {outlier_int8:e}"
    );
    assert!(gaussian_f16 <= 1e-3, "f16: {gaussian_f16:e}");
    assert!(gaussian_bf16 <= 1e-2, "bf16: {gaussian_bf16:e}");
    // Rounding is not nothing: a type that stored f32 unchanged would pass the bounds above.
    assert!(gaussian_int8 > 1e-4 && gaussian_f16 > 1e-6);
}

#[test]
fn int8_rows_keep_their_largest_element_and_zero_rows() {
    let row = [0.5f32, -2.0, 1.0, 0.0];
    let mut to = [0i8; 4];
    let scale = <i8 as Stored>::encode(&row, &mut to);
    assert_eq!(to, [32, -127, 64, 0]);
    assert_eq!(scale * f32::from(to[1]), -2.0);
    assert_eq!(<i8 as Stored>::encode(&[0.0; 4], &mut to), 0.0);
    assert_eq!(to, [0; 4]);
    assert!(<i8 as Stored>::encode(&[1.0, f32::NAN, 0.0, 0.0], &mut to).is_nan());
}

#[test]
fn halves_saturate_past_their_range_and_keep_infinities() {
    let mut to = [half::f16::ZERO; 4];
    <half::f16 as Stored>::encode(&[1.0e6, -7.0e4, f32::INFINITY, 0.5], &mut to);
    let back: Vec<f32> = to.iter().map(|x| x.to_f32()).collect();
    assert_eq!(back, [65_504.0, -65_504.0, f32::INFINITY, 0.5]);
    let mut to = [half::bf16::ZERO; 2];
    <half::bf16 as Stored>::encode(&[f32::MAX, f32::NEG_INFINITY], &mut to);
    assert_eq!(to, [half::bf16::MAX, half::bf16::NEG_INFINITY]);
}
