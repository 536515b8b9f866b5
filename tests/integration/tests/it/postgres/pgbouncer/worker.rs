//! Workers through PgBouncer in transaction mode (SPEC §13, §7): a poll-only worker claims,
//! acks, retries and dead-letters; a handler's own transaction commits its writes with its
//! row's completion.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use outbox::dlq::DeadLetterFilter;
use outbox::store::{ClaimRequest, Renewal, Store};
use outbox::{Context, Error, HandlerOptions, Message, Outcome, RetryStrategy, Worker};
use outbox_tests::eventually;
use sqlx::AssertSqlSafe;

use super::Through;

/// A poll-only worker (`listen(false)`) over a store through the pooler runs 40 rows
/// published through it while it works: the successes are deleted, a row that keeps
/// failing is retried and then archived as a dead letter, and nothing is left.
#[tokio::test]
async fn a_poll_only_worker_processes_rows_through_pgbouncer() {
    let t = Through::new(8).await;
    let runs = Arc::new(AtomicUsize::new(0));
    let failing = Arc::new(AtomicUsize::new(0));
    let worker = {
        let (runs, failing) = (runs.clone(), failing.clone());
        Worker::builder(t.store.clone())
            .listen(false)
            .idle_poll(Duration::from_millis(100))
            .concurrency(3)
            .queue("pgb.ok", move |_: Vec<u8>, _ctx: Context| {
                runs.fetch_add(1, Ordering::SeqCst);
                async {}
            })
            .queue_with(
                "pgb.fail",
                move |_: Vec<u8>, _ctx: Context| {
                    failing.fetch_add(1, Ordering::SeqCst);
                    async { Outcome::Retry("always fails".to_owned()) }
                },
                HandlerOptions::new().retry(
                    RetryStrategy::exponential(Duration::from_millis(50), 1.0).max_attempts(2),
                ),
            )
            .build()
            .unwrap()
            .start()
    };
    let mut conn = t.pooled.acquire().await.unwrap();
    for _ in 0..40 {
        t.outbox
            .publish(&mut conn, Message::new("pgb.ok", b"x"))
            .await
            .unwrap();
    }
    t.outbox
        .publish(&mut conn, Message::new("pgb.fail", b"f"))
        .await
        .unwrap();
    drop(conn);
    eventually(30, "every row is done", || async {
        runs.load(Ordering::SeqCst) >= 40
            && t.rows("pgb.ok").await.is_empty()
            && t.rows("pgb.fail").await.is_empty()
    })
    .await;
    let shutdown = worker.shutdown().await;
    assert!(shutdown.graceful, "{shutdown:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 40, "each row once");
    assert_eq!(failing.load(Ordering::SeqCst), 2, "two attempts");
    let letters = t
        .store
        .dead_letters(&DeadLetterFilter::new().queue("pgb.fail"), None, 10)
        .await
        .unwrap();
    assert_eq!(letters.len(), 1, "{letters:?}");
    t.cleanup().await;
}

/// A handler's own transaction (`ctx.begin()`) through the pooler: its write (unnamed, as
/// the deployment guide says) and its row's completion commit together, for every row.
#[tokio::test]
async fn a_handler_transaction_commits_through_pgbouncer() {
    let t = Through::new(8).await;
    let effects = format!("\"{}_effects\"", t.outbox.table().trim_matches('"'));
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE {effects} (n bigint PRIMARY KEY)"
    )))
    .execute(&t.direct)
    .await
    .unwrap();
    let worker = {
        let insert = format!("INSERT INTO {effects} (n) VALUES ($1)");
        Worker::builder(t.store.clone())
            .listen(false)
            .idle_poll(Duration::from_millis(100))
            .concurrency(3)
            .queue("pgb.tx", move |payload: Vec<u8>, ctx: Context| {
                let insert = insert.clone();
                async move {
                    let n: i64 = String::from_utf8(payload).unwrap().parse().unwrap();
                    let mut tx = ctx.begin().await?;
                    sqlx::query(AssertSqlSafe(insert))
                        .persistent(false)
                        .bind(n)
                        .execute(&mut *tx)
                        .await?;
                    tx.commit().await?;
                    Ok::<_, Error>(())
                }
            })
            .build()
            .unwrap()
            .start()
    };
    let mut conn = t.pooled.acquire().await.unwrap();
    for n in 0..20 {
        let payload = n.to_string();
        t.outbox
            .publish(&mut conn, Message::new("pgb.tx", payload.as_bytes()))
            .await
            .unwrap();
    }
    drop(conn);
    let count = || async {
        sqlx::query_scalar::<_, i64>(AssertSqlSafe(format!("SELECT count(*) FROM {effects}")))
            .fetch_one(&t.direct)
            .await
            .unwrap()
    };
    eventually(30, "every handler committed", || async {
        count().await == 20 && t.rows("pgb.tx").await.is_empty()
    })
    .await;
    assert!(worker.shutdown().await.graceful);
    sqlx::raw_sql(AssertSqlSafe(format!("DROP TABLE {effects}")))
        .execute(&t.direct)
        .await
        .unwrap();
    t.cleanup().await;
}

/// The store's fenced writes keep their short `lock_timeout` through the pooler (`SET
/// LOCAL` in their transaction): a lease renewal that meets a row an application
/// transaction holds reports it busy after about 200 ms (bounded here at 3 s) instead of
/// waiting for that transaction, and renews once the lock is gone. Without the knob the
/// store's second pool cannot connect at all: PgBouncer refuses its `lock_timeout`
/// startup parameter.
#[tokio::test]
async fn fenced_writes_keep_their_lock_timeout_through_pgbouncer() {
    let t = Through::new(8).await;
    let q = "pgb.lock".to_owned();
    let mut conn = t.pooled.acquire().await.unwrap();
    t.outbox
        .publish(&mut conn, Message::new(&q, b"x"))
        .await
        .unwrap();
    drop(conn);
    let queues = [q.clone()];
    let claimed = t
        .store
        .claim(ClaimRequest::new(&queues, 1, Duration::from_secs(60)))
        .await
        .unwrap();
    assert_eq!(claimed.len(), 1);
    let lease = claimed[0].lease;

    // An application transaction, straight to the server, holds the row's lock.
    let mut holder = t.direct.begin().await.unwrap();
    sqlx::query(AssertSqlSafe(format!(
        "SELECT 1 FROM {} WHERE id = $1 FOR UPDATE",
        t.outbox.table()
    )))
    .bind(lease.id)
    .execute(&mut *holder)
    .await
    .unwrap();
    let renewed = tokio::time::timeout(Duration::from_secs(3), t.store.renew(&[lease]))
        .await
        .expect("the renewal gives up on the lock instead of waiting")
        .unwrap();
    assert_eq!(renewed, [Renewal::Busy]);
    holder.commit().await.unwrap();
    assert_eq!(t.store.renew(&[lease]).await.unwrap(), [Renewal::Renewed]);

    let plain_store = outbox::PgStore::new(t.pooled.clone(), t.plain.clone());
    let refused = plain_store
        .renew(&[lease])
        .await
        .expect_err("the fenced pool's startup parameter is refused");
    assert!(
        refused
            .to_string()
            .contains("unsupported startup parameter"),
        "{refused}"
    );
    t.cleanup().await;
}
