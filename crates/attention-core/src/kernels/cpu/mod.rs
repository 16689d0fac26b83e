//! Causal attention on a CPU kernel of this crate's own: blockwise, skipping the masked half,
//! parallel over query blocks, `O(seq)` memory forward and backward. The fused path takes it on
//! ndarray and burn-flex (see [`crate::kernels`]).
//!
//! - `kernel/`: the kernel on slices (forward, backward, grouped heads, windows, padding)
//! - `simd.rs`: its vector-width inner loops (the one module with `unsafe`)
//! - `op.rs`: the kernel as a Burn operation, with its autodiff node
//! - `host_cache.rs`: a key/value cache's storage in the kernel's layout
//! - `products.rs`: the projections on the host, every operand read in place
//! - `packed.rs`: weights packed once, kept by their module, and their products
//! - `matvec.rs`: a decoding step's product on weights read in place (where not packed)
//! - `products_op.rs`: the products under `Autodiff`, with their own backward
//! - `elementwise.rs`: the models' nonlinearities and rotary turns, one pass over a buffer

mod elementwise;
mod host_cache;
pub mod kernel;
mod matvec;
mod op;
mod packed;
mod products;
mod products_op;
mod simd;

pub(crate) use elementwise::{Nonlinearity, in_place, rotated_in_place};
pub(crate) use host_cache::HostStorage;
pub(crate) use op::{cached, end_step, forward, on_autodiff};
pub use packed::PackedWeightsCache;
pub(crate) use products::{Reuse, products};
pub(crate) use products_op::tracked_products;
