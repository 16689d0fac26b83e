//! The inference paths agree: fused == explicit, cached decoding == one full forward, a padded
//! batch == each sequence alone; rows with every key masked stay finite; and the fused op's
//! conventions (`true` = masked, causal mask aligned bottom-right) are what we rely on.

use crate::common;

use attention_core::mask::causal_mask;
use attention_core::weights::LayerWeights;
use attention_core::{AttentionInput, AttentionPath, MultiHeadAttentionConfig};
use burn::backend::Autodiff;
use burn::prelude::*;
use burn::tensor::Bool;
use burn::tensor::module::attention;
use burn::tensor::ops::AttentionModuleOptions;
use common::{on_path, output_and_gradients, randn, seeded_layer};
use test_support::cases_on;

const TOL: f64 = 1e-5;

fn assert_close<B: Backend, const D: usize>(a: Tensor<B, D>, b: Tensor<B, D>, what: &str) {
    attention_backends::compare::assert_close(&a.into_data(), &b.into_data(), TOL, 0.0, what);
}

/// Several shapes, with and without QKV bias, input_dim ≠ output_dim included.
fn fused_equals_explicit<B: Backend>(device: &B::Device) {
    let cases = [
        (1, 150, 16, 16, 2, true), // several query and key blocks of the CPU kernel
        (3, 7, 10, 12, 3, true),
        (1, 6, 4, 4, 2, false),
        (2, 17, 32, 32, 4, true),
        (2, 65, 64, 64, 2, false),
    ];
    for (i, &(batch, seq, input, output, heads, bias)) in
        cases_on::<B, _>(&cases).iter().enumerate()
    {
        let config = MultiHeadAttentionConfig::new(input, output, seq, heads).with_qkv_bias(bias);
        let layer = seeded_layer::<B>(&config, 11 + i as u64, device);
        let x = randn::<B, 3>([batch, seq, input], 20 + i as u64, device);
        let fused = on_path(&layer, x.clone(), AttentionPath::Fused);
        let explicit = on_path(&layer, x, AttentionPath::Explicit);
        assert_close(fused, explicit, &format!("fused vs explicit, shape {i}"));
    }
}

/// A prefill of `p` tokens then steps of one give the full forward's outputs, for p = 0 … t, in
/// chunks too, with a cache larger than the sequence or exactly its size.
fn cached_decoding_equals_full_forward<B: Backend>(device: &B::Device) {
    let cases = [
        (2, 9, 12, 3, 12, true),
        (1, 6, 8, 4, 6, false),
        (2, 5, 8, 2, 8, true),
    ];
    for (i, &(batch, seq, width, heads, context, bias)) in
        cases_on::<B, _>(&cases).iter().enumerate()
    {
        let config = MultiHeadAttentionConfig::new(8, width, context, heads).with_qkv_bias(bias);
        let layer = seeded_layer::<B>(&config, 30 + i as u64, device);
        let x = randn::<B, 3>([batch, seq, 8], 31 + i as u64, device);
        let full = layer.forward(x.clone());
        for (prefill, path) in [0, 1, seq / 2, seq]
            .into_iter()
            .flat_map(|p| [(p, AttentionPath::Fused), (p, AttentionPath::Explicit)])
        {
            let mut cache = layer.new_cache();
            let mut step = |x: Tensor<B, 3>| {
                layer
                    .forward_cached(AttentionInput::new(x).path(path), &mut cache)
                    .unwrap()
            };
            let mut outputs = Vec::new();
            if prefill > 0 {
                outputs.push(step(x.clone().slice([0..batch, 0..prefill])));
            }
            for t in prefill..seq {
                outputs.push(step(x.clone().slice([0..batch, t..t + 1])));
            }
            assert_eq!(cache.len(), seq);
            assert_close(
                Tensor::cat(outputs, 1),
                full.clone(),
                &format!("case {i}: prefill {prefill} then steps, {path:?}"),
            );
        }
        // Paths alternating step by step: on ndarray and flex the cache moves between host
        // memory (the CPU kernel's) and tensors (the explicit path's) at every step.
        let mut cache = layer.new_cache();
        let alternating: Vec<_> = (0..seq)
            .map(|t| {
                let path = match t % 2 {
                    0 => AttentionPath::Fused,
                    _ => AttentionPath::Explicit,
                };
                let x = x.clone().slice([0..batch, t..t + 1]);
                layer
                    .forward_cached(AttentionInput::new(x).path(path), &mut cache)
                    .unwrap()
            })
            .collect();
        assert_close(
            Tensor::cat(alternating, 1),
            full.clone(),
            &format!("case {i}: paths alternating step by step"),
        );
        let mut cache = layer.new_cache();
        let chunks: Vec<_> = [0..2, 2..3, 3..seq]
            .into_iter()
            .map(|r| {
                layer
                    .forward_cached(x.clone().slice([0..batch, r]), &mut cache)
                    .unwrap()
            })
            .collect();
        assert_close(
            Tensor::cat(chunks, 1),
            full,
            &format!("case {i}: chunks of 2, 1, rest"),
        );
    }
}

/// Sequence `a` (5 tokens) and `b` (3 tokens) batched with `b` padded on the right or the left:
/// the real positions match each sequence run alone, on both paths; padding rows are finite.
fn padded_batch_equals_each_sequence_alone<B: Backend>(device: &B::Device) {
    let config = MultiHeadAttentionConfig::new(8, 8, 5, 2).with_qkv_bias(true);
    let layer = seeded_layer::<B>(&config, 40, device);
    let a = randn::<B, 3>([1, 5, 8], 41, device);
    let b = randn::<B, 3>([1, 3, 8], 42, device);
    let pad = randn::<B, 3>([1, 2, 8], 43, device) * 100.0; // padding content must not leak
    let alone_a = layer.forward(a.clone());
    let alone_b = layer.forward(b.clone());
    for (name, b_padded, b_mask, real) in [
        (
            "right",
            Tensor::cat(vec![b.clone(), pad.clone()], 1),
            [false, false, false, true, true],
            0..3,
        ),
        (
            "left",
            Tensor::cat(vec![pad.clone(), b.clone()], 1),
            [true, true, false, false, false],
            2..5,
        ),
    ] {
        let x = Tensor::cat(vec![a.clone(), b_padded], 0);
        let mask = Tensor::<B, 2, Bool>::from_bool(TensorData::from([[false; 5], b_mask]), device);
        for path in [AttentionPath::Explicit, AttentionPath::Fused] {
            let y = layer
                .try_forward(
                    AttentionInput::new(x.clone())
                        .key_padding(mask.clone())
                        .path(path),
                )
                .unwrap();
            let what = format!("{name} padding, {path:?}");
            assert_close(
                y.clone().narrow(0, 0, 1),
                alone_a.clone(),
                &format!("{what}: unpadded row"),
            );
            assert_close(
                y.clone().slice([1..2, real.clone()]),
                alone_b.clone(),
                &format!("{what}: padded row"),
            );
            let values = y.into_data().to_vec::<f32>().unwrap();
            assert!(
                values.iter().all(|v| v.is_finite()),
                "{what}: non-finite output"
            );
        }
    }
}

/// A query whose keys are all padding gets a zero context: the output is the output bias.
fn fully_masked_rows_are_finite<B: Backend>(device: &B::Device) {
    let config = MultiHeadAttentionConfig::new(4, 4, 3, 2);
    let layer = seeded_layer::<B>(&config, 50, device);
    let x = randn::<B, 3>([1, 3, 4], 51, device);
    let mask = Tensor::<B, 2, Bool>::from_bool(TensorData::from([[true, true, true]]), device);
    let bias = layer
        .output_layer
        .bias
        .as_ref()
        .unwrap()
        .val()
        .reshape([1, 1, 4])
        .expand([1, 3, 4]);
    for path in [AttentionPath::Explicit, AttentionPath::Fused] {
        let y = layer
            .try_forward(
                AttentionInput::new(x.clone())
                    .key_padding(mask.clone())
                    .path(path),
            )
            .unwrap();
        assert_close(y, bias.clone(), &format!("{path:?}: all keys masked"));
    }
}

/// Burn's fused op: `true` in `mask` is masked, and with `is_causal` and fewer queries than keys
/// the queries are the *last* positions (query i sees keys ≤ i + t_k − t_q).
fn fused_op_conventions<B: Backend>(device: &B::Device) {
    let (t_q, t_k, hd) = (3, 7, 4);
    let q = randn::<B, 4>([1, 2, t_q, hd], 60, device);
    let k = randn::<B, 4>([1, 2, t_k, hd], 61, device);
    let v = randn::<B, 4>([1, 2, t_k, hd], 62, device);
    let causal = AttentionModuleOptions {
        scale: None,
        softcap: None,
        is_causal: true,
    };
    let plain = AttentionModuleOptions {
        is_causal: false,
        ..causal
    };
    let bottom_right = causal_mask::<B>(t_q, t_k - t_q, device)
        .reshape([1, 1, t_q, t_k])
        .expand([1, 2, t_q, t_k]);
    let with_flag = attention(q.clone(), k.clone(), v.clone(), None, None, causal);
    let with_mask = attention(
        q.clone(),
        k.clone(),
        v.clone(),
        Some(bottom_right.clone()),
        None,
        plain,
    );
    assert_close(
        with_flag.clone(),
        with_mask,
        "is_causal == explicit bottom-right mask",
    );
    let scores = q
        .matmul(k.swap_dims(2, 3))
        .mask_fill(bottom_right, f32::NEG_INFINITY)
        / (hd as f64).sqrt();
    let by_hand = burn::tensor::activation::softmax(scores, 3).matmul(v);
    assert_close(
        with_flag,
        by_hand,
        "is_causal == softmax(masked q kᵀ / √hd) v",
    );
}

/// The bottom-right mask of a cached step: new query i sees every past key and new keys ≤ i.
fn causal_mask_shape<B: Backend>(device: &B::Device) {
    let as_numbers = |mask: Tensor<B, 2, Bool>| {
        mask.float()
            .into_data()
            .convert::<f32>()
            .to_vec::<f32>()
            .unwrap()
    };
    assert_eq!(
        as_numbers(causal_mask::<B>(2, 3, device)),
        [0., 0., 0., 0., 1., 0., 0., 0., 0., 0.]
    );
    assert_eq!(
        as_numbers(causal_mask::<B>(3, 0, device)),
        [0., 1., 1., 0., 0., 1., 0., 0., 0.]
    );
}

/// Under autodiff the fused path (on ndarray and flex: the CPU kernel with its own backward)
/// gives the explicit path's outputs and the same gradients for the input and every parameter,
/// with padding (fully masked rows included) and across several kernel blocks.
fn fused_gradients_equal_explicit<B: Backend>(device: &B::Device) {
    for (i, &(batch, seq, width, heads, bias, padded)) in [
        (1, 6, 4, 2, false, false),
        (3, 7, 12, 3, true, false),
        (2, 9, 8, 2, true, true),
        (2, 150, 16, 2, true, true),
    ]
    .iter()
    .enumerate()
    {
        let config = MultiHeadAttentionConfig::new(width, width, seq, heads).with_qkv_bias(bias);
        let layer = seeded_layer::<Autodiff<B>>(&config, 40 + i as u64, device);
        let x = randn::<Autodiff<B>, 3>([batch, seq, width], 50 + i as u64, device).require_grad();
        let r = randn::<Autodiff<B>, 3>([batch, seq, width], 60 + i as u64, device);
        // Sequence 0 left-padded by 2 (its first rows see only padding), the others right-padded.
        let padding = padded.then(|| {
            let flags: Vec<bool> = (0..batch * seq)
                .map(|n| {
                    if n < seq {
                        n % seq < 2
                    } else {
                        n % seq >= seq - 3
                    }
                })
                .collect();
            Tensor::<Autodiff<B>, 2, Bool>::from_data(TensorData::new(flags, [batch, seq]), device)
        });
        let run = |path: AttentionPath| {
            let mut input = AttentionInput::new(x.clone()).path(path);
            if let Some(padding) = &padding {
                input = input.key_padding(padding.clone());
            }
            output_and_gradients(&layer, input, &x, r.clone())
        };
        for ((name, fused), (_, explicit)) in run(AttentionPath::Fused)
            .into_iter()
            .zip(run(AttentionPath::Explicit))
        {
            let what = format!("case {i}: fused vs explicit, {name}");
            attention_backends::compare::assert_close(&fused, &explicit, TOL, 1e-4, &what);
        }
    }
}

test_support::backend_tests!(
    fused_equals_explicit,
    fused_gradients_equal_explicit,
    cached_decoding_equals_full_forward,
    padded_batch_equals_each_sequence_alone,
    fully_masked_rows_are_finite,
    fused_op_conventions,
    causal_mask_shape,
    fused_op_reads_strided_views,
    cached_decoding_reproduces_the_fixtures,
);

/// The fused op reads keys and values that are views into larger storage (what a cache step
/// passes) as it reads contiguous ones.
fn fused_op_reads_strided_views<B: Backend>(device: &B::Device) {
    for (batch, heads, t_q, t_k, capacity) in [
        (2, 2, 1, 2, 5),
        (2, 4, 1, 3, 7),
        (1, 2, 2, 4, 6),
        (3, 3, 1, 5, 9),
    ] {
        let q = randn::<B, 4>([batch, heads, t_q, 4], 70, device);
        let storage_k = randn::<B, 4>([batch, heads, capacity, 4], 71, device);
        let storage_v = randn::<B, 4>([batch, heads, capacity, 4], 72, device);
        let options = AttentionModuleOptions {
            scale: None,
            softcap: None,
            is_causal: true,
        };
        let viewed = attention(
            q.clone(),
            storage_k.clone().narrow(2, 0, t_k),
            storage_v.clone().narrow(2, 0, t_k),
            None,
            None,
            options,
        );
        let copy =
            |t: Tensor<B, 4>| Tensor::<B, 4>::from_data(t.narrow(2, 0, t_k).into_data(), device);
        let contiguous = attention(q, copy(storage_k), copy(storage_v), None, None, options);
        assert_close(
            viewed,
            contiguous,
            &format!("views b{batch} h{heads} q{t_q} k{t_k} of {capacity}"),
        );
    }
}

/// Token-by-token decoding of every PyTorch fixture (weights loaded from the file) reproduces its
/// output: the cached path on imported weights, end to end; and no step waits for the device
/// (on Burn's fused wgpu, steps back to back are where its fusion once went wrong: see
/// `kernels/gpu/op.rs`, `end_step`).
fn cached_decoding_reproduces_the_fixtures<B: Backend>(device: &B::Device) {
    let syncs = attention_core::device_syncs();
    let mut fixtures = common::book_fixtures();
    fixtures.push(test_support::fixture(
        "gpt2_causal_s0_b2_t7_d16_h4.safetensors",
    ));
    for path in fixtures {
        let dict = attention_core::weights::StateDict::load(&path).unwrap();
        let heads = if dict.layout().unwrap() == attention_core::weights::WeightsLayout::Gpt2 {
            4
        } else {
            common::heads_of(&path)
        };
        let x = dict.tensor::<B, 3>("x", device).unwrap();
        let [batch, seq, _] = x.dims();
        let config = dict
            .infer_config(heads, dict.mask_context_length().unwrap().unwrap_or(seq))
            .unwrap();
        let layer = dict.to_layer::<B>(&config, device).unwrap();
        let mut cache = layer.new_cache();
        let steps: Vec<_> = (0..seq)
            .map(|t| {
                layer
                    .forward_cached(x.clone().slice([0..batch, t..t + 1]), &mut cache)
                    .unwrap()
            })
            .collect();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        attention_backends::compare::assert_close(
            &Tensor::cat(steps, 1).into_data(),
            dict.data("y").unwrap(),
            1e-5,
            1e-4,
            &name,
        );
    }
    assert_eq!(
        attention_core::device_syncs(),
        syncs,
        "decoding waited for the device"
    );
}

/// The sync counter counts: on a backend without a kernel of the crate's own (burn-ndarray with
/// 32-bit integers), whose queue the crate cannot reach, each step of a layer ends with a sync.
#[test]
fn a_backend_the_crate_cannot_drain_is_synced_each_step() {
    type Other = burn::backend::NdArray<f32, i32>;
    let device = Default::default();
    let layer = seeded_layer::<Other>(&MultiHeadAttentionConfig::new(8, 8, 16, 2), 3, &device);
    let mut cache = layer.new_cache();
    let syncs = attention_core::device_syncs();
    for t in 0..3 {
        let token = randn::<Other, 3>([1, 1, 8], 40 + t, &device);
        layer.forward_cached(token, &mut cache).unwrap();
    }
    assert_eq!(attention_core::device_syncs(), syncs + 3);
}

/// A cache that grows past its first allocations (64, then doubling) still equals the full
/// forward pass, on both paths.
#[test]
fn cache_growth_keeps_every_position() {
    type B = attention_backends::NdArray;
    let device = Default::default();
    let config = MultiHeadAttentionConfig::new(8, 8, 1 << 40, 2).with_qkv_bias(true);
    let layer = seeded_layer::<B>(&config, 7, &device);
    let seq = 150;
    let x = randn::<B, 3>([2, seq, 8], 8, &device);
    let full = layer.forward(x.clone());
    for path in [AttentionPath::Fused, AttentionPath::Explicit] {
        let mut cache = layer.new_cache();
        let mut outputs = vec![
            layer
                .forward_cached(
                    AttentionInput::new(x.clone().slice([0..2, 0..70])).path(path),
                    &mut cache,
                )
                .unwrap(),
        ];
        for t in 70..seq {
            let token = x.clone().slice([0..2, t..t + 1]);
            outputs.push(
                layer
                    .forward_cached(AttentionInput::new(token).path(path), &mut cache)
                    .unwrap(),
            );
        }
        assert_eq!(
            (cache.len(), cache.allocated()),
            (seq, 280),
            "70, then 140, then 280"
        );
        assert_close(Tensor::cat(outputs, 1), full.clone(), &format!("{path:?}"));
    }
}

/// The binaries' `--backend` list against the one list of kernel backends (`src/kernels/backends.rs`):
/// a backend added to either without the other fails here (the match is exhaustive).
#[test]
fn every_backend_of_the_binaries_has_the_kernel_the_kernel_list_gives_it() {
    use attention_backends::{Autodiff, BackendName, Flex, NdArray, Wgpu};
    use attention_core::Kernel;
    use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
    fn kernels<B: Backend>() -> [Option<Kernel>; 3] {
        [
            Kernel::of::<B>(),
            Kernel::of::<Autodiff<B>>(),
            Kernel::of::<Autodiff<B, BalancedCheckpointing>>(),
        ]
    }
    for backend in BackendName::ALL {
        let (found, expected) = match backend {
            BackendName::Ndarray => (kernels::<NdArray>(), Some(Kernel::Cpu)),
            BackendName::Flex => (kernels::<Flex>(), Some(Kernel::Cpu)),
            BackendName::Wgpu => (kernels::<Wgpu>(), Some(Kernel::Gpu)),
        };
        assert_eq!(found, [expected; 3], "{}", backend.name());
    }
    // Only a bare backend keeps a decoding cache in its kernel's storage.
    assert!(Kernel::keeps_cache::<NdArray>() && Kernel::keeps_cache::<Flex>());
    assert!(Kernel::keeps_cache::<Wgpu>());
    assert!(!Kernel::keeps_cache::<Autodiff<Flex>>() && !Kernel::keeps_cache::<Autodiff<Wgpu>>());
}
