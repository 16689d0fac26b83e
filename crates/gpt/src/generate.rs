//! One prompt's continuation, one token per step through every block's KV cache (or, as the
//! reference, without caches), each token chosen by a [`Sampler`].

use attention_core::AttentionError;
use burn::prelude::*;
use thiserror::Error;

use crate::decoder::{Decoder, DecoderError};
use crate::input::Logits;
use crate::sampling::{Sampler, Sampling, SamplingError};

/// Why generation could not run.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum GenerateError {
    /// No prompt token to start from.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// A prompt token outside the vocabulary.
    #[error("prompt token {token} is outside the vocabulary of {vocab_size}")]
    TokenOutOfRange {
        /// The token.
        token: usize,
        /// The vocabulary size.
        vocab_size: usize,
    },
    /// A sampling setting out of range.
    #[error("bad sampling settings: {0}")]
    Sampling(#[from] SamplingError),
    /// The prompt and the new tokens do not fit the context, or the forward pass failed.
    #[error(transparent)]
    Decoder(#[from] DecoderError),
}

impl<B: Backend> Decoder<B> {
    fn check_prompt(&self, prompt: &[usize], new_tokens: usize) -> Result<(), GenerateError> {
        if prompt.is_empty() {
            return Err(GenerateError::EmptyPrompt);
        }
        let vocab_size = self.vocab_size();
        if let Some(&token) = prompt.iter().find(|&&t| t >= vocab_size) {
            return Err(GenerateError::TokenOutOfRange { token, vocab_size });
        }
        let total = prompt.len().saturating_add(new_tokens);
        let context_length = self.context_length();
        if total > context_length {
            let overflow = AttentionError::ContextOverflow {
                seq: total,
                context_length,
            };
            return Err(DecoderError::Attention(overflow).into());
        }
        Ok(())
    }

    /// The prompt followed by `new_tokens` generated tokens, decoding one token per step through
    /// every block's KV cache. `prompt.len() + new_tokens` must fit `context_length`.
    pub fn generate(
        &self,
        prompt: &[usize],
        new_tokens: usize,
        sampling: &Sampling,
        device: &B::Device,
    ) -> Result<Vec<usize>, GenerateError> {
        self.continue_prompt(prompt, new_tokens, sampling, device, true)
    }

    /// [`generate`](Self::generate) without caches: every step runs the whole sequence again.
    /// The reference the cached path is tested against.
    pub fn generate_uncached(
        &self,
        prompt: &[usize],
        new_tokens: usize,
        sampling: &Sampling,
        device: &B::Device,
    ) -> Result<Vec<usize>, GenerateError> {
        self.continue_prompt(prompt, new_tokens, sampling, device, false)
    }

    /// [`generate`](Self::generate) through the blocks' caches when `cached` (each step runs
    /// only the tokens the caches have not seen), else over the whole sequence at every step.
    fn continue_prompt(
        &self,
        prompt: &[usize],
        new_tokens: usize,
        sampling: &Sampling,
        device: &B::Device,
        cached: bool,
    ) -> Result<Vec<usize>, GenerateError> {
        self.check_prompt(prompt, new_tokens)?;
        let mut sampler = Sampler::new(sampling)?;
        let mut caches = cached.then(|| self.new_caches());
        let mut tokens = prompt.to_vec();
        // Tokens the caches hold.
        let mut seen = 0;
        for _ in 0..new_tokens {
            let logits = match caches.as_mut() {
                Some(caches) => {
                    let step = token_tensor(&tokens[seen..], device);
                    seen = tokens.len();
                    self.forward_tokens(step, Some(&mut caches[..]), Logits::Last)?
                }
                None => self.forward_tokens(token_tensor(&tokens, device), None, Logits::Last)?,
            };
            tokens.push(sampler.pick(&last_logits(logits)));
        }
        Ok(tokens)
    }
}

/// `[1, len]` token ids.
fn token_tensor<B: Backend>(tokens: &[usize], device: &B::Device) -> Tensor<B, 2, Int> {
    let ids: Vec<i64> = tokens.iter().map(|&t| t as i64).collect();
    Tensor::<B, 1, Int>::from_data(TensorData::new(ids, [tokens.len()]), device)
        .reshape([1, tokens.len()])
}

/// The logits of the one sequence's last position.
///
/// # Shapes
/// - `logits`: `[1, 1, vocab]`
/// - output: `[vocab]`
fn last_logits<B: Backend>(logits: Tensor<B, 3>) -> Vec<f32> {
    let vocab = logits.dims()[2];
    logits
        .reshape([vocab])
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .expect("f32")
}
