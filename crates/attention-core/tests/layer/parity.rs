//! Parity with PyTorch: every `book_*` fixture (made by the source chapter's module in PyTorch
//! 2.15, see `fixtures/README.md`) on every backend — output, attention weights and the
//! gradients of `loss = sum(y * r)` for the input and every parameter.

use crate::common;

use attention_backends::compare::assert_close;
use attention_core::weights::{AttentionParams, StateDict, WeightsLayout};
use burn::backend::Autodiff;
use burn::prelude::*;
use common::{ATOL, RTOL, book_fixtures, fixture_layer};
use test_support::cases_on;

/// Forward output (default and explicit path) and attention weights.
fn forward_matches_pytorch<B: Backend>(device: &B::Device) {
    for path in cases_on::<B, _>(&book_fixtures()) {
        let fixture = StateDict::load(path).unwrap();
        let layer = fixture_layer::<B>(&fixture, path, device);
        let x = fixture.tensor::<B, 3>("x", device).unwrap();
        let name = path.file_name().unwrap().to_string_lossy();
        let expected_y = fixture.tensor::<B, 3>("y", device).unwrap().into_data();

        let y = layer.forward(x.clone());
        assert_close(
            &y.into_data(),
            &expected_y,
            ATOL,
            RTOL,
            &format!("{name}: y"),
        );
        let trace = layer.forward_traced(x).unwrap();
        assert_close(
            &trace.output.into_data(),
            &expected_y,
            ATOL,
            RTOL,
            &format!("{name}: y (explicit)"),
        );
        let expected_w = fixture.tensor::<B, 4>("attn_weights", device).unwrap();
        assert_close(
            &trace.weights.into_data(),
            &expected_w.into_data(),
            ATOL,
            RTOL,
            &format!("{name}: attn_weights"),
        );
    }
}

/// The `.pt` state dict loads to the same parameters as the `.safetensors` one.
fn pt_loads_like_safetensors<B: Backend>(device: &B::Device) {
    let st = test_support::fixture("book_s0_b2_t5_i8_o8_h2_bias.safetensors");
    let fixture = StateDict::load(&st).unwrap();
    let from_st = fixture_layer::<B>(&fixture, &st, device);
    let from_pt = fixture_layer::<B>(
        &fixture,
        &test_support::fixture("book_s0_b2_t5_i8_o8_h2_bias.pt"),
        device,
    );
    let a = AttentionParams::of(&from_st).to_state_dict(WeightsLayout::Chapter);
    let b = AttentionParams::of(&from_pt).to_state_dict(WeightsLayout::Chapter);
    assert_eq!(a.len(), 8, "4 weights and 4 biases");
    for ((key_a, data_a), (key_b, data_b)) in a.iter().zip(&b) {
        assert_eq!(key_a, key_b);
        assert_eq!(
            data_a, data_b,
            "{key_a} differs between .pt and .safetensors"
        );
    }
    // And the .pt layer reproduces the reference output.
    let y = from_pt.forward(fixture.tensor("x", device).unwrap());
    assert_close(
        &y.into_data(),
        &fixture.tensor::<B, 3>("y", device).unwrap().into_data(),
        ATOL,
        RTOL,
        ".pt: y",
    );
}

/// `d sum(y * r) / d x` and `/ d param` for every parameter, in PyTorch's layout.
fn gradients_match_pytorch<B: Backend>(device: &B::Device) {
    for path in cases_on::<B, _>(&book_fixtures()) {
        let fixture = StateDict::load(path).unwrap();
        let name = path.file_name().unwrap().to_string_lossy();
        let layer = fixture_layer::<Autodiff<B>>(&fixture, path, device);
        let x = fixture
            .tensor::<Autodiff<B>, 3>("x", device)
            .unwrap()
            .require_grad();
        let r = fixture.tensor::<Autodiff<B>, 3>("r", device).unwrap();
        let grads = (layer.forward(x.clone()) * r).sum().backward();

        let grad_x = x.grad(&grads).expect("x has a gradient");
        let expected = fixture.tensor::<B, 3>("grad.x", device).unwrap();
        assert_close(
            &grad_x.into_data(),
            &expected.into_data(),
            ATOL,
            RTOL,
            &format!("{name}: grad.x"),
        );

        let param_grads =
            AttentionParams::grads_of(&layer, &grads).to_state_dict(WeightsLayout::Chapter);
        let expected_count = fixture
            .keys()
            .filter(|k| k.starts_with("grad.") && *k != "grad.x")
            .count();
        assert_eq!(
            param_grads.len(),
            expected_count,
            "{name}: one gradient per parameter"
        );
        for (key, grad) in param_grads {
            let reference = format!("grad.{key}");
            let expected = match grad.shape.len() {
                1 => fixture
                    .tensor::<B, 1>(&reference, device)
                    .unwrap()
                    .into_data(),
                _ => fixture
                    .tensor::<B, 2>(&reference, device)
                    .unwrap()
                    .into_data(),
            };
            assert_close(
                &grad,
                &expected,
                ATOL,
                RTOL,
                &format!("{name}: {reference}"),
            );
        }
    }
}

test_support::backend_tests!(
    forward_matches_pytorch,
    pt_loads_like_safetensors,
    gradients_match_pytorch
);
