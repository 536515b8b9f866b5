//! Schedules declared in `#[timer]` (issue 17 req 1, 4, 6; SPEC §9.1), run by a worker on
//! the in-memory store in virtual time: registration under `schedule:default` with the
//! type's `Default` payload, the instants of a cron expression across both DST changes of
//! Europe/Berlin (the stored instants, as the worker sees them), UTC when `tz` is omitted,
//! a real-time interval, and the build errors of a bad declared schedule.

use std::future::Ready;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, TimeDelta, TimeZone, Utc};
use outbox::periodic::{Recurrence, DECLARED_SCHEDULE_NAME};
use outbox::store::Registered;
use outbox::testing::MemoryStore;
use outbox::{Context, Error, Timer, Worker};
use outbox_macro_cron_tests::{DailyReport, Hourly, NightJob, Quarterly};

type Seen = Arc<Mutex<Vec<DateTime<Utc>>>>;

fn utc(y: i32, mo: u32, d: u32, h: u32, mi: u32) -> DateTime<Utc> {
    Utc.with_ymd_and_hms(y, mo, d, h, mi, 0).unwrap()
}

/// A worker handling `T` (and so registering its declared schedule) on a store whose
/// virtual clock starts at `start`; the handler records each run's deadline and checks the
/// payload is `T::default()`.
async fn worker_for<T>(start: DateTime<Utc>) -> (MemoryStore, Worker<MemoryStore>, Seen)
where
    T: Timer + Default + PartialEq + std::fmt::Debug,
{
    let store = MemoryStore::starting_at(start);
    let seen: Seen = Arc::default();
    let record = seen.clone();
    let worker = Worker::builder(store.clone())
        .timer::<T>(move |payload: T, ctx: Context| -> Ready<()> {
            assert_eq!(payload, T::default());
            record.lock().unwrap().push(ctx.deadline());
            std::future::ready(())
        })
        .build()
        .expect("a declared schedule builds");
    let registered = worker.register_schedules().await.expect("registered");
    assert!(
        matches!(&registered[..], [(key, Registered::Inserted { .. })] if key == "schedule:default"),
        "{registered:?}"
    );
    (store, worker, seen)
}

/// Advances the virtual clock by `span` in one-minute steps, running what is due at each.
async fn run_for(store: &MemoryStore, worker: &Worker<MemoryStore>, span: TimeDelta) {
    for _ in 0..span.num_minutes() {
        store.advance(Duration::from_secs(60));
        worker.run_due().await.expect("run_due");
    }
}

#[tokio::test]
async fn the_declared_name_is_default() {
    assert_eq!(DECLARED_SCHEDULE_NAME, "default");
    let (recurrence, payload) = DailyReport::declared_schedule().expect("declared");
    assert_eq!(
        recurrence.unwrap(),
        Recurrence::cron("0 0 6 * * *", "Europe/Berlin").unwrap()
    );
    assert_eq!(payload, DailyReport::default());
    // No `tz`: UTC.
    assert_eq!(
        Quarterly::declared_schedule().unwrap().0.unwrap(),
        Recurrence::cron("*/15 * * * *", "UTC").unwrap()
    );
    assert_eq!(
        Hourly::declared_schedule().unwrap().0.unwrap(),
        Recurrence::parse_every("1h").unwrap()
    );
}

/// 06:00 Berlin time is 05:00 UTC in winter and 04:00 UTC in summer: the fires follow the
/// wall clock across the spring change (29 March 2026).
#[tokio::test]
async fn a_daily_cron_follows_the_wall_clock_across_the_spring_change() {
    let (store, worker, seen) = worker_for::<DailyReport>(utc(2026, 3, 27, 12, 0)).await;
    run_for(&store, &worker, TimeDelta::days(4)).await;
    assert_eq!(
        *seen.lock().unwrap(),
        [
            utc(2026, 3, 28, 5, 0), // 06:00 CET
            utc(2026, 3, 29, 4, 0), // 06:00 CEST
            utc(2026, 3, 30, 4, 0),
            utc(2026, 3, 31, 4, 0),
        ]
    );
    let rows = store.rows();
    assert_eq!(rows.len(), 1, "one live row");
    assert_eq!(rows[0].timer_id.as_deref(), Some("schedule:default"));
    assert_eq!(rows[0].next_attempt_at, utc(2026, 4, 1, 4, 0));
}

/// 02:30 does not exist on 29 March 2026 in Berlin: that day's run is at 03:00 CEST, the
/// first time after the gap. It occurs twice on 25 October: it fires once, at the first
/// pass (CEST).
#[tokio::test]
async fn a_night_job_fires_once_on_both_dst_days() {
    let (store, worker, seen) = worker_for::<NightJob>(utc(2026, 3, 27, 12, 0)).await;
    run_for(&store, &worker, TimeDelta::days(3)).await;
    assert_eq!(
        *seen.lock().unwrap(),
        [
            utc(2026, 3, 28, 1, 30), // 02:30 CET
            utc(2026, 3, 29, 1, 0),  // 03:00 CEST: 02:30 does not exist
            utc(2026, 3, 30, 0, 30), // 02:30 CEST
        ]
    );

    let (store, worker, seen) = worker_for::<NightJob>(utc(2026, 10, 23, 12, 0)).await;
    run_for(&store, &worker, TimeDelta::days(3)).await;
    assert_eq!(
        *seen.lock().unwrap(),
        [
            utc(2026, 10, 24, 0, 30), // 02:30 CEST
            utc(2026, 10, 25, 0, 30), // 02:30 CEST, the first pass only
            utc(2026, 10, 26, 1, 30), // 02:30 CET
        ]
    );
}

/// A cron without `tz` is read in UTC: a virtual day of `*/15 * * * *` is 96 runs on the
/// quarter hours; an `every = "1h"` is 24 runs, one hour of real time apart from the
/// registration.
#[tokio::test]
async fn utc_cron_and_interval_over_a_virtual_day() {
    let start = utc(2026, 10, 24, 12, 0);
    let (store, worker, seen) = worker_for::<Quarterly>(start + TimeDelta::minutes(7)).await;
    run_for(&store, &worker, TimeDelta::days(1)).await;
    let want: Vec<_> = (1..=96)
        .map(|k| start + TimeDelta::minutes(15 * k))
        .collect();
    assert_eq!(*seen.lock().unwrap(), want);

    // Across the autumn change (25 October): real hours, not wall-clock ones.
    let (store, worker, seen) = worker_for::<Hourly>(start).await;
    run_for(&store, &worker, TimeDelta::days(1)).await;
    let want: Vec<_> = (1..=24).map(|k| start + TimeDelta::hours(k)).collect();
    assert_eq!(*seen.lock().unwrap(), want);
}

/// `schedule("default", …)` for a type that declares its own is the same name twice.
#[test]
fn a_worker_schedule_named_default_collides_with_the_declared_one() {
    let err = Worker::builder(MemoryStore::new())
        .timer::<Hourly>(|_: Hourly, _: Context| std::future::ready(()))
        .schedule("default", Recurrence::parse_every("5m").unwrap(), Hourly {})
        .build()
        .expect_err("refused");
    assert!(
        matches!(&err, Error::InvalidConfig { knob: "schedule", reason } if reason.contains("schedule:default") && reason.contains("give `schedule` another name")),
        "{err:?}"
    );
    // Another name runs beside it.
    let worker = Worker::builder(MemoryStore::new())
        .timer::<Hourly>(|_: Hourly, _: Context| std::future::ready(()))
        .schedule("fast", Recurrence::parse_every("5m").unwrap(), Hourly {})
        .build();
    assert!(worker.is_ok());
}

/// A hand-written `Timer` whose declared schedule is invalid (the attribute checks at
/// compile time; a hand-written impl is checked by `build`, before anything is written).
#[derive(Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
struct HandWritten {}

impl Timer for HandWritten {
    const QUEUE: &'static str = "maintenance.hand";
    const MAX_DELIVERIES: u32 = 3;

    fn declared_schedule() -> Option<(outbox::Result<Recurrence>, Self)> {
        Some((
            Recurrence::cron("0 0 6 * * *", "Mars/Olympus"),
            HandWritten {},
        ))
    }
}

#[test]
fn an_invalid_hand_written_declared_schedule_is_a_build_error() {
    let store = MemoryStore::new();
    let err = Worker::builder(store.clone())
        .timer::<HandWritten>(|_: HandWritten, _: Context| std::future::ready(()))
        .build()
        .expect_err("refused");
    assert!(
        matches!(&err, Error::InvalidArgument { field: "schedule", reason } if reason.contains("Mars/Olympus") && reason.contains("schedule \"default\"")),
        "{err:?}"
    );
    assert!(store.rows().is_empty());
}
