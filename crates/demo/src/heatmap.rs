//! `heatmap`: attention weights as a PNG, one panel per head, token labels on both axes and a
//! colour scale; masked (future) cells are drawn grey so the causal triangle shows.

use attention_core::weights::{LayerWeights, StateDict};
use burn::prelude::*;
use tensor_files::OutputFile;

use crate::cli::HeatmapArgs;
use crate::io::read_tensor;
use crate::walkthrough::{TOKENS, example};
use crate::{DemoBackend, DemoError};

pub fn run<B: Backend>(backend: &DemoBackend<B>, args: &HeatmapArgs) -> Result<(), DemoError> {
    let device = &backend.device;
    let inputs: Vec<(&str, &std::path::Path)> =
        [("--weights", &args.weights), ("--input", &args.input)]
            .into_iter()
            .filter_map(|(role, path)| path.as_deref().map(|path| (role, path)))
            .collect();
    let output = OutputFile::new(&args.output, &inputs)?;
    let (weights, labels, title) = match (&args.weights, &args.input, args.num_heads) {
        (Some(weights_path), Some(input), Some(num_heads)) => {
            let dict = StateDict::load(weights_path)?;
            let x = read_tensor::<B, 3>(input, "x", device)?;
            let [batch, seq, _] = x.dims();
            if batch == 0 {
                return Err(DemoError(format!(
                    "{}: `x` has an empty batch (shape {:?}): nothing to draw",
                    input.display(),
                    x.dims()
                )));
            }
            let context = dict.mask_context_length()?.unwrap_or(seq);
            let config = dict.infer_config(num_heads, context)?;
            let layer = dict.to_layer::<B>(&config, device)?;
            let trace = layer.forward_traced(x.narrow(0, 0, 1))?;
            let labels: Vec<String> = (0..seq).map(|i| i.to_string()).collect();
            (trace.weights, labels, format!("{}", weights_path.display()))
        }
        _ => {
            let (layer, x) = example::<B>(args.seed, device);
            let trace = layer.forward_traced(x)?;
            let labels: Vec<String> = TOKENS.iter().map(|t| t.to_string()).collect();
            (
                trace.weights,
                labels,
                format!("动手学大模型, seed {}", args.seed),
            )
        }
    };
    let [_, heads, seq, _] = weights.dims();
    let values = weights
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .expect("f32");
    if let Some(bad) = values.iter().find(|v| !v.is_finite()) {
        return Err(DemoError(format!(
            "the attention weights are not finite ({bad}): the weights or the input hold NaN or \
             infinite values; nothing drawn"
        )));
    }
    output
        .write_to_path(|path| attention_plots::heatmap(path, &values, heads, seq, &labels, &title))
        .map_err(|e| DemoError(format!("cannot draw {}: {e}", args.output.display())))?;
    println!(
        "wrote {} ({heads} heads, {seq} tokens)",
        args.output.display()
    );
    Ok(())
}
