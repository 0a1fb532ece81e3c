//! The plot: rows/s (log scale) against workers, one line per mode, one panel
//! per backend. Written by hand: a few polylines, axes, labels and a legend.

use std::fmt::Write;

use crate::db::BackendKind;
use crate::drain::Mode;
use crate::report::{modes_run, Results};

const PANEL_WIDTH: f64 = 440.0;
const PANEL_HEIGHT: f64 = 300.0;
/// Room for the axis labels left of and below each panel, and above it.
const MARGIN_LEFT: f64 = 70.0;
const MARGIN_TOP: f64 = 50.0;
const MARGIN_BOTTOM: f64 = 50.0;
const LEGEND_ROW: f64 = 18.0;
const LEGEND_COLUMN: f64 = 230.0;

/// One colour per mode, in [`Mode::all`] order.
const COLOURS: [&str; 12] = [
    "#1f77b4", "#d62728", "#7f7f7f", "#2ca02c", "#9467bd", "#8c564b", "#17becf", "#e377c2",
    "#bcbd22", "#ff7f0e", "#393b79", "#637939",
];

pub fn plot(results: &Results, title: &str) -> String {
    let backends: Vec<BackendKind> = BackendKind::ALL
        .into_iter()
        .filter(|&backend| results.drains.iter().any(|run| run.backend == backend))
        .collect();
    let legend: Vec<Mode> = Mode::all()
        .into_iter()
        .filter(|mode| results.drains.iter().any(|run| run.mode == *mode))
        .collect();
    let panel_span = MARGIN_LEFT + PANEL_WIDTH + 20.0;
    let width = panel_span * backends.len().max(1) as f64;
    let legend_top = MARGIN_TOP + PANEL_HEIGHT + MARGIN_BOTTOM;
    let legend_columns = ((width - 20.0) / LEGEND_COLUMN).floor().max(1.0) as usize;
    let legend_rows = legend.len().div_ceil(legend_columns);
    let height = legend_top + LEGEND_ROW * (legend_rows as f64 + 1.0);

    let mut svg = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<text x="{}" y="18" text-anchor="middle" font-size="14">{}</text>
"#,
        width / 2.0,
        escape(title)
    );
    for (i, &backend) in backends.iter().enumerate() {
        panel(
            &mut svg,
            results,
            backend,
            panel_span * i as f64 + MARGIN_LEFT,
        );
    }
    for (i, mode) in legend.iter().enumerate() {
        let x = 20.0 + (i % legend_columns) as f64 * LEGEND_COLUMN;
        let y = legend_top + LEGEND_ROW * (i / legend_columns) as f64;
        let _ = writeln!(
            svg,
            r#"<line x1="{x}" y1="{y}" x2="{}" y2="{y}" {}/><text x="{}" y="{}">{}</text>"#,
            x + 30.0,
            stroke(*mode),
            x + 36.0,
            y + 4.0,
            escape(&legend_label(*mode))
        );
    }
    svg.push_str("</svg>\n");
    svg
}

/// One backend's panel, its plot area starting at `left`.
fn panel(svg: &mut String, results: &Results, backend: BackendKind, left: f64) {
    let runs = || results.drains.iter().filter(|run| run.backend == backend);
    let workers: Vec<usize> = {
        let mut workers: Vec<usize> = runs().map(|run| run.workers).collect();
        workers.sort_unstable();
        workers.dedup();
        workers
    };
    let rates = || runs().map(|run| run.rows_per_sec().max(1.0));
    let low = rates().fold(f64::INFINITY, f64::min).log10().floor();
    let high = rates().fold(0.0, f64::max).log10().ceil().max(low + 1.0);
    let (min_w, max_w) = (workers[0] as f64, *workers.last().unwrap_or(&1) as f64);
    let x = |w: usize| {
        let span = (max_w / min_w).log2().max(1.0);
        left + PANEL_WIDTH * (w as f64 / min_w).log2() / span
    };
    let y = |rate: f64| MARGIN_TOP + PANEL_HEIGHT * (high - rate.max(1.0).log10()) / (high - low);

    let bottom = MARGIN_TOP + PANEL_HEIGHT;
    let _ = writeln!(
        svg,
        r##"<text x="{}" y="{}" text-anchor="middle" font-size="13">{}</text>
<rect x="{left}" y="{MARGIN_TOP}" width="{PANEL_WIDTH}" height="{PANEL_HEIGHT}" fill="none" stroke="#444"/>
<text x="{}" y="{}" text-anchor="middle">workers</text>
<text transform="translate({},{}) rotate(-90)" text-anchor="middle">rows/s (log scale)</text>"##,
        left + PANEL_WIDTH / 2.0,
        MARGIN_TOP - 8.0,
        backend.name(),
        left + PANEL_WIDTH / 2.0,
        bottom + 36.0,
        left - 52.0,
        MARGIN_TOP + PANEL_HEIGHT / 2.0,
    );
    for decade in (low as i32)..=(high as i32) {
        let rate = 10f64.powi(decade);
        let _ = writeln!(
            svg,
            r##"<line x1="{left}" y1="{0}" x2="{1}" y2="{0}" stroke="#ddd"/><text x="{2}" y="{3}" text-anchor="end">{4}</text>"##,
            y(rate),
            left + PANEL_WIDTH,
            left - 6.0,
            y(rate) + 4.0,
            format_rate(rate)
        );
    }
    for &w in &workers {
        let _ = writeln!(
            svg,
            r#"<text x="{}" y="{}" text-anchor="middle">{w}</text>"#,
            x(w),
            bottom + 16.0
        );
    }
    for mode in modes_run(results, backend) {
        let points: Vec<(f64, f64)> = runs()
            .filter(|run| run.mode == mode)
            .map(|run| (x(run.workers), y(run.rows_per_sec())))
            .collect();
        let line: Vec<String> = points
            .iter()
            .map(|(x, y)| format!("{x:.1},{y:.1}"))
            .collect();
        let _ = writeln!(
            svg,
            r#"<polyline points="{}" fill="none" {}/>"#,
            line.join(" "),
            stroke(mode)
        );
        for (x, y) in points {
            let _ = writeln!(
                svg,
                r#"<circle cx="{x:.1}" cy="{y:.1}" r="2.5" fill="{}"/>"#,
                colour(mode)
            );
        }
    }
}

/// Crate modes solid, hand-written ones dashed.
fn stroke(mode: Mode) -> String {
    let dash = if mode.is_crate_mode() {
        ""
    } else {
        r#" stroke-dasharray="6 3""#
    };
    format!(r#"stroke="{}" stroke-width="2"{dash}"#, colour(mode))
}

fn colour(mode: Mode) -> &'static str {
    let index = Mode::all().iter().position(|m| *m == mode).unwrap_or(0);
    COLOURS[index % COLOURS.len()]
}

fn legend_label(mode: Mode) -> String {
    let kind = if mode.is_crate_mode() {
        "crate"
    } else {
        "hand-written"
    };
    format!("{mode} ({kind})")
}

fn format_rate(rate: f64) -> String {
    match rate {
        r if r >= 1e6 => format!("{}M", r / 1e6),
        r if r >= 1e3 => format!("{}k", r / 1e3),
        r => format!("{r}"),
    }
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}
