//! Every bad input is an error value naming what was wrong, never a panic or a NaN.
//! Validation does not depend on the backend, so these run on ndarray alone.

use attention_backends::NdArray as B;
use attention_core::weights::{LayerWeights, StateDict, StateDictError, WeightsError};
use attention_core::{
    AttentionError, AttentionInput, AttentionPath, MultiHeadAttentionConfig, QkNormConfig,
    QkNormScope, RopeConfig,
};
use burn::prelude::*;
use burn::tensor::Bool;
use test_support::fixture;

fn device() -> burn::backend::ndarray::NdArrayDevice {
    Default::default()
}

fn layer() -> attention_core::MultiHeadAttention<B> {
    MultiHeadAttentionConfig::new(4, 6, 5, 2).init(&device())
}

#[test]
fn config_errors() {
    let err = |c: MultiHeadAttentionConfig| c.try_init::<B>(&device()).unwrap_err();
    assert_eq!(
        err(MultiHeadAttentionConfig::new(4, 6, 5, 4)),
        AttentionError::HeadsDoNotDivide {
            output_dim: 6,
            num_heads: 4
        }
    );
    for (config, name) in [
        (MultiHeadAttentionConfig::new(0, 6, 5, 2), "input_dim"),
        (MultiHeadAttentionConfig::new(4, 0, 5, 2), "output_dim"),
        (MultiHeadAttentionConfig::new(4, 6, 0, 2), "context_length"),
        (MultiHeadAttentionConfig::new(4, 6, 5, 0), "num_heads"),
    ] {
        assert_eq!(err(config), AttentionError::ZeroSize { name });
    }
    for p in [-0.1, 1.0, 1.5] {
        assert_eq!(
            err(MultiHeadAttentionConfig::new(4, 6, 5, 2).with_dropout(p)),
            AttentionError::DropoutOutOfRange(p)
        );
    }
    let nan = err(MultiHeadAttentionConfig::new(4, 6, 5, 2).with_dropout(f64::NAN));
    assert!(matches!(nan, AttentionError::DropoutOutOfRange(p) if p.is_nan()));
    assert!(
        MultiHeadAttentionConfig::new(4, 6, 5, 2)
            .with_dropout(0.99)
            .try_init::<B>(&device())
            .is_ok()
    );
}

#[test]
fn scale_and_softcap_must_be_finite_and_positive() {
    let err = |c: MultiHeadAttentionConfig| c.try_init::<B>(&device()).unwrap_err();
    let base = || MultiHeadAttentionConfig::new(8, 8, 16, 2);
    for value in [0.0, -0.5, f64::INFINITY] {
        assert_eq!(
            err(base().with_scale(Some(value))),
            AttentionError::ScoreParameter {
                name: "scale",
                value
            }
        );
        assert_eq!(
            err(base().with_softcap(Some(value))),
            AttentionError::ScoreParameter {
                name: "softcap",
                value
            }
        );
    }
    let nan = err(base().with_softcap(Some(f64::NAN)));
    assert!(
        matches!(nan, AttentionError::ScoreParameter { name: "softcap", value } if value.is_nan()),
        "{nan}"
    );
    assert_eq!(
        err(base().with_scale(Some(-1.0))).to_string(),
        "`scale` must be finite and positive, got -1"
    );
    let fine = base()
        .with_scale(Some(0.1))
        .with_softcap(Some(50.0))
        .with_sinks(true);
    assert_eq!(
        fine.try_init::<B>(&device()).unwrap().sinks.unwrap().dims(),
        [2]
    );
}

#[test]
fn qk_norm_and_partial_rotary_config_errors() {
    let err = |c: MultiHeadAttentionConfig| c.try_init::<B>(&device()).unwrap_err();
    // 2 heads of 4 features.
    let base = || MultiHeadAttentionConfig::new(8, 8, 16, 2);
    let qk_norm = |epsilon: f64| {
        base().with_qk_norm(Some(
            QkNormConfig::new(QkNormScope::Head).with_epsilon(epsilon),
        ))
    };
    for epsilon in [0.0, -1e-6, f64::INFINITY] {
        assert_eq!(
            err(qk_norm(epsilon)),
            AttentionError::QkNormEpsilon(epsilon)
        );
    }
    let nan = err(qk_norm(f64::NAN));
    assert!(
        matches!(nan, AttentionError::QkNormEpsilon(e) if e.is_nan()),
        "{nan}"
    );
    assert_eq!(
        err(qk_norm(0.0)).to_string(),
        "q/k norm `epsilon` must be finite and positive, got 0"
    );
    assert!(qk_norm(1e-5).try_init::<B>(&device()).is_ok());

    let rotary = |rotary_dim: usize| {
        base().with_rope(Some(RopeConfig::new().with_rotary_dim(Some(rotary_dim))))
    };
    assert_eq!(err(rotary(3)), AttentionError::RopeOddRotaryDim(3));
    assert_eq!(
        err(rotary(6)),
        AttentionError::RopeRotaryDimTooLarge {
            rotary_dim: 6,
            head_dim: 4
        }
    );
    assert_eq!(
        err(rotary(6)).to_string(),
        "rotary_dim (6) must be at most head_dim (4)"
    );
    assert_eq!(
        err(rotary(0)),
        AttentionError::ZeroSize { name: "rotary_dim" }
    );
    for rotary_dim in [2, 4] {
        assert!(rotary(rotary_dim).try_init::<B>(&device()).is_ok());
    }
    // Heads of 5 features: full RoPE needs an even width, a partial one only an even rotated
    // part.
    let odd = || MultiHeadAttentionConfig::new(8, 10, 16, 2);
    assert_eq!(
        err(odd().with_rope(Some(RopeConfig::new()))),
        AttentionError::RopeOddHeadDim(5)
    );
    let partial = RopeConfig::new().with_rotary_dim(Some(4));
    assert!(
        odd()
            .with_rope(Some(partial))
            .try_init::<B>(&device())
            .is_ok()
    );
}

/// A Llama-layout state dict of 2 heads of 4 features over 1 key/value head (q_proj `[8, 8]`,
/// k_proj and v_proj `[4, 8]`), with q/k norm weights of the given lengths.
fn llama_with_norms(norms: &[(&str, usize)]) -> StateDict {
    let projections = [
        ("q_proj.weight", [8, 8]),
        ("k_proj.weight", [4, 8]),
        ("v_proj.weight", [4, 8]),
        ("o_proj.weight", [8, 8]),
    ];
    StateDict::from_tensors(
        projections
            .into_iter()
            .map(|(key, shape)| (key.to_string(), TensorData::zeros::<f32, _>(shape)))
            .chain(
                norms
                    .iter()
                    .map(|&(key, len)| (key.to_string(), TensorData::ones::<f32, _>([len]))),
            ),
    )
}

#[test]
fn qk_norm_weight_errors_name_the_key() {
    // The norms' lengths say their scope: head_dim per head, the projected width over it.
    for (norms, scope) in [([4, 4], QkNormScope::Head), ([8, 4], QkNormScope::Width)] {
        let dict = llama_with_norms(&[("q_norm.weight", norms[0]), ("k_norm.weight", norms[1])]);
        let config = dict.infer_config(2, 8).unwrap();
        assert_eq!(config.qk_norm, Some(QkNormConfig::new(scope)));
        let layer = dict.to_layer::<B>(&config, &device()).unwrap();
        assert_eq!(layer.query_norm.as_ref().unwrap().width(), norms[0]);
        assert_eq!(layer.key_norm.as_ref().unwrap().width(), norms[1]);

        // Present without qk_norm, or a config of the other scope.
        let e = dict
            .to_layer::<B>(&config.clone().with_qk_norm(None), &device())
            .unwrap_err();
        assert!(
            matches!(&e, WeightsError::StateDict(StateDictError::UnexpectedKey { key, .. }) if key == "q_norm.weight"),
            "{e}"
        );
        let other = match scope {
            QkNormScope::Head => QkNormScope::Width,
            QkNormScope::Width => QkNormScope::Head,
        };
        let e = dict
            .to_layer::<B>(
                &config.with_qk_norm(Some(QkNormConfig::new(other))),
                &device(),
            )
            .unwrap_err();
        assert!(
            matches!(&e, WeightsError::StateDict(StateDictError::Shape { key, .. }) if key == "q_norm.weight"),
            "{e}"
        );
    }

    // Missing with qk_norm.
    let plain = llama_with_norms(&[]);
    let config = plain
        .infer_config(2, 8)
        .unwrap()
        .with_qk_norm(Some(QkNormConfig::new(QkNormScope::Head)));
    let e = plain.to_layer::<B>(&config, &device()).unwrap_err();
    assert!(
        matches!(&e, WeightsError::StateDict(StateDictError::MissingKey { key }) if key == "q_norm.weight"),
        "{e}"
    );

    // One norm without the other, a key norm of the query's width, a length of neither scope.
    let e = llama_with_norms(&[("q_norm.weight", 4)])
        .infer_config(2, 8)
        .unwrap_err();
    assert!(
        matches!(&e, WeightsError::StateDict(StateDictError::MissingKey { key }) if key == "k_norm.weight"),
        "{e}"
    );
    let e = llama_with_norms(&[("q_norm.weight", 8), ("k_norm.weight", 8)])
        .infer_config(2, 8)
        .unwrap_err();
    assert!(
        matches!(&e, WeightsError::StateDict(StateDictError::Shape { key, expected, found, .. }) if key == "k_norm.weight" && expected == &[4] && found == &[8]),
        "{e}"
    );
    let e = llama_with_norms(&[("q_norm.weight", 5), ("k_norm.weight", 4)])
        .infer_config(2, 8)
        .unwrap_err();
    assert!(
        matches!(&e, WeightsError::StateDict(StateDictError::Shape { key, .. }) if key == "q_norm.weight"),
        "{e}"
    );
}

#[test]
#[should_panic(expected = "`output_dim` (6) must be divisible by `num_heads` (4)")]
fn init_panics_with_the_same_message() {
    MultiHeadAttentionConfig::new(4, 6, 5, 4).init::<B>(&device());
}

#[test]
fn forward_errors() {
    let layer = layer();
    let x = |shape: [usize; 3]| Tensor::<B, 3>::zeros(shape, &device());
    assert_eq!(
        layer.try_forward(x([1, 3, 5])).unwrap_err(),
        AttentionError::InputDim {
            expected: 4,
            found: 5
        }
    );
    assert_eq!(
        layer.try_forward(x([1, 6, 4])).unwrap_err(),
        AttentionError::ContextOverflow {
            seq: 6,
            context_length: 5
        }
    );
    assert_eq!(
        layer.try_forward(x([1, 0, 4])).unwrap_err(),
        AttentionError::EmptySequence
    );
    assert_eq!(
        layer.forward_traced(x([1, 0, 4])).unwrap_err(),
        AttentionError::EmptySequence
    );
    let padding = Tensor::<B, 2, Bool>::empty([1, 4], &device());
    assert_eq!(
        layer
            .try_forward(AttentionInput::new(x([1, 3, 4])).key_padding(padding))
            .unwrap_err(),
        AttentionError::PaddingShape {
            expected: [1, 3],
            found: [1, 4]
        }
    );
    assert!(layer.try_forward(x([2, 5, 4])).is_ok());
}

#[test]
#[should_panic(expected = "sequence of 6 tokens exceeds context_length = 5")]
fn forward_panics_with_the_same_message() {
    layer().forward(Tensor::zeros([1, 6, 4], &device()));
}

#[test]
fn cache_errors_leave_the_cache_as_it_was() {
    let layer = layer();
    let mut cache = layer.new_cache();
    layer
        .forward_cached(Tensor::zeros([2, 3, 4], &device()), &mut cache)
        .unwrap();
    assert_eq!(cache.len(), 3);
    assert_eq!(
        layer
            .forward_cached(Tensor::zeros([2, 3, 4], &device()), &mut cache)
            .unwrap_err(),
        AttentionError::ContextOverflow {
            seq: 6,
            context_length: 5
        }
    );
    assert_eq!(
        layer
            .forward_cached(Tensor::zeros([1, 1, 4], &device()), &mut cache)
            .unwrap_err(),
        AttentionError::CacheBatch {
            expected: 2,
            found: 1
        }
    );
    let other = MultiHeadAttentionConfig::new(4, 6, 5, 3).init::<B>(&device());
    assert!(matches!(
        other.forward_cached(Tensor::zeros([2, 1, 4], &device()), &mut cache),
        Err(AttentionError::CacheLayout { .. })
    ));
    assert_eq!(cache.len(), 3, "failed steps must not change the cache");
    layer
        .forward_cached(Tensor::zeros([2, 2, 4], &device()), &mut cache)
        .unwrap();
    assert_eq!(cache.len(), 5);
    cache.reset();
    assert!(cache.is_empty() && cache.batch_size().is_none());
    layer
        .forward_cached(Tensor::zeros([1, 5, 4], &device()), &mut cache)
        .unwrap();
}

/// A copy of the `b2_t5_i8_o8_h2_bias` weights with `edit` applied, as an in-memory state dict.
fn edited(edit: impl FnOnce(&mut Vec<(String, TensorData)>)) -> StateDict {
    let source = StateDict::load(fixture("book_s0_b2_t5_i8_o8_h2_bias.safetensors")).unwrap();
    let mut tensors: Vec<(String, TensorData)> = source
        .keys()
        .filter(|k| k.ends_with(".weight") || k.ends_with(".bias"))
        .map(|k| (k.to_string(), source.data(k).unwrap().clone()))
        .collect();
    edit(&mut tensors);
    StateDict::from_tensors(tensors)
}

fn bias_config() -> MultiHeadAttentionConfig {
    MultiHeadAttentionConfig::new(8, 8, 8, 2).with_qkv_bias(true)
}

#[test]
fn weight_errors_name_the_key_and_shapes() {
    let missing = edited(|t| t.retain(|(k, _)| k != "key_layer.weight"));
    let e = missing
        .to_layer::<B>(&bias_config(), &device())
        .unwrap_err();
    assert!(
        matches!(&e, WeightsError::StateDict(StateDictError::MissingKey { key }) if key == "key_layer.weight"),
        "{e}"
    );

    let misshapen = edited(|t| {
        for (k, v) in t.iter_mut() {
            if k == "value_layer.weight" {
                *v = TensorData::zeros::<f32, _>([8, 7]);
            }
        }
    });
    let e = misshapen
        .to_layer::<B>(&bias_config(), &device())
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "`value_layer.weight` has shape [8, 7], expected [8, 8]"
    );

    // The file has Q/K/V biases, the config says there are none.
    let e = edited(|_| {})
        .to_layer::<B>(&bias_config().with_qkv_bias(false), &device())
        .unwrap_err();
    assert!(
        matches!(&e, WeightsError::StateDict(StateDictError::UnexpectedKey { key, .. }) if key == "query_layer.bias"),
        "{e}"
    );

    // Weights of another width than the config.
    let e = edited(|_| {})
        .to_layer::<B>(
            &MultiHeadAttentionConfig::new(8, 6, 8, 2).with_qkv_bias(true),
            &device(),
        )
        .unwrap_err();
    assert!(
        matches!(&e, WeightsError::StateDict(StateDictError::Shape { key, expected, found, .. }) if key == "query_layer.weight" && expected == &[6, 8] && found == &[8, 8]),
        "{e}"
    );

    // Heads that do not divide the width.
    let e = edited(|_| {}).infer_config(3, 8).unwrap_err();
    assert!(
        matches!(
            e,
            WeightsError::Config(AttentionError::HeadsDoNotDivide { .. })
        ),
        "{e}"
    );

    let e = edited(|t| t.retain(|(k, _)| !k.starts_with("query_layer")))
        .infer_config(2, 8)
        .unwrap_err();
    assert!(matches!(e, WeightsError::UnknownLayout { .. }), "{e}");
}

#[test]
fn the_mask_buffer_is_accepted_and_ignored() {
    let dict = StateDict::load(fixture("book_s0_b2_t5_i8_o8_h2_bias.pt")).unwrap();
    assert_eq!(dict.shape("mask"), Some(&[8usize, 8][..]));
    assert_eq!(dict.mask_context_length().unwrap(), Some(8));
    let config = dict.infer_config(2, 8).unwrap();
    assert!(config.qkv_bias && config.input_dim == 8 && config.output_dim == 8);
    dict.to_layer::<B>(&config, &device()).unwrap();
}

#[test]
fn empty_batches_are_errors_on_every_path() {
    let layer = layer();
    let x = Tensor::<B, 3>::zeros([0, 3, 4], &device());
    for path in [
        AttentionPath::Explicit,
        AttentionPath::Fused,
        AttentionPath::Auto,
    ] {
        let input = AttentionInput::new(x.clone()).path(path);
        assert_eq!(
            layer.try_forward(input).unwrap_err(),
            AttentionError::EmptyBatch
        );
    }
    assert_eq!(
        layer.forward_traced(x.clone()).unwrap_err(),
        AttentionError::EmptyBatch
    );
    let mut cache = layer.new_cache();
    assert_eq!(
        layer.forward_cached(x, &mut cache).unwrap_err(),
        AttentionError::EmptyBatch
    );
    assert!(cache.is_empty());
}

#[test]
fn explicit_attention_too_large_to_materialize_is_refused_up_front() {
    // 40 000 tokens, 2 heads: [1, 2, 40000, 40000] f32 scores are 11.9 GiB per tensor.
    let layer = MultiHeadAttentionConfig::new(4, 6, 100_000, 2).init::<B>(&device());
    let x = Tensor::<B, 3>::zeros([1, 40_000, 4], &device());
    let too_large = |e: AttentionError| {
        assert!(
            matches!(
                e,
                AttentionError::ExplicitTooLarge {
                    shape: [1, 2, 40_000, 40_000],
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("--path fused"), "{e}");
    };
    too_large(layer.forward_traced(x.clone()).unwrap_err());
    let explicit = AttentionInput::new(x.clone()).path(AttentionPath::Explicit);
    too_large(layer.try_forward(explicit).unwrap_err());
    let mut cache = layer.new_cache();
    too_large(
        layer
            .forward_cached(
                AttentionInput::new(x).path(AttentionPath::Explicit),
                &mut cache,
            )
            .unwrap_err(),
    );
    assert!(cache.is_empty(), "the cache is untouched");
}

#[test]
fn a_huge_context_costs_nothing_until_used() {
    // The cache grows with the positions it holds, not with context_length.
    let layer = MultiHeadAttentionConfig::new(4, 6, usize::MAX, 2).init::<B>(&device());
    let mut cache = layer.new_cache();
    let x = Tensor::<B, 3>::ones([2, 3, 4], &device());
    let y = layer.forward_cached(x.clone(), &mut cache).unwrap();
    assert_eq!(y.dims(), [2, 3, 6]);
    assert_eq!(cache.len(), 3);
    assert_eq!(
        cache.allocated(),
        attention_core::KvCache::<B>::MIN_POSITIONS
    );
    assert_eq!(layer.forward(x).dims(), [2, 3, 6]);
}

#[test]
fn file_errors_speak_in_the_users_terms() {
    // A tensor of the wrong rank says how many dimensions were expected.
    let dict = StateDict::from_tensors([("x".to_string(), TensorData::zeros::<f32, _>([2, 3]))]);
    let e = dict.tensor::<B, 3>("x", &device()).unwrap_err();
    assert_eq!(
        e.to_string(),
        "`x` has shape [2, 3], expected a tensor of 3 dimensions"
    );

    // Weights saved transposed ([in, out] instead of nn.Linear's [out, in]), not square.
    let source = StateDict::load(fixture("book_s0_b3_t7_i10_o12_h3_nobias.safetensors")).unwrap();
    let transposed = StateDict::from_tensors(
        source
            .keys()
            .filter(|k| k.ends_with(".weight"))
            .map(|k| {
                let w = source.tensor::<B, 2>(k, &device()).unwrap();
                (k.to_string(), w.transpose().into_data())
            })
            .chain(
                source
                    .keys()
                    .filter(|k| k.ends_with(".bias"))
                    .map(|k| (k.to_string(), source.data(k).unwrap().clone())),
            ),
    );
    let e = transposed.infer_config(3, 7).unwrap_err();
    let message = e.to_string();
    assert!(
        message.starts_with("`output_layer.weight` has shape [12, 12], expected [12, 10]"),
        "{message}"
    );
    assert!(message.contains("nn.Linear stores [out, in]"), "{message}");

    // The chapter's mask buffer must be [C, C].
    let mut tensors: Vec<(String, TensorData)> = source
        .keys()
        .map(|k| (k.to_string(), source.data(k).unwrap().clone()))
        .collect();
    tensors.push(("mask".into(), TensorData::from([1.0f32])));
    let e = StateDict::from_tensors(tensors)
        .mask_context_length()
        .unwrap_err();
    assert!(e.to_string().starts_with("`mask` has shape [1]"), "{e}");
}
