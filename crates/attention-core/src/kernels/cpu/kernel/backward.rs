//! The backward pass: each key block's weights recomputed from the saved log-sum-exp, per
//! (sequence, key/value head) group, its key blocks dealt to several tasks when the groups are
//! fewer than the threads.

use ndarray::{Array2, ArrayViewMut2, Axis, ShapeBuilder, Slice};
use rayon::prelude::*;

use super::*;
use cpu_linalg::simd::mat_mul;

/// The gradients of `sum(output ⊙ output_grad)` with respect to query, key and value, given the
/// forward pass's `output` and `log_sum_exp`.
///
/// # Shapes
/// - `output`, `output_grad`: `[batch, queries, heads, head_dim]`
/// - `log_sum_exp`: `[batch, queries, heads]`
pub fn backward<E: KernelFloat>(
    inputs: Inputs<E>,
    forward: &Forward<E>,
    output_grad: &[E],
) -> Gradients<E> {
    let splits = key_splits(&inputs.dims, rayon::current_num_threads());
    backward_in_splits(inputs, forward, output_grad, splits)
}

/// How many tasks share the keys of one (sequence, key/value head) pair in the backward pass:
/// one while the pairs alone give every thread work, else enough for about two tasks per
/// thread (FlashAttention-2's split over key blocks). The split count is a function of the
/// shape and the thread count only, so results are reproducible for a given pool.
pub(super) fn key_splits(dims: &Dims, threads: usize) -> usize {
    let pairs = dims.batch * dims.kv_heads;
    let key_blocks = dims.keys.div_ceil(KEY_BLOCK).max(1);
    if pairs >= threads {
        1
    } else {
        (2 * threads).div_ceil(pairs).min(key_blocks)
    }
}

/// [`backward`] with the keys of each (sequence, key/value head) pair dealt to `splits` tasks:
/// task `s` takes key blocks `s, s + splits, …` (interleaved, since under the causal mask later
/// keys are seen by fewer queries). Each task owns its key and value gradient rows and a
/// partial query gradient of the group; the partials are summed in task order.
pub(super) fn backward_in_splits<E: KernelFloat>(
    inputs: Inputs<E>,
    forward: &Forward<E>,
    output_grad: &[E],
    splits: usize,
) -> Gradients<E> {
    inputs.check();
    let dims = inputs.dims;
    assert_eq!(
        inputs.key_rows,
        KeyRows::packed(&dims),
        "the backward pass reads packed keys"
    );
    assert_eq!(
        output_grad.len(),
        dims.query_len(),
        "output gradient for {dims:?}"
    );
    let per_task: Vec<GroupGradients<E>> = (0..dims.batch * dims.kv_heads * splits)
        .into_par_iter()
        .map(|task| {
            let (pair, split) = (task / splits, task % splits);
            let pair = [pair / dims.kv_heads, pair % dims.kv_heads];
            backward_group(&inputs, forward, output_grad, pair, (split, splits))
        })
        .collect();
    let mut gradients = Gradients {
        query: vec![E::zero(); dims.query_len()],
        key: vec![E::zero(); dims.key_len()],
        value: vec![E::zero(); dims.key_len()],
        sinks: inputs
            .scoring
            .sinks
            .map(|sinks| sink_gradients(&dims, sinks, forward, output_grad)),
    };
    let mut tasks = per_task.into_iter();
    for pair in 0..dims.batch * dims.kv_heads {
        let (batch, kv_head) = (pair / dims.kv_heads, pair % dims.kv_heads);
        // The pair's first task's buffers take the sums: no copy where there is one task.
        let GroupGradients {
            mut query,
            mut key,
            mut value,
        } = tasks.next().expect("one task per split of every pair");
        for task in tasks.by_ref().take(splits - 1) {
            add_in_parallel(&mut query, &task.query);
            add_in_parallel(&mut key, &task.key);
            add_in_parallel(&mut value, &task.value);
        }
        let query_start = batch * dims.queries * dims.width();
        let query_end = query_start + dims.queries * dims.width();
        let first_head = kv_head * dims.group();
        dims.scatter_group(
            query.as_slice().expect("gradients are row-major"),
            first_head * dims.head_dim,
            &mut gradients.query[query_start..query_end],
        );
        let start = batch * dims.keys * dims.kv_width() + kv_head * dims.head_dim;
        for (data, grad) in [(&mut gradients.key, key), (&mut gradients.value, value)] {
            let shape = grad.dim().strides((dims.kv_width(), 1));
            ArrayViewMut2::from_shape(shape, &mut data[start..])
                .expect("the buffer holds the tensor")
                .assign(&grad);
        }
    }
    gradients
}

/// The gradient of each head's sink: `−Σ exp(sink − log Σ exp) · rowsum(dO ⊙ O)` over that
/// head's rows (the sink is a key whose value is zero).
///
/// # Shapes
/// - `sinks`, output: `[heads]`
fn sink_gradients<E: KernelFloat>(
    dims: &Dims,
    sinks: &[E],
    forward: &Forward<E>,
    output_grad: &[E],
) -> Vec<E> {
    let mut gradients = vec![E::zero(); dims.heads];
    let rows = forward
        .output
        .chunks(dims.head_dim)
        .zip(output_grad.chunks(dims.head_dim))
        .zip(&forward.log_sum_exp);
    for (row, ((output, output_grad), &log_sum_exp)) in rows.enumerate() {
        let head = row % dims.heads;
        let dot = output
            .iter()
            .zip(output_grad)
            .fold(E::zero(), |sum, (&o, &g)| sum + o * g);
        gradients[head] = gradients[head] - (sinks[head] - log_sum_exp).exp() * dot;
    }
    gradients
}

/// `total += part`, element by element, split across threads.
fn add_in_parallel<E: KernelFloat>(total: &mut Array2<E>, part: &Array2<E>) {
    const CHUNK: usize = 1 << 14;
    let total = total.as_slice_mut().expect("gradients are row-major");
    let part = part.as_slice().expect("gradients are row-major");
    total
        .par_chunks_mut(CHUNK)
        .zip(part.par_chunks(CHUNK))
        .for_each(|(total, part)| total.iter_mut().zip(part).for_each(|(t, &p)| *t = *t + p));
}

/// One backward task's share of the gradients of one (sequence, key/value head) pair.
struct GroupGradients<E> {
    /// The group's query heads stacked position-major: `[queries · group, head_dim]`.
    query: Array2<E>,
    /// `[keys, head_dim]`
    key: Array2<E>,
    /// `[keys, head_dim]`
    value: Array2<E>,
}

/// The gradients from key blocks `split, split + splits, …` of key/value head `kv_head` of
/// sequence `batch`, for the whole group of query heads that reads it, stacked so that each
/// block product covers the group.
fn backward_group<E: KernelFloat>(
    inputs: &Inputs<E>,
    forward: &Forward<E>,
    output_grad: &[E],
    [batch, kv_head]: [usize; 2],
    (split, splits): (usize, usize),
) -> GroupGradients<E> {
    let dims = inputs.dims;
    let group = dims.group();
    let stacked = dims.queries * group;
    let all_queries = 0..dims.queries;
    let gather = |data: &[E], positions| {
        let mut stacked_rows = Array2::zeros((stacked, dims.head_dim));
        let rows = stacked_rows
            .as_slice_mut()
            .expect("a new array is row-major");
        dims.gather_group(data, batch, kv_head, positions, rows);
        stacked_rows
    };
    let query = gather(inputs.query, all_queries.clone());
    let query_output_grad = gather(output_grad, all_queries);
    let key = inputs.key_view(inputs.key.floats(), batch, kv_head);
    let value = inputs.key_view(inputs.value.floats(), batch, kv_head);
    // Per stacked row: log Σ exp, and Σ_d dO ⊙ O, the softmax gradient's row term.
    // `[batch, queries, heads, width]` indices of the group at `position`.
    let group_rows = |position: usize, width: usize| {
        let start = ((batch * dims.queries + position) * dims.heads + kv_head * group) * width;
        start..start + group * width
    };
    let log_sum_exp: Vec<E> = (0..dims.queries)
        .flat_map(|position| forward.log_sum_exp[group_rows(position, 1)].iter().copied())
        .collect();
    let row_dot: Vec<E> = (0..dims.queries)
        .flat_map(|position| {
            let rows = group_rows(position, dims.head_dim);
            let (output, output_grad) = (&forward.output[rows.clone()], &output_grad[rows]);
            output
                .chunks(dims.head_dim)
                .zip(output_grad.chunks(dims.head_dim))
                .map(|(o, g)| o.iter().zip(g).fold(E::zero(), |sum, (&o, &g)| sum + o * g))
        })
        .collect();

    let positions = dims.positions_per_product();
    let mut weights_buffer = vec![E::zero(); positions * group * KEY_BLOCK];
    let mut score_grad_buffer = vec![E::zero(); positions * group * KEY_BLOCK];
    // With a soft-cap: the capped scores of the block, for the cap's derivative.
    let softcap = inputs.scoring.softcap;
    let mut capped_buffer = vec![E::zero(); softcap.map_or(0, |_| positions * group * KEY_BLOCK)];
    let mut grads = GroupGradients {
        query: Array2::zeros((stacked, dims.head_dim)),
        key: Array2::zeros((dims.keys, dims.head_dim)),
        value: Array2::zeros((dims.keys, dims.head_dim)),
    };
    for cols in inputs
        .blocks(batch, 0..dims.keys, KEY_BLOCK)
        .skip(split)
        .step_by(splits)
    {
        let key_block = key.slice_axis(Axis(0), Slice::from(cols.clone()));
        let value_block = value.slice_axis(Axis(0), Slice::from(cols.clone()));
        // The queries that see a key of this block: from the first that sees key `cols.start`
        // (causal) to the last whose window reaches back into the block, within the document
        // of its last key.
        let first_query = cols.start.saturating_sub(dims.offset());
        let end_query = inputs.queries_seeing(batch, &cols);
        for row_start in (first_query..end_query).step_by(positions) {
            let row_end = (row_start + positions).min(end_query);
            let rows = row_start * group..row_end * group;
            let query_block = query.slice_axis(Axis(0), Slice::from(rows.clone()));
            let output_grad_block =
                query_output_grad.slice_axis(Axis(0), Slice::from(rows.clone()));
            // The weights, rebuilt: exp(scores − log Σ exp), 0 where masked.
            let mut weights = block_matrix(&mut weights_buffer, rows.len(), cols.len());
            inputs.masked_scores(
                batch,
                &query_block,
                (&Block::Floats(key_block), None),
                row_start,
                cols.clone(),
                &mut weights,
            );
            if softcap.is_some() {
                block_matrix(&mut capped_buffer, rows.len(), cols.len()).assign(&weights);
            }
            for (mut row, &lse) in weights
                .rows_mut()
                .into_iter()
                .zip(&log_sum_exp[rows.clone()])
            {
                let row = row.as_slice_mut().expect("weights are row-major");
                if lse == E::neg_infinity() {
                    row.fill(E::zero());
                } else {
                    E::exp_shifted_sum(row, lse);
                }
            }
            let mut value_grad_block = grads
                .value
                .slice_axis_mut(Axis(0), Slice::from(cols.clone()));
            mat_mul(
                E::one(),
                &weights.t(),
                &output_grad_block,
                E::one(),
                &mut value_grad_block,
            );
            // dS = P ⊙ (dO vᵀ − rowdot), then dQ += dS k · scale and dK += dSᵀ q · scale.
            let mut score_grad = block_matrix(&mut score_grad_buffer, rows.len(), cols.len());
            mat_mul(
                E::one(),
                &output_grad_block,
                &value_block.t(),
                E::zero(),
                &mut score_grad,
            );
            for ((mut grad_row, weight_row), &dot) in score_grad
                .rows_mut()
                .into_iter()
                .zip(weights.rows())
                .zip(&row_dot[rows.clone()])
            {
                grad_row.zip_mut_with(&weight_row, |g, &w| *g = w * (*g - dot));
            }
            // Through the cap: d(c · tanh(s / c)) / ds = 1 − tanh², where a weight is nonzero.
            if let Some(cap) = softcap {
                let inverse = cap.recip();
                let capped = block_matrix(&mut capped_buffer, rows.len(), cols.len());
                score_grad.zip_mut_with(&capped, |g, &s| {
                    if *g != E::zero() {
                        let tanh = s * inverse;
                        *g = *g * (E::one() - tanh * tanh);
                    }
                });
            }
            let mut query_grad_block = grads.query.slice_axis_mut(Axis(0), Slice::from(rows));
            mat_mul(
                inputs.scoring.scale,
                &score_grad,
                &key_block,
                E::one(),
                &mut query_grad_block,
            );
            let mut key_grad_block = grads.key.slice_axis_mut(Axis(0), Slice::from(cols.clone()));
            mat_mul(
                inputs.scoring.scale,
                &score_grad.t(),
                &query_block,
                E::one(),
                &mut key_grad_block,
            );
        }
    }
    grads
}
