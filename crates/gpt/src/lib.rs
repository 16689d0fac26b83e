//! A small GPT assembled from [`attention_core::MultiHeadAttention`], as the source chapter's book
//! builds it next: pre-norm transformer blocks with the book's gated feed-forward, learned
//! positions, a bias-free language-model head, and generation that reuses every block's
//! [`KvCache`](attention_core::KvCache); [`checkpoint`] saves and loads a trained model.
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
#![warn(missing_docs)]

mod block;
pub mod checkpoint;
mod feed_forward;
mod generate;
mod model;
mod named;

pub use block::{TransformerBlock, TransformerBlockConfig};
pub use feed_forward::{FeedForward, FeedForwardConfig};
pub use generate::{GenerateError, Sampling};
pub use model::{GptConfig, GptConfigError, GptModel};
pub use named::{load_parameters, named_parameters, parameter_shapes};
