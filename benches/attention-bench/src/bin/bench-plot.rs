//! Draws time against sequence length from JSON lines written by the runner and by
//! `shared/peers/torch_mha.py` (records whose shape is `1xTx768x12`, one PNG per mode).
//!
//! ```text
//! cargo run --release -p attention-bench --bin bench-plot -- results.jsonl benches/attention-bench/plots
//! ```

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;

use attention_plots::{Axes, Series, line_chart};

/// The fields of a timing line that the plot reads; lines of other kinds (the sgemm ceiling,
/// errors) lack some and are skipped.
#[derive(serde::Deserialize)]
struct Timing {
    /// Ours only; PyTorch's lines have none.
    backend: Option<String>,
    #[serde(rename = "impl")]
    implementation: String,
    mode: String,
    shape: String,
    median_ms: f64,
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [input, out_dir] = &args[..] else {
        eprintln!("usage: bench-plot RESULTS.jsonl OUT_DIR");
        return ExitCode::from(2);
    };
    let text = match std::fs::read_to_string(input) {
        Ok(text) => text,
        Err(e) => {
            eprintln!("error: cannot read {input}: {e}");
            return ExitCode::from(2);
        }
    };
    // mode -> series name -> (seq, ms)
    let mut by_mode: BTreeMap<String, BTreeMap<String, Vec<(f64, f64)>>> = BTreeMap::new();
    for timing in text
        .lines()
        .filter_map(|line| serde_json::from_str::<Timing>(line).ok())
    {
        let sizes: Vec<&str> = timing.shape.split('x').collect();
        let (Some(&"1"), Some(seq)) = (
            sizes.first(),
            sizes.get(1).and_then(|s| s.parse::<f64>().ok()),
        ) else {
            continue;
        };
        let name = format!(
            "{}/{}",
            timing.backend.as_deref().unwrap_or("pytorch"),
            timing.implementation
        );
        by_mode
            .entry(timing.mode)
            .or_default()
            .entry(name)
            .or_default()
            .push((seq, timing.median_ms));
    }
    std::fs::create_dir_all(out_dir).ok();
    for (mode, series) in by_mode {
        let series: Vec<Series> = series
            .into_iter()
            .map(|(label, mut points)| {
                points.sort_by(|a, b| a.0.total_cmp(&b.0));
                Series {
                    emphasis: label.starts_with("pytorch/sdpa") || label.ends_with("/fused"),
                    label,
                    points,
                }
            })
            .collect();
        let path = PathBuf::from(out_dir).join(format!("time-vs-seq-{mode}.png"));
        let axes = Axes {
            title: format!("causal attention, batch 1, width 768, 12 heads: {mode}"),
            x: "sequence length".into(),
            y: "median time (ms)".into(),
            log: true,
        };
        match line_chart(&path, &axes, &series) {
            Ok(()) => println!("wrote {}", path.display()),
            Err(e) => {
                eprintln!("error: cannot draw {}: {e}", path.display());
                return ExitCode::from(2);
            }
        }
    }
    ExitCode::SUCCESS
}
