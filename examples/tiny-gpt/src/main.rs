//! tiny-gpt: trains a byte-level GPT made of the attention layer on a generated corpus, then
//! samples from the checkpoint.
//!
//! ```text
//! cargo run --release -p tiny-gpt -- train                       # flex, default settings
//! cargo run --release -p tiny-gpt -- generate --checkpoint tiny-gpt-checkpoint --prompt "the cat "
//! ```

mod corpus;
mod plot;
mod train;

use std::path::PathBuf;
use std::process::ExitCode;

use attention_backends::{Autodiff, Flex, NdArray, Wgpu, wgpu_device};
use burn::prelude::*;
use clap::{Parser, Subcommand, ValueEnum};
use gpt::{GptConfig, Sampling};

use train::{TrainSettings, VOCAB};

#[derive(Debug, Parser)]
#[command(about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum BackendArg {
    Ndarray,
    Flex,
    Wgpu,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Trains on the generated corpus and writes a checkpoint and the loss curve.
    Train {
        #[arg(long, value_enum, default_value_t = BackendArg::Flex)]
        backend: BackendArg,
        #[arg(long, default_value_t = 600)]
        steps: usize,
        #[arg(long, default_value_t = 16)]
        batch: usize,
        #[arg(long, default_value_t = 3e-3)]
        learning_rate: f64,
        #[arg(long, default_value_t = 64)]
        context: usize,
        #[arg(long, default_value_t = 64)]
        d_model: usize,
        #[arg(long, default_value_t = 4)]
        heads: usize,
        #[arg(long, default_value_t = 2)]
        layers: usize,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Checkpoint directory.
        #[arg(long, default_value = "tiny-gpt-checkpoint")]
        out: PathBuf,
    },
    /// Continues a prompt with a trained checkpoint.
    Generate {
        #[arg(long)]
        checkpoint: PathBuf,
        #[arg(long)]
        prompt: String,
        #[arg(long, default_value_t = 40)]
        tokens: usize,
        /// 0 for greedy decoding.
        #[arg(long, default_value_t = 0.8)]
        temperature: f64,
        #[arg(long, default_value_t = 20)]
        top_k: usize,
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
}

fn main() -> ExitCode {
    let outcome = match Cli::parse().command {
        Command::Train {
            backend,
            steps,
            batch,
            learning_rate,
            context,
            d_model,
            heads,
            layers,
            seed,
            out,
        } => {
            let settings = TrainSettings {
                steps,
                batch,
                learning_rate,
                seed,
                out,
                config: GptConfig::new(VOCAB, context, d_model, heads, layers),
            };
            let trained = match backend {
                BackendArg::Ndarray => {
                    train::train::<Autodiff<NdArray>>(&settings, "ndarray", &Default::default())
                }
                BackendArg::Flex => {
                    train::train::<Autodiff<Flex>>(&settings, "flex", &Default::default())
                }
                BackendArg::Wgpu => wgpu_device()
                    .map_err(|e| e.to_string())
                    .and_then(|device| train::train::<Autodiff<Wgpu>>(&settings, "wgpu", &device)),
            };
            trained.map(|(valid, unigram)| {
                println!(
                    "final: val_loss={valid:.4} unigram_loss={unigram:.4} ratio={:.4}",
                    valid / unigram
                );
            })
        }
        Command::Generate {
            checkpoint,
            prompt,
            tokens,
            temperature,
            top_k,
            seed,
        } => generate::<Flex>(&checkpoint, &prompt, tokens, temperature, top_k, seed),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::from(2)
        }
    }
}

fn generate<B: Backend>(
    checkpoint: &std::path::Path,
    prompt: &str,
    tokens: usize,
    temperature: f64,
    top_k: usize,
    seed: u64,
) -> Result<(), String> {
    let device = Default::default();
    let model = train::load::<B>(checkpoint, &device)?;
    let sampling = if temperature == 0.0 {
        Sampling::Greedy
    } else {
        Sampling::TopK {
            k: top_k,
            temperature,
            seed,
        }
    };
    let prompt_ids: Vec<usize> = prompt.bytes().map(usize::from).collect();
    let room = model.context_length().saturating_sub(prompt_ids.len());
    let ids = model
        .generate(&prompt_ids, tokens.min(room), &sampling, &device)
        .map_err(|e| e.to_string())?;
    let bytes: Vec<u8> = ids.iter().map(|&t| t as u8).collect();
    println!("{}", String::from_utf8_lossy(&bytes));
    Ok(())
}
