//! Gradient checks for the input and every parameter, with `loss = sum(y * r)`.
//!
//! - [`Gradcheck::FiniteDifferences`]: autodiff in f64 against central finite differences in f64.
//! - [`Gradcheck::AgainstF64Reference`]: the backend's own (f32) autodiff against autodiff on
//!   ndarray in f64 with the same weights and inputs (an f32 finite difference is too noisy to
//!   judge at 1e-4).

use attention_backends::NdArray64;
use attention_backends::compare::deviation;
use attention_core::weights::{AttentionParams, LayerWeights, StateDict, WeightsLayout};
use attention_core::{Kernel, MultiHeadAttentionConfig, QkNormConfig, QkNormScope, RopeConfig};
use burn::backend::Autodiff;
use burn::prelude::*;
use burn::tensor::Distribution;
use rand::SeedableRng;
use rand::rngs::StdRng;

use crate::cli::GradcheckArgs;
use crate::{DemoBackend, DemoError};

/// How a demo's gradients are judged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gradcheck {
    /// Autodiff on ndarray f64 against central finite differences; max relative error ≤ 1e-6.
    FiniteDifferences,
    /// The demo backend's autodiff against ndarray f64 autodiff; max relative error ≤ 1e-4.
    AgainstF64Reference,
}

impl Gradcheck {
    fn tolerance(self) -> f64 {
        match self {
            Self::FiniteDifferences => 1e-6,
            Self::AgainstF64Reference => 1e-4,
        }
    }

    /// Relative errors are taken against `max(|reference|, floor)`: gradients here are of order
    /// 0.1–1, and one of them (the key bias's) is zero in exact arithmetic (softmax ignores a
    /// per-row constant), so in f32 it is all rounding, ~1e-7.
    fn rel_floor(self) -> f64 {
        match self {
            Self::FiniteDifferences => 1e-3,
            Self::AgainstF64Reference => 1e-2,
        }
    }
}
/// Central-difference step, for f64.
const STEP: f64 = 1e-6;

/// One layer shape to check, on two sequences of its whole context length.
struct Case {
    name: &'static str,
    config: MultiHeadAttentionConfig,
}

impl Case {
    const BATCH: usize = 2;

    fn seq(&self) -> usize {
        self.config.context_length
    }
}

fn cases() -> [Case; 5] {
    [
        Case {
            name: "qkv_bias on, input_dim 5 -> output_dim 6, 2 heads",
            config: MultiHeadAttentionConfig::new(5, 6, 4, 2).with_qkv_bias(true),
        },
        Case {
            name: "qkv_bias off, input_dim 6 -> output_dim 4, 2 heads",
            config: MultiHeadAttentionConfig::new(6, 4, 5, 2),
        },
        Case {
            name: "Llama-style: 4 heads over 2 kv heads of 2, RoPE, window 3, no output bias",
            config: MultiHeadAttentionConfig::new(6, 5, 6, 4)
                .with_num_kv_heads(Some(2))
                .with_head_dim(Some(2))
                .with_qkv_bias(true)
                .with_output_bias(false)
                .with_rope(Some(RopeConfig::new()))
                .with_sliding_window(Some(3)),
        },
        Case {
            name: "Gemma-like with sinks: 4 heads of 4 over 2 kv heads, q/k norms per head \
                   (1 + w), RoPE on half of each head, scale 0.4, soft-cap 1.5, sinks, window 4",
            config: MultiHeadAttentionConfig::new(5, 6, 7, 4)
                .with_num_kv_heads(Some(2))
                .with_head_dim(Some(4))
                .with_output_bias(false)
                .with_qk_norm(Some(
                    QkNormConfig::new(QkNormScope::Head)
                        .with_epsilon(1e-3)
                        .with_unit_offset(true),
                ))
                .with_rope(Some(
                    RopeConfig::new().with_theta(100.0).with_rotary_dim(Some(2)),
                ))
                .with_scale(Some(0.4))
                .with_softcap(Some(1.5))
                .with_sinks(true)
                .with_sliding_window(Some(4)),
        },
        Case {
            name: "OLMo2-like: q/k norms over the width (16 and 4 features), 1 kv head, RoPE",
            config: MultiHeadAttentionConfig::new(5, 6, 5, 4)
                .with_num_kv_heads(Some(1))
                .with_head_dim(Some(4))
                .with_qk_norm(Some(
                    QkNormConfig::new(QkNormScope::Width).with_epsilon(1e-3),
                ))
                .with_rope(Some(RopeConfig::new())),
        },
    ]
}

/// The inputs of one check, as f64 data: the weights as a PyTorch state dict, `x` and `r`.
struct Problem {
    weights: Vec<(String, TensorData)>,
    x: TensorData,
    r: TensorData,
}

impl Problem {
    fn new(case: &Case, seed: u64) -> Self {
        let device = Default::default();
        NdArray64::seed(&device, seed);
        let layer = case.config.init::<NdArray64>(&device);
        let mut weights = AttentionParams::of(&layer).to_state_dict(WeightsLayout::Chapter);
        let mut rng = StdRng::seed_from_u64(seed);
        let normal = Distribution::Normal(0.0, 1.0);
        // Norm weights and sinks start at 1 or 0: draw them, so that no gradient is checked at a
        // point where its terms vanish.
        for (key, data) in weights.iter_mut() {
            if key.ends_with("_norm.weight") || key == "sinks" {
                *data = TensorData::random::<f64, _, _>(
                    data.shape.clone(),
                    Distribution::Uniform(0.3, 0.9),
                    &mut rng,
                );
            }
        }
        let x = TensorData::random::<f64, _, _>(
            [Case::BATCH, case.seq(), case.config.input_dim],
            normal,
            &mut rng,
        );
        let r = TensorData::random::<f64, _, _>(
            [Case::BATCH, case.seq(), case.config.output_dim],
            normal,
            &mut rng,
        );
        Self { weights, x, r }
    }

    /// `d sum(y * r) / d x` and `/ d param` on `B`, named `x` and as the state dict names them.
    fn autodiff_grads<B: Backend>(
        &self,
        config: &MultiHeadAttentionConfig,
        device: &B::Device,
    ) -> Vec<(String, TensorData)> {
        let layer = StateDict::from_tensors(self.weights.clone())
            .to_layer::<Autodiff<B>>(config, device)
            .expect("weights fit");
        let x = Tensor::<Autodiff<B>, 3>::from_data(self.x.clone(), device).require_grad();
        let r = Tensor::<Autodiff<B>, 3>::from_data(self.r.clone(), device);
        let grads = (layer.forward(x.clone()) * r).sum().backward();
        let mut named = vec![(
            "x".to_string(),
            x.grad(&grads).expect("x takes part").into_data(),
        )];
        named.extend(
            AttentionParams::grads_of(&layer, &grads).to_state_dict(WeightsLayout::Chapter),
        );
        named
    }

    /// `sum(y * r)` in f64 with `weights` and `x`.
    fn loss(
        &self,
        config: &MultiHeadAttentionConfig,
        weights: &[(String, TensorData)],
        x: &TensorData,
    ) -> f64 {
        let device = Default::default();
        let layer = StateDict::from_tensors(weights.to_vec())
            .to_layer::<NdArray64>(config, &device)
            .expect("weights fit");
        let x = Tensor::<NdArray64, 3>::from_data(x.clone(), &device);
        let r = Tensor::<NdArray64, 3>::from_data(self.r.clone(), &device);
        (layer.forward(x) * r).sum().into_scalar()
    }

    /// Central finite differences of the loss for every element of `x` and every parameter.
    fn finite_difference_grads(
        &self,
        config: &MultiHeadAttentionConfig,
    ) -> Vec<(String, TensorData)> {
        let nudged = |data: &TensorData, index: usize, delta: f64| {
            let mut values = data.clone().into_vec::<f64>().expect("f64");
            values[index] += delta;
            TensorData::new(values, data.shape.clone())
        };
        let difference =
            |loss_at: &dyn Fn(f64) -> f64| (loss_at(STEP) - loss_at(-STEP)) / (2.0 * STEP);
        let mut named = Vec::new();
        let x_grad: Vec<f64> = (0..self.x.num_elements())
            .map(|i| difference(&|d| self.loss(config, &self.weights, &nudged(&self.x, i, d))))
            .collect();
        named.push((
            "x".to_string(),
            TensorData::new(x_grad, self.x.shape.clone()),
        ));
        for (k, (key, data)) in self.weights.iter().enumerate() {
            let grad: Vec<f64> = (0..data.num_elements())
                .map(|i| {
                    difference(&|d| {
                        let mut weights = self.weights.clone();
                        weights[k].1 = nudged(data, i, d);
                        self.loss(config, &weights, &self.x)
                    })
                })
                .collect();
            named.push((key.clone(), TensorData::new(grad, data.shape.clone())));
        }
        named
    }
}

/// Runs every case; prints a line per tensor and a verdict; `Ok(false)` when a check fails.
pub fn run<B: Backend>(backend: &DemoBackend<B>, args: &GradcheckArgs) -> Result<bool, DemoError> {
    let mode = backend.gradcheck;
    let tolerance = mode.tolerance();
    let (tested, reference) = match mode {
        Gradcheck::FiniteDifferences => ("ndarray f64 autodiff", "f64 central finite differences"),
        Gradcheck::AgainstF64Reference => (backend.name, "ndarray f64 autodiff"),
    };
    println!(
        "gradcheck: {tested} vs {reference}, loss = sum(y * r), max relative error ≤ {tolerance:e} \
         (relative to max(|reference|, {:e}))",
        mode.rel_floor()
    );
    let (mut checked, mut worst, mut failures) = (0, 0.0f64, 0);
    // The attention core of the autodiff under test: a kernel of attention-core's, whose own
    // backward pass is what this checks, or Burn's ops.
    let kernel = match mode {
        Gradcheck::FiniteDifferences => Kernel::of::<Autodiff<NdArray64>>(),
        Gradcheck::AgainstF64Reference => Kernel::of::<Autodiff<B>>(),
    };
    let kernel_calls = || kernel.map_or(0, Kernel::calls);
    // Counted around the autodiff under test only: the references may run the same kernel.
    let mut calls = 0;
    for case in cases() {
        println!(
            "case: {} (batch {}, seq {})",
            case.name,
            Case::BATCH,
            case.seq()
        );
        let problem = Problem::new(&case, args.seed);
        let calls_before = kernel_calls();
        let actual = match mode {
            Gradcheck::FiniteDifferences => {
                problem.autodiff_grads::<NdArray64>(&case.config, &Default::default())
            }
            Gradcheck::AgainstF64Reference => {
                problem.autodiff_grads::<B>(&case.config, &backend.device)
            }
        };
        calls += kernel_calls() - calls_before;
        let expected = match mode {
            Gradcheck::FiniteDifferences => problem.finite_difference_grads(&case.config),
            Gradcheck::AgainstF64Reference => {
                problem.autodiff_grads::<NdArray64>(&case.config, &Default::default())
            }
        };
        for ((name, a), (_, e)) in actual.iter().zip(&expected) {
            let dev = deviation(a, e, 0.0, 0.0, mode.rel_floor());
            let ok = dev.max_rel <= tolerance;
            println!(
                "  {:<25} {:<10} max abs {:9.2e}  max rel {:9.2e}  {}",
                format!("grad.{name}"),
                format!("{:?}", a.shape.as_slice()),
                dev.max_abs,
                dev.max_rel,
                if ok { "ok" } else { "FAIL" }
            );
            checked += 1;
            worst = worst.max(dev.max_rel);
            failures += usize::from(!ok);
        }
    }
    match kernel {
        Some(kernel) => {
            println!("attention core: the {kernel:?} kernel's forward and backward ({calls} calls)")
        }
        None => println!("attention core: Burn's ops (no kernel of attention-core's on {tested})"),
    }
    let verdict = if failures == 0 { "PASS" } else { "FAIL" };
    println!(
        "gradcheck {verdict}: {checked} tensors, {failures} over tolerance, worst max rel {worst:.2e} (tolerance {tolerance:e})"
    );
    Ok(failures == 0)
}
