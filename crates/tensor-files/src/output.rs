//! Output paths checked before anything is computed, written whole or not at all.
//!
//! The checks compare files, not strings: an output that is an input under another spelling,
//! through a symbolic link or a hard link, has the input's device and inode. The temporary file
//! is created exclusively (`O_EXCL`, a random name) in the output's directory, so a link planted
//! at a predictable name is never followed, and the final rename is atomic.

use std::fs::{File, Metadata};
use std::io::Write;
use std::path::{Path, PathBuf};

use tempfile::{Builder, NamedTempFile, TempDir};

use crate::error::OutputError;

/// A file about to be written: checked when made, and again right before it is replaced.
#[derive(Debug, Clone)]
pub struct OutputFile {
    role: String,
    path: PathBuf,
    inputs: Vec<(String, PathBuf)>,
}

impl OutputFile {
    /// Checks that `path` (the value of the flag `role`, say `--output`) may be written: it is
    /// absent or a regular file, it is none of `inputs` (each with its flag), and its directory
    /// exists.
    pub fn new(path: &Path, inputs: &[(&str, &Path)]) -> Result<Self, OutputError> {
        Self::with_role("--output", path, inputs)
    }

    /// [`new`](Self::new) for an output given by another flag.
    pub fn with_role(
        role: &str,
        path: &Path,
        inputs: &[(&str, &Path)],
    ) -> Result<Self, OutputError> {
        let output = Self {
            role: role.to_string(),
            path: path.to_path_buf(),
            inputs: inputs
                .iter()
                .map(|(role, path)| (role.to_string(), path.to_path_buf()))
                .collect(),
        };
        output.check()?;
        Ok(output)
    }

    /// The path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes `bytes` as the file's whole content.
    pub fn write_bytes(&self, bytes: &[u8]) -> Result<(), OutputError> {
        self.write_with(|file| file.write_all(bytes))
    }

    /// Writes the file through `write`, which fills a temporary file in the same directory;
    /// only when it succeeds is the temporary file renamed over the path.
    pub fn write_with(
        &self,
        write: impl FnOnce(&mut File) -> std::io::Result<()>,
    ) -> Result<(), OutputError> {
        let mut temporary = self.temporary()?;
        write(temporary.as_file_mut())
            .and_then(|()| temporary.as_file().sync_all())
            .map_err(|source| self.io_error(source))?;
        self.persist(temporary)
    }

    /// Writes the file through `write`, which is given the path of an exclusively created
    /// temporary file to fill (for libraries that write to a path themselves).
    pub fn write_to_path<E: std::fmt::Display>(
        &self,
        write: impl FnOnce(&Path) -> Result<(), E>,
    ) -> Result<(), OutputError> {
        let temporary = self.temporary()?;
        write(temporary.path())
            .map_err(|error| self.io_error(std::io::Error::other(error.to_string())))?;
        self.persist(temporary)
    }

    /// `.NAME.RANDOM.partial.EXT` beside the output: hidden, never a predictable name, and with
    /// the output's extension for writers that choose a format by it.
    fn temporary(&self) -> Result<NamedTempFile, OutputError> {
        let name = self.path.file_name().unwrap_or_default().to_string_lossy();
        let extension = self
            .path
            .extension()
            .map(|e| format!(".{}", e.to_string_lossy()))
            .unwrap_or_default();
        Builder::new()
            .prefix(&format!(".{name}."))
            .suffix(&format!(".partial{extension}"))
            .tempfile_in(parent(&self.path))
            .map_err(|source| self.io_error(source))
    }

    fn persist(&self, temporary: NamedTempFile) -> Result<(), OutputError> {
        // The inputs may have been replaced while we computed: check again before replacing.
        self.check()?;
        temporary
            .persist(&self.path)
            .map(drop)
            .map_err(|error| self.io_error(error.error))
    }

    fn check(&self) -> Result<(), OutputError> {
        check_placeable(&self.role, &self.path, "file")?;
        let Ok(output) = std::fs::metadata(&self.path) else {
            return Ok(()); // absent (or a dangling link, which the rename replaces)
        };
        if !output.is_file() {
            return Err(OutputError::NotRegularFile {
                role: self.role.clone(),
                path: self.path.clone(),
                kind: crate::input::file_kind(&output),
            });
        }
        for (input_role, input) in &self.inputs {
            if let Ok(input_metadata) = std::fs::metadata(input)
                && same_file(&output, &input_metadata)
            {
                return Err(OutputError::SameAsInput {
                    role: self.role.clone(),
                    path: self.path.clone(),
                    input_role: input_role.clone(),
                    input: input.clone(),
                });
            }
        }
        Ok(())
    }

    fn io_error(&self, source: std::io::Error) -> OutputError {
        OutputError::Io {
            path: self.path.clone(),
            source,
        }
    }
}

/// A directory of files about to be written as a unit (a checkpoint): filled in a temporary
/// directory beside it, then moved into place. An existing directory is replaced only when every
/// name in it is one of `names` (an earlier checkpoint), never when it holds anything else.
#[derive(Debug)]
pub struct OutputDir {
    role: String,
    path: PathBuf,
    names: Vec<String>,
}

impl OutputDir {
    /// Checks that `path` (the value of the flag `role`) is absent, or a directory holding only
    /// files named in `names`.
    pub fn new(role: &str, path: &Path, names: &[&str]) -> Result<Self, OutputError> {
        let output = Self {
            role: role.to_string(),
            path: path.to_path_buf(),
            names: names.iter().map(|name| name.to_string()).collect(),
        };
        output.check()?;
        Ok(output)
    }

    /// Writes the directory through `write`, which fills a temporary directory; only when it
    /// succeeds does the temporary directory take the path's place.
    pub fn write_with<E: std::fmt::Display>(
        &self,
        write: impl FnOnce(&Path) -> Result<(), E>,
    ) -> Result<(), OutputError> {
        let io_error = |source| OutputError::Io {
            path: self.path.clone(),
            source,
        };
        let name = self.path.file_name().unwrap_or_default().to_string_lossy();
        let staging: TempDir = Builder::new()
            .prefix(&format!(".{name}."))
            .suffix(".partial")
            .tempdir_in(parent(&self.path))
            .map_err(io_error)?;
        write(staging.path()).map_err(|e| io_error(std::io::Error::other(e.to_string())))?;
        self.check()?;
        let staged = staging.keep();
        if self.path.exists() {
            // A directory cannot be renamed over a non-empty one: move the old one aside first,
            // so that the path holds either the old checkpoint or the new one, never a mixture.
            let old = Builder::new()
                .prefix(&format!(".{name}."))
                .suffix(".old")
                .tempdir_in(parent(&self.path))
                .map_err(io_error)?
                .keep();
            std::fs::remove_dir(&old).map_err(io_error)?;
            std::fs::rename(&self.path, &old).map_err(io_error)?;
            if let Err(error) = std::fs::rename(&staged, &self.path) {
                let _ = std::fs::rename(&old, &self.path);
                let _ = std::fs::remove_dir_all(&staged);
                return Err(io_error(error));
            }
            let _ = std::fs::remove_dir_all(&old);
        } else if let Err(error) = std::fs::rename(&staged, &self.path) {
            let _ = std::fs::remove_dir_all(&staged);
            return Err(io_error(error));
        }
        Ok(())
    }

    fn check(&self) -> Result<(), OutputError> {
        check_placeable(&self.role, &self.path, "directory")?;
        let Ok(metadata) = std::fs::symlink_metadata(&self.path) else {
            return Ok(());
        };
        if !metadata.is_dir() {
            return Err(OutputError::NotRegularFile {
                role: self.role.clone(),
                path: self.path.clone(),
                kind: match crate::input::file_kind(&metadata) {
                    "a regular file" => "a file",
                    other => other,
                },
            });
        }
        let entries = std::fs::read_dir(&self.path).map_err(|source| OutputError::Io {
            path: self.path.clone(),
            source,
        })?;
        for entry in entries {
            let entry = entry.map_err(|source| OutputError::Io {
                path: self.path.clone(),
                source,
            })?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let is_file = entry.file_type().is_ok_and(|t| t.is_file());
            if !is_file || !self.names.contains(&name) {
                return Err(OutputError::ForeignDirectory {
                    role: self.role.clone(),
                    path: self.path.clone(),
                    entry: name,
                });
            }
        }
        Ok(())
    }
}

/// Checks that `path` (the value of flag `role`) names a `what` in a directory that exists.
fn check_placeable(role: &str, path: &Path, what: &str) -> Result<(), OutputError> {
    let bad_path = |problem: String| OutputError::BadPath {
        role: role.to_string(),
        path: path.to_path_buf(),
        problem,
    };
    if path.file_name().is_none() {
        return Err(bad_path(format!("not a {what} path")));
    }
    let directory = parent(path);
    if !directory.is_dir() {
        return Err(bad_path(format!(
            "its directory {} does not exist",
            directory.display()
        )));
    }
    Ok(())
}

/// The directory a path's file is in (`.` for a bare name).
fn parent(path: &Path) -> &Path {
    match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    }
}

#[cfg(unix)]
fn same_file(a: &Metadata, b: &Metadata) -> bool {
    use std::os::unix::fs::MetadataExt;
    (a.dev(), a.ino()) == (b.dev(), b.ino())
}

#[cfg(not(unix))]
fn same_file(_: &Metadata, _: &Metadata) -> bool {
    false
}
