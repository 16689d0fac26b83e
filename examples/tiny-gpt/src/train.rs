//! Training: AdamW (or SGD) on random windows of the corpus — or on rows of documents cut from
//! it, packed or one per row — by one replica or by several whose gradients the collective
//! averages, validation on held-out text, a checkpoint and the loss curve at the end.

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
use gpt::{
    DecoderError, GptConfig, GptConfigError, GptModel, Labels, Logits, RowLayout, TokenRows,
};
use indicatif::{ProgressBar, ProgressStyle};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use thiserror::Error;

use crate::corpus::{self, CorpusRecord};
use crate::parallel::{Heartbeat, ParallelError, Peer, Topology, panic_message};
use crate::plot;

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
    /// Documents instead of random windows (`--pack`, `--one-document-per-row`).
    pub documents: Option<DocumentSettings>,
}

/// How the corpus is cut into documents and the documents laid into rows of `--context` tokens.
#[derive(Debug, Clone, Copy)]
pub struct DocumentSettings {
    /// Packed (`--pack`) or one per row, right-padded (`--one-document-per-row`).
    pub layout: RowLayout,
    /// The shortest document cut, in bytes (`--min-document`).
    pub min_length: usize,
    /// The longest document cut, in bytes (`--max-document`).
    pub max_length: usize,
}

pub const VOCAB: usize = 256;
const CORPUS_BYTES: usize = 200_000;
const VALIDATION_BATCHES: usize = 8;
/// tiny-gpt trains small models: 2^28 parameters (1 GiB in f32, 4 GiB with gradients and AdamW's
/// moments) is far beyond what 2 cores train in reasonable time.
pub const MAX_PARAMETERS: usize = 1 << 28;
/// Files a checkpoint directory may hold besides the checkpoint's own (the corpus record, the
/// loss curve, and the weights file of earlier versions), so that training again replaces it.
pub const EXTRA_FILES: [&str; 3] = [corpus::RECORD_FILE, "loss.png", "model.bin"];

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
    /// The model refused a batch.
    #[error(transparent)]
    Model(#[from] DecoderError),
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
        if let Some(documents) = &self.documents {
            if documents.min_length == 0 {
                return Err(setting("--min-document", "0".into(), "must be at least 1"));
            }
            if documents.max_length < documents.min_length {
                return Err(setting(
                    "--max-document",
                    documents.max_length.to_string(),
                    &format!("must be at least --min-document {}", documents.min_length),
                ));
            }
        }
        if !(self.learning_rate.is_finite() && self.learning_rate > 0.0) {
            return Err(setting(
                "--learning-rate",
                self.learning_rate.to_string(),
                "must be a finite number above 0",
            ));
        }
        // Training and validation windows are drawn from the validation text, the shorter part.
        let longest = (CORPUS_BYTES as f64 * corpus::VALIDATION_FRACTION) as usize - 2;
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

/// The next-token cross-entropy of `model` (nats) summed over the labels within the documents of
/// `rows` (a document's last token, and padding, have none): each document as if alone.
fn document_loss_sum<B: Backend>(
    model: &GptModel<B>,
    tokens: &TokenRows,
    rows: &[usize],
    device: &B::Device,
) -> Result<Tensor<B, 1>, DecoderError> {
    let input = tokens.input(rows, device)?;
    let labels = Labels::within_rows(&input)?;
    let logits = model.try_forward(&input, None, Logits::All)?;
    Ok(labels.cross_entropy_sum(logits))
}

/// The rows of documents training and validation draw from, with `--pack` or
/// `--one-document-per-row`.
struct DocumentRows {
    /// The training text's documents, laid out as the flag says.
    train: TokenRows,
    /// The validation text's documents, packed: each is scored within itself, which is its
    /// score alone in a row (`crates/gpt/tests/model/documents.rs`), in both layouts.
    valid: TokenRows,
    /// The validation rows scored (the first ones, as many as the windows validation scores).
    scored: Vec<usize>,
}

impl DocumentRows {
    /// The training and validation texts cut into documents as `settings` say (the validation
    /// text from another seed), laid into rows of `context` tokens.
    fn new(
        settings: &DocumentSettings,
        train_text: &[u8],
        valid_text: &[u8],
        context: usize,
        seed: u64,
        batch: usize,
    ) -> Self {
        let lengths = settings.min_length..=settings.max_length;
        let rows = |text: &[u8], seed: u64, layout: RowLayout| {
            let documents = corpus::documents(text, lengths.clone(), seed);
            // Settings checked and texts not empty: documents of at least one byte, rows of at
            // least one.
            TokenRows::new(&documents, context, layout, 0).expect("checked settings")
        };
        let train = rows(train_text, seed, settings.layout);
        let valid = rows(valid_text, seed.wrapping_add(1), RowLayout::Packed);
        let scored = (0..valid.len().min(VALIDATION_BATCHES * batch)).collect();
        Self {
            train,
            valid,
            scored,
        }
    }
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
    /// `None`: random windows of the text.
    documents: Option<DocumentRows>,
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
    let record = CorpusRecord {
        bytes: CORPUS_BYTES,
        seed: settings.seed,
    };
    let text = record.text();
    let (train_text, valid_text) = corpus::split(&text);
    let valid_starts: Vec<usize> = (0..VALIDATION_BATCHES * settings.batch)
        .map(|i| i * (valid_text.len() - context - 1) / (VALIDATION_BATCHES * settings.batch))
        .collect();
    // Every replica of every node cuts and lays out the same documents from the seed, so a
    // batch's row indices are all a replica needs to build its share, documents included.
    let documents = settings.documents.as_ref().map(|documents| {
        DocumentRows::new(
            documents,
            train_text,
            valid_text,
            context,
            settings.seed,
            settings.batch,
        )
    });
    let job = Arc::new(Job {
        settings: settings.clone(),
        topology: topology.clone(),
        unigram: corpus::unigram_loss(train_text, valid_text),
        train_text: train_text.to_vec(),
        valid_text: valid_text.to_vec(),
        valid_starts,
        documents,
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
        if let (Some(documents), Some(rows)) = (&settings.documents, &job.documents) {
            println!("{}", documents_note(documents, rows));
        }
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
        record.write(dir)?;
        plot::loss_curve(&dir.join("loss.png"), &train_curve, &valid_curve, unigram)
            .map_err(|e| format!("cannot draw the loss curve: {e}"))
    })?;
    println!(
        "checkpoint: {} ({}, {}, {}, loss.png)",
        settings.out.display(),
        checkpoint::WEIGHTS_FILE,
        checkpoint::CONFIG_FILE,
        corpus::RECORD_FILE,
    );
    Ok(Some((valid_loss, unigram)))
}

/// What the documents are and how they are laid out, for the first lines of a run.
fn documents_note(settings: &DocumentSettings, rows: &DocumentRows) -> String {
    let layout = match settings.layout {
        RowLayout::Packed => "packed in order",
        RowLayout::OnePerRow => "one per row, right-padded",
    };
    let all: Vec<usize> = (0..rows.train.len()).collect();
    format!(
        "documents of {}–{} bytes, {layout}: {} training rows of {} ({} real tokens); \
         validation scores each document on its own ({} labels)",
        settings.min_length,
        settings.max_length,
        rows.train.len(),
        rows.train.seq(),
        rows.train.real_tokens(&all),
        rows.valid.labels(&rows.scored),
    )
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
    let validate = |model: &GptModel<B>| -> Result<f64, TrainError> {
        let model = model.valid();
        let Some(documents) = &job.documents else {
            return Ok(job
                .valid_starts
                .chunks(settings.batch)
                .map(|starts| {
                    loss(&model, &job.valid_text, starts, context, device)
                        .into_scalar()
                        .elem::<f64>()
                })
                .sum::<f64>()
                / VALIDATION_BATCHES as f64);
        };
        // Summed per batch, then averaged over every label scored: each label weighs the same
        // whatever the documents of its batch.
        let mut sum = 0.0;
        for rows in documents.scored.chunks(settings.batch) {
            sum += document_loss_sum(&model, &documents.valid, rows, device)?
                .into_scalar()
                .elem::<f64>();
        }
        Ok(sum / documents.valid.labels(&documents.scored).max(1) as f64)
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
    // Tokens of every replica's share, padding left out.
    let mut tokens = 0;
    let started = Instant::now();
    for step in 1..=settings.steps {
        let loss = match &job.documents {
            None => {
                let starts: Vec<usize> = (0..settings.batch)
                    .map(|_| rng.random_range(0..job.train_text.len() - context - 1))
                    .collect();
                let mine = &starts[index * share..(index + 1) * share];
                tokens += settings.batch * context;
                loss(&model, &job.train_text, mine, context, device)
            }
            Some(documents) => {
                let rows: Vec<usize> = (0..settings.batch)
                    .map(|_| rng.random_range(0..documents.train.len()))
                    .collect();
                let mine = &rows[index * share..(index + 1) * share];
                tokens += documents.train.real_tokens(&rows);
                // Each replica divides its sum by the whole batch's label count (times the
                // replicas, whose mean the collective takes): the step's loss is the batch's
                // mean over its labels however its rows are dealt, as one replica's would be.
                let labels = documents.train.labels(&rows).max(1);
                document_loss_sum(&model, &documents.train, mine, device)?
                    .mul_scalar(replicas as f64 / labels as f64)
            }
        };
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
                valid_curve.push((step, validate(&model)?));
            }
        }
        let seconds = started.elapsed().as_secs_f64();
        let (rate, token_rate) = (step as f64 / seconds, tokens as f64 / seconds);
        progress.set_message(format!(
            "{rate:.1} steps/s, {token_rate:.0} tokens/s, loss {value:.3}"
        ));
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
        "{} steps in {seconds:.1} s: {:.2} steps/s, {:.0} tokens/s ({tokens} tokens, padding left out), last loss {:.4}",
        settings.steps,
        settings.steps as f64 / seconds,
        tokens as f64 / seconds,
        train_curve.last().map_or(f64::NAN, |&(_, loss)| loss),
    );
    let valid_loss = validate(&model)?;
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
