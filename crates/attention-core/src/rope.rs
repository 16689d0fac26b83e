//! Rotary position embeddings (RoPE): queries and keys turned by angles that grow with their
//! position, so that `q · k` depends on how far apart they are, as Llama, Qwen2 and Mistral do.
//!
//! Pairs of features `(a, b)` of a head are rotated by `angle = position · inv_freq[i]`:
//! `(a cos − b sin, b cos + a sin)`. Which features pair up is the [`RopeLayout`]; the inverse
//! frequencies are `theta^(−2i / head_dim)`, optionally rescaled ([`RopeScaling`]). The
//! arithmetic follows Hugging Face's float32 rounding: inverse frequencies rounded to `f32`, the
//! angle a float32 product of position and frequency.

use burn::prelude::*;
use burn::tensor::{DType, Int};

use crate::error::AttentionError;

/// Which features of a head form the rotated pairs.
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum RopeLayout {
    /// Feature `i` with feature `i + head_dim / 2` (Hugging Face's `rotate_half`): what Hugging
    /// Face checkpoints of Llama, Qwen2 and Mistral need.
    Half,
    /// Features `2i` and `2i + 1` (Meta's original Llama, GPT-J, Burn's `RotaryEncoding`).
    Interleaved,
}

/// How the inverse frequencies are rescaled for contexts longer than training's.
#[derive(Config, Debug, PartialEq)]
pub enum RopeScaling {
    /// `theta^(−2i / head_dim)` as it is (Hugging Face's `rope_type: "default"`).
    None,
    /// Every inverse frequency divided by `factor` (`rope_type: "linear"`).
    Linear {
        /// The divisor, at least 1 in practice; must be finite and positive.
        factor: f64,
    },
    /// Llama 3's scaling (`rope_type: "llama3"`).
    Llama3(Llama3Scaling),
}

/// Llama 3's scaling of the inverse frequencies (transformers' `_compute_llama3_parameters`):
/// high frequencies kept, low ones divided by `factor`, a smooth blend between.
#[derive(Config, Debug, PartialEq)]
pub struct Llama3Scaling {
    /// The divisor of the low frequencies.
    pub factor: f64,
    /// Wavelengths above `original_max_position_embeddings / low_freq_factor` are divided.
    pub low_freq_factor: f64,
    /// Wavelengths below `original_max_position_embeddings / high_freq_factor` are kept.
    pub high_freq_factor: f64,
    /// The context length the model was trained with.
    pub original_max_position_embeddings: usize,
}

impl Llama3Scaling {
    fn validate(&self) -> Result<(), AttentionError> {
        positive("factor", self.factor)?;
        positive("low_freq_factor", self.low_freq_factor)?;
        positive("high_freq_factor", self.high_freq_factor)?;
        positive(
            "original_max_position_embeddings",
            self.original_max_position_embeddings as f64,
        )?;
        if self.high_freq_factor <= self.low_freq_factor {
            return Err(AttentionError::RopeParameter {
                name: "high_freq_factor (must exceed low_freq_factor)",
                value: self.high_freq_factor,
            });
        }
        Ok(())
    }

    fn scale(&self, inverse: f64) -> f64 {
        let original = self.original_max_position_embeddings as f64;
        let wavelength = 2.0 * std::f64::consts::PI / inverse;
        if wavelength < original / self.high_freq_factor {
            inverse
        } else if wavelength > original / self.low_freq_factor {
            inverse / self.factor
        } else {
            let smooth = (original / wavelength - self.low_freq_factor)
                / (self.high_freq_factor - self.low_freq_factor);
            (1.0 - smooth) * inverse / self.factor + smooth * inverse
        }
    }
}

/// `Ok` for a finite positive `value`, else the error naming `name`.
fn positive(name: &'static str, value: f64) -> Result<(), AttentionError> {
    if value.is_finite() && value > 0.0 {
        Ok(())
    } else {
        Err(AttentionError::RopeParameter { name, value })
    }
}

impl RopeScaling {
    /// Hugging Face's `rope_scaling` / `rope_parameters` JSON (`{"rope_type": "llama3",
    /// "factor": 8.0, …}`; `"type"` is accepted for `"rope_type"`, as transformers 4 wrote it).
    /// A missing or `"default"` type is no scaling; any other type is an error naming it.
    pub fn from_hugging_face(json: &str) -> Result<Self, AttentionError> {
        let invalid = |reason: String| AttentionError::RopeScaling(reason);
        let value: serde_json::Value =
            serde_json::from_str(json).map_err(|e| invalid(format!("not JSON: {e}")))?;
        let object = value
            .as_object()
            .ok_or_else(|| invalid("expected a JSON object".into()))?;
        let number = |key: &str| {
            object
                .get(key)
                .and_then(serde_json::Value::as_f64)
                .ok_or_else(|| invalid(format!("`{key}` must be a number")))
        };
        let kind = object
            .get("rope_type")
            .or_else(|| object.get("type"))
            .map(|kind| kind.as_str().unwrap_or("?"))
            .unwrap_or("default");
        match kind {
            "default" => Ok(Self::None),
            "linear" => Ok(Self::Linear {
                factor: number("factor")?,
            }),
            "llama3" => Ok(Self::Llama3(Llama3Scaling {
                factor: number("factor")?,
                low_freq_factor: number("low_freq_factor")?,
                high_freq_factor: number("high_freq_factor")?,
                original_max_position_embeddings: object
                    .get("original_max_position_embeddings")
                    .and_then(serde_json::Value::as_u64)
                    .ok_or_else(|| {
                        invalid("`original_max_position_embeddings` must be a whole number".into())
                    })? as usize,
            })),
            other => Err(AttentionError::RopeType(other.to_string())),
        }
    }
}

/// Rotary position embeddings of a [`MultiHeadAttention`](crate::MultiHeadAttention).
#[derive(Config, Debug, PartialEq)]
pub struct RopeConfig {
    /// The base of the inverse frequencies. Default: `10000.0`.
    #[config(default = 10000.0)]
    pub theta: f64,
    /// Which features pair up. Default: [`RopeLayout::Half`], Hugging Face's.
    #[config(default = "RopeLayout::Half")]
    pub layout: RopeLayout,
    /// Rescaling of the inverse frequencies. Default: none.
    #[config(default = "RopeScaling::None")]
    pub scaling: RopeScaling,
}

impl RopeConfig {
    /// Checks the config for heads of `head_dim` features: an even width, a finite `theta` above
    /// 1, finite positive factors.
    pub fn validate(&self, head_dim: usize) -> Result<(), AttentionError> {
        if !head_dim.is_multiple_of(2) {
            return Err(AttentionError::RopeOddHeadDim(head_dim));
        }
        if !(self.theta.is_finite() && self.theta > 1.0) {
            return Err(AttentionError::RopeParameter {
                name: "theta",
                value: self.theta,
            });
        }
        match &self.scaling {
            RopeScaling::None => Ok(()),
            RopeScaling::Linear { factor } => positive("factor", *factor),
            RopeScaling::Llama3(llama3) => llama3.validate(),
        }
    }

    /// The `head_dim / 2` inverse frequencies, after scaling, rounded to `f32` as Hugging Face
    /// stores them.
    pub fn inverse_frequencies(&self, head_dim: usize) -> Vec<f32> {
        (0..head_dim / 2)
            .map(|i| {
                // HF: `1 / theta ** (arange(0, hd, 2) / hd)` in float32.
                let exponent = (2 * i) as f32 / head_dim as f32;
                let inverse = 1.0 / self.theta.powf(f64::from(exponent));
                self.scale(inverse) as f32
            })
            .collect()
    }

    fn scale(&self, inverse: f64) -> f64 {
        match &self.scaling {
            RopeScaling::None => inverse,
            RopeScaling::Linear { factor } => inverse / factor,
            RopeScaling::Llama3(llama3) => llama3.scale(inverse),
        }
    }
}

/// A layer's rotary embedding, ready to apply: its layout and inverse frequencies.
#[derive(Debug, Clone)]
pub(crate) struct Rotary {
    layout: RopeLayout,
    inverse_frequencies: Vec<f32>,
}

/// The positions of a forward call's tokens, for the rotary embedding.
#[derive(Debug, Clone)]
pub(crate) enum Positions<B: Backend> {
    /// `start, start + 1, …` in every row.
    From(usize),
    /// Per row: `[batch, seq]`.
    Given(Tensor<B, 2, Int>),
}

impl Rotary {
    pub(crate) fn new(config: &RopeConfig, head_dim: usize) -> Self {
        Self {
            layout: config.layout,
            inverse_frequencies: config.inverse_frequencies(head_dim),
        }
    }

    /// `cos` and `sin` of every position's angles, `[batch or 1, seq, 1, head_dim / 2]` each,
    /// in `dtype` (the queries' float type).
    fn cos_sin<B: Backend>(
        &self,
        positions: &Positions<B>,
        seq: usize,
        dtype: DType,
        device: &B::Device,
    ) -> (Tensor<B, 4>, Tensor<B, 4>) {
        let half = self.inverse_frequencies.len();
        let floats = |values: Vec<f32>, len: usize| {
            Tensor::<B, 1>::from_data(TensorData::new(values, [len]).convert_dtype(dtype), device)
        };
        let positions: Tensor<B, 2> = match positions {
            Positions::From(start) => {
                let rows: Vec<f32> = (*start..start + seq).map(|p| p as f32).collect();
                floats(rows, seq).reshape([1, seq])
            }
            Positions::Given(positions) => positions.clone().float().cast(dtype),
        };
        let rows = positions.dims()[0];
        let inverse = floats(self.inverse_frequencies.clone(), half).reshape([1, 1, 1, half]);
        // A float32 product, as Hugging Face's angle.
        let angles = positions.reshape([rows, seq, 1, 1]) * inverse;
        (angles.clone().cos(), angles.sin())
    }

    /// Turns every head of `x` by its position's angles.
    ///
    /// # Shapes
    /// - `x`: `[batch, seq, heads, head_dim]`; positions: `[batch, seq]` when given
    /// - output: `[batch, seq, heads, head_dim]`
    pub(crate) fn apply<B: Backend>(
        &self,
        x: Tensor<B, 4>,
        positions: &Positions<B>,
    ) -> Tensor<B, 4> {
        let [batch, seq, heads, head_dim] = x.dims();
        let half = head_dim / 2;
        let (cos, sin) = self.cos_sin(positions, seq, x.dtype(), &x.device());
        match self.layout {
            RopeLayout::Half => {
                let first = x.clone().narrow(3, 0, half);
                let second = x.narrow(3, half, half);
                Tensor::cat(
                    vec![
                        first.clone() * cos.clone() - second.clone() * sin.clone(),
                        second * cos + first * sin,
                    ],
                    3,
                )
            }
            RopeLayout::Interleaved => {
                let pairs = x.reshape([batch, seq, heads, half, 2]);
                let first = pairs.clone().narrow(4, 0, 1).squeeze_dim::<4>(4);
                let second = pairs.narrow(4, 1, 1).squeeze_dim::<4>(4);
                Tensor::stack::<5>(
                    vec![
                        first.clone() * cos.clone() - second.clone() * sin.clone(),
                        second * cos + first * sin,
                    ],
                    4,
                )
                .reshape([batch, seq, heads, head_dim])
            }
        }
    }
}
