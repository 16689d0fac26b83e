//! PyTorch weights in and out: `.safetensors` files and `torch.save(state_dict)` `.pt` files,
//! in the source chapter's layout or Hugging Face GPT-2's.
//!
//! | layout | keys | weight storage |
//! |---|---|---|
//! | [`WeightsLayout::Chapter`] | `query_layer.weight` `[O, I]`, `query_layer.bias` `[O]` (iff `qkv_bias`), the same for `key_layer`, `value_layer`, `output_layer` (bias always), a `mask` buffer `[C, C]` (ignored) | `nn.Linear`: `[out, in]` |
//! | [`WeightsLayout::Gpt2`] | `c_attn.weight` `[d, 3d]`, `c_attn.bias` `[3d]` (Q, K, V column blocks), `c_proj.weight` `[d, d]`, `c_proj.bias` `[d]` | `Conv1D`: `[in, out]` |
//!
//! ```no_run
//! use attention_core::weights::StateDict;
//! use burn::backend::NdArray;
//!
//! let device = Default::default();
//! let dict = StateDict::load("model.pt")?;
//! let config = dict.infer_config(2, dict.mask_context_length().unwrap_or(1024))?;
//! let layer = dict.to_layer::<NdArray>(&config, &device)?;
//! # Ok::<(), attention_core::weights::WeightsError>(())
//! ```

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::module::Param;
use burn::nn::Linear;
use burn::prelude::*;
use burn::tensor::DType;
use burn::tensor::backend::AutodiffBackend;
use burn_store::{ModuleStore, PytorchStore, SafetensorsStore};
use thiserror::Error;

use crate::error::AttentionError;
use crate::mha::{MultiHeadAttention, MultiHeadAttentionConfig};

/// What went wrong reading weights or fitting them to a layer.
#[derive(Debug, Error)]
pub enum WeightsError {
    /// The file could not be read as the format its name says.
    #[error("cannot read {path}: {message}")]
    Read {
        /// The file.
        path: PathBuf,
        /// What the reader said.
        message: String,
    },
    /// The file name ends neither in `.safetensors` nor in `.pt`/`.pth`/`.bin`.
    #[error("{path}: unknown weights format (expected .safetensors, .pt, .pth or .bin)")]
    UnknownFormat {
        /// The file.
        path: PathBuf,
    },
    /// The keys are neither the chapter's nor GPT-2's.
    #[error(
        "no attention weights found: expected `query_layer.weight` (the chapter's layout) or \
         `c_attn.weight` (GPT-2's); the file has {keys:?}"
    )]
    UnknownLayout {
        /// The keys the file has.
        keys: Vec<String>,
    },
    /// A key the layer needs is absent.
    #[error("missing key `{key}`")]
    MissingKey {
        /// The key.
        key: String,
    },
    /// A key that the config says should not be there (a Q/K/V bias without `qkv_bias`).
    #[error("unexpected key `{key}`: {reason}")]
    UnexpectedKey {
        /// The key.
        key: String,
        /// Why it does not fit.
        reason: String,
    },
    /// A tensor's shape is not the one the layer needs.
    #[error("`{key}` has shape {found:?}, expected {expected:?}")]
    Shape {
        /// The key.
        key: String,
        /// The shape the layer needs.
        expected: Vec<usize>,
        /// The shape in the file.
        found: Vec<usize>,
    },
    /// A tensor is not floating point.
    #[error("`{key}` has dtype {dtype:?}, expected a float tensor")]
    DType {
        /// The key.
        key: String,
        /// Its dtype.
        dtype: DType,
    },
    /// The config built from (or given for) the weights is invalid.
    #[error("weights do not fit the config: {0}")]
    Config(#[from] AttentionError),
}

/// Which PyTorch module the keys come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightsLayout {
    /// The source chapter's `MultiHeadAttention`: separate `nn.Linear` Q, K, V, output layers.
    Chapter,
    /// Hugging Face's `GPT2Attention`: fused `c_attn` and `c_proj`, stored as `Conv1D`.
    Gpt2,
}

/// A PyTorch state dict (or any safetensors file): named tensors, read eagerly.
#[derive(Debug, Clone)]
pub struct StateDict {
    path: PathBuf,
    tensors: BTreeMap<String, TensorData>,
}

impl StateDict {
    /// Reads every tensor of a `.safetensors` file or a `torch.save` `.pt`/`.pth`/`.bin` file.
    pub fn load(path: impl AsRef<Path>) -> Result<Self, WeightsError> {
        let path = path.as_ref().to_path_buf();
        let read_error = |message: String| WeightsError::Read {
            path: path.clone(),
            message,
        };
        if !path.is_file() {
            return Err(read_error("no such file".into()));
        }
        let extension = path.extension().and_then(|e| e.to_str()).unwrap_or("");
        let snapshots = match extension {
            "safetensors" => SafetensorsStore::from_file(&path)
                .get_all_snapshots()
                .cloned()
                .map_err(|e| read_error(e.to_string()))?,
            "pt" | "pth" | "bin" => PytorchStore::from_file(&path)
                .get_all_snapshots()
                .cloned()
                .map_err(|e| read_error(e.to_string()))?,
            _ => return Err(WeightsError::UnknownFormat { path }),
        };
        let mut tensors = BTreeMap::new();
        for (key, snapshot) in snapshots {
            let data = snapshot
                .to_data()
                .map_err(|e| read_error(format!("`{key}`: {e}")))?;
            tensors.insert(key, data);
        }
        Ok(Self { path, tensors })
    }

    /// A state dict from tensors already in memory (named as PyTorch names them).
    pub fn from_tensors(tensors: impl IntoIterator<Item = (String, TensorData)>) -> Self {
        Self {
            path: PathBuf::from("<memory>"),
            tensors: tensors.into_iter().collect(),
        }
    }

    /// The file it was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The tensor names, sorted.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// The raw tensor `key`, as stored, if present.
    pub fn data(&self, key: &str) -> Option<&TensorData> {
        self.tensors.get(key)
    }

    /// The shape of `key`, if present.
    pub fn shape(&self, key: &str) -> Option<&[usize]> {
        self.tensors.get(key).map(|data| data.shape.as_slice())
    }

    /// The tensor `key` as a float tensor on `device`, checked for its number of dimensions.
    pub fn tensor<B: Backend, const D: usize>(
        &self,
        key: &str,
        device: &B::Device,
    ) -> Result<Tensor<B, D>, WeightsError> {
        let data = self
            .tensors
            .get(key)
            .ok_or_else(|| WeightsError::MissingKey {
                key: key.to_string(),
            })?;
        if !data.dtype.is_float() {
            return Err(WeightsError::DType {
                key: key.to_string(),
                dtype: data.dtype,
            });
        }
        if data.shape.len() != D {
            return Err(WeightsError::Shape {
                key: key.to_string(),
                expected: vec![0; D],
                found: data.shape.to_vec(),
            });
        }
        let data = data.clone().convert::<B::FloatElem>();
        Ok(Tensor::from_data(data, device))
    }

    /// Like [`tensor`](Self::tensor), checking the exact shape.
    fn tensor_shaped<B: Backend, const D: usize>(
        &self,
        key: &str,
        expected: [usize; D],
        device: &B::Device,
    ) -> Result<Tensor<B, D>, WeightsError> {
        if let Some(found) = self.shape(key)
            && found != expected
        {
            return Err(WeightsError::Shape {
                key: key.to_string(),
                expected: expected.to_vec(),
                found: found.to_vec(),
            });
        }
        self.tensor(key, device)
    }

    /// Which module the keys come from.
    pub fn layout(&self) -> Result<WeightsLayout, WeightsError> {
        if self.tensors.contains_key("query_layer.weight") {
            Ok(WeightsLayout::Chapter)
        } else if self.tensors.contains_key("c_attn.weight") {
            Ok(WeightsLayout::Gpt2)
        } else {
            Err(WeightsError::UnknownLayout {
                keys: self.tensors.keys().cloned().collect(),
            })
        }
    }

    /// The context length of the chapter's `mask` buffer `[C, C]`, if the file has one.
    pub fn mask_context_length(&self) -> Option<usize> {
        self.shape("mask").map(|shape| shape[0])
    }

    /// The config these weights fit, given what a state dict does not record: the number of heads
    /// and the context length. Sizes and `qkv_bias` come from the tensors; dropout is 0.
    pub fn infer_config(
        &self,
        num_heads: usize,
        context_length: usize,
    ) -> Result<MultiHeadAttentionConfig, WeightsError> {
        let weight_shape = |key: &str| {
            let shape = self.shape(key).ok_or_else(|| WeightsError::MissingKey {
                key: key.to_string(),
            })?;
            match *shape {
                [rows, cols] => Ok((rows, cols)),
                _ => Err(WeightsError::Shape {
                    key: key.to_string(),
                    expected: vec![0, 0],
                    found: shape.to_vec(),
                }),
            }
        };
        let config = match self.layout()? {
            WeightsLayout::Chapter => {
                let (output_dim, input_dim) = weight_shape("query_layer.weight")?;
                MultiHeadAttentionConfig::new(input_dim, output_dim, context_length, num_heads)
                    .with_qkv_bias(self.tensors.contains_key("query_layer.bias"))
            }
            WeightsLayout::Gpt2 => {
                let (width, _) = weight_shape("c_attn.weight")?;
                MultiHeadAttentionConfig::new(width, width, context_length, num_heads)
                    .with_qkv_bias(true)
            }
        };
        config.validate()?;
        Ok(config)
    }

    /// A layer for `config` with these weights, in whichever layout they are. Every key the
    /// layer needs must be present with the shape `config` implies.
    pub fn to_layer<B: Backend>(
        &self,
        config: &MultiHeadAttentionConfig,
        device: &B::Device,
    ) -> Result<MultiHeadAttention<B>, WeightsError> {
        let params = match self.layout()? {
            WeightsLayout::Chapter => self.chapter_params(config, device)?,
            WeightsLayout::Gpt2 => self.gpt2_params(config, device)?,
        };
        params.into_layer(config)
    }

    fn chapter_params<B: Backend>(
        &self,
        config: &MultiHeadAttentionConfig,
        device: &B::Device,
    ) -> Result<AttentionParams<B>, WeightsError> {
        let (input, output) = (config.input_dim, config.output_dim);
        let linear = |name: &str, input: usize, has_bias: bool| {
            // nn.Linear stores [out, in]; Burn's Linear wants [in, out].
            let weight = self
                .tensor_shaped::<B, 2>(&format!("{name}.weight"), [output, input], device)?
                .transpose();
            let bias_key = format!("{name}.bias");
            let bias = match (has_bias, self.tensors.contains_key(&bias_key)) {
                (true, _) => Some(self.tensor_shaped::<B, 1>(&bias_key, [output], device)?),
                (false, false) => None,
                (false, true) => {
                    return Err(WeightsError::UnexpectedKey {
                        key: bias_key,
                        reason: "the config has qkv_bias = false".into(),
                    });
                }
            };
            Ok(LinearParams { weight, bias })
        };
        Ok(AttentionParams {
            query: linear("query_layer", input, config.qkv_bias)?,
            key: linear("key_layer", input, config.qkv_bias)?,
            value: linear("value_layer", input, config.qkv_bias)?,
            output: linear("output_layer", output, true)?,
        })
    }

    fn gpt2_params<B: Backend>(
        &self,
        config: &MultiHeadAttentionConfig,
        device: &B::Device,
    ) -> Result<AttentionParams<B>, WeightsError> {
        let width = config.output_dim;
        if config.input_dim != width || !config.qkv_bias {
            return Err(WeightsError::UnexpectedKey {
                key: "c_attn.weight".into(),
                reason: format!(
                    "GPT-2 attention needs input_dim = output_dim and qkv_bias, the config has \
                     input_dim = {}, output_dim = {width}, qkv_bias = {}",
                    config.input_dim, config.qkv_bias
                ),
            });
        }
        // Conv1D stores [in, out], as Burn's Linear does; Q, K, V are column blocks.
        let qkv_weight = self.tensor_shaped::<B, 2>("c_attn.weight", [width, 3 * width], device)?;
        let qkv_bias = self.tensor_shaped::<B, 1>("c_attn.bias", [3 * width], device)?;
        let block = |i: usize| LinearParams {
            weight: qkv_weight.clone().narrow(1, i * width, width),
            bias: Some(qkv_bias.clone().narrow(0, i * width, width)),
        };
        Ok(AttentionParams {
            query: block(0),
            key: block(1),
            value: block(2),
            output: LinearParams {
                weight: self.tensor_shaped("c_proj.weight", [width, width], device)?,
                bias: Some(self.tensor_shaped("c_proj.bias", [width], device)?),
            },
        })
    }
}

/// A linear layer's weight (Burn's layout, `[in, out]`) and optional bias.
#[derive(Debug, Clone)]
pub struct LinearParams<B: Backend> {
    /// `[in, out]`
    pub weight: Tensor<B, 2>,
    /// `[out]`
    pub bias: Option<Tensor<B, 1>>,
}

/// The four projections' parameters — or their gradients — in Burn's layout, the bridge between a
/// [`MultiHeadAttention`] and a PyTorch state dict in either [`WeightsLayout`].
#[derive(Debug, Clone)]
pub struct AttentionParams<B: Backend> {
    /// `query_layer`
    pub query: LinearParams<B>,
    /// `key_layer`
    pub key: LinearParams<B>,
    /// `value_layer`
    pub value: LinearParams<B>,
    /// `output_layer`
    pub output: LinearParams<B>,
}

impl<B: Backend> AttentionParams<B> {
    /// The layer's current parameters.
    pub fn of(layer: &MultiHeadAttention<B>) -> Self {
        let linear = |layer: &Linear<B>| LinearParams {
            weight: layer.weight.val(),
            bias: layer.bias.as_ref().map(Param::val),
        };
        Self {
            query: linear(&layer.query_layer),
            key: linear(&layer.key_layer),
            value: linear(&layer.value_layer),
            output: linear(&layer.output_layer),
        }
    }

    /// A layer with these parameters, after checking that they fit `config`.
    pub fn into_layer(
        self,
        config: &MultiHeadAttentionConfig,
    ) -> Result<MultiHeadAttention<B>, WeightsError> {
        let device = self.output.weight.device();
        let mut layer = config.try_init::<B>(&device)?;
        let assign = |target: &mut Linear<B>, params: LinearParams<B>| {
            target.weight = Param::from_tensor(params.weight);
            target.bias = params.bias.map(Param::from_tensor);
        };
        assign(&mut layer.query_layer, self.query);
        assign(&mut layer.key_layer, self.key);
        assign(&mut layer.value_layer, self.value);
        assign(&mut layer.output_layer, self.output);
        Ok(layer)
    }

    /// The state dict of these parameters in `layout`, named and shaped as PyTorch writes them.
    ///
    /// In GPT-2's layout, a layer without QKV bias is written with a zero `c_attn.bias` (the same
    /// function); GPT-2's layout needs `input_dim = output_dim`.
    pub fn to_state_dict(&self, layout: WeightsLayout) -> Vec<(String, TensorData)> {
        let bias_or_zeros = |linear: &LinearParams<B>| {
            linear.bias.clone().unwrap_or_else(|| {
                Tensor::zeros([linear.weight.dims()[1]], &linear.weight.device())
            })
        };
        match layout {
            WeightsLayout::Chapter => {
                let mut dict = Vec::new();
                for (name, linear) in [
                    ("query_layer", &self.query),
                    ("key_layer", &self.key),
                    ("value_layer", &self.value),
                    ("output_layer", &self.output),
                ] {
                    let weight = linear.weight.clone().transpose(); // [out, in]
                    dict.push((format!("{name}.weight"), weight.into_data()));
                    if let Some(bias) = &linear.bias {
                        dict.push((format!("{name}.bias"), bias.to_data()));
                    }
                }
                dict
            }
            WeightsLayout::Gpt2 => {
                let blocks = [&self.query, &self.key, &self.value];
                let weight = Tensor::cat(blocks.map(|l| l.weight.clone()).to_vec(), 1);
                let bias = Tensor::cat(blocks.map(bias_or_zeros).to_vec(), 0);
                vec![
                    ("c_attn.weight".into(), weight.into_data()),
                    ("c_attn.bias".into(), bias.into_data()),
                    ("c_proj.weight".into(), self.output.weight.to_data()),
                    (
                        "c_proj.bias".into(),
                        bias_or_zeros(&self.output).into_data(),
                    ),
                ]
            }
        }
    }
}

impl<B: AutodiffBackend> AttentionParams<B> {
    /// The gradients of the layer's parameters after `loss.backward()`; a parameter that did not
    /// take part in the loss gets zeros.
    pub fn grads_of(
        layer: &MultiHeadAttention<B>,
        grads: &B::Gradients,
    ) -> AttentionParams<B::InnerBackend> {
        let grad_2 = |param: &Param<Tensor<B, 2>>| {
            param
                .grad(grads)
                .unwrap_or_else(|| param.val().inner().zeros_like())
        };
        let linear = |layer: &Linear<B>| LinearParams {
            weight: grad_2(&layer.weight),
            bias: layer.bias.as_ref().map(|bias| {
                bias.grad(grads)
                    .unwrap_or_else(|| bias.val().inner().zeros_like())
            }),
        };
        AttentionParams {
            query: linear(&layer.query_layer),
            key: linear(&layer.key_layer),
            value: linear(&layer.value_layer),
            output: linear(&layer.output_layer),
        }
    }
}
