//! [`CausalLm`]: a checkpoint directory loaded into a [`Decoder`], with the checks a forward pass
//! makes of its input.

use std::path::Path;

use attention_core::{AttentionError, KvCache};
use burn::prelude::*;
use gpt::{Decoder, DecoderError, LmInput, Logits};
use thiserror::Error;

use crate::checkpoint::{Checkpoint, LoadError, read_config, read_special_tokens, read_weights};
use crate::config::{ModelConfig, SpecialTokens};
use crate::{gpt2, llama};

/// Why a forward pass could not run.
#[derive(Debug, Error)]
pub enum ModelError {
    /// The attention layers refused the input (context overflow, mismatched cache, shapes).
    #[error(transparent)]
    Attention(#[from] AttentionError),
    /// A token id outside the vocabulary.
    #[error("token id {token} is outside the vocabulary of {vocab_size}")]
    TokenOutOfRange {
        /// The id.
        token: i64,
        /// The vocabulary size.
        vocab_size: usize,
    },
    /// A position outside the model's range.
    #[error("position {position} is outside the model's {max_positions} positions")]
    PositionOutOfRange {
        /// The position.
        position: i64,
        /// `max_position_embeddings` / `n_positions`.
        max_positions: usize,
    },
    /// The positions' shape is not the tokens'.
    #[error("tokens are {tokens:?} but positions are {positions:?}")]
    PositionsShape {
        /// The tokens' `[batch, seq]`.
        tokens: [usize; 2],
        /// The positions' shape.
        positions: [usize; 2],
    },
    /// The caches are not one per layer.
    #[error("{found} caches for {layers} layers")]
    Caches {
        /// The caches given.
        found: usize,
        /// The model's layers.
        layers: usize,
    },
    /// A ragged step's page tables or steps are not one per attention kind of the model.
    #[error("{found} page tables or steps for a model of {kinds} attention kinds")]
    AttentionKinds {
        /// The tables or steps given.
        found: usize,
        /// The model's attention kinds.
        kinds: usize,
    },
}

impl From<DecoderError> for ModelError {
    fn from(error: DecoderError) -> Self {
        match error {
            DecoderError::Attention(error) => Self::Attention(error),
            DecoderError::Caches { found, layers } => Self::Caches { found, layers },
            DecoderError::AttentionKinds { found, kinds } => Self::AttentionKinds { found, kinds },
        }
    }
}

/// A causal language model loaded from a Hugging Face checkpoint directory.
#[derive(Debug)]
pub struct CausalLm<B: Backend> {
    config: ModelConfig,
    special_tokens: SpecialTokens,
    decoder: Decoder<B>,
}

impl<B: Backend> CausalLm<B> {
    /// Loads a directory as `save_pretrained` writes it: `config.json` (the architecture from
    /// `model_type`) and `model.safetensors` or its sharded form. A missing, mis-shaped or extra
    /// tensor, and a config value not implemented here, are errors naming it.
    pub fn load(dir: impl AsRef<Path>, device: &B::Device) -> Result<Self, LoadError> {
        let dir = dir.as_ref();
        let config = read_config(dir)?;
        let special_tokens = read_special_tokens(dir)?;
        let weights = read_weights(dir)?;
        Ok(Self::from_weights(config, weights, device)?.with_special_tokens(special_tokens))
    }

    /// Sets the end-of-sequence and pad ids (read from the directory by [`load`](Self::load)).
    pub fn with_special_tokens(mut self, special_tokens: SpecialTokens) -> Self {
        self.special_tokens = special_tokens;
        self
    }

    /// The end-of-sequence and pad ids.
    pub fn special_tokens(&self) -> &SpecialTokens {
        &self.special_tokens
    }

    /// The model of `config` with the tensors of a state dict, named as transformers names them.
    pub fn from_weights(
        config: ModelConfig,
        weights: attention_core::weights::StateDict,
        device: &B::Device,
    ) -> Result<Self, LoadError> {
        let mut checkpoint = Checkpoint::new(weights, config.architecture());
        let decoder = match &config {
            ModelConfig::Gpt2(gpt2) => gpt2::load(gpt2, &mut checkpoint, device)?,
            ModelConfig::Llama(llama) => llama::load(llama, &mut checkpoint, device)?,
        };
        checkpoint.finish()?;
        Ok(Self {
            config,
            special_tokens: SpecialTokens::default(),
            decoder,
        })
    }

    /// What `config.json` said.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The network, to reach its layers.
    pub fn decoder(&self) -> &Decoder<B> {
        &self.decoder
    }

    /// One empty KV cache per block, for [`forward_cached`](Self::forward_cached).
    pub fn new_caches(&self) -> Vec<KvCache<B>> {
        self.decoder.new_caches()
    }

    /// The logits of every token of a whole sequence.
    ///
    /// # Shapes
    /// - `input`: see [`LmInput`] (no cached positions)
    /// - output: `[batch, seq, vocab]`
    pub fn forward(&self, input: &LmInput<B>) -> Result<Tensor<B, 3>, ModelError> {
        self.check(input)?;
        self.run(input, None, Logits::All)
    }

    /// The logits of tokens that follow those in `caches` (one per layer, from
    /// [`new_caches`](Self::new_caches)), appending their keys and values.
    ///
    /// # Shapes
    /// - `input`: see [`LmInput`]
    /// - output: `[batch, seq, vocab]`
    pub fn forward_cached(
        &self,
        input: &LmInput<B>,
        caches: &mut [KvCache<B>],
    ) -> Result<Tensor<B, 3>, ModelError> {
        self.check(input)?;
        self.run(input, Some(caches), Logits::All)
    }

    /// The forward pass of input already checked (generation checks its tokens on the host,
    /// without the device round trips of [`check`](Self::check)).
    pub(crate) fn run(
        &self,
        input: &LmInput<B>,
        caches: Option<&mut [KvCache<B>]>,
        logits: Logits,
    ) -> Result<Tensor<B, 3>, ModelError> {
        self.decoder
            .try_forward(input, caches, logits)
            .map_err(ModelError::from)
    }

    /// Token ids within the vocabulary, positions within the model's range, matching shapes:
    /// an embedding lookup out of range would read another row or fail on the device.
    fn check(&self, input: &LmInput<B>) -> Result<(), ModelError> {
        let dims = input.tokens.dims();
        if input.positions.dims() != dims {
            return Err(ModelError::PositionsShape {
                tokens: dims,
                positions: input.positions.dims(),
            });
        }
        let range = |tensor: &Tensor<B, 2, Int>| {
            let [min, max] =
                [tensor.clone().min(), tensor.clone().max()].map(|t| t.into_scalar().elem::<i64>());
            (min, max)
        };
        let vocab_size = self.config.vocab_size();
        let (min, max) = range(&input.tokens);
        if let Some(token) = [min, max]
            .into_iter()
            .find(|&t| t < 0 || t >= vocab_size as i64)
        {
            return Err(ModelError::TokenOutOfRange { token, vocab_size });
        }
        let max_positions = self.config.max_positions();
        let (min, max) = range(&input.positions);
        if let Some(position) = [min, max]
            .into_iter()
            .find(|&p| p < 0 || p >= max_positions as i64)
        {
            return Err(ModelError::PositionOutOfRange {
                position,
                max_positions,
            });
        }
        Ok(())
    }
}
