//! Training: AdamW (or SGD) on random windows of the corpus, by one replica or by several whose
//! gradients the collective averages, validation on held-out text, a checkpoint and the loss
//! curve at the end.

use std::path::PathBuf;
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use burn::collective;
use burn::module::{AutodiffModule, ModuleVisitor, Param};
use burn::optim::{AdamWConfig, GradientsParams, Optimizer, SgdConfig};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::loss::cross_entropy_with_logits;
use gpt::checkpoint::{self, CheckpointError};
use gpt::{GptConfig, GptConfigError, GptModel};
use indicatif::{ProgressBar, ProgressStyle};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use thiserror::Error;

use crate::parallel::{Heartbeat, ParallelError, Peer, Topology, panic_message};
use crate::{corpus, plot};

/// Training settings (the command line's).
#[derive(Debug, Clone)]
pub struct TrainSettings {
    pub steps: usize,
    pub batch: usize,
    pub learning_rate: f64,
    pub seed: u64,
    pub optimizer: OptimizerName,
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
    /// The replicas could not train together.
    #[error(transparent)]
    Parallel(#[from] ParallelError),
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

/// How long the node that keeps the model stays up after the last all-reduce of a run across
/// processes, for the others to fetch its share of it.
const FINAL_GRACE: Duration = Duration::from_secs(1);

/// The optimizer `--optimizer` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OptimizerName {
    /// AdamW, weight decay 0.01.
    Adamw,
    /// Plain SGD: replicas and one replica on the whole batch agree to rounding, where AdamW's
    /// first steps act like `sign(g)` and amplify it.
    Sgd,
}

/// What every replica trains on, shared by their threads.
struct Job {
    settings: TrainSettings,
    topology: Topology,
    train_text: Vec<u8>,
    valid_text: Vec<u8>,
    valid_starts: Vec<usize>,
    unigram: f64,
    heartbeat: Heartbeat,
}

/// What the replica that keeps the model returns.
struct Trained<B: AutodiffBackend> {
    model: GptModel<B>,
    valid_loss: f64,
    train_curve: Vec<(usize, f64)>,
    valid_curve: Vec<(usize, f64)>,
}

/// Trains on `B` with the replicas `topology` places in this process, and (on rank 0) writes
/// `model.safetensors`, `config.json` and `loss.png` into `settings.out`, as a unit. Returns
/// `(validation loss, unigram loss)` on rank 0, `None` on the other nodes.
pub fn train<B: AutodiffBackend>(
    settings: &TrainSettings,
    topology: &Topology,
    backend: &str,
    device: &B::Device,
) -> Result<Option<(f64, f64)>, TrainError> {
    settings.validate()?;
    topology.validate(settings.batch)?;
    let writes_checkpoint = topology.rank == 0;
    // Refused before training, not after: a path holding anything but a checkpoint.
    let output = writes_checkpoint
        .then(|| checkpoint::output_dir("--out", &settings.out, &EXTRA_FILES))
        .transpose()?;
    let config = &settings.config;
    let context = config.context_length;
    let text = corpus::generate(CORPUS_BYTES, settings.seed).into_bytes();
    let split = (text.len() as f64 * (1.0 - VALIDATION_FRACTION)) as usize;
    let (train_text, valid_text) = text.split_at(split);
    let valid_starts: Vec<usize> = (0..VALIDATION_BATCHES * settings.batch)
        .map(|i| i * (valid_text.len() - context - 1) / (VALIDATION_BATCHES * settings.batch))
        .collect();
    let job = Arc::new(Job {
        settings: settings.clone(),
        topology: topology.clone(),
        unigram: corpus::unigram_loss(train_text, valid_text),
        train_text: train_text.to_vec(),
        valid_text: valid_text.to_vec(),
        valid_starts,
        heartbeat: Heartbeat::new(),
    });

    B::seed(device, settings.seed);
    // Every process draws the same initial values from the seed; numbered parameters make the
    // collective reduce them in the same order everywhere.
    let model = config.init::<B>(device);
    model.visit(&mut InitializeNow);
    if writes_checkpoint {
        println!(
            "training on {backend}: {} layers, d_model {}, {} heads, context {context}, batch {}, {} steps, corpus {} bytes (unigram loss {:.3}){}",
            config.num_layers,
            config.d_model,
            config.num_heads,
            settings.batch,
            settings.steps,
            text.len(),
            job.unigram,
            replicas_note(topology),
        );
    } else {
        let replicas = match topology.peers {
            1 => "1 replica".to_string(),
            peers => format!("{peers} replicas"),
        };
        println!(
            "node {} of {}: {replicas} on {backend}; rank 0 reports the loss and writes the checkpoint",
            topology.rank, topology.nodes
        );
    }
    let trained = if topology.is_parallel() {
        topology.start_orchestrator()?;
        run_peers(&job, model, device)?
    } else {
        replica(&job, 0, None, model, device)?
    };
    let Some(trained) = trained else {
        return Ok(None);
    };
    if topology.nodes > 1 {
        // The other nodes may still be fetching this node's share of the last all-reduce from
        // its data service, which ends with the process: give them a moment.
        std::thread::sleep(FINAL_GRACE);
    }
    let output = output.expect("rank 0 checked its output directory");
    let Trained {
        model,
        valid_loss,
        train_curve,
        valid_curve,
    } = trained;
    let unigram = job.unigram;
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
    Ok(Some((valid_loss, unigram)))
}

fn replicas_note(topology: &Topology) -> String {
    match (topology.nodes, topology.peers) {
        (1, 1) => String::new(),
        (1, peers) => format!(", {peers} replicas"),
        (nodes, peers) => format!(", {} replicas ({nodes} nodes × {peers})", nodes * peers),
    }
}

/// This process's replicas, one thread each, under the watchdog: the first error of any of
/// them, or no step finished within the timeout, ends the run (the threads left waiting in the
/// collective end with the process). Returns what the replica of global index 0 returns.
fn run_peers<B: AutodiffBackend>(
    job: &Arc<Job>,
    model: GptModel<B>,
    device: &B::Device,
) -> Result<Option<Trained<B>>, TrainError> {
    let topology = &job.topology;
    collective::reset_collective::<B::InnerBackend>();
    let (sender, results) = mpsc::channel();
    let handles: Vec<_> = (0..topology.peers)
        .map(|local| {
            // Its own copy of the parameters: clones share their autodiff leaves, and the
            // replicas' graphs would then meet in one another's backward pass.
            let model = model.clone().fork(device);
            let (job, device, sender) = (job.clone(), device.clone(), sender.clone());
            let index = topology.global_peer(local);
            std::thread::spawn(move || {
                let outcome = Peer::register::<B>(index, &job.topology, &device)
                    .map_err(TrainError::from)
                    .and_then(|peer| {
                        let trained = replica(&job, index, Some(peer), model, &device)?;
                        // After the replica's last barrier nobody reads this node's data service:
                        // leaving closes its connections with a goodbye, not a reset.
                        peer.finish::<B>()?;
                        Ok(trained)
                    });
                // The receiver is gone only when the run has already failed.
                let _ = sender.send((local, outcome));
            })
        })
        .collect();
    drop(sender);
    let mut done = vec![false; handles.len()];
    let mut kept = None;
    while done.iter().any(|d| !d) {
        match results.recv_timeout(Duration::from_millis(200)) {
            Ok((local, outcome)) => {
                done[local] = true;
                if let Some(trained) = outcome? {
                    kept = Some(trained);
                }
            }
            Err(_) => {
                if let Some(local) =
                    (0..handles.len()).find(|&l| !done[l] && handles[l].is_finished())
                {
                    // Finished without sending: the thread panicked.
                    let peer = topology.global_peer(local);
                    let message = match handles.into_iter().nth(local).map(|h| h.join()) {
                        Some(Err(panic)) => panic_message(panic.as_ref()),
                        _ => "no result".into(),
                    };
                    return Err(ParallelError::Panicked { peer, message }.into());
                }
                let (step, since) = job.heartbeat.last();
                if since > topology.timeout {
                    return Err(ParallelError::Stalled {
                        seconds: topology.timeout.as_secs(),
                        step: step + 1,
                        waiting_for: topology.waiting_for(),
                    }
                    .into());
                }
            }
        }
    }
    Ok(kept)
}

/// One replica's training: its share of every global batch, its gradients averaged with the
/// others' through `peer` (none when it trains alone), the optimizer step every replica takes
/// alike. Replica 0 also validates, logs and returns the model; the others return `None`.
fn replica<B: AutodiffBackend>(
    job: &Job,
    index: usize,
    peer: Option<Peer>,
    model: GptModel<B>,
    device: &B::Device,
) -> Result<Option<Trained<B>>, TrainError> {
    match job.settings.optimizer {
        OptimizerName::Adamw => {
            let optimizer = AdamWConfig::new()
                .with_weight_decay(0.01)
                .init::<B, GptModel<B>>();
            replica_with(job, index, peer, model, optimizer, device)
        }
        OptimizerName::Sgd => {
            let optimizer = SgdConfig::new().init::<B, GptModel<B>>();
            replica_with(job, index, peer, model, optimizer, device)
        }
    }
}

fn replica_with<B: AutodiffBackend, O: Optimizer<GptModel<B>, B>>(
    job: &Job,
    index: usize,
    peer: Option<Peer>,
    mut model: GptModel<B>,
    mut optimizer: O,
    device: &B::Device,
) -> Result<Option<Trained<B>>, TrainError> {
    let settings = &job.settings;
    let context = settings.config.context_length;
    let replicas = job.topology.replicas();
    let share = settings.batch / replicas;
    let keeps_model = index == 0;
    let validate = |model: &GptModel<B>| {
        let model = model.valid();
        job.valid_starts
            .chunks(settings.batch)
            .map(|starts| {
                loss(&model, &job.valid_text, starts, context, device)
                    .into_scalar()
                    .elem::<f64>()
            })
            .sum::<f64>()
            / VALIDATION_BATCHES as f64
    };
    // Every replica draws the same global batches and takes its share of each.
    let mut rng = StdRng::seed_from_u64(settings.seed);
    let progress = if keeps_model {
        let bar = ProgressBar::new(settings.steps as u64);
        bar.set_style(
            ProgressStyle::with_template("{bar:30} {pos}/{len} [{elapsed_precise}] {msg}")
                .expect("valid template"),
        );
        bar
    } else {
        ProgressBar::hidden()
    };
    let (mut train_curve, mut valid_curve) = (Vec::new(), Vec::new());
    let every = (settings.steps / 20).max(1);
    let started = Instant::now();
    for step in 1..=settings.steps {
        let starts: Vec<usize> = (0..settings.batch)
            .map(|_| rng.random_range(0..job.train_text.len() - context - 1))
            .collect();
        let mine = &starts[index * share..(index + 1) * share];
        let loss = loss(&model, &job.train_text, mine, context, device);
        let mut value = loss.clone().into_scalar().elem::<f64>();
        let mut grads = GradientsParams::from_grads(loss.backward(), &model);
        if let Some(peer) = peer {
            // Every replica then sees the same loss, and stops together if it is not finite.
            (value, grads) = peer.mean_step(&model, value, grads, device)?;
        }
        if !value.is_finite() {
            progress.abandon();
            return Err(TrainError::Diverged { step, loss: value });
        }
        let warmup = (step as f64 / 50.0).min(1.0);
        model = optimizer.step(settings.learning_rate * warmup, model, grads);
        job.heartbeat.beat(step);
        if keeps_model {
            train_curve.push((step, value));
            if step % every == 0 || step == settings.steps {
                valid_curve.push((step, validate(&model)));
            }
        }
        let rate = step as f64 / started.elapsed().as_secs_f64();
        progress.set_message(format!("{rate:.1} steps/s, loss {value:.3}"));
        progress.inc(1);
    }
    progress.finish();
    if let Some(peer) = peer {
        peer.barrier::<B>(device)?;
    }
    if !keeps_model {
        return Ok(None);
    }
    let seconds = started.elapsed().as_secs_f64();
    println!(
        "{} steps in {seconds:.1} s: {:.2} steps/s",
        settings.steps,
        settings.steps as f64 / seconds
    );
    let valid_loss = validate(&model);
    if !valid_loss.is_finite() {
        return Err(TrainError::Diverged {
            step: settings.steps,
            loss: valid_loss,
        });
    }
    Ok(Some(Trained {
        model,
        valid_loss,
        train_curve,
        valid_curve,
    }))
}

/// Initialises every parameter of a module now, in the order the module visits them.
///
/// Burn initialises a parameter lazily, from the global random generator, when it is first
/// used: the values would depend on the order a forward pass touches them, and each replica's
/// copy of a model not yet initialised would draw its own values.
struct InitializeNow;

impl<B: Backend> ModuleVisitor<B> for InitializeNow {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        param.val();
    }
}
