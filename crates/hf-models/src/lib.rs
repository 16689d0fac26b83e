//! Causal language models from Hugging Face checkpoints: GPT-2 and the Llama family (Llama,
//! Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3's text model, Phi-3, OLMo 2, SmolLM3) loaded into
//! [`gpt`]'s one [`Decoder`], generic over the Burn backend, giving transformers' logits and
//! tokens. Weights stored in float32, bfloat16, float16 or float64 are converted to the backend's
//! float type.
//!
//! ```no_run
//! use burn::backend::NdArray;
//! use hf_models::{CausalLm, Prompts};
//!
//! let device = Default::default();
//! // A directory as `save_pretrained` writes it: config.json, model.safetensors.
//! let model = CausalLm::<NdArray>::load("models/tiny-llama", &device)?;
//! let prompts = Prompts::left_padded(&[vec![5, 17, 9], vec![12]], model.special_tokens().pad())?;
//! let generation = model.generate(&prompts, &model.greedy(16), &device)?;
//! println!("{:?}", generation.tokens);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! The network itself — blocks, norms, MLPs, caches, the sampler — is the `gpt` crate's; this
//! crate keeps what is Hugging Face's:
//!
//! - `config/`: `config.json` read into a [`ModelConfig`]; anything that changes the
//!   computation and is not implemented is an error naming the field. [`rope_scaling`] reads
//!   transformers' RoPE scaling JSON.
//! - `checkpoint.rs`: the directory's files (`model.safetensors`, or shards), tensors taken by
//!   name, extra ones refused.
//! - `gpt2.rs`, `llama.rs`: which parts of the [`Decoder`] each architecture takes, and its
//!   tensors' names. A family of `llama.rs` is a few fields of its [`LlamaConfig`] (norm
//!   placement and convention, q/k norms, fused tensors, which layers have a window or which
//!   RoPE, score scale and soft-caps), not a copy.
//! - `model.rs`: [`CausalLm`], a loaded checkpoint and the checks of a forward pass's input.
//! - `generate.rs`: a checkpoint's generation settings; the loop is `gpt`'s.
#![warn(missing_docs)]

mod checkpoint;
mod config;
mod generate;
mod gpt2;
mod llama;
mod model;

pub use checkpoint::{LoadError, read_config, read_special_tokens, read_weights};
pub use config::{
    BlockNorms, ConfigError, Gpt2Config, LlamaConfig, LlamaFamily, ModelConfig, RopeLayers,
    SpecialTokens, Windows, rope_scaling,
};
pub use gpt::{
    Activation, Completion, Decoder, DecoderBlock, Engine, EngineConfig, EngineError, EngineStats,
    Event, Finish, GatedMlp, GenerateConfig, GenerateError, Generation, KvDtype, LmInput, Mlp,
    Norm, PlainMlp, Prompts, PromptsError, Request, RequestError, RequestId, Sampling,
    SamplingError,
};
pub use model::{CausalLm, ModelError};
