//! Safetensors in and out, for the command line's files.

use std::path::Path;

use attention_core::weights::StateDict;
use burn::prelude::*;
use safetensors::Dtype;
use safetensors::tensor::TensorView;

use crate::DemoError;

/// The float tensor `key` of the safetensors file `path`, checked for its rank.
pub fn read_tensor<B: Backend, const D: usize>(
    path: &Path,
    key: &str,
    device: &B::Device,
) -> Result<Tensor<B, D>, DemoError> {
    let dict = StateDict::load(path)?;
    dict.tensor::<B, D>(key, device)
        .map_err(|error| DemoError(format!("{}: {error}", path.display())))
}

/// Writes named tensors as f32 safetensors, all or nothing: into a temporary file beside `path`,
/// renamed over it only once complete.
pub fn write_tensors(path: &Path, tensors: Vec<(String, TensorData)>) -> Result<(), DemoError> {
    let encoded: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .into_iter()
        .map(|(name, data)| {
            let shape = data.shape.to_vec();
            let values = data
                .convert::<f32>()
                .into_vec::<f32>()
                .expect("f32 after convert");
            let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            (name, shape, bytes)
        })
        .collect();
    write_encoded(path, &encoded)
}

/// Writes `(name, shape, little-endian f32 bytes)` tensors through a temporary file.
fn write_encoded(path: &Path, tensors: &[(String, Vec<usize>, Vec<u8>)]) -> Result<(), DemoError> {
    let views = tensors
        .iter()
        .map(|(name, shape, bytes)| {
            Ok((
                name.clone(),
                TensorView::new(Dtype::F32, shape.clone(), bytes)?,
            ))
        })
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()?;
    let file_name = path
        .file_name()
        .ok_or_else(|| DemoError(format!("{}: not a file path", path.display())))?;
    let temporary = path.with_file_name(format!(".{}.partial", file_name.to_string_lossy()));
    let written = safetensors::serialize_to_file(views, None, &temporary)
        .map_err(DemoError::from)
        .and_then(|()| std::fs::rename(&temporary, path).map_err(DemoError::from));
    if written.is_err() {
        let _ = std::fs::remove_file(&temporary);
    }
    written.map_err(|error| DemoError(format!("cannot write {}: {error}", path.display())))
}
