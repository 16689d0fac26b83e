//! The workspace's pictures, as PNG files: attention heatmaps (one panel per head, labels on both
//! axes, a colour scale) and line charts (loss curves, timings). Text uses a bundled font with
//! printable ASCII and the chapter's Chinese characters, so labels never render as boxes.
#![warn(missing_docs)]

use std::path::Path;

use plotters::coord::Shift;
use plotters::coord::ranged1d::ValueFormatter;
use plotters::prelude::*;
use plotters::style::{FontStyle, register_font};

/// A subset of Droid Sans Fallback (see `assets/README.md`).
const FONT: &[u8] = include_bytes!("../assets/cjk-subset.ttf");
const FONT_NAME: &str = "attention-plots";
const PANEL: u32 = 440;
const SCALE_WIDTH: u32 = 110;
const MASKED: RGBColor = RGBColor(215, 215, 215);

/// A drawing failure.
pub type PlotError = Box<dyn std::error::Error>;

fn register() -> Result<(), PlotError> {
    register_font(FONT_NAME, FontStyle::Normal, FONT)
        .map_err(|_| "the bundled font is invalid".into())
}

/// Width in pixels of a heatmap of `heads` panels.
pub fn heatmap_width(heads: usize) -> u32 {
    PANEL * heads as u32 + SCALE_WIDTH
}

/// Draws `heads` panels of `[seq, seq]` attention weights (head-major `values`), `labels` on
/// both axes (queries top to bottom), a colour scale, and masked cells (above the diagonal) grey.
pub fn heatmap(
    path: &Path,
    values: &[f32],
    heads: usize,
    seq: usize,
    labels: &[String],
    title: &str,
) -> Result<(), PlotError> {
    register()?;
    let width = heatmap_width(heads);
    let root = BitMapBackend::new(path, (width, PANEL + 40)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(&format!("attention weights: {title}"), (FONT_NAME, 22))?;
    let (panels, scale) = root.split_horizontally(PANEL * heads as u32);
    let label_size = if seq <= 16 { 18 } else { 12 };
    for (head, panel) in panels.split_evenly((1, heads)).iter().enumerate() {
        let mut chart = ChartBuilder::on(panel)
            .caption(format!("head {head}"), (FONT_NAME, 20))
            .margin(10)
            .x_label_area_size(48)
            .y_label_area_size(48)
            // `(0..n).into_segmented()` has n + 1 segments.
            .build_cartesian_2d((0..seq - 1).into_segmented(), (0..seq - 1).into_segmented())?;
        let key_label = |v: &SegmentValue<usize>| match v {
            SegmentValue::CenterOf(i) => labels.get(*i).cloned().unwrap_or_default(),
            _ => String::new(),
        };
        // Queries top to bottom: the chart's y axis counts from the bottom.
        let query_label = |v: &SegmentValue<usize>| match v {
            SegmentValue::CenterOf(i) if *i < seq => labels[seq - 1 - i].clone(),
            _ => String::new(),
        };
        chart
            .configure_mesh()
            .disable_mesh()
            .x_labels(seq)
            .y_labels(seq)
            .x_label_formatter(&key_label)
            .y_label_formatter(&query_label)
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
                let colour = if col > row {
                    MASKED
                } else {
                    ViridisRGB::get_color(weights[row * seq + col])
                };
                Rectangle::new(
                    [
                        (SegmentValue::Exact(col), SegmentValue::Exact(y)),
                        (SegmentValue::Exact(col + 1), SegmentValue::Exact(y + 1)),
                    ],
                    colour.filled(),
                )
            })
        }))?;
    }
    draw_scale(&scale)?;
    root.present()?;
    Ok(())
}

/// The colour scale, 0 to 1, and the grey of masked cells.
fn draw_scale<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>) -> Result<(), PlotError>
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
        Rectangle::new(
            [(0.0, lo), (1.0, hi)],
            ViridisRGB::get_color(lo as f32).filled(),
        )
    }))?;
    area.draw(&Text::new(
        "grey: masked",
        (5, area.dim_in_pixel().1 as i32 - 25),
        (FONT_NAME, 13),
    ))?;
    Ok(())
}

/// One line of a [`line_chart`].
#[derive(Debug, Clone)]
pub struct Series {
    /// Legend text.
    pub label: String,
    /// `(x, y)` points, in order.
    pub points: Vec<(f64, f64)>,
    /// Drawn thick (the series that matters) or thin.
    pub emphasis: bool,
}

/// Axes of a [`line_chart`].
#[derive(Debug, Clone)]
pub struct Axes {
    /// Chart title.
    pub title: String,
    /// x-axis description.
    pub x: String,
    /// y-axis description.
    pub y: String,
    /// Logarithmic x and y (for timings over sizes).
    pub log: bool,
}

/// A line chart with a legend, 900×520.
pub fn line_chart(path: &Path, axes: &Axes, series: &[Series]) -> Result<(), PlotError> {
    register()?;
    let root = BitMapBackend::new(path, (900, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let points = series.iter().flat_map(|s| s.points.iter().copied());
    let (mut x_min, mut x_max, mut y_min, mut y_max) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for (x, y) in points {
        (x_min, x_max, y_min, y_max) = (x_min.min(x), x_max.max(x), y_min.min(y), y_max.max(y));
    }
    if x_min > x_max {
        return Err("nothing to plot".into());
    }
    let mut builder = ChartBuilder::on(&root);
    builder
        .caption(&axes.title, (FONT_NAME, 22))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(60);
    if axes.log {
        let chart = builder.build_cartesian_2d(
            (x_min..x_max * 1.05).log_scale(),
            (y_min * 0.8..y_max * 1.25).log_scale(),
        )?;
        draw_lines(chart, axes, series, 3)?;
    } else {
        let chart = builder.build_cartesian_2d(x_min..x_max, 0.0..y_max * 1.05)?;
        draw_lines(chart, axes, series, 0)?;
    }
    root.present()?;
    Ok(())
}

/// The mesh, the series (with markers of `point_size` pixels, none at 0) and the legend, on
/// either kind of axes.
fn draw_lines<'a, X, Y>(
    mut chart: ChartContext<'a, BitMapBackend<'a>, Cartesian2d<X, Y>>,
    axes: &Axes,
    series: &[Series],
    point_size: u32,
) -> Result<(), PlotError>
where
    X: Ranged<ValueType = f64> + ValueFormatter<f64>,
    Y: Ranged<ValueType = f64> + ValueFormatter<f64>,
{
    let palette = |i: usize| Palette99::pick(i).to_rgba();
    chart
        .configure_mesh()
        .x_desc(&axes.x)
        .y_desc(&axes.y)
        .label_style((FONT_NAME, 14))
        .draw()?;
    for (i, s) in series.iter().enumerate() {
        let style = palette(i).stroke_width(if s.emphasis { 3 } else { 1 });
        chart
            .draw_series(LineSeries::new(s.points.iter().copied(), style).point_size(point_size))?
            .label(&s.label)
            .legend(move |(x, y)| {
                PathElement::new([(x, y), (x + 20, y)], palette(i).stroke_width(3))
            });
    }
    chart
        .configure_series_labels()
        .label_font((FONT_NAME, 14))
        .border_style(BLACK)
        .background_style(WHITE.mix(0.85))
        .draw()?;
    Ok(())
}
