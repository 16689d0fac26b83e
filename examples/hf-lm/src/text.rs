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

/// The checkpoint's tokenizer for `--requests`' `prompt` lines and `text` results: loaded when
/// the `tokenizer` feature is on and the directory has a `tokenizer.json`.
pub struct Texts {
    #[cfg(feature = "tokenizer")]
    tokenizer: Option<tokenizers::Tokenizer>,
}

impl Texts {
    #[cfg(feature = "tokenizer")]
    pub fn load(dir: &std::path::Path) -> Result<Self, CliError> {
        let path = dir.join("tokenizer.json");
        if std::fs::metadata(&path).is_err() {
            return Ok(Self { tokenizer: None });
        }
        let json = tensor_files::read_text(&path, tensor_files::MAX_JSON_BYTES)?;
        let tokenizer = json
            .parse::<tokenizers::Tokenizer>()
            .map_err(|e| CliError::Input(format!("{}: {e}", path.display())))?;
        Ok(Self {
            tokenizer: Some(tokenizer),
        })
    }

    #[cfg(not(feature = "tokenizer"))]
    pub fn load(_dir: &std::path::Path) -> Result<Self, CliError> {
        Ok(Self {})
    }

    /// A `prompt`'s ids, or the message of its error line.
    pub fn encode(&self, prompt: &str) -> Result<Vec<u32>, String> {
        #[cfg(feature = "tokenizer")]
        if let Some(tokenizer) = &self.tokenizer {
            return tokenizer
                .encode(prompt, true)
                .map(|encoding| encoding.get_ids().to_vec())
                .map_err(|e| format!("cannot tokenize the prompt: {e}"));
        }
        let _ = prompt;
        Err(if cfg!(feature = "tokenizer") {
            "`prompt` needs a tokenizer.json beside the model: give `ids` instead".into()
        } else {
            "`prompt` needs hf-lm built with the `tokenizer` feature: give `ids` instead".into()
        })
    }

    /// The text of generated ids, where there is a tokenizer.
    pub fn decode(&self, ids: &[u32]) -> Option<String> {
        #[cfg(feature = "tokenizer")]
        if let Some(tokenizer) = &self.tokenizer {
            return tokenizer.decode(ids, true).ok();
        }
        let _ = ids;
        None
    }
}
