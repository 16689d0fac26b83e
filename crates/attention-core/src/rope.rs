//! Rotary position embeddings (RoPE): queries and keys turned by angles that grow with their
//! position, so that `q · k` depends on how far apart they are, as Llama, Qwen2 and Mistral do.
//!
//! Pairs of features `(a, b)` of a head are rotated by `angle = position · inv_freq[i]`:
//! `(a cos − b sin, b cos + a sin)`. Which features pair up is the [`RopeLayout`]; the inverse
//! frequencies are `theta^(−2i / rotary_dim)`, optionally rescaled ([`RopeScaling`]), where
//! `rotary_dim` is the head width, or fewer features for partial rotary embeddings (Phi-3's
//! `partial_rotary_factor`: only the first `rotary_dim` features of each head turn, the rest pass
//! through). The arithmetic follows Hugging Face's float32 rounding: inverse frequencies rounded
//! to `f32`, the angle a float32 product of position and frequency.

use std::sync::{Arc, Mutex, PoisonError};

use burn::prelude::*;
use burn::tensor::{DType, Int};

use crate::error::AttentionError;
pub use cpu_linalg::RopeLayout;
use cpu_linalg::rotated_in_place;

/// How the inverse frequencies are rescaled for contexts longer than training's.
#[derive(Config, Debug, PartialEq)]
pub enum RopeScaling {
    /// `theta^(−2i / rotary_dim)` as it is (Hugging Face's `rope_type: "default"`).
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
    /// Partial rotary embeddings: only the first `rotary_dim` features of each head turn (their
    /// inverse frequencies `theta^(−2i / rotary_dim)`, `i < rotary_dim / 2`, as transformers'
    /// Phi-3 computes them from `partial_rotary_factor`), the others pass through unchanged. Must
    /// be even and at most `head_dim`. Default: every feature (`head_dim`).
    #[config(default = "None")]
    pub rotary_dim: Option<usize>,
}

impl RopeConfig {
    /// Checks the config for heads of `head_dim` features: an even rotated width (`rotary_dim`,
    /// at least 2 and at most `head_dim`, or else `head_dim` itself), a finite `theta` above 1,
    /// finite positive factors.
    pub fn validate(&self, head_dim: usize) -> Result<(), AttentionError> {
        match self.rotary_dim {
            None if !head_dim.is_multiple_of(2) => {
                return Err(AttentionError::RopeOddHeadDim(head_dim));
            }
            None => {}
            Some(0) => return Err(AttentionError::ZeroSize { name: "rotary_dim" }),
            Some(rotary_dim) if !rotary_dim.is_multiple_of(2) => {
                return Err(AttentionError::RopeOddRotaryDim(rotary_dim));
            }
            Some(rotary_dim) if rotary_dim > head_dim => {
                return Err(AttentionError::RopeRotaryDimTooLarge {
                    rotary_dim,
                    head_dim,
                });
            }
            Some(_) => {}
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

    /// The features of a `head_dim`-wide head that turn: `rotary_dim`, or all of them.
    pub fn rotary_width(&self, head_dim: usize) -> usize {
        self.rotary_dim.unwrap_or(head_dim)
    }

    /// The `rotary_dim / 2` inverse frequencies of heads of `head_dim` features (`rotary_dim` is
    /// [`rotary_width`](Self::rotary_width)), after scaling, rounded to `f32` as Hugging Face
    /// stores them.
    pub fn inverse_frequencies(&self, head_dim: usize) -> Vec<f32> {
        let width = self.rotary_width(head_dim);
        (0..width / 2)
            .map(|i| {
                // HF: `1 / theta ** (arange(0, dim, 2) / dim)` in float32, `dim` the rotated
                // width (Phi-3's `int(head_dim * partial_rotary_factor)`).
                let exponent = (2 * i) as f32 / width as f32;
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

/// A layer's rotary embedding, ready to apply: its layout, its inverse frequencies (computed once,
/// when the layer is made; `rotary_dim / 2` of them) and a table of `cos` and `sin` by position,
/// filled as far as the layer's calls have reached. Clones of a layer share the table.
#[derive(Debug, Clone)]
pub(crate) struct Rotary {
    layout: RopeLayout,
    inverse_frequencies: Vec<f32>,
    table: Arc<Mutex<AngleTable>>,
}

/// `cos` and `sin` of positions `0..positions`, `[positions, rotary_dim / 2]` each, as float32
/// products of position and inverse frequency (Hugging Face's rounding).
#[derive(Debug, Default)]
struct AngleTable {
    cos: Vec<f32>,
    sin: Vec<f32>,
    positions: usize,
}

impl AngleTable {
    /// Grows the table to at least `positions` (doubling, so that decoding step by step fills it
    /// `O(log n)` times).
    fn reach(&mut self, positions: usize, inverse_frequencies: &[f32]) {
        if positions <= self.positions {
            return;
        }
        let target = positions.max(2 * self.positions).max(64);
        for position in self.positions..target {
            for &inverse in inverse_frequencies {
                let angle = position as f32 * inverse;
                self.cos.push(angle.cos());
                self.sin.push(angle.sin());
            }
        }
        self.positions = target;
    }
}

/// The positions of a forward call's tokens, for the rotary embedding.
#[derive(Debug, Clone)]
pub(crate) enum Positions<B: Backend> {
    /// `start, start + 1, …` in every row.
    From(usize),
    /// Per row: `[batch, seq]`.
    Given(Tensor<B, 2, Int>),
}

/// `cos` and `sin` of a call's angles, shared by its queries and keys.
///
/// # Shapes
/// - `cos`, `sin`: `[batch or 1, seq, 1, rotary_dim / 2]`
#[derive(Debug, Clone)]
pub(crate) struct Angles<B: Backend> {
    cos: Tensor<B, 4>,
    sin: Tensor<B, 4>,
}

impl Rotary {
    pub(crate) fn new(config: &RopeConfig, head_dim: usize) -> Self {
        Self {
            layout: config.layout,
            inverse_frequencies: config.inverse_frequencies(head_dim),
            table: Arc::default(),
        }
    }

    /// The angles of a call's `seq` tokens at `positions`, in `dtype` (the queries' float type):
    /// rows of the layer's table for positions counted from a start, computed on the device for
    /// positions given per row.
    pub(crate) fn angles<B: Backend>(
        &self,
        positions: &Positions<B>,
        seq: usize,
        dtype: DType,
        device: &B::Device,
    ) -> Angles<B> {
        let half = self.inverse_frequencies.len();
        let floats = |values: Vec<f32>, shape: [usize; 4]| {
            Tensor::<B, 4>::from_data(TensorData::new(values, shape).convert_dtype(dtype), device)
        };
        match positions {
            Positions::From(start) => {
                let mut table = self.table.lock().unwrap_or_else(PoisonError::into_inner);
                table.reach(start + seq, &self.inverse_frequencies);
                let rows = start * half..(start + seq) * half;
                Angles {
                    cos: floats(table.cos[rows.clone()].to_vec(), [1, seq, 1, half]),
                    sin: floats(table.sin[rows].to_vec(), [1, seq, 1, half]),
                }
            }
            Positions::Given(positions) => {
                let rows = positions.dims()[0];
                let positions = positions.clone().float().cast(dtype);
                let inverse = floats(self.inverse_frequencies.clone(), [1, 1, 1, half]);
                // A float32 product, as Hugging Face's angle.
                let angles = positions.reshape([rows, seq, 1, 1]) * inverse;
                Angles {
                    cos: angles.clone().cos(),
                    sin: angles.sin(),
                }
            }
        }
    }

    /// Turns every head of `x` by its position's angles: its first `rotary_dim` features, the
    /// others (with partial rotary embeddings) passed through.
    ///
    /// # Shapes
    /// - `x`: `[batch, seq, heads, head_dim]`
    /// - output: `[batch, seq, heads, head_dim]`
    pub(crate) fn apply<B: Backend>(&self, x: Tensor<B, 4>, angles: &Angles<B>) -> Tensor<B, 4> {
        let head_dim = x.dims()[3];
        let rotary_dim = 2 * self.inverse_frequencies.len();
        if rotary_dim == head_dim {
            return self.rotate(x, angles);
        }
        // [batch, seq, heads, rotary_dim] turned, [batch, seq, heads, head_dim − rotary_dim] kept.
        let turned = self.rotate(x.clone().narrow(3, 0, rotary_dim), angles);
        let kept = x.narrow(3, rotary_dim, head_dim - rotary_dim);
        Tensor::cat(vec![turned, kept], 3)
    }

    /// Turns every feature of every head of `x` by its position's angles.
    ///
    /// # Shapes
    /// - `x`: `[batch, seq, heads, rotary_dim]`
    /// - output: `[batch, seq, heads, rotary_dim]`
    fn rotate<B: Backend>(&self, x: Tensor<B, 4>, angles: &Angles<B>) -> Tensor<B, 4> {
        rotated_in_place(x, &angles.cos, &angles.sin, self.layout)
            .unwrap_or_else(|x| self.rotate_with_ops(x, angles))
    }

    /// [`Self::rotate`] in Burn's tensor ops: under `Autodiff`, on GPU backends, in `f64`.
    fn rotate_with_ops<B: Backend>(&self, x: Tensor<B, 4>, angles: &Angles<B>) -> Tensor<B, 4> {
        let [batch, seq, heads, width] = x.dims();
        let half = width / 2;
        let Angles { cos, sin } = angles.clone();
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
                .reshape([batch, seq, heads, width])
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::NdArray;

    use super::*;

    /// The layer's table (positions counted from a start, grown as calls reach further) gives the
    /// angles computed on the device from the same positions given per row (to the last bits: the
    /// host's and the backend's `cos` may round differently).
    #[test]
    fn the_table_gives_the_angles_of_the_positions() {
        let device = Default::default();
        let rotary = Rotary::new(&RopeConfig::new().with_theta(500_000.0), 16);
        // Within the first allocation, across a growth, past a second one, then back.
        for (start, seq) in [(0, 5), (60, 10), (70, 1), (130, 100), (3, 2)] {
            let from = rotary.angles::<NdArray>(&Positions::From(start), seq, DType::F32, &device);
            let positions: Vec<i64> = (start as i64..(start + seq) as i64).collect();
            let given = Positions::Given(Tensor::<NdArray, 2, Int>::from_data(
                TensorData::new(positions, [1, seq]),
                &device,
            ));
            let given = rotary.angles::<NdArray>(&given, seq, DType::F32, &device);
            for (table, direct) in [(from.cos, given.cos), (from.sin, given.sin)] {
                assert_eq!(table.dims(), [1, seq, 1, 8]);
                let [table, direct] =
                    [table, direct].map(|t| t.into_data().to_vec::<f32>().unwrap());
                for (i, (a, b)) in table.iter().zip(&direct).enumerate() {
                    assert!(
                        (a - b).abs() <= 2.0 * f32::EPSILON,
                        "start {start}, element {i}: table {a}, direct {b}"
                    );
                }
            }
        }
    }

    /// On the bare CPU backends a head is turned in one pass over its buffer, to the bit as
    /// Burn's ops turn it, in both layouts, for positions from a start and given per row, on a
    /// tensor alone and on one whose buffer another clone shares (which must not change).
    fn one_pass_is_burns_ops<B: Backend>() {
        let device = Default::default();
        let (batch, seq, heads, head_dim) = (2, 7, 3, 12);
        let values: Vec<f32> = (0..batch * seq * heads * head_dim)
            .map(|i| (i as f32 * 0.61).cos() * 3.0)
            .collect();
        let data = TensorData::new(values, [batch, seq, heads, head_dim]);
        let given: Vec<i64> = (0..batch * seq).map(|i| (5 * i % 13) as i64).collect();
        let given = Positions::Given(Tensor::<B, 2, Int>::from_data(
            TensorData::new(given, [batch, seq]),
            &device,
        ));
        for layout in [RopeLayout::Half, RopeLayout::Interleaved] {
            let rotary = Rotary::new(&RopeConfig::new().with_layout(layout), head_dim);
            for positions in [Positions::From(40), given.clone()] {
                let angles = rotary.angles(&positions, seq, DType::F32, &device);
                let x = Tensor::<B, 4>::from_data(data.clone(), &device);
                let expected = rotary.rotate_with_ops(x.clone(), &angles).into_data();
                let shared = x.clone();
                let turned = rotated_in_place(x, &angles.cos, &angles.sin, layout);
                let turned = turned.expect("a bare CPU backend, f32");
                let what = format!("{layout:?}, {positions:?}");
                assert_eq!(turned.into_data(), expected, "{what}");
                assert_eq!(shared.into_data(), data, "{what}: the shared clone");
                let alone = Tensor::<B, 4>::from_data(data.clone(), &device);
                assert_eq!(
                    rotary.rotate(alone, &angles).into_data(),
                    expected,
                    "{what}"
                );
            }
        }
    }

    #[test]
    fn one_pass_is_burns_ops_on_flex() {
        one_pass_is_burns_ops::<burn::backend::Flex>();
    }

    #[test]
    fn one_pass_is_burns_ops_on_ndarray() {
        one_pass_is_burns_ops::<NdArray>();
    }

    /// Phi-3's partial rotary frequencies (the spec of issue 27, transformers 5.24
    /// `Phi3RotaryEmbedding`): `rotary_dim = 4` of `head_dim = 8`, theta 10000 → `[1, 0.01]`,
    /// the exponent over the rotated width, not the head's.
    #[test]
    fn partial_rotary_frequencies_have_the_exponent_over_the_rotated_width() {
        let config = RopeConfig::new().with_rotary_dim(Some(4));
        assert_eq!(config.rotary_width(8), 4);
        assert_eq!(config.inverse_frequencies(8), [1.0, 0.01]);
        assert_eq!(RopeConfig::new().inverse_frequencies(4), [1.0, 0.01]);
    }

    /// Partial rotary embeddings leave the features from `rotary_dim` on as they are, and turn the
    /// first `rotary_dim` exactly as full RoPE turns a head of `rotary_dim` features with the
    /// same theta, in both layouts, for positions from a start and given per row.
    #[test]
    fn partial_rotary_is_full_rope_of_the_first_features() {
        let device = Default::default();
        let (batch, seq, heads, head_dim, rotary_dim) = (2, 5, 3, 10, 4);
        let shape = [batch, seq, heads, head_dim];
        let values: Vec<f32> = (0..batch * seq * heads * head_dim)
            .map(|i| (i as f32 * 0.37).sin() * 2.0)
            .collect();
        let x = Tensor::<NdArray, 4>::from_data(TensorData::new(values, shape), &device);
        let given: Vec<i64> = (0..batch * seq).map(|i| (7 * i % 11) as i64).collect();
        let given = Positions::Given(Tensor::<NdArray, 2, Int>::from_data(
            TensorData::new(given, [batch, seq]),
            &device,
        ));
        for layout in [RopeLayout::Half, RopeLayout::Interleaved] {
            let config = RopeConfig::new().with_theta(500.0).with_layout(layout);
            let partial = Rotary::new(&config.clone().with_rotary_dim(Some(rotary_dim)), head_dim);
            let full = Rotary::new(&config, rotary_dim);
            for positions in [Positions::From(3), given.clone()] {
                let turned = partial.apply(
                    x.clone(),
                    &partial.angles(&positions, seq, DType::F32, &device),
                );
                let expected = full.apply(
                    x.clone().narrow(3, 0, rotary_dim),
                    &full.angles(&positions, seq, DType::F32, &device),
                );
                let what = format!("{layout:?}, {positions:?}");
                assert_eq!(turned.dims(), shape, "{what}");
                assert_eq!(
                    turned.clone().narrow(3, 0, rotary_dim).into_data(),
                    expected.into_data(),
                    "{what}: the rotated features"
                );
                let rest = head_dim - rotary_dim;
                assert_eq!(
                    turned.narrow(3, rotary_dim, rest).into_data(),
                    x.clone().narrow(3, rotary_dim, rest).into_data(),
                    "{what}: the features passed through"
                );
            }
        }
    }
}
