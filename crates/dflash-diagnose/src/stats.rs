//! Hidden-state statistics of the drafter's taps: measured now, recorded at training time in the
//! drafter directory's `tap_stats.json`, and compared.
//!
//! Invariants:
//! - Statistics cover the answer rows only (the target's own text, not the prompt's template and
//!   attention-sink rows) of each declared tap layer: `mean` and `std` over every element, `norm`
//!   the mean L2 norm of a row; accumulated in f64.
//! - `tap_stats.json` is written atomically ([`dflash_core::fs::write_atomic`]) and
//!   read strictly: an unreadable or malformed file is bad input, never silently ignored.
//! - [`judge`]: a relative change above [`MAX_RELATIVE_CHANGE`] in `std` or `norm` of any tap the
//!   file records is a FAIL; a declared tap the file lacks is a warn; no file is ok with a note.

use crate::{Check, DiagnoseError, Result, Sample, Verdict};
use candle_core::{DType, Tensor};
use dflash_models::TargetModel;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;

/// The file name in a drafter directory.
pub const TAP_STATS_FILE: &str = "tap_stats.json";
/// Largest relative change of `std` or `norm` that is not a FAIL.
pub const MAX_RELATIVE_CHANGE: f64 = 0.25;

/// One tap layer's statistics.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TapStat {
    pub mean: f64,
    pub std: f64,
    /// Mean L2 norm of a row.
    pub norm: f64,
}

/// `tap_stats.json`: per tap layer (its id as the key) statistics, and what they were taken on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TapStatsFile {
    pub version: u32,
    /// The target's compute dtype.
    pub dtype: String,
    /// Rows (answer tokens) the statistics cover.
    pub rows: usize,
    pub layers: BTreeMap<String, TapStat>,
}

/// Sums towards a [`TapStatsFile`].
pub struct TapStatsAccumulator {
    dtype: DType,
    /// layer → (Σx, Σx², elements, Σ row norm, rows)
    sums: BTreeMap<usize, (f64, f64, usize, f64, usize)>,
}

impl TapStatsAccumulator {
    pub fn new(layers: &[usize], dtype: DType) -> Self {
        Self {
            dtype,
            sums: layers.iter().map(|&l| (l, (0.0, 0.0, 0, 0.0, 0))).collect(),
        }
    }

    /// Adds rows `[n, H]` of tap layer `layer`.
    pub fn add(&mut self, layer: usize, rows: &Tensor) -> Result<()> {
        let x = rows.to_dtype(DType::F32)?;
        let (n, h) = x.dims2()?;
        let sum = x.sum_all()?.to_scalar::<f32>()? as f64;
        let sq = x.sqr()?;
        let sumsq = sq.sum_all()?.to_scalar::<f32>()? as f64;
        let norms = sq.sum(1)?.sqrt()?.sum_all()?.to_scalar::<f32>()? as f64;
        let e = self.sums.entry(layer).or_default();
        e.0 += sum;
        e.1 += sumsq;
        e.2 += n * h;
        e.3 += norms;
        e.4 += n;
        Ok(())
    }

    pub fn finish(self) -> TapStatsFile {
        let rows = self.sums.values().map(|s| s.4).max().unwrap_or(0);
        TapStatsFile {
            version: 1,
            dtype: format!("{:?}", self.dtype).to_lowercase(),
            rows,
            layers: self
                .sums
                .into_iter()
                .map(|(l, (s, sq, n, norms, r))| {
                    let n = n.max(1) as f64;
                    let mean = s / n;
                    let var = (sq / n - mean * mean).max(0.0);
                    (
                        l.to_string(),
                        TapStat {
                            mean,
                            std: var.sqrt(),
                            norm: norms / r.max(1) as f64,
                        },
                    )
                })
                .collect(),
        }
    }
}

/// Reads `dir/tap_stats.json`, `None` when there is none.
pub fn read_tap_stats(dir: &Path) -> Result<Option<TapStatsFile>> {
    let path = dir.join(TAP_STATS_FILE);
    if !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&path).map_err(|e| DiagnoseError::BadFile {
        path: path.display().to_string(),
        msg: e.to_string(),
    })?;
    let f: TapStatsFile = serde_json::from_str(&text).map_err(|e| DiagnoseError::BadFile {
        path: path.display().to_string(),
        msg: e.to_string(),
    })?;
    if f.version != 1 {
        return Err(DiagnoseError::BadFile {
            path: path.display().to_string(),
            msg: format!("version {} (this build reads 1)", f.version),
        });
    }
    Ok(Some(f))
}

/// Writes `stats` to `dir/tap_stats.json` atomically (what `train` records for `diagnose`).
pub fn write_tap_stats(dir: &Path, stats: &TapStatsFile) -> Result<()> {
    let path = dir.join(TAP_STATS_FILE);
    let text = serde_json::to_string_pretty(stats).expect("plain data serialises") + "\n";
    dflash_core::fs::write_atomic(&path, text.as_bytes()).map_err(|source| DiagnoseError::Io {
        path: path.display().to_string(),
        source,
    })
}

/// The statistics of tap `layers` over the answer rows of `samples` (one target forward each):
/// what `train` records, taken as the conventions scan takes its declared row's.
pub fn measure(
    target: &dyn TargetModel,
    layers: &[usize],
    samples: &[Sample],
) -> Result<TapStatsFile> {
    let info = target.info();
    let h = info.hidden_size;
    let mut acc = TapStatsAccumulator::new(layers, info.dtype);
    for s in samples {
        let (start, end) = (s.prompt_len, s.tokens.len());
        if end <= start {
            continue;
        }
        let taps = dflash_train::sequence_taps(target, &s.tokens, layers)?;
        for (i, &l) in layers.iter().enumerate() {
            acc.add(l, &taps.narrow(0, start, end - start)?.narrow(1, i * h, h)?)?;
        }
    }
    Ok(acc.finish())
}

/// Statistics measured now and those recorded, if any.
#[derive(Debug, Clone, Serialize)]
pub struct StatsReport {
    pub measured: TapStatsFile,
    pub recorded: Option<TapStatsFile>,
}

fn rel(now: f64, then: f64) -> f64 {
    (now - then).abs() / then.abs().max(1e-12)
}

/// The verdict (see the module's invariants).
pub fn judge(measured: &TapStatsFile, recorded: Option<&TapStatsFile>) -> Check {
    const NAME: &str = "tap_statistics";
    // layer ids in numeric order (the map's keys sort as strings)
    let mut layers: Vec<(&String, &TapStat)> = measured.layers.iter().collect();
    layers.sort_by_key(|(l, _)| l.parse::<usize>().unwrap_or(usize::MAX));
    let now: Vec<String> = layers
        .iter()
        .map(|(l, s)| format!("{l}: std {:.3} norm {:.2}", s.std, s.norm))
        .collect();
    let Some(rec) = recorded else {
        return Check::ok(
            NAME,
            format!(
                "{}; no training-time statistics recorded ({TAP_STATS_FILE})",
                now.join(", ")
            ),
        );
    };
    let mut worst: Option<(String, &str, f64, f64, f64)> = None;
    let mut missing = vec![];
    let mut lines = vec![];
    for &(l, s) in &layers {
        let Some(r) = rec.layers.get(l) else {
            missing.push(l.clone());
            continue;
        };
        for (what, a, b) in [("std", s.std, r.std), ("norm", s.norm, r.norm)] {
            let d = rel(a, b);
            if worst.as_ref().is_none_or(|w| d > w.4) {
                worst = Some((l.clone(), what, a, b, d));
            }
        }
        lines.push(format!(
            "{l}: std {:.3} (was {:.3}) norm {:.2} (was {:.2})",
            s.std, r.std, s.norm, r.norm
        ));
    }
    let mut evidence = lines.join(", ");
    if let Some((l, what, a, b, d)) = &worst {
        evidence += &format!(
            "; largest change: tap {l} {what} {a:.3} vs {b:.3} ({:.0} %)",
            d * 100.0
        );
    }
    if let Some((l, what, _, _, d)) = worst.filter(|w| w.4 > MAX_RELATIVE_CHANGE) {
        return Check {
            check: NAME.into(),
            verdict: Verdict::Fail,
            evidence,
            cause: format!(
                "tap {l}'s {what} moved {:.0} % (> {:.0} %) from training: taps from another layer path or dtype (recorded {}, now {})",
                d * 100.0,
                MAX_RELATIVE_CHANGE * 100.0,
                rec.dtype,
                measured.dtype
            ),
            fix: "run the target as in training (same model class / checkpoint, same dtype), or retrain the drafter on this target's taps".into(),
        };
    }
    if !missing.is_empty() {
        return Check {
            check: NAME.into(),
            verdict: Verdict::Warn,
            evidence,
            cause: format!(
                "{TAP_STATS_FILE} records no statistics for declared tap(s) {}: recorded for other layers",
                missing.join(", ")
            ),
            fix: "rerecord the statistics with the drafter's taps (dflash diagnose --record-stats)".into(),
        };
    }
    Check::ok(NAME, evidence)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(std: f64, norm: f64, layers: &[usize]) -> TapStatsFile {
        TapStatsFile {
            version: 1,
            dtype: "f32".into(),
            rows: 10,
            layers: layers
                .iter()
                .map(|l| {
                    (
                        l.to_string(),
                        TapStat {
                            mean: 0.0,
                            std,
                            norm,
                        },
                    )
                })
                .collect(),
        }
    }

    #[test]
    fn accumulated_statistics_match_a_direct_computation() {
        let dev = candle_core::Device::Cpu;
        let a = Tensor::new(&[[3f32, 4.0], [0.0, 0.0]], &dev).unwrap();
        let b = Tensor::new(&[[1f32, -1.0]], &dev).unwrap();
        let mut acc = TapStatsAccumulator::new(&[7], DType::F32);
        acc.add(7, &a).unwrap();
        acc.add(7, &b).unwrap();
        let f = acc.finish();
        let s = f.layers["7"];
        // elements 3 4 0 0 1 -1: mean 7/6, E[x²] 27/6; row norms 5, 0, √2
        assert!((s.mean - 7.0 / 6.0).abs() < 1e-6);
        assert!((s.std - (27.0f64 / 6.0 - 49.0 / 36.0).sqrt()).abs() < 1e-6);
        assert!((s.norm - (5.0 + 2f64.sqrt()) / 3.0).abs() < 1e-6);
        assert_eq!(f.rows, 3);
    }

    #[test]
    fn a_shift_beyond_a_quarter_fails_and_no_file_is_ok() {
        let now = file(1.0, 20.0, &[1, 8]);
        assert_eq!(judge(&now, None).verdict, Verdict::Ok);
        assert!(judge(&now, None).evidence.contains("no training-time"));
        assert_eq!(
            judge(&now, Some(&file(1.1, 22.0, &[1, 8]))).verdict,
            Verdict::Ok
        );
        let c = judge(&now, Some(&file(1.0, 30.0, &[1, 8])));
        assert_eq!(c.verdict, Verdict::Fail, "{c:?}");
        assert!(c.cause.contains("another layer path"), "{}", c.cause);
        assert_eq!(
            judge(&now, Some(&file(2.0, 20.0, &[1, 8]))).verdict,
            Verdict::Fail
        );
        assert_eq!(
            judge(&now, Some(&file(1.0, 20.0, &[1]))).verdict,
            Verdict::Warn
        );
    }

    #[test]
    fn the_file_round_trips_atomically_and_bad_files_are_bad_input() {
        let dir = tempfile::tempdir().unwrap();
        assert!(read_tap_stats(dir.path()).unwrap().is_none());
        let f = file(0.5, 9.0, &[1, 27]);
        write_tap_stats(dir.path(), &f).unwrap();
        assert_eq!(read_tap_stats(dir.path()).unwrap(), Some(f));
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(names.len(), 1, "no temporary file left behind");
        std::fs::write(dir.path().join(TAP_STATS_FILE), "{not json").unwrap();
        let e = read_tap_stats(dir.path()).unwrap_err();
        assert!(e.is_bad_input(), "{e}");
        assert!(e.to_string().contains(TAP_STATS_FILE), "{e}");
    }
}
