//! A ragged step on the CPU kernel: each sequence's new queries over its keys and values where
//! they lie in the page pool's host storage, read through the sequence's page table.

use burn::prelude::*;
use burn::tensor::TensorData;
use rayon::prelude::*;

use super::host_cache::{HostKv, HostStorage, Stored, with_host_kv};
use super::kernel::{self, Dims, Inputs, KeyRows, Pages};
use super::op::scoring;
use crate::kernels::{PagedInputs, PagedStorage};
use crate::paged::RaggedStep;
use crate::score_rule::{ScoreRule, scale_for};

/// Causal attention of a ragged step's packed queries, each sequence over its own pages in host
/// memory (`Bare`, which `B` is, is the kernel list's entry shape).
///
/// # Shapes
/// - `inputs.query`: `[1, tokens, heads · head_dim]`, the step's sequences one after another
/// - host pages: `[kv_heads, pages · page_size, head_dim]`
/// - output: `[1, tokens, heads · head_dim]`
#[allow(clippy::extra_unused_type_parameters)]
pub(crate) fn paged<B: Backend, Bare>(inputs: PagedInputs<'_, B>) -> Tensor<B, 3> {
    let PagedStorage::CpuHost(pages) = inputs.pages else {
        unreachable!("the CPU kernel's pages are host memory")
    };
    let PagedInputs {
        query,
        step,
        heads,
        scores,
        ..
    } = inputs;
    with_host_kv!(pages, kv => run(query, step, heads, scores, kv))
}

/// [`paged`] over host pages of stored type `S`.
fn run<B: Backend, S: Stored>(
    query: Tensor<B, 3>,
    step: &RaggedStep,
    heads: usize,
    scores: ScoreRule<B>,
    kv: &HostKv<S>,
) -> Tensor<B, 3> {
    let device = query.device();
    let [_, tokens, width] = query.dims();
    let query = query.into_data().convert::<S::Compute>();
    let query: &[S::Compute] = query.as_slice().expect("converted to the pages' precision");
    let ScoreRule {
        scale,
        softcap,
        sinks,
    } = scores;
    let sinks: Option<Vec<S::Compute>> = sinks.map(|sinks| {
        let sinks = sinks.into_data().convert::<S::Compute>();
        sinks.into_vec().expect("converted to the pages' precision")
    });
    let head_dim = width / heads;
    assert_eq!(
        head_dim, kv.head_dim,
        "the queries' and the pages' head size"
    );
    let (tables, per_sequence) = step.tables();
    let [key, value] = kv.buffers();
    let parts: Vec<Vec<S::Compute>> = step
        .sequences()
        .par_iter()
        .enumerate()
        .map(|(index, sequence)| {
            let rows = step.offsets()[index] * width..step.offsets()[index + 1] * width;
            let dims = Dims {
                batch: 1,
                heads,
                kv_heads: kv.kv_heads,
                queries: sequence.new,
                keys: sequence.keys(),
                head_dim,
                window: step.window(),
            };
            let table = &tables[index * per_sequence..(index + 1) * per_sequence];
            kernel::forward(Inputs {
                dims,
                query: &query[rows],
                key,
                value,
                key_rows: KeyRows::Pages(Pages {
                    tables: table,
                    per_sequence,
                    size: step.page_size(),
                    count: step.pool_pages(),
                }),
                key_padding: None,
                documents: None,
                scoring: scoring(scale_for(scale, head_dim), softcap, sinks.as_deref()),
            })
            .output
        })
        .collect();
    Tensor::from_data(TensorData::new(parts.concat(), [1, tokens, width]), &device)
}
