//! Fair across queues (SPEC §6 v2): one worker serving a queue with a large,
//! old backlog and slow handlers, and a queue whose timers fall due now. The claim takes
//! queues round robin and each queue's `max_concurrency` caps its share, so the second
//! queue's timers fire on time while the first drains.
//!
//! Fair across claims (SPEC §6 v3, issue 26): with `concurrency(1)` and
//! `fetch_batch_size(1)` (the sizing for slow handlers) a claim takes one row, so the order
//! of the runs is the order of the claims; each claim resumes after the queue the previous
//! one ended on, so a queue's fresh row runs within `n` claims (`n` queues), not after
//! another queue's backlog. Also with two workers, each rotating on its own.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::Utc;
use outbox::{message::Schedule, Context, Error, HandlerOptions, Message, PgStore, Worker};
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

/// Inserts `n` rows of `queue` with payloads `<queue>1..=<queue>n`, the first due `ago`
/// (a Postgres interval) before now and each next one a millisecond later.
async fn seed(f: &Fixture, queue: &str, n: usize, ago: &str) {
    let t = f.outbox.table();
    let sql = format!(
        "INSERT INTO {t} (queue, payload, next_attempt_at) \
         SELECT '{queue}', convert_to('{queue}' || i, 'UTF8'), \
                now() - interval '{ago}' + i * interval '1 ms' \
         FROM generate_series(1, {n}) i"
    );
    sqlx::raw_sql(AssertSqlSafe(sql))
        .execute(&f.pool)
        .await
        .unwrap();
}

/// The labels (payloads) of the runs, in the order they started, each with the worker
/// (`who`) that ran it.
type Runs = Arc<Mutex<Vec<(usize, String)>>>;

/// A worker with one slot and one row per claim serving `queues`, whose handlers record
/// each run in `runs` as worker `who` and take `each`.
fn one_by_one(
    store: &PgStore,
    queues: &[&str],
    runs: &Runs,
    who: usize,
    each: Duration,
) -> Worker<PgStore> {
    let mut b = Worker::builder(store.clone())
        .concurrency(1)
        .fetch_batch_size(1);
    for q in queues {
        let runs = runs.clone();
        b = b.queue(*q, move |payload: Vec<u8>, _: Context| {
            let runs = runs.clone();
            async move {
                let label = String::from_utf8(payload).unwrap();
                runs.lock().unwrap().push((who, label));
                tokio::time::sleep(each).await;
                Ok::<(), Error>(())
            }
        });
    }
    b.build().unwrap()
}

fn position(runs: &[(usize, String)], label: &str) -> Option<usize> {
    runs.iter().position(|(_, l)| l == label).map(|i| i + 1)
}

/// Issue 26's case, as a new user would try it: one worker, `concurrency(1)`,
/// `fetch_batch_size(1)`; `a` holds 30 rows due ten minutes ago, `b` one row due now. `b`'s
/// row runs 2nd of 31 (it ran 31st when every claim began with the oldest queue), and `a`'s
/// rows run in deadline order around it.
#[tokio::test]
async fn one_row_a_claim_a_fresh_row_runs_second_not_after_the_backlog() {
    let f = Fixture::new().await;
    seed(&f, "a", 30, "10 minutes").await;
    seed(&f, "b", 1, "0 seconds").await;
    let runs: Runs = Arc::default();
    let running = one_by_one(&f.store, &["a", "b"], &runs, 0, Duration::ZERO).start();
    eventually(30, "all 31 rows ran", || {
        let n = runs.lock().unwrap().len();
        async move { n == 31 }
    })
    .await;
    running.shutdown().await;
    let runs = runs.lock().unwrap().clone();
    assert_eq!(position(&runs, "b1"), Some(2), "{runs:?}");
    let a: Vec<&str> = runs
        .iter()
        .map(|(_, l)| l.as_str())
        .filter(|l| l.starts_with('a'))
        .collect();
    let want: Vec<String> = (1..=30).map(|i| format!("a{i}")).collect();
    assert_eq!(a, want, "a's backlog by deadline");
    f.cleanup().await;
}

/// `run_due` claims in rounds of `fetch_batch_size` and rotates the same way.
#[tokio::test]
async fn run_due_rotates_its_claims_too() {
    let f = Fixture::new().await;
    seed(&f, "a", 30, "10 minutes").await;
    seed(&f, "b", 1, "0 seconds").await;
    let runs: Runs = Arc::default();
    let worker = one_by_one(&f.store, &["a", "b"], &runs, 0, Duration::ZERO);
    let done = worker.run_due().await.unwrap();
    let order: Vec<&str> = done.iter().map(|d| d.delivery.queue.as_str()).collect();
    assert_eq!(order.len(), 31);
    assert_eq!(
        order.iter().position(|q| *q == "b"),
        Some(1),
        "b's row is run_due's 2nd: {order:?}"
    );
    f.cleanup().await;
}

/// A row of `b` that falls due while the worker drains `a`'s backlog runs within the next
/// few runs: the row running, the one claimed and waiting for the slot, at most one claim
/// that began before the publish committed, then `b`'s.
#[tokio::test]
async fn a_row_falling_due_during_a_backlog_runs_within_the_next_claims() {
    /// Each run of the backlog: 30 of them take 1.2 s, far longer than the few runs the
    /// bound allows.
    const EACH: Duration = Duration::from_millis(40);
    let f = Fixture::new().await;
    seed(&f, "a", 30, "10 minutes").await;
    let runs: Runs = Arc::default();
    let running = one_by_one(&f.store, &["a", "b"], &runs, 0, EACH).start();
    eventually(30, "five runs of a", || {
        let n = runs.lock().unwrap().len();
        async move { n >= 5 }
    })
    .await;
    let before = runs.lock().unwrap().len();
    let mut conn = f.pool.acquire().await.unwrap();
    f.outbox
        .publish(
            &mut conn,
            Message::new("b", b"b1").schedule(Schedule::now()),
        )
        .await
        .unwrap();
    eventually(30, "b's row ran", || {
        let ran = position(&runs.lock().unwrap(), "b1").is_some();
        async move { ran }
    })
    .await;
    running.shutdown().await;
    let runs = runs.lock().unwrap().clone();
    let b = position(&runs, "b1").unwrap();
    assert!(
        b <= before + 4,
        "b's row ran {}th after {before} runs, more than 3 runs after it fell due: {runs:?}",
        b
    );
    assert!(runs.len() < 31, "the backlog had not drained: {runs:?}");
    f.cleanup().await;
}

/// Two workers, each with one slot and one row per claim, serving `a` (30 rows due ten
/// minutes ago), `b` (30 rows due five minutes ago) and `c` (one row due now). Each worker
/// rotates on its own: its claims take `a`, then `b`, then `c`, unless the other worker
/// holds the row, so `c`'s row is among the first 3 (the number of queues) of the worker
/// that runs it, and runs long before the backlogs drain.
#[tokio::test]
async fn two_workers_each_reach_a_fresh_queue_within_n_claims() {
    /// Each run of the backlogs: 60 of them on two workers take 1.5 s.
    const EACH: Duration = Duration::from_millis(50);
    let f = Fixture::new().await;
    seed(&f, "a", 30, "10 minutes").await;
    seed(&f, "b", 30, "5 minutes").await;
    seed(&f, "c", 1, "0 seconds").await;
    let runs: Runs = Arc::default();
    let queues = ["a", "b", "c"];
    let first = one_by_one(&f.store, &queues, &runs, 1, EACH).start();
    let second = one_by_one(&f.store, &queues, &runs, 2, EACH).start();
    eventually(30, "c's row ran", || {
        let ran = position(&runs.lock().unwrap(), "c1").is_some();
        async move { ran }
    })
    .await;
    first.shutdown().await;
    second.shutdown().await;
    let runs = runs.lock().unwrap().clone();
    let at = position(&runs, "c1").unwrap();
    let who = runs[at - 1].0;
    let its: Vec<&str> = runs
        .iter()
        .filter(|(w, _)| *w == who)
        .map(|(_, l)| l.as_str())
        .collect();
    let k = its.iter().position(|l| *l == "c1").unwrap() + 1;
    assert!(
        k <= queues.len(),
        "worker {who} claimed c's row with its claim {k}, not within {}: {runs:?}",
        queues.len()
    );
    // The other worker runs meanwhile, at the same pace: a handful of rows, not 60.
    assert!(at <= 10, "c's row ran {at}th overall: {runs:?}");
    f.cleanup().await;
}
