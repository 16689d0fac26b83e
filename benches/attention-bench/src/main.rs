//! The JSON runner: one line per shape with the median, min and max of repeated runs, the
//! nominal GFLOP/s and the process's peak RSS.
//!
//! ```text
//! cargo run --release -p attention-bench -- --backend flex --impl fused --mode fwd \
//!     --shape 1x1024x768x12 --shape 4x512x768x12 --repeats 10
//! ```

use std::process::ExitCode;
use std::time::Duration;

use attention_backends::{BackendName, OnBackend, dispatch};
use attention_bench::{Impl, Mode, Shape, Unsupported, prepare};
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
}

fn main() -> ExitCode {
    let args = Args::parse();
    let outcome = dispatch(args.backend, Runner(&args))
        .unwrap_or_else(|no_adapter| Err(Unsupported(no_adapter.to_string())));
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::from(2)
        }
    }
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
    for &shape in &args.shapes {
        reset_peak_rss();
        let mut case = prepare::<B>(args.implementation, args.mode, shape, device)?;
        let mut times: Vec<f64> = case
            .time(args.warmup, args.repeats)
            .iter()
            .map(Duration::as_secs_f64)
            .collect();
        times.sort_by(f64::total_cmp);
        let median = if times.len() % 2 == 1 {
            times[times.len() / 2]
        } else {
            (times[times.len() / 2 - 1] + times[times.len() / 2]) / 2.0
        };
        let gflops = args.mode.flops(shape) / median / 1e9;
        println!(
            "{{\"backend\":\"{backend}\",\"impl\":\"{}\",\"mode\":\"{}\",\"shape\":\"{shape}\",\"repeats\":{},\"median_ms\":{:.4},\"min_ms\":{:.4},\"max_ms\":{:.4},\"gflops\":{},\"peak_rss_mib\":{:.1}}}",
            args.implementation.name(),
            args.mode.name(),
            times.len(),
            median * 1e3,
            times[0] * 1e3,
            times[times.len() - 1] * 1e3,
            gflops,
            peak_rss_mib(),
        );
    }
    Ok(())
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
