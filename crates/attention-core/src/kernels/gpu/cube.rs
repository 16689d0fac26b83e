//! [`FlashBackend`] on a plain `CubeBackend`: the SIMT kernels launched on its tensors.

use burn::tensor::{DType, Shape};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::*;

use super::simt::{self, GeometryLaunch, SplitsLaunch, Tiling};
use super::tiling::{self, Pass, Sizes};
use super::{FlashBackend, FlashCall, FlashGradInputs, FlashTensors, KvTensors, PagedLaunch};

/// Units per cube of the combine of split keys.
pub(super) const COMBINE_UNITS: u32 = 256;

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
        let vector = vector_size(&client, &call, dtype);
        let tiling = tiling_of(&client, Pass::Forward, &call, dtype, vector);
        // The outputs are shaped as the query: `[batch, queries, ·]`, or a ragged step's `[1,
        // tokens, ·]` (its `call.batch` sequences, the longest of `call.queries`).
        let [rows_batch, rows] = match call.page_size {
            0 => [call.batch, call.queries],
            _ => [1, query.meta.shape()[1]],
        };
        // Split partials are kept in f32 until they are combined.
        let partial_dtype = if splits == 1 { dtype } else { DType::F32 };
        let output = empty_device_dtype::<R>(
            client.clone(),
            device.clone(),
            Shape::new([splits, rows_batch, rows, call.heads * call.head_dim]),
            partial_dtype,
        );
        let lse = empty_device_dtype::<R>(
            client.clone(),
            device.clone(),
            Shape::new([splits, rows_batch, rows, call.heads]),
            DType::F32,
        );
        // A ragged step's launch counts every sequence's queries together.
        let launched = FlashCall {
            queries: rows,
            ..call
        };
        let has_sinks = sinks.is_some();
        let sinks = sinks.map_or_else(|| query.clone(), into_contiguous);
        // A ragged step's cubes are its work list's rows; a plain call's, every block and split
        // of every sequence.
        let cubes = match tensors.work_rows {
            0 => CubeCount::Static(
                pair_blocks(&call, &tiling) * splits as u32,
                call.kv_heads as u32,
                call.batch as u32,
            ),
            rows => CubeCount::Static(rows as u32, call.kv_heads as u32, 1),
        };
        let stored = &tensors.stored;
        simt::flash_forward::launch::<R>(
            &client,
            cubes,
            CubeDim::new_1d(tiling.units()),
            vector,
            query.clone().into_tensor_arg(),
            tensors.key.clone().into_tensor_arg(),
            tensors.value.clone().into_tensor_arg(),
            stored.words[0].clone().into_tensor_arg(),
            stored.words[1].clone().into_tensor_arg(),
            stored.scales[0].clone().into_tensor_arg(),
            stored.scales[1].clone().into_tensor_arg(),
            tensors.padding_arg(),
            tensors.documents_arg(),
            tensors.tables.clone().into_tensor_arg(),
            tensors.work.clone().into_tensor_arg(),
            sinks.into_tensor_arg(),
            output.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            geometry(&launched, &tensors, has_sinks),
            tiling,
            stored.int8,
            [dtype.into(), partial_dtype.into(), tensors.key.dtype.into()],
        );
        let unsplit = |tensor: CubeTensor<R>| {
            let dims = tensor.meta.shape().clone();
            reshaped(tensor, Shape::new([dims[1], dims[2], dims[3]]))
        };
        if splits == 1 {
            return [unsplit(output), unsplit(lse)];
        }
        let combined = empty_device_dtype::<R>(
            client.clone(),
            device.clone(),
            Shape::new([rows_batch, rows, call.heads * call.head_dim]),
            dtype,
        );
        let combined_lse = empty_device_dtype::<R>(
            client.clone(),
            device,
            Shape::new([rows_batch, rows, call.heads]),
            DType::F32,
        );
        let rows = (rows_batch * rows * call.heads) as u32;
        let head_vectors = (call.head_dim / vector) as u32;
        simt::flash_combine::launch::<R>(
            &client,
            CubeCount::Static((rows * head_vectors).div_ceil(COMBINE_UNITS), 1, 1),
            CubeDim::new_1d(COMBINE_UNITS),
            vector,
            output.into_tensor_arg(),
            lse.into_tensor_arg(),
            combined.clone().into_tensor_arg(),
            combined_lse.clone().into_tensor_arg(),
            SplitsLaunch::new(rows, head_vectors, splits as u32),
            dtype.into(),
        );
        [combined, combined_lse]
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
        let vector = vector_size(&client, &call, dtype);
        let query_tiling = tiling_of(&client, Pass::QueryGrad, &call, dtype, vector);
        simt::flash_query_grad::launch::<R>(
            &client,
            CubeCount::Static(
                pair_blocks(&call, &query_tiling),
                call.kv_heads as u32,
                call.batch as u32,
            ),
            CubeDim::new_1d(query_tiling.units()),
            vector,
            query.clone().into_tensor_arg(),
            tensors.key.clone().into_tensor_arg(),
            tensors.value.clone().into_tensor_arg(),
            tensors.padding_arg(),
            tensors.documents_arg(),
            output_grad.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            delta.clone().into_tensor_arg(),
            query_grad.clone().into_tensor_arg(),
            geometry(&call, &tensors, false),
            query_tiling,
            dtype.into(),
        );
        let key_tiling = tiling_of(&client, Pass::KeyValueGrad, &call, dtype, vector);
        simt::flash_key_value_grad::launch::<R>(
            &client,
            CubeCount::Static(
                (call.keys as u32).div_ceil(key_tiling.block),
                call.kv_heads as u32,
                call.batch as u32,
            ),
            CubeDim::new_1d(key_tiling.units()),
            vector,
            query.clone().into_tensor_arg(),
            tensors.key.clone().into_tensor_arg(),
            tensors.value.clone().into_tensor_arg(),
            tensors.padding_arg(),
            tensors.documents_arg(),
            output_grad.into_tensor_arg(),
            lse.into_tensor_arg(),
            delta.into_tensor_arg(),
            key_grad.clone().into_tensor_arg(),
            value_grad.clone().into_tensor_arg(),
            geometry(&call, &tensors, false),
            key_tiling,
            dtype.into(),
        );
        [query_grad, key_grad, value_grad]
    }

    fn forward_tiling(device: &Self::Device, call: &FlashCall, dtype: DType) -> Tiling {
        let client = R::client(device);
        let vector = vector_size(&client, call, dtype);
        tiling_of(&client, Pass::Forward, call, dtype, vector)
    }

    fn end_step(_: &Self::Device) {
        // Launches go to the device's queue as they are made: nothing is held back.
    }
}

/// The kernels' inputs, contiguous (the kernels index rows by hand); a kernel without padding
/// gets the query in its place, and one without documents or pages a scalar, never read.
/// Over an int8 cache the query stands in for the key and value, and over a float one scalars
/// for the int8 words and scales (never read either).
struct Contiguous<R: CubeRuntime> {
    query: CubeTensor<R>,
    key: CubeTensor<R>,
    value: CubeTensor<R>,
    stored: Int8Kv<R>,
    key_padding: CubeTensor<R>,
    has_padding: bool,
    documents: CubeTensor<R>,
    has_documents: bool,
    /// A ragged step's tables and work list ([`PagedLaunch`]).
    tables: CubeTensor<R>,
    work: CubeTensor<R>,
    /// Page ids per sequence, and cubes of the work list; 0 without pages.
    table_len: usize,
    work_rows: usize,
}

/// An int8 cache's keys and values as the forward kernel reads them: words, scales, and whether
/// it reads them (else they are placeholders).
struct Int8Kv<R: CubeRuntime> {
    words: [CubeTensor<R>; 2],
    scales: [CubeTensor<R>; 2],
    int8: bool,
}

impl<R: CubeRuntime> Contiguous<R> {
    fn new<F: FloatElement, I: IntElement, BT: BoolElement>(
        tensors: FlashTensors<CubeBackend<R, F, I, BT>>,
    ) -> Self {
        let query = into_contiguous(tensors.query);
        let has_padding = tensors.key_padding.is_some();
        let has_documents = tensors.documents.is_some();
        // A placeholder of one element for an input the call does not have.
        let none = |dtype: DType| {
            let (client, device) = (query.client.clone(), query.device.clone());
            empty_device_dtype::<R>(client, device, Shape::new([1]), dtype)
        };
        let (tables, work, table_len, work_rows) = match tensors.pages {
            Some(PagedLaunch { tables, work }) => {
                let (table_len, work_rows) = (tables.meta.shape()[1], work.meta.shape()[0]);
                let [tables, work] = [tables, work].map(into_contiguous);
                (tables, work, table_len, work_rows)
            }
            None => (none(DType::U32), none(DType::U32), 0, 0),
        };
        let (key, value, stored) = match tensors.kv {
            KvTensors::Float { key, value } => {
                let stored = Int8Kv {
                    words: [none(DType::U32), none(DType::U32)],
                    scales: [none(DType::F32), none(DType::F32)],
                    int8: false,
                };
                (into_contiguous(key), into_contiguous(value), stored)
            }
            KvTensors::Int8 { words, scales } => {
                let stored = Int8Kv {
                    words: words.map(into_contiguous),
                    scales: scales.map(into_contiguous),
                    int8: true,
                };
                (query.clone(), query.clone(), stored)
            }
        };
        Self {
            tables,
            work,
            table_len,
            work_rows,
            key,
            value,
            stored,
            key_padding: tensors
                .key_padding
                .map_or_else(|| query.clone(), into_contiguous),
            documents: tensors
                .documents
                .map_or_else(|| none(DType::F32), into_contiguous),
            query,
            has_padding,
            has_documents,
        }
    }

    fn padding_arg(&self) -> TensorArg<R> {
        self.key_padding.clone().into_tensor_arg()
    }

    fn documents_arg(&self) -> TensorArg<R> {
        self.documents.clone().into_tensor_arg()
    }
}

/// The vector width of the call's loads on `client`'s device.
fn vector_size<R: Runtime>(client: &ComputeClient<R>, call: &FlashCall, dtype: DType) -> usize {
    let widest = client
        .io_optimized_vector_sizes(dtype.size())
        .next()
        .unwrap_or(1);
    tiling::vector_size(call.head_dim, widest)
}

/// The tiling of `pass` for `call` on `client`'s device.
fn tiling_of<R: Runtime>(
    client: &ComputeClient<R>,
    pass: Pass,
    call: &FlashCall,
    dtype: DType,
    vector: usize,
) -> Tiling {
    let hardware = &client.properties().hardware;
    let group = call.heads / call.kv_heads;
    let rows = match pass {
        Pass::Forward | Pass::QueryGrad => call.queries * group,
        Pass::KeyValueGrad => call.keys,
    };
    let sizes = Sizes {
        head_dim: call.head_dim,
        element: dtype.size(),
        rows,
        vector,
        shared_memory: hardware.max_shared_memory_size,
        max_units: hardware.max_units_per_cube,
    };
    tiling::tiling(pass, sizes, call.tiles)
}

/// Blocks of (query, query head) pairs per key/value head.
fn pair_blocks(call: &FlashCall, tiling: &Tiling) -> u32 {
    let pairs = call.queries * (call.heads / call.kv_heads);
    (pairs as u32).div_ceil(tiling.block)
}

/// `tensor`, contiguous, as `shape` (the same elements).
fn reshaped<R: CubeRuntime>(tensor: CubeTensor<R>, shape: Shape) -> CubeTensor<R> {
    burn_cubecl::ops::reshape(tensor, shape)
}

fn geometry<R: CubeRuntime>(
    call: &FlashCall,
    tensors: &Contiguous<R>,
    with_sinks: bool,
) -> GeometryLaunch<R> {
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
        tensors.has_padding.into(),
        with_sinks.into(),
        tensors.has_documents.into(),
        call.key_splits as u32,
        call.keys.div_ceil(call.key_splits) as u32,
        call.page_size as u32,
        tensors.table_len as u32,
    )
}
