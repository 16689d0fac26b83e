//! The JSON runner at the chapter's shape, for every backend × implementation × mode: it runs,
//! its line parses, times are positive — or the combination is refused in one clear line.

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_attention-bench");

/// The value of `"key":…` in a flat JSON object line.
fn field<'a>(line: &'a str, key: &str) -> &'a str {
    let start = line
        .find(&format!("\"{key}\":"))
        .unwrap_or_else(|| panic!("no {key} in {line}"))
        + key.len()
        + 3;
    let rest = &line[start..];
    let end = rest.find([',', '}']).unwrap();
    rest[..end].trim_matches('"')
}

#[test]
fn every_combination_at_the_chapters_shape() {
    let wgpu = attention_backends::wgpu_device_for_test(
        "every_combination_at_the_chapters_shape (wgpu part)",
    )
    .is_some();
    let backends: &[&str] = if wgpu {
        &["ndarray", "flex", "wgpu"]
    } else {
        &["ndarray", "flex"]
    };
    for backend in backends {
        for implementation in ["explicit", "fused", "burn-nn"] {
            for mode in ["fwd", "fwdbwd", "decode"] {
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
                let line = lines[0];
                assert!(
                    line.starts_with('{') && line.ends_with('}'),
                    "{what}: {line}"
                );
                assert_eq!(field(line, "backend"), *backend);
                assert_eq!(field(line, "impl"), implementation);
                assert_eq!(field(line, "mode"), mode);
                assert_eq!(field(line, "shape"), "1x6x4x2");
                for key in ["median_ms", "min_ms", "max_ms", "gflops", "peak_rss_mib"] {
                    let value: f64 = field(line, key)
                        .parse()
                        .unwrap_or_else(|_| panic!("{what}: {key} in {line}"));
                    assert!(value > 0.0 && value.is_finite(), "{what}: {key} = {value}");
                }
                let (min, median, max): (f64, f64, f64) = (
                    field(line, "min_ms").parse().unwrap(),
                    field(line, "median_ms").parse().unwrap(),
                    field(line, "max_ms").parse().unwrap(),
                );
                assert!(min <= median && median <= max, "{what}: {line}");
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
