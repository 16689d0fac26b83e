//! The one generation loop of the workspace: a batch of left-padded [`Prompts`] continued through
//! every block's KV cache (or, as the reference, without caches), each row with its own positions
//! (`cumsum(mask) − 1`, as transformers derives them) and its own padding, so that a padded row
//! generates what it generates alone; a row that produced an end-of-sequence id continues with
//! the pad id. Tokens are chosen where the logits are ([`Sampler::pick_rows`]): a step reads back
//! only its `[batch]` ids, and the logits only when asked for.

use attention_core::KvDtype;
use burn::prelude::*;
use burn::tensor::{Bool, TensorData};
use thiserror::Error;

use crate::decoder::{Decoder, DecoderError};
use crate::input::{LmInput, Logits};
use crate::sampling::{Sampler, Sampling, SamplingError};

/// Why generation could not run.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum GenerateError {
    /// The prompts are not a batch of left-padded rows.
    #[error("prompts: {0}")]
    Prompts(#[from] PromptsError),
    /// A prompt token outside the vocabulary.
    #[error(
        "prompt row {row}, column {column}: token id {token} is outside the vocabulary of {vocab_size}"
    )]
    TokenOutOfRange {
        /// The row.
        row: usize,
        /// The column.
        column: usize,
        /// The id.
        token: i64,
        /// The vocabulary size.
        vocab_size: usize,
    },
    /// Prompt and new tokens exceed the model's positions.
    #[error(
        "{prompt} prompt tokens + {new} new tokens exceed the model's {max_positions} positions"
    )]
    TooLong {
        /// Prompt length (pads included: they take cache slots).
        prompt: usize,
        /// Tokens to generate.
        new: usize,
        /// The model's context: its learned positions or its layers' `context_length`.
        max_positions: usize,
    },
    /// Sampling settings out of range.
    #[error("sampling: {0}")]
    Sampling(#[from] SamplingError),
    /// The forward pass failed.
    #[error(transparent)]
    Decoder(#[from] DecoderError),
}

/// Why rows of tokens are not a batch of left-padded prompts.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum PromptsError {
    /// No rows, or a row without tokens.
    #[error("every prompt needs at least one token")]
    EmptyPrompt,
    /// A batch or a length of 0.
    #[error("an empty batch [{batch}, {len}]")]
    EmptyBatch {
        /// Rows.
        batch: usize,
        /// Columns.
        len: usize,
    },
    /// `input_ids` or `attention_mask` does not hold `batch · len` values.
    #[error("input_ids has {ids} values and attention_mask {mask}, {shape:?} needs {needed}")]
    Values {
        /// Values of `input_ids`.
        ids: usize,
        /// Values of `attention_mask`.
        mask: usize,
        /// `[batch, len]`.
        shape: [usize; 2],
        /// `batch · len`.
        needed: usize,
    },
    /// A mask value other than 0 and 1.
    #[error("attention_mask row {row} holds {value}, not 0 or 1")]
    MaskValue {
        /// The row.
        row: usize,
        /// The value.
        value: i64,
    },
    /// Padding after a real token.
    #[error(
        "attention_mask row {row} has padding after a real token: only left padding is supported \
         (generated tokens follow the last column)"
    )]
    RightPadding {
        /// The row.
        row: usize,
    },
    /// A row of padding only.
    #[error("attention_mask row {row} is all padding")]
    AllPadding {
        /// The row.
        row: usize,
    },
    /// An id that no token has.
    #[error(
        "input_ids row {row}, column {column} holds {id}, which is no token id (ids are whole \
         numbers from 0 to the vocabulary size − 1)"
    )]
    TokenId {
        /// The row.
        row: usize,
        /// The column.
        column: usize,
        /// The id.
        id: i64,
    },
}

/// A batch of prompts of one length, shorter rows padded on the left.
#[derive(Debug, Clone, PartialEq)]
pub struct Prompts {
    batch: usize,
    len: usize,
    ids: Vec<u32>,
    real: Vec<bool>,
}

impl Prompts {
    /// Rows of different lengths, padded on the left with `pad_id` to the longest.
    pub fn left_padded(rows: &[Vec<u32>], pad_id: u32) -> Result<Self, PromptsError> {
        let len = rows.iter().map(Vec::len).max().unwrap_or(0);
        if rows.is_empty() || rows.iter().any(Vec::is_empty) {
            return Err(PromptsError::EmptyPrompt);
        }
        let mut ids = Vec::with_capacity(rows.len() * len);
        let mut real = Vec::with_capacity(rows.len() * len);
        for row in rows {
            let pads = len - row.len();
            ids.extend(std::iter::repeat_n(pad_id, pads).chain(row.iter().copied()));
            real.extend((0..len).map(|column| column >= pads));
        }
        Ok(Self {
            batch: rows.len(),
            len,
            ids,
            real,
        })
    }

    /// `input_ids` and `attention_mask` as transformers takes them (`[batch, len]`, row-major;
    /// mask 1 for real tokens, 0 for padding on the left).
    pub fn from_padded(
        ids: &[i64],
        mask: &[i64],
        [batch, len]: [usize; 2],
    ) -> Result<Self, PromptsError> {
        if batch == 0 || len == 0 {
            return Err(PromptsError::EmptyBatch { batch, len });
        }
        let needed = batch.saturating_mul(len);
        if ids.len() != needed || mask.len() != needed {
            return Err(PromptsError::Values {
                ids: ids.len(),
                mask: mask.len(),
                shape: [batch, len],
                needed,
            });
        }
        for (row, values) in mask.chunks(len).enumerate() {
            if let Some(&value) = values.iter().find(|&&m| m != 0 && m != 1) {
                return Err(PromptsError::MaskValue { row, value });
            }
            if values.windows(2).any(|pair| pair == [1, 0]) {
                return Err(PromptsError::RightPadding { row });
            }
            if values.iter().all(|&m| m == 0) {
                return Err(PromptsError::AllPadding { row });
            }
        }
        let mut converted = Vec::with_capacity(ids.len());
        for (i, &id) in ids.iter().enumerate() {
            let (row, column) = (i / len, i % len);
            let id = u32::try_from(id).map_err(|_| PromptsError::TokenId { row, column, id })?;
            converted.push(id);
        }
        Ok(Self {
            batch,
            len,
            ids: converted,
            real: mask.iter().map(|&m| m == 1).collect(),
        })
    }

    /// `[batch, len]`.
    pub fn dims(&self) -> [usize; 2] {
        [self.batch, self.len]
    }

    /// The ids, row-major, pads included.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// Each token's position: its index among its row's real tokens, 0 for pads
    /// (transformers' `cumsum(attention_mask) − 1`, as `generate` feeds it).
    pub fn positions(&self) -> Vec<i64> {
        self.real
            .chunks(self.len)
            .flat_map(|row| {
                let mut seen = 0i64;
                row.iter().map(move |&real| {
                    seen += i64::from(real);
                    (seen - 1).max(0)
                })
            })
            .collect()
    }

    fn has_padding(&self) -> bool {
        self.real.iter().any(|&real| !real)
    }
}

/// What to generate.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateConfig {
    /// Tokens to add to every row.
    pub max_new_tokens: usize,
    /// How each token is chosen.
    pub sampling: Sampling,
    /// Ids that end a row; the row continues with `pad_token_id`.
    pub eos_token_ids: Vec<u32>,
    /// The id after a row's end.
    pub pad_token_id: u32,
    /// Through the KV caches (the default), or the whole sequence again at every step (the
    /// reference the cached path is tested against).
    pub use_cache: bool,
    /// Whether to return the logits of every prompt position in
    /// [`Generation::prompt_logits`]. Off by default: choosing the next token needs only the
    /// last position's, and projecting every position onto the vocabulary is a large part of a
    /// long prompt's cost.
    pub prompt_logits: bool,
    /// Whether to return the logits each new token was chosen from in
    /// [`Generation::step_logits`]. Off by default: they stay on the device, and a step reads
    /// back only its ids.
    pub step_logits: bool,
    /// What the KV caches store keys and values as: the model's float type (the default), or
    /// fewer bytes per position ([`KvDtype`]).
    pub kv_dtype: KvDtype,
}

impl GenerateConfig {
    /// Greedy, `max_new_tokens` tokens, through the caches, no end-of-sequence id.
    pub fn greedy(max_new_tokens: usize) -> Self {
        Self {
            max_new_tokens,
            sampling: Sampling::Greedy,
            eos_token_ids: Vec::new(),
            pad_token_id: 0,
            use_cache: true,
            prompt_logits: false,
            step_logits: false,
            kv_dtype: KvDtype::Model,
        }
    }
}

/// A batch's generation.
#[derive(Debug, Clone)]
pub struct Generation<B: Backend> {
    /// With [`GenerateConfig::prompt_logits`], the prompt's logits, with the positions
    /// generation uses: `[batch, len, vocab]` (meaningless at pad positions).
    pub prompt_logits: Option<Tensor<B, 3>>,
    /// With [`GenerateConfig::step_logits`], the logits each new token was chosen from:
    /// `[batch, new, vocab]`.
    pub step_logits: Option<Tensor<B, 3>>,
    /// Each row: the prompt as given (pads included), then the new tokens.
    pub tokens: Vec<Vec<u32>>,
    /// The read-backs from the device the loop made: one per new token (its ids), none for
    /// the logits.
    pub reads: usize,
}

impl<B: Backend> Decoder<B> {
    /// Generates `config.max_new_tokens` tokens after every prompt, one step per token through
    /// every block's KV cache (with `config.use_cache`).
    pub fn generate_batch(
        &self,
        prompts: &Prompts,
        config: &GenerateConfig,
        device: &B::Device,
    ) -> Result<Generation<B>, GenerateError> {
        let mut sampler = Sampler::new(&config.sampling)?;
        let [batch, len] = prompts.dims();
        let vocab_size = self.vocab_size();
        if let Some(i) = prompts.ids.iter().position(|&id| id as usize >= vocab_size) {
            return Err(GenerateError::TokenOutOfRange {
                row: i / len,
                column: i % len,
                token: i64::from(prompts.ids[i]),
                vocab_size,
            });
        }
        let max_positions = self.context_length();
        if len
            .checked_add(config.max_new_tokens)
            .is_none_or(|total| total > max_positions)
        {
            return Err(GenerateError::TooLong {
                prompt: len,
                new: config.max_new_tokens,
                max_positions,
            });
        }
        let mut sequence = Sequence::new(prompts);
        let mut caches = config
            .use_cache
            .then(|| self.new_caches_of(config.kv_dtype));
        let prompt_input = sequence.input(0, device);
        let (prompt_logits, mut next_logits) = if config.prompt_logits {
            let logits = self.try_forward(&prompt_input, caches.as_deref_mut(), Logits::All)?;
            let last = logits.clone().narrow(1, len - 1, 1);
            (Some(logits), last)
        } else {
            let last = self.try_forward(&prompt_input, caches.as_deref_mut(), Logits::Last)?;
            (None, last)
        };
        let mut finished = vec![false; batch];
        let mut steps = Vec::new();
        let mut reads = 0;
        for step in 0..config.max_new_tokens {
            let logits = next_logits.reshape([batch, vocab_size]);
            if config.step_logits {
                steps.push(logits.clone());
            }
            reads += 1;
            let next: Vec<u32> = sampler
                .pick_rows(logits)
                .into_iter()
                .zip(&mut finished)
                .map(|(token, done)| {
                    if *done {
                        return config.pad_token_id;
                    }
                    let token = token as u32;
                    *done = config.eos_token_ids.contains(&token);
                    token
                })
                .collect();
            sequence.push(&next);
            if step + 1 == config.max_new_tokens {
                break;
            }
            next_logits = match caches.as_deref_mut() {
                Some(caches) => self.try_forward(
                    &sequence.input(sequence.len - 1, device),
                    Some(caches),
                    Logits::Last,
                )?,
                None => self.try_forward(&sequence.input(0, device), None, Logits::Last)?,
            };
        }
        let step_logits = config.step_logits.then(|| match steps.is_empty() {
            true => Tensor::zeros([batch, 0, vocab_size], device),
            false => Tensor::stack(steps, 1),
        });
        Ok(Generation {
            prompt_logits,
            step_logits,
            tokens: sequence.rows(),
            reads,
        })
    }

    /// One prompt followed by `new_tokens` generated tokens, decoding one token per step through
    /// every block's KV cache: [`generate_batch`](Self::generate_batch) of one row.
    pub fn generate(
        &self,
        prompt: &[usize],
        new_tokens: usize,
        sampling: &Sampling,
        device: &B::Device,
    ) -> Result<Vec<usize>, GenerateError> {
        let vocab_size = self.vocab_size();
        if let Some(column) = prompt.iter().position(|&token| token >= vocab_size) {
            return Err(GenerateError::TokenOutOfRange {
                row: 0,
                column,
                token: prompt[column] as i64,
                vocab_size,
            });
        }
        let row: Vec<u32> = prompt.iter().map(|&token| token as u32).collect();
        let prompts = Prompts::left_padded(&[row], 0)?;
        let config = GenerateConfig {
            sampling: sampling.clone(),
            ..GenerateConfig::greedy(new_tokens)
        };
        let generation = self.generate_batch(&prompts, &config, device)?;
        let [tokens] = <[Vec<u32>; 1]>::try_from(generation.tokens).expect("one row");
        Ok(tokens.into_iter().map(|token| token as usize).collect())
    }
}

/// The tokens so far, with their positions and padding, on the host.
struct Sequence {
    batch: usize,
    len: usize,
    ids: Vec<Vec<u32>>,
    positions: Vec<Vec<i64>>,
    real: Vec<Vec<bool>>,
    padded: bool,
}

impl Sequence {
    fn new(prompts: &Prompts) -> Self {
        let [batch, len] = prompts.dims();
        Self {
            batch,
            len,
            ids: rows(&prompts.ids, len),
            positions: rows(&prompts.positions(), len),
            real: rows(&prompts.real, len),
            padded: prompts.has_padding(),
        }
    }

    /// Appends one token to every row, one position after the row's last.
    fn push(&mut self, tokens: &[u32]) {
        for (row, &token) in tokens.iter().enumerate() {
            let position = self.positions[row][self.len - 1] + 1;
            self.ids[row].push(token);
            self.positions[row].push(position);
            self.real[row].push(true);
        }
        self.len += 1;
    }

    /// The tokens from column `start` on, with the padding of every column up to the last.
    fn input<B: Backend>(&self, start: usize, device: &B::Device) -> LmInput<B> {
        let shape = [self.batch, self.len - start];
        // Only the columns from `start` on: a cached step converts one token per row.
        let ids: Vec<i64> = self
            .ids
            .iter()
            .flat_map(|row| row[start..].iter().map(|&id| i64::from(id)))
            .collect();
        let positions: Vec<i64> = self
            .positions
            .iter()
            .flat_map(|row| row[start..].iter().copied())
            .collect();
        let int = |values: Vec<i64>| {
            Tensor::<B, 2, Int>::from_data(TensorData::new(values, shape), device)
        };
        let key_padding = self.padded.then(|| {
            let pads: Vec<bool> = self.real.iter().flatten().map(|&real| !real).collect();
            Tensor::<B, 2, Bool>::from_data(TensorData::new(pads, [self.batch, self.len]), device)
        });
        LmInput {
            tokens: int(ids),
            positions: int(positions),
            key_padding,
            documents: None,
        }
    }

    fn rows(self) -> Vec<Vec<u32>> {
        self.ids
    }
}

/// Row-major values as rows of `len`.
fn rows<T: Clone>(values: &[T], len: usize) -> Vec<Vec<T>> {
    values.chunks(len).map(<[T]>::to_vec).collect()
}
