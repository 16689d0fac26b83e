//! The sizes of this CPU's caches, read from the machine for the prefill's cut
//! (`prefill_blocking.rs`): as Linux lists them under `/sys/devices/system/cpu/cpu0/cache/`, or,
//! where that cannot be read, as `cpuid`'s deterministic cache parameters give them (leaf 4 on
//! Intel, leaf `0x8000_001D` on AMD). Reading them is kept apart from what is chosen from them,
//! so that the choice can be tested on the sizes recorded for other machines.

use std::path::Path;

/// The sizes of a core's caches that a prefill's cut is chosen from, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CacheSizes {
    /// One core's first-level data cache; `None` where it could not be read.
    pub l1_data: Option<usize>,
}

impl CacheSizes {
    /// This CPU's: as Linux lists them for its first core, else as `cpuid` gives them for the
    /// core this runs on.
    pub(crate) fn of_this_cpu() -> Self {
        let l1_data = l1_data_from_sysfs(Path::new("/sys/devices/system/cpu/cpu0"))
            .or_else(l1_data_from_cpuid);
        Self { l1_data }
    }
}

/// The size of the first-level data cache of the CPU whose directory under
/// `/sys/devices/system/cpu/` is `cpu`, from its `cache/index*/` entries (`level`, `type` and
/// `size` each); `None` where Linux lists none.
fn l1_data_from_sysfs(cpu: &Path) -> Option<usize> {
    let caches = std::fs::read_dir(cpu.join("cache")).ok()?;
    caches.flatten().find_map(|cache| {
        let read = |name: &str| std::fs::read_to_string(cache.path().join(name)).ok();
        if read("level")?.trim() != "1" || read("type")?.trim() != "Data" {
            return None;
        }
        parse_size(read("size")?.trim()).filter(|&bytes| bytes > 0)
    })
}

/// A size as Linux writes it in `size`: bytes, or a count of kibibytes, mebibytes or gibibytes
/// followed by `K`, `M` or `G`.
fn parse_size(size: &str) -> Option<usize> {
    let (count, unit) = [("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)]
        .into_iter()
        .find_map(|(suffix, unit)| Some((size.strip_suffix(suffix)?, unit)))
        .unwrap_or((size, 1));
    count.parse::<usize>().ok()?.checked_mul(unit)
}

/// The size of the first-level data cache as `cpuid`'s deterministic cache parameters give it,
/// for the core this runs on: AMD's leaf where the CPU has topology extensions (which is how it
/// says that leaf is there), Intel's leaf 4 otherwise; `None` where neither lists one.
#[cfg(target_arch = "x86_64")]
fn l1_data_from_cpuid() -> Option<usize> {
    use std::arch::x86_64::{__cpuid, __cpuid_count, CpuidResult};
    // Leaf `0x8000_0001`'s `ecx` bit for AMD's topology extensions.
    const TOPOLOGY_EXTENSIONS: u32 = 1 << 22;
    let amd = __cpuid(0x8000_0000).eax >= AMD_CACHE_LEAF
        && (__cpuid(0x8000_0001).ecx & TOPOLOGY_EXTENSIONS) != 0;
    let leaf = if amd {
        AMD_CACHE_LEAF
    } else if __cpuid(0).eax >= INTEL_CACHE_LEAF {
        INTEL_CACHE_LEAF
    } else {
        return None;
    };
    let kind = |cache: &CpuidResult| cache.eax & 0b1_1111;
    let level = |cache: &CpuidResult| (cache.eax >> 5) & 0b111;
    // One sub-leaf per cache, until one of no type (no more caches); a bound in case a
    // hypervisor never reports that one.
    (0..MOST_CACHES)
        .map(|index| __cpuid_count(leaf, index))
        .take_while(|cache| kind(cache) != NO_MORE_CACHES)
        .find(|cache| kind(cache) == DATA_CACHE && level(cache) == 1)
        .and_then(|cache| cache_bytes(cache.ebx, cache.ecx))
        .filter(|&bytes| bytes > 0)
}

#[cfg(not(target_arch = "x86_64"))]
fn l1_data_from_cpuid() -> Option<usize> {
    None
}

/// Intel's leaf of deterministic cache parameters.
#[cfg(target_arch = "x86_64")]
const INTEL_CACHE_LEAF: u32 = 4;

/// AMD's leaf of deterministic cache parameters, laid out as Intel's.
#[cfg(target_arch = "x86_64")]
const AMD_CACHE_LEAF: u32 = 0x8000_001D;

/// The sub-leaves read at most.
#[cfg(target_arch = "x86_64")]
const MOST_CACHES: u32 = 16;

/// The type a sub-leaf gives past the last cache.
#[cfg(target_arch = "x86_64")]
const NO_MORE_CACHES: u32 = 0;

/// The type of a data cache.
#[cfg(target_arch = "x86_64")]
const DATA_CACHE: u32 = 1;

/// A cache's size from its sub-leaf's `ebx` and `ecx`: ways × partitions × line size × sets,
/// each stored as one less; `None` where the product overflows (parameters no cache has).
#[cfg(target_arch = "x86_64")]
fn cache_bytes(ebx: u32, ecx: u32) -> Option<usize> {
    let field = |shift: u32, width: u32| ((ebx >> shift) & ((1 << width) - 1)) as usize + 1;
    let (ways, partitions, line) = (field(22, 10), field(12, 10), field(0, 12));
    let sets = ecx as usize + 1;
    [ways, partitions, line, sets]
        .into_iter()
        .try_fold(1usize, usize::checked_mul)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first-level data cache of this machine reads as a plausible size: a whole number of
    /// kibibytes, more than a few and less than a second-level cache, wherever it can be read (on
    /// every x86-64 CPU).
    #[test]
    fn this_machines_first_level_cache_is_plausible() {
        let l1_data = CacheSizes::of_this_cpu().l1_data;
        #[cfg(target_arch = "x86_64")]
        assert!(l1_data.is_some(), "cpuid lists a first-level data cache");
        if let Some(bytes) = l1_data {
            assert!(bytes.is_multiple_of(1024), "{bytes} bytes");
            assert!((4 << 10..=1 << 20).contains(&bytes), "{bytes} bytes");
        }
    }

    /// `cpuid` gives the size Linux lists for a core of this machine (a core of another kind, on
    /// CPUs whose cores differ, may be the one this runs on), where both can be read.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn cpuid_reads_what_linux_lists() {
        let Ok(cpus) = std::fs::read_dir("/sys/devices/system/cpu") else {
            return;
        };
        let listed: Vec<usize> = cpus
            .flatten()
            .filter(|cpu| {
                let name = cpu.file_name();
                let name = name.to_string_lossy();
                name.strip_prefix("cpu").is_some_and(|index| {
                    !index.is_empty() && index.bytes().all(|b| b.is_ascii_digit())
                })
            })
            .filter_map(|cpu| l1_data_from_sysfs(&cpu.path()))
            .collect();
        if listed.is_empty() {
            return;
        }
        let Some(read) = l1_data_from_cpuid() else {
            return;
        };
        assert!(listed.contains(&read), "cpuid {read}, Linux {listed:?}");
    }

    /// Linux's sizes as it writes them.
    #[test]
    fn sizes_as_linux_writes_them() {
        assert_eq!(parse_size("32K"), Some(32 << 10));
        assert_eq!(parse_size("1024K"), Some(1 << 20));
        assert_eq!(parse_size("2M"), Some(2 << 20));
        assert_eq!(parse_size("512"), Some(512));
        assert_eq!(parse_size("K"), None);
        assert_eq!(parse_size("big"), None);
    }

    /// `cpuid`'s parameters of the EPYC's first- and second-level caches (as Linux lists them
    /// there: ways, line size, sets, one partition) give their sizes.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn cache_sizes_from_cpuid_parameters() {
        let ebx = |ways: u32, line: u32| ((ways - 1) << 22) | (line - 1);
        assert_eq!(cache_bytes(ebx(8, 64), 64 - 1), Some(32 << 10));
        assert_eq!(cache_bytes(ebx(8, 64), 2048 - 1), Some(1 << 20));
        assert_eq!(
            cache_bytes(u32::MAX, u32::MAX),
            None,
            "more bytes than a usize counts"
        );
    }
}
