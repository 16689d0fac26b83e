//! A ragged step on the CPU kernel: each sequence's new queries over its keys and values where
//! they lie in the page pool's host storage, read through the sequence's page table.

use burn::prelude::*;
use burn::tensor::{DType, Element, TensorData};
use rayon::prelude::*;

use super::host_cache::{HostStorage, with_host_kv};
use super::kernel::{self, Dims, Inputs, KernelFloat, KeyRows, Pages};
use super::op::scoring;
use crate::kernels::{PagedInputs, PagedStorage};
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
    let device = query.device();
    let [_, tokens, width] = query.dims();
    let query = query.into_data();
    let ScoreRule {
        scale,
        softcap,
        sinks,
    } = scores;
    let sinks = sinks.map(Tensor::into_data);
    with_host_kv!(pages, kv => {
        let dtype = element_dtype(&kv.keys);
        let query = query.convert_dtype(dtype);
        let sinks = sinks.map(|sinks| sinks.convert_dtype(dtype).into_vec().expect("converted"));
        let head_dim = width / heads;
        assert_eq!(head_dim, kv.head_dim, "the queries' and the pages' head size");
        let (tables, per_sequence) = step.tables();
        let query: &[_] = query.as_slice().expect("converted to the pages' precision");
        let parts: Vec<Vec<_>> = step
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
                    key: &kv.keys,
                    value: &kv.values,
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
    })
}

fn element_dtype<E: Element + KernelFloat>(_: &[E]) -> DType {
    E::dtype()
}
