//! Whole models over a page pool: sequences of different lengths run together in ragged steps —
//! prompt chunks beside decoding rows, a sequence admitted late, a shared prompt — give, sequence
//! by sequence, the logits and greedy tokens of each sequence run alone through dense caches: the
//! book's GPT (learned positions) and a Llama-style decoder with one windowed block (two
//! attention kinds, each with its own tables).

use crate::packed::{VOCAB, book_gpt, llama_style};

use attention_backends::{Flex, NdArray};
use attention_core::{AttentionError, PagePool};
use burn::prelude::*;
use burn::tensor::TensorData;
use gpt::{Decoder, DecoderError, Logits, SequencePages};

const CONTEXT: usize = 160;
/// Relative to the reference's largest logit.
const RTOL: f64 = 1e-5;

fn ids<B: Backend>(ids: &[u32], device: &B::Device) -> Tensor<B, 2, Int> {
    let ids: Vec<i64> = ids.iter().map(|&id| i64::from(id)).collect();
    Tensor::from_data(TensorData::new(ids.clone(), [1, ids.len()]), device)
}

fn floats<B: Backend>(tensor: Tensor<B, 3>) -> Vec<f64> {
    tensor.into_data().convert::<f64>().to_vec().unwrap()
}

fn argmax(logits: &[f64]) -> u32 {
    (0..logits.len())
        .max_by(|&a, &b| logits[a].total_cmp(&logits[b]))
        .unwrap() as u32
}

/// A prompt of `len` ids, different for each `seed`.
fn prompt(len: usize, seed: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i * 7 + seed * 13 + 1) % VOCAB as u32)
        .collect()
}

/// Sequences fed by ragged steps and, alone, through dense caches.
struct Run<'m, B: Backend> {
    model: &'m Decoder<B>,
    pool: PagePool,
    pages: Vec<attention_core::LayerPages<B>>,
    sequences: Vec<SequencePages>,
    caches: Vec<Vec<attention_core::KvCache<B>>>,
    /// Each sequence's tokens so far, and how many have been fed.
    tokens: Vec<(Vec<u32>, usize)>,
    device: B::Device,
}

impl<'m, B: Backend> Run<'m, B> {
    fn new(
        model: &'m Decoder<B>,
        pool: PagePool,
        prompts: Vec<Vec<u32>>,
        device: &B::Device,
    ) -> Self {
        Self {
            pages: model.new_pages(&pool).unwrap(),
            sequences: prompts.iter().map(|_| model.new_sequence()).collect(),
            caches: prompts.iter().map(|_| model.new_caches()).collect(),
            tokens: prompts.into_iter().map(|prompt| (prompt, 0)).collect(),
            model,
            pool,
            device: device.clone(),
        }
    }

    /// A step of `(sequence, tokens fed)`; a sequence whose tokens are all fed gets its greedy
    /// next token appended. Checks each sequence's last logits against the dense run's.
    fn step(&mut self, step: &[(usize, usize)], what: &str) {
        let mut held: Vec<Option<&mut SequencePages>> =
            self.sequences.iter_mut().map(Some).collect();
        let mut reserved: Vec<(&mut SequencePages, usize)> = step
            .iter()
            .map(|&(s, new)| (held[s].take().unwrap(), new))
            .collect();
        let steps = self.model.reserve(&mut self.pool, &mut reserved).unwrap();
        let fed: Vec<u32> = step
            .iter()
            .flat_map(|&(s, new)| {
                let (tokens, done) = &self.tokens[s];
                tokens[*done..*done + new].to_vec()
            })
            .collect();
        let logits = self
            .model
            .forward_paged(
                ids(&fed, &self.device),
                &steps,
                &mut self.pages,
                Logits::Last,
            )
            .unwrap();
        let logits = floats(logits);
        for (index, &(s, new)) in step.iter().enumerate() {
            let (tokens, done) = &mut self.tokens[s];
            let chunk = &tokens[*done..*done + new];
            let want = self
                .model
                .forward_cached(ids(chunk, &self.device), &mut self.caches[s])
                .unwrap();
            let want = floats(want);
            let want = &want[(new - 1) * VOCAB..];
            let found = &logits[index * VOCAB..(index + 1) * VOCAB];
            let scale = want.iter().fold(1e-3f64, |m, x| m.max(x.abs()));
            let error = found
                .iter()
                .zip(want)
                .fold(0f64, |m, (f, w)| m.max((f - w).abs()));
            assert!(
                error <= RTOL * scale,
                "{what}: sequence {s}: logits off by {error:e}"
            );
            *done += new;
            if *done == tokens.len() {
                let next = argmax(found);
                assert_eq!(next, argmax(want), "{what}: sequence {s}'s greedy token");
                tokens.push(next);
            }
        }
    }

    fn release_all(&mut self) {
        for sequence in &mut self.sequences {
            sequence.release(&mut self.pool);
        }
        assert!(self.pool.is_whole(), "pages left after every release");
    }
}

fn models<B: Backend>(device: &B::Device) -> [(&'static str, Decoder<B>); 2] {
    [
        ("the book's GPT", book_gpt(device, CONTEXT)),
        (
            "a Llama-style decoder with a window of 40 in its first block",
            llama_style(device, CONTEXT, [Some(40), None]),
        ),
    ]
}

fn ragged_steps_give_each_sequence_alone<B: Backend>(device: &B::Device) {
    for (name, model) in models::<B>(device) {
        assert_eq!(
            model.attention_kinds().len(),
            if name.contains("window") { 2 } else { 1 }
        );
        let prompts = vec![prompt(45, 0), prompt(3, 1), prompt(70, 2), prompt(100, 3)];
        let mut run = Run::new(&model, PagePool::new(40, 32).unwrap(), prompts, device);
        run.step(&[(0, 30), (1, 3), (2, 70)], name);
        run.step(&[(0, 15), (1, 1), (2, 1), (3, 64)], name);
        run.step(&[(3, 36), (1, 1), (0, 1), (2, 1)], name);
        for _ in 0..4 {
            run.step(&[(0, 1), (1, 1), (2, 1), (3, 1)], name);
        }
        run.release_all();
    }
}

/// A second sequence shares a running one's first 40 positions (a page and a part), every
/// attention kind's, then both go on with tokens of their own.
fn shared_prompts_give_each_sequence_alone<B: Backend>(device: &B::Device) {
    for (name, model) in models::<B>(device) {
        let shared = prompt(40, 5);
        let mut own = shared.clone();
        own.extend(prompt(6, 6));
        let mut run = Run::new(
            &model,
            PagePool::new(12, 32).unwrap(),
            vec![shared.clone(), own],
            device,
        );
        run.step(&[(0, 40)], name);
        run.sequences[1] = run.sequences[0].share(&mut run.pool, 40).unwrap();
        model
            .forward_cached(ids(&shared, device), &mut run.caches[1])
            .unwrap();
        run.tokens[1].1 = 40;
        run.step(&[(0, 1), (1, 6)], name);
        for _ in 0..3 {
            run.step(&[(1, 1), (0, 1)], name);
        }
        run.release_all();
    }
}

/// Out of pages across the attention kinds together: refused before any kind reserves.
fn out_of_pages_reserves_nothing<B: Backend>(device: &B::Device) {
    let model = llama_style::<B>(device, CONTEXT, [Some(40), None]);
    let mut pool = PagePool::new(5, 32).unwrap();
    let mut sequence = model.new_sequence();
    // 100 positions: 4 global pages and 4 windowed ones.
    let error = model
        .reserve(&mut pool, &mut [(&mut sequence, 100)])
        .unwrap_err();
    assert_eq!(
        error,
        DecoderError::Attention(AttentionError::OutOfPages { needed: 8, free: 5 })
    );
    assert!(pool.is_whole() && sequence.is_empty());
    let other = book_gpt::<B>(device, CONTEXT).new_sequence();
    let mut other = other;
    // A sequence of a model with one attention kind, given to one with two.
    assert_eq!(
        model
            .reserve(&mut pool, &mut [(&mut other, 1)])
            .unwrap_err(),
        DecoderError::AttentionKinds { found: 1, kinds: 2 }
    );
}

#[test]
fn ragged_steps_give_each_sequence_alone_on_ndarray_and_flex() {
    ragged_steps_give_each_sequence_alone::<NdArray>(&Default::default());
    ragged_steps_give_each_sequence_alone::<Flex>(&Default::default());
}

#[test]
fn shared_prompts_give_each_sequence_alone_on_ndarray_and_flex() {
    shared_prompts_give_each_sequence_alone::<NdArray>(&Default::default());
    shared_prompts_give_each_sequence_alone::<Flex>(&Default::default());
}

#[test]
fn out_of_pages_reserves_nothing_on_ndarray() {
    out_of_pages_reserves_nothing::<NdArray>(&Default::default());
}
