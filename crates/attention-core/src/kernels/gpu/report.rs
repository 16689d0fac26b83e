//! The GPU kernels' CUDA source as cubecl's CUDA compiler writes it, without a CUDA device: each
//! kernel is defined through a wgpu client (any adapter: the kernels read no device property
//! when they are defined) and compiled by cubecl-cpp's CUDA dialect, for a report of registers,
//! spills and shared memory by NVIDIA's own compiler (`benches/kernel-report`).

use burn::tensor::DType;
use cubecl::prelude::*;
use cubecl::wgpu::{WgpuDevice, WgpuRuntime};
use cubecl::{Compiler, Runtime};
use cubecl_cpp::cuda::CudaDialect;
use cubecl_cpp::cuda::mma::CudaWmmaCompiler;
use cubecl_cpp::shared::{CompilationOptions, CppCompiler, CppSupportedFeatures};

use super::simt::{self, GeometryCompilationArg, SplitsCompilationArg, Tiling};
use super::tiling::{self, Pass, Sizes, TileRule};

/// One compiled kernel.
#[derive(Debug, Clone)]
pub struct KernelSource {
    /// The kernel and what it was compiled for, e.g. `forward f32 w64 b64 t32 l8`.
    pub name: String,
    /// Its entry point in the source.
    pub entry: String,
    /// Units per cube.
    pub units: u32,
    /// Shared memory per cube, bytes, as the kernels' tiling counts it.
    pub shared_memory: usize,
    /// The CUDA C++ source.
    pub source: String,
}

/// The kernels a call of head width `head_dim` in `dtype` (`"f32"`, `"f16"`, `"bf16"`) runs
/// on a device with `shared_memory` bytes per cube and 1024 units per cube, long sequences
/// (the tilings the rule picks there): forward, query gradient, key/value gradient, and the
/// combine of split keys.
///
/// # Panics
/// Without a wgpu adapter to define the kernels through, or for a dtype not listed.
pub fn cuda_sources(dtype: &str, head_dim: usize, shared_memory: usize) -> Vec<KernelSource> {
    let client = WgpuRuntime::client(&WgpuDevice::default());
    let dtype_of = match dtype {
        "f32" => DType::F32,
        "f16" => DType::F16,
        "bf16" => DType::BF16,
        other => panic!("no dtype {other}"),
    };
    let (storage, element): (StorageType, usize) = (dtype_of.into(), dtype_of.size());
    let vector = tiling::vector_size(head_dim, 4);
    let tiling_of = |pass| {
        let sizes = Sizes {
            head_dim,
            element,
            rows: 4096,
            vector,
            shared_memory,
            max_units: 1024,
        };
        tiling::tiling(pass, sizes, TileRule::Auto)
    };
    let tensor = || TensorCompilationArg { inplace: None };
    let geometry = || GeometryCompilationArg {
        heads: (),
        kv_heads: (),
        head_dim: (),
        queries: (),
        keys: (),
        key_first: (),
        key_rows: (),
        window: (),
        scale: (),
        softcap: (),
        padded: (),
        with_sinks: (),
        splits: (),
        split_len: (),
    };
    let settings =
        |tiling: &Tiling| KernelSettings::default().cube_dim(CubeDim::new_1d(tiling.units()));
    let mut sources = Vec::new();
    let mut push =
        |pass: &str, tiling: &Tiling, units: u32, memory: usize, kernel: &dyn CubeKernel| {
            let definition = kernel.define();
            let entry = definition.options.kernel_name.clone();
            sources.push(KernelSource {
                name: format!(
                    "{pass} {dtype} w{} b{} t{} l{}",
                    tiling.width, tiling.block, tiling.tile, tiling.lanes
                ),
                entry,
                units,
                shared_memory: memory,
                source: cuda(definition),
            });
        };

    let forward = tiling_of(Pass::Forward);
    let kernel = simt::flash_forward::FlashForward::<WgpuRuntime>::new(
        settings(&forward),
        client.clone(),
        tensor(),
        tensor(),
        tensor(),
        tensor(),
        tensor(),
        tensor(),
        tensor(),
        geometry(),
        vector,
        forward,
        [storage, storage],
    );
    let memory = tiling::shared_memory(Pass::Forward, &forward, element, vector);
    push("forward", &forward, forward.units(), memory, &kernel);

    let query_grad = tiling_of(Pass::QueryGrad);
    let kernel = simt::flash_query_grad::FlashQueryGrad::<WgpuRuntime>::new(
        settings(&query_grad),
        client.clone(),
        tensor(),
        tensor(),
        tensor(),
        tensor(),
        tensor(),
        tensor(),
        tensor(),
        tensor(),
        geometry(),
        vector,
        query_grad,
        storage,
    );
    let memory = tiling::shared_memory(Pass::QueryGrad, &query_grad, element, vector);
    push(
        "query-grad",
        &query_grad,
        query_grad.units(),
        memory,
        &kernel,
    );

    let key_grad = tiling_of(Pass::KeyValueGrad);
    let kernel = simt::flash_key_value_grad::FlashKeyValueGrad::<WgpuRuntime>::new(
        settings(&key_grad),
        client.clone(),
        tensor(),
        tensor(),
        tensor(),
        tensor(),
        tensor(),
        tensor(),
        tensor(),
        tensor(),
        tensor(),
        geometry(),
        vector,
        key_grad,
        storage,
    );
    let memory = tiling::shared_memory(Pass::KeyValueGrad, &key_grad, element, vector);
    push(
        "key-value-grad",
        &key_grad,
        key_grad.units(),
        memory,
        &kernel,
    );

    let combine = Tiling {
        block: 0,
        tile: 0,
        lanes: 0,
        ..forward
    };
    let kernel = simt::flash_combine::FlashCombine::<WgpuRuntime>::new(
        KernelSettings::default().cube_dim(CubeDim::new_1d(super::cube::COMBINE_UNITS)),
        client,
        tensor(),
        tensor(),
        tensor(),
        tensor(),
        SplitsCompilationArg {
            rows: (),
            head_vectors: (),
            splits: (),
        },
        vector,
        storage,
    );
    push("combine", &combine, super::cube::COMBINE_UNITS, 0, &kernel);
    sources
}

/// `definition` as cubecl's CUDA compiler writes it for an H100/H200 (`sm_90`), checked bounds
/// as the kernels launch.
fn cuda(definition: cubecl::prelude::KernelDefinition) -> String {
    let options = CompilationOptions {
        warp_size: 32,
        supports_features: CppSupportedFeatures {
            grid_constants: true,
            clusters: true,
            fast_math: true,
            fast_tanh: true,
            elect_sync: true,
        },
    };
    let address = cubecl::prelude::AddressType::U32.unsigned_type();
    CppCompiler::<CudaDialect<CudaWmmaCompiler>>::default()
        .compile(definition, &options, ExecutionMode::Checked, address)
        .expect("cubecl's CUDA compiler takes the kernels")
        .to_string()
}
