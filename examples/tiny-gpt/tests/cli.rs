//! tiny-gpt as a careless user runs it: bad settings and tampered checkpoints are one-line
//! errors (exit 2) before anything is allocated, a diverging run leaves the last checkpoint
//! alone, and a small run trains, saves and generates.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_tiny-gpt");
/// A model small enough to train a few steps in a test.
const SMALL: [&str; 12] = [
    "--steps",
    "3",
    "--batch",
    "2",
    "--context",
    "8",
    "--d-model",
    "8",
    "--heads",
    "2",
    "--layers",
    "1",
];

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tiny-gpt-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn run(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().unwrap()
}

fn stderr_lines(output: &Output) -> Vec<String> {
    String::from_utf8_lossy(&output.stderr)
        .lines()
        .map(str::to_owned)
        .collect()
}

fn refused(args: &[&str], needle: &str) {
    let output = run(args);
    let lines = stderr_lines(&output);
    assert_eq!(output.status.code(), Some(2), "{args:?}: {lines:?}");
    assert_eq!(lines.len(), 1, "{args:?}: one line, got {lines:?}");
    assert!(
        lines[0].starts_with("error: ") && lines[0].contains(needle),
        "{args:?}: {lines:?} should say {needle:?}"
    );
}

/// How long one refused run may take before it counts as a hang.
const HANG_GUARD: Duration = Duration::from_secs(60);

/// [`refused`] under a hang guard (a FIFO read would block forever): a run still going after
/// [`HANG_GUARD`] is killed and the test fails. Its stderr goes to a file in `scratch`.
fn refused_guarded(args: &[&str], needle: &str, scratch: &Path) {
    let stderr_path = scratch.join("stderr.txt");
    let stderr = std::fs::File::create(&stderr_path).unwrap();
    let mut child = Command::new(BIN)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .unwrap();
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > HANG_GUARD {
            child.kill().unwrap();
            child.wait().unwrap();
            panic!("{args:?}: tiny-gpt hung for {HANG_GUARD:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stderr = std::fs::read_to_string(&stderr_path).unwrap();
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(status.code(), Some(2), "{args:?}: {lines:?}");
    assert_eq!(lines.len(), 1, "{args:?}: one line, got {lines:?}");
    assert!(
        lines[0].starts_with("error: ") && lines[0].contains(needle),
        "{args:?}: {lines:?} should say {needle:?}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// `SMALL` with `flag` set to `value` and `--out dir`.
fn small_with<'a>(flag: &'a str, value: &'a str, out: &'a str) -> Vec<&'a str> {
    let mut args = vec!["train", "--out", out];
    let mut rest = SMALL.to_vec();
    if let Some(i) = rest.iter().position(|a| *a == flag) {
        rest[i + 1] = value;
    } else {
        rest.extend([flag, value]);
    }
    args.extend(rest);
    args
}

fn s(path: &Path) -> &str {
    path.to_str().unwrap()
}

#[test]
fn settings_that_cannot_train_are_refused_up_front() {
    let dir = scratch("settings");
    let out = dir.join("ckpt");
    for (flag, value, needle) in [
        ("--batch", "0", "--batch 0: must be at least 1"),
        ("--heads", "0", "--heads 0: must be at least 1"),
        ("--heads", "3", "--heads 3: must divide --d-model 8"),
        ("--d-model", "0", "--d-model 0: must be at least 1"),
        ("--context", "0", "--context 0: must be at least 1"),
        (
            "--context",
            "1000000",
            "longer than the validation text allows",
        ),
        (
            "--context",
            "1000000000000",
            "longer than the validation text allows",
        ),
        ("--layers", "1000000", "more than tiny-gpt trains"),
        ("--learning-rate", "NaN", "must be a finite number above 0"),
        ("--learning-rate", "inf", "must be a finite number above 0"),
        (
            "--learning-rate",
            "-0.001",
            "must be a finite number above 0",
        ),
        ("--learning-rate", "0", "must be a finite number above 0"),
    ] {
        refused(&small_with(flag, value, s(&out)), needle);
        assert!(!out.exists(), "{flag} {value}: nothing written");
    }
    let file = dir.join("a-file");
    std::fs::write(&file, "mine").unwrap();
    refused(&small_with("--seed", "0", s(&file)), "is a file");
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "mine");
}

#[test]
fn documents_packed_or_one_per_row_train_and_report_tokens_per_second() {
    let dir = scratch("documents");
    for (flag, layout) in [
        ("--pack", "packed in order"),
        ("--one-document-per-row", "one per row, right-padded"),
    ] {
        let out = dir.join(flag.trim_start_matches('-'));
        let mut args = small_with("--seed", "5", s(&out));
        args.push(flag);
        let trained = run(&args);
        assert!(
            trained.status.success(),
            "{flag}: {:?}",
            stderr_lines(&trained)
        );
        let stdout = String::from_utf8_lossy(&trained.stdout);
        for needle in [
            layout,
            "scores each document on its own",
            "tokens/s",
            "final: val_loss=",
        ] {
            assert!(stdout.contains(needle), "{flag}: {needle:?} in {stdout}");
        }
    }
    let out = dir.join("refused");
    for (flag, value, needle) in [
        (
            "--min-document",
            "0",
            "--min-document 0: must be at least 1",
        ),
        (
            "--max-document",
            "2",
            "--max-document 2: must be at least --min-document 4",
        ),
    ] {
        let mut args = small_with(flag, value, s(&out));
        args.push("--pack");
        refused(&args, needle);
        assert!(!out.exists(), "{flag} {value}: nothing written");
    }
}

#[test]
fn training_then_generating_and_what_divergence_leaves_behind() {
    let dir = scratch("train");
    let out = dir.join("ckpt");
    let trained = run(&small_with("--seed", "1", s(&out)));
    assert!(trained.status.success(), "{:?}", stderr_lines(&trained));
    assert!(String::from_utf8_lossy(&trained.stdout).contains("final: val_loss="));
    for file in ["config.json", "model.safetensors", "loss.png"] {
        assert!(out.join(file).is_file(), "{file}");
    }
    let generated = run(&[
        "generate",
        "--checkpoint",
        s(&out),
        "--prompt",
        "the ",
        "--tokens",
        "3",
    ]);
    assert!(generated.status.success(), "{:?}", stderr_lines(&generated));

    // A learning rate that overflows the weights: the run stops, the checkpoint stays.
    let before: Vec<Vec<u8>> = ["config.json", "model.safetensors"]
        .iter()
        .map(|f| std::fs::read(out.join(f)).unwrap())
        .collect();
    refused(
        &small_with("--learning-rate", "1e38", s(&out)),
        "training diverged",
    );
    let after: Vec<Vec<u8>> = ["config.json", "model.safetensors"]
        .iter()
        .map(|f| std::fs::read(out.join(f)).unwrap())
        .collect();
    assert_eq!(before, after, "the last good checkpoint is untouched");

    // A directory holding anything else is never replaced.
    std::fs::write(out.join("notes.txt"), "mine").unwrap();
    refused(&small_with("--seed", "2", s(&out)), "notes.txt");
    assert_eq!(
        std::fs::read_to_string(out.join("notes.txt")).unwrap(),
        "mine"
    );
}

#[test]
fn tampered_checkpoints_name_the_field_that_disagrees() {
    let dir = scratch("tampered");
    let out = dir.join("ckpt");
    assert!(run(&small_with("--seed", "3", s(&out))).status.success());
    let config_path = out.join("config.json");
    let original = std::fs::read_to_string(&config_path).unwrap();
    for (field, value, needle) in [
        ("num_heads", "0", "`num_heads` must be at least 1"),
        ("num_layers", "4", "holds"),
        ("d_model", "1000000000", "token_embedding.weight"),
        (
            "context_length",
            "1000000000000",
            "position_embedding.weight",
        ),
    ] {
        let mut json: serde_json::Value = serde_json::from_str(&original).unwrap();
        json[field] = value.parse::<serde_json::Value>().unwrap();
        std::fs::write(&config_path, json.to_string()).unwrap();
        refused(
            &["generate", "--checkpoint", s(&out), "--prompt", "a"],
            needle,
        );
    }
    std::fs::write(&config_path, "{\"vocab_size\": ").unwrap();
    refused(
        &["generate", "--checkpoint", s(&out), "--prompt", "a"],
        "config.json: EOF while parsing",
    );
    refused(
        &["generate", "--checkpoint", s(&dir), "--prompt", "a"],
        "not a checkpoint (no config.json)",
    );
}

#[test]
fn checkpoint_files_that_are_not_regular_files_are_refused_without_hanging() {
    let dir = scratch("special-files");
    let out = dir.join("ckpt");
    let trained = run(&small_with("--seed", "4", s(&out)));
    assert!(trained.status.success(), "{:?}", stderr_lines(&trained));
    let generate = ["generate", "--checkpoint", s(&out), "--prompt", "a"];
    for file in ["config.json", "model.safetensors"] {
        let path = out.join(file);
        let original = std::fs::read(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        for kind in ["a FIFO", "a directory", "a device"] {
            match kind {
                "a FIFO" => {
                    let status = Command::new("mkfifo").arg(&path).status().unwrap();
                    assert!(status.success(), "mkfifo {}", path.display());
                }
                "a directory" => std::fs::create_dir(&path).unwrap(),
                _ => std::os::unix::fs::symlink("/dev/null", &path).unwrap(),
            }
            refused_guarded(
                &generate,
                &format!("{} is {kind}, not a regular file", path.display()),
                &dir,
            );
            if kind == "a directory" {
                std::fs::remove_dir(&path).unwrap();
            } else {
                std::fs::remove_file(&path).unwrap();
            }
        }
        std::fs::write(&path, original).unwrap();
    }
    // Restored, the checkpoint generates again: the refusals were the special files'.
    let generated = run(&generate);
    assert!(generated.status.success(), "{:?}", stderr_lines(&generated));
}

/// The last line of a successful run: `loss=<mean>`.
fn scored(args: &[&str]) -> f64 {
    let output = run(args);
    assert!(
        output.status.success(),
        "{args:?}: {:?}",
        stderr_lines(&output)
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    let last = stdout.lines().last().unwrap_or_default();
    last.strip_prefix("loss=")
        .and_then(|loss| loss.parse().ok())
        .unwrap_or_else(|| panic!("{args:?}: last line {last:?}"))
}

/// `score` on a checkpoint trained here (to about half the unigram loss, so that attention
/// matters): through the f32 cache, token by token, it gives the loss training's validation gave
/// with whole windows (the same 64 windows: 8 batches of 8); through caches in fewer bytes it
/// loses at most what each type promises (int8 0.5 %, f16 0.05 %, bf16 0.5 %), and int8 does
/// round. A checkpoint without its corpus record and `--windows 0` are one-line errors.
#[test]
fn scores_through_narrow_caches_track_the_f32_cache() {
    let dir = scratch("score");
    let out = dir.join("ckpt");
    let train = [
        "train",
        "--steps",
        "300",
        "--batch",
        "8",
        "--context",
        "32",
        "--d-model",
        "32",
        "--heads",
        "2",
        "--layers",
        "2",
        "--seed",
        "3",
        "--out",
        s(&out),
    ];
    let trained = run(&train);
    assert!(trained.status.success(), "{:?}", stderr_lines(&trained));
    let stdout = String::from_utf8_lossy(&trained.stdout);
    let valid: f64 = stdout
        .split("val_loss=")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|loss| loss.parse().ok())
        .unwrap_or_else(|| panic!("no val_loss in {stdout}"));
    let score = |kv_dtype: &str| {
        scored(&[
            "score",
            "--checkpoint",
            s(&out),
            "--kv-dtype",
            kv_dtype,
            "--windows",
            "64",
        ])
    };
    let f32 = score("f32");
    // Training prints its loss to 4 decimals.
    assert!(
        (f32 - valid).abs() <= 1e-4,
        "scored {f32} through the cache, validation {valid}"
    );
    for (kv_dtype, bound) in [("int8", 5e-3), ("f16", 5e-4), ("bf16", 5e-3)] {
        let loss = score(kv_dtype);
        let relative = (loss - f32).abs() / f32;
        assert!(
            relative <= bound,
            "{kv_dtype}: loss {loss} against f32's {f32} ({relative:e})"
        );
        if kv_dtype == "int8" {
            assert_ne!(loss, f32, "int8 rounds the cache");
        }
    }
    refused(
        &["score", "--checkpoint", s(&out), "--windows", "0"],
        "--windows 0",
    );
    std::fs::remove_file(out.join("corpus.json")).unwrap();
    refused(
        &["score", "--checkpoint", s(&out)],
        "corpus.json: not found",
    );
}
