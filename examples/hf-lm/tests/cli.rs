//! `hf-lm` from the command line: transformers' greedy tokens and logits from a checkpoint
//! directory; bad input is one `error:` line, exit code 2 and no output file.

use std::path::Path;
use std::process::{Command, Output};

use tensor_files::{Dtype, RawTensor};
use test_support::fixture;

fn hf_lm(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_hf-lm"))
        .args(args)
        .output()
        .expect("hf-lm runs")
}

fn path(path: &Path) -> &str {
    path.to_str().expect("UTF-8 path")
}

fn values(raw: &RawTensor) -> Vec<f64> {
    match raw.to_i64() {
        Some(ints) => ints.into_iter().map(|v| v as f64).collect(),
        None => raw
            .to_f32()
            .expect("int or f32")
            .into_iter()
            .map(f64::from)
            .collect(),
    }
}

/// The fixture's own file serves as the input (it holds `input_ids` and `attention_mask`
/// beside the expected outputs, which `hf-lm` ignores).
#[test]
fn generates_what_transformers_generated() {
    let model = fixture("hf/mistral_tiny_s3");
    let expected_path = model.join("expected.safetensors");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.safetensors");
    let output = hf_lm(&[
        "--model",
        path(&model),
        "--input",
        path(&expected_path),
        "--new-tokens",
        "12",
        "--output",
        path(&out),
        "--backend",
        "ndarray",
    ]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let got = tensor_files::read(&out).unwrap();
    let expected = tensor_files::read(&expected_path).unwrap();
    assert_eq!(got["generated"].shape, expected["generated"].shape);
    assert_eq!(values(&got["generated"]), values(&expected["generated"]));
    let (logits, want) = (
        values(&got["logits"]),
        values(&expected["logits_with_position_ids"]),
    );
    let mask = values(&expected["attention_mask"]);
    let vocab = got["logits"].shape[2];
    let scale = want.iter().fold(1f64, |m, w| m.max(w.abs()));
    for (i, (g, w)) in logits.iter().zip(&want).enumerate() {
        if mask[i / vocab] == 1.0 {
            assert!((g - w).abs() <= 1e-4 * scale, "logit {i}: {g} vs {w}");
        }
    }
}

#[test]
fn bad_input_is_one_error_line_and_no_output() {
    let model = fixture("hf/gpt2_tiny_s0");
    let dir = tempfile::tempdir().unwrap();
    let ids_only = dir.path().join("weights.safetensors");
    std::fs::copy(model.join("model.safetensors"), &ids_only).unwrap();
    let input = dir.path().join("ids.safetensors");
    let ids: Vec<u8> = [1i64, 2, 3].iter().flat_map(|v| v.to_le_bytes()).collect();
    let tensors = tensor_files::Tensors::from([(
        "input_ids".to_string(),
        RawTensor::new(Dtype::I64, vec![1, 3], ids).unwrap(),
    )]);
    std::fs::write(
        &input,
        tensor_files::safetensors::serialize(&tensors).unwrap(),
    )
    .unwrap();
    let before = std::fs::read(&input).unwrap();
    let out = dir.path().join("out.safetensors");
    // `--model M --input I --output O`, and what the one error line must name.
    fn run<'a>(model: &'a Path, input: &'a Path, output: &'a Path) -> Vec<&'a str> {
        vec![
            "--model",
            path(model),
            "--input",
            path(input),
            "--output",
            path(output),
        ]
    }
    let too_many_tokens = [run(&model, &input, &out), vec!["--new-tokens", "62"]].concat();
    let cases = [
        (run(&model, &input, &input), "--output"),
        (run(dir.path(), &input, &out), "config.json"),
        (run(&model, &ids_only, &out), "input_ids"),
        (too_many_tokens, "exceed the model's 64 positions"),
    ];
    for (args, expected) in cases {
        let output = hf_lm(&args);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert!(
            stderr.starts_with("error:") && stderr.contains(expected),
            "{args:?}: {stderr}"
        );
        assert!(!out.exists());
    }
    assert_eq!(
        std::fs::read(&input).unwrap(),
        before,
        "the input is untouched"
    );
}
