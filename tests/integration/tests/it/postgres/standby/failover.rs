//! A failover as a managed service does it: the primary stops, the standby is promoted and
//! takes over the primary's address (here its port). A worker pointed at that address,
//! never restarted, reconnects, runs every row committed before the switch exactly once,
//! and LISTENs again: with a 60 s `idle_poll` it stops polling (no statement of its own for
//! a while) and a publish still wakes it at once, which only a notification explains.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox::{PgStore, Worker};
use outbox_tests::eventually;
use sqlx::PgPool;

use super::{pool_at, Pair};

#[outbox::timer(queue = "standby.failover", max_deliveries = 5)]
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Job {
    n: i64,
}

const IDLE_POLL: Duration = Duration::from_secs(60);
/// The worker's cap between failed claims and between LISTEN tries.
const BACKOFF_CAP: Duration = Duration::from_secs(5);

/// Statements naming the outbox's table since the last reset of `pg_stat_statements`: the
/// worker's claims and deadline reads (the test's own queries name it only as a bind).
async fn worker_statements(pool: &PgPool, table: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT coalesce(sum(calls), 0)::bigint FROM pg_stat_statements \
         WHERE strpos(query, $1) > 0",
    )
    .bind(table)
    .fetch_one(pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn a_worker_reconnects_to_the_promoted_standby_and_listens_again() {
    let mut pair = Pair::start().await;
    let address = pair.primary.port();
    let pool = pool_at(address).await;
    let runs: Arc<Mutex<HashMap<i64, usize>>> = Arc::default();
    let worker = {
        let runs = runs.clone();
        Worker::builder(PgStore::new(pool.clone(), pair.outbox.clone()))
            .idle_poll(IDLE_POLL)
            .timer::<Job>(move |j: Job, _| {
                *runs.lock().unwrap().entry(j.n).or_default() += 1;
                async {}
            })
            .build()
            .unwrap()
            .start()
    };
    let ran = |n: i64| {
        let runs = runs.clone();
        move || {
            let done = runs.lock().unwrap().contains_key(&n);
            async move { done }
        }
    };
    let mut conn = pool.acquire().await.unwrap();
    publish_job(
        pair.outbox.on(&mut conn),
        "first",
        &Job { n: -1 },
        Duration::ZERO,
    )
    .await
    .unwrap();
    drop(conn);
    eventually(10, "the first row runs on the primary", ran(-1)).await;

    // Committed on the primary, due after the switch.
    const ROWS: i64 = 20;
    let mut conn = pool.acquire().await.unwrap();
    for n in 0..ROWS {
        publish_job(
            pair.outbox.on(&mut conn),
            &format!("j{n}"),
            &Job { n },
            Duration::from_secs(2),
        )
        .await
        .unwrap();
    }
    drop(conn);

    // The switch: no wait for the standby to catch up (a fast shutdown sends the WAL its
    // walsenders have not sent yet before it ends).
    pair.primary.stop("fast").unwrap();
    pair.standby.promote().unwrap();
    pair.standby.move_to_port(address).unwrap();
    let switched = Instant::now();
    let bound = 3 * BACKOFF_CAP + Duration::from_secs(2);
    eventually(
        bound.as_secs(),
        "every row committed before the switch runs",
        || {
            let done = runs.lock().unwrap().len() == ROWS as usize + 1;
            async move { done }
        },
    )
    .await;
    eprintln!("all rows ran {:?} after the switch", switched.elapsed());

    // Back on LISTEN: the 1 s polls of a worker without notifications stop. Look for a
    // quiet window of 2.5 s, within 3 × the LISTEN back-off cap.
    let server = pool_at(address).await;
    let table = pair.outbox.table().to_string();
    let table = table.trim_matches('"').to_owned();
    // The count sees a statement that names the table (so a zero below means none ran).
    sqlx::query("SELECT pg_stat_statements_reset()")
        .execute(&server)
        .await
        .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {}",
        pair.outbox.table()
    )))
    .execute(&server)
    .await
    .unwrap();
    assert!(worker_statements(&server, &table).await >= 1);
    let quiet_by = Instant::now() + 3 * BACKOFF_CAP + Duration::from_secs(5);
    loop {
        sqlx::query("SELECT pg_stat_statements_reset()")
            .execute(&server)
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(2500)).await;
        if worker_statements(&server, &table).await == 0 {
            break;
        }
        assert!(
            Instant::now() < quiet_by,
            "the worker still polls {:?} after the switch: no LISTEN",
            switched.elapsed()
        );
    }
    let mut conn = server.acquire().await.unwrap();
    let published = Instant::now();
    publish_job(
        pair.outbox.on(&mut conn),
        "after",
        &Job { n: 1000 },
        Duration::ZERO,
    )
    .await
    .unwrap();
    drop(conn);
    // A third of the idle poll: the worker slept, so the notification woke it.
    let wake_bound = IDLE_POLL / 3;
    eventually(
        wake_bound.as_secs(),
        "a notification wakes the worker",
        ran(1000),
    )
    .await;
    eprintln!("woken {:?} after the publish", published.elapsed());

    let report = worker.shutdown().await;
    assert!(report.graceful, "{report:?}");
    let runs = runs.lock().unwrap().clone();
    let duplicates: Vec<_> = runs.iter().filter(|(_, &c)| c != 1).collect();
    assert!(duplicates.is_empty(), "each row ran once: {duplicates:?}");
    assert_eq!(runs.len(), ROWS as usize + 2, "lost none: {runs:?}");
    let left: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {}",
        pair.outbox.table()
    )))
    .fetch_one(&server)
    .await
    .unwrap();
    assert_eq!(left, 0);
}
