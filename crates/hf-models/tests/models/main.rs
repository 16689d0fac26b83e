//! hf-models' integration tests, one binary: each module loads models on several backends, and
//! in one binary the model stack's generic code is compiled once for all of them instead of once
//! per file.
//!
//! - `fixtures`: every fixture directory's logits and greedy tokens against transformers'.
//! - `errors`: a directory or request that does not fit is an error naming what is wrong.
//! - `mutated_configs`: randomly mutated `config.json` files load or are refused, never panic.
//!
//! [`MODELS`], the fixture directories, is theirs to share.

mod errors;
mod fixtures;
mod mutated_configs;

/// The model directories, Llama first: wgpu runs the first two (see `cases_on`). After the
/// first four, today's small families (q/k norms per head and over the width; Gemma's sandwich
/// of `1 + w` norms, scaled embeddings, score scale, soft-caps and windows on some layers, with
/// RoPE per layer type in Gemma 3; fused tensors with partial RoPE; layers without RoPE) and a
/// Llama stored in bfloat16.
pub(crate) const MODELS: [&str; 11] = [
    "llama_tiny_s1",
    "gpt2_tiny_s0",
    "qwen2_tiny_s2",
    "mistral_tiny_s3",
    "qwen3_s20",
    "gemma2_s21",
    "gemma3_s22",
    "phi3_s23",
    "olmo2_s24",
    "smollm3_s25",
    "llama_bf16_s26",
];
