//! dflash-plot: line charts for training curves (loss, accuracy, acceptance streak vs step) and
//! evaluation plots, drawn with plotters on its bitmap backend and written as PNG.
//!
//! A [`Figure`] is a title over a grid of [`Panel`]s, `columns` per row, each panel a cell of
//! `panel_width × panel_height` pixels with a titled chart: a light grid, numeric tick labels,
//! axis descriptions, one coloured line per [`Series`] and a legend. Text is set in DejaVu Sans,
//! embedded in the crate (`assets/DejaVuSans.ttf`, its licence beside it), so rendering reads no
//! system font; sizes scale with the panel size.
//!
//! Invariants:
//! - Rendering never panics on data: NaN/±inf points are skipped (they break the line), a run of
//!   one point is a dot, empty series and all-equal values are fine (ranges are padded), and a
//!   panel without any finite point shows its title and "no data". With `log_y` the y axis is
//!   logarithmic and points with `y <= 0` are skipped like non-finite ones.
//! - Output is deterministic: the same figure gives byte-identical pixels and PNG.
//! - The image is RGB8, row-major, white background; its size is
//!   `min(columns, panels) * panel_width` by `title_height + rows * panel_height`.
//! - Errors instead of panics for unusable input: no panels, `columns == 0`, panels too small
//!   for their text, or an image too large to allocate sensibly.
//! - [`Figure::save_png`] is atomic: it writes a temporary file in the target directory and
//!   renames it over the target, so readers never see a half-written PNG.
//!
//! A [`BarChart`] is one titled chart of labelled bars (same font, palette and guarantees).
//!
//! Series colours come from a fixed ten-colour palette, in series order (see
//! [`series_color`]).
//!
//! ```
//! use dflash_plot::{Figure, Panel, Series};
//! let loss: Vec<(f64, f64)> = (0..100).map(|s| (s as f64, 4.0 / (1.0 + s as f64))).collect();
//! let fig = Figure {
//!     title: "training".into(),
//!     panels: vec![Panel {
//!         title: "loss".into(),
//!         x_label: "step".into(),
//!         y_label: "loss".into(),
//!         series: vec![Series::new("train", loss)],
//!         log_y: true,
//!     }],
//!     ..Figure::default()
//! };
//! let png = fig.render()?.encode_png()?;
//! assert_eq!(&png[1..4], b"PNG");
//! # Ok::<(), dflash_plot::PlotError>(())
//! ```

mod chart;

use std::io::Write;
use std::path::{Path, PathBuf};

/// An RGB colour.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rgb(pub u8, pub u8, pub u8);

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

/// The colour of series number `i`.
pub fn series_color(i: usize) -> Rgb {
    PALETTE[i % PALETTE.len()]
}

/// Smallest accepted panel width in pixels.
pub const MIN_PANEL_WIDTH: u32 = 160;
/// Smallest accepted panel height in pixels.
pub const MIN_PANEL_HEIGHT: u32 = 120;
/// Largest accepted image, in pixels (about 100 megapixels).
pub const MAX_PIXELS: u64 = 100_000_000;

/// One line: a name for the legend and `(x, y)` points drawn in order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

impl Series {
    /// A series named `name` with the given points.
    pub fn new(name: impl Into<String>, points: Vec<(f64, f64)>) -> Series {
        Series {
            name: name.into(),
            points,
        }
    }
}

/// One chart of the figure. Series with an empty name are drawn but left out of the legend.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Panel {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub series: Vec<Series>,
    /// Plot `log10(y)` with ticks at powers of ten; non-positive `y` are skipped.
    pub log_y: bool,
}

/// A titled grid of panels.
#[derive(Clone, Debug, PartialEq)]
pub struct Figure {
    pub title: String,
    pub panels: Vec<Panel>,
    /// Panels per row (at least 1).
    pub columns: usize,
    /// Width of each panel cell in pixels (at least [`MIN_PANEL_WIDTH`]).
    pub panel_width: u32,
    /// Height of each panel cell in pixels (at least [`MIN_PANEL_HEIGHT`]).
    pub panel_height: u32,
}

impl Default for Figure {
    /// No title, no panels, two columns of 640×400 panels.
    fn default() -> Figure {
        Figure {
            title: String::new(),
            panels: Vec::new(),
            columns: 2,
            panel_width: 640,
            panel_height: 400,
        }
    }
}

/// An RGB8 image, row-major: pixel `(x, y)` is at `pixels[3 * (y * width + x)..][..3]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RgbImage {
    pub width: u32,
    pub height: u32,
    pub pixels: Vec<u8>,
}

/// Everything that can go wrong while rendering or writing a figure.
#[derive(thiserror::Error, Debug)]
pub enum PlotError {
    #[error("figure has no panels")]
    NoPanels,
    #[error("invalid figure layout: {0}")]
    Layout(String),
    #[error("image of {width}x{height} pixels is too large (limit {MAX_PIXELS} pixels)")]
    TooLarge { width: u64, height: u64 },
    #[error("pixel buffer has {got} bytes, expected {expected} for a {width}x{height} RGB8 image")]
    BadBuffer {
        width: u32,
        height: u32,
        expected: usize,
        got: usize,
    },
    #[error("PNG encoding failed: {0}")]
    Encode(#[from] png::EncodingError),
    #[error("drawing failed: {0}")]
    Draw(String),
    #[error("writing {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Text scale for panels of the given size: larger panels get larger text.
fn text_scale(w: u32, h: u32) -> u32 {
    if w >= 1200 && h >= 750 {
        3
    } else if w >= 480 && h >= 300 {
        2
    } else {
        1
    }
}

/// A titled chart of horizontal bars, one labelled bar per entry, the first at the top (the
/// diagnosis's τ per variant). Highlighted bars take the palette's second colour, the others its
/// first; each bar's value is printed after it. Non-finite values draw no bar (their label
/// stays). `y_label` describes the values' axis.
#[derive(Clone, Debug, PartialEq)]
pub struct BarChart {
    pub title: String,
    pub y_label: String,
    /// `(label, value, highlighted)`.
    pub bars: Vec<(String, f64, bool)>,
    pub width: u32,
    pub height: u32,
}

impl BarChart {
    /// Renders the chart to an RGB image (errors: no bars, a size under
    /// [`MIN_PANEL_WIDTH`]×[`MIN_PANEL_HEIGHT`] or over [`MAX_PIXELS`]).
    pub fn render(&self) -> Result<RgbImage, PlotError> {
        if self.bars.is_empty() {
            return Err(PlotError::NoPanels);
        }
        if self.width < MIN_PANEL_WIDTH || self.height < MIN_PANEL_HEIGHT {
            return Err(PlotError::Layout(format!(
                "charts must be at least {MIN_PANEL_WIDTH}x{MIN_PANEL_HEIGHT} pixels, got {}x{}",
                self.width, self.height
            )));
        }
        if self.width as u64 * self.height as u64 > MAX_PIXELS {
            return Err(PlotError::TooLarge {
                width: self.width as u64,
                height: self.height as u64,
            });
        }
        let mut pixels = vec![255u8; self.width as usize * self.height as usize * 3];
        let scale = text_scale(self.width, self.height);
        chart::draw_bars(self, &mut pixels, scale)?;
        Ok(RgbImage {
            width: self.width,
            height: self.height,
            pixels,
        })
    }

    /// Renders the chart and writes it as a PNG to `path`, atomically.
    pub fn save_png(&self, path: &Path) -> Result<(), PlotError> {
        let bytes = self.render()?.encode_png()?;
        write_atomic(path, &bytes).map_err(|source| PlotError::Io {
            path: path.to_path_buf(),
            source,
        })
    }
}

/// Height of the figure's title band at text scale `scale` (a 14·scale px line, 6·scale px above
/// and below).
fn title_height(scale: u32) -> u32 {
    26 * scale
}

impl Figure {
    /// Renders the figure to an RGB image.
    pub fn render(&self) -> Result<RgbImage, PlotError> {
        if self.panels.is_empty() {
            return Err(PlotError::NoPanels);
        }
        if self.columns == 0 {
            return Err(PlotError::Layout("columns must be at least 1".into()));
        }
        if self.panel_width < MIN_PANEL_WIDTH || self.panel_height < MIN_PANEL_HEIGHT {
            return Err(PlotError::Layout(format!(
                "panels must be at least {MIN_PANEL_WIDTH}x{MIN_PANEL_HEIGHT} pixels, got {}x{}",
                self.panel_width, self.panel_height
            )));
        }
        let n = self.panels.len() as u64;
        let cols = (self.columns as u64).min(n);
        let rows = n.div_ceil(cols);
        let scale = text_scale(self.panel_width, self.panel_height);
        let title_h = if self.title.is_empty() {
            0
        } else {
            title_height(scale) as u64
        };
        let width = cols * self.panel_width as u64;
        let height = title_h + rows * self.panel_height as u64;
        if width * height > MAX_PIXELS || width > u32::MAX as u64 || height > u32::MAX as u64 {
            return Err(PlotError::TooLarge { width, height });
        }
        let (width, height) = (width as u32, height as u32);
        let mut pixels = vec![255u8; width as usize * height as usize * 3];
        chart::draw(
            self,
            &mut pixels,
            (width, height),
            title_h as u32,
            (rows as usize, cols as usize),
            scale,
        )?;
        Ok(RgbImage {
            width,
            height,
            pixels,
        })
    }

    /// Renders the figure and writes it as a PNG to `path`, atomically (temporary file in the
    /// same directory, then rename). On error no temporary file is left behind.
    pub fn save_png(&self, path: &Path) -> Result<(), PlotError> {
        let bytes = self.render()?.encode_png()?;
        write_atomic(path, &bytes).map_err(|source| PlotError::Io {
            path: path.to_path_buf(),
            source,
        })
    }
}

impl RgbImage {
    /// The colour of pixel `(x, y)`, or `None` outside the image (or for a short buffer).
    pub fn pixel(&self, x: u32, y: u32) -> Option<[u8; 3]> {
        if x >= self.width || y >= self.height {
            return None;
        }
        let i = 3 * (y as usize * self.width as usize + x as usize);
        self.pixels.get(i..i + 3).map(|p| [p[0], p[1], p[2]])
    }

    /// Encodes the image as an 8-bit RGB PNG.
    pub fn encode_png(&self) -> Result<Vec<u8>, PlotError> {
        let expected = self.width as usize * self.height as usize * 3;
        if self.pixels.len() != expected {
            return Err(PlotError::BadBuffer {
                width: self.width,
                height: self.height,
                expected,
                got: self.pixels.len(),
            });
        }
        let mut out = Vec::new();
        {
            let mut enc = png::Encoder::new(&mut out, self.width, self.height);
            enc.set_color(png::ColorType::Rgb);
            enc.set_depth(png::BitDepth::Eight);
            let mut writer = enc.write_header()?;
            writer.write_image_data(&self.pixels)?;
            writer.finish()?;
        }
        Ok(out)
    }
}

/// Writes `bytes` to a temporary file next to `path`, syncs it and renames it over `path`
/// (`tempfile` removes the temporary file if any step fails).
fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let mut f = tempfile::NamedTempFile::new_in(dir)?;
    f.write_all(bytes)?;
    f.as_file().sync_all()?;
    f.persist(path).map_err(|e| e.error)?;
    Ok(())
}

#[cfg(test)]
mod tests;
