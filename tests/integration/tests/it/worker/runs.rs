//! The worker on real Postgres (SPEC §7): outcomes, retries, dead letters, rearm during a
//! run, redelivery after a lost lease, wake-ups, database failures, shutdown.

use sqlx::AssertSqlSafe;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox::dlq::DeadLetterFilter;
use outbox::{
    Context, Error, HandlerOptions, Message, Outcome, PgStore, Published, RetryStrategy, Worker,
};
use outbox_tests::{count_runs, eventually, Fixture};
use tokio::sync::Notify;

#[outbox::timer(queue = "presence.expiry", max_deliveries = 5)]
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct Expiry {
    user_id: i64,
    seq: u32,
}

#[outbox::timer(queue = "presence.expiry", max_deliveries = 3)]
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct SameQueue;

#[outbox::timer(queue = "jobs", max_deliveries = 3)]
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Job {
    n: u32,
}

fn fast(store: PgStore) -> outbox::WorkerBuilder<PgStore> {
    Worker::builder(store).idle_poll(Duration::from_millis(200))
}

async fn seed_job(f: &Fixture, n: u32) {
    let mut conn = f.pool.acquire().await.unwrap();
    outbox::message::publish_timer(
        &mut f.outbox.on(&mut conn),
        &format!("job-{n}"),
        &Job { n },
        Duration::ZERO,
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn build_rejects_bad_knobs_and_duplicate_queues() {
    let f = Fixture::new().await;
    let ok = |_: Expiry, _: Context| async { Ok::<(), String>(()) };
    let err = Worker::builder(f.store.clone())
        .timer::<Expiry>(ok)
        .concurrency(0)
        .build()
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidConfig {
                knob: "concurrency",
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("`concurrency`"), "{err}");
    let err = Worker::builder(f.store.clone())
        .timer::<Expiry>(ok)
        .lease_ttl(Duration::ZERO)
        .build()
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidConfig {
                knob: "lease_ttl",
                ..
            }
        ),
        "{err}"
    );
    let bad_retry =
        HandlerOptions::new().retry(RetryStrategy::exponential(Duration::from_secs(1), 0.5));
    let err = Worker::builder(f.store.clone())
        .timer_with::<Expiry>(ok, bad_retry)
        .build()
        .unwrap_err();
    assert!(
        matches!(err, Error::InvalidConfig { knob: "retry", .. }),
        "{err}"
    );
    let err = Worker::builder(f.store.clone()).build().unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidConfig {
                knob: "handlers",
                ..
            }
        ),
        "{err}"
    );
    let err = Worker::builder(f.store.clone())
        .timer::<Expiry>(ok)
        .timer::<SameQueue>(|_: SameQueue, _: Context| async {})
        .build()
        .unwrap_err();
    match &err {
        Error::DuplicateHandler {
            queue,
            first,
            second,
        } => {
            assert_eq!(queue, "presence.expiry");
            assert!(
                first.ends_with("Expiry") && second.ends_with("SameQueue"),
                "{err}"
            );
        }
        other => panic!("{other:?}"),
    }
    let raw = |_: Vec<u8>, _: Context| async {};
    let err = Worker::builder(f.store.clone())
        .timer::<Expiry>(ok)
        .queue("presence.expiry", raw)
        .build()
        .unwrap_err();
    assert!(matches!(err, Error::DuplicateHandler { .. }), "{err}");
    let err = Worker::builder(f.store.clone())
        .queue("", raw)
        .build()
        .unwrap_err();
    assert!(
        matches!(err, Error::InvalidArgument { field: "queue", .. }),
        "{err}"
    );
    f.cleanup().await;
}

/// The motivating case: a ping (extend) lands while the expiry handler runs; the timer
/// fires again for the newer deadline with the newer payload.
#[tokio::test]
async fn a_ping_during_a_running_expiry_makes_it_fire_again() {
    let f = Fixture::new().await;
    let runs: Arc<Mutex<Vec<Expiry>>> = Arc::default();
    let started = Arc::new(Notify::new());
    let release = Arc::new(Notify::new());
    let worker = {
        let (runs, started, release) = (runs.clone(), started.clone(), release.clone());
        fast(f.store.clone())
            .timer::<Expiry>(move |t: Expiry, _ctx: Context| {
                let (runs, started, release) = (runs.clone(), started.clone(), release.clone());
                async move {
                    let first = runs.lock().unwrap().is_empty();
                    runs.lock().unwrap().push(t);
                    if first {
                        started.notify_one();
                        release.notified().await;
                    }
                }
            })
            .build()
            .unwrap()
            .start()
    };
    let mut conn = f.pool.acquire().await.unwrap();
    let p = extend_expiry(
        &mut f.outbox.on(&mut conn),
        "7",
        &Expiry { user_id: 7, seq: 1 },
        Duration::ZERO,
    )
    .await
    .unwrap();
    assert!(matches!(p, Published::Inserted { .. }));
    started.notified().await;
    // The ping, while the handler runs.
    let p = extend_expiry(
        &mut f.outbox.on(&mut conn),
        "7",
        &Expiry { user_id: 7, seq: 2 },
        Duration::from_millis(500),
    )
    .await
    .unwrap();
    assert!(matches!(p, Published::RearmQueued { .. }), "{p:?}");
    release.notify_one();
    eventually(10, "the rearmed timer fires", || async {
        runs.lock().unwrap().len() == 2
    })
    .await;
    assert_eq!(runs.lock().unwrap()[1], Expiry { user_id: 7, seq: 2 });
    eventually(5, "the row is gone", || async {
        f.rows("presence.expiry").await.is_empty()
    })
    .await;
    assert!(worker.shutdown().await.graceful);
    assert_eq!(runs.lock().unwrap().len(), 2);
    f.cleanup().await;
}

#[tokio::test]
async fn a_handler_that_extends_itself_three_times_runs_four_times() {
    let f = Fixture::new().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let worker = {
        let (runs, pool, outbox) = (runs.clone(), f.pool.clone(), f.outbox.clone());
        fast(f.store.clone())
            .timer::<Expiry>(move |t: Expiry, ctx: Context| {
                let (runs, pool, outbox) = (runs.clone(), pool.clone(), outbox.clone());
                async move {
                    let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
                    assert_eq!(ctx.timer_id(), Some("me"));
                    if n <= 3 {
                        let mut conn = pool.acquire().await?;
                        let next = Expiry {
                            seq: t.seq + 1,
                            ..t
                        };
                        extend_expiry(
                            &mut outbox.on(&mut conn),
                            "me",
                            &next,
                            Duration::from_millis(100),
                        )
                        .await?;
                    }
                    Ok::<(), Error>(())
                }
            })
            .build()
            .unwrap()
            .start()
    };
    let mut conn = f.pool.acquire().await.unwrap();
    publish_expiry(
        &mut f.outbox.on(&mut conn),
        "me",
        &Expiry { user_id: 1, seq: 0 },
        Duration::ZERO,
    )
    .await
    .unwrap();
    eventually(10, "four runs", || async {
        runs.load(Ordering::SeqCst) >= 4
    })
    .await;
    eventually(5, "the row is gone", || async {
        f.rows("presence.expiry").await.is_empty()
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(runs.load(Ordering::SeqCst), 4, "exactly four runs");
    worker.shutdown().await;
    f.cleanup().await;
}

/// A slow handler loses its lease; a second worker gets the row; the slow worker's
/// completion is reported as lease_lost and changes nothing.
/// SPEC §5.1, §7.8: when the lease of a running handler is lost (here: taken by SQL, as
/// another worker's claim would), the handler learns it through its context at the next
/// renewal, and its completion writes nothing.
#[tokio::test]
async fn a_lost_lease_reaches_the_handler_and_its_completion_changes_nothing() {
    let f = Fixture::new().await;
    let seen: Arc<Mutex<Vec<outbox::worker::CancelReason>>> = Arc::default();
    let started = Arc::new(Notify::new());
    let w = {
        let (seen, started) = (seen.clone(), started.clone());
        fast(f.store.clone())
            .lease_ttl(Duration::from_millis(300))
            .timer::<Job>(move |_: Job, ctx: Context| {
                let (seen, started) = (seen.clone(), started.clone());
                async move {
                    started.notify_one();
                    let why = ctx.cancelled().await;
                    seen.lock().unwrap().push(why);
                    assert_eq!(ctx.cancel_reason(), Some(why));
                    Ok::<(), String>(())
                }
            })
            .build()
            .unwrap()
            .start()
    };
    seed_job(&f, 1).await;
    started.notified().await;
    // Another claimer takes the row: a new token.
    let stolen = format!(
        "UPDATE {} SET acquired_token = $1, acquired_at = now() RETURNING acquired_token",
        f.outbox.table()
    );
    // The token as a parameter: Citus refuses a VOLATILE function in an UPDATE.
    let token: uuid::Uuid = sqlx::query_scalar(AssertSqlSafe(stolen))
        .bind(uuid::Uuid::new_v4())
        .fetch_one(&f.pool)
        .await
        .unwrap();
    // Renewal runs every lease_ttl / 3 = 100 ms: bound by 3 × lease_ttl.
    eventually(1, "the handler hears of the lost lease", || async {
        !seen.lock().unwrap().is_empty()
    })
    .await;
    assert_eq!(
        *seen.lock().unwrap(),
        vec![outbox::worker::CancelReason::LeaseLost]
    );
    w.shutdown().await;
    let rows = f.rows("jobs").await;
    assert_eq!(rows.len(), 1, "the stale success deleted nothing");
    assert_eq!(
        rows[0].acquired_token,
        Some(token),
        "the new lease is untouched"
    );
    f.cleanup().await;
}

/// SPEC §7.8, the reported cases: a handler that runs longer than `lease_ttl` runs once and
/// completes, with one worker, with two workers on the queue, and with the dead-letter
/// queue on and a lease shorter than the run (today: redelivered until `max_deliveries`).
#[tokio::test]
async fn a_handler_longer_than_its_lease_runs_once() {
    for (workers, ttl_ms, run_ms) in [(1, 1000, 1500), (2, 1000, 1500), (1, 300, 450)] {
        let f = Fixture::new().await;
        let runs = Arc::new(AtomicUsize::new(0));
        let overlapping = Arc::new(AtomicUsize::new(0));
        let running = Arc::new(AtomicUsize::new(0));
        let mut started = Vec::new();
        for _ in 0..workers {
            let (runs, running, overlapping) = (runs.clone(), running.clone(), overlapping.clone());
            started.push(
                fast(f.store.clone())
                    .lease_ttl(Duration::from_millis(ttl_ms))
                    .timer::<Job>(move |_: Job, _: Context| {
                        let (runs, running, overlapping) =
                            (runs.clone(), running.clone(), overlapping.clone());
                        async move {
                            runs.fetch_add(1, Ordering::SeqCst);
                            if running.fetch_add(1, Ordering::SeqCst) > 0 {
                                overlapping.fetch_add(1, Ordering::SeqCst);
                            }
                            tokio::time::sleep(Duration::from_millis(run_ms)).await;
                            running.fetch_sub(1, Ordering::SeqCst);
                        }
                    })
                    .build()
                    .unwrap()
                    .start(),
            );
        }
        seed_job(&f, 1).await;
        eventually(10, "the row completes", || async {
            f.rows("jobs").await.is_empty()
        })
        .await;
        // Three more lease periods: a redelivery would have happened by now.
        tokio::time::sleep(Duration::from_millis(3 * ttl_ms)).await;
        for w in started {
            w.shutdown().await;
        }
        let label = format!("{workers} worker(s), lease {ttl_ms} ms, run {run_ms} ms");
        assert_eq!(runs.load(Ordering::SeqCst), 1, "{label}");
        assert_eq!(overlapping.load(Ordering::SeqCst), 0, "{label}");
        let dead: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM {}",
            f.outbox.dead_letter_table()
        )))
        .fetch_one(&f.pool)
        .await
        .unwrap();
        assert_eq!(dead, 0, "{label}: nothing dead-lettered");
        f.cleanup().await;
    }
}

#[tokio::test]
async fn two_workers_never_run_one_row_at_once() {
    let f = Fixture::new().await;
    let running: Arc<Mutex<HashMap<u32, bool>>> = Arc::default();
    let runs: Arc<Mutex<Vec<u32>>> = Arc::default();
    let overlap = Arc::new(AtomicUsize::new(0));
    let make = || {
        let (running, runs, overlap) = (running.clone(), runs.clone(), overlap.clone());
        fast(f.store.clone())
            .concurrency(4)
            .fetch_batch_size(8)
            .timer::<Job>(move |j: Job, _: Context| {
                let (running, runs, overlap) = (running.clone(), runs.clone(), overlap.clone());
                async move {
                    if running.lock().unwrap().insert(j.n, true) == Some(true) {
                        overlap.fetch_add(1, Ordering::SeqCst);
                    }
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    running.lock().unwrap().insert(j.n, false);
                    runs.lock().unwrap().push(j.n);
                }
            })
            .build()
            .unwrap()
            .start()
    };
    let (a, b) = (make(), make());
    let mut conn = f.pool.acquire().await.unwrap();
    let payloads: Vec<Vec<u8>> = (0..300)
        .map(|n| serde_json::to_vec(&Job { n }).unwrap())
        .collect();
    let items: Vec<_> = payloads
        .iter()
        .map(|p| outbox::message::BatchItem::new(p))
        .collect();
    f.outbox
        .publish_batch(&mut conn, "jobs", &items, Duration::ZERO)
        .await
        .unwrap();
    eventually(30, "all 300 handled", || async {
        runs.lock().unwrap().len() >= 300
    })
    .await;
    a.shutdown().await;
    b.shutdown().await;
    let mut seen = runs.lock().unwrap().clone();
    seen.sort_unstable();
    assert_eq!(seen, (0..300).collect::<Vec<_>>(), "each row exactly once");
    assert_eq!(overlap.load(Ordering::SeqCst), 0);
    assert!(f.rows("jobs").await.is_empty());
    f.cleanup().await;
}

#[tokio::test]
async fn outcomes_retries_dead_letters_panics_and_decode_errors() {
    let f = Fixture::new().await;
    let calls: Arc<Mutex<HashMap<u32, u32>>> = Arc::default();
    let worker = {
        let calls = calls.clone();
        fast(f.store.clone())
            .concurrency(2)
            .timer_with::<Job>(
                move |j: Job, ctx: Context| {
                    let calls = calls.clone();
                    async move {
                        let n = {
                            let mut c = calls.lock().unwrap();
                            let e = c.entry(j.n).or_default();
                            *e += 1;
                            *e
                        };
                        assert_eq!(ctx.attempt(), n, "attempt = failed runs before + 1");
                        match j.n {
                            // Fails twice, then succeeds.
                            1 if n < 3 => Err(format!("transient {n}")),
                            1 => Ok(Outcome::Ack),
                            // Rejected at once.
                            2 => Ok(Outcome::Reject("bad order".into())),
                            // Panics on the first run, succeeds after.
                            3 if n == 1 => panic!("handler bug"),
                            3 => Ok(Outcome::Ack),
                            // Always fails: exhausted after max_attempts = 3.
                            4 => Err("always".to_owned()),
                            _ => Ok(Outcome::Ack),
                        }
                    }
                },
                HandlerOptions::new()
                    .retry(RetryStrategy::constant(Duration::from_millis(50)).max_attempts(3)),
            )
            .build()
            .unwrap()
            .start()
    };
    for n in 1..=4 {
        seed_job(&f, n).await;
    }
    // A payload that does not decode as Job: terminal at once, original bytes archived.
    let mut conn = f.pool.acquire().await.unwrap();
    f.outbox
        .publish(&mut conn, Message::new("jobs", b"{not json"))
        .await
        .unwrap();
    eventually(15, "every row finished", || async {
        f.rows("jobs").await.is_empty()
    })
    .await;
    worker.shutdown().await;
    let c = calls.lock().unwrap().clone();
    assert_eq!((c[&1], c[&2], c[&3], c[&4]), (3, 1, 2, 3), "{c:?}");
    let dlq = f
        .store
        .dead_letters(&DeadLetterFilter::new().queue("jobs"), None, 10)
        .await
        .unwrap();
    let by_reason: HashMap<&str, &outbox::store::DeadLetter> =
        dlq.iter().map(|d| (d.failure_reason.as_str(), d)).collect();
    assert_eq!(dlq.len(), 3, "{dlq:#?}");
    let rejected = by_reason["rejected"];
    assert_eq!(
        (rejected.last_error.as_deref(), rejected.attempts_count),
        (Some("bad order"), 1)
    );
    let exhausted = by_reason["retry_exhausted"];
    assert_eq!(
        (
            exhausted.last_error.as_deref(),
            exhausted.attempts_count,
            exhausted.deliveries_count
        ),
        (Some("always"), 3, 3)
    );
    let decode = by_reason["decode_error"];
    assert_eq!(
        (decode.payload.as_slice(), decode.attempts_count),
        (&b"{not json"[..], 0)
    );
    assert!(
        decode
            .last_error
            .as_deref()
            .unwrap_or("")
            .contains("key must be a string"),
        "{decode:?}"
    );
    f.cleanup().await;
}

#[tokio::test]
async fn max_deliveries_is_enforced_before_the_handler_runs() {
    let f = Fixture::new().await;
    let runs = Arc::new(AtomicUsize::new(0));
    seed_job(&f, 9).await;
    // Three claims already happened (Job::MAX_DELIVERIES = 3): the fourth is terminal.
    sqlx::query(AssertSqlSafe(format!(
        "UPDATE {} SET deliveries_count = 3",
        f.outbox.table()
    )))
    .execute(&f.pool)
    .await
    .unwrap();
    let worker = fast(f.store.clone())
        .timer::<Job>(count_runs::<Job>(&runs))
        .build()
        .unwrap()
        .start();
    eventually(10, "the row is gone", || async {
        f.rows("jobs").await.is_empty()
    })
    .await;
    worker.shutdown().await;
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    let dlq = f
        .store
        .dead_letters(&DeadLetterFilter::new().queue("jobs"), None, 10)
        .await
        .unwrap();
    assert_eq!(
        (dlq[0].failure_reason.as_str(), dlq[0].deliveries_count),
        ("max_deliveries", 4)
    );
    f.cleanup().await;
}

#[tokio::test]
async fn batched_acks_flush_when_idle_and_on_shutdown() {
    let f = Fixture::new().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let worker = fast(f.store.clone())
        .concurrency(2)
        .fetch_batch_size(20)
        .ack_batch_size(16)
        .timer::<Job>(count_runs::<Job>(&runs))
        .build()
        .unwrap()
        .start();
    for n in 0..50 {
        seed_job(&f, n).await;
    }
    eventually(10, "all rows deleted by batched acks", || async {
        f.rows("jobs").await.is_empty()
    })
    .await;
    assert_eq!(runs.load(Ordering::SeqCst), 50);
    // One more, then shut down at once: the pending ack is flushed, not lost.
    seed_job(&f, 99).await;
    eventually(10, "the last one ran", || async {
        runs.load(Ordering::SeqCst) == 51
    })
    .await;
    let report = worker.shutdown().await;
    assert!(report.graceful);
    assert!(f.rows("jobs").await.is_empty());
    f.cleanup().await;
}

#[tokio::test]
async fn shutdown_waits_for_running_handlers_and_abandons_wedged_ones() {
    let f = Fixture::new().await;
    let finished = Arc::new(AtomicUsize::new(0));
    let started = Arc::new(AtomicUsize::new(0));
    let make = |sleep: Duration, timeout: Duration| {
        let (finished, started) = (finished.clone(), started.clone());
        fast(f.store.clone())
            .graceful_timeout(timeout)
            .lease_ttl(Duration::from_secs(1))
            .timer::<Job>(move |_: Job, _: Context| {
                let (finished, started) = (finished.clone(), started.clone());
                async move {
                    started.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(sleep).await;
                    finished.fetch_add(1, Ordering::SeqCst);
                }
            })
            .build()
            .unwrap()
            .start()
    };
    // In flight at shutdown, finishes within the timeout: completed and acked.
    let w = make(Duration::from_millis(300), Duration::from_secs(5));
    seed_job(&f, 1).await;
    eventually(10, "started", || async {
        started.load(Ordering::SeqCst) == 1
    })
    .await;
    let report = w.shutdown().await;
    assert!(report.graceful, "{report:?}");
    assert_eq!(
        (report.abandoned, report.retried, report.unreleased),
        (0, 0, 0),
        "{report:?}"
    );
    assert_eq!(finished.load(Ordering::SeqCst), 1);
    assert!(f.rows("jobs").await.is_empty());

    // Wedged: shutdown returns after the timeout; the run is stopped and its row given back
    // as a failed attempt, due now (SPEC §7.5).
    let w = make(Duration::from_secs(3600), Duration::from_millis(300));
    seed_job(&f, 2).await;
    eventually(10, "started", || async {
        started.load(Ordering::SeqCst) == 2
    })
    .await;
    let t0 = std::time::Instant::now();
    let report = w.shutdown().await;
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "shutdown is not held by a wedged handler"
    );
    assert!(!report.graceful, "{report:?}");
    assert_eq!(
        (report.abandoned, report.retried, report.unreleased),
        (1, 1, 0),
        "{report:?}"
    );
    let rows = f.rows("jobs").await;
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].acquired_token, None, "given back, not left leased");
    assert_eq!(
        rows[0].attempts_count, 1,
        "the stopped run counts as an attempt"
    );
    // A new worker picks it up at once.
    let w = make(Duration::ZERO, Duration::from_secs(5));
    eventually(10, "redelivered and finished", || async {
        f.rows("jobs").await.is_empty()
    })
    .await;
    w.shutdown().await;
    f.cleanup().await;
}

/// SPEC §3: a cancel while the handler runs sticks. The run then fails with a retry
/// (30 s later), with and without a rearm queued before the cancel: the row is gone at
/// once, nothing fires again, nothing is archived.
#[tokio::test]
async fn a_cancel_during_a_failing_run_sticks() {
    let f = Fixture::new().await;
    let started = Arc::new(Notify::new());
    let release = Arc::new(Notify::new());
    let runs = Arc::new(AtomicUsize::new(0));
    let worker = {
        let (started, release, runs) = (started.clone(), release.clone(), runs.clone());
        fast(f.store.clone())
            .timer_with::<Expiry>(
                move |_: Expiry, _: Context| {
                    let (started, release, runs) = (started.clone(), release.clone(), runs.clone());
                    async move {
                        runs.fetch_add(1, Ordering::SeqCst);
                        started.notify_one();
                        release.notified().await;
                        Err::<(), _>("the run fails after the cancel")
                    }
                },
                HandlerOptions::new().retry(RetryStrategy::constant(Duration::from_secs(30))),
            )
            .build()
            .unwrap()
            .start()
    };
    for (key, rearm_first) in [("plain", false), ("rearmed", true)] {
        let mut conn = f.pool.acquire().await.unwrap();
        let payload = Expiry { user_id: 1, seq: 0 };
        extend_expiry(f.outbox.on(&mut conn), key, &payload, Duration::ZERO)
            .await
            .unwrap();
        started.notified().await;
        if rearm_first {
            let later = Expiry { user_id: 1, seq: 1 };
            let queued =
                extend_expiry(f.outbox.on(&mut conn), key, &later, Duration::from_secs(60))
                    .await
                    .unwrap();
            assert!(
                matches!(queued, Published::RearmQueued { .. }),
                "{queued:?}"
            );
        }
        let cancelled = cancel_expiry(f.outbox.on(&mut conn), key).await.unwrap();
        let want_rearm_dropped = rearm_first;
        assert_eq!(
            matches!(cancelled, outbox::Cancelled::RearmDropped { .. }),
            want_rearm_dropped,
            "{key}: {cancelled:?}"
        );
        release.notify_one();
        eventually(
            10,
            &format!("{key}: the cancelled row is deleted"),
            || async { f.rows("presence.expiry").await.is_empty() },
        )
        .await;
    }
    worker.shutdown().await;
    assert_eq!(runs.load(Ordering::SeqCst), 2, "one run per timer");
    let mut conn = f.pool.acquire().await.unwrap();
    let dead: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM {}",
        f.outbox.dead_letter_table()
    )))
    .fetch_one(&mut *conn)
    .await
    .unwrap();
    assert_eq!(dead, 0, "a cancelled run is never archived");
    f.cleanup().await;
}
