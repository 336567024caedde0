//! Drawing a [`Figure`] with plotters on an RGB8 buffer (bitmap backend), text in the embedded
//! DejaVu Sans (`assets/DejaVuSans.ttf`, registered once per process), so no system font is read.
//!
//! Invariants: a panel draws only inside its cell; non-finite points (and non-positive `y` on a
//! log axis) break a series' line and a run of one point is drawn as a dot; a panel with no
//! drawable point shows its title and "no data"; ranges that are empty or a single value are
//! padded, ranges too wide for f64 arithmetic are clamped; the same figure always gives the same
//! pixels (plotters draws lines and fills without randomness).

use crate::{series_color, BarChart, Figure, Panel, PlotError};
use plotters::coord::ranged1d::ValueFormatter;
use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use plotters::style::{register_font, FontStyle};
use std::sync::OnceLock;

const FONT: &str = "sans-serif";
const FONT_BYTES: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");
const TEXT: RGBColor = RGBColor(25, 25, 25);
const GRID: RGBColor = RGBColor(232, 232, 232);
const MUTED: RGBColor = RGBColor(150, 150, 150);

type Area<'a> = DrawingArea<BitMapBackend<'a>, Shift>;

fn draw_err<E: std::fmt::Display>(e: E) -> PlotError {
    PlotError::Draw(e.to_string())
}

/// Registers the embedded font under [`FONT`] (once per process).
fn font() -> Result<(), PlotError> {
    static DONE: OnceLock<Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        register_font(FONT, FontStyle::Normal, FONT_BYTES)
            .map_err(|_| "the embedded font does not parse".to_string())
    })
    .clone()
    .map_err(PlotError::Draw)
}

/// Draws `fig` into `pixels` (`width × height` RGB8, already validated by the caller): the title
/// band of `title_h` pixels, then `rows × cols` cells; `scale` sizes text and lines.
#[allow(clippy::too_many_arguments)]
pub(crate) fn draw(
    fig: &Figure,
    pixels: &mut [u8],
    (width, height): (u32, u32),
    title_h: u32,
    (rows, cols): (usize, usize),
    scale: u32,
) -> Result<(), PlotError> {
    font()?;
    let root = BitMapBackend::with_buffer(pixels, (width, height)).into_drawing_area();
    root.fill(&WHITE).map_err(draw_err)?;
    let body = if title_h > 0 {
        let (band, body) = root.split_vertically(title_h);
        let style = TextStyle::from((FONT, 14 * scale as i32).into_font())
            .color(&TEXT)
            .pos(Pos::new(HPos::Center, VPos::Center));
        band.draw(&Text::new(
            fig.title.clone(),
            (width as i32 / 2, title_h as i32 / 2),
            style,
        ))
        .map_err(draw_err)?;
        body
    } else {
        root.clone()
    };
    let cells = body.split_evenly((rows, cols));
    for (p, cell) in fig.panels.iter().zip(cells.iter()) {
        draw_panel(cell, p, scale)?;
    }
    root.present().map_err(draw_err)?;
    Ok(())
}

/// Each series' drawable points, cut into runs at the points that are not.
fn runs(p: &Panel) -> Vec<Vec<Vec<(f64, f64)>>> {
    let keep = |x: f64, y: f64| x.is_finite() && y.is_finite() && (!p.log_y || y > 0.0);
    p.series
        .iter()
        .map(|s| {
            let mut out: Vec<Vec<(f64, f64)>> = vec![];
            let mut cur = vec![];
            for &(x, y) in &s.points {
                if keep(x, y) {
                    cur.push((x, y));
                } else if !cur.is_empty() {
                    out.push(std::mem::take(&mut cur));
                }
            }
            if !cur.is_empty() {
                out.push(cur);
            }
            out
        })
        .collect()
}

/// `[lo, hi]` of `values` made drawable: a single value widened, 4 % margins, clamped to where
/// the span stays finite. `log`: the range of positive values, widened by factors.
fn range(values: impl Iterator<Item = f64>, log: bool) -> (f64, f64) {
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for v in values {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    if log {
        if hi <= lo {
            return (lo / 2.0, hi * 2.0);
        }
        return (lo / 1.2, hi * 1.2);
    }
    let limit = f64::MAX / 8.0;
    lo = lo.max(-limit);
    hi = hi.min(limit);
    if hi <= lo {
        let d = if lo == 0.0 { 1.0 } else { lo.abs() * 0.1 };
        return (lo - d, hi + d);
    }
    let m = (hi - lo) * 0.04;
    (lo - m, hi + m)
}

fn draw_panel(area: &Area, p: &Panel, scale: u32) -> Result<(), PlotError> {
    let s = scale as i32;
    let (w, h) = area.dim_in_pixel();
    let runs = runs(p);
    let points = || runs.iter().flatten().flatten().copied();
    if points().next().is_none() {
        let title = TextStyle::from((FONT, 12 * s).into_font())
            .color(&TEXT)
            .pos(Pos::new(HPos::Center, VPos::Top));
        area.draw(&Text::new(p.title.clone(), (w as i32 / 2, 6 * s), title))
            .map_err(draw_err)?;
        let note = TextStyle::from((FONT, 11 * s).into_font())
            .color(&MUTED)
            .pos(Pos::new(HPos::Center, VPos::Center));
        area.draw(&Text::new("no data", (w as i32 / 2, h as i32 / 2), note))
            .map_err(draw_err)?;
        return Ok(());
    }
    let (x0, x1) = range(points().map(|(x, _)| x), false);
    let (y0, y1) = range(points().map(|(_, y)| y), p.log_y);
    let mut builder = ChartBuilder::on(area);
    builder
        .caption(p.title.clone(), (FONT, 12 * s))
        .margin(5 * s)
        .x_label_area_size(30 * s)
        .y_label_area_size(36 * s);
    if p.log_y {
        let chart = builder
            .build_cartesian_2d(x0..x1, (y0..y1).log_scale())
            .map_err(draw_err)?;
        plot(chart, p, &runs, s)
    } else {
        let chart = builder
            .build_cartesian_2d(x0..x1, y0..y1)
            .map_err(draw_err)?;
        plot(chart, p, &runs, s)
    }
}

/// A tick label: integers without a fraction, few digits otherwise, exponents for the very large
/// and very small.
fn tick(v: f64) -> String {
    let a = v.abs();
    if v == 0.0 {
        return "0".into();
    }
    if !(1e-3..1e5).contains(&a) {
        return format!("{v:.1e}");
    }
    let s = format!("{v:.4}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

fn plot<'a, Y>(
    mut chart: ChartContext<'a, BitMapBackend<'a>, Cartesian2d<RangedCoordf64, Y>>,
    p: &Panel,
    runs: &[Vec<Vec<(f64, f64)>>],
    s: i32,
) -> Result<(), PlotError>
where
    Y: Ranged<ValueType = f64> + ValueFormatter<f64>,
{
    chart
        .configure_mesh()
        .light_line_style(GRID)
        .bold_line_style(GRID)
        .max_light_lines(1)
        .x_labels(6)
        .y_labels(6)
        .x_label_formatter(&|v| tick(*v))
        .y_label_formatter(&|v| tick(*v))
        .x_desc(p.x_label.clone())
        .y_desc(p.y_label.clone())
        .label_style((FONT, 10 * s))
        .axis_desc_style((FONT, 11 * s))
        .draw()
        .map_err(draw_err)?;
    let mut named = false;
    for (i, (series, pieces)) in p.series.iter().zip(runs).enumerate() {
        let color = series_color(i);
        let c = RGBColor(color.0, color.1, color.2);
        let style = c.stroke_width(s.max(1) as u32);
        let mut labelled = series.name.is_empty();
        for piece in pieces {
            let drawn = if piece.len() == 1 {
                chart
                    .draw_series(std::iter::once(Circle::new(piece[0], s + 1, c.filled())))
                    .map_err(draw_err)?
            } else {
                chart
                    .draw_series(LineSeries::new(piece.iter().copied(), style))
                    .map_err(draw_err)?
            };
            if !labelled {
                drawn
                    .label(series.name.clone())
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], style));
                labelled = true;
                named = true;
            }
        }
    }
    if named {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(RGBColor(190, 190, 190))
            .label_font((FONT, 10 * s))
            .draw()
            .map_err(draw_err)?;
    }
    Ok(())
}

/// Draws `bars` into `pixels` (`bars.width × bars.height` RGB8, validated by the caller) as
/// horizontal bars, the first at the top, labels left of the axis (long variant names stay
/// readable), each value printed after its bar.
pub(crate) fn draw_bars(bars: &BarChart, pixels: &mut [u8], scale: u32) -> Result<(), PlotError> {
    font()?;
    let s = scale as i32;
    let root = BitMapBackend::with_buffer(pixels, (bars.width, bars.height)).into_drawing_area();
    root.fill(&WHITE).map_err(draw_err)?;
    let n = bars.bars.len();
    let finite = || bars.bars.iter().map(|b| b.1).filter(|v| v.is_finite());
    let top = finite().fold(0.0f64, f64::max);
    let bottom = finite().fold(0.0f64, f64::min);
    let (x0, x1) = if top > bottom {
        (bottom, top + (top - bottom) * 0.12)
    } else {
        (bottom - 1.0, bottom + 1.0)
    };
    let labels: Vec<String> = bars.bars.iter().map(|b| b.0.clone()).collect();
    let longest = labels.iter().map(|l| l.chars().count()).max().unwrap_or(1) as i32;
    let label_w = (longest * 6 * s + 12 * s).min(bars.width as i32 / 2);
    // bar i sits at y = n - 1 - i
    let label_at = |v: &f64| {
        let y = v.round();
        if (v - y).abs() < 1e-6 && y >= 0.0 && (y as usize) < n {
            labels[n - 1 - y as usize].clone()
        } else {
            String::new()
        }
    };
    let mut chart = ChartBuilder::on(&root)
        .caption(bars.title.clone(), (FONT, 13 * s))
        .margin(8 * s)
        .x_label_area_size(30 * s)
        .y_label_area_size(label_w)
        .build_cartesian_2d(x0..x1, -0.5f64..n as f64 - 0.5)
        .map_err(draw_err)?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .light_line_style(GRID)
        .bold_line_style(GRID)
        .max_light_lines(1)
        .y_labels(n)
        .y_label_formatter(&label_at)
        .x_label_formatter(&|v| tick(*v))
        .x_desc(bars.y_label.clone())
        .label_style((FONT, 10 * s))
        .axis_desc_style((FONT, 11 * s))
        .draw()
        .map_err(draw_err)?;
    for (i, (_, v, hi)) in bars.bars.iter().enumerate() {
        if !v.is_finite() {
            continue;
        }
        let c = series_color(if *hi { 1 } else { 0 });
        let c = RGBColor(c.0, c.1, c.2);
        let y = (n - 1 - i) as f64;
        chart
            .draw_series(std::iter::once(Rectangle::new(
                [(0.0f64.max(x0), y - 0.35), (*v, y + 0.35)],
                c.filled(),
            )))
            .map_err(draw_err)?;
        let style = TextStyle::from((FONT, 10 * s).into_font())
            .color(&TEXT)
            .pos(Pos::new(HPos::Left, VPos::Center));
        chart
            .draw_series(std::iter::once(Text::new(
                format!(" {}", tick_value(*v)),
                (*v, y),
                style,
            )))
            .map_err(draw_err)?;
    }
    root.present().map_err(draw_err)?;
    Ok(())
}

/// A bar's value label: two decimals.
fn tick_value(v: f64) -> String {
    format!("{v:.2}")
}
