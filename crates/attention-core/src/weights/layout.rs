//! The layouts a PyTorch attention module's weights come in, mapped to and from a layer.

use burn::module::Param;
use burn::nn::Linear;
use burn::prelude::*;

use state_dict::{StateDict, StateDictError};

use super::WeightsError;
use crate::error::AttentionError;
use crate::mha::{MultiHeadAttention, MultiHeadAttentionConfig};
use crate::qk_norm::{QkNorm, QkNormConfig, QkNormScope};

/// The key of the sinks' logits, `[num_heads]`, in every layout that has them (gpt-oss names them
/// `self_attn.sinks`).
const SINKS: &str = "sinks";

/// Which PyTorch module the keys come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightsLayout {
    /// The source chapter's `MultiHeadAttention`: separate `nn.Linear` Q, K, V, output layers
    /// (and this crate's q/k norms as `query_norm.weight`, `key_norm.weight`: the layer's field
    /// names, with PyTorch's `nn.RMSNorm` parameter name).
    Chapter,
    /// Hugging Face's `GPT2Attention`: fused `c_attn` and `c_proj`, stored as `Conv1D`.
    Gpt2,
    /// Hugging Face's Llama-family attention (`LlamaAttention`, `Qwen2Attention`,
    /// `MistralAttention`, `Qwen3Attention`, `Olmo2Attention`, …): separate `nn.Linear` `q_proj`,
    /// `k_proj`, `v_proj`, `o_proj` (key/value ones with `num_kv_heads` heads), and the q/k
    /// RMSNorms' `q_norm.weight`, `k_norm.weight` where the family has them.
    Llama,
}

impl WeightsLayout {
    /// The key prefixes of the query, key, value and output projections and of the query and key
    /// norms, for the layouts of separate `nn.Linear` layers.
    fn linear_names(self) -> Option<([&'static str; 4], [&'static str; 2])> {
        match self {
            Self::Chapter => Some((
                ["query_layer", "key_layer", "value_layer", "output_layer"],
                ["query_norm", "key_norm"],
            )),
            Self::Llama => Some((
                ["q_proj", "k_proj", "v_proj", "o_proj"],
                ["q_norm", "k_norm"],
            )),
            Self::Gpt2 => None,
        }
    }
}

/// What a [`StateDict`] says about one attention layer: its layout, the config its weights fit,
/// and the layer itself. A trait because the state dict is `state-dict`'s type; bring it into
/// scope with `use attention_core::weights::LayerWeights`.
pub trait LayerWeights {
    /// Which module the keys come from.
    fn layout(&self) -> Result<WeightsLayout, WeightsError>;

    /// The config these weights fit, given what a state dict does not record: the number of
    /// (query) heads and the context length. Sizes, the head width, the key/value heads and the
    /// biases come from the tensors; dropout is 0; no RoPE and no window (a state dict does not
    /// record them either: set them on the returned config).
    ///
    /// Query and key norm weights (`q_norm.weight` and `k_norm.weight` in the Llama layout) give
    /// [`qk_norm`](MultiHeadAttentionConfig::qk_norm): per head
    /// ([`QkNormScope::Head`], Qwen3, Gemma 3) when the query norm has `head_dim` weights, over
    /// the projected width ([`QkNormScope::Width`], OLMo2) when it has `num_heads · head_dim`
    /// (with one head the two are the same computation, and `Head` is taken). A state dict does
    /// not record the norms' epsilon or convention either: the config has the default epsilon
    /// (`1e-6`) and `w` (not `1 + w`); set the model's `rms_norm_eps`, and Gemma's
    /// [`unit_offset`](QkNormConfig::unit_offset), on it.
    ///
    /// The projections' shapes are checked against each other first, so that a file whose
    /// weights are transposed or mixed up is reported by key and shape.
    fn infer_config(
        &self,
        num_heads: usize,
        context_length: usize,
    ) -> Result<MultiHeadAttentionConfig, WeightsError>;

    /// A layer for `config` with these weights, in whichever layout they are. Every key the
    /// layer needs must be present with the shape `config` implies.
    fn to_layer<B: Backend>(
        &self,
        config: &MultiHeadAttentionConfig,
        device: &B::Device,
    ) -> Result<MultiHeadAttention<B>, WeightsError>;

    /// The context length of the chapter's `mask` buffer `[C, C]`, if the file has one.
    fn mask_context_length(&self) -> Result<Option<usize>, WeightsError>;
}

impl LayerWeights for StateDict {
    fn layout(&self) -> Result<WeightsLayout, WeightsError> {
        if self.contains("query_layer.weight") {
            Ok(WeightsLayout::Chapter)
        } else if self.contains("q_proj.weight") {
            Ok(WeightsLayout::Llama)
        } else if self.contains("c_attn.weight") {
            Ok(WeightsLayout::Gpt2)
        } else {
            Err(WeightsError::UnknownLayout {
                keys: self.keys().map(str::to_string).collect(),
            })
        }
    }

    fn infer_config(
        &self,
        num_heads: usize,
        context_length: usize,
    ) -> Result<MultiHeadAttentionConfig, WeightsError> {
        let matrix = |key: &str| {
            let shape = self.shape(key).ok_or_else(|| StateDictError::MissingKey {
                key: key.to_string(),
            })?;
            match *shape {
                [rows, cols] => Ok((rows, cols)),
                _ => Err(StateDictError::Rank {
                    key: key.to_string(),
                    expected: 2,
                    found: shape.to_vec(),
                }),
            }
        };
        let expect = |key: &str, expected: [usize; 2], hint: &str| {
            let found = matrix(key)?;
            if found != (expected[0], expected[1]) {
                return Err(StateDictError::Shape {
                    key: key.to_string(),
                    expected: expected.to_vec(),
                    found: vec![found.0, found.1],
                    hint: format!(" ({hint})"),
                });
            }
            Ok(())
        };
        let layout = self.layout()?;
        let config = match layout.linear_names() {
            Some(([query, key, value, output], norms)) => {
                let weight = |name: &str| format!("{name}.weight");
                let (query_width, input_dim) = matrix(&weight(query))?;
                let hint = format!(
                    "{query}.weight is [{query_width}, {input_dim}], i.e. {query_width} query \
                     features from {input_dim} inputs: nn.Linear stores [out, in]"
                );
                let (kv_width, _) = matrix(&weight(key))?;
                expect(&weight(key), [kv_width, input_dim], &hint)?;
                expect(&weight(value), [kv_width, input_dim], &hint)?;
                let (output_dim, _) = matrix(&weight(output))?;
                expect(&weight(output), [output_dim, query_width], &hint)?;
                if !query_width.is_multiple_of(num_heads.max(1)) {
                    return Err(AttentionError::HeadsDoNotDivide {
                        output_dim: query_width,
                        num_heads,
                    }
                    .into());
                }
                let head_dim = query_width / num_heads.max(1);
                if head_dim == 0 || !kv_width.is_multiple_of(head_dim) || kv_width == 0 {
                    return Err(StateDictError::Shape {
                        key: weight(key),
                        expected: vec![head_dim, input_dim],
                        found: vec![kv_width, input_dim],
                        hint: format!(
                            " (its rows are key/value heads of head_dim = {head_dim}: \
                             {query_width} query features / {num_heads} heads)"
                        ),
                    }
                    .into());
                }
                let kv_heads = kv_width / head_dim;
                let mut config =
                    MultiHeadAttentionConfig::new(input_dim, output_dim, context_length, num_heads)
                        .with_qkv_bias(self.contains(&format!("{query}.bias")))
                        .with_output_bias(self.contains(&format!("{output}.bias")));
                if kv_heads != num_heads {
                    config.num_kv_heads = Some(kv_heads);
                }
                if query_width != output_dim {
                    config.head_dim = Some(head_dim);
                }
                config.qk_norm = infer_qk_norm(self, norms, head_dim, [query_width, kv_width])?;
                config.sinks = self.contains(SINKS);
                config
            }
            None => {
                let (width, columns) = matrix("c_attn.weight")?;
                let hint = format!(
                    "c_attn.weight is [{width}, {columns}]: GPT-2's Conv1D stores [in, out] with \
                     out = 3 · in"
                );
                expect("c_attn.weight", [width, 3 * width], &hint)?;
                expect("c_proj.weight", [width, width], &hint)?;
                MultiHeadAttentionConfig::new(width, width, context_length, num_heads)
                    .with_qkv_bias(true)
            }
        };
        config.validate()?;
        Ok(config)
    }

    fn to_layer<B: Backend>(
        &self,
        config: &MultiHeadAttentionConfig,
        device: &B::Device,
    ) -> Result<MultiHeadAttention<B>, WeightsError> {
        let layout = self.layout()?;
        let params = match layout.linear_names() {
            Some((names, norms)) => linear_params(self, names, norms, config, device)?,
            None => gpt2_params(self, config, device)?,
        };
        params.into_layer(config)
    }

    /// The context length of the chapter's `mask` buffer `[C, C]`, if the file has one.
    fn mask_context_length(&self) -> Result<Option<usize>, WeightsError> {
        match self.shape("mask") {
            None => Ok(None),
            Some(&[rows, cols]) if rows == cols && rows > 0 => Ok(Some(rows)),
            Some(found) => Err(StateDictError::Shape {
                key: "mask".into(),
                expected: vec![found.first().copied().unwrap_or(1).max(1); 2],
                found: found.to_vec(),
                hint: " (the chapter's causal mask buffer is square: [context_length, context_length])"
                    .into(),
            }
            .into()),
        }
    }
}

/// The q/k norms of weights whose norm keys are `{query}.weight` and `{key}.weight`, if they
/// have them: their scope from the query norm's length, checked against the key norm's.
fn infer_qk_norm(
    dict: &StateDict,
    [query, key]: [&str; 2],
    head_dim: usize,
    [query_width, kv_width]: [usize; 2],
) -> Result<Option<QkNormConfig>, WeightsError> {
    let [query, key] = [query, key].map(|name| format!("{name}.weight"));
    let (query_shape, key_shape) = match (dict.shape(&query), dict.shape(&key)) {
        (None, None) => return Ok(None),
        (Some(_), None) => return Err(StateDictError::MissingKey { key }.into()),
        (None, Some(_)) => return Err(StateDictError::MissingKey { key: query }.into()),
        (Some(query_shape), Some(key_shape)) => (query_shape, key_shape),
    };
    let scope = match *query_shape {
        [width] if width == head_dim => QkNormScope::Head,
        [width] if width == query_width => QkNormScope::Width,
        _ => {
            return Err(StateDictError::Shape {
                key: query,
                expected: vec![head_dim],
                found: query_shape.to_vec(),
                hint: format!(
                    " (a norm per head has head_dim = {head_dim} weights, one over the \
                         projected width num_heads · head_dim = {query_width})"
                ),
            }
            .into());
        }
    };
    let key_width = match scope {
        QkNormScope::Head => head_dim,
        QkNormScope::Width => kv_width,
    };
    if key_shape != [key_width] {
        return Err(StateDictError::Shape {
            key,
            expected: vec![key_width],
            found: key_shape.to_vec(),
            hint: format!(
                " (the query norm's {} weights make it a {scope:?} norm)",
                query_shape[0]
            ),
        }
        .into());
    }
    Ok(Some(QkNormConfig::new(scope)))
}

/// The projections (and q/k norms) of a layout of separate `nn.Linear` layers named `names`,
/// with norms named `norms`.
fn linear_params<B: Backend>(
    dict: &StateDict,
    [query, key, value, output]: [&str; 4],
    [query_norm, key_norm]: [&str; 2],
    config: &MultiHeadAttentionConfig,
    device: &B::Device,
) -> Result<AttentionParams<B>, WeightsError> {
    let input = config.input_dim;
    let query_width = config.num_heads * config.head_dim();
    let kv_width = config.num_kv_heads() * config.head_dim();
    let linear = |name: &str, [rows, cols]: [usize; 2], has_bias: bool, flag: &str| {
        // nn.Linear stores [out, in]; Burn's Linear wants [in, out].
        let weight = dict
            .tensor_shaped::<B, 2>(&format!("{name}.weight"), [rows, cols], device)?
            .transpose();
        let bias_key = format!("{name}.bias");
        let bias = match (has_bias, dict.contains(&bias_key)) {
            (true, _) => Some(dict.tensor_shaped::<B, 1>(&bias_key, [rows], device)?),
            (false, false) => None,
            (false, true) => {
                return Err(StateDictError::UnexpectedKey {
                    key: bias_key,
                    reason: format!("the config has {flag} = false"),
                });
            }
        };
        Ok(LinearParams { weight, bias })
    };
    // A norm's weight: required with `qk_norm`, refused without it.
    let norm = |name: &str, width: usize| -> Result<Option<Tensor<B, 1>>, WeightsError> {
        let key = format!("{name}.weight");
        match &config.qk_norm {
            Some(_) => Ok(Some(dict.tensor_shaped::<B, 1>(&key, [width], device)?)),
            None if dict.contains(&key) => Err(StateDictError::UnexpectedKey {
                key,
                reason: "the config has no qk_norm".into(),
            }
            .into()),
            None => Ok(None),
        }
    };
    let sinks = match (config.sinks, dict.contains(SINKS)) {
        (true, _) => Some(dict.tensor_shaped::<B, 1>(SINKS, [config.num_heads], device)?),
        (false, false) => None,
        (false, true) => {
            return Err(StateDictError::UnexpectedKey {
                key: SINKS.into(),
                reason: "the config has sinks = false".into(),
            }
            .into());
        }
    };
    let (query_norm_width, key_norm_width) = match config.qk_norm.as_ref().map(|n| n.scope) {
        Some(QkNormScope::Width) => (query_width, kv_width),
        _ => (config.head_dim(), config.head_dim()),
    };
    Ok(AttentionParams {
        query: linear(query, [query_width, input], config.qkv_bias, "qkv_bias")?,
        key: linear(key, [kv_width, input], config.qkv_bias, "qkv_bias")?,
        value: linear(value, [kv_width, input], config.qkv_bias, "qkv_bias")?,
        output: linear(
            output,
            [config.output_dim, query_width],
            config.output_bias,
            "output_bias",
        )?,
        query_norm: norm(query_norm, query_norm_width)?,
        key_norm: norm(key_norm, key_norm_width)?,
        sinks,
    })
}

fn gpt2_params<B: Backend>(
    dict: &StateDict,
    config: &MultiHeadAttentionConfig,
    device: &B::Device,
) -> Result<AttentionParams<B>, WeightsError> {
    let width = config.output_dim;
    let plain = config.num_kv_heads() == config.num_heads
        && config.head_dim() * config.num_heads == width
        && config.output_bias
        && config.qk_norm.is_none()
        && !config.sinks;
    if config.input_dim != width || !config.qkv_bias || !plain {
        return Err(StateDictError::UnexpectedKey {
            key: "c_attn.weight".into(),
            reason: format!(
                "GPT-2 attention needs input_dim = output_dim, qkv_bias, output_bias, \
                     plain heads, no q/k norms and no sinks, the config has input_dim = {}, \
                     output_dim = {width}, qkv_bias = {}, {config:?}",
                config.input_dim, config.qkv_bias
            ),
        }
        .into());
    }
    // Conv1D stores [in, out], as Burn's Linear does; Q, K, V are column blocks.
    let qkv_weight = dict.tensor_shaped::<B, 2>("c_attn.weight", [width, 3 * width], device)?;
    let qkv_bias = dict.tensor_shaped::<B, 1>("c_attn.bias", [3 * width], device)?;
    let block = |i: usize| LinearParams {
        weight: qkv_weight.clone().narrow(1, i * width, width),
        bias: Some(qkv_bias.clone().narrow(0, i * width, width)),
    };
    Ok(AttentionParams {
        query: block(0),
        key: block(1),
        value: block(2),
        output: LinearParams {
            weight: dict.tensor_shaped("c_proj.weight", [width, width], device)?,
            bias: Some(dict.tensor_shaped("c_proj.bias", [width], device)?),
        },
        query_norm: None,
        key_norm: None,
        sinks: None,
    })
}

/// A linear layer's weight (Burn's layout, `[in, out]`) and optional bias.
#[derive(Debug, Clone)]
pub struct LinearParams<B: Backend> {
    /// `[in, out]`
    pub weight: Tensor<B, 2>,
    /// `[out]`
    pub bias: Option<Tensor<B, 1>>,
}

/// The four projections' parameters and the q/k norms' weights — or their gradients — in Burn's
/// layout, the bridge between a [`MultiHeadAttention`] and a PyTorch state dict in any
/// [`WeightsLayout`].
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
    /// `query_norm`'s weight, if the layer has q/k norms: `[head_dim]` or
    /// `[num_heads · head_dim]`.
    pub query_norm: Option<Tensor<B, 1>>,
    /// `key_norm`'s weight, if the layer has q/k norms: `[head_dim]` or
    /// `[num_kv_heads · head_dim]`.
    pub key_norm: Option<Tensor<B, 1>>,
    /// The sinks' logits, if the layer has sinks: `[num_heads]`.
    pub sinks: Option<Tensor<B, 1>>,
}

impl<B: Backend> AttentionParams<B> {
    /// The layer's current parameters.
    pub fn of(layer: &MultiHeadAttention<B>) -> Self {
        Self::read(layer, Param::val, Param::val)
    }

    /// One tensor per parameter of `layer` (of backend `L`): `matrix` of each projection's
    /// weight, `vector` of its bias, the q/k norms' scales and the sinks.
    pub(super) fn read<L: Backend>(
        layer: &MultiHeadAttention<L>,
        matrix: impl Fn(&Param<Tensor<L, 2>>) -> Tensor<B, 2>,
        vector: impl Fn(&Param<Tensor<L, 1>>) -> Tensor<B, 1>,
    ) -> Self {
        let linear = |layer: &Linear<L>| LinearParams {
            weight: matrix(&layer.weight),
            bias: layer.bias.as_ref().map(&vector),
        };
        let norm = |norm: &Option<QkNorm<L>>| norm.as_ref().map(|norm| vector(&norm.gamma));
        Self {
            query: linear(&layer.query_layer),
            key: linear(&layer.key_layer),
            value: linear(&layer.value_layer),
            output: linear(&layer.output_layer),
            query_norm: norm(&layer.query_norm),
            key_norm: norm(&layer.key_norm),
            sinks: layer.sinks.as_ref().map(&vector),
        }
    }

    /// A layer with these parameters, after checking that they fit `config` (the q/k norms'
    /// weights: present with the config's `qk_norm` and of its width, absent without).
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
        assign_norm(&mut layer.query_norm, self.query_norm, "query_norm")?;
        assign_norm(&mut layer.key_norm, self.key_norm, "key_norm")?;
        match (&mut layer.sinks, self.sinks) {
            (Some(target), Some(sinks)) => {
                let [heads] = sinks.dims();
                if heads != config.num_heads {
                    return Err(StateDictError::shape(SINKS, &[config.num_heads], &[heads]).into());
                }
                *target = Param::from_tensor(sinks);
            }
            (None, None) => {}
            (Some(_), None) => return Err(StateDictError::MissingKey { key: SINKS.into() }.into()),
            (None, Some(_)) => {
                return Err(StateDictError::UnexpectedKey {
                    key: SINKS.into(),
                    reason: "the config has sinks = false".into(),
                }
                .into());
            }
        }
        Ok(layer)
    }

    /// The state dict of these parameters in `layout`, named and shaped as PyTorch writes them;
    /// the q/k norms' weights as `q_norm.weight` and `k_norm.weight` in the Llama layout
    /// (`query_norm.weight`, `key_norm.weight` in the chapter's), the sinks as `sinks`.
    ///
    /// In GPT-2's layout, a layer without QKV bias is written with a zero `c_attn.bias` (the same
    /// function); GPT-2's layout needs `input_dim = output_dim` and has no place for q/k norms
    /// (their weights are left out).
    pub fn to_state_dict(&self, layout: WeightsLayout) -> Vec<(String, TensorData)> {
        let bias_or_zeros = |linear: &LinearParams<B>| {
            linear.bias.clone().unwrap_or_else(|| {
                Tensor::zeros([linear.weight.dims()[1]], &linear.weight.device())
            })
        };
        match layout.linear_names() {
            Some(([query, key, value, output], [query_norm, key_norm])) => {
                let mut dict = Vec::new();
                for (name, linear) in [
                    (query, &self.query),
                    (key, &self.key),
                    (value, &self.value),
                    (output, &self.output),
                ] {
                    let weight = linear.weight.clone().transpose(); // [out, in]
                    dict.push((format!("{name}.weight"), weight.into_data()));
                    if let Some(bias) = &linear.bias {
                        dict.push((format!("{name}.bias"), bias.to_data()));
                    }
                }
                for (name, norm) in [(query_norm, &self.query_norm), (key_norm, &self.key_norm)] {
                    if let Some(weight) = norm {
                        dict.push((format!("{name}.weight"), weight.to_data()));
                    }
                }
                if let Some(sinks) = &self.sinks {
                    dict.push((SINKS.into(), sinks.to_data()));
                }
                dict
            }
            None => {
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

/// Puts the loaded `weight` into a layer's q/k norm `target` (made by the config, so present iff
/// the config has `qk_norm`), checking that one comes with the other and its width.
fn assign_norm<B: Backend>(
    target: &mut Option<QkNorm<B>>,
    weight: Option<Tensor<B, 1>>,
    name: &str,
) -> Result<(), WeightsError> {
    match (target, weight) {
        (Some(norm), Some(weight)) => {
            let [width] = weight.dims();
            if width != norm.width() {
                return Err(StateDictError::shape(name, &[norm.width()], &[width]).into());
            }
            norm.gamma = Param::from_tensor(weight);
            Ok(())
        }
        (None, None) => Ok(()),
        (Some(_), None) => Err(StateDictError::MissingKey {
            key: name.to_string(),
        }
        .into()),
        (None, Some(_)) => Err(StateDictError::UnexpectedKey {
            key: name.to_string(),
            reason: "the config has no qk_norm".into(),
        }
        .into()),
    }
}

/// `tensor` copied into storage of its own, in row-major order (Burn 0.21 workaround). On Burn
/// 0.21's wgpu backend a
/// transposed or narrowed view used as a weight gives wrong one-token products (the KV-cached
/// decoding steps of `hf-models`' fixtures), so inference code stores loaded weights this way.
pub fn contiguous<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> Tensor<B, D> {
    let device = tensor.device();
    Tensor::from_data(tensor.into_data(), &device)
}
