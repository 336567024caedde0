//! Crate-level tests: rendering, PNG round trips, robustness and atomic saving.

use super::*;
use std::fs;
use std::io::Cursor;

fn two_series_figure() -> Figure {
    let a: Vec<(f64, f64)> = (0..200)
        .map(|i| (i as f64, (i as f64 / 20.0).sin()))
        .collect();
    let b: Vec<(f64, f64)> = (0..200).map(|i| (i as f64, i as f64 / 200.0)).collect();
    Figure {
        title: "Test figure".into(),
        panels: vec![Panel {
            title: "two series".into(),
            x_label: "step".into(),
            y_label: "value".into(),
            series: vec![Series::new("sin", a), Series::new("ramp", b)],
            log_y: false,
        }],
        columns: 1,
        panel_width: 640,
        panel_height: 400,
    }
}

fn count_color(img: &RgbImage, c: Rgb) -> usize {
    img.pixels
        .chunks_exact(3)
        .filter(|p| p[0] == c.0 && p[1] == c.1 && p[2] == c.2)
        .count()
}

fn decode(bytes: &[u8]) -> (u32, u32, Vec<u8>) {
    let dec = png::Decoder::new(Cursor::new(bytes));
    let mut reader = dec.read_info().expect("png header");
    let mut buf = vec![0; reader.output_buffer_size().expect("buffer size")];
    let info = reader.next_frame(&mut buf).expect("png frame");
    assert_eq!(info.color_type, png::ColorType::Rgb);
    assert_eq!(info.bit_depth, png::BitDepth::Eight);
    buf.truncate(info.buffer_size());
    (info.width, info.height, buf)
}

fn scratch_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("dflash-plot-{tag}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&d);
    fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn render_has_expected_size() {
    let fig = two_series_figure();
    let img = fig.render().unwrap();
    let title_h = title_height(2); // 640×400 panels set text at scale 2
    assert_eq!(img.width, 640);
    assert_eq!(img.height, 400 + title_h);
    assert_eq!(img.pixels.len(), (img.width * img.height * 3) as usize);
    // White background dominates.
    assert_eq!(img.pixel(0, 0), Some([255, 255, 255]));
}

#[test]
fn grid_size_follows_columns() {
    let mut fig = two_series_figure();
    fig.title.clear();
    fig.panels = vec![fig.panels[0].clone(); 3];
    fig.columns = 2;
    let img = fig.render().unwrap();
    assert_eq!((img.width, img.height), (1280, 800));
    fig.columns = 5; // more columns than panels: width shrinks to the panels present
    let img = fig.render().unwrap();
    assert_eq!((img.width, img.height), (1920, 400));
}

#[test]
fn png_round_trip_has_series_colours() {
    let fig = two_series_figure();
    let img = fig.render().unwrap();
    let bytes = img.encode_png().unwrap();
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    let (w, h, px) = decode(&bytes);
    assert_eq!((w, h), (img.width, img.height));
    assert_eq!(px, img.pixels);
    let decoded = RgbImage {
        width: w,
        height: h,
        pixels: px,
    };
    for i in 0..2 {
        let n = count_color(&decoded, series_color(i));
        // A line across a ~560 px wide plot has far more solid pixels than its legend entry.
        assert!(n > 600, "series {i}: only {n} pixels of its colour");
    }
    // A colour not used by any series is absent.
    assert_eq!(count_color(&decoded, series_color(2)), 0);
}

#[test]
fn non_finite_points_are_skipped() {
    let base = vec![(0.0, 0.0), (1.0, 1.0), (2.0, 4.0)];
    let mut noisy = base.clone();
    noisy.extend([
        (f64::NAN, 1e300),
        (5e10, f64::NAN),
        (f64::INFINITY, 3.0),
        (1.0, f64::NEG_INFINITY),
    ]);
    let mk = |a: Vec<(f64, f64)>, b: Vec<(f64, f64)>| Figure {
        title: String::new(),
        panels: vec![Panel {
            title: "nan".into(),
            series: vec![Series::new("a", a), Series::new("b", b)],
            ..Panel::default()
        }],
        columns: 1,
        panel_width: 400,
        panel_height: 300,
    };
    let clean = mk(base.clone(), vec![]).render().unwrap();
    let dirty = mk(
        noisy,
        vec![
            (f64::NAN, 1.0),
            (2.0, f64::NAN),
            (f64::INFINITY, f64::INFINITY),
        ],
    )
    .render()
    .unwrap();
    assert!(clean == dirty, "non-finite points changed the picture");
    // Sanity: the comparison can fail — different data gives a different image.
    let other = mk(vec![(0.0, 0.0), (1.0, 2.0), (2.0, 4.0)], vec![])
        .render()
        .unwrap();
    assert!(clean != other);
}

#[test]
fn zero_panels_is_an_error() {
    let fig = Figure::default();
    assert!(matches!(fig.render(), Err(PlotError::NoPanels)));
    let dir = scratch_dir("nopanels");
    let path = dir.join("x.png");
    assert!(matches!(fig.save_png(&path), Err(PlotError::NoPanels)));
    assert!(!path.exists());
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_layouts_are_errors() {
    let mut fig = two_series_figure();
    fig.columns = 0;
    assert!(matches!(fig.render(), Err(PlotError::Layout(_))));
    let mut fig = two_series_figure();
    fig.panel_width = 50;
    assert!(matches!(fig.render(), Err(PlotError::Layout(_))));
    let mut fig = two_series_figure();
    fig.panels = vec![fig.panels[0].clone(); 40];
    fig.columns = 40;
    fig.panel_width = 20_000;
    assert!(matches!(fig.render(), Err(PlotError::TooLarge { .. })));
}

#[test]
fn degenerate_data_does_not_panic() {
    let panels = vec![
        Panel::default(),
        Panel {
            title: "empty series".into(),
            series: vec![Series::new("e", vec![]), Series::default()],
            ..Panel::default()
        },
        Panel {
            title: "all equal".into(),
            series: vec![Series::new("c", vec![(1.0, 3.0); 10])],
            ..Panel::default()
        },
        Panel {
            title: "single point, log".into(),
            series: vec![Series::new("p", vec![(5.0, 0.5)])],
            log_y: true,
            ..Panel::default()
        },
        Panel {
            title: "log with non-positive".into(),
            series: vec![Series::new(
                "l",
                vec![(0.0, -1.0), (1.0, 0.0), (2.0, 0.1), (3.0, 0.01)],
            )],
            log_y: true,
            ..Panel::default()
        },
        Panel {
            title: "log all non-positive".into(),
            series: vec![Series::new("z", vec![(0.0, 0.0), (1.0, -3.0)])],
            log_y: true,
            ..Panel::default()
        },
        Panel {
            title: "huge".into(),
            series: vec![Series::new(
                "h",
                vec![(-f64::MAX, -f64::MAX), (f64::MAX, f64::MAX)],
            )],
            ..Panel::default()
        },
    ];
    let fig = Figure {
        title: "degenerate ☃ cases".into(),
        panels,
        columns: 3,
        panel_width: 320,
        panel_height: 240,
    };
    let img = fig.render().unwrap();
    assert_eq!(img.width, 960);
    // The isolated log point is drawn as a dot in its colour.
    assert!(count_color(&img, series_color(0)) > 0);
}

#[test]
fn rendering_is_deterministic() {
    let fig = two_series_figure();
    let a = fig.render().unwrap().encode_png().unwrap();
    let b = fig.render().unwrap().encode_png().unwrap();
    assert_eq!(a, b);
}

#[test]
fn encode_rejects_bad_buffers() {
    let img = RgbImage {
        width: 3,
        height: 2,
        pixels: vec![0; 17],
    };
    assert!(matches!(
        img.encode_png(),
        Err(PlotError::BadBuffer { expected: 18, .. })
    ));
}

#[test]
fn save_is_atomic_and_leaves_no_temp_file() {
    let dir = scratch_dir("save");
    let path = dir.join("curves.png");
    fs::write(&path, b"old contents").unwrap();
    let fig = two_series_figure();
    fig.save_png(&path).unwrap();
    let names: Vec<_> = fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(names, vec!["curves.png".to_string()]);
    let bytes = fs::read(&path).unwrap();
    let (w, h, _) = decode(&bytes);
    let img = fig.render().unwrap();
    assert_eq!((w, h), (img.width, img.height));

    // A save into a missing directory fails cleanly.
    let missing = dir.join("no-such-dir").join("x.png");
    assert!(matches!(fig.save_png(&missing), Err(PlotError::Io { .. })));
    let names: Vec<_> = fs::read_dir(&dir).unwrap().collect();
    assert_eq!(names.len(), 1);
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn many_points_render() {
    let pts: Vec<(f64, f64)> = (0..200_000)
        .map(|i| (i as f64, 1.0 + ((i * 7919) % 1000) as f64 / 1000.0))
        .collect();
    let fig = Figure {
        title: String::new(),
        panels: vec![Panel {
            title: "noisy".into(),
            series: vec![Series::new("n", pts)],
            ..Panel::default()
        }],
        columns: 1,
        panel_width: 640,
        panel_height: 400,
    };
    let img = fig.render().unwrap();
    assert!(count_color(&img, series_color(0)) > 1000);
}

#[test]
fn bar_chart_draws_each_bar_in_its_colour() {
    let mk = |bars: Vec<(String, f64, bool)>| BarChart {
        title: "tau per variant".into(),
        y_label: "tau".into(),
        bars,
        width: 800,
        height: 400,
    };
    let chart = mk(vec![
        ("declared".into(), 3.5, true),
        ("taps -1".into(), 3.4, false),
        ("final norm".into(), 1.3, false),
        ("broken".into(), f64::NAN, false),
    ]);
    let img = chart.render().unwrap();
    assert_eq!((img.width, img.height), (800, 400));
    let hi = count_color(&img, series_color(1));
    let lo = count_color(&img, series_color(0));
    // two plain bars (3.4 and 1.3 high) against one highlighted bar of 3.5
    assert!(hi > 1000 && lo > hi, "highlighted {hi}, plain {lo}");
    assert_eq!(chart.render().unwrap(), img, "deterministic");
    // the NaN bar draws nothing: taking it away leaves every bar's pixel count as it was
    let three = mk(vec![
        ("declared".into(), 3.5, true),
        ("taps -1".into(), 3.4, false),
        ("final norm".into(), 1.3, false),
    ])
    .render()
    .unwrap();
    let (lo3, hi3) = (
        count_color(&three, series_color(0)),
        count_color(&three, series_color(1)),
    );
    // (three bars spread wider than four: more pixels each, in the same proportion)
    assert!(lo3 > lo && hi3 > hi);
    let ratio = |a: usize, b: usize| a as f64 / b as f64;
    assert!((ratio(lo3, hi3) - ratio(lo, hi)).abs() < 0.05 * ratio(lo, hi));
    assert!(matches!(mk(vec![]).render(), Err(PlotError::NoPanels)));
    let small = BarChart {
        width: 50,
        ..mk(vec![("a".into(), 1.0, false)])
    };
    assert!(matches!(small.render(), Err(PlotError::Layout(_))));
}
