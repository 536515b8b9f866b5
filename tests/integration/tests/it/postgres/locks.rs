//! SPEC §7.4's lock rule on real Postgres: the worker's completion, renewal and release
//! statements never wait for a row lock while holding another, so an application
//! transaction that extends timers in its own order never deadlocks with them, and one
//! transaction holding one row never stalls the worker's other completions or renewals.

use std::time::{Duration, Instant};

use outbox::{
    message::OnConflict,
    store::{ClaimRequest, Completion, Delivery, Lease, Release, Released, Renewal, Store},
    Message, Published,
};
use outbox_tests::Fixture;
use sqlx::{AssertSqlSafe, Connection};

const Q: &str = "locks";
const TTL: Duration = Duration::from_secs(60);

/// Seeds `backlog` pending rows of another queue (so the planner uses the production plan),
/// publishes the timers `keys` due now and claims them.
async fn running(f: &Fixture, backlog: usize, keys: &[String]) -> Vec<Delivery> {
    let seed = format!(
        "INSERT INTO {t} (queue, payload, next_attempt_at) \
         SELECT 'backlog', 'x', now() + interval '1 day' FROM generate_series(1, {backlog}); \
         ANALYZE {t}",
        t = f.outbox.table()
    );
    sqlx::raw_sql(AssertSqlSafe(seed))
        .execute(&f.pool)
        .await
        .unwrap();
    let mut conn = f.pool.acquire().await.unwrap();
    for k in keys {
        f.outbox
            .publish(&mut conn, Message::new(Q, b"0").timer_id(k))
            .await
            .unwrap();
    }
    let queues = [Q.to_owned()];
    let got = f
        .store
        .claim(ClaimRequest::new(&queues, keys.len(), TTL))
        .await
        .unwrap();
    assert_eq!(got.len(), keys.len());
    got
}

/// Fails the test instead of hanging it when a statement waits on a lock it must not.
async fn within<T>(fut: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(5), fut)
        .await
        .expect("waited for a row lock the worker must not wait for")
}

fn extend(key: &str) -> Message<'_> {
    Message::new(Q, b"1")
        .timer_id(key)
        .schedule(Duration::from_secs(3600))
        .on_conflict(OnConflict::Extend)
}

/// The reported case: a table of ~20 000 rows, running timers A (lower id) and B. An
/// application transaction extends A; the worker's batched ack of [B, A] starts; the
/// transaction then extends B. Before: "deadlock detected" and both rows stay leased.
/// Now: no deadlock; B's and A's acks land once the transaction ends (each applying the
/// rearm the transaction queued); and meanwhile the worker's other completions and its
/// renewal are not stalled.
#[tokio::test]
async fn a_batched_ack_never_deadlocks_with_an_application_transaction() {
    let f = Fixture::new().await;
    let keys: Vec<String> = ["a", "b", "c", "d"].map(String::from).to_vec();
    let ds = running(&f, 20_000, &keys).await;
    let lease = |k: &str| {
        ds.iter()
            .find(|d| d.timer_id.as_deref() == Some(k))
            .unwrap()
            .lease
    };
    let (a, b, c, d) = (lease("a"), lease("b"), lease("c"), lease("d"));
    assert!(a.id < b.id);

    let mut app = f.pool.acquire().await.unwrap();
    let mut tx = app.begin().await.unwrap();
    assert_eq!(
        f.outbox.publish(&mut tx, extend("a")).await.unwrap(),
        Published::RearmQueued { id: a.id }
    );
    let store = f.store.clone();
    let batch = tokio::spawn(async move { store.ack_batch(&[b, a]).await });
    // Let the batch lock B and wait for A, then extend B in the same transaction.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let extended_b = within(f.outbox.publish(&mut tx, extend("b"))).await;
    assert!(
        matches!(
            extended_b,
            Ok(Published::RearmQueued { .. } | Published::Inserted { .. })
        ),
        "no deadlock in the application transaction: {extended_b:?}"
    );

    // While the transaction holds A (and B), other completions and renewals go on.
    let t0 = Instant::now();
    assert_eq!(within(f.store.ack(c)).await.unwrap(), Completion::Deleted);
    let renewed = within(f.store.renew(&[a, d])).await.unwrap();
    assert_eq!(renewed, vec![Renewal::Busy, Renewal::Renewed]);
    assert!(
        t0.elapsed() < Duration::from_secs(2),
        "not stalled by the application's locks: {:?}",
        t0.elapsed()
    );
    assert!(!batch.is_finished(), "A's ack waits for the transaction");

    tx.commit().await.unwrap();
    let done = batch.await.unwrap().expect("the batched ack lands");
    assert!(matches!(done[1], Completion::Rearmed { .. }), "{done:?}");
    assert!(
        matches!(done[0], Completion::Rearmed { .. } | Completion::Deleted),
        "{done:?}"
    );
    assert_eq!(f.store.ack(d).await.unwrap(), Completion::Deleted);
    f.cleanup().await;
}

/// A batched ack whose DELETE lands but whose follow-up (for a row with a queued rearm) meets
/// that row locked by an application transaction: the deleted rows report `Deleted`, not a
/// lost lease, and the locked one applies its rearm once the transaction ends.
#[tokio::test]
async fn a_batched_ack_reports_what_its_delete_did_when_its_follow_up_waits() {
    let f = Fixture::new().await;
    let keys: Vec<String> = ["a", "b"].map(String::from).to_vec();
    let ds = running(&f, 0, &keys).await;
    let lease = |k: &str| {
        ds.iter()
            .find(|d| d.timer_id.as_deref() == Some(k))
            .unwrap()
            .lease
    };
    let (a, b) = (lease("a"), lease("b"));
    let mut conn = f.pool.acquire().await.unwrap();
    f.outbox.publish(&mut conn, extend("b")).await.unwrap();
    let mut tx = conn.begin().await.unwrap();
    let mut later = extend("b");
    later = later.schedule(Duration::from_secs(7200));
    assert!(matches!(
        f.outbox.publish(&mut tx, later).await.unwrap(),
        Published::RearmQueued { .. }
    ));
    let store = f.store.clone();
    let batch = tokio::spawn(async move { store.ack_batch(&[a, b]).await });
    tokio::time::sleep(Duration::from_millis(600)).await;
    tx.commit().await.unwrap();
    let done = within(batch).await.unwrap().unwrap();
    assert_eq!(done[0], Completion::Deleted, "{done:?}");
    assert!(matches!(done[1], Completion::Rearmed { .. }), "{done:?}");
    f.cleanup().await;
}

/// Stress: application transactions, each extending its own random subset of running
/// timers in random order (no two share a timer, so they cannot deadlock with each other),
/// against batched acks, renewals and releases of those timers. Zero deadlocks in the
/// application transactions, and every completion lands.
#[tokio::test]
async fn extends_in_any_order_never_deadlock_with_completions_renewals_and_releases() {
    let f = Fixture::new().await;
    for round in 0..4u64 {
        let keys: Vec<String> = (0..24).map(|i| format!("r{round}k{i}")).collect();
        let ds = running(&f, if round == 0 { 2_000 } else { 0 }, &keys).await;
        let leases: Vec<(String, Lease)> = ds
            .iter()
            .map(|d| (d.timer_id.clone().unwrap(), d.lease))
            .collect();
        // Four application transactions over disjoint, shuffled subsets.
        let mut apps = Vec::new();
        for part in 0..4usize {
            let mut mine: Vec<String> = keys
                .iter()
                .enumerate()
                .filter(|(i, _)| i % 4 == part)
                .map(|(_, k)| k.clone())
                .collect();
            shuffle(&mut mine, round * 31 + part as u64);
            let (pool, outbox) = (f.pool.clone(), f.outbox.clone());
            apps.push(tokio::spawn(async move {
                let mut conn = pool.acquire().await.unwrap();
                let mut tx = conn.begin().await.unwrap();
                for k in &mine {
                    outbox.publish(&mut tx, extend(k)).await?;
                    tokio::time::sleep(Duration::from_millis(15)).await;
                }
                tx.commit().await?;
                Ok::<_, outbox::Error>(())
            }));
        }
        // The worker's side, at the same time: renewals of everything, then batched acks
        // of two thirds (in shuffled batches) and a release of the rest.
        let mut order: Vec<Lease> = leases.iter().map(|(_, l)| *l).collect();
        shuffle(&mut order, round * 7 + 3);
        let store = f.store.clone();
        let worker = tokio::spawn(async move {
            let all = order.clone();
            let renewals = store.renew(&all).await?;
            let (acked, released) = order.split_at(16);
            let mut done = Vec::new();
            for batch in acked.chunks(5) {
                done.extend(store.ack_batch(batch).await?);
            }
            let items: Vec<Release> = released
                .iter()
                .map(|&lease| Release {
                    lease,
                    started: false,
                })
                .collect();
            let gone = store.release(&items).await?;
            Ok::<_, outbox::Error>((renewals, done, gone))
        });
        for app in apps {
            let result = app.await.unwrap();
            if let Err(e) = &result {
                assert_ne!(e.sqlstate().as_deref(), Some("40P01"), "round {round}: {e}");
            }
            result.unwrap_or_else(|e| panic!("round {round}: {e}"));
        }
        let (renewals, done, gone) = worker.await.unwrap().expect("every worker write lands");
        assert!(
            renewals
                .iter()
                .all(|r| matches!(r, Renewal::Renewed | Renewal::Busy)),
            "round {round}: {renewals:?}"
        );
        assert!(
            done.iter()
                .all(|c| matches!(c, Completion::Deleted | Completion::Rearmed { .. })),
            "round {round}: {done:?}"
        );
        assert!(
            gone.iter().all(|r| matches!(r, Released::Pending)),
            "round {round}: {gone:?}"
        );
        // Everything is settled: no row of this round is still leased.
        let leased: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM {} WHERE queue = '{Q}' AND acquired_token IS NOT NULL",
            f.outbox.table()
        )))
        .fetch_one(&f.pool)
        .await
        .unwrap();
        assert_eq!(leased, 0, "round {round}");
        sqlx::raw_sql(AssertSqlSafe(format!(
            "DELETE FROM {} WHERE queue = '{Q}'",
            f.outbox.table()
        )))
        .execute(&f.pool)
        .await
        .unwrap();
    }
    f.cleanup().await;
}

/// A deterministic Fisher–Yates shuffle (xorshift), so a failing round can be replayed.
fn shuffle<T>(v: &mut [T], seed: u64) {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for i in (1..v.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let j = (x % (i as u64 + 1)) as usize;
        v.swap(i, j);
    }
}

/// Found by a trial of pipelined acks: two application transactions, each holding the lock
/// of a row whose handler had succeeded, stalled every other ack until they committed (the
/// completer allowed two statements in flight, and each locked row's own ack waits for its
/// application). Now up to `concurrency + 1` statements may be in flight, so with
/// concurrency 3 two such locks hold back nothing else.
#[tokio::test]
async fn two_application_locks_do_not_stall_the_other_acks() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    let f = Fixture::new().await;
    let t = f.outbox.table();
    let seed = format!(
        "INSERT INTO {t} (queue, payload, next_attempt_at) \
         VALUES ('{Q}', '\\x31', now() - interval '10 s'), ('{Q}', '\\x32', now() - interval '10 s')"
    );
    sqlx::raw_sql(AssertSqlSafe(seed))
        .execute(&f.pool)
        .await
        .unwrap();
    let gates = Arc::new([tokio::sync::Notify::new(), tokio::sync::Notify::new()]);
    let started = Arc::new(AtomicUsize::new(0));
    let worker = outbox::Worker::builder(f.store.clone())
        .concurrency(3)
        .idle_poll(Duration::from_millis(100))
        .queue(Q, {
            let (gates, started) = (gates.clone(), started.clone());
            move |p: Vec<u8>, _: outbox::Context| {
                let (gates, started) = (gates.clone(), started.clone());
                async move {
                    if p == b"1" || p == b"2" {
                        started.fetch_add(1, Ordering::SeqCst);
                        gates[usize::from(p[0] - b'1')].notified().await;
                    }
                    Ok::<(), outbox::Error>(())
                }
            }
        })
        .build()
        .unwrap()
        .start();
    outbox_tests::eventually(10, "both gated handlers run", || {
        let n = started.load(Ordering::SeqCst);
        async move { n == 2 }
    })
    .await;
    // Each application transaction locks one of the two rows, then lets its handler
    // succeed: both acks meet a lock, in two statements of their own.
    let mut apps = Vec::new();
    for (i, payload) in ["\\x31", "\\x32"].iter().enumerate() {
        let mut tx = f.pool.begin().await.unwrap();
        sqlx::query(AssertSqlSafe(format!(
            "SELECT id FROM {t} WHERE payload = '{payload}'::bytea FOR UPDATE"
        )))
        .fetch_one(&mut *tx)
        .await
        .unwrap();
        apps.push(tx);
        gates[i].notify_one();
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
    let more = format!(
        "INSERT INTO {t} (queue, payload, next_attempt_at) \
         SELECT '{Q}', convert_to('x' || i, 'UTF8'), now() FROM generate_series(1, 100) i"
    );
    sqlx::raw_sql(AssertSqlSafe(more))
        .execute(&f.pool)
        .await
        .unwrap();
    let count = format!("SELECT count(*) FROM {t}");
    let left = || async {
        sqlx::query_scalar::<_, i64>(AssertSqlSafe(count.clone()))
            .fetch_one(&f.pool)
            .await
            .unwrap()
    };
    // Bound: 20 × (the completer's 250 ms stall + the store's 200 ms lock timeout).
    outbox_tests::eventually(
        9,
        "the other 100 acks land while both locks are held",
        || async { left().await == 2 },
    )
    .await;
    for tx in apps {
        tx.commit().await.unwrap();
    }
    outbox_tests::eventually(
        10,
        "the locked rows' acks land after the commits",
        || async { left().await == 0 },
    )
    .await;
    let report = worker.shutdown().await;
    assert!(report.graceful, "{report:?}");
    f.cleanup().await;
}
