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

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use attention_backends::{BackendName, OnBackend};
use attention_bench::process::{median, run_on};
use burn::prelude::*;
use clap::Parser;
use hf_models::{CausalLm, GenerateConfig, Prompts};

/// Times prefill and decode of a Hugging Face checkpoint; prints one JSON object per batch.
#[derive(Debug, Parser)]
struct Args {
    /// A directory as `save_pretrained` writes it.
    #[arg(long)]
    model: PathBuf,
    #[arg(long, value_enum, default_value_t = BackendName::Flex)]
    backend: BackendName,
    /// Prompts per batch; repeat for several.
    #[arg(long = "batch", required = true)]
    batches: Vec<usize>,
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
}

#[derive(serde::Serialize)]
struct Record<'a> {
    #[serde(rename = "impl")]
    implementation: &'static str,
    backend: &'a str,
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
}

fn main() -> ExitCode {
    let args = Args::parse();
    run_on(args.threads, args.backend, Bench(&args))
}

/// The benchmark on the backend `--backend` names.
struct Bench<'a>(&'a Args);

impl OnBackend for Bench<'_> {
    type Output = Result<(), String>;

    fn run<B: Backend>(self, backend: &'static str, device: B::Device) -> Self::Output {
        let args = self.0;
        let model = CausalLm::<B>::load(&args.model, &device).map_err(|e| e.to_string())?;
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
            let time_generate = |new_tokens: usize| -> Result<f64, String> {
                let config = GenerateConfig {
                    eos_token_ids: Vec::new(),
                    ..GenerateConfig::greedy(&model, new_tokens)
                };
                let start = Instant::now();
                model
                    .generate(&prompts, &config, &device)
                    .map_err(|e| e.to_string())?;
                Ok(start.elapsed().as_secs_f64() * 1e3)
            };
            time_generate(2)?; // warm-up
            let new = args.new as usize;
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
            };
            println!(
                "{}",
                serde_json::to_string(&record).expect("a record serializes")
            );
        }
        Ok(())
    }
}
