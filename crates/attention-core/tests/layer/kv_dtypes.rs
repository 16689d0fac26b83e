//! Caches that store keys and values in fewer bytes ([`KvDtype`]). Where a kernel reads them
//! (the CPU kernel on ndarray and flex: every type; the GPU kernel on wgpu: f16 and int8): a
//! prefill and decoding steps through a narrow cache lose no more than each type promises
//! against the f32 cache, a narrow page pool gives what the narrow dense cache gives, and an int8
//! cache refuses a non-finite key without changing. Where nothing reads them (bf16 on the GPU,
//! the explicit path) a narrow cache is a typed error that changes nothing.

use crate::common::{randn, seeded_layer};

use attention_core::{
    AttentionError, AttentionInput, AttentionPath, Kernel, KvDtype, MultiHeadAttentionConfig,
    PagePool, PageTable, RopeConfig,
};
use burn::prelude::*;

const CONTEXT: usize = 300;
const NARROW: [KvDtype; 3] = [KvDtype::F16, KvDtype::Bf16, KvDtype::Int8];

/// Heads of 64, as GPT-2's; grouped with rotary positions and sinks, as Llama's and gpt-oss's.
fn configs() -> [MultiHeadAttentionConfig; 2] {
    [
        MultiHeadAttentionConfig::new(256, 256, CONTEXT, 4).with_qkv_bias(true),
        MultiHeadAttentionConfig::new(256, 256, CONTEXT, 4)
            .with_num_kv_heads(Some(2))
            .with_rope(Some(RopeConfig::new()))
            .with_sinks(true),
    ]
}

fn floats<B: Backend>(tensor: Tensor<B, 3>) -> Vec<f64> {
    tensor.into_data().convert::<f64>().to_vec().unwrap()
}

/// The relative L2 error of `found` against `want`.
fn relative_l2<B: Backend>(found: Tensor<B, 3>, want: Tensor<B, 3>) -> f64 {
    test_support::relative_l2(&floats(found), &floats(want))
}

/// The most each type may lose against the f32 cache, relative L2 of a step's outputs.
fn bound(kv_dtype: KvDtype) -> f64 {
    match kv_dtype {
        KvDtype::Model => 0.0,
        KvDtype::F16 => 1e-3,
        KvDtype::Bf16 => 1e-2,
        KvDtype::Int8 => 0.015,
    }
}

/// How far a narrow page pool's outputs may be from the narrow dense cache's. On the GPU the
/// projections of the pool's packed tokens and of the cache's batch round differently in their
/// last bits (Burn's matmul tiles each shape its own way), and int8's rounding now and then turns
/// such a difference into one quantum of a key or value: the kernels' own agreement on the same
/// stored values is checked to 1e-5 in attention-core's kernel tests.
fn paged_bound<B: Backend>(kv_dtype: KvDtype) -> f64 {
    match (Kernel::of::<B>(), kv_dtype) {
        (Some(Kernel::Gpu), KvDtype::Int8) => 1e-4,
        _ => 1e-5,
    }
}

/// The narrow types `B`'s kernel reads in a cache, and those it refuses.
fn read_and_refused<B: Backend>() -> (Vec<KvDtype>, Vec<KvDtype>) {
    NARROW
        .into_iter()
        .partition(|&kv_dtype| match Kernel::of::<B>() {
            Some(Kernel::Cpu) => true,
            Some(Kernel::Gpu) => kv_dtype != KvDtype::Bf16,
            None => false,
        })
}

/// A prompt of 200 then three decoding steps, batch 2, through the f32 cache and each narrow
/// one; and the same through a narrow page pool, sequence by sequence.
pub fn narrow_caches_track_the_f32_cache<B: Backend>(device: &B::Device) {
    let (read, refused) = read_and_refused::<B>();
    narrow_caches_are_refused::<B>(&refused, device);
    for config in configs() {
        let layer = seeded_layer::<B>(&config, 5, device);
        let x = randn::<B, 3>([2, 203, 256], 7, device);
        let chunks = || [(0, 200), (200, 1), (201, 1), (202, 1)];
        let mut f32_cache = layer.new_cache();
        let want: Vec<Tensor<B, 3>> = chunks()
            .map(|(at, len)| {
                let chunk = x.clone().narrow(1, at, len);
                layer.forward_cached(chunk, &mut f32_cache).unwrap()
            })
            .into();
        for &kv_dtype in &read {
            let what = format!("{kv_dtype}, {} kv heads", config.num_kv_heads());
            let mut cache = layer.new_cache().with_kv_dtype(kv_dtype);
            let mut pool = PagePool::new(8, 64).unwrap().with_kv_dtype(kv_dtype);
            let mut pages = layer.new_pages(&pool).unwrap();
            let mut tables = [0, 1].map(|_| PageTable::new(CONTEXT, None));
            for ((at, len), want) in chunks().into_iter().zip(&want) {
                let chunk = x.clone().narrow(1, at, len);
                let found = layer.forward_cached(chunk.clone(), &mut cache).unwrap();
                let error = relative_l2(found.clone(), want.clone());
                assert!(
                    error <= bound(kv_dtype),
                    "{what}: {len} tokens at {at} off by {error:e}"
                );
                assert!(error > 0.0, "{what}: the cache rounds nothing");
                // The pool's step: both sequences' chunks packed along one axis.
                let [a, b] = &mut tables;
                let step = pool.step(&mut [(a, len), (b, len)]).unwrap();
                let packed = Tensor::cat(
                    vec![chunk.clone().narrow(0, 0, 1), chunk.narrow(0, 1, 1)],
                    1,
                );
                let paged = layer.forward_paged(packed, &step, &mut pages).unwrap();
                let paged = Tensor::cat(
                    vec![paged.clone().narrow(1, 0, len), paged.narrow(1, len, len)],
                    0,
                );
                let difference = relative_l2(paged, found);
                assert!(
                    difference <= paged_bound::<B>(kv_dtype),
                    "{what}: {len} tokens at {at}: paged off the dense cache by {difference:e}"
                );
            }
            assert_eq!(cache.kv_dtype(), kv_dtype);
            let bytes = pages.bytes_per_position();
            assert_eq!(
                bytes,
                2 * config.num_kv_heads() * kv_dtype.row_bytes(64, 4),
                "{what}: bytes per position"
            );
        }
    }
}

/// A cache or pool of a type no kernel reads on `B` is a typed error, and the cache is as it
/// was.
fn narrow_caches_are_refused<B: Backend>(refused: &[KvDtype], device: &B::Device) {
    let [config, _] = configs();
    let layer = seeded_layer::<B>(&config, 5, device);
    let x = randn::<B, 3>([1, 3, 256], 7, device);
    for &kv_dtype in refused {
        let mut cache = layer.new_cache().with_kv_dtype(kv_dtype);
        let error = layer.forward_cached(x.clone(), &mut cache).unwrap_err();
        assert!(
            matches!(error, AttentionError::KvDtypeUnsupported { kv_dtype: found, .. } if found == kv_dtype),
            "{error}"
        );
        assert_eq!(cache.len(), 0);
        let pool = PagePool::new(4, 64).unwrap().with_kv_dtype(kv_dtype);
        assert!(matches!(
            layer.new_pages(&pool),
            Err(AttentionError::KvDtypeUnsupported { .. })
        ));
    }
}

/// An int8 cache refuses a NaN key (the dense cache and the pool alike), says where, and is as it
/// was: the next finite step gives what it gives on a cache that never saw the NaN. The explicit
/// path, which keeps its cache in Burn tensors, refuses a narrow cache.
pub fn bad_keys_for_a_narrow_cache_are_typed_errors<B: Backend>(device: &B::Device) {
    if !read_and_refused::<B>().0.contains(&KvDtype::Int8) {
        return;
    }
    let [config, _] = configs();
    let layer = seeded_layer::<B>(&config, 5, device);
    let x = randn::<B, 3>([2, 6, 256], 7, device);
    let mut cache = layer.new_cache().with_kv_dtype(KvDtype::Int8);
    let mut clean = layer.new_cache().with_kv_dtype(KvDtype::Int8);
    for cache in [&mut cache, &mut clean] {
        layer
            .forward_cached(x.clone().narrow(1, 0, 4), cache)
            .unwrap();
    }
    // NaN in every feature of sequence 1's second new token: its key and value are NaN.
    let nan = x.clone().narrow(1, 4, 2).slice_assign(
        [1..2, 1..2, 0..256],
        Tensor::full([1, 1, 256], f32::NAN, device),
    );
    let error = layer.forward_cached(nan, &mut cache).unwrap_err();
    assert!(
        matches!(
            error,
            AttentionError::NonFiniteKv {
                sequence: 1,
                position: 5,
                ..
            }
        ),
        "{error}"
    );
    assert_eq!(cache.len(), 4, "the refused step is not cached");
    let next = x.clone().narrow(1, 4, 2);
    let found = layer.forward_cached(next.clone(), &mut cache).unwrap();
    let want = layer.forward_cached(next, &mut clean).unwrap();
    assert_eq!(floats(found), floats(want));

    let mut pool = PagePool::new(4, 64).unwrap().with_kv_dtype(KvDtype::Int8);
    let mut pages = layer.new_pages(&pool).unwrap();
    let mut tables = [0, 1].map(|_| PageTable::new(CONTEXT, None));
    let [a, b] = &mut tables;
    let step = pool.step(&mut [(a, 2), (b, 3)]).unwrap();
    let packed = Tensor::cat(
        vec![
            x.clone().narrow(0, 0, 1).narrow(1, 0, 2),
            x.clone().narrow(0, 1, 1).narrow(1, 0, 3).slice_assign(
                [0..1, 2..3, 0..256],
                Tensor::full([1, 1, 256], f32::INFINITY, device),
            ),
        ],
        1,
    );
    let error = layer.forward_paged(packed, &step, &mut pages).unwrap_err();
    assert!(
        matches!(
            error,
            AttentionError::NonFiniteKv {
                sequence: 1,
                position: 2,
                ..
            }
        ),
        "{error}"
    );

    let mut narrow = layer.new_cache().with_kv_dtype(KvDtype::F16);
    let explicit = AttentionInput::new(x.narrow(1, 0, 2)).path(AttentionPath::Explicit);
    let error = layer.forward_cached(explicit, &mut narrow).unwrap_err();
    assert!(
        matches!(error, AttentionError::KvDtypeUnsupported { .. }),
        "{error}"
    );
    assert_eq!(narrow.len(), 0);
}

test_support::backend_tests!(
    narrow_caches_track_the_f32_cache,
    bad_keys_for_a_narrow_cache_are_typed_errors,
);
