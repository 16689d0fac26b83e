//! `apply`: a PyTorch-trained layer on given inputs (with their rotary positions and the documents
//! their rows are packed from, where the input file has them); outputs, attention weights and
//! gradients written as safetensors, gradients in the layout the weights came in.

use attention_core::weights::{AttentionParams, LayerWeights, StateDict};
use attention_core::{
    AttentionError, AttentionInput, Documents, KvDtype, MultiHeadAttention,
    MultiHeadAttentionConfig, QkNormConfig, QkNormScope, RopeConfig, RopeLayout, RopeScaling,
};
use burn::backend::Autodiff;
use burn::prelude::*;
use burn::tensor::{Int, TensorData};

use tensor_files::OutputFile;

use crate::cli::{ApplyArgs, PathArg, QkNormArg, RopeLayoutArg};
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
    let config = with_flags(config, args)?;
    let input = StateDict::load(&args.input)?;
    let positions = read_positions::<B>(&input, [batch, seq], device)?;
    let documents = read_documents(&input, [batch, seq])?;
    if args.kv_dtype.is_narrow() && args.path != PathArg::Cached {
        return Err(DemoError(format!(
            "--kv-dtype {} is for --path cached (the other paths keep no cache)",
            args.kv_dtype
        )));
    }
    if documents.is_some() && args.path == PathArg::Cached {
        // The layer refuses too (a cached call continues one sequence per row); said here first,
        // naming the file and the tensor that asked for documents.
        return Err(DemoError(format!(
            "{}: `segment_ids` cannot go with --path cached: {}",
            args.input.display(),
            AttentionError::DocumentsWithCache
        )));
    }

    let mut tensors = Vec::new();
    match &args.cotangent {
        None => {
            let layer = weights
                .to_layer::<B>(&config, device)
                .map_err(weights_error)?;
            let path = (args.path, args.kv_dtype);
            let (y, attn_weights) = outputs(&layer, x, positions, documents.as_ref(), path)?;
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
            let positions = positions.map(Tensor::from_inner);
            let path = (args.path, args.kv_dtype);
            let (y, attn_weights) =
                outputs(&layer, x.clone(), positions, documents.as_ref(), path)?;
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

/// The inferred config with what the flags add (RoPE, partial rotary, a window, the q/k norms'
/// scope, epsilon and convention) and check (heads, head width).
fn with_flags(
    config: MultiHeadAttentionConfig,
    args: &ApplyArgs,
) -> Result<MultiHeadAttentionConfig, DemoError> {
    let weights = args.weights.display();
    for (flag, given, found) in [
        ("--num-kv-heads", args.num_kv_heads, config.num_kv_heads()),
        ("--head-dim", args.head_dim, config.head_dim()),
    ] {
        if given.is_some_and(|given| given != found) {
            return Err(DemoError(format!(
                "{flag} {} disagrees with {weights}: its projections' shapes give {found} for \
                 --num-heads {}",
                given.unwrap_or_default(),
                args.num_heads
            )));
        }
    }
    let rope = match args.rope_theta {
        None => None,
        Some(theta) => Some(
            RopeConfig::new()
                .with_theta(theta)
                .with_layout(match args.rope_layout {
                    RopeLayoutArg::Half => RopeLayout::Half,
                    RopeLayoutArg::Interleaved => RopeLayout::Interleaved,
                })
                .with_scaling(match &args.rope_scaling {
                    Some(json) => rope_scaling(json)?,
                    None => RopeScaling::None,
                })
                .with_rotary_dim(args.rotary_dim),
        ),
    };
    let qk_norm = qk_norm_of(config.qk_norm.as_ref(), args)?;
    let config = config
        .with_rope(rope)
        .with_sliding_window(args.sliding_window)
        .with_qk_norm(qk_norm)
        .with_scale(args.scale)
        .with_softcap(args.softcap);
    config.validate()?;
    Ok(config)
}

/// The q/k norms: over the features `--qk-norm` names, else those the weights' shapes gave
/// (`inferred`), with `--qk-norm-eps` and `--qk-norm-unit-offset`. Whether the weights fit the
/// scope is checked when they are loaded, naming the key.
fn qk_norm_of(
    inferred: Option<&QkNormConfig>,
    args: &ApplyArgs,
) -> Result<Option<QkNormConfig>, DemoError> {
    let scope = match args.qk_norm {
        Some(QkNormArg::Head) => Some(QkNormScope::Head),
        Some(QkNormArg::Width) => Some(QkNormScope::Width),
        None => inferred.map(|norm| norm.scope),
    };
    let Some(scope) = scope else {
        let flags = [
            ("--qk-norm-eps", args.qk_norm_eps.is_some()),
            ("--qk-norm-unit-offset", args.qk_norm_unit_offset),
        ];
        return match flags.into_iter().find(|&(_, given)| given) {
            Some((flag, _)) => Err(DemoError(format!(
                "{flag} needs q/k norms: {} has no q/k norm weights (`q_norm.weight`, \
                 `k_norm.weight`) and --qk-norm is not given",
                args.weights.display()
            ))),
            None => Ok(None),
        };
    };
    let mut norm = QkNormConfig::new(scope).with_unit_offset(args.qk_norm_unit_offset);
    if let Some(epsilon) = args.qk_norm_eps {
        norm = norm.with_epsilon(epsilon);
    }
    Ok(Some(norm))
}

/// `--rope-scaling`'s JSON, as Hugging Face's `rope_scaling` writes it.
fn rope_scaling(json: &str) -> Result<RopeScaling, DemoError> {
    let value: serde_json::Value = serde_json::from_str(json)
        .map_err(|e| DemoError(format!("--rope-scaling: not JSON: {e}")))?;
    Ok(hf_models::rope_scaling(&value)?)
}

/// The input file's `position_ids` (`[batch, seq]`, integers), if it has them.
fn read_positions<B: Backend>(
    input: &StateDict,
    shape: [usize; 2],
    device: &B::Device,
) -> Result<Option<Tensor<B, 2, Int>>, DemoError> {
    let positions = integer_rows(input, "position_ids", shape)?;
    Ok(positions.map(|data| Tensor::from_data(data.clone(), device)))
}

/// The documents the input file's `segment_ids` (`[batch, seq]`, integers) describe, if it has
/// them: a run of equal ids is one document (ids at least 0, never decreasing along a row), as
/// PyTorch's document masks take them.
///
/// The ids are checked on the host, as the file holds them: on the device they would first be
/// narrowed to the backend's integer type, which may not hold an int64 id.
fn read_documents(input: &StateDict, shape: [usize; 2]) -> Result<Option<Documents>, DemoError> {
    let Some(data) = integer_rows(input, "segment_ids", shape)? else {
        return Ok(None);
    };
    // Every integer type a file holds (int8 to int64, uint8) widens to i64 exactly.
    let ids: Vec<i64> = data.iter::<i64>().collect();
    let documents = Documents::from_segment_id_rows(&ids, shape).map_err(|error| {
        DemoError(format!(
            "{}: `segment_ids`: {error}",
            input.path().display()
        ))
    })?;
    Ok(Some(documents))
}

/// The input file's tensor `key`, if present, checked to be integers of shape `[batch, seq]`.
fn integer_rows<'a>(
    input: &'a StateDict,
    key: &str,
    [batch, seq]: [usize; 2],
) -> Result<Option<&'a TensorData>, DemoError> {
    let Some(data) = input.data(key) else {
        return Ok(None);
    };
    let integers = data.dtype.is_int() || data.dtype.is_uint();
    if data.shape.as_slice() != [batch, seq] || !integers {
        return Err(DemoError(format!(
            "{}: `{key}` must be integers of shape [batch, seq] = [{batch}, {seq}], got {:?} {:?}",
            input.path().display(),
            data.dtype,
            data.shape.as_slice()
        )));
    }
    Ok(Some(data))
}

/// The layer's output on `path`, with the attention weights on the explicit path; with
/// `documents`, each token attends within its own document only (the cached path refuses them:
/// [`AttentionError::DocumentsWithCache`]); the cached path's cache stores `kv_dtype`.
///
/// # Shapes
/// - `x`: `[batch, seq, input_dim]`; `positions` and `documents`: `[batch, seq]`
/// - output: `[batch, seq, output_dim]` and `[batch, heads, seq, seq]`
fn outputs<C: Backend>(
    layer: &MultiHeadAttention<C>,
    x: Tensor<C, 3>,
    positions: Option<Tensor<C, 2, Int>>,
    documents: Option<&Documents>,
    (path, kv_dtype): (PathArg, KvDtype),
) -> Result<(Tensor<C, 3>, Option<Tensor<C, 4>>), DemoError> {
    let input = |x: Tensor<C, 3>, positions: Option<Tensor<C, 2, Int>>| {
        let mut input = AttentionInput::new(x).path(path.attention_path());
        if let Some(positions) = positions {
            input = input.positions(positions);
        }
        if let Some(documents) = documents {
            input = input.documents(documents.clone());
        }
        input
    };
    Ok(match path {
        PathArg::Explicit => {
            let trace = layer.forward_traced(input(x, positions))?;
            (trace.output, Some(trace.weights))
        }
        PathArg::Fused => (layer.try_forward(input(x, positions))?, None),
        PathArg::Cached => {
            let [batch, seq, _] = x.dims();
            // No token, no step: refused as the other paths refuse it, with the layer's error.
            if seq == 0 {
                return Err(AttentionError::EmptySequence.into());
            }
            let mut cache = layer.new_cache().with_kv_dtype(kv_dtype);
            let steps = (0..seq)
                .map(|t| {
                    let token = x.clone().slice([0..batch, t..t + 1]);
                    let position = positions
                        .clone()
                        .map(|positions| positions.slice([0..batch, t..t + 1]));
                    layer.forward_cached(input(token, position), &mut cache)
                })
                .collect::<Result<Vec<_>, _>>()?;
            (Tensor::cat(steps, 1), None)
        }
    })
}
