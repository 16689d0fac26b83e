//! A projection's training step on the CPU: one `Linear`'s forward and backward under `Autodiff`
//! as Burn's `Linear::forward` records it, beside [`cpu_linalg::projection::linear`], whose
//! node's backward is the CPU products (`dx = dy · Wᵀ`, `dW = xᵀ · dy`, `db = Σ dy`); and the
//! forward alone on the bare backend, Burn's and the products'. Per shape and round, one JSON line
//! with the medians, shapes interleaved.
//!
//! ```text
//! cargo run --release -p lm-bench --bin linear-grad-rate -- --threads 2
//! ```

use std::process::ExitCode;
use std::time::Instant;

use attention_backends::{BackendName, OnBackend};
use attention_bench::process::{median, run_on};
use burn::backend::Autodiff;
use burn::module::AutodiffModule;
use burn::nn::{Linear, LinearConfig};
use burn::prelude::*;
use burn::tensor::Distribution;
use clap::Parser;
use cpu_linalg::projection::{self, PackedWeightsCache};

/// Times one `Linear` per shape, Burn's against the CPU products.
#[derive(Debug, Parser)]
struct Args {
    /// `BATCHxSEQxINxOUT`; repeat for several. Default: GPT-2 small's and SmolLM2-135M's
    /// projections at batch 8 × 128 tokens.
    #[arg(long = "shape", value_parser = parse_shape)]
    shapes: Vec<[usize; 4]>,
    #[arg(long, value_enum, default_value_t = BackendName::Flex)]
    backend: BackendName,
    /// Threads of every pool (rayon's, matrixmultiply's).
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    threads: Option<u16>,
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: u32,
    /// Timed calls per shape, path and round (after one warm-up).
    #[arg(long, default_value_t = 7, value_parser = clap::value_parser!(u32).range(1..))]
    repeats: u32,
    /// Time the bare forward passes only (the products row of the CPU targets).
    #[arg(long)]
    forward_only: bool,
}

const DEFAULT_SHAPES: [[usize; 4]; 5] = [
    [8, 128, 768, 768],
    [8, 128, 768, 3072],
    [8, 128, 3072, 768],
    [8, 128, 576, 1536],
    [8, 128, 1536, 576],
];

fn parse_shape(text: &str) -> Result<[usize; 4], String> {
    let dims: Vec<usize> = text
        .split('x')
        .map(|dim| {
            dim.parse()
                .map_err(|_| format!("`{dim}` in `{text}` is not a size"))
        })
        .collect::<Result<_, _>>()?;
    match <[usize; 4]>::try_from(dims) {
        Ok(dims) if dims.iter().all(|&dim| dim > 0) => Ok(dims),
        _ => Err(format!(
            "`{text}` is not BATCHxSEQxINxOUT, four sizes above 0"
        )),
    }
}

#[derive(serde::Serialize)]
struct Record {
    backend: &'static str,
    threads: usize,
    round: u32,
    shape: String,
    burn_forward_ms: f64,
    products_forward_ms: f64,
    /// Forward and backward under `Autodiff`, every gradient read back (absent with
    /// `--forward-only`).
    #[serde(skip_serializing_if = "Option::is_none")]
    burn_step_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    products_step_ms: Option<f64>,
    /// `products_step_ms / burn_step_ms`
    #[serde(skip_serializing_if = "Option::is_none")]
    step_ratio: Option<f64>,
}

struct Measure {
    shapes: Vec<[usize; 4]>,
    rounds: u32,
    repeats: u32,
    forward_only: bool,
}

impl OnBackend for Measure {
    type Output = Result<(), std::convert::Infallible>;

    fn run<B: Backend>(self, name: &'static str, device: B::Device) -> Self::Output {
        let layers: Vec<_> = self
            .shapes
            .iter()
            .map(|&[batch, seq, input, output]| {
                let layer = LinearConfig::new(input, output).init::<Autodiff<B>>(&device);
                let normal = Distribution::Normal(0.0, 1.0);
                let x = Tensor::<B, 3>::random([batch, seq, input], normal, &device);
                let dy = Tensor::<B, 3>::random([batch, seq, output], normal, &device);
                (layer, x, dy)
            })
            .collect();
        for round in 1..=self.rounds {
            for (shape, (layer, x, dy)) in self.shapes.iter().zip(&layers) {
                let bare = layer.valid();
                // The layer's packed weights, kept across the timed calls as a model keeps them.
                let packed = PackedWeightsCache::default();
                let time = |step: &dyn Fn()| time_ms(self.repeats, step);
                let record = Record {
                    backend: name,
                    threads: rayon::current_num_threads(),
                    round,
                    shape: shape.map(|dim| dim.to_string()).join("x"),
                    burn_forward_ms: time(&|| drop(bare.forward(x.clone()).into_data())),
                    products_forward_ms: time(&|| {
                        drop(projection::linear(&bare, x.clone(), &packed).into_data())
                    }),
                    burn_step_ms: None,
                    products_step_ms: None,
                    step_ratio: None,
                };
                let record = match self.forward_only {
                    true => record,
                    false => {
                        let burn = time(&|| burns_step(layer, x, dy));
                        let products = time(&|| products_step(layer, x, dy, &packed));
                        Record {
                            burn_step_ms: Some(burn),
                            products_step_ms: Some(products),
                            step_ratio: Some(products / burn),
                            ..record
                        }
                    }
                };
                println!("{}", serde_json::to_string(&record).expect("serializes"));
            }
        }
        Ok(())
    }
}

/// Burn's forward and backward of `layer` at `x`, `dy` the output's gradient; every gradient
/// read back.
fn burns_step<B: Backend>(layer: &Linear<Autodiff<B>>, x: &Tensor<B, 3>, dy: &Tensor<B, 3>) {
    step(layer, x, dy, Linear::forward);
}

/// [`burns_step`] through [`projection::linear`].
fn products_step<B: Backend>(
    layer: &Linear<Autodiff<B>>,
    x: &Tensor<B, 3>,
    dy: &Tensor<B, 3>,
    packed: &PackedWeightsCache,
) {
    step(layer, x, dy, |layer, x| {
        projection::linear(layer, x, packed)
    });
}

/// `forward` and the backward of its output weighed by `dy`, every gradient read back.
fn step<B: Backend>(
    layer: &Linear<Autodiff<B>>,
    x: &Tensor<B, 3>,
    dy: &Tensor<B, 3>,
    forward: impl Fn(&Linear<Autodiff<B>>, Tensor<Autodiff<B>, 3>) -> Tensor<Autodiff<B>, 3>,
) {
    let x = Tensor::<Autodiff<B>, 3>::from_inner(x.clone()).require_grad();
    let dy = Tensor::<Autodiff<B>, 3>::from_inner(dy.clone());
    let gradients = (forward(layer, x.clone()) * dy).sum().backward();
    let bias = layer.bias.as_ref().expect("a bias");
    drop(x.grad(&gradients).expect("x's gradient").into_data());
    drop(
        layer
            .weight
            .grad(&gradients)
            .expect("W's gradient")
            .into_data(),
    );
    drop(bias.grad(&gradients).expect("b's gradient").into_data());
}

/// The median of `repeats` timed calls of `step`, after one warm-up, in milliseconds.
fn time_ms(repeats: u32, step: &dyn Fn()) -> f64 {
    step();
    let mut times: Vec<f64> = (0..repeats)
        .map(|_| {
            let start = Instant::now();
            step();
            start.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    median(&mut times)
}

fn main() -> ExitCode {
    let args = Args::parse();
    let shapes = match args.shapes.is_empty() {
        true => DEFAULT_SHAPES.to_vec(),
        false => args.shapes,
    };
    let measure = Measure {
        shapes,
        rounds: args.rounds,
        repeats: args.repeats,
        forward_only: args.forward_only,
    };
    run_on(args.threads, args.backend, measure)
}
