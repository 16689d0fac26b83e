//! The ndarray demo's command line, run as a user runs it.

demo_cli_cases::cli_tests!(env!("CARGO_BIN_EXE_demo-ndarray"), |_test| true);
