//! `torch.save` files (`.pt`, `.pth`, `.bin`): a zip archive holding `data.pkl`, the pickled
//! state dict, and one record per storage under `data/`.
//!
//! A tensor in the pickle is a strided view of a storage (`_rebuild_tensor_v2(storage,
//! storage_offset, size, stride)`); PyTorch saves views as they are, so a transposed, sliced or
//! expanded tensor is read here element by element through its strides. Before anything is
//! allocated, each view is checked against its storage's declared length and each storage against
//! its record in the archive; a storage is read once, and only as far as its views reach, so a
//! record that inflates far beyond what the tensors use is never inflated.
//!
//! The legacy (pre-1.6, not zip) format is refused with a message saying so.

mod pickle;
mod write;

use std::collections::{BTreeMap, HashMap};
use std::io::{BufReader, Read, Seek};
use std::path::{Path, PathBuf};
use std::rc::Rc;

use zip::ZipArchive;

use crate::error::{FileError, LayoutProblem};
use crate::{Dtype, RawTensor, Tensors};
use pickle::{TensorRef, Value};

pub use write::{StoredView, serialize, serialize_views};

/// The largest `data.pkl` read: a state dict of a million tensors pickles to about 100 MB.
const MAX_PICKLE_BYTES: u64 = 256 << 20;
/// How deep a state dict may nest dicts in dicts.
const MAX_NESTING: usize = 16;

/// Reads every tensor of a `torch.save` file, nested dicts flattened to dotted names
/// (`{"model": {"w": t}}` → `model.w`); values that are not tensors are skipped.
pub fn read(path: &Path) -> Result<Tensors, FileError> {
    let (file, _) = crate::open_regular(path)?;
    read_from(BufReader::new(file), path)
}

/// [`read`] from an open archive; `path` names it in errors.
pub fn read_from<R: Read + Seek>(archive: R, path: &Path) -> Result<Tensors, FileError> {
    let mut reader = Reader {
        path: path.to_path_buf(),
        archive: ZipArchive::new(archive).map_err(|error| FileError::Malformed {
            path: path.to_path_buf(),
            format: "torch.save",
            problem: format!(
                "not a readable zip archive ({error}); a torch.save file is one since PyTorch \
                 1.6 (the older format is not supported: load and save it again with a current \
                 PyTorch)"
            ),
        })?,
        prefix: String::new(),
    };
    reader.find_records()?;
    let pickle = reader.record(&format!("{}data.pkl", reader.prefix), MAX_PICKLE_BYTES)?;
    let root = pickle::load(&pickle).map_err(|error| reader.malformed(error.to_string()))?;
    let mut views = Vec::new();
    collect(&root, "", 0, &mut views).map_err(|problem| reader.malformed(problem))?;
    reader.tensors(views)
}

struct Reader<R> {
    path: PathBuf,
    archive: ZipArchive<R>,
    /// `archive/`: the folder every record of the archive is in.
    prefix: String,
}

/// A view checked against its own declaration: sizes and strides non-negative, the extent
/// without overflow.
struct Layout {
    dtype: Dtype,
    shape: Vec<usize>,
    strides: Vec<usize>,
    offset: usize,
    /// One past the last storage element the view reads (0 for an empty tensor).
    end: usize,
}

impl<R: Read + Seek> Reader<R> {
    fn malformed(&self, problem: String) -> FileError {
        malformed(&self.path, problem)
    }

    fn layout_error(&self, key: &str, problem: LayoutProblem) -> FileError {
        FileError::Layout {
            path: self.path.clone(),
            key: key.to_string(),
            problem: Box::new(problem),
        }
    }

    /// Finds `<prefix>/data.pkl` and checks the byte order.
    fn find_records(&mut self) -> Result<(), FileError> {
        let pickle = self
            .archive
            .file_names()
            .find(|name| name.ends_with("data.pkl") && name.matches('/').count() <= 1)
            .map(str::to_string)
            .ok_or_else(|| self.malformed("the archive has no data.pkl".into()))?;
        self.prefix = pickle.trim_end_matches("data.pkl").to_string();
        let byteorder = format!("{}byteorder", self.prefix);
        if self.archive.index_for_name(&byteorder).is_some() {
            let order = self.record(&byteorder, 16)?;
            if order != b"little" {
                return Err(self.malformed(format!(
                    "byte order {:?}: only little-endian files are supported",
                    String::from_utf8_lossy(&order)
                )));
            }
        }
        Ok(())
    }

    /// The whole record `name`, refused when it declares more than `limit` bytes.
    fn record(&mut self, name: &str, limit: u64) -> Result<Vec<u8>, FileError> {
        let mut file = self
            .archive
            .by_name(name)
            .map_err(|error| malformed(&self.path, format!("record {name}: {error}")))?;
        let size = file.size();
        if size > limit {
            return Err(FileError::Malformed {
                path: self.path.clone(),
                format: "torch.save",
                problem: format!("record {name} declares {size} bytes, more than {limit}"),
            });
        }
        let mut bytes = Vec::new();
        let read = (&mut file).take(size).read_to_end(&mut bytes);
        drop(file);
        read.map_err(|error| self.malformed(format!("record {name}: {error}")))?;
        if bytes.len() as u64 != size {
            return Err(self.malformed(format!("record {name} is truncated")));
        }
        Ok(bytes)
    }

    fn layout(&self, key: &str, view: &TensorRef) -> Result<Layout, FileError> {
        let problem = |problem| self.layout_error(key, problem);
        let dtype =
            storage_dtype(&view.storage.type_name).ok_or_else(|| FileError::UnsupportedDtype {
                path: self.path.clone(),
                key: key.to_string(),
                dtype: view.storage.type_name.clone(),
            })?;
        if view.shape.len() != view.stride.len() {
            return Err(problem(LayoutProblem::RankMismatch {
                sizes: view.shape.len(),
                strides: view.stride.len(),
            }));
        }
        let non_negative = |what: String, value: i64| {
            usize::try_from(value).map_err(|_| problem(LayoutProblem::Negative { what, value }))
        };
        let offset = non_negative("the storage offset".into(), view.offset)?;
        let shape = (view.shape.iter().enumerate())
            .map(|(i, &size)| non_negative(format!("size[{i}]"), size))
            .collect::<Result<Vec<_>, _>>()?;
        let strides = (view.stride.iter().enumerate())
            .map(|(i, &stride)| non_negative(format!("stride[{i}]"), stride))
            .collect::<Result<Vec<_>, _>>()?;
        let overflow = || {
            problem(LayoutProblem::Overflow {
                shape: view.shape.clone(),
                strides: view.stride.clone(),
            })
        };
        crate::byte_len(&shape, dtype).ok_or_else(overflow)?;
        let end = if shape.contains(&0) {
            0
        } else {
            // The last element read is at offset + Σ (size − 1) · stride.
            shape
                .iter()
                .zip(&strides)
                .try_fold(offset, |end, (&size, &stride)| {
                    end.checked_add((size - 1).checked_mul(stride)?)
                })
                .and_then(|last| last.checked_add(1))
                .ok_or_else(overflow)?
        };
        Ok(Layout {
            dtype,
            shape,
            strides,
            offset,
            end,
        })
    }

    /// Checks every view, reads each storage once (as far as its views reach) and gathers the
    /// views' elements.
    fn tensors(&mut self, views: Vec<(String, Rc<TensorRef>)>) -> Result<Tensors, FileError> {
        let mut layouts = Vec::with_capacity(views.len());
        // Per storage record: the first tensor that uses it, its element type, declared length,
        // and how far its views reach.
        let mut storages: HashMap<String, (String, Dtype, i64, usize)> = HashMap::new();
        for (key, view) in &views {
            let layout = self.layout(key, view)?;
            let storage = &view.storage;
            if layout.end > 0 {
                let available = usize::try_from(storage.numel).unwrap_or(0);
                if layout.end > available {
                    return Err(self.layout_error(
                        key,
                        LayoutProblem::PastStorage {
                            shape: layout.shape.clone(),
                            strides: layout.strides.clone(),
                            offset: layout.offset,
                            needed: layout.end,
                            available,
                            storage: storage.key.clone(),
                        },
                    ));
                }
                let entry = storages.entry(storage.key.clone()).or_insert((
                    key.clone(),
                    layout.dtype,
                    storage.numel,
                    0,
                ));
                if entry.1 != layout.dtype {
                    return Err(
                        self.layout_error(key, LayoutProblem::StorageDtype(storage.key.clone()))
                    );
                }
                entry.3 = entry.3.max(layout.end);
            }
            layouts.push(layout);
        }
        let mut data = HashMap::with_capacity(storages.len());
        // Read in a fixed order, so that errors do not depend on hashing.
        let ordered: BTreeMap<_, _> = storages.into_iter().collect();
        for (storage, (key, dtype, numel, end)) in ordered {
            let bytes = self.storage(&key, &storage, dtype, numel, end)?;
            data.insert(storage, bytes);
        }
        let mut tensors = Tensors::new();
        for ((key, view), layout) in views.into_iter().zip(layouts) {
            let storage = data.get(&view.storage.key).map_or(&[][..], Vec::as_slice);
            let bytes = gather(storage, &layout).ok_or_else(|| FileError::Allocation {
                path: self.path.clone(),
                key: key.clone(),
                bytes: crate::byte_len(&layout.shape, layout.dtype).unwrap_or(usize::MAX),
            })?;
            let tensor =
                RawTensor::new(layout.dtype, layout.shape, bytes).expect("gather fills the shape");
            tensors.insert(key, tensor);
        }
        Ok(tensors)
    }

    /// The first `end` elements of storage record `storage` (declared `numel` long), for the
    /// tensor `key` that first uses it.
    fn storage(
        &mut self,
        key: &str,
        storage: &str,
        dtype: Dtype,
        numel: i64,
        end: usize,
    ) -> Result<Vec<u8>, FileError> {
        let name = format!("{}data/{storage}", self.prefix);
        let element = dtype.size() as u64;
        let declared = u64::try_from(numel).unwrap_or(0).saturating_mul(element);
        let Some(index) = self.archive.index_for_name(&name) else {
            return Err(self.layout_error(key, LayoutProblem::MissingStorage(name)));
        };
        let mut file = self
            .archive
            .by_index(index)
            .map_err(|error| malformed(&self.path, format!("record {name}: {error}")))?;
        if file.size() < declared {
            let found = file.size();
            drop(file);
            return Err(self.layout_error(
                key,
                LayoutProblem::ShortStorage {
                    storage: name,
                    expected: declared,
                    found,
                },
            ));
        }
        let len = end * dtype.size(); // end ≤ numel, whose byte size the record holds
        let Some(mut bytes) = crate::allocate(len) else {
            drop(file);
            return Err(FileError::Allocation {
                path: self.path.clone(),
                key: key.to_string(),
                bytes: len,
            });
        };
        let read = (&mut file).take(len as u64).read_to_end(&mut bytes);
        drop(file);
        match read {
            Ok(n) if n == len => Ok(bytes),
            Ok(_) => Err(self.malformed(format!("record {name} is shorter than it declares"))),
            Err(error) => Err(self.malformed(format!("record {name}: {error}"))),
        }
    }
}

fn malformed(path: &Path, problem: String) -> FileError {
    FileError::Malformed {
        path: path.to_path_buf(),
        format: "torch.save",
        problem,
    }
}

/// The view's elements in row-major order.
fn gather(storage: &[u8], layout: &Layout) -> Option<Vec<u8>> {
    let element = layout.dtype.size();
    let numel: usize = layout.shape.iter().product();
    let mut out = crate::allocate(numel * element)?;
    if numel == 0 {
        return Some(out);
    }
    if is_contiguous(&layout.shape, &layout.strides) {
        let start = layout.offset * element;
        out.extend_from_slice(&storage[start..start + numel * element]);
        return Some(out);
    }
    // An odometer over the indices, the source position kept incrementally.
    let rank = layout.shape.len();
    let mut index = vec![0usize; rank];
    let mut source = layout.offset;
    for _ in 0..numel {
        out.extend_from_slice(&storage[source * element..(source + 1) * element]);
        for dim in (0..rank).rev() {
            index[dim] += 1;
            source += layout.strides[dim];
            if index[dim] < layout.shape[dim] {
                break;
            }
            source -= layout.strides[dim] * layout.shape[dim];
            index[dim] = 0;
        }
    }
    Some(out)
}

/// Whether row-major `shape` is laid out with `strides` without gaps (dimensions of size 1 may
/// have any stride).
fn is_contiguous(shape: &[usize], strides: &[usize]) -> bool {
    let mut expected = 1;
    for (&size, &stride) in shape.iter().zip(strides).rev() {
        if size != 1 && stride != expected {
            return false;
        }
        expected *= size;
    }
    true
}

/// The storage classes `torch.save` names.
fn storage_dtype(type_name: &str) -> Option<Dtype> {
    Some(match type_name {
        "DoubleStorage" => Dtype::F64,
        "FloatStorage" => Dtype::F32,
        "HalfStorage" => Dtype::F16,
        "BFloat16Storage" => Dtype::BF16,
        "LongStorage" => Dtype::I64,
        "IntStorage" => Dtype::I32,
        "ShortStorage" => Dtype::I16,
        "CharStorage" => Dtype::I8,
        "ByteStorage" => Dtype::U8,
        "BoolStorage" => Dtype::Bool,
        _ => return None,
    })
}

/// The tensors of a state dict, with dotted names for nested dicts.
fn collect(
    value: &Value,
    prefix: &str,
    depth: usize,
    out: &mut Vec<(String, Rc<TensorRef>)>,
) -> Result<(), String> {
    let Value::Dict(pairs) = value else {
        return Err("the pickle is not a dict of tensors (a state dict)".into());
    };
    if depth > MAX_NESTING {
        return Err(format!("dicts nested deeper than {MAX_NESTING}"));
    }
    for (key, value) in pairs.borrow().iter() {
        let name = match key {
            Value::Str(key) => format!("{prefix}{key}"),
            Value::Int(key) => format!("{prefix}{key}"),
            _ => continue,
        };
        match value {
            Value::Tensor(tensor) => out.push((name, tensor.clone())),
            Value::Dict(_) => collect(value, &format!("{name}."), depth + 1, out)?,
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguity_ignores_unit_dimensions() {
        assert!(is_contiguous(&[2, 3], &[3, 1]));
        assert!(is_contiguous(&[1, 3], &[99, 1]));
        assert!(!is_contiguous(&[2, 3], &[1, 2]));
        assert!(!is_contiguous(&[2, 3], &[0, 1]));
    }
}
