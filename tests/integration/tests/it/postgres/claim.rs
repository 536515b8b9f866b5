//! Claiming (SPEC §6): one statement, both partial indexes, ordering, limit, reclaim.

use sqlx::AssertSqlSafe;
use std::time::Duration;

use chrono::{TimeDelta, Utc};
use outbox::{
    store::{ClaimRequest, Store},
    Message,
};
use outbox_tests::Fixture;

const TTL: Duration = Duration::from_secs(60);

#[tokio::test]
async fn claim_orders_limits_filters_and_reclaims() {
    let f = Fixture::new().await;
    let mut conn = f.pool.acquire().await.unwrap();
    let now = Utc::now();
    // Distinct deadlines, oldest last inserted, two queues, one future row.
    for (q, secs, body) in [
        ("a", -1, "a1"),
        ("a", -3, "a3"),
        ("b", -2, "b2"),
        ("a", 3600, "future"),
    ] {
        let m = Message::new(q, body.as_bytes()).schedule(now + TimeDelta::seconds(secs));
        f.outbox.publish(&mut conn, m).await.unwrap();
    }
    let qs = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert!(
        f.store
            .claim(ClaimRequest::new(&[], 10, TTL))
            .await
            .unwrap()
            .is_empty(),
        "empty queue list"
    );

    let got = f
        .store
        .claim(ClaimRequest::new(&qs(&["a", "b"]), 2, TTL))
        .await
        .unwrap();
    let bodies: Vec<_> = got
        .iter()
        .map(|d| String::from_utf8(d.payload.clone()).unwrap())
        .collect();
    assert_eq!(
        bodies,
        ["a3", "b2"],
        "the oldest due rows across served queues, in deadline order"
    );
    assert_eq!(
        got[0].lease.token, got[1].lease.token,
        "one token per claim"
    );
    assert!(got
        .iter()
        .all(|d| d.deliveries_count == 1 && d.attempts_count == 0));

    let got = f
        .store
        .claim(ClaimRequest::new(&qs(&["b"]), 10, TTL))
        .await
        .unwrap();
    assert!(got.is_empty(), "queue filter: b has nothing left");
    let got = f
        .store
        .claim(ClaimRequest::new(&qs(&["a", "b"]), 10, TTL))
        .await
        .unwrap();
    assert_eq!(
        got.len(),
        1,
        "the future row is not claimed, fresh leases are not reclaimed"
    );
    assert_eq!(got[0].payload, b"a1");

    // Expired leases come back with a new token and deliveries_count 2.
    let sql = format!(
        "UPDATE {} SET acquired_at = acquired_at - interval '2 minutes' WHERE payload = 'a3'",
        f.outbox.table()
    );
    sqlx::query(AssertSqlSafe(&*sql))
        .execute(&f.pool)
        .await
        .unwrap();
    let again = f
        .store
        .claim(ClaimRequest::new(&qs(&["a"]), 10, TTL))
        .await
        .unwrap();
    assert_eq!(again.len(), 1);
    assert_eq!(
        (again[0].payload.as_slice(), again[0].deliveries_count),
        (&b"a3"[..], 2)
    );
    assert_ne!(again[0].lease.token, got[0].lease.token);
    let row = f
        .rows("a")
        .await
        .into_iter()
        .find(|r| r.payload == b"a3")
        .unwrap();
    assert_eq!(row.acquired_token, Some(again[0].lease.token));
    assert_eq!(row.acquired_at, Some(again[0].claimed_at));
    f.cleanup().await;
}

/// Both branches must use their partial index; a 100 000-row backlog must not be scanned.
#[tokio::test]
async fn claim_plan_uses_both_partial_indexes_on_a_large_backlog() {
    let f = Fixture::new().await;
    let t = f.outbox.table();
    let seed = format!(
        "INSERT INTO {t} (queue, payload, next_attempt_at) \
           SELECT 'q' || (i % 4), 'x', now() - (i || ' seconds')::interval FROM generate_series(1, 100000) i; \
         INSERT INTO {t} (queue, payload, acquired_at, acquired_token) \
           SELECT 'q' || (i % 4), 'y', now() - interval '1 hour', gen_random_uuid() FROM generate_series(1, 5000) i; \
         ANALYZE {t}"
    );
    sqlx::raw_sql(AssertSqlSafe(&*seed))
        .execute(&f.pool)
        .await
        .unwrap();
    let explain = format!("EXPLAIN {}", f.outbox.claim_sql());
    let queues = vec!["q0".to_owned(), "q1".to_owned()];
    let plan: Vec<String> = sqlx::query_scalar(AssertSqlSafe(&*explain))
        .bind(&queues)
        .bind(10i64)
        .bind(sqlx::postgres::types::PgInterval {
            months: 0,
            days: 0,
            microseconds: 60_000_000,
        })
        .bind(uuid::Uuid::new_v4())
        .bind(Vec::<i64>::new())
        .bind(vec![10i64, 10])
        .fetch_all(&f.pool)
        .await
        .unwrap();
    let plan = plan.join("\n");
    let name = t.trim_matches('"');
    // The queue table by its exact name: PostgreSQL 16 and later may read `<t>_paused` (a
    // row per paused queue, none of the backlog) with a sequential scan, as the outer side
    // of a hash right anti join (a join type new in 16); the prefix `{name}` matches it.
    let scanned: Vec<&str> = plan
        .lines()
        .map(|l| l.trim_start())
        .map(|l| l.strip_prefix("->  ").unwrap_or(l))
        .filter_map(|l| l.strip_prefix("Seq Scan on "))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert!(
        !scanned.contains(&name),
        "sequential scan of the queue table in:\n{plan}"
    );
    assert!(
        plan.contains(&format!("{name}_pending_idx")),
        "pending branch without its index:\n{plan}"
    );
    assert!(
        plan.contains(&format!("{name}_lease_idx")),
        "reclaim branch without its index:\n{plan}"
    );

    // And it claims the right rows: the oldest pending ones (i = 100000 is the oldest).
    let got = f
        .store
        .claim(ClaimRequest::new(&queues, 10, TTL))
        .await
        .unwrap();
    assert_eq!(got.len(), 10);
    // Round robin across the two queues, each queue's rows by deadline.
    let queue_order: Vec<&str> = got.iter().map(|d| d.queue.as_str()).collect();
    assert!(
        queue_order.chunks(2).all(|p| p.len() == 2 && p[0] != p[1]),
        "{queue_order:?}"
    );
    for q in &queues {
        let mine: Vec<_> = got.iter().filter(|d| &d.queue == q).collect();
        assert_eq!(mine.len(), 5);
        assert!(mine
            .windows(2)
            .all(|w| (w[0].deadline, w[0].lease.id) <= (w[1].deadline, w[1].lease.id)));
    }
    f.cleanup().await;
}

/// Connections of `pool` checked out (held by someone), once a connection just dropped
/// has made its way back (sqlx returns it from a spawned task, in microseconds; 100 ms is
/// the margin).
async fn in_use(pool: &sqlx::PgPool) -> usize {
    tokio::time::sleep(Duration::from_millis(100)).await;
    pool.size() as usize - pool.num_idle()
}

// Issue 27: the claims of a busy worker follow each other on one connection, which has the
// claim statement prepared and its catalog cached; it goes back to the pool when the loop
// reads its next wake-up (about to sleep) and when the claim loop stops. A claim that does
// not ask for it keeps nothing.
#[tokio::test]
async fn consecutive_claims_keep_one_connection_until_the_next_wakeup() {
    let f = Fixture::new().await;
    let mut conn = f.pool.acquire().await.unwrap();
    for i in 0..3 {
        let body = format!("m{i}");
        let m = Message::new("a", body.as_bytes());
        f.outbox.publish(&mut conn, m).await.unwrap();
    }
    drop(conn);
    let qs = vec!["a".to_string()];
    let keep = || ClaimRequest::new(&qs, 1, TTL).keep_connection();
    assert_eq!(in_use(&f.pool).await, 0);
    let got = f.store.claim(ClaimRequest::new(&qs, 1, TTL)).await.unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(
        in_use(&f.pool).await,
        0,
        "a plain claim keeps no connection"
    );
    let got = f.store.claim(keep()).await.unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(
        in_use(&f.pool).await,
        1,
        "the claim's connection is kept for the next claim"
    );
    let got = f.store.claim(keep()).await.unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(
        in_use(&f.pool).await,
        1,
        "the next claim reuses it: still one"
    );
    f.store
        .next_wakeup(ClaimRequest::new(&qs, 1, TTL))
        .await
        .unwrap();
    assert_eq!(
        in_use(&f.pool).await,
        0,
        "reading the next wake-up gives it back"
    );
    let body = "m3";
    let m = Message::new("a", body.as_bytes());
    f.outbox
        .publish(&mut f.pool.acquire().await.unwrap(), m)
        .await
        .unwrap();
    let got = f.store.claim(keep()).await.unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(in_use(&f.pool).await, 1);
    f.store.claims_stopped();
    assert_eq!(
        in_use(&f.pool).await,
        0,
        "a stopped claim loop gives it back"
    );
}

// A worker that drained a backlog and stopped leaves no connection checked out of the pool,
// even while a clone of its store lives on: closing the pool finishes.
#[tokio::test]
async fn a_stopped_worker_leaves_the_pool_closable() {
    use outbox::{Context, Error, Worker};
    let f = Fixture::new().await;
    let mut conn = f.pool.acquire().await.unwrap();
    for i in 0..50 {
        let body = format!("m{i}");
        let m = Message::new("a", body.as_bytes());
        f.outbox.publish(&mut conn, m).await.unwrap();
    }
    drop(conn);
    let done = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = done.clone();
    let worker = Worker::builder(f.store.clone())
        .fetch_batch_size(5)
        .queue("a", move |_: Vec<u8>, _: Context| {
            let seen = seen.clone();
            async move {
                seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                Ok::<(), Error>(())
            }
        })
        .build()
        .unwrap();
    let running = worker.start();
    outbox_tests::eventually(30, "every row handled", || async {
        done.load(std::sync::atomic::Ordering::SeqCst) == 50
    })
    .await;
    let report = running.shutdown().await;
    assert!(report.graceful, "{report:?}");
    let kept = f.store.clone();
    tokio::time::timeout(Duration::from_secs(10), f.pool.close())
        .await
        .expect("the pool closes: no connection is kept by the stopped worker's store");
    drop(kept);
}
