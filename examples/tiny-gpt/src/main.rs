//! tiny-gpt: trains a byte-level GPT made of the attention layer on a generated corpus, then
//! samples from the checkpoint.
//!
//! ```text
//! cargo run --release -p tiny-gpt -- train                       # flex, default settings
//! cargo run --release -p tiny-gpt -- train --peers 2              # two data-parallel replicas
//! cargo run --release -p tiny-gpt -- train --pack                 # packed documents
//! cargo run --release -p tiny-gpt -- generate --checkpoint tiny-gpt-checkpoint --prompt "the cat "
//! cargo run --release -p tiny-gpt -- score --checkpoint tiny-gpt-checkpoint --kv-dtype int8
//! ```

mod corpus;
mod parallel;
mod plot;
mod score;
mod train;

use std::path::PathBuf;
use std::process::ExitCode;

use attention_backends::{Autodiff, BackendName, NoAdapter, OnBackend, dispatch};
use burn::prelude::*;
use clap::{Parser, Subcommand};
use gpt::checkpoint::{self, CheckpointError};
use gpt::{GenerateError, GptConfig, KvDtype, RowLayout, Sampling};
use thiserror::Error;

use parallel::{ParallelError, Topology};
use score::{ScoreError, ScoreSettings};
use train::{DocumentSettings, OptimizerName, TrainError, TrainSettings, VOCAB};

/// What the user is told, as one `error:` line.
#[derive(Debug, Error)]
enum CliError {
    #[error(transparent)]
    Train(#[from] TrainError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(transparent)]
    Generate(#[from] GenerateError),
    #[error(transparent)]
    NoAdapter(#[from] NoAdapter),
    #[error(transparent)]
    Parallel(#[from] ParallelError),
    #[error(transparent)]
    Score(#[from] ScoreError),
    #[error("the checkpoint's vocabulary has {0} tokens; tiny-gpt's byte-level prompts need 256")]
    Vocabulary(usize),
}

#[derive(Debug, Parser)]
#[command(about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Trains on the generated corpus and writes a checkpoint and the loss curve.
    Train {
        #[arg(long, value_enum, default_value_t = BackendName::Flex)]
        backend: BackendName,
        #[arg(long, default_value_t = 600)]
        steps: usize,
        #[arg(long, default_value_t = 16)]
        batch: usize,
        /// Above 0 (a negative value is accepted here so that it is refused with a reason).
        #[arg(long, default_value_t = 3e-3, allow_negative_numbers = true)]
        learning_rate: f64,
        #[arg(long, default_value_t = 64)]
        context: usize,
        #[arg(long, default_value_t = 64)]
        d_model: usize,
        #[arg(long, default_value_t = 4)]
        heads: usize,
        #[arg(long, default_value_t = 2)]
        layers: usize,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        #[arg(long, value_enum, default_value_t = OptimizerName::Adamw)]
        optimizer: OptimizerName,
        /// Checkpoint directory (written by node rank 0).
        #[arg(long, default_value = "tiny-gpt-checkpoint")]
        out: PathBuf,
        #[command(flatten)]
        documents: DocumentFlags,
        #[command(flatten)]
        replicas: ReplicaFlags,
    },
    /// Serves the collective's orchestrator for `train --nodes … --external-orchestrator`.
    Orchestrator {
        #[arg(long)]
        port: u16,
    },
    /// Continues a prompt with a trained checkpoint.
    Generate {
        #[arg(long, value_enum, default_value_t = BackendName::Flex)]
        backend: BackendName,
        #[arg(long)]
        checkpoint: PathBuf,
        #[arg(long)]
        prompt: String,
        #[arg(long, default_value_t = 40)]
        tokens: usize,
        /// 0 for greedy decoding.
        #[arg(long, default_value_t = 0.8)]
        temperature: f64,
        #[arg(long, default_value_t = 20)]
        top_k: usize,
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
    /// Scores the checkpoint on its validation text through the cached path, one token at a
    /// time, and prints `loss=<mean>` last (nats per byte): what a cache stored in fewer bytes
    /// costs the trained model.
    Score {
        #[arg(long, value_enum, default_value_t = BackendName::Flex)]
        backend: BackendName,
        #[arg(long)]
        checkpoint: PathBuf,
        /// What the KV cache stores keys and values as: `f32` (the model's float type), `f16`,
        /// `bf16` or `int8` (f16 and int8 on the GPU kernel too; bf16 on the CPU kernel only).
        #[arg(long, default_value_t = KvDtype::Model)]
        kv_dtype: KvDtype,
        /// Windows of the validation text scored, each the model's context long, as one batch.
        #[arg(long, default_value_t = 16)]
        windows: usize,
    },
}

/// Training on documents instead of random windows of the corpus.
#[derive(Debug, clap::Args)]
struct DocumentFlags {
    /// Cuts the corpus into documents (--min-document to --max-document bytes) and packs them in
    /// order into rows of --context tokens, a row filled before the next (a document that does
    /// not fit continues in the next row); each token attends within its own document, positions
    /// restart in each, and a document's last token has no label. Validation scores each
    /// document on its own.
    #[arg(long, conflicts_with = "one_document_per_row")]
    pack: bool,
    /// The documents of --pack, one per row, right-padded (a longer one over several rows),
    /// padding labels ignored: training without packing, to compare --pack with.
    #[arg(long)]
    one_document_per_row: bool,
    /// The shortest document, in bytes (with --pack or --one-document-per-row).
    #[arg(long, default_value_t = 4)]
    min_document: usize,
    /// The longest document, in bytes (with --pack or --one-document-per-row).
    #[arg(long, default_value_t = 128)]
    max_document: usize,
}

impl DocumentFlags {
    fn settings(&self) -> Option<DocumentSettings> {
        let layout = if self.pack {
            RowLayout::Packed
        } else if self.one_document_per_row {
            RowLayout::OnePerRow
        } else {
            return None;
        };
        Some(DocumentSettings {
            layout,
            min_length: self.min_document,
            max_length: self.max_document,
        })
    }
}

/// Where the data-parallel replicas run.
#[derive(Debug, clap::Args)]
struct ReplicaFlags {
    /// Replicas in this process, one thread each; each takes --batch / (peers × nodes) windows of
    /// every batch, and their gradients are averaged before each step.
    #[arg(long, default_value_t = 1)]
    peers: usize,
    /// Processes training together (on this machine or others), each with --peers replicas.
    #[arg(long, default_value_t = 1)]
    nodes: usize,
    /// This process's rank, 0 to --nodes − 1; rank 0 starts the orchestrator and writes the
    /// checkpoint.
    #[arg(long, default_value_t = 0)]
    node_rank: usize,
    /// The orchestrator's HOST:PORT (rank 0 serves it on PORT).
    #[arg(long)]
    orchestrator: Option<String>,
    /// Rank 0 joins an orchestrator started by `tiny-gpt orchestrator` instead of serving one.
    #[arg(long)]
    external_orchestrator: bool,
    /// This node's data service, HOST:PORT as the other nodes reach it; it listens on PORT.
    #[arg(long)]
    data_address: Option<String>,
    /// Seconds the replicas may go without finishing a step before the run ends with an error
    /// (the first step includes waiting for every node to join).
    #[arg(long, default_value_t = 60)]
    peer_timeout: u64,
}

impl ReplicaFlags {
    fn topology(self) -> Topology {
        Topology {
            peers: self.peers,
            nodes: self.nodes,
            rank: self.node_rank,
            orchestrator: self.orchestrator,
            external_orchestrator: self.external_orchestrator,
            data_address: self.data_address,
            timeout: std::time::Duration::from_secs(self.peer_timeout),
        }
    }
}

fn main() -> ExitCode {
    parallel::quiet_logging();
    let outcome = match Cli::parse().command {
        Command::Train {
            backend,
            steps,
            batch,
            learning_rate,
            context,
            d_model,
            heads,
            layers,
            seed,
            optimizer,
            out,
            documents,
            replicas,
        } => {
            let settings = TrainSettings {
                steps,
                batch,
                learning_rate,
                seed,
                optimizer,
                out,
                config: GptConfig::new(VOCAB, context, d_model, heads, layers),
                documents: documents.settings(),
            };
            let topology = replicas.topology();
            let trained = dispatch(backend, Train(&settings, &topology)).map_err(CliError::from);
            trained
                .and_then(|trained| Ok(trained?))
                .map(|trained| match trained {
                    Some((valid, unigram)) => println!(
                        "final: val_loss={valid:.4} unigram_loss={unigram:.4} ratio={:.4}",
                        valid / unigram
                    ),
                    None => println!("node {}: done", topology.rank),
                })
        }
        Command::Orchestrator { port } => parallel::port_free("orchestrator", port)
            .map(|()| {
                println!("orchestrator on port {port}; stop it with Ctrl-C");
                parallel::run_orchestrator(port)
            })
            .map_err(CliError::from),
        Command::Generate {
            backend,
            checkpoint,
            prompt,
            tokens,
            temperature,
            top_k,
            seed,
        } => {
            let sampling = if temperature == 0.0 {
                Sampling::Greedy
            } else {
                Sampling::Sample {
                    temperature,
                    top_k: Some(top_k),
                    top_p: None,
                    seed,
                }
            };
            let request = Generate {
                checkpoint: &checkpoint,
                prompt: &prompt,
                tokens,
                sampling,
            };
            dispatch(backend, request)
                .map_err(CliError::from)
                .and_then(|generated| generated)
        }
        Command::Score {
            backend,
            checkpoint,
            kv_dtype,
            windows,
        } => {
            let settings = ScoreSettings {
                checkpoint: &checkpoint,
                kv_dtype,
                windows,
            };
            dispatch(backend, Score(&settings))
                .map_err(CliError::from)
                .and_then(|scored| Ok(scored?))
                .map(|score| {
                    println!(
                        "scored {} windows of {} bytes through a cache of {kv_dtype}",
                        score.windows, score.tokens
                    );
                    println!("loss={:.6}", score.loss);
                })
        }
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::from(2)
        }
    }
}

/// Training on the backend `--backend` names (with `Autodiff` around it).
struct Train<'a>(&'a TrainSettings, &'a Topology);

impl OnBackend for Train<'_> {
    type Output = Result<Option<(f64, f64)>, TrainError>;

    fn run<B: Backend>(self, name: &'static str, device: B::Device) -> Self::Output {
        train::train::<Autodiff<B>>(self.0, self.1, name, &device)
    }
}

/// A score of a checkpoint on the backend `--backend` names.
struct Score<'a>(&'a ScoreSettings<'a>);

impl OnBackend for Score<'_> {
    type Output = Result<score::Score, ScoreError>;

    fn run<B: Backend>(self, _: &'static str, device: B::Device) -> Self::Output {
        score::score::<B>(self.0, &device)
    }
}

/// A continuation of `prompt` from a checkpoint.
struct Generate<'a> {
    checkpoint: &'a std::path::Path,
    prompt: &'a str,
    tokens: usize,
    sampling: Sampling,
}

impl OnBackend for Generate<'_> {
    type Output = Result<(), CliError>;

    fn run<B: Backend>(self, _: &'static str, device: B::Device) -> Self::Output {
        let model = checkpoint::load::<B>(self.checkpoint, &device)?;
        if model.vocab_size() != VOCAB {
            return Err(CliError::Vocabulary(model.vocab_size()));
        }
        let prompt_ids: Vec<usize> = self.prompt.bytes().map(usize::from).collect();
        let room = model.context_length().saturating_sub(prompt_ids.len());
        let ids = model.generate(&prompt_ids, self.tokens.min(room), &self.sampling, &device)?;
        let bytes: Vec<u8> = ids.iter().map(|&t| t as u8).collect();
        println!("{}", String::from_utf8_lossy(&bytes));
        Ok(())
    }
}
