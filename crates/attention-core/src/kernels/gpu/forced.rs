//! The blocks and tiles the kernel tests force (`tests.rs`), in one table: the tests run each
//! variant, and the kernel report names, for each tiling the rule picks on a larger device, the
//! forced variant that stands for it on lavapipe, the adapter CI runs the tests on.

use burn::tensor::DType::{self, F16, F32};

use self::Kernels::{All, Forward, Gradients};
use super::simt::Tiling;
use super::tiling::{self, Pass, Sizes, TileRule};

/// Lavapipe's shared memory per cube, bytes: every forced variant fits in it.
pub(crate) const LAVAPIPE_SHARED_MEMORY: usize = 32 << 10;
/// Units per cube every wgpu adapter allows (WebGPU's default limit): no forced variant has more.
const ANY_ADAPTER_UNITS: u32 = 256;

/// Which kernels of a call a forced variant is run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kernels {
    Forward,
    Gradients,
    All,
}

impl Kernels {
    /// Whether the kernel of `pass` is among these.
    pub(crate) fn runs(self, pass: Pass) -> bool {
        match self {
            Kernels::Forward => pass == Pass::Forward,
            Kernels::Gradients => pass != Pass::Forward,
            Kernels::All => true,
        }
    }
}

/// A block and tile forced on each kernel of `kernels` in `dtype` at `head_dim`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Forced {
    pub kernels: Kernels,
    pub dtype: DType,
    pub head_dim: usize,
    pub block: u32,
    pub tile: u32,
}

impl Forced {
    const fn new(kernels: Kernels, dtype: DType, head_dim: usize, block: u32, tile: u32) -> Self {
        Self {
            kernels,
            dtype,
            head_dim,
            block,
            tile,
        }
    }

    /// The rule that forces it.
    pub(crate) fn rule(&self) -> TileRule {
        TileRule::Fixed {
            block: self.block,
            tile: self.tile,
        }
    }

    /// The tiling it gives the kernel of `pass` on lavapipe.
    ///
    /// # Panics
    /// When lavapipe's shared memory does not hold it (this module's test).
    pub(crate) fn tiling(&self, pass: Pass) -> Tiling {
        let sizes = Sizes {
            head_dim: self.head_dim,
            element: self.dtype.size(),
            rows: self.block as usize,
            vector: tiling::vector_size(self.head_dim, 4),
            shared_memory: LAVAPIPE_SHARED_MEMORY,
            max_units: ANY_ADAPTER_UNITS,
        };
        tiling::tiling(pass, sizes, self.rule())
    }
}

/// Width 64 in f32 on grouped heads, every kernel: blocks and tiles of several sizes.
pub(crate) const GROUPED_WIDTH_64: [Forced; 4] = [
    Forced::new(All, F32, 64, 32, 16),
    Forced::new(All, F32, 64, 16, 32),
    Forced::new(All, F32, 64, 8, 8),
    Forced::new(All, F32, 64, 4, 16),
];

/// Width 128 in f32 with a window, padding and scores, every kernel.
pub(crate) const SCORED_WIDTH_128: Forced = Forced::new(All, F32, 128, 8, 8);

/// A decoding step over a windowed cache, its keys split.
pub(crate) const SPLIT_DECODING: Forced = Forced::new(Forward, F32, 64, 8, 16);

/// Stand-ins for the tilings larger devices get (CUDA's and Vulkan's shared memory on NVIDIA):
/// of each, the same kernel, float type and block at the largest tile lavapipe holds. Among them
/// the largest blocks, cubes of the most units: the rule seldom picks those at lavapipe's own
/// sizes, so that no other test runs such a cube, and a bug that only they show would first show
/// on a user's GPU.
pub(crate) const STAND_INS: [Forced; 7] = [
    Forced::new(Forward, F32, 64, 64, 16),
    Forced::new(Forward, F16, 64, 64, 32),
    Forced::new(Forward, F16, 128, 64, 16),
    Forced::new(Gradients, F16, 64, 64, 16),
    Forced::new(Forward, F32, 128, 32, 8),
    Forced::new(Gradients, F32, 128, 16, 8),
    Forced::new(Gradients, F16, 128, 32, 16),
];

/// Every forced variant.
pub(crate) fn all() -> impl Iterator<Item = Forced> {
    GROUPED_WIDTH_64
        .into_iter()
        .chain([SCORED_WIDTH_128, SPLIT_DECODING])
        .chain(STAND_INS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_forced_variant_fits_lavapipe() {
        for variant in all() {
            for pass in [Pass::Forward, Pass::QueryGrad, Pass::KeyValueGrad] {
                if variant.kernels.runs(pass) {
                    let tiling = variant.tiling(pass);
                    let bytes = tiling::shared_memory(
                        pass,
                        &tiling,
                        variant.dtype.size(),
                        tiling::vector_size(variant.head_dim, 4),
                    );
                    assert!(
                        bytes <= LAVAPIPE_SHARED_MEMORY,
                        "{variant:?} {pass:?}: {bytes} B"
                    );
                }
            }
        }
    }

    #[test]
    fn the_stand_ins_have_cubes_of_128_units() {
        let units: Vec<u32> = STAND_INS
            .iter()
            .filter(|variant| variant.block == 64)
            .map(|variant| {
                let pass = if variant.kernels.runs(Pass::Forward) {
                    Pass::Forward
                } else {
                    Pass::QueryGrad
                };
                variant.tiling(pass).units()
            })
            .collect();
        assert_eq!(units, [128; 4]);
    }
}
