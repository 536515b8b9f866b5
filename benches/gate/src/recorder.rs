//! A `metrics` recorder that watches the worker through its own metrics (SPEC §11): how many
//! completions have been written (`outbox_acked_total`, counted after the fenced write
//! returned) and how many claims came back short of the limit (`outbox_claim_batch_size`).
//!
//! The first tells the harness when the last message of a run is really finished — its
//! completion committed, not only its handler called — so the timed window ends there.
//! The second tells it that the claim loop has run out of due rows and gone idle, so the
//! statements counted for a run do not depend on when the run was stopped.
//!
//! It also totals a few failure counters ([`TRACKED`]) for the fault matrix (`faults.rs`),
//! which reports how often the worker met each kind of failure during a fault.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use metrics::{
    Counter, CounterFn, Gauge, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder,
    SharedString, Unit,
};
use tokio::sync::Notify;

/// Worker counters totalled over the whole process, never reset: the fault matrix reads
/// them before and after a scenario. Labels are summed, except `phase` (which completion
/// lost its lease), kept as `<name>/<phase>`.
pub const TRACKED: &[&str] = &[
    "outbox_lease_lost_total",
    "outbox_claim_errors_total",
    "outbox_completion_errors_total",
    "outbox_retried_total",
    "outbox_poison_rows_total",
];

/// Counts of one run; [`Watch::reset`] starts a new one.
#[derive(Default)]
pub struct Watch {
    acked: AtomicU64,
    short_claims: AtomicU64,
    limit: AtomicU64,
    changed: Notify,
    tracked: Mutex<BTreeMap<String, Arc<AtomicU64>>>,
}

impl Watch {
    /// Zeroes the counts; `limit` is the run's `fetch_batch_size` (a claim returning fewer
    /// rows is short).
    pub fn reset(&self, limit: usize) {
        self.acked.store(0, Ordering::SeqCst);
        self.short_claims.store(0, Ordering::SeqCst);
        self.limit.store(limit as u64, Ordering::SeqCst);
    }

    pub fn acked(&self) -> u64 {
        self.acked.load(Ordering::SeqCst)
    }

    pub fn short_claims(&self) -> u64 {
        self.short_claims.load(Ordering::SeqCst)
    }

    /// The process-wide totals of [`TRACKED`] seen so far, by name (and phase).
    pub fn tracked(&self) -> BTreeMap<String, u64> {
        self.tracked
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(k, n)| (k.clone(), n.load(Ordering::SeqCst)))
            .collect()
    }

    fn tracked_cell(&self, key: String) -> Arc<AtomicU64> {
        self.tracked
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(key)
            .or_default()
            .clone()
    }

    /// Waits until at least `n` completions have been written.
    pub async fn acked_at_least(&self, n: u64) {
        loop {
            let notified = self.changed.notified();
            if self.acked() >= n {
                return;
            }
            notified.await;
        }
    }
}

struct Acked(Arc<Watch>);

impl CounterFn for Acked {
    fn increment(&self, value: u64) {
        self.0.acked.fetch_add(value, Ordering::SeqCst);
        self.0.changed.notify_waiters();
    }

    fn absolute(&self, value: u64) {
        self.0.acked.fetch_max(value, Ordering::SeqCst);
        self.0.changed.notify_waiters();
    }
}

/// One of [`TRACKED`].
struct Tracked(Arc<AtomicU64>);

impl CounterFn for Tracked {
    fn increment(&self, value: u64) {
        self.0.fetch_add(value, Ordering::SeqCst);
    }

    fn absolute(&self, value: u64) {
        self.0.fetch_max(value, Ordering::SeqCst);
    }
}

struct ClaimSize(Arc<Watch>);

impl HistogramFn for ClaimSize {
    fn record(&self, value: f64) {
        if (value as u64) < self.0.limit.load(Ordering::SeqCst) {
            self.0.short_claims.fetch_add(1, Ordering::SeqCst);
        }
        self.0.changed.notify_waiters();
    }
}

struct BenchRecorder(Arc<Watch>);

impl Recorder for BenchRecorder {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        match key.name() {
            "outbox_acked_total" => Counter::from_arc(Arc::new(Acked(self.0.clone()))),
            name if TRACKED.contains(&name) => {
                let cell = match key.labels().find(|l| l.key() == "phase") {
                    Some(phase) => format!("{name}/{}", phase.value()),
                    None => name.to_owned(),
                };
                Counter::from_arc(Arc::new(Tracked(self.0.tracked_cell(cell))))
            }
            _ => Counter::noop(),
        }
    }

    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
    }

    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        match key.name() {
            "outbox_claim_batch_size" => Histogram::from_arc(Arc::new(ClaimSize(self.0.clone()))),
            _ => Histogram::noop(),
        }
    }
}

static WATCH: OnceLock<Arc<Watch>> = OnceLock::new();

/// The process-wide watch, installing the recorder on first use.
pub fn watch() -> Arc<Watch> {
    WATCH
        .get_or_init(|| {
            let w = Arc::new(Watch::default());
            // Only fails if another recorder is installed, which this binary never does.
            let _ = metrics::set_global_recorder(BenchRecorder(w.clone()));
            w
        })
        .clone()
}
