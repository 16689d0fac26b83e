//! `hf-lm --prompt`, text in and out through a checkpoint's `tokenizer.json` (the `tokenizer`
//! feature): the continuation transformers' greedy `generate` and `decode` give, character for
//! character. Run with `cargo test -p hf-lm --features tokenizer`.
#![cfg(feature = "tokenizer")]

use std::path::Path;
use std::process::Command;

use test_support::fixture;

/// `llama_tiny_s1` with the tokenizer `fixtures/make_tokenizer.py` trained for it.
fn model_with_tokenizer(dir: &Path) {
    let model = fixture("hf/llama_tiny_s1");
    for file in ["config.json", "generation_config.json", "model.safetensors"] {
        std::fs::copy(model.join(file), dir.join(file)).unwrap();
    }
    std::fs::copy(
        fixture("tokenizer/llama_tiny_s1.json"),
        dir.join("tokenizer.json"),
    )
    .unwrap();
}

fn continuation(model: &Path, prompt: &str, backend: &str) -> String {
    let output = Command::new(env!("CARGO_BIN_EXE_hf-lm"))
        .args(["--model", model.to_str().unwrap(), "--prompt", prompt])
        .args(["--new-tokens", "10", "--backend", backend])
        .output()
        .expect("hf-lm runs");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap()
}

#[test]
fn prompts_continue_as_in_transformers() {
    let dir = tempfile::tempdir().unwrap();
    model_with_tokenizer(dir.path());
    // From `make_tokenizer.py`: transformers 5.24, greedy, 10 new tokens.
    let expected = [
        ("the cat sat on", "the cat sat on youoouccccccc"),
        ("hello world", "hello worldyouo iso qucatoo rot you"),
    ];
    for backend in ["ndarray", "flex"] {
        for (prompt, text) in expected {
            assert_eq!(
                continuation(dir.path(), prompt, backend),
                format!("{text}\n"),
                "{backend}: {prompt:?}"
            );
        }
    }
}

#[test]
fn a_directory_without_a_tokenizer_is_one_error_line() {
    let output = Command::new(env!("CARGO_BIN_EXE_hf-lm"))
        .args(["--model", fixture("hf/llama_tiny_s1").to_str().unwrap()])
        .args(["--prompt", "hello"])
        .output()
        .expect("hf-lm runs");
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.starts_with("error:")
            && stderr.contains("tokenizer.json")
            && stderr.lines().count() == 1,
        "{stderr}"
    );
}
