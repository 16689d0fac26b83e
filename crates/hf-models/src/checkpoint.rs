//! A checkpoint directory as `save_pretrained` writes it: `config.json` and `model.safetensors`,
//! or the sharded form, `model.safetensors.index.json` naming the file of every tensor.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use attention_core::weights::{StateDict, WeightsError, contiguous};
use attention_core::{MultiHeadAttention, MultiHeadAttentionConfig};
use burn::module::Param;
use burn::nn::{
    Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig, RmsNorm,
    RmsNormConfig,
};
use burn::prelude::*;
use thiserror::Error;

use crate::config::{ConfigError, ModelConfig, SpecialTokens};

/// Why a checkpoint directory could not be loaded.
#[derive(Debug, Error)]
pub enum LoadError {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// `config.json` is invalid or asks for something not implemented.
    #[error("{path}: {source}")]
    Config {
        /// The config file.
        path: PathBuf,
        /// What is wrong with it.
        source: ConfigError,
    },
    /// Neither `model.safetensors` nor `model.safetensors.index.json` is there.
    #[error(
        "{dir} holds no weights: expected model.safetensors or model.safetensors.index.json \
         (save_pretrained with safe_serialization)"
    )]
    NoWeights {
        /// The directory.
        dir: PathBuf,
    },
    /// The shard index is not what `save_pretrained` writes.
    #[error("{path}: {problem}")]
    Index {
        /// The index file.
        path: PathBuf,
        /// What is wrong with it.
        problem: String,
    },
    /// A tensor is missing, mis-shaped, of the wrong type, or a file is malformed.
    #[error(transparent)]
    Weights(#[from] WeightsError),
    /// Tensors the architecture does not have (a checkpoint of another model, or of a variant
    /// this crate does not implement).
    #[error("the checkpoint has tensors a {architecture} model does not: {keys:?}")]
    UnexpectedTensors {
        /// The architecture read from `config.json`.
        architecture: &'static str,
        /// The first few unexpected names.
        keys: Vec<String>,
    },
}

/// Reads `dir/config.json`.
pub fn read_config(dir: &Path) -> Result<ModelConfig, LoadError> {
    let path = dir.join("config.json");
    let text = read_text(&path)?;
    ModelConfig::from_json(&text).map_err(|source| LoadError::Config { path, source })
}

/// The end-of-sequence and pad ids of `dir/config.json`, overridden by those of
/// `dir/generation_config.json` when there is one.
pub fn read_special_tokens(dir: &Path) -> Result<SpecialTokens, LoadError> {
    let mut tokens = SpecialTokens::default();
    for name in ["config.json", "generation_config.json"] {
        let path = dir.join(name);
        if name == "generation_config.json" && !path.is_file() {
            continue;
        }
        let text = read_text(&path)?;
        tokens
            .update_from_json(&text)
            .map_err(|source| LoadError::Config { path, source })?;
    }
    Ok(tokens)
}

/// Reads every tensor of the checkpoint: `model.safetensors`, or each shard that
/// `model.safetensors.index.json` names.
pub fn read_weights(dir: &Path) -> Result<StateDict, LoadError> {
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(StateDict::load(&single)?);
    }
    let index = dir.join("model.safetensors.index.json");
    if !index.is_file() {
        return Err(LoadError::NoWeights {
            dir: dir.to_path_buf(),
        });
    }
    let index_error = |problem: String| LoadError::Index {
        path: index.clone(),
        problem,
    };
    let value: serde_json::Value =
        serde_json::from_str(&read_text(&index)?).map_err(|e| index_error(e.to_string()))?;
    let map = value
        .get("weight_map")
        .and_then(serde_json::Value::as_object)
        .ok_or_else(|| index_error("no `weight_map` object".into()))?;
    let mut shards = BTreeSet::new();
    for (key, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| index_error(format!("`{key}` maps to {file}, not a file name")))?;
        // A shard is a file beside the index, never a path elsewhere.
        if file.contains(['/', '\\']) || file.starts_with('.') || !file.ends_with(".safetensors") {
            return Err(index_error(format!(
                "`{key}` maps to {file:?}, not a .safetensors file name in the directory"
            )));
        }
        shards.insert(file.to_string());
    }
    let mut tensors = Vec::new();
    for shard in &shards {
        let dict = StateDict::load(dir.join(shard))?;
        for (key, data) in dict.into_tensors() {
            match map.get(&key).and_then(serde_json::Value::as_str) {
                Some(listed) if listed == shard => tensors.push((key, data)),
                _ => {
                    return Err(index_error(format!(
                        "{shard} holds `{key}`, which the index does not place in it"
                    )));
                }
            }
        }
    }
    if tensors.len() != map.len() {
        let found: BTreeSet<&str> = tensors.iter().map(|(key, _)| key.as_str()).collect();
        let missing: Vec<&String> = map
            .keys()
            .filter(|k| !found.contains(k.as_str()))
            .take(5)
            .collect();
        return Err(index_error(format!(
            "tensors listed but in no shard: {missing:?}"
        )));
    }
    Ok(StateDict::from_tensors(tensors))
}

fn read_text(path: &Path) -> Result<String, LoadError> {
    std::fs::read_to_string(path).map_err(|source| LoadError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// A checkpoint's tensors, taken by the model that loads them; whatever is left at the end is
/// an error ([`LoadError::UnexpectedTensors`]).
pub(crate) struct Checkpoint {
    dict: StateDict,
    used: BTreeSet<String>,
    architecture: &'static str,
}

/// Buffers transformers writes beside the weights but recomputes: GPT-2's causal masks, old
/// Llama checkpoints' rotary frequencies.
const RECOMPUTED: [&str; 3] = ["attn.bias", "attn.masked_bias", "rotary_emb.inv_freq"];

impl Checkpoint {
    pub(crate) fn new(dict: StateDict, architecture: &'static str) -> Self {
        Self {
            dict,
            used: BTreeSet::new(),
            architecture,
        }
    }

    /// Whether the checkpoint has `key`.
    pub(crate) fn contains(&self, key: &str) -> bool {
        self.dict.contains(key)
    }

    /// The tensor `key`, which must have shape `shape`.
    pub(crate) fn tensor<B: Backend, const D: usize>(
        &mut self,
        key: &str,
        shape: [usize; D],
        device: &B::Device,
    ) -> Result<Tensor<B, D>, LoadError> {
        let tensor = self.dict.tensor_shaped(key, shape, device)?;
        self.used.insert(key.to_string());
        Ok(tensor)
    }

    /// Marks `key` as read without loading it (a tied LM head's copy of the embedding).
    fn skip(&mut self, key: &str) {
        self.used.insert(key.to_string());
    }

    /// The attention layer whose tensors are named `prefix` + the names of its layout
    /// ([`StateDict::to_layer`]); any other tensor under `prefix` is unexpected.
    pub(crate) fn attention<B: Backend>(
        &mut self,
        prefix: &str,
        config: &MultiHeadAttentionConfig,
        device: &B::Device,
    ) -> Result<MultiHeadAttention<B>, LoadError> {
        let sub = self.dict.split_prefix(prefix);
        let known = |key: &str| {
            let param = key.trim_end_matches(".weight").trim_end_matches(".bias");
            let projection = ["q_proj", "k_proj", "v_proj", "o_proj", "c_attn", "c_proj"];
            (key.ends_with(".weight") || key.ends_with(".bias")) && projection.contains(&param)
                || RECOMPUTED
                    .iter()
                    .any(|buffer| format!("{prefix}{key}").ends_with(buffer))
        };
        if let Some(key) = sub.keys().find(|key| !known(key)) {
            return Err(LoadError::UnexpectedTensors {
                architecture: self.architecture,
                keys: vec![format!("{prefix}{key}")],
            });
        }
        let mut layer = sub.to_layer(config, device).map_err(|error| {
            LoadError::from(match error {
                WeightsError::MissingKey { key } => WeightsError::MissingKey {
                    key: format!("{prefix}{key}"),
                },
                WeightsError::Shape {
                    key,
                    expected,
                    found,
                    hint,
                } => WeightsError::Shape {
                    key: format!("{prefix}{key}"),
                    expected,
                    found,
                    hint,
                },
                other => other,
            })
        })?;
        // Stored anew: transposed (nn.Linear) or narrowed (GPT-2's c_attn) views give wrong
        // one-token products on Burn 0.21's wgpu backend, i.e. wrong cached decoding.
        for linear in [
            &mut layer.query_layer,
            &mut layer.key_layer,
            &mut layer.value_layer,
            &mut layer.output_layer,
        ] {
            linear.weight = Param::from_tensor(contiguous(linear.weight.val()));
        }
        Ok(layer)
    }

    /// Errors when tensors are left that the model did not take.
    pub(crate) fn finish(self) -> Result<(), LoadError> {
        let keys: Vec<String> = self
            .dict
            .keys()
            .filter(|key| !self.used.contains(*key))
            .filter(|key| !RECOMPUTED.iter().any(|buffer| key.ends_with(buffer)))
            .take(8)
            .map(str::to_string)
            .collect();
        if keys.is_empty() {
            Ok(())
        } else {
            Err(LoadError::UnexpectedTensors {
                architecture: self.architecture,
                keys,
            })
        }
    }
}

/// The layers both architectures are made of, read from their PyTorch names.
impl Checkpoint {
    /// An `nn.Linear` (`weight` `[out, in]`, transposed into Burn's `[in, out]`).
    pub(crate) fn linear<B: Backend>(
        &mut self,
        prefix: &str,
        [input, output]: [usize; 2],
        bias: bool,
        device: &B::Device,
    ) -> Result<Linear<B>, LoadError> {
        let weight = self.tensor::<B, 2>(&format!("{prefix}.weight"), [output, input], device)?;
        self.linear_from(prefix, weight.transpose(), bias, device)
    }

    /// GPT-2's `Conv1D` (`weight` `[in, out]`, as Burn stores it) with its bias.
    pub(crate) fn conv1d<B: Backend>(
        &mut self,
        prefix: &str,
        [input, output]: [usize; 2],
        device: &B::Device,
    ) -> Result<Linear<B>, LoadError> {
        let weight = self.tensor::<B, 2>(&format!("{prefix}.weight"), [input, output], device)?;
        self.linear_from(prefix, weight, true, device)
    }

    fn linear_from<B: Backend>(
        &mut self,
        prefix: &str,
        weight: Tensor<B, 2>,
        bias: bool,
        device: &B::Device,
    ) -> Result<Linear<B>, LoadError> {
        let [input, output] = weight.dims();
        let bias = if bias {
            Some(Param::from_tensor(self.tensor(
                &format!("{prefix}.bias"),
                [output],
                device,
            )?))
        } else {
            None
        };
        let mut linear = LinearConfig::new(input, output)
            .with_bias(false)
            .init(device);
        linear.weight = Param::from_tensor(contiguous(weight));
        linear.bias = bias;
        Ok(linear)
    }

    /// The LM head `lm_head` (`[width, vocab]` in Burn's layout), or `None` when it is tied to
    /// the token embedding (a copy of it in the file is then ignored, as transformers ties it).
    pub(crate) fn lm_head<B: Backend>(
        &mut self,
        tied: bool,
        shape: [usize; 2],
        device: &B::Device,
    ) -> Result<Option<Linear<B>>, LoadError> {
        if tied {
            self.skip("lm_head.weight");
            Ok(None)
        } else {
            self.linear("lm_head", shape, false, device).map(Some)
        }
    }

    /// An `nn.Embedding` of `count` vectors of `width`.
    pub(crate) fn embedding<B: Backend>(
        &mut self,
        key: &str,
        [count, width]: [usize; 2],
        device: &B::Device,
    ) -> Result<Embedding<B>, LoadError> {
        let mut embedding = EmbeddingConfig::new(1, 1).init(device);
        embedding.weight = Param::from_tensor(self.tensor(key, [count, width], device)?);
        Ok(embedding)
    }

    /// An `nn.LayerNorm` (`weight`, `bias`).
    pub(crate) fn layer_norm<B: Backend>(
        &mut self,
        prefix: &str,
        width: usize,
        epsilon: f64,
        device: &B::Device,
    ) -> Result<LayerNorm<B>, LoadError> {
        let mut norm = LayerNormConfig::new(width)
            .with_epsilon(epsilon)
            .init(device);
        norm.gamma =
            Param::from_tensor(self.tensor(&format!("{prefix}.weight"), [width], device)?);
        norm.beta = Some(Param::from_tensor(self.tensor(
            &format!("{prefix}.bias"),
            [width],
            device,
        )?));
        Ok(norm)
    }

    /// An RMSNorm (`weight`).
    pub(crate) fn rms_norm<B: Backend>(
        &mut self,
        prefix: &str,
        width: usize,
        epsilon: f64,
        device: &B::Device,
    ) -> Result<RmsNorm<B>, LoadError> {
        let mut norm = RmsNormConfig::new(width).with_epsilon(epsilon).init(device);
        norm.gamma =
            Param::from_tensor(self.tensor(&format!("{prefix}.weight"), [width], device)?);
        Ok(norm)
    }
}
