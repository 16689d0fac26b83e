//! Prefill and decode speed of a whole causal LM from a Hugging Face checkpoint directory, timed
//! as `peer_lm.py` times transformers' `generate`: one JSON line per batch size.
//!
//! ```text
//! cargo run --release -p lm-bench -- --model DIR --backend flex \
//!     --batch 1 --batch 8 --prompt 128 --new 128 --threads 2
//! ```
//!
//! `prefill` is a greedy `generate` call that makes 1 token (the prompt's forward pass through
//! the caches and one pick), `total` one that makes `--new`; the decode rate is
//! `batch · (new − 1) / (total − prefill)`. Prompt ids are `(row · 7919 + column · 104729) mod
//! vocab`, as in `peer_lm.py`.
//!
//! Counters, from the first `--new` call after a warm-up of 2 tokens (which compiles the
//! prefill and the first steps): `syncs_per_token`, this workspace's read-backs and device syncs
//! in steps 3…`--new` (the generation loop's, one per step for its ids, and attention-core's
//! caches') per token of a row; `compiles_in_steady_state`, kernels compiled and autotune passes
//! in those steps (cubecl's log, `attention_backends::compiles`). `launches_per_token` is not
//! counted: cubecl 0.10 has no launch counter outside its profiler.
//!
//! `--workload FILE.jsonl` times a file of requests instead, through the continuous-batching
//! engine and as static batches (`workload.rs`).

mod workload;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use attention_backends::{BackendName, FloatType, OnBackend, compiles};
use attention_bench::process::{median, run_on_in};
use burn::prelude::*;
use clap::Parser;
use hf_models::{CausalLm, GenerateConfig, KvDtype, Prompts};

/// Times prefill and decode of a Hugging Face checkpoint; prints one JSON object per batch.
#[derive(Debug, Parser)]
struct Args {
    /// A directory as `save_pretrained` writes it.
    #[arg(long)]
    model: PathBuf,
    #[arg(long, value_enum, default_value_t = BackendName::Flex)]
    backend: BackendName,
    /// Prompts per batch; repeat for several.
    #[arg(long = "batch", required_unless_present = "workload")]
    batches: Vec<usize>,
    /// A JSON-lines file of requests (`ids`, `max_new_tokens`) to time through the engine and
    /// as static batches, instead of `--batch`.
    #[arg(long, conflicts_with = "batches")]
    workload: Option<PathBuf>,
    /// With --workload: requests per static batch.
    #[arg(long, default_value_t = 8)]
    static_batch: usize,
    /// With --workload: the engine's KV pool, in MiB over every layer.
    #[arg(long, default_value_t = 1024)]
    kv_mib: usize,
    /// With --workload: positions per page.
    #[arg(long, default_value_t = 128)]
    page_size: usize,
    /// With --workload: the most requests an engine step runs.
    #[arg(long, default_value_t = 32)]
    max_running: usize,
    /// With --workload: the most tokens an engine step feeds.
    #[arg(long, default_value_t = 512)]
    step_tokens: usize,
    /// With --workload: an engine step beside `d` decoding rows feeds at most `max(d, this)`
    /// prompt tokens (default: the engine's).
    #[arg(long)]
    prefill_while_decoding: Option<usize>,
    /// With --workload: time the engine only, not static batches.
    #[arg(long)]
    no_static: bool,
    /// With --workload: every request computes its whole prompt (no prefix caching).
    #[arg(long)]
    no_prefix_sharing: bool,
    /// Tokens in every prompt.
    #[arg(long, default_value_t = 128)]
    prompt: usize,
    /// Tokens generated after every prompt (at least 2).
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u32).range(2..))]
    new: u32,
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    repeats: u32,
    /// Threads of every pool (rayon's, matrixmultiply's).
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    threads: Option<u16>,
    /// The float type the backend computes in (the checkpoint's weights are converted to it).
    #[arg(long, value_enum, default_value_t = FloatType::F32)]
    dtype: FloatType,
    /// What the KV caches (and the engine's pages) store keys and values as: `f32` (the model's
    /// float type), `f16`, `bf16` or `int8`.
    #[arg(long, default_value_t = KvDtype::Model)]
    kv_dtype: KvDtype,
}

#[derive(serde::Serialize)]
struct Record<'a> {
    #[serde(rename = "impl")]
    implementation: &'static str,
    backend: &'a str,
    dtype: &'static str,
    /// What the KV caches store keys and values as (`--kv-dtype`).
    kv_dtype: String,
    /// The shader compiler of the backend's kernels; `null` on the CPU backends.
    compiler: Option<&'static str>,
    batch: usize,
    prompt: usize,
    new: usize,
    threads: usize,
    repeats: usize,
    prefill_ms: f64,
    prefill_ms_range: [f64; 2],
    total_ms: f64,
    total_ms_range: [f64; 2],
    decode_tokens_per_s: f64,
    syncs_per_token: f64,
    compiles_in_steady_state: u64,
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Err(error) = compiles::install() {
        eprintln!("error: could not count compilations: {error}");
        return ExitCode::from(2);
    }
    run_on_in(args.threads, args.backend, args.dtype, Bench(&args))
}

/// The benchmark on the backend `--backend` names.
struct Bench<'a>(&'a Args);

impl OnBackend for Bench<'_> {
    type Output = Result<(), String>;

    fn run<B: Backend>(self, backend: &'static str, device: B::Device) -> Self::Output {
        let args = self.0;
        let model = CausalLm::<B>::load(&args.model, &device).map_err(|e| e.to_string())?;
        if let Some(path) = &args.workload {
            let settings = workload::EngineSettings {
                kv_mib: args.kv_mib,
                page_size: args.page_size,
                max_running: args.max_running,
                step_tokens: args.step_tokens,
                prefill_while_decoding: args.prefill_while_decoding,
                share_prefixes: !args.no_prefix_sharing,
                kv_dtype: args.kv_dtype,
            };
            let static_batch = (!args.no_static).then_some(args.static_batch);
            return workload::run(&model, backend, path, &settings, static_batch, &device);
        }
        let vocab = model.config().vocab_size();
        for &batch in &args.batches {
            let ids: Vec<i64> = (0..batch)
                .flat_map(|row| {
                    (0..args.prompt)
                        .map(move |column| ((row * 7919 + column * 104729) % vocab) as i64)
                })
                .collect();
            let prompts = Prompts::from_padded(&ids, &vec![1; ids.len()], [batch, args.prompt])
                .map_err(|e| e.to_string())?;
            // The time of a call, and its read-backs and syncs.
            let time_generate = |new_tokens: usize| -> Result<(f64, usize), String> {
                let config = GenerateConfig {
                    eos_token_ids: Vec::new(),
                    kv_dtype: args.kv_dtype,
                    ..model.greedy(new_tokens)
                };
                let syncs = attention_core::device_syncs();
                let start = Instant::now();
                let generation = model
                    .generate(&prompts, &config, &device)
                    .map_err(|e| e.to_string())?;
                let ms = start.elapsed().as_secs_f64() * 1e3;
                let syncs = attention_core::device_syncs() - syncs;
                Ok((ms, generation.reads + syncs as usize))
            };
            let new = args.new as usize;
            // Warm-up: the prefill and the first two steps compile their kernels.
            let (_, syncs_of_two) = time_generate(2)?;
            let compiled = compiles::counted();
            let (_, syncs_of_all) = time_generate(new)?;
            let compiles_in_steady_state = compiles::counted().total() - compiled.total();
            let syncs_per_token =
                (syncs_of_all - syncs_of_two) as f64 / (new.saturating_sub(2).max(1)) as f64;
            let time_generate = |new_tokens| time_generate(new_tokens).map(|(ms, _)| ms);
            let mut prefill = (0..args.repeats)
                .map(|_| time_generate(1))
                .collect::<Result<Vec<_>, _>>()?;
            let mut total = (0..args.repeats)
                .map(|_| time_generate(new))
                .collect::<Result<Vec<_>, _>>()?;
            let (prefill_ms, total_ms) = (median(&mut prefill), median(&mut total));
            let record = Record {
                implementation: "ours",
                backend,
                dtype: args.dtype.name(),
                kv_dtype: args.kv_dtype.to_string(),
                compiler: args.backend.compiler(),
                batch,
                prompt: args.prompt,
                new,
                threads: rayon::current_num_threads(),
                repeats: args.repeats as usize,
                prefill_ms,
                prefill_ms_range: [prefill[0], prefill[prefill.len() - 1]],
                total_ms,
                total_ms_range: [total[0], total[total.len() - 1]],
                decode_tokens_per_s: (batch * (new - 1)) as f64 / ((total_ms - prefill_ms) / 1e3),
                syncs_per_token,
                compiles_in_steady_state,
            };
            println!(
                "{}",
                serde_json::to_string(&record).expect("a record serializes")
            );
        }
        Ok(())
    }
}
