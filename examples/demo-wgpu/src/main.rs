//! The attention demos on Burn's wgpu backend; gradients checked against ndarray in f64.

use std::process::ExitCode;

use attention_backends::{Wgpu, wgpu_device};
use attention_demo::{DemoBackend, Gradcheck, run};

fn main() -> ExitCode {
    match wgpu_device() {
        Ok(device) => run::<Wgpu>(DemoBackend {
            name: "wgpu",
            device,
            gradcheck: Gradcheck::AgainstF64Reference,
        }),
        Err(no_adapter) => {
            eprintln!("error: {no_adapter}");
            ExitCode::from(2)
        }
    }
}
