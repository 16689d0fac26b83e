//! The GPU kernel as a Burn operation: the layer's tensors handed to [`FlashBackend`] as they
//! are (no copy to the host, no head split), and on `Autodiff` a graph node whose backward is
//! the kernel's own. Which backends reach it is decided in [`crate::kernels`].

use burn::backend::Autodiff;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops};
use burn::prelude::*;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Bool, DType, TensorData, TensorPrimitive};

use super::tiling::TileRule;
use super::work::{self, WorkSizes};
use super::{FlashBackend, FlashCall, FlashGradInputs, FlashTensors, KvTensors, PagedLaunch};
use crate::documents::Documents;
use crate::kernels::device_kv::DeviceKv;
use crate::kernels::inputs::KernelInputs;
use crate::kernels::{CachedInputs, KvStorage, PagedInputs, PagedStorage, same_type};
use crate::paged::StepUpload;

/// The kernel's forward pass on `Bare`, which `B` is.
pub(crate) fn forward<B: Backend, Bare: FlashBackend>(inputs: KernelInputs<B>) -> Tensor<B, 3> {
    let inputs: KernelInputs<Bare> = same_type(inputs);
    let (tensors, sinks, call) = prepared(inputs);
    let [output, _] = Bare::flash_forward(tensors, sinks.map(float), call);
    same_type(Tensor::<Bare, 3>::from_primitive(TensorPrimitive::Float(
        output,
    )))
}

/// `B` is `Autodiff<I, C>`: run the kernel on `I`'s tensors and record a node with its backward.
pub(crate) fn on_autodiff<B: Backend, I: FlashBackend, C: CheckpointStrategy>(
    inputs: KernelInputs<B>,
) -> Tensor<B, 3> {
    let inputs: KernelInputs<Autodiff<I, C>> = same_type(inputs);
    same_type(tracked::<I, C>(inputs))
}

/// The kernel's forward pass on `I`, recorded as one graph node whose parents are the query, key
/// and value, and the sinks where the layer has them.
fn tracked<I: FlashBackend, C: CheckpointStrategy>(
    inputs: KernelInputs<Autodiff<I, C>>,
) -> Tensor<Autodiff<I, C>, 3> {
    let (inputs, nodes, sinks_node): (KernelInputs<I>, _, _) = untracked_kernel_inputs!(inputs);
    let (tensors, sinks, call) = prepared(inputs);
    let [output, lse] = I::flash_forward(tensors.clone(), sinks.clone().map(float), call);
    let saved = Saved {
        tensors,
        sinks,
        output: output.clone(),
        lse,
        call,
    };
    let output = record_kernel_node!(FlashBackward, C, nodes, sinks_node, saved, output);
    Tensor::from_primitive(TensorPrimitive::Float(output))
}

/// The kernels' tensors and call of `inputs`, and the sinks.
fn prepared<B: Backend>(
    inputs: KernelInputs<B>,
) -> (FlashTensors<B>, Option<Tensor<B, 1>>, FlashCall) {
    let [batch, queries, width] = inputs.query.dims();
    let keys = inputs.key.dims()[1];
    let head_dim = width / inputs.heads;
    let dtype = inputs.query.dtype();
    let device = inputs.query.device();
    let call = FlashCall {
        batch,
        heads: inputs.heads,
        kv_heads: inputs.kv_heads,
        head_dim,
        queries,
        keys,
        key_first: 0,
        key_rows: keys,
        window: inputs.window,
        scale: inputs.scores.scale_for(head_dim) as f32,
        softcap: inputs.scores.softcap.map(|cap| cap as f32),
        key_splits: 1,
        page_size: 0,
        tiles: TileRule::Auto,
    };
    let tensors = FlashTensors {
        query: float(inputs.query),
        kv: KvTensors::Float {
            key: float(inputs.key),
            value: float(inputs.value),
        },
        key_padding: inputs.key_padding.map(|mask| padding(mask, dtype)),
        documents: inputs
            .documents
            .map(|documents| spans::<B>(&documents, &device)),
        pages: None,
    };
    (tensors, inputs.scores.sinks, call)
}

/// The float primitive of `tensor`.
fn float<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> FloatTensor<B> {
    tensor.into_primitive().tensor()
}

/// A padding mask as the kernels read it: `1` = padding, in `dtype`.
fn padding<B: Backend>(mask: Tensor<B, 2, Bool>, dtype: DType) -> FloatTensor<B> {
    float(mask.float().cast(dtype))
}

/// Each position's document as the kernels read it: `[start, end)` in `f32` (exact up to 2²⁴
/// positions, and in one type whatever the model's float type).
///
/// # Shapes
/// - output: `[batch, keys, 2]`
fn spans<B: Backend>(documents: &Documents, device: &B::Device) -> FloatTensor<B> {
    let [batch, keys] = documents.shape();
    let spans: Vec<f32> = documents.spans().into_iter().map(|x| x as f32).collect();
    let data = TensorData::new(spans, [batch, keys, 2]);
    float(Tensor::<B, 3>::from_data(data, (device, DType::F32)))
}

/// The backward pass of [`on_autodiff`]'s node.
#[derive(Debug)]
struct FlashBackward;

/// What the backward pass needs: the inputs, the output and the log-sum-exp, all `O(seq)` — the
/// attention weights are rebuilt tile by tile.
#[derive(Debug, Clone)]
struct Saved<B: Backend> {
    tensors: FlashTensors<B>,
    sinks: Option<Tensor<B, 1>>,
    output: FloatTensor<B>,
    lse: FloatTensor<B>,
    call: FlashCall,
}

impl<I: FlashBackend, const N: usize> Backward<I, N> for FlashBackward {
    type State = Saved<I>;

    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _: &mut Checkpointer) {
        let Saved {
            tensors,
            sinks,
            output,
            lse,
            call,
        } = ops.state;
        let output_grad = grads.consume::<I>(&ops.node);
        let delta = row_dots(&call, output_grad.clone(), output);
        let lse = Tensor::<I, 3>::from_primitive(TensorPrimitive::Float(lse));
        let sinks_grad = sinks.map(|sinks| sinks_grad(sinks, lse.clone(), delta.clone()));
        let gradients = I::flash_backward(
            tensors,
            FlashGradInputs {
                output_grad,
                lse: float(lse),
                delta: float(delta),
            },
            call,
        );
        let register = |grads: &mut Gradients, id: NodeId, gradient: FloatTensor<I>| {
            grads.register::<I>(id, gradient);
        };
        // The parents in order: query, key, value, then the sinks if the layer has them.
        let mut parents = ops.parents.into_iter();
        for gradient in gradients {
            if let Some(node) = parents.next().flatten() {
                register(grads, node.id, gradient);
            }
        }
        if let (Some(node), Some(gradient)) = (parents.next().flatten(), sinks_grad) {
            register(grads, node.id, float(gradient));
        }
    }
}

/// `Dᵢ = dOᵢ · Oᵢ` per query and head, in `f32`: FlashAttention-2's pre-pass.
///
/// # Shapes
/// - output: `[batch, queries, heads]`
fn row_dots<B: Backend>(
    call: &FlashCall,
    output_grad: FloatTensor<B>,
    output: FloatTensor<B>,
) -> Tensor<B, 3> {
    let [output_grad, output] = [output_grad, output]
        .map(|tensor| Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(tensor)));
    let split = [call.batch, call.queries, call.heads, call.head_dim];
    (output_grad.cast(DType::F32) * output.cast(DType::F32))
        .reshape(split)
        .sum_dim(3)
        .reshape([call.batch, call.queries, call.heads])
}

/// The sinks' gradient: a sink takes weight `exp(sink − lse)` in each row, whose gradient is
/// `−weight · Dᵢ`, summed over the rows of its head.
///
/// # Shapes
/// - `sinks`: `[heads]`; `lse`, `delta`: `[batch, queries, heads]`
fn sinks_grad<B: Backend>(
    sinks: Tensor<B, 1>,
    lse: Tensor<B, 3>,
    delta: Tensor<B, 3>,
) -> Tensor<B, 1> {
    let dtype = sinks.dtype();
    let heads = sinks.dims()[0];
    let weights = (sinks.cast(DType::F32).reshape([1, 1, heads]) - lse).exp();
    (weights * delta)
        .neg()
        .sum_dim(0)
        .sum_dim(1)
        .reshape([heads])
        .cast(dtype)
}

/// Causal attention of new queries over a cache kept on the device in the kernel's layout
/// (`KvStorage::Device`), on `Bare`, which `B` is: the cached keys and values are read where
/// they lie.
///
/// # Shapes
/// - output: `[batch, queries, heads · head_dim]`
pub(crate) fn cached<B: Backend, Bare: FlashBackend>(inputs: CachedInputs<'_, B>) -> Tensor<B, 3> {
    let KvStorage::Device { keys, values } = inputs.cache else {
        unreachable!("a GPU kernel step is appended to device storage")
    };
    let [_, allocated] = keys.dims();
    let seen = inputs.seen.len();
    let step = StoredStep {
        query: inputs.query,
        heads: inputs.heads,
        window: inputs.window,
        key_padding: inputs.key_padding,
        scores: inputs.scores,
    };
    let (tensors, sinks, call) = step.prepared::<Bare>([keys, values]);
    let call = FlashCall {
        keys: seen,
        key_first: inputs.seen.start,
        key_rows: allocated,
        key_splits: decode_splits(call.batch * call.heads, call.queries, seen),
        ..call
    };
    let [output, _] = Bare::flash_forward(tensors, sinks.map(float), call);
    same_type(Tensor::<Bare, 3>::from_primitive(TensorPrimitive::Float(
        output,
    )))
}

/// A step's queries over keys and values stored in a cache's [`DeviceKv`]: what the cached and
/// the ragged step hand the kernel beside the storage.
struct StoredStep<B: Backend> {
    query: Tensor<B, 3>,
    heads: usize,
    window: Option<usize>,
    key_padding: Option<Tensor<B, 2, Bool>>,
    scores: crate::score_rule::ScoreRule<B>,
}

impl<B: Backend> StoredStep<B> {
    /// The kernel's tensors and call for these queries over `stored` keys and values (`[n,
    /// rows, ·]`), on `Bare`, which `B` is; the call's keys and rows are the caller's to set.
    fn prepared<Bare: FlashBackend>(
        self,
        [keys, values]: [&DeviceKv<B>; 2],
    ) -> (FlashTensors<Bare>, Option<Tensor<Bare, 1>>, FlashCall) {
        let head_dim = self.query.dims()[2] / self.heads;
        let kv_heads = match keys {
            DeviceKv::Float(tensor) => tensor.dims()[2] / head_dim,
            DeviceKv::Int8 { scales, .. } => scales.dims()[2],
        };
        // The kernel's call for the query over itself, then the stored keys and values in place
        // of its own.
        let step = KernelInputs {
            query: self.query.clone(),
            key: self.query.clone(),
            value: self.query,
            heads: self.heads,
            kv_heads,
            window: self.window,
            key_padding: self.key_padding,
            documents: None,
            scores: self.scores,
        };
        let (mut tensors, sinks, call) = prepared(same_type::<_, KernelInputs<Bare>>(step));
        let bare = |rows: &DeviceKv<B>| same_type::<_, DeviceKv<Bare>>(rows.clone());
        tensors.kv = KvTensors::stored(bare(keys), bare(values));
        (tensors, sinks, call)
    }
}

/// A ragged step over a page pool on the device (`PagedStorage::Tensors`), on `Bare`, which `B`
/// is: one launch for every sequence, each cube's sequence, query block and split of the keys
/// read from the step's work list, its keys and values read where they lie in the pool. Each
/// sequence takes its own count of key splits (none for a prompt chunk). The tables go up once
/// per step, and the work list once per step and launch size, shared by its layers.
///
/// # Shapes
/// - `inputs.query`: `[1, tokens, heads · head_dim]`; output the same
pub(crate) fn paged<B: Backend, Bare: FlashBackend>(inputs: PagedInputs<'_, B>) -> Tensor<B, 3> {
    let PagedStorage::Tensors { keys, values } = inputs.pages else {
        unreachable!("the GPU kernel's pages are device tensors")
    };
    let [_, page_size] = keys.dims();
    let step = inputs.step;
    let (device, dtype) = (inputs.query.device(), inputs.query.dtype());
    let stored = StoredStep {
        query: inputs.query,
        heads: inputs.heads,
        window: step.window(),
        key_padding: None,
        scores: inputs.scores,
    };
    // The pages as one pool of rows.
    let [keys, values] = [keys, values].map(|pages| pages.clone().merged());
    let [_, pool_rows] = keys.dims();
    let (mut tensors, sinks, call) = stored.prepared::<Bare>([&keys, &values]);
    let sequences = step.sequences();
    let pairs = sequences.len() * call.heads;
    // Each sequence's own count of splits: a prompt chunk or a short row beside a long decoding
    // row is not split. The launch's outputs hold the most.
    let splits: Vec<usize> = sequences
        .iter()
        .map(|s| decode_splits(pairs, s.new, s.keys()))
        .collect();
    let call = FlashCall {
        batch: sequences.len(),
        queries: sequences.iter().map(|s| s.new).max().unwrap_or(1),
        keys: sequences.iter().map(|s| s.keys()).max().unwrap_or(1),
        key_rows: pool_rows,
        page_size,
        key_splits: splits.iter().copied().max().unwrap_or(1),
        ..call
    };
    // The work list is cut by the launch's blocks: the launch runs at the tiling it was cut by.
    let bare_device: Bare::Device = same_type(device.clone());
    let tiling = Bare::forward_tiling(&bare_device, &call, dtype);
    let call = FlashCall {
        tiles: TileRule::Fixed {
            block: tiling.block,
            tile: tiling.tile,
        },
        ..call
    };
    let group = call.heads / call.kv_heads;
    let upload = StepUpload::WorkList {
        heads: call.heads,
        kv_heads: call.kv_heads,
        pairs_per_block: tiling.block as usize,
    };
    let work = step.uploaded_once::<B>(upload, &device, || {
        let sizes = WorkSizes {
            group,
            block: tiling.block as usize,
            window: step.window(),
        };
        work::rows(&work::work_list(sequences, &splits, sizes))
    });
    let int =
        |tensor: Tensor<B, 2, Int>| same_type::<_, Tensor<Bare, 2, Int>>(tensor).into_primitive();
    tensors.pages = Some(PagedLaunch {
        tables: int(step.tables_on::<B>(&device)),
        work: int(work),
    });
    let [output, _] = Bare::flash_forward(tensors, sinks.map(float), call);
    same_type(Tensor::<Bare, 3>::from_primitive(TensorPrimitive::Float(
        output,
    )))
}

/// Ends a layer's decoding step on `Bare`, which `B` is: on Burn's fusion backends the stream
/// runs what it has queued, so that no fused optimization spans two steps; the host does not wait
/// for the device.
///
/// Burn 0.21 workaround. Burn 0.21's fusion, given a layer's steps back to back, optimizes operations of consecutive
/// steps together, and the result is wrong: `cached_decoding_reproduces_the_fixtures` failed on
/// the fused wgpu backend by up to 1.1 (a layer's output) on four of the nine fixtures, on the
/// GPU kernel's path and on Burn's attention op alike, while the explicit path, the plain (unfused)
/// `CubeBackend` and a drained stream were right. It is no write overtaking a read: the cache
/// written out of place (its old buffer still held) failed the same. A device sync at the end of
/// each step (this crate's earlier workaround) drains the stream too, and waits for the device
/// besides.
pub(crate) fn end_step<B: Backend, Bare: FlashBackend>(device: &B::Device) {
    let device: Bare::Device = same_type(device.clone());
    Bare::end_step(&device);
}

/// Keys a split of a decoding step takes at least.
const SPLIT_KEYS: usize = 64;
/// Queries per sequence above which a call's keys are not split (a prompt chunk's cubes are
/// enough work without).
const SPLIT_MAX_QUERIES: usize = 8;
/// The most splits of a decoding step.
const MAX_SPLITS: usize = 16;
/// `batch · heads` from which a decoding step's one cube per (sequence, head) keeps a GPU busy.
const BUSY_CUBES: usize = 64;

/// Into how many parts a step's `keys` are split (flash-decoding): a few queries over a long
/// cache for few (sequence, head) pairs would otherwise run on `pairs` cubes, each walking the
/// whole cache.
fn decode_splits(pairs: usize, queries: usize, keys: usize) -> usize {
    if pairs >= BUSY_CUBES || queries > SPLIT_MAX_QUERIES {
        return 1;
    }
    (keys / SPLIT_KEYS).clamp(1, MAX_SPLITS)
}

#[cfg(test)]
mod tests {
    use super::{BUSY_CUBES, MAX_SPLITS, decode_splits};

    #[test]
    fn a_long_cache_at_few_pairs_is_split_into_whole_parts() {
        assert_eq!(decode_splits(2, 1, 300), 4);
        assert_eq!(decode_splits(4, 1, 200), 3);
        assert_eq!(decode_splits(2, 8, 127), 1);
        assert_eq!(decode_splits(1, 1, 1 << 20), MAX_SPLITS);
    }

    #[test]
    fn a_busy_step_or_a_prefill_is_not_split() {
        assert_eq!(decode_splits(BUSY_CUBES, 1, 4096), 1);
        assert_eq!(decode_splits(2, 9, 4096), 1);
    }
}
