//! Layout and drawing of one [`Panel`] inside its cell of the figure.
//!
//! A panel never draws outside its cell: text that would not fit is shortened with `..`, and
//! series are clipped to the plot rectangle. Non-finite points (and non-positive `y` on a log
//! axis) break the polyline; a run of one point is drawn as a dot.

use crate::axes::{finite_range, linear_axis, log_axis, Axis};
use crate::font::{draw_text, draw_text_up, text_width, CAP_H, CELL_H, CELL_W};
use crate::raster::{Canvas, Mask, Rgb};
use crate::{Panel, PlotError};

/// Series colours, used in order and then cycled.
pub const PALETTE: [Rgb; 10] = [
    Rgb(31, 119, 180),
    Rgb(255, 127, 14),
    Rgb(44, 160, 44),
    Rgb(214, 39, 40),
    Rgb(148, 103, 189),
    Rgb(140, 86, 75),
    Rgb(227, 119, 194),
    Rgb(127, 127, 127),
    Rgb(188, 189, 34),
    Rgb(23, 190, 207),
];

const TEXT: Rgb = Rgb(25, 25, 25);
const FRAME: Rgb = Rgb(70, 70, 70);
const GRID: Rgb = Rgb(232, 232, 232);
const MUTED: Rgb = Rgb(150, 150, 150);
const LEGEND_BORDER: Rgb = Rgb(190, 190, 190);

/// The colour of series number `i`.
pub fn series_color(i: usize) -> Rgb {
    PALETTE[i % PALETTE.len()]
}

/// An axis-aligned pixel rectangle `[x, x + w) × [y, y + h)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rect {
    pub x: i64,
    pub y: i64,
    pub w: i64,
    pub h: i64,
}

impl Rect {
    fn contains(&self, px: f64, py: f64) -> bool {
        px >= self.x as f64
            && py >= self.y as f64
            && px < (self.x + self.w) as f64
            && py < (self.y + self.h) as f64
    }
}

/// Shortens `text` with a trailing `..` so that it is at most `max_w` pixels wide at `scale`.
pub fn fit(text: &str, max_w: i64, scale: u32) -> String {
    if text_width(text, scale) as i64 <= max_w {
        return text.to_string();
    }
    let mut chars: Vec<char> = text.chars().collect();
    while !chars.is_empty() {
        chars.pop();
        let s: String = chars.iter().chain(['.', '.'].iter()).collect();
        if text_width(&s, scale) as i64 <= max_w {
            return s;
        }
    }
    String::new()
}

/// The panel's series in axis space: `None` marks a break in the line.
fn project(panel: &Panel) -> Vec<Vec<Option<(f64, f64)>>> {
    panel
        .series
        .iter()
        .map(|s| {
            s.points
                .iter()
                .map(|&(x, y)| {
                    let ok = x.is_finite() && y.is_finite() && (!panel.log_y || y > 0.0);
                    if !ok {
                        None
                    } else if panel.log_y {
                        Some((x, y.log10()))
                    } else {
                        Some((x, y))
                    }
                })
                .collect()
        })
        .collect()
}

/// The x and y axes for the projected points (whether there was any point at all, too).
fn axes_for(panel: &Panel, pts: &[Vec<Option<(f64, f64)>>]) -> (Axis, Axis, bool) {
    let all = || pts.iter().flatten().flatten();
    let xr = finite_range(all().map(|p| p.0));
    let yr = finite_range(all().map(|p| p.1));
    let x_axis = match xr {
        Some((lo, hi)) => linear_axis(lo, hi, 0.0),
        None => linear_axis(0.0, 1.0, 0.0),
    };
    let y_axis = match (yr, panel.log_y) {
        // The projected y is already log10; the log axis wants data units.
        (Some((lo, hi)), true) => log_axis(10f64.powf(lo), 10f64.powf(hi), 0.05),
        (None, true) => log_axis(1.0, 10.0, 0.0),
        (Some((lo, hi)), false) => linear_axis(lo, hi, 0.05),
        (None, false) => linear_axis(0.0, 1.0, 0.0),
    };
    (x_axis, y_axis, xr.is_some())
}

/// Computed geometry of a panel.
pub struct Layout {
    pub plot: Rect,
    x_axis: Axis,
    y_axis: Axis,
    has_data: bool,
    pts: Vec<Vec<Option<(f64, f64)>>>,
}

impl Layout {
    fn px(&self, x: f64) -> f64 {
        self.plot.x as f64 + self.x_axis.frac(x) * self.plot.w as f64
    }

    fn py(&self, y: f64) -> f64 {
        self.plot.y as f64 + (1.0 - self.y_axis.frac(y)) * self.plot.h as f64
    }
}

/// Works out the plot rectangle of `panel` in the cell `cell` with text scale `s`.
pub fn layout(panel: &Panel, cell: Rect, s: u32) -> Result<Layout, PlotError> {
    let pts = project(panel);
    let (x_axis, y_axis, has_data) = axes_for(panel, &pts);
    let si = s as i64;
    let pad = 6 * si;
    let tick = 4 * si;
    let gap = 3 * si;
    let ytick_w = y_axis
        .ticks
        .iter()
        .map(|t| text_width(&t.label, s) as i64)
        .max()
        .unwrap_or(0);
    let xtick_half = x_axis
        .ticks
        .iter()
        .map(|t| text_width(&t.label, s) as i64 / 2)
        .max()
        .unwrap_or(0);
    let ylabel_w = if panel.y_label.is_empty() {
        0
    } else {
        CELL_H as i64 * si + 2 * gap
    };
    let xlabel_h = if panel.x_label.is_empty() {
        0
    } else {
        CELL_H as i64 * si + gap
    };
    let top = pad + CELL_H as i64 * si + 2 * gap;
    let left = pad + ylabel_w + ytick_w + gap + tick;
    let bottom = tick + gap + CAP_H as i64 * si + gap + xlabel_h + pad;
    let right = pad + xtick_half;
    let plot = Rect {
        x: cell.x + left,
        y: cell.y + top,
        w: cell.w - left - right,
        h: cell.h - top - bottom,
    };
    if plot.w < 16 || plot.h < 16 {
        return Err(PlotError::Layout(format!(
            "panel {:?} leaves only {}x{} pixels for the plot; make panels larger",
            panel.title, plot.w, plot.h
        )));
    }
    Ok(Layout {
        plot,
        x_axis,
        y_axis,
        has_data,
        pts,
    })
}

/// Stroke width of series lines at text scale `s`.
fn line_width(s: u32) -> f64 {
    2.0 + 0.5 * (s.max(1) - 1) as f64
}

/// Draws `panel` into `cell` of `canvas`; returns its layout.
pub fn draw(canvas: &mut Canvas, panel: &Panel, cell: Rect, s: u32) -> Result<Layout, PlotError> {
    let lay = layout(panel, cell, s)?;
    let p = lay.plot;
    let si = s as i64;
    let tick = 4 * si;
    let gap = 3 * si;

    // Grid.
    for t in &lay.x_axis.ticks {
        let x = (lay.px(t.pos).floor() as i64).clamp(p.x, p.x + p.w - 1);
        canvas.fill_rect(x, p.y, 1, p.h, GRID);
    }
    for t in &lay.y_axis.ticks {
        let y = (lay.py(t.pos).floor() as i64).clamp(p.y, p.y + p.h - 1);
        canvas.fill_rect(p.x, y, p.w, 1, GRID);
    }

    // Series.
    let lw = line_width(s);
    for (i, series) in lay.pts.iter().enumerate() {
        let mut mask = Mask::new(p.x, p.y, p.w, p.h);
        let px: Vec<Option<(f64, f64)>> = series
            .iter()
            .map(|q| q.map(|(x, y)| (lay.px(x), lay.py(y))))
            .map(|q| q.filter(|(x, y)| x.is_finite() && y.is_finite()))
            .collect();
        // Each run of consecutive valid points is a polyline; a run that collapses to (nearly)
        // a single pixel, such as one point or repeated equal points, is drawn as a dot.
        for run in px.split(|q| q.is_none()).filter(|r| !r.is_empty()) {
            let run: Vec<(f64, f64)> = run.iter().flatten().copied().collect();
            for w in run.windows(2) {
                mask.segment(w[0], w[1], lw);
            }
            let ext = |f: fn(&(f64, f64)) -> f64| {
                let (lo, hi) = run
                    .iter()
                    .map(f)
                    .fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), v| {
                        (l.min(v), h.max(v))
                    });
                hi - lo
            };
            if ext(|p| p.0) < lw && ext(|p| p.1) < lw {
                mask.dot(run[0], lw * 1.25);
            }
        }
        mask.paint(canvas, series_color(i));
    }

    // Frame and ticks.
    canvas.stroke_rect(p.x - 1, p.y - 1, p.w + 2, p.h + 2, FRAME);
    let cell_right = cell.x + cell.w;
    for t in &lay.x_axis.ticks {
        let x = (lay.px(t.pos).floor() as i64).clamp(p.x, p.x + p.w - 1);
        canvas.fill_rect(x, p.y + p.h + 1, 1, tick, FRAME);
        let w = text_width(&t.label, s) as i64;
        let lx = (x - w / 2).clamp(cell.x, (cell_right - w).max(cell.x));
        draw_text(canvas, lx, p.y + p.h + 1 + tick + gap, &t.label, s, TEXT);
    }
    for t in &lay.y_axis.ticks {
        let y = (lay.py(t.pos).floor() as i64).clamp(p.y, p.y + p.h - 1);
        canvas.fill_rect(p.x - 1 - tick, y, tick, 1, FRAME);
        let w = text_width(&t.label, s) as i64;
        let ly = y - (CAP_H as i64 * si) / 2;
        draw_text(canvas, p.x - 1 - tick - gap - w, ly, &t.label, s, TEXT);
    }

    // Title and axis labels.
    let pad = 6 * si;
    let title = fit(&panel.title, cell.w - 2 * pad, s);
    let tw = text_width(&title, s) as i64;
    let tx = (p.x + (p.w - tw) / 2).clamp(cell.x + pad, (cell_right - pad - tw).max(cell.x));
    draw_text(canvas, tx, cell.y + pad, &title, s, TEXT);
    if s >= 2 {
        // Faux bold: a second pass one pixel to the right.
        draw_text(canvas, tx + 1, cell.y + pad, &title, s, TEXT);
    }
    if !panel.x_label.is_empty() {
        let xl = fit(&panel.x_label, cell.w - 2 * pad, s);
        let w = text_width(&xl, s) as i64;
        let y = p.y + p.h + 1 + tick + gap + CAP_H as i64 * si + gap;
        let x = (p.x + (p.w - w) / 2).clamp(cell.x, (cell_right - w).max(cell.x));
        draw_text(canvas, x, y, &xl, s, TEXT);
    }
    if !panel.y_label.is_empty() {
        let yl = fit(&panel.y_label, p.h + (p.y - cell.y), s);
        let w = text_width(&yl, s) as i64;
        let bottom = (p.y + (p.h + w) / 2).min(cell.y + cell.h);
        draw_text_up(canvas, cell.x + pad, bottom, &yl, s, TEXT);
    }
    if !lay.has_data {
        let msg = "no data";
        let w = text_width(msg, s) as i64;
        let y = p.y + (p.h - CAP_H as i64 * si) / 2;
        draw_text(canvas, p.x + (p.w - w) / 2, y, msg, s, MUTED);
    }

    draw_legend(canvas, panel, &lay, s);
    Ok(lay)
}

/// Draws the legend in the corner of the plot that hides the fewest points.
fn draw_legend(canvas: &mut Canvas, panel: &Panel, lay: &Layout, s: u32) {
    let p = lay.plot;
    let si = s as i64;
    let inner = 4 * si;
    let sample = 4 * CELL_W as i64 * si;
    let row_h = CELL_H as i64 * si + 2 * si;
    let max_name = (p.w / 2).max(CELL_W as i64 * si * 4);
    let entries: Vec<(usize, String)> = panel
        .series
        .iter()
        .enumerate()
        .filter(|(_, sr)| !sr.name.is_empty())
        .map(|(i, sr)| (i, fit(&sr.name, max_name, s)))
        .collect();
    if entries.is_empty() {
        return;
    }
    let name_w = entries
        .iter()
        .map(|(_, n)| text_width(n, s) as i64)
        .max()
        .unwrap_or(0);
    let text_gap = inner + si + 2;
    let bw = 2 * inner + sample + text_gap + name_w;
    let bh = 2 * inner + entries.len() as i64 * row_h - 2 * si;
    let m = 5 * si;
    let corners = [
        (p.x + p.w - m - bw, p.y + m),
        (p.x + m, p.y + m),
        (p.x + p.w - m - bw, p.y + p.h - m - bh),
        (p.x + m, p.y + p.h - m - bh),
    ];
    let hidden = |bx: i64, by: i64| -> usize {
        let r = Rect {
            x: bx - m,
            y: by - m,
            w: bw + 2 * m,
            h: bh + 2 * m,
        };
        lay.pts
            .iter()
            .flatten()
            .flatten()
            .filter(|&&(x, y)| r.contains(lay.px(x), lay.py(y)))
            .count()
    };
    let (bx, by) = corners
        .iter()
        .copied()
        .min_by_key(|&(x, y)| hidden(x, y))
        .unwrap_or(corners[0]);

    for y in by..by + bh {
        for x in bx..bx + bw {
            canvas.blend(x, y, Rgb::WHITE, 0.88);
        }
    }
    canvas.stroke_rect(bx, by, bw, bh, LEGEND_BORDER);
    for (row, (i, name)) in entries.iter().enumerate() {
        let ty = by + inner + row as i64 * row_h;
        let mid = ty as f64 + (CAP_H as i64 * si) as f64 / 2.0;
        let x0 = (bx + inner) as f64;
        let mut mask = Mask::new(bx + 1, by + 1, bw - 2, bh - 2);
        mask.segment((x0, mid), (x0 + sample as f64, mid), line_width(s));
        mask.paint(canvas, series_color(*i));
        draw_text(
            canvas,
            bx + inner + sample + inner,
            ty,
            name,
            s,
            series_color(*i),
        );
    }
}
