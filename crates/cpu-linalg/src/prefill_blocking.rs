//! How a prefill's panel products (`packed.rs`) cut their work on the CPU they run on, chosen
//! from the size of its first-level data cache (read in `cache_sizes.rs`).
//!
//! The register blocking follows the instruction set (`simd.rs`); how the rows and the features
//! are cut around it follows the caches and the memory, which differ between machines with the
//! same instruction set. The two kinds of core these products were measured on want different
//! cuts (BENCHMARKS.md, "The CPU targets"): an Intel Xeon, whose cores read memory more slowly
//! than an AMD EPYC's, gains from reading each weight once per call and from runs of features
//! whose part of a panel stays in its first-level cache beside a pass's inputs; the EPYC, whose
//! third-level cache holds a call's weights and whose first-level cache is too small for such a
//! run, gains from keeping a pass's sums in registers over the whole of `k` and from giving every
//! thread its own rows. Of what the two machines' records give (their `lscpu`), the first-level
//! data cache is what tells them apart and what the feature runs depend on, so the cut follows
//! it: the Xeon's where a run fits, the EPYC's where it does not. The Xeon's third-level cache
//! was never recorded, so the weights' side of the cut cannot follow its own property; it goes
//! with the feature runs, as each pair was measured together.

use crate::cache_sizes::CacheSizes;
use crate::simd::{AVX512_PANEL_ROWS, PANEL};

/// The cut of a prefill's product (see [`PrefillBlocking::for_this_cpu`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct PrefillBlocking {
    /// The features of a panel a pass adds before its sums go to memory and the next pass takes
    /// the same features: a panel's part then stays in the first-level cache for all of a
    /// block's passes. `usize::MAX`: all of them, the sums staying in registers.
    pub features_at_once: usize,
    /// The fewest blocks of rows per thread a prefill's rows are cut in (each block at least one
    /// pass of rows): every block reads all the weights. Where the rows still make fewer blocks
    /// than threads, the panels are cut in runs, a task per thread, each reading its part.
    pub blocks_per_thread: usize,
}

impl PrefillBlocking {
    /// Measured on an Intel Xeon (Sapphire Rapids): runs of features (a panel's part and a pass's
    /// inputs fit its first-level cache), and few rows in one block whose panels are cut in runs,
    /// so that each weight is read from memory once per call.
    pub const READ_WEIGHTS_ONCE: Self = Self {
        features_at_once: 256,
        blocks_per_thread: 0,
    };

    /// Measured on an AMD EPYC (Zen 4): a panel's whole `k` per pass (runs of features only add
    /// the sums' trips to memory), and few rows in two blocks per thread, each reading the
    /// weights from the shared cache (runs of panels measured slower there).
    pub const ROWS_PER_THREAD: Self = Self {
        features_at_once: usize::MAX,
        blocks_per_thread: 2,
    };

    /// The bytes a pass over one run of [`Self::READ_WEIGHTS_ONCE`]'s features reads again for
    /// every pass of a block: the panel's weights for those features and the tallest pass's
    /// inputs for them (AVX-512's).
    const FEATURE_RUN_BYTES: usize =
        Self::READ_WEIGHTS_ONCE.features_at_once * (PANEL + AVX512_PANEL_ROWS) * size_of::<f32>();

    /// This CPU's cut, from its caches as read now.
    pub fn for_this_cpu() -> Self {
        Self::for_caches(CacheSizes::of_this_cpu())
    }

    /// The cut for a CPU with `caches`: the Xeon's where a core's first-level data cache holds a
    /// run of features of a panel with a pass's inputs ([`Self::FEATURE_RUN_BYTES`]), the EPYC's
    /// where it does not; the Xeon's where its size is unknown (the cut every CPU but AMD's had
    /// before it was read).
    pub fn for_caches(caches: CacheSizes) -> Self {
        match caches.l1_data {
            Some(bytes) if bytes < Self::FEATURE_RUN_BYTES => Self::ROWS_PER_THREAD,
            _ => Self::READ_WEIGHTS_ONCE,
        }
    }

    /// The number of blocks `rows` are cut in on `threads` threads, in passes of at most `pass`
    /// rows: blocks of at most `max_block_rows`, and at least [`Self::blocks_per_thread`] per
    /// thread while each keeps a pass's rows.
    pub fn blocks(&self, rows: usize, threads: usize, pass: usize, max_block_rows: usize) -> usize {
        let per_thread = (self.blocks_per_thread * threads).min(rows.div_ceil(pass));
        rows.div_ceil(max_block_rows).max(per_thread).max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Few rows take two blocks per thread on the EPYC's cut (one pass's rows at least) and one
    /// block on the Xeon's; many rows take blocks of at most the largest size on both.
    #[test]
    fn blocks_per_cut() {
        let (xeon, epyc) = (
            PrefillBlocking::READ_WEIGHTS_ONCE,
            PrefillBlocking::ROWS_PER_THREAD,
        );
        assert_eq!(xeon.blocks(128, 2, 14, 128), 1);
        assert_eq!(epyc.blocks(128, 2, 14, 128), 4);
        assert_eq!(epyc.blocks(20, 2, 14, 128), 2, "a pass's rows each");
        assert_eq!(epyc.blocks(9, 4, 14, 128), 1);
        assert_eq!(xeon.blocks(1024, 2, 14, 128), 8);
        assert_eq!(epyc.blocks(1024, 2, 14, 128), 8);
        assert_eq!(epyc.blocks(1024, 8, 14, 128), 16);
    }

    /// The Xeon's first-level data cache as its `lscpu` recorded it (BENCHMARKS.md, "The CPU
    /// targets on an Intel Xeon") gets the cut measured there.
    #[test]
    fn the_xeons_caches_get_the_xeons_cut() {
        let xeon = CacheSizes {
            l1_data: Some(48 << 10),
        };
        assert_eq!(
            PrefillBlocking::for_caches(xeon),
            PrefillBlocking::READ_WEIGHTS_ONCE
        );
    }

    /// The EPYC's first-level data cache as its `lscpu` and Linux's cache listing recorded it
    /// (BENCHMARKS.md, "The CPU targets, every row on one machine") gets the cut measured there.
    #[test]
    fn the_epycs_caches_get_the_epycs_cut() {
        let epyc = CacheSizes {
            l1_data: Some(32 << 10),
        };
        assert_eq!(
            PrefillBlocking::for_caches(epyc),
            PrefillBlocking::ROWS_PER_THREAD
        );
    }

    /// Caches that could not be read get the Xeon's cut, as every CPU but AMD's did before.
    #[test]
    fn unknown_caches_get_the_xeons_cut() {
        let unknown = CacheSizes { l1_data: None };
        assert_eq!(
            PrefillBlocking::for_caches(unknown),
            PrefillBlocking::READ_WEIGHTS_ONCE
        );
    }

    /// On either measured machine, this CPU's cut is the one measured on it, as it was when the
    /// vendor chose it (the machine told by `/proc/cpuinfo` on Linux: the EPYC by its model, the
    /// Xeon by its name and its AVX-512 half-precision, which its generation brought); on any
    /// other, one of the two.
    #[test]
    fn this_cpus_cut_is_its_kinds() {
        fn field<'a>(cpuinfo: &'a str, name: &str) -> Option<&'a str> {
            cpuinfo.lines().find_map(|line| {
                let (key, value) = line.split_once(':')?;
                (key.trim() == name).then_some(value.trim())
            })
        }
        let cut = PrefillBlocking::for_this_cpu();
        let measured = [
            PrefillBlocking::READ_WEIGHTS_ONCE,
            PrefillBlocking::ROWS_PER_THREAD,
        ];
        assert!(measured.contains(&cut), "{cut:?}");
        let Ok(cpuinfo) = std::fs::read_to_string("/proc/cpuinfo") else {
            return;
        };
        let entry = |name| field(&cpuinfo, name);
        let half_precision = entry("flags")
            .is_some_and(|flags| flags.split_whitespace().any(|flag| flag == "avx512_fp16"));
        let expected = match (entry("model name"), entry("cpu family"), entry("model")) {
            (Some("AMD EPYC"), Some("25"), Some("17")) => PrefillBlocking::ROWS_PER_THREAD,
            (Some("Intel(R) Xeon(R) Processor"), _, _) if half_precision => {
                PrefillBlocking::READ_WEIGHTS_ONCE
            }
            _ => return,
        };
        assert_eq!(cut, expected);
    }
}
