//! Scoring a checkpoint on its validation text through the cached path, one token at a time:
//! what a key/value cache stored in fewer bytes costs a trained model, as a loss.

use std::path::Path;

use burn::prelude::*;
use burn::tensor::TensorData;
use burn::tensor::activation::log_softmax;
use gpt::checkpoint::{self, CheckpointError};
use gpt::{DecoderError, GptModel, KvDtype};
use thiserror::Error;

use crate::corpus::{self, CorpusRecord};
use crate::train::VOCAB;

/// What `tiny-gpt score` is asked.
#[derive(Debug, Clone)]
pub struct ScoreSettings<'a> {
    pub checkpoint: &'a Path,
    pub kv_dtype: KvDtype,
    /// Windows of the validation text scored, each the model's context long.
    pub windows: usize,
}

/// The mean loss of a score, and over how much it was taken.
#[derive(Debug, Clone, Copy)]
pub struct Score {
    /// Nats per predicted byte.
    pub loss: f64,
    pub windows: usize,
    /// Predicted bytes per window.
    pub tokens: usize,
}

/// What can stop a score.
#[derive(Debug, Error)]
pub enum ScoreError {
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(transparent)]
    Model(#[from] DecoderError),
    #[error("{0}")]
    Corpus(String),
    #[error("--windows 0: must be at least 1")]
    NoWindows,
    #[error("the checkpoint's vocabulary has {0} tokens; tiny-gpt's byte-level text needs 256")]
    Vocabulary(usize),
    #[error(
        "--windows {windows}: the validation text ({bytes} bytes) holds windows of {context} + 1 \
         bytes at {max} places at most"
    )]
    TooManyWindows {
        windows: usize,
        bytes: usize,
        context: usize,
        max: usize,
    },
}

/// Scores `settings.windows` windows of the checkpoint's validation text (the text it was trained
/// beside, generated again from the checkpoint's corpus record), evenly spaced, all at once as a
/// batch: each window a 1-token prefill, then one cached step per token, its caches stored as
/// `settings.kv_dtype`; every step's next-byte cross-entropy, averaged.
pub fn score<B: Backend>(
    settings: &ScoreSettings<'_>,
    device: &B::Device,
) -> Result<Score, ScoreError> {
    if settings.windows == 0 {
        return Err(ScoreError::NoWindows);
    }
    let model: GptModel<B> = checkpoint::load(settings.checkpoint, device)?;
    let record = CorpusRecord::read(settings.checkpoint).map_err(ScoreError::Corpus)?;
    if model.vocab_size() != VOCAB {
        return Err(ScoreError::Vocabulary(model.vocab_size()));
    }
    let context = model.context_length();
    let text = record.text();
    let (_, valid) = corpus::split(&text);
    let places = valid.len().saturating_sub(context);
    if settings.windows > places {
        return Err(ScoreError::TooManyWindows {
            windows: settings.windows,
            bytes: valid.len(),
            context,
            max: places,
        });
    }
    // Window `w`: bytes `start .. start + context + 1`, inputs the first `context`, labels the
    // last `context`.
    let windows: Vec<&[u8]> = (0..settings.windows)
        .map(|w| {
            let start = w * (places - 1) / settings.windows;
            &valid[start..start + context + 1]
        })
        .collect();
    let column = |at: usize| -> [Tensor<B, 2, Int>; 2] {
        [at, at + 1].map(|at| {
            let ids: Vec<i64> = windows.iter().map(|w| i64::from(w[at])).collect();
            Tensor::from_data(TensorData::new(ids, [windows.len(), 1]), device)
        })
    };
    let mut caches = model.new_caches_of(settings.kv_dtype);
    let mut total = 0.0;
    for at in 0..context {
        let [inputs, labels] = column(at);
        let logits = model.forward_cached(inputs, &mut caches)?;
        let log_probabilities = log_softmax(logits, 2).reshape([windows.len(), VOCAB]);
        let picked: f64 = log_probabilities
            .gather(1, labels)
            .sum()
            .into_scalar()
            .elem();
        total -= picked;
    }
    Ok(Score {
        loss: total / (windows.len() * context) as f64,
        windows: windows.len(),
        tokens: context,
    })
}
