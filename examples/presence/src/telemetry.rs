//! A small in-process [`metrics`] recorder: the outbox worker reports through the `metrics`
//! facade (SPEC §11), and this recorder keeps what it reports so the service can show it on
//! `GET /stats` and `GET /metrics` (Prometheus text format).
//!
//! A real deployment would install an exporter (Prometheus, StatsD, ...) instead; the
//! counters and histograms are the same.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use metrics::{
    Counter, CounterFn, Gauge, GaugeFn, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder,
    SharedString, Unit,
};

/// Histogram values are stored as integers in millionths of the recorded unit (seconds →
/// microseconds), with three significant digits; quantiles report the low end of their
/// bucket.
const SCALE: f64 = 1e6;

/// Every metric reported so far, by name and label set.
#[derive(Default)]
pub struct Registry {
    counters: Mutex<BTreeMap<(String, String), Arc<AtomicCounter>>>,
    gauges: Mutex<BTreeMap<(String, String), Arc<AtomicGauge>>>,
    histograms: Mutex<BTreeMap<(String, String), Arc<Hist>>>,
}

/// Quantiles of one histogram, in the recorded unit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Quantiles {
    /// Values recorded.
    pub count: u64,
    /// Median.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest value.
    pub max: f64,
}

static GLOBAL: OnceLock<Option<&'static Registry>> = OnceLock::new();

/// Installs the recorder as the process-wide `metrics` recorder, once. Returns `None` when
/// another recorder was installed first (the numbers then go there instead).
pub fn install() -> Option<&'static Registry> {
    *GLOBAL.get_or_init(|| {
        let registry: &'static Registry = Box::leak(Box::default());
        match metrics::set_global_recorder(Handle(registry)) {
            Ok(()) => Some(registry),
            Err(_) => {
                tracing::warn!("another metrics recorder is installed; /stats will not show the worker's metrics");
                None
            }
        }
    })
}

fn labels(key: &Key) -> String {
    let mut out = String::new();
    for (i, l) in key.labels().enumerate() {
        if i > 0 {
            out.push(',');
        }
        let _ = write!(
            out,
            "{}=\"{}\"",
            l.key(),
            l.value().replace('\\', "\\\\").replace('"', "\\\"")
        );
    }
    out
}

fn entry<T: Default>(map: &Mutex<BTreeMap<(String, String), Arc<T>>>, key: &Key) -> Arc<T> {
    let mut map = map.lock().unwrap_or_else(|p| p.into_inner());
    map.entry((key.name().to_owned(), labels(key)))
        .or_default()
        .clone()
}

impl Registry {
    /// The sum of counter `name` over all its label sets (0 if never reported).
    pub fn counter(&self, name: &str) -> u64 {
        let map = self.counters.lock().unwrap_or_else(|p| p.into_inner());
        map.iter()
            .filter(|((n, _), _)| n == name)
            .map(|(_, c)| c.0.load(Ordering::Relaxed))
            .sum()
    }

    /// Quantiles of histogram `name`, merged over all its label sets; `None` if nothing was
    /// recorded.
    pub fn quantiles(&self, name: &str) -> Option<Quantiles> {
        let map = self.histograms.lock().unwrap_or_else(|p| p.into_inner());
        let mut merged = new_histogram();
        for ((n, _), h) in map.iter() {
            if n == name {
                let h = h.0.lock().unwrap_or_else(|p| p.into_inner());
                let _ = merged.add(&*h);
            }
        }
        quantiles_of(&merged)
    }

    /// Everything in the Prometheus text exposition format; histograms as summaries.
    pub fn render_prometheus(&self) -> String {
        let mut out = String::new();
        let braces = |l: &str| {
            if l.is_empty() {
                String::new()
            } else {
                format!("{{{l}}}")
            }
        };
        let with = |l: &str, extra: &str| {
            if l.is_empty() {
                format!("{{{extra}}}")
            } else {
                format!("{{{l},{extra}}}")
            }
        };
        for ((name, l), c) in self
            .counters
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            let _ = writeln!(out, "{name}{} {}", braces(l), c.0.load(Ordering::Relaxed));
        }
        for ((name, l), g) in self.gauges.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            let _ = writeln!(
                out,
                "{name}{} {}",
                braces(l),
                f64::from_bits(g.0.load(Ordering::Relaxed))
            );
        }
        for ((name, l), h) in self
            .histograms
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            let h = h.0.lock().unwrap_or_else(|p| p.into_inner());
            for q in [0.5, 0.9, 0.99, 1.0] {
                let v = h.lowest_equivalent(h.value_at_quantile(q)) as f64 / SCALE;
                let _ = writeln!(out, "{name}{} {v}", with(l, &format!("quantile=\"{q}\"")));
            }
            let _ = writeln!(out, "{name}_count{} {}", braces(l), h.len());
        }
        out
    }
}

fn new_histogram() -> hdrhistogram::Histogram<u64> {
    // Three significant digits; grows as needed, so any value fits.
    hdrhistogram::Histogram::new(3).expect("3 significant digits is a valid precision")
}

fn quantiles_of(h: &hdrhistogram::Histogram<u64>) -> Option<Quantiles> {
    if h.is_empty() {
        return None;
    }
    Some(Quantiles {
        count: h.len(),
        p50: h.lowest_equivalent(h.value_at_quantile(0.5)) as f64 / SCALE,
        p99: h.lowest_equivalent(h.value_at_quantile(0.99)) as f64 / SCALE,
        max: h.lowest_equivalent(h.max()) as f64 / SCALE,
    })
}

#[derive(Default)]
struct AtomicCounter(AtomicU64);

impl CounterFn for AtomicCounter {
    fn increment(&self, value: u64) {
        self.0.fetch_add(value, Ordering::Relaxed);
    }

    fn absolute(&self, value: u64) {
        self.0.fetch_max(value, Ordering::Relaxed);
    }
}

#[derive(Default)]
struct AtomicGauge(AtomicU64);

impl AtomicGauge {
    fn update(&self, f: impl Fn(f64) -> f64) {
        let _ = self
            .0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                Some(f(f64::from_bits(bits)).to_bits())
            });
    }
}

impl GaugeFn for AtomicGauge {
    fn increment(&self, value: f64) {
        self.update(|v| v + value);
    }

    fn decrement(&self, value: f64) {
        self.update(|v| v - value);
    }

    fn set(&self, value: f64) {
        self.0.store(value.to_bits(), Ordering::Relaxed);
    }
}

struct Hist(Mutex<hdrhistogram::Histogram<u64>>);

impl Default for Hist {
    fn default() -> Self {
        Hist(Mutex::new(new_histogram()))
    }
}

impl HistogramFn for Hist {
    fn record(&self, value: f64) {
        if value.is_finite() && value >= 0.0 {
            let mut h = self.0.lock().unwrap_or_else(|p| p.into_inner());
            // The histogram grows as needed; a value it cannot grow to is dropped.
            let _ = h.record((value * SCALE) as u64);
        }
    }
}

/// The recorder handed to `metrics`: a reference to the leaked, process-wide registry.
struct Handle(&'static Registry);

impl Recorder for Handle {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        Counter::from_arc(entry(&self.0.counters, key))
    }

    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::from_arc(entry(&self.0.gauges, key))
    }

    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::from_arc(entry(&self.0.histograms, key))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_quantiles_merge_label_sets() {
        let r: &'static Registry = Box::leak(Box::default());
        let h = Handle(r);
        let meta = Metadata::new("t", metrics::Level::INFO, None);
        let a = Key::from_parts("hits", vec![metrics::Label::new("queue", "a")]);
        let b = Key::from_parts("hits", vec![metrics::Label::new("queue", "b")]);
        h.register_counter(&a, &meta).increment(2);
        h.register_counter(&b, &meta).increment(3);
        h.register_counter(&a, &meta).increment(1);
        assert_eq!(r.counter("hits"), 6);
        assert_eq!(r.counter("misses"), 0);
        let lat = Key::from_name("lateness_seconds");
        for ms in 1..=100 {
            h.register_histogram(&lat, &meta)
                .record(f64::from(ms) / 1000.0);
        }
        let q = r.quantiles("lateness_seconds").unwrap();
        assert_eq!(q.count, 100);
        assert!((q.p50 - 0.050).abs() < 0.001, "{q:?}");
        assert!((q.max - 0.100).abs() < 0.001, "{q:?}");
        let text = r.render_prometheus();
        assert!(text.contains("hits{queue=\"a\"} 3"), "{text}");
        assert!(text.contains("lateness_seconds_count 100"), "{text}");
    }
}
