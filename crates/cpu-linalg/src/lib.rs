//! Linear algebra on the host for Burn's CPU backends (burn-flex and burn-ndarray, bare or under
//! `Autodiff`): what a model built on the attention layer computes besides attention, at the
//! machine's rate.
//!
//! - [`projection`]: `x · W (+ b)` as the layer and the models compute it — on weights packed
//!   once in panels and kept by the module that owns them ([`PackedWeightsCache`]), under
//!   `Autodiff` with a backward of the same products; Burn's `Linear` on every other backend.
//! - [`activation`]: SiLU and the tanh GELU in one vectorized pass.
//! - [`rotated_in_place`]: rotary embeddings' turn of every head in one pass.
//! - [`simd`]: the vector-width loops under all of it and under attention-core's CPU attention
//!   kernel — the workspace's one module with `unsafe` (CONTRIBUTING.md).
//!
//! The private modules under them, each importing only modules after it in this list (and
//! [`simd`]), so that no two import each other in a circle:
//! - `elementwise.rs`: the vectorized passes of [`activation`] and [`rotated_in_place`];
//! - `backends.rs`: which backends' buffers these loops read, in one list, and the one place a
//!   projection's backend is decided;
//! - `products_op.rs`: the products under `Autodiff`, with their own backward;
//! - `products.rs`: the bare products, and which path takes them;
//! - `matvec.rs`: a decoding step's products on weights read in place;
//! - `packed.rs`: weights packed once in panels, and their products;
//! - `prefill_blocking.rs`: how a prefill's products cut their work on this CPU;
//! - `cache_sizes.rs`: this CPU's cache sizes, read from the machine;
//! - `host_matrix.rs`: a bare backend's buffer read as a matrix;
//! - `known_type.rs`: a generic value handed over as the type it was found to be.
//!
//! Every entry point falls back to Burn's own ops where the backend, the float type or a
//! tensor's layout is not one it reads, so a caller never chooses by backend.
#![warn(missing_docs)]

pub mod activation;
mod backends;
mod cache_sizes;
mod elementwise;
mod host_matrix;
mod known_type;
mod matvec;
mod packed;
mod prefill_blocking;
mod products;
mod products_op;
pub mod projection;
pub mod simd;

pub use backends::is_bare_host;
pub use elementwise::{RopeLayout, rotated_in_place};
pub use packed::PackedWeightsCache;
