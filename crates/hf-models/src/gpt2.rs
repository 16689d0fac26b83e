//! GPT-2 (`GPT2LMHeadModel`): learned positions, pre-norm blocks with a GELU MLP, a final norm and
//! an LM head tied to the token embedding.

use attention_core::{KvCache, MultiHeadAttention, MultiHeadAttentionConfig};
use burn::nn::{Embedding, LayerNorm, Linear};
use burn::prelude::*;
use burn::tensor::activation::{gelu, gelu_approximate};

use crate::checkpoint::{Checkpoint, LoadError};
use crate::config::{Gelu, Gpt2Config};
use crate::model::{LmInput, ModelError, attend, lm_head};

/// GPT-2 with its language-model head.
#[derive(Module, Debug)]
pub struct Gpt2<B: Backend> {
    /// `wte`: `[vocab, width]`.
    pub token_embedding: Embedding<B>,
    /// `wpe`: `[n_positions, width]`.
    pub position_embedding: Embedding<B>,
    /// `h.0` … `h.{n_layer − 1}`.
    pub blocks: Vec<Gpt2Block<B>>,
    /// `ln_f`.
    pub final_norm: LayerNorm<B>,
    /// `lm_head`, or `None` when it is tied to `wte` (GPT-2's checkpoints).
    pub lm_head: Option<Linear<B>>,
}

/// `x + attn(ln_1(x))`, then `x + c_proj(gelu(c_fc(ln_2(x))))`.
#[derive(Module, Debug)]
pub struct Gpt2Block<B: Backend> {
    /// `ln_1`.
    pub attention_norm: LayerNorm<B>,
    /// `attn`: `c_attn` (Q | K | V) and `c_proj`, causal, scaled by `1/√head_dim`.
    pub attention: MultiHeadAttention<B>,
    /// `ln_2`.
    pub mlp_norm: LayerNorm<B>,
    /// `mlp.c_fc`: `width → n_inner`.
    pub fc: Linear<B>,
    /// `mlp.c_proj`: `n_inner → width`.
    pub projection: Linear<B>,
    /// `activation_function`.
    #[module(skip)]
    pub activation: Gelu,
}

impl<B: Backend> Gpt2<B> {
    /// Builds the model from a checkpoint's tensors (named with or without `transformer.`).
    pub(crate) fn load(
        config: &Gpt2Config,
        checkpoint: &mut Checkpoint,
        device: &B::Device,
    ) -> Result<Self, LoadError> {
        let base = if checkpoint.contains("transformer.wte.weight") {
            "transformer."
        } else {
            ""
        };
        let width = config.width;
        let attention =
            MultiHeadAttentionConfig::new(width, width, config.max_positions, config.num_heads)
                .with_qkv_bias(true);
        attention.validate().map_err(|e| LoadError::Config {
            path: "config.json".into(),
            source: e.into(),
        })?;
        let blocks = (0..config.num_layers)
            .map(|i| {
                let prefix = format!("{base}h.{i}.");
                Ok(Gpt2Block {
                    attention_norm: checkpoint.layer_norm(
                        &format!("{prefix}ln_1"),
                        width,
                        config.layer_norm_eps,
                        device,
                    )?,
                    attention: checkpoint.attention(
                        &format!("{prefix}attn."),
                        &attention,
                        device,
                    )?,
                    mlp_norm: checkpoint.layer_norm(
                        &format!("{prefix}ln_2"),
                        width,
                        config.layer_norm_eps,
                        device,
                    )?,
                    fc: checkpoint.conv1d(
                        &format!("{prefix}mlp.c_fc"),
                        [width, config.mlp_width],
                        device,
                    )?,
                    projection: checkpoint.conv1d(
                        &format!("{prefix}mlp.c_proj"),
                        [config.mlp_width, width],
                        device,
                    )?,
                    activation: config.activation,
                })
            })
            .collect::<Result<_, LoadError>>()?;
        let lm_head = checkpoint.lm_head(
            config.tie_word_embeddings,
            [width, config.vocab_size],
            device,
        )?;
        Ok(Self {
            token_embedding: checkpoint.embedding(
                &format!("{base}wte.weight"),
                [config.vocab_size, width],
                device,
            )?,
            position_embedding: checkpoint.embedding(
                &format!("{base}wpe.weight"),
                [config.max_positions, width],
                device,
            )?,
            blocks,
            final_norm: checkpoint.layer_norm(
                &format!("{base}ln_f"),
                width,
                config.layer_norm_eps,
                device,
            )?,
            lm_head,
        })
    }

    /// Logits of every token; with `caches`, of tokens that follow those cached.
    ///
    /// # Shapes
    /// - `input.tokens`, `input.positions`: `[batch, seq]`
    /// - output: `[batch, seq, vocab]`
    pub(crate) fn forward(
        &self,
        input: &LmInput<B>,
        mut caches: Option<&mut [KvCache<B>]>,
    ) -> Result<Tensor<B, 3>, ModelError> {
        let mut x = self.token_embedding.forward(input.tokens.clone())
            + self.position_embedding.forward(input.positions.clone());
        for (i, block) in self.blocks.iter().enumerate() {
            let cache = caches.as_deref_mut().map(|caches| &mut caches[i]);
            let attended = attend(
                &block.attention,
                block.attention_norm.forward(x.clone()),
                input,
                cache,
            )?;
            x = x + attended;
            let hidden = block.fc.forward(block.mlp_norm.forward(x.clone()));
            let hidden = match block.activation {
                Gelu::Tanh => gelu_approximate(hidden),
                Gelu::Exact => gelu(hidden),
            };
            x = x + block.projection.forward(hidden);
        }
        let x = self.final_norm.forward(x);
        Ok(lm_head(x, self.lm_head.as_ref(), &self.token_embedding))
    }
}
