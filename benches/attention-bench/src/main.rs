//! The JSON runner: one line per shape with the median, min and max of repeated runs, the
//! nominal GFLOP/s and the process's peak RSS.
//!
//! ```text
//! cargo run --release -p attention-bench -- --backend flex --impl fused --mode fwd \
//!     --shape 1x1024x768x12 --shape 4x512x768x12 --repeats 10 --threads 2
//! # each 1024-token row packed from documents of 100, 400 and 524 tokens
//! cargo run --release -p attention-bench -- --backend flex --impl fused --mode fwdbwd \
//!     --shape 1x1024x768x12 --documents 100,400,524 --core
//! # a decoding step of 8 rows at their own lengths, over a page pool
//! cargo run --release -p attention-bench -- --backend flex --impl fused --mode decode \
//!     --shape 8x4096x768x12 --cache paged --lengths 32,64,128,256,512,1024,2048,4096
//! ```

use std::process::ExitCode;
use std::time::Duration;

use attention_backends::{BackendName, FloatType, OnBackend};
use attention_bench::process::{median, run_on_in};
use attention_bench::{
    CacheKind, DecodeRows, Impl, Mode, Shape, Timed, Unsupported, packed_documents, prepare,
    prepare_core, supports,
};
use attention_core::{KvDtype, PagePool};
use burn::prelude::*;
use clap::Parser;

/// Times causal self-attention; prints one JSON object per shape.
#[derive(Debug, Parser)]
struct Args {
    #[arg(long, value_enum)]
    backend: BackendName,
    #[arg(long = "impl", value_enum)]
    implementation: Impl,
    #[arg(long, value_enum)]
    mode: Mode,
    /// `BxTxDxH`; repeat for several.
    #[arg(long = "shape", required = true)]
    shapes: Vec<Shape>,
    #[arg(long, default_value_t = 10)]
    repeats: usize,
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Key/value heads (grouped-query attention); must divide every shape's heads. Default: as
    /// many as heads.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    num_kv_heads: Option<u32>,
    /// Keys each query sees at most (sliding-window attention). Default: all earlier ones.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    sliding_window: Option<u32>,
    /// Threads of every pool (rayon's, matrixmultiply's); default: what each pool picks, usually
    /// one per core.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    threads: Option<u16>,
    /// Time the attention core alone (queries, keys and values in the layer's layout → the
    /// context), not the layer.
    #[arg(long)]
    core: bool,
    /// The float type the backend computes in.
    #[arg(long, value_enum, default_value_t = FloatType::F32)]
    dtype: FloatType,
    /// Calls queued per device sync; a time is per call. A GPU runtime's sync costs more than a
    /// small call: time those with 20 or more.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    calls_per_sync: u32,
    /// Packs every row from documents of these lengths, in order, `L1,L2,…` (each at least 1,
    /// adding up to the shape's sequence): each token attends within its own document. Whole
    /// rows only (`--mode fwd` or `fwdbwd`), of our layer or core (not `--impl burn-nn`).
    #[arg(long, value_name = "L1,L2,…", value_delimiter = ',')]
    documents: Option<Vec<usize>>,
    /// Where a decoding step (`--mode decode`) keeps its keys and values: the layer's dense
    /// `KvCache`, or a page pool read through each row's table (our layer, `--impl fused`).
    #[arg(long, value_enum, default_value_t = CacheKind::Dense)]
    cache: CacheKind,
    /// Positions per page of `--cache paged` (a power of two, at least 32).
    #[arg(long, default_value_t = PagePool::DEFAULT_PAGE_SIZE)]
    page_size: usize,
    /// One decoding row per length, `L1,L2,…`: row `i` decodes a token after `Li − 1` cached
    /// positions (`--mode decode`; as many as the shape's batch, the longest the shape's seq).
    /// A dense cache pads the rows to the longest, their padding keys masked.
    #[arg(long, value_name = "L1,L2,…", value_delimiter = ',')]
    lengths: Option<Vec<usize>>,
    /// What a decoding step's cache stores keys and values as: `f32` (the layer's float type),
    /// `f16`, `bf16` or `int8` (`--mode decode`, `--impl fused`; read by the CPU kernel).
    #[arg(long, default_value_t = KvDtype::Model)]
    kv_dtype: KvDtype,
}

/// One JSON line per shape.
#[derive(serde::Serialize)]
struct Record<'a> {
    backend: &'a str,
    #[serde(rename = "impl")]
    implementation: &'static str,
    mode: &'static str,
    /// The attention core alone (`--core`), or the layer.
    core: bool,
    dtype: &'static str,
    /// The shader compiler of the backend's kernels; `null` on the CPU backends.
    compiler: Option<&'static str>,
    calls_per_sync: u32,
    shape: String,
    num_kv_heads: usize,
    sliding_window: Option<usize>,
    /// The lengths of the documents each row is packed from (`--documents`); `null` for one
    /// document per row. The GFLOP/s stay nominal: those of whole causal rows.
    documents: Option<&'a [usize]>,
    /// Where a decoding step keeps its keys and values (`dense` or `paged`).
    cache: &'static str,
    /// Positions per page (`--cache paged`); `null` for a dense cache.
    page_size: Option<usize>,
    /// Each decoding row's length (`--lengths`); `null` for every row at the shape's seq.
    lengths: Option<&'a [usize]>,
    /// What the cache stores keys and values as (`--kv-dtype`).
    kv_dtype: String,
    /// A decoding step's keys and values, in bytes: a dense cache's allocated positions, or
    /// the pages the tables hold; `null` for other modes.
    cache_bytes: Option<usize>,
    /// The size of rayon's pool as this process found it.
    threads: usize,
    repeats: usize,
    median_ms: f64,
    min_ms: f64,
    max_ms: f64,
    gflops: f64,
    peak_rss_mib: f64,
}

fn main() -> ExitCode {
    let args = Args::parse();
    run_on_in(args.threads, args.backend, args.dtype, Runner(&args))
}

/// The runner on the backend `--backend` names.
struct Runner<'a>(&'a Args);

impl OnBackend for Runner<'_> {
    type Output = Result<(), Unsupported>;

    fn run<B: Backend>(self, name: &'static str, device: B::Device) -> Self::Output {
        run::<B>(name, &device, self.0)
    }
}

fn run<B: Backend>(backend: &str, device: &B::Device, args: &Args) -> Result<(), Unsupported> {
    if args.repeats == 0 {
        return Err(Unsupported("--repeats must be at least 1".into()));
    }
    // The flags checked against every shape before any is timed: a bad one costs no run. (Whether
    // a shape fits in memory is asked when it comes, after the shapes before it.)
    let cases = args
        .shapes
        .iter()
        .map(|&shape| case_of(shape, args))
        .collect::<Result<Vec<_>, _>>()?;
    for timed in cases {
        let shape = timed.shape;
        reset_peak_rss();
        let mut case = match args.core {
            true => prepare_core::<B>(timed, device)?,
            false => prepare::<B>(timed, device)?,
        };
        let mut times: Vec<f64> = case
            .time(args.warmup, args.repeats)
            .iter()
            .map(Duration::as_secs_f64)
            .collect();
        let median = median(&mut times);
        let gflops = args.mode.flops(shape, args.core) / median / 1e9;
        let record = Record {
            backend,
            implementation: args.implementation.name(),
            mode: args.mode.name(),
            core: args.core,
            dtype: args.dtype.name(),
            compiler: args.backend.compiler(),
            calls_per_sync: args.calls_per_sync,
            shape: shape.to_string(),
            num_kv_heads: shape.kv_heads,
            sliding_window: shape.window,
            documents: args.documents.as_deref(),
            cache: args.cache.name(),
            page_size: (args.cache == CacheKind::Paged).then_some(args.page_size),
            lengths: args.lengths.as_deref(),
            kv_dtype: args.kv_dtype.to_string(),
            cache_bytes: case.cache_bytes(),
            threads: rayon::current_num_threads(),
            repeats: times.len(),
            median_ms: median * 1e3,
            min_ms: times[0] * 1e3,
            max_ms: times[times.len() - 1] * 1e3,
            gflops,
            peak_rss_mib: peak_rss_mib(),
        };
        println!(
            "{}",
            serde_json::to_string(&record).expect("a record serializes")
        );
    }
    Ok(())
}

/// What `args` ask of `shape`: its key/value heads, window and documents, checked against it.
fn case_of(mut shape: Shape, args: &Args) -> Result<Timed, Unsupported> {
    if let Some(kv_heads) = args.num_kv_heads {
        let kv_heads = kv_heads as usize;
        if !shape.heads.is_multiple_of(kv_heads) {
            return Err(Unsupported(format!(
                "shape `{shape}`: --num-kv-heads {kv_heads} does not divide {} heads",
                shape.heads
            )));
        }
        shape.kv_heads = kv_heads;
    }
    shape.window = args.sliding_window.map(|window| window as usize);
    let documents = match &args.documents {
        Some(lengths) => {
            // The lengths are copied for every row: refused first where the rows could never fit.
            supports(args.implementation, args.mode, shape)?;
            Some(packed_documents(shape, lengths)?)
        }
        None => None,
    };
    Ok(Timed {
        implementation: args.implementation,
        mode: args.mode,
        shape,
        calls: args.calls_per_sync as usize,
        documents,
        decode: DecodeRows {
            cache: args.cache,
            page_size: args.page_size,
            lengths: args.lengths.clone(),
            kv_dtype: args.kv_dtype,
        },
    })
}

/// Resets the kernel's peak-RSS mark (Linux), so each shape reports its own peak.
fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// The process's peak resident set size since the last reset (`VmHWM`), in MiB.
fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status.lines().find_map(|line| {
                line.strip_prefix("VmHWM:")
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
            })
        })
        .map_or(f64::NAN, |kib| kib / 1024.0)
}
