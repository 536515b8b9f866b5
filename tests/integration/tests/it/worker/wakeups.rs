//! The worker's runtime behaviour on real Postgres: on-time wake-ups without polling
//! (SPEC §7.3), no queries while idle, recovery from killed connections (SPEC §7.4).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use outbox::dlq::DeadLetterFilter;
use outbox::{
    store::{ClaimRequest, Completion, Delivery, Failure, Lease, NextWakeup, Store, Wakeup},
    Context, Message, PgStore, Published, Publisher, Worker,
};
use outbox_tests::{count_runs, eventually, Fixture};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::AssertSqlSafe;

#[outbox::timer(queue = "jobs", max_deliveries = 10)]
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Job {
    n: u32,
}

/// A store that counts the statements the worker issues through it.
#[derive(Clone)]
pub(crate) struct Counting {
    inner: PgStore,
    calls: Arc<Mutex<HashMap<&'static str, usize>>>,
    /// Makes every `next_wakeup` fail, as the read across the shards does on a Citus
    /// cluster with a worker node down.
    failing_look_ahead: bool,
}

impl Counting {
    pub(crate) fn new(inner: PgStore) -> Self {
        Counting {
            inner,
            calls: Arc::default(),
            failing_look_ahead: false,
        }
    }
    fn hit(&self, op: &'static str) {
        *self.calls.lock().unwrap().entry(op).or_default() += 1;
    }
    pub(crate) fn snapshot(&self) -> HashMap<&'static str, usize> {
        self.calls.lock().unwrap().clone()
    }
}

// A wrapper of a store: `Store` is sealed, the `testing` feature opens it to wrappers.
impl outbox::testing::Unsealed for Counting {}

impl Store for Counting {
    async fn claim(&self, request: ClaimRequest<'_>) -> outbox::Result<Vec<Delivery>> {
        self.hit("claim");
        self.inner.claim(request).await
    }
    async fn claim_in_order(
        &self,
        request: ClaimRequest<'_>,
        key_header: &str,
    ) -> outbox::Result<Vec<Delivery>> {
        self.hit("claim_in_order");
        self.inner.claim_in_order(request, key_header).await
    }
    fn claims_in_order(&self) -> bool {
        self.inner.claims_in_order()
    }
    async fn ack(&self, lease: Lease) -> outbox::Result<Completion> {
        self.hit("ack");
        self.inner.ack(lease).await
    }
    async fn ack_batch(&self, leases: &[Lease]) -> outbox::Result<Vec<Completion>> {
        self.hit("ack_batch");
        self.inner.ack_batch(leases).await
    }
    async fn retry(&self, lease: Lease, delay: Duration) -> outbox::Result<Completion> {
        self.hit("retry");
        self.inner.retry(lease, delay).await
    }
    async fn fail(&self, lease: Lease, failure: Failure<'_>) -> outbox::Result<Completion> {
        self.hit("fail");
        self.inner.fail(lease, failure).await
    }
    async fn next_wakeup(&self, request: ClaimRequest<'_>) -> outbox::Result<NextWakeup> {
        self.hit("next_wakeup");
        if self.failing_look_ahead {
            return Err(outbox::Error::Database(sqlx::Error::Protocol(
                "connection to the remote node refused".into(),
            )));
        }
        self.inner.next_wakeup(request).await
    }
    async fn peek(&self, request: ClaimRequest<'_>) -> outbox::Result<Vec<(i64, String)>> {
        self.hit("peek");
        self.inner.peek(request).await
    }
    async fn renew(&self, leases: &[Lease]) -> outbox::Result<Vec<outbox::store::Renewal>> {
        self.hit("renew");
        self.inner.renew(leases).await
    }
    async fn release(
        &self,
        items: &[outbox::store::Release],
    ) -> outbox::Result<Vec<outbox::store::Released>> {
        self.hit("release");
        self.inner.release(items).await
    }
    async fn fail_unclaimed(
        &self,
        id: i64,
        ttl: Duration,
        failure: Failure<'_>,
    ) -> outbox::Result<Completion> {
        self.hit("fail_unclaimed");
        self.inner.fail_unclaimed(id, ttl, failure).await
    }
    fn max_connections(&self) -> Option<u32> {
        self.inner.max_connections()
    }
    fn dead_letter_enabled(&self) -> bool {
        self.inner.dead_letter_enabled()
    }
    async fn wakeups(&self) -> outbox::Result<Option<tokio::sync::mpsc::Receiver<Wakeup>>> {
        self.hit("wakeups");
        self.inner.wakeups().await
    }
    async fn now(&self) -> outbox::Result<DateTime<Utc>> {
        self.hit("now");
        self.inner.now().await
    }
}

/// A look-ahead that keeps failing while claims work (on a Citus cluster with a worker node
/// down the claim goes bucket by bucket, the read across the shards fails) backs off
/// 100 ms, 200 ms, 400 ms … as any failure does: the claims' success between the failures
/// does not reset it (found by a fresh user: 47 claims and look-aheads in 10 s).
#[tokio::test]
async fn a_failing_look_ahead_backs_off_although_claims_work() {
    let f = Fixture::new().await;
    let store = Counting {
        failing_look_ahead: true,
        ..Counting::new(f.store.clone())
    };
    let worker = Worker::builder(store.clone())
        .idle_poll(Duration::from_secs(60))
        .timer::<Job>(|_: Job, _: Context| async {})
        .build()
        .unwrap()
        .start();
    // Back-offs of 100 + 200 + 400 + 800 + 1 600 ms: about 5 look-aheads in 3.5 s, where a
    // reset after each claim made one every 100 ms (about 35).
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let calls = store.snapshot();
    assert!(worker.shutdown().await.graceful);
    let look_aheads = calls.get("next_wakeup").copied().unwrap_or(0);
    assert!(
        (3..=8).contains(&look_aheads),
        "look-aheads in 3.5 s: {look_aheads} ({calls:?})"
    );
    f.cleanup().await;
}

/// With a 60 s idle ceiling, a timer published for now + 2 s while the worker sleeps
/// fires at its deadline, and the idle worker issues no queries in between.
#[tokio::test]
async fn a_sleeping_worker_fires_a_new_timer_on_time_without_polling() {
    let f = Fixture::new().await;
    let store = Counting::new(f.store.clone());
    /// (local firing time, deadline, claimed_at)
    type Fired = (Instant, DateTime<Utc>, DateTime<Utc>);
    let fired: Arc<Mutex<Vec<Fired>>> = Arc::default();
    let worker = {
        let fired = fired.clone();
        Worker::builder(store.clone())
            .idle_poll(Duration::from_secs(60))
            .timer::<Job>(move |_: Job, ctx: Context| {
                let fired = fired.clone();
                async move {
                    fired
                        .lock()
                        .unwrap()
                        .push((Instant::now(), ctx.deadline(), ctx.claimed_at()));
                }
            })
            .build()
            .unwrap()
            .start()
    };
    tokio::time::sleep(Duration::from_millis(800)).await;
    let settled = store.snapshot();
    assert_eq!(
        (settled.get("claim"), settled.get("next_wakeup")),
        (Some(&1), Some(&1)),
        "{settled:?}"
    );
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(
        store.snapshot(),
        settled,
        "an idle worker issues no queries"
    );

    let published = Instant::now();
    let mut conn = f.pool.acquire().await.unwrap();
    publish_job(
        &mut f.outbox.on(&mut conn),
        "t",
        &Job { n: 1 },
        Duration::from_secs(2),
    )
    .await
    .unwrap();
    // The notification alone moves the wake-up: still no query before the deadline.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(store.snapshot(), settled, "the notification costs no query");
    eventually(20, "the timer fires", || async {
        !fired.lock().unwrap().is_empty()
    })
    .await;
    let (at, deadline, claimed_at) = fired.lock().unwrap()[0];
    let after = at - published;
    assert!(
        after >= Duration::from_millis(1900),
        "not before its deadline: {after:?}"
    );
    assert!(
        after < Duration::from_secs(10),
        "well before the 60 s ceiling: {after:?}"
    );
    assert!(claimed_at >= deadline);
    // Acks are pipelined by default: a lone success is written at once, as a batch of one.
    eventually(5, "acked", || async {
        store.snapshot().get("ack_batch") == Some(&1)
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let idle_again = store.snapshot();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(store.snapshot(), idle_again, "idle again, no queries");
    assert!(idle_again["claim"] <= 4, "{idle_again:?}");
    worker.shutdown().await;
    f.cleanup().await;
}

/// A pool whose connections carry `application_name`, so the test can kill exactly them.
async fn named_pool(app: &str) -> sqlx::PgPool {
    let opts: PgConnectOptions = outbox_tests::database_url()
        .parse::<PgConnectOptions>()
        .unwrap()
        .application_name(app);
    PgPoolOptions::new()
        .max_connections(8)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(opts)
        .await
        .unwrap()
}

/// Killing the worker's backends mid-run (claims, completions and the LISTEN connection):
/// it recovers, every message is handled, none is lost, and the only duplicates are
/// redeliveries (a later delivery number of the same row).
#[tokio::test]
async fn the_worker_survives_terminated_backends_without_losing_messages() {
    let f = Fixture::new().await;
    let app = format!(
        "outbox-kill-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    let worker_pool = named_pool(&app).await;
    let store = PgStore::new(worker_pool.clone(), f.outbox.clone());
    const N: u32 = 2000;
    let handled: Arc<Mutex<Vec<(u32, u32)>>> = Arc::default();
    let worker = {
        let handled = handled.clone();
        Worker::builder(store)
            .concurrency(4)
            .fetch_batch_size(50)
            .lease_ttl(Duration::from_secs(2))
            .idle_poll(Duration::from_millis(500))
            .timer::<Job>(move |j: Job, ctx: Context| {
                let handled = handled.clone();
                async move {
                    handled.lock().unwrap().push((j.n, ctx.delivery()));
                    tokio::time::sleep(Duration::from_micros(500)).await;
                }
            })
            .build()
            .unwrap()
            .start()
    };
    let payloads: Vec<Vec<u8>> = (0..N)
        .map(|n| serde_json::to_vec(&Job { n }).unwrap())
        .collect();
    let items: Vec<_> = payloads
        .iter()
        .map(|p| outbox::message::BatchItem::new(p))
        .collect();
    let mut conn = f.pool.acquire().await.unwrap();
    f.outbox
        .publish_batch(&mut conn, "jobs", &items, Duration::ZERO)
        .await
        .unwrap();

    let mut kills = 0i64;
    for _ in 0..5 {
        eventually(30, "progress between kills", || {
            let seen = handled.lock().unwrap().len();
            async move { seen > (kills as usize + 1) * 250 }
        })
        .await;
        let killed: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1) k",
        )
        .bind(&app)
        .fetch_one(&f.pool)
        .await
        .unwrap();
        assert!(killed > 0, "the worker had backends to kill");
        kills += 1;
    }
    eventually(60, "every message handled and deleted", || async {
        f.rows("jobs").await.is_empty()
    })
    .await;
    worker.shutdown().await;

    let handled = handled.lock().unwrap().clone();
    let distinct: HashSet<u32> = handled.iter().map(|h| h.0).collect();
    assert_eq!(distinct.len(), N as usize, "none lost");
    let runs: HashSet<(u32, u32)> = handled.iter().copied().collect();
    assert_eq!(
        runs.len(),
        handled.len(),
        "a row never runs twice under one delivery"
    );
    for &(n, delivery) in &handled {
        if delivery > 1 {
            assert!(
                handled.iter().any(|h| h.0 == n),
                "redelivery of a known row"
            );
        }
    }
    let duplicates = handled.len() - distinct.len();
    println!("{N} messages, {kills} kills, {duplicates} redeliveries");
    f.cleanup().await;
}

/// One poison row (a payload that does not decode) is dead-lettered and does not stall
/// the others, in its queue or in another.
#[tokio::test]
async fn a_poison_row_is_isolated() {
    let f = Fixture::new().await;
    let ok = Arc::new(AtomicUsize::new(0));
    let raw = Arc::new(AtomicUsize::new(0));
    let worker = Worker::builder(f.store.clone())
        .idle_poll(Duration::from_millis(200))
        .timer::<Job>(count_runs::<Job>(&ok))
        .queue("other", count_runs::<Vec<u8>>(&raw))
        .build()
        .unwrap()
        .start();
    let mut conn = f.pool.acquire().await.unwrap();
    f.outbox
        .publish(&mut conn, Message::new("jobs", b"\x00\x01 not json"))
        .await
        .unwrap();
    for n in 0..20 {
        publish_job(
            &mut f.outbox.on(&mut conn),
            &format!("j{n}"),
            &Job { n },
            Duration::ZERO,
        )
        .await
        .unwrap();
        f.outbox
            .publish(&mut conn, Message::new("other", b"x"))
            .await
            .unwrap();
    }
    eventually(20, "all good rows handled", || async {
        ok.load(Ordering::SeqCst) == 20 && raw.load(Ordering::SeqCst) == 20
    })
    .await;
    eventually(5, "queues drained", || async {
        f.rows("jobs").await.is_empty() && f.rows("other").await.is_empty()
    })
    .await;
    let dlq = f
        .store
        .dead_letters(&DeadLetterFilter::new().queue("jobs"), None, 10)
        .await
        .unwrap();
    assert_eq!(dlq.len(), 1);
    assert_eq!(
        (dlq[0].failure_reason.as_str(), dlq[0].payload.as_slice()),
        ("decode_error", &b"\x00\x01 not json"[..])
    );
    worker.shutdown().await;
    f.cleanup().await;
}

/// After the LISTEN connection is killed, the worker re-LISTENs and re-scans: a timer
/// published right after the kill still fires near its deadline, not at the 60 s ceiling.
#[tokio::test]
async fn a_lost_listen_connection_is_rebuilt_and_timers_stay_on_time() {
    let f = Fixture::new().await;
    let app = format!(
        "outbox-listen-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    let store = PgStore::new(named_pool(&app).await, f.outbox.clone());
    let fired = Arc::new(AtomicUsize::new(0));
    let worker = Worker::builder(store)
        .idle_poll(Duration::from_secs(60))
        .timer::<Job>(count_runs::<Job>(&fired))
        .build()
        .unwrap()
        .start();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let killed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE application_name = $1 AND query ILIKE 'LISTEN%') k",
    )
    .bind(&app)
    .fetch_one(&f.pool)
    .await
    .unwrap();
    assert_eq!(killed, 1, "exactly the LISTEN connection");
    let t0 = Instant::now();
    let mut conn = f.pool.acquire().await.unwrap();
    publish_job(
        &mut f.outbox.on(&mut conn),
        "after-kill",
        &Job { n: 1 },
        Duration::from_millis(1500),
    )
    .await
    .unwrap();
    eventually(20, "the timer fires", || async {
        fired.load(Ordering::SeqCst) == 1
    })
    .await;
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "fired long before the 60 s ceiling: {:?}",
        t0.elapsed()
    );
    // LISTEN is back: a later timer fires through the notification again.
    eventually(10, "LISTEN restored", || async {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND query ILIKE 'LISTEN%'",
        )
        .bind(&app)
        .fetch_one(&f.pool)
        .await
        .unwrap();
        n == 1
    })
    .await;
    publish_job(
        &mut f.outbox.on(&mut conn),
        "later",
        &Job { n: 2 },
        Duration::from_millis(500),
    )
    .await
    .unwrap();
    eventually(20, "the second timer fires", || async {
        fired.load(Ordering::SeqCst) == 2
    })
    .await;
    worker.shutdown().await;
    f.cleanup().await;
}

/// A due row locked by an open transaction (an uncommitted extend) cannot be claimed; the
/// worker must not back off past the next timer that becomes due meanwhile.
#[tokio::test]
async fn a_locked_due_row_does_not_delay_other_timers() {
    use sqlx::Connection;
    let f = Fixture::new().await;
    let fired: Arc<Mutex<Vec<(String, Duration)>>> = Arc::default();
    let worker = {
        let fired = fired.clone();
        Worker::builder(f.store.clone())
            .idle_poll(Duration::from_secs(60))
            .timer::<Job>(move |_: Job, ctx: Context| {
                let fired = fired.clone();
                async move {
                    let late = (ctx.claimed_at() - ctx.deadline())
                        .to_std()
                        .unwrap_or_default();
                    fired
                        .lock()
                        .unwrap()
                        .push((ctx.timer_id().unwrap_or("").to_owned(), late));
                }
            })
            .build()
            .unwrap()
            .start()
    };
    let mut conn = f.pool.acquire().await.unwrap();
    publish_job(
        &mut f.outbox.on(&mut conn),
        "locked",
        &Job { n: 1 },
        Duration::from_millis(200),
    )
    .await
    .unwrap();
    publish_job(
        &mut f.outbox.on(&mut conn),
        "free",
        &Job { n: 2 },
        Duration::from_millis(2500),
    )
    .await
    .unwrap();
    // An extend of `locked` stays uncommitted past both deadlines.
    let mut other = f.pool.acquire().await.unwrap();
    let mut tx = other.begin().await.unwrap();
    extend_job(
        &mut f.outbox.on(&mut tx),
        "locked",
        &Job { n: 3 },
        Duration::from_secs(60),
    )
    .await
    .unwrap();
    eventually(20, "the free timer fires", || async {
        !fired.lock().unwrap().is_empty()
    })
    .await;
    tx.rollback().await.unwrap();
    let (id, late) = fired.lock().unwrap()[0].clone();
    assert_eq!(id, "free");
    assert!(
        late < Duration::from_millis(1500),
        "fired {late:?} after its deadline"
    );
    // Once the lock is gone, the locked timer fires too (the contention poll finds it).
    eventually(10, "the formerly locked timer fires", || async {
        fired.lock().unwrap().len() == 2
    })
    .await;
    worker.shutdown().await;
    f.cleanup().await;
}

/// A panic in the synchronous part of a handler closure (before its future exists) is a
/// failed run like any other, with its message kept; the worker's handler task survives.
#[tokio::test]
async fn a_panic_before_the_future_is_a_failed_run_with_its_message() {
    let f = Fixture::new().await;
    let ok = Arc::new(AtomicUsize::new(0));
    let worker = {
        let ok = ok.clone();
        Worker::builder(f.store.clone())
            .idle_poll(Duration::from_millis(100))
            .concurrency(1)
            .queue_with(
                "sync",
                move |body: Vec<u8>, _: Context| {
                    if body == b"boom" {
                        panic!("sync panic {}", 41);
                    }
                    let ok = ok.clone();
                    async move {
                        if body == b"later" {
                            panic!("async panic {}", 42);
                        }
                        ok.fetch_add(1, Ordering::SeqCst);
                    }
                },
                outbox::HandlerOptions::new().retry(outbox::RetryStrategy::none()),
            )
            .build()
            .unwrap()
            .start()
    };
    let mut conn = f.pool.acquire().await.unwrap();
    for body in [&b"boom"[..], b"later", b"ok", b"ok", b"ok"] {
        f.outbox
            .publish(&mut conn, Message::new("sync", body))
            .await
            .unwrap();
    }
    eventually(10, "every row finished", || async {
        f.rows("sync").await.is_empty()
    })
    .await;
    assert_eq!(ok.load(Ordering::SeqCst), 3, "the worker kept going");
    let dlq = f
        .store
        .dead_letters(&DeadLetterFilter::new().queue("sync"), None, 10)
        .await
        .unwrap();
    let errors: Vec<_> = dlq.iter().filter_map(|d| d.last_error.clone()).collect();
    assert_eq!(
        errors,
        [
            "handler panicked: sync panic 41",
            "handler panicked: async panic 42"
        ]
    );
    worker.shutdown().await;
    f.cleanup().await;
}

/// Shutting down while a claim is in flight never strands claimed rows: after a graceful
/// shutdown no row is left leased, whenever the stop lands.
#[tokio::test]
async fn shutdown_during_a_claim_leaves_no_row_leased() {
    let f = Fixture::new().await;
    let payloads: Vec<Vec<u8>> = (0..600)
        .map(|n| serde_json::to_vec(&Job { n }).unwrap())
        .collect();
    let items: Vec<_> = payloads
        .iter()
        .map(|p| outbox::message::BatchItem::new(p))
        .collect();
    let mut conn = f.pool.acquire().await.unwrap();
    f.outbox
        .publish_batch(&mut conn, "jobs", &items, Duration::ZERO)
        .await
        .unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    for i in 0..25u64 {
        let runs2 = runs.clone();
        let worker = Worker::builder(f.store.clone())
            .fetch_batch_size(20)
            .timer::<Job>(move |_: Job, _: Context| {
                let runs = runs2.clone();
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                }
            })
            .build()
            .unwrap()
            .start();
        tokio::time::sleep(Duration::from_micros(700 * (i % 12))).await;
        let report = worker.shutdown().await;
        assert!(report.graceful);
        let leased: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM {} WHERE acquired_token IS NOT NULL",
            f.outbox.table()
        )))
        .fetch_one(&f.pool)
        .await
        .unwrap();
        assert_eq!(
            leased, 0,
            "round {i}: claimed rows were stranded by the shutdown"
        );
    }
    let left = f.rows("jobs").await.len();
    assert_eq!(
        runs.load(Ordering::SeqCst) + left,
        600,
        "every row ran once or is still pending"
    );
    f.cleanup().await;
}

/// A rearm applied by a worker that then shuts down is announced: an idle second worker
/// (60 s ceiling) fires it on time.
#[tokio::test]
async fn a_rearm_applied_by_another_worker_wakes_an_idle_one() {
    let f = Fixture::new().await;
    let fired: Arc<Mutex<Vec<(u32, Duration)>>> = Arc::default();
    let started = Arc::new(tokio::sync::Notify::new());
    let release = Arc::new(tokio::sync::Notify::new());
    let a = {
        let (started, release) = (started.clone(), release.clone());
        Worker::builder(f.store.clone())
            .idle_poll(Duration::from_secs(60))
            .timer::<Job>(move |_: Job, _: Context| {
                let (started, release) = (started.clone(), release.clone());
                async move {
                    started.notify_one();
                    release.notified().await;
                }
            })
            .build()
            .unwrap()
            .start()
    };
    let mut conn = f.pool.acquire().await.unwrap();
    publish_job(
        &mut f.outbox.on(&mut conn),
        "x",
        &Job { n: 1 },
        Duration::ZERO,
    )
    .await
    .unwrap();
    started.notified().await;
    let p = extend_job(
        &mut f.outbox.on(&mut conn),
        "x",
        &Job { n: 2 },
        Duration::from_millis(1500),
    )
    .await
    .unwrap();
    assert!(matches!(p, Published::RearmQueued { .. }), "{p:?}");
    // B starts idle now: it has scanned and sleeps towards its 60 s ceiling.
    let b = {
        let fired = fired.clone();
        Worker::builder(f.store.clone())
            .idle_poll(Duration::from_secs(60))
            .timer::<Job>(move |j: Job, ctx: Context| {
                let fired = fired.clone();
                async move {
                    let late = (ctx.claimed_at() - ctx.deadline())
                        .to_std()
                        .unwrap_or_default();
                    fired.lock().unwrap().push((j.n, late));
                }
            })
            .build()
            .unwrap()
            .start()
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    release.notify_one();
    a.shutdown().await;
    eventually(20, "B fires the rearmed timer", || async {
        !fired.lock().unwrap().is_empty()
    })
    .await;
    let (n, late) = fired.lock().unwrap()[0];
    assert_eq!(n, 2);
    assert!(
        late < Duration::from_secs(5),
        "fired {late:?} late, not at B's 60 s ceiling"
    );
    b.shutdown().await;
    f.cleanup().await;
}

/// `migrate` and the other entry points can run inside `tokio::spawn`: their futures are
/// Send. A compile-time check; the futures are built and dropped, never run.
#[tokio::test]
async fn public_futures_are_send() {
    fn send<T: Send>(_: T) {}
    let pool = PgPoolOptions::new()
        .connect_lazy(&outbox_tests::database_url())
        .unwrap();
    let outbox = outbox::Outbox::default();
    send(outbox::migrate(&pool));
    send(outbox.migrate(&pool));
    send(outbox.migrate_base_only(&pool));
    send(outbox::schema::validate_schema(&pool));
    send(outbox.validate_schema(&pool));
    let store = PgStore::new(pool.clone(), outbox.clone());
    send(store.claim(ClaimRequest::new(&[], 1, Duration::from_secs(1))));
    send(store.pending("q", 1));
    send(store.dead_letters(&DeadLetterFilter::new().queue("q"), None, 1));
    send((&store).publish_message(Message::new("q", b"x")));
    send((&store).cancel_timer("q", "k"));
    send((&pool).publish_message(Message::new("q", b"x")));
    send(publish_job(&pool, "k", &Job { n: 1 }, Duration::ZERO));
    send(publish_job(&store, "k", &Job { n: 1 }, Duration::ZERO));
    send(store.next_wakeup(ClaimRequest::new(&[], 0, Duration::from_secs(1))));
    send(store.wakeups());
}

/// A poll-only worker (`listen(false)`, for poolers in transaction mode, where a LISTEN would
/// be lost) never asks for notifications and no session LISTENs on its channel, yet a row
/// published while it sleeps runs within `idle_poll` (bounded at 3× `idle_poll`). A default
/// worker over the same counting store does ask (the control).
#[tokio::test]
async fn a_poll_only_worker_never_listens_and_finds_new_rows_within_idle_poll() {
    let f = Fixture::new().await;
    let noop = |_: Job, _ctx: Context| async {};

    let control = Counting::new(f.store.clone());
    let listening = Worker::builder(control.clone())
        .timer::<Job>(noop)
        .build()
        .unwrap()
        .start();
    let channel = f.outbox.channel().to_owned();
    let listeners = || async {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE query ILIKE 'LISTEN%' AND strpos(query, $1) > 0",
        )
        .bind(&channel)
        .fetch_one(&f.pool)
        .await
        .unwrap();
        n
    };
    eventually(10, "the default worker LISTENs", || async {
        listeners().await == 1
    })
    .await;
    listening.shutdown().await;
    assert_eq!(control.snapshot().get("wakeups"), Some(&1));
    eventually(10, "its listener is gone", || async {
        listeners().await == 0
    })
    .await;

    let store = Counting::new(f.store.clone());
    let poll = Duration::from_millis(500);
    let fired: Arc<Mutex<Vec<Instant>>> = Arc::default();
    let worker = {
        let fired = fired.clone();
        Worker::builder(store.clone())
            .listen(false)
            .idle_poll(poll)
            .timer::<Job>(move |_: Job, _ctx: Context| {
                let fired = fired.clone();
                async move { fired.lock().unwrap().push(Instant::now()) }
            })
            .build()
            .unwrap()
            .start()
    };
    tokio::time::sleep(Duration::from_millis(300)).await; // asleep, nothing due
    assert_eq!(listeners().await, 0, "no session LISTENs on {channel}");

    let published = Instant::now();
    let mut conn = f.pool.acquire().await.unwrap();
    publish_job(
        &mut f.outbox.on(&mut conn),
        "p",
        &Job { n: 1 },
        Duration::ZERO,
    )
    .await
    .unwrap();
    eventually(10, "the poll-only worker runs the row", || async {
        !fired.lock().unwrap().is_empty()
    })
    .await;
    let after = fired.lock().unwrap()[0] - published;
    assert!(
        after <= poll * 3,
        "ran {after:?} after publish, idle_poll {poll:?}"
    );
    assert_eq!(
        store.snapshot().get("wakeups"),
        None,
        "never asked to LISTEN"
    );
    worker.shutdown().await;
    f.cleanup().await;
}
