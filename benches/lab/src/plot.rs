//! SVG line charts of the growth curves and the soak, for the lab notes (`docs/lab-notes/`).
//!
//! Drawn with `plotters`' SVG backend only: no system font library is needed (the SVG
//! holds `<text>` elements the viewer lays out; plotters estimates their size itself).
//! The curves use a logarithmic x axis (backlogs and counts grow by powers of ten); the
//! soak plots time on a linear one. `outbox-lab plot` redraws from saved JSON lines.

use std::path::{Path, PathBuf};

use clap::Args;
use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;

use crate::scale::Point;
use crate::soak::{Sample, Start};
use outbox_bench::BoxError;

fn default_dir() -> &'static str {
    concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/img")
}

/// Where `run --scale` / `run --soak` draw their plots.
#[derive(Args, Debug, Clone)]
pub struct PlotDir {
    /// Directory for the SVG plots of --scale and --soak.
    #[arg(long, default_value = default_dir(), value_name = "DIR")]
    pub plots: PathBuf,
}

/// `outbox-lab plot`: draws the plots from JSON lines written by `run --json`.
#[derive(Args, Debug, Clone)]
pub struct PlotArgs {
    /// JSON lines of a `run --scale --json FILE` (lines of other kinds are ignored).
    #[arg(long, value_name = "FILE")]
    pub scale: Option<PathBuf>,
    /// JSON lines of a `run --soak M --json FILE` (lines of other kinds are ignored).
    #[arg(long, value_name = "FILE")]
    pub soak: Option<PathBuf>,
    #[command(flatten)]
    pub dir: PlotDir,
}

pub fn run(args: &PlotArgs) -> Result<(), BoxError> {
    if args.scale.is_none() && args.soak.is_none() {
        return Err("plot: give --scale FILE and/or --soak FILE".into());
    }
    if let Some(f) = &args.scale {
        let points: Vec<Point> = read_kind(f, "scale")?;
        scale(&args.dir.plots, &points)?;
    }
    if let Some(f) = &args.soak {
        let start: Vec<Start> = read_kind(f, "soak_start")?;
        let samples: Vec<Sample> = read_kind(f, "soak")?;
        soak(&args.dir.plots, start.last(), &samples)?;
    }
    Ok(())
}

/// The lines of `file` whose `kind` is `kind`, decoded.
fn read_kind<T: serde::de::DeserializeOwned>(file: &Path, kind: &str) -> Result<Vec<T>, BoxError> {
    let text = std::fs::read_to_string(file).map_err(|e| format!("{}: {e}", file.display()))?;
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| format!("{}:{}: {e}", file.display(), n + 1))?;
        if v.get("kind").and_then(|k| k.as_str()) == Some(kind) {
            out.push(
                serde_json::from_value(v)
                    .map_err(|e| format!("{}:{}: not a {kind} line: {e}", file.display(), n + 1))?,
            );
        }
    }
    Ok(out)
}

/// One line of a chart.
struct Series {
    name: String,
    points: Vec<(f64, f64)>,
}

struct Chart<'a> {
    file: &'a str,
    title: &'a str,
    x: &'a str,
    y: &'a str,
    log_x: bool,
    series: Vec<Series>,
}

const COLORS: [RGBColor; 5] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
];

fn draw(dir: &Path, c: Chart<'_>) -> Result<PathBuf, BoxError> {
    let all: Vec<(f64, f64)> = c.series.iter().flat_map(|s| s.points.clone()).collect();
    if all.is_empty() {
        return Err(format!("{}: nothing to draw", c.file).into());
    }
    std::fs::create_dir_all(dir)?;
    let path = dir.join(c.file);
    let xmin = all.iter().map(|p| p.0).fold(f64::INFINITY, f64::min);
    let xmax = all.iter().map(|p| p.0).fold(f64::NEG_INFINITY, f64::max);
    let ymax = all.iter().map(|p| p.1).fold(0.0, f64::max);
    let y = 0.0..(ymax * 1.15).max(1e-9);
    let root = SVGBackend::new(&path, (760, 440)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let mut builder = ChartBuilder::on(&root);
    builder
        .caption(c.title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(70);
    if c.log_x {
        // A decade either side would waste room: pad the ends by a fraction of a decade.
        // The ticks are the measured x values (powers of ten, or 1, 2, 4 … connections).
        let mut ticks: Vec<f64> = all.iter().map(|p| p.0).collect();
        ticks.sort_by(f64::total_cmp);
        ticks.dedup();
        let chart = builder
            .build_cartesian_2d(
                (xmin / 1.3..xmax * 1.3).log_scale().with_key_points(ticks),
                y,
            )
            .map_err(|e| e.to_string())?;
        lines(chart, &c)?;
    } else {
        let pad = ((xmax - xmin) * 0.02).max(1.0);
        let chart = builder
            .build_cartesian_2d(xmin - pad..xmax + pad, y)
            .map_err(|e| e.to_string())?;
        lines(chart, &c)?;
    }
    root.present().map_err(|e| e.to_string())?;
    drop(root);
    Ok(path)
}

fn lines<'a, X>(
    mut chart: ChartContext<'a, SVGBackend<'a>, Cartesian2d<X, RangedCoordf64>>,
    c: &Chart<'_>,
) -> Result<(), BoxError>
where
    X: Ranged<ValueType = f64> + ValueFormatter<f64>,
    std::ops::Range<f64>: AsRangedCoord,
{
    chart
        .configure_mesh()
        .x_desc(c.x)
        .y_desc(c.y)
        .x_label_formatter(&|v| short(*v))
        .y_label_formatter(&|v| short(*v))
        .light_line_style(WHITE.mix(0.0))
        .draw()
        .map_err(|e| e.to_string())?;
    for (i, s) in c.series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(s.points.clone(), color.stroke_width(2)).point_size(3))
            .map_err(|e| e.to_string())?
            .label(s.name.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| e.to_string())?;
    Ok(())
}

/// Axis labels: 10000 → 10k, 1000000 → 1M, small values with their decimals.
fn short(v: f64) -> String {
    let a = v.abs();
    if a >= 1e6 && (v / 1e6).fract().abs() < 1e-9 {
        format!("{:.0}M", v / 1e6)
    } else if a >= 1e4 && (v / 1e3).fract().abs() < 1e-9 {
        format!("{:.0}k", v / 1e3)
    } else if a >= 100.0 || v == v.trunc() {
        format!("{v:.0}")
    } else if a >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

fn series_of(
    points: &[Point],
    curve: &str,
    name: &str,
    y: impl Fn(&Point) -> Option<f64>,
) -> Vec<Series> {
    let mut names: Vec<&str> = Vec::new();
    for p in points.iter().filter(|p| p.curve == curve) {
        if !names.contains(&p.series.as_str()) {
            names.push(&p.series);
        }
    }
    names
        .into_iter()
        .map(|s| Series {
            name: if name.is_empty() {
                s.to_owned()
            } else {
                format!("{name} ({s})")
            },
            points: points
                .iter()
                .filter(|p| p.curve == curve && p.series == s)
                .filter_map(|p| y(p).map(|v| (p.x as f64, v)))
                .collect(),
        })
        .filter(|s| !s.points.is_empty())
        .collect()
}

fn latency(points: &[Point], curve: &str) -> Vec<Series> {
    let mut s = series_of(points, curve, "p50", |p| p.p50_ms);
    s.extend(series_of(points, curve, "p99", |p| p.p99_ms));
    s
}

/// Draws every growth curve present in `points`; returns the files written.
pub fn scale(dir: &Path, points: &[Point]) -> Result<Vec<PathBuf>, BoxError> {
    let charts = [
        Chart {
            file: "scale_claim_latency.svg",
            title: "Claim latency (limit 10) vs backlog",
            x: "due rows in the table",
            y: "ms per claim",
            log_x: true,
            series: latency(points, "claim"),
        },
        Chart {
            file: "scale_consumer.svg",
            title: "Consumer throughput (worker w1/b10) vs backlog",
            x: "due rows in the table",
            y: "messages/s",
            log_x: true,
            series: series_of(points, "consumer", "", |p| Some(p.per_s)),
        },
        Chart {
            file: "scale_extend.svg",
            title: "Extend throughput (1 connection, tx each) vs live timers",
            x: "live timers",
            y: "extends/s",
            log_x: true,
            series: series_of(points, "extend", "", |p| Some(p.per_s)),
        },
        Chart {
            file: "scale_extend_latency.svg",
            title: "Extend latency (BEGIN, extend, COMMIT) vs live timers",
            x: "live timers",
            y: "ms per extend",
            log_x: true,
            series: latency(points, "extend"),
        },
        Chart {
            file: "scale_next_wakeup.svg",
            title: "next_wakeup latency vs served queues",
            x: "queues",
            y: "ms per call",
            log_x: true,
            series: latency(points, "next_wakeup"),
        },
        Chart {
            file: "scale_publish.svg",
            title: "Publish throughput (1 message per transaction) vs connections",
            x: "publishing connections",
            y: "messages/s",
            log_x: true,
            series: series_of(points, "publish", "", |p| Some(p.per_s)),
        },
    ];
    let mut written = Vec::new();
    for c in charts {
        if !c.series.is_empty() {
            written.push(draw(dir, c)?);
        }
    }
    for w in &written {
        eprintln!("plot written: {}", w.display());
    }
    Ok(written)
}

/// Draws the soak's series over time; returns the files written. A soak without
/// autovacuum gets its own file names, so it does not replace the normal soak's plots.
pub fn soak(
    dir: &Path,
    start: Option<&Start>,
    samples: &[Sample],
) -> Result<Vec<PathBuf>, BoxError> {
    if samples.is_empty() {
        return Err("soak: no samples to plot".into());
    }
    let autovacuum_off = start.is_some_and(|s| {
        s.server
            .iter()
            .any(|(k, v)| k == "autovacuum" && v == "off")
    });
    let prefix = if autovacuum_off {
        "soak_autovacuum_off"
    } else {
        "soak"
    };
    let suffix = if autovacuum_off {
        " (autovacuum off)"
    } else {
        ""
    };
    let over = |name: &str, f: &dyn Fn(&Sample) -> f64| Series {
        name: name.to_owned(),
        points: samples.iter().map(|s| (s.t_s, f(s))).collect(),
    };
    let files = [
        format!("{prefix}_rates.svg"),
        format!("{prefix}_lateness.svg"),
        format!("{prefix}_sizes.svg"),
        format!("{prefix}_tuples.svg"),
    ];
    let titles = [
        format!("Soak: extends/s and fires/s{suffix}"),
        format!("Soak: firing lateness p99{suffix}"),
        format!("Soak: table and index size{suffix}"),
        format!("Soak: dead and live tuples{suffix}"),
    ];
    let charts = [
        Chart {
            file: &files[0],
            title: &titles[0],
            x: "seconds",
            y: "per second",
            log_x: false,
            series: vec![
                over("extends/s", &|s| s.extends_per_s),
                over("fires/s", &|s| s.fires_per_s),
            ],
        },
        Chart {
            file: &files[1],
            title: &titles[1],
            x: "seconds",
            y: "ms (handler start − deadline)",
            log_x: false,
            // A window without fires has no lateness (its sample says 0): leave it out.
            series: vec![Series {
                name: "lateness p99".to_owned(),
                points: samples
                    .iter()
                    .filter(|s| s.fires_per_s > 0.0)
                    .map(|s| (s.t_s, s.lateness_p99_ms))
                    .collect(),
            }],
        },
        Chart {
            file: &files[2],
            title: &titles[2],
            x: "seconds",
            y: "MB",
            log_x: false,
            series: vec![
                over("table (pg_table_size)", &|s| s.table_bytes as f64 / 1e6),
                over("indexes (pg_indexes_size)", &|s| s.index_bytes as f64 / 1e6),
            ],
        },
        Chart {
            file: &files[3],
            title: &titles[3],
            x: "seconds",
            y: "tuples",
            log_x: false,
            series: vec![
                over("n_dead_tup", &|s| s.dead_tuples as f64),
                over("n_live_tup", &|s| s.live_tuples as f64),
            ],
        },
    ];
    let mut written = Vec::new();
    for c in charts {
        written.push(draw(dir, c)?);
    }
    for w in &written {
        eprintln!("plot written: {}", w.display());
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_labels() {
        assert_eq!(short(10_000.0), "10k");
        assert_eq!(short(1_000_000.0), "1M");
        assert_eq!(short(32.0), "32");
        assert_eq!(short(0.25), "0.25");
        assert_eq!(short(2.5), "2.5");
    }

    #[test]
    fn draws_svg_without_system_fonts() {
        let dir = std::env::temp_dir().join(format!("outbox-bench-plot-{}", std::process::id()));
        let points: Vec<Point> = [10_000u64, 100_000, 1_000_000]
            .iter()
            .map(|&x| {
                serde_json::from_value(serde_json::json!({
                    "kind": "scale", "curve": "claim", "series": "s", "x": x, "ops": 1,
                    "seconds": 1.0, "per_s": 1.0, "p50_ms": 0.2, "p99_ms": 0.9,
                    "table_bytes": 0, "index_bytes": 0
                }))
                .expect("a point")
            })
            .collect();
        let written = scale(&dir, &points).expect("drawn");
        assert_eq!(written.len(), 1);
        let svg = std::fs::read_to_string(&written[0]).expect("read");
        assert!(svg.contains("<svg") && svg.contains("Claim latency"));
        std::fs::remove_dir_all(&dir).ok();
    }
}
