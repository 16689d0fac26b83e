//! Causal attention on a CPU kernel of this crate's own: blockwise, skipping the masked half,
//! parallel over query blocks, `O(seq)` memory forward and backward. The fused path takes it on
//! ndarray and burn-flex (see [`AttentionPath::Fused`](crate::AttentionPath::Fused)).

mod host_cache;
pub mod kernel;
mod op;
mod simd;

pub(crate) use host_cache::HostStorage;
pub(crate) use op::{
    CachedInputs, FlashInputs, cached_attention, causal_attention, keeps_host_cache, supports,
};
