//! Text in and out through the checkpoint's `tokenizer.json`.

use std::time::Instant;

use burn::prelude::*;
use hf_models::{CausalLm, GenerateError, Prompts};

use crate::{Cli, CliError};

#[cfg(feature = "tokenizer")]
pub fn run<B: Backend>(cli: &Cli, prompt: &str, device: &B::Device) -> Result<(), CliError> {
    let path = cli.model.join("tokenizer.json");
    if std::fs::metadata(&path).is_err() {
        return Err(CliError::Input(format!(
            "{} has no tokenizer.json: give token ids with --input instead",
            cli.model.display()
        )));
    }
    // A regular file within the JSON bound: a FIFO there is refused, not waited on.
    let json = tensor_files::read_text(&path, tensor_files::MAX_JSON_BYTES)?;
    let tokenizer = json
        .parse::<tokenizers::Tokenizer>()
        .map_err(|e| CliError::Input(format!("{}: {e}", path.display())))?;
    let encoding = tokenizer
        .encode(prompt, true)
        .map_err(|e| CliError::Input(format!("cannot tokenize the prompt: {e}")))?;
    let ids = encoding.get_ids().to_vec();
    if ids.is_empty() {
        return Err(CliError::Input(format!(
            "the prompt {prompt:?} has no tokens: give some text"
        )));
    }
    let model = CausalLm::<B>::load(&cli.model, device)?;
    let (new, seconds) = generate(&model, ids.clone(), cli, device)?;
    // The prompt and the continuation decoded together: decoding the new tokens alone would
    // drop the space a SentencePiece tokenizer keeps at the start of a word.
    let all: Vec<u32> = ids.iter().chain(&new).copied().collect();
    let text = tokenizer
        .decode(&all, true)
        .map_err(|e| CliError::Input(format!("cannot decode the tokens: {e}")))?;
    println!("{text}");
    eprintln!(
        "{} tokens in {seconds:.2} s: {:.1} tokens/s",
        new.len(),
        new.len() as f64 / seconds
    );
    Ok(())
}

#[cfg(not(feature = "tokenizer"))]
pub fn run<B: Backend>(cli: &Cli, _prompt: &str, _device: &B::Device) -> Result<(), CliError> {
    Err(CliError::Input(format!(
        "--prompt needs the `tokenizer` feature (cargo run --release -p hf-lm --features \
         tokenizer -- --model {} --prompt …); without it give token ids with --input",
        cli.model.display()
    )))
}

/// The new tokens after `ids`, and the seconds they took (prefill included).
#[cfg_attr(not(feature = "tokenizer"), allow(dead_code))]
fn generate<B: Backend>(
    model: &CausalLm<B>,
    ids: Vec<u32>,
    cli: &Cli,
    device: &B::Device,
) -> Result<(Vec<u32>, f64), CliError> {
    let len = ids.len();
    let prompts =
        Prompts::left_padded(&[ids], model.special_tokens().pad()).map_err(GenerateError::from)?;
    let start = Instant::now();
    let generation = model.generate(&prompts, &cli.generate_config(model), device)?;
    let seconds = start.elapsed().as_secs_f64();
    let mut tokens = generation.tokens.into_iter().next().unwrap_or_default();
    let new = tokens.split_off(len);
    // Stop at the end of the sequence; what follows it is padding.
    let end = new
        .iter()
        .position(|id| model.special_tokens().eos.contains(id))
        .unwrap_or(new.len());
    Ok((new[..end].to_vec(), seconds))
}
