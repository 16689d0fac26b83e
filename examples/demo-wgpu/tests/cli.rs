//! The wgpu demo's command line, run as a user runs it; skipped (saying why) without an adapter
//! unless `REQUIRE_WGPU` is set.

demo_cli_cases::cli_tests!(env!("CARGO_BIN_EXE_demo-wgpu"), |test| {
    test_support::wgpu_device_for_test(test).is_some()
});

/// Without a Vulkan driver the demo says what is missing in one line and exits 2, no panic.
#[test]
fn no_adapter_is_one_clear_line() {
    let output = std::process::Command::new(BIN)
        .env("VK_ICD_FILENAMES", "/nonexistent.json")
        .env("VK_DRIVER_FILES", "/nonexistent.json")
        .env("WGPU_BACKEND", "vulkan")
        .output()
        .unwrap();
    let lines = stderr_lines(&output);
    assert_eq!(output.status.code(), Some(2), "{lines:?}");
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(
        lines[0].starts_with("error: no wgpu adapter found")
            && lines[0].contains("mesa-vulkan-drivers"),
        "{lines:?}"
    );
}

/// The GPU kernel reads f16 and int8 caches in place; a bf16 one is one clear error.
#[test]
fn apply_narrow_caches_track_the_fixtures() {
    if test_support::wgpu_device_for_test("apply_narrow_caches_track_the_fixtures").is_some() {
        demo_cli_cases::apply_narrow_caches_track_the_fixtures(BIN, &["f16", "int8"]);
        demo_cli_cases::apply_an_unread_cache_type_is_refused(BIN, "bf16");
    }
}
