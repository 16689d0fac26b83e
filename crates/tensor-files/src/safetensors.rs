//! `.safetensors` files: read (every header checked by the `safetensors` crate, in time linear
//! in the number of tensors) and written.

use std::path::Path;

use safetensors::tensor::TensorView;
use safetensors::{Dtype as StDtype, SafeTensors};

use crate::error::FileError;
use crate::{Dtype, RawTensor, Tensors};

/// Reads every tensor of a safetensors file.
pub fn read(path: &Path) -> Result<Tensors, FileError> {
    let bytes = crate::read_bytes(path)?;
    read_from(&bytes, path)
}

/// [`read`] from the file's bytes; `path` names it in errors.
pub fn read_from(bytes: &[u8], path: &Path) -> Result<Tensors, FileError> {
    parse(bytes).map_err(|problem| problem.at(path))
}

/// Where [`parse`] failed, before the file's name is known.
#[derive(Debug)]
enum ParseError {
    Malformed(String),
    Dtype { key: String, dtype: String },
    Allocation { key: String, bytes: usize },
}

impl ParseError {
    fn at(self, path: &Path) -> FileError {
        let path = path.to_path_buf();
        match self {
            Self::Malformed(problem) => FileError::Malformed {
                path,
                format: "safetensors",
                problem,
            },
            Self::Dtype { key, dtype } => FileError::UnsupportedDtype { path, key, dtype },
            Self::Allocation { key, bytes } => FileError::Allocation { path, key, bytes },
        }
    }
}

/// Every tensor of a safetensors file's bytes.
fn parse(bytes: &[u8]) -> Result<Tensors, ParseError> {
    let file = SafeTensors::deserialize(bytes).map_err(|e| ParseError::Malformed(e.to_string()))?;
    let mut tensors = Tensors::new();
    for (key, view) in file.iter() {
        let dtype = dtype(view.dtype()).ok_or_else(|| ParseError::Dtype {
            key: key.to_string(),
            dtype: format!("{:?}", view.dtype()),
        })?;
        let data = view.data();
        let mut buffer = crate::allocate(data.len()).ok_or_else(|| ParseError::Allocation {
            key: key.to_string(),
            bytes: data.len(),
        })?;
        buffer.extend_from_slice(data);
        let tensor = RawTensor::new(dtype, view.shape().to_vec(), buffer).ok_or_else(|| {
            ParseError::Malformed(format!("`{key}`: data does not fit its shape"))
        })?;
        tensors.insert(key.to_string(), tensor);
    }
    Ok(tensors)
}

/// The bytes of a safetensors file holding `tensors`.
pub fn serialize(tensors: &Tensors) -> Result<Vec<u8>, safetensors::SafeTensorError> {
    let views = tensors
        .iter()
        .map(|(name, tensor)| {
            TensorView::new(st_dtype(tensor.dtype), tensor.shape.clone(), &tensor.bytes)
                .map(|view| (name.as_str(), view))
        })
        .collect::<Result<Vec<_>, _>>()?;
    safetensors::serialize(views, None)
}

fn dtype(dtype: StDtype) -> Option<Dtype> {
    Some(match dtype {
        StDtype::F64 => Dtype::F64,
        StDtype::F32 => Dtype::F32,
        StDtype::F16 => Dtype::F16,
        StDtype::BF16 => Dtype::BF16,
        StDtype::I64 => Dtype::I64,
        StDtype::I32 => Dtype::I32,
        StDtype::I16 => Dtype::I16,
        StDtype::I8 => Dtype::I8,
        StDtype::U8 => Dtype::U8,
        StDtype::BOOL => Dtype::Bool,
        _ => return None,
    })
}

fn st_dtype(dtype: Dtype) -> StDtype {
    match dtype {
        Dtype::F64 => StDtype::F64,
        Dtype::F32 => StDtype::F32,
        Dtype::F16 => StDtype::F16,
        Dtype::BF16 => StDtype::BF16,
        Dtype::I64 => StDtype::I64,
        Dtype::I32 => StDtype::I32,
        Dtype::I16 => StDtype::I16,
        Dtype::I8 => StDtype::I8,
        Dtype::U8 => StDtype::U8,
        Dtype::Bool => StDtype::BOOL,
    }
}
