//! The virtual-time harness (SPEC §10): `Worker::run_due` over `MemoryStore`, no database,
//! and the same call draining a Postgres store; periodic timers (SPEC §9.1) registered by
//! `run_due`'s first call, as a started worker registers them at start.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use outbox::periodic::Recurrence;
use outbox::testing::MemoryStore;
use outbox::{
    store::{Completion, FailureReason, SCHEDULE_HEADER},
    worker::Decision,
    Context, HandlerOptions, Message, Publisher, RetryStrategy, Worker,
};
use outbox_tests::{count_runs, Fixture};

#[outbox::timer(queue = "reminders", max_deliveries = 3)]
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct Reminder {
    n: u32,
}

#[tokio::test]
async fn run_due_runs_exactly_what_is_due_at_the_virtual_time() {
    let store = MemoryStore::new().with_dead_letter(true);
    let runs = Arc::new(AtomicUsize::new(0));
    let worker = {
        let (runs, store) = (runs.clone(), store.clone());
        Worker::builder(store.clone())
            .timer_with::<Reminder>(
                move |r: Reminder, ctx: Context| {
                    let (runs, store) = (runs.clone(), store.clone());
                    async move {
                        runs.fetch_add(1, Ordering::SeqCst);
                        match r.n {
                            // Extends itself once, by 10 s, on its first run.
                            0 => {
                                let next = Reminder { n: 100 };
                                extend_reminder(&store, "self", &next, Duration::from_secs(10))
                                    .await?;
                                Ok(())
                            }
                            // Fails twice with a zero-delay retry, then succeeds.
                            1 if ctx.attempt() < 3 => Err(outbox::Error::InvalidArgument {
                                field: "n",
                                reason: "flaky".into(),
                            }),
                            _ => Ok(()),
                        }
                    }
                },
                HandlerOptions::new().retry(RetryStrategy::constant(Duration::ZERO)),
            )
            .build()
            .unwrap()
    };
    publish_reminder(&store, "self", &Reminder { n: 0 }, Duration::from_secs(5))
        .await
        .unwrap();
    publish_reminder(&store, "flaky", &Reminder { n: 1 }, Duration::from_secs(5))
        .await
        .unwrap();
    store
        .publish_message(Message::new("reminders", b"not json").schedule(Duration::from_secs(5)))
        .await
        .unwrap();

    assert!(
        worker.run_due().await.unwrap().is_empty(),
        "nothing is due before 5 s"
    );
    store.advance(Duration::from_secs(5));
    let ran = worker.run_due().await.unwrap();
    // "self" once (rearmed, pending at +10 s), "flaky" three times (zero-delay retries run
    // in the same call), the undecodable row once (dead-lettered, handler not run).
    let decisions: Vec<(Option<&str>, &Decision)> = ran
        .iter()
        .map(|r| (r.delivery.timer_id.as_deref(), &r.decision))
        .collect();
    assert_eq!(ran.len(), 5, "{decisions:#?}");
    assert_eq!(runs.load(Ordering::SeqCst), 4);
    let selfie = ran
        .iter()
        .find(|r| r.delivery.timer_id.as_deref() == Some("self"))
        .unwrap();
    assert!(
        matches!(selfie.completion, Completion::Rearmed { .. }),
        "{selfie:?}"
    );
    assert!(ran.iter().any(|r| matches!(
        &r.decision,
        Decision::Fail {
            reason: FailureReason::DecodeError,
            ..
        }
    )));
    assert_eq!(store.rows().len(), 1, "only the rearmed timer is left");
    assert_eq!(store.dead_letter_rows().len(), 1);

    assert!(
        worker.run_due().await.unwrap().is_empty(),
        "not due again before its new deadline"
    );
    store.advance(Duration::from_secs(10));
    let ran = worker.run_due().await.unwrap();
    assert_eq!(ran.len(), 1);
    assert_eq!(ran[0].completion, Completion::Deleted);
    assert!(store.rows().is_empty());
}

#[tokio::test]
async fn run_due_drains_a_postgres_store() {
    let f = Fixture::new().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let worker = Worker::builder(f.store.clone())
        .fetch_batch_size(7)
        .timer::<Reminder>(count_runs::<Reminder>(&runs))
        .build()
        .unwrap();
    let mut conn = f.pool.acquire().await.unwrap();
    for n in 0..20 {
        publish_reminder(
            &mut f.outbox.on(&mut conn),
            &n.to_string(),
            &Reminder { n },
            Duration::ZERO,
        )
        .await
        .unwrap();
    }
    publish_reminder(
        &mut f.outbox.on(&mut conn),
        "later",
        &Reminder { n: 99 },
        Duration::from_secs(3600),
    )
    .await
    .unwrap();
    let ran = worker.run_due().await.unwrap();
    assert_eq!(ran.len(), 20);
    assert!(ran.iter().all(|r| r.completion == Completion::Deleted));
    assert_eq!(runs.load(Ordering::SeqCst), 20);
    assert_eq!(f.rows("reminders").await.len(), 1, "the future timer stays");
    f.cleanup().await;
}

/// SPEC §7.9 on the in-memory store: a handler that asks for its own transaction gets a
/// typed refusal (the store has no database to run its SQL), never a pretend success; the
/// run fails like any handler error, and the harness reports it.
#[tokio::test]
async fn a_transaction_on_the_memory_store_is_refused_with_a_typed_error() {
    let store = MemoryStore::new().with_dead_letter(true);
    let refusals = Arc::new(Mutex::new(Vec::new()));
    let worker = {
        let refusals = refusals.clone();
        Worker::builder(store.clone())
            .timer_with::<Reminder>(
                move |_: Reminder, ctx: Context| {
                    let refusals = refusals.clone();
                    async move {
                        let err = ctx.begin().await.unwrap_err();
                        refusals.lock().unwrap().push(err.to_string());
                        assert!(
                            matches!(err, outbox::Error::TransactionUnavailable { .. }),
                            "{err:?}"
                        );
                        Err::<(), _>(err)
                    }
                },
                HandlerOptions::new().retry(RetryStrategy::none()),
            )
            .build()
            .unwrap()
    };
    publish_reminder(&store, "r", &Reminder { n: 1 }, Duration::ZERO)
        .await
        .unwrap();
    let ran = worker.run_due().await.unwrap();
    assert_eq!(ran.len(), 1);
    assert!(
        matches!(
            &ran[0].decision,
            Decision::Fail { reason: FailureReason::RetryExhausted, error: Some(e) }
                if e.contains("no handler transaction")
        ),
        "{:?}",
        ran[0].decision
    );
    assert_eq!(refusals.lock().unwrap().len(), 1);
    assert!(refusals.lock().unwrap()[0].contains("in-memory store"));
}

/// The deadlines of the runs of `worker` over one virtual day from the store's clock, in
/// steps of one minute, each step's `run_due` returning what ran.
async fn a_day_in_minutes<S: outbox::store::Store>(
    store: &MemoryStore,
    worker: &Worker<S>,
) -> Vec<DateTime<Utc>> {
    let mut deadlines = Vec::new();
    for _ in 0..24 * 60 {
        store.advance(Duration::from_secs(60));
        for run in worker.run_due().await.unwrap() {
            assert_eq!(run.decision, Decision::Ack, "{run:?}");
            deadlines.push(run.delivery.deadline);
        }
    }
    deadlines
}

fn start() -> DateTime<Utc> {
    "2026-03-01T00:00:00Z".parse().unwrap()
}

/// No `register_schedules` call: the first `run_due` registers the schedule at the virtual
/// clock of that call, and a day of a 5-minute schedule fires 288 times, once per instant,
/// on that grid. Registration happens once per worker (as once per start): after a cancel
/// the same worker's `run_due` does not bring the schedule back; a new worker (the next
/// start) does, on its first call.
#[tokio::test]
async fn run_due_registers_the_schedules_on_its_first_call() {
    let store = MemoryStore::starting_at(start());
    let runs = Arc::new(AtomicUsize::new(0));
    let worker = |store: &MemoryStore| {
        Worker::builder(store.clone())
            .timer::<Reminder>(count_runs::<Reminder>(&runs))
            .schedule(
                "tick",
                Recurrence::parse_every("5m").unwrap(),
                Reminder { n: 5 },
            )
            .build()
            .unwrap()
    };
    let first = worker(&store);
    assert!(store.rows().is_empty(), "building registers nothing");
    assert!(first.run_due().await.unwrap().is_empty());
    let rows = store.rows();
    assert_eq!(rows.len(), 1, "{rows:#?}");
    assert_eq!(rows[0].timer_id.as_deref(), Some("schedule:tick"));
    assert_eq!(rows[0].next_attempt_at, start() + TimeDelta::minutes(5));

    let deadlines = a_day_in_minutes(&store, &first).await;
    let want: Vec<_> = (1..=288)
        .map(|k| start() + TimeDelta::minutes(5 * k))
        .collect();
    assert_eq!(deadlines, want);
    assert_eq!(runs.load(Ordering::SeqCst), 288);
    assert_eq!(store.rows().len(), 1, "one live row");

    // A cancel stops the schedule for this worker: its later calls do not register again.
    let cancelled = cancel_reminder(&store, "schedule:tick").await.unwrap();
    assert!(
        matches!(cancelled, outbox::Cancelled::Deleted { .. }),
        "{cancelled:?}"
    );
    store.advance(Duration::from_secs(3600));
    assert!(first.run_due().await.unwrap().is_empty());
    assert!(store.rows().is_empty(), "{:#?}", store.rows());

    // The next start registers it again, first due 5 minutes after that call.
    let second = worker(&store);
    assert!(second.run_due().await.unwrap().is_empty());
    let rows = store.rows();
    assert_eq!(rows.len(), 1, "{rows:#?}");
    assert_eq!(
        rows[0].next_attempt_at,
        store.time() + TimeDelta::minutes(5)
    );
    store.advance(Duration::from_secs(5 * 60));
    assert_eq!(second.run_due().await.unwrap().len(), 1);
}

/// A registration that fails is `run_due`'s error, and the next call tries again: here the
/// clock sits where the schedule has no next instant in chrono's range, then comes back.
#[tokio::test]
async fn a_failed_registration_is_returned_and_retried_by_the_next_run_due() {
    let store = MemoryStore::starting_at(DateTime::<Utc>::MAX_UTC - TimeDelta::minutes(1));
    let worker = Worker::builder(store.clone())
        .timer::<Reminder>(|_: Reminder, _: Context| std::future::ready(()))
        .schedule(
            "tick",
            Recurrence::parse_every("5m").unwrap(),
            Reminder { n: 5 },
        )
        .build()
        .unwrap();
    let err = worker.run_due().await.unwrap_err();
    assert!(
        matches!(
            err,
            outbox::Error::InvalidArgument {
                field: "schedule",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(store.rows().is_empty());
    store.set_time(start());
    assert!(worker.run_due().await.unwrap().is_empty());
    let rows = store.rows();
    assert_eq!(rows.len(), 1, "{rows:#?}");
    assert_eq!(rows[0].next_attempt_at, start() + TimeDelta::minutes(5));
}

/// A schedule declared on the type (`every = "1h"`), no `.schedule` call: handling the type
/// is enough. Over a virtual day it fires 24 times with the type's `Default` payload, as
/// the timer `schedule:default` carrying the fingerprint `every:3600s`.
#[outbox::timer(queue = "hourly", max_deliveries = 3, every = "1h")]
#[derive(Debug, Clone, PartialEq, Default, serde::Serialize, serde::Deserialize)]
struct Hourly {
    note: String,
}

#[tokio::test]
async fn a_schedule_declared_on_the_type_fires_hourly_without_schedule_calls() {
    let store = MemoryStore::starting_at(start());
    let seen: Arc<Mutex<Vec<Hourly>>> = Arc::default();
    let worker = {
        let seen = seen.clone();
        Worker::builder(store.clone())
            .timer::<Hourly>(move |h: Hourly, _: Context| {
                seen.lock().unwrap().push(h);
                std::future::ready(())
            })
            .build()
            .unwrap()
    };
    assert!(worker.run_due().await.unwrap().is_empty());
    let deadlines = a_day_in_minutes(&store, &worker).await;
    let want: Vec<_> = (1..=24).map(|k| start() + TimeDelta::hours(k)).collect();
    assert_eq!(deadlines, want);
    assert_eq!(*seen.lock().unwrap(), vec![Hourly::default(); 24]);
    let rows = store.rows();
    assert_eq!(rows.len(), 1, "{rows:#?}");
    assert_eq!(rows[0].timer_id.as_deref(), Some("schedule:default"));
    assert_eq!(
        rows[0]
            .headers
            .as_ref()
            .and_then(|h| h.get(SCHEDULE_HEADER)),
        Some(&"every:3600s".to_owned())
    );
    assert_eq!(rows[0].next_attempt_at, start() + TimeDelta::hours(25));
}

/// A schedule whose handler fails at every instant keeps its grid: a failed run's retry
/// yields to the next instant (no run between instants), the failures count on across
/// instants until a success, and with `max_deliveries = 3` the fourth consecutive failing
/// instant is not run: it ends as a `max_deliveries` terminal failure (dead-lettered here),
/// and the schedule goes on from the next instant with fresh counts.
#[tokio::test]
async fn a_failing_schedule_keeps_its_grid_and_ends_every_fourth_run_as_terminal() {
    let store = MemoryStore::starting_at(start()).with_dead_letter(true);
    let runs = Arc::new(AtomicUsize::new(0));
    let worker = {
        let runs = runs.clone();
        Worker::builder(store.clone())
            .timer::<Reminder>(move |_: Reminder, _: Context| {
                runs.fetch_add(1, Ordering::SeqCst);
                std::future::ready(Err::<(), _>("boom".to_owned()))
            })
            .schedule(
                "tick",
                Recurrence::parse_every("5m").unwrap(),
                Reminder { n: 5 },
            )
            .build()
            .unwrap()
    };
    assert!(worker.run_due().await.unwrap().is_empty());
    let mut ran = Vec::new();
    for _ in 0..60 {
        store.advance(Duration::from_secs(60));
        ran.extend(worker.run_due().await.unwrap());
    }
    let deadlines: Vec<_> = ran.iter().map(|r| r.delivery.deadline).collect();
    let want: Vec<_> = (1..=12)
        .map(|k| start() + TimeDelta::minutes(5 * k))
        .collect();
    assert_eq!(deadlines, want, "one delivery per instant, none between");
    for (k, r) in ran.iter().enumerate() {
        let next = start() + TimeDelta::minutes(5 * (k as i64 + 2));
        assert_eq!(r.completion, Completion::Rearmed { at: next }, "{r:?}");
        assert_eq!(r.delivery.deliveries_count, (k % 4) as i32 + 1, "{r:?}");
        if k % 4 == 3 {
            assert!(
                matches!(
                    r.decision,
                    Decision::Fail {
                        reason: FailureReason::MaxDeliveries,
                        ..
                    }
                ),
                "{r:?}"
            );
        } else {
            assert!(matches!(r.decision, Decision::Retry { .. }), "{r:?}");
        }
    }
    assert_eq!(
        runs.load(Ordering::SeqCst),
        9,
        "the handler ran 3 of every 4"
    );
    let dead = store.dead_letter_rows();
    assert_eq!(dead.len(), 3, "{dead:#?}");
    assert!(dead.iter().all(|d| d.failure_reason == "max_deliveries"));
    let rows = store.rows();
    assert_eq!(rows.len(), 1, "{rows:#?}");
    assert_eq!(rows[0].next_attempt_at, start() + TimeDelta::minutes(65));
}

/// A worker that handles the type without the schedule (an older version during a deploy,
/// another program, or the schedule removed from the code): the row's stored recurrence
/// keeps the schedule going on its grid, with its stored payload; a cancel then stops it
/// for good, since no worker registers it again.
#[tokio::test]
async fn a_worker_without_the_schedule_keeps_it_until_a_cancel() {
    let store = MemoryStore::starting_at(start());
    type Seen = Arc<Mutex<Vec<(DateTime<Utc>, Reminder)>>>;
    let seen: Seen = Arc::default();
    let recorder = || {
        let seen = seen.clone();
        move |r: Reminder, ctx: Context| {
            seen.lock().unwrap().push((ctx.deadline(), r));
            std::future::ready(())
        }
    };
    let old = Worker::builder(store.clone())
        .timer::<Reminder>(recorder())
        .schedule(
            "tick",
            Recurrence::parse_every("5m").unwrap(),
            Reminder { n: 5 },
        )
        .build()
        .unwrap();
    assert!(old.run_due().await.unwrap().is_empty());
    store.advance(Duration::from_secs(5 * 60));
    assert_eq!(old.run_due().await.unwrap().len(), 1);

    let new = Worker::builder(store.clone())
        .timer::<Reminder>(recorder())
        .build()
        .unwrap();
    assert!(new.run_due().await.unwrap().is_empty());
    for _ in 0..3 {
        store.advance(Duration::from_secs(5 * 60));
        let ran = new.run_due().await.unwrap();
        assert_eq!(ran.len(), 1);
        assert!(
            matches!(ran[0].completion, Completion::Rearmed { .. }),
            "{ran:?}"
        );
    }
    let want: Vec<_> = (1..=4)
        .map(|k| (start() + TimeDelta::minutes(5 * k), Reminder { n: 5 }))
        .collect();
    assert_eq!(*seen.lock().unwrap(), want);

    let cancelled = cancel_reminder(&store, "schedule:tick").await.unwrap();
    assert!(
        matches!(cancelled, outbox::Cancelled::Deleted { .. }),
        "{cancelled:?}"
    );
    store.advance(Duration::from_secs(3600));
    assert!(new.run_due().await.unwrap().is_empty());
    assert!(store.rows().is_empty());
    assert_eq!(seen.lock().unwrap().len(), 4);
}
