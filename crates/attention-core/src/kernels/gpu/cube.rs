//! [`FlashBackend`] on a plain `CubeBackend`: the kernels launched on its tensors.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Shape, Tensor, TensorPrimitive};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::*;

use super::kernel::{self, GeometryLaunch};
use super::{FlashBackend, FlashCall, FlashGradInputs, FlashTensors};

/// Rows per cube: the queries (or keys) a cube computes, one a unit.
const BLOCK: u32 = 32;
/// The most rows of a shared-memory tile.
const MAX_TILE: usize = 32;
/// The narrowest head the kernels are compiled for (see [`head_capacity`]).
const MIN_HEAD_CAPACITY: usize = 64;

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> FlashBackend
    for CubeBackend<R, F, I, BT>
{
    fn flash_forward(
        tensors: FlashTensors<Self>,
        sinks: Option<CubeTensor<R>>,
        call: FlashCall,
    ) -> [CubeTensor<R>; 2] {
        let tensors = Contiguous::new(tensors);
        let query = &tensors.query;
        let (client, device, dtype) = (query.client.clone(), query.device.clone(), query.dtype);
        let splits = call.key_splits;
        let output = empty_device_dtype::<R>(
            client.clone(),
            device.clone(),
            Shape::new([splits, call.batch, call.queries, call.heads * call.head_dim]),
            dtype,
        );
        let lse = empty_device_dtype::<R>(
            client.clone(),
            device,
            Shape::new([splits, call.batch, call.queries, call.heads]),
            DType::F32,
        );
        let has_sinks = sinks.is_some();
        let sinks = sinks.map_or_else(|| query.clone(), into_contiguous);
        let [query_blocks, heads, batch] = cubes(call.queries, call.heads, call.batch);
        kernel::flash_forward::launch::<R>(
            &client,
            CubeCount::Static(query_blocks * splits as u32, heads, batch),
            CubeDim::new_1d(BLOCK),
            query.clone().into_tensor_arg(),
            tensors.key.clone().into_tensor_arg(),
            tensors.value.clone().into_tensor_arg(),
            tensors.padding_arg(),
            sinks.into_tensor_arg(),
            output.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            geometry(&call, tensors.has_padding, has_sinks),
            head_capacity(call.head_dim),
            tile_rows(&client, call.head_dim, dtype),
            dtype.into(),
        );
        if splits == 1 {
            return [output, lse].map(drop_first_axis::<Self>);
        }
        combined::<Self>(output, lse, &call)
    }

    fn flash_backward(
        tensors: FlashTensors<Self>,
        grads: FlashGradInputs<Self>,
        call: FlashCall,
    ) -> [CubeTensor<R>; 3] {
        let tensors = Contiguous::new(tensors);
        let [output_grad, lse, delta] =
            [grads.output_grad, grads.lse, grads.delta].map(into_contiguous);
        let query = &tensors.query;
        let (client, device, dtype) = (query.client.clone(), query.device.clone(), query.dtype);
        let empty =
            |shape: Shape| empty_device_dtype::<R>(client.clone(), device.clone(), shape, dtype);
        let query_grad = empty(query.meta.shape().clone());
        let key_grad = empty(tensors.key.meta.shape().clone());
        let value_grad = empty(tensors.value.meta.shape().clone());
        let tile = tile_rows(&client, call.head_dim, dtype);
        kernel::flash_query_grad::launch::<R>(
            &client,
            count(cubes(call.queries, call.heads, call.batch)),
            CubeDim::new_1d(BLOCK),
            query.clone().into_tensor_arg(),
            tensors.key.clone().into_tensor_arg(),
            tensors.value.clone().into_tensor_arg(),
            tensors.padding_arg(),
            output_grad.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            delta.clone().into_tensor_arg(),
            query_grad.clone().into_tensor_arg(),
            geometry(&call, tensors.has_padding, false),
            head_capacity(call.head_dim),
            tile,
            dtype.into(),
        );
        kernel::flash_key_value_grad::launch::<R>(
            &client,
            count(cubes(call.keys, call.kv_heads, call.batch)),
            CubeDim::new_1d(BLOCK),
            query.clone().into_tensor_arg(),
            tensors.key.clone().into_tensor_arg(),
            tensors.value.clone().into_tensor_arg(),
            tensors.padding_arg(),
            output_grad.into_tensor_arg(),
            lse.into_tensor_arg(),
            delta.into_tensor_arg(),
            key_grad.clone().into_tensor_arg(),
            value_grad.clone().into_tensor_arg(),
            geometry(&call, tensors.has_padding, false),
            head_capacity(call.head_dim),
            tile,
            dtype.into(),
        );
        [query_grad, key_grad, value_grad]
    }
}

/// The kernels' inputs, contiguous (the kernels index rows by hand); a kernel without padding
/// gets the query in its place, never read.
struct Contiguous<R: CubeRuntime> {
    query: CubeTensor<R>,
    key: CubeTensor<R>,
    value: CubeTensor<R>,
    key_padding: CubeTensor<R>,
    has_padding: bool,
}

impl<R: CubeRuntime> Contiguous<R> {
    fn new<F: FloatElement, I: IntElement, BT: BoolElement>(
        tensors: FlashTensors<CubeBackend<R, F, I, BT>>,
    ) -> Self {
        let query = into_contiguous(tensors.query);
        let has_padding = tensors.key_padding.is_some();
        Self {
            key: into_contiguous(tensors.key),
            value: into_contiguous(tensors.value),
            key_padding: tensors
                .key_padding
                .map_or_else(|| query.clone(), into_contiguous),
            query,
            has_padding,
        }
    }

    fn padding_arg(&self) -> TensorArg<R> {
        self.key_padding.clone().into_tensor_arg()
    }
}

/// One cube per block of `rows`, per head, per sequence.
fn cubes(rows: usize, heads: usize, batch: usize) -> [u32; 3] {
    [(rows as u32).div_ceil(BLOCK), heads as u32, batch as u32]
}

fn count([x, y, z]: [u32; 3]) -> CubeCount {
    CubeCount::Static(x, y, z)
}

/// `[1, a, b, c]` → `[a, b, c]`.
fn drop_first_axis<B: Backend>(tensor: B::FloatTensorPrimitive) -> B::FloatTensorPrimitive {
    let tensor = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(tensor));
    let [_, a, b, c] = tensor.dims();
    tensor.reshape([a, b, c]).into_primitive().tensor()
}

/// Flash-decoding's combine: the splits' outputs weighted by `exp(lse_s − lse)`, where `lse` is
/// the log-sum-exp over all splits. A split that saw no key has `lse_s` = [`kernel::masked`]
/// and weight 0; a row no split saw keeps output 0.
///
/// # Shapes
/// - `output`: `[splits, batch, queries, heads · head_dim]` → `[batch, queries, heads · head_dim]`
/// - `lse`: `[splits, batch, queries, heads]` → `[batch, queries, heads]`
fn combined<B: Backend>(
    output: B::FloatTensorPrimitive,
    lse: B::FloatTensorPrimitive,
    call: &FlashCall,
) -> [B::FloatTensorPrimitive; 2] {
    let (splits, batch, queries, heads) = (call.key_splits, call.batch, call.queries, call.heads);
    let output = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(output));
    let lse = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(lse));
    let most = lse.clone().max_dim(0);
    let weights = (lse - most.clone()).exp();
    let total = weights.clone().sum_dim(0);
    let weights = (weights / total.clone()).cast(output.dtype());
    let output = (output.reshape([splits, batch, queries, heads, call.head_dim])
        * weights.unsqueeze_dim::<5>(4))
    .sum_dim(0)
    .reshape([batch, queries, heads * call.head_dim]);
    let lse = (most + total.log()).reshape([batch, queries, heads]);
    [output, lse].map(|tensor| tensor.into_primitive().tensor())
}

fn geometry<R: Runtime>(call: &FlashCall, padded: bool, with_sinks: bool) -> GeometryLaunch<R> {
    GeometryLaunch::new(
        call.heads as u32,
        call.kv_heads as u32,
        call.head_dim as u32,
        call.queries as u32,
        call.keys as u32,
        call.key_first as u32,
        call.key_rows as u32,
        call.window.unwrap_or(0) as u32,
        call.scale,
        call.softcap.unwrap_or(0.0),
        padded.into(),
        with_sinks.into(),
        call.key_splits as u32,
        call.keys.div_ceil(call.key_splits) as u32,
    )
}

/// The head width the kernels are compiled for: `head_dim` rounded up to a power of two, at
/// least [`MIN_HEAD_CAPACITY`]. The width itself is a runtime value, so that every head width up
/// to a capacity runs one compiled kernel (a software adapter takes seconds to compile one).
fn head_capacity(head_dim: usize) -> u32 {
    head_dim.next_power_of_two().max(MIN_HEAD_CAPACITY) as u32
}

/// Rows per shared-memory tile: two tiles of `dtype` rows as wide as the head capacity, and two
/// `f32` rows per tile row, within the device's shared memory; a power of two, at most
/// [`MAX_TILE`].
fn tile_rows<R: Runtime>(client: &ComputeClient<R>, head_dim: usize, dtype: DType) -> u32 {
    let shared = client.properties().hardware.max_shared_memory_size;
    let per_row = 2 * head_capacity(head_dim) as usize * dtype.size() + 2 * 4;
    let fit = (shared / per_row).clamp(1, MAX_TILE);
    1 << fit.ilog2()
}
