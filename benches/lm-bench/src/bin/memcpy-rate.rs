//! The machine's `memcpy` rate and its read rate, the bound a decoding step approaches when it
//! streams its weights from memory: per thread count, one JSON line with the bytes copied per
//! second (`"kind":"memcpy"`: each byte read once and written once) and one with the bytes summed
//! per second (`"kind":"read"`: read only, as a step reads its weights), over a buffer far larger
//! than the caches.
//!
//! ```text
//! cargo run --release -p lm-bench --bin memcpy-rate -- --threads 1 --threads 2
//! ```

use std::time::Instant;

use attention_bench::process::median;
use clap::Parser;

/// Times `copy_from_slice`, and a sum, of `--mib` MiB split into one contiguous part per thread.
#[derive(Debug, Parser)]
struct Args {
    /// Threads copying at once, each its own contiguous part; repeat for several.
    #[arg(long = "threads", default_values_t = [1u16, 2], value_parser = clap::value_parser!(u16).range(1..))]
    threads: Vec<u16>,
    /// Size of the buffer copied (and of its destination).
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u32).range(64..))]
    mib: u32,
    #[arg(long, default_value_t = 9, value_parser = clap::value_parser!(u32).range(1..))]
    repeats: u32,
}

#[derive(serde::Serialize)]
struct Record {
    kind: &'static str,
    threads: usize,
    mib: usize,
    repeats: usize,
    gb_per_s_median: f64,
    gb_per_s_range: [f64; 2],
}

/// Times `run` `repeats` times after one warm-up and prints the median rate over `mib` MiB.
fn print_rate(
    kind: &'static str,
    threads: usize,
    mib: usize,
    repeats: usize,
    mut run: impl FnMut(),
) {
    let mut rates: Vec<f64> = (0..repeats + 1)
        .map(|_| {
            let start = Instant::now();
            run();
            (mib << 20) as f64 / start.elapsed().as_secs_f64() / 1e9
        })
        .skip(1) // the first run warms the pool
        .collect();
    let gb_per_s_median = median(&mut rates);
    let record = Record {
        kind,
        threads,
        mib,
        repeats,
        gb_per_s_median,
        gb_per_s_range: [rates[0], rates[rates.len() - 1]],
    };
    println!(
        "{}",
        serde_json::to_string(&record).expect("a record serializes")
    );
}

/// The sum of `xs` in 16 independent lanes, so that it vectorizes and runs at the rate memory
/// delivers.
fn sum(xs: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 16];
    for chunk in xs.chunks_exact(16) {
        for (lane, x) in lanes.iter_mut().zip(chunk) {
            *lane += x;
        }
    }
    lanes.iter().sum()
}

fn main() -> Result<(), rayon::ThreadPoolBuildError> {
    let args = Args::parse();
    let (mib, repeats) = (args.mib as usize, args.repeats as usize);
    let len = (mib << 20) / size_of::<f32>();
    // Written once before timing, so that page faults are not part of the figures.
    let source: Vec<f32> = (0..len).map(|i| (i % 251) as f32).collect();
    let mut destination = vec![0.0f32; len];
    for threads in args.threads.iter().map(|&threads| usize::from(threads)) {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()?;
        let part = len.div_ceil(threads);
        print_rate("memcpy", threads, mib, repeats, || {
            pool.scope(|scope| {
                for (to, from) in destination.chunks_mut(part).zip(source.chunks(part)) {
                    scope.spawn(move |_| to.copy_from_slice(from));
                }
            })
        });
        print_rate("read", threads, mib, repeats, || {
            pool.scope(|scope| {
                for from in source.chunks(part) {
                    scope.spawn(move |_| {
                        std::hint::black_box(sum(from));
                    });
                }
            })
        });
    }
    std::hint::black_box(&destination);
    Ok(())
}
