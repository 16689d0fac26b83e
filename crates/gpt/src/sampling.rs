//! How the next token is chosen from a row of logits: greedy, or a seeded draw after
//! transformers' processors in their order (temperature, top-k, top-p). [`Sampler::pick_rows`]
//! chooses where the logits are (on a GPU backend, on the GPU) and reads back only the ids;
//! [`Sampler::pick`] is the same rule on the host, for one row.

use burn::prelude::*;
use burn::tensor::TensorData;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use thiserror::Error;

/// How the next token is chosen.
#[derive(Debug, Clone, PartialEq)]
pub enum Sampling {
    /// The most likely token (the first, on a tie, as `argmax` picks).
    Greedy,
    /// A draw from `softmax(logits / temperature)`, restricted to the `top_k` most likely
    /// tokens and then to the smallest set whose probability reaches `top_p`.
    Sample {
        /// Above 0; below 1 sharpens, above 1 flattens.
        temperature: f64,
        /// Keep the `k` most likely tokens (at least 1); `None` keeps all.
        top_k: Option<usize>,
        /// Keep the most likely tokens whose probabilities sum to at least `p` (in `(0, 1]`);
        /// `None` keeps all.
        top_p: Option<f64>,
        /// The same seed gives the same tokens.
        seed: u64,
    },
}

/// A [`Sampling`] setting out of range.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum SamplingError {
    /// The temperature is not a finite number above 0.
    #[error("temperature {0} must be above 0")]
    Temperature(f64),
    /// `top_k` is 0.
    #[error("top_k {0} must be at least 1")]
    TopK(usize),
    /// `top_p` is outside `(0, 1]`.
    #[error("top_p {0} must be in (0, 1]")]
    TopP(f64),
}

impl Sampling {
    /// Errors naming a setting out of range.
    pub fn validate(&self) -> Result<(), SamplingError> {
        if let Self::Sample {
            temperature,
            top_k,
            top_p,
            ..
        } = *self
        {
            if !(temperature.is_finite() && temperature > 0.0) {
                return Err(SamplingError::Temperature(temperature));
            }
            if let Some(k @ 0) = top_k {
                return Err(SamplingError::TopK(k));
            }
            if let Some(p) = top_p
                && !(p > 0.0 && p <= 1.0)
            {
                return Err(SamplingError::TopP(p));
            }
        }
        Ok(())
    }
}

/// Chooses tokens, holding the random state of a sampled generation.
#[derive(Debug)]
pub struct Sampler {
    sampling: Sampling,
    rng: StdRng,
}

impl Sampler {
    /// A sampler of `sampling`'s settings (checked), its random state seeded.
    pub fn new(sampling: &Sampling) -> Result<Self, SamplingError> {
        sampling.validate()?;
        let seed = match sampling {
            Sampling::Greedy => 0,
            Sampling::Sample { seed, .. } => *seed,
        };
        Ok(Self {
            sampling: sampling.clone(),
            rng: StdRng::seed_from_u64(seed),
        })
    }

    /// The next token of every row of `logits`, chosen on `logits`' device: greedy is an
    /// `argmax`; a draw ranks each row (a sort), keeps its top-k and top-p tokens, and takes the
    /// first whose running sum of weights passes a uniform draw from this sampler's seeded
    /// generator (one per row, in row order). Only the `[batch]` ids are read back.
    ///
    /// The device computes in its own float type: where two tokens' scores are within its
    /// rounding, the choice may differ from [`pick`](Self::pick)'s.
    ///
    /// # Shapes
    /// - `logits`: `[batch, vocab]`
    pub fn pick_rows<B: Backend>(&mut self, logits: Tensor<B, 2>) -> Vec<usize> {
        let [batch, vocab] = logits.dims();
        let chosen = match self.sampling {
            Sampling::Greedy => logits.argmax(1),
            Sampling::Sample {
                temperature,
                top_k,
                top_p,
                ..
            } => {
                let (ranked, tokens) = logits
                    .div_scalar(temperature)
                    .sort_descending_with_indices(1);
                let kept = top_k.map_or(vocab, |k| k.clamp(1, vocab));
                let (ranked, tokens) = (ranked.narrow(1, 0, kept), tokens.narrow(1, 0, kept));
                let most = ranked.clone().narrow(1, 0, 1);
                let mut weights = (ranked - most).exp();
                if let Some(p) = top_p {
                    // Keep a token while the weight before it is under `p`: the smallest set
                    // reaching `p`, the first token always.
                    let total = weights.clone().sum_dim(1);
                    let before = (weights.clone().cumsum(1) - weights.clone()) / total;
                    weights = weights.mask_fill(before.greater_equal_elem(p), 0.0);
                }
                let device = weights.device();
                let draws: Vec<f32> = (0..batch)
                    .map(|_| self.rng.random::<f64>() as f32)
                    .collect();
                let draws = Tensor::<B, 2>::from_data(TensorData::new(draws, [batch, 1]), &device);
                let running = weights.clone().cumsum(1);
                let threshold = draws * weights.sum_dim(1);
                // The first token whose running sum passes the draw.
                let first = running.greater(threshold).int().argmax(1);
                tokens.gather(1, first)
            }
        };
        chosen
            .into_data()
            .convert::<i64>()
            .into_vec::<i64>()
            .expect("integer ids")
            .into_iter()
            .map(|id| id as usize)
            .collect()
    }

    /// The next token of a row with these logits, chosen on the host.
    ///
    /// # Shapes
    /// - `logits`: `[vocab]`
    pub fn pick(&mut self, logits: &[f32]) -> usize {
        match self.sampling {
            Sampling::Greedy => argmax(logits),
            Sampling::Sample {
                temperature,
                top_k,
                top_p,
                ..
            } => {
                let candidates = candidates(logits, temperature, top_k, top_p);
                let total: f64 = candidates.iter().map(|&(_, p)| p).sum();
                let mut draw = self.rng.random::<f64>() * total;
                for &(token, p) in &candidates {
                    if draw < p {
                        return token;
                    }
                    draw -= p;
                }
                candidates.last().map_or(0, |&(token, _)| token)
            }
        }
    }
}

/// The index of the largest value, the first of equals; NaN never wins.
fn argmax(values: &[f32]) -> usize {
    let mut best = 0;
    for (i, &value) in values.iter().enumerate() {
        if value > values[best] || values[best].is_nan() && !value.is_nan() {
            best = i;
        }
    }
    best
}

/// The tokens that may be drawn, with their unnormalized probabilities, most likely first.
fn candidates(
    logits: &[f32],
    temperature: f64,
    top_k: Option<usize>,
    top_p: Option<f64>,
) -> Vec<(usize, f64)> {
    let mut ranked: Vec<(usize, f64)> = logits
        .iter()
        .enumerate()
        .filter(|(_, l)| !l.is_nan())
        .map(|(i, &l)| (i, f64::from(l) / temperature))
        .collect();
    // Stable: equal logits keep their order.
    ranked.sort_by(|a, b| b.1.total_cmp(&a.1));
    if let Some(k) = top_k {
        ranked.truncate(k.max(1));
    }
    let max = ranked.first().map_or(0.0, |&(_, l)| l);
    let mut weights: Vec<(usize, f64)> = ranked
        .into_iter()
        .map(|(i, l)| (i, (l - max).exp()))
        .collect();
    if let Some(p) = top_p {
        let total: f64 = weights.iter().map(|&(_, w)| w).sum();
        let mut cumulative = 0.0;
        let keep = weights
            .iter()
            .position(|&(_, w)| {
                cumulative += w / total;
                cumulative >= p
            })
            .map_or(weights.len(), |last| last + 1);
        weights.truncate(keep.max(1));
    }
    weights
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_takes_the_first_of_equal_maxima() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[f32::NAN, -1.0, -2.0]), 1);
    }

    #[test]
    fn top_k_and_top_p_keep_the_most_likely_tokens() {
        let logits = [0.0, 3.0, 1.0, 2.0];
        let kept = |k, p| -> Vec<usize> {
            candidates(&logits, 1.0, k, p)
                .into_iter()
                .map(|(i, _)| i)
                .collect()
        };
        assert_eq!(kept(Some(2), None), [1, 3]);
        assert_eq!(kept(None, None), [1, 3, 2, 0]);
        // softmax: 0.644, 0.237, 0.087, 0.032
        assert_eq!(kept(None, Some(0.6)), [1]);
        assert_eq!(kept(None, Some(0.85)), [1, 3]);
        assert_eq!(kept(None, Some(0.9)), [1, 3, 2]);
        assert_eq!(kept(Some(1), Some(1.0)), [1]);
    }

    #[test]
    fn the_same_seed_draws_the_same_tokens_and_draws_follow_the_probabilities() {
        let sampling = Sampling::Sample {
            temperature: 1.0,
            top_k: None,
            top_p: None,
            seed: 7,
        };
        let logits = [0.0, (3.0f32).ln(), f32::NEG_INFINITY];
        let draws = |n| {
            let mut sampler = Sampler::new(&sampling).unwrap();
            (0..n).map(|_| sampler.pick(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(draws(50), draws(50));
        let ones = draws(4000).iter().filter(|&&t| t == 1).count();
        // p(1) = 3/4; 4000 draws put the count within ±4σ (σ ≈ 27) of 3000.
        assert!((2890..=3110).contains(&ones), "{ones}");
        assert!(!draws(4000).contains(&2));
    }

    /// Rows of logits as a tensor on the CPU.
    fn rows(values: &[f32], vocab: usize) -> Tensor<attention_backends::NdArray, 2> {
        let batch = values.len() / vocab;
        Tensor::from_data(
            TensorData::new(values.to_vec(), [batch, vocab]),
            &Default::default(),
        )
    }

    #[test]
    fn rows_picked_on_the_device_are_the_hosts_greedy_picks() {
        let vocab = 37;
        let values: Vec<f32> = (0..5 * vocab)
            .map(|i| ((i * 7919) % 101) as f32 / 10.0 - (i % 3) as f32)
            .collect();
        let mut sampler = Sampler::new(&Sampling::Greedy).unwrap();
        let host: Vec<usize> = values.chunks(vocab).map(|row| sampler.pick(row)).collect();
        assert_eq!(sampler.pick_rows(rows(&values, vocab)), host);
    }

    #[test]
    fn rows_drawn_on_the_device_follow_the_probabilities_top_k_and_top_p() {
        let draws = |top_k, top_p, seed| {
            let sampling = Sampling::Sample {
                temperature: 1.0,
                top_k,
                top_p,
                seed,
            };
            let mut sampler = Sampler::new(&sampling).unwrap();
            // p(0) = 3/4, p(1) = 1/4, p(2) = 0; 400 rows of 3, drawn at once.
            let row = [(3.0f32).ln(), 0.0, f32::NEG_INFINITY];
            let values: Vec<f32> = row.iter().copied().cycle().take(3 * 400).collect();
            sampler.pick_rows(rows(&values, 3))
        };
        assert_eq!(draws(None, None, 7), draws(None, None, 7));
        assert_ne!(draws(None, None, 7), draws(None, None, 8));
        let all = draws(None, None, 7);
        let zeros = all.iter().filter(|&&t| t == 0).count();
        // 400 draws put the count within ±4σ (σ ≈ 8.7) of 300.
        assert!((265..=335).contains(&zeros), "{zeros}");
        assert!(!all.contains(&2));
        // Top-1, and a top-p the first token alone reaches, keep only token 0.
        assert!(draws(Some(1), None, 3).iter().all(|&t| t == 0));
        assert!(draws(None, Some(0.7), 3).iter().all(|&t| t == 0));
        // A top-p past the first token's mass keeps both.
        assert!(draws(None, Some(0.8), 3).contains(&1));
    }

    #[test]
    fn bad_settings_are_named_with_their_values() {
        let sample = |temperature, top_k, top_p| Sampling::Sample {
            temperature,
            top_k,
            top_p,
            seed: 0,
        };
        let error = |sampling: Sampling| sampling.validate().unwrap_err();
        assert_eq!(
            error(sample(0.0, None, None)),
            SamplingError::Temperature(0.0)
        );
        assert!(matches!(
            error(sample(f64::NAN, None, None)),
            SamplingError::Temperature(t) if t.is_nan()
        ));
        assert_eq!(error(sample(1.0, Some(0), None)), SamplingError::TopK(0));
        assert_eq!(
            error(sample(1.0, None, Some(1.5))),
            SamplingError::TopP(1.5)
        );
        assert!(
            error(sample(-1.0, None, None))
                .to_string()
                .contains("temperature -1")
        );
        assert!(sample(0.7, Some(5), Some(0.9)).validate().is_ok());
        assert!(Sampler::new(&sample(1.0, Some(0), None)).is_err());
    }
}
