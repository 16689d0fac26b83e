//! The model stack of this workspace, built from [`attention_core::MultiHeadAttention`]: one
//! decoder-only transformer, [`Decoder`], whose families differ in fields, not in code — which
//! [`Norm`] (LayerNorm, RMSNorm, Gemma's `1 + w` RMSNorm) and where a [`DecoderBlock`] puts it,
//! which [`Mlp`] (GPT-2's, the book's gated GELU, the Llama family's SwiGLU, Gemma's tanh-GELU),
//! learned or rotary positions, a separate or tied LM head, scaled embeddings and soft-capped
//! logits — and one [`Sampler`] that picks generated tokens.
//!
//! The book's small GPT ([`GptConfig`]) is one configuration of it, trained by `tiny-gpt` and
//! saved and loaded by [`checkpoint`]; `hf-models` loads GPT-2 and the Llama family from Hugging
//! Face checkpoints into the same [`Decoder`].
//!
//! ```
//! use burn::backend::NdArray;
//! use gpt::{GptConfig, Sampling};
//!
//! let device = Default::default();
//! let model = GptConfig::new(256, 32, 16, 2, 2).init::<NdArray>(&device);
//! let tokens = model.generate(&[72, 105], 5, &Sampling::Greedy, &device).unwrap();
//! assert_eq!(tokens.len(), 2 + 5);
//! ```
//!
//! - `norm.rs`: [`Norm`], a LayerNorm or an [`RmsNorm`](attention_core::RmsNorm).
//! - `mlp.rs`: [`Mlp`] and its [`Activation`]s.
//! - `input.rs`: [`LmInput`], a forward pass's tokens, positions, padding and packed documents;
//!   [`Logits`].
//! - `block.rs`: [`DecoderBlock`], and the per-token rows its MLP runs on.
//! - `decoder.rs`: [`Decoder`], with and without KV caches.
//! - `paged.rs`: the decoder on a ragged step over a page pool, and each sequence's
//!   [`SequencePages`].
//! - `engine.rs`: continuous batching, [`Engine`]: requests added and ended while it runs,
//!   each step one ragged batch of decoding rows and prompt chunks over the page pool.
//! - `loss.rs`: [`Labels`], the next-token labels within a batch's rows and documents, and the
//!   cross-entropy over them.
//! - `packing.rs`: [`TokenRows`], documents laid into training rows, packed or one per row.
//! - `config.rs`: [`GptConfig`], the book's GPT as a configuration of the decoder.
//! - `sampling.rs`: [`Sampling`] and the [`Sampler`] that follows it.
//! - `generate.rs`: the generation loop: a batch of left-padded [`Prompts`] continued through
//!   the caches, tokens chosen on the device.
//! - `checkpoint.rs`: a trained GPT on disk, checked against its config.
//! - `named.rs`: parameters by their path in a model.
#![warn(missing_docs)]

mod block;
pub mod checkpoint;
mod config;
mod decoder;
mod engine;
mod generate;
mod input;
mod loss;
mod mlp;
mod named;
mod norm;
mod packing;
mod paged;
mod sampling;

/// What a KV cache stores keys and values as, re-exported for the caches' and the engine's
/// configs.
pub use attention_core::KvDtype;
pub use block::DecoderBlock;
pub use config::{GptConfig, GptConfigError, GptModel};
pub use decoder::{Decoder, DecoderError};
pub use engine::{
    Completion, Engine, EngineConfig, EngineError, EngineStats, Event, Finish, Request,
    RequestError, RequestId,
};
pub use generate::{GenerateConfig, GenerateError, Generation, Prompts, PromptsError};
pub use input::{LmInput, Logits};
pub use loss::Labels;
pub use mlp::{Activation, GatedMlp, Mlp, PlainMlp};
pub use named::{load_parameters, named_parameters, parameter_shapes};
pub use norm::Norm;
pub use packing::{PackingError, RowLayout, TokenRows};
pub use paged::SequencePages;
pub use sampling::{Sampler, Sampling, SamplingError};
