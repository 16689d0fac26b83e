//! The packed-documents check shared by `model/documents.rs` (f32, ndarray and flex) and
//! `packed_f64.rs` (f64, in a process of its own): documents of 3, 1, 4 and 8 tokens packed into
//! two rows against the same documents one per row, through the book's GPT and a Llama-style
//! decoder; the loss and every parameter's gradient compared.

use attention_core::{Documents, MultiHeadAttentionConfig, RmsNormConfig, RopeConfig};
use burn::backend::Autodiff;
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::nn::{DropoutConfig, EmbeddingConfig, LinearConfig};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Bool, TensorData};
use gpt::{Activation, Decoder, DecoderBlock, GatedMlp, GptConfig, Labels, LmInput, Mlp, Norm};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

pub const VOCAB: usize = 50;
/// Tokens per packed row, and the longest document.
pub const SEQ: usize = 8;
/// Documents of 3, 1, 4 and 8 tokens, packed in order into two rows of 8: boundaries after 3
/// and 4 tokens in the first row, one document filling the second. The 1-token document has no
/// label at all.
pub const PACKED: [&[usize]; 2] = [&[3, 1, 4], &[8]];

/// Below this, a gradient's largest magnitude is rounding of a zero (a key bias's, without
/// rotary positions: a shift of a whole row of scores leaves its softmax as it is).
pub const SCALE_FLOOR: f64 = 1e-3;

/// The documents' token ids, in order.
pub fn documents() -> Vec<Vec<u32>> {
    let mut next = 0u32;
    PACKED
        .iter()
        .flat_map(|row| row.iter())
        .map(|&length| {
            let document = (next..next + length as u32)
                .map(|i| (7 * i + 3) % VOCAB as u32)
                .collect();
            next += length as u32;
            document
        })
        .collect()
}

pub fn int<B: Backend>(ids: Vec<i64>, shape: [usize; 2], device: &B::Device) -> Tensor<B, 2, Int> {
    Tensor::from_data(TensorData::new(ids, shape), device)
}

/// The documents packed into two rows, as [`LmInput::packed`] builds the input.
pub fn packed<B: Backend>(device: &B::Device) -> LmInput<B> {
    let ids: Vec<i64> = documents().concat().into_iter().map(i64::from).collect();
    let lengths: Vec<Vec<usize>> = PACKED.iter().map(|row| row.to_vec()).collect();
    let documents = Documents::from_lengths(&lengths).unwrap();
    LmInput::packed(int(ids, [2, SEQ], device), documents).unwrap()
}

/// The same documents one per row, right-padded to the longest, the padding's keys masked.
pub fn one_per_row<B: Backend>(device: &B::Device) -> LmInput<B> {
    let documents = documents();
    let (mut ids, mut padding) = (Vec::new(), Vec::new());
    for document in &documents {
        ids.extend(document.iter().map(|&id| i64::from(id)));
        ids.extend(std::iter::repeat_n(0, SEQ - document.len()));
        padding.extend((0..SEQ).map(|i| i >= document.len()));
    }
    let shape = [documents.len(), SEQ];
    let mut input = LmInput::after(int(ids, shape, device), 0);
    input.key_padding = Some(Tensor::<B, 2, Bool>::from_data(
        TensorData::new(padding, shape),
        device,
    ));
    input
}

/// Replaces every parameter with values from a generator of this test's own. `B::seed` seeds
/// one generator for the whole process, and tests running beside each other draw from it in
/// any order: models seeded that way differ from run to run, and so do their rounding errors.
struct OwnWeights(StdRng);

impl<B: Backend> ModuleMapper<B> for OwnWeights {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let shape = tensor.shape();
        // A matrix is `[in, out]`: scaled as Burn's default initialization scales it. A vector
        // (a bias, a norm's scale or shift) is drawn around one, so no norm scales a row to zero.
        let (centre, half_width) = match D {
            1 => (1.0, 0.5),
            _ => (0.0, 1.0 / (shape.dims::<D>()[0] as f64).sqrt()),
        };
        let values: Vec<f32> = (0..shape.num_elements())
            .map(|_| (centre + half_width * self.0.random_range(-1.0..1.0)) as f32)
            .collect();
        let value = Tensor::from_data(TensorData::new(values, shape), &tensor.device())
            .set_require_grad(tensor.is_require_grad());
        Param::from_mapped_value(id, value, mapper)
    }
}

fn with_own_weights<B: Backend>(model: Decoder<B>, seed: u64) -> Decoder<B> {
    model.map(&mut OwnWeights(StdRng::seed_from_u64(seed)))
}

/// The book's GPT: learned positions, LayerNorm, gated GELU.
pub fn learned_positions<B: Backend>(device: &B::Device) -> Decoder<B> {
    book_gpt(device, SEQ)
}

/// The book's GPT with `context` positions.
pub fn book_gpt<B: Backend>(device: &B::Device, context: usize) -> Decoder<B> {
    let model = GptConfig::new(VOCAB, context, 16, 2, 2)
        .with_qkv_bias(true)
        .init(device);
    with_own_weights(model, 11)
}

/// A Llama-style decoder: rotary positions, grouped key/value heads, RMSNorm, SwiGLU, a tied
/// LM head.
pub fn rotary_positions<B: Backend>(device: &B::Device) -> Decoder<B> {
    llama_style(device, SEQ, [None, None])
}

/// The Llama-style decoder with `context` positions, each of its two blocks attending with its
/// own sliding window (or none): Gemma's and Qwen's models window some layers only.
pub fn llama_style<B: Backend>(
    device: &B::Device,
    context: usize,
    windows: [Option<usize>; 2],
) -> Decoder<B> {
    let (width, hidden) = (16, 32);
    let norm = || Norm::Rms(RmsNormConfig::new(width).init(device));
    let linear = |i, o| LinearConfig::new(i, o).with_bias(false).init(device);
    let attention = MultiHeadAttentionConfig::new(width, width, context, 4)
        .with_num_kv_heads(Some(2))
        .with_output_bias(false)
        .with_rope(Some(RopeConfig::new()));
    let block = |window| {
        DecoderBlock::pre_norm(
            norm(),
            attention.clone().with_sliding_window(window).init(device),
            norm(),
            Mlp::Gated(GatedMlp {
                gate: linear(width, hidden),
                up: linear(width, hidden),
                down: linear(hidden, width),
                activation: Activation::Silu,
                packed_gate_up: Default::default(),
                packed_down: Default::default(),
            }),
        )
    };
    let model = Decoder {
        token_embedding: EmbeddingConfig::new(VOCAB, width).init(device),
        embedding_scale: None,
        position_embedding: None,
        dropout: DropoutConfig::new(0.0).init(),
        blocks: windows.into_iter().map(block).collect(),
        final_norm: norm(),
        lm_head: None,
        logit_softcap: None,
        packed_lm_head: Default::default(),
    };
    with_own_weights(model, 12)
}

/// Every parameter's gradient by its path in the model (`None` where it has none).
pub fn gradients<B: AutodiffBackend>(model: &Decoder<B>, grads: &B::Gradients) -> NamedGradients {
    struct Collect<'a, B: AutodiffBackend> {
        grads: &'a B::Gradients,
        path: Vec<String>,
        found: NamedGradients,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Collect<'_, B> {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let grad = param.val().grad(self.grads).map(|grad| {
                grad.into_data()
                    .convert::<f64>()
                    .into_vec::<f64>()
                    .expect("f64 gradients")
            });
            self.found.push((self.path.join("."), grad));
        }
    }
    let mut collect = Collect::<B> {
        grads,
        path: Vec::new(),
        found: Vec::new(),
    };
    model.visit(&mut collect);
    collect.found
}

/// Every parameter's gradient by name (`None` for a parameter outside the loss).
pub type NamedGradients = Vec<(String, Option<Vec<f64>>)>;

/// The loss (mean over the labels within documents), its label count and every gradient.
pub fn loss_and_gradients<B: AutodiffBackend>(
    model: &Decoder<B>,
    input: &LmInput<B>,
) -> (f64, i64, NamedGradients) {
    let count = Labels::within_rows(input)
        .unwrap()
        .count()
        .into_scalar()
        .elem::<i64>();
    let loss = model.next_token_loss(input).unwrap();
    let value = loss.clone().into_scalar().elem::<f64>();
    let grads = loss.backward();
    (value, count, gradients(model, &grads))
}

/// `max |a − b| / max(max |b|, SCALE_FLOOR)`.
pub fn relative(a: &[f64], b: &[f64]) -> f64 {
    let scale = b.iter().fold(SCALE_FLOOR, |m, v| m.max(v.abs()));
    let diff = a.iter().zip(b).fold(0f64, |m, (x, y)| m.max((x - y).abs()));
    diff / scale
}

/// The check itself: packed against one per row on `I`, within `tolerance`.
pub fn packed_rows_train_as_one_document_per_row<I: Backend>(
    name: &str,
    model_of: fn(&I::Device) -> Decoder<Autodiff<I>>,
    tolerance: f64,
) {
    let device = Default::default();
    let model = model_of(&device);
    // One pass at a time, each graph consumed by its own backward pass.
    let (packed_loss, packed_count, packed_grads) =
        loss_and_gradients(&model, &packed::<Autodiff<I>>(&device));
    let (padded_loss, padded_count, padded_grads) =
        loss_and_gradients(&model, &one_per_row::<Autodiff<I>>(&device));
    // A document of L tokens has L − 1 labels either way: 2 + 0 + 3 + 7.
    assert_eq!((packed_count, padded_count), (12, 12), "{name}");
    assert!(packed_loss.is_finite(), "{name}: loss {packed_loss}");
    let loss_difference = relative(&[packed_loss], &[padded_loss]);
    assert!(
        loss_difference <= tolerance,
        "{name}: loss packed {packed_loss} vs one per row {padded_loss}"
    );
    assert_eq!(packed_grads.len(), padded_grads.len());
    for ((path, packed), (_, padded)) in packed_grads.iter().zip(&padded_grads) {
        let (Some(packed), Some(padded)) = (packed, padded) else {
            panic!("{name}: {path} has a gradient in only one layout, or none");
        };
        let difference = relative(packed, padded);
        assert!(
            difference <= tolerance,
            "{name}: {path}'s gradient differs by {difference:e} (relative to its largest)"
        );
    }
}
