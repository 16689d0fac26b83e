//! PyTorch weights in and out of a layer: a [`StateDict`] (crate `state-dict`: `.safetensors`
//! and `torch.save(state_dict)` `.pt` files) in the source chapter's layout, Hugging Face GPT-2's
//! or Hugging Face Llama's, mapped onto a [`MultiHeadAttention`](crate::MultiHeadAttention) and
//! back.
//!
//! | layout | keys | weight storage |
//! |---|---|---|
//! | [`WeightsLayout::Chapter`] | `query_layer.weight` `[O, I]`, `query_layer.bias` `[O]` (iff `qkv_bias`), the same for `key_layer`, `value_layer`, `output_layer` (bias always), a `mask` buffer `[C, C]` (ignored); `query_norm.weight`, `key_norm.weight` (iff `qk_norm`); `sinks` `[H]` (iff `sinks`) | `nn.Linear`: `[out, in]` |
//! | [`WeightsLayout::Gpt2`] | `c_attn.weight` `[d, 3d]`, `c_attn.bias` `[3d]` (Q, K, V column blocks), `c_proj.weight` `[d, d]`, `c_proj.bias` `[d]` | `Conv1D`: `[in, out]` |
//! | [`WeightsLayout::Llama`] | `q_proj.weight` `[H·hd, I]`, `k_proj.weight` and `v_proj.weight` `[KV·hd, I]`, `o_proj.weight` `[O, H·hd]`, biases iff `qkv_bias` / `output_bias`; `q_norm.weight` and `k_norm.weight` (iff `qk_norm`): `[hd]` per head, or `[H·hd]` and `[KV·hd]` over the width; `sinks` `[H]` (iff `sinks`, gpt-oss) | `nn.Linear`: `[out, in]` |
//!
//! Files are read by `tensor-files` through `state-dict`, which treat them as hostile input:
//! strided `.pt` views load with their true values, and every declared size is checked against
//! the file before anything is allocated.
//!
//! - `mod.rs`: [`WeightsError`], and [`LayerWeights`]: what a state dict says about a layer.
//! - `layout.rs`: the layouts mapped to and from a layer ([`AttentionParams`]).
//! - `grads.rs`: a layer's parameter gradients after `backward`, in the same layouts.
//!
//! ```no_run
//! use attention_core::weights::{LayerWeights, StateDict};
//! use burn::backend::NdArray;
//!
//! let device = Default::default();
//! let dict = StateDict::load("model.pt")?;
//! let config = dict.infer_config(2, dict.mask_context_length()?.unwrap_or(1024))?;
//! let layer = dict.to_layer::<NdArray>(&config, &device)?;
//! # Ok::<(), attention_core::weights::WeightsError>(())
//! ```

mod grads;
mod layout;

use thiserror::Error;

use crate::error::AttentionError;

pub use layout::{AttentionParams, LayerWeights, LinearParams, WeightsLayout, contiguous};
pub use state_dict::{StateDict, StateDictError};

/// What went wrong reading weights or fitting them to a layer.
#[derive(Debug, Error)]
pub enum WeightsError {
    /// The file could not be read, or a tensor the layer needs is absent, unexpected, of another
    /// shape or dtype, or not finite.
    #[error(transparent)]
    StateDict(#[from] StateDictError),
    /// The keys are neither the chapter's nor GPT-2's.
    #[error(
        "no attention weights found: expected `query_layer.weight` (the chapter's layout) or \
         `c_attn.weight` (GPT-2's); the file has {keys:?}"
    )]
    UnknownLayout {
        /// The keys the file has.
        keys: Vec<String>,
    },
    /// The config built from (or given for) the weights is invalid.
    #[error("weights do not fit the config: {0}")]
    Config(#[from] AttentionError),
}

impl WeightsError {
    /// The same error with `prefix` before the tensor name it carries: what a dict split off a
    /// larger checkpoint ([`StateDict::split_prefix`]) reports in the checkpoint's own names.
    pub fn with_key_prefix(self, prefix: &str) -> Self {
        match self {
            Self::StateDict(error) => Self::StateDict(error.with_key_prefix(prefix)),
            other @ (Self::UnknownLayout { .. } | Self::Config(_)) => other,
        }
    }
}
