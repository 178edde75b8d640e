//! Latency distributions as one SVG file: a panel per table, an empirical CDF per row on a
//! logarithmic time axis. The SVG is written by hand (lines, polylines and text, nothing
//! that needs font metrics), so the benchmark carries no plotting or font stack.

use std::fmt::Write;

/// One table's rows: name and samples in milliseconds.
#[derive(Debug, Clone)]
pub(crate) struct Panel {
    pub(crate) title: String,
    pub(crate) series: Vec<(String, Vec<f64>)>,
}

const WIDTH: f64 = 960.0;
const PANEL_H: f64 = 300.0;
const LEFT: f64 = 64.0;
const RIGHT: f64 = 300.0;
const TOP: f64 = 34.0;
const BOTTOM: f64 = 44.0;
const COLORS: [&str; 10] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf",
];

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// An SVG document's opening: the root element and a white background.
fn svg_open(height: f64) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(out, r#"<rect width="100%" height="100%" fill="white"/>"#);
    out
}

/// The SVG document of `panels` (series without samples are left out).
pub(crate) fn svg(panels: &[Panel]) -> String {
    let height = PANEL_H * panels.len().max(1) as f64;
    let mut out = svg_open(height);
    for (p, panel) in panels.iter().enumerate() {
        draw_panel(&mut out, panel, PANEL_H * p as f64);
    }
    out.push_str("</svg>\n");
    out
}

fn draw_panel(out: &mut String, panel: &Panel, y0: f64) {
    let series: Vec<&(String, Vec<f64>)> = panel
        .series
        .iter()
        .filter(|(_, s)| s.iter().any(|v| *v > 0.0))
        .collect();
    let (x0, x1) = (LEFT, WIDTH - RIGHT);
    let (top, bottom) = (y0 + TOP, y0 + PANEL_H - BOTTOM);
    let _ = writeln!(
        out,
        r#"<text x="{x0}" y="{}" font-weight="bold">{} (CDF)</text>"#,
        y0 + 20.0,
        escape(&panel.title)
    );
    let positive = series
        .iter()
        .flat_map(|(_, s)| s.iter().copied())
        .filter(|v| *v > 0.0);
    let (lo, hi) = positive.fold((f64::INFINITY, 0.0f64), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    if series.is_empty() || !lo.is_finite() {
        let _ = writeln!(
            out,
            r#"<text x="{x0}" y="{}">no samples</text>"#,
            top + 20.0
        );
        return;
    }
    // Whole decades around the data.
    let (dlo, dhi) = (
        lo.log10().floor(),
        hi.log10().ceil().max(lo.log10().floor() + 1.0),
    );
    let x = |ms: f64| x0 + (ms.log10() - dlo) / (dhi - dlo) * (x1 - x0);
    let y = |f: f64| bottom - f * (bottom - top);
    let _ = writeln!(
        out,
        r##"<rect x="{x0}" y="{top}" width="{}" height="{}" fill="none" stroke="#444"/>"##,
        x1 - x0,
        bottom - top
    );
    let mut decade = dlo;
    while decade <= dhi {
        for m in [1.0, 2.0, 5.0] {
            let ms = m * 10f64.powf(decade);
            let d = ms.log10();
            if d < dlo || d > dhi {
                continue;
            }
            let px = x(ms);
            let _ = writeln!(
                out,
                r##"<line x1="{px:.1}" y1="{top}" x2="{px:.1}" y2="{bottom}" stroke="#ddd"/><text x="{px:.1}" y="{}" text-anchor="middle">{}</text>"##,
                bottom + 16.0,
                if ms >= 1.0 {
                    format!("{ms:.0}")
                } else {
                    format!("{ms}")
                }
            );
        }
        decade += 1.0;
    }
    let _ = writeln!(
        out,
        r#"<text x="{}" y="{}" text-anchor="middle">ms (log scale)</text>"#,
        (x0 + x1) / 2.0,
        bottom + 34.0
    );
    for f in [0.0, 0.25, 0.5, 0.75, 1.0] {
        let py = y(f);
        let _ = writeln!(
            out,
            r##"<line x1="{x0}" y1="{py:.1}" x2="{x1}" y2="{py:.1}" stroke="#eee"/><text x="{}" y="{:.1}" text-anchor="end">{f}</text>"##,
            x0 - 6.0,
            py + 4.0
        );
    }
    for (i, (name, samples)) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let mut s: Vec<f64> = samples.iter().copied().filter(|v| *v > 0.0).collect();
        s.sort_by(|a, b| a.total_cmp(b));
        let n = s.len() as f64;
        let mut points = format!("{:.1},{:.1}", x(s[0]), y(0.0));
        for (k, v) in s.iter().enumerate() {
            let _ = write!(
                points,
                " {:.1},{:.1} {:.1},{:.1}",
                x(*v),
                y(k as f64 / n),
                x(*v),
                y((k + 1) as f64 / n)
            );
        }
        let _ = writeln!(
            out,
            r#"<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{points}"/>"#
        );
        let ly = top + 14.0 + 16.0 * i as f64;
        let _ = writeln!(
            out,
            r#"<line x1="{}" y1="{ly}" x2="{}" y2="{ly}" stroke="{color}" stroke-width="3"/><text x="{}" y="{}">{}</text>"#,
            x1 + 12.0,
            x1 + 32.0,
            x1 + 38.0,
            ly + 4.0,
            escape(name)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn polyline_points(svg: &str) -> Vec<Vec<(f64, f64)>> {
        svg.lines()
            .filter_map(|l| l.split("points=\"").nth(1)?.split('"').next())
            .map(|pts| {
                pts.split(' ')
                    .filter_map(|p| {
                        let (a, b) = p.split_once(',')?;
                        Some((a.parse().ok()?, b.parse().ok()?))
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn each_series_is_a_monotone_cdf_inside_its_panel() {
        let panels = vec![
            Panel {
                title: "a <b> & c".into(),
                series: vec![
                    ("fast".into(), vec![1.0, 2.0, 3.0, 4.0]),
                    ("slow".into(), vec![40.0, 10.0, 200.0]),
                    ("n/a".into(), vec![]),
                ],
            },
            Panel {
                title: "second".into(),
                series: vec![("one".into(), vec![0.5, 0.7])],
            },
        ];
        let doc = svg(&panels);
        assert!(doc.starts_with("<svg") && doc.trim_end().ends_with("</svg>"));
        assert!(doc.contains("a &lt;b&gt; &amp; c"));
        let lines = polyline_points(&doc);
        assert_eq!(lines.len(), 3, "one line per series with samples");
        for (i, pts) in lines.iter().enumerate() {
            let (y_top, y_bottom) = if i < 2 {
                (TOP, PANEL_H - BOTTOM)
            } else {
                (PANEL_H + TOP, 2.0 * PANEL_H - BOTTOM)
            };
            for w in pts.windows(2) {
                assert!(w[1].0 >= w[0].0 - 0.01, "x goes back: {w:?}");
                assert!(w[1].1 <= w[0].1 + 0.01, "CDF goes down: {w:?}");
            }
            for (x, y) in pts {
                assert!((LEFT - 0.1..=WIDTH - RIGHT + 0.1).contains(x), "x {x}");
                assert!((y_top - 0.1..=y_bottom + 0.1).contains(y), "y {y}");
            }
            // Ends at fraction 1: the panel's top.
            assert!((pts.last().expect("points").1 - y_top).abs() < 0.1);
        }
        // The slower series sits to the right of the faster one at the median.
        assert!(lines[1][3].0 > lines[0][3].0);
    }
}

/// One panel of a time series plot: lines over a shared time axis (seconds).
#[derive(Debug, Clone)]
pub(crate) struct TimePanel {
    pub(crate) title: String,
    pub(crate) unit: String,
    pub(crate) series: Vec<(String, Vec<f64>)>,
}

/// The SVG document of time series `panels` sampled at times `t` (seconds), linear axes.
pub(crate) fn timeseries_svg(t: &[f64], panels: &[TimePanel]) -> String {
    let height = PANEL_H * panels.len().max(1) as f64;
    let mut out = svg_open(height);
    let t_max = t.iter().copied().fold(1.0f64, f64::max);
    for (p, panel) in panels.iter().enumerate() {
        let y0 = PANEL_H * p as f64;
        let (x0, x1) = (LEFT, WIDTH - RIGHT);
        let (top, bottom) = (y0 + TOP, y0 + PANEL_H - BOTTOM);
        let v_max = panel
            .series
            .iter()
            .flat_map(|(_, s)| s.iter().copied())
            .fold(1.0f64, f64::max)
            * 1.1;
        let x = |s: f64| x0 + s / t_max * (x1 - x0);
        let y = |v: f64| bottom - v / v_max * (bottom - top);
        let _ = writeln!(
            out,
            r#"<text x="{x0}" y="{}" font-weight="bold">{}</text>"#,
            y0 + 20.0,
            escape(&panel.title)
        );
        let _ = writeln!(
            out,
            r##"<rect x="{x0}" y="{top}" width="{}" height="{}" fill="none" stroke="#444"/>"##,
            x1 - x0,
            bottom - top
        );
        for k in 0..=5 {
            let v = v_max * k as f64 / 5.0;
            let py = y(v);
            let _ = writeln!(
                out,
                r##"<line x1="{x0}" y1="{py:.1}" x2="{x1}" y2="{py:.1}" stroke="#eee"/><text x="{}" y="{:.1}" text-anchor="end">{v:.0}</text>"##,
                x0 - 6.0,
                py + 4.0
            );
            let s = t_max * k as f64 / 5.0;
            let px = x(s);
            let _ = writeln!(
                out,
                r##"<line x1="{px:.1}" y1="{top}" x2="{px:.1}" y2="{bottom}" stroke="#eee"/><text x="{px:.1}" y="{}" text-anchor="middle">{s:.0}</text>"##,
                bottom + 16.0
            );
        }
        let _ = writeln!(
            out,
            r#"<text x="{}" y="{}" text-anchor="middle">seconds; y: {}</text>"#,
            (x0 + x1) / 2.0,
            bottom + 34.0,
            escape(&panel.unit)
        );
        for (i, (name, values)) in panel.series.iter().enumerate() {
            let color = COLORS[i % COLORS.len()];
            let points: Vec<String> = t
                .iter()
                .zip(values)
                .map(|(s, v)| format!("{:.1},{:.1}", x(*s), y(*v)))
                .collect();
            let _ = writeln!(
                out,
                r#"<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{}"/>"#,
                points.join(" ")
            );
            let ly = top + 16.0 * (i as f64 + 1.0);
            let _ = writeln!(
                out,
                r#"<line x1="{}" y1="{ly:.1}" x2="{}" y2="{ly:.1}" stroke="{color}" stroke-width="3"/><text x="{}" y="{:.1}">{}</text>"#,
                x1 + 12.0,
                x1 + 32.0,
                x1 + 38.0,
                ly + 4.0,
                escape(name)
            );
        }
    }
    out.push_str("</svg>\n");
    out
}
