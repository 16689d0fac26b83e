//! The layer owns what it allocates.

use burn::backend::Flex;

use super::*;

/// The layer's packed weights live and die with it: its forward on a CPU backend packs its
/// projections' weights into its own caches, and once the layer is dropped nothing but the
/// caller's tensor holds a weight's buffer.
#[test]
fn the_layer_owns_its_packed_weights() {
    let device = Default::default();
    let layer = MultiHeadAttentionConfig::new(16, 16, 8, 2).init::<Flex>(&device);
    let x = Tensor::<Flex, 3>::ones([1, 3, 16], &device);
    layer.forward(x);
    assert!(
        layer.packed_inputs.is_packed(),
        "queries, keys and values packed"
    );
    assert!(
        layer.packed_output.is_packed(),
        "the output projection packed"
    );
    let weights = [&layer.query_layer, &layer.output_layer].map(|linear| linear.weight.val());
    drop(layer);
    for weight in weights {
        assert!(
            weight.into_primitive().tensor().is_unique(),
            "released with the layer"
        );
    }
}
