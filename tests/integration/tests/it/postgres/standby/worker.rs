//! A started worker pointed at a standby: its claims fail with `Error::ReadOnly`, counted
//! in `outbox_claim_errors_total{error="ReadOnly"}`, with a back-off between tries (capped
//! at 5 s) instead of a hot loop; its LISTEN is refused too (SQLSTATE 25006, "cannot execute
//! LISTEN during recovery") and keeps being retried. Once the standby is promoted the same
//! worker, never restarted, runs the rows within 3 × the 5 s cap and LISTENs again.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use outbox::{PgStore, Worker};
use outbox_tests::{count_runs, eventually};

use super::{pool_at, Pair};

#[outbox::timer(queue = "standby.work", max_deliveries = 5)]
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Work {
    n: i64,
}

/// The worker's cap between failed claims (`worker/shared.rs`'s `backoff`).
const BACKOFF_CAP: Duration = Duration::from_secs(5);

/// Claim errors by their `error` label, accumulated (a snapshot drains counters).
fn claim_errors(s: &Snapshotter, seen: &mut HashMap<String, u64>) {
    for (key, _, _, value) in s.snapshot().into_vec() {
        if key.key().name() != "outbox_claim_errors_total" {
            continue;
        }
        let label = key
            .key()
            .labels()
            .find(|l| l.key() == "error")
            .map(|l| l.value().to_owned())
            .unwrap_or_default();
        if let DebugValue::Counter(c) = value {
            *seen.entry(label).or_default() += c;
        }
    }
}

#[tokio::test]
async fn a_worker_on_a_standby_backs_off_then_resumes_once_it_is_promoted() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _local = metrics::set_default_local_recorder(&recorder);

    let pair = Pair::start().await;
    let primary = pool_at(pair.primary.port()).await;
    const ROWS: i64 = 5;
    let mut conn = primary.acquire().await.unwrap();
    for n in 0..ROWS {
        publish_work(
            pair.outbox.on(&mut conn),
            &format!("w{n}"),
            &Work { n },
            Duration::ZERO,
        )
        .await
        .unwrap();
    }
    drop(conn);
    pair.replayed().await;

    let standby = pool_at(pair.standby.port()).await;
    let runs = Arc::new(AtomicUsize::new(0));
    let worker = Worker::builder(PgStore::new(standby.clone(), pair.outbox.clone()))
        .idle_poll(Duration::from_millis(200))
        .timer::<Work>(count_runs(&runs))
        .build()
        .unwrap()
        .start();

    // Three seconds on the standby: every claim refused, a few tries, none of them a run.
    let watched = Duration::from_secs(3);
    tokio::time::sleep(watched).await;
    let mut errors = HashMap::new();
    claim_errors(&snapshotter, &mut errors);
    let read_only = errors.get("ReadOnly").copied().unwrap_or(0);
    // Back-off 0.1, 0.2, 0.4, 0.8, 1.6 s…: about 5 tries in 3 s; a loop without it makes
    // thousands. Allow twice the schedule's count for a slow machine's timing.
    assert!(
        (2..=12).contains(&read_only),
        "claim errors in {watched:?} on a standby: {errors:?}"
    );
    assert_eq!(errors.len(), 1, "only ReadOnly: {errors:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 0, "nothing runs on a standby");
    // The LISTEN connection keeps trying (with its own back-off, also capped at 5 s).
    let refused = pair
        .standby
        .log()
        .matches("cannot execute LISTEN during recovery")
        .count();
    assert!(
        (2..=12).contains(&refused),
        "LISTEN tries refused in {watched:?}: {refused}"
    );

    // The primary goes away and the standby is promoted; the worker is left as it is.
    pair.primary.stop("fast").unwrap();
    let promoted = Instant::now();
    pair.standby.promote().unwrap();
    assert!(!pair.standby.in_recovery().await.unwrap());
    let bound = 3 * BACKOFF_CAP;
    eventually(
        bound.as_secs(),
        "the rows run after the promotion",
        || async { runs.load(Ordering::SeqCst) == ROWS as usize },
    )
    .await;
    let resumed = promoted.elapsed();
    eprintln!("resumed {resumed:?} after the promotion");

    // Exactly once each, and the table is empty once the acks are written (shutdown waits
    // for them).
    let report = worker.shutdown().await;
    assert!(report.graceful, "{report:?}");
    let left: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {}",
        pair.outbox.table()
    )))
    .fetch_one(&standby)
    .await
    .unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), ROWS as usize);
    assert_eq!(left, 0, "every row acked on the promoted server");
}

/// A worker with a periodic schedule registers it before its first claim; on a standby the
/// registration is refused (`ReadOnly`) and retried with the same back-off, so once the
/// standby is promoted the schedule registers and runs, without a restart.
#[tokio::test]
async fn a_schedule_registers_once_the_standby_is_promoted() {
    let pair = Pair::start().await;
    let standby = pool_at(pair.standby.port()).await;
    let ticks = Arc::new(AtomicUsize::new(0));
    let worker = Worker::builder(PgStore::new(standby.clone(), pair.outbox.clone()))
        .idle_poll(Duration::from_millis(200))
        .timer::<Work>(count_runs(&ticks))
        .schedule(
            "tick",
            outbox::periodic::Recurrence::parse_every("1s").unwrap(),
            Work { n: 99 },
        )
        .build()
        .unwrap()
        .start();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        ticks.load(Ordering::SeqCst),
        0,
        "nothing registers on a standby"
    );

    pair.primary.stop("fast").unwrap();
    pair.standby.promote().unwrap();
    // The back-off cap, three times, plus the schedule's own second.
    let bound = 3 * BACKOFF_CAP + Duration::from_secs(1);
    eventually(
        bound.as_secs(),
        "the schedule runs after the promotion",
        || async { ticks.load(Ordering::SeqCst) >= 1 },
    )
    .await;
    let report = worker.shutdown().await;
    assert!(report.graceful, "{report:?}");
}
