//! The whole model: shapes, causality, cached == uncached generation, record round trip, and a
//! short training run that lowers the loss.

use attention_backends::NdArray;
use burn::backend::Autodiff;
use burn::module::Module;
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::prelude::*;
use burn::record::{BinFileRecorder, FullPrecisionSettings};
use burn::tensor::loss::cross_entropy_with_logits;
use gpt::{
    DecoderError, GenerateConfig, GenerateError, GptConfig, GptModel, Prompts, PromptsError,
    Sampling, SamplingError,
};

fn config() -> GptConfig {
    GptConfig::new(50, 16, 24, 3, 2).with_qkv_bias(true)
}

fn model<B: Backend>(seed: u64, device: &B::Device) -> GptModel<B> {
    B::seed(device, seed);
    config().init(device)
}

fn tokens<B: Backend>(ids: &[[i64; 6]], device: &B::Device) -> Tensor<B, 2, Int> {
    let flat: Vec<i64> = ids.iter().flatten().copied().collect();
    Tensor::<B, 1, Int>::from_data(TensorData::new(flat, [ids.len() * 6]), device)
        .reshape([ids.len(), 6])
}

#[test]
fn logits_have_the_vocabulary_at_every_position() {
    let device = Default::default();
    let logits = model::<NdArray>(1, &device).forward(tokens(
        &[[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]],
        &device,
    ));
    assert_eq!(logits.dims(), [2, 6, 50]);
    assert!(
        logits
            .into_data()
            .to_vec::<f32>()
            .unwrap()
            .iter()
            .all(|v| v.is_finite())
    );
}

#[test]
fn future_tokens_do_not_change_earlier_logits() {
    let device = Default::default();
    let model = model::<NdArray>(2, &device);
    let a = model.forward(tokens(&[[1, 2, 3, 4, 5, 6]], &device));
    let b = model.forward(tokens(&[[1, 2, 3, 40, 41, 42]], &device));
    let head = |t: Tensor<NdArray, 3>| t.slice([0..1, 0..3]).into_data();
    head(a.clone())
        .assert_approx_eq::<f32>(&head(b.clone()), burn::tensor::Tolerance::absolute(1e-5));
    let moved = (a.slice([0..1, 3..6]) - b.slice([0..1, 3..6]))
        .abs()
        .max()
        .into_scalar();
    assert!(moved > 1e-3, "later logits must depend on later tokens");
}

#[test]
fn cached_generation_gives_the_uncached_tokens() {
    let device = Default::default();
    let model = model::<NdArray>(3, &device);
    let prompt = [5, 9, 13];
    for sampling in [
        Sampling::Greedy,
        Sampling::Sample {
            temperature: 0.8,
            top_k: Some(5),
            top_p: None,
            seed: 7,
        },
    ] {
        let cached = model.generate(&prompt, 12, &sampling, &device).unwrap();
        // The same row through `generate_batch` without the caches.
        let without_caches = GenerateConfig {
            sampling: sampling.clone(),
            use_cache: false,
            ..GenerateConfig::greedy(12)
        };
        let row = prompt.map(|id| id as u32).to_vec();
        let prompts = Prompts::left_padded(&[row], 0).unwrap();
        let uncached = model.generate_batch(&prompts, &without_caches, &device);
        let cached_row: Vec<u32> = cached.iter().map(|&id| id as u32).collect();
        assert_eq!(uncached.unwrap().tokens, [cached_row], "{sampling:?}");
        assert_eq!(&cached[..3], &prompt);
        assert_eq!(cached.len(), 15);
    }
    let a = model
        .generate(
            &prompt,
            12,
            &Sampling::Sample {
                temperature: 2.0,
                top_k: Some(50),
                top_p: None,
                seed: 1,
            },
            &device,
        )
        .unwrap();
    let b = model
        .generate(
            &prompt,
            12,
            &Sampling::Sample {
                temperature: 2.0,
                top_k: Some(50),
                top_p: None,
                seed: 2,
            },
            &device,
        )
        .unwrap();
    assert_ne!(a, b, "different seeds, different samples");
}

#[test]
fn generation_errors() {
    let device = Default::default();
    let model = model::<NdArray>(4, &device);
    assert_eq!(
        model.generate(&[], 3, &Sampling::Greedy, &device),
        Err(GenerateError::Prompts(PromptsError::EmptyPrompt))
    );
    assert_eq!(
        model.generate(&[1, 50], 3, &Sampling::Greedy, &device),
        Err(GenerateError::TokenOutOfRange {
            row: 0,
            column: 1,
            token: 50,
            vocab_size: 50
        })
    );
    assert_eq!(
        model.generate(&[1; 10], 7, &Sampling::Greedy, &device),
        Err(GenerateError::TooLong {
            prompt: 10,
            new: 7,
            max_positions: 16
        })
    );
    assert_eq!(
        model.generate(
            &[1],
            3,
            &Sampling::Sample {
                temperature: 1.0,
                top_k: Some(0),
                top_p: None,
                seed: 0
            },
            &device
        ),
        Err(GenerateError::Sampling(SamplingError::TopK(0)))
    );
    let mut caches = model.new_caches();
    caches.pop();
    assert_eq!(
        model
            .forward_cached(tokens(&[[1, 2, 3, 4, 5, 6]], &device), &mut caches)
            .map(drop),
        Err(DecoderError::Caches {
            found: 1,
            layers: 2
        })
    );
}

#[test]
fn a_saved_and_loaded_model_gives_identical_logits() {
    let device = Default::default();
    let model = model::<NdArray>(5, &device);
    let input = tokens(&[[3, 1, 4, 1, 5, 9]], &device);
    let before = model.forward(input.clone()).into_data();
    let path = std::env::temp_dir().join(format!("gpt-record-{}", std::process::id()));
    let recorder = BinFileRecorder::<FullPrecisionSettings>::new();
    model.save_file(&path, &recorder).unwrap();
    let loaded = config()
        .init::<NdArray>(&device)
        .load_file(&path, &recorder, &device)
        .unwrap();
    assert_eq!(loaded.forward(input).into_data(), before);
    let _ = std::fs::remove_file(path.with_extension("bin"));
}

#[test]
fn a_few_training_steps_lower_the_loss() {
    type B = Autodiff<NdArray>;
    let device = Default::default();
    let mut model = model::<B>(6, &device);
    let mut optimizer = AdamWConfig::new().init::<B, GptModel<B>>();
    // A repeating pattern: each next token is predictable from the current one.
    let batch = tokens::<B>(
        &[[1, 2, 3, 1, 2, 3], [2, 3, 1, 2, 3, 1], [3, 1, 2, 3, 1, 2]],
        &device,
    );
    let inputs = batch.clone().slice([0..3, 0..5]);
    let targets = batch.slice([0..3, 1..6]).reshape([15]);
    let loss_of = |model: &GptModel<B>| {
        let logits = model.forward(inputs.clone()).reshape([15, 50]);
        cross_entropy_with_logits(logits, targets.clone().one_hot(50).float())
    };
    let first = loss_of(&model).into_scalar();
    for _ in 0..30 {
        let loss = loss_of(&model);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optimizer.step(3e-3, model, grads);
    }
    let last = loss_of(&model).into_scalar();
    assert!(last < 0.5 * first, "loss {first} -> {last}");
}
