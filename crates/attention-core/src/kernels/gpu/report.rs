//! The GPU kernels' CUDA source as cubecl's CUDA compiler writes it, without a CUDA device: each
//! kernel is defined through a wgpu client (any adapter: the kernels read no device property
//! when they are defined) and compiled by cubecl-cpp's CUDA dialect, for a report of registers,
//! spills and shared memory by NVIDIA's own compiler (`benches/kernel-report`). With each
//! kernel, the tested variant that stands for its tiling on lavapipe, where CI runs the tests.

use burn::tensor::DType;
use cubecl::prelude::*;
use cubecl::wgpu::{WgpuDevice, WgpuRuntime};
use cubecl::{Compiler, Runtime};
use cubecl_cpp::cuda::CudaDialect;
use cubecl_cpp::cuda::mma::CudaWmmaCompiler;
use cubecl_cpp::shared::{CompilationOptions, CppCompiler, CppSupportedFeatures};

use super::forced::{self, LAVAPIPE_SHARED_MEMORY};
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
    /// What stands for its tiling on lavapipe (see [`StandIn`]); `None` for a kernel without a
    /// tiling.
    pub stand_in: Option<StandIn>,
    /// The CUDA C++ source.
    pub source: String,
}

/// What stands on lavapipe, where CI runs the kernel tests, for a tiling a larger device gets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StandIn {
    /// Variants the tests force of the same kernel, float type, head width and block (so the
    /// same units a cube): their tiles, the nearest to the tiling's first.
    Tested {
        /// Query rows a cube.
        block: u32,
        /// Keys a tile, of each forced variant.
        tiles: Vec<u32>,
    },
    /// No test forces one, though lavapipe's shared memory holds the block at `tile`.
    Untested {
        /// Query rows a cube.
        block: u32,
        /// Keys a tile, the largest that fits.
        tile: u32,
        /// Shared memory at that tile.
        bytes: usize,
    },
    /// Lavapipe's shared memory holds no tile of the block: the smallest takes `bytes`.
    TooLarge {
        /// Query rows a cube.
        block: u32,
        /// Shared memory at the smallest tile.
        bytes: usize,
    },
}

impl std::fmt::Display for StandIn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StandIn::Tested { block, tiles } => {
                let tiles: Vec<String> = tiles.iter().map(|tile| format!("t{tile}")).collect();
                write!(f, "tested at b{block} {}", tiles.join(", "))
            }
            StandIn::Untested { block, tile, bytes } => {
                write!(f, "untested: lavapipe holds b{block} t{tile} ({bytes} B)")
            }
            StandIn::TooLarge { block, bytes } => {
                write!(f, "no lavapipe stand-in: b{block} needs {bytes} B at least")
            }
        }
    }
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
    let storage: StorageType = dtype_of.into();
    let sizes = production_sizes(dtype_of, head_dim, shared_memory);
    let vector = sizes.vector;
    let mut sources: Vec<KernelSource> = [Pass::Forward, Pass::QueryGrad, Pass::KeyValueGrad]
        .into_iter()
        .map(|pass| {
            let tiling = tiling::tiling(pass, sizes, TileRule::Auto);
            let kernel = simt_kernel(&client, pass, tiling, vector, storage);
            let (entry, source) = defined(&*kernel);
            KernelSource {
                name: variant_name(pass_name(pass), dtype, &tiling),
                entry,
                units: tiling.units(),
                shared_memory: tiling::shared_memory(pass, &tiling, sizes.element, vector),
                stand_in: Some(stand_in(pass, dtype_of, head_dim, &tiling)),
                source,
            }
        })
        .collect();

    let combine = Tiling {
        width: tiling::compiled_width(head_dim),
        block: 0,
        tile: 0,
        lanes: 0,
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
    let (entry, source) = defined(&kernel);
    sources.push(KernelSource {
        name: variant_name("combine", dtype, &combine),
        entry,
        units: super::cube::COMBINE_UNITS,
        shared_memory: 0,
        stand_in: None,
        source,
    });
    sources
}

/// A kernel's name in the report.
fn pass_name(pass: Pass) -> &'static str {
    match pass {
        Pass::Forward => "forward",
        Pass::QueryGrad => "query-grad",
        Pass::KeyValueGrad => "key-value-grad",
    }
}

/// `kernel` in `dtype` at `tiling`, e.g. `forward f32 w64 b64 t32 l8`.
fn variant_name(kernel: &str, dtype: &str, tiling: &Tiling) -> String {
    format!(
        "{kernel} {dtype} w{} b{} t{} l{}",
        tiling.width, tiling.block, tiling.tile, tiling.lanes
    )
}

/// The argument a kernel's definition takes for each of its tensors.
fn tensor() -> TensorCompilationArg {
    TensorCompilationArg { inplace: None }
}

/// The SIMT kernel of `pass` at `tiling`, for `storage` inputs loaded in vectors of `vector`.
fn simt_kernel(
    client: &ComputeClient<WgpuRuntime>,
    pass: Pass,
    tiling: Tiling,
    vector: usize,
    storage: StorageType,
) -> Box<dyn CubeKernel> {
    let settings = KernelSettings::default().cube_dim(CubeDim::new_1d(tiling.units()));
    let client = client.clone();
    let geometry = GeometryCompilationArg {
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
        packed: (),
        splits: (),
        split_len: (),
        page_size: (),
        table_len: (),
    };
    // One `tensor()` per tensor of the kernel, in its order; the kernels differ in how many.
    #[rustfmt::skip]
    let kernel: Box<dyn CubeKernel> = match pass {
        Pass::Forward => Box::new(simt::flash_forward::FlashForward::<WgpuRuntime>::new(
            settings, client, tensor(), tensor(), tensor(), tensor(), tensor(), tensor(), tensor(),
            tensor(), tensor(), tensor(), tensor(), tensor(), tensor(), tensor(), geometry, vector,
            tiling, false, [storage, storage, storage],
        )),
        Pass::QueryGrad => Box::new(simt::flash_query_grad::FlashQueryGrad::<WgpuRuntime>::new(
            settings, client, tensor(), tensor(), tensor(), tensor(), tensor(), tensor(), tensor(),
            tensor(), tensor(), geometry, vector, tiling, storage,
        )),
        Pass::KeyValueGrad => Box::new(
            simt::flash_key_value_grad::FlashKeyValueGrad::<WgpuRuntime>::new(
                settings, client, tensor(), tensor(), tensor(), tensor(), tensor(), tensor(),
                tensor(), tensor(), tensor(), tensor(), geometry, vector, tiling, storage,
            ),
        ),
    };
    kernel
}

/// What the tiling rule is asked for a long call of heads `head_dim` wide in `dtype` on a device
/// with `shared_memory` bytes a cube: the tilings the report compiles.
fn production_sizes(dtype: DType, head_dim: usize, shared_memory: usize) -> Sizes {
    Sizes {
        head_dim,
        element: dtype.size(),
        rows: 4096,
        vector: tiling::vector_size(head_dim, 4),
        shared_memory,
        max_units: 1024,
    }
}

/// `kernel`'s entry point and its CUDA source.
fn defined(kernel: &dyn CubeKernel) -> (String, String) {
    let definition = kernel.define();
    let entry = definition.options.kernel_name.clone();
    (entry, cuda(definition))
}

/// What stands on lavapipe for `production`, the tiling of `pass` for `head_dim` in `dtype` on a
/// larger device: the forced variants of the same kernel, float type and cube, else the largest
/// tile of the block lavapipe holds, else the least the block needs.
fn stand_in(pass: Pass, dtype: DType, head_dim: usize, production: &Tiling) -> StandIn {
    let block = production.block;
    // The same width, lanes and block: the same units, each with the same share of a row.
    let same_cube = |tested: &Tiling| {
        (tested.width, tested.lanes, tested.block) == (production.width, production.lanes, block)
    };
    let mut tiles: Vec<u32> = forced::all()
        .filter(|variant| variant.kernels.runs(pass) && variant.dtype == dtype)
        .map(|variant| variant.tiling(pass))
        .filter(same_cube)
        .map(|tested| tested.tile)
        .collect();
    tiles.sort_by_key(|&tile| (tile.abs_diff(production.tile), std::cmp::Reverse(tile)));
    tiles.dedup();
    if !tiles.is_empty() {
        return StandIn::Tested { block, tiles };
    }
    let vector = tiling::vector_size(head_dim, 4);
    let bytes_at = |tile| {
        let tiling = Tiling {
            tile,
            ..*production
        };
        tiling::shared_memory(pass, &tiling, dtype.size(), vector)
    };
    let tiles = tiling::TILES
        .into_iter()
        .filter(|&tile| tile >= production.lanes && tile.is_multiple_of(production.lanes));
    let largest_held = tiles
        .clone()
        .filter(|&tile| bytes_at(tile) <= LAVAPIPE_SHARED_MEMORY)
        .max();
    match largest_held {
        Some(tile) => StandIn::Untested {
            block,
            tile,
            bytes: bytes_at(tile),
        },
        None => StandIn::TooLarge {
            block,
            bytes: tiles.map(bytes_at).min().unwrap_or(0),
        },
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Shared memory per cube: CUDA's on an H100/H200, and Vulkan's common 48 KiB.
    const CUDA: usize = 227 << 10;
    const VULKAN: usize = 48 << 10;

    /// The stand-in of the tiling the rule picks for `pass` on a device with `shared_memory`.
    fn stand_in_on(pass: Pass, dtype: DType, head_dim: usize, shared_memory: usize) -> StandIn {
        let sizes = production_sizes(dtype, head_dim, shared_memory);
        let production = tiling::tiling(pass, sizes, TileRule::Auto);
        stand_in(pass, dtype, head_dim, &production)
    }

    #[test]
    fn every_vulkan_tiling_has_a_tested_stand_in() {
        for pass in [Pass::Forward, Pass::QueryGrad, Pass::KeyValueGrad] {
            for dtype in [DType::F32, DType::F16] {
                for head_dim in [64, 128] {
                    let found = stand_in_on(pass, dtype, head_dim, VULKAN);
                    assert!(
                        matches!(found, StandIn::Tested { .. }),
                        "{pass:?} {dtype:?} width {head_dim}: {found}"
                    );
                }
            }
        }
    }

    #[test]
    fn cudas_128_unit_cubes_are_tested_where_lavapipe_holds_them() {
        // The forward's 64-row cubes in f32 and f16, and f16's 64-row gradient cubes.
        for (pass, dtype) in [
            (Pass::Forward, DType::F32),
            (Pass::Forward, DType::F16),
            (Pass::QueryGrad, DType::F16),
            (Pass::KeyValueGrad, DType::F16),
        ] {
            let found = stand_in_on(pass, dtype, 64, CUDA);
            assert!(
                matches!(&found, StandIn::Tested { block: 64, .. }),
                "{pass:?} {dtype:?}: {found}"
            );
        }
        // f32's 64-row gradient cubes need more than lavapipe's 32 KiB at any tile.
        for pass in [Pass::QueryGrad, Pass::KeyValueGrad] {
            let found = stand_in_on(pass, DType::F32, 64, CUDA);
            assert!(
                matches!(found, StandIn::TooLarge { block: 64, bytes } if bytes > LAVAPIPE_SHARED_MEMORY),
                "{pass:?}: {found}"
            );
        }
    }
}
