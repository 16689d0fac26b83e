//! Causal attention on a GPU kernel of this crate's own: CubeCL's flash attention, forward and
//! backward, on any backend of Burn's `CubeBackend` (wgpu and CUDA), plain or under Burn's
//! fusion. The fused path takes it on those backends (see [`crate::kernels`]).
//!
//! - `simt/`: the `#[cube]` kernels on plain FMA units (forward, split-key combine, query
//!   gradient, key/value gradient); a tier on tensor cores would sit beside it, chosen in
//!   `cube.rs` where the device has them
//! - `tiling.rs`: which compiled variant (head width, vector, block and tile) a call runs
//! - `work.rs`: which cube of a ragged step's forward launch computes what
//! - `forced.rs`: the blocks and tiles the tests force, and so which variants lavapipe has run
//! - `cube.rs`: [`FlashBackend`] on a plain `CubeBackend`: launches on its tensors
//! - `fusion.rs`: [`FlashBackend`] on `Fusion<B>`: each call one custom operation of the fusion
//!   stream, run by `B`'s launches when the stream reaches it
//! - `op.rs`: the kernel as a Burn operation, with its autodiff node

mod cube;
#[cfg(any(all(test, feature = "wgpu"), feature = "kernel-report"))]
mod forced;
mod fusion;
mod op;
#[cfg(feature = "kernel-report")]
pub mod report;
mod simt;
#[cfg(all(test, feature = "wgpu"))]
mod tests;
mod tiling;
mod work;

use burn::prelude::*;
use burn::tensor::DType;
use burn::tensor::ops::{FloatTensor, IntTensor};

use super::device_kv::DeviceKv;

pub(crate) use op::{cached, end_step, forward, on_autodiff, paged};

/// The sizes and score rule of one kernel call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct FlashCall {
    pub batch: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Query rows: the last `queries` of the `keys` positions.
    pub queries: usize,
    pub keys: usize,
    /// The storage row of key 0 in each sequence, and the rows a sequence has in the key and
    /// value tensors (0 and `keys`, except over a cache).
    pub key_first: usize,
    pub key_rows: usize,
    pub window: Option<usize>,
    pub scale: f32,
    pub softcap: Option<f32>,
    /// Into how many parts the forward pass splits the keys (flash-decoding; 1: none).
    pub key_splits: usize,
    /// Positions per page where the keys are a page pool read through
    /// [`FlashTensors::pages`] (forward pass only); 0: rows of the key and value tensors.
    pub page_size: usize,
    /// How the kernels' blocks and tiles are chosen.
    pub tiles: tiling::TileRule,
}

/// The tensors every kernel reads.
///
/// # Shapes
/// - `query`: `[batch, queries, heads · head_dim]`
/// - `kv`: see [`KvTensors`]
/// - `key_padding`: `[batch, keys]`, `1` = padding, in the query's float type
/// - `documents`: `[batch, keys, 2]`, each position's document `[start, end)`, `f32`, where the
///   sequences are packed from documents (then `queries == keys`)
/// - `pages`: see [`PagedLaunch`]
#[derive(Debug, Clone)]
pub(crate) struct FlashTensors<B: Backend> {
    pub query: FloatTensor<B>,
    pub kv: KvTensors<B>,
    pub key_padding: Option<FloatTensor<B>>,
    pub documents: Option<FloatTensor<B>>,
    /// A ragged step's tables and work list, where the keys and values are a page pool `[1,
    /// pages · page_size, ·]` (forward pass only).
    pub pages: Option<PagedLaunch<B>>,
}

/// What a ragged step's forward launch reads besides its queries and the page pool: both
/// uploaded once per step and shared by its layers.
///
/// # Shapes
/// - `tables`: `[sequences, table_len]` (`i32`): each sequence's first query row, queries and
///   keys, then its page ids
/// - `work`: `[cubes, work::WORK_COLUMNS]` (`i32`): each cube's sequence, block of pairs, split
///   of the keys, and that sequence's count of splits (`work.rs`)
#[derive(Debug, Clone)]
pub(crate) struct PagedLaunch<B: Backend> {
    pub tables: IntTensor<B>,
    pub work: IntTensor<B>,
}

/// The keys and values a kernel reads: in a float type (the query's; the forward pass also reads
/// an f16 cache's), or an int8 cache's words and scales (forward pass only).
///
/// # Shapes
/// - `Float`: key, value `[batch, key_rows, kv_heads · head_dim]`
/// - `Int8`: `words` `[batch, key_rows, kv_heads · ⌈head_dim / 4⌉]` (`i32`, four values a word,
///   see `DeviceKv`), `scales` `[batch, key_rows, kv_heads]` (`f32`); keys first in each
#[derive(Debug, Clone)]
pub(crate) enum KvTensors<B: Backend> {
    Float {
        key: FloatTensor<B>,
        value: FloatTensor<B>,
    },
    Int8 {
        words: [IntTensor<B>; 2],
        scales: [FloatTensor<B>; 2],
    },
}

impl<B: Backend> KvTensors<B> {
    /// A cache's stored keys and values as the kernel reads them.
    pub(crate) fn stored(keys: DeviceKv<B>, values: DeviceKv<B>) -> Self {
        match (keys, values) {
            (DeviceKv::Float(key), DeviceKv::Float(value)) => Self::Float {
                key: key.into_primitive().tensor(),
                value: value.into_primitive().tensor(),
            },
            (
                DeviceKv::Int8 {
                    words: k,
                    scales: ks,
                },
                DeviceKv::Int8 {
                    words: v,
                    scales: vs,
                },
            ) => Self::Int8 {
                words: [k.into_primitive(), v.into_primitive()],
                scales: [ks.into_primitive().tensor(), vs.into_primitive().tensor()],
            },
            _ => unreachable!("keys and values are stored alike"),
        }
    }

    /// The keys and values in a float type, which the backward pass reads (a narrow cache is for
    /// inference: the layer refuses one under `Autodiff`).
    pub(crate) fn float(&self) -> [&FloatTensor<B>; 2] {
        match self {
            Self::Float { key, value } => [key, value],
            Self::Int8 { .. } => unreachable!("an int8 cache is read by the forward pass only"),
        }
    }
}

/// What the backward pass reads beyond [`FlashTensors`].
///
/// # Shapes
/// - `output_grad`: `[batch, queries, heads · head_dim]`
/// - `lse` (the forward pass's log-sum-exp), `delta` (`rowsum(dO ∘ O)`): `[batch, queries,
///   heads]`, `f32`
#[derive(Debug, Clone)]
pub(crate) struct FlashGradInputs<B: Backend> {
    pub output_grad: FloatTensor<B>,
    pub lse: FloatTensor<B>,
    pub delta: FloatTensor<B>,
}

/// A backend the flash kernels run on.
pub(crate) trait FlashBackend: Backend {
    /// The forward pass: `[output, lse]`, `[batch, queries, heads · head_dim]` and `[batch,
    /// queries, heads]` (`f32`). `sinks`: `[heads]`.
    fn flash_forward(
        tensors: FlashTensors<Self>,
        sinks: Option<FloatTensor<Self>>,
        call: FlashCall,
    ) -> [FloatTensor<Self>; 2];

    /// The backward pass: `[query, key, value]` gradients, shaped as those inputs.
    fn flash_backward(
        tensors: FlashTensors<Self>,
        grads: FlashGradInputs<Self>,
        call: FlashCall,
    ) -> [FloatTensor<Self>; 3];

    /// The block and tile the forward pass runs `call` at on `device`, for queries of `dtype`:
    /// what a ragged step's work list is cut by before the launch.
    fn forward_tiling(device: &Self::Device, call: &FlashCall, dtype: DType) -> simt::Tiling;

    /// Ends a decoding step on `device`'s queue without waiting for the device (see
    /// [`end_step`]): a fusion backend runs what it has queued, a plain one has nothing to do.
    fn end_step(device: &Self::Device);
}
