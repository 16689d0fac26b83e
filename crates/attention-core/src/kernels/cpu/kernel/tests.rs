//! The kernel against the textbook formula, computed densely in f64 on the same inputs.

use super::backward::{backward_in_splits, key_splits};
use super::forward::{forward_block, forward_by_head, kv_splits};
use super::*;

/// Deterministic values in [-2, 2).
fn values(len: usize, seed: u64) -> Vec<f64> {
    test_support::values(len, seed)
        .into_iter()
        .map(|x| 2.0 * x)
        .collect()
}

/// Dense causal attention and its gradients for `loss = Σ output ⊙ output_grad`.
fn reference(inputs: &Inputs<f64>, output_grad: &[f64]) -> (Vec<f64>, Gradients<f64>) {
    let d = inputs.dims;
    let Scoring {
        scale,
        softcap,
        sinks,
    } = inputs.scoring;
    let at = |rows: usize, b: usize, t: usize, h: usize, c: usize| {
        ((b * rows + t) * d.heads + h) * d.head_dim + c
    };
    // Key/value element `c` of the head query head `h` reads.
    let kv = |b: usize, j: usize, h: usize, c: usize| {
        ((b * d.keys + j) * d.kv_heads + h / (d.heads / d.kv_heads)) * d.head_dim + c
    };
    let mut output = vec![0.0; d.query_len()];
    let mut grads = Gradients {
        query: vec![0.0; d.query_len()],
        key: vec![0.0; d.key_len()],
        value: vec![0.0; d.key_len()],
        sinks: sinks.map(|_| vec![0.0; d.heads]),
    };
    for b in 0..d.batch {
        for h in 0..d.heads {
            for i in 0..d.queries {
                let position = i + d.offset();
                let visible = |j: usize| {
                    j <= position
                        && d.window.is_none_or(|w| position - j < w)
                        && !inputs.key_padding.is_some_and(|p| p[b * d.keys + j])
                        && inputs
                            .documents
                            .is_none_or(|spans| j as u32 >= spans[2 * (b * d.keys + i)])
                };
                let scores: Vec<f64> = (0..d.keys)
                    .map(|j| {
                        (0..d.head_dim)
                            .map(|c| {
                                inputs.query[at(d.queries, b, i, h, c)]
                                    * inputs.key.floats()[kv(b, j, h, c)]
                            })
                            .sum::<f64>()
                            * scale
                    })
                    .map(|s| softcap.map_or(s, |c| c * (s / c).tanh()))
                    .collect();
                let sink = sinks.map(|sinks| sinks[h]);
                let max = (0..d.keys)
                    .filter(|&j| visible(j))
                    .map(|j| scores[j])
                    .chain(sink)
                    .fold(f64::NEG_INFINITY, f64::max);
                if max == f64::NEG_INFINITY {
                    continue;
                }
                let exp: Vec<f64> = (0..d.keys)
                    .map(|j| {
                        if visible(j) {
                            (scores[j] - max).exp()
                        } else {
                            0.0
                        }
                    })
                    .collect();
                let sink_exp = sink.map_or(0.0, |sink| (sink - max).exp());
                let sum: f64 = exp.iter().sum::<f64>() + sink_exp;
                let weights: Vec<f64> = exp.iter().map(|e| e / sum).collect();
                for c in 0..d.head_dim {
                    output[at(d.queries, b, i, h, c)] = (0..d.keys)
                        .map(|j| weights[j] * inputs.value.floats()[kv(b, j, h, c)])
                        .sum();
                }
                let go = |c: usize| output_grad[at(d.queries, b, i, h, c)];
                let weight_grad: Vec<f64> = (0..d.keys)
                    .map(|j| {
                        (0..d.head_dim)
                            .map(|c| go(c) * inputs.value.floats()[kv(b, j, h, c)])
                            .sum()
                    })
                    .collect();
                let dot: f64 = (0..d.keys).map(|j| weights[j] * weight_grad[j]).sum();
                if let Some(sink_grads) = &mut grads.sinks {
                    sink_grads[h] -= sink_exp / sum * dot;
                }
                for j in 0..d.keys {
                    let cap_grad = softcap.map_or(1.0, |c| 1.0 - (scores[j] / c).powi(2));
                    let score_grad = weights[j] * (weight_grad[j] - dot) * cap_grad * scale;
                    for c in 0..d.head_dim {
                        grads.value[kv(b, j, h, c)] += weights[j] * go(c);
                        grads.query[at(d.queries, b, i, h, c)] +=
                            score_grad * inputs.key.floats()[kv(b, j, h, c)];
                        grads.key[kv(b, j, h, c)] +=
                            score_grad * inputs.query[at(d.queries, b, i, h, c)];
                    }
                }
            }
        }
    }
    (output, grads)
}

fn max_error(found: &[f64], expected: &[f64]) -> f64 {
    assert_eq!(found.len(), expected.len());
    found
        .iter()
        .zip(expected)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max)
}

/// Runs the kernel in f64 and f32 against the reference, forward and backward.
fn check(dims: Dims, key_padding: Option<Vec<bool>>) {
    check_scored(dims, key_padding, &Scored::default());
}

/// A check's scale (default `1/√head_dim`), soft-cap and sinks, in f64, and its sequences'
/// documents (their spans, as [`Inputs::documents`]).
#[derive(Debug, Clone, Default)]
struct Scored {
    scale: Option<f64>,
    softcap: Option<f64>,
    sinks: Option<Vec<f64>>,
    documents: Option<Vec<u32>>,
}

impl Scored {
    /// The kernel's scoring in `E`, with `sinks` converted by the caller.
    fn scoring<'a, E: KernelFloat>(&self, dims: &Dims, sinks: Option<&'a [E]>) -> Scoring<'a, E> {
        let plain = Scoring::<E>::plain(dims.head_dim);
        Scoring {
            scale: self.scale.map_or(plain.scale, |s| E::from(s).unwrap()),
            softcap: self.softcap.map(|c| E::from(c).unwrap()),
            sinks,
        }
    }
}

/// [`check`] with a scale, a soft-cap and sinks.
fn check_scored(dims: Dims, key_padding: Option<Vec<bool>>, scored: &Scored) {
    let data = [
        values(dims.query_len(), 1),
        values(dims.key_len(), 2),
        values(dims.key_len(), 3),
        values(dims.query_len(), 4), // the output's gradient
    ];
    let inputs = Inputs::packed(dims, [&data[0], &data[1], &data[2]], key_padding.as_deref())
        .with_scoring(scored.scoring(&dims, scored.sinks.as_deref()))
        .with_documents(scored.documents.as_deref());
    let expected = reference(&inputs, &data[3]);
    let padding = key_padding.as_deref();
    check_in::<f64>(dims, padding, scored, &data, &expected, [1e-12, 1e-12]);
    check_in::<f32>(dims, padding, scored, &data, &expected, [2e-6, 2e-5]);
}

/// The kernel in `E` on `data` (query, key, value, output gradient) against the reference's
/// output and gradients, within `tolerance` (output, gradients).
fn check_in<E: KernelFloat>(
    dims: Dims,
    key_padding: Option<&[bool]>,
    scored: &Scored,
    data: &[Vec<f64>; 4],
    (expected, expected_grads): &(Vec<f64>, Gradients<f64>),
    [output_tolerance, grad_tolerance]: [f64; 2],
) {
    let precision = std::any::type_name::<E>();
    let [query, key, value, output_grad] = data
        .each_ref()
        .map(|xs| xs.iter().map(|&x| E::from(x).unwrap()).collect::<Vec<E>>());
    let widen = |xs: &[E]| xs.iter().map(|x| x.to_f64().unwrap()).collect::<Vec<f64>>();
    let sinks: Option<Vec<E>> = scored
        .sinks
        .as_ref()
        .map(|sinks| sinks.iter().map(|&x| E::from(x).unwrap()).collect());
    let inputs = Inputs::packed(dims, [&query, &key, &value], key_padding)
        .with_scoring(scored.scoring(&dims, sinks.as_deref()))
        .with_documents(scored.documents.as_deref());
    let forward = super::forward(inputs);
    let error = max_error(&widen(&forward.output), expected);
    assert!(
        error < output_tolerance,
        "{precision} output off by {error}, {dims:?}"
    );
    // Decoding with the keys split across tasks (combined by their log-sum-exps) gives the
    // unsplit kernel's output to 1e-6 of its scale, and its log-sum-exp.
    if dims.queries <= QUERY_BLOCK {
        let scale = widen(&forward.output)
            .iter()
            .fold(1.0f64, |max, x| max.max(x.abs()));
        for splits in [1, 2, 3] {
            let mut output = vec![E::zero(); dims.query_len()];
            let mut log_sum_exp = vec![E::neg_infinity(); dims.batch * dims.queries * dims.heads];
            forward_by_head(&inputs, splits, &mut output, &mut log_sum_exp);
            let error = max_error(&widen(&output), &widen(&forward.output)) / scale;
            assert!(
                error < 1e-6,
                "{precision} {splits} splits: output off by {error} of its scale, {dims:?}"
            );
            let found = widen(&log_sum_exp);
            let unsplit = widen(&forward.log_sum_exp);
            for (found, unsplit) in found.iter().zip(&unsplit) {
                let same = found == unsplit || (found - unsplit).abs() < 1e-6 * unsplit.abs();
                assert!(
                    same,
                    "{precision} {splits} splits: log-sum-exp {found} vs {unsplit}"
                );
            }
        }
    }
    // One task per (sequence, key/value head), and the keys of each dealt to three.
    for splits in [1, 3] {
        let grads = backward_in_splits(inputs, &forward, &output_grad, splits);
        for (name, found, expected) in [
            ("query", &grads.query, &expected_grads.query),
            ("key", &grads.key, &expected_grads.key),
            ("value", &grads.value, &expected_grads.value),
        ] {
            let error = max_error(&widen(found), expected);
            assert!(
                error < grad_tolerance,
                "{precision} {name} gradient off by {error}, {splits} splits, {dims:?}"
            );
        }
        match (&grads.sinks, &expected_grads.sinks) {
            (Some(found), Some(expected)) => {
                let error = max_error(&widen(found), expected);
                // A sum over every row of its head: a longer sum than the others.
                assert!(
                    error < 10.0 * grad_tolerance,
                    "{precision} sinks gradient off by {error}, {scored:?}, {dims:?}"
                );
            }
            (None, None) => {}
            _ => panic!("a sinks gradient iff the call has sinks"),
        }
    }
}

fn dims(batch: usize, heads: usize, queries: usize, keys: usize, head_dim: usize) -> Dims {
    Dims {
        batch,
        heads,
        kv_heads: heads,
        queries,
        keys,
        head_dim,
        window: None,
    }
}

#[test]
fn matches_the_formula_within_one_block() {
    check(dims(1, 2, 6, 6, 2), None); // the chapter's shape
    check(dims(2, 3, 5, 5, 4), None);
}

#[test]
fn matches_the_formula_across_blocks_of_uneven_size() {
    // 200 queries: blocks of 64 with a short last one; keys in 128s with a short last one.
    check(dims(2, 2, 200, 200, 8), None);
}

#[test]
fn matches_the_formula_for_queries_after_cached_keys() {
    check(dims(1, 2, 1, 150, 4), None); // one decoding step
    check(dims(2, 1, 70, 300, 4), None);
    // Decoding over 6 key blocks with one key/value head: split across tasks.
    let multi_query = Dims {
        kv_heads: 1,
        ..dims(1, 4, 3, 700, 8)
    };
    check(multi_query, None);
    check(
        Dims {
            window: Some(300),
            ..multi_query
        },
        Some((0..700).map(|j| j < 5).collect()),
    );
}

#[test]
fn matches_the_formula_with_padding_and_fully_masked_rows() {
    let (batch, keys) = (2, 140);
    // Sequence 0 left-padded by 3 (its first queries see only padding), 1 right-padded by 70.
    let padding: Vec<bool> = (0..batch * keys)
        .map(|n| {
            let (b, j) = (n / keys, n % keys);
            if b == 0 { j < 3 } else { j >= keys - 70 }
        })
        .collect();
    check(dims(batch, 2, keys, keys, 4), Some(padding));
}

#[test]
fn matches_the_formula_with_grouped_heads_and_windows() {
    // (kv heads, window, batch, heads, queries, keys, head_dim): multi-query and groups of
    // 2, across blocks; windows inside one block, of 1, across block edges, wider
    // than the sequence, with cached keys and grouped heads.
    let cases = [
        (1, None, 2, 4, 7, 7, 4),
        (2, None, 1, 4, 150, 150, 4),
        (3, None, 1, 6, 1, 140, 2),
        (2, Some(4), 1, 2, 9, 9, 4),
        (1, Some(1), 1, 1, 5, 5, 2),
        (2, Some(70), 2, 2, 300, 300, 4),
        (1, Some(200), 1, 1, 150, 150, 2),
        (1, Some(130), 1, 2, 20, 333, 4),
        // Groups of 3 stack 21 positions per product (63 rows): parts end off the blocks.
        (2, None, 2, 6, 150, 150, 4),
        (2, Some(50), 1, 6, 100, 230, 4),
    ];
    for (kv_heads, window, batch, heads, queries, keys, head_dim) in cases {
        let base = dims(batch, heads, queries, keys, head_dim);
        check(
            Dims {
                kv_heads,
                window,
                ..base
            },
            None,
        );
    }
    let padding: Vec<bool> = (0..2 * 140).map(|n| n % 140 < 5).collect();
    let base = dims(2, 2, 140, 140, 4);
    check(
        Dims {
            window: Some(3),
            kv_heads: 1,
            ..base
        },
        Some(padding),
    );
}

#[test]
fn matches_the_formula_with_a_scale_a_softcap_and_sinks() {
    // Groups of 2 across key blocks, a window across a block edge, and sequence 0 left-padded
    // by 3 (its first queries see only padding: with a sink they give the sink all weight).
    let grouped = Dims {
        kv_heads: 2,
        window: Some(70),
        ..dims(2, 4, 140, 140, 8)
    };
    let padding: Vec<bool> = (0..2 * 140).map(|i| i < 3).collect();
    let decoding = Dims {
        kv_heads: 1,
        ..dims(1, 4, 2, 150, 8)
    };
    let sinks = Some(vec![0.5, -1.0, 2.0, 0.0]);
    // Scores reach ±8 here (8 features in [-2, 2)): a cap of 1.5 bends most of them.
    let cases = [
        Scored {
            scale: Some(0.3),
            ..Scored::default()
        },
        Scored {
            softcap: Some(1.5),
            ..Scored::default()
        },
        Scored {
            sinks: sinks.clone(),
            ..Scored::default()
        },
        Scored {
            scale: Some(0.5),
            softcap: Some(2.0),
            sinks,
            documents: None,
        },
    ];
    for scored in &cases {
        check_scored(grouped, Some(padding.clone()), scored);
        check_scored(decoding, None, scored);
    }
}

/// The spans ([`Inputs::documents`]) of rows packed from documents of these lengths.
fn spans(rows: &[&[usize]]) -> Vec<u32> {
    let mut spans = Vec::new();
    for row in rows {
        let mut start = 0;
        for &length in *row {
            for _ in 0..length {
                spans.extend([start as u32, (start + length) as u32]);
            }
            start += length;
        }
    }
    spans
}

#[test]
fn matches_the_formula_on_rows_packed_from_documents() {
    let packed = |rows: &[&[usize]]| Scored {
        documents: Some(spans(rows)),
        ..Scored::default()
    };
    // Boundaries on and off the 64-query and 128-key block edges, one-token documents, and rows
    // that pack differently.
    check_scored(
        dims(2, 2, 200, 200, 8),
        None,
        &packed(&[&[1, 63, 64, 72], &[37, 1, 1, 150, 11]]),
    );
    check_scored(dims(1, 2, 5, 5, 4), None, &packed(&[&[1, 1, 1, 1, 1]]));
    // A row that is one document, beside one of three, with groups, a window, a soft-cap and
    // sinks.
    let grouped = Dims {
        kv_heads: 2,
        window: Some(70),
        ..dims(2, 4, 300, 300, 8)
    };
    check_scored(
        grouped,
        None,
        &Scored {
            softcap: Some(2.0),
            sinks: Some(vec![0.5, -1.0, 2.0, 0.0]),
            ..packed(&[&[300], &[128, 130, 42]])
        },
    );
    // Few queries (tasks per head, keys split across tasks), a right-padded last document.
    let multi_query = Dims {
        kv_heads: 1,
        ..dims(1, 4, 60, 60, 8)
    };
    let padding = (0..60).map(|j| j >= 50).collect();
    check_scored(multi_query, Some(padding), &packed(&[&[10, 40, 10]]));
}

#[test]
fn decoding_splits_the_keys_only_when_the_pairs_leave_threads_idle() {
    let decode = |kv_heads, keys| Dims {
        kv_heads,
        ..dims(1, 12, 1, keys, 64)
    };
    assert_eq!(kv_splits(&decode(12, 16384), 2), 1); // 12 pairs for 2 threads
    assert_eq!(kv_splits(&decode(1, 16384), 2), 4); // about two tasks per thread
    assert_eq!(kv_splits(&decode(3, 16384), 8), 6);
    assert_eq!(kv_splits(&decode(1, 100), 8), 1); // one key block
    assert_eq!(kv_splits(&decode(1, 300), 8), 3); // a block per split at least
}

#[test]
fn keys_are_split_only_when_the_pairs_leave_threads_idle() {
    let base = dims(1, 12, 4096, 4096, 64);
    assert_eq!(key_splits(&base, 2), 1); // 12 pairs for 2 threads
    assert_eq!(key_splits(&base, 16), 3); // 12 pairs, 36 tasks
    let grouped = Dims {
        kv_heads: 3,
        ..base
    };
    assert_eq!(key_splits(&grouped, 16), 11); // 3 pairs, 33 tasks
    let short = Dims {
        keys: 200,
        queries: 200,
        ..grouped
    };
    assert_eq!(key_splits(&short, 16), 2); // no more tasks than key blocks
}

/// Decoding's split, one task per (sequence, key/value head), gives bit for bit what one
/// task per block over all heads gives, whatever the thread count picks.
#[test]
fn tasks_per_head_give_what_tasks_per_block_give() {
    for (dims, padding) in [
        (
            Dims {
                batch: 1,
                heads: 4,
                kv_heads: 4,
                queries: 1,
                keys: 300,
                head_dim: 8,
                window: None,
            },
            false,
        ),
        (
            Dims {
                batch: 2,
                heads: 6,
                kv_heads: 2,
                queries: 5,
                keys: 140,
                head_dim: 4,
                window: Some(33),
            },
            true,
        ),
        (
            Dims {
                batch: 1,
                heads: 2,
                kv_heads: 1,
                queries: 64,
                keys: 64,
                head_dim: 16,
                window: None,
            },
            false,
        ),
    ] {
        let [query, key, value] = [1, 2, 3].map(|seed| {
            let len = if seed == 1 {
                dims.query_len()
            } else {
                dims.key_len()
            };
            values(len, seed)
                .into_iter()
                .map(|x| x as f32)
                .collect::<Vec<f32>>()
        });
        let padding: Option<Vec<bool>> =
            padding.then(|| (0..dims.batch * dims.keys).map(|i| i % 7 == 3).collect());
        let inputs = Inputs::packed(dims, [&query, &key, &value], padding.as_deref());
        let mut by_head = [
            vec![0.0; dims.query_len()],
            vec![f32::NEG_INFINITY; dims.batch * dims.queries * dims.heads],
        ];
        let [output, log_sum_exp] = &mut by_head;
        forward_by_head(&inputs, 1, output, log_sum_exp);
        let mut by_block = [
            vec![0.0; dims.query_len()],
            vec![f32::NEG_INFINITY; dims.batch * dims.queries * dims.heads],
        ];
        let [output, log_sum_exp] = &mut by_block;
        for ((batch, output), log_sum_exp) in output
            .chunks_mut(dims.queries * dims.width())
            .enumerate()
            .zip(log_sum_exp.chunks_mut(dims.queries * dims.heads))
        {
            forward_block(&inputs, batch, 0, 0..dims.kv_heads, output, log_sum_exp);
        }
        assert_eq!(by_head, by_block, "{dims:?}");
    }
}

/// Keys read from the middle of longer rows (a cache's storage), in either order of rows and
/// heads, give what the same keys packed give.
#[test]
fn keys_inside_longer_rows_are_read_where_they_lie() {
    let dims = Dims {
        batch: 2,
        heads: 4,
        kv_heads: 2,
        queries: 3,
        keys: 150,
        head_dim: 8,
        window: None,
    };
    let query: Vec<f64> = values(dims.query_len(), 1);
    let (first, per_sequence) = (5, 170);
    for head_major in [false, true] {
        let rows = KeyRows::Rows {
            first,
            per_sequence,
            head_major,
        };
        let stored: Vec<Vec<f64>> = [2, 3]
            .iter()
            .map(|&seed| values(dims.batch * per_sequence * dims.kv_width(), seed))
            .collect();
        // Element (b, j, h, c) of the call's keys, where the storage holds it.
        let stored_at = |b: usize, j: usize, h: usize, c: usize| {
            let row = first + j;
            let place = match head_major {
                true => (b * dims.kv_heads + h) * per_sequence + row,
                false => (b * per_sequence + row) * dims.kv_heads + h,
            };
            place * dims.head_dim + c
        };
        let packed: Vec<Vec<f64>> = stored
            .iter()
            .map(|buffer| {
                let mut packed = Vec::new();
                for b in 0..dims.batch {
                    for j in 0..dims.keys {
                        for h in 0..dims.kv_heads {
                            for c in 0..dims.head_dim {
                                packed.push(buffer[stored_at(b, j, h, c)]);
                            }
                        }
                    }
                }
                packed
            })
            .collect();
        let from_rows = forward(Inputs {
            dims,
            query: &query,
            key: KvBuffer::Float(&stored[0]),
            value: KvBuffer::Float(&stored[1]),
            key_rows: rows,
            key_padding: None,
            documents: None,
            scoring: Scoring::plain(dims.head_dim),
        });
        let from_packed = forward(Inputs::packed(dims, [&query, &packed[0], &packed[1]], None));
        assert_eq!(from_rows.output, from_packed.output, "{rows:?}");
        assert_eq!(from_rows.log_sum_exp, from_packed.log_sum_exp, "{rows:?}");
    }
}

/// Keys and values in pages of a pool, in an order of their own and with pages that do not divide
/// the keys, read through each sequence's table, give what the same keys packed give: with a
/// window and sinks, and split across threads when decoding.
#[test]
fn keys_in_pages_are_read_through_the_tables() {
    for (queries, window, size) in [
        (1, None, 32),
        (1, Some(70), 64),
        (40, None, 32),
        (40, Some(50), 128),
    ] {
        let dims = Dims {
            batch: 2,
            heads: 4,
            kv_heads: 2,
            queries,
            keys: 300,
            head_dim: 8,
            window,
        };
        let query: Vec<f64> = values(dims.query_len(), 1);
        let packed: Vec<Vec<f64>> = [2, 3]
            .iter()
            .map(|&seed| values(dims.key_len(), seed))
            .collect();
        let per_sequence = dims.keys.div_ceil(size);
        // Sequence b's page i is pool page `tables[b · per_sequence + i]`, interleaved and
        // reversed, with pool pages no table names.
        let count = 2 * dims.batch * per_sequence + 3;
        let tables: Vec<u32> = (0..dims.batch)
            .flat_map(|b| {
                (0..per_sequence).map(move |i| (2 * (per_sequence - 1 - i) + b) as u32 + 3)
            })
            .collect();
        let pools: Vec<Vec<f64>> = packed
            .iter()
            .map(|packed| {
                let mut pool = vec![f64::NAN; count * dims.kv_heads * size * dims.head_dim];
                for b in 0..dims.batch {
                    for j in 0..dims.keys {
                        let page = tables[b * per_sequence + j / size] as usize;
                        for h in 0..dims.kv_heads {
                            let to = ((h * count + page) * size + j % size) * dims.head_dim;
                            let from = ((b * dims.keys + j) * dims.kv_heads + h) * dims.head_dim;
                            pool[to..to + dims.head_dim]
                                .copy_from_slice(&packed[from..from + dims.head_dim]);
                        }
                    }
                }
                pool
            })
            .collect();
        let sinks = [0.5, -1.0, 2.0, 0.0];
        let scoring = Scoring {
            sinks: Some(&sinks[..]),
            ..Scoring::plain(dims.head_dim)
        };
        let from_pages = forward(Inputs {
            dims,
            query: &query,
            key: KvBuffer::Float(&pools[0]),
            value: KvBuffer::Float(&pools[1]),
            key_rows: KeyRows::Pages(Pages {
                tables: &tables,
                per_sequence,
                size,
                count,
            }),
            key_padding: None,
            documents: None,
            scoring,
        });
        let from_packed = forward(
            Inputs::packed(dims, [&query, &packed[0], &packed[1]], None).with_scoring(scoring),
        );
        let close = from_pages
            .output
            .iter()
            .zip(&from_packed.output)
            .all(|(a, b)| (a - b).abs() <= 1e-12 * b.abs().max(1.0));
        assert!(close, "{dims:?}, pages of {size}");
    }
}
