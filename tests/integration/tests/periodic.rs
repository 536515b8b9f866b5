//! Periodic timers on Postgres (SPEC §9.1, issue 17): registrations of one schedule racing
//! each other leave exactly one live row; workers with `WorkerBuilder::schedule` fire each
//! instant once, a cancel stops a schedule until the next start, a changed schedule applies
//! at the next start. The single-session rules of `arm_next` and registration are in the
//! contract suite (`contract.rs`), on both stores.

use chrono::{DateTime, TimeDelta, Utc};
use futures::future::join_all;
use outbox::periodic::Recurrence;
use outbox::store::{RegisterSchedule, Registered, Store, SCHEDULE_HEADER};
use outbox::testing::MemoryStore;
use outbox::{message::Headers, Context, Error, PgStore, Worker};
use outbox_tests::{eventually, Fixture};
use sqlx::{AssertSqlSafe, Row};
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[outbox::timer(queue = "reports", max_deliveries = 3)]
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct Report {
    kind: String,
}

/// The deadlines the handler saw, with the payload of each run.
type Seen = Arc<Mutex<Vec<(DateTime<Utc>, Report)>>>;

fn recorder(
    seen: &Seen,
) -> impl Fn(Report, Context) -> std::future::Ready<()> + Send + Sync + 'static {
    let seen = seen.clone();
    move |r: Report, ctx: Context| {
        seen.lock().unwrap().push((ctx.deadline(), r));
        std::future::ready(())
    }
}

fn report(kind: &str) -> Report {
    Report {
        kind: kind.to_owned(),
    }
}

fn scheduled(store: PgStore, seen: &Seen, every: &str) -> Worker<PgStore> {
    Worker::builder(store)
        .idle_poll(Duration::from_millis(200))
        .lease_ttl(Duration::from_secs(5))
        .timer::<Report>(recorder(seen))
        .schedule(
            "tick",
            Recurrence::parse_every(every).unwrap(),
            report("tick"),
        )
        .build()
        .expect("valid worker")
}

const Q: &str = "reports";

fn fingerprint(fp: &str) -> Headers {
    [(SCHEDULE_HEADER.to_owned(), fp.to_owned())].into()
}

fn micros(t: DateTime<Utc>) -> DateTime<Utc> {
    DateTime::from_timestamp_micros(t.timestamp_micros()).expect("in range")
}

async fn register(store: &PgStore, key: &str, fp: &str, first: DateTime<Utc>) -> Registered {
    let hs = fingerprint(fp);
    store
        .register_schedule(RegisterSchedule::new(Q, key, b"{}", &hs, first))
        .await
        .expect("register")
}

/// Sessions of this test waiting for a lock on a statement that names its table.
async fn waiting_on_a_lock(f: &Fixture) -> i64 {
    sqlx::query(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
         AND strpos(query, $1) > 0",
    )
    .bind(f.outbox.table().to_string())
    .fetch_one(&f.pool)
    .await
    .unwrap()
    .get(0)
}

/// A registration whose insert waits for another registration's uncommitted insert of the
/// same key takes the conflict branch once that commits: one row, and the second writes
/// nothing (same fingerprint) or brings the row to its schedule (another fingerprint).
#[tokio::test]
async fn a_registration_waiting_on_another_finds_its_row() {
    let f = Fixture::new().await;
    let register_sql = outbox::__private::statements(&f.outbox)
        .into_iter()
        .find(|(name, _)| *name == "periodic.register")
        .expect("the register statement")
        .1;
    let first = micros(Utc::now() + TimeDelta::seconds(60));
    for (key, fp, want_fp) in [("schedule:same", "A", "A"), ("schedule:changed", "B", "B")] {
        let mut tx = f.pool.begin().await.unwrap();
        let inserted = sqlx::query(AssertSqlSafe(register_sql.clone()))
            .bind(Q)
            .bind(key)
            .bind(&b"{}"[..])
            .bind(sqlx::types::Json(fingerprint("A")))
            .bind(first)
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        assert!(inserted.get::<bool, _>(1), "the first registration inserts");
        let store = f.store.clone();
        let second =
            tokio::spawn(
                async move { register(&store, key, fp, first + TimeDelta::seconds(10)).await },
            );
        eventually(
            30,
            "the second registration waits for the first",
            || async { waiting_on_a_lock(&f).await == 1 },
        )
        .await;
        assert!(!second.is_finished());
        tx.commit().await.unwrap();
        let got = second.await.unwrap();
        let rows: Vec<_> = f
            .rows(Q)
            .await
            .into_iter()
            .filter(|r| r.timer_id.as_deref() == Some(key))
            .collect();
        assert_eq!(rows.len(), 1, "{key}: one live row: {rows:#?}");
        assert_eq!(
            rows[0]
                .headers
                .as_ref()
                .and_then(|h| h.get(SCHEDULE_HEADER)),
            Some(&want_fp.to_owned())
        );
        if fp == "A" {
            assert_eq!(got, Registered::Unchanged, "{key}");
            assert_eq!(rows[0].next_attempt_at, first);
        } else {
            assert_eq!(
                got,
                Registered::Rescheduled {
                    id: rows[0].id,
                    at: first + TimeDelta::seconds(10)
                },
                "{key}"
            );
        }
    }
    f.cleanup().await;
}

/// Many workers registering many schedules at once (one statement each, autocommit):
/// every schedule ends with exactly one live row and exactly one registration inserted it.
#[tokio::test]
async fn concurrent_registrations_leave_one_live_row_per_schedule() {
    let f = Fixture::new().await;
    let first = micros(Utc::now() + TimeDelta::seconds(60));
    let keys: Vec<String> = (0..20).map(|i| format!("schedule:s{i}")).collect();
    for round in 0..3 {
        let fp = format!("v{round}");
        let calls = keys
            .iter()
            .flat_map(|k| (0..6).map(move |_| k))
            .map(|k| register(&f.store, k, &fp, first));
        let outcomes = join_all(calls).await;
        for (i, key) in keys.iter().enumerate() {
            let mine = &outcomes[i * 6..(i + 1) * 6];
            let writes = mine
                .iter()
                .filter(|o| !matches!(o, Registered::Unchanged))
                .count();
            assert_eq!(writes, 1, "{key} round {round}: {mine:?}");
            if round == 0 {
                assert!(
                    mine.iter()
                        .any(|o| matches!(o, Registered::Inserted { .. })),
                    "{mine:?}"
                );
            } else {
                assert!(
                    mine.iter()
                        .any(|o| matches!(o, Registered::Rescheduled { .. })),
                    "{mine:?}"
                );
            }
        }
        let rows = f.rows(Q).await;
        assert_eq!(rows.len(), keys.len(), "one row per schedule: {rows:#?}");
        assert!(rows
            .iter()
            .all(|r| { r.headers.as_ref().and_then(|h| h.get(SCHEDULE_HEADER)) == Some(&fp) }));
    }
    // The common start of a worker: the same schedule again writes nothing at all.
    let mut conn = f.pool.acquire().await.unwrap();
    let before: String = sqlx::query(AssertSqlSafe(format!(
        "SELECT string_agg(xmin::text, ',' ORDER BY id) FROM {}",
        f.outbox.table()
    )))
    .fetch_one(&mut *conn)
    .await
    .unwrap()
    .get(0);
    for key in &keys {
        assert_eq!(
            register(&f.store, key, "v2", first).await,
            Registered::Unchanged
        );
    }
    let after: String = sqlx::query(AssertSqlSafe(format!(
        "SELECT string_agg(xmin::text, ',' ORDER BY id) FROM {}",
        f.outbox.table()
    )))
    .fetch_one(&mut *conn)
    .await
    .unwrap()
    .get(0);
    assert_eq!(before, after, "no row version written");
    conn.close().await.unwrap();
    f.cleanup().await;
}

/// Bad schedules are refused by `build`, before any statement: an empty or too long name, a
/// schedule without a handler for its queue, one name twice on a queue.
#[tokio::test]
async fn bad_schedules_are_typed_build_errors() {
    let store = MemoryStore::new();
    let every = || Recurrence::parse_every("1s").unwrap();
    let seen: Seen = Arc::default();
    for name in [String::new(), "n".repeat(300), "a\0b".to_owned()] {
        let err = Worker::builder(store.clone())
            .timer::<Report>(recorder(&seen))
            .schedule(&name, every(), report("x"))
            .build()
            .unwrap_err();
        assert!(
            matches!(
                err,
                Error::InvalidArgument {
                    field: "schedule",
                    ..
                }
            ),
            "{name:?}: {err:?}"
        );
    }
    let err = Worker::builder(store.clone())
        .queue("other", |_: Vec<u8>, _: Context| async {})
        .schedule("tick", every(), report("x"))
        .build()
        .unwrap_err();
    assert!(
        matches!(err, Error::InvalidConfig { knob: "schedule", ref reason } if reason.contains("no handler")),
        "{err:?}"
    );
    let err = Worker::builder(store.clone())
        .timer::<Report>(recorder(&seen))
        .schedule("tick", every(), report("x"))
        .schedule("tick", every(), report("y"))
        .build()
        .unwrap_err();
    assert!(
        matches!(err, Error::InvalidConfig { knob: "schedule", ref reason } if reason.contains("twice")),
        "{err:?}"
    );
    // Several schedules of one type by distinct names are fine.
    let _worker = Worker::builder(store)
        .timer::<Report>(recorder(&seen))
        .schedule("a", every(), report("a"))
        .schedule("b", every(), report("b"))
        .build()
        .expect("two names");
}

/// Three workers of one outbox with one schedule every second, for about 8 s: no instant
/// fires twice (every deadline a handler saw is distinct, on the schedule's 1 s grid), the
/// instants fire (at least a third of the expected count: a 3x margin, no throughput
/// claim), and one live row remains.
#[tokio::test]
async fn three_workers_fire_each_instant_once() {
    let f = Fixture::new().await;
    let seen: Seen = Arc::default();
    let workers: Vec<_> = (0..3)
        .map(|_| scheduled(f.store.clone(), &seen, "1s").start())
        .collect();
    let window = Duration::from_secs(8);
    tokio::time::sleep(window).await;
    for w in workers {
        w.shutdown().await;
    }
    let mut deadlines: Vec<DateTime<Utc>> = seen.lock().unwrap().iter().map(|(d, _)| *d).collect();
    deadlines.sort();
    let fired = deadlines.len();
    deadlines.dedup();
    assert_eq!(
        deadlines.len(),
        fired,
        "an instant fired twice: {deadlines:?}"
    );
    let expected = window.as_secs() as usize; // one instant per second
    assert!(
        fired * 3 >= expected,
        "{fired} fires in {window:?}: {deadlines:?}"
    );
    assert!(
        fired <= expected + 1,
        "more fires than instants: {deadlines:?}"
    );
    for pair in deadlines.windows(2) {
        let step = (pair[1] - pair[0]).num_microseconds().unwrap();
        assert!(
            step > 0 && step % 1_000_000 == 0,
            "off the 1 s grid: {deadlines:?}"
        );
    }
    assert!(seen
        .lock()
        .unwrap()
        .iter()
        .all(|(_, r)| *r == report("tick")));
    let rows = f.rows(Q).await;
    assert_eq!(rows.len(), 1, "one live row: {rows:#?}");
    assert_eq!(rows[0].timer_id.as_deref(), Some("schedule:tick"));
    assert_eq!(
        rows[0]
            .headers
            .as_ref()
            .and_then(|h| h.get(SCHEDULE_HEADER)),
        Some(&"every:1s".to_owned())
    );
    f.cleanup().await;
}

/// A cancel of the pending schedule row stops the schedule: nothing fires while the worker
/// runs on (three instants' worth), until a new worker start registers it again.
#[tokio::test]
async fn a_cancel_stops_the_schedule_until_the_next_start() {
    let f = Fixture::new().await;
    let seen: Seen = Arc::default();
    let first = scheduled(f.store.clone(), &seen, "2s").start();
    eventually(10, "the schedule's row", || async {
        !f.rows(Q).await.is_empty()
    })
    .await;
    let mut conn = f.pool.acquire().await.unwrap();
    let cancelled = f
        .outbox
        .cancel(&mut conn, Q, "schedule:tick")
        .await
        .unwrap();
    assert!(
        matches!(cancelled, outbox::Cancelled::Deleted { .. }),
        "{cancelled:?}"
    );
    drop(conn);
    tokio::time::sleep(Duration::from_secs(6)).await; // three instants
    let fired = seen.lock().unwrap().clone();
    assert!(fired.is_empty(), "{fired:?}");
    assert!(f.rows(Q).await.is_empty());
    first.shutdown().await;
    let second = scheduled(f.store.clone(), &seen, "2s").start();
    eventually(6 * 3, "a fire after the new start", || async {
        !seen.lock().unwrap().is_empty()
    })
    .await;
    second.shutdown().await;
    f.cleanup().await;
}

/// A restart with a changed recurrence applies it: a schedule registered every hour is
/// moved to the new, earlier instant (every second) and fires at once.
#[tokio::test]
async fn a_restart_with_a_changed_schedule_applies_it() {
    let f = Fixture::new().await;
    let seen: Seen = Arc::default();
    let hourly = scheduled(f.store.clone(), &seen, "1h").start();
    eventually(10, "the hourly row", || async {
        !f.rows(Q).await.is_empty()
    })
    .await;
    hourly.shutdown().await;
    let row = f.only_row(Q).await;
    let now = Utc::now();
    assert!(
        row.next_attempt_at > now + TimeDelta::minutes(50),
        "{row:?}"
    );
    let secondly = scheduled(f.store.clone(), &seen, "1s").start();
    eventually(3 * 3, "a fire of the new schedule", || async {
        !seen.lock().unwrap().is_empty()
    })
    .await;
    secondly.shutdown().await;
    let fired = seen.lock().unwrap().clone();
    assert!(
        fired.iter().all(|(d, _)| *d < now + TimeDelta::seconds(60)),
        "the deadline moved earlier: {fired:?}"
    );
    let row = f.only_row(Q).await;
    assert_eq!(
        row.headers.as_ref().and_then(|h| h.get(SCHEDULE_HEADER)),
        Some(&"every:1s".to_owned())
    );
    assert!(
        row.next_attempt_at < now + TimeDelta::seconds(60),
        "{row:?}"
    );
    f.cleanup().await;
}

/// On the in-memory store with its virtual clock: registration, then a day of a 5-minute
/// schedule in steps of one minute fires 288 times, each instant once; after three hours
/// with no run (the clock jumped) the row's own instant runs and then the latest missed
/// instant once, and the grid goes on.
#[tokio::test]
async fn memory_store_runs_a_schedule_in_virtual_time() {
    let start = "2026-03-01T00:00:00Z".parse::<DateTime<Utc>>().unwrap();
    let store = MemoryStore::starting_at(start);
    let seen: Seen = Arc::default();
    let worker = Worker::builder(store.clone())
        .timer::<Report>(recorder(&seen))
        .schedule(
            "five",
            Recurrence::parse_every("5m").unwrap(),
            report("five"),
        )
        .build()
        .unwrap();
    let registered = worker.register_schedules().await.unwrap();
    assert!(
        matches!(registered[..], [(ref k, Registered::Inserted { at, .. })] if k == "schedule:five" && at == start + TimeDelta::minutes(5)),
        "{registered:?}"
    );
    // Registering again at the next start writes nothing.
    assert!(matches!(
        worker.register_schedules().await.unwrap()[..],
        [(_, Registered::Unchanged)]
    ));
    for _ in 0..24 * 60 {
        store.advance(Duration::from_secs(60));
        worker.run_due().await.unwrap();
    }
    let deadlines: Vec<_> = seen.lock().unwrap().iter().map(|(d, _)| *d).collect();
    let want: Vec<_> = (1..=288)
        .map(|k| start + TimeDelta::minutes(5 * k))
        .collect();
    assert_eq!(deadlines, want);
    // Three hours without a run: the missed instants fire once, then the grid goes on.
    seen.lock().unwrap().clear();
    store.advance(Duration::from_secs(3 * 3600));
    worker.run_due().await.unwrap();
    // The row's own (first missed) instant runs, then the latest instant not after the
    // clock, once: the 34 instants between them do not fire.
    let end = start + TimeDelta::days(1);
    let fired: Vec<_> = seen.lock().unwrap().iter().map(|(d, _)| *d).collect();
    assert_eq!(
        fired,
        [end + TimeDelta::minutes(5), end + TimeDelta::hours(3)]
    );
    let row = &store.rows()[0];
    assert_eq!(
        row.next_attempt_at,
        end + TimeDelta::hours(3) + TimeDelta::minutes(5)
    );
}
