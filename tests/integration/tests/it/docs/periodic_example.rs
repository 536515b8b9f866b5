//! The example of the guide's "Periodic timers" page (`docs/guide/periodic.md`), verbatim
//! (`docs::readme` checks the page's block is this file's code), run in virtual time on the
//! in-memory store: a day of its three schedules, and its nightly cron schedule on the two
//! DST days the page describes.

use outbox::periodic::Recurrence;
use outbox::store::Store;
use outbox::{Context, Worker};

// Declared on the type: every 5 minutes, as the timer `schedule:default` of the queue
// `maintenance`. Each run gets `PurgeSessions::default()`.
#[outbox::timer(queue = "maintenance", max_deliveries = 3, every = "5m")]
#[derive(Default, serde::Serialize, serde::Deserialize)]
pub struct PurgeSessions;

// Registered on the worker: any number of schedules per type, by name.
#[outbox::timer(queue = "reports", max_deliveries = 3)]
#[derive(serde::Serialize, serde::Deserialize)]
pub struct Report {
    pub kind: String,
}

async fn purge_sessions(_job: PurgeSessions, _ctx: Context) -> Result<(), outbox::Error> {
    Ok(()) // your logic
}

async fn send_report(report: Report, _ctx: Context) -> Result<(), outbox::Error> {
    println!("sending the {} report", report.kind); // your logic
    Ok(())
}

/// A `PgStore` in production, a `MemoryStore` in tests.
pub fn scheduled_worker<S: Store>(store: S) -> Result<Worker<S>, outbox::Error> {
    let report = |kind: &str| Report {
        kind: kind.to_owned(),
    };
    Worker::builder(store)
        // Handling the type is enough for its declared schedule.
        .timer::<PurgeSessions>(purge_sessions)
        .timer::<Report>(send_report)
        .schedule("hourly", Recurrence::parse_every("1h")?, report("summary"))
        .schedule(
            "nightly",
            Recurrence::cron("0 0 2 * * *", "Europe/Berlin")?, // feature `cron`
            report("full"),
        )
        .build()
}

// What follows is not on the page: the checks of what it says.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use outbox::testing::MemoryStore;

/// The deadlines each `(queue, timer_id)` ran at from `from` to `from + minutes`, in
/// one-minute steps of the virtual clock (the first `run_due` registers the schedules).
async fn fired(
    from: DateTime<Utc>,
    minutes: u32,
) -> BTreeMap<(String, String), Vec<DateTime<Utc>>> {
    let store = MemoryStore::starting_at(from);
    let worker = scheduled_worker(store.clone()).unwrap();
    assert!(worker.run_due().await.unwrap().is_empty());
    let mut out: BTreeMap<_, Vec<_>> = BTreeMap::new();
    for _ in 0..minutes {
        store.advance(Duration::from_secs(60));
        for run in worker.run_due().await.unwrap() {
            assert_eq!(run.decision, outbox::worker::Decision::Ack, "{run:?}");
            let key = (run.delivery.queue.clone(), run.delivery.timer_id.unwrap());
            out.entry(key).or_default().push(run.delivery.deadline);
        }
    }
    assert_eq!(store.rows().len(), 3, "one live row per schedule");
    out
}

fn at(text: &str) -> DateTime<Utc> {
    text.parse().unwrap()
}

fn key(queue: &str, timer_id: &str) -> (String, String) {
    (queue.to_owned(), timer_id.to_owned())
}

/// A winter day from midnight UTC: 288 five-minute runs, 24 hourly ones, and the nightly
/// one at 02:00 in Berlin (CET, 01:00 UTC).
#[tokio::test]
async fn a_day_of_the_readme_schedules() {
    let start = at("2026-01-10T00:00:00Z");
    let fired = fired(start, 24 * 60).await;
    assert_eq!(fired.len(), 3, "{fired:?}");
    let purge = &fired[&key("maintenance", "schedule:default")];
    assert_eq!(purge.len(), 288);
    assert!(purge
        .iter()
        .enumerate()
        .all(|(k, d)| *d == start + TimeDelta::minutes(5 * (k as i64 + 1))));
    let hourly = &fired[&key("reports", "schedule:hourly")];
    assert_eq!(hourly.len(), 24);
    assert_eq!(
        fired[&key("reports", "schedule:nightly")],
        [at("2026-01-10T01:00:00Z")]
    );
}

/// The page's DST rules for the nightly 02:00 Berlin schedule: on 29 March 2026 02:00
/// does not exist and the run is at 03:00 CEST (01:00 UTC); on 25 October 2026 02:00 occurs
/// twice and the run is once, at the first occurrence (CEST, 00:00 UTC). Each day before
/// and after keeps its 02:00.
#[tokio::test]
async fn the_nightly_schedule_on_the_dst_days() {
    let nightly = key("reports", "schedule:nightly");
    let spring = fired(at("2026-03-27T12:00:00Z"), 3 * 24 * 60).await;
    assert_eq!(
        spring[&nightly],
        [
            at("2026-03-28T01:00:00Z"), // 02:00 CET
            at("2026-03-29T01:00:00Z"), // 03:00 CEST: 02:00 does not exist
            at("2026-03-30T00:00:00Z"), // 02:00 CEST
        ]
    );
    let autumn = fired(at("2026-10-23T12:00:00Z"), 3 * 24 * 60).await;
    assert_eq!(
        autumn[&nightly],
        [
            at("2026-10-24T00:00:00Z"), // 02:00 CEST
            at("2026-10-25T00:00:00Z"), // 02:00 CEST, the first of two 02:00s
            at("2026-10-26T01:00:00Z"), // 02:00 CET
        ]
    );
    // An interval is a step of real time: 24 hourly runs a day, 25 hours of wall clock on
    // the autumn day included.
    assert_eq!(autumn[&key("reports", "schedule:hourly")].len(), 3 * 24);
}
