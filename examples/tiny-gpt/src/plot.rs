//! The loss curve as a PNG.

use std::path::Path;

use attention_plots::{Axes, PlotError, Series, line_chart};

/// Training loss per step, validation loss at checkpoints, the unigram baseline and the 60% mark.
pub fn loss_curve(
    path: &Path,
    train: &[(usize, f64)],
    valid: &[(usize, f64)],
    unigram: f64,
) -> Result<(), PlotError> {
    let last = train.last().map_or(1, |&(s, _)| s) as f64;
    let line = |label: &str, points: Vec<(f64, f64)>, emphasis| Series {
        label: label.to_string(),
        points,
        emphasis,
    };
    let at = |points: &[(usize, f64)]| points.iter().map(|&(s, l)| (s as f64, l)).collect();
    line_chart(
        path,
        &Axes {
            title: "tiny-gpt: next-byte cross-entropy (nats)".into(),
            x: "step".into(),
            y: "loss".into(),
            log: false,
        },
        &[
            line("train", at(train), false),
            line("validation", at(valid), true),
            line(
                "unigram baseline",
                vec![(0.0, unigram), (last, unigram)],
                false,
            ),
            line(
                "60% of unigram",
                vec![(0.0, 0.6 * unigram), (last, 0.6 * unigram)],
                false,
            ),
        ],
    )
}
