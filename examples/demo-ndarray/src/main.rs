//! The attention demos on Burn's ndarray backend (CPU); gradients checked in f64 against finite
//! differences.

use std::process::ExitCode;

use attention_backends::NdArray;
use attention_demo::{DemoBackend, Gradcheck, run};

fn main() -> ExitCode {
    run::<NdArray>(DemoBackend {
        name: "ndarray",
        device: Default::default(),
        gradcheck: Gradcheck::FiniteDifferences,
    })
}
