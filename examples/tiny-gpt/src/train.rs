//! Training: AdamW on random windows of the corpus, validation on held-out text, a checkpoint
//! and the loss curve at the end.

use std::path::PathBuf;
use std::time::Instant;

use burn::module::AutodiffModule;
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::loss::cross_entropy_with_logits;
use gpt::checkpoint::{self, CheckpointError};
use gpt::{GptConfig, GptConfigError, GptModel};
use indicatif::{ProgressBar, ProgressStyle};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use thiserror::Error;

use crate::{corpus, plot};

/// Training settings (the command line's).
#[derive(Debug, Clone)]
pub struct TrainSettings {
    pub steps: usize,
    pub batch: usize,
    pub learning_rate: f64,
    pub seed: u64,
    pub out: PathBuf,
    pub config: GptConfig,
}

pub const VOCAB: usize = 256;
const CORPUS_BYTES: usize = 200_000;
const VALIDATION_FRACTION: f64 = 0.1;
const VALIDATION_BATCHES: usize = 8;
/// tiny-gpt trains small models: 2^28 parameters (1 GiB in f32, 4 GiB with gradients and AdamW's
/// moments) is far beyond what 2 cores train in reasonable time.
pub const MAX_PARAMETERS: usize = 1 << 28;
/// Files a checkpoint directory may hold besides the checkpoint's own (the loss curve, and the
/// weights file of earlier versions), so that training again replaces it.
pub const EXTRA_FILES: [&str; 2] = ["loss.png", "model.bin"];

/// What can stop training.
#[derive(Debug, Error)]
pub enum TrainError {
    /// A flag's value cannot train.
    #[error("{flag} {value}: {reason}")]
    Setting {
        /// The flag.
        flag: &'static str,
        /// Its value.
        value: String,
        /// Why not.
        reason: String,
    },
    /// The model the flags describe is too large for this program.
    #[error(
        "the model has {parameters} parameters, more than tiny-gpt trains ({MAX_PARAMETERS}); \
         lower --context, --d-model or --layers"
    )]
    TooLarge {
        /// Its parameter count (or `"more than usize::MAX"`).
        parameters: String,
    },
    /// The loss stopped being a number.
    #[error(
        "training diverged at step {step} (loss {loss}); no checkpoint written, any existing one \
         is untouched: try a smaller --learning-rate"
    )]
    Diverged {
        /// The step.
        step: usize,
        /// The loss.
        loss: f64,
    },
    /// Writing the checkpoint failed, or its directory may not be written.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
}

impl TrainSettings {
    /// Checks every setting before anything is allocated or trained.
    pub fn validate(&self) -> Result<(), TrainError> {
        let setting = |flag, value: String, reason: &str| TrainError::Setting {
            flag,
            value,
            reason: reason.to_string(),
        };
        let config = &self.config;
        for (flag, value) in [
            ("--steps", self.steps),
            ("--batch", self.batch),
            ("--context", config.context_length),
            ("--d-model", config.d_model),
            ("--heads", config.num_heads),
            ("--layers", config.num_layers),
        ] {
            if value == 0 {
                return Err(setting(flag, "0".into(), "must be at least 1"));
            }
        }
        if !config.d_model.is_multiple_of(config.num_heads) {
            return Err(setting(
                "--heads",
                config.num_heads.to_string(),
                &format!("must divide --d-model {}", config.d_model),
            ));
        }
        if !(self.learning_rate.is_finite() && self.learning_rate > 0.0) {
            return Err(setting(
                "--learning-rate",
                self.learning_rate.to_string(),
                "must be a finite number above 0",
            ));
        }
        // Training and validation windows are drawn from the validation text, the shorter part.
        let longest = (CORPUS_BYTES as f64 * VALIDATION_FRACTION) as usize - 2;
        if config.context_length > longest {
            return Err(setting(
                "--context",
                config.context_length.to_string(),
                &format!("longer than the validation text allows (at most {longest})"),
            ));
        }
        match config.parameter_count() {
            Some(parameters) if parameters <= MAX_PARAMETERS => {}
            parameters => {
                return Err(TrainError::TooLarge {
                    parameters: parameters
                        .map_or_else(|| "more than usize::MAX".into(), |p| p.to_string()),
                });
            }
        }
        config
            .validate()
            .map_err(|error: GptConfigError| setting("--config", String::new(), &error.to_string()))
    }
}

/// `[batch, context + 1]` windows of `text` starting at `starts`, as token ids.
fn windows<B: Backend>(
    text: &[u8],
    starts: &[usize],
    len: usize,
    device: &B::Device,
) -> Tensor<B, 2, Int> {
    let ids: Vec<i64> = starts
        .iter()
        .flat_map(|&s| text[s..s + len].iter().map(|&b| b as i64))
        .collect();
    Tensor::<B, 1, Int>::from_data(TensorData::new(ids, [starts.len() * len]), device)
        .reshape([starts.len(), len])
}

/// Mean next-byte cross-entropy (nats) of `model` on windows at `starts`.
fn loss<B: Backend>(
    model: &GptModel<B>,
    text: &[u8],
    starts: &[usize],
    context: usize,
    device: &B::Device,
) -> Tensor<B, 1> {
    let batch = windows::<B>(text, starts, context + 1, device);
    let inputs = batch.clone().slice([0..starts.len(), 0..context]);
    let targets = batch
        .slice([0..starts.len(), 1..context + 1])
        .reshape([starts.len() * context]);
    let logits = model
        .forward(inputs)
        .reshape([starts.len() * context, VOCAB]);
    cross_entropy_with_logits(logits, targets.one_hot(VOCAB).float())
}

/// Trains on `B` and writes `model.safetensors`, `config.json` and `loss.png` into
/// `settings.out`, as a unit. Returns `(validation loss, unigram loss)`.
pub fn train<B: AutodiffBackend>(
    settings: &TrainSettings,
    backend: &str,
    device: &B::Device,
) -> Result<(f64, f64), TrainError> {
    settings.validate()?;
    // Refused before training, not after: a path holding anything but a checkpoint.
    let output = checkpoint::output_dir("--out", &settings.out, &EXTRA_FILES)?;
    let config = &settings.config;
    let context = config.context_length;
    let text = corpus::generate(CORPUS_BYTES, settings.seed).into_bytes();
    let split = (text.len() as f64 * (1.0 - VALIDATION_FRACTION)) as usize;
    let (train_text, valid_text) = text.split_at(split);
    let unigram = corpus::unigram_loss(train_text, valid_text);

    B::seed(device, settings.seed);
    let mut model: GptModel<B> = config.init(device);
    let mut optimizer = AdamWConfig::new()
        .with_weight_decay(0.01)
        .init::<B, GptModel<B>>();
    let mut rng = StdRng::seed_from_u64(settings.seed);
    let valid_starts: Vec<usize> = (0..VALIDATION_BATCHES * settings.batch)
        .map(|i| i * (valid_text.len() - context - 1) / (VALIDATION_BATCHES * settings.batch))
        .collect();
    let validate = |model: &GptModel<B>| {
        let model = model.valid();
        valid_starts
            .chunks(settings.batch)
            .map(|starts| {
                loss(&model, valid_text, starts, context, device)
                    .into_scalar()
                    .elem::<f64>()
            })
            .sum::<f64>()
            / VALIDATION_BATCHES as f64
    };

    println!(
        "training on {backend}: {} layers, d_model {}, {} heads, context {context}, batch {}, {} steps, corpus {} bytes (unigram loss {unigram:.3})",
        config.num_layers,
        config.d_model,
        config.num_heads,
        settings.batch,
        settings.steps,
        text.len()
    );
    let progress = ProgressBar::new(settings.steps as u64);
    progress.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} [{elapsed_precise}] {msg}")
            .expect("valid template"),
    );
    let (mut train_curve, mut valid_curve) = (Vec::new(), Vec::new());
    let every = (settings.steps / 20).max(1);
    let started = Instant::now();
    for step in 1..=settings.steps {
        let starts: Vec<usize> = (0..settings.batch)
            .map(|_| rng.random_range(0..train_text.len() - context - 1))
            .collect();
        let loss = loss(&model, train_text, &starts, context, device);
        let value = loss.clone().into_scalar().elem::<f64>();
        if !value.is_finite() {
            progress.abandon();
            return Err(TrainError::Diverged { step, loss: value });
        }
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let warmup = (step as f64 / 50.0).min(1.0);
        model = optimizer.step(settings.learning_rate * warmup, model, grads);
        train_curve.push((step, value));
        if step % every == 0 || step == settings.steps {
            valid_curve.push((step, validate(&model)));
        }
        let rate = step as f64 / started.elapsed().as_secs_f64();
        progress.set_message(format!("{rate:.1} steps/s, loss {value:.3}"));
        progress.inc(1);
    }
    progress.finish();
    let valid_loss = validate(&model);
    if !valid_loss.is_finite() {
        return Err(TrainError::Diverged {
            step: settings.steps,
            loss: valid_loss,
        });
    }

    checkpoint::save(&output, &model.valid(), config, |dir| {
        plot::loss_curve(&dir.join("loss.png"), &train_curve, &valid_curve, unigram)
            .map_err(|e| format!("cannot draw the loss curve: {e}"))
    })?;
    println!(
        "checkpoint: {} ({}, {}, loss.png)",
        settings.out.display(),
        checkpoint::WEIGHTS_FILE,
        checkpoint::CONFIG_FILE
    );
    Ok((valid_loss, unigram))
}
