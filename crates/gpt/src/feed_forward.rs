//! The book's gated feed-forward: `down(gelu(gate(x)) * up(x))`, no biases.

use burn::nn::{Linear, LinearConfig};
use burn::prelude::*;
use burn::tensor::activation::gelu;

/// Configuration of a [`FeedForward`].
#[derive(Config, Debug)]
pub struct FeedForwardConfig {
    /// Width of the model.
    pub d_model: usize,
    /// Width of the hidden layer (the GPT's blocks use `4 · d_model`).
    pub hidden: usize,
}

impl FeedForwardConfig {
    /// Initializes the layer.
    pub fn init<B: Backend>(&self, device: &B::Device) -> FeedForward<B> {
        let linear = |i, o| LinearConfig::new(i, o).with_bias(false).init(device);
        FeedForward {
            gate: linear(self.d_model, self.hidden),
            up: linear(self.d_model, self.hidden),
            down: linear(self.hidden, self.d_model),
        }
    }
}

/// Gated feed-forward: `down(gelu(gate(x)) ⊙ up(x))`.
#[derive(Module, Debug)]
pub struct FeedForward<B: Backend> {
    /// `d_model → hidden`, through GELU.
    pub gate: Linear<B>,
    /// `d_model → hidden`, the gated values.
    pub up: Linear<B>,
    /// `hidden → d_model`.
    pub down: Linear<B>,
}

impl<B: Backend> FeedForward<B> {
    /// # Shapes
    /// - `x`: `[batch, seq, d_model]`
    /// - output: `[batch, seq, d_model]`
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        self.down
            .forward(gelu(self.gate.forward(x.clone())) * self.up.forward(x))
    }
}
