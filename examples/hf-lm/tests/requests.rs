//! `hf-lm --requests`: requests run together give transformers' greedy tokens, each result a JSON
//! line; a bad line is an error line for that request alone, and the exit code says so.

use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;
use test_support::fixture;

fn hf_lm(model: &Path, requests: &Path, backend: &str) -> Output {
    hf_lm_with(model, requests, backend, &[])
}

fn hf_lm_with(model: &Path, requests: &Path, backend: &str, extra: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_hf-lm"))
        .args(extra)
        .args([
            "--model",
            model.to_str().unwrap(),
            "--requests",
            requests.to_str().unwrap(),
            "--backend",
            backend,
            // Pages of 32 positions, a pool of a few: the fixture's model is tiny.
            "--page-size",
            "32",
            "--kv-mib",
            "1",
            "--step-tokens",
            "5",
            "--max-running",
            "4",
        ])
        .output()
        .expect("hf-lm runs")
}

fn ints(tensors: &tensor_files::Tensors, key: &str) -> (Vec<i64>, Vec<usize>) {
    (tensors[key].to_i64().unwrap(), tensors[key].shape.clone())
}

fn results(output: &Output) -> Vec<Value> {
    String::from_utf8(output.stdout.clone())
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect()
}

fn by_id<'a>(results: &'a [Value], id: &Value) -> &'a Value {
    let found: Vec<&Value> = results.iter().filter(|r| &r["id"] == id).collect();
    assert_eq!(found.len(), 1, "one result for {id}: {results:?}");
    found[0]
}

/// Mistral's tiny fixture (a sliding window of 4): its two prompts as requests, fed 5 tokens a
/// step beside each other, give transformers' 12 greedy tokens each; the bad lines around them
/// fail alone.
#[test]
fn requests_give_transformers_tokens_and_bad_lines_fail_alone() {
    let model = fixture("hf/mistral_tiny_s3");
    let expected = tensor_files::read(&model.join("expected.safetensors")).unwrap();
    let (ids, shape) = ints(&expected, "input_ids");
    let (generated, generated_shape) = ints(&expected, "generated");
    let (t, columns) = (shape[1], generated_shape[1]);
    let row0: Vec<i64> = ids[..t].to_vec();
    // Row 1 has 2 pads on the left.
    let row1: Vec<i64> = ids[t + 2..2 * t].to_vec();
    let want0: Vec<i64> = generated[t..columns].to_vec();
    let want1: Vec<i64> = generated[columns + t..2 * columns].to_vec();

    let lines = [
        format!(r#"{{"id": "a", "ids": {row0:?}, "max_new_tokens": 12, "stop_ids": []}}"#),
        // No id (its line number, 1), the model's end-of-sequence ids as stop ids.
        format!(r#"{{"ids": {row1:?}, "max_new_tokens": 12}}"#),
        r#"{"id": "empty", "ids": [], "max_new_tokens": 3}"#.into(),
        r#"{"id": "both", "ids": [1], "prompt": "hi", "max_new_tokens": 3}"#.into(),
        r#"{"id": "neither", "max_new_tokens": 3}"#.into(),
        r#"{"id": "vocab", "ids": [1, 109], "max_new_tokens": 3}"#.into(),
        r#"{"id": "zero", "ids": [1], "max_new_tokens": 0}"#.into(),
        r#"{"id": "past", "ids": [1, 2], "max_new_tokens": 63}"#.into(),
        r#"{"id": "hot", "ids": [1], "max_new_tokens": 3, "temperature": -1}"#.into(),
        r#"{"id": "top_p", "ids": [1], "max_new_tokens": 3, "temperature": 1, "top_p": 0}"#.into(),
        r#"{"id": "top_k", "ids": [1], "max_new_tokens": 3, "temperature": 1, "top_k": 0}"#.into(),
        r#"{"id": "stop", "ids": [1], "max_new_tokens": 3, "stop_ids": [500]}"#.into(),
        r#"{"id": "a", "ids": [1], "max_new_tokens": 3}"#.into(),
        r#"{"id": "json", "ids": [1"#.into(),
    ];
    let mut file = lines.join("\n").into_bytes();
    file.extend(b"\n\xff\xfe\n");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("requests.jsonl");
    std::fs::write(&path, &file).unwrap();

    for backend in ["ndarray", "flex"] {
        let output = hf_lm(&model, &path, backend);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{backend}: {stderr}");
        let results = results(&output);
        assert_eq!(results.len(), 15, "{backend}: one line per request");
        let successes: Vec<&Value> = results.iter().filter(|r| r["finish"] != "error").collect();
        assert_eq!(successes.len(), 2, "{backend}: {results:?}");
        let a = by_id(
            &successes.iter().map(|&r| r.clone()).collect::<Vec<_>>(),
            &"a".into(),
        )
        .clone();
        assert_eq!(a["finish"], "length");
        assert_eq!(
            a["generated"],
            Value::from(want0.clone()),
            "{backend}: row 0"
        );
        assert!(a["ttft_s"].as_f64().unwrap() > 0.0);
        assert!(a["tokens_per_s"].as_f64().unwrap() > 0.0);
        let b = by_id(&results, &Value::from(1));
        assert_eq!(b["finish"], "length");
        assert_eq!(
            b["generated"],
            Value::from(want1.clone()),
            "{backend}: row 1"
        );
        let errors = [
            ("empty", "prompt is empty"),
            ("both", "both `ids` and `prompt`"),
            ("neither", "neither `ids` nor `prompt`"),
            ("vocab", "outside the vocabulary of 109"),
            ("zero", "max_new_tokens must be at least 1"),
            ("past", "passes the context of 64"),
            ("hot", "temperature -1"),
            ("top_p", "top_p 0"),
            ("top_k", "top_k 0"),
            ("stop", "stop id 500"),
        ];
        for (id, message) in errors {
            let result = by_id(&results, &Value::from(id));
            assert_eq!(result["finish"], "error", "{id}");
            let found = result["message"].as_str().unwrap();
            assert!(found.contains(message), "{id}: {found}");
        }
        let line = |number: usize| {
            let found: Vec<&Value> = results.iter().filter(|r| r["line"] == number).collect();
            assert_eq!(found.len(), 1, "line {number}");
            found[0].clone()
        };
        // The second "a" fails, not the first; broken lines are named by their numbers.
        let duplicate = line(12);
        assert_eq!(duplicate["id"], "a");
        assert!(
            duplicate["message"]
                .as_str()
                .unwrap()
                .contains("second request with id")
        );
        let json = by_id(&results, &Value::from(13));
        assert!(json["message"].as_str().unwrap().contains("not a request"));
        let utf8 = by_id(&results, &Value::from(14));
        assert!(utf8["message"].as_str().unwrap().contains("not UTF-8"));
    }

    // A requests file that is not there: one error line, exit code 2, nothing on stdout.
    let output = hf_lm(&model, &dir.path().join("missing.jsonl"), "ndarray");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.starts_with("error:") && stderr.lines().count() == 1,
        "{stderr}"
    );
    assert!(stderr.contains("missing.jsonl"), "{stderr}");
    assert!(output.stdout.is_empty());

    // Only good lines: exit code 0.
    std::fs::write(&path, format!("{}\n", lines[0])).unwrap();
    let output = hf_lm(&model, &path, "ndarray");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(results(&output).len(), 1);
}

/// `--kv-dtype`: two requests served over pages in int8 and in f16 on the CPU backends and on
/// wgpu (both kernels read those in place), each making its 12 tokens; bf16, which the GPU kernel
/// does not read, is refused on wgpu in one error line that names the cache type.
#[test]
fn narrow_caches_serve_requests_on_both_kernels() {
    let model = fixture("hf/mistral_tiny_s3");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("requests.jsonl");
    let lines = [
        r#"{"id": "a", "ids": [5, 17, 9, 4, 30, 2], "max_new_tokens": 12, "stop_ids": []}"#,
        r#"{"id": "b", "ids": [12, 3], "max_new_tokens": 12, "stop_ids": []}"#,
    ];
    std::fs::write(&path, lines.join("\n")).unwrap();
    let wgpu = test_support::wgpu_device_for_test("narrow_caches_serve_requests_on_both_kernels")
        .is_some();
    let backends = ["ndarray", "flex", "wgpu"];
    let backends = &backends[..if wgpu { 3 } else { 2 }];
    for kv_dtype in ["int8", "f16"] {
        for &backend in backends {
            let output = hf_lm_with(&model, &path, backend, &["--kv-dtype", kv_dtype]);
            let stderr = String::from_utf8_lossy(&output.stderr);
            assert_eq!(
                output.status.code(),
                Some(0),
                "{kv_dtype}, {backend}: {stderr}"
            );
            let results = results(&output);
            assert_eq!(results.len(), 2, "{kv_dtype}, {backend}: {results:?}");
            for result in &results {
                assert_eq!(result["finish"], "length", "{result}");
                assert_eq!(
                    result["generated"].as_array().unwrap().len(),
                    12,
                    "{result}"
                );
            }
        }
    }
    if wgpu {
        let output = hf_lm_with(&model, &path, "wgpu", &["--kv-dtype", "bf16"]);
        let stderr = String::from_utf8_lossy(&output.stderr);
        let lines: Vec<&str> = stderr.lines().filter(|line| !line.is_empty()).collect();
        assert_eq!(output.status.code(), Some(2), "{stderr}");
        assert_eq!(lines.len(), 1, "{stderr}");
        assert!(
            lines[0].starts_with("error: ") && lines[0].contains("key/value cache of bf16"),
            "{stderr}"
        );
        assert!(output.stdout.is_empty());
    }
}
