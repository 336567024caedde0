//! Pixel operations on an RGB8 canvas: solid fills, axis-aligned lines, and anti-aliased thick
//! polylines.
//!
//! Every write is clipped to the canvas, so callers may pass any coordinates. Polylines are
//! rasterised into a coverage [`Mask`] first (taking the maximum coverage per pixel) and then
//! composited once, so joints between segments are not darkened by double blending.

/// An RGB colour.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rgb(pub u8, pub u8, pub u8);

impl Rgb {
    pub const WHITE: Rgb = Rgb(255, 255, 255);
    pub const BLACK: Rgb = Rgb(0, 0, 0);

    /// Linear mix: `t = 0` gives `self`, `t = 1` gives `other`.
    pub fn mix(self, other: Rgb, t: f32) -> Rgb {
        let t = t.clamp(0.0, 1.0);
        let m = |a: u8, b: u8| (a as f32 + (b as f32 - a as f32) * t).round() as u8;
        Rgb(m(self.0, other.0), m(self.1, other.1), m(self.2, other.2))
    }
}

/// A row-major RGB8 pixel buffer.
#[derive(Clone, Debug)]
pub struct Canvas {
    pub width: u32,
    pub height: u32,
    pub pixels: Vec<u8>,
}

impl Canvas {
    /// A canvas filled with `bg`.
    pub fn new(width: u32, height: u32, bg: Rgb) -> Canvas {
        let n = width as usize * height as usize;
        let mut pixels = Vec::with_capacity(n * 3);
        for _ in 0..n {
            pixels.extend_from_slice(&[bg.0, bg.1, bg.2]);
        }
        Canvas {
            width,
            height,
            pixels,
        }
    }

    fn index(&self, x: i64, y: i64) -> Option<usize> {
        if x < 0 || y < 0 || x >= self.width as i64 || y >= self.height as i64 {
            None
        } else {
            Some((y as usize * self.width as usize + x as usize) * 3)
        }
    }

    /// The colour at `(x, y)`, or `None` outside the canvas.
    #[cfg(test)]
    pub fn get(&self, x: u32, y: u32) -> Option<Rgb> {
        let i = self.index(x as i64, y as i64)?;
        Some(Rgb(self.pixels[i], self.pixels[i + 1], self.pixels[i + 2]))
    }

    /// Sets one pixel (ignored outside the canvas).
    pub fn put(&mut self, x: i64, y: i64, c: Rgb) {
        if let Some(i) = self.index(x, y) {
            self.pixels[i] = c.0;
            self.pixels[i + 1] = c.1;
            self.pixels[i + 2] = c.2;
        }
    }

    /// Blends `c` over the pixel with opacity `alpha` in `[0, 1]`.
    pub fn blend(&mut self, x: i64, y: i64, c: Rgb, alpha: f32) {
        if alpha <= 0.0 {
            return;
        }
        if let Some(i) = self.index(x, y) {
            let old = Rgb(self.pixels[i], self.pixels[i + 1], self.pixels[i + 2]);
            let new = if alpha >= 1.0 { c } else { old.mix(c, alpha) };
            self.pixels[i] = new.0;
            self.pixels[i + 1] = new.1;
            self.pixels[i + 2] = new.2;
        }
    }

    /// Fills the half-open rectangle `[x, x + w) × [y, y + h)`.
    pub fn fill_rect(&mut self, x: i64, y: i64, w: i64, h: i64, c: Rgb) {
        let x0 = x.max(0);
        let y0 = y.max(0);
        let x1 = (x + w).min(self.width as i64);
        let y1 = (y + h).min(self.height as i64);
        for yy in y0..y1 {
            for xx in x0..x1 {
                self.put(xx, yy, c);
            }
        }
    }

    /// Outlines the rectangle `[x, x + w) × [y, y + h)` with a 1-pixel border.
    pub fn stroke_rect(&mut self, x: i64, y: i64, w: i64, h: i64, c: Rgb) {
        if w <= 0 || h <= 0 {
            return;
        }
        self.fill_rect(x, y, w, 1, c);
        self.fill_rect(x, y + h - 1, w, 1, c);
        self.fill_rect(x, y, 1, h, c);
        self.fill_rect(x + w - 1, y, 1, h, c);
    }
}

/// Per-pixel coverage in `[0, 1]` over a clip rectangle of a canvas.
pub struct Mask {
    x0: i64,
    y0: i64,
    w: i64,
    h: i64,
    cov: Vec<f32>,
}

impl Mask {
    /// An empty mask covering the clip rectangle `[x0, x0 + w) × [y0, y0 + h)`.
    pub fn new(x0: i64, y0: i64, w: i64, h: i64) -> Mask {
        let (w, h) = (w.max(0), h.max(0));
        Mask {
            x0,
            y0,
            w,
            h,
            cov: vec![0.0; (w * h) as usize],
        }
    }

    fn raise(&mut self, x: i64, y: i64, v: f32) {
        let (lx, ly) = (x - self.x0, y - self.y0);
        if lx < 0 || ly < 0 || lx >= self.w || ly >= self.h {
            return;
        }
        let i = (ly * self.w + lx) as usize;
        if v > self.cov[i] {
            self.cov[i] = v.min(1.0);
        }
    }

    /// Adds an anti-aliased segment of the given stroke `width` (pixel-centre coordinates:
    /// pixel `(i, j)` spans `[i, i + 1) × [j, j + 1)` and has its centre at `(i + 0.5, j + 0.5)`).
    pub fn segment(&mut self, a: (f64, f64), b: (f64, f64), width: f64) {
        if !(a.0.is_finite() && a.1.is_finite() && b.0.is_finite() && b.1.is_finite()) {
            return;
        }
        let r = width / 2.0;
        // Pixels whose centre is within `reach` of the segment get some coverage.
        let reach = r + 0.5;
        let by0 = ((a.1.min(b.1) - reach - 1.0).floor() as i64).max(self.y0);
        let by1 = ((a.1.max(b.1) + reach + 1.0).ceil() as i64).min(self.y0 + self.h - 1);
        let (dx, dy) = (b.0 - a.0, b.1 - a.1);
        let len2 = dx * dx + dy * dy;
        for y in by0..=by1 {
            let py = y as f64 + 0.5;
            // The capsule is convex, so each row meets it in one interval: the union of the
            // rows through the two end discs and through the rectangle between them.
            let Some((lo, hi)) = capsule_row(a, b, py, reach + 0.01) else {
                continue;
            };
            let x0 = ((lo - 0.5).floor() as i64).max(self.x0);
            let x1 = ((hi - 0.5).ceil() as i64).min(self.x0 + self.w - 1);
            for x in x0..=x1 {
                let px = x as f64 + 0.5;
                let t = if len2 > 0.0 {
                    (((px - a.0) * dx + (py - a.1) * dy) / len2).clamp(0.0, 1.0)
                } else {
                    0.0
                };
                let (qx, qy) = (a.0 + t * dx - px, a.1 + t * dy - py);
                let d = (qx * qx + qy * qy).sqrt();
                let c = (reach - d).clamp(0.0, 1.0);
                if c > 0.0 {
                    self.raise(x, y, c as f32);
                }
            }
        }
    }

    /// Adds a filled disc (used for isolated points).
    pub fn dot(&mut self, p: (f64, f64), radius: f64) {
        self.segment(p, p, radius * 2.0);
    }

    /// Composites `color` onto the canvas with the accumulated coverage as opacity.
    pub fn paint(&self, canvas: &mut Canvas, color: Rgb) {
        for ly in 0..self.h {
            for lx in 0..self.w {
                let c = self.cov[(ly * self.w + lx) as usize];
                canvas.blend(self.x0 + lx, self.y0 + ly, color, c);
            }
        }
    }
}

/// The x-interval where the horizontal line at `py` is within `reach` of segment `a`–`b`.
fn capsule_row(a: (f64, f64), b: (f64, f64), py: f64, reach: f64) -> Option<(f64, f64)> {
    let mut out: Option<(f64, f64)> = None;
    let mut add = |lo: f64, hi: f64| {
        if lo <= hi {
            out = Some(match out {
                None => (lo, hi),
                Some((l, h)) => (l.min(lo), h.max(hi)),
            });
        }
    };
    for c in [a, b] {
        let d = py - c.1;
        if d.abs() < reach {
            let half = (reach * reach - d * d).sqrt();
            add(c.0 - half, c.0 + half);
        }
    }
    let (dx, dy) = (b.0 - a.0, b.1 - a.1);
    let len = (dx * dx + dy * dy).sqrt();
    if len > 0.0 {
        let (ux, uy) = (dx / len, dy / len);
        // Along the segment: 0 <= u·(p - a) <= len; across it: |n·(p - a)| <= reach, n = (-uy, ux).
        let along = solve(ux, uy * (py - a.1) - ux * a.0, 0.0, len);
        let across = solve(-uy, ux * (py - a.1) + uy * a.0, -reach, reach);
        if let (Some(p), Some(q)) = (along, across) {
            add(p.0.max(q.0), p.1.min(q.1));
        }
    }
    out
}

/// Solves `lo <= k * x + c <= hi` for `x`; `None` when empty, infinite bounds when `k == 0`.
fn solve(k: f64, c: f64, lo: f64, hi: f64) -> Option<(f64, f64)> {
    if k.abs() < 1e-12 {
        return (c >= lo && c <= hi).then_some((f64::NEG_INFINITY, f64::INFINITY));
    }
    let (p, q) = ((lo - c) / k, (hi - c) / k);
    Some((p.min(q), p.max(q)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_are_clipped() {
        let mut c = Canvas::new(4, 3, Rgb::WHITE);
        c.put(-1, 0, Rgb::BLACK);
        c.put(4, 0, Rgb::BLACK);
        c.fill_rect(-10, -10, 100, 100, Rgb(1, 2, 3));
        assert_eq!(c.pixels.len(), 4 * 3 * 3);
        assert!(c.pixels.chunks(3).all(|p| p == [1, 2, 3]));
        assert_eq!(c.get(4, 0), None);
    }

    #[test]
    fn thick_segment_has_solid_core_and_stays_in_clip() {
        let mut canvas = Canvas::new(20, 20, Rgb::WHITE);
        let mut m = Mask::new(2, 2, 16, 16);
        m.segment((0.0, 10.0), (30.0, 10.0), 2.5);
        let red = Rgb(200, 0, 0);
        m.paint(&mut canvas, red);
        assert_eq!(canvas.get(10, 9), Some(red));
        assert_eq!(canvas.get(10, 12), Some(Rgb::WHITE));
        // Clipped to the mask rectangle.
        assert_eq!(canvas.get(1, 9), Some(Rgb::WHITE));
        assert_eq!(canvas.get(18, 9), Some(Rgb::WHITE));
    }

    #[test]
    fn row_spans_match_brute_force() {
        // Coverage from the row-span rasteriser equals a brute-force distance test.
        let segs = [
            ((3.2, 4.7), (40.1, 31.9)),
            ((10.0, 10.0), (10.0, 30.0)),
            ((5.5, 20.2), (44.0, 20.2)),
            ((30.0, 2.0), (6.0, 38.0)),
            ((20.0, 20.0), (20.0, 20.0)),
        ];
        for (a, b) in segs {
            let mut m = Mask::new(0, 0, 48, 40);
            m.segment(a, b, 2.5);
            let reach = 1.25 + 0.5;
            for y in 0..40 {
                for x in 0..48 {
                    let (px, py) = (x as f64 + 0.5, y as f64 + 0.5);
                    let (dx, dy) = (b.0 - a.0, b.1 - a.1);
                    let l2 = dx * dx + dy * dy;
                    let t = if l2 > 0.0 {
                        (((px - a.0) * dx + (py - a.1) * dy) / l2).clamp(0.0, 1.0)
                    } else {
                        0.0
                    };
                    let d = ((a.0 + t * dx - px).powi(2) + (a.1 + t * dy - py).powi(2)).sqrt();
                    let want = (reach - d).clamp(0.0, 1.0) as f32;
                    let got = m.cov[(y * 48 + x) as usize];
                    assert!(
                        (got - want).abs() < 1e-6,
                        "{a:?}-{b:?} at ({x},{y}): {got} vs {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn mix_endpoints() {
        let a = Rgb(0, 100, 200);
        let b = Rgb(255, 0, 0);
        assert_eq!(a.mix(b, 0.0), a);
        assert_eq!(a.mix(b, 1.0), b);
    }
}
