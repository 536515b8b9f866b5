//! The opt-in queue-depth gauge (SPEC §11): the statistics of
//! every queue as `outbox_queue_depth{queue, state}` and
//! `outbox_queue_oldest_due_lateness_seconds{queue}`, read once per process however many
//! workers have it on, its interval at least 15 s, its connection counted in the pool check.
//! The gauge's poller slot is one per process, and a test that reads the gauge installs the
//! global `metrics` recorder, so each such test needs a process of its own (nextest runs
//! every test in its own process).

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use outbox::stats::{QueueStats, StatsMode, StatsRequest};
use outbox::store::{
    ClaimRequest, Completion, Delivery, Failure, Lease, NextWakeup, Release, Released, Renewal,
    Store, Wakeup,
};
use outbox::testing::MemoryStore;
use outbox::{Context, Error, Message, PgStore, Publisher, Worker};
use outbox_tests::Fixture;
use sqlx::AssertSqlSafe;

const EVERY: Duration = Duration::from_secs(15);

/// Every gauge's value set since the last snapshot (the debugging recorder's snapshot
/// drains gauges to 0), by name and sorted labels (`name{k=v,…}`), with its unit and
/// description.
fn gauges(s: &Snapshotter) -> HashMap<String, (f64, Option<metrics::Unit>, Option<String>)> {
    let mut out = HashMap::new();
    for (key, unit, description, value) in s.snapshot().into_vec() {
        let DebugValue::Gauge(g) = value else {
            continue;
        };
        let mut labels: Vec<String> = key
            .key()
            .labels()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        labels.sort();
        let name = format!("{}{{{}}}", key.key().name(), labels.join(","));
        out.insert(
            name,
            (g.into_inner(), unit, description.map(|d| d.to_string())),
        );
    }
    out
}

fn depth(queue: &str, state: &str) -> String {
    format!("outbox_queue_depth{{queue={queue},state={state}}}")
}

fn lateness(queue: &str) -> String {
    format!("outbox_queue_oldest_due_lateness_seconds{{queue={queue}}}")
}

fn install() -> Snapshotter {
    crate::own_process();
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::set_global_recorder(recorder).expect("the only recorder of this process");
    snapshotter
}

#[tokio::test]
async fn the_gauge_reports_every_queue_of_the_table_from_the_first_read() {
    let snapshotter = install();
    let f = Fixture::new().await;
    let (t, d) = (f.outbox.table(), f.outbox.dead_letter_table());
    sqlx::raw_sql(AssertSqlSafe(format!(
        "INSERT INTO {t} (queue, payload, next_attempt_at) VALUES \
           ('a', 'x', now() - interval '30 seconds'), ('a', 'x', now()), \
           ('a', 'x', now() + interval '1 hour'); \
         INSERT INTO {t} (queue, payload, acquired_at, acquired_token) VALUES \
           ('b', 'x', now() - interval '10 minutes', gen_random_uuid()); \
         INSERT INTO {d} (original_id, queue, payload, attempts_count, deliveries_count, \
                          created_at, failure_reason) VALUES \
           (1, 'dead', 'x', 1, 1, now(), 'rejected');"
    )))
    .execute(&f.pool)
    .await
    .unwrap();
    // The worker serves another queue: the gauge covers the whole table.
    let worker = Worker::builder(f.store.clone())
        .queue("gauge.idle", |_: Vec<u8>, _: Context| async {})
        .lease_ttl(Duration::from_secs(120))
        .queue_depth_gauge(EVERY, StatsMode::Exact)
        .build()
        .unwrap()
        .start();
    // The first read runs at start, not after the interval. Snapshots drain the gauges, and
    // one may fall in the middle of a read: keep each series' last value set.
    let seen = Mutex::new(HashMap::new());
    outbox_tests::eventually(10, "the first read of the gauge", || async {
        let mut seen = seen.lock().unwrap();
        for (k, v) in gauges(&snapshotter) {
            if v.0 != 0.0 || !seen.contains_key(&k) {
                seen.insert(k, v);
            }
        }
        seen.len() >= 7 * 3 + 3
    })
    .await;
    worker.shutdown().await;
    let g = seen.into_inner().unwrap();
    let value = |k: &str| g.get(k).unwrap_or_else(|| panic!("no {k}: {g:#?}")).0;
    assert_eq!(value(&depth("a", "pending")), 3.0);
    assert_eq!(value(&depth("a", "due")), 2.0);
    assert_eq!(value(&depth("a", "leased")), 0.0);
    assert_eq!(value(&depth("b", "leased")), 1.0);
    // The worker's lease_ttl (120 s) judges expiry: the 10-minute-old lease expired.
    assert_eq!(value(&depth("b", "expired_leases")), 1.0);
    assert_eq!(value(&depth("b", "pending")), 0.0);
    assert_eq!(value(&depth("dead", "dead_letters")), 1.0);
    assert_eq!(value(&depth("a", "dead_letters")), 0.0);
    let late = value(&lateness("a"));
    assert!((30.0..90.0).contains(&late), "{late}");
    assert_eq!(value(&lateness("b")), 0.0);
    // Described, with units.
    for (name, unit) in [
        (depth("a", "pending"), metrics::Unit::Count),
        (lateness("a"), metrics::Unit::Seconds),
    ] {
        let (_, u, description) = &g[&name];
        assert_eq!(*u, Some(unit), "{name}");
        assert!(
            description.as_ref().is_some_and(|d| !d.is_empty()),
            "{name}"
        );
    }
    f.cleanup().await;
}

#[tokio::test]
async fn the_interval_and_the_pool_are_checked_at_build() {
    let f = Fixture::new().await;
    let build = |store: PgStore, every: Duration| {
        Worker::builder(store)
            .queue("q", |_: Vec<u8>, _: Context| async {})
            .concurrency(1)
            .queue_depth_gauge(every, StatsMode::Estimate)
            .build()
    };
    let knob = |r: Result<Worker<PgStore>, Error>| match r {
        Err(Error::InvalidConfig { knob, reason }) => (knob, reason),
        other => panic!("{other:?}"),
    };
    let (k, reason) = knob(build(f.store.clone(), Duration::from_secs(14)));
    assert_eq!(k, "queue_depth_gauge");
    assert!(reason.contains("15s"), "{reason}");
    assert!(build(f.store.clone(), Duration::from_secs(15)).is_ok());

    // concurrency 1 needs 3 connections, 4 with the gauge's read.
    let three = PgStore::new(outbox_tests::pool_with(3).await, f.outbox.clone());
    let (k, reason) = knob(build(three.clone(), EVERY));
    assert_eq!(k, "max_connections");
    assert!(
        reason.contains("needs 4") && reason.contains("queue-depth gauge"),
        "{reason}"
    );
    let without = Worker::builder(three)
        .queue("q", |_: Vec<u8>, _: Context| async {})
        .build();
    assert!(without.is_ok());
    let four = PgStore::new(outbox_tests::pool_with(4).await, f.outbox.clone());
    assert!(build(four, EVERY).is_ok());
    f.cleanup().await;
}

/// A [`MemoryStore`] that counts the statistics reads and records their lease TTLs.
#[derive(Clone)]
struct Counting {
    inner: MemoryStore,
    reads: Arc<AtomicUsize>,
    ttls: Arc<Mutex<Vec<Duration>>>,
}

// A wrapper of a store: `Store` is sealed, the `testing` feature opens it to wrappers.
impl outbox::testing::Unsealed for Counting {}

impl Store for Counting {
    fn claim(
        &self,
        r: ClaimRequest<'_>,
    ) -> impl Future<Output = outbox::Result<Vec<Delivery>>> + Send {
        self.inner.claim(r)
    }
    fn ack(&self, l: Lease) -> impl Future<Output = outbox::Result<Completion>> + Send {
        self.inner.ack(l)
    }
    fn ack_batch(
        &self,
        l: &[Lease],
    ) -> impl Future<Output = outbox::Result<Vec<Completion>>> + Send {
        self.inner.ack_batch(l)
    }
    fn retry(
        &self,
        l: Lease,
        d: Duration,
    ) -> impl Future<Output = outbox::Result<Completion>> + Send {
        self.inner.retry(l, d)
    }
    fn fail(
        &self,
        l: Lease,
        f: Failure<'_>,
    ) -> impl Future<Output = outbox::Result<Completion>> + Send {
        self.inner.fail(l, f)
    }
    fn renew(&self, l: &[Lease]) -> impl Future<Output = outbox::Result<Vec<Renewal>>> + Send {
        self.inner.renew(l)
    }
    fn release(&self, r: &[Release]) -> impl Future<Output = outbox::Result<Vec<Released>>> + Send {
        self.inner.release(r)
    }
    fn fail_unclaimed(
        &self,
        id: i64,
        ttl: Duration,
        f: Failure<'_>,
    ) -> impl Future<Output = outbox::Result<Completion>> + Send {
        self.inner.fail_unclaimed(id, ttl, f)
    }
    fn next_wakeup(
        &self,
        r: ClaimRequest<'_>,
    ) -> impl Future<Output = outbox::Result<NextWakeup>> + Send {
        self.inner.next_wakeup(r)
    }
    fn peek(
        &self,
        r: ClaimRequest<'_>,
    ) -> impl Future<Output = outbox::Result<Vec<(i64, String)>>> + Send {
        self.inner.peek(r)
    }
    fn wakeups(
        &self,
    ) -> impl Future<Output = outbox::Result<Option<tokio::sync::mpsc::Receiver<Wakeup>>>> + Send
    {
        self.inner.wakeups()
    }
    fn now(&self) -> impl Future<Output = outbox::Result<DateTime<Utc>>> + Send {
        self.inner.now()
    }
    fn dead_letter_enabled(&self) -> bool {
        self.inner.dead_letter_enabled()
    }
    fn queue_stats(
        &self,
        request: &StatsRequest,
    ) -> impl Future<Output = outbox::Result<Option<Vec<QueueStats>>>> + Send {
        self.reads.fetch_add(1, Ordering::SeqCst);
        self.ttls.lock().unwrap().push(request.lease_ttl_of("a"));
        self.inner.queue_stats(request)
    }
}

/// Two workers with the gauge in one process read once per interval between them; when the
/// reading one stops, the other takes over; a queue that empties is set to 0. On tokio's
/// paused clock, so the 15 s intervals cost nothing.
#[tokio::test(start_paused = true)]
async fn one_read_per_process_and_a_take_over() {
    let snapshotter = install();
    let store = Counting {
        inner: MemoryStore::new(),
        reads: Arc::default(),
        ttls: Arc::default(),
    };
    for _ in 0..2 {
        (&store.inner)
            .publish_message(Message::new("a", b"x"))
            .await
            .unwrap();
    }
    let start = |store: &Counting| {
        Worker::builder(store.clone())
            .queue("w", |_: Vec<u8>, _: Context| async {})
            .lease_ttl(Duration::from_secs(45))
            .queue_depth_gauge(EVERY, StatsMode::Exact)
            .build()
            .unwrap()
            .start()
    };
    // The first worker's first read, at 0 s, takes the poller slot.
    let first = start(&store);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(store.reads.load(Ordering::SeqCst), 1);
    let second = start(&store);

    // Reads at 0, 15, 30, 45 and 60 s: five, not ten.
    tokio::time::sleep(Duration::from_secs(60)).await;
    let reads = store.reads.load(Ordering::SeqCst);
    assert!((4..=6).contains(&reads), "{reads} reads in 61 s");
    assert!(store
        .ttls
        .lock()
        .unwrap()
        .iter()
        .all(|t| *t == Duration::from_secs(45)));
    let g = gauges(&snapshotter);
    assert_eq!(g[&depth("a", "pending")].0, 2.0, "{g:#?}");
    assert_eq!(g[&depth("a", "due")].0, 2.0);

    // Queue `a` empties; the next read sets its figures to 0. (The snapshot above drained
    // the gauges to 0: a stand-in value shows that the read sets them, not the drain.)
    let queues = ["a".to_owned()];
    let taken = store
        .inner
        .claim(ClaimRequest::new(&queues, 10, Duration::from_secs(45)))
        .await
        .unwrap();
    for d in taken {
        store.inner.ack(d.lease).await.unwrap();
    }
    metrics::gauge!("outbox_queue_depth", "queue" => "a", "state" => "pending").set(99.0);
    metrics::gauge!("outbox_queue_oldest_due_lateness_seconds", "queue" => "a").set(99.0);
    assert_eq!(gauges(&snapshotter)[&depth("a", "pending")].0, 99.0);
    metrics::gauge!("outbox_queue_depth", "queue" => "a", "state" => "pending").set(99.0);
    metrics::gauge!("outbox_queue_oldest_due_lateness_seconds", "queue" => "a").set(99.0);
    tokio::time::sleep(EVERY).await;
    let g = gauges(&snapshotter);
    assert_eq!(g[&depth("a", "pending")].0, 0.0, "{g:#?}");
    assert_eq!(g[&lateness("a")].0, 0.0);

    // The reading worker stops: the other takes over within its interval.
    first.shutdown().await;
    let before = store.reads.load(Ordering::SeqCst);
    tokio::time::sleep(2 * EVERY + Duration::from_secs(1)).await;
    let after = store.reads.load(Ordering::SeqCst);
    assert!((2..=3).contains(&(after - before)), "{before} → {after}");
    second.shutdown().await;
    // Nobody reads any more.
    tokio::time::sleep(3 * EVERY).await;
    assert_eq!(store.reads.load(Ordering::SeqCst), after);
}
