//! A decoder block: attention, then an MLP, each a residual branch between its norms.

use attention_core::{
    AttentionError, AttentionInput, KvCache, LayerPages, MultiHeadAttention, RaggedStep,
};
use burn::nn::{Dropout, DropoutConfig};
use burn::prelude::*;

use crate::input::LmInput;
use crate::mlp::Mlp;
use crate::norm::{Norm, optional};

/// `x + dropout(post_attention_norm(attention(attention_norm(x))))`, then
/// `x + dropout(post_feed_forward_norm(feed_forward(feed_forward_norm(x))))`; a norm that is
/// `None` is left out.
///
/// Where the norms sit is one of the things families differ in, and it is these fields, not
/// another block: GPT-2, the Llama family and the book's GPT normalize each branch's input only
/// (pre-norm, [`pre_norm`](Self::pre_norm): the two post norms `None`); a family that also
/// normalizes each branch's output (Gemma 2 and 3's sandwich) sets all four, one that normalizes
/// only the outputs (OLMo 2) sets the post norms alone.
#[derive(Module, Debug)]
pub struct DecoderBlock<B: Backend> {
    /// Norm of the attention's input: GPT-2's `ln_1`, the Llama family's and Gemma's
    /// `input_layernorm`.
    pub attention_norm: Option<Norm<B>>,
    /// Causal self-attention (GPT-2's `attn`, the Llama family's `self_attn`): the model's
    /// heads, positions and window.
    pub attention: MultiHeadAttention<B>,
    /// Norm of the attention's output, before the residual sum: OLMo 2's and Gemma's
    /// `post_attention_layernorm`.
    pub post_attention_norm: Option<Norm<B>>,
    /// Norm of the MLP's input: GPT-2's `ln_2`, the Llama family's `post_attention_layernorm`,
    /// Gemma's `pre_feedforward_layernorm`.
    pub feed_forward_norm: Option<Norm<B>>,
    /// The MLP (`mlp`).
    pub feed_forward: Mlp<B>,
    /// Norm of the MLP's output, before the residual sum: OLMo 2's and Gemma's
    /// `post_feedforward_layernorm`.
    pub post_feed_forward_norm: Option<Norm<B>>,
    /// Dropout on both residual branches: active only while training (under autodiff), with
    /// probability 0 in a loaded checkpoint.
    pub dropout: Dropout,
}

impl<B: Backend> DecoderBlock<B> {
    /// A pre-norm block, `x + attention(attention_norm(x))` then
    /// `x + feed_forward(feed_forward_norm(x))`, without dropout.
    pub fn pre_norm(
        attention_norm: Norm<B>,
        attention: MultiHeadAttention<B>,
        feed_forward_norm: Norm<B>,
        feed_forward: Mlp<B>,
    ) -> Self {
        Self {
            attention_norm: Some(attention_norm),
            attention,
            post_attention_norm: None,
            feed_forward_norm: Some(feed_forward_norm),
            feed_forward,
            post_feed_forward_norm: None,
            dropout: DropoutConfig::new(0.0).init(),
        }
    }

    /// The block over `x`, whose tokens have `input`'s positions, padding and documents (each
    /// token attends within its own); with `cache`, they follow the tokens cached, and their
    /// keys and values are appended.
    ///
    /// # Shapes
    /// - `x`: `[batch, seq, width]`
    /// - `input.positions`, `input.documents`: `[batch, seq]`; `input.key_padding`:
    ///   `[batch, cached + seq]`
    /// - output: `[batch, seq, width]`
    pub fn forward(
        &self,
        x: Tensor<B, 3>,
        input: &LmInput<B>,
        cache: Option<&mut KvCache<B>>,
    ) -> Result<Tensor<B, 3>, AttentionError> {
        self.around_attention(x, |normed| self.attend(normed, input, cache))
    }

    /// The block over a ragged step's tokens, packed one sequence after another, whose keys and
    /// values go to (and are read from) `pages` through `step`'s tables (see
    /// [`MultiHeadAttention::forward_paged`]).
    ///
    /// # Shapes
    /// - `x`: `[1, tokens, width]`; output the same
    pub fn forward_paged(
        &self,
        x: Tensor<B, 3>,
        step: &RaggedStep,
        pages: &mut LayerPages<B>,
    ) -> Result<Tensor<B, 3>, AttentionError> {
        self.around_attention(x, |normed| {
            self.attention.forward_paged(normed, step, pages)
        })
    }

    /// The block with `attend` as its attention: the norms, both residual branches and the MLP
    /// around it.
    fn around_attention(
        &self,
        x: Tensor<B, 3>,
        attend: impl FnOnce(Tensor<B, 3>) -> Result<Tensor<B, 3>, AttentionError>,
    ) -> Result<Tensor<B, 3>, AttentionError> {
        let normed = optional(self.attention_norm.as_ref(), x.clone());
        let attended = attend(normed)?;
        let attended = optional(self.post_attention_norm.as_ref(), attended);
        let x = x + self.dropout.forward(attended);
        let transformed = per_token(x.clone(), |rows| {
            let normed = optional(self.feed_forward_norm.as_ref(), rows);
            optional(
                self.post_feed_forward_norm.as_ref(),
                self.feed_forward.forward(normed),
            )
        });
        Ok(x + self.dropout.forward(transformed))
    }

    /// The attention over `x`, through `cache` when there is one.
    ///
    /// # Shapes
    /// - `x`: `[batch, seq, width]`
    /// - output: `[batch, seq, width]`
    fn attend(
        &self,
        x: Tensor<B, 3>,
        input: &LmInput<B>,
        cache: Option<&mut KvCache<B>>,
    ) -> Result<Tensor<B, 3>, AttentionError> {
        let mut attention_input = AttentionInput::new(x).positions(input.positions.clone());
        if let Some(padding) = &input.key_padding {
            attention_input = attention_input.key_padding(padding.clone());
        }
        if let Some(documents) = &input.documents {
            attention_input = attention_input.documents(documents.clone());
        }
        match cache {
            Some(cache) => self.attention.forward_cached(attention_input, cache),
            None => self.attention.try_forward(attention_input),
        }
    }
}

/// `f` applied to every token's features, given as the rows of one matrix.
///
/// The parts of the model that see one token at a time (a block's MLP and its norms, the final
/// norm and the LM head) run on `[batch · seq, width]` rows. Besides being the plain shape for
/// their matrix products, this avoids (Burn 0.21 workaround) a fault of Burn 0.21's fusion on wgpu: an RMSNorm read by
/// the gate and up projections as `[batch ≥ 2, 1, width]` (a decode step of a batch) gave wrong
/// values for the rows after the first (`crates/hf-models/tests/models/fixtures.rs` runs the padded
/// batch on wgpu).
///
/// # Shapes
/// - `x`: `[batch, seq, width]`
/// - `f`: `[tokens, width]` → `[tokens, out]`
/// - output: `[batch, seq, out]`
pub(crate) fn per_token<B: Backend>(
    x: Tensor<B, 3>,
    f: impl FnOnce(Tensor<B, 2>) -> Tensor<B, 2>,
) -> Tensor<B, 3> {
    let [batch, seq, width] = x.dims();
    let out = f(x.reshape([batch * seq, width]));
    let out_width = out.dims()[1];
    out.reshape([batch, seq, out_width])
}

#[cfg(test)]
mod tests {
    use attention_backends::NdArray;
    use attention_core::{MultiHeadAttentionConfig, RmsNormConfig};
    use burn::nn::LinearConfig;
    use burn::tensor::{Distribution, Tolerance};

    use super::*;
    use crate::mlp::{Activation, GatedMlp};

    /// A block with all four norms (the sandwich a later family needs) equals its formula written
    /// out: each norm sits where its field says.
    #[test]
    fn each_norm_sits_where_its_field_says() {
        let device = Default::default();
        NdArray::seed(&device, 1);
        let width = 8;
        let norm = |epsilon| {
            Norm::<NdArray>::Rms(
                RmsNormConfig::new(width)
                    .with_epsilon(epsilon)
                    .init(&device),
            )
        };
        let [n1, n2, n3, n4] = [1e-6, 1e-3, 1e-2, 1e-1].map(norm);
        let linear = |i, o| LinearConfig::new(i, o).init::<NdArray>(&device);
        let attention = MultiHeadAttentionConfig::new(width, width, 16, 2).init::<NdArray>(&device);
        let mlp = Mlp::Gated(GatedMlp {
            gate: linear(width, 16),
            up: linear(width, 16),
            down: linear(16, width),
            activation: Activation::Silu,
            packed_gate_up: Default::default(),
            packed_down: Default::default(),
        });
        // Burn draws parameters lazily, at first use: a clone would draw its own, so the formula
        // below reads the block's own parts.
        let block = DecoderBlock {
            attention_norm: Some(n1.clone()),
            attention,
            post_attention_norm: Some(n2.clone()),
            feed_forward_norm: Some(n3.clone()),
            feed_forward: mlp,
            post_feed_forward_norm: Some(n4.clone()),
            dropout: DropoutConfig::new(0.0).init(),
        };
        let x = Tensor::<NdArray, 3>::random([2, 5, width], Distribution::Default, &device);
        let input = LmInput::after(Tensor::<NdArray, 2, Int>::zeros([2, 5], &device), 0);
        let got = block.forward(x.clone(), &input, None).unwrap();
        let x = x.clone() + n2.forward(block.attention.forward(n1.forward(x)));
        let expected = x.clone() + n4.forward(block.feed_forward.forward(n3.forward(x)));
        got.into_data()
            .assert_approx_eq::<f32>(&expected.into_data(), Tolerance::absolute(1e-5));
    }
}
