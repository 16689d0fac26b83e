//! `hf-lm` on model directories and id files that are careless or hostile: each is exit code 2,
//! one `error:` line naming what is wrong, no panic text and no output file — run under a 2 GB
//! address-space limit (an allocation sized by a file's number aborts there rather than
//! succeeding on overcommit) and a hang guard (a FIFO read would block forever).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tensor_files::{Dtype, RawTensor, Tensors};
use test_support::fixture;

/// How long one refused run may take before it counts as a hang.
const HANG_GUARD: Duration = Duration::from_secs(60);

/// Runs `hf-lm` under `ulimit -v` 2 GB and the hang guard; returns its exit code and stderr.
fn hf_lm_guarded(args: &[&str], scratch: &Path) -> (Option<i32>, String) {
    let stderr_path = scratch.join("stderr.txt");
    let stderr = std::fs::File::create(&stderr_path).unwrap();
    let mut child = Command::new("sh")
        .arg("-c")
        .arg("ulimit -v 2000000 && exec \"$0\" \"$@\"")
        .arg(env!("CARGO_BIN_EXE_hf-lm"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .expect("hf-lm starts");
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > HANG_GUARD {
            child.kill().unwrap();
            child.wait().unwrap();
            panic!("{args:?}: hf-lm hung for {HANG_GUARD:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    (
        status.code(),
        std::fs::read_to_string(&stderr_path).unwrap(),
    )
}

/// A copy of fixture model `name` (config, weights, generation config) in `dir`.
fn copy_model(name: &str, dir: &Path) -> PathBuf {
    let source = fixture(&format!("hf/{name}"));
    let model = dir.join(name);
    std::fs::create_dir_all(&model).unwrap();
    for file in ["config.json", "model.safetensors", "generation_config.json"] {
        if source.join(file).exists() {
            std::fs::copy(source.join(file), model.join(file)).unwrap();
        }
    }
    model
}

fn edit_config(model: &Path, edit: impl FnOnce(&mut Value)) {
    let path = model.join("config.json");
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(&path, config.to_string()).unwrap();
}

/// Sets element 3 of tensor `key` to `value`.
fn poison_weight(model: &Path, key: &str, value: f32) {
    let path = model.join("model.safetensors");
    let mut tensors = tensor_files::read(&path).unwrap();
    let tensor = tensors.get_mut(key).expect("the tensor exists");
    tensor.bytes[12..16].copy_from_slice(&value.to_le_bytes());
    std::fs::write(
        &path,
        tensor_files::safetensors::serialize(&tensors).unwrap(),
    )
    .unwrap();
}

fn make_fifo(path: &Path) {
    let _ = std::fs::remove_file(path);
    let status = Command::new("mkfifo").arg(path).status().expect("mkfifo");
    assert!(status.success());
}

/// An ids file: `input_ids` (int64, or f32 with `float_ids`) and, when given, `attention_mask`.
fn ids_file(
    path: &Path,
    ids: &[i64],
    shape: [usize; 2],
    mask: Option<(&[i64], [usize; 2])>,
    float_ids: bool,
) {
    let int = |values: &[i64], shape: [usize; 2]| {
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        RawTensor::new(Dtype::I64, shape.to_vec(), bytes).unwrap()
    };
    let ids = if float_ids {
        let values: Vec<f32> = ids.iter().map(|&v| v as f32).collect();
        RawTensor::from_f32(shape.to_vec(), &values)
    } else {
        int(ids, shape)
    };
    let mut tensors = Tensors::from([("input_ids".to_string(), ids)]);
    if let Some((mask, shape)) = mask {
        tensors.insert("attention_mask".into(), int(mask, shape));
    }
    std::fs::write(
        path,
        tensor_files::safetensors::serialize(&tensors).unwrap(),
    )
    .unwrap();
}

fn s(path: &Path) -> &str {
    path.to_str().expect("UTF-8 path")
}

/// One refused run: exit 2, one `error:` line containing `needle`, no panic, no output.
fn refused(args: &[&str], needle: &str, output: &Path, scratch: &Path) {
    let (code, stderr) = hf_lm_guarded(args, scratch);
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|line| !line.contains("XDG_RUNTIME_DIR"))
        .collect();
    assert_eq!(code, Some(2), "{args:?}: {stderr}");
    assert_eq!(lines.len(), 1, "{args:?}: one line, got {stderr}");
    assert!(
        lines[0].starts_with("error: ") && lines[0].contains(needle),
        "{args:?}: {:?} should name {needle:?}",
        lines[0]
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(!output.exists(), "{args:?}: no output on error");
}

/// `--model M --input I --output O --backend ndarray`, then `extra`.
fn args<'a>(model: &'a Path, input: &'a Path, output: &'a Path, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "--model",
        s(model),
        "--input",
        s(input),
        "--output",
        s(output),
        "--backend",
        "ndarray",
    ];
    args.extend_from_slice(extra);
    args
}

/// A fixture model, an edit of its config, and what the error must name.
type ConfigEdit = (&'static str, fn(&mut Value), &'static str);

#[test]
fn model_directories_that_would_abort_hang_or_give_nan_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let scratch = dir.path();
    let input = scratch.join("ids.safetensors");
    ids_file(&input, &[5, 6, 7], [1, 3], None, false);
    let output = scratch.join("out.safetensors");

    // Sizes far past the weights: an allocation of gigabytes (an abort) before; now the field.
    let cases: [ConfigEdit; 6] = [
        (
            "llama_tiny_s1",
            |c| c["num_hidden_layers"] = json!(2_000_000_000u64),
            "`num_hidden_layers` = 2000000000 does not fit the weights: they hold 2 layers",
        ),
        (
            "gpt2_tiny_s0",
            |c| c["n_layer"] = json!(1u64 << 40),
            "`n_layer`",
        ),
        (
            "llama_tiny_s1",
            |c| c["vocab_size"] = json!(1u64 << 50),
            "`vocab_size`",
        ),
        (
            "llama_tiny_s1",
            |c| {
                c["num_attention_heads"] = json!(1u64 << 62);
                c["num_key_value_heads"] = json!(1u64 << 62);
            },
            "`num_attention_heads · head_dim` = a product past usize",
        ),
        (
            "llama_tiny_s1",
            |c| c["intermediate_size"] = json!(1u64 << 40),
            "`intermediate_size`",
        ),
        (
            "gpt2_tiny_s0",
            |c| c["n_embd"] = json!(u64::MAX / 2),
            "`n_embd`",
        ),
    ];
    for (i, (name, edit, needle)) in cases.into_iter().enumerate() {
        let model = copy_model(name, &scratch.join(format!("size{i}")));
        edit_config(&model, edit);
        refused(
            &args(&model, &input, &output, &[]),
            needle,
            &output,
            scratch,
        );
    }

    // Special files in place of the directory's files: a read would block forever.
    for file in ["config.json", "generation_config.json", "model.safetensors"] {
        let model = copy_model("gpt2_tiny_s0", &scratch.join(format!("fifo-{file}")));
        let path = model.join(file);
        make_fifo(&path);
        refused(
            &args(&model, &input, &output, &[]),
            &format!("{} is a FIFO, not a regular file", path.display()),
            &output,
            scratch,
        );
    }
    let model = copy_model("gpt2_tiny_s0", &scratch.join("dir-config"));
    std::fs::remove_file(model.join("config.json")).unwrap();
    std::fs::create_dir(model.join("config.json")).unwrap();
    refused(
        &args(&model, &input, &output, &[]),
        "config.json is a directory",
        &output,
        scratch,
    );

    // A NaN or an infinity in a weight: exit 0 and non-finite logits before; now the tensor.
    let poisons = [
        (
            "llama_tiny_s1",
            "model.layers.1.mlp.down_proj.weight",
            f32::NAN,
            "NaN",
        ),
        (
            "llama_tiny_s1",
            "model.layers.0.self_attn.k_proj.weight",
            f32::INFINITY,
            "inf",
        ),
        (
            "gpt2_tiny_s0",
            "transformer.h.0.attn.c_attn.bias",
            f32::NEG_INFINITY,
            "-inf",
        ),
        ("gpt2_tiny_s0", "transformer.wte.weight", f32::NAN, "NaN"),
    ];
    for (i, (name, key, value, shown)) in poisons.into_iter().enumerate() {
        let model = copy_model(name, &scratch.join(format!("poison{i}")));
        poison_weight(&model, key, value);
        refused(
            &args(&model, &input, &output, &[]),
            &format!("`{key}` holds {shown} at flat index 3"),
            &output,
            scratch,
        );
    }
}

#[test]
fn id_files_that_do_not_fit_the_model_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let scratch = dir.path();
    // GPT-2 tiny: a vocabulary of 101, 64 positions.
    let model = copy_model("gpt2_tiny_s0", scratch);
    let output = scratch.join("out.safetensors");
    let input = scratch.join("ids.safetensors");
    type Case = (
        Vec<i64>,
        [usize; 2],
        Option<(Vec<i64>, [usize; 2])>,
        bool,
        &'static str,
    );
    let cases: Vec<Case> = vec![
        (
            vec![5, 101, 7],
            [1, 3],
            None,
            false,
            "token id 101 is outside the vocabulary of 101",
        ),
        (
            vec![5, -3, 7],
            [1, 3],
            None,
            false,
            "column 1 holds -3, which is no token id",
        ),
        (
            vec![5, 1 << 40, 7],
            [1, 3],
            None,
            false,
            "holds 1099511627776, which is no token id",
        ),
        (
            vec![5, 6, 7],
            [1, 3],
            None,
            true,
            "`input_ids` is F32, expected int64",
        ),
        (
            vec![5, 6, 7, 8],
            [2, 2],
            Some((vec![1, 1, 1], [1, 3])),
            false,
            "`attention_mask` has shape [1, 3], `input_ids` [2, 2]",
        ),
        (vec![], [1, 0], None, false, "an empty batch [1, 0]"),
        (vec![], [0, 3], None, false, "an empty batch [0, 3]"),
        (
            vec![5, 6, 7],
            [1, 3],
            Some((vec![1, 1, 0], [1, 3])),
            false,
            "only left padding is supported",
        ),
        (
            vec![5, 6, 7, 8, 9, 10],
            [2, 3],
            Some((vec![1, 1, 1, 0, 0, 0], [2, 3])),
            false,
            "attention_mask row 1 is all padding",
        ),
        (
            vec![5; 65],
            [1, 65],
            None,
            false,
            "65 prompt tokens + 16 new tokens exceed the model's 64 positions",
        ),
    ];
    for (ids, shape, mask, float_ids, needle) in cases {
        let mask = mask
            .as_ref()
            .map(|(values, shape)| (values.as_slice(), *shape));
        ids_file(&input, &ids, shape, mask, float_ids);
        refused(
            &args(&model, &input, &output, &[]),
            needle,
            &output,
            scratch,
        );
    }
    ids_file(&input, &[5, 6, 7], [1, 3], None, false);
    for (new_tokens, needle) in [
        (
            "62",
            "3 prompt tokens + 62 new tokens exceed the model's 64 positions",
        ),
        (
            "18446744073709551615",
            "3 prompt tokens + 18446744073709551615 new tokens exceed",
        ),
    ] {
        let extra = ["--new-tokens", new_tokens];
        refused(
            &args(&model, &input, &output, &extra),
            needle,
            &output,
            scratch,
        );
    }
    // The most the model holds is a correct run.
    let (code, stderr) = hf_lm_guarded(
        &args(&model, &input, &output, &["--new-tokens", "61"]),
        scratch,
    );
    assert_eq!(code, Some(0), "{stderr}");
    let logits = tensor_files::read(&output).unwrap()["logits"]
        .to_f32()
        .unwrap();
    assert!(logits.iter().all(|x| x.is_finite()));
}

/// `--kv-dtype` outside its four names: exit 2, an error naming the value and the choices, no
/// panic, and a file already at `--output` left as it was.
#[test]
fn an_unknown_cache_type_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let model = fixture("hf/mistral_tiny_s3");
    let (input, output) = (
        dir.path().join("ids.safetensors"),
        dir.path().join("out.safetensors"),
    );
    std::fs::write(&output, b"kept").unwrap();
    let (code, stderr) = hf_lm_guarded(
        &args(&model, &input, &output, &["--kv-dtype", "fp8"]),
        dir.path(),
    );
    assert_eq!(code, Some(2), "{stderr}");
    let first = stderr.lines().next().unwrap_or_default();
    assert!(
        first.starts_with("error: ")
            && first.contains("fp8")
            && first.contains("f16, bf16 or int8"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(std::fs::read(&output).unwrap(), b"kept");
}
