//! Causal attention on a CPU kernel of this crate's own: blockwise, skipping the masked half,
//! parallel over query blocks, `O(seq)` memory forward and backward. The fused path takes it on
//! ndarray and burn-flex (see [`AttentionPath::Fused`](crate::AttentionPath::Fused)).

pub mod kernel;
mod op;

pub(crate) use op::{FlashInputs, causal_attention, supports};
