//! `hf-lm`: a Hugging Face checkpoint directory (GPT-2, Llama, Mistral, Qwen2, Qwen3, Gemma 2,
//! Gemma 3's text model, Phi-3, OLMo 2, SmolLM3) on a Burn backend.
//!
//! - `hf-lm --model DIR --input IDS.safetensors --new-tokens N --output OUT.safetensors`:
//!   `IDS` holds `input_ids` and `attention_mask` (`[batch, t]`, int64, padding on the left);
//!   `OUT` gets the prompt's `logits` (`[batch, t, vocab]`, f32) and `generated`
//!   (`[batch, t + N]`, int64).
//! - `hf-lm --model DIR --prompt TEXT`: with `DIR/tokenizer.json` (and the `tokenizer`
//!   feature), prints the continuation and the speed.
//! - `hf-lm --model DIR --requests FILE.jsonl`: many requests at once (continuous batching),
//!   each result a JSON line on stdout as it finishes; exit code 1 when any request failed.
//!
//! Bad input is one `error:` line and exit code 2, with no output file written.

mod files;
mod requests;
mod text;

use std::path::PathBuf;
use std::process::ExitCode;

use attention_backends::{BackendName, DispatchError, FloatType, OnBackend, dispatch_in};
use burn::prelude::*;
use clap::Parser;
use hf_models::{CausalLm, GenerateConfig, GenerateError, KvDtype, LoadError, Sampling};
use thiserror::Error;

/// What the user is told, as one `error:` line.
#[derive(Debug, Error)]
enum CliError {
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error(transparent)]
    Generate(#[from] GenerateError),
    #[error(transparent)]
    Dispatch(#[from] DispatchError),
    #[error(transparent)]
    Output(#[from] tensor_files::OutputError),
    #[error(transparent)]
    File(#[from] tensor_files::FileError),
    #[error("{0}")]
    Input(String),
}

#[derive(Debug, Parser)]
#[command(about)]
struct Cli {
    /// A directory as `save_pretrained` writes it: config.json and model.safetensors (or shards).
    #[arg(long)]
    model: PathBuf,
    /// A safetensors file with `input_ids` and `attention_mask` ([batch, t], int64).
    #[arg(long, requires = "output", conflicts_with_all = ["prompt", "requests"])]
    input: Option<PathBuf>,
    /// A JSON-lines file of requests, run together (see the crate's docs for the fields).
    #[arg(long, conflicts_with = "prompt")]
    requests: Option<PathBuf>,
    /// Where `logits` and `generated` are written (never over an input).
    #[arg(long, requires = "input")]
    output: Option<PathBuf>,
    /// Text to continue (needs DIR/tokenizer.json and the `tokenizer` feature).
    #[arg(long, required_unless_present_any = ["input", "requests"])]
    prompt: Option<String>,
    /// Tokens to generate after every prompt (a request's own `max_new_tokens` wins).
    #[arg(long, default_value_t = 16)]
    new_tokens: usize,
    #[arg(long, value_enum, default_value_t = BackendName::Flex)]
    backend: BackendName,
    /// The float type the backend computes in; the checkpoint's weights (f32, bf16, f16) are
    /// converted to it.
    #[arg(long, value_enum, default_value_t = FloatType::F32)]
    dtype: FloatType,
    /// Sample at this temperature instead of choosing the most likely token.
    #[arg(long, allow_negative_numbers = true)]
    temperature: Option<f64>,
    /// With sampling: draw from the k most likely tokens.
    #[arg(long, requires = "temperature")]
    top_k: Option<usize>,
    /// With sampling: draw from the most likely tokens whose probabilities reach p.
    #[arg(long, requires = "temperature", allow_negative_numbers = true)]
    top_p: Option<f64>,
    /// With sampling: the seed of the draws.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// With --requests: the KV cache's pool, in MiB over every layer.
    #[arg(long, default_value_t = 512)]
    kv_mib: usize,
    /// With --requests: positions per page of the pool.
    #[arg(long, default_value_t = 128)]
    page_size: usize,
    /// With --requests: the most requests a step runs.
    #[arg(long, default_value_t = 64)]
    max_running: usize,
    /// With --requests: the most tokens a step feeds (decoding rows, then prompt chunks).
    #[arg(long, default_value_t = 512)]
    step_tokens: usize,
    /// With --requests: a step beside `d` decoding rows feeds at most `max(d, this)` prompt
    /// tokens (default: the engine's), which bounds the time between a running request's tokens
    /// while prompts are admitted.
    #[arg(long)]
    prefill_while_decoding: Option<usize>,
    /// What the KV cache stores keys and values as: `f32` (the model's float type), `f16`,
    /// `bf16` or `int8` (fewer bytes per position, read in place: every type by the CPU
    /// kernel, `--backend flex` or `ndarray`; f16 and int8 by the GPU kernel, `--backend wgpu`).
    #[arg(long, default_value_t = KvDtype::Model)]
    kv_dtype: KvDtype,
}

impl Cli {
    fn sampling(&self) -> Sampling {
        match self.temperature {
            None => Sampling::Greedy,
            Some(temperature) => Sampling::Sample {
                temperature,
                top_k: self.top_k,
                top_p: self.top_p,
                seed: self.seed,
            },
        }
    }

    fn generate_config<B: Backend>(&self, model: &CausalLm<B>) -> GenerateConfig {
        GenerateConfig {
            sampling: self.sampling(),
            kv_dtype: self.kv_dtype,
            ..model.greedy(self.new_tokens)
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match dispatch_in(cli.backend, cli.dtype, Run(&cli))
        .map_err(CliError::from)
        .and_then(|done| done)
    {
        Ok(code) => code,
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::from(2)
        }
    }
}

/// The command on the backend `--backend` names.
struct Run<'a>(&'a Cli);

impl OnBackend for Run<'_> {
    type Output = Result<ExitCode, CliError>;

    fn run<B: Backend>(self, _: &'static str, device: B::Device) -> Self::Output {
        let cli = self.0;
        if let Some(requests) = &cli.requests {
            let all_ok = requests::run::<B>(cli, requests, &device)?;
            return Ok(if all_ok {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            });
        }
        match (&cli.input, &cli.output, &cli.prompt) {
            (Some(input), Some(output), _) => files::run::<B>(cli, input, output, &device),
            (_, _, Some(prompt)) => text::run::<B>(cli, prompt, &device),
            _ => unreachable!("clap requires --input and --output, --prompt, or --requests"),
        }
        .map(|()| ExitCode::SUCCESS)
    }
}
