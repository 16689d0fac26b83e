//! The JSON runner at the chapter's shape, for every backend × implementation × mode: it runs,
//! its line parses, times are positive — or the combination is refused in one clear line.

use std::process::Command;

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_attention-bench");

#[test]
fn every_combination_at_the_chapters_shape() {
    let wgpu =
        test_support::wgpu_device_for_test("every_combination_at_the_chapters_shape (wgpu part)")
            .is_some();
    let backends: &[&str] = if wgpu {
        &["ndarray", "flex", "wgpu"]
    } else {
        &["ndarray", "flex"]
    };
    let every_case = test_support::wgpu_all_cases();
    for backend in backends {
        for implementation in ["explicit", "fused", "burn-nn"] {
            for mode in ["fwd", "fwdbwd", "decode"] {
                // Each wgpu process compiles its kernels anew (seconds on a software adapter):
                // there, our two paths' forward and the fused decode unless asked for all.
                let wgpu_case = matches!(
                    (implementation, mode),
                    ("explicit" | "fused", "fwd") | ("fused", "decode")
                );
                if *backend == "wgpu" && !wgpu_case && !every_case {
                    continue;
                }
                let output = Command::new(BIN)
                    .args([
                        "--backend",
                        backend,
                        "--impl",
                        implementation,
                        "--mode",
                        mode,
                        "--shape",
                        "1x6x4x2",
                        "--repeats",
                        "3",
                        "--warmup",
                        "1",
                    ])
                    .output()
                    .unwrap();
                let stdout = String::from_utf8_lossy(&output.stdout);
                let what = format!("{backend}/{implementation}/{mode}");
                if implementation == "burn-nn" && mode == "decode" {
                    let stderr = String::from_utf8_lossy(&output.stderr);
                    assert_eq!(output.status.code(), Some(2), "{what}");
                    assert!(
                        stderr
                            .lines()
                            .any(|l| l.starts_with("error: burn-nn has no KV-cache decode")),
                        "{what}: {stderr}"
                    );
                    continue;
                }
                assert!(
                    output.status.success(),
                    "{what}: {}",
                    String::from_utf8_lossy(&output.stderr)
                );
                let lines: Vec<&str> = stdout.lines().collect();
                assert_eq!(lines.len(), 1, "{what}: {stdout}");
                let record: Value = serde_json::from_str(lines[0])
                    .unwrap_or_else(|e| panic!("{what}: {e}: {}", lines[0]));
                assert_eq!(record["backend"], *backend, "{what}");
                assert_eq!(record["impl"], implementation, "{what}");
                assert_eq!(record["mode"], mode, "{what}");
                assert_eq!(record["shape"], "1x6x4x2", "{what}");
                assert_eq!(record["repeats"], 3, "{what}");
                let number = |key: &str| {
                    let value = record[key]
                        .as_f64()
                        .unwrap_or_else(|| panic!("{what}: {key} in {record}"));
                    assert!(value > 0.0 && value.is_finite(), "{what}: {key} = {value}");
                    value
                };
                for key in ["gflops", "peak_rss_mib"] {
                    number(key);
                }
                let (min, median, max) = (number("min_ms"), number("median_ms"), number("max_ms"));
                assert!(min <= median && median <= max, "{what}: {record}");
            }
        }
    }
}

#[test]
fn a_bad_shape_is_one_clear_error() {
    let output = Command::new(BIN)
        .args([
            "--backend",
            "ndarray",
            "--impl",
            "fused",
            "--mode",
            "fwd",
            "--shape",
            "1x6x5x2",
        ])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("2 heads do not divide 5"));
}

/// Shapes whose buffers could never fit are refused in one line before anything is allocated
/// (they aborted on the allocation before).
#[test]
fn shapes_too_large_for_memory_are_refused() {
    for (implementation, mode, shape) in [
        ("fused", "fwd", "1x100000000000x768x12"),
        ("explicit", "fwd", "1x1000000x64x1"),
        ("burn-nn", "fwdbwd", "18446744073709551615x2x2x1"),
        ("fused", "decode", "64x1000000000x768x12"),
    ] {
        let output = Command::new(BIN)
            .args([
                "--backend",
                "ndarray",
                "--impl",
                implementation,
                "--mode",
                mode,
            ])
            .args(["--shape", shape, "--repeats", "1"])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        let what = format!("{implementation}/{mode}/{shape}");
        assert_eq!(output.status.code(), Some(2), "{what}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{what}: {stderr}");
        assert!(stderr.contains("GiB available"), "{what}: {stderr}");
    }
}

/// `--threads N` sizes the pools (the line reports rayon's pool as the process found it); 0 is
/// refused.
#[test]
fn threads_are_set_and_reported() {
    let run = |threads: &str| {
        Command::new(BIN)
            .args(["--backend", "ndarray", "--impl", "fused", "--mode", "fwd"])
            .args(["--shape", "1x6x4x2", "--repeats", "1", "--threads", threads])
            .env_remove("RAYON_NUM_THREADS")
            .output()
            .unwrap()
    };
    for threads in [1, 3] {
        let output = run(&threads.to_string());
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
        let record: Value = serde_json::from_slice(&output.stdout).unwrap();
        assert_eq!(record["threads"], threads);
    }
    let output = run("0");
    assert_eq!(output.status.code(), Some(2));
}

/// `--num-kv-heads` and `--sliding-window` reach the layer and the line; a count of key/value
/// heads that does not divide the heads is refused in one line.
#[test]
fn grouped_heads_and_windows_are_benchmarked() {
    let run = |extra: &[&str]| {
        Command::new(BIN)
            .args(["--backend", "flex", "--impl", "fused", "--shape", "1x6x4x2"])
            .args(["--repeats", "1", "--warmup", "0"])
            .args(extra)
            .output()
            .unwrap()
    };
    for mode in ["fwd", "fwdbwd", "decode"] {
        let output = run(&[
            "--mode",
            mode,
            "--num-kv-heads",
            "1",
            "--sliding-window",
            "2",
        ]);
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
        let record: Value = serde_json::from_slice(&output.stdout).unwrap();
        assert_eq!(record["num_kv_heads"], 1, "{mode}");
        assert_eq!(record["sliding_window"], 2, "{mode}");
    }
    let output = run(&["--mode", "fwd", "--num-kv-heads", "3"]);
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("does not divide 2 heads"));
}

/// `--core` times the attention core alone, ours and Burn's op, forward and backward, with
/// grouped heads and a window; each line says it is the core, its float type and its compiler.
/// A float type the backend does not compute in is one clear error.
#[test]
fn the_core_alone_and_its_float_type() {
    for implementation in ["fused", "burn-op"] {
        for mode in ["fwd", "fwdbwd", "decode"] {
            let output = Command::new(BIN)
                .args([
                    "--backend",
                    "flex",
                    "--impl",
                    implementation,
                    "--mode",
                    mode,
                ])
                .args(["--core", "--shape", "1x9x16x4", "--num-kv-heads", "2"])
                .args([
                    "--sliding-window",
                    "4",
                    "--repeats",
                    "2",
                    "--calls-per-sync",
                    "3",
                ])
                .output()
                .unwrap();
            let what = format!("{implementation}/{mode}");
            assert!(
                output.status.success(),
                "{what}: {}",
                String::from_utf8_lossy(&output.stderr)
            );
            let record: Value = serde_json::from_slice(&output.stdout).unwrap();
            assert_eq!(record["core"], true, "{what}");
            assert_eq!(record["dtype"], "f32", "{what}");
            assert_eq!(record["compiler"], Value::Null, "{what}");
            assert_eq!(record["calls_per_sync"], 3, "{what}");
            assert!(record["median_ms"].as_f64().unwrap() > 0.0, "{what}");
        }
    }
    let output = Command::new(BIN)
        .args([
            "--backend",
            "flex",
            "--impl",
            "fused",
            "--mode",
            "fwd",
            "--core",
        ])
        .args(["--shape", "1x9x16x4", "--dtype", "bf16"])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("--backend flex does not compute in bf16"),
        "{stderr}"
    );
}

/// `--documents` packs every row from documents of the given lengths, for the layer and the core
/// (ours and Burn's op), forward and backward; the line lists the lengths (and `null` without
/// them). Lengths that do not fill the rows, an empty document, a decoding step and Burn's layer
/// are refused in one line.
#[test]
fn packed_documents_are_benchmarked_and_listed() {
    let run = |extra: &[&str]| {
        Command::new(BIN)
            .args(["--backend", "flex", "--shape", "2x9x16x4"])
            .args(["--repeats", "1", "--warmup", "0"])
            .args(extra)
            .output()
            .unwrap()
    };
    for (implementation, core) in [
        ("fused", false),
        ("explicit", false),
        ("burn-op", false),
        ("fused", true),
        ("burn-op", true),
    ] {
        for mode in ["fwd", "fwdbwd"] {
            let mut extra = vec!["--impl", implementation, "--mode", mode];
            extra.extend(["--documents", "3,1,5"]);
            if core {
                extra.push("--core");
            }
            let what = format!("{extra:?}");
            let output = run(&extra);
            assert!(
                output.status.success(),
                "{what}: {}",
                String::from_utf8_lossy(&output.stderr)
            );
            let record: Value = serde_json::from_slice(&output.stdout).unwrap();
            assert_eq!(record["documents"], serde_json::json!([3, 1, 5]), "{what}");
            assert_eq!(record["core"], core, "{what}");
            assert!(record["median_ms"].as_f64().unwrap() > 0.0, "{what}");
        }
    }
    let output = run(&["--impl", "fused", "--mode", "fwd"]);
    let record: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(record["documents"], Value::Null);
    let refusals: [(&[&str], &str); 4] = [
        (
            &["--impl", "fused", "--mode", "fwd", "--documents", "3,1,4"],
            "3,1,4: the lengths add up to 8 tokens, but shape `2x9x16x4` has rows of 9",
        ),
        (
            &["--impl", "fused", "--mode", "fwd", "--documents", "4,0,5"],
            "--documents 4,0,5: document 1 has 0 tokens",
        ),
        (
            &["--impl", "fused", "--mode", "decode", "--documents", "9"],
            "--documents packs whole rows: not --mode decode",
        ),
        (
            &["--impl", "burn-nn", "--mode", "fwd", "--documents", "9"],
            "burn-nn has no documents",
        ),
    ];
    assert_refused(run, &refusals);
}

/// `--cache paged` times a decoding step of rows at their own `--lengths` over a page pool (our
/// layer's fused path); `--cache dense` pads the same rows to the longest. Each line lists the cache, the
/// page size and the lengths, and the cache's bytes: the pages held, `Σ ceil(L / page)`, against
/// the dense cache's rows of the longest. Bad sizes are refused in one line.
#[test]
fn paged_decoding_is_benchmarked_with_the_cache_bytes() {
    let run = |extra: &[&str]| {
        Command::new(BIN)
            .args(["--backend", "flex", "--mode", "decode"])
            .args(["--shape", "3x100x16x4", "--repeats", "1", "--warmup", "0"])
            .args(extra)
            .output()
            .unwrap()
    };
    let record = |extra: &[&str]| -> Value {
        let output = run(&[&["--impl", "fused"], extra].concat());
        assert!(
            output.status.success(),
            "{extra:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        serde_json::from_slice(&output.stdout).unwrap()
    };
    // 4 features per head, 4 key/value heads, keys and values in f32: 128 bytes a position.
    let paged = record(&[
        "--cache",
        "paged",
        "--page-size",
        "32",
        "--lengths",
        "2,100,40",
    ]);
    assert_eq!(paged["cache"], "paged");
    assert_eq!(paged["page_size"], 32);
    assert_eq!(paged["lengths"], serde_json::json!([2, 100, 40]));
    assert_eq!(paged["cache_bytes"], (1 + 4 + 2) * 32 * 128);
    assert!(paged["median_ms"].as_f64().unwrap() > 0.0);
    let dense = record(&["--cache", "dense", "--lengths", "2,100,40"]);
    assert_eq!(
        (dense["cache"].clone(), dense["page_size"].clone()),
        ("dense".into(), Value::Null)
    );
    assert_eq!(dense["cache_bytes"], 3 * 99 * 128);
    let refusals: [(&[&str], &str); 4] = [
        (
            &["--impl", "fused", "--cache", "paged", "--page-size", "48"],
            "--page-size 48",
        ),
        (
            &["--impl", "fused", "--lengths", "2,100"],
            "--lengths gives 2 rows",
        ),
        (
            &["--impl", "fused", "--lengths", "2,99,40"],
            "the longest equal to it",
        ),
        (&["--cache", "paged", "--impl", "explicit"], "--impl fused"),
    ];
    assert_refused(run, &refusals);
}

/// Each `(flags, needle)` of `refusals`, run by `run`, is refused with exit code 2 and one line
/// on stderr that contains `needle`.
fn assert_refused(run: impl Fn(&[&str]) -> std::process::Output, refusals: &[(&[&str], &str)]) {
    for (extra, needle) in refusals {
        let output = run(extra);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{extra:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{extra:?}: {stderr}");
        assert!(stderr.contains(needle), "{extra:?}: {stderr}");
    }
}
