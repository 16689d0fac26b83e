//! Causal multi-head self-attention for [Burn](https://burn.dev), the GPT layer of the source
//! chapter ("implement the GPT multi-head attention layer"), with exact PyTorch parity.
//!
//! ```
//! use attention_core::MultiHeadAttentionConfig;
//! use burn::backend::NdArray;
//! use burn::prelude::*;
//!
//! let device = Default::default();
//! // The chapter's example: 4 features in and out, 2 heads, up to 6 tokens.
//! let layer = MultiHeadAttentionConfig::new(4, 4, 6, 2)
//!     .with_dropout(0.1)
//!     .init::<NdArray>(&device);
//! let x = Tensor::<NdArray, 3>::random([1, 6, 4], burn::tensor::Distribution::Default, &device);
//! let y = layer.forward(x.clone());
//! assert_eq!(y.dims(), [1, 6, 4]);
//!
//! // What the chapter prints: scores, masked scores and weights, [batch, heads, seq, seq].
//! let trace = layer.forward_traced(x).unwrap();
//! assert_eq!(trace.weights.dims(), [1, 2, 6, 6]);
//! ```
//!
//! - [`MultiHeadAttentionConfig`] / [`MultiHeadAttention`]: the layer (`mha/`). Every
//!   variant of the queries and keys — grouped heads, [`RopeConfig`] (over all of a head or its
//!   first `rotary_dim` features, `rope.rs`), [`QkNormConfig`] (RMSNorms per head or over the
//!   projected width, `qk_norm.rs`) — is applied in its one projection step, before any attention
//!   core, so that every path sees it.
//! - [`AttentionPath`]: the explicit and the fused attention core (`attend.rs`: the tensor ops;
//!   `kernels/`: this crate's kernels); which code runs for a path on a backend is decided in one
//!   place, `route.rs`. [`causal_attention`] (`causal.rs`): the core alone, on projections a model
//!   made itself. The scale, soft-cap and sinks every core reads: `score_rule.rs`; the head split
//!   and merge: `heads.rs`.
//! - [`Documents`]: rows packed from several documents, each attending within itself
//!   (`documents.rs`), honoured by every path and both kernels, forward and backward.
//! - [`RmsNorm`]: the one RMSNorm, `w` or Gemma's `1 + w` (`rms_norm.rs`): the q/k norms, and
//!   the `gpt` crate's block norms.
//! - [`mask`]: causal and key-padding masks.
//! - [`Kernel`]: the attention kernels of this crate's own and the backends they run on, all
//!   named in one place (`kernels/backends.rs`); `kernels/cpu/` is the CPU kernel behind the fused
//!   path on ndarray and burn-flex, with its own backward pass.
//! - [`KvCache`]: incremental decoding (`cache.rs`), its keys and values in the layer's float
//!   type or a narrower [`KvDtype`] (`kv_dtype.rs`).
//! - [`weights`]: PyTorch state dicts in and out (the chapter's, GPT-2's and Hugging Face Llama's
//!   layouts, q/k norm weights included).
#![warn(missing_docs)]

mod attend;
mod cache;
mod causal;
mod documents;
mod error;
mod heads;
mod kernels;
mod kv_dtype;
pub mod mask;
mod mha;
mod paged;
mod qk_norm;
mod rms_norm;
mod rope;
mod route;
mod score_rule;
pub mod weights;

pub use attend::AttentionPath;
/// The explicit path's softmax, for tests that rebuild a reference from it.
#[cfg(feature = "test-hooks")]
pub use attend::masked_softmax;
pub use cache::KvCache;
pub use causal::causal_attention;
pub use documents::Documents;
pub use error::AttentionError;
pub use kernels::Kernel;
/// How many device syncs decoding has made on this thread: what tests check stays zero.
#[cfg(feature = "test-hooks")]
pub use kernels::device_syncs;
/// The GPU kernels' CUDA source without a CUDA device, for `benches/kernel-report`.
#[cfg(feature = "kernel-report")]
#[doc(hidden)]
pub use kernels::kernel_report;
pub use kv_dtype::KvDtype;
pub use mha::{
    AttentionInput, AttentionTrace, EXPLICIT_SCORES_LIMIT, MultiHeadAttention,
    MultiHeadAttentionConfig,
};
pub use paged::{LayerPages, PageCopy, PagePool, PageTable, RaggedStep, SequenceStep};
pub use qk_norm::{QkNorm, QkNormConfig, QkNormScope};
pub use rms_norm::{RmsNorm, RmsNormConfig};
pub use rope::{Llama3Scaling, RopeConfig, RopeLayout, RopeScaling};
