//! Training: AdamW on random windows of the corpus, validation on held-out text, a checkpoint
//! and the loss curve at the end.

use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::module::AutodiffModule;
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::prelude::*;
use burn::record::{BinFileRecorder, FullPrecisionSettings};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::loss::cross_entropy_with_logits;
use gpt::{GptConfig, GptModel};
use indicatif::{ProgressBar, ProgressStyle};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

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

/// Trains on `B` and writes `model.bin`, `config.json` and `loss.png` into `settings.out`.
/// Returns `(validation loss, unigram loss)`.
pub fn train<B: AutodiffBackend>(
    settings: &TrainSettings,
    backend: &str,
    device: &B::Device,
) -> Result<(f64, f64), String> {
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

    std::fs::create_dir_all(&settings.out)
        .map_err(|e| format!("cannot create {}: {e}", settings.out.display()))?;
    save(&model.valid(), config, &settings.out)?;
    plot::loss_curve(
        &settings.out.join("loss.png"),
        &train_curve,
        &valid_curve,
        unigram,
    )
    .map_err(|e| format!("cannot draw the loss curve: {e}"))?;
    println!(
        "checkpoint: {} (model.bin, config.json, loss.png)",
        settings.out.display()
    );
    Ok((valid_loss, unigram))
}

fn save<B: Backend>(model: &GptModel<B>, config: &GptConfig, dir: &Path) -> Result<(), String> {
    config
        .save(dir.join("config.json"))
        .map_err(|e| format!("cannot write config.json: {e}"))?;
    model
        .clone()
        .save_file(
            dir.join("model"),
            &BinFileRecorder::<FullPrecisionSettings>::new(),
        )
        .map_err(|e| format!("cannot write model.bin: {e}"))
}

/// Loads a checkpoint written by [`train`]: a directory with `config.json` and `model.bin`.
pub fn load<B: Backend>(dir: &Path, device: &B::Device) -> Result<GptModel<B>, String> {
    let config_path = dir.join("config.json");
    if !config_path.is_file() {
        return Err(format!(
            "{}: not a checkpoint (no config.json)",
            dir.display()
        ));
    }
    let config =
        GptConfig::load(&config_path).map_err(|e| format!("{}: {e}", config_path.display()))?;
    let model: GptModel<B> = config.init(device);
    model
        .load_file(
            dir.join("model"),
            &BinFileRecorder::<FullPrecisionSettings>::new(),
            device,
        )
        .map_err(|e| {
            format!(
                "{}: cannot load the model: {e}",
                dir.join("model.bin").display()
            )
        })
}
