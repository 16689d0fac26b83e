//! A trained model on disk: a directory with `config.json` (the [`GptConfig`]) and
//! `model.safetensors` (every parameter, f32, named by its path in the model).
//!
//! Loading treats the directory as hostile input: the config is validated, and every tensor the
//! config implies is checked against the file, by name and shape, *before* the model is
//! allocated, so a config that disagrees with its weights says which field is wrong instead of
//! allocating what it asks for. Saving writes the directory as a unit ([`OutputDir`]): the path
//! holds the old checkpoint or the new one, never a mixture, and a directory holding anything
//! else is never replaced.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::prelude::*;
use tensor_files::{Dtype, FileError, OutputDir, OutputError, RawTensor, Tensors};
use thiserror::Error;

use crate::config::{GptConfig, GptConfigError, GptModel};
use crate::named::{load_parameters, named_parameters};

/// The config's file name.
pub const CONFIG_FILE: &str = "config.json";
/// The weights' file name.
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// The largest `config.json` read.
const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// Why a checkpoint could not be loaded or saved.
#[derive(Debug, Error)]
pub enum CheckpointError {
    /// The directory lacks a file of a checkpoint.
    #[error("{dir}: not a checkpoint (no {file})")]
    NotACheckpoint {
        /// The directory.
        dir: PathBuf,
        /// The missing file.
        file: &'static str,
    },
    /// `config.json` could not be read or parsed.
    #[error("{path}: {problem}")]
    ConfigFile {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        problem: String,
    },
    /// `config.json` parses but describes no valid model.
    #[error("{path}: {source}")]
    InvalidConfig {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        source: GptConfigError,
    },
    /// A file of the checkpoint could not be read (absent, not a regular file, too large for a
    /// config, a malformed `model.safetensors`).
    #[error(transparent)]
    File(#[from] FileError),
    /// The weights lack a tensor the config implies.
    #[error("{path}: no tensor `{key}`, which config.json implies ({fields})")]
    MissingTensor {
        /// The weights file.
        path: PathBuf,
        /// The tensor.
        key: String,
        /// The config fields that call for it.
        fields: &'static str,
    },
    /// The weights hold a tensor the config has no place for.
    #[error(
        "{path}: tensor `{key}` has no place in the model config.json describes \
         (num_layers = {num_layers}, qkv_bias = {qkv_bias})"
    )]
    UnexpectedTensor {
        /// The weights file.
        path: PathBuf,
        /// The tensor.
        key: String,
        /// The config's layer count.
        num_layers: usize,
        /// The config's bias flag.
        qkv_bias: bool,
    },
    /// A tensor's shape disagrees with the config.
    #[error("{path}: `{key}` has shape {found:?}, but config.json implies {expected:?} = {fields}")]
    TensorShape {
        /// The weights file.
        path: PathBuf,
        /// The tensor.
        key: String,
        /// Its shape in the file.
        found: Vec<usize>,
        /// The shape the config implies.
        expected: Vec<usize>,
        /// The config fields it comes from.
        fields: &'static str,
    },
    /// The config implies another number of parameters than the file holds.
    #[error(
        "{path} holds {found} parameters, but config.json implies {expected} \
         (vocab_size, context_length, d_model, num_layers or qkv_bias disagree with the weights)"
    )]
    ParameterCount {
        /// The weights file.
        path: PathBuf,
        /// What the file holds.
        found: usize,
        /// What the config implies.
        expected: usize,
    },
    /// A tensor is not `f32`.
    #[error("{path}: `{key}` has element type {dtype:?}, expected F32")]
    TensorDtype {
        /// The weights file.
        path: PathBuf,
        /// The tensor.
        key: String,
        /// Its type.
        dtype: Dtype,
    },
    /// The checkpoint could not be written (the path is as it was).
    #[error(transparent)]
    Output(#[from] OutputError),
}

/// Reads and validates `config.json` of a checkpoint directory. A config too large to address
/// passes here: [`load`] then names the tensor that disagrees with it.
pub fn load_config(dir: &Path) -> Result<GptConfig, CheckpointError> {
    let path = dir.join(CONFIG_FILE);
    if std::fs::metadata(&path).is_err() {
        return Err(CheckpointError::NotACheckpoint {
            dir: dir.to_path_buf(),
            file: CONFIG_FILE,
        });
    }
    let config_error = |problem: String| CheckpointError::ConfigFile {
        path: path.clone(),
        problem,
    };
    // A FIFO or a device in its place is refused, not waited on; so is an oversized file.
    let text = tensor_files::read_text(&path, MAX_CONFIG_BYTES)?;
    let config: GptConfig = serde_json::from_str(&text).map_err(|e| config_error(e.to_string()))?;
    match config.validate() {
        Ok(()) | Err(GptConfigError::Overflow) => Ok(config),
        Err(source) => Err(CheckpointError::InvalidConfig { path, source }),
    }
}

/// Loads a checkpoint written by [`save`], after checking every tensor against the config.
pub fn load<B: Backend>(dir: &Path, device: &B::Device) -> Result<GptModel<B>, CheckpointError> {
    let config = load_config(dir)?;
    let path = dir.join(WEIGHTS_FILE);
    if std::fs::metadata(&path).is_err() {
        return Err(CheckpointError::NotACheckpoint {
            dir: dir.to_path_buf(),
            file: WEIGHTS_FILE,
        });
    }
    let mut tensors = tensor_files::safetensors::read(&path)?;
    // A cheap check first, so that a config asking for a huge model fails before its list of
    // tensors is even built.
    let found: usize = tensors.values().map(RawTensor::numel).sum();
    let expected_count = config.parameter_count().unwrap_or(usize::MAX);
    if found != expected_count {
        if let Some(mismatch) = first_mismatch(&config, &tensors, &path) {
            return Err(mismatch);
        }
        return Err(CheckpointError::ParameterCount {
            path,
            found,
            expected: expected_count,
        });
    }
    let mut expected = BTreeMap::new();
    for (key, shape, fields) in config.parameter_shapes() {
        let tensor = tensors
            .get(&key)
            .ok_or_else(|| CheckpointError::MissingTensor {
                path: path.clone(),
                key: key.clone(),
                fields,
            })?;
        if tensor.shape != shape {
            return Err(CheckpointError::TensorShape {
                path: path.clone(),
                key,
                found: tensor.shape.clone(),
                expected: shape,
                fields,
            });
        }
        if tensor.dtype != Dtype::F32 {
            return Err(CheckpointError::TensorDtype {
                path: path.clone(),
                key,
                dtype: tensor.dtype,
            });
        }
        expected.insert(key, ());
    }
    if let Some(key) = tensors.keys().find(|key| !expected.contains_key(*key)) {
        return Err(CheckpointError::UnexpectedTensor {
            path: path.clone(),
            key: key.clone(),
            num_layers: config.num_layers,
            qkv_bias: config.qkv_bias,
        });
    }
    // Every tensor matches the config, so what is allocated now is what the file holds.
    let mut data: BTreeMap<String, TensorData> = std::mem::take(&mut tensors)
        .into_iter()
        .map(|(key, tensor)| {
            (
                key,
                TensorData::from_bytes_vec(tensor.bytes, tensor.shape, burn::tensor::DType::F32),
            )
        })
        .collect();
    let (model, unmatched) = load_parameters(config.init::<B>(device), &mut data);
    assert!(
        unmatched.is_empty() && data.is_empty(),
        "GptConfig::parameter_shapes disagrees with the model: {unmatched:?} {:?}",
        data.keys().collect::<Vec<_>>()
    );
    Ok(model)
}

/// Why the parameter counts differ, by name where that can be found without listing every
/// layer's tensors: a fixed-size tensor (embeddings, final norm, head) of another shape than the
/// config implies, or a tensor the config has no place for.
fn first_mismatch(config: &GptConfig, tensors: &Tensors, path: &Path) -> Option<CheckpointError> {
    let fixed = GptConfig {
        num_layers: 0,
        ..config.clone()
    };
    let shape_mismatch = fixed
        .parameter_shapes()
        .into_iter()
        .find_map(|(key, shape, fields)| {
            let tensor = tensors.get(&key)?;
            (tensor.shape != shape).then(|| CheckpointError::TensorShape {
                path: path.to_path_buf(),
                key,
                found: tensor.shape.clone(),
                expected: shape,
                fields,
            })
        });
    if shape_mismatch.is_some() {
        return shape_mismatch;
    }
    let fixed_names: Vec<String> = fixed
        .parameter_shapes()
        .into_iter()
        .map(|(k, ..)| k)
        .collect();
    let layer_names: Vec<String> = GptConfig {
        num_layers: 1,
        ..config.clone()
    }
    .parameter_shapes()
    .into_iter()
    .filter_map(|(key, ..)| key.strip_prefix("blocks.0.").map(str::to_string))
    .collect();
    let has_place = |key: &str| {
        fixed_names.iter().any(|name| name == key)
            || key
                .strip_prefix("blocks.")
                .and_then(|rest| rest.split_once('.'))
                .is_some_and(|(layer, name)| {
                    layer.parse::<usize>().is_ok_and(|l| l < config.num_layers)
                        && layer_names.iter().any(|n| n == name)
                })
    };
    let key = tensors.keys().find(|key| !has_place(key))?;
    Some(CheckpointError::UnexpectedTensor {
        path: path.to_path_buf(),
        key: key.clone(),
        num_layers: config.num_layers,
        qkv_bias: config.qkv_bias,
    })
}

/// The names [`save`] writes, besides any `extra` files.
pub const CHECKPOINT_FILES: [&str; 2] = [CONFIG_FILE, WEIGHTS_FILE];

/// Checks that `dir` may be written as a checkpoint (absent, or an earlier checkpoint holding
/// only `CHECKPOINT_FILES` and `extra` names), before any work is spent on it.
pub fn output_dir(role: &str, dir: &Path, extra: &[&str]) -> Result<OutputDir, CheckpointError> {
    let names: Vec<&str> = CHECKPOINT_FILES.iter().chain(extra).copied().collect();
    Ok(OutputDir::new(role, dir, &names)?)
}

/// Writes `model` and `config` into `output` as a unit; `extra` writes further files (a plot)
/// into the same staging directory.
pub fn save<B: Backend>(
    output: &OutputDir,
    model: &GptModel<B>,
    config: &GptConfig,
    extra: impl FnOnce(&Path) -> Result<(), String>,
) -> Result<(), CheckpointError> {
    let tensors: Tensors = named_parameters(model)
        .into_iter()
        .map(|(key, data)| {
            let shape = data.shape.to_vec();
            let values = data.convert::<f32>().into_vec::<f32>().expect("f32");
            (key, RawTensor::from_f32(shape, &values))
        })
        .collect();
    output.write_with(|dir| -> Result<(), String> {
        let bytes = tensor_files::safetensors::serialize(&tensors).map_err(|e| e.to_string())?;
        std::fs::write(dir.join(WEIGHTS_FILE), bytes).map_err(|e| e.to_string())?;
        let json = serde_json::to_string_pretty(config).map_err(|e| e.to_string())?;
        std::fs::write(dir.join(CONFIG_FILE), json).map_err(|e| e.to_string())?;
        extra(dir)
    })?;
    Ok(())
}
