//! Packed documents through the whole model: a packed batch's loss and every parameter's
//! gradient equal those of the same documents run one per row (right-padded, padding keys
//! masked, padding labels ignored, the loss averaged over the same labels), with learned
//! positions (the book's GPT) and with rotary ones (a Llama-style decoder).

use crate::packed::*;

use attention_backends::{Flex, NdArray};
use attention_core::{AttentionError, Documents};
use burn::prelude::*;
use gpt::{DecoderError, Labels, LmInput, Logits, RowLayout, TokenRows};

/// The tolerance of the loss and of every gradient in `f32`, relative to the larger of its largest
/// magnitude and `SCALE_FLOOR`. The two layouts compute the same sums: in `f64` they agree to
/// the last bit (`packed_f64.rs`). In `f32` they round in another order (products of other
/// shapes, softmaxes over other widths), and gradients whose entries are sums that largely
/// cancel move by up to a few times 1e-5 of their largest. A key that sees across a document's
/// boundary moves the loss alone by more than 5e-2.
const F32_TOLERANCE: f64 = 2e-4;

#[test]
fn packed_rows_train_as_one_document_per_row_with_learned_positions() {
    packed_rows_train_as_one_document_per_row::<NdArray>(
        "ndarray",
        learned_positions,
        F32_TOLERANCE,
    );
    packed_rows_train_as_one_document_per_row::<Flex>("flex", learned_positions, F32_TOLERANCE);
}

#[test]
fn packed_rows_train_as_one_document_per_row_with_rotary_positions() {
    packed_rows_train_as_one_document_per_row::<NdArray>(
        "ndarray",
        rotary_positions,
        F32_TOLERANCE,
    );
    packed_rows_train_as_one_document_per_row::<Flex>("flex", rotary_positions, F32_TOLERANCE);
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
