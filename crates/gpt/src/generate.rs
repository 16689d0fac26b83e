//! Text generation: greedy or top-k sampling, with or without the KV caches.

use attention_core::AttentionError;
use burn::prelude::*;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

use crate::model::GptModel;

/// How the next token is chosen from the logits.
#[derive(Debug, Clone, PartialEq)]
pub enum Sampling {
    /// The most likely token.
    Greedy,
    /// A draw from the `k` most likely tokens, with `softmax(logits / temperature)`.
    TopK {
        /// How many of the most likely tokens to draw from (at least 1).
        k: usize,
        /// Above 0; below 1 sharpens, above 1 flattens.
        temperature: f64,
        /// Seed of the draws: the same seed gives the same text.
        seed: u64,
    },
}

/// Why generation could not run.
#[derive(Debug, Clone, PartialEq)]
pub enum GenerateError {
    /// No prompt token to start from.
    EmptyPrompt,
    /// A prompt token outside the vocabulary.
    TokenOutOfRange {
        /// The token.
        token: usize,
        /// The vocabulary size.
        vocab_size: usize,
    },
    /// `k` is 0 or the temperature is not positive.
    BadSampling(String),
    /// The prompt and the new tokens do not fit the context.
    Attention(AttentionError),
}

impl std::fmt::Display for GenerateError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::EmptyPrompt => write!(f, "the prompt is empty"),
            Self::TokenOutOfRange { token, vocab_size } => {
                write!(
                    f,
                    "prompt token {token} is outside the vocabulary of {vocab_size}"
                )
            }
            Self::BadSampling(why) => write!(f, "bad sampling settings: {why}"),
            Self::Attention(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for GenerateError {}

/// Picks next tokens from logits, holding the random state of a sampled generation.
struct Picker {
    sampling: Sampling,
    rng: StdRng,
}

impl Picker {
    fn new(sampling: &Sampling) -> Result<Self, GenerateError> {
        let seed = match *sampling {
            Sampling::Greedy => 0,
            Sampling::TopK {
                k,
                temperature,
                seed,
            } => {
                if k == 0 || !temperature.is_finite() || temperature <= 0.0 {
                    return Err(GenerateError::BadSampling(format!(
                        "k = {k} (≥ 1), temperature = {temperature} (> 0)"
                    )));
                }
                seed
            }
        };
        Ok(Self {
            sampling: sampling.clone(),
            rng: StdRng::seed_from_u64(seed),
        })
    }

    fn pick(&mut self, logits: &[f32]) -> usize {
        let by_logit = |a: &(usize, f32), b: &(usize, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        let mut ranked: Vec<(usize, f32)> = logits.iter().copied().enumerate().collect();
        match self.sampling {
            Sampling::Greedy => ranked
                .iter()
                .copied()
                .min_by(by_logit)
                .map_or(0, |(i, _)| i),
            Sampling::TopK { k, temperature, .. } => {
                ranked.sort_by(by_logit);
                ranked.truncate(k);
                let top = ranked[0].1 as f64;
                let weights: Vec<f64> = ranked
                    .iter()
                    .map(|&(_, l)| ((l as f64 - top) / temperature).exp())
                    .collect();
                let mut draw = self.rng.random::<f64>() * weights.iter().sum::<f64>();
                for (&(token, _), weight) in ranked.iter().zip(&weights) {
                    draw -= weight;
                    if draw <= 0.0 {
                        return token;
                    }
                }
                ranked[ranked.len() - 1].0
            }
        }
    }
}

impl<B: Backend> GptModel<B> {
    fn check_prompt(&self, prompt: &[usize], new_tokens: usize) -> Result<(), GenerateError> {
        if prompt.is_empty() {
            return Err(GenerateError::EmptyPrompt);
        }
        let vocab_size = self.vocab_size();
        if let Some(&token) = prompt.iter().find(|&&t| t >= vocab_size) {
            return Err(GenerateError::TokenOutOfRange { token, vocab_size });
        }
        let total = prompt.len() + new_tokens;
        if total > self.context_length() {
            return Err(GenerateError::Attention(AttentionError::ContextOverflow {
                seq: total,
                context_length: self.context_length(),
            }));
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
        self.check_prompt(prompt, new_tokens)?;
        let mut picker = Picker::new(sampling)?;
        let mut caches = self.new_caches();
        let mut tokens = prompt.to_vec();
        let mut step = prompt.to_vec();
        for _ in 0..new_tokens {
            let logits = self
                .forward_cached(token_tensor(&step, device), &mut caches)
                .map_err(GenerateError::Attention)?;
            let next = picker.pick(&last_logits(logits));
            tokens.push(next);
            step = vec![next];
        }
        Ok(tokens)
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
        self.check_prompt(prompt, new_tokens)?;
        let mut picker = Picker::new(sampling)?;
        let mut tokens = prompt.to_vec();
        for _ in 0..new_tokens {
            let logits = self.forward(token_tensor(&tokens, device));
            tokens.push(picker.pick(&last_logits(logits)));
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

/// The logits of the last position of the first sequence.
fn last_logits<B: Backend>(logits: Tensor<B, 3>) -> Vec<f32> {
    let [_, seq, vocab] = logits.dims();
    logits
        .slice([0..1, seq - 1..seq])
        .reshape([vocab])
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .expect("f32")
}
