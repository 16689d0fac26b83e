//! hf-models' integration tests, one binary: each module loads models on several backends, and
//! in one binary the model stack's generic code is compiled once for all of them instead of once
//! per file.
//!
//! - `fixtures`: every fixture directory's logits and greedy tokens against transformers'.
//! - `errors`: a directory or request that does not fit is an error naming what is wrong.
//! - `mutated_configs`: randomly mutated `config.json` files load or are refused, never panic.

mod errors;
mod fixtures;
mod mutated_configs;
