//! Packed documents through the whole model: a packed batch's loss and every parameter's
//! gradient equal those of the same documents run one per row (right-padded, padding keys
//! masked, padding labels ignored, the loss averaged over the same labels), with learned
//! positions (the book's GPT) and with rotary ones (a Llama-style decoder).

use attention_backends::{Flex, NdArray};
use attention_core::{
    AttentionError, Documents, MultiHeadAttentionConfig, RmsNormConfig, RopeConfig,
};
use burn::backend::Autodiff;
use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::{DropoutConfig, EmbeddingConfig, LinearConfig};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Bool, TensorData};
use gpt::{
    Activation, Decoder, DecoderBlock, DecoderError, GatedMlp, GptConfig, Labels, LmInput, Logits,
    Mlp, Norm, RowLayout, TokenRows,
};

const VOCAB: usize = 50;
/// Tokens per packed row, and the longest document.
const SEQ: usize = 8;
/// Documents of 3, 1, 4 and 8 tokens, packed in order into two rows of 8: boundaries after 3
/// and 4 tokens in the first row, one document filling the second. The 1-token document has no
/// label at all.
const PACKED: [&[usize]; 2] = [&[3, 1, 4], &[8]];

/// The tolerance of the loss and of every gradient, relative to the larger of its largest magnitude
/// and [`SCALE_FLOOR`]. The two layouts compute the same sums: on `NdArray<f64>` (in a process of
/// its own: Burn 0.21 keeps one default float type per device, set by the first backend to use it)
/// they agree to the last bit. In `f32`, rounding in another order (products of other shapes,
/// softmaxes over other widths) moves the token embedding's gradient, whose entries are sums that
/// largely cancel, by up to 3e-5 of its largest; every other tensor stays within 1e-5.
const TOLERANCE: f64 = 5e-5;
/// Below this, a gradient's largest magnitude is rounding of a zero (a key bias's, without
/// rotary positions: a shift of a whole row of scores leaves its softmax as it is).
const SCALE_FLOOR: f64 = 1e-3;

/// The documents' token ids, in order.
fn documents() -> Vec<Vec<u32>> {
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

fn int<B: Backend>(ids: Vec<i64>, shape: [usize; 2], device: &B::Device) -> Tensor<B, 2, Int> {
    Tensor::from_data(TensorData::new(ids, shape), device)
}

/// The documents packed into two rows, as [`LmInput::packed`] builds the input.
fn packed<B: Backend>(device: &B::Device) -> LmInput<B> {
    let ids: Vec<i64> = documents().concat().into_iter().map(i64::from).collect();
    let lengths: Vec<Vec<usize>> = PACKED.iter().map(|row| row.to_vec()).collect();
    let documents = Documents::from_lengths(&lengths).unwrap();
    LmInput::packed(int(ids, [2, SEQ], device), documents).unwrap()
}

/// The same documents one per row, right-padded to the longest, the padding's keys masked.
fn one_per_row<B: Backend>(device: &B::Device) -> LmInput<B> {
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

/// The book's GPT: learned positions, LayerNorm, gated GELU.
fn learned_positions<B: Backend>(device: &B::Device) -> Decoder<B> {
    B::seed(device, 11);
    GptConfig::new(VOCAB, SEQ, 16, 2, 2)
        .with_qkv_bias(true)
        .init(device)
}

/// A Llama-style decoder: rotary positions, grouped key/value heads, RMSNorm, SwiGLU, a tied
/// LM head.
fn rotary_positions<B: Backend>(device: &B::Device) -> Decoder<B> {
    B::seed(device, 12);
    let (width, hidden) = (16, 32);
    let norm = || Norm::Rms(RmsNormConfig::new(width).init(device));
    let linear = |i, o| LinearConfig::new(i, o).with_bias(false).init(device);
    let attention = MultiHeadAttentionConfig::new(width, width, SEQ, 4)
        .with_num_kv_heads(Some(2))
        .with_output_bias(false)
        .with_rope(Some(RopeConfig::new()));
    let block = || {
        DecoderBlock::pre_norm(
            norm(),
            attention.init(device),
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
    Decoder {
        token_embedding: EmbeddingConfig::new(VOCAB, width).init(device),
        embedding_scale: None,
        position_embedding: None,
        dropout: DropoutConfig::new(0.0).init(),
        blocks: (0..2).map(|_| block()).collect(),
        final_norm: norm(),
        lm_head: None,
        logit_softcap: None,
        packed_lm_head: Default::default(),
    }
}

/// Every parameter's gradient by its path in the model (`None` where it has none).
fn gradients<B: AutodiffBackend>(model: &Decoder<B>, grads: &B::Gradients) -> NamedGradients {
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
type NamedGradients = Vec<(String, Option<Vec<f64>>)>;

/// The loss (mean over the labels within documents), its label count and every gradient.
fn loss_and_gradients<B: AutodiffBackend>(
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
fn relative(a: &[f64], b: &[f64]) -> f64 {
    let scale = b.iter().fold(SCALE_FLOOR, |m, v| m.max(v.abs()));
    let diff = a.iter().zip(b).fold(0f64, |m, (x, y)| m.max((x - y).abs()));
    diff / scale
}

fn packed_rows_train_as_one_document_per_row<I: Backend>(
    name: &str,
    model_of: fn(&I::Device) -> Decoder<Autodiff<I>>,
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
        loss_difference <= TOLERANCE,
        "{name}: loss packed {packed_loss} vs one per row {padded_loss}"
    );
    assert_eq!(packed_grads.len(), padded_grads.len());
    for ((path, packed), (_, padded)) in packed_grads.iter().zip(&padded_grads) {
        let (Some(packed), Some(padded)) = (packed, padded) else {
            panic!("{name}: {path} has a gradient in only one layout, or none");
        };
        let difference = relative(packed, padded);
        assert!(
            difference <= TOLERANCE,
            "{name}: {path}'s gradient differs by {difference:e} (relative to its largest)"
        );
    }
}

#[test]
fn packed_rows_train_as_one_document_per_row_with_learned_positions() {
    packed_rows_train_as_one_document_per_row::<NdArray>("ndarray", learned_positions);
    packed_rows_train_as_one_document_per_row::<Flex>("flex", learned_positions);
}

#[test]
fn packed_rows_train_as_one_document_per_row_with_rotary_positions() {
    packed_rows_train_as_one_document_per_row::<NdArray>("ndarray", rotary_positions);
    packed_rows_train_as_one_document_per_row::<Flex>("flex", rotary_positions);
}

/// The packer lays these documents out as the test above does by hand.
#[test]
fn the_packer_gives_the_rows_and_documents_written_out_above() {
    let device = Default::default();
    let rows = TokenRows::new(&documents(), SEQ, RowLayout::Packed, 0).unwrap();
    assert_eq!(rows.len(), 2);
    let input = rows.input::<NdArray>(&[0, 1], &device).unwrap();
    let expected = packed::<NdArray>(&device);
    assert_eq!(input.tokens.into_data(), expected.tokens.into_data());
    assert_eq!(input.positions.into_data(), expected.positions.into_data());
    assert_eq!(input.documents, expected.documents);
    assert!(input.key_padding.is_none());
    let padded = TokenRows::new(&documents(), SEQ, RowLayout::OnePerRow, 0).unwrap();
    let input = padded.input::<NdArray>(&[0, 1, 2, 3], &device).unwrap();
    let expected = one_per_row::<NdArray>(&device);
    assert_eq!(input.tokens.into_data(), expected.tokens.into_data());
    assert_eq!(
        input.key_padding.map(Tensor::into_data),
        expected.key_padding.map(Tensor::into_data)
    );
    assert!(input.documents.is_none());
    assert_eq!(rows.labels(&[0, 1]), 12);
    assert_eq!(padded.labels(&[0, 1, 2, 3]), 12);
}

#[test]
fn documents_that_do_not_fit_the_input_are_refused() {
    let device = Default::default();
    let model = learned_positions::<NdArray>(&device);
    let one_row = Documents::from_lengths(&[vec![SEQ]]).unwrap();
    let tokens = packed::<NdArray>(&device).tokens;
    let shape_error = AttentionError::DocumentsShape {
        expected: [2, SEQ],
        found: [1, SEQ],
    };
    assert_eq!(
        LmInput::packed(tokens, one_row.clone()).map(drop),
        Err(shape_error.clone())
    );
    let mut input = packed::<NdArray>(&device);
    input.documents = Some(one_row);
    assert_eq!(
        model.next_token_loss(&input).map(drop),
        Err(DecoderError::Attention(shape_error.clone()))
    );
    assert_eq!(Labels::within_rows(&input).map(drop), Err(shape_error));
    let mut caches = model.new_caches();
    assert_eq!(
        model
            .try_forward(&packed(&device), Some(&mut caches[..]), Logits::All)
            .map(drop),
        Err(DecoderError::Attention(AttentionError::DocumentsWithCache))
    );
}
