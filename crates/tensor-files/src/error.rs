//! What can be wrong with a file the user named: one to read, or one to write.

use std::path::PathBuf;

use thiserror::Error;

/// A tensor file that could not be read, and why, naming the file and where it matters the
/// tensor.
#[derive(Debug, Error)]
pub enum FileError {
    /// The file system refused (no such file, a directory, no permission, …).
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What the system said.
        source: std::io::Error,
    },
    /// The path is not a regular file (a FIFO, a device, a directory, …): reading it could
    /// block forever or never end.
    #[error("{path} is {kind}, not a regular file")]
    NotRegularFile {
        /// The file.
        path: PathBuf,
        /// What it is.
        kind: &'static str,
    },
    /// The file is larger than what is read of its kind.
    #[error("{path} holds {bytes} bytes, more than the {limit} read of such a file")]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Its size.
        bytes: u64,
        /// The bound.
        limit: u64,
    },
    /// The extension names no format this crate reads.
    #[error("{path}: unknown tensor file format (expected .safetensors, .pt, .pth or .bin)")]
    UnknownFormat {
        /// The file.
        path: PathBuf,
    },
    /// The file is not a well-formed file of its format.
    #[error("{path}: not a valid {format} file: {problem}")]
    Malformed {
        /// The file.
        path: PathBuf,
        /// `safetensors` or `torch.save`.
        format: &'static str,
        /// What is wrong, in the format's terms.
        problem: String,
    },
    /// A tensor's element type is not one this crate reads.
    #[error("{path}: `{key}` has element type {dtype}, which is not supported")]
    UnsupportedDtype {
        /// The file.
        path: PathBuf,
        /// The tensor.
        key: String,
        /// The type as the file names it.
        dtype: String,
    },
    /// A tensor's declared size, strides or offset do not fit the data the file holds.
    #[error("{path}: `{key}`: {problem}")]
    Layout {
        /// The file.
        path: PathBuf,
        /// The tensor.
        key: String,
        /// What does not fit (boxed: it carries shapes, and errors travel by value).
        problem: Box<LayoutProblem>,
    },
    /// The memory a tensor needs could not be allocated.
    #[error("{path}: `{key}` needs {bytes} bytes, which could not be allocated")]
    Allocation {
        /// The file.
        path: PathBuf,
        /// The tensor.
        key: String,
        /// Bytes asked for.
        bytes: usize,
    },
}

/// How a tensor's declared layout fails to fit its storage.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum LayoutProblem {
    /// A size, stride or offset is negative.
    #[error("{what} is negative ({value})")]
    Negative {
        /// `size[i]`, `stride[i]` or `storage offset`.
        what: String,
        /// The value.
        value: i64,
    },
    /// Sizes and strides of different lengths.
    #[error("{sizes} sizes but {strides} strides")]
    RankMismatch {
        /// Number of sizes.
        sizes: usize,
        /// Number of strides.
        strides: usize,
    },
    /// The element count or the extent overflows.
    #[error("shape {shape:?} with strides {strides:?} overflows")]
    Overflow {
        /// Sizes.
        shape: Vec<i64>,
        /// Strides.
        strides: Vec<i64>,
    },
    /// The view reaches past the end of its storage.
    #[error(
        "shape {shape:?} with strides {strides:?} at offset {offset} needs {needed} elements of \
         storage `{storage}`, which holds {available}"
    )]
    PastStorage {
        /// Sizes.
        shape: Vec<usize>,
        /// Strides.
        strides: Vec<usize>,
        /// Storage offset.
        offset: usize,
        /// Elements the view reaches.
        needed: usize,
        /// Elements the storage holds.
        available: usize,
        /// The storage record.
        storage: String,
    },
    /// The archive has no record for the tensor's storage.
    #[error("its storage record `{0}` is missing from the archive")]
    MissingStorage(String),
    /// The storage record holds fewer bytes than its declared element count needs.
    #[error("storage record `{storage}` holds {found} bytes, {expected} expected")]
    ShortStorage {
        /// The storage record.
        storage: String,
        /// Bytes declared by the pickle.
        expected: u64,
        /// Bytes in the archive.
        found: u64,
    },
    /// Two tensors read one storage as different element types.
    #[error("storage `{0}` is read as two different element types")]
    StorageDtype(String),
}

/// An output path that would lose or corrupt data if written, or a write that failed.
#[derive(Debug, Error)]
pub enum OutputError {
    /// The output is one of the command's inputs (the same device and inode, whatever the
    /// spelling of the path, through symbolic and hard links too).
    #[error(
        "{role} {path} is the same file as {input_role} {input}: refusing to overwrite an input"
    )]
    SameAsInput {
        /// The output's flag, e.g. `--output`.
        role: String,
        /// The output path.
        path: PathBuf,
        /// The input's flag.
        input_role: String,
        /// The input path.
        input: PathBuf,
    },
    /// The output exists and is not a regular file (a directory, a FIFO, a device, …).
    #[error("{role} {path} exists and is {kind}, not a regular file: refusing to replace it")]
    NotRegularFile {
        /// The output's flag.
        role: String,
        /// The output path.
        path: PathBuf,
        /// What it is.
        kind: &'static str,
    },
    /// The output directory exists and holds files this program did not write.
    #[error(
        "{role} {path} exists and holds {entry}, which is not part of a checkpoint: refusing to \
         replace it"
    )]
    ForeignDirectory {
        /// The output's flag.
        role: String,
        /// The output path.
        path: PathBuf,
        /// A name in it that is not ours.
        entry: String,
    },
    /// The path has no file name, or its directory does not exist.
    #[error("{role} {path}: {problem}")]
    BadPath {
        /// The output's flag.
        role: String,
        /// The output path.
        path: PathBuf,
        /// What is wrong.
        problem: String,
    },
    /// Writing failed; the output is as it was.
    #[error("cannot write {path}: {source}")]
    Io {
        /// The output path.
        path: PathBuf,
        /// What the system said.
        source: std::io::Error,
    },
}
