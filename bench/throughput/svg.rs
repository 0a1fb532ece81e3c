//! The plot: median rows/s (log scale) against workers, one panel per backend,
//! one line per mode (crate modes solid, hand-written ones dashed), the legend
//! beside the panels.

use std::error::Error;

use plotters::coord::Shift;
use plotters::element::DashedPathElement;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::db::BackendKind;
use crate::drain::Mode;
use crate::report::{DrainRuns, Results};

type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;

const PANEL: (u32, u32) = (480, 380);
const LEGEND_WIDTH: u32 = 250;
const FONT: &str = "sans-serif";

/// One colour per mode, in [`Mode::all`] order.
const COLOURS: [RGBColor; 15] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x7f, 0x7f, 0x7f),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x8c, 0x56, 0x4b),
    RGBColor(0x17, 0xbe, 0xcf),
    RGBColor(0xe3, 0x77, 0xc2),
    RGBColor(0xbc, 0xbd, 0x22),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x39, 0x3b, 0x79),
    RGBColor(0x63, 0x79, 0x39),
    RGBColor(0xb8, 0x86, 0x0b),
    RGBColor(0x00, 0x80, 0x80),
    RGBColor(0x80, 0x00, 0x00),
];

/// The SVG document.
pub fn plot(results: &Results, title: &str) -> Result<String, String> {
    let mut svg = String::new();
    draw(results, title, &mut svg).map_err(|e| format!("plot: {e}"))?;
    Ok(svg)
}

fn draw(results: &Results, title: &str, svg: &mut String) -> Result<(), Box<dyn Error>> {
    let backends: Vec<BackendKind> = BackendKind::ALL
        .into_iter()
        .filter(|&backend| results.drains.iter().any(|runs| runs.backend == backend))
        .collect();
    let modes: Vec<Mode> = Mode::all()
        .into_iter()
        .filter(|&mode| results.drains.iter().any(|runs| runs.mode == mode))
        .collect();
    let panels_width = PANEL.0 * backends.len() as u32;
    // The panels and the legend, under 40 pixels for the title.
    let root = SVGBackend::with_string(svg, (panels_width + LEGEND_WIDTH, PANEL.1 + 40))
        .into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(title, (FONT, 18))?;
    let (panels, legend_area) = root.split_horizontally(panels_width);
    for (area, backend) in panels
        .split_evenly((1, backends.len()))
        .iter()
        .zip(backends)
    {
        panel(area, results, backend, &modes)?;
    }
    legend(&legend_area, &modes)?;
    root.present()?;
    Ok(())
}

/// One backend's chart.
fn panel(
    area: &Area,
    results: &Results,
    backend: BackendKind,
    modes: &[Mode],
) -> Result<(), Box<dyn Error>> {
    let drains: Vec<&DrainRuns> = results
        .drains
        .iter()
        .filter(|runs| runs.backend == backend)
        .collect();
    let mut workers: Vec<f64> = drains.iter().map(|runs| runs.workers as f64).collect();
    workers.sort_by(f64::total_cmp);
    workers.dedup();
    // Whole decades, from below the slowest median to above the fastest.
    let rates = || drains.iter().map(|runs| runs.median().max(1.0).log10());
    let low = rates().fold(f64::INFINITY, f64::min).floor() as i32;
    let high = (rates().fold(0.0, f64::max).ceil() as i32).max(low + 1);
    let decades: Vec<f64> = (low..=high).map(|d| 10f64.powi(d)).collect();
    // Some room beside the first and last worker counts, for their markers.
    let x = (workers[0] / 1.15..workers[workers.len() - 1] * 1.15)
        .log_scale()
        .with_key_points(workers);
    let y = (decades[0]..decades[decades.len() - 1])
        .log_scale()
        .with_key_points(decades);
    let mut chart = ChartBuilder::on(area)
        .caption(backend.name(), (FONT, 16))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d(x, y)?;
    chart
        .configure_mesh()
        .x_desc("workers")
        .y_desc("rows/s (median, log scale)")
        .x_label_formatter(&|w| w.to_string())
        .y_label_formatter(&|rate| format_rate(*rate))
        .draw()?;
    for &mode in modes {
        let points: Vec<(f64, f64)> = drains
            .iter()
            .filter(|runs| runs.mode == mode)
            .map(|runs| (runs.workers as f64, runs.median()))
            .collect();
        let style = style(mode);
        if mode.is_crate_mode() {
            chart.draw_series(LineSeries::new(points.clone(), style))?;
        } else {
            chart.draw_series(DashedLineSeries::new(points.clone(), 6, 4, style))?;
        }
        chart.draw_series(
            points
                .into_iter()
                .map(|p| Circle::new(p, 3, style.filled())),
        )?;
    }
    Ok(())
}

/// Every mode's line and name, one under the other.
fn legend(area: &Area, modes: &[Mode]) -> Result<(), Box<dyn Error>> {
    let label = TextStyle::from((FONT, 13)).pos(Pos::new(HPos::Left, VPos::Center));
    for (i, &mode) in modes.iter().enumerate() {
        let y = 50 + 20 * i as i32;
        let line = [(4, y), (34, y)];
        if mode.is_crate_mode() {
            area.draw(&PathElement::new(line, style(mode)))?;
        } else {
            area.draw(&DashedPathElement::new(line, 6, 4, style(mode)))?;
        }
        let kind = if mode.is_crate_mode() {
            "crate"
        } else {
            "hand-written"
        };
        area.draw(&Text::new(format!("{mode} ({kind})"), (42, y), &label))?;
    }
    Ok(())
}

fn style(mode: Mode) -> ShapeStyle {
    let index = Mode::all().iter().position(|m| *m == mode).unwrap_or(0);
    COLOURS[index % COLOURS.len()].stroke_width(2)
}

fn format_rate(rate: f64) -> String {
    match rate {
        r if r >= 1e6 => format!("{}M", r / 1e6),
        r if r >= 1e3 => format!("{}k", r / 1e3),
        r => format!("{r}"),
    }
}
