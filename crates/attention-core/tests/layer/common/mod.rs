//! Shared by the modules of the layer's test binary: the PyTorch fixtures and small builders.

use std::path::PathBuf;

use attention_core::weights::{LayerWeights, StateDict};
use attention_core::{MultiHeadAttention, MultiHeadAttentionConfig};
use burn::prelude::*;

/// PyTorch's `allclose` tolerance the fixtures are made for (see `fixtures/README.md`).
pub const ATOL: f64 = 1e-5;
pub const RTOL: f64 = 1e-4;

/// The chapter-module fixtures (`book_*.safetensors`), sorted.
pub fn book_fixtures() -> Vec<PathBuf> {
    let dir = test_support::fixture("");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("the fixtures folder")
        .map(|entry| entry.unwrap().path())
        .filter(|path| {
            let name = path.file_name().unwrap().to_string_lossy();
            name.starts_with("book_") && name.ends_with(".safetensors")
        })
        .collect();
    files.sort();
    assert!(files.len() >= 8, "expected the 8 book fixtures in {dir:?}");
    files
}

/// The number of heads in a fixture's name (`…_h<heads>_…`).
pub fn heads_of(path: &std::path::Path) -> usize {
    let name = path.file_stem().unwrap().to_string_lossy();
    name.split('_')
        .find_map(|part| part.strip_prefix('h').and_then(|n| n.parse().ok()))
        .expect("fixture name has _h<heads>_")
}

/// A fixture's layer, built from its weights in `weights_file` (the fixture itself or its `.pt`).
pub fn fixture_layer<B: Backend>(
    fixture: &StateDict,
    weights_file: &std::path::Path,
    device: &B::Device,
) -> MultiHeadAttention<B> {
    let weights = StateDict::load(weights_file).unwrap();
    let config = weights
        .infer_config(
            heads_of(fixture.path()),
            fixture.mask_context_length().unwrap().unwrap(),
        )
        .unwrap();
    weights.to_layer(&config, device).unwrap()
}

/// A layer with PyTorch's default initialization from a fixed seed.
pub fn seeded_layer<B: Backend>(
    config: &MultiHeadAttentionConfig,
    seed: u64,
    device: &B::Device,
) -> MultiHeadAttention<B> {
    B::seed(device, seed);
    let layer = config.init(device);
    // Burn initializes parameters lazily, on first use: draw them now, while the seed holds.
    let _ = attention_core::weights::AttentionParams::of(&layer);
    layer
}

/// A standard-normal tensor from a fixed seed.
pub fn randn<B: Backend, const D: usize>(
    shape: [usize; D],
    seed: u64,
    device: &B::Device,
) -> Tensor<B, D> {
    B::seed(device, seed);
    Tensor::random(shape, burn::tensor::Distribution::Normal(0.0, 1.0), device)
}

/// The layer's output for `x` on `path`.
pub fn on_path<B: Backend>(
    layer: &MultiHeadAttention<B>,
    x: Tensor<B, 3>,
    path: attention_core::AttentionPath,
) -> Tensor<B, 3> {
    layer
        .try_forward(attention_core::AttentionInput::new(x).path(path))
        .unwrap()
}

/// `y = layer(input)`, `x`'s gradient and every parameter's (named as the chapter's state dict
/// names them), for the loss `sum(y · r)`: what a path must give to equal another.
pub fn output_and_gradients<B: burn::tensor::backend::AutodiffBackend>(
    layer: &MultiHeadAttention<B>,
    input: attention_core::AttentionInput<B>,
    x: &Tensor<B, 3>,
    r: Tensor<B, 3>,
) -> Vec<(String, TensorData)> {
    use attention_core::weights::{AttentionParams, WeightsLayout};
    let y = layer.try_forward(input).unwrap();
    let grads = (y.clone() * r).sum().backward();
    let mut tensors = vec![
        ("y".to_string(), y.into_data()),
        ("grad.x".to_string(), x.grad(&grads).unwrap().into_data()),
    ];
    tensors.extend(AttentionParams::grads_of(layer, &grads).to_state_dict(WeightsLayout::Chapter));
    tensors
}
