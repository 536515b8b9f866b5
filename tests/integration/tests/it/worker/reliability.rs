//! The worker's reliability on real Postgres (SPEC §3, §7.4, §7.5, §7.8): poison rows never
//! stall other rows or queues; a lease lost before its row started keeps the row from
//! starting; a hung handler is stopped by its timeout; shutdown gives held rows back, and
//! keeps its deadline when the database is gone; a pool too small is refused by `build()`;
//! a worker facing a database that is down says why.
//!
//! Time bounds derive from the configured values with a margin of at least 3×.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox::dlq::DeadLetterFilter;
use outbox::{
    store::{ClaimRequest, Store},
    Context, Error, HandlerOptions, Outbox, PgStore, RetryStrategy, Worker,
};
use outbox_tests::proxy::Proxy;
use outbox_tests::{eventually, Fixture};
use sqlx::postgres::PgPoolOptions;
use sqlx::AssertSqlSafe;
use tokio::sync::Notify;

#[outbox::timer(queue = "jobs", max_deliveries = 3)]
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Job {
    n: u32,
}

#[outbox::timer(queue = "other", max_deliveries = 3)]
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Other {
    n: u32,
}

fn fast(store: PgStore) -> outbox::WorkerBuilder<PgStore> {
    Worker::builder(store).idle_poll(Duration::from_millis(100))
}

async fn sql(f: &Fixture, text: String) {
    sqlx::raw_sql(AssertSqlSafe(text))
        .execute(&f.pool)
        .await
        .unwrap();
}

/// Counts the runs of each job number.
#[derive(Clone, Default)]
struct Runs(Arc<Mutex<Vec<u32>>>);

impl Runs {
    fn job(&self) -> impl Fn(Job, Context) -> std::future::Ready<()> + Send + Sync + 'static {
        let runs = self.0.clone();
        move |j: Job, _| {
            runs.lock().unwrap().push(j.n);
            std::future::ready(())
        }
    }
    fn other(&self) -> impl Fn(Other, Context) -> std::future::Ready<()> + Send + Sync + 'static {
        let runs = self.0.clone();
        move |o: Other, _| {
            runs.lock().unwrap().push(1000 + o.n);
            std::future::ready(())
        }
    }
    fn sorted(&self) -> Vec<u32> {
        let mut v = self.0.lock().unwrap().clone();
        v.sort_unstable();
        v
    }
}

async fn publish_jobs(f: &Fixture, ns: &[u32]) {
    let mut conn = f.pool.acquire().await.unwrap();
    for &n in ns {
        publish_job(
            f.outbox.on(&mut conn),
            &format!("j{n}"),
            &Job { n },
            Duration::ZERO,
        )
        .await
        .unwrap();
    }
}

async fn seed_other(f: &Fixture, n: u32) {
    let mut conn = f.pool.acquire().await.unwrap();
    publish_other(
        f.outbox.on(&mut conn),
        &format!("o{n}"),
        &Other { n },
        Duration::ZERO,
    )
    .await
    .unwrap();
}

/// SPEC §7.4: a row whose stored headers are valid JSON but not a string map. The good row
/// beside it runs; the bad one is a terminal `decode_error` whose dead letter keeps the raw
/// bytes and headers; `pending()` reports the raw headers; another queue keeps flowing.
#[tokio::test]
async fn a_row_with_undecodable_headers_is_isolated() {
    let f = Fixture::new().await;
    publish_jobs(&f, &[1, 2]).await;
    sql(
        &f,
        format!(
            "UPDATE {} SET headers = '{{\"n\": 1}}' WHERE timer_id = 'j2'",
            f.outbox.table()
        ),
    )
    .await;
    let live = f.store.pending("jobs", 10).await.expect("pending reads it");
    let bad = live
        .iter()
        .find(|r| r.timer_id.as_deref() == Some("j2"))
        .unwrap();
    assert_eq!(bad.headers, None);
    assert_eq!(bad.raw_headers.as_deref(), Some(r#"{"n":1}"#));
    seed_other(&f, 1).await;

    let runs = Runs::default();
    let w = fast(f.store.clone())
        .timer::<Job>(runs.job())
        .timer::<Other>(runs.other())
        .build()
        .unwrap()
        .start();
    eventually(10, "both queues drained", || async {
        f.rows("jobs").await.is_empty() && f.rows("other").await.is_empty()
    })
    .await;
    w.shutdown().await;
    assert_eq!(
        runs.sorted(),
        vec![1, 1001],
        "the good rows ran, the bad one did not"
    );
    let dead = f
        .store
        .dead_letters(&DeadLetterFilter::new().queue("jobs"), None, 10)
        .await
        .unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].failure_reason, "decode_error");
    assert_eq!(dead[0].payload, br#"{"n":2}"#);
    assert_eq!(dead[0].headers, None);
    assert_eq!(dead[0].raw_headers.as_deref(), Some(r#"{"n":1}"#));
    assert_eq!(dead[0].deliveries_count, 1, "one claim, then terminal");
    f.cleanup().await;
}

/// SPEC §7.4: a trigger that raises when one row is leased. The claim is isolated by ids:
/// the other row of the queue and the other queue run; the poison row is set aside and,
/// after `max_deliveries` (3) observed failures, archived by a delete-based statement.
#[tokio::test]
async fn a_row_whose_lease_raises_is_isolated_and_archived() {
    let f = Fixture::new().await;
    let t = f.outbox.table();
    let fun = format!("poison_{}", t.trim_matches('"'));
    sql(
        &f,
        format!(
            "CREATE FUNCTION {fun}() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
               IF NEW.acquired_token IS NOT NULL AND NEW.timer_id = 'j2' THEN \
                 RAISE EXCEPTION 'row % refuses a lease', NEW.id; END IF; \
               RETURN NEW; END $$; \
             CREATE TRIGGER poison BEFORE UPDATE ON {t} FOR EACH ROW EXECUTE FUNCTION {fun}()"
        ),
    )
    .await;
    publish_jobs(&f, &[1, 2, 3]).await;
    seed_other(&f, 1).await;
    let runs = Runs::default();
    let w = fast(f.store.clone())
        .timer::<Job>(runs.job())
        .timer::<Other>(runs.other())
        .build()
        .unwrap()
        .start();
    eventually(10, "the good rows ran", || async {
        runs.sorted() == vec![1, 3, 1001]
    })
    .await;
    // Set aside for 1 s, 2 s, 4 s after the 1st, 2nd and 3rd failure; archived at the 4th.
    eventually(3 * 8, "the poison row is archived", || async {
        f.rows("jobs").await.is_empty()
    })
    .await;
    w.shutdown().await;
    let dead = f
        .store
        .dead_letters(&DeadLetterFilter::new().queue("jobs"), None, 10)
        .await
        .unwrap();
    assert_eq!(dead.len(), 1, "{dead:#?}");
    assert_eq!(dead[0].failure_reason, "max_deliveries");
    assert!(
        dead[0]
            .last_error
            .as_deref()
            .is_some_and(|e| e.contains("refuses a lease")),
        "{dead:#?}"
    );
    assert_eq!(runs.sorted(), vec![1, 3, 1001], "nothing ran twice");
    sql(&f, format!("DROP FUNCTION {fun}() CASCADE")).await;
    f.cleanup().await;
}

/// SPEC §7.4: a running timer whose queued rearm carries headers that are not a string map
/// (written by SQL), plus ten good rows. The ack installs the bad headers; the next claim
/// of that row is a terminal `decode_error`; all ten good rows run.
#[tokio::test]
async fn a_bad_rearm_is_isolated() {
    let f = Fixture::new().await;
    publish_jobs(&f, &[0]).await;
    let started = Arc::new(Notify::new());
    let release = Arc::new(Notify::new());
    let runs = Runs::default();
    let w = {
        let (started, release, runs) = (started.clone(), release.clone(), runs.0.clone());
        fast(f.store.clone())
            .concurrency(2)
            .timer::<Job>(move |j: Job, _: Context| {
                let (started, release, runs) = (started.clone(), release.clone(), runs.clone());
                async move {
                    runs.lock().unwrap().push(j.n);
                    if j.n == 0 {
                        started.notify_one();
                        release.notified().await;
                    }
                }
            })
            .build()
            .unwrap()
            .start()
    };
    started.notified().await;
    sql(
        &f,
        format!(
            "UPDATE {} SET rearm_at = now(), rearm_payload = '{{\"n\":0}}', rearm_headers = '\"oops\"' \
             WHERE timer_id = 'j0'",
            f.outbox.table()
        ),
    )
    .await;
    publish_jobs(&f, &(1..=10).collect::<Vec<_>>()).await;
    release.notify_one();
    eventually(10, "every row is done", || async {
        f.rows("jobs").await.is_empty()
    })
    .await;
    w.shutdown().await;
    assert_eq!(runs.sorted(), (0..=10).collect::<Vec<_>>(), "each ran once");
    let dead = f
        .store
        .dead_letters(&DeadLetterFilter::new().queue("jobs"), None, 10)
        .await
        .unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].failure_reason, "decode_error");
    assert_eq!(dead[0].raw_headers.as_deref(), Some(r#""oops""#));
    f.cleanup().await;
}

/// SPEC §7.8: a buffered row whose lease is lost before a handler slot takes it is never
/// started.
#[tokio::test]
async fn a_buffered_row_whose_lease_was_lost_never_starts() {
    let f = Fixture::new().await;
    publish_jobs(&f, &[1, 2]).await;
    let started = Arc::new(Notify::new());
    let release = Arc::new(Notify::new());
    let runs = Runs::default();
    let w = {
        let (started, release, runs) = (started.clone(), release.clone(), runs.0.clone());
        fast(f.store.clone())
            .concurrency(1)
            .fetch_batch_size(2)
            .lease_ttl(Duration::from_millis(300))
            .timer::<Job>(move |j: Job, _: Context| {
                let (started, release, runs) = (started.clone(), release.clone(), runs.clone());
                async move {
                    runs.lock().unwrap().push(j.n);
                    started.notify_one();
                    release.notified().await;
                }
            })
            .build()
            .unwrap()
            .start()
    };
    started.notified().await;
    let first = runs.sorted()[0];
    let other = 3 - first;
    // Another claimer takes the buffered row.
    sql(
        &f,
        format!(
            "UPDATE {} SET acquired_token = gen_random_uuid(), acquired_at = now() + interval '1 hour' \
             WHERE timer_id = 'j{other}'",
            f.outbox.table()
        ),
    )
    .await;
    // Three renewal periods (lease_ttl / 3 each) are enough for the worker to notice.
    tokio::time::sleep(Duration::from_millis(300)).await;
    release.notify_one();
    tokio::time::sleep(Duration::from_millis(300)).await;
    w.shutdown().await;
    assert_eq!(runs.sorted(), vec![first], "the lost row never started");
    f.cleanup().await;
}

/// SPEC §7.8: a handler that never returns, at concurrency 4. The timeout stops each run;
/// the row is retried and then ends on the terminal path (`timeout`), with never two slots
/// running it at once; the other rows keep flowing.
#[tokio::test]
async fn a_hung_handler_is_stopped_by_its_timeout() {
    let f = Fixture::new().await;
    publish_jobs(&f, &[0]).await;
    let attempts = Arc::new(AtomicUsize::new(0));
    let running = Arc::new(AtomicUsize::new(0));
    let overlaps = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicUsize::new(0));
    let timeout = Duration::from_millis(200);
    let w = {
        let (attempts, running, overlaps, done) = (
            attempts.clone(),
            running.clone(),
            overlaps.clone(),
            done.clone(),
        );
        fast(f.store.clone())
            .concurrency(4)
            .timer_with::<Job>(
                move |j: Job, _: Context| {
                    let (attempts, running, overlaps, done) = (
                        attempts.clone(),
                        running.clone(),
                        overlaps.clone(),
                        done.clone(),
                    );
                    async move {
                        if j.n != 0 {
                            done.fetch_add(1, Ordering::SeqCst);
                            return;
                        }
                        attempts.fetch_add(1, Ordering::SeqCst);
                        // Counted down by a guard: the timeout drops this future.
                        struct Leave(Arc<AtomicUsize>);
                        impl Drop for Leave {
                            fn drop(&mut self) {
                                self.0.fetch_sub(1, Ordering::SeqCst);
                            }
                        }
                        if running.fetch_add(1, Ordering::SeqCst) > 0 {
                            overlaps.fetch_add(1, Ordering::SeqCst);
                        }
                        let _leave = Leave(running.clone());
                        std::future::pending::<()>().await;
                    }
                },
                HandlerOptions::new()
                    .timeout(timeout)
                    .retry(RetryStrategy::constant(Duration::ZERO).max_attempts(3)),
            )
            .build()
            .unwrap()
            .start()
    };
    publish_jobs(&f, &(1..=20).collect::<Vec<_>>()).await;
    // Three runs of 200 ms each, with a 3× margin on the whole.
    eventually(3, "the hung row ends and the others run", || async {
        f.rows("jobs").await.is_empty()
    })
    .await;
    w.shutdown().await;
    assert_eq!(attempts.load(Ordering::SeqCst), 3, "retried, then terminal");
    assert_eq!(
        overlaps.load(Ordering::SeqCst),
        0,
        "never two slots for one row"
    );
    assert_eq!(
        done.load(Ordering::SeqCst),
        20,
        "the other rows kept flowing"
    );
    let dead = f
        .store
        .dead_letters(&DeadLetterFilter::new().queue("jobs"), None, 10)
        .await
        .unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].failure_reason, "timeout");
    assert_eq!(dead[0].attempts_count, 3);
    f.cleanup().await;
}

/// SPEC §7.5, the reported case: concurrency 1, `fetch_batch_size` 5, `lease_ttl` 30 s,
/// `graceful_timeout` 200 ms, five rows whose handler sleeps 5 s; shut down once the first
/// handler starts. All five rows are claimable at once afterwards, with the counters of the
/// release table.
#[tokio::test]
async fn shutdown_gives_every_held_row_back() {
    let f = Fixture::new().await;
    publish_jobs(&f, &[1, 2, 3, 4, 5]).await;
    let started = Arc::new(Notify::new());
    let w = {
        let started = started.clone();
        fast(f.store.clone())
            .concurrency(1)
            .fetch_batch_size(5)
            .lease_ttl(Duration::from_secs(30))
            .graceful_timeout(Duration::from_millis(200))
            .timer::<Job>(move |_: Job, _: Context| {
                let started = started.clone();
                async move {
                    started.notify_one();
                    tokio::time::sleep(Duration::from_secs(5)).await;
                }
            })
            .build()
            .unwrap()
            .start()
    };
    started.notified().await;
    let t0 = std::time::Instant::now();
    let report = w.shutdown().await;
    assert!(
        t0.elapsed() < 3 * (Duration::from_millis(200) + outbox::worker::SHUTDOWN_GRACE),
        "{:?}",
        t0.elapsed()
    );
    assert_eq!(
        (
            report.abandoned,
            report.released,
            report.retried,
            report.unreleased
        ),
        (1, 4, 1, 0),
        "{report:?}"
    );
    let rows = f.rows("jobs").await;
    assert_eq!(rows.len(), 5);
    assert!(rows.iter().all(|r| r.acquired_token.is_none()), "{rows:#?}");
    let started_row: Vec<_> = rows.iter().filter(|r| r.attempts_count == 1).collect();
    assert_eq!(started_row.len(), 1, "the stopped run counts as an attempt");
    assert_eq!(started_row[0].deliveries_count, 1);
    let never: Vec<_> = rows.iter().filter(|r| r.attempts_count == 0).collect();
    assert!(
        never.iter().all(|r| r.deliveries_count == 0),
        "a row that never started was not delivered: {never:#?}"
    );
    // Another worker can claim all five now.
    let queues = ["jobs".to_owned()];
    let got = f
        .store
        .claim(ClaimRequest::new(&queues, 10, Duration::from_secs(30)))
        .await
        .unwrap();
    assert_eq!(got.len(), 5);
    f.cleanup().await;
}

/// SPEC §7.5: with the database gone, shutdown keeps its deadline and reports what it could
/// not give back.
#[tokio::test]
async fn shutdown_keeps_its_deadline_when_the_database_is_gone() {
    let f = Fixture::new().await;
    publish_jobs(&f, &[1, 2, 3]).await;
    let proxy = Proxy::start().await;
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(30))
        .connect(&proxy.url())
        .await
        .unwrap();
    let store = PgStore::new(pool, f.outbox.clone());
    let started = Arc::new(Notify::new());
    let graceful = Duration::from_secs(1);
    let w = {
        let started = started.clone();
        fast(store)
            .concurrency(1)
            .fetch_batch_size(3)
            .graceful_timeout(graceful)
            .timer::<Job>(move |_: Job, _: Context| {
                let started = started.clone();
                async move {
                    started.notify_one();
                    tokio::time::sleep(Duration::from_secs(60)).await;
                }
            })
            .build()
            .unwrap()
            .start()
    };
    started.notified().await;
    proxy.cut().await;
    let t0 = std::time::Instant::now();
    let report = w.shutdown().await;
    let took = t0.elapsed();
    assert!(
        took < 3 * (graceful + outbox::worker::SHUTDOWN_GRACE),
        "{took:?}"
    );
    assert!(!report.graceful, "{report:?}");
    assert_eq!(report.unreleased, 3, "{report:?}");
    f.cleanup().await;
}

/// SPEC §7.4: a pool too small for the worker is refused by `build()`, naming the numbers.
#[tokio::test]
async fn a_pool_too_small_is_refused_by_build() {
    let pool = outbox_tests::pool_with(1).await;
    let store = PgStore::new(pool, Outbox::default());
    let err = Worker::builder(store)
        .concurrency(2)
        .timer::<Job>(|_: Job, _: Context| async {})
        .build()
        .unwrap_err();
    match &err {
        Error::InvalidConfig { knob, reason } => {
            assert_eq!(*knob, "max_connections");
            assert!(reason.contains("holds 1 connection"), "{reason}");
            assert!(reason.contains("needs 4"), "{reason}");
            // What the two beyond the slots are for, as the `PgStore` docs' table says
            // (a fresh-user trial of 2026-12-05 found the two disagreeing).
            assert!(
                reason.contains("2 for the handler slots")
                    && reason.contains("1 for claims and wake-up reads")
                    && reason.contains("1 for a batched ack that must wait for a row lock"),
                "{reason}"
            );
        }
        other => panic!("{other:?}"),
    }
}

/// SPEC §7.4: a worker's store facing a database that is down reports the real cause
/// (connection refused), not a pool timeout, as soon as its pool gives up.
#[tokio::test]
async fn a_database_that_is_down_is_reported_with_its_cause() {
    let proxy = Proxy::start().await;
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_millis(500))
        .connect_lazy(&proxy.url())
        .unwrap();
    proxy.cut().await;
    let store = PgStore::new(pool, Outbox::default());
    let queues = ["jobs".to_owned()];
    let t0 = std::time::Instant::now();
    let err = store
        .claim(ClaimRequest::new(&queues, 1, Duration::from_secs(30)))
        .await
        .unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    assert!(err.is_connection_error(), "{err:?}");
    let text = err.to_string().to_lowercase();
    assert!(text.contains("refused"), "{text}");
}

/// SPEC §3, §7.8: a cancel reaches a running handler through its context at the next lease
/// renewal, told apart from a lost lease; the run's end then deletes the row.
#[tokio::test]
async fn a_cancel_reaches_the_running_handler() {
    let f = Fixture::new().await;
    publish_jobs(&f, &[1]).await;
    let seen: Arc<Mutex<Vec<outbox::worker::CancelReason>>> = Arc::default();
    let started = Arc::new(Notify::new());
    let lease_ttl = Duration::from_millis(300);
    let w = {
        let (seen, started) = (seen.clone(), started.clone());
        fast(f.store.clone())
            .lease_ttl(lease_ttl)
            .timer::<Job>(move |_: Job, ctx: Context| {
                let (seen, started) = (seen.clone(), started.clone());
                async move {
                    started.notify_one();
                    let why = ctx.cancelled().await;
                    seen.lock().unwrap().push(why);
                    Err::<(), _>("stopped early")
                }
            })
            .build()
            .unwrap()
            .start()
    };
    started.notified().await;
    let mut conn = f.pool.acquire().await.unwrap();
    let c = cancel_job(f.outbox.on(&mut conn), "j1").await.unwrap();
    assert!(matches!(c, outbox::Cancelled::Running { .. }), "{c:?}");
    // Renewals run every lease_ttl / 3: bound by 3 × lease_ttl.
    let t0 = std::time::Instant::now();
    eventually(10, "the handler hears of the cancel", || async {
        !seen.lock().unwrap().is_empty()
    })
    .await;
    assert!(t0.elapsed() < 3 * lease_ttl, "{:?}", t0.elapsed());
    assert_eq!(
        *seen.lock().unwrap(),
        vec![outbox::worker::CancelReason::TimerCancelled]
    );
    eventually(10, "the failed, cancelled run deletes the row", || async {
        f.rows("jobs").await.is_empty()
    })
    .await;
    w.shutdown().await;
    assert!(f
        .store
        .dead_letters(&DeadLetterFilter::new().queue("jobs"), None, 10)
        .await
        .unwrap()
        .is_empty());
    f.cleanup().await;
}

/// A completion that fails for good (here a trigger refuses the DELETE) leaves its row to
/// lease expiry; the worker, idle and with the default 30 s idle poll, looks again when that
/// lease has expired, not at the idle poll (found by a new-user trial).
#[tokio::test]
async fn a_failed_completion_is_retried_when_its_lease_expires() {
    let f = Fixture::new().await;
    let t = f.outbox.table();
    let fun = format!("nodelete_{}", t.trim_matches('"'));
    // The sequence counts refused deletes (nextval survives the rollback of the raise).
    let refused = format!("refused_{}", t.trim_matches('"'));
    sql(
        &f,
        format!(
            "CREATE SEQUENCE {refused}; \
             CREATE FUNCTION {fun}() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
               PERFORM nextval('{refused}'); RAISE EXCEPTION 'not now'; END $$; \
             CREATE TRIGGER nodelete BEFORE DELETE ON {t} FOR EACH ROW EXECUTE FUNCTION {fun}()"
        ),
    )
    .await;
    let runs = Runs::default();
    let lease_ttl = Duration::from_secs(1);
    let w = Worker::builder(f.store.clone())
        .lease_ttl(lease_ttl)
        .timer::<Job>(runs.job())
        .build()
        .unwrap()
        .start();
    publish_jobs(&f, &[1]).await;
    eventually(10, "the first run", || async { runs.sorted().len() == 1 }).await;
    // Its completion is written after the handler returned (pipelined): wait until the
    // trigger refused it twice — the batched delete, then the row alone — so the run's own
    // ack cannot land after the trigger is gone.
    let calls = format!("SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM {refused}");
    eventually(10, "the completion is refused", || async {
        sqlx::query_scalar::<_, i64>(AssertSqlSafe(calls.clone()))
            .fetch_one(&f.pool)
            .await
            .unwrap()
            >= 2
    })
    .await;
    sql(&f, format!("DROP TRIGGER nodelete ON {t}")).await;
    let t0 = std::time::Instant::now();
    eventually(10, "redelivered and completed", || async {
        f.rows("jobs").await.is_empty()
    })
    .await;
    assert!(t0.elapsed() < 3 * lease_ttl, "{:?}", t0.elapsed());
    assert_eq!(
        runs.sorted(),
        vec![1, 1],
        "run again after its lease expired"
    );
    w.shutdown().await;
    sql(
        &f,
        format!("DROP FUNCTION {fun}(); DROP SEQUENCE {refused}"),
    )
    .await;
    f.cleanup().await;
}

/// A typed payload whose JSON does not decode back into its type (a NaN float, which JSON
/// writes as `null`) is refused at publish with `Error::Encode`, before any SQL, instead of
/// failing as `decode_error` when it fires (found by a new-user trial).
#[tokio::test]
async fn a_payload_that_does_not_survive_json_is_refused_at_publish() {
    #[outbox::timer(queue = "floats", max_deliveries = 3)]
    #[derive(Debug, serde::Serialize, serde::Deserialize)]
    struct Floaty {
        score: f64,
    }
    let f = Fixture::new().await;
    let mut conn = f.pool.acquire().await.unwrap();
    for bad in [f64::NAN, f64::INFINITY] {
        let err = publish_floaty(
            f.outbox.on(&mut conn),
            "1",
            &Floaty { score: bad },
            Duration::ZERO,
        )
        .await
        .unwrap_err();
        assert!(matches!(err, Error::Encode(_)), "{err:?}");
    }
    assert!(f.rows("floats").await.is_empty(), "nothing was written");
    let ok = publish_floaty(
        f.outbox.on(&mut conn),
        "1",
        &Floaty { score: 0.5 },
        Duration::ZERO,
    )
    .await
    .unwrap();
    assert!(matches!(ok, outbox::Published::Inserted { .. }), "{ok:?}");
    f.cleanup().await;
}
