//! The training text: simple English sentences from a small grammar, generated from a seed, so
//! every fresh clone has the same corpus without downloading anything.

use std::ops::RangeInclusive;
use std::path::Path;

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

const SUBJECTS: [&str; 8] = [
    "the cat",
    "a dog",
    "the old man",
    "my sister",
    "the teacher",
    "a small bird",
    "the farmer",
    "our neighbour",
];
const VERBS: [&str; 8] = [
    "sees",
    "likes",
    "finds",
    "follows",
    "paints",
    "feeds",
    "visits",
    "remembers",
];
const OBJECTS: [&str; 8] = [
    "the red ball",
    "a quiet river",
    "the tall tree",
    "an open door",
    "the green hill",
    "a warm house",
    "the bright moon",
    "a wooden boat",
];
const WHEN: [&str; 6] = [
    "in the morning",
    "at night",
    "every day",
    "after the rain",
    "near the sea",
    "before dinner",
];

/// About `bytes` bytes of sentences, one per line.
pub fn generate(bytes: usize, seed: u64) -> String {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut pick = |words: &[&'static str]| words[rng.random_range(0..words.len())];
    let mut text = String::with_capacity(bytes + 80);
    while text.len() < bytes {
        let sentence = format!(
            "{} {} {} {}.\n",
            pick(&SUBJECTS),
            pick(&VERBS),
            pick(&OBJECTS),
            pick(&WHEN)
        );
        text.push_str(&sentence);
    }
    text
}

/// Cross-entropy (nats per byte) on `eval` of the byte frequencies of `train` (add-one smoothed):
/// what a model that ignores context can reach.
pub fn unigram_loss(train: &[u8], eval: &[u8]) -> f64 {
    let mut counts = [1.0f64; 256];
    for &b in train {
        counts[b as usize] += 1.0;
    }
    let total: f64 = counts.iter().sum();
    eval.iter()
        .map(|&b| -(counts[b as usize] / total).ln())
        .sum::<f64>()
        / eval.len() as f64
}

/// `text` cut into documents, in order, as token ids (one per byte): each of a length drawn
/// uniformly from `lengths` (from `seed`), the last one what is left. Documents of varied
/// lengths are what packing is for: rows of one length hold several short ones, and a long one
/// crosses rows.
pub fn documents(text: &[u8], lengths: RangeInclusive<usize>, seed: u64) -> Vec<Vec<u32>> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut documents = Vec::new();
    let mut rest = text;
    while !rest.is_empty() {
        let length = rng.random_range(lengths.clone()).min(rest.len());
        let (document, after) = rest.split_at(length);
        documents.push(document.iter().map(|&b| u32::from(b)).collect());
        rest = after;
    }
    documents
}

/// The share of the corpus held out for validation, at its end.
pub const VALIDATION_FRACTION: f64 = 0.1;

/// `text` split into its training part and its validation part (the last
/// [`VALIDATION_FRACTION`]).
pub fn split(text: &[u8]) -> (&[u8], &[u8]) {
    text.split_at((text.len() as f64 * (1.0 - VALIDATION_FRACTION)) as usize)
}

/// The file of a checkpoint that records the corpus it was trained on.
pub const RECORD_FILE: &str = "corpus.json";

/// What generates a corpus again: [`generate`]'s size and seed, as a checkpoint records them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CorpusRecord {
    pub bytes: usize,
    pub seed: u64,
}

impl CorpusRecord {
    /// The corpus's text.
    pub fn text(&self) -> Vec<u8> {
        generate(self.bytes, self.seed).into_bytes()
    }

    /// Writes the record into checkpoint directory `dir`.
    pub fn write(&self, dir: &Path) -> Result<(), String> {
        let json = serde_json::json!({ "bytes": self.bytes, "seed": self.seed });
        std::fs::write(dir.join(RECORD_FILE), format!("{json:#}\n"))
            .map_err(|e| format!("cannot write {RECORD_FILE}: {e}"))
    }

    /// The record of checkpoint directory `dir`; the error says what is wrong with it.
    pub fn read(dir: &Path) -> Result<Self, String> {
        let path = dir.join(RECORD_FILE);
        let shown = path.display();
        // A FIFO or a device would block or never end: regular files only, and small ones.
        match std::fs::metadata(&path) {
            Err(_) => {
                return Err(format!(
                    "{shown}: not found: the checkpoint does not record its corpus (trained by \
                     an older tiny-gpt: train it again)"
                ));
            }
            Ok(meta) if !meta.is_file() => return Err(format!("{shown}: not a regular file")),
            Ok(meta) if meta.len() > 4096 => {
                return Err(format!("{shown}: {} bytes, more than a record", meta.len()));
            }
            Ok(_) => {}
        }
        let text = std::fs::read_to_string(&path).map_err(|e| format!("{shown}: {e}"))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| format!("{shown}: {e}"))?;
        let field = |name: &str| {
            json.get(name).and_then(serde_json::Value::as_u64).ok_or_else(|| {
                format!("{shown}: `{name}` is not a whole number: expected {{\"bytes\": N, \"seed\": S}}")
            })
        };
        let bytes = usize::try_from(field("bytes")?).map_err(|e| format!("{shown}: bytes: {e}"))?;
        // The largest corpus tiny-gpt generates: a larger record is not one of its own.
        if !(1..=1 << 30).contains(&bytes) {
            return Err(format!(
                "{shown}: `bytes` {bytes} is not a corpus size tiny-gpt makes"
            ));
        }
        Ok(Self {
            bytes,
            seed: field("seed")?,
        })
    }
}
