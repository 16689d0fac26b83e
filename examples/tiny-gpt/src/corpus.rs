//! The training text: simple English sentences from a small grammar, generated from a seed, so
//! every fresh clone has the same corpus without downloading anything.

use std::ops::RangeInclusive;

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
