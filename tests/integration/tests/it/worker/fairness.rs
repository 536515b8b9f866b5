//! Fair across queues (SPEC §6 v2): one worker serving a queue with a large,
//! old backlog and slow handlers, and a queue whose timers fall due now. The claim takes
//! queues round robin and each queue's `max_concurrency` caps its share, so the second
//! queue's timers fire on time while the first drains.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::Utc;
use outbox::{message::Schedule, Context, Error, HandlerOptions, Message, Worker};
use outbox_tests::{eventually, Fixture};
use sqlx::AssertSqlSafe;

/// How long each run of the backlog's queue takes.
const SLOW: Duration = Duration::from_millis(500);
/// The backlog: rows of queue `a`, due an hour ago.
const BACKLOG: usize = 10_000;
/// Timers of queue `b`, published one by one while `a` drains.
const B_TIMERS: usize = 5;

#[tokio::test]
async fn a_backlog_of_slow_rows_does_not_delay_another_queue() {
    let f = Fixture::new().await;
    let t = f.outbox.table();
    let seed = format!(
        "INSERT INTO {t} (queue, payload, next_attempt_at) \
         SELECT 'a', 'x', now() - interval '1 hour' + i * interval '1 ms' \
         FROM generate_series(1, {BACKLOG}) i; ANALYZE {t}"
    );
    sqlx::raw_sql(AssertSqlSafe(seed))
        .execute(&f.pool)
        .await
        .unwrap();

    let a_running = Arc::new(AtomicUsize::new(0));
    let a_most = Arc::new(AtomicUsize::new(0));
    let a_done = Arc::new(AtomicUsize::new(0));
    let b_late: Arc<Mutex<Vec<Duration>>> = Arc::default();
    let worker = Worker::builder(f.store.clone())
        .concurrency(4)
        .queue_with(
            "a",
            {
                let (running, most, done) = (a_running.clone(), a_most.clone(), a_done.clone());
                move |_: Vec<u8>, _: Context| {
                    let (running, most, done) = (running.clone(), most.clone(), done.clone());
                    async move {
                        let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                        most.fetch_max(now, Ordering::SeqCst);
                        tokio::time::sleep(SLOW).await;
                        running.fetch_sub(1, Ordering::SeqCst);
                        done.fetch_add(1, Ordering::SeqCst);
                        Ok::<(), Error>(())
                    }
                }
            },
            HandlerOptions::new().max_concurrency(2),
        )
        .queue("b", {
            let late = b_late.clone();
            move |_: Vec<u8>, ctx: Context| {
                let late = late.clone();
                async move {
                    let behind = (Utc::now() - ctx.deadline()).to_std().unwrap_or_default();
                    late.lock().unwrap().push(behind);
                    Ok::<(), Error>(())
                }
            }
        })
        .build()
        .unwrap();
    let running = worker.start();

    // Let `a` fill what it may, then publish `b`'s timers one at a time.
    eventually(10, "queue a runs", || {
        let done = a_running.load(Ordering::SeqCst);
        async move { done > 0 }
    })
    .await;
    let mut conn = f.pool.acquire().await.unwrap();
    for i in 0..B_TIMERS {
        let body = format!("b{i}");
        f.outbox
            .publish(
                &mut conn,
                Message::new("b", body.as_bytes()).schedule(Schedule::now()),
            )
            .await
            .unwrap();
        tokio::time::sleep(SLOW).await;
    }
    eventually(10, "every timer of b fired", || {
        let n = b_late.lock().unwrap().len();
        async move { n == B_TIMERS }
    })
    .await;
    running.shutdown().await;

    let late = b_late.lock().unwrap().clone();
    // Without fairness each would wait for the whole backlog (10 000 × 500 ms / 2 slots);
    // with it, for a claim and a notification. Bound: 3 × one slow run.
    assert!(
        late.iter().all(|l| *l < SLOW * 3),
        "b's timers fired late: {late:?}"
    );
    assert_eq!(
        a_most.load(Ordering::SeqCst),
        2,
        "queue a never runs more than its max_concurrency, and uses it"
    );
    assert!(
        a_done.load(Ordering::SeqCst) > 0,
        "the backlog drains meanwhile"
    );
    f.cleanup().await;
}

#[tokio::test]
async fn max_concurrency_is_checked_when_the_worker_is_built() {
    let f = Fixture::new().await;
    for bad in [0, 10_001] {
        let built = Worker::builder(f.store.clone())
            .queue_with(
                "a",
                |_: Vec<u8>, _: Context| async { Ok::<(), Error>(()) },
                HandlerOptions::new().max_concurrency(bad),
            )
            .build();
        let Err(e) = built else {
            panic!("max_concurrency {bad} accepted")
        };
        assert!(
            matches!(&e, Error::InvalidConfig { knob, .. } if *knob == "max_concurrency"),
            "{e}"
        );
        assert!(e.to_string().contains("`a`"), "{e}");
    }
    f.cleanup().await;
}
