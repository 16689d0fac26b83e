//! The model crate's integration tests, one binary (its generic code compiled once for every
//! backend the modules use, instead of once per file).
//!
//! - `whole`: shapes, causality, cached == uncached generation, record round trip, training.
//! - `checkpoint`: round trips, config/weight disagreements, mutated files.
//! - `documents`: packed documents train as one document per row (loss and gradients), and
//!   documents that do not fit are refused (`packed`: the check, shared with `packed_f64.rs`).
//! - `paged`: ragged steps over a page pool give each sequence's logits and greedy tokens alone.
//! - `engine`: continuous batching gives each request's tokens alone, whatever the mix.

mod checkpoint;
mod documents;
mod engine;
mod packed;
mod paged;
mod whole;
