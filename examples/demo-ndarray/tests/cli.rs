//! The ndarray demo's command line, run as a user runs it.

demo_cli_cases::cli_tests!(env!("CARGO_BIN_EXE_demo-ndarray"), |_test| true);

/// The cached path with a cache in fewer bytes, against PyTorch's outputs.
#[test]
fn apply_narrow_caches_track_the_fixtures() {
    demo_cli_cases::apply_narrow_caches_track_the_fixtures(BIN, &["f16", "bf16", "int8"]);
}
