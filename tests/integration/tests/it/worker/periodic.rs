//! Periodic timers on Postgres (SPEC §9.1): registrations of one schedule racing
//! each other leave exactly one live row; workers with `WorkerBuilder::schedule` fire each
//! instant once (three workers, 20 s of a 1 s schedule, every instant fired or a documented
//! miss), a worker process killed mid-run leaves the schedule going, a row claimed but not
//! started at shutdown keeps its instant, a failed write of the next instant never ends the
//! schedule, a cancel stops a schedule until the next start, a changed schedule applies at
//! the next start. The single-session rules of `arm_next` and registration are in the
//! contract suite (`contract::periodic`), on both stores.
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

/// The lease of the tests that wait for one to expire.
const SHORT_LEASE: Duration = Duration::from_secs(1);

/// One run of a schedule as a handler saw it: (deadline, claimed at, delivery number).
type Run = (DateTime<Utc>, DateTime<Utc>, u32);

/// A worker on `store` with the schedule `tick` of `Report` (`every`) and `lease_ttl`,
/// whose handler records every run in `runs`.
fn recording<S: Store>(
    store: S,
    runs: &Arc<Mutex<Vec<Run>>>,
    every: &str,
    lease_ttl: Duration,
) -> Worker<S> {
    let runs = runs.clone();
    Worker::builder(store)
        .idle_poll(Duration::from_millis(200))
        .lease_ttl(lease_ttl)
        .timer::<Report>(move |_: Report, ctx: Context| {
            runs.lock()
                .unwrap()
                .push((ctx.deadline(), ctx.claimed_at(), ctx.delivery()));
            std::future::ready(())
        })
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

/// Registers the schedule `tick` as a worker with `every` = `fp` would, with the payload
/// such a worker registers, but due first at `first` (in the past, say).
async fn register_tick(store: &PgStore, fp: &str, first: DateTime<Utc>) -> Registered {
    let hs = fingerprint(fp);
    let payload = serde_json::to_vec(&report("tick")).unwrap();
    store
        .register_schedule(RegisterSchedule::new(
            Q,
            "schedule:tick",
            &payload,
            &hs,
            first,
        ))
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
    let register_sql = f
        .outbox
        .statements()
        .into_iter()
        .find(|(name, _)| *name == "periodic.register")
        .expect("the register statement")
        .1;
    let first = micros(Utc::now() + TimeDelta::seconds(60));
    for (key, fp, want_fp) in [
        ("schedule:same", "every:1s", "every:1s"),
        ("schedule:changed", "every:2s", "every:2s"),
    ] {
        let mut tx = f.pool.begin().await.unwrap();
        let inserted = sqlx::query(AssertSqlSafe(register_sql.clone()))
            .bind(Q)
            .bind(key)
            .bind(&b"{}"[..])
            .bind(sqlx::types::Json(fingerprint("every:1s")))
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
        if fp == "every:1s" {
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
        let fp = format!("every:{}s", round + 1);
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
            register(&f.store, key, "every:3s", first).await,
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

/// Three workers of one outbox with one schedule every second, for 20 s: no instant fires
/// twice, and every instant fires or is a documented miss. Each run's deadline is exactly
/// the instant its predecessor queued when it started: the next one on the 1 s grid, or,
/// for a run that started more than a second late, the latest instant not after its claim
/// (missed instants fire once). The row left at the end is the instant the last run queued,
/// no more than three periods before the workers stopped. Counts are bounded with a 3x
/// margin; nothing about throughput.
#[tokio::test]
async fn three_workers_fire_each_instant_once() {
    let f = Fixture::new().await;
    let runs: Arc<Mutex<Vec<Run>>> = Arc::default();
    let every = Recurrence::parse_every("1s").unwrap();
    let period = TimeDelta::seconds(1);
    let began = Utc::now();
    // A lease long enough that none expires on a loaded machine: a reclaim would run an
    // instant again (at least once), which is not what this test counts.
    let workers: Vec<_> = (0..3)
        .map(|_| recording(f.store.clone(), &runs, "1s", Duration::from_secs(30)).start())
        .collect();
    let window = Duration::from_secs(20);
    tokio::time::sleep(window).await;
    let stopping = Utc::now();
    for w in workers {
        w.shutdown().await;
    }
    let mut runs = runs.lock().unwrap().clone();
    runs.sort();
    let fired = runs.len();
    let mut deadlines: Vec<_> = runs.iter().map(|(d, _, _)| *d).collect();
    deadlines.dedup();
    assert_eq!(deadlines.len(), fired, "an instant fired twice: {runs:?}");
    let expected = window.as_secs() as usize; // one instant per second
    assert!(
        fired * 3 >= expected,
        "{fired} fires in {window:?}: {runs:?}"
    );
    assert!(fired <= expected + 1, "more fires than instants: {runs:?}");
    assert!(
        runs[0].0 <= began + period * 3,
        "the first instant is one period after the start: {runs:?}"
    );
    assert_chain(&runs, &every);
    let row = f.only_row(Q).await;
    assert_eq!(row.timer_id.as_deref(), Some("schedule:tick"));
    assert_eq!(
        row.headers.as_ref().and_then(|h| h.get(SCHEDULE_HEADER)),
        Some(&"every:1s".to_owned())
    );
    let (last, last_claimed, _) = runs[fired - 1];
    assert_eq!(
        Some(row.next_attempt_at),
        every.next_instant(last, last_claimed),
        "the stored instant is the one the last run queued"
    );
    assert!(
        row.next_attempt_at >= stopping - period * 3,
        "due instants left unfired at the stop: {row:?}"
    );
    assert!(
        runs.iter().all(|&(d, c, n)| c >= d && n == 1),
        "a run before its instant, or delivered twice: {runs:?}"
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

/// A worker process killed in the middle of a periodic run (SIGKILL, nothing written at
/// the end): the next instant it queued when the run started is on the row, the worker
/// that reclaims the row once its lease has expired runs the killed instant again (at least
/// once) and the schedule goes on from there; one live row throughout.
#[tokio::test]
async fn a_worker_killed_mid_run_keeps_the_schedule() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};

    let f = Fixture::new().await;
    let table = f.outbox.table().trim_matches('"').to_owned();
    let mut child = Command::new(env!("CARGO_BIN_EXE_periodic_process"))
        .args([&outbox_tests::database_url(), &table])
        .stdout(Stdio::piped())
        .spawn()
        .expect("the worker process starts");
    let mut lines = BufReader::new(child.stdout.take().unwrap());
    // Killed if the test fails before it does (a read that never returns ends with it).
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut child = Kill(child);
    let reader = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        lines.read_line(&mut line).map(|_| line)
    });
    // The first instant is a second after its registration; the process starts in far less.
    let line = tokio::time::timeout(Duration::from_secs(30), reader)
        .await
        .expect("the process starts a run")
        .unwrap()
        .unwrap();
    let killed: DateTime<Utc> = line
        .trim()
        .strip_prefix("started ")
        .unwrap_or_else(|| panic!("unexpected output {line:?}"))
        .parse()
        .unwrap();
    let row = f.only_row(Q).await;
    assert!(
        row.acquired_token.is_some(),
        "leased while it runs: {row:?}"
    );
    assert_eq!(row.next_attempt_at, killed);
    let queued = row.rearm_at.expect("the next instant is queued");
    assert_eq!(queued, killed + TimeDelta::seconds(1), "{row:?}");
    child.0.kill().unwrap();
    child.0.wait().unwrap();

    let runs: Arc<Mutex<Vec<Run>>> = Arc::default();
    let worker = recording(f.store.clone(), &runs, "1s", SHORT_LEASE).start();
    // The lease (1 s) expires, the row is claimed (idle poll 200 ms) and runs; its next
    // instant then runs a second or so later: 3x margin on all of it.
    eventually(3 * 4, "two runs after the kill", || async {
        runs.lock().unwrap().len() >= 2
    })
    .await;
    worker.shutdown().await;
    let runs = runs.lock().unwrap().clone();
    let (deadline, claimed, delivery) = runs[0];
    assert_eq!(
        (deadline, delivery),
        (killed, 2),
        "the killed instant runs again: {runs:?}"
    );
    let every = Recurrence::parse_every("1s").unwrap();
    assert_eq!(
        Some(runs[1].0),
        every.next_instant(deadline, claimed),
        "the schedule goes on from the reclaimed run: {runs:?}"
    );
    let row = f.only_row(Q).await;
    assert_eq!(row.timer_id.as_deref(), Some("schedule:tick"));
    f.cleanup().await;
}

/// A periodic row claimed but not started when the worker shuts down (its only handler
/// slot busy with another row) is given back as it was: no rearm queued, its own instant,
/// not counted as a delivery; the next worker runs that instant.
#[tokio::test]
async fn a_periodic_row_released_at_shutdown_keeps_its_instant() {
    let f = Fixture::new().await;
    let now = micros(Utc::now());
    // An ordinary timer of the same queue, due before the schedule's instant, takes the
    // one handler slot first (claims of one queue go in deadline order).
    let mut conn = f.pool.acquire().await.unwrap();
    let blocker = f
        .outbox
        .publish(
            &mut conn,
            outbox::Message::new(Q, br#"{"kind":"block"}"#)
                .timer_id("blocker")
                .schedule(now - TimeDelta::seconds(10)),
        )
        .await
        .unwrap();
    drop(conn);
    // The schedule's row, registered as the worker below would (same fingerprint, so the
    // worker's registration leaves it alone), due 5 s ago.
    let instant = now - TimeDelta::seconds(5);
    let Registered::Inserted { id, .. } = register_tick(&f.store, "every:3600s", instant).await
    else {
        panic!("inserted");
    };
    let started = Arc::new(tokio::sync::Notify::new());
    let worker = {
        let started = started.clone();
        Worker::builder(f.store.clone())
            .concurrency(1)
            .fetch_batch_size(2)
            .idle_poll(Duration::from_millis(200))
            .lease_ttl(Duration::from_secs(30))
            .graceful_timeout(Duration::from_millis(200))
            .timer::<Report>(move |r: Report, _: Context| {
                let started = started.clone();
                async move {
                    assert_eq!(r, report("block"), "only the blocker starts");
                    started.notify_one();
                    tokio::time::sleep(Duration::from_secs(5)).await;
                }
            })
            .schedule(
                "tick",
                Recurrence::parse_every("1h").unwrap(),
                report("tick"),
            )
            .build()
            .unwrap()
            .start()
    };
    tokio::time::timeout(Duration::from_secs(30), started.notified())
        .await
        .expect("the blocker starts");
    let shut = worker.shutdown().await;
    assert_eq!(
        (shut.abandoned, shut.released, shut.unreleased),
        (1, 1, 0),
        "{shut:?}"
    );
    let rows = f.rows(Q).await;
    let tick = rows
        .iter()
        .find(|r| r.id == id)
        .expect("the schedule's row");
    assert!(tick.acquired_token.is_none(), "given back: {tick:?}");
    assert_eq!(tick.next_attempt_at, instant, "its own instant: {tick:?}");
    assert_eq!(tick.rearm_at, None, "no next instant queued: {tick:?}");
    assert_eq!(tick.deliveries_count, 0, "never delivered: {tick:?}");
    assert!(rows.iter().any(|r| Some(r.id) == blocker.id()));

    // The next worker runs the instant that was given back.
    let runs: Arc<Mutex<Vec<Run>>> = Arc::default();
    let next = recording(f.store.clone(), &runs, "1h", SHORT_LEASE).start();
    eventually(10, "the released instant runs", || async {
        runs.lock().unwrap().len() >= 2 // the blocker and the schedule's instant
    })
    .await;
    next.shutdown().await;
    let runs = runs.lock().unwrap().clone();
    assert!(
        runs.iter().any(|&(d, _, n)| d == instant && n == 1),
        "{runs:?}"
    );
    let row = f.only_row(Q).await;
    assert_eq!(row.id, id);
    assert_eq!(row.next_attempt_at, instant + TimeDelta::hours(1));
    f.cleanup().await;
}

/// `PgStore` with `arm_next` failing with the queued errors first (one per call).
#[derive(Clone)]
struct FailingArm {
    inner: PgStore,
    errors: Arc<Mutex<Vec<Error>>>,
    arms: Arc<std::sync::atomic::AtomicUsize>,
}

// A wrapper of a store: `Store` is sealed, the `testing` feature opens it to wrappers.
impl outbox::testing::Unsealed for FailingArm {}

impl Store for FailingArm {
    async fn claim(
        &self,
        r: outbox::store::ClaimRequest<'_>,
    ) -> outbox::Result<Vec<outbox::store::Delivery>> {
        self.inner.claim(r).await
    }
    async fn ack(&self, l: outbox::store::Lease) -> outbox::Result<outbox::store::Completion> {
        self.inner.ack(l).await
    }
    async fn ack_batch(
        &self,
        l: &[outbox::store::Lease],
    ) -> outbox::Result<Vec<outbox::store::Completion>> {
        self.inner.ack_batch(l).await
    }
    async fn retry(
        &self,
        l: outbox::store::Lease,
        d: Duration,
    ) -> outbox::Result<outbox::store::Completion> {
        self.inner.retry(l, d).await
    }
    async fn fail(
        &self,
        l: outbox::store::Lease,
        f: outbox::store::Failure<'_>,
    ) -> outbox::Result<outbox::store::Completion> {
        self.inner.fail(l, f).await
    }
    async fn renew(
        &self,
        l: &[outbox::store::Lease],
    ) -> outbox::Result<Vec<outbox::store::Renewal>> {
        self.inner.renew(l).await
    }
    async fn release(
        &self,
        i: &[outbox::store::Release],
    ) -> outbox::Result<Vec<outbox::store::Released>> {
        self.inner.release(i).await
    }
    async fn fail_unclaimed(
        &self,
        id: i64,
        ttl: Duration,
        f: outbox::store::Failure<'_>,
    ) -> outbox::Result<outbox::store::Completion> {
        self.inner.fail_unclaimed(id, ttl, f).await
    }
    async fn arm_next(
        &self,
        lease: outbox::store::Lease,
        at: DateTime<Utc>,
    ) -> outbox::Result<outbox::store::Armed> {
        self.arms.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let injected = self.errors.lock().unwrap().pop();
        match injected {
            Some(e) => Err(e),
            None => self.inner.arm_next(lease, at).await,
        }
    }
    async fn register_schedule(&self, r: RegisterSchedule<'_>) -> outbox::Result<Registered> {
        self.inner.register_schedule(r).await
    }
    async fn next_wakeup(
        &self,
        r: outbox::store::ClaimRequest<'_>,
    ) -> outbox::Result<outbox::store::NextWakeup> {
        self.inner.next_wakeup(r).await
    }
    async fn peek(&self, r: outbox::store::ClaimRequest<'_>) -> outbox::Result<Vec<(i64, String)>> {
        self.inner.peek(r).await
    }
    async fn wakeups(
        &self,
    ) -> outbox::Result<Option<tokio::sync::mpsc::Receiver<outbox::store::Wakeup>>> {
        self.inner.wakeups().await
    }
    async fn now(&self) -> outbox::Result<DateTime<Utc>> {
        self.inner.now().await
    }
    fn dead_letter_enabled(&self) -> bool {
        self.inner.dead_letter_enabled()
    }
    fn max_connections(&self) -> Option<u32> {
        self.inner.max_connections()
    }
}

/// Arming a periodic run's next instant fails: a connection error is retried (100 ms
/// later, well inside the lease) and the run starts on its first delivery; any other error
/// keeps the run from starting (it would end the row without a next instant and stop the
/// schedule): the row runs once its lease has expired, for the same instant, armed, and the
/// schedule goes on. Without that rule the first case loses the schedule.
#[tokio::test]
async fn a_failed_arm_never_ends_the_schedule() {
    let cases = [
        (
            "connection error, retried",
            Error::Database(sqlx::Error::Protocol("injected".into())),
            1,
        ),
        (
            "statement error, not started",
            Error::Database(sqlx::Error::ColumnNotFound("injected".into())),
            2,
        ),
    ];
    for (case, injected, delivery) in cases {
        let f = Fixture::new().await;
        let instant = micros(Utc::now() - TimeDelta::seconds(5));
        register_tick(&f.store, "every:3600s", instant).await;
        let store = FailingArm {
            inner: f.store.clone(),
            errors: Arc::new(Mutex::new(vec![injected])),
            arms: Arc::default(),
        };
        let runs: Arc<Mutex<Vec<Run>>> = Arc::default();
        let worker = recording(store.clone(), &runs, "1h", SHORT_LEASE).start();
        // A lease (1 s) to expire, then an idle poll (200 ms): 3x margin.
        eventually(3 * 2, "the instant runs", || async {
            !runs.lock().unwrap().is_empty()
        })
        .await;
        worker.shutdown().await;
        let runs = runs.lock().unwrap().clone();
        assert_eq!(runs.len(), 1, "{case}: {runs:?}");
        assert_eq!(
            (runs[0].0, runs[0].2),
            (instant, delivery),
            "{case}: {runs:?}"
        );
        assert_eq!(
            store.arms.load(std::sync::atomic::Ordering::SeqCst),
            2,
            "{case}"
        );
        let row = f.only_row(Q).await;
        assert_eq!(
            row.next_attempt_at,
            instant + TimeDelta::hours(1),
            "{case}: the schedule goes on: {row:?}"
        );
        f.cleanup().await;
    }
}

/// The grid check of a run log: each run's deadline is the instant its predecessor queued
/// with `every` (the next one, or the latest missed one for a late run), no instant twice.
fn assert_chain(runs: &[Run], every: &Recurrence) {
    for pair in runs.windows(2) {
        let ((deadline, claimed, _), (next, _, _)) = (pair[0], pair[1]);
        assert_eq!(
            Some(next),
            every.next_instant(deadline, claimed),
            "the run of {deadline} (claimed {claimed}) queued another instant: {runs:?}"
        );
    }
}

/// A worker that handles the type without registering the schedule, beside one that does:
/// the runs it takes queue the next instant from the recurrence stored with the row, so
/// the schedule goes on whichever worker runs it (no run ends it), each instant once.
#[tokio::test]
async fn a_worker_without_the_schedule_keeps_it_going() {
    let f = Fixture::new().await;
    let runs: Arc<Mutex<Vec<Run>>> = Arc::default();
    let with = recording(f.store.clone(), &runs, "1s", Duration::from_secs(30)).start();
    let without = {
        let runs = runs.clone();
        Worker::builder(f.store.clone())
            .idle_poll(Duration::from_millis(200))
            .lease_ttl(Duration::from_secs(30))
            .timer::<Report>(move |_: Report, ctx: Context| {
                runs.lock()
                    .unwrap()
                    .push((ctx.deadline(), ctx.claimed_at(), ctx.delivery()));
                std::future::ready(())
            })
            .build()
            .unwrap()
            .start()
    };
    eventually(10, "the schedule's row", || async {
        !f.rows(Q).await.is_empty()
    })
    .await;
    // Only the worker without the schedule from here on.
    with.shutdown().await;
    let before = runs.lock().unwrap().len();
    tokio::time::sleep(Duration::from_secs(4)).await;
    without.shutdown().await;
    let mut runs = runs.lock().unwrap().clone();
    runs.sort();
    assert!(
        // 4 s of a 1 s schedule, with a 3x margin.
        runs.len() >= before + 4 / 3,
        "the schedule ran on without its registering worker: {runs:?}"
    );
    assert_chain(&runs, &Recurrence::parse_every("1s").unwrap());
    let row = f.only_row(Q).await;
    assert_eq!(row.timer_id.as_deref(), Some("schedule:tick"));
    f.cleanup().await;
}

/// A rolling deploy that changes the recurrence: once the new worker registered, every
/// run, on the old worker too, queues its next instant on the new recurrence stored with
/// the row: the two do not mix.
#[tokio::test]
async fn during_a_rolling_deploy_the_registered_recurrence_holds_on_old_workers() {
    let f = Fixture::new().await;
    let runs: Arc<Mutex<Vec<Run>>> = Arc::default();
    let old = recording(f.store.clone(), &runs, "1s", Duration::from_secs(30)).start();
    eventually(3 * 2, "a run of the old schedule", || async {
        !runs.lock().unwrap().is_empty()
    })
    .await;
    let registered = Utc::now();
    let new = recording(f.store.clone(), &runs, "3s", Duration::from_secs(30)).start();
    eventually(10, "the new schedule stored", || async {
        f.rows(Q).await.iter().any(|r| {
            let fp = |h: &Option<Headers>| h.as_ref().and_then(|h| h.get(SCHEDULE_HEADER)).cloned();
            fp(&r.headers).as_deref() == Some("every:3s")
                || fp(&r.rearm_headers).as_deref() == Some("every:3s")
        })
    })
    .await;
    new.shutdown().await;
    // The old worker alone runs the new schedule: three periods' worth.
    tokio::time::sleep(Duration::from_secs(10)).await;
    old.shutdown().await;
    let mut runs = runs.lock().unwrap().clone();
    runs.sort();
    let switched = registered + TimeDelta::seconds(3) + TimeDelta::milliseconds(500);
    let after: Vec<Run> = runs.iter().copied().filter(|r| r.0 > switched).collect();
    assert!(after.len() >= 2, "{runs:?}");
    assert_chain(&after, &Recurrence::parse_every("3s").unwrap());
    let row = f.only_row(Q).await;
    assert_eq!(
        row.headers.as_ref().and_then(|h| h.get(SCHEDULE_HEADER)),
        Some(&"every:3s".to_owned())
    );
    f.cleanup().await;
}

/// A restart with a changed payload and the same recurrence: the stored row takes the new
/// payload and keeps its instant (the grid does not move); its run gets the new payload.
#[tokio::test]
async fn a_restart_with_a_changed_payload_applies_it_at_the_same_instant() {
    let f = Fixture::new().await;
    let hourly = |kind: &str| {
        Worker::builder(f.store.clone())
            .idle_poll(Duration::from_millis(200))
            .timer::<Report>(recorder(&Seen::default()))
            .schedule("tick", Recurrence::parse_every("1h").unwrap(), report(kind))
            .build()
            .unwrap()
    };
    let first = hourly("v1");
    let registered = first.register_schedules().await.unwrap();
    assert!(
        matches!(registered[..], [(_, Registered::Inserted { .. })]),
        "{registered:?}"
    );
    let before = f.only_row(Q).await;
    let second = hourly("v2");
    let registered = second.register_schedules().await.unwrap();
    assert_eq!(
        registered,
        [(
            "schedule:tick".to_owned(),
            Registered::Rescheduled {
                id: before.id,
                at: before.next_attempt_at
            }
        )]
    );
    let row = f.only_row(Q).await;
    assert_eq!(
        row.next_attempt_at, before.next_attempt_at,
        "the instant kept"
    );
    assert_eq!(
        serde_json::from_slice::<Report>(&row.payload).unwrap(),
        report("v2")
    );
    // Starting it again with the same payload writes nothing.
    assert_eq!(
        hourly("v2").register_schedules().await.unwrap()[0].1,
        Registered::Unchanged
    );
    // The instant, run now by an operator, carries the new payload.
    let mut conn = f.pool.acquire().await.unwrap();
    f.outbox.run_now(&mut conn, row.id).await.unwrap();
    drop(conn);
    let seen: Seen = Arc::default();
    let worker = Worker::builder(f.store.clone())
        .idle_poll(Duration::from_millis(200))
        .timer::<Report>(recorder(&seen))
        .schedule("tick", Recurrence::parse_every("1h").unwrap(), report("v2"))
        .build()
        .unwrap()
        .start();
    eventually(10, "the run", || async { !seen.lock().unwrap().is_empty() }).await;
    worker.shutdown().await;
    assert_eq!(seen.lock().unwrap()[0].1, report("v2"));
    f.cleanup().await;
}

/// A schedule's row whose stored recurrence this build cannot read (here a fingerprint of
/// a format it does not know, as a newer version might write; registration refuses to
/// write one, so the test sets it by hand), on a worker that does not register the
/// schedule: the run does not start (it would end the schedule), and the row is given back
/// untouched, again and again at a growing interval, for a worker that can.
#[tokio::test]
async fn a_schedule_no_worker_here_can_compute_is_given_back_untouched() {
    const UNREADABLE: &str = "v9:lunar";
    let f = Fixture::new().await;
    let instant = micros(Utc::now() - TimeDelta::seconds(5));
    let Registered::Inserted { id, .. } = register_tick(&f.store, "every:3600s", instant).await
    else {
        panic!("inserted");
    };
    sqlx::query(AssertSqlSafe(format!(
        "UPDATE {} SET headers = $1 WHERE id = $2",
        f.outbox.table()
    )))
    .bind(sqlx::types::Json(fingerprint(UNREADABLE)))
    .bind(id)
    .execute(&f.pool)
    .await
    .unwrap();
    let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let worker = Worker::builder(f.store.clone())
        .idle_poll(Duration::from_millis(100))
        .timer::<Report>(outbox_tests::count_runs::<Report>(&runs))
        .build()
        .unwrap()
        .start();
    tokio::time::sleep(Duration::from_secs(2)).await;
    worker.shutdown().await;
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 0);
    let row = f.only_row(Q).await;
    assert_eq!(row.id, id);
    assert_eq!(
        (
            row.next_attempt_at,
            row.deliveries_count,
            row.acquired_token,
            row.rearm_at
        ),
        (instant, 0, None, None),
        "{row:?}"
    );

    // The same on the in-memory store's `run_due`: nothing runs, the row stays as it was.
    let store = MemoryStore::starting_at(instant);
    store
        .insert_row(outbox::store::StoredRow {
            id: 0,
            ..row.clone()
        })
        .unwrap();
    let before = store.rows();
    assert_eq!(before.len(), 1);
    // A second row of the key is refused, as the unique index would.
    assert!(matches!(
        store.insert_row(row.clone()),
        Err(Error::InvalidArgument {
            field: "timer_id",
            ..
        })
    ));
    let worker = Worker::builder(store.clone())
        .timer::<Report>(outbox_tests::count_runs::<Report>(&runs))
        .build()
        .unwrap();
    assert!(worker.run_due().await.unwrap().is_empty());
    assert_eq!(store.rows(), before);
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 0);
    f.cleanup().await;
}

/// A schedule's handler that completes its run in its own transaction (`Context::begin`,
/// an application write, `commit`): the commit applies the next instant queued when the
/// run started, so the schedule goes on, and each instant's write lands once.
#[tokio::test]
async fn a_run_completed_in_the_handlers_transaction_keeps_the_schedule() {
    let f = Fixture::new().await;
    let effects = format!("\"{}_effects\"", f.outbox.table().trim_matches('"'));
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE {effects} (deadline timestamptz PRIMARY KEY)"
    )))
    .execute(&f.pool)
    .await
    .unwrap();
    type Done = Arc<Mutex<Vec<(DateTime<Utc>, outbox::store::Completion)>>>;
    let done: Done = Arc::default();
    let worker = {
        let (done, insert) = (
            done.clone(),
            format!("INSERT INTO {effects} (deadline) VALUES ($1)"),
        );
        Worker::builder(f.store.clone())
            .idle_poll(Duration::from_millis(200))
            .lease_ttl(Duration::from_secs(30))
            .timer::<Report>(move |_: Report, ctx: Context| {
                let (done, insert) = (done.clone(), insert.clone());
                async move {
                    let mut tx = ctx.begin().await?;
                    sqlx::query(AssertSqlSafe(insert))
                        .bind(ctx.deadline())
                        .execute(&mut *tx)
                        .await?;
                    let completion = tx.commit().await?;
                    done.lock().unwrap().push((ctx.deadline(), completion));
                    Ok::<_, Error>(())
                }
            })
            .schedule(
                "tick",
                Recurrence::parse_every("1s").unwrap(),
                report("tick"),
            )
            .build()
            .unwrap()
            .start()
    };
    // Three instants of a 1 s schedule, with a 3x margin.
    eventually(3 * 3, "three runs", || async {
        done.lock().unwrap().len() >= 3
    })
    .await;
    worker.shutdown().await;
    let done = done.lock().unwrap().clone();
    for pair in done.windows(2) {
        let ((deadline, completion), (next, _)) = (pair[0], pair[1]);
        assert_eq!(
            completion,
            outbox::store::Completion::Rearmed { at: next },
            "the commit applied the next instant: {done:?}"
        );
        assert!(next > deadline, "{done:?}");
    }
    let written: i64 = sqlx::query(AssertSqlSafe(format!("SELECT count(*) FROM {effects}")))
        .fetch_one(&f.pool)
        .await
        .unwrap()
        .get(0);
    assert_eq!(written, done.len() as i64, "one write per run");
    assert_eq!(
        f.only_row(Q).await.timer_id.as_deref(),
        Some("schedule:tick")
    );
    sqlx::raw_sql(AssertSqlSafe(format!("DROP TABLE {effects}")))
        .execute(&f.pool)
        .await
        .unwrap();
    f.cleanup().await;
}
