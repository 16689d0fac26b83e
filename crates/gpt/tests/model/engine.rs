//! Continuous batching: every request's greedy tokens through the [`Engine`] equal those of
//! generating it alone through dense caches, whatever the mix — requests added while others run,
//! prompts fed in chunks beside decoding rows, sequences preempted when the pool runs short — and
//! the pool is whole after the engine drains. A sampled request's tokens do not depend on what
//! else runs; cancelling frees pages at once; bad requests are refused alone; requests sharing a
//! prompt's first pages map them instead of computing them, with the same tokens.

use crate::packed::{VOCAB, llama_style};

use attention_backends::{Flex, NdArray, Wgpu};
use burn::prelude::*;
use gpt::{
    Completion, Decoder, Engine, EngineConfig, EngineError, Event, Finish, GenerateConfig, KvDtype,
    Prompts, Request, RequestError, RequestId, Sampling, SamplingError,
};

const CONTEXT: usize = 160;

/// A prompt of `len` ids, different for each `seed`, with no period: a sequence computed again
/// from the wrong position would not find the same context.
fn prompt(len: usize, seed: u32) -> Vec<u32> {
    let mut state = 0x9e37_79b9u32 ^ seed.wrapping_mul(0x85eb_ca6b);
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            state % VOCAB as u32
        })
        .collect()
}

/// Prompt lengths and limits: short and long prompts, short and long generations.
const REQUESTS: [(usize, usize); 6] = [(45, 5), (3, 20), (70, 8), (100, 4), (12, 15), (30, 10)];

fn requests() -> Vec<Request> {
    REQUESTS
        .iter()
        .enumerate()
        .map(|(seed, &(len, limit))| Request::greedy(prompt(len, seed as u32), limit))
        .collect()
}

/// The request's new tokens, generated alone through dense caches.
fn alone<B: Backend>(model: &Decoder<B>, request: &Request, device: &B::Device) -> Vec<u32> {
    let prompt: Vec<usize> = request.ids.iter().map(|&id| id as usize).collect();
    model
        .generate(&prompt, request.max_new_tokens, &request.sampling, device)
        .unwrap()[prompt.len()..]
        .iter()
        .map(|&id| id as u32)
        .collect()
}

/// Adds the first half of `requests`, steps twice, adds the rest, and runs to the end.
fn serve<B: Backend>(
    engine: &mut Engine<'_, B>,
    requests: &[Request],
) -> Vec<(RequestId, Completion)> {
    let (early, late) = requests.split_at(requests.len() / 2);
    let mut ids: Vec<RequestId> = early
        .iter()
        .map(|r| engine.add(r.clone()).unwrap())
        .collect();
    let mut tokens: Vec<(RequestId, u32)> = Vec::new();
    for _ in 0..2 {
        for event in engine.step().unwrap() {
            if let Event::Token { request, id } = event {
                tokens.push((request, id));
            }
        }
    }
    ids.extend(late.iter().map(|r| engine.add(r.clone()).unwrap()));
    let mut completions = engine.run_to_end().unwrap();
    for completion in &mut completions {
        let mut before: Vec<u32> = tokens
            .iter()
            .filter(|(request, _)| *request == completion.request)
            .map(|&(_, id)| id)
            .collect();
        before.append(&mut completion.generated);
        completion.generated = before;
    }
    ids.into_iter()
        .map(|id| {
            let completion = completions.iter().find(|c| c.request == id).unwrap();
            (id, completion.clone())
        })
        .collect()
}

/// Llama-style decoders: their greedy tokens depend on the whole prompt (checked below), unlike
/// the tiny book's GPT of these tests, whose greedy tokens barely do.
fn models<B: Backend>(device: &B::Device) -> [(&'static str, Decoder<B>); 2] {
    [
        (
            "a Llama-style decoder",
            llama_style(device, CONTEXT, [None, None]),
        ),
        (
            "a Llama-style decoder with a window of 40 in its first block",
            llama_style(device, CONTEXT, [Some(40), None]),
        ),
    ]
}

fn configs() -> [(&'static str, EngineConfig); 3] {
    [
        ("a roomy pool", EngineConfig::new(64).with_page_size(32)),
        (
            "chunks of 16 tokens a step, 6 beside decoding rows, 4 running",
            EngineConfig::new(64)
                .with_page_size(32)
                .with_step_tokens(16)
                .with_prefill_while_decoding(6)
                .with_max_running(4),
        ),
        (
            "a pool too small for all at once, whole chunks beside decoding rows",
            EngineConfig::new(9)
                .with_page_size(32)
                .with_step_tokens(64)
                .with_prefill_while_decoding(64),
        ),
    ]
}

/// `cases`: how many of the models and configs to run (lavapipe runs the last of each: the
/// windowed model, preemption).
fn every_request_gets_its_tokens_alone<B: Backend>(device: &B::Device, cases: usize) {
    let requests = requests();
    for (name, model) in models::<B>(device).into_iter().rev().take(cases) {
        let want: Vec<Vec<u32>> = requests.iter().map(|r| alone(&model, r, device)).collect();
        let tails = requests.iter().filter(|r| {
            let tail = Request::greedy(r.ids[r.ids.len() / 2..].to_vec(), r.max_new_tokens);
            alone(&model, &tail, device) != alone(&model, r, device)
        });
        assert!(
            tails.count() >= 3,
            "{name}: a prompt's tail alone gives the same tokens: the test shows little"
        );
        for (setting, config) in configs().into_iter().rev().take(cases) {
            let mut engine = Engine::new(&model, config, device).unwrap();
            let served = serve(&mut engine, &requests);
            for (index, (_, completion)) in served.iter().enumerate() {
                assert_eq!(
                    completion.generated, want[index],
                    "{name}, {setting}: request {index}'s tokens"
                );
                assert_eq!(completion.finish, Finish::Length);
            }
            assert!(engine.pool().is_whole(), "{name}, {setting}: pages left");
            let stats = engine.stats();
            let prompts: usize = REQUESTS.iter().map(|&(len, limit)| len + limit - 1).sum();
            if setting.contains("too small") {
                assert!(stats.preemptions > 0, "{name}: nothing was preempted");
                assert!(stats.peak_pages <= 9);
                assert!(stats.tokens_fed > prompts, "{name}: nothing computed again");
            } else {
                assert_eq!(stats.preemptions, 0, "{name}, {setting}");
                assert_eq!(stats.tokens_fed, prompts, "{name}, {setting}: tokens fed");
            }
        }
    }
}

/// A sampled request with its seed gives the same tokens alone and beside others; a stop id
/// ends a request with the stop token last.
fn sampled_and_stopped_requests<B: Backend>(device: &B::Device) {
    let model = llama_style::<B>(device, CONTEXT, [None, None]);
    let sampled = Request {
        sampling: Sampling::Sample {
            temperature: 1.5,
            top_k: Some(20),
            top_p: Some(0.95),
            seed: 7,
        },
        ..Request::greedy(prompt(20, 9), 12)
    };
    let config = EngineConfig::new(64).with_page_size(32);
    let run = |others: &[Request], config: EngineConfig| {
        let mut engine = Engine::new(&model, config, device).unwrap();
        for other in others {
            engine.add(other.clone()).unwrap();
        }
        let id = engine.add(sampled.clone()).unwrap();
        let done = engine.run_to_end().unwrap();
        done.into_iter()
            .find(|c| c.request == id)
            .unwrap()
            .generated
    };
    let lone = run(&[], config.clone());
    let beside = run(&requests(), config.with_step_tokens(24).with_max_running(5));
    assert_eq!(
        lone, beside,
        "a sampled request's tokens changed with the mix"
    );
    assert_eq!(
        lone,
        alone(&model, &sampled, device),
        "the same seed through dense caches"
    );
    let greedy = Request {
        sampling: Sampling::Greedy,
        ..sampled.clone()
    };
    assert_ne!(
        lone,
        alone(&model, &greedy, device),
        "the draw picked the greedy tokens: the test shows nothing"
    );

    let plain = Request::greedy(prompt(10, 4), 12);
    let want = alone(&model, &plain, device);
    let stop = want[3];
    let first = want.iter().position(|&id| id == stop).unwrap();
    let stopping = Request {
        stop_ids: vec![stop],
        ..plain
    };
    let mut engine = Engine::new(&model, EngineConfig::new(16).with_page_size(32), device).unwrap();
    engine.add(stopping).unwrap();
    let [done] = <[Completion; 1]>::try_from(engine.run_to_end().unwrap()).unwrap();
    assert_eq!(done.finish, Finish::Stop);
    assert_eq!(done.generated, want[..=first]);
    assert!(engine.pool().is_whole());
}

/// Cancelling a running request frees its pages before the next step; the others go on.
fn cancelling_frees_pages_at_once<B: Backend>(device: &B::Device) {
    let model = llama_style::<B>(device, CONTEXT, [None, None]);
    let requests = requests();
    let mut engine = Engine::new(&model, EngineConfig::new(64).with_page_size(32), device).unwrap();
    let ids: Vec<RequestId> = requests
        .iter()
        .map(|r| engine.add(r.clone()).unwrap())
        .collect();
    engine.step().unwrap();
    let free = engine.pool().free_pages();
    assert!(engine.cancel(ids[3]), "a running request");
    // Request 3 holds its 100-token prompt: 4 pages of 32.
    assert_eq!(engine.pool().free_pages(), free + 4);
    assert!(!engine.cancel(ids[3]), "cancelled twice");
    let events = engine.step().unwrap();
    assert_eq!(
        events[0],
        Event::Finished {
            request: ids[3],
            finish: Finish::Cancelled
        }
    );
    let done = engine.run_to_end().unwrap();
    for (index, request) in requests.iter().enumerate().filter(|&(i, _)| i != 3) {
        let completion = done.iter().find(|c| c.request == ids[index]).unwrap();
        // The first step's tokens came with its events, not in `done`.
        let want = alone(&model, request, device);
        assert_eq!(
            completion.generated,
            want[want.len() - completion.generated.len()..]
        );
    }
    assert!(engine.pool().is_whole());
}

/// A step beside a decoding row feeds at most `prefill_while_decoding` prompt tokens; a step
/// with none decoding fills the budget.
fn prompts_beside_decoding_rows_are_capped<B: Backend>(device: &B::Device) {
    let model = llama_style::<B>(device, CONTEXT, [None, None]);
    let config = EngineConfig::new(64)
        .with_page_size(32)
        .with_step_tokens(64)
        .with_prefill_while_decoding(10);
    let mut engine = Engine::new(&model, config, device).unwrap();
    let short = Request::greedy(prompt(5, 1), 30);
    let long = Request::greedy(prompt(100, 2), 3);
    engine.add(short.clone()).unwrap();
    let fed = |engine: &Engine<'_, B>| engine.stats().tokens_fed;
    engine.step().unwrap();
    assert_eq!(fed(&engine), 5, "the prompt alone, whole");
    let id = engine.add(long.clone()).unwrap();
    // 100 prompt tokens at 10 a step beside the decoding row: its first token on the tenth.
    for step in 1..=10 {
        let before = fed(&engine);
        let events = engine.step().unwrap();
        assert_eq!(fed(&engine) - before, 1 + 10, "step {step}");
        let long_tokens = events
            .iter()
            .filter(|e| matches!(e, Event::Token { request, .. } if *request == id))
            .count();
        assert_eq!(long_tokens, usize::from(step == 10), "step {step}");
    }
    let done = engine.run_to_end().unwrap();
    let long_done = done.iter().find(|c| c.request == id).unwrap();
    assert_eq!(long_done.generated, alone(&model, &long, device)[1..]);
    assert!(engine.pool().is_whole());

    let zero = EngineConfig::new(64).with_prefill_while_decoding(0);
    assert!(matches!(
        Engine::new(&model, zero, device),
        Err(EngineError::Zero {
            field: "prefill_while_decoding"
        })
    ));
}

fn bad_requests_are_refused_alone<B: Backend>(device: &B::Device) {
    let model = llama_style::<B>(device, CONTEXT, [Some(40), None]);
    let mut engine = Engine::new(&model, EngineConfig::new(6).with_page_size(32), device).unwrap();
    let good = engine.add(Request::greedy(prompt(5, 1), 3)).unwrap();
    let vocab = VOCAB as u32;
    let refused = [
        (Request::greedy(vec![], 3), RequestError::EmptyPrompt),
        (Request::greedy(vec![1], 0), RequestError::NoNewTokens),
        (
            Request::greedy(vec![1, vocab], 3),
            RequestError::PromptId {
                position: 1,
                id: vocab,
                vocab_size: VOCAB,
            },
        ),
        (
            Request {
                stop_ids: vec![vocab + 5],
                ..Request::greedy(vec![1], 3)
            },
            RequestError::StopId {
                id: vocab + 5,
                vocab_size: VOCAB,
            },
        ),
        (
            Request::greedy(prompt(150, 0), 11),
            RequestError::PastContext {
                prompt: 150,
                max_new_tokens: 11,
                context_length: CONTEXT,
            },
        ),
        (
            Request {
                sampling: Sampling::Sample {
                    temperature: -1.0,
                    top_k: None,
                    top_p: None,
                    seed: 0,
                },
                ..Request::greedy(vec![1], 3)
            },
            RequestError::Sampling(SamplingError::Temperature(-1.0)),
        ),
        (
            // 150 positions, 5 pages in each attention kind (a step of up to 512 tokens may
            // hold them all in the windowed one too), in a pool of 6.
            Request::greedy(prompt(140, 0), 11),
            RequestError::LargerThanPool {
                needed: 10,
                pages: 6,
            },
        ),
    ];
    for (request, error) in refused {
        assert_eq!(engine.add(request).unwrap_err(), error);
    }
    let done = engine.run_to_end().unwrap();
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].request, good);
    assert_eq!(done[0].generated.len(), 3);

    let zero = Engine::new(&model, EngineConfig::new(6).with_max_running(0), device);
    assert_eq!(
        zero.err(),
        Some(EngineError::Zero {
            field: "max_running"
        })
    );
    let starved = Engine::new(
        &model,
        EngineConfig::new(6).with_max_running(8).with_step_tokens(4),
        device,
    );
    assert_eq!(
        starved.err(),
        Some(EngineError::BudgetBelowRunning {
            step_tokens: 4,
            max_running: 8
        })
    );
}

/// Requests that begin with the same 70 ids: those admitted after the first has computed whole
/// pages of it map them (a running sequence's, or a finished one's kept pages) and give the
/// tokens they give alone.
fn shared_prefixes_are_mapped_not_computed<B: Backend>(device: &B::Device) {
    let shared = prompt(70, 40);
    let requests: Vec<Request> = (0..4)
        .map(|seed| {
            let mut ids = shared.clone();
            ids.extend(prompt(5 + 4 * seed, 50 + seed as u32));
            Request::greedy(ids, 6)
        })
        .collect();
    for (name, model) in models::<B>(device) {
        let want: Vec<Vec<u32>> = requests.iter().map(|r| alone(&model, r, device)).collect();
        let mut fed = Vec::new();
        for share in [true, false] {
            // 32 tokens a step: the first request computes the prefix over three steps, the
            // others are admitted beside it as pages of it are done.
            let config = EngineConfig::new(64)
                .with_page_size(32)
                .with_step_tokens(32)
                .with_max_running(4)
                .with_share_prefixes(share);
            let mut engine = Engine::new(&model, config, device).unwrap();
            let served = serve(&mut engine, &requests);
            for (index, (_, completion)) in served.iter().enumerate() {
                assert_eq!(
                    completion.generated, want[index],
                    "{name}, sharing {share}: request {index}'s tokens"
                );
            }
            assert!(engine.pool().is_whole(), "{name}: pages left");
            let stats = engine.stats();
            assert_eq!(
                stats.prefix_tokens_shared > 0,
                share,
                "{name}, sharing {share}: {stats:?}"
            );
            fed.push(stats.tokens_fed);
        }
        assert!(fed[0] < fed[1], "{name}: sharing fed {fed:?}");
    }

    // A finished request's pages, kept, serve a later one.
    let model = llama_style::<B>(device, CONTEXT, [None, None]);
    let config = EngineConfig::new(64)
        .with_page_size(32)
        .with_retain_pages(8);
    let mut engine = Engine::new(&model, config, device).unwrap();
    engine.add(requests[0].clone()).unwrap();
    engine.run_to_end().unwrap();
    assert_eq!(engine.pool().free_pages(), 64 - 3, "75 + 5 positions kept");
    engine.add(requests[3].clone()).unwrap();
    let done = engine.run_to_end().unwrap();
    assert_eq!(done[0].generated, alone(&model, &requests[3], device));
    assert_eq!(engine.stats().prefix_tokens_shared, 64);
    engine.forget_prefixes();
    assert!(engine.pool().is_whole());
}

/// Pages stored in fewer bytes give each request the greedy tokens of generating it alone through
/// dense caches of the same type (both round the same keys once, when written), chunked or
/// whole, with the pool's bytes per page cut as the type says.
fn narrow_pages_give_what_narrow_dense_caches_give<B: Backend>(device: &B::Device) {
    let requests = requests();
    let model = llama_style::<B>(device, CONTEXT, [None, None]);
    let f32_page = Engine::bytes_per_page(&model, 32, KvDtype::Model).unwrap();
    for kv_dtype in [KvDtype::Int8, KvDtype::F16] {
        let want: Vec<Vec<u32>> = requests
            .iter()
            .map(|request| {
                let prompts = Prompts::left_padded(std::slice::from_ref(&request.ids), 0).unwrap();
                let config = GenerateConfig {
                    kv_dtype,
                    ..GenerateConfig::greedy(request.max_new_tokens)
                };
                let generation = model.generate_batch(&prompts, &config, device).unwrap();
                generation.tokens[0][request.ids.len()..].to_vec()
            })
            .collect();
        for (setting, config) in configs().into_iter().take(2) {
            let mut engine = Engine::new(&model, config.with_kv_dtype(kv_dtype), device).unwrap();
            let served = serve(&mut engine, &requests);
            for (index, (_, completion)) in served.iter().enumerate() {
                assert_eq!(
                    completion.generated, want[index],
                    "{kv_dtype}, {setting}: request {index}'s tokens"
                );
            }
            assert!(
                engine.pool().is_whole(),
                "{kv_dtype}, {setting}: pages left"
            );
        }
        let page = Engine::bytes_per_page(&model, 32, kv_dtype).unwrap();
        let head_dim = 4;
        let expected = f32_page / (head_dim * 4) * kv_dtype.row_bytes(head_dim, 4);
        assert_eq!(page, expected, "{kv_dtype}: bytes per page");
    }
}

#[test]
fn narrow_pages_give_what_narrow_dense_caches_give_on_ndarray_and_flex() {
    narrow_pages_give_what_narrow_dense_caches_give::<NdArray>(&Default::default());
    narrow_pages_give_what_narrow_dense_caches_give::<Flex>(&Default::default());
}

#[test]
fn narrow_pages_give_what_narrow_dense_caches_give_on_wgpu() {
    if let Some(device) = test_support::wgpu_device_for_test("engine") {
        narrow_pages_give_what_narrow_dense_caches_give::<Wgpu>(&device);
    }
}

#[test]
fn shared_prefixes_are_mapped_not_computed_on_ndarray_and_flex() {
    shared_prefixes_are_mapped_not_computed::<NdArray>(&Default::default());
    shared_prefixes_are_mapped_not_computed::<Flex>(&Default::default());
}

#[test]
fn every_request_gets_its_tokens_alone_on_ndarray_and_flex() {
    every_request_gets_its_tokens_alone::<NdArray>(&Default::default(), 3);
    every_request_gets_its_tokens_alone::<Flex>(&Default::default(), 3);
}

#[test]
fn every_request_gets_its_tokens_alone_on_wgpu() {
    if let Some(device) = test_support::wgpu_device_for_test("engine") {
        every_request_gets_its_tokens_alone::<Wgpu>(&device, 1);
    }
}

#[test]
fn sampled_and_stopped_requests_on_ndarray_and_flex() {
    sampled_and_stopped_requests::<NdArray>(&Default::default());
    sampled_and_stopped_requests::<Flex>(&Default::default());
}

#[test]
fn cancelling_frees_pages_at_once_on_ndarray() {
    cancelling_frees_pages_at_once::<NdArray>(&Default::default());
}

#[test]
fn prompts_beside_decoding_rows_are_capped_on_ndarray() {
    prompts_beside_decoding_rows_are_capped::<NdArray>(&Default::default());
}

#[test]
fn bad_requests_are_refused_alone_on_ndarray() {
    bad_requests_are_refused_alone::<NdArray>(&Default::default());
}
