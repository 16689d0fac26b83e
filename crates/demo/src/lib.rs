//! The demos' runner: one command line and one implementation of each subcommand, generic over
//! the backend. `demo-ndarray` and `demo-wgpu` only pick a backend and call [`run`].
//!
//! - `walkthrough` (default): the source chapter's example, printing what it prints.
//! - `gradcheck`: autodiff gradients against finite differences (f64) or an f64 reference.
//! - `apply`: a PyTorch-trained layer on given inputs, optionally with gradients.
//! - `heatmap`: the attention weights as a PNG.
#![warn(missing_docs)]

mod apply;
mod cli;
mod gradcheck;
mod heatmap;
mod io;
mod table;
mod walkthrough;

use std::process::ExitCode;

use burn::prelude::*;
use clap::Parser;

pub use cli::{Cli, Command};
pub use gradcheck::Gradcheck;

/// A failure the user can act on: printed as one line, exit code 2. (Not an `Error` itself, so
/// that every error converts into it with `?`.)
#[derive(Debug)]
pub struct DemoError(pub String);

impl std::fmt::Display for DemoError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl<E: std::error::Error> From<E> for DemoError {
    fn from(error: E) -> Self {
        Self(error.to_string())
    }
}

/// The backend a demo runs on, as its `main` picks it.
#[derive(Debug, Clone)]
pub struct DemoBackend<B: Backend> {
    /// Shown in the output, e.g. `"ndarray"`.
    pub name: &'static str,
    /// The device to run on.
    pub device: B::Device,
    /// How `gradcheck` judges this backend's gradients.
    pub gradcheck: Gradcheck,
}

/// Parses the command line and runs the subcommand on `backend`.
///
/// Exit codes: 0 success, 1 a failed check (`gradcheck`), 2 bad input (a missing file, a
/// misshapen tensor, …) reported as one line on stderr.
pub fn run<B: Backend>(backend: DemoBackend<B>) -> ExitCode {
    let cli = Cli::parse();
    let outcome = match cli.command.unwrap_or_default() {
        Command::Walkthrough(args) => walkthrough::run(&backend, &args).map(|()| true),
        Command::Gradcheck(args) => gradcheck::run(&backend, &args),
        Command::Apply(args) => apply::run(&backend, &args).map(|()| true),
        Command::Heatmap(args) => heatmap::run(&backend, &args).map(|()| true),
    };
    match outcome {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::from(2)
        }
    }
}
