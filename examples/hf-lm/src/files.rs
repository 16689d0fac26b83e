//! Token ids in, logits and generated ids out, as safetensors files.

use std::path::Path;

use burn::prelude::*;
use hf_models::{CausalLm, GenerateConfig, Prompts};
use tensor_files::{Dtype, OutputFile, RawTensor, Tensors};

use crate::{Cli, CliError};

pub fn run<B: Backend>(
    cli: &Cli,
    input: &Path,
    output: &Path,
    device: &B::Device,
) -> Result<(), CliError> {
    // Refused before any work: an output that is one of the inputs, or not a regular file.
    let model_files = [
        "config.json",
        "model.safetensors",
        "model.safetensors.index.json",
    ]
    .map(|name| cli.model.join(name));
    let mut inputs = vec![("--input", input)];
    inputs.extend(model_files.iter().map(|path| ("--model", path.as_path())));
    let output = OutputFile::new(output, &inputs)?;
    let prompts = read_prompts(input)?;
    let model = CausalLm::<B>::load(&cli.model, device)?;
    let config = GenerateConfig {
        prompt_logits: true,
        ..cli.generate_config(&model)
    };
    let generation = model.generate(&prompts, &config, device)?;
    let [batch, len] = prompts.dims();
    let logits = generation.prompt_logits.expect("asked for").into_data();
    let logits = RawTensor::from_f32(
        logits.shape.to_vec(),
        &logits
            .convert::<f32>()
            .into_vec::<f32>()
            .expect("f32 logits"),
    );
    let generated: Vec<u8> = generation
        .tokens
        .iter()
        .flatten()
        .flat_map(|&id| i64::from(id).to_le_bytes())
        .collect();
    let columns = len + cli.new_tokens;
    let generated =
        RawTensor::new(Dtype::I64, vec![batch, columns], generated).expect("one id per slot");
    let tensors = Tensors::from([
        ("logits".to_string(), logits),
        ("generated".to_string(), generated),
    ]);
    let bytes = tensor_files::safetensors::serialize(&tensors)
        .map_err(|e| CliError::Input(format!("cannot encode the output: {e}")))?;
    output.write_bytes(&bytes)?;
    Ok(())
}

/// An integer tensor's values, widened to `i64`, and its shape.
type IntTensor = (Vec<i64>, Vec<usize>);

/// `input_ids` and `attention_mask` (all ones when absent), int64 or int32, `[batch, t]`.
fn read_prompts(path: &Path) -> Result<Prompts, CliError> {
    let tensors = tensor_files::read(path)?;
    let problem = |why: String| CliError::Input(format!("{}: {why}", path.display()));
    let ints = |key: &str| -> Result<Option<IntTensor>, CliError> {
        let Some(raw) = tensors.get(key) else {
            return Ok(None);
        };
        let values = raw.to_i64().ok_or_else(|| {
            problem(format!(
                "`{key}` is {:?}, expected int64 (or int32)",
                raw.dtype
            ))
        })?;
        if raw.shape.len() != 2 {
            return Err(problem(format!(
                "`{key}` has shape {:?}, expected [batch, t]",
                raw.shape
            )));
        }
        Ok(Some((values, raw.shape.clone())))
    };
    let (ids, shape) = ints("input_ids")?.ok_or_else(|| problem("no `input_ids`".into()))?;
    let mask = match ints("attention_mask")? {
        Some((_, mask_shape)) if mask_shape != shape => {
            return Err(problem(format!(
                "`attention_mask` has shape {mask_shape:?}, `input_ids` {shape:?}"
            )));
        }
        Some((mask, _)) => mask,
        None => vec![1; ids.len()],
    };
    Prompts::from_padded(&ids, &mask, [shape[0], shape[1]]).map_err(|e| problem(e.to_string()))
}
