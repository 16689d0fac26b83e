//! Writing `torch.save` files: what `torch.load` reads back as an `OrderedDict` of tensors.
//! [`serialize`] writes contiguous tensors; [`serialize_views`] writes any strided views over
//! given storage records, valid or not, so that readers can be tested against both.

use std::io::{Cursor, Write};

use zip::ZipWriter;
use zip::write::SimpleFileOptions;

use crate::{Dtype, Tensors};

/// One tensor of a state dict as `torch.save` records it: a view of a storage.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredView {
    /// The state dict's key.
    pub key: String,
    /// The storage record's name (under `data/`).
    pub storage: String,
    /// The storage's element type.
    pub dtype: Dtype,
    /// The storage's length in elements, as the pickle declares it.
    pub storage_numel: i64,
    /// First element of the view.
    pub offset: i64,
    /// Sizes.
    pub shape: Vec<i64>,
    /// Strides, in elements.
    pub stride: Vec<i64>,
}

/// A `torch.save` archive of contiguous tensors, one storage each.
pub fn serialize(tensors: &Tensors) -> Vec<u8> {
    let mut views = Vec::new();
    let mut records = Vec::new();
    for (index, (key, tensor)) in tensors.iter().enumerate() {
        let mut stride = vec![1i64; tensor.shape.len()];
        for dim in (0..tensor.shape.len().saturating_sub(1)).rev() {
            stride[dim] = stride[dim + 1] * tensor.shape[dim + 1] as i64;
        }
        views.push(StoredView {
            key: key.clone(),
            storage: index.to_string(),
            dtype: tensor.dtype,
            storage_numel: tensor.numel() as i64,
            offset: 0,
            shape: tensor.shape.iter().map(|&s| s as i64).collect(),
            stride,
        });
        records.push((index.to_string(), tensor.bytes.clone()));
    }
    serialize_views(&views, &records)
}

/// A `torch.save` archive whose state dict holds `views` (in order), with the storage records
/// `records` (`(name, bytes)`), written as given: nothing is checked.
pub fn serialize_views(views: &[StoredView], records: &[(String, Vec<u8>)]) -> Vec<u8> {
    let mut zip = ZipWriter::new(Cursor::new(Vec::new()));
    let options = SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    let mut add = |name: &str, bytes: &[u8]| {
        zip.start_file(format!("archive/{name}"), options)
            .and_then(|()| zip.write_all(bytes).map_err(Into::into))
            .expect("writing to memory");
    };
    add("data.pkl", &pickle(views));
    add("byteorder", b"little");
    for (name, bytes) in records {
        add(&format!("data/{name}"), bytes);
    }
    add("version", b"3\n");
    zip.finish().expect("writing to memory").into_inner()
}

/// `OrderedDict([(key, _rebuild_tensor_v2(storage, offset, size, stride, False,
/// OrderedDict())), …])` in pickle protocol 2.
fn pickle(views: &[StoredView]) -> Vec<u8> {
    let mut out = vec![0x80, 2];
    let ordered_dict = |out: &mut Vec<u8>| {
        out.extend_from_slice(b"ccollections\nOrderedDict\n)R");
    };
    let string = |out: &mut Vec<u8>, text: &str| {
        out.push(b'X');
        out.extend_from_slice(&(text.len() as u32).to_le_bytes());
        out.extend_from_slice(text.as_bytes());
    };
    let int = |out: &mut Vec<u8>, value: i64| {
        out.push(0x8a);
        out.push(8);
        out.extend_from_slice(&value.to_le_bytes());
    };
    let ints = |out: &mut Vec<u8>, values: &[i64]| {
        out.push(b'(');
        values.iter().for_each(|&v| int(out, v));
        out.push(b't');
    };
    ordered_dict(&mut out);
    out.push(b'(');
    for view in views {
        string(&mut out, &view.key);
        out.extend_from_slice(b"ctorch._utils\n_rebuild_tensor_v2\n(");
        // The persistent id of the storage.
        out.push(b'(');
        string(&mut out, "storage");
        out.extend_from_slice(format!("ctorch\n{}\n", storage_class(view.dtype)).as_bytes());
        string(&mut out, &view.storage);
        string(&mut out, "cpu");
        int(&mut out, view.storage_numel);
        out.extend_from_slice(b"tQ");
        int(&mut out, view.offset);
        ints(&mut out, &view.shape);
        ints(&mut out, &view.stride);
        out.push(0x89); // requires_grad = False
        ordered_dict(&mut out);
        out.extend_from_slice(b"tR");
    }
    out.extend_from_slice(b"u.");
    out
}

fn storage_class(dtype: Dtype) -> &'static str {
    match dtype {
        Dtype::F64 => "DoubleStorage",
        Dtype::F32 => "FloatStorage",
        Dtype::F16 => "HalfStorage",
        Dtype::BF16 => "BFloat16Storage",
        Dtype::I64 => "LongStorage",
        Dtype::I32 => "IntStorage",
        Dtype::I16 => "ShortStorage",
        Dtype::I8 => "CharStorage",
        Dtype::U8 => "ByteStorage",
        Dtype::Bool => "BoolStorage",
    }
}
