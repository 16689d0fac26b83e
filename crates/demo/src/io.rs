//! The command line's files: tensors read from safetensors or `.pt` files, outputs written as
//! safetensors through [`OutputFile`] (never over an input, whole or not at all).

use std::path::Path;

use attention_core::weights::StateDict;
use burn::prelude::*;
use tensor_files::{OutputFile, RawTensor, Tensors};

use crate::DemoError;

/// The float tensor `key` of the file `path`, checked for its rank.
pub fn read_tensor<B: Backend, const D: usize>(
    path: &Path,
    key: &str,
    device: &B::Device,
) -> Result<Tensor<B, D>, DemoError> {
    let dict = StateDict::load(path)?;
    dict.tensor::<B, D>(key, device)
        .map_err(|error| DemoError(format!("{}: {error}", path.display())))
}

/// Writes named tensors as an f32 safetensors file.
pub fn write_tensors(
    output: &OutputFile,
    tensors: Vec<(String, TensorData)>,
) -> Result<(), DemoError> {
    let tensors: Tensors = tensors
        .into_iter()
        .map(|(name, data)| {
            let shape = data.shape.to_vec();
            let values = data
                .convert::<f32>()
                .into_vec::<f32>()
                .expect("f32 after convert");
            (name, RawTensor::from_f32(shape, &values))
        })
        .collect();
    let bytes = tensor_files::safetensors::serialize(&tensors).map_err(|error| {
        DemoError(format!(
            "cannot encode {}: {error}",
            output.path().display()
        ))
    })?;
    output.write_bytes(&bytes)?;
    Ok(())
}
