//! A checkpoint directory as `save_pretrained` writes it: `config.json` and `model.safetensors`,
//! or the sharded form, `model.safetensors.index.json` naming the file of every tensor.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use attention_core::weights::{LayerWeights, StateDict, StateDictError, WeightsError, contiguous};
use attention_core::{MultiHeadAttention, MultiHeadAttentionConfig, RmsNorm, RmsNormConfig};
use burn::module::Param;
use burn::nn::{Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::prelude::*;
use tensor_files::{FileError, MAX_JSON_BYTES};
use thiserror::Error;

use crate::config::{ConfigError, ModelConfig, SpecialTokens};

/// Why a checkpoint directory could not be loaded.
#[derive(Debug, Error)]
pub enum LoadError {
    /// A file could not be read: absent, not a regular file (a FIFO would block the reader
    /// forever), or larger than a JSON file is read.
    #[error(transparent)]
    File(#[from] FileError),
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

impl From<StateDictError> for LoadError {
    fn from(error: StateDictError) -> Self {
        Self::Weights(error.into())
    }
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
        if name == "generation_config.json" && !exists(&path) {
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
    if exists(&single) {
        return Ok(StateDict::load(&single)?);
    }
    let index = dir.join("model.safetensors.index.json");
    if !exists(&index) {
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

/// A JSON file of the directory: a regular file of at most [`MAX_JSON_BYTES`].
fn read_text(path: &Path) -> Result<String, LoadError> {
    Ok(tensor_files::read_text(path, MAX_JSON_BYTES)?)
}

/// Whether something is at `path` (after links): a FIFO or a directory there is then read, and
/// refused by name, rather than taken for an absent file.
fn exists(path: &Path) -> bool {
    std::fs::metadata(path).is_ok()
}

/// How a checkpoint stores an attention layer's query, key and value projections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum QkvTensors {
    /// As [`LayerWeights::to_layer`] reads them: `q_proj`, `k_proj`, `v_proj` (the Llama family),
    /// or GPT-2's `c_attn`.
    ByLayout,
    /// Phi-3's `qkv_proj.weight`, the three `nn.Linear` weights' rows one after the other
    /// (`[(heads + 2 · kv_heads) · head_dim, width]`), no biases.
    Fused,
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
    /// ([`LayerWeights::to_layer`], which reads the query and key norms `q_norm`, `k_norm` when
    /// `config` has them), or of Phi-3's fused `qkv_proj` ([`QkvTensors`]); any other tensor
    /// under `prefix` is unexpected.
    pub(crate) fn attention<B: Backend>(
        &mut self,
        prefix: &str,
        config: &MultiHeadAttentionConfig,
        qkv: QkvTensors,
        device: &B::Device,
    ) -> Result<MultiHeadAttention<B>, LoadError> {
        let sub = self.dict.split_prefix(prefix);
        let qk_norm = config.qk_norm.is_some();
        let known = |key: &str| {
            let param = key.trim_end_matches(".weight").trim_end_matches(".bias");
            let projection = match qkv {
                QkvTensors::ByLayout => {
                    ["q_proj", "k_proj", "v_proj", "o_proj", "c_attn", "c_proj"].contains(&param)
                }
                // Phi-3's projections have no biases.
                QkvTensors::Fused => ["qkv_proj.weight", "o_proj.weight"].contains(&key),
            };
            (key.ends_with(".weight") || key.ends_with(".bias")) && projection
                // Read by `to_layer`; Phi-3 has no q/k norms.
                || qk_norm
                    && qkv == QkvTensors::ByLayout
                    && ["q_norm.weight", "k_norm.weight"].contains(&key)
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
        let named = |error: WeightsError| LoadError::from(error.with_key_prefix(prefix));
        let mut layer = match qkv {
            QkvTensors::ByLayout => sub.to_layer(config, device).map_err(named)?,
            QkvTensors::Fused => {
                // Both tensors read (their shapes checked) before the layer is allocated from
                // the config's sizes; saturating, a size past usize matches no tensor.
                let head_dim = config.head_dim();
                let query_width = config.num_heads.saturating_mul(head_dim);
                let kv_width = config.num_kv_heads().saturating_mul(head_dim);
                // `[q | k | v]` rows, each block an nn.Linear's `[out, in]`.
                let rows = kv_width.saturating_mul(2).saturating_add(query_width);
                let fused = sub
                    .tensor_shaped::<B, 2>("qkv_proj.weight", [rows, config.input_dim], device)
                    .map_err(|error| named(error.into()))?;
                let output = sub
                    .tensor_shaped::<B, 2>(
                        "o_proj.weight",
                        [config.output_dim, query_width],
                        device,
                    )
                    .map_err(|error| named(error.into()))?;
                let mut layer = config
                    .try_init::<B>(device)
                    .map_err(|error| named(error.into()))?;
                for (linear, start, rows) in [
                    (&mut layer.query_layer, 0, query_width),
                    (&mut layer.key_layer, query_width, kv_width),
                    (&mut layer.value_layer, query_width + kv_width, kv_width),
                ] {
                    linear.weight =
                        Param::from_tensor(fused.clone().narrow(0, start, rows).transpose());
                    linear.bias = None;
                }
                layer.output_layer.weight = Param::from_tensor(output.transpose());
                layer.output_layer.bias = None;
                layer
            }
        };
        // Burn 0.21 workaround. Stored anew: transposed (nn.Linear) or narrowed (GPT-2's c_attn, Phi-3's qkv_proj)
        // views give wrong one-token products on Burn 0.21's wgpu backend, i.e. wrong cached
        // decoding.
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

/// A size `config.json` gives, and the tensor dimension that must equal it.
pub(crate) struct Size {
    /// The field (or fields, for a product) it comes from.
    pub field: &'static str,
    /// Its value; `None` when a product of fields overflows.
    pub value: Option<usize>,
    /// The tensor.
    pub key: String,
    /// Which of its dimensions.
    pub dim: usize,
}

impl Checkpoint {
    /// Checks the config's sizes against the tensors before any is allocated: the number of
    /// layers (`{layer_prefix}{i}.` names, field `layers.0`) and each of `sizes`. A tensor that
    /// is absent is left to the loader, which names it.
    pub(crate) fn check_sizes(
        &self,
        layer_prefix: &str,
        (layers_field, layers): (&'static str, usize),
        sizes: &[Size],
    ) -> Result<(), LoadError> {
        let error = |field: &'static str, value: String, found: String| LoadError::Config {
            path: "config.json".into(),
            source: ConfigError::Weights {
                field,
                value,
                found,
            },
        };
        let held = self
            .dict
            .keys()
            .filter_map(|key| {
                key.strip_prefix(layer_prefix)?
                    .split('.')
                    .next()?
                    .parse()
                    .ok()
            })
            .map(|layer: usize| layer.saturating_add(1))
            .max()
            .unwrap_or(0);
        if held != layers {
            return Err(error(
                layers_field,
                layers.to_string(),
                format!(
                    "they hold {held} layers (`{layer_prefix}0.` to `{layer_prefix}{}.`)",
                    held.saturating_sub(1)
                ),
            ));
        }
        for size in sizes {
            let Some(shape) = self.dict.shape(&size.key) else {
                continue;
            };
            let found = shape.get(size.dim).copied();
            if size.value.is_none() || found != size.value {
                let value = size
                    .value
                    .map_or_else(|| "a product past usize".to_string(), |v| v.to_string());
                return Err(error(
                    size.field,
                    value,
                    format!("`{}` has shape {shape:?}", size.key),
                ));
            }
        }
        Ok(())
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

    /// `nn.Linear`s stored as one (Phi-3's `gate_up_proj`): `{prefix}.weight`
    /// `[sum of outputs, input]`, whose consecutive blocks of rows are the layers, without biases.
    pub(crate) fn fused_linears<B: Backend, const N: usize>(
        &mut self,
        prefix: &str,
        input: usize,
        outputs: [usize; N],
        device: &B::Device,
    ) -> Result<[Linear<B>; N], LoadError> {
        let rows = outputs
            .iter()
            .fold(0usize, |sum, &rows| sum.saturating_add(rows));
        let weight = self.tensor::<B, 2>(&format!("{prefix}.weight"), [rows, input], device)?;
        let mut start = 0;
        Ok(outputs.map(|rows| {
            let block = weight.clone().narrow(0, start, rows);
            start += rows;
            linear_layer(block.transpose(), None, device)
        }))
    }

    fn linear_from<B: Backend>(
        &mut self,
        prefix: &str,
        weight: Tensor<B, 2>,
        bias: bool,
        device: &B::Device,
    ) -> Result<Linear<B>, LoadError> {
        let [_, output] = weight.dims();
        let bias = if bias {
            Some(self.tensor(&format!("{prefix}.bias"), [output], device)?)
        } else {
            None
        };
        Ok(linear_layer(weight, bias, device))
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
        config: &RmsNormConfig,
        device: &B::Device,
    ) -> Result<RmsNorm<B>, LoadError> {
        let mut norm = config.init(device);
        norm.gamma =
            Param::from_tensor(self.tensor(&format!("{prefix}.weight"), [config.width], device)?);
        Ok(norm)
    }
}

/// A linear layer of `weight` (Burn's layout, `[in, out]`, stored anew: see
/// [`Checkpoint::attention`]) and `bias`.
fn linear_layer<B: Backend>(
    weight: Tensor<B, 2>,
    bias: Option<Tensor<B, 1>>,
    device: &B::Device,
) -> Linear<B> {
    let [input, output] = weight.dims();
    let mut linear = LinearConfig::new(input, output)
        .with_bias(false)
        .init(device);
    linear.weight = Param::from_tensor(contiguous(weight));
    linear.bias = bias.map(Param::from_tensor);
    linear
}
