//! PyTorch state dicts: the named tensors of a `.safetensors` file or a `torch.save` `.pt` file,
//! read by [`tensor_files`] (which treats files as hostile input: every declared size is checked
//! against the file before anything is allocated), as Burn [`TensorData`], and taken out as
//! float tensors checked for their shape and for NaN or infinity.
//!
//! What the tensors mean is the reader's: `attention_core::weights` maps the attention layer's
//! layouts (the source chapter's, GPT-2's, Hugging Face Llama's) onto a layer, `hf-models` whole
//! models' checkpoints.
//!
//! ```no_run
//! use burn::backend::NdArray;
//! use state_dict::StateDict;
//!
//! let dict = StateDict::load("model.safetensors")?;
//! let weight = dict.tensor_shaped::<NdArray, 2>("c_proj.weight", [768, 768], &Default::default())?;
//! # Ok::<(), state_dict::StateDictError>(())
//! ```
#![warn(missing_docs)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::prelude::*;
use burn::tensor::{BoolStore, DType};
use tensor_files::{Dtype, RawTensor};
use thiserror::Error;

pub use tensor_files::FileError;

/// What went wrong reading a state dict or taking a tensor from it.
#[derive(Debug, Error)]
pub enum StateDictError {
    /// The file could not be read (absent, not of its format, or a tensor that does not fit
    /// the data the file holds).
    #[error(transparent)]
    File(#[from] FileError),
    /// A key the reader needs is absent.
    #[error("missing key `{key}`")]
    MissingKey {
        /// The key.
        key: String,
    },
    /// A key that should not be there (for a layer: a Q/K/V bias its config does not have).
    #[error("unexpected key `{key}`: {reason}")]
    UnexpectedKey {
        /// The key.
        key: String,
        /// Why it does not fit.
        reason: String,
    },
    /// A tensor's shape is not the one the reader needs.
    #[error("`{key}` has shape {found:?}, expected {expected:?}{hint}")]
    Shape {
        /// The key.
        key: String,
        /// The shape the reader needs.
        expected: Vec<usize>,
        /// The shape in the file.
        found: Vec<usize>,
        /// Where the expectation comes from (empty, or `" (…)"`).
        hint: String,
    },
    /// A tensor has another number of dimensions than its role needs.
    #[error("`{key}` has shape {found:?}, expected a tensor of {expected} dimensions")]
    Rank {
        /// The key.
        key: String,
        /// Dimensions needed.
        expected: usize,
        /// The shape in the file.
        found: Vec<usize>,
    },
    /// A tensor is not floating point.
    #[error("`{key}` has dtype {dtype:?}, expected a float tensor")]
    DType {
        /// The key.
        key: String,
        /// Its dtype.
        dtype: DType,
    },
    /// A weight holds a NaN or an infinity: every output it reaches would be one too.
    #[error("`{key}` holds {value} at flat index {index}: weights must be finite")]
    NonFinite {
        /// The key.
        key: String,
        /// The first non-finite element's index, row-major.
        index: usize,
        /// Its value (`NaN`, `inf` or `-inf`).
        value: f64,
    },
}

impl StateDictError {
    /// The same error with `prefix` before the tensor name it carries: what a dict split off a
    /// larger checkpoint ([`StateDict::split_prefix`]) reports in the checkpoint's own names.
    pub fn with_key_prefix(self, prefix: &str) -> Self {
        let prefixed = |key: String| format!("{prefix}{key}");
        match self {
            Self::MissingKey { key } => Self::MissingKey { key: prefixed(key) },
            Self::UnexpectedKey { key, reason } => Self::UnexpectedKey {
                key: prefixed(key),
                reason,
            },
            Self::Shape {
                key,
                expected,
                found,
                hint,
            } => Self::Shape {
                key: prefixed(key),
                expected,
                found,
                hint,
            },
            Self::Rank {
                key,
                expected,
                found,
            } => Self::Rank {
                key: prefixed(key),
                expected,
                found,
            },
            Self::DType { key, dtype } => Self::DType {
                key: prefixed(key),
                dtype,
            },
            Self::NonFinite { key, index, value } => Self::NonFinite {
                key: prefixed(key),
                index,
                value,
            },
            other @ Self::File(_) => other,
        }
    }

    /// A [`Shape`](Self::Shape) error without a hint.
    pub fn shape(key: &str, expected: &[usize], found: &[usize]) -> Self {
        Self::Shape {
            key: key.to_string(),
            expected: expected.to_vec(),
            found: found.to_vec(),
            hint: String::new(),
        }
    }
}

/// A PyTorch state dict (or any safetensors file): named tensors, read eagerly.
#[derive(Debug, Clone)]
pub struct StateDict {
    path: PathBuf,
    tensors: BTreeMap<String, TensorData>,
}

impl StateDict {
    /// Reads every tensor of a `.safetensors` file or a `torch.save` `.pt`/`.pth`/`.bin` file.
    pub fn load(path: impl AsRef<Path>) -> Result<Self, StateDictError> {
        let path = path.as_ref();
        let tensors = tensor_files::read(path)?
            .into_iter()
            .map(|(key, tensor)| (key, tensor_data(tensor)))
            .collect();
        Ok(Self {
            path: path.to_path_buf(),
            tensors,
        })
    }

    /// A state dict from tensors already in memory (named as PyTorch names them).
    pub fn from_tensors(tensors: impl IntoIterator<Item = (String, TensorData)>) -> Self {
        Self {
            path: PathBuf::from("<memory>"),
            tensors: tensors.into_iter().collect(),
        }
    }

    /// Moves the tensors whose names start with `prefix` into a dict of their own, the prefix
    /// stripped: `model.layers.0.self_attn.` turns a whole checkpoint's
    /// `model.layers.0.self_attn.q_proj.weight` into the `q_proj.weight` that one layer's reader
    /// (`attention_core::weights::LayerWeights::to_layer`) takes.
    pub fn split_prefix(&mut self, prefix: &str) -> StateDict {
        let keys: Vec<String> = self
            .tensors
            .keys()
            .filter(|key| key.starts_with(prefix))
            .cloned()
            .collect();
        let tensors = keys
            .into_iter()
            .filter_map(|key| {
                let data = self.tensors.remove(&key)?;
                Some((key[prefix.len()..].to_string(), data))
            })
            .collect();
        StateDict {
            path: self.path.clone(),
            tensors,
        }
    }

    /// The named tensors, moved out.
    pub fn into_tensors(self) -> impl Iterator<Item = (String, TensorData)> {
        self.tensors.into_iter()
    }

    /// The file it was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The tensor names, sorted.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// The raw tensor `key`, as stored, if present.
    pub fn data(&self, key: &str) -> Option<&TensorData> {
        self.tensors.get(key)
    }

    /// The shape of `key`, if present.
    pub fn shape(&self, key: &str) -> Option<&[usize]> {
        self.tensors.get(key).map(|data| data.shape.as_slice())
    }

    /// Whether `key` is present.
    pub fn contains(&self, key: &str) -> bool {
        self.tensors.contains_key(key)
    }

    /// The tensor `key` as a float tensor on `device`, checked for its number of dimensions and
    /// refused when it holds a NaN or an infinity (stored in any float type, or become one in
    /// the conversion: an f64 beyond f32's range).
    pub fn tensor<B: Backend, const D: usize>(
        &self,
        key: &str,
        device: &B::Device,
    ) -> Result<Tensor<B, D>, StateDictError> {
        let data = self
            .tensors
            .get(key)
            .ok_or_else(|| StateDictError::MissingKey {
                key: key.to_string(),
            })?;
        if !data.dtype.is_float() {
            return Err(StateDictError::DType {
                key: key.to_string(),
                dtype: data.dtype,
            });
        }
        if data.shape.len() != D {
            return Err(StateDictError::Rank {
                key: key.to_string(),
                expected: D,
                found: data.shape.to_vec(),
            });
        }
        let data = data.clone().convert::<B::FloatElem>();
        if let Some((index, value)) = first_non_finite(&data) {
            return Err(StateDictError::NonFinite {
                key: key.to_string(),
                index,
                value,
            });
        }
        Ok(Tensor::from_data(data, device))
    }

    /// Like [`tensor`](Self::tensor), checking the exact shape.
    pub fn tensor_shaped<B: Backend, const D: usize>(
        &self,
        key: &str,
        expected: [usize; D],
        device: &B::Device,
    ) -> Result<Tensor<B, D>, StateDictError> {
        if let Some(found) = self.shape(key)
            && found != expected
        {
            return Err(StateDictError::shape(key, &expected, found));
        }
        self.tensor(key, device)
    }
}

/// The index and value of the first NaN or infinity in float data, if any.
fn first_non_finite(data: &TensorData) -> Option<(usize, f64)> {
    let found = match data.dtype {
        DType::F32 => first_non_finite_in(data.as_slice::<f32>().ok()?, |x| x.is_finite()),
        DType::F64 => first_non_finite_in(data.as_slice::<f64>().ok()?, |x| x.is_finite()),
        _ => data.iter::<f64>().position(|x| !x.is_finite()),
    };
    found.map(|index| (index, data.iter::<f64>().nth(index).unwrap_or(f64::NAN)))
}

/// The first index where `finite` is false. Each chunk is checked without an early exit, which
/// the compiler vectorizes (a plain `position` does not); the check runs once over every weight
/// a checkpoint loads.
fn first_non_finite_in<T: Copy>(values: &[T], finite: impl Fn(T) -> bool) -> Option<usize> {
    const CHUNK: usize = 4096;
    values
        .chunks(CHUNK)
        .enumerate()
        .find_map(|(chunk_index, chunk)| {
            let bad = chunk.iter().fold(false, |bad, &x| bad | !finite(x));
            let within = bad.then(|| chunk.iter().position(|&x| !finite(x)))??;
            Some(chunk_index * CHUNK + within)
        })
}

/// A file's tensor as Burn data (the bytes are moved, not copied).
fn tensor_data(tensor: RawTensor) -> TensorData {
    let dtype = match tensor.dtype {
        Dtype::F64 => DType::F64,
        Dtype::F32 => DType::F32,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        Dtype::I64 => DType::I64,
        Dtype::I32 => DType::I32,
        Dtype::I16 => DType::I16,
        Dtype::I8 => DType::I8,
        Dtype::U8 => DType::U8,
        // tensor-files stores each bool as a byte that is 0 or 1.
        Dtype::Bool => DType::Bool(BoolStore::Native),
    };
    TensorData::from_bytes_vec(tensor.bytes, tensor.shape, dtype)
}

#[cfg(test)]
mod tests {
    use burn::tensor::TensorData;

    use super::{first_non_finite, first_non_finite_in};

    /// Longer than two 4096-element chunks, not a multiple of one.
    const LEN: usize = 10_000;
    /// Chunk edges (4096, 8192), their neighbours, both ends.
    const INDICES: [usize; 9] = [0, 1, 4095, 4096, 4097, 8191, 8192, 8193, LEN - 1];

    /// What the chunked search must agree with.
    fn reference<T: Copy>(values: &[T], finite: impl Fn(T) -> bool) -> Option<usize> {
        values.iter().position(|&x| !finite(x))
    }

    #[test]
    fn one_bad_f32_is_found_at_every_chunk_edge() {
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            for index in INDICES {
                let mut values = vec![1.5f32; LEN];
                values[index] = bad;
                assert_eq!(
                    first_non_finite_in(&values, f32::is_finite),
                    Some(index),
                    "{bad} at {index}"
                );
            }
        }
    }

    #[test]
    fn one_bad_f64_is_found_at_every_chunk_edge() {
        for bad in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            for index in INDICES {
                let mut values = vec![-2.5f64; LEN];
                values[index] = bad;
                assert_eq!(
                    first_non_finite_in(&values, f64::is_finite),
                    Some(index),
                    "{bad} at {index}"
                );
            }
        }
    }

    #[test]
    fn the_first_of_several_bad_values_is_the_one_found() {
        // (first, later): across a chunk edge, within one chunk, and a chunk with many.
        for (first, later) in [
            (4095, 4096),
            (4096, 4097),
            (4097, 9000),
            (0, LEN - 1),
            (4100, 5000),
            (8191, 8192),
        ] {
            let mut values = vec![0.25f32; LEN];
            values[later] = f32::NAN;
            values[first] = f32::INFINITY;
            assert_eq!(
                first_non_finite_in(&values, f32::is_finite),
                Some(first),
                "bad at {first} and {later}"
            );
        }
        let mut values = vec![0.25f32; LEN];
        values[5000..].fill(f32::NAN);
        assert_eq!(first_non_finite_in(&values, f32::is_finite), Some(5000));
        let all_bad = vec![f64::NAN; LEN];
        assert_eq!(first_non_finite_in(&all_bad, f64::is_finite), Some(0));
    }

    #[test]
    fn finite_values_and_empty_slices_give_none() {
        let empty_f32: [f32; 0] = [];
        assert_eq!(first_non_finite_in(&empty_f32[..], f32::is_finite), None);
        let empty_f64: [f64; 0] = [];
        assert_eq!(first_non_finite_in(&empty_f64[..], f64::is_finite), None);
        // Extremes that are still finite: the largest, the smallest, subnormals, -0.
        let extremes_f32 = [
            f32::MAX,
            f32::MIN,
            f32::MIN_POSITIVE,
            f32::MIN_POSITIVE / 2.0,
            -0.0,
        ];
        for len in [1, 4095, 4096, 4097, LEN] {
            let values: Vec<f32> = (0..len)
                .map(|i| extremes_f32[i % extremes_f32.len()])
                .collect();
            assert_eq!(first_non_finite_in(&values, f32::is_finite), None, "{len}");
        }
        // An f64 beyond f32's range is finite as an f64.
        let extremes_f64 = [
            f64::MAX,
            f64::MIN,
            1e300,
            -1e300,
            f64::MIN_POSITIVE / 2.0,
            -0.0,
        ];
        for len in [1, 4095, 4096, 4097, LEN] {
            let values: Vec<f64> = (0..len)
                .map(|i| extremes_f64[i % extremes_f64.len()])
                .collect();
            assert_eq!(first_non_finite_in(&values, f64::is_finite), None, "{len}");
        }
    }

    #[test]
    fn lengths_around_the_chunk_size_agree_with_a_plain_search() {
        for len in [1, 2, 4095, 4096, 4097, 8192, 8193, 12_289] {
            for index in [0, len / 2, len - 1] {
                let mut values = vec![3.0f32; len];
                values[index] = f32::NAN;
                assert_eq!(
                    first_non_finite_in(&values, f32::is_finite),
                    reference(&values, f32::is_finite),
                    "len {len}, NaN at {index}"
                );
                assert_eq!(
                    first_non_finite_in(&values, f32::is_finite),
                    Some(index),
                    "len {len}, NaN at {index}"
                );
            }
        }
    }

    #[test]
    fn first_non_finite_reports_the_index_and_the_value() {
        let mut values = vec![1.0f32; LEN];
        values[4097] = f32::NEG_INFINITY;
        values[9999] = f32::NAN;
        let found = first_non_finite(&TensorData::new(values, [LEN]));
        assert_eq!(found, Some((4097, f64::NEG_INFINITY)));

        let mut values = vec![1.0f64; LEN];
        values[4096] = f64::NAN;
        let (index, value) = first_non_finite(&TensorData::new(values, [100, 100])).unwrap();
        assert_eq!(index, 4096);
        assert!(value.is_nan(), "{value}");

        let finite = TensorData::new(vec![1e300f64; LEN], [LEN]);
        assert_eq!(first_non_finite(&finite), None);
        let empty = TensorData::new(Vec::<f32>::new(), [0]);
        assert_eq!(first_non_finite(&empty), None);
    }
}
