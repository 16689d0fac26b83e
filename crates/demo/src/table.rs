//! Printing `[seq, seq]` matrices with token labels on rows and columns, aligned in a terminal
//! (CJK characters take two cells).

use std::fmt::Write;

/// Width of one printed column, in terminal cells.
const CELL: usize = 9;

/// Terminal cells `text` takes: East Asian wide characters count two.
fn display_width(text: &str) -> usize {
    text.chars()
        .map(|c| if matches!(c as u32, 0x1100..=0x115F | 0x2E80..=0xA4CF | 0xAC00..=0xD7A3 | 0xF900..=0xFAFF | 0xFF00..=0xFF60) { 2 } else { 1 })
        .sum()
}

/// `text` right-aligned in `width` cells.
fn pad_left(text: &str, width: usize) -> String {
    let padding = width.saturating_sub(display_width(text));
    format!("{}{text}", " ".repeat(padding))
}

/// One head's `[rows, cols]` matrix (row-major `values`) as text, `-inf` spelled out.
pub fn matrix(labels: &[String], values: &[f32]) -> String {
    let n = labels.len();
    let label_width = labels.iter().map(|l| display_width(l)).max().unwrap_or(0) + 2;
    let mut out = " ".repeat(label_width);
    for label in labels {
        out += &pad_left(label, CELL);
    }
    out.push('\n');
    for (row, label) in labels.iter().enumerate() {
        out += &pad_left(label, label_width);
        for value in &values[row * n..(row + 1) * n] {
            let cell = if *value == f32::NEG_INFINITY {
                "-inf".to_string()
            } else {
                format!("{value:.4}")
            };
            let _ = write!(out, "{}", pad_left(&cell, CELL));
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cjk_labels_align_with_ascii_cells() {
        let labels = vec!["动".to_string(), "手".to_string()];
        let text = matrix(&labels, &[1.0, f32::NEG_INFINITY, 0.25, 0.75]);
        let lines: Vec<_> = text.lines().collect();
        assert_eq!(
            lines[1],
            format!("  动{}{}", pad_left("1.0000", CELL), pad_left("-inf", CELL))
        );
        assert!(
            lines.iter().all(|l| display_width(l) == 4 + 2 * CELL),
            "{text}"
        );
    }
}
