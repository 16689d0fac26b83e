//! Causal language models from Hugging Face checkpoints: GPT-2 and the Llama family (Llama,
//! Mistral, Qwen2) loaded into [`gpt`]'s one [`Decoder`], generic over the Burn backend, giving
//! transformers' logits and tokens.
//!
//! ```no_run
//! use burn::backend::NdArray;
//! use hf_models::{CausalLm, GenerateConfig, Prompts};
//!
//! let device = Default::default();
//! // A directory as `save_pretrained` writes it: config.json, model.safetensors.
//! let model = CausalLm::<NdArray>::load("models/tiny-llama", &device)?;
//! let prompts = Prompts::left_padded(&[vec![5, 17, 9], vec![12]], model.special_tokens().pad())?;
//! let generation = model.generate(&prompts, &GenerateConfig::greedy(&model, 16), &device)?;
//! println!("{:?}", generation.tokens);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! The network itself — blocks, norms, MLPs, caches, the sampler — is the `gpt` crate's; this
//! crate keeps what is Hugging Face's:
//!
//! - `config.rs`: `config.json` read into a [`ModelConfig`]; anything that changes the
//!   computation and is not implemented is an error naming the field. [`rope_scaling`] reads
//!   transformers' RoPE scaling JSON.
//! - `checkpoint.rs`: the directory's files (`model.safetensors`, or shards), tensors taken by
//!   name, extra ones refused.
//! - `gpt2.rs`, `llama.rs`: which parts of the [`Decoder`] each architecture takes, and its
//!   tensors' names.
//! - `model.rs`: [`CausalLm`], a loaded checkpoint and the checks of a forward pass's input.
//! - `generate.rs`: batched generation from left-padded [`Prompts`].
#![warn(missing_docs)]

mod checkpoint;
mod config;
mod generate;
mod gpt2;
mod llama;
mod model;

pub use checkpoint::{LoadError, read_config, read_special_tokens, read_weights};
pub use config::{
    ConfigError, Gpt2Config, LlamaConfig, LlamaFamily, ModelConfig, SpecialTokens, Windows,
    rope_scaling,
};
pub use generate::{GenerateConfig, GenerateError, Generation, Prompts, PromptsError};
pub use gpt::{
    Activation, Decoder, DecoderBlock, GatedMlp, LmInput, Mlp, Norm, PlainMlp, Sampling,
    SamplingError,
};
pub use model::{CausalLm, ModelError};
