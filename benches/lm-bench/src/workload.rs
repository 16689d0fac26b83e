//! `--workload FILE.jsonl`: a file of requests (`ids`, `max_new_tokens`, as `hf-lm --requests`
//! reads them) timed two ways — through the continuous-batching engine, and as static batches
//! (`generate_batch` on consecutive groups of `--static-batch` requests in file order, each
//! group left-padded and run to its largest limit, counting only each request's own tokens) —
//! one JSON line each (`--no-static`: the engine only). Every request is there at the start: a
//! request's time to first token counts its wait.

use std::path::Path;
use std::time::Instant;

use burn::prelude::*;
use hf_models::{
    CausalLm, Engine, EngineConfig, EngineStats, Event, GenerateConfig, KvDtype, Prompts, Request,
};
use serde::{Deserialize, Serialize};

/// A workload line: greedy, no stop ids.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Line {
    #[serde(default)]
    id: Option<serde_json::Value>,
    ids: Vec<u32>,
    max_new_tokens: usize,
}

/// How the engine runs.
pub struct EngineSettings {
    pub kv_mib: usize,
    pub page_size: usize,
    pub max_running: usize,
    pub step_tokens: usize,
    /// `None`: the engine's default.
    pub prefill_while_decoding: Option<usize>,
    pub share_prefixes: bool,
    /// What the caches and pages store keys and values as.
    pub kv_dtype: KvDtype,
}

#[derive(Serialize)]
struct Record<'a> {
    #[serde(rename = "impl")]
    implementation: &'static str,
    mode: &'static str,
    backend: &'a str,
    workload: String,
    requests: usize,
    threads: usize,
    generated_tokens: usize,
    seconds: f64,
    tokens_per_s: f64,
    /// Time to first token and inter-token latency quantiles, the engine's only: a static
    /// batch is one `generate_batch` call, whose steps are not seen from outside.
    ttft_s_p50: Option<f64>,
    ttft_s_p95: Option<f64>,
    itl_ms_p50: Option<f64>,
    itl_ms_p95: Option<f64>,
    /// Tokens through the model: prompts, recomputed tokens, generated tokens but the last
    /// (engine), or every padded row's columns (static).
    tokens_fed: usize,
    /// The engine's most pages held at once, and its page size; `null` for static batches.
    peak_pages: Option<usize>,
    page_size: Option<usize>,
    preemptions: Option<usize>,
    /// Prompt positions the engine mapped from other sequences' pages; `null` for static.
    prefix_tokens_shared: Option<usize>,
    /// The engine's token budget a step, and its prompt tokens beside decoding rows.
    step_tokens: Option<usize>,
    prefill_while_decoding: Option<usize>,
}

fn read(path: &Path) -> Result<Vec<Request>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    text.lines()
        .enumerate()
        .map(|(number, line)| {
            let line: Line = serde_json::from_str(line)
                .map_err(|e| format!("{} line {number}: {e}", path.display()))?;
            let _ = line.id;
            Ok(Request::greedy(line.ids, line.max_new_tokens))
        })
        .collect()
}

/// The `q`-quantile of `values` (sorted here), nearest rank.
fn quantile(values: &mut [f64], q: f64) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    values.sort_by(f64::total_cmp);
    let rank = ((q * values.len() as f64).ceil() as usize).clamp(1, values.len());
    values[rank - 1]
}

/// Each request's token times (seconds from the start) → TTFT and inter-token quantiles.
fn latencies(times: &[Vec<f64>]) -> [f64; 4] {
    let mut first: Vec<f64> = times.iter().filter_map(|t| t.first().copied()).collect();
    let mut gaps: Vec<f64> = times
        .iter()
        .flat_map(|t| t.windows(2).map(|w| (w[1] - w[0]) * 1e3))
        .collect();
    [
        quantile(&mut first, 0.5),
        quantile(&mut first, 0.95),
        quantile(&mut gaps, 0.5),
        quantile(&mut gaps, 0.95),
    ]
}

/// Times the workload through the engine, then as static batches; prints a line for each.
pub fn run<B: Backend>(
    model: &CausalLm<B>,
    backend: &str,
    path: &Path,
    settings: &EngineSettings,
    static_batch: Option<usize>,
    device: &B::Device,
) -> Result<(), String> {
    let requests = read(path)?;
    let workload = path
        .file_name()
        .map_or_else(String::new, |name| name.to_string_lossy().into_owned());
    let limits: usize = requests.iter().map(|r| r.max_new_tokens).sum();
    let prefill_while_decoding = settings
        .prefill_while_decoding
        .unwrap_or_else(|| EngineConfig::new(0).prefill_while_decoding);
    let record = |mode,
                  seconds: f64,
                  times: Option<&[Vec<f64>]>,
                  tokens_fed,
                  engine: Option<EngineStats>| {
        let [ttft50, ttft95, itl50, itl95] =
            times.map(latencies).map_or([None; 4], |q| q.map(Some));
        let record = Record {
            implementation: "ours",
            mode,
            backend,
            workload: workload.clone(),
            requests: requests.len(),
            threads: rayon::current_num_threads(),
            generated_tokens: limits,
            seconds,
            tokens_per_s: limits as f64 / seconds,
            ttft_s_p50: ttft50,
            ttft_s_p95: ttft95,
            itl_ms_p50: itl50,
            itl_ms_p95: itl95,
            tokens_fed,
            peak_pages: engine.map(|stats| stats.peak_pages),
            page_size: engine.map(|_| settings.page_size),
            preemptions: engine.map(|stats| stats.preemptions),
            prefix_tokens_shared: engine.map(|stats| stats.prefix_tokens_shared),
            step_tokens: engine.map(|_| settings.step_tokens),
            prefill_while_decoding: engine.map(|_| prefill_while_decoding),
        };
        println!(
            "{}",
            serde_json::to_string(&record).expect("a record serializes")
        );
    };

    // Continuous batching.
    let bytes_per_page =
        Engine::bytes_per_page(model.decoder(), settings.page_size, settings.kv_dtype)
            .map_err(|e| e.to_string())?;
    let config = EngineConfig::new((settings.kv_mib << 20) / bytes_per_page)
        .with_page_size(settings.page_size)
        .with_max_running(settings.max_running)
        .with_step_tokens(settings.step_tokens)
        .with_share_prefixes(settings.share_prefixes)
        .with_kv_dtype(settings.kv_dtype)
        .with_prefill_while_decoding(prefill_while_decoding);
    let mut engine = Engine::new(model.decoder(), config, device).map_err(|e| e.to_string())?;
    let start = Instant::now();
    let ids = requests
        .iter()
        .map(|r| engine.add(r.clone()).map_err(|e| e.to_string()))
        .collect::<Result<Vec<_>, _>>()?;
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); requests.len()];
    while !engine.is_idle() {
        for event in engine.step().map_err(|e| e.to_string())? {
            if let Event::Token { request, .. } = event {
                let index = ids.iter().position(|&id| id == request).expect("ours");
                times[index].push(start.elapsed().as_secs_f64());
            }
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    let stats = engine.stats();
    record(
        "continuous",
        seconds,
        Some(&times),
        stats.tokens_fed,
        Some(stats),
    );
    drop(engine);

    // Static batches.
    let Some(static_batch) = static_batch else {
        return Ok(());
    };
    let start = Instant::now();
    let mut tokens_fed = 0;
    for group in requests.chunks(static_batch) {
        let rows: Vec<Vec<u32>> = group.iter().map(|r| r.ids.clone()).collect();
        let prompts =
            Prompts::left_padded(&rows, model.special_tokens().pad()).map_err(|e| e.to_string())?;
        let longest = group.iter().map(|r| r.max_new_tokens).max().unwrap_or(0);
        let config = GenerateConfig {
            eos_token_ids: Vec::new(),
            kv_dtype: settings.kv_dtype,
            ..model.greedy(longest)
        };
        model
            .generate(&prompts, &config, device)
            .map_err(|e| e.to_string())?;
        let [batch, width] = prompts.dims();
        tokens_fed += batch * (width + longest - 1);
    }
    let seconds = start.elapsed().as_secs_f64();
    record("static", seconds, None, tokens_fed, None);
    Ok(())
}
