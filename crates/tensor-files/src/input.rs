//! Input files opened as hostile input: only a regular file is read (a FIFO would block the
//! reader forever, a device never end), into memory that is allocated fallibly, and a text file
//! only up to a size bound.

use std::fs::{File, Metadata};
use std::io::Read;
use std::path::Path;

use crate::error::FileError;

/// The largest JSON file read ([`read_text`]'s bound for `config.json`, shard indexes and
/// `tokenizer.json`, whose largest real instances are a few tens of MiB).
pub const MAX_JSON_BYTES: u64 = 64 << 20;

/// Opens `path` for reading, refusing anything but a regular file (after following links).
///
/// The file is opened without blocking (`O_NONBLOCK`: opening a FIFO would otherwise wait for a
/// writer) and its type read from the open descriptor, so a file swapped after a check cannot
/// slip through.
pub fn open_regular(path: &Path) -> Result<(File, Metadata), FileError> {
    let io = |source| FileError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.custom_flags(libc::O_NONBLOCK);
    }
    let file = options.open(path).map_err(io)?;
    let metadata = file.metadata().map_err(io)?;
    if !metadata.is_file() {
        return Err(FileError::NotRegularFile {
            path: path.to_path_buf(),
            kind: file_kind(&metadata),
        });
    }
    Ok((file, metadata))
}

/// Every byte of the regular file `path`; a file larger than the memory there is gives
/// [`FileError::Allocation`], not an abort.
pub fn read_bytes(path: &Path) -> Result<Vec<u8>, FileError> {
    read_bounded(path, u64::MAX)
}

/// The text of the regular file `path`, refused when it holds more than `limit` bytes or is not
/// UTF-8.
pub fn read_text(path: &Path, limit: u64) -> Result<String, FileError> {
    let bytes = read_bounded(path, limit)?;
    String::from_utf8(bytes).map_err(|error| FileError::Io {
        path: path.to_path_buf(),
        source: std::io::Error::new(std::io::ErrorKind::InvalidData, error.utf8_error()),
    })
}

fn read_bounded(path: &Path, limit: u64) -> Result<Vec<u8>, FileError> {
    let (file, metadata) = open_regular(path)?;
    let size = metadata.len();
    if size > limit {
        return Err(FileError::TooLarge {
            path: path.to_path_buf(),
            bytes: size,
            limit,
        });
    }
    let bytes = usize::try_from(size).unwrap_or(usize::MAX);
    let mut buffer = crate::allocate(bytes).ok_or_else(|| FileError::Allocation {
        path: path.to_path_buf(),
        key: "the whole file".into(),
        bytes,
    })?;
    // `take`: a file that grows while it is read stays within what was allocated and checked.
    file.take(size)
        .read_to_end(&mut buffer)
        .map_err(|source| FileError::Io {
            path: path.to_path_buf(),
            source,
        })?;
    Ok(buffer)
}

/// What kind of file `metadata` describes, for messages: "a FIFO", "a directory", ….
pub(crate) fn file_kind(metadata: &Metadata) -> &'static str {
    let file_type = metadata.file_type();
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if file_type.is_fifo() {
            return "a FIFO";
        }
        if file_type.is_char_device() || file_type.is_block_device() {
            return "a device";
        }
        if file_type.is_socket() {
            return "a socket";
        }
    }
    if file_type.is_dir() {
        "a directory"
    } else if file_type.is_symlink() {
        "a symbolic link"
    } else if file_type.is_file() {
        "a regular file"
    } else {
        "not a regular file"
    }
}
