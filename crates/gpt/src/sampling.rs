//! How the next token is chosen from a row of logits: greedy, or a seeded draw after
//! transformers' processors in their order (temperature, top-k, top-p).

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

    /// The next token of a row with these logits.
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
