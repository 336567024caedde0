//! Training curves as a PNG, drawn from a run's `log.jsonl` (one [`StepLog`] per line).
//!
//! Invariants: the picture is a pure function of the log (a resumed run's curves continue the same
//! lines); a log line that does not parse is an error naming its line, never skipped silently;
//! the PNG is written atomically.

use crate::{Result, TrainError};
use dflash_plot::{Figure, Panel, Series};
use serde::Deserialize;
use std::path::Path;

/// The fields of a log line the curves use.
#[derive(Debug, Clone, Deserialize)]
pub struct LoggedStep {
    pub step: usize,
    pub loss: f64,
    pub accuracy: Vec<f64>,
    pub streak: f64,
    pub lr: f64,
    pub grad_norm: f64,
    pub tokens_per_second: f64,
}

/// Reads `log.jsonl`.
pub fn read_log(path: &Path) -> Result<Vec<LoggedStep>> {
    let text = std::fs::read_to_string(path).map_err(|e| TrainError::Io {
        path: path.display().to_string(),
        source: e,
    })?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l)
                .map_err(|e| TrainError::InvalidInput(format!("{}:{}: {e}", path.display(), i + 1)))
        })
        .collect()
}

/// Mean over a trailing window of `w` steps (the raw per-step values are noisy).
fn smooth(points: &[(f64, f64)], w: usize) -> Vec<(f64, f64)> {
    let w = w.max(1);
    let mut sum = 0.0;
    points
        .iter()
        .enumerate()
        .map(|(i, &(x, y))| {
            sum += y;
            if i >= w {
                sum -= points[i - w].1;
            }
            (x, sum / (i + 1).min(w) as f64)
        })
        .collect()
}

/// The figure of a run: loss (log scale), per-row accuracy, streak, learning rate, gradient norm
/// and throughput against the step.
pub fn curves_figure(log: &[LoggedStep], title: &str) -> Figure {
    let w = (log.len() / 50).max(1);
    let of = |f: &dyn Fn(&LoggedStep) -> f64| -> Vec<(f64, f64)> {
        log.iter().map(|s| (s.step as f64, f(s))).collect()
    };
    let rows = log.first().map(|s| s.accuracy.len()).unwrap_or(0);
    let mut acc: Vec<Series> = [1usize, 2, 4, 8, 15]
        .iter()
        .filter(|&&k| k <= rows)
        .map(|&k| {
            let pts = of(&|s| s.accuracy.get(k - 1).copied().unwrap_or(f64::NAN));
            Series::new(format!("row {k}"), smooth(&pts, w))
        })
        .collect();
    if acc.is_empty() {
        acc.push(Series::new("row 1", vec![]));
    }
    let smoothed = if w > 1 {
        format!(" (mean of {w} steps)")
    } else {
        String::new()
    };
    let panel = |title: &str, y: &str, series: Vec<Series>, log_y: bool| Panel {
        title: title.into(),
        x_label: "step".into(),
        y_label: y.into(),
        series,
        log_y,
    };
    Figure {
        title: title.into(),
        panels: vec![
            panel(
                "training loss",
                "decay-weighted CE",
                vec![
                    Series::new("per step", of(&|s| s.loss)),
                    Series::new(format!("mean of {w}"), smooth(&of(&|s| s.loss), w)),
                ],
                true,
            ),
            panel(
                &format!("argmax accuracy per block row{smoothed}"),
                "accuracy",
                acc,
                false,
            ),
            panel(
                &format!("teacher-forced streak{smoothed}"),
                "1 + leading run",
                vec![Series::new("streak", smooth(&of(&|s| s.streak), w))],
                false,
            ),
            panel(
                "learning rate",
                "lr",
                vec![Series::new("lr", of(&|s| s.lr))],
                false,
            ),
            panel(
                "gradient norm (before clipping)",
                "L2 norm",
                vec![Series::new("grad norm", of(&|s| s.grad_norm))],
                true,
            ),
            panel(
                "throughput",
                "sequence tokens / s",
                vec![Series::new(
                    "tok/s",
                    smooth(&of(&|s| s.tokens_per_second), w),
                )],
                false,
            ),
        ],
        columns: 2,
        panel_width: 640,
        panel_height: 400,
    }
}

/// Draws `log` (a run's `log.jsonl`) into `png`.
pub fn write_curves(log: &Path, png: &Path, title: &str) -> Result<()> {
    let steps = read_log(log)?;
    if steps.is_empty() {
        return Err(TrainError::InvalidInput(format!(
            "{}: no training steps logged",
            log.display()
        )));
    }
    curves_figure(&steps, title).save_png(png)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smoothing_is_a_trailing_mean() {
        let p = [(0.0, 1.0), (1.0, 3.0), (2.0, 5.0), (3.0, 7.0)];
        let s = smooth(&p, 2);
        assert_eq!(s, vec![(0.0, 1.0), (1.0, 2.0), (2.0, 4.0), (3.0, 6.0)]);
    }

    #[test]
    fn curves_render_from_a_log_and_bad_lines_name_the_place() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("log.jsonl");
        let mut text = String::new();
        for s in 1..=30 {
            text.push_str(&format!(
                "{{\"step\":{s},\"total_steps\":30,\"loss\":{},\"accuracy\":[{},0.1,0.05],\
                 \"streak\":1.2,\"lr\":0.001,\"grad_norm\":2.0,\"sequences\":3,\"blocks\":40,\
                 \"tokens_per_second\":900.0,\"drafter_mfu\":0.0,\"seconds\":0.1}}\n",
                10.0 / s as f64,
                s as f64 / 40.0
            ));
        }
        std::fs::write(&log, &text).unwrap();
        let png = dir.path().join("curves.png");
        write_curves(&log, &png, "test run").unwrap();
        let bytes = std::fs::read(&png).unwrap();
        assert_eq!(&bytes[1..4], b"PNG");
        text.push_str("{\"step\": oops}\n");
        std::fs::write(&log, &text).unwrap();
        let err = write_curves(&log, &png, "t").unwrap_err().to_string();
        assert!(err.contains("log.jsonl:31"), "{err}");
        std::fs::write(&log, "").unwrap();
        assert!(
            write_curves(&log, &png, "t").is_err(),
            "an empty log is refused"
        );
    }
}
