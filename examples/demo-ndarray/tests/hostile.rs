//! `apply` and `heatmap` as a hostile or careless user runs them: every case exits 2 with one
//! `error:` line and no panic text, leaves every input byte for byte as it was, and writes no
//! output (or, where the input is valid after all, the right one).

use std::io::Write;
use std::path::{Path, PathBuf};

use demo_cli_cases::{
    assert_matches_fixture, assert_no_partial_files, fixture, run, scratch, stderr_lines,
};
use tensor_files::torch::{StoredView, serialize_views};
use tensor_files::{Dtype, RawTensor, Tensors};

const BIN: &str = env!("CARGO_BIN_EXE_demo-ndarray");
const BOOK: &str = "book_s0_b2_t5_i8_o8_h2_bias";

/// Every input's bytes, to compare after the run.
fn snapshot(paths: &[&Path]) -> Vec<Option<Vec<u8>>> {
    paths.iter().map(|p| std::fs::read(p).ok()).collect()
}

/// Runs `args`, expecting exit 2, one `error:` line containing `needle`, no panic, no change to
/// `inputs`, and `output` as it was (absent, or the same bytes).
fn refused(args: &[&str], needle: &str, inputs: &[&Path], output: &Path) {
    let before = snapshot(inputs);
    // Only a regular file is read: reading a FIFO would wait for a writer.
    let regular = |path: &Path| std::fs::metadata(path).is_ok_and(|m| m.is_file());
    let output_before = regular(output).then(|| std::fs::read(output).unwrap());
    let result = run(BIN, args);
    let lines = stderr_lines(&result);
    assert_eq!(result.status.code(), Some(2), "{args:?}: {lines:?}");
    assert_eq!(lines.len(), 1, "{args:?}: one line, got {lines:?}");
    assert!(lines[0].starts_with("error: "), "{lines:?}");
    assert!(
        lines[0].contains(needle),
        "{args:?}: {:?} should say {needle:?}",
        lines[0]
    );
    assert!(!lines[0].contains("panicked"), "{lines:?}");
    assert_eq!(snapshot(inputs), before, "{args:?}: an input changed");
    if regular(output) || output_before.is_some() {
        assert_eq!(
            std::fs::read(output).ok(),
            output_before,
            "{args:?}: the output changed"
        );
    }
    assert_no_partial_files(output);
}

fn s(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// `apply --weights W --input X --num-heads 2 --output OUT` and `extra`.
fn apply<'a>(
    weights: &'a Path,
    input: &'a Path,
    output: &'a Path,
    extra: &[&'a str],
) -> Vec<&'a str> {
    let mut args = vec![
        "apply",
        "--weights",
        s(weights),
        "--input",
        s(input),
        "--num-heads",
        "2",
        "--output",
        s(output),
    ];
    args.extend_from_slice(extra);
    args
}

/// A copy of a fixture in `dir` (tests may damage their copies, never the fixtures).
fn copy(dir: &Path, name: &str) -> PathBuf {
    let to = dir.join(name);
    std::fs::copy(fixture(name), &to).unwrap();
    to
}

fn write_x(path: &Path, shape: Vec<usize>) {
    let n = shape.iter().product();
    let tensors = Tensors::from([("x".to_string(), RawTensor::from_f32(shape, &vec![0.5; n]))]);
    std::fs::write(
        path,
        tensor_files::safetensors::serialize(&tensors).unwrap(),
    )
    .unwrap();
}

#[test]
fn an_output_that_is_an_input_is_refused_however_it_is_spelled() {
    let dir = scratch("same-file");
    let weights = copy(&dir, &format!("{BOOK}.safetensors"));
    let pt = copy(&dir, &format!("{BOOK}.pt"));
    let link = dir.join("link.safetensors");
    std::os::unix::fs::symlink(&weights, &link).unwrap();
    let hard = dir.join("hard.safetensors");
    std::fs::hard_link(&weights, &hard).unwrap();
    let respelled = dir
        .join(".")
        .join("..")
        .join(dir.file_name().unwrap())
        .join(weights.file_name().unwrap());
    let inputs = [weights.as_path(), pt.as_path()];
    for (output, role) in [
        (&weights, "--weights"),
        (&link, "--weights"),
        (&hard, "--weights"),
        (&respelled, "--weights"),
    ] {
        refused(
            &apply(&weights, &pt, output, &[]),
            &format!("same file as {role}"),
            &inputs,
            output,
        );
    }
    // One file may serve as weights, input and cotangent; the output may be none of them.
    for (role, args) in [
        (
            "--input",
            [
                "--weights",
                s(&pt),
                "--input",
                s(&weights),
                "--cotangent",
                s(&pt),
            ],
        ),
        (
            "--cotangent",
            [
                "--weights",
                s(&pt),
                "--input",
                s(&pt),
                "--cotangent",
                s(&weights),
            ],
        ),
    ] {
        let mut full = vec!["apply", "--num-heads", "2", "--output", s(&link)];
        full.extend(args);
        refused(&full, &format!("same file as {role}"), &inputs, &link);
    }
    refused(
        &[
            "heatmap",
            "--weights",
            s(&weights),
            "--input",
            s(&weights),
            "--num-heads",
            "2",
            "--output",
            s(&hard),
        ],
        "same file as --weights",
        &inputs,
        &hard,
    );
}

#[test]
fn an_output_that_is_not_a_regular_file_is_refused() {
    let dir = scratch("not-regular");
    let weights = copy(&dir, &format!("{BOOK}.safetensors"));
    let fifo = dir.join("fifo");
    assert!(
        std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success()
    );
    let directory = dir.join("a-directory");
    std::fs::create_dir(&directory).unwrap();
    std::fs::write(directory.join("keep"), "kept").unwrap();
    for (output, kind) in [
        (fifo.as_path(), "a FIFO"),
        (directory.as_path(), "a directory"),
        (Path::new("/dev/null"), "a device"),
    ] {
        refused(
            &apply(&weights, &weights, output, &[]),
            kind,
            &[weights.as_path()],
            output,
        );
    }
    assert!(
        !std::fs::symlink_metadata(&fifo)
            .unwrap()
            .file_type()
            .is_file()
    );
    assert_eq!(
        std::fs::read_to_string(directory.join("keep")).unwrap(),
        "kept"
    );
}

fn make_fifo(path: &Path) {
    let status = std::process::Command::new("mkfifo")
        .arg(path)
        .status()
        .unwrap();
    assert!(status.success(), "mkfifo {}", path.display());
}

#[test]
fn an_input_that_is_not_a_regular_file_is_refused_without_reading_it() {
    use std::os::unix::fs::FileTypeExt;

    let dir = scratch("input-not-regular");
    let weights = copy(&dir, &format!("{BOOK}.safetensors"));
    let out = dir.join("out.safetensors");
    // Both readers: safetensors and torch.save.
    for extension in ["safetensors", "pt"] {
        let fifo = dir.join(format!("fifo.{extension}"));
        make_fifo(&fifo);
        let directory = dir.join(format!("a-directory.{extension}"));
        std::fs::create_dir(&directory).unwrap();
        let device = dir.join(format!("null.{extension}"));
        std::os::unix::fs::symlink("/dev/null", &device).unwrap();
        for (special, kind) in [
            (&fifo, "a FIFO"),
            (&directory, "a directory"),
            (&device, "a device"),
        ] {
            let needle = format!("{} is {kind}, not a regular file", special.display());
            // The special file is not among the inputs compared: reading a FIFO would block.
            refused(
                &apply(special, &weights, &out, &[]),
                &needle,
                &[weights.as_path()],
                &out,
            );
            refused(
                &apply(&weights, special, &out, &[]),
                &needle,
                &[weights.as_path()],
                &out,
            );
            assert!(!out.exists(), "{kind} .{extension}: no output");
        }
        assert!(
            std::fs::symlink_metadata(&fifo)
                .unwrap()
                .file_type()
                .is_fifo()
        );
        assert!(std::fs::metadata(&directory).unwrap().is_dir());
    }
}

#[test]
fn weights_holding_a_nan_or_an_infinity_are_refused_naming_the_tensor() {
    let dir = scratch("non-finite");
    let input = copy(&dir, &format!("{BOOK}.safetensors"));
    let out = dir.join("out.safetensors");
    let poisons = [
        ("query_layer.weight", f32::NAN, "NaN"),
        ("value_layer.weight", f32::INFINITY, "inf"),
        ("output_layer.bias", f32::NEG_INFINITY, "-inf"),
    ];
    for (i, (key, value, shown)) in poisons.into_iter().enumerate() {
        // Element 3 of `key` set to `value`, every other tensor as it was.
        let mut tensors = tensor_files::read(&input).unwrap();
        let tensor = tensors.get_mut(key).expect("the tensor exists");
        let mut values = tensor.to_f32().expect("a float tensor");
        values[3] = value;
        *tensor = RawTensor::from_f32(tensor.shape.clone(), &values);
        let weights = dir.join(format!("poison{i}.safetensors"));
        std::fs::write(
            &weights,
            tensor_files::safetensors::serialize(&tensors).unwrap(),
        )
        .unwrap();
        let needle = format!("`{key}` holds {shown} at flat index 3: weights must be finite");
        for path in ["explicit", "fused", "cached"] {
            refused(
                &apply(&weights, &input, &out, &["--path", path]),
                &needle,
                &[weights.as_path(), input.as_path()],
                &out,
            );
            assert!(!out.exists(), "{key} {shown} --path {path}: no output");
        }
    }
}

#[test]
fn a_link_planted_at_the_old_temporary_name_is_never_followed() {
    let dir = scratch("planted-link");
    let weights = copy(&dir, &format!("{BOOK}.safetensors"));
    let victim = dir.join("victim.txt");
    std::fs::write(&victim, "precious").unwrap();
    let out = dir.join("out.safetensors");
    std::os::unix::fs::symlink(&victim, dir.join(".out.safetensors.partial")).unwrap();
    let result = run(BIN, &apply(&weights, &weights, &out, &[]));
    assert!(result.status.success(), "{:?}", stderr_lines(&result));
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
    assert_matches_fixture(&out, &weights, &["y", "attn_weights"]);
}

/// The chapter's weights saved as PyTorch saves `w.t().contiguous().t()`: column-major views.
fn column_major_pt(dir: &Path) -> PathBuf {
    let source = tensor_files::read(&fixture(&format!("{BOOK}.safetensors"))).unwrap();
    let mut views = Vec::new();
    let mut records = Vec::new();
    for (i, (key, tensor)) in source
        .iter()
        .filter(|(k, _)| k.ends_with("weight") || k.ends_with("bias"))
        .enumerate()
    {
        let storage = i.to_string();
        let (stride, bytes) = match tensor.shape[..] {
            [rows, cols] => {
                // The storage holds the transpose, row-major: element (r, c) at c · rows + r.
                let mut bytes = vec![0u8; tensor.bytes.len()];
                for r in 0..rows {
                    for c in 0..cols {
                        let (from, to) = ((r * cols + c) * 4, (c * rows + r) * 4);
                        bytes[to..to + 4].copy_from_slice(&tensor.bytes[from..from + 4]);
                    }
                }
                (vec![1, rows as i64], bytes)
            }
            _ => (vec![1], tensor.bytes.clone()),
        };
        views.push(StoredView {
            key: key.clone(),
            storage: storage.clone(),
            dtype: Dtype::F32,
            storage_numel: tensor.numel() as i64,
            offset: 0,
            shape: tensor.shape.iter().map(|&d| d as i64).collect(),
            stride,
        });
        records.push((storage, bytes));
    }
    let path = dir.join("column-major.pt");
    std::fs::write(&path, serialize_views(&views, &records)).unwrap();
    path
}

#[test]
fn strided_pt_weights_give_pytorchs_numbers() {
    let dir = scratch("strided");
    let weights = column_major_pt(&dir);
    let out = dir.join("out.safetensors");
    let input = fixture(&format!("{BOOK}.safetensors"));
    let result = run(BIN, &apply(&weights, &input, &out, &[]));
    assert!(result.status.success(), "{:?}", stderr_lines(&result));
    assert_matches_fixture(&out, &input, &["y", "attn_weights"]);
}

#[test]
fn hostile_pt_layouts_are_refused_naming_the_tensor() {
    let dir = scratch("hostile-pt");
    let input = copy(&dir, &format!("{BOOK}.safetensors"));
    let out = dir.join("out.safetensors");
    let view = |offset: i64, shape: &[i64], stride: &[i64], numel: i64| StoredView {
        key: "query_layer.weight".into(),
        storage: "0".into(),
        dtype: Dtype::F32,
        storage_numel: numel,
        offset,
        shape: shape.to_vec(),
        stride: stride.to_vec(),
    };
    let cases: [(&str, StoredView, usize, &str); 6] = [
        (
            "short storage",
            view(0, &[8, 8], &[8, 1], 60),
            60,
            "needs 64 elements",
        ),
        (
            "offset past storage",
            view(100, &[8, 8], &[8, 1], 64),
            64,
            "needs 164 elements",
        ),
        (
            "negative stride",
            view(63, &[8, 8], &[-8, 1], 64),
            64,
            "stride[0] is negative",
        ),
        (
            "record shorter than declared",
            view(0, &[8, 8], &[8, 1], 64),
            10,
            "holds 40 bytes, 256 expected",
        ),
        (
            "2^20 x 2^20 over 64 elements",
            view(0, &[1 << 20, 1 << 20], &[1 << 20, 1], 64),
            64,
            "holds 64",
        ),
        (
            "missing record",
            view(0, &[8, 8], &[8, 1], 64),
            0,
            "is missing",
        ),
    ];
    for (what, view, record_elements, needle) in cases {
        let records = if record_elements == 0 {
            vec![]
        } else {
            vec![("0".to_string(), vec![0u8; record_elements * 4])]
        };
        let weights = dir.join("hostile.pt");
        std::fs::write(&weights, serialize_views(&[view], &records)).unwrap();
        refused(
            &apply(&weights, &input, &out, &[]),
            needle,
            &[weights.as_path(), input.as_path()],
            &out,
        );
        assert!(!out.exists(), "{what}");
    }
}

#[test]
fn a_deflate_bomb_is_refused_in_bounded_memory() {
    // A 3 GiB record of zeros deflated to a few MB, declared as one 3 GiB tensor. Under a 2 GB
    // address-space limit the reader must say it cannot allocate, not abort.
    let dir = scratch("bomb");
    let weights = dir.join("bomb.pt");
    let numel: i64 = 3 << 28; // 3 GiB of f32
    let view = StoredView {
        key: "query_layer.weight".into(),
        storage: "0".into(),
        dtype: Dtype::F32,
        storage_numel: numel,
        offset: 0,
        shape: vec![numel],
        stride: vec![1],
    };
    let plain = serialize_views(&[view], &[]);
    let mut plain = zip::ZipArchive::new(std::io::Cursor::new(plain)).unwrap();
    let mut pickle = Vec::new();
    std::io::Read::read_to_end(&mut plain.by_name("archive/data.pkl").unwrap(), &mut pickle)
        .unwrap();
    let mut zip = zip::ZipWriter::new(std::fs::File::create(&weights).unwrap());
    let stored =
        zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    let deflated = zip::write::SimpleFileOptions::default()
        .compression_method(zip::CompressionMethod::Deflated)
        .compression_level(Some(1))
        .large_file(true);
    zip.start_file("archive/data.pkl", stored).unwrap();
    zip.write_all(&pickle).unwrap();
    zip.start_file("archive/data/0", deflated).unwrap();
    let zeros = vec![0u8; 1 << 20];
    for _ in 0..3 * 1024 {
        zip.write_all(&zeros).unwrap();
    }
    zip.finish().unwrap();
    assert!(std::fs::metadata(&weights).unwrap().len() < 64 << 20);
    let input = copy(&dir, &format!("{BOOK}.safetensors"));
    let out = dir.join("out.safetensors");
    let script = "ulimit -v 2000000 && exec \"$0\" \"$@\"";
    let result = std::process::Command::new("sh")
        .args([
            "-c",
            script,
            BIN,
            "apply",
            "--weights",
            s(&weights),
            "--input",
            s(&input),
        ])
        .args(["--num-heads", "2", "--output", s(&out)])
        .output()
        .unwrap();
    let lines = stderr_lines(&result);
    assert_eq!(result.status.code(), Some(2), "{lines:?}");
    assert!(lines[0].contains("could not be allocated"), "{lines:?}");
    assert!(!out.exists());
}

#[test]
fn ten_thousand_unused_tensors_load_in_linear_time() {
    // A hang guard, not a benchmark: the quadratic loader took minutes on this file.
    let dir = scratch("many");
    let mut tensors = tensor_files::read(&fixture(&format!("{BOOK}.safetensors"))).unwrap();
    for i in 0..10_000 {
        tensors.insert(
            format!("unused.{i}"),
            RawTensor::from_f32(vec![1], &[i as f32]),
        );
    }
    let started = std::time::Instant::now();
    for (name, bytes) in [
        ("many.pt", tensor_files::torch::serialize(&tensors)),
        (
            "many.safetensors",
            tensor_files::safetensors::serialize(&tensors).unwrap(),
        ),
    ] {
        let weights = dir.join(name);
        std::fs::write(&weights, bytes).unwrap();
        let out = dir.join(format!("{name}.out.safetensors"));
        let result = run(BIN, &apply(&weights, &weights, &out, &[]));
        assert!(
            result.status.success(),
            "{name}: {:?}",
            stderr_lines(&result)
        );
    }
    assert!(started.elapsed().as_secs() < 30, "{:?}", started.elapsed());
}

#[test]
fn inputs_that_would_panic_or_exhaust_memory_are_one_line_errors() {
    let dir = scratch("sizes");
    let weights = copy(&dir, &format!("{BOOK}.safetensors"));
    let out = dir.join("out.safetensors");
    let empty_batch = dir.join("empty-batch.safetensors");
    write_x(&empty_batch, vec![0, 5, 8]);
    let empty_seq = dir.join("empty-seq.safetensors");
    write_x(&empty_seq, vec![2, 0, 8]);
    let long = dir.join("long.safetensors");
    write_x(&long, vec![1, 60_000, 8]);
    let refused_input = |input: &Path, extra: &[&str], needle: &str| {
        let args = apply(&weights, input, &out, extra);
        refused(&args, needle, &[weights.as_path(), input], &out);
    };
    refused_input(&empty_batch, &["--path", "explicit"], "batch = 0");
    refused_input(&empty_batch, &["--path", "fused"], "batch = 0");
    refused_input(&empty_seq, &["--path", "cached"], "seq = 0");
    refused_input(
        &long,
        &["--path", "explicit", "--context-length", "60000"],
        "use the fused path",
    );

    // A mask buffer that is not [C, C].
    let mut tensors = tensor_files::read(&weights).unwrap();
    tensors.insert("mask".into(), RawTensor::from_f32(vec![], &[1.0]));
    let scalar_mask = dir.join("scalar-mask.safetensors");
    std::fs::write(
        &scalar_mask,
        tensor_files::safetensors::serialize(&tensors).unwrap(),
    )
    .unwrap();
    refused(
        &apply(&scalar_mask, &weights, &out, &[]),
        "`mask` has shape []",
        &[scalar_mask.as_path()],
        &out,
    );

    // Heatmap: an empty batch, and weights that make NaN.
    let heatmap_out = dir.join("map.png");
    refused(
        &[
            "heatmap",
            "--weights",
            s(&weights),
            "--input",
            s(&empty_batch),
            "--num-heads",
            "2",
            "--output",
            s(&heatmap_out),
        ],
        "empty batch",
        &[weights.as_path()],
        &heatmap_out,
    );
    // A NaN weight is refused when it is loaded, naming it; finite weights so large that the
    // scores overflow make NaN weights, which the heatmap refuses to draw.
    for (value, name, needle) in [
        (
            f32::NAN,
            "nan.safetensors",
            "`query_layer.weight` holds NaN",
        ),
        (3.0e38, "huge.safetensors", "not finite"),
    ] {
        let mut tensors = tensor_files::read(&weights).unwrap();
        tensors.insert(
            "query_layer.weight".into(),
            RawTensor::from_f32(vec![8, 8], &[value; 64]),
        );
        let bad_weights = dir.join(name);
        std::fs::write(
            &bad_weights,
            tensor_files::safetensors::serialize(&tensors).unwrap(),
        )
        .unwrap();
        refused(
            &[
                "heatmap",
                "--weights",
                s(&bad_weights),
                "--input",
                s(&weights),
                "--num-heads",
                "2",
                "--output",
                s(&heatmap_out),
            ],
            needle,
            &[bad_weights.as_path()],
            &heatmap_out,
        );
    }
}

#[test]
fn position_ids_of_the_wrong_shape_or_type_are_refused() {
    let dir = scratch("positions");
    let name = "llama_s0_b2_t7_d32_h4_kv2.safetensors";
    let layer = dir.join(name);
    std::fs::copy(fixture(&format!("hf/{name}")), &layer).unwrap();
    let out = dir.join("out.safetensors");
    let int64 = |shape: Vec<usize>| {
        let n: usize = shape.iter().product();
        let bytes = (0..n as i64).flat_map(i64::to_le_bytes).collect();
        RawTensor::new(Dtype::I64, shape, bytes).unwrap()
    };
    let cases = [
        ("short", int64(vec![2, 6]), "got I64 [2, 6]"),
        ("flat", int64(vec![14]), "got I64 [14]"),
        (
            "float",
            RawTensor::from_f32(vec![2, 7], &[1.0; 14]),
            "got F32 [2, 7]",
        ),
        (
            "bool",
            RawTensor::new(Dtype::Bool, vec![2, 7], vec![1; 14]).unwrap(),
            "got Bool",
        ),
    ];
    for (label, positions, needle) in cases {
        let mut tensors = tensor_files::read(&layer).unwrap();
        tensors.insert("position_ids".into(), positions);
        let input = dir.join(format!("{label}.safetensors"));
        std::fs::write(
            &input,
            tensor_files::safetensors::serialize(&tensors).unwrap(),
        )
        .unwrap();
        for path in ["explicit", "fused", "cached"] {
            let args = [
                "apply",
                "--weights",
                s(&layer),
                "--input",
                s(&input),
                "--num-heads",
                "4",
                "--rope-theta",
                "10000",
                "--path",
                path,
                "--output",
                s(&out),
            ];
            let needle =
                format!("`position_ids` must be integers of shape [batch, seq] = [2, 7], {needle}");
            refused(&args, &needle, &[layer.as_path(), input.as_path()], &out);
        }
    }
}

#[test]
fn a_huge_context_length_runs_the_cache_on_demand() {
    let dir = scratch("huge-context");
    let weights = copy(&dir, &format!("{BOOK}.safetensors"));
    for context in ["1000000000", "18446744073709551615"] {
        let out = dir.join(format!("out-{}.safetensors", context.len()));
        let result = run(
            BIN,
            &apply(
                &weights,
                &weights,
                &out,
                &["--path", "cached", "--context-length", context],
            ),
        );
        assert!(
            result.status.success(),
            "{context}: {:?}",
            stderr_lines(&result)
        );
        assert_matches_fixture(&out, &weights, &["y"]);
    }
}

/// A copy of the packed fixture in `dir` named `label`, its `segment_ids` replaced by `ids`.
fn with_segment_ids(dir: &Path, label: &str, ids: RawTensor) -> PathBuf {
    let mut tensors = tensor_files::read(&fixture(demo_cli_cases::PACKED)).unwrap();
    tensors.insert("segment_ids".into(), ids);
    let path = dir.join(format!("{label}.safetensors"));
    std::fs::write(
        &path,
        tensor_files::safetensors::serialize(&tensors).unwrap(),
    )
    .unwrap();
    path
}

/// An int64 tensor of `shape` holding `ids`.
fn int64_ids(shape: Vec<usize>, ids: &[i64]) -> RawTensor {
    let bytes = ids.iter().flat_map(|id| id.to_le_bytes()).collect();
    RawTensor::new(Dtype::I64, shape, bytes).unwrap()
}

#[test]
fn segment_ids_that_describe_no_documents_are_refused_naming_the_tensor() {
    let dir = scratch("segment-ids");
    let weights = copy(&dir, demo_cli_cases::PACKED);
    let out = dir.join("out.safetensors");
    let good = [0, 0, 0, 1, 2, 2, 2, 2, 2, 3, 3, 3, 3, 8, 8, 8, 8, 8];
    let mut decreasing = good;
    decreasing[17] = 2;
    let mut negative = good;
    negative[0] = -1;
    let cases = [
        (
            "decreasing",
            int64_ids(vec![2, 9], &decreasing),
            "`segment_ids`: segment id 2 at row 1, position 8 is smaller than the one before it",
        ),
        (
            "negative",
            int64_ids(vec![2, 9], &negative),
            "`segment_ids`: segment id -1 at row 0, position 0 is negative",
        ),
        (
            "short",
            int64_ids(vec![2, 8], &good[..16]),
            "`segment_ids` must be integers of shape [batch, seq] = [2, 9], got I64 [2, 8]",
        ),
        (
            "float",
            RawTensor::from_f32(vec![2, 9], &[1.0; 18]),
            "`segment_ids` must be integers of shape [batch, seq] = [2, 9], got F32 [2, 9]",
        ),
        (
            "bool",
            RawTensor::new(Dtype::Bool, vec![2, 9], vec![1; 18]).unwrap(),
            "`segment_ids` must be integers of shape [batch, seq] = [2, 9], got Bool",
        ),
    ];
    for (label, ids, needle) in cases {
        let input = with_segment_ids(&dir, label, ids);
        // Bad ids are refused on every path, before the cached path's own refusal.
        for path in ["explicit", "fused", "cached"] {
            refused(
                &apply(&weights, &input, &out, &["--path", path]),
                needle,
                &[weights.as_path(), input.as_path()],
                &out,
            );
        }
    }
}

/// A document is a run of equal ids, whatever their values and integer type: ids beyond 32 bits,
/// int32 and uint8 ids give the fixture's numbers.
#[test]
fn segment_ids_of_any_integer_type_and_size_give_the_same_documents() {
    let dir = scratch("segment-id-types");
    let weights = copy(&dir, demo_cli_cases::PACKED);
    // Each token's document in its row: 3, 1 and 5 tokens, then 4 and 5.
    const DOCUMENTS: [i64; 18] = [0, 0, 0, 1, 2, 2, 2, 2, 2, 0, 0, 0, 0, 1, 1, 1, 1, 1];
    // Each row's documents numbered from `first`, `step` apart.
    let ids = |first: i64, step: i64| DOCUMENTS.map(|document| first + step * document);
    let huge = ids(1 << 40, 1 << 20);
    let int32: Vec<u8> = ids(0, 7)
        .iter()
        .flat_map(|&id| (id as i32).to_le_bytes())
        .collect();
    let uint8: Vec<u8> = ids(250, 1).iter().map(|&id| id as u8).collect();
    let cases = [
        ("huge", int64_ids(vec![2, 9], &huge)),
        (
            "int32",
            RawTensor::new(Dtype::I32, vec![2, 9], int32).unwrap(),
        ),
        (
            "uint8",
            RawTensor::new(Dtype::U8, vec![2, 9], uint8).unwrap(),
        ),
    ];
    for (label, ids) in cases {
        let input = with_segment_ids(&dir, label, ids);
        let out = dir.join(format!("{label}.out.safetensors"));
        let result = run(BIN, &apply(&weights, &input, &out, &[]));
        assert!(
            result.status.success(),
            "{label}: {:?}",
            stderr_lines(&result)
        );
        assert_matches_fixture(&out, &weights, &["y", "attn_weights"]);
    }
}
