//! The network both architectures are: a decoder-only transformer of pre-norm blocks,
//! `x + attention(norm(x))` then `x + mlp(norm(x))`, between the embeddings and a final norm and
//! LM head. GPT-2 and the Llama family differ only in the parts ([`Norm`], [`Mlp`], learned or
//! rotary positions), which `gpt2.rs` and `llama.rs` pick when they load a checkpoint.

use attention_core::{AttentionError, AttentionInput, KvCache, MultiHeadAttention};
use burn::nn::{Embedding, LayerNorm, Linear, RmsNorm};
use burn::prelude::*;
use burn::tensor::activation::{gelu, gelu_approximate, silu};

use crate::config::Gelu;
use crate::model::{LmInput, ModelError};

/// Which positions a forward pass projects onto the vocabulary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Logits {
    /// Every position.
    All,
    /// The last one: all that generation needs to pick the next token (the projection onto a
    /// large vocabulary is a good part of a long prompt's cost).
    Last,
}

/// A decoder-only language model.
#[derive(Module, Debug)]
pub struct Decoder<B: Backend> {
    /// `wte` / `embed_tokens`: `[vocab, width]`.
    pub token_embedding: Embedding<B>,
    /// GPT-2's learned positions `wpe` (`[n_positions, width]`); `None` where the attention
    /// rotates by position instead (the Llama family).
    pub position_embedding: Option<Embedding<B>>,
    /// The blocks, in order.
    pub blocks: Vec<DecoderBlock<B>>,
    /// `ln_f` / `norm`.
    pub final_norm: Norm<B>,
    /// `lm_head`, or `None` when it is tied to the token embedding.
    pub lm_head: Option<Linear<B>>,
}

/// `x + attention(attention_norm(x))`, then `x + mlp(mlp_norm(x))`.
#[derive(Module, Debug)]
pub struct DecoderBlock<B: Backend> {
    /// `ln_1` / `input_layernorm`.
    pub attention_norm: Norm<B>,
    /// `attn` / `self_attn`: causal, with the model's heads, positions and window.
    pub attention: MultiHeadAttention<B>,
    /// `ln_2` / `post_attention_layernorm`.
    pub mlp_norm: Norm<B>,
    /// `mlp`.
    pub mlp: Mlp<B>,
}

/// A block's normalization.
#[derive(Module, Debug)]
pub enum Norm<B: Backend> {
    /// GPT-2's LayerNorm (mean and variance, weight and bias).
    Layer(LayerNorm<B>),
    /// The Llama family's RMSNorm (root mean square, weight only).
    Rms(RmsNorm<B>),
}

/// A block's feed-forward network.
// One per block, never moved in a loop: the variants' size difference costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum Mlp<B: Backend> {
    /// GPT-2's `c_proj(gelu(c_fc(x)))`.
    Gelu(GeluMlp<B>),
    /// The Llama family's `down(silu(gate(x)) · up(x))`.
    SwiGlu(SwiGlu<B>),
}

/// `projection(gelu(fc(x)))`.
#[derive(Module, Debug)]
pub struct GeluMlp<B: Backend> {
    /// `c_fc`: `width → n_inner`.
    pub fc: Linear<B>,
    /// `c_proj`: `n_inner → width`.
    pub projection: Linear<B>,
    /// `activation_function`.
    #[module(skip)]
    pub activation: Gelu,
}

/// `down(silu(gate(x)) · up(x))`.
#[derive(Module, Debug)]
pub struct SwiGlu<B: Backend> {
    /// `gate_proj`: `hidden → intermediate`, through SiLU.
    pub gate: Linear<B>,
    /// `up_proj`: `hidden → intermediate`.
    pub up: Linear<B>,
    /// `down_proj`: `intermediate → hidden`.
    pub down: Linear<B>,
}

impl<B: Backend> Norm<B> {
    /// Normalizes each token's features.
    ///
    /// # Shapes
    /// - `x`, output: `[..., width]`
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        match self {
            Norm::Layer(norm) => norm.forward(x),
            Norm::Rms(norm) => norm.forward(x),
        }
    }
}

impl<B: Backend> Mlp<B> {
    /// Transforms each token's features on their own.
    ///
    /// # Shapes
    /// - `x`, output: `[..., width]`
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        match self {
            Mlp::Gelu(mlp) => {
                let hidden = mlp.fc.forward(x);
                let hidden = match mlp.activation {
                    Gelu::Tanh => gelu_approximate(hidden),
                    Gelu::Exact => gelu(hidden),
                };
                mlp.projection.forward(hidden)
            }
            Mlp::SwiGlu(mlp) => {
                let gated = silu(mlp.gate.forward(x.clone())) * mlp.up.forward(x);
                mlp.down.forward(gated)
            }
        }
    }
}

impl<B: Backend> Decoder<B> {
    /// Logits of every token (of the last one only with `Logits::Last`); with `caches` (one per
    /// block), of tokens that follow those cached.
    ///
    /// # Shapes
    /// - `input.tokens`, `input.positions`: `[batch, seq]`
    /// - output: `[batch, seq, vocab]`, or `[batch, 1, vocab]` with `Logits::Last`
    pub(crate) fn forward(
        &self,
        input: &LmInput<B>,
        mut caches: Option<&mut [KvCache<B>]>,
        logits: Logits,
    ) -> Result<Tensor<B, 3>, ModelError> {
        let mut x = self.token_embedding.forward(input.tokens.clone());
        if let Some(positions) = &self.position_embedding {
            x = x + positions.forward(input.positions.clone());
        }
        for (i, block) in self.blocks.iter().enumerate() {
            let cache = caches.as_deref_mut().map(|caches| &mut caches[i]);
            let normed = block.attention_norm.forward(x.clone());
            x = x + attend(&block.attention, normed, input, cache)?;
            let mlp = per_token(x.clone(), |rows| {
                block.mlp.forward(block.mlp_norm.forward(rows))
            });
            x = x + mlp;
        }
        if logits == Logits::Last {
            let seq = x.dims()[1];
            x = x.narrow(1, seq - 1, 1);
        }
        Ok(per_token(x, |rows| {
            self.lm_head(self.final_norm.forward(rows))
        }))
    }

    /// The LM head: `lm_head`, or the token embedding's transpose when tied (`h · Eᵀ`).
    ///
    /// # Shapes
    /// - `rows`: `[tokens, width]`
    /// - output: `[tokens, vocab]`
    fn lm_head(&self, rows: Tensor<B, 2>) -> Tensor<B, 2> {
        match &self.lm_head {
            Some(head) => head.forward(rows),
            // `[vocab, width]`
            None => rows.matmul(self.token_embedding.weight.val().transpose()),
        }
    }
}

/// `f` applied to every token's features, given as the rows of one matrix.
///
/// The parts of a block that see one token at a time (its MLP, the final norm and the LM head)
/// run on `[batch · seq, width]` rows. Besides being the plain shape for their matrix products,
/// this avoids a fault of Burn 0.21's fusion on wgpu: an RMSNorm read by the gate and up
/// projections as `[batch ≥ 2, 1, width]` (a decode step of a batch) gave wrong values for the
/// rows after the first (`tests/fixtures.rs` runs the padded batch on wgpu).
///
/// # Shapes
/// - `x`: `[batch, seq, width]`
/// - `f`: `[tokens, width]` → `[tokens, out]`
/// - output: `[batch, seq, out]`
fn per_token<B: Backend>(
    x: Tensor<B, 3>,
    f: impl FnOnce(Tensor<B, 2>) -> Tensor<B, 2>,
) -> Tensor<B, 3> {
    let [batch, seq, width] = x.dims();
    let out = f(x.reshape([batch * seq, width]));
    let out_width = out.dims()[1];
    out.reshape([batch, seq, out_width])
}

/// A block's attention over `x`, through `cache` when there is one.
fn attend<B: Backend>(
    attention: &MultiHeadAttention<B>,
    x: Tensor<B, 3>,
    input: &LmInput<B>,
    cache: Option<&mut KvCache<B>>,
) -> Result<Tensor<B, 3>, AttentionError> {
    let mut attention_input = AttentionInput::new(x).positions(input.positions.clone());
    if let Some(padding) = &input.key_padding {
        attention_input = attention_input.key_padding(padding.clone());
    }
    match cache {
        Some(cache) => attention.forward_cached_with(attention_input, cache),
        None => attention.forward_with(attention_input),
    }
}
