//! One path for a claimed row: a started worker and `Worker::run_due` run each
//! row through the same code, so one scenario run through both makes the same metric calls
//! (names, labels, values) and the same spans with the same events. They may differ only in
//! how a completion is written: here the started worker pipelines its acks through the
//! completer (the default `ack_batch_size`), `run_due` writes each one inline.
//!
//! Both run over a `MemoryStore` whose virtual clock starts at the same instant, so row ids,
//! deadlines, lateness and completions are the same. Each run records into its own metrics
//! recorder and `tracing` subscriber, set as this thread's defaults: `#[tokio::test]` runs on
//! one thread, so the started worker's tasks record there too.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use metrics_util::MetricKind;
use outbox::periodic::Recurrence;
use outbox::testing::MemoryStore;
use outbox::{Context, HandlerOptions, Message, Outcome, Publisher, RetryStrategy, Worker};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Subscriber};
use tracing_subscriber::layer::{Context as LayerContext, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::Layer;

const QUEUE: &str = "one.path";
const KEY: &str = "job";

#[outbox::timer(queue = "one.path", max_deliveries = 5)]
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Job {
    kind: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scenario {
    /// The handler succeeds.
    Ack,
    /// The first attempt fails (retried at once), the second succeeds.
    Retry,
    /// `Outcome::Reject`: terminal, dead-lettered.
    Reject,
    /// The handler extends its own timer: the ack applies the queued rearm.
    Rearm,
    /// The handler cancels its own timer, then fails: the retry finds it cancelled.
    Cancel,
    /// A payload that does not decode as `Job`: terminal before any handler runs.
    DecodeError,
    /// A schedule's run: it queues its next instant when it starts.
    Periodic,
}

/// The virtual clock's start, the same for both runs.
fn start() -> DateTime<Utc> {
    "2030-01-01T00:00:00Z".parse().unwrap()
}

fn worker(store: &MemoryStore, scenario: Scenario) -> Worker<MemoryStore> {
    let handler = {
        let store = store.clone();
        move |job: Job, ctx: Context| {
            let store = store.clone();
            async move {
                match (job.kind.as_str(), ctx.attempt()) {
                    ("retry", 1) => Err("the first attempt fails".to_owned()),
                    ("reject", _) => Ok(Outcome::Reject("rejected by the handler".into())),
                    ("rearm", _) => {
                        let next = Job {
                            kind: "later".into(),
                        };
                        extend_job(&store, KEY, &next, Duration::from_secs(60))
                            .await
                            .map_err(|e| e.to_string())?;
                        Ok(Outcome::Ack)
                    }
                    ("cancel", _) => {
                        cancel_job(&store, KEY).await.map_err(|e| e.to_string())?;
                        Err("failed after cancelling its own timer".to_owned())
                    }
                    _ => Ok(Outcome::Ack),
                }
            }
        }
    };
    let builder = Worker::builder(store.clone())
        .idle_poll(Duration::from_millis(20))
        .timer_with::<Job>(
            handler,
            HandlerOptions::new().retry(RetryStrategy::constant(Duration::ZERO)),
        );
    let builder = if scenario == Scenario::Periodic {
        builder.schedule(
            "tick",
            Recurrence::parse_every("1m").unwrap(),
            Job {
                kind: "tick".into(),
            },
        )
    } else {
        builder
    };
    builder.build().unwrap()
}

/// A store at [`start`] with the scenario's row (none for a schedule: the worker registers
/// it).
async fn store_for(scenario: Scenario) -> MemoryStore {
    let store = MemoryStore::starting_at(start()).with_dead_letter(true);
    let kind = match scenario {
        Scenario::Ack => "ack",
        Scenario::Retry => "retry",
        Scenario::Reject => "reject",
        Scenario::Rearm => "rearm",
        Scenario::Cancel => "cancel",
        Scenario::DecodeError => {
            store
                .publish_message(Message::new(QUEUE, b"not json").timer_id(KEY))
                .await
                .unwrap();
            return store;
        }
        Scenario::Periodic => return store,
    };
    let job = Job { kind: kind.into() };
    publish_job(&store, KEY, &job, Duration::ZERO)
        .await
        .unwrap();
    store
}

/// What one run recorded: every metric (name and sorted labels → value) and every closed
/// span with its fields and events, sorted.
#[derive(Debug, PartialEq)]
struct Observed {
    metrics: BTreeMap<String, String>,
    spans: Vec<Closed>,
}

/// A closed span: its name, its parent's, its fields as last recorded, and the events it
/// saw in order (level, message and fields).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Closed {
    name: &'static str,
    parent: Option<&'static str>,
    fields: BTreeMap<String, String>,
    events: Vec<String>,
}

impl Observed {
    fn metric(&self, key: &str) -> Option<&str> {
        self.metrics.get(key).map(String::as_str)
    }

    fn spans<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a Closed> {
        self.spans.iter().filter(move |s| s.name == name)
    }

    /// The `outbox.outcome` of every `settle` span, sorted.
    fn settled(&self) -> Vec<&str> {
        let mut out: Vec<&str> = self
            .spans("settle")
            .filter_map(|s| s.fields.get("outbox.outcome"))
            .map(String::as_str)
            .collect();
        out.sort();
        out
    }
}

/// The metrics as comparable text. A histogram of durations is compared by its number of
/// samples (wall time differs from run to run); the others by their samples. Empty claims
/// (a started worker claims again whenever it wakes up, `run_due` once more after its last
/// row) are left out of the claim batch sizes: their number depends on timing, not on the
/// rows.
fn read_metrics(snapshotter: &Snapshotter) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        let mut labels: Vec<String> = key
            .key()
            .labels()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        labels.sort();
        let name = key.key().name();
        let text = match (key.kind(), value) {
            (MetricKind::Counter, DebugValue::Counter(c)) => c.to_string(),
            (MetricKind::Gauge, DebugValue::Gauge(g)) => g.into_inner().to_string(),
            (MetricKind::Histogram, DebugValue::Histogram(h)) => {
                let mut samples: Vec<f64> = h.iter().map(|v| v.into_inner()).collect();
                if name == "outbox_claim_batch_size" {
                    samples.retain(|&n| n > 0.0);
                }
                samples.sort_by(f64::total_cmp);
                if name.ends_with("_duration_seconds") {
                    format!("{} samples", samples.len())
                } else {
                    format!("{samples:?}")
                }
            }
            (kind, value) => format!("{kind:?} {value:?}"),
        };
        out.insert(format!("{name}{{{}}}", labels.join(",")), text);
    }
    out
}

#[derive(Default)]
struct Fields(BTreeMap<String, String>);

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(
            field.name().to_owned(),
            format!("{value:?}").replace('"', ""),
        );
    }
}

/// The events a span saw, in order: level, message and fields.
#[derive(Default)]
struct Events(Vec<String>);

/// Records every closed span.
#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<Closed>>>);

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Capture {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: LayerContext<'_, S>) {
        let mut fields = Fields::default();
        attrs.record(&mut fields);
        let span = ctx.span(id).unwrap();
        let mut ext = span.extensions_mut();
        ext.insert(fields);
        ext.insert(Events::default());
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: LayerContext<'_, S>) {
        let span = ctx.span(id).unwrap();
        let mut ext = span.extensions_mut();
        values.record(ext.get_mut::<Fields>().unwrap());
    }

    fn on_event(&self, event: &Event<'_>, ctx: LayerContext<'_, S>) {
        // Events outside a span (a started worker's start and shutdown) are not a row's.
        let Some(span) = ctx.event_span(event) else {
            return;
        };
        let mut fields = Fields::default();
        event.record(&mut fields);
        let line = format!("{} {:?}", event.metadata().level(), fields.0);
        span.extensions_mut()
            .get_mut::<Events>()
            .unwrap()
            .0
            .push(line);
    }

    fn on_close(&self, id: Id, ctx: LayerContext<'_, S>) {
        let span = ctx.span(&id).unwrap();
        let mut ext = span.extensions_mut();
        let fields = ext.remove::<Fields>().unwrap().0;
        let events = ext.remove::<Events>().unwrap().0;
        // A claim that took no row is left out, as in the metrics.
        if span.name() == "receive"
            && fields
                .get("messaging.batch.message_count")
                .map(String::as_str)
                == Some("0")
        {
            return;
        }
        self.0.lock().unwrap().push(Closed {
            name: span.name(),
            parent: span.parent().map(|p| p.name()),
            fields,
            events,
        });
    }
}

impl Capture {
    fn closed(&self, name: &str) -> usize {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.name == name)
            .count()
    }
}

/// Runs `body` with a recorder and a subscriber of its own as this thread's defaults.
async fn observe<F, Fut>(body: F) -> Observed
where
    F: FnOnce(Capture) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let capture = Capture::default();
    {
        let _metrics = metrics::set_default_local_recorder(&recorder);
        let _tracing =
            tracing::subscriber::set_default(tracing_subscriber::registry().with(capture.clone()));
        body(capture.clone()).await;
    }
    let mut spans = capture.0.lock().unwrap().clone();
    spans.sort();
    Observed {
        metrics: read_metrics(&snapshotter),
        spans,
    }
}

/// The scenario through `run_due`: the first call registers a schedule (and runs whatever
/// is due); for a schedule the clock then moves to its first instant and a second call runs
/// it.
async fn inline(scenario: Scenario) -> Observed {
    observe(|_| async move {
        let store = store_for(scenario).await;
        let worker = worker(&store, scenario);
        worker.run_due().await.unwrap();
        if scenario == Scenario::Periodic {
            store.advance(Duration::from_secs(60));
            assert_eq!(worker.run_due().await.unwrap().len(), 1);
        }
    })
    .await
}

/// The scenario through a started worker, until `runs` runs have ended.
async fn started(scenario: Scenario, runs: usize) -> Observed {
    observe(|capture| async move {
        let store = store_for(scenario).await;
        let running = worker(&store, scenario).start();
        if scenario == Scenario::Periodic {
            outbox_tests::eventually(10, "the schedule is registered", || async {
                !store.rows().is_empty()
            })
            .await;
            store.advance(Duration::from_secs(60));
        }
        outbox_tests::eventually(20, "every run ended", || async {
            capture.closed("process") >= runs
        })
        .await;
        let report = running.shutdown().await;
        assert!(report.graceful, "{report:?}");
    })
    .await
}

/// Runs `scenario` both ways, checks that `run_due` recorded what the scenario is about
/// (`want`: metric → value, and the settle outcomes), then that the started worker recorded
/// the same.
async fn same_both_ways(scenario: Scenario, want: &[(&str, &str)], settled: &[&str]) {
    // The spans are read through `tracing`, which caches per process which sites are
    // enabled (see the crate docs).
    crate::own_process();
    let inline = inline(scenario).await;
    for (key, value) in want {
        assert_eq!(
            inline.metric(key),
            Some(*value),
            "{scenario:?}: {key} through run_due: {:#?}",
            inline.metrics
        );
    }
    assert_eq!(
        inline.settled(),
        settled,
        "{scenario:?}: {:#?}",
        inline.spans
    );
    let runs = inline.spans("process").count();
    let started = started(scenario, runs).await;
    assert_eq!(
        inline.metrics, started.metrics,
        "{scenario:?}: the metrics of run_due (left) and of a started worker (right)"
    );
    assert_eq!(
        inline.spans, started.spans,
        "{scenario:?}: the spans of run_due (left) and of a started worker (right)"
    );
}

const ACKED: &str = "outbox_acked_total{queue=one.path}";
const REARMED: &str = "outbox_rearmed_total{queue=one.path}";
const IN_FLIGHT: &str = "outbox_in_flight{queue=one.path}";
const DURATION: &str = "outbox_handler_duration_seconds{queue=one.path}";
const LATENESS: &str = "outbox_firing_lateness_seconds{queue=one.path}";
const DLQ: &str = "outbox_dlq_written_total{queue=one.path}";

#[tokio::test]
async fn ack() {
    let want = [
        (ACKED, "1"),
        (IN_FLIGHT, "0"),
        (DURATION, "1 samples"),
        (LATENESS, "[0.0]"),
        ("outbox_claim_batch_size{}", "[1.0]"),
    ];
    same_both_ways(Scenario::Ack, &want, &["acked"]).await;
}

#[tokio::test]
async fn retry() {
    let want = [
        ("outbox_retried_total{queue=one.path}", "1"),
        (ACKED, "1"),
        (DURATION, "2 samples"),
        (LATENESS, "[0.0, 0.0]"),
    ];
    same_both_ways(Scenario::Retry, &want, &["acked", "retried"]).await;
}

#[tokio::test]
async fn reject() {
    let want = [
        ("outbox_terminal_total{queue=one.path,reason=rejected}", "1"),
        (DLQ, "1"),
    ];
    same_both_ways(Scenario::Reject, &want, &["dead_lettered"]).await;
}

#[tokio::test]
async fn rearm() {
    let want = [(ACKED, "1"), (REARMED, "1")];
    same_both_ways(Scenario::Rearm, &want, &["rearmed"]).await;
}

#[tokio::test]
async fn cancel() {
    let want = [("outbox_cancelled_runs_total{queue=one.path}", "1")];
    same_both_ways(Scenario::Cancel, &want, &["cancelled"]).await;
}

#[tokio::test]
async fn decode_error() {
    let want = [
        (
            "outbox_terminal_total{queue=one.path,reason=decode_error}",
            "1",
        ),
        (DLQ, "1"),
        (IN_FLIGHT, "0"),
    ];
    same_both_ways(Scenario::DecodeError, &want, &["dead_lettered"]).await;
}

#[tokio::test]
async fn periodic() {
    let want = [(ACKED, "1"), (REARMED, "1"), (LATENESS, "[0.0]")];
    same_both_ways(Scenario::Periodic, &want, &["rearmed"]).await;
}
