//! Mutated files never panic a reader: every mutation of a valid file reads as `Ok` or `Err`.
//! `FUZZ_CASES` sets the number of cases per property (default 2000).

use std::io::{Cursor, Read, Write};
use std::path::Path;

use proptest::prelude::*;
use tensor_files::torch::{StoredView, serialize_views};
use tensor_files::{Dtype, RawTensor, Tensors};

fn cases() -> u32 {
    std::env::var("FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000)
}

fn sample() -> Tensors {
    Tensors::from([
        (
            "a.weight".into(),
            RawTensor::from_f32(vec![3, 4], &[0.5; 12]),
        ),
        ("a.bias".into(), RawTensor::from_f32(vec![4], &[1.5; 4])),
        (
            "b".into(),
            RawTensor::new(Dtype::I64, vec![2], vec![7; 16]).unwrap(),
        ),
    ])
}

fn sample_pt() -> Vec<u8> {
    let views = vec![
        StoredView {
            key: "w".into(),
            storage: "0".into(),
            dtype: Dtype::F32,
            storage_numel: 12,
            offset: 1,
            shape: vec![3, 2],
            stride: vec![4, 1],
        },
        StoredView {
            key: "nested.t".into(),
            storage: "0".into(),
            dtype: Dtype::F32,
            storage_numel: 12,
            offset: 0,
            shape: vec![4, 3],
            stride: vec![1, 4],
        },
    ];
    serialize_views(&views, &[("0".into(), vec![0x3f; 48])])
}

/// The pickle of [`sample_pt`], to mutate and zip again (so the mutation passes the zip's CRC and
/// reaches the pickle machine).
fn sample_pickle() -> Vec<u8> {
    let mut archive = zip::ZipArchive::new(Cursor::new(sample_pt())).unwrap();
    let mut pickle = Vec::new();
    archive
        .by_name("archive/data.pkl")
        .unwrap()
        .read_to_end(&mut pickle)
        .unwrap();
    pickle
}

fn zip_with_pickle(pickle: &[u8]) -> Vec<u8> {
    let options =
        zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    let mut zip = zip::ZipWriter::new(Cursor::new(Vec::new()));
    zip.start_file("archive/data.pkl", options).unwrap();
    zip.write_all(pickle).unwrap();
    zip.start_file("archive/data/0", options).unwrap();
    zip.write_all(&[0x3f; 48]).unwrap();
    zip.finish().unwrap().into_inner()
}

#[derive(Debug, Clone)]
enum Mutation {
    Flip {
        at: usize,
        bits: u8,
    },
    Set {
        at: usize,
        value: u8,
    },
    /// Overwrites 8 bytes with an extreme size (0, all ones, a power of two).
    Extreme {
        at: usize,
        value: u64,
    },
    Truncate {
        at: usize,
    },
    Insert {
        at: usize,
        bytes: Vec<u8>,
    },
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let at = any::<usize>();
    prop_oneof![
        (at, 1u8..).prop_map(|(at, bits)| Mutation::Flip { at, bits }),
        (at, any::<u8>()).prop_map(|(at, value)| Mutation::Set { at, value }),
        (
            at,
            prop_oneof![
                Just(0u64),
                Just(u64::MAX),
                Just(1 << 31),
                Just(1 << 40),
                Just(i64::MAX as u64)
            ]
        )
            .prop_map(|(at, value)| Mutation::Extreme { at, value }),
        at.prop_map(|at| Mutation::Truncate { at }),
        (at, proptest::collection::vec(any::<u8>(), 1..16))
            .prop_map(|(at, bytes)| Mutation::Insert { at, bytes }),
    ]
}

fn apply(mut bytes: Vec<u8>, mutations: &[Mutation]) -> Vec<u8> {
    for mutation in mutations {
        if bytes.is_empty() {
            break;
        }
        let len = bytes.len();
        match mutation {
            Mutation::Flip { at, bits } => bytes[at % len] ^= bits,
            Mutation::Set { at, value } => bytes[at % len] = *value,
            Mutation::Extreme { at, value } => {
                let start = at % len;
                let end = (start + 8).min(len);
                bytes[start..end].copy_from_slice(&value.to_le_bytes()[..end - start]);
            }
            Mutation::Truncate { at } => bytes.truncate(at % len),
            Mutation::Insert {
                at,
                bytes: inserted,
            } => {
                let at = at % len;
                bytes.splice(at..at, inserted.iter().copied());
            }
        }
    }
    bytes
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    #[test]
    fn mutated_safetensors_never_panic(mutations in proptest::collection::vec(mutation(), 1..4)) {
        let valid = tensor_files::safetensors::serialize(&sample()).unwrap();
        let _ = tensor_files::safetensors::read_from(&apply(valid, &mutations), Path::new("x.safetensors"));
    }

    #[test]
    fn mutated_pt_archives_never_panic(mutations in proptest::collection::vec(mutation(), 1..4)) {
        let bytes = apply(sample_pt(), &mutations);
        let _ = tensor_files::torch::read_from(Cursor::new(bytes), Path::new("x.pt"));
    }

    #[test]
    fn mutated_pickles_never_panic(mutations in proptest::collection::vec(mutation(), 1..4)) {
        let bytes = zip_with_pickle(&apply(sample_pickle(), &mutations));
        let _ = tensor_files::torch::read_from(Cursor::new(bytes), Path::new("x.pt"));
    }
}

#[test]
fn the_unmutated_samples_read() {
    let tensors =
        tensor_files::torch::read_from(Cursor::new(sample_pt()), Path::new("x.pt")).unwrap();
    assert_eq!(tensors["w"].shape, vec![3, 2]);
    assert_eq!(tensors["nested.t"].shape, vec![4, 3]);
    let again = tensor_files::torch::read_from(
        Cursor::new(zip_with_pickle(&sample_pickle())),
        Path::new("x.pt"),
    );
    assert_eq!(again.unwrap(), tensors);
}
