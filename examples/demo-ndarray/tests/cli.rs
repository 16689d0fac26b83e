//! The ndarray demo's command line, run as a user runs it.

#[path = "../../../crates/demo/testing/cli_cases.rs"]
mod cli_cases;

cli_tests!(env!("CARGO_BIN_EXE_demo-ndarray"), |_test| true);
