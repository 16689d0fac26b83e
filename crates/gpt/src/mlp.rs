//! A block's feed-forward network, one token at a time: GPT-2's `projection(act(fc(x)))`, or a
//! gated one, `down(act(gate(x)) ⊙ up(x))` — the book's GELU-gated feed-forward and the Llama
//! family's SwiGLU.

use burn::nn::Linear;
use burn::prelude::*;
use burn::tensor::activation::gelu;
use cpu_linalg::activation::{gelu_tanh, silu};
use cpu_linalg::projection::{self, PackedWeightsCache};

/// An MLP's nonlinearity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `x Φ(x)` with the error function: PyTorch's `gelu`, transformers' `"gelu"`; the book's
    /// gated feed-forward.
    Gelu,
    /// `0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³)))`: transformers' `gelu_new`,
    /// `gelu_pytorch_tanh`, `gelu_fast` (GPT-2, Gemma).
    GeluTanh,
    /// `x σ(x)` (SiLU, swish): the Llama family's `silu`.
    Silu,
}

impl Activation {
    /// Applies the nonlinearity element by element.
    ///
    /// # Shapes
    /// - `x`, output: any shape
    pub fn forward<B: Backend, const D: usize>(self, x: Tensor<B, D>) -> Tensor<B, D> {
        match self {
            Self::Gelu => gelu(x),
            Self::GeluTanh => gelu_tanh(x),
            Self::Silu => silu(x),
        }
    }
}

/// A block's feed-forward network.
///
/// As with [`Norm`](crate::Norm), the variant is not part of a parameter's path: the book's
/// GPT's gate is `feed_forward.gate.weight`.
// One per block, never moved in a loop: the variants' size difference costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum Mlp<B: Backend> {
    /// `projection(act(fc(x)))`: GPT-2's `c_proj(gelu(c_fc(x)))`.
    Plain(PlainMlp<B>),
    /// `down(act(gate(x)) ⊙ up(x))`: the book's GELU-gated feed-forward, the Llama family's
    /// SwiGLU.
    Gated(GatedMlp<B>),
}

/// `projection(act(fc(x)))`.
#[derive(Module, Debug)]
pub struct PlainMlp<B: Backend> {
    /// `width → hidden` (GPT-2's `c_fc`).
    pub fc: Linear<B>,
    /// `hidden → width` (GPT-2's `c_proj`).
    pub projection: Linear<B>,
    /// The nonlinearity between them (GPT-2's `activation_function`).
    #[module(skip)]
    pub activation: Activation,
    /// `fc`'s weight packed for the CPU products (`Default::default()` when built by hand).
    #[module(skip)]
    pub packed_fc: PackedWeightsCache,
    /// `projection`'s weight packed for the CPU products.
    #[module(skip)]
    pub packed_projection: PackedWeightsCache,
}

/// `down(act(gate(x)) ⊙ up(x))`.
#[derive(Module, Debug)]
pub struct GatedMlp<B: Backend> {
    /// `width → hidden`, through the nonlinearity (`gate_proj`).
    pub gate: Linear<B>,
    /// `width → hidden`, the gated values (`up_proj`).
    pub up: Linear<B>,
    /// `hidden → width` (`down_proj`).
    pub down: Linear<B>,
    /// The gate's nonlinearity: GELU for the book's GPT, SiLU for SwiGLU, tanh-GELU for Gemma.
    #[module(skip)]
    pub activation: Activation,
    /// `gate`'s and `up`'s weights packed side by side for the CPU products
    /// (`Default::default()` when built by hand).
    #[module(skip)]
    pub packed_gate_up: PackedWeightsCache,
    /// `down`'s weight packed for the CPU products.
    #[module(skip)]
    pub packed_down: PackedWeightsCache,
}

impl<B: Backend> Mlp<B> {
    /// Transforms each token's features on their own.
    ///
    /// # Shapes
    /// - `x`, output: `[..., width]`
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        match self {
            Mlp::Plain(mlp) => mlp.forward(x),
            Mlp::Gated(mlp) => mlp.forward(x),
        }
    }
}

impl<B: Backend> PlainMlp<B> {
    /// `projection(act(fc(x)))`.
    ///
    /// # Shapes
    /// - `x`, output: `[..., width]`
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let hidden = projection::linear(&self.fc, x, &self.packed_fc);
        let hidden = self.activation.forward(hidden);
        projection::linear(&self.projection, hidden, &self.packed_projection)
    }
}

impl<B: Backend> GatedMlp<B> {
    /// `down(act(gate(x)) ⊙ up(x))`.
    ///
    /// # Shapes
    /// - `x`, output: `[..., width]`
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let packed = &self.packed_gate_up;
        let [gate, up] = projection::linears_on_host([&self.gate, &self.up], &x, packed)
            .unwrap_or_else(|| {
                [
                    projection::linear(&self.gate, x.clone(), packed),
                    projection::linear(&self.up, x, packed),
                ]
            });
        let gated = self.activation.forward(gate) * up;
        projection::linear(&self.down, gated, &self.packed_down)
    }
}
