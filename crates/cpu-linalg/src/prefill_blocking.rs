//! How a prefill's panel products (`packed.rs`) cut their work on the CPU they run on.
//!
//! The register blocking follows the instruction set (`simd.rs`); how the rows and the features
//! are cut around it follows the caches and the memory, which differ between machines with the
//! same instruction set. The two kinds of core these products were measured on want different
//! cuts (BENCHMARKS.md, "The CPU targets"): an Intel Xeon, whose cores read memory more slowly
//! than an AMD EPYC's, gains from reading each weight once per call; the EPYC, whose third-level
//! cache holds a call's weights, gains from keeping a pass's sums in registers over the whole of
//! `k` and from giving every thread its own rows.

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
    /// Measured on an Intel Xeon (Sapphire Rapids): runs of 256 features (a panel's part and a
    /// pass's inputs fit its 48 KiB first-level cache), and few rows in one block whose panels
    /// are cut in runs, so that each weight is read from memory once per call.
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

    /// This CPU's cut: the EPYC's on AMD's cores, the Xeon's on every other.
    pub fn for_this_cpu() -> Self {
        if cpu_vendor_is_amd() {
            Self::ROWS_PER_THREAD
        } else {
            Self::READ_WEIGHTS_ONCE
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

/// Whether the CPU's vendor string (`cpuid` leaf 0) is AMD's.
fn cpu_vendor_is_amd() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let leaf = std::arch::x86_64::__cpuid(0);
        let vendor: Vec<u8> = [leaf.ebx, leaf.edx, leaf.ecx]
            .iter()
            .flat_map(|word| word.to_le_bytes())
            .collect();
        vendor == b"AuthenticAMD"
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
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

    /// This CPU's cut is one of the two measured ones, the EPYC's exactly where `cpuid` says
    /// AMD (as `/proc/cpuinfo` does on Linux).
    #[test]
    fn this_cpus_cut_follows_its_vendor() {
        let cut = PrefillBlocking::for_this_cpu();
        let Ok(cpuinfo) = std::fs::read_to_string("/proc/cpuinfo") else {
            return;
        };
        let amd = cpuinfo
            .lines()
            .any(|line| line.starts_with("vendor_id") && line.trim_end().ends_with("AuthenticAMD"));
        let expected = match amd {
            true => PrefillBlocking::ROWS_PER_THREAD,
            false => PrefillBlocking::READ_WEIGHTS_ONCE,
        };
        assert_eq!(cut, expected);
    }
}
