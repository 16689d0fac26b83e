//! The one seam between the layer and the attention kernels of this crate's own: which backends
//! have a kernel, the kernels' entry points, and what a kernel keeps between decoding steps. The
//! layer (`mha/`), its cache (`cache.rs`) and the route (`route.rs`) ask this module and name no
//! backend.
//!
//! | kernel | module | backends (attention-core's cargo feature) |
//! |---|---|---|
//! | [`Kernel::Cpu`] | `cpu/` | burn-ndarray `f32` and `f64` (`ndarray`), burn-flex (`flex`) |
//! | [`Kernel::Gpu`] | `gpu/` | Burn's `Wgpu` (fused) and its plain `CubeBackend` (`wgpu`); Burn's `Cuda` (fused; f32, f16, bf16) and its plain `CubeBackend` (`cuda`) |
//!
//! Each backend is recognised bare and under `Autodiff` with either checkpointing strategy (Burn
//! has no specialization, so by `TypeId`, here and nowhere else). Every other backend keeps
//! Burn's own attention op or the explicit path ([`crate::route`]).
//!
//! - Adding a backend to a kernel: one line of the list in `backends.rs`.
//! - Adding a kernel: a module with the same three entry points as `cpu` and `gpu` (`forward` on
//!   the bare backend, `on_autodiff` recording its own backward, `cached` over its own cache
//!   storage), a [`Kernel`] variant, a [`KvStorage`] variant for its cache (`storage.rs`), and its
//!   lines in the list in `backends.rs`.

use std::any::Any;
use std::ops::Range;

use burn::prelude::*;
use burn::tensor::Bool;

use crate::score_rule::ScoreRule;

/// A kernel's forward output recorded as one node of Burn's autodiff graph, shared by the CPU and
/// GPU kernels' `on_autodiff`: its parents are the query, key and value (`$nodes`) and the sinks
/// where the layer has them (`$sinks`, an `Option`), its backward `$backward` (a `Backward` for 3
/// and 4 parents) with the state `$saved`; untracked when no parent requires a gradient. A macro:
/// burn-autodiff does not export the parents' type, and their count is 3 or 4.
macro_rules! record_kernel_node {
    ($backward:expr, $strategy:ty, $nodes:expr, $sinks:expr, $saved:expr, $output:expr) => {{
        use burn::backend::autodiff::ops::OpsKind;
        let (backward, saved, output) = ($backward, $saved, $output);
        match $sinks {
            None => match backward
                .prepare::<$strategy>($nodes)
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(prep) => prep.finish(saved, output),
                OpsKind::UnTracked(prep) => prep.finish(output),
            },
            Some(sinks) => {
                let [query, key, value] = $nodes;
                let parents = [query, key, value, sinks];
                match backward
                    .prepare::<$strategy>(parents)
                    .compute_bound()
                    .stateful()
                {
                    OpsKind::Tracked(prep) => prep.finish(saved, output),
                    OpsKind::UnTracked(prep) => prep.finish(output),
                }
            }
        }
    }};
}

/// An `Autodiff` call's [`KernelInputs`] split into the inner backend's inputs and the graph
/// nodes [`record_kernel_node!`] takes: `(inputs, nodes, sinks_node)`, shared by the CPU and GPU
/// kernels' `on_autodiff`. A macro for the reason that one is: the nodes' type is not exported.
macro_rules! untracked_kernel_inputs {
    ($inputs:expr) => {{
        use burn::tensor::{Tensor, TensorPrimitive};
        let inputs = $inputs;
        let [query, key, value] =
            [inputs.query, inputs.key, inputs.value].map(|tensor| tensor.into_primitive().tensor());
        let nodes = [&query, &key, &value].map(|tensor| tensor.node.clone());
        let [query, key, value] = [query, key, value]
            .map(|tensor| Tensor::from_primitive(TensorPrimitive::Float(tensor.primitive)));
        let sinks = inputs
            .scores
            .sinks
            .map(|sinks| sinks.into_primitive().tensor());
        let sinks_node = sinks.as_ref().map(|sinks| sinks.node.clone());
        let inputs = $crate::kernels::KernelInputs {
            query,
            key,
            value,
            heads: inputs.heads,
            kv_heads: inputs.kv_heads,
            window: inputs.window,
            key_padding: inputs
                .key_padding
                .map(|mask| Tensor::from_primitive(mask.into_primitive())),
            documents: inputs.documents,
            scores: $crate::score_rule::ScoreRule {
                scale: inputs.scores.scale,
                softcap: inputs.scores.softcap,
                sinks: sinks
                    .map(|sinks| Tensor::from_primitive(TensorPrimitive::Float(sinks.primitive))),
            },
        };
        (inputs, nodes, sinks_node)
    }};
}

// Without a CPU backend feature the list is empty.
#[cfg_attr(not(any(feature = "ndarray", feature = "flex")), allow(unused))]
mod backends;
// Without a GPU backend feature nothing reads device storage of a narrow type; the cache's
// seams still name it.
#[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(unused))]
mod device_kv;
// Without a CPU backend feature nothing reaches the CPU kernel; it still compiles (and is tested
// under the default features).
#[cfg_attr(not(any(feature = "ndarray", feature = "flex")), allow(unused))]
pub(crate) mod cpu;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod gpu;
#[cfg(feature = "kernel-report")]
pub use gpu::report as kernel_report;
mod inputs;
mod pages;
mod storage;

pub use backends::Kernel;
pub(crate) use backends::{warn_gathering_pages, warn_if_gpu_without_kernel};
pub(crate) use inputs::KernelInputs;
pub(crate) use pages::PagedStorage;
#[cfg(feature = "test-hooks")]
pub use storage::device_syncs;
pub(crate) use storage::{KvStorage, NewKv};

/// Causal attention on `B`'s kernel.
///
/// # Shapes
/// - output: `[batch, queries, heads · head_dim]`, the heads side by side
///
/// # Panics
/// When no kernel runs on `B` (the route asks [`Kernel::of`] first).
pub(crate) fn attention<B: Backend>(inputs: KernelInputs<B>) -> Tensor<B, 3> {
    let entry = backends::entry_points::<B>().unwrap_or_else(|| {
        panic!(
            "no attention kernel of this crate runs on {}",
            std::any::type_name::<B>()
        )
    });
    entry.kernel.count_call();
    (entry.forward)(inputs)
}

/// The inputs of a decoding step on a kernel: the new queries and the cache they attend over.
///
/// # Shapes
/// - `query`: `[batch, queries, heads · head_dim]`
/// - `key_padding`: `[batch, seen.len()]`, `true` = padding
pub(crate) struct CachedInputs<'a, B: Backend> {
    pub query: Tensor<B, 3>,
    pub cache: &'a KvStorage<B>,
    /// The storage slots this step's queries see, the last of them the queries' own.
    pub seen: Range<usize>,
    pub heads: usize,
    pub window: Option<usize>,
    pub key_padding: Option<Tensor<B, 2, Bool>>,
    pub scores: ScoreRule<B>,
}

/// Causal attention of new queries over a cache in a kernel's own storage.
///
/// # Shapes
/// - output: `[batch, queries, heads · head_dim]`
///
/// # Panics
/// When the cache is not in the storage of `B`'s kernel (the route asks [`Kernel::keeps_cache`]
/// first, and the cache moves into the kernel's storage when the step is appended).
pub(crate) fn cached_attention<B: Backend>(inputs: CachedInputs<'_, B>) -> Tensor<B, 3> {
    let entry = backends::entry_points::<B>()
        .filter(|_| Kernel::keeps_cache::<B>())
        .expect("the route checked that B's kernel keeps the cache");
    entry.kernel.count_call();
    (entry.cached)(inputs)
}

/// The inputs of a ragged step on a kernel: the step's packed queries and one layer's pages.
///
/// # Shapes
/// - `query`: `[1, tokens, heads · head_dim]`, the step's sequences one after another
pub(crate) struct PagedInputs<'a, B: Backend> {
    pub query: Tensor<B, 3>,
    pub pages: &'a PagedStorage<B>,
    pub step: &'a crate::paged::RaggedStep,
    pub heads: usize,
    pub scores: ScoreRule<B>,
}

/// Causal attention of a ragged step's queries over a page pool in the storage of `B`'s
/// kernel, read in place through the step's tables.
///
/// # Shapes
/// - output: `[1, tokens, heads · head_dim]`
///
/// # Panics
/// When no kernel of `B` reads pages (the layer asks [`Kernel::reads_pages`] first).
pub(crate) fn paged_attention<B: Backend>(inputs: PagedInputs<'_, B>) -> Tensor<B, 3> {
    let entry = backends::entry_points::<B>()
        .filter(|_| Kernel::reads_pages::<B>())
        .expect("the layer checked that B's kernel reads pages");
    entry.kernel.count_call();
    (entry.paged)(inputs)
}

/// `value` as the type it is known (by its `TypeId`) to be.
fn same_type<T: 'static, U: 'static>(value: T) -> U {
    *(Box::new(value) as Box<dyn Any>)
        .downcast::<U>()
        .expect("the caller checked the type")
}
