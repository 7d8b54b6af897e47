//! Loss curves: train and val loss against iteration, rendered to a PNG beside each checkpoint.
//!
//! Text is drawn with a font compiled into the binary (Noto Sans Regular, Apache-2.0, from the
//! `ttf-noto-sans` crate) through plotters' `ab_glyph` renderer, so plots render the same on a
//! headless machine with no system fonts and no fontconfig. The pixels are encoded with `png` and the
//! file is written atomically (temp file in the same directory, then renamed over the target).

use std::ops::Range;
use std::path::Path;
use std::sync::OnceLock;

use anyhow::{Context, Result, anyhow, bail};
use plotters::coord::ranged1d::Ranged;
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;
use plotters::style::{FontStyle, register_font};

/// Image size in pixels.
const WIDTH: u32 = 960;
const HEIGHT: u32 = 540;
/// The family the bundled font is registered under; plotters' default for labels.
const FONT: &str = "sans-serif";
/// At most this many labels on the y axis.
const Y_LABELS: usize = 10;
const TRAIN_COLOUR: RGBColor = RGBColor(31, 119, 180);
const VAL_COLOUR: RGBColor = RGBColor(255, 127, 14);

/// Writes a loss-curve PNG (960x540) of `train` and `val` (iteration, loss) points to `path`.
///
/// Non-finite losses are skipped; either series may be empty or hold a single point. The y-range is
/// the data's min..max with a margin. The file is replaced atomically: on error `path` is untouched and
/// no partial file is left behind.
pub fn write_loss_png(
    path: &Path,
    title: &str,
    train: &[(usize, f32)],
    val: &[(usize, f32)],
) -> Result<()> {
    let png = render_png(title, train, val)
        .with_context(|| format!("rendering the loss plot for {}", path.display()))?;
    tinygpt_models::gpt::checkpoint::write_atomic(path, &png)
        .with_context(|| format!("writing the loss plot {}", path.display()))
}

/// Registers the bundled font with plotters once per process.
fn ensure_font() -> Result<()> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let ok = *REGISTERED
        .get_or_init(|| register_font(FONT, FontStyle::Normal, ttf_noto_sans::REGULAR).is_ok());
    if !ok {
        bail!("the bundled font could not be parsed");
    }
    Ok(())
}

/// The finite points of a series, as plot coordinates.
fn finite(points: &[(usize, f32)]) -> Vec<(usize, f64)> {
    points
        .iter()
        .filter(|(_, y)| y.is_finite())
        .map(|&(x, y)| (x, f64::from(y)))
        .collect()
}

/// The x-range covering every point (at least one iteration wide), or 0..1 with no points.
fn x_range(points: &[(usize, f64)]) -> Range<usize> {
    let lo = points.iter().map(|p| p.0).min().unwrap_or(0);
    let hi = points.iter().map(|p| p.0).max().unwrap_or(1);
    lo..hi.max(lo.saturating_add(1))
}

/// The y-range: min..max of the values with a 5% margin each side (a fixed margin around a single
/// value), or 0..1 with no values.
fn y_range(points: &[(usize, f64)]) -> Range<f64> {
    let lo = points.iter().map(|p| p.1).fold(f64::INFINITY, f64::min);
    let hi = points.iter().map(|p| p.1).fold(f64::NEG_INFINITY, f64::max);
    if lo > hi {
        return 0.0..1.0;
    }
    let span = hi - lo;
    let margin = if span > 0.0 {
        span * 0.05
    } else {
        (lo.abs() * 0.05).max(0.05)
    };
    (lo - margin)..(hi + margin)
}

/// Decimals for the y labels: the fewest that print every tick plotters places on `ys` exactly, so
/// all labels get the same number of decimals ("1.40", "1.45", "1.50", not "1.4", "1.45", "1.5").
fn label_decimals(ys: &Range<f64>) -> usize {
    let ticks = RangedCoordf64::from(ys.clone()).key_points(Y_LABELS);
    (0..8)
        .find(|&d| {
            let scale = 10f64.powi(d as i32);
            ticks
                .iter()
                .all(|t| ((t * scale).round() - t * scale).abs() < 1e-6)
        })
        .unwrap_or(8)
}

/// Renders the plot and encodes it as PNG bytes.
fn render_png(title: &str, train: &[(usize, f32)], val: &[(usize, f32)]) -> Result<Vec<u8>> {
    ensure_font()?;
    let train = finite(train);
    let val = finite(val);
    let all: Vec<(usize, f64)> = train.iter().chain(&val).copied().collect();
    let (xs, ys) = (x_range(&all), y_range(&all));
    let decimals = label_decimals(&ys);
    let y_label = move |y: &f64| {
        // Values that round to zero print as "0.00", not "-0.00".
        let y = if y.abs() < 0.5 * 10f64.powi(-(decimals as i32)) {
            0.0
        } else {
            *y
        };
        format!("{y:.decimals$}")
    };

    let mut rgb = vec![0u8; WIDTH as usize * HEIGHT as usize * 3];
    {
        // Plotters' errors borrow the backend's error type; flatten them to text for anyhow.
        let e = |e: DrawingAreaErrorKind<_>| anyhow!("{e}");
        let root = BitMapBackend::with_buffer(&mut rgb, (WIDTH, HEIGHT)).into_drawing_area();
        root.fill(&WHITE).map_err(e)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, (FONT, 24))
            .margin(16)
            .x_label_area_size(52)
            .y_label_area_size(72)
            .build_cartesian_2d(xs, ys)
            .map_err(e)?;
        chart
            .configure_mesh()
            .x_desc("iteration")
            .y_desc("loss")
            .label_style((FONT, 14))
            .axis_desc_style((FONT, 16))
            .y_labels(Y_LABELS)
            .y_label_formatter(&y_label)
            .light_line_style(RGBColor(242, 242, 242))
            .draw()
            .map_err(e)?;

        // A line needs two points: a lone train point gets a marker so it still shows.
        let series = [
            (
                "train",
                &train,
                TRAIN_COLOUR,
                if train.len() == 1 { 3 } else { 0 },
            ),
            ("val", &val, VAL_COLOUR, 3),
        ];
        let mut labelled = false;
        for (label, points, colour, marker) in series {
            if points.is_empty() {
                continue;
            }
            let style = colour.stroke_width(2);
            chart
                .draw_series(LineSeries::new(points.iter().copied(), style).point_size(marker))
                .map_err(e)?
                .label(label)
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 24, y)], style));
            labelled = true;
        }
        if labelled {
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperRight)
                .label_font((FONT, 14))
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .draw()
                .map_err(e)?;
        }
        root.present().map_err(e)?;
    }

    let mut png = Vec::new();
    let mut encoder = png::Encoder::new(&mut png, WIDTH, HEIGHT);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header()?;
    writer.write_image_data(&rgb)?;
    writer.finish()?;
    Ok(png)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    type Series = Vec<(usize, f32)>;
    type Points = [(usize, f32)];

    fn temp_dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("tinygpt-plot-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// Decodes a PNG file to (width, height, RGB pixels).
    fn decode(path: &Path) -> (u32, u32, Vec<[u8; 3]>) {
        let file = std::io::BufReader::new(std::fs::File::open(path).unwrap());
        let mut reader = png::Decoder::new(file).read_info().unwrap();
        let mut buf = vec![0; reader.output_buffer_size().unwrap()];
        let info = reader.next_frame(&mut buf).unwrap();
        assert_eq!(info.color_type, png::ColorType::Rgb);
        assert_eq!(info.bit_depth, png::BitDepth::Eight);
        let px = buf[..info.buffer_size()]
            .chunks_exact(3)
            .map(|c| [c[0], c[1], c[2]])
            .collect();
        (info.width, info.height, px)
    }

    fn count(px: &[[u8; 3]], c: RGBColor) -> usize {
        px.iter().filter(|p| **p == [c.0, c.1, c.2]).count()
    }

    /// A nanoGPT-like run: loss falls from ~4.2 towards ~1.5, evaluated every 250 iterations.
    fn curves() -> (Series, Series) {
        let loss = |i: usize| 1.45 + 2.75 * (-(i as f32) / 800.0).exp();
        let train = (0..=5000)
            .step_by(10)
            .map(|i| (i, loss(i) + 0.03 * ((i as f32) * 0.37).sin()))
            .collect();
        let val = (0..=5000)
            .step_by(250)
            .map(|i| (i, loss(i) + 0.05))
            .collect();
        (train, val)
    }

    #[test]
    fn renders_a_realistic_curve() {
        let dir = temp_dir("curve");
        let path = dir.join("loss.png");
        let (train, val) = curves();
        write_loss_png(&path, "shakespeare-char", &train, &val).unwrap();

        let bytes = std::fs::read(&path).unwrap();
        assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n"));
        let (w, h, px) = decode(&path);
        assert_eq!((w, h), (WIDTH, HEIGHT));
        // Both lines are drawn in their own colours, and text (dark, anti-aliased) is there too.
        assert!(count(&px, TRAIN_COLOUR) > 500, "train line missing");
        assert!(count(&px, VAL_COLOUR) > 500, "val line missing");
        let grey = px
            .iter()
            .filter(|p| p[0] == p[1] && p[1] == p[2] && p[0] > 20 && p[0] < 200)
            .count();
        assert!(grey > 1000, "no anti-aliased text ({grey} grey pixels)");
        // The title is drawn: dark pixels in the caption band above the plot.
        let title = px[..40 * WIDTH as usize]
            .iter()
            .filter(|p| p.iter().all(|&c| c < 128))
            .count();
        assert!(title > 50, "no title ({title} dark pixels)");
        // Nothing but the PNG is left in the directory.
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["loss.png"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn replaces_an_existing_plot() {
        let dir = temp_dir("replace");
        let path = dir.join("loss.png");
        std::fs::write(&path, b"old").unwrap();
        let (train, val) = curves();
        write_loss_png(&path, "run", &train[..10], &val[..2]).unwrap();
        assert_eq!(decode(&path).0, WIDTH);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn empty_single_and_non_finite_series_render() {
        let dir = temp_dir("edge");
        let nan = f32::NAN;
        let cases: [(&Points, &Points); 7] = [
            (&[], &[]),
            (&[(0, 4.2)], &[]),
            (&[], &[(100, 3.0)]),
            (&[(7, 2.0)], &[(7, 2.0)]),
            (&[(0, 0.0), (10, 0.0)], &[]),
            (
                &[(0, nan), (1, f32::INFINITY), (2, f32::NEG_INFINITY)],
                &[(5, nan)],
            ),
            (
                &[(0, 4.0), (1, nan), (2, 3.0), (3, f32::INFINITY), (4, 2.5)],
                &[(2, 3.1)],
            ),
        ];
        for (i, (train, val)) in cases.into_iter().enumerate() {
            let path = dir.join(format!("{i}.png"));
            write_loss_png(&path, "", train, val).unwrap();
            assert_eq!(decode(&path).0, WIDTH, "case {i}");
        }
        // A lone point still shows (as a marker).
        let (_, _, px) = decode(&dir.join("1.png"));
        assert!(count(&px, TRAIN_COLOUR) > 0);
        let (_, _, px) = decode(&dir.join("2.png"));
        assert!(count(&px, VAL_COLOUR) > 0);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn ranges_cover_the_data_with_a_margin() {
        assert_eq!(x_range(&[]), 0..1);
        assert_eq!(x_range(&[(5, 1.0)]), 5..6);
        assert_eq!(x_range(&[(5, 1.0), (9, 2.0), (0, 3.0)]), 0..9);
        assert_eq!(y_range(&[]), 0.0..1.0);
        let r = y_range(&[(0, 2.0), (1, 4.0)]);
        assert!(
            (r.start - 1.9).abs() < 1e-12 && (r.end - 4.1).abs() < 1e-12,
            "{r:?}"
        );
        let r = y_range(&[(0, 2.0)]);
        assert!(r.start < 2.0 && r.end > 2.0, "{r:?}");
        let r = y_range(&[(0, 0.0)]);
        assert!(r.start < 0.0 && r.end > 0.0, "{r:?}");
        // y labels: as many decimals as the tick step needs, the same for every label.
        assert_eq!(label_decimals(&(1.3..4.4)), 1);
        assert_eq!(label_decimals(&(1.42..1.53)), 2);
        assert_eq!(label_decimals(&(4.1975..4.2525)), 2);
        assert_eq!(label_decimals(&(4.1995..4.2015)), 4);
        assert_eq!(label_decimals(&(0.0..40.0)), 0);
    }

    #[test]
    fn missing_directory_is_an_error_and_leaves_nothing() {
        let dir = temp_dir("missing");
        let path = dir.join("no/such/dir/loss.png");
        let err = write_loss_png(&path, "t", &[(0, 1.0), (1, 0.5)], &[]).unwrap_err();
        assert!(format!("{err:#}").contains("loss.png"), "{err:#}");
        assert!(!path.exists());
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
