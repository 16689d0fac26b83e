//! Every causal-LM directory of the Hugging Face fixtures (`save_pretrained` output of
//! transformers' own classes, random weights): prompt logits, every step's logits and the greedy
//! tokens, against `expected.safetensors`.

use attention_core::PagePool;
use burn::prelude::*;
use burn::tensor::TensorData;
use gpt::Logits;
use hf_models::{CausalLm, Engine, EngineConfig, GenerateConfig, Generation, Prompts, Request};
use tensor_files::{RawTensor, Tensors};
use test_support::{backend_tests, cases_on, fixture};

use crate::MODELS;

struct Expected {
    tensors: Tensors,
}

impl Expected {
    fn read(model: &str) -> Self {
        let path = fixture(&format!("hf/{model}/expected.safetensors"));
        Self {
            tensors: tensor_files::read(&path).unwrap(),
        }
    }

    fn raw(&self, key: &str) -> &RawTensor {
        &self.tensors[key]
    }

    fn ints(&self, key: &str) -> (Vec<i64>, Vec<usize>) {
        let raw = self.raw(key);
        (raw.to_i64().expect("int64"), raw.shape.clone())
    }

    fn floats(&self, key: &str) -> (Vec<f32>, Vec<usize>) {
        let raw = self.raw(key);
        (raw.to_f32().expect("f32"), raw.shape.clone())
    }

    fn prompts(&self) -> Prompts {
        let (ids, shape) = self.ints("input_ids");
        let (mask, _) = self.ints("attention_mask");
        Prompts::from_padded(&ids, &mask, [shape[0], shape[1]]).unwrap()
    }
}

fn generate<B: Backend>(
    model: &str,
    use_cache: bool,
    device: &B::Device,
) -> (CausalLm<B>, Generation<B>) {
    let lm = CausalLm::<B>::load(fixture(&format!("hf/{model}")), device).unwrap();
    let expected = Expected::read(model);
    let new = expected.raw("generated").shape[1] - expected.prompts().dims()[1];
    let config = GenerateConfig {
        use_cache,
        prompt_logits: true,
        step_logits: true,
        ..lm.greedy(new)
    };
    let generation = lm.generate(&expected.prompts(), &config, device).unwrap();
    (lm, generation)
}

fn host<B: Backend>(tensor: Tensor<B, 3>) -> Vec<f32> {
    tensor.into_data().convert::<f32>().into_vec().unwrap()
}

/// `|got − want| ≤ 1e-4 · max(1, max |want|)` wherever `keep(row, column)`; returns the largest
/// error as a fraction of the tolerance.
fn assert_logits_close(
    what: &str,
    got: &[f32],
    want: &[f32],
    [batch, len, vocab]: [usize; 3],
    keep: impl Fn(usize, usize) -> bool,
) -> f32 {
    assert_eq!(got.len(), want.len(), "{what}: sizes");
    let scale = want.iter().fold(1f32, |m, w| m.max(w.abs()));
    let tolerance = 1e-4 * scale;
    let mut worst = 0f32;
    for row in 0..batch {
        for column in (0..len).filter(|&c| keep(row, c)) {
            for token in 0..vocab {
                let i = (row * len + column) * vocab + token;
                let error = (got[i] - want[i]).abs();
                assert!(
                    error <= tolerance,
                    "{what}[{row}, {column}, {token}]: {} vs {} (tolerance {tolerance})",
                    got[i],
                    want[i]
                );
                worst = worst.max(error / tolerance);
            }
        }
    }
    worst
}

fn check_against_transformers<B: Backend>(model: &str, generation: Generation<B>) {
    let expected = Expected::read(model);
    let (mask, _) = expected.ints("attention_mask");
    let (want, shape) = expected.floats("logits_with_position_ids");
    let [batch, len, vocab] = [shape[0], shape[1], shape[2]];
    let got = host(generation.prompt_logits.expect("asked for"));
    let prompt_worst = assert_logits_close(
        &format!("{model} prompt logits"),
        &got,
        &want,
        [batch, len, vocab],
        |row, column| mask[row * len + column] == 1,
    );
    let (want, shape) = expected.floats("step_logits");
    let got = host(generation.step_logits.expect("asked for"));
    let step_worst = assert_logits_close(
        &format!("{model} step logits"),
        &got,
        &want,
        [shape[0], shape[1], shape[2]],
        |_, _| true,
    );
    let (generated, shape) = expected.ints("generated");
    let tokens: Vec<i64> = generation
        .tokens
        .iter()
        .flatten()
        .map(|&t| i64::from(t))
        .collect();
    assert_eq!(tokens.len(), shape[0] * shape[1]);
    assert_eq!(tokens, generated, "{model}: greedy tokens");
    eprintln!(
        "{model}: worst logit error {prompt_worst:.3} (prompt), {step_worst:.3} (steps) of the \
         tolerance"
    );
}

/// Logits of the prompt and of every step, and the greedy tokens, as transformers gave them.
fn models_match_transformers<B: Backend>(device: &B::Device) {
    for model in cases_on::<B, _>(&MODELS) {
        let (_, generation) = generate::<B>(model, true, device);
        check_against_transformers(model, generation);
    }
}

/// Generating through the caches and recomputing the whole sequence at every step give the
/// same tokens and (to rounding) the same logits: GPT-2, Llama and each family that changes
/// what the cache holds or how it is read (normalized keys, partly rotated keys, unrotated
/// keys, windows on some layers only, soft-capped scores, RoPE per layer type).
fn cached_generation_equals_uncached<B: Backend>(device: &B::Device) {
    let models = MODELS[..2].iter().chain(&MODELS[4..]);
    for &model in models {
        let (_, cached) = generate::<B>(model, true, device);
        let (_, uncached) = generate::<B>(model, false, device);
        assert_eq!(cached.tokens, uncached.tokens, "{model}");
        let [cached_logits, uncached_logits] =
            [cached, uncached].map(|generation| generation.step_logits.expect("asked for"));
        let dims = cached_logits.dims();
        let worst = assert_logits_close(
            model,
            &host(cached_logits),
            &host(uncached_logits),
            dims,
            |_, _| true,
        );
        assert!(
            worst < 0.5,
            "{model}: cached vs uncached at {worst} of the tolerance"
        );
    }
}

/// Row 1 of every fixture is left-padded: alone and unpadded it generates the same tokens, with
/// the step logits transformers gave for it alone.
fn a_padded_row_generates_what_it_generates_alone<B: Backend>(device: &B::Device) {
    for model in cases_on::<B, _>(&MODELS) {
        let expected = Expected::read(model);
        let lm = CausalLm::<B>::load(fixture(&format!("hf/{model}")), device).unwrap();
        let (ids, shape) = expected.ints("input_ids");
        let (mask, _) = expected.ints("attention_mask");
        let len = shape[1];
        let row: Vec<u32> = (0..len)
            .filter(|&c| mask[len + c] == 1)
            .map(|c| ids[len + c] as u32)
            .collect();
        let prompts = Prompts::left_padded(&[row], lm.special_tokens().pad()).unwrap();
        let (alone, alone_shape) = expected.ints("generated_unpadded_row1");
        let new = alone_shape[1] - prompts.dims()[1];
        let config = GenerateConfig {
            step_logits: true,
            ..lm.greedy(new)
        };
        let generation = lm.generate(&prompts, &config, device).unwrap();
        let tokens: Vec<i64> = generation.tokens[0].iter().map(|&t| i64::from(t)).collect();
        assert_eq!(tokens, alone, "{model}: row 1 alone");
        let (want, shape) = expected.floats("step_logits_unpadded_row1");
        assert_logits_close(
            &format!("{model} row 1 alone"),
            &host(generation.step_logits.expect("asked for")),
            &want,
            [shape[0], shape[1], shape[2]],
            |_, _| true,
        );
        let (padded, shape) = expected.ints("generated");
        let pads = len - prompts.dims()[1];
        assert_eq!(
            &padded[shape[1] + pads..2 * shape[1]],
            &alone[..],
            "{model}"
        );
    }
}

/// Both rows of every fixture generated together over a page pool, each at its own length with
/// no padding — row 0's prompt in two chunks, the second beside row 1's first decoded token —
/// give transformers' greedy tokens for each row (row 1's as it generated it alone).
fn paged_steps_generate_each_rows_tokens<B: Backend>(device: &B::Device) {
    for model in cases_on::<B, _>(&MODELS) {
        let expected = Expected::read(model);
        let lm = CausalLm::<B>::load(fixture(&format!("hf/{model}")), device).unwrap();
        let decoder = lm.decoder();
        let (ids, shape) = expected.ints("input_ids");
        let (mask, _) = expected.ints("attention_mask");
        let len = shape[1];
        let prompts: Vec<Vec<u32>> = (0..2)
            .map(|row| {
                (0..len)
                    .filter(|&c| mask[row * len + c] == 1)
                    .map(|c| ids[row * len + c] as u32)
                    .collect()
            })
            .collect();
        let (generated, generated_shape) = expected.ints("generated");
        let (alone, _) = expected.ints("generated_unpadded_row1");
        let new = generated_shape[1] - len;
        let want = [
            &generated[len..generated_shape[1]],
            &alone[prompts[1].len()..],
        ];
        let mut pool = PagePool::new(16, 32).unwrap();
        let mut pages = decoder.new_pages(&pool).unwrap();
        let mut sequences = [decoder.new_sequence(), decoder.new_sequence()];
        // Each row's prompt chunks: row 0's in two (where it has two tokens), row 1's whole.
        let half = prompts[0].len() / 2;
        let chunks = [vec![half, prompts[0].len() - half], vec![prompts[1].len()]]
            .map(|sizes| sizes.into_iter().filter(|&n| n > 0).collect::<Vec<_>>());
        let (mut fed, mut chunk) = ([0usize; 2], [0usize; 2]);
        let mut tokens: [Vec<u32>; 2] = [Vec::new(), Vec::new()];
        while tokens.iter().any(|row| row.len() < new) {
            // (row, ids): the row's next prompt chunk, or its last token.
            let step: Vec<(usize, Vec<u32>)> = (0..2)
                .filter(|&row| tokens[row].len() < new)
                .map(|row| match fed[row] < prompts[row].len() {
                    true => {
                        let end = fed[row] + chunks[row][chunk[row]];
                        (row, prompts[row][fed[row]..end].to_vec())
                    }
                    false => (row, vec![*tokens[row].last().unwrap()]),
                })
                .collect();
            let [first, second] = &mut sequences;
            let mut held = [Some(first), Some(second)];
            let mut reserved: Vec<_> = step
                .iter()
                .map(|(row, ids)| (held[*row].take().unwrap(), ids.len()))
                .collect();
            let steps = decoder.reserve(&mut pool, &mut reserved).unwrap();
            let fed_ids: Vec<i64> = step
                .iter()
                .flat_map(|(_, ids)| ids.iter().map(|&id| i64::from(id)))
                .collect();
            let count = fed_ids.len();
            let fed_ids =
                Tensor::<B, 2, Int>::from_data(TensorData::new(fed_ids, [1, count]), device);
            let logits = decoder
                .forward_paged(fed_ids, &steps, &mut pages, Logits::Last)
                .unwrap();
            let vocab = logits.dims()[2];
            let logits = host(logits);
            for (index, (row, ids)) in step.into_iter().enumerate() {
                if fed[row] < prompts[row].len() {
                    fed[row] += ids.len();
                    chunk[row] += 1;
                }
                // A prompt's last chunk, or a decoded token: its logits pick the next token.
                if fed[row] == prompts[row].len() {
                    let row_logits = &logits[index * vocab..(index + 1) * vocab];
                    let next = (0..vocab)
                        .max_by(|&a, &b| row_logits[a].total_cmp(&row_logits[b]))
                        .unwrap();
                    tokens[row].push(next as u32);
                }
            }
        }
        for row in 0..2 {
            let got: Vec<i64> = tokens[row].iter().map(|&t| i64::from(t)).collect();
            assert_eq!(got, want[row], "{model}: row {row} over pages");
        }
        for sequence in &mut sequences {
            sequence.release(&mut pool);
        }
        assert!(pool.is_whole(), "{model}: pages left after the release");
    }
}

/// Twelve requests through the continuous-batching engine on every fixture — prompts of 3 to 40
/// ids, four of them opening with the same page of 32, fed 16 tokens a step, at most 6 running,
/// in a pool too small for all at once — each give the greedy tokens of generating it alone
/// through dense caches.
fn engine_requests_get_their_tokens_alone<B: Backend>(device: &B::Device) {
    const SHAPES: [(usize, usize); 12] = [
        (5, 8),
        (40, 3),
        (12, 6),
        (33, 8),
        (20, 4),
        (37, 5),
        (8, 8),
        (36, 2),
        (3, 7),
        (25, 6),
        (34, 4),
        (16, 8),
    ];
    for model in cases_on::<B, _>(&MODELS) {
        let lm = CausalLm::<B>::load(fixture(&format!("hf/{model}")), device).unwrap();
        let vocab = lm.config().vocab_size() as u32;
        let mut state = 0x2545_f491u32;
        let mut draw = move || {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            state % vocab
        };
        let shared: Vec<u32> = (0..32).map(|_| draw()).collect();
        let requests: Vec<Request> = SHAPES
            .iter()
            .enumerate()
            .map(|(index, &(len, limit))| {
                let mut ids: Vec<u32> = (0..len).map(|_| draw()).collect();
                if [1, 3, 7, 10].contains(&index) {
                    ids[..32].copy_from_slice(&shared);
                }
                Request::greedy(ids, limit)
            })
            .collect();
        let decoder = lm.decoder();
        let config = EngineConfig::new(8)
            .with_page_size(32)
            .with_step_tokens(16)
            .with_max_running(6);
        let mut engine = Engine::new(decoder, config, device).unwrap();
        let ids: Vec<_> = requests
            .iter()
            .map(|r| engine.add(r.clone()).unwrap())
            .collect();
        let done = engine.run_to_end().unwrap();
        for (index, request) in requests.iter().enumerate() {
            let prompt: Vec<usize> = request.ids.iter().map(|&id| id as usize).collect();
            let alone: Vec<u32> = decoder
                .generate(&prompt, request.max_new_tokens, &request.sampling, device)
                .unwrap()[prompt.len()..]
                .iter()
                .map(|&id| id as u32)
                .collect();
            let got = &done
                .iter()
                .find(|c| c.request == ids[index])
                .unwrap()
                .generated;
            assert_eq!(got, &alone, "{model}: request {index}");
        }
        let stats = engine.stats();
        assert!(stats.prefix_tokens_shared > 0, "{model}: no prefix shared");
        assert!(engine.pool().is_whole(), "{model}: pages left");
    }
}

backend_tests!(
    models_match_transformers,
    a_padded_row_generates_what_it_generates_alone,
    paged_steps_generate_each_rows_tokens,
);

/// On the CPU backends only: on wgpu its many step shapes fill the autotune cache on disk that
/// `steady_state.rs`, run after this binary from the same directory, needs empty to see a new
/// shape compile (the gpt engine tests run the engine on lavapipe).
mod engine_requests {
    #[test]
    fn ndarray() {
        super::engine_requests_get_their_tokens_alone::<attention_backends::NdArray>(
            &Default::default(),
        );
    }
    #[test]
    fn flex() {
        super::engine_requests_get_their_tokens_alone::<attention_backends::Flex>(
            &Default::default(),
        );
    }
}

/// On the CPU backends only: uncached generation recomputes a longer sequence at every step, and
/// each new length makes wgpu compile and autotune its kernels again.
mod cached_equals_uncached {
    #[test]
    fn ndarray() {
        super::cached_generation_equals_uncached::<attention_backends::NdArray>(&Default::default());
    }
    #[test]
    fn flex() {
        super::cached_generation_equals_uncached::<attention_backends::Flex>(&Default::default());
    }
}
