//! Tensor files read as hostile input, and output files written whole or not at all.
//!
//! - [`read`]: a `.safetensors` file or a `torch.save` `.pt`/`.pth`/`.bin` file into named,
//!   contiguous little-endian tensors ([`RawTensor`]). Every size a file declares is checked
//!   against what the file holds before anything is allocated, strided `.pt` views load with the
//!   values PyTorch shows, and allocation failure is an error, not an abort.
//! - [`read_text`], [`read_bytes`], [`open_regular`]: any input file, refused unless it is a
//!   regular file (a FIFO would hang the reader), JSON within [`MAX_JSON_BYTES`].
//! - [`OutputFile`]: a path to write that is refused when it is one of the command's inputs (by
//!   device and inode) or not a regular file, written through an exclusively created temporary
//!   file renamed over it once complete.
//!
//! ```no_run
//! use tensor_files::{OutputFile, read, safetensors};
//!
//! let tensors = read("weights.pt".as_ref())?;
//! let output = OutputFile::new("out.safetensors".as_ref(), &[("--weights", "weights.pt".as_ref())])?;
//! output.write_bytes(&safetensors::serialize(&tensors)?)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![warn(missing_docs)]

mod error;
mod input;
mod output;
pub mod safetensors;
pub mod torch;

use std::collections::BTreeMap;
use std::path::Path;

pub use error::{FileError, OutputError};
pub use input::{MAX_JSON_BYTES, open_regular, read_bytes, read_text};
pub use output::{OutputDir, OutputFile};

/// Element types the readers accept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// `float64`
    F64,
    /// `float32`
    F32,
    /// `float16`
    F16,
    /// `bfloat16`
    BF16,
    /// `int64`
    I64,
    /// `int32`
    I32,
    /// `int16`
    I16,
    /// `int8`
    I8,
    /// `uint8`
    U8,
    /// `bool`, one byte per element
    Bool,
}

impl Dtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Self::F64 | Self::I64 => 8,
            Self::F32 | Self::I32 => 4,
            Self::F16 | Self::BF16 | Self::I16 => 2,
            Self::I8 | Self::U8 | Self::Bool => 1,
        }
    }

    /// Whether it is a floating-point type.
    pub fn is_float(self) -> bool {
        matches!(self, Self::F64 | Self::F32 | Self::F16 | Self::BF16)
    }
}

/// One tensor: row-major, contiguous, little-endian.
#[derive(Debug, Clone, PartialEq)]
pub struct RawTensor {
    /// Element type.
    pub dtype: Dtype,
    /// Size of each dimension (empty for a scalar).
    pub shape: Vec<usize>,
    /// `shape.iter().product() * dtype.size()` bytes.
    pub bytes: Vec<u8>,
}

impl RawTensor {
    /// A tensor, after checking that `bytes` holds exactly `shape` elements of `dtype`. A `bool`
    /// byte other than 0 is read as 1 (`true`), so that no invalid `bool` ever exists.
    pub fn new(dtype: Dtype, shape: Vec<usize>, mut bytes: Vec<u8>) -> Option<Self> {
        let expected = byte_len(&shape, dtype)?;
        if dtype == Dtype::Bool {
            bytes.iter_mut().for_each(|b| *b = u8::from(*b != 0));
        }
        (bytes.len() == expected).then_some(Self {
            dtype,
            shape,
            bytes,
        })
    }

    /// An `f32` tensor.
    ///
    /// # Panics
    /// When `values` does not hold `shape.iter().product()` elements.
    pub fn from_f32(shape: Vec<usize>, values: &[f32]) -> Self {
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Self::new(Dtype::F32, shape, bytes).expect("values fit the shape")
    }

    /// The values of an integer tensor (`int64`, or `int32` widened), `None` for other dtypes.
    pub fn to_i64(&self) -> Option<Vec<i64>> {
        match self.dtype {
            Dtype::I64 => Some(
                self.bytes
                    .chunks_exact(8)
                    .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")))
                    .collect(),
            ),
            Dtype::I32 => Some(
                self.bytes
                    .chunks_exact(4)
                    .map(|b| i64::from(i32::from_le_bytes(b.try_into().expect("4 bytes"))))
                    .collect(),
            ),
            _ => None,
        }
    }

    /// The values of an `f32` tensor, `None` for other dtypes.
    pub fn to_f32(&self) -> Option<Vec<f32>> {
        (self.dtype == Dtype::F32).then(|| {
            self.bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
                .collect()
        })
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Named tensors, sorted by name.
pub type Tensors = BTreeMap<String, RawTensor>;

/// `shape.iter().product() * dtype.size()`, `None` on overflow.
pub(crate) fn byte_len(shape: &[usize], dtype: Dtype) -> Option<usize> {
    shape
        .iter()
        .try_fold(dtype.size(), |bytes, &size| bytes.checked_mul(size))
}

/// An empty buffer with room for `len` bytes, or `None` when the memory cannot be had (instead
/// of Rust's abort on allocation failure: a hostile file's declared sizes reach here only after
/// every check against the file, but may still exceed the memory there is).
pub(crate) fn allocate(len: usize) -> Option<Vec<u8>> {
    let mut buffer = Vec::new();
    buffer.try_reserve_exact(len).ok()?;
    Some(buffer)
}

/// Reads every tensor of a file, its format chosen by the extension: `.safetensors`, or
/// `.pt`/`.pth`/`.bin` for `torch.save` files.
pub fn read(path: &Path) -> Result<Tensors, FileError> {
    let extension = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    match extension {
        "safetensors" => safetensors::read(path),
        "pt" | "pth" | "bin" => torch::read(path),
        _ => Err(FileError::UnknownFormat {
            path: path.to_path_buf(),
        }),
    }
}
