//! The demos' command-line tests, shared by `demo-ndarray` and `demo-wgpu`: each test file
//! instantiates [`cli_tests!`] with its binary. They run the real binary and read the files it
//! writes. A dev-dependency only.
#![warn(missing_docs)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use attention_backends::compare::assert_close;
use attention_core::weights::StateDict;

/// The path of a file in the workspace's `fixtures/`.
pub use test_support::fixture;

/// A fresh, empty directory for one test's files.
pub fn scratch(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("demo-cli-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs `binary` with `args` to its end.
pub fn run(binary: &str, args: &[&str]) -> Output {
    Command::new(binary)
        .args(args)
        .output()
        .expect("the demo binary runs")
}

/// What a run printed on its standard output.
pub fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Lines of stderr that are the program's (not a driver's diagnostics).
pub fn stderr_lines(output: &Output) -> Vec<String> {
    String::from_utf8_lossy(&output.stderr)
        .lines()
        .filter(|line| !line.contains("XDG_RUNTIME_DIR"))
        .map(str::to_owned)
        .collect()
}

/// Asserts success and returns stdout.
pub fn success(binary: &str, args: &[&str]) -> String {
    let output = run(binary, args);
    assert!(
        output.status.success(),
        "{args:?} failed: {:?}\n{}",
        output.status,
        stderr_lines(&output).join("\n")
    );
    stdout(&output)
}

/// Asserts exit code 2 with one `error:` line naming `needle`, and that `output_file` was not
/// written.
pub fn user_error(binary: &str, args: &[&str], needle: &str, output_file: &Path) {
    let output = run(binary, args);
    let lines = stderr_lines(&output);
    assert_eq!(output.status.code(), Some(2), "{args:?}: {lines:?}");
    assert_eq!(
        lines.len(),
        1,
        "{args:?}: one line on stderr, got {lines:?}"
    );
    assert!(
        lines[0].starts_with("error: ") && lines[0].contains(needle),
        "{args:?}: {:?} should name {needle:?}",
        lines[0]
    );
    assert!(!output_file.exists(), "{args:?}: no output file on error");
    assert_no_partial_files(output_file);
}

/// No temporary file (`.NAME.*.partial*`) is left beside `output_file`.
pub fn assert_no_partial_files(output_file: &Path) {
    let prefix = format!(".{}.", output_file.file_name().unwrap().to_string_lossy());
    let Ok(entries) = std::fs::read_dir(output_file.parent().unwrap()) else {
        return;
    };
    for entry in entries {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        assert!(
            !(name.starts_with(&prefix) && name.contains(".partial")),
            "partial file {name} left behind"
        );
    }
}

/// Every tensor of `expected_keys` in `written` matches the fixture (atol 1e-5, rtol 1e-4).
pub fn assert_matches_fixture(written: &Path, fixture_file: &Path, expected_keys: &[&str]) {
    let written = StateDict::load(written).unwrap();
    let reference = StateDict::load(fixture_file).unwrap();
    let keys: Vec<&str> = written.keys().collect();
    assert_eq!(keys.len(), expected_keys.len(), "written keys {keys:?}");
    for key in expected_keys {
        let actual = written
            .data(key)
            .unwrap_or_else(|| panic!("{key} not written"));
        assert_close(actual, reference.data(key).unwrap(), 1e-5, 1e-4, key);
    }
}

/// The gradient keys of a fixture: `grad.x` and one per parameter.
pub fn grad_keys(fixture_file: &Path) -> Vec<String> {
    StateDict::load(fixture_file)
        .unwrap()
        .keys()
        .filter(|k| k.starts_with("grad."))
        .map(str::to_owned)
        .collect()
}

/// The walkthrough prints the chapter's three steps, masks 15 entries per head, and is
/// reproducible by seed.
pub fn walkthrough_prints_the_chapters_steps(bin: &str) {
    let out = success(bin, &[]);
    for needle in [
        "input x: shape [1, 6, 4]",
        "1. attention scores",
        "2. masked scores",
        "3. attention weights",
        "output: shape [1, 6, 4]",
        "动       手       学       大       模       型",
        "head 1:",
    ] {
        assert!(out.contains(needle), "walkthrough lacks {needle:?}:\n{out}");
    }
    let masked = out
        .split("2. masked scores")
        .nth(1)
        .unwrap()
        .split("3. attention")
        .next()
        .unwrap();
    let table_cells = masked
        .lines()
        .filter(|l| l.starts_with("  "))
        .map(|l| l.matches("-inf").count())
        .sum::<usize>();
    assert_eq!(table_cells, 2 * 15, "15 masked entries per head:\n{masked}");
    assert_eq!(
        success(bin, &["walkthrough", "--seed", "7"]),
        success(bin, &["walkthrough", "--seed", "7"]),
        "--seed is reproducible"
    );
    assert_ne!(
        success(bin, &["walkthrough", "--seed", "7"]),
        out,
        "another seed, other numbers"
    );
}

/// The gradient check passes on every tensor, through a kernel's own backward pass (the CPU
/// kernel's on ndarray, the GPU kernel's on wgpu), once per case.
///
/// On wgpu it runs only when `WGPU_ALL_CASES` is set: on a software adapter (lavapipe, as in CI)
/// its five shapes compile and autotune Burn's kernels for minutes, and the GPU kernel's
/// gradients are checked against f64 in every run by `attention-core`'s `tests/layer/gpu_kernel.rs`.
pub fn gradcheck_passes(bin: &str) {
    let on_wgpu = bin.ends_with("demo-wgpu");
    if on_wgpu && !test_support::wgpu_all_cases() {
        eprintln!(
            "SKIPPED gradcheck_passes on wgpu: WGPU_ALL_CASES=1 runs it (minutes on lavapipe)"
        );
        return;
    }
    let out = success(bin, &["gradcheck"]);
    let kernel = if on_wgpu { "Gpu" } else { "Cpu" };
    assert!(
        out.contains(&format!(
            "attention core: the {kernel} kernel's forward and backward (5 calls)"
        )),
        "{out}"
    );
    assert!(
        out.lines()
            .last()
            .unwrap()
            .starts_with("gradcheck PASS: 39 tensors"),
        "{out}"
    );
    assert_eq!(out.matches(" ok\n").count(), 39, "{out}");
}

/// `apply` on GPT-2 weights (safetensors and `.pt`) gives PyTorch's output, weights and gradients.
pub fn apply_gpt2_matches_pytorch_with_gradients(bin: &str) {
    let dir = scratch("apply-gpt2");
    // The causal reference (see fixtures/make_gpt2_causal.py): Hugging Face's standalone
    // GPT2Attention, which made the shared file, applies no causal mask.
    let data = fixture("gpt2_causal_s0_b2_t7_d16_h4.safetensors");
    for weights in [
        "gpt2_s0_b2_t7_d16_h4.safetensors",
        "gpt2_s0_b2_t7_d16_h4.pt",
    ] {
        let out = dir.join(format!("{weights}.out.safetensors"));
        success(
            bin,
            &[
                "apply",
                "--weights",
                fixture(weights).to_str().unwrap(),
                "--num-heads",
                "4",
                "--input",
                data.to_str().unwrap(),
                "--cotangent",
                data.to_str().unwrap(),
                "--output",
                out.to_str().unwrap(),
            ],
        );
        let mut keys = vec!["y".to_string(), "attn_weights".to_string()];
        keys.extend(grad_keys(&data));
        assert!(keys.contains(&"grad.c_attn.weight".to_string()), "{keys:?}");
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        assert_matches_fixture(&out, &data, &keys);
    }
}

/// `apply` gives the fixtures' outputs on the explicit, fused and cached paths.
pub fn apply_paths_agree_on_every_fixture(bin: &str) {
    let dir = scratch("apply-paths");
    let cases = [
        ("book_s0_b1_t6_i4_o4_h2_nobias.safetensors", "2"),
        ("book_s0_b2_t5_i8_o8_h2_bias.safetensors", "2"),
        ("book_s1_b3_t7_i10_o12_h3_nobias.safetensors", "3"),
        ("book_s1_b1_t1_i4_o4_h1_bias.safetensors", "1"),
        ("gpt2_causal_s0_b2_t7_d16_h4.safetensors", "4"),
    ];
    for (name, heads) in cases {
        let file = fixture(name);
        let file = file.to_str().unwrap();
        for path in ["explicit", "fused", "cached"] {
            let out = dir.join(format!("{name}.{path}.safetensors"));
            success(
                bin,
                &[
                    "apply",
                    "--weights",
                    file,
                    "--num-heads",
                    heads,
                    "--input",
                    file,
                    "--output",
                    out.to_str().unwrap(),
                    "--path",
                    path,
                ],
            );
            let keys: &[&str] = if path == "explicit" {
                &["y", "attn_weights"]
            } else {
                &["y"]
            };
            assert_matches_fixture(&out, std::path::Path::new(file), keys);
        }
    }
}

/// `apply --path cached --kv-dtype T` on the GPT-2 fixture (heads of 4) and Llama's (heads of 8,
/// grouped, RoPE), each step's cache stored as `T` (each of `kv_dtypes`, those the binary's
/// kernel reads): within what the type keeps of PyTorch's outputs (relative L2), and not exactly
/// them — the cache does round. `--kv-dtype` without `--path cached` is refused.
pub fn apply_narrow_caches_track_the_fixtures(bin: &str, kv_dtypes: &[&str]) {
    let dir = scratch("apply-kv-dtype");
    let cases = [
        (
            "gpt2_causal_s0_b2_t7_d16_h4.safetensors",
            &["--num-heads", "4"][..],
        ),
        (
            "hf/llama_s0_b2_t7_d32_h4_kv2.safetensors",
            &["--num-heads", "4", "--rope-theta", "10000"][..],
        ),
    ];
    for (name, flags) in cases {
        let file = fixture(name);
        let want = StateDict::load(&file).unwrap().data("y").unwrap().clone();
        let want = want.convert::<f64>().to_vec::<f64>().unwrap();
        let bounds = [("f16", 1e-3), ("bf16", 1e-2), ("int8", 3e-2)];
        for (kv_dtype, bound) in bounds.into_iter().filter(|(t, _)| kv_dtypes.contains(t)) {
            let out = dir.join(format!("{kv_dtype}.safetensors"));
            let mut args = vec!["apply", "--weights", file.to_str().unwrap()];
            args.extend_from_slice(flags);
            args.extend([
                "--input",
                file.to_str().unwrap(),
                "--output",
                out.to_str().unwrap(),
            ]);
            args.extend(["--path", "cached", "--kv-dtype", kv_dtype]);
            success(bin, &args);
            let found = StateDict::load(&out).unwrap().data("y").unwrap().clone();
            let found = found.convert::<f64>().to_vec::<f64>().unwrap();
            let relative = test_support::relative_l2(&found, &want);
            assert!(
                relative <= bound && relative > 0.0,
                "{name}, {kv_dtype}: relative L2 {relative:e}"
            );
            std::fs::remove_file(&out).unwrap();
        }
    }
    let file = fixture(cases[0].0);
    let file = file.to_str().unwrap();
    let out = dir.join("fused.safetensors");
    let out_str = out.to_str().unwrap();
    let args = [
        "apply",
        "--weights",
        file,
        "--num-heads",
        "4",
        "--input",
        file,
        "--output",
    ];
    let mut fused = args.to_vec();
    fused.extend([out_str, "--path", "fused", "--kv-dtype", "int8"]);
    user_error(bin, &fused, "--kv-dtype int8 is for --path cached", &out);
}

/// `apply --path cached --kv-dtype T` where the binary's kernel does not read `T` (bf16 on the GPU
/// kernel): one error line naming the cache type, no file.
pub fn apply_an_unread_cache_type_is_refused(bin: &str, kv_dtype: &str) {
    let dir = scratch("apply-kv-dtype-refused");
    let file = fixture("gpt2_causal_s0_b2_t7_d16_h4.safetensors");
    let file = file.to_str().unwrap();
    let out = dir.join("y.safetensors");
    let args = [
        "apply",
        "--weights",
        file,
        "--num-heads",
        "4",
        "--input",
        file,
        "--output",
        out.to_str().unwrap(),
        "--path",
        "cached",
        "--kv-dtype",
        kv_dtype,
    ];
    let error = format!("key/value cache of {kv_dtype} is not read where this step's keys go");
    user_error(bin, &args, &error, &out);
}

/// `apply --scale --softcap` on Llama weights: the three paths give one output, and not the one
/// without the flags.
pub fn apply_score_flags_agree_on_every_path(bin: &str) {
    let dir = scratch("apply-score-flags");
    let file = fixture("hf/llama_s0_b2_t7_d32_h4_kv2.safetensors");
    let file = file.to_str().unwrap();
    let run = |path: &str, flags: &[&str]| {
        let out = dir.join(format!("{path}-{}.safetensors", flags.len()));
        let mut args = vec![
            "apply",
            "--weights",
            file,
            "--num-heads",
            "4",
            "--input",
            file,
        ];
        args.extend(["--output", out.to_str().unwrap(), "--path", path]);
        args.extend_from_slice(flags);
        success(bin, &args);
        StateDict::load(&out).unwrap().data("y").unwrap().clone()
    };
    let flags = [
        "--rope-theta",
        "10000",
        "--scale",
        "0.6",
        "--softcap",
        "0.8",
    ];
    let explicit = run("explicit", &flags);
    for path in ["fused", "cached"] {
        assert_close(&run(path, &flags), &explicit, 1e-5, 1e-4, path);
    }
    let plain = run("explicit", &flags[..2]);
    let moved = attention_backends::compare::deviation(&plain, &explicit, 0.0, 0.0, 1e-3);
    assert!(moved.max_abs > 1e-3, "the flags change nothing");
}

/// Bad `apply` input: exit 2, one `error:` line naming what was wrong, no output file.
pub fn apply_errors_are_one_line_and_write_nothing(bin: &str) {
    let dir = scratch("apply-errors");
    let out = dir.join("out.safetensors");
    let path = |file: PathBuf| file.to_str().unwrap().to_owned();
    let gpt2 = path(fixture("gpt2_s0_b2_t7_d16_h4.safetensors"));
    let book = path(fixture("book_s0_b2_t5_i8_o8_h2_bias.safetensors"));
    let pt = path(fixture("gpt2_s0_b2_t7_d16_h4.pt"));
    let llama = path(fixture("hf/llama_s0_b2_t7_d32_h4_kv2.safetensors"));
    let yarn = r#"{"rope_type":"yarn","factor":4.0}"#;
    let missing = path(dir.join("missing.safetensors"));
    let bad = path(dir.join("bad.safetensors"));
    std::fs::write(&bad, b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\":1}        ").unwrap();
    // (weights, heads, input, extra flags, what the error line names)
    let cases: [(&str, &str, &str, &[&str], &str); 15] = [
        (&missing, "4", &gpt2, &[], "No such file"),
        (&gpt2, "4", &missing, &[], "No such file"),
        (&gpt2, "4", &pt, &[], "missing key `x`"),
        (&gpt2, "3", &gpt2, &[], "divisible by `num_heads` (3)"),
        (
            &gpt2,
            "4",
            &gpt2,
            &["--context-length", "3"],
            "sequence of 7 tokens exceeds context_length = 3",
        ),
        (&gpt2, "4", &book, &[], "input has 8 features"),
        (
            &gpt2,
            "4",
            &gpt2,
            &["--cotangent", &book],
            "`r` has shape [2, 5, 8], expected the shape of y [2, 7, 16]",
        ),
        (&bad, "4", &gpt2, &[], "not a valid safetensors file"),
        (
            &llama,
            "4",
            &llama,
            &["--num-kv-heads", "4"],
            "--num-kv-heads 4 disagrees",
        ),
        (
            &llama,
            "3",
            &llama,
            &[],
            "(32) must be divisible by `num_heads` (3)",
        ),
        (
            &llama,
            "32",
            &llama,
            &["--rope-theta", "10000"],
            "rotary embeddings need an even head_dim, got 1",
        ),
        (
            &llama,
            "4",
            &llama,
            &["--rope-theta", "10000", "--rope-scaling", yarn],
            "rope_type `yarn` is not supported",
        ),
        (
            &llama,
            "4",
            &llama,
            &["--sliding-window", "0"],
            "`sliding_window` must be at least 1",
        ),
        (
            &llama,
            "4",
            &llama,
            &["--softcap", "0"],
            "`softcap` must be finite and positive, got 0",
        ),
        (
            &llama,
            "4",
            &llama,
            &["--scale=-1"],
            "`scale` must be finite and positive, got -1",
        ),
    ];
    for (weights, heads, input, extra, needle) in cases {
        let mut args = vec!["apply", "--output", out.to_str().unwrap()];
        args.extend(["--weights", weights, "--num-heads", heads, "--input", input]);
        args.extend_from_slice(extra);
        user_error(bin, &args, needle, &out);
    }
}

/// `apply` on Hugging Face's Llama, Qwen2 and Mistral attention (grouped heads, RoPE with the
/// file's `position_ids`, biases, a window) gives transformers' output, weights and gradients on
/// the three paths (`fixtures/hf/README.md`'s tolerance). On wgpu: the first case, unless
/// `WGPU_ALL_CASES` is set (each run compiles its kernels anew).
pub fn apply_hugging_face_layers_match_transformers(bin: &str) {
    let dir = scratch("apply-hf");
    let cases = [
        ("llama_s0_b2_t7_d32_h4_kv2", None),
        ("mistral_s3_b1_t9_d32_h4_kv2_w4", Some("4")),
        ("qwen2_s2_b2_t6_d32_h4_kv2_bias", None),
        ("llama_s1_b1_t5_d16_h4_kv1", None),
        ("llama_s4_b1_t6_d32_h4_kv4_offset5", None),
    ];
    let every_case = !bin.contains("wgpu") || test_support::wgpu_all_cases();
    let cases = if every_case { &cases[..] } else { &cases[..1] };
    for &(name, window) in cases {
        let file = fixture(&format!("hf/{name}.safetensors"));
        let file = file.to_str().unwrap();
        for path in ["explicit", "fused", "cached"] {
            let out = dir.join(format!("{name}.{path}.safetensors"));
            let mut args = vec![
                "apply",
                "--weights",
                file,
                "--input",
                file,
                "--cotangent",
                file,
            ];
            args.extend([
                "--num-heads",
                "4",
                "--rope-theta",
                "10000.0",
                "--path",
                path,
            ]);
            args.extend(["--output", out.to_str().unwrap()]);
            if let Some(window) = window {
                args.extend(["--sliding-window", window]);
            }
            success(bin, &args);
            let written = StateDict::load(&out).unwrap();
            let reference = StateDict::load(file).unwrap();
            let mut keys = vec!["y".to_string()];
            if path == "explicit" {
                keys.push("attn_weights".into());
            }
            keys.extend(grad_keys(Path::new(file)));
            for key in &keys {
                let want = reference.data(key).unwrap();
                let scale = want.iter::<f32>().fold(1.0f32, |m, x| m.max(x.abs()));
                let found = written
                    .data(key)
                    .unwrap_or_else(|| panic!("{name} {path}: {key} not written"));
                let what = format!("{name} {path}: {key}");
                assert_close(found, want, 1e-5 * f64::from(scale), 1e-4, &what);
            }
        }
    }
}

/// The chapter's layer on rows packed from documents (`fixtures/make_packed.py`): the input
/// file's `segment_ids` give each row's documents.
pub const PACKED: &str = "packed_book_s0_b2_t9_i8_o8_h2_bias.safetensors";

/// `apply` on rows packed from documents (the input file's `segment_ids`) gives PyTorch's
/// output, attention weights and every gradient under the causal, same-document mask, on the
/// explicit and fused paths; `--path cached`, which continues one sequence per row, is refused
/// naming the tensor.
pub fn apply_packed_documents_match_pytorch(bin: &str) {
    let dir = scratch("apply-packed");
    let file = fixture(PACKED);
    let file = file.to_str().unwrap();
    let apply_args = |path: &str, out: &Path| -> Vec<String> {
        [
            "apply",
            "--weights",
            file,
            "--num-heads",
            "2",
            "--input",
            file,
            "--cotangent",
            file,
            "--path",
            path,
            "--output",
            out.to_str().unwrap(),
        ]
        .map(str::to_owned)
        .to_vec()
    };
    for path in ["explicit", "fused"] {
        let out = dir.join(format!("{path}.safetensors"));
        let args = apply_args(path, &out);
        success(bin, &args.iter().map(String::as_str).collect::<Vec<_>>());
        let mut keys = vec!["y".to_string()];
        if path == "explicit" {
            keys.push("attn_weights".into());
        }
        keys.extend(grad_keys(Path::new(file)));
        assert!(
            keys.contains(&"grad.query_layer.bias".to_string()),
            "{keys:?}"
        );
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        assert_matches_fixture(&out, Path::new(file), &keys);
    }
    let out = dir.join("cached.safetensors");
    let args = apply_args("cached", &out);
    user_error(
        bin,
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
        "`segment_ids` cannot go with --path cached: document boundaries are for whole",
        &out,
    );
}

/// `heatmap` draws one panel per head and a scale, for the walkthrough and for given weights.
pub fn heatmap_writes_a_png(bin: &str) {
    let dir = scratch("heatmap");
    let walkthrough = dir.join("walkthrough.png");
    success(bin, &["heatmap", "--output", walkthrough.to_str().unwrap()]);
    let gpt2 = fixture("gpt2_s0_b2_t7_d16_h4.safetensors");
    let given = dir.join("given.png");
    success(
        bin,
        &[
            "heatmap",
            "--weights",
            gpt2.to_str().unwrap(),
            "--input",
            gpt2.to_str().unwrap(),
            "--num-heads",
            "4",
            "--output",
            given.to_str().unwrap(),
        ],
    );
    for (png, width) in [(walkthrough, 2 * 440 + 110), (given, 4 * 440 + 110)] {
        let bytes = std::fs::read(&png).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "{png:?} is a PNG");
        let png_width = u32::from_be_bytes(bytes[16..20].try_into().unwrap());
        assert_eq!(png_width, width, "{png:?}: one panel per head and a scale");
    }
}

/// Instantiates the command-line tests for one demo binary: one `#[test]` per case above.
/// `$ready` is evaluated first (with the test's name in scope as `test`) and skips the test when
/// false.
#[macro_export]
macro_rules! cli_tests {
    ($binary:expr, |$test:ident| $ready:expr) => {
        $crate::cli_tests!(@each $binary, |$test| $ready;
            walkthrough_prints_the_chapters_steps,
            gradcheck_passes,
            apply_gpt2_matches_pytorch_with_gradients,
            apply_paths_agree_on_every_fixture,
            apply_errors_are_one_line_and_write_nothing,
            apply_score_flags_agree_on_every_path,
            apply_hugging_face_layers_match_transformers,
            apply_packed_documents_match_pytorch,
            heatmap_writes_a_png);
    };
    (@each $binary:expr, |$test:ident| $ready:expr; $($case:ident),+) => {
        #[allow(unused_imports)]
        use $crate::*;

        const BIN: &str = $binary;

        $(
            #[test]
            fn $case() {
                let $test = stringify!($case);
                if $ready {
                    $crate::$case(BIN);
                }
            }
        )+
    };
}
