//! What cubecl compiles and autotunes, counted from its log records: each GPU kernel compiled
//! (wgpu's WGSL or SPIR-V modules, CUDA's NVRTC programs) and each autotune pass is logged by
//! cubecl, and a logger that counts them tells a benchmark or a test whether a decoding step,
//! after the first ones, compiles or tunes anything.
//!
//! The logger is the process's `log` logger (one per process, installed once): a binary or a
//! test binary of one test installs it.

use std::sync::atomic::{AtomicU64, Ordering};

/// The counts so far (since the counter was installed).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Compiles {
    /// GPU kernels compiled.
    pub kernels: u64,
    /// Autotune passes (one per new tune key).
    pub tunes: u64,
}

impl Compiles {
    /// Kernels and tunes together.
    pub fn total(self) -> u64 {
        self.kernels + self.tunes
    }
}

struct Counter {
    kernels: AtomicU64,
    tunes: AtomicU64,
}

static COUNTER: Counter = Counter {
    kernels: AtomicU64::new(0),
    tunes: AtomicU64::new(0),
};

impl log::Log for Counter {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        metadata.target().starts_with("cubecl")
    }

    fn log(&self, record: &log::Record<'_>) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let target = record.target();
        let message = record.args().to_string();
        // cubecl-wgpu: `[cubecl-wgpu] compiling WGSL module …` (trace), `Compiling …` (SPIR-V,
        // debug); cubecl-cuda: `Compiling kernel …`; cubecl-runtime's tuner: `Tuning …` (info).
        let compiled = message.starts_with("[cubecl-wgpu] compiling")
            || (target.starts_with("cubecl_wgpu") || target.starts_with("cubecl_cuda"))
                && message.starts_with("Compiling");
        if compiled {
            self.kernels.fetch_add(1, Ordering::Relaxed);
        } else if message.starts_with("Tuning ") {
            self.tunes.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn flush(&self) {}
}

/// Installs the counter as the process's logger; an error when another logger was installed
/// first (then nothing is counted).
pub fn install() -> Result<(), log::SetLoggerError> {
    log::set_logger(&COUNTER)?;
    log::set_max_level(log::LevelFilter::Trace);
    Ok(())
}

/// What has been compiled and tuned since [`install`].
pub fn counted() -> Compiles {
    Compiles {
        kernels: COUNTER.kernels.load(Ordering::Relaxed),
        tunes: COUNTER.tunes.load(Ordering::Relaxed),
    }
}
