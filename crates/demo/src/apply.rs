//! `apply`: a PyTorch-trained layer on given inputs; outputs, attention weights and gradients
//! written as safetensors, gradients in the layout the weights came in.

use attention_core::weights::{AttentionParams, StateDict};
use attention_core::{AttentionInput, MultiHeadAttention};
use burn::backend::Autodiff;
use burn::prelude::*;

use tensor_files::OutputFile;

use crate::cli::{ApplyArgs, PathArg};
use crate::io::{read_tensor, write_tensors};
use crate::{DemoBackend, DemoError};

pub fn run<B: Backend>(backend: &DemoBackend<B>, args: &ApplyArgs) -> Result<(), DemoError> {
    let device = &backend.device;
    // Refused before any work: an output that is one of the inputs, or not a regular file.
    let mut inputs = vec![
        ("--weights", args.weights.as_path()),
        ("--input", args.input.as_path()),
    ];
    inputs.extend(args.cotangent.as_deref().map(|path| ("--cotangent", path)));
    let output = OutputFile::new(&args.output, &inputs)?;
    let weights = StateDict::load(&args.weights)?;
    let weights_error = |e| DemoError(format!("{}: {e}", args.weights.display()));
    let layout = weights.layout().map_err(weights_error)?;
    let x = read_tensor::<B, 3>(&args.input, "x", device)?;
    let [batch, seq, _] = x.dims();
    let context_length = match args.context_length {
        Some(context_length) => context_length,
        None => weights
            .mask_context_length()
            .map_err(weights_error)?
            .unwrap_or(seq),
    };
    let config = weights
        .infer_config(args.num_heads, context_length)
        .map_err(weights_error)?;

    let mut tensors = Vec::new();
    match &args.cotangent {
        None => {
            let layer = weights
                .to_layer::<B>(&config, device)
                .map_err(weights_error)?;
            let (y, attn_weights) = outputs(&layer, x, args.path)?;
            tensors.push(("y".to_string(), y.into_data()));
            tensors.extend(attn_weights.map(|w| ("attn_weights".to_string(), w.into_data())));
        }
        Some(cotangent) => {
            let layer = weights
                .to_layer::<Autodiff<B>>(&config, device)
                .map_err(weights_error)?;
            let r = read_tensor::<Autodiff<B>, 3>(cotangent, "r", device)?;
            let expected = [batch, seq, config.output_dim];
            if r.dims() != expected {
                return Err(DemoError(format!(
                    "{}: `r` has shape {:?}, expected the shape of y {expected:?}",
                    cotangent.display(),
                    r.dims()
                )));
            }
            let x = Tensor::<Autodiff<B>, 3>::from_inner(x).require_grad();
            let (y, attn_weights) = outputs(&layer, x.clone(), args.path)?;
            let grads = (y.clone() * r).sum().backward();
            tensors.push(("y".to_string(), y.inner().into_data()));
            tensors
                .extend(attn_weights.map(|w| ("attn_weights".to_string(), w.inner().into_data())));
            let grad_x = x.grad(&grads).expect("x takes part in the loss");
            tensors.push(("grad.x".to_string(), grad_x.into_data()));
            for (key, grad) in AttentionParams::grads_of(&layer, &grads).to_state_dict(layout) {
                tensors.push((format!("grad.{key}"), grad));
            }
        }
    }
    write_tensors(&output, tensors)
}

/// The layer's output on `path`, with the attention weights on the explicit path.
///
/// # Shapes
/// - `x`: `[batch, seq, input_dim]`
/// - output: `[batch, seq, output_dim]` and `[batch, heads, seq, seq]`
fn outputs<C: Backend>(
    layer: &MultiHeadAttention<C>,
    x: Tensor<C, 3>,
    path: PathArg,
) -> Result<(Tensor<C, 3>, Option<Tensor<C, 4>>), DemoError> {
    // Every path refuses an empty batch or sequence alike (the cached one would otherwise have
    // no step to concatenate).
    layer.check_input(&x, 0)?;
    Ok(match path {
        PathArg::Explicit => {
            let trace = layer.forward_traced(x)?;
            (trace.output, Some(trace.weights))
        }
        PathArg::Fused => (
            layer.forward_with(AttentionInput::new(x).path(path.attention_path()))?,
            None,
        ),
        PathArg::Cached => {
            let [batch, seq, _] = x.dims();
            let mut cache = layer.new_cache();
            let steps = (0..seq)
                .map(|t| layer.forward_cached(x.clone().slice([0..batch, t..t + 1]), &mut cache))
                .collect::<Result<Vec<_>, _>>()?;
            (Tensor::cat(steps, 1), None)
        }
    })
}
