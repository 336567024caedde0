//! Axis ranges, "nice" tick positions (1, 2, 5 × 10^k) and tick labels.
//!
//! An [`Axis`] lives in *axis space*: data values for a linear axis, `log10(value)` for a log
//! axis. Its range is always finite with `lo < hi` (degenerate data ranges are padded), and its
//! ticks lie inside that range, ascending, each with a ready-made label.

/// One tick: its position in axis space and its label.
#[derive(Clone, Debug, PartialEq)]
pub struct Tick {
    pub pos: f64,
    pub label: String,
}

/// A finished axis: finite range `lo < hi` and ticks within it.
#[derive(Clone, Debug, PartialEq)]
pub struct Axis {
    pub lo: f64,
    pub hi: f64,
    pub ticks: Vec<Tick>,
}

impl Axis {
    /// Fraction `0..=1` of the way from `lo` to `hi` (outside for out-of-range values).
    pub fn frac(&self, v: f64) -> f64 {
        (v - self.lo) / (self.hi - self.lo)
    }
}

/// The target number of ticks per axis.
pub const TARGET_TICKS: usize = 5;
/// Upper bound on ticks, whatever the input (guards against float pathologies).
const MAX_TICKS: f64 = 200.0;

/// Min and max of the finite values, or `None` if there are none.
pub fn finite_range(values: impl IntoIterator<Item = f64>) -> Option<(f64, f64)> {
    values
        .into_iter()
        .filter(|v| v.is_finite())
        .fold(None, |acc, v| match acc {
            None => Some((v, v)),
            Some((lo, hi)) => Some((lo.min(v), hi.max(v))),
        })
}

/// Widens `[lo, hi]` by `frac` of its span on each side; a zero-width range is widened to
/// `±10 %` of its magnitude (or `±1` around zero) so that `lo < hi` always holds on return.
pub fn pad_range(lo: f64, hi: f64, frac: f64) -> (f64, f64) {
    let (lo, hi) = if lo <= hi { (lo, hi) } else { (hi, lo) };
    let span = hi - lo;
    let (mut a, mut b) = if span > 0.0 && span.is_finite() {
        (lo - span * frac, hi + span * frac)
    } else {
        let d = if lo == 0.0 { 1.0 } else { lo.abs() * 0.1 };
        (lo - d, hi + d)
    };
    if !a.is_finite() || !b.is_finite() {
        a = a.clamp(-f64::MAX / 4.0, f64::MAX / 4.0);
        b = b.clamp(-f64::MAX / 4.0, f64::MAX / 4.0);
    }
    if a >= b {
        // Precision exhausted (e.g. huge magnitudes): fall back to a unit-free widening.
        b = a + a.abs().max(1.0) * 1e-6;
        if a >= b {
            return (-1.0, 1.0);
        }
    }
    (a, b)
}

/// Rounds `raw > 0` to the nearest of 1, 2, 5 × 10^k.
pub fn nice_step(raw: f64) -> f64 {
    if raw.is_nan() || raw <= 0.0 || raw.is_infinite() {
        return 1.0;
    }
    let exp = raw.log10().floor();
    let base = 10f64.powf(exp);
    let f = raw / base;
    let m = if f < 1.5 {
        1.0
    } else if f < 3.0 {
        2.0
    } else if f < 7.0 {
        5.0
    } else {
        10.0
    };
    m * base
}

/// Multiples of `step` inside `[lo, hi]` (with a little tolerance for rounding), ascending.
fn multiples(lo: f64, hi: f64, step: f64) -> Vec<f64> {
    let eps = 1e-9;
    let k0 = (lo / step - eps).ceil();
    let k1 = (hi / step + eps).floor();
    if !k0.is_finite() || !k1.is_finite() || k1 < k0 || k1 - k0 > MAX_TICKS {
        return Vec::new();
    }
    let mut out = Vec::new();
    let mut k = k0;
    while k <= k1 {
        let v = k * step;
        // Snap float noise (3 * 0.1 = 0.30000000000000004) and avoid "-0".
        let v = if v.abs() < step * 1e-9 { 0.0 } else { v };
        out.push(v);
        k += 1.0;
    }
    out
}

/// About `target` nice tick values inside `[lo, hi]`: e.g. `0..1` gives
/// `0, 0.2, 0.4, 0.6, 0.8, 1` and `0..54` gives `0, 10, 20, 30, 40, 50`. Returns the step too.
pub fn nice_ticks(lo: f64, hi: f64, target: usize) -> (Vec<f64>, f64) {
    let (lo, hi) = if lo <= hi { (lo, hi) } else { (hi, lo) };
    let step = nice_step((hi - lo) / target.max(1) as f64);
    let ticks = multiples(lo, hi, step);
    if ticks.is_empty() {
        let ends = [lo, hi].into_iter().filter(|v| v.is_finite()).collect();
        return (ends, step);
    }
    (ticks, step)
}

/// Number of decimals needed so that multiples of `step` print exactly.
fn decimals_for(step: f64) -> usize {
    let d = (-step.log10() - 1e-9).ceil();
    if d.is_finite() && d > 0.0 {
        (d as usize).min(12)
    } else {
        0
    }
}

/// Decimal exponent of the leading digit of `v` (`0` for zero).
fn exponent(v: f64) -> i32 {
    if v == 0.0 || !v.is_finite() {
        0
    } else {
        // Round first so that 9.9999999e2 counts as 1e3.
        let e = v.abs().log10().floor() as i32;
        let m = v.abs() / 10f64.powi(e);
        if m >= 9.999_999_999 {
            e + 1
        } else {
            e
        }
    }
}

/// Label for the value `v` on a linear axis whose ticks are `step` apart.
/// Plain decimals normally; `1.5e-5` style for very large or very small magnitudes.
pub fn format_linear(v: f64, step: f64, max_abs: f64) -> String {
    if v == 0.0 {
        return "0".to_string();
    }
    if max_abs >= 1e6 || step < 1e-4 {
        let prec = (exponent(v) - exponent(step)).max(0) as usize;
        return format!("{:.*e}", prec.min(12), v);
    }
    format!("{:.*}", decimals_for(step), v)
}

/// Label for a positive value on a log axis: `0.001`, `20`, `1e-5`, `5e6`.
pub fn format_log(v: f64) -> String {
    let e = exponent(v);
    if (-4..=5).contains(&e) {
        let d = if e < 0 { (-e) as usize } else { 0 };
        format!("{:.*}", d, v)
    } else {
        format!("{:.0e}", v)
    }
}

/// A linear axis over the data range `[lo, hi]`, padded by `pad` of its span on each side.
pub fn linear_axis(lo: f64, hi: f64, pad: f64) -> Axis {
    let (lo, hi) = pad_range(lo, hi, pad);
    let (vals, step) = nice_ticks(lo, hi, TARGET_TICKS);
    let max_abs = lo.abs().max(hi.abs());
    let ticks = vals
        .into_iter()
        .map(|v| Tick {
            pos: v,
            label: format_linear(v, step, max_abs),
        })
        .collect();
    Axis { lo, hi, ticks }
}

/// Ticks at `m × 10^k` for the given multipliers `m`, inside the log-space range `[lo, hi]`.
fn multiples_log(lo: f64, hi: f64, mults: &[f64]) -> Vec<Tick> {
    let mut ticks = Vec::new();
    let mut k = lo.floor() - 1.0;
    while k <= hi.ceil() && ticks.len() < MAX_TICKS as usize {
        for &m in mults {
            let v = m * 10f64.powf(k);
            let p = v.log10();
            if p >= lo - 1e-12 && p <= hi + 1e-12 {
                ticks.push(Tick {
                    pos: p,
                    label: format_log(v),
                });
            }
        }
        k += 1.0;
    }
    ticks
}

/// A log axis over positive data `[lo, hi]` (given in data units, both `> 0`), padded by `pad`
/// of its span in decades. Ticks sit at powers of ten; when fewer than three powers fall
/// inside, 2× and 5× multiples are used, and for very narrow ranges nice linear values.
pub fn log_axis(lo: f64, hi: f64, pad: f64) -> Axis {
    let (lo, hi) = pad_range(lo.log10(), hi.log10(), pad);
    let mut ticks: Vec<Tick> = Vec::new();
    let (k0, k1) = (lo.ceil(), hi.floor());
    let decades = k1 - k0 + 1.0;
    if (2.0..=MAX_TICKS * 10.0).contains(&decades) {
        let stride = (decades / (TARGET_TICKS as f64 + 1.0)).ceil().max(1.0);
        let mut k = (k0 / stride).ceil() * stride;
        while k <= k1 {
            let v = 10f64.powf(k);
            ticks.push(Tick {
                pos: k,
                label: format_log(v),
            });
            k += stride;
        }
    }
    if ticks.len() < 3 {
        // Too few powers of ten: try 1-2-5 multiples (or 1-5 if that gets crowded).
        for mults in [&[1.0, 2.0, 5.0][..], &[1.0, 5.0][..]] {
            let cand = multiples_log(lo, hi, mults);
            if cand.len() >= 3 && cand.len() <= TARGET_TICKS + 2 {
                ticks = cand;
                break;
            }
        }
    }
    if ticks.len() < 2 || (ticks.len() < 3 && hi - lo < 1.0) {
        // Less than a decade: nice linear values, placed at their logarithms.
        let (vlo, vhi) = (10f64.powf(lo), 10f64.powf(hi));
        let (vals, step) = nice_ticks(vlo, vhi, TARGET_TICKS);
        ticks = vals
            .into_iter()
            .filter(|&v| v > 0.0)
            .map(|v| Tick {
                pos: v.log10(),
                label: format_linear(v, step, vhi),
            })
            .collect();
    }
    Axis { lo, hi, ticks }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: &[f64], b: &[f64]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-12)
    }

    #[test]
    fn nice_ticks_unit_range() {
        let (t, step) = nice_ticks(0.0, 1.0, 5);
        assert!(close(&t, &[0.0, 0.2, 0.4, 0.6, 0.8, 1.0]), "{t:?}");
        assert!((step - 0.2).abs() < 1e-15);
    }

    #[test]
    fn nice_ticks_0_to_54() {
        let (t, step) = nice_ticks(0.0, 54.0, 5);
        assert_eq!(t, vec![0.0, 10.0, 20.0, 30.0, 40.0, 50.0]);
        assert_eq!(step, 10.0);
    }

    #[test]
    fn nice_ticks_negative_and_offset() {
        let (t, _) = nice_ticks(-1.3, 2.7, 5);
        assert_eq!(t, vec![-1.0, 0.0, 1.0, 2.0]);
        let (t, _) = nice_ticks(1003.0, 1017.0, 5);
        assert_eq!(
            t,
            vec![1004.0, 1006.0, 1008.0, 1010.0, 1012.0, 1014.0, 1016.0]
        );
    }

    #[test]
    fn nice_step_rounds_to_1_2_5() {
        for (raw, want) in [
            (0.13, 0.1),
            (0.2, 0.2),
            (0.31, 0.5),
            (7.5, 10.0),
            (2900.0, 2000.0),
        ] {
            assert!(
                (nice_step(raw) - want).abs() < 1e-12,
                "{raw} -> {}",
                nice_step(raw)
            );
        }
    }

    #[test]
    fn labels_are_clean() {
        let (t, step) = nice_ticks(0.0, 1.0, 5);
        let labels: Vec<_> = t.iter().map(|&v| format_linear(v, step, 1.0)).collect();
        assert_eq!(labels, ["0", "0.2", "0.4", "0.6", "0.8", "1.0"]);
        assert_eq!(format_linear(30000.0, 10000.0, 40000.0), "30000");
        assert_eq!(format_linear(2e6, 1e6, 5e6), "2e6");
        assert_eq!(format_linear(6e-5, 2e-5, 1e-4), "6e-5");
        assert_eq!(format_linear(1.2e-4, 2e-5, 1e-4), "1.2e-4");
        assert_eq!(format_log(0.001), "0.001");
        assert_eq!(format_log(100.0), "100");
        assert_eq!(format_log(1e-7), "1e-7");
        assert_eq!(format_log(2e8), "2e8");
    }

    #[test]
    fn degenerate_ranges_are_padded() {
        let a = linear_axis(3.0, 3.0, 0.05);
        assert!(a.lo < 3.0 && a.hi > 3.0);
        assert!(!a.ticks.is_empty());
        let a = linear_axis(0.0, 0.0, 0.05);
        assert!(a.lo < 0.0 && a.hi > 0.0);
        let a = linear_axis(-f64::MAX, f64::MAX, 0.05);
        assert!(a.lo.is_finite() && a.hi.is_finite() && a.lo < a.hi);
    }

    #[test]
    fn log_axis_uses_powers_of_ten() {
        let a = log_axis(0.001, 10.0, 0.0);
        let pos: Vec<f64> = a.ticks.iter().map(|t| t.pos).collect();
        assert!(close(&pos, &[-3.0, -2.0, -1.0, 0.0, 1.0]), "{pos:?}");
        let labels: Vec<&str> = a.ticks.iter().map(|t| t.label.as_str()).collect();
        assert_eq!(labels, ["0.001", "0.01", "0.1", "1", "10"]);
        // Many decades: strided so there are not too many ticks.
        let a = log_axis(1e-30, 1e30, 0.0);
        assert!(
            a.ticks.len() >= 2 && a.ticks.len() <= TARGET_TICKS + 2,
            "{:?}",
            a.ticks
        );
    }

    #[test]
    fn narrow_log_axis_still_has_ticks() {
        let a = log_axis(2.0, 4.0, 0.05);
        assert!(a.ticks.len() >= 3, "{:?}", a.ticks);
        let a = log_axis(2.0, 6.0, 0.05);
        let labels: Vec<&str> = a.ticks.iter().map(|t| t.label.as_str()).collect();
        assert_eq!(labels, ["2", "3", "4", "5", "6"]);
        // Two powers of ten inside: filled in with 2x and 5x.
        let a = log_axis(0.6, 15.0, 0.0);
        let labels: Vec<&str> = a.ticks.iter().map(|t| t.label.as_str()).collect();
        assert_eq!(labels, ["1", "2", "5", "10"]);
        let a = log_axis(3.0, 3.0, 0.05);
        assert!(a.ticks.len() >= 2, "{:?}", a.ticks);
        for t in &a.ticks {
            assert!(t.pos >= a.lo && t.pos <= a.hi);
        }
    }

    #[test]
    fn finite_range_skips_nan_and_inf() {
        let r = finite_range([f64::NAN, 1.0, f64::INFINITY, -2.0, f64::NEG_INFINITY]);
        assert_eq!(r, Some((-2.0, 1.0)));
        assert_eq!(finite_range([f64::NAN]), None);
    }
}
