//! Causal attention on a CPU kernel of this crate's own: blockwise, skipping the masked half,
//! parallel over query blocks, `O(seq)` memory forward and backward. The fused path takes it on
//! ndarray and burn-flex (see [`crate::kernels`]).
//!
//! - `kernel/`: the kernel on slices (forward, backward, grouped heads, windows, padding), its
//!   inner loops at the CPU's vector width from `cpu_linalg::simd`
//! - `op.rs`: the kernel as a Burn operation, with its autodiff node
//! - `host_cache.rs`: a key/value cache's storage in the kernel's layout (a page pool's too)
//! - `paged.rs`: a ragged step over a page pool's host storage

mod host_cache;
pub mod kernel;
mod op;
mod paged;

pub(crate) use host_cache::HostStorage;
pub(crate) use op::{cached, end_step, forward, on_autodiff};
pub(crate) use paged::paged;
