//! The source chapter's example: batch 1, the six tokens 动手学大模型, 4 features, 2 heads,
//! dropout 0.1; prints the scores, the masked scores and the attention weights.

use attention_core::{AttentionTrace, MultiHeadAttention, MultiHeadAttentionConfig};
use burn::prelude::*;
use burn::tensor::Distribution;

use crate::cli::WalkthroughArgs;
use crate::{DemoBackend, DemoError, table};

/// The chapter's tokens.
pub const TOKENS: [&str; 6] = ["动", "手", "学", "大", "模", "型"];

/// The chapter's layer and input: `MultiHeadAttention(4, 4, 6, 0.1, 2)` and `randn(1, 6, 4)`,
/// from `seed`.
pub fn example<B: Backend>(seed: u64, device: &B::Device) -> (MultiHeadAttention<B>, Tensor<B, 3>) {
    B::seed(device, seed);
    let layer = MultiHeadAttentionConfig::new(4, 4, TOKENS.len(), 2)
        .with_dropout(0.1)
        .init(device);
    let x = Tensor::random([1, TOKENS.len(), 4], Distribution::Normal(0.0, 1.0), device);
    (layer, x)
}

pub fn run<B: Backend>(backend: &DemoBackend<B>, args: &WalkthroughArgs) -> Result<(), DemoError> {
    let (layer, x) = example::<B>(args.seed, &backend.device);
    println!(
        "Causal multi-head attention on {} (seed {})\n",
        backend.name, args.seed
    );
    println!(
        "input x: shape {:?} (batch, tokens {}, input_dim)\n",
        x.dims(),
        TOKENS.concat()
    );
    println!("layer:\n{layer}\n");
    let AttentionTrace {
        output,
        scores,
        masked_scores,
        weights,
    } = layer.forward_traced(x)?;
    let labels: Vec<String> = TOKENS.iter().map(|t| t.to_string()).collect();
    print_heads("1. attention scores q·kᵀ", &scores, &labels);
    print_heads(
        "2. masked scores (-inf above the diagonal: no token sees the future)",
        &masked_scores,
        &labels,
    );
    print_heads(
        "3. attention weights softmax(masked / √head_dim) (rows sum to 1)",
        &weights,
        &labels,
    );
    println!(
        "output: shape {:?} (batch, tokens, output_dim)",
        output.dims()
    );
    Ok(())
}

/// Prints every head of the first sequence of a `[batch, heads, seq, seq]` tensor.
fn print_heads<B: Backend>(title: &str, tensor: &Tensor<B, 4>, labels: &[String]) {
    let [_, heads, seq, _] = tensor.dims();
    let values = tensor
        .clone()
        .narrow(0, 0, 1)
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .expect("f32");
    println!("{title}: shape {:?}", tensor.dims());
    for head in 0..heads {
        println!("head {head}:");
        print!(
            "{}",
            table::matrix(labels, &values[head * seq * seq..(head + 1) * seq * seq])
        );
    }
    println!();
}
