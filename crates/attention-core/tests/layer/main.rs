//! The layer's integration tests, one binary: every module instantiates its generic test bodies
//! on ndarray, flex and wgpu (`backend_tests!`), and in one binary Burn's generic code is compiled
//! once for all of them instead of once per file.
//!
//! - `parity`: PyTorch's chapter module (outputs, weights, gradients; `.pt` and safetensors).
//! - `gpt2`: Hugging Face's `GPT2Attention`.
//! - `hugging_face`: Hugging Face's Llama, Qwen2 and Mistral attention (GQA, RoPE, windows).
//! - `modern`: grouped heads, rotary positions and windows against equivalent layers.
//! - `paths`: explicit == fused == cached, padding, masks.
//! - `properties`: causality, distributions, determinism, dropout.
//! - `variants`: q/k norms (per head, over the width, `1 + w`) and partial rotary embeddings, on
//!   every path, alone and combined.
//! - `errors`: bad input is an error value naming what was wrong.
//! - `documents`: rows packed from documents, against each document alone.
//! - `paged`: ragged steps over a page pool, against each sequence alone through a dense cache.
//! - `kv_dtypes`: caches in fewer bytes (f16, bf16, int8) against the f32 cache.
//! - `core_alone`: the attention core alone (`causal_attention`) against its formula written out.
//! - `gpu_kernel`: the GPU kernel on wgpu, forward, backward and cached, against the explicit
//!   path.

mod common;
mod core_alone;
mod documents;
mod errors;
mod gpt2;
#[cfg(feature = "wgpu")]
mod gpu_kernel;
mod hugging_face;
mod kv_dtypes;
mod modern;
mod paged;
mod parity;
mod paths;
mod properties;
mod variants;
