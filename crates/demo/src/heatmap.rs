//! `heatmap`: attention weights as a PNG, one panel per head, token labels on both axes and a
//! colour scale; masked (future) cells are drawn grey so the causal triangle shows.

use std::path::Path;

use attention_core::weights::StateDict;
use plotters::prelude::*;
use plotters::style::{FontStyle, register_font};

use burn::prelude::*;

use crate::cli::HeatmapArgs;
use crate::io::read_tensor;
use crate::walkthrough::{TOKENS, example};
use crate::{DemoBackend, DemoError};

/// A font with printable ASCII and the chapter's characters (see `assets/README.md`).
const FONT: &[u8] = include_bytes!("../assets/cjk-subset.ttf");
const FONT_NAME: &str = "demo-cjk";
const PANEL: u32 = 440;
const SCALE_WIDTH: u32 = 110;
const MASKED: RGBColor = RGBColor(215, 215, 215);

pub fn run<B: Backend>(backend: &DemoBackend<B>, args: &HeatmapArgs) -> Result<(), DemoError> {
    let device = &backend.device;
    let (weights, labels, title) = match (&args.weights, &args.input, args.num_heads) {
        (Some(weights_path), Some(input), Some(num_heads)) => {
            let dict = StateDict::load(weights_path)?;
            let x = read_tensor::<B, 3>(input, "x", device)?;
            let [batch, seq, _] = x.dims();
            let context = dict.mask_context_length().unwrap_or(seq);
            let config = dict.infer_config(num_heads, context)?;
            let layer = dict.to_layer::<B>(&config, device)?;
            let trace = layer.forward_traced(x.slice([0..1.min(batch)]))?;
            let labels: Vec<String> = (0..seq).map(|i| i.to_string()).collect();
            (trace.weights, labels, format!("{}", weights_path.display()))
        }
        _ => {
            let (layer, x) = example::<B>(args.seed, device);
            let trace = layer.forward_traced(x)?;
            let labels: Vec<String> = TOKENS.iter().map(|t| t.to_string()).collect();
            (trace.weights, labels, format!("动手学大模型, seed {}", args.seed))
        }
    };
    let [_, heads, seq, _] = weights.dims();
    let values = weights.into_data().convert::<f32>().into_vec::<f32>().expect("f32");
    draw(&args.output, &values, heads, seq, &labels, &title)
        .map_err(|e| DemoError(format!("cannot draw {}: {e}", args.output.display())))?;
    println!("wrote {} ({heads} heads, {seq} tokens)", args.output.display());
    Ok(())
}

/// Draws `heads` panels of `[seq, seq]` weights (head-major `values`) and a colour scale.
fn draw(
    path: &Path,
    values: &[f32],
    heads: usize,
    seq: usize,
    labels: &[String],
    title: &str,
) -> Result<(), Box<dyn std::error::Error>> {
    register_font(FONT_NAME, FontStyle::Normal, FONT).map_err(|_| "the bundled font is invalid")?;
    let width = PANEL * heads as u32 + SCALE_WIDTH;
    let root = BitMapBackend::new(path, (width, PANEL + 40)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(&format!("attention weights: {title}"), (FONT_NAME, 22))?;
    let (panels, scale) = root.split_horizontally(PANEL * heads as u32);
    let label_size = if seq <= 16 { 18 } else { 12 };
    for (head, panel) in panels.split_evenly((1, heads)).iter().enumerate() {
        let mut chart = ChartBuilder::on(panel)
            .caption(format!("head {head}"), (FONT_NAME, 20))
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(40)
            .build_cartesian_2d((0..seq).into_segmented(), (0..seq).into_segmented())?;
        let label = |v: &SegmentValue<usize>| match v {
            SegmentValue::CenterOf(i) => labels.get(*i).cloned().unwrap_or_default(),
            _ => String::new(),
        };
        chart
            .configure_mesh()
            .disable_mesh()
            .x_labels(seq)
            .y_labels(seq)
            .x_label_formatter(&label)
            .y_label_formatter(&label)
            .x_desc("key")
            .y_desc("query")
            .label_style((FONT_NAME, label_size))
            .axis_desc_style((FONT_NAME, 14))
            .draw()?;
        let weights = &values[head * seq * seq..(head + 1) * seq * seq];
        chart.draw_series((0..seq).flat_map(|row| {
            (0..seq).map(move |col| {
                // Rows are drawn top-down: query 0 at the top.
                let y = seq - 1 - row;
                let colour = if col > row { MASKED } else { ViridisRGB::get_color(weights[row * seq + col]) };
                Rectangle::new(
                    [(SegmentValue::Exact(col), SegmentValue::Exact(y)), (SegmentValue::Exact(col + 1), SegmentValue::Exact(y + 1))],
                    colour.filled(),
                )
            })
        }))?;
        chart.configure_mesh().disable_mesh().y_label_formatter(&|v| label(&flip(v, seq))).draw()?;
    }
    draw_scale(&scale)?;
    root.present()?;
    Ok(())
}

/// Row labels count from the top; the chart's y axis counts from the bottom.
fn flip(v: &SegmentValue<usize>, seq: usize) -> SegmentValue<usize> {
    match v {
        SegmentValue::CenterOf(i) => SegmentValue::CenterOf(seq - 1 - i),
        other => other.clone(),
    }
}

/// The colour scale, 0 to 1, and the grey of masked cells.
fn draw_scale<DB: DrawingBackend>(area: &DrawingArea<DB, plotters::coord::Shift>) -> Result<(), Box<dyn std::error::Error>>
where
    DB::ErrorType: 'static,
{
    let mut chart = ChartBuilder::on(area)
        .margin_top(40)
        .margin_bottom(40)
        .margin_right(50)
        .y_label_area_size(0)
        .right_y_label_area_size(40)
        .build_cartesian_2d(0.0..1.0, 0.0..1.0)?;
    chart
        .configure_mesh()
        .disable_mesh()
        .disable_x_axis()
        .y_labels(6)
        .label_style((FONT_NAME, 14))
        .draw()?;
    let steps = 100;
    chart.draw_series((0..steps).map(|i| {
        let (lo, hi) = (i as f64 / steps as f64, (i + 1) as f64 / steps as f64);
        Rectangle::new([(0.0, lo), (1.0, hi)], ViridisRGB::get_color(lo as f32).filled())
    }))?;
    area.draw(&Text::new("grey: masked", (5, area.dim_in_pixel().1 as i32 - 25), (FONT_NAME, 13)))?;
    Ok(())
}
