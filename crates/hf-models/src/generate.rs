//! Generation from a loaded checkpoint: the `gpt` crate's one loop
//! ([`Decoder::generate_batch`](gpt::Decoder::generate_batch)) with the checkpoint's special
//! tokens.

use burn::prelude::*;
use gpt::{GenerateConfig, GenerateError, Generation, Prompts, Sampling};

use crate::model::CausalLm;

impl<B: Backend> CausalLm<B> {
    /// Greedy, `max_new_tokens` tokens, through the caches, with the model's end-of-sequence
    /// and pad ids.
    pub fn greedy(&self, max_new_tokens: usize) -> GenerateConfig {
        let tokens = self.special_tokens();
        GenerateConfig {
            sampling: Sampling::Greedy,
            eos_token_ids: tokens.eos.clone(),
            pad_token_id: tokens.pad(),
            ..GenerateConfig::greedy(max_new_tokens)
        }
    }

    /// Generates `config.max_new_tokens` tokens after every prompt.
    pub fn generate(
        &self,
        prompts: &Prompts,
        config: &GenerateConfig,
        device: &B::Device,
    ) -> Result<Generation<B>, GenerateError> {
        self.decoder().generate_batch(prompts, config, device)
    }
}
