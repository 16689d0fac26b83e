//! GPT-2 (`GPT2LMHeadModel`) as a [`Decoder`]: learned positions, LayerNorm, a GELU MLP
//! (`c_fc`, `c_proj`, stored as `Conv1D`: `[in, out]`) and an LM head tied to the token
//! embedding.

use attention_core::MultiHeadAttentionConfig;
use burn::nn::DropoutConfig;
use burn::prelude::*;
use gpt::{Decoder, DecoderBlock, Mlp, Norm, PlainMlp};

use crate::checkpoint::{Checkpoint, LoadError, QkvTensors, Size};
use crate::config::Gpt2Config;

/// Builds GPT-2 from a checkpoint's tensors (named with or without `transformer.`).
pub(crate) fn load<B: Backend>(
    config: &Gpt2Config,
    checkpoint: &mut Checkpoint,
    device: &B::Device,
) -> Result<Decoder<B>, LoadError> {
    let base = if checkpoint.contains("transformer.wte.weight") {
        "transformer."
    } else {
        ""
    };
    let [width, mlp] = [config.width, config.mlp_width];
    let size = |field, value, key: &str, dim| Size {
        field,
        value: Some(value),
        key: format!("{base}{key}"),
        dim,
    };
    checkpoint.check_sizes(
        &format!("{base}h."),
        ("n_layer", config.num_layers),
        &[
            size("vocab_size", config.vocab_size, "wte.weight", 0),
            size("n_embd", width, "wte.weight", 1),
            size("n_positions", config.max_positions, "wpe.weight", 0),
            size("n_inner", mlp, "h.0.mlp.c_fc.weight", 1),
        ],
    )?;
    let attention =
        MultiHeadAttentionConfig::new(width, width, config.max_positions, config.num_heads)
            .with_qkv_bias(true);
    attention.validate().map_err(|e| LoadError::Config {
        path: "config.json".into(),
        source: e.into(),
    })?;
    let layer_norm = |checkpoint: &mut Checkpoint, name: &str| {
        let norm = checkpoint.layer_norm(name, width, config.layer_norm_eps, device)?;
        Ok::<_, LoadError>(Norm::Layer(norm))
    };
    let blocks = (0..config.num_layers)
        .map(|i| {
            let prefix = format!("{base}h.{i}.");
            Ok(DecoderBlock::pre_norm(
                layer_norm(checkpoint, &format!("{prefix}ln_1"))?,
                checkpoint.attention(
                    &format!("{prefix}attn."),
                    &attention,
                    QkvTensors::ByLayout,
                    device,
                )?,
                layer_norm(checkpoint, &format!("{prefix}ln_2"))?,
                Mlp::Plain(PlainMlp {
                    fc: checkpoint.conv1d(&format!("{prefix}mlp.c_fc"), [width, mlp], device)?,
                    projection: checkpoint.conv1d(
                        &format!("{prefix}mlp.c_proj"),
                        [mlp, width],
                        device,
                    )?,
                    activation: config.activation,
                    packed_fc: Default::default(),
                    packed_projection: Default::default(),
                }),
            ))
        })
        .collect::<Result<_, LoadError>>()?;
    Ok(Decoder {
        token_embedding: checkpoint.embedding(
            &format!("{base}wte.weight"),
            [config.vocab_size, width],
            device,
        )?,
        embedding_scale: None,
        position_embedding: Some(checkpoint.embedding(
            &format!("{base}wpe.weight"),
            [config.max_positions, width],
            device,
        )?),
        dropout: DropoutConfig::new(0.0).init(),
        blocks,
        final_norm: layer_norm(checkpoint, &format!("{base}ln_f"))?,
        lm_head: checkpoint.lm_head(
            config.tie_word_embeddings,
            [width, config.vocab_size],
            device,
        )?,
        logit_softcap: None,
        packed_lm_head: Default::default(),
    })
}
