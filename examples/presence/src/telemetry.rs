//! The worker's metrics in the Prometheus text format, through the maintained
//! [`metrics_exporter_prometheus`] recorder: the outbox worker reports through the
//! [`metrics`] facade, [`install`] makes the exporter's recorder the process-wide one, and the
//! service serves [`PrometheusHandle::render`] on `GET /metrics` from its own axum router (the
//! exporter's own HTTP listener is not compiled in). `GET /stats` reads the same text back
//! through [`Scrape`], so both endpoints show the same numbers.
//!
//! Shapes: counters keep their names (`outbox_acked_total{queue="presence.expiry"} 12`, no
//! suffix added); every histogram is a Prometheus *summary* with the quantiles 0, 0.5, 0.9,
//! 0.95, 0.99, 0.999 and 1 over a rolling window of [`SUMMARY_WINDOW`] (six buckets of 20 s,
//! so the two-minute window drops its oldest 20 s at a time), plus `_sum` and `_count` since
//! the process started. Values are in the metric's unit (seconds for `*_seconds`). The
//! library describes every `outbox_*` metric when the first worker starts, so the text
//! carries a `# HELP` and a `# TYPE` line for each; [`Server::start`](crate::Server::start)
//! installs the recorder before it starts the worker for that reason.

use std::num::NonZeroU32;
use std::sync::OnceLock;
use std::time::Duration;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// Width of the rolling window the summaries' quantiles cover: long enough to span a whole
/// default demo (30 s of load and its final check) and the 20 s load test.
pub const SUMMARY_WINDOW: Duration = Duration::from_secs(120);

/// Buckets of the rolling window (each `SUMMARY_WINDOW / SUMMARY_BUCKETS` wide).
const SUMMARY_BUCKETS: u32 = 6;

/// How often the background thread drains recorded histogram samples into the summaries
/// (rendering drains them too). Every second rather than the exporter's 5 s: a drain hands
/// over the newest block of 64 samples first, and the exporter's rolling summary (0.18.3)
/// drops samples older than the first bucket it opens, so the first drain after the worker
/// starts keeps only its newest block; small drains lose nothing in practice. The count
/// (`_count`) includes every sample either way.
const UPKEEP_EVERY: Duration = Duration::from_secs(1);

static GLOBAL: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

/// Installs the Prometheus recorder as the process-wide `metrics` recorder, once per
/// process, and returns its handle; later calls return the same handle. Returns `None` when
/// another recorder was installed first (a test harness's, say): the worker's numbers then go
/// there, `GET /metrics` answers 404 and the metric fields of `GET /stats` are `null`.
///
/// A named background thread runs the exporter's upkeep every second for the life of the
/// process (the handle does not spawn one, and a tokio task would end with the runtime that
/// spawned it, while several runtimes may start servers in one test process).
pub fn install() -> Option<&'static PrometheusHandle> {
    GLOBAL
        .get_or_init(|| {
            let buckets = NonZeroU32::new(SUMMARY_BUCKETS).expect("a non-zero bucket count");
            let builder = PrometheusBuilder::new()
                .set_bucket_count(buckets)
                .set_bucket_duration(SUMMARY_WINDOW / SUMMARY_BUCKETS)
                .expect("a non-zero bucket width");
            match builder.install_recorder() {
                Ok(handle) => {
                    let upkeep = handle.clone();
                    let spawned = std::thread::Builder::new()
                        .name("presence-metrics-upkeep".into())
                        .spawn(move || loop {
                            std::thread::sleep(UPKEEP_EVERY);
                            upkeep.run_upkeep();
                        });
                    if let Err(e) = spawned {
                        // Rendering drains the samples too; only memory between scrapes grows.
                        tracing::warn!(error = %e, "no metrics upkeep thread");
                    }
                    Some(handle)
                }
                Err(e) => {
                    tracing::warn!(error = %e, "another metrics recorder is installed; /metrics and /stats will not show the worker's metrics");
                    None
                }
            }
        })
        .as_ref()
}

/// One sample line of the text format: `name{label="value",...} value`.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Metric name, with its `_sum`/`_count` suffix if it has one.
    pub name: String,
    /// Label pairs in the order written, values unescaped.
    pub labels: Vec<(String, String)>,
    /// The value.
    pub value: f64,
}

impl Sample {
    /// The value of label `key`, if the sample has it.
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// The samples of one rendering of the Prometheus text format, read back for `GET /stats`
/// and the tests. `# HELP`/`# TYPE` comments are skipped; a line that is not a sample is
/// skipped too (this reads what the exporter wrote, not arbitrary input).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Scrape {
    /// Every sample, in the order of the text.
    pub samples: Vec<Sample>,
}

/// Quantiles of one summary, in the metric's unit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Quantiles {
    /// Values recorded since the process started (`_count`).
    pub count: u64,
    /// Median over the rolling window.
    pub p50: f64,
    /// 99th percentile over the rolling window.
    pub p99: f64,
    /// Largest value in the rolling window (quantile 1).
    pub max: f64,
}

impl Scrape {
    /// Reads the text format.
    pub fn parse(text: &str) -> Scrape {
        Scrape {
            samples: text.lines().filter_map(parse_line).collect(),
        }
    }

    /// The sum of counter `name` over all its label sets; 0 when it has no sample (a
    /// counter appears only once something incremented it).
    pub fn counter(&self, name: &str) -> u64 {
        self.samples
            .iter()
            .filter(|s| s.name == name)
            .map(|s| s.value as u64)
            .sum()
    }

    /// The quantiles of summary `name` for the label set that has `label` (key, value);
    /// `None` when nothing was recorded for it. Quantiles of different label sets cannot be
    /// merged, hence the label.
    pub fn summary(&self, name: &str, label: (&str, &str)) -> Option<Quantiles> {
        let of = |suffix: &str, quantile: Option<&str>| {
            let full = format!("{name}{suffix}");
            self.samples
                .iter()
                .find(|s| {
                    s.name == full
                        && s.label(label.0) == Some(label.1)
                        && s.label("quantile") == quantile
                })
                .map(|s| s.value)
        };
        let count = of("_count", None)? as u64;
        if count == 0 {
            return None;
        }
        Some(Quantiles {
            count,
            p50: of("", Some("0.5"))?,
            p99: of("", Some("0.99"))?,
            max: of("", Some("1"))?,
        })
    }
}

fn parse_line(line: &str) -> Option<Sample> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let name_end = line.find(['{', ' '])?;
    let name = line[..name_end].to_owned();
    let mut labels = Vec::new();
    let mut rest = &line[name_end..];
    if let Some(inner) = rest.strip_prefix('{') {
        let mut chars = inner.char_indices();
        loop {
            // key="value" pairs separated by commas, up to the closing brace.
            let (start, c) = chars.next()?;
            match c {
                '}' => {
                    rest = &inner[start + 1..];
                    break;
                }
                ',' | ' ' => continue,
                _ => {}
            }
            let eq = start + inner[start..].find('=')?;
            let key = inner[start..eq].trim().to_owned();
            while chars.next()?.0 < eq {}
            if chars.next()?.1 != '"' {
                return None;
            }
            let mut value = String::new();
            loop {
                match chars.next()?.1 {
                    '"' => break,
                    '\\' => match chars.next()?.1 {
                        'n' => value.push('\n'),
                        other => value.push(other),
                    },
                    other => value.push(other),
                }
            }
            labels.push((key, value));
        }
    }
    // The value, then an optional timestamp.
    let value = rest.split_whitespace().next()?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    Some(Sample {
        name,
        labels,
        value,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The exporter's text, read back: counters summed over label sets, a counter never
    /// incremented reads 0, summary quantiles and count of one label set, and the HELP and
    /// TYPE lines the descriptions produce.
    #[test]
    fn reads_back_what_the_exporter_renders() {
        let recorder = PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            metrics::describe_counter!("hits_total", metrics::Unit::Count, "Hits, by queue");
            metrics::counter!("hits_total", "queue" => "a").increment(2);
            metrics::counter!("hits_total", "queue" => "b").increment(3);
            metrics::counter!("hits_total", "queue" => "a").increment(1);
            for ms in 1..=100 {
                metrics::histogram!("lateness_seconds", "queue" => "a")
                    .record(f64::from(ms) / 1000.0);
                // Drained as the upkeep thread does (see UPKEEP_EVERY: one drain of all 100
                // would keep only the newest 36 in the quantiles).
                handle.run_upkeep();
            }
            metrics::histogram!("lateness_seconds", "queue" => "b").record(5.0);
        });
        let text = handle.render();
        assert!(text.contains("# HELP hits_total Hits, by queue"), "{text}");
        assert!(text.contains("# TYPE hits_total counter"), "{text}");
        assert!(text.contains("# TYPE lateness_seconds summary"), "{text}");
        let scrape = Scrape::parse(&text);
        assert_eq!(scrape.counter("hits_total"), 6, "{text}");
        assert_eq!(scrape.counter("misses_total"), 0);
        let q = scrape
            .summary("lateness_seconds", ("queue", "a"))
            .expect("queue a recorded");
        assert_eq!(q.count, 100, "{text}");
        assert!((q.p50 - 0.050).abs() < 0.002, "{q:?}");
        assert!((q.p99 - 0.099).abs() < 0.002, "{q:?}");
        assert!((q.max - 0.100).abs() < 0.001, "{q:?}");
        let b = scrape.summary("lateness_seconds", ("queue", "b")).unwrap();
        assert_eq!(b.count, 1);
        assert!((b.max - 5.0).abs() < 0.001, "{b:?}");
        assert_eq!(scrape.summary("lateness_seconds", ("queue", "c")), None);
    }

    #[test]
    fn parses_escaped_labels_and_skips_comments() {
        let scrape = Scrape::parse(
            "# HELP x_total X\n# TYPE x_total counter\n\
             x_total{queue=\"a \\\"b\\\", c\\\\d\",phase=\"claim\"} 7\n\
             up 1 1700000000000\n\
             y{quantile=\"1\"} +Inf\n\
             not a sample\n",
        );
        assert_eq!(
            scrape.samples[0],
            Sample {
                name: "x_total".into(),
                labels: vec![
                    ("queue".into(), "a \"b\", c\\d".into()),
                    ("phase".into(), "claim".into())
                ],
                value: 7.0
            }
        );
        assert_eq!(scrape.samples[1].name, "up");
        assert_eq!(scrape.samples[1].value, 1.0);
        assert_eq!(scrape.samples[2].value, f64::INFINITY);
        assert_eq!(scrape.samples.len(), 3, "{scrape:?}");
        assert_eq!(scrape.counter("x_total"), 7);
    }
}
