//! The idle cost on a Citus cluster (issue 28 req 4): a worker with nothing due and 10⁴
//! rows an hour ahead sends no statement per shard of its own. Its look-ahead and its claim
//! are one statement each on the coordinator per wake-up, which Citus runs on every shard
//! (the read across the shards); between wake-ups it sleeps until the earliest deadline, a
//! notification or `idle_poll`.
//!
//! Measured as the calls `pg_stat_statements` counts (`.ci/citus` loads it on every node) of
//! the statements that name the test's table: on the coordinator the worker's own, on the
//! worker nodes the shard queries Citus sends for them. A count, not a speed.

use super::*;

/// Every node's database: the coordinator first, then the workers.
async fn nodes(f: &Fixture) -> Vec<PgPool> {
    let mut pools = vec![f.pool.clone()];
    for url in std::env::var("OUTBOX_CITUS_WORKERS")
        .expect("OUTBOX_CITUS_WORKERS")
        .split_whitespace()
    {
        pools.push(
            PgPoolOptions::new()
                .max_connections(1)
                .connect(url)
                .await
                .expect("connect to a worker node"),
        );
    }
    pools
}

/// Calls so far, on each node, of the statements whose text names `table` (a shard's name
/// is the table's with a suffix).
async fn statements(nodes: &[PgPool], table: &str) -> Vec<i64> {
    let mut out = Vec::new();
    for pool in nodes {
        out.push(
            sqlx::query_scalar(
                "SELECT coalesce(sum(calls), 0)::bigint FROM pg_stat_statements \
                 WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) \
                   AND strpos(query, $1) > 0",
            )
            .bind(table)
            .fetch_one(pool)
            .await
            .expect("pg_stat_statements (.ci/citus loads it)"),
        );
    }
    out
}

/// Statements per second on each node over `window`.
async fn rate(nodes: &[PgPool], table: &str, window: Duration) -> Vec<f64> {
    let before = statements(nodes, table).await;
    tokio::time::sleep(window).await;
    let after = statements(nodes, table).await;
    before
        .iter()
        .zip(&after)
        .map(|(b, a)| (a - b) as f64 / window.as_secs_f64())
        .collect()
}

fn idle_worker(f: &Fixture, idle_poll: Option<Duration>) -> outbox::RunningWorker {
    let mut b = Worker::builder(f.store.clone()).queue("later", |_: Vec<u8>, _: Context| async {
        Ok::<(), Error>(())
    });
    if let Some(p) = idle_poll {
        b = b.idle_poll(p);
    }
    b.build().unwrap().start()
}

#[tokio::test]
#[ignore = "needs a Citus cluster: .ci/citus -- cargo nextest run --run-ignored only -E 'test(/citus/)'"]
async fn an_idle_worker_over_ten_thousand_future_rows_costs_no_statement_per_shard() {
    let f = cluster().await;
    // 10⁴ rows an hour ahead, 16 batches of 625 spread round robin over the 16 buckets.
    let mut conn = f.pool.acquire().await.unwrap();
    let payloads: Vec<Vec<u8>> = (0..625).map(|i| format!("{i}").into_bytes()).collect();
    let items: Vec<outbox::message::BatchItem<'_>> = payloads
        .iter()
        .map(|p| outbox::message::BatchItem::new(p))
        .collect();
    for _ in 0..CITUS_BUCKETS {
        f.outbox
            .publish_batch(
                &mut conn,
                "later",
                &items,
                outbox::message::Schedule::after(Duration::from_secs(3600)),
            )
            .await
            .unwrap();
    }
    drop(conn);
    let nodes = nodes(&f).await;
    // The table's name as it appears in every statement, shards included.
    let table = f
        .outbox
        .table()
        .rsplit('.')
        .next()
        .unwrap()
        .trim_matches('"')
        .to_owned();
    let window = Duration::from_secs(8);

    // A default worker (idle_poll 30 s): it claims once, finds nothing due, and sleeps
    // until the deadline an hour ahead or a notification.
    let worker = idle_worker(&f, None);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let idle = rate(&nodes, &table, window).await;
    assert!(worker.shutdown().await.graceful);

    // A worker that wakes every second: the cost of one wake-up, spread over the shards.
    let worker = idle_worker(&f, Some(Duration::from_secs(1)));
    tokio::time::sleep(Duration::from_secs(2)).await;
    let polling = rate(&nodes, &table, window).await;
    assert!(worker.shutdown().await.graceful);

    eprintln!(
        "statements/s naming the table (coordinator, worker 1, worker 2): default worker {idle:.2?}; \
         idle_poll 1 s {polling:.2?}"
    );
    // The default idle worker: at most the gate's bound for a single node, 10 statements/s,
    // on the whole cluster.
    assert!(
        idle.iter().sum::<f64>() <= 10.0,
        "an idle default worker costs {idle:.2?} statements/s"
    );
    // Waking every second, the coordinator sees the worker's few statements per wake-up
    // (the claim's read for buckets with work and the look-ahead), not one per shard (8
    // shards, 16 buckets). The count is not zero: the measure sees the wake-ups.
    assert!(
        (0.5..=6.0).contains(&polling[0]),
        "the coordinator: {:.2} statements/s for one wake-up a second",
        polling[0]
    );
    f.cleanup().await;
}
