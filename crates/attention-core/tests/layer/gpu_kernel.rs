//! The GPU kernel on wgpu (Burn's fused `Wgpu`, as the layer's users get it): the output and
//! every gradient of the fused path (the kernel's forward and backward) equal the explicit path's
//! in f64 on ndarray (and, on two cases, the explicit path's on wgpu itself) over shapes that
//! end inside and on the kernel's 32-row blocks, grouped and multi-query heads, head widths
//! 16 / 64 / 128, windows of 1, 4 and 70, left padding with fully padded queries, a scale, a
//! soft-cap and sinks; cached prefill and steps (split over a long cache or not) equal the full
//! forward pass; and the route reaches the kernel (its call counter moves). Sized for a software adapter: the kernels
//! compile once per head width and set of score options, not per shape. Under attention-core's
//! `cuda` feature the f32 cases and a bf16 one also run on Burn's CUDA backend, where a device is.

use crate::common;

use attention_backends::compare::deviation;
use attention_backends::{Autodiff, NdArray64, Wgpu};
use attention_core::weights::{AttentionParams, LayerWeights, StateDict, WeightsLayout};
use attention_core::{
    AttentionInput, AttentionPath, Kernel, MultiHeadAttention, MultiHeadAttentionConfig,
};
use burn::prelude::*;
use burn::tensor::Bool;
use common::{output_and_gradients, randn, seeded_layer};

/// The largest error allowed, relative to the largest magnitude of each compared tensor (at
/// least [`FLOOR`]).
const TOL: f64 = 1e-5;
/// A gradient that is zero in exact arithmetic is all rounding: the query's where each query
/// sees one key (a softmax of one score ignores it: a sequence of 1, a window of 1). Errors are
/// judged relative to at least this share of the largest magnitude among the case's tensors.
const FLOOR: f64 = 0.01;

/// One layer shape.
struct Case {
    batch: usize,
    seq: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    window: Option<usize>,
    /// Sequence 0 left-padded by 2 (its first queries see only padding), the last right-padded
    /// by 3.
    padded: bool,
    /// Scale 0.3, soft-cap 5 and sinks.
    scored: bool,
}

impl Case {
    fn config(&self) -> MultiHeadAttentionConfig {
        let width = self.heads * self.head_dim;
        let config = MultiHeadAttentionConfig::new(width, width, self.seq, self.heads)
            .with_num_kv_heads(Some(self.kv_heads))
            .with_sliding_window(self.window)
            .with_qkv_bias(true);
        if self.scored {
            config
                .with_scale(Some(0.3))
                .with_softcap(Some(5.0))
                .with_sinks(true)
        } else {
            config
        }
    }

    /// The key padding flags, `[batch, seq]`.
    fn padding(&self) -> Option<TensorData> {
        let (batch, seq) = (self.batch, self.seq);
        self.padded.then(|| {
            let flags: Vec<bool> = (0..batch * seq)
                .map(|n| match n / seq {
                    0 => n % seq < 2,
                    b if b == batch - 1 => n % seq >= seq.saturating_sub(3),
                    _ => false,
                })
                .collect();
            TensorData::new(flags, [batch, seq])
        })
    }

    fn name(&self) -> String {
        format!(
            "b{} t{} h{}/{} d{} w{:?}{}{}",
            self.batch,
            self.seq,
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.window,
            if self.padded { " padded" } else { "" },
            if self.scored { " scale+cap+sinks" } else { "" }
        )
    }
}

#[rustfmt::skip]
const CASES: [Case; 7] = [
    Case { batch: 1, seq: 1, heads: 2, kv_heads: 2, head_dim: 16, window: None, padded: false, scored: false },
    Case { batch: 2, seq: 7, heads: 4, kv_heads: 1, head_dim: 16, window: Some(4), padded: true, scored: false },
    Case { batch: 1, seq: 63, heads: 2, kv_heads: 2, head_dim: 64, window: None, padded: false, scored: false },
    Case { batch: 3, seq: 64, heads: 8, kv_heads: 2, head_dim: 16, window: Some(1), padded: true, scored: false },
    Case { batch: 1, seq: 65, heads: 4, kv_heads: 2, head_dim: 16, window: None, padded: false, scored: true },
    Case { batch: 2, seq: 130, heads: 2, kv_heads: 1, head_dim: 128, window: Some(70), padded: true, scored: false },
    Case { batch: 2, seq: 33, heads: 4, kv_heads: 4, head_dim: 16, window: Some(4), padded: true, scored: true },
];

/// The largest magnitude in `data`.
fn largest(data: &TensorData) -> f64 {
    data.clone()
        .convert::<f64>()
        .iter::<f64>()
        .fold(0.0f64, |max, x| max.max(x.abs()))
}

/// `found` within [`TOL`] of `want`, relative to `want`'s largest magnitude or `floor`.
fn assert_close(found: &TensorData, want: &TensorData, floor: f64, what: &str) {
    let scale = largest(want).max(floor);
    let dev = deviation(found, want, 0.0, 0.0, scale);
    assert!(
        dev.max_rel <= TOL,
        "{what}: max error {:e} of the largest magnitude {scale:e} (max abs {:e})",
        dev.max_rel,
        dev.max_abs
    );
}

/// The output and every gradient of `layer` (`[y, grad.x, grad.<param>…]`) on `path`, for the
/// loss `sum(y · r)`.
fn run<B: Backend>(
    layer: &MultiHeadAttention<Autodiff<B>>,
    [x, r]: [&TensorData; 2],
    padding: Option<&TensorData>,
    path: AttentionPath,
    device: &B::Device,
) -> Vec<(String, TensorData)> {
    let x = Tensor::<Autodiff<B>, 3>::from_data(x.clone(), device).require_grad();
    let r = Tensor::from_data(r.clone(), device);
    let mut input = AttentionInput::new(x.clone()).path(path);
    if let Some(padding) = padding {
        input = input.key_padding(Tensor::from_data(padding.clone(), device));
    }
    output_and_gradients(layer, input, &x, r)
}

/// `layer`'s weights in a layer on backend `B`.
fn moved<A: Backend, B: Backend>(
    layer: &MultiHeadAttention<A>,
    config: &MultiHeadAttentionConfig,
    device: &B::Device,
) -> MultiHeadAttention<B> {
    let weights = AttentionParams::of(layer).to_state_dict(WeightsLayout::Chapter);
    StateDict::from_tensors(weights)
        .to_layer(config, device)
        .expect("the layer's own weights fit it")
}

/// [`run`] on the fused path, asserting that it reached the GPU kernel.
fn fused_on_the_kernel<B: Backend>(
    layer: &MultiHeadAttention<Autodiff<B>>,
    inputs: [&TensorData; 2],
    padding: Option<&TensorData>,
    device: &B::Device,
    what: &str,
) -> Vec<(String, TensorData)> {
    let calls = Kernel::Gpu.calls();
    let fused = run(layer, inputs, padding, AttentionPath::Fused, device);
    assert!(
        Kernel::Gpu.calls() > calls,
        "{what}: the fused path ran the GPU kernel"
    );
    fused
}

/// The reference: [`run`] on the explicit path with `layer`'s weights on ndarray f64.
fn explicit_in_f64<B: Backend>(
    layer: &MultiHeadAttention<Autodiff<B>>,
    config: &MultiHeadAttentionConfig,
    inputs: [&TensorData; 2],
    padding: Option<&TensorData>,
) -> Vec<(String, TensorData)> {
    let device = Default::default();
    run::<NdArray64>(
        &moved(layer, config, &device),
        inputs,
        padding,
        AttentionPath::Explicit,
        &device,
    )
}

#[test]
fn forward_and_gradients_equal_the_explicit_path() {
    let Some(device) = test_support::wgpu_device_for_test("gpu kernel: forward and gradients")
    else {
        return;
    };
    forward_and_gradients_equal_the_explicit_path_on::<Wgpu>(&device);
}

/// On backend `B` (f32), for every case of [`CASES`]: the fused path reaches the GPU kernel and
/// its output and gradients equal the explicit path's in f64 on ndarray, and on the first two
/// cases also the explicit path's on `B`.
fn forward_and_gradients_equal_the_explicit_path_on<B: Backend>(device: &B::Device) {
    for (i, case) in CASES.iter().enumerate() {
        let config = case.config();
        let layer = seeded_layer::<Autodiff<B>>(&config, 80 + i as u64, device);
        let shape = [case.batch, case.seq, case.heads * case.head_dim];
        let x = randn::<B, 3>(shape, 90 + i as u64, device).into_data();
        let r = randn::<B, 3>(shape, 100 + i as u64, device).into_data();
        let padding = case.padding();
        let fused = fused_on_the_kernel(&layer, [&x, &r], padding.as_ref(), device, &case.name());
        let mut references = vec![(
            "explicit, ndarray f64",
            explicit_in_f64(&layer, &config, [&x, &r], padding.as_ref()),
        )];
        if i < 2 {
            let inputs = [&x, &r];
            let explicit = run(
                &layer,
                inputs,
                padding.as_ref(),
                AttentionPath::Explicit,
                device,
            );
            references.push(("explicit, same backend", explicit));
        }
        for (reference, tensors) in references {
            assert_eq!(fused.len(), tensors.len());
            let floor = FLOOR
                * tensors
                    .iter()
                    .map(|(_, data)| largest(data))
                    .fold(0.0, f64::max);
            for ((name, fused), (_, want)) in fused.iter().zip(&tensors) {
                let what = format!("{}: {name} against the {reference}", case.name());
                assert_close(fused, want, floor, &what);
            }
        }
    }
}

#[test]
fn cached_prefill_and_steps_equal_the_full_forward() {
    let Some(device) = test_support::wgpu_device_for_test("gpu kernel: cached decoding") else {
        return;
    };
    for (i, case) in [&CASES[1], &CASES[5], &CASES[6]].into_iter().enumerate() {
        assert_cached_equals_full(case, case.seq / 2, 110 + i as u64, &device);
    }
}

/// Steps over a long cache at few (sequence, head) pairs are split over the cached keys
/// (flash-decoding: 4 splits of ~75 keys, then 3 over a window cache's 200), the partial results
/// combined by their log-sum-exps; with sinks (counted once, in the first split) and padding.
#[test]
fn split_decoding_equals_the_full_forward() {
    let Some(device) = test_support::wgpu_device_for_test("gpu kernel: split decoding") else {
        return;
    };
    #[rustfmt::skip]
    let cases = [
        Case { batch: 1, seq: 300, heads: 2, kv_heads: 1, head_dim: 16, window: None, padded: true, scored: true },
        Case { batch: 1, seq: 300, heads: 4, kv_heads: 2, head_dim: 16, window: Some(200), padded: false, scored: true },
    ];
    for (i, case) in cases.iter().enumerate() {
        assert_cached_equals_full(case, case.seq - 6, 130 + i as u64, &device);
    }
}

/// A prefill of `prefill` positions and one-token steps to the end equal the explicit full
/// forward pass, each call on the GPU kernel.
fn assert_cached_equals_full(
    case: &Case,
    prefill: usize,
    seed: u64,
    device: &attention_backends::WgpuDevice,
) {
    let layer = seeded_layer::<Wgpu>(&case.config(), seed, device);
    let (batch, seq) = (case.batch, case.seq);
    let x = randn::<Wgpu, 3>([batch, seq, case.heads * case.head_dim], seed + 10, device);
    let padding = case
        .padding()
        .map(|flags| Tensor::<Wgpu, 2, Bool>::from_data(flags, device));
    let input = |x: Tensor<Wgpu, 3>, seen: usize| {
        let input = AttentionInput::new(x);
        match &padding {
            Some(mask) => input.key_padding(mask.clone().narrow(1, 0, seen)),
            None => input,
        }
    };
    let full = layer
        .try_forward(input(x.clone(), seq).path(AttentionPath::Explicit))
        .unwrap();
    let calls = Kernel::Gpu.calls();
    let mut cache = layer.new_cache();
    let mut outputs = vec![
        layer
            .forward_cached(input(x.clone().narrow(1, 0, prefill), prefill), &mut cache)
            .unwrap(),
    ];
    for t in prefill..seq {
        outputs.push(
            layer
                .forward_cached(input(x.clone().narrow(1, t, 1), t + 1), &mut cache)
                .unwrap(),
        );
    }
    assert_eq!(
        Kernel::Gpu.calls() - calls,
        (seq - prefill + 1) as u64,
        "{}: every step ran the GPU kernel",
        case.name()
    );
    assert_close(
        &Tensor::cat(outputs, 1).into_data(),
        &full.into_data(),
        0.0,
        &format!("{}: cached", case.name()),
    );
}

/// Burn's fused wgpu backend in half precision.
type Half = burn::backend::Wgpu<burn::tensor::f16>;

/// Whether `device`'s adapter computes in f16 (wgpu's `SHADER_F16`).
fn has_f16(device: &attention_backends::WgpuDevice) -> bool {
    use cubecl::Runtime;
    burn::backend::wgpu::WgpuRuntime::client(device)
        .properties()
        .supports_type(cubecl::ir::FloatKind::F16)
}

/// f16 tensors, f32 accumulation: the fused path (the GPU kernel) is within f16's own error of
/// the f64 explicit path — no further from it than Burn's f16 explicit path on the same
/// adapter, and within 1 % of the largest magnitude. Skipped, saying so, on adapters without
/// f16.
#[test]
fn half_precision_is_as_close_as_burns_own_half_precision_path() {
    let Some(device) = test_support::wgpu_device_for_test("gpu kernel: f16") else {
        return;
    };
    if !has_f16(&device) {
        eprintln!("gpu kernel: f16 skipped: the adapter has no SHADER_F16");
        return;
    }
    half_precision_is_as_close_as_burns_own::<Wgpu, Half, burn::tensor::f16>(&device, 1e-2);
}

/// On backend `Low` (`Full`'s device, floats in `E`): the fused path's output and gradients are
/// no further from the f64 explicit path than twice Burn's own explicit path in `E` (or 1e-3),
/// and within `most` of the largest magnitude. Weights and inputs are drawn on `Full`.
fn half_precision_is_as_close_as_burns_own<Full, Low, E>(device: &Full::Device, most: f64)
where
    Full: Backend,
    Low: Backend<Device = Full::Device>,
    E: burn::tensor::Element,
{
    #[rustfmt::skip]
    let case = Case { batch: 2, seq: 65, heads: 4, kv_heads: 2, head_dim: 64, window: Some(40), padded: true, scored: true };
    let config = case.config();
    let shape = [case.batch, case.seq, case.heads * case.head_dim];
    let what = std::any::type_name::<E>();
    // Weights and inputs rounded to `E` first, so that every path starts from the same values.
    let layer: MultiHeadAttention<Autodiff<Low>> =
        moved(&seeded_layer::<Full>(&config, 140, device), &config, device);
    let [x, r] = [150, 160].map(|seed| {
        randn::<Full, 3>(shape, seed, device)
            .into_data()
            .convert::<E>()
    });
    let padding = case.padding();
    let (inputs, padding) = ([&x, &r], padding.as_ref());
    let fused = fused_on_the_kernel(&layer, inputs, padding, device, what);
    let explicit = run(&layer, inputs, padding, AttentionPath::Explicit, device);
    let want = explicit_in_f64(&layer, &config, inputs, padding);
    for ((name, fused), ((_, explicit), (_, want))) in fused.iter().zip(explicit.iter().zip(&want))
    {
        let scale = largest(want);
        let error = |found: &TensorData| deviation(found, want, 0.0, 0.0, scale).max_rel;
        let (kernel, burn) = (error(fused), error(explicit));
        assert!(
            kernel <= most && kernel <= (2.0 * burn).max(1e-3),
            "{name}: the kernel's {what} error {kernel:e} of the largest magnitude, Burn's \
             {what} explicit path's {burn:e}"
        );
    }
}

/// The GPU kernel on Burn's CUDA backend (attention-core's `cuda` feature): f32 over every case,
/// and bf16 (which wgpu lacks) where the device has it. Skipped, saying so, without a CUDA
/// driver and device.
#[cfg(feature = "cuda")]
#[test]
fn on_cuda_f32_and_bf16() {
    use burn::backend::Cuda;
    use burn::backend::cuda::CudaDevice;
    use cubecl::Runtime;
    // cudarc panics when it finds no driver to load.
    let device = std::panic::catch_unwind(|| {
        let device = CudaDevice::default();
        let _ = Tensor::<Cuda, 1>::zeros([1], &device).into_data();
        device
    });
    let Ok(device) = device else {
        eprintln!("gpu kernel on CUDA skipped: no CUDA driver or device");
        return;
    };
    forward_and_gradients_equal_the_explicit_path_on::<Cuda>(&device);
    let bf16 = cubecl::cuda::CudaRuntime::client(&device)
        .properties()
        .supports_type(cubecl::ir::FloatKind::BF16);
    if bf16 {
        half_precision_is_as_close_as_burns_own::<Cuda, Cuda<burn::tensor::bf16>, burn::tensor::bf16>(
            &device, 5e-2,
        );
    } else {
        eprintln!("gpu kernel on CUDA: bf16 skipped: the device has no bf16");
    }
}
