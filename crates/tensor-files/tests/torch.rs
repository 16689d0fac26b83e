//! `.pt` files: PyTorch's own fixtures, strided views read with their true values, and every
//! hostile layout refused with an error naming the tensor.

use std::io::{Cursor, Write};
use std::path::Path;
use std::time::Instant;

use tensor_files::torch::{StoredView, serialize, serialize_views};
use tensor_files::{Dtype, FileError, RawTensor, Tensors};

fn fixture(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(name)
}

fn read(bytes: Vec<u8>) -> Result<Tensors, FileError> {
    tensor_files::torch::read_from(Cursor::new(bytes), Path::new("test.pt"))
}

fn f32s(tensor: &RawTensor) -> Vec<f32> {
    assert_eq!(tensor.dtype, Dtype::F32);
    tensor
        .bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

/// A float storage `0, 1, …, n − 1` and one view of it.
fn view(offset: i64, shape: &[i64], stride: &[i64], storage_numel: i64) -> StoredView {
    StoredView {
        key: "w".into(),
        storage: "0".into(),
        dtype: Dtype::F32,
        storage_numel,
        offset,
        shape: shape.to_vec(),
        stride: stride.to_vec(),
    }
}

fn counting(n: usize) -> Vec<u8> {
    (0..n).flat_map(|i| (i as f32).to_le_bytes()).collect()
}

fn read_view(view: StoredView, record_elements: usize) -> Result<Tensors, FileError> {
    read(serialize_views(
        &[view],
        &[("0".into(), counting(record_elements))],
    ))
}

#[test]
fn pytorch_files_match_their_safetensors_twins() {
    for name in ["book_s0_b2_t5_i8_o8_h2_bias", "gpt2_s0_b2_t7_d16_h4"] {
        let pt = tensor_files::read(&fixture(&format!("{name}.pt"))).unwrap();
        let st = tensor_files::read(&fixture(&format!("{name}.safetensors"))).unwrap();
        assert!(!pt.is_empty());
        for (key, tensor) in &pt {
            if let Some(twin) = st.get(key) {
                assert_eq!(tensor, twin, "{name}: {key}");
            }
        }
    }
}

#[test]
fn pytorch_strided_views_load_with_their_values() {
    // Saved by PyTorch: see make_strided.py beside the file; `expected.<key>` holds each view's
    // values made contiguous before saving.
    let tensors = tensor_files::read(&fixture("strided_views.pt")).unwrap();
    let expected = tensor_files::read(&fixture("strided_views_expected.safetensors")).unwrap();
    assert_eq!(tensors.len(), expected.len());
    for (key, tensor) in &tensors {
        assert_eq!(Some(tensor), expected.get(key), "{key}");
    }
}

#[test]
fn every_dtype_round_trips() {
    let mut tensors = Tensors::new();
    for (i, dtype) in [
        Dtype::F64,
        Dtype::F32,
        Dtype::F16,
        Dtype::BF16,
        Dtype::I64,
        Dtype::I32,
        Dtype::I16,
        Dtype::I8,
        Dtype::U8,
        Dtype::Bool,
    ]
    .into_iter()
    .enumerate()
    {
        let shape = vec![2, 3];
        let bytes = (0..6 * dtype.size()).map(|b| (b % 2) as u8).collect();
        tensors.insert(
            format!("t{i}"),
            RawTensor::new(dtype, shape, bytes).unwrap(),
        );
    }
    tensors.insert("scalar".into(), RawTensor::from_f32(vec![], &[7.5]));
    tensors.insert("empty".into(), RawTensor::from_f32(vec![0, 4], &[]));
    assert_eq!(read(serialize(&tensors)).unwrap(), tensors);
}

#[test]
fn transposed_sliced_stepped_and_expanded_views_read_through_their_strides() {
    // storage 0..12 seen as a [3, 4] matrix m
    /// What the view is in PyTorch, its offset, shape, strides, and its values.
    type Case<'a> = (&'a str, i64, &'a [i64], &'a [i64], Vec<f32>);
    let cases: [Case; 5] = [
        (
            "m.t()",
            0,
            &[4, 3],
            &[1, 4],
            vec![0., 4., 8., 1., 5., 9., 2., 6., 10., 3., 7., 11.],
        ),
        (
            "m[:, 1:3]",
            1,
            &[3, 2],
            &[4, 1],
            vec![1., 2., 5., 6., 9., 10.],
        ),
        (
            "m[:, ::2]",
            0,
            &[3, 2],
            &[4, 2],
            vec![0., 2., 4., 6., 8., 10.],
        ),
        (
            "m[1].expand(2, 4)",
            4,
            &[2, 4],
            &[0, 1],
            vec![4., 5., 6., 7., 4., 5., 6., 7.],
        ),
        ("m[2, 3:]", 11, &[1], &[1], vec![11.]),
    ];
    for (what, offset, shape, stride, expected) in cases {
        let tensors = read_view(view(offset, shape, stride, 12), 12).unwrap();
        assert_eq!(f32s(&tensors["w"]), expected, "{what}");
        let shape: Vec<usize> = shape.iter().map(|&s| s as usize).collect();
        assert_eq!(tensors["w"].shape, shape, "{what}");
    }
}

fn layout_error(result: Result<Tensors, FileError>) -> String {
    match result {
        Err(error @ FileError::Layout { .. }) => {
            let message = error.to_string();
            assert!(message.contains("`w`"), "names the tensor: {message}");
            message
        }
        other => panic!("expected a layout error, got {other:?}"),
    }
}

#[test]
fn views_that_do_not_fit_their_storage_are_refused_naming_the_tensor() {
    let cases: [(&str, StoredView, usize, &str); 7] = [
        (
            "storage shorter than the view",
            view(0, &[4, 4], &[4, 1], 12),
            12,
            "needs 16 elements",
        ),
        (
            "offset past the storage",
            view(20, &[2], &[1], 12),
            12,
            "needs 22 elements",
        ),
        (
            "negative stride",
            view(11, &[3], &[-1], 12),
            12,
            "stride[0] is negative",
        ),
        (
            "negative size",
            view(0, &[-3], &[1], 12),
            12,
            "size[0] is negative",
        ),
        (
            "negative offset",
            view(-1, &[3], &[1], 12),
            12,
            "offset is negative",
        ),
        (
            "sizes and strides of different rank",
            view(0, &[3, 4], &[1], 12),
            12,
            "2 sizes but 1 strides",
        ),
        (
            "record shorter than its declared storage",
            view(0, &[3], &[1], 12),
            6,
            "holds 24 bytes, 48 expected",
        ),
    ];
    for (what, view, record_elements, needle) in cases {
        let message = layout_error(read_view(view, record_elements));
        assert!(message.contains(needle), "{what}: {message}");
    }
    let missing = serialize_views(&[view(0, &[3], &[1], 12)], &[]);
    let message = layout_error(read(missing));
    assert!(message.contains("archive/data/0` is missing"), "{message}");
}

#[test]
fn a_huge_declared_shape_is_refused_before_any_allocation() {
    // [2^20, 2^20] floats would be 4 TiB; the storage holds 64 elements.
    let message = layout_error(read_view(
        view(0, &[1 << 20, 1 << 20], &[1 << 20, 1], 64),
        64,
    ));
    assert!(message.contains("holds 64"), "{message}");
    let overflow = view(0, &[1 << 62, 1 << 62], &[1, 1], 64);
    assert!(layout_error(read_view(overflow, 64)).contains("overflows"));
}

#[test]
fn an_expanded_view_too_large_to_allocate_is_an_error_not_an_abort() {
    // One element seen as 2^62 bytes of floats: a valid view, but no machine has the memory.
    let tensors = read_view(view(0, &[1 << 30, 1 << 30], &[0, 0], 1), 1);
    match tensors {
        Err(error @ FileError::Allocation { .. }) => {
            assert!(error.to_string().contains("could not be allocated"))
        }
        other => panic!("expected an allocation error, got {other:?}"),
    }
}

#[test]
fn a_record_that_inflates_far_beyond_its_tensor_is_never_inflated() {
    // 1 GiB of zeros deflated to about 1 MB, behind a 16-element tensor.
    let mut zip = zip::ZipWriter::new(Cursor::new(Vec::new()));
    let stored =
        zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    let deflated = zip::write::SimpleFileOptions::default()
        .compression_method(zip::CompressionMethod::Deflated)
        .compression_level(Some(1));
    let plain = serialize_views(&[view(0, &[16], &[1], 1 << 28)], &[]);
    let mut plain = zip::ZipArchive::new(Cursor::new(plain)).unwrap();
    let mut pickle = Vec::new();
    std::io::Read::read_to_end(&mut plain.by_name("archive/data.pkl").unwrap(), &mut pickle)
        .unwrap();
    zip.start_file("archive/data.pkl", stored).unwrap();
    zip.write_all(&pickle).unwrap();
    zip.start_file("archive/data/0", deflated).unwrap();
    let zeros = vec![0u8; 1 << 20];
    for _ in 0..1024 {
        zip.write_all(&zeros).unwrap();
    }
    let bomb = zip.finish().unwrap().into_inner();
    assert!(bomb.len() < 16 << 20, "{} bytes", bomb.len());
    let started = Instant::now();
    let tensors = read(bomb).unwrap();
    assert_eq!(f32s(&tensors["w"]), vec![0.0; 16]);
    assert!(started.elapsed().as_secs() < 10, "{:?}", started.elapsed());
}

#[test]
fn ten_thousand_tensors_load_in_linear_time() {
    // A hang guard, not a benchmark: a quadratic loader takes minutes here.
    let tensors: Tensors = (0..10_000)
        .map(|i| {
            (
                format!("layer.{i}.weight"),
                RawTensor::from_f32(vec![2], &[i as f32, 1.0]),
            )
        })
        .collect();
    let pt = serialize(&tensors);
    let st = tensor_files::safetensors::serialize(&tensors).unwrap();
    let started = Instant::now();
    assert_eq!(read(pt).unwrap().len(), 10_000);
    let from_st = tensor_files::safetensors::read_from(&st, Path::new("many.safetensors")).unwrap();
    assert_eq!(from_st, tensors);
    assert!(started.elapsed().as_secs() < 30, "{:?}", started.elapsed());
}

#[test]
fn truncated_and_foreign_files_say_what_they_are() {
    let valid = serialize(&Tensors::from([(
        "w".into(),
        RawTensor::from_f32(vec![2], &[1.0, 2.0]),
    )]));
    let message = read(valid[..valid.len() / 2].to_vec())
        .unwrap_err()
        .to_string();
    assert!(message.contains("not a readable zip archive"), "{message}");
    let legacy = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19.".to_vec();
    let message = read(legacy).unwrap_err().to_string();
    assert!(
        message.contains("older format is not supported"),
        "{message}"
    );
}
