//! Distributed mode on a real Citus cluster (issue 28): a coordinator and two worker nodes
//! started by `.ci/citus`, which sets `OUTBOX_CITUS=1` and points `DATABASE_URL` at the
//! coordinator. Ignored in the ordinary run (there is no Citus there); `.ci/run` runs them
//! under `.ci/citus` with `--run-ignored only`, and each one fails unless the server is a
//! Citus coordinator with two active workers, so they never pass vacuously.
//!
//! Single-shard is proven the way Citus offers: `citus.multi_task_query_log_level =
//! 'error'` on the connection makes any statement Citus would split over several shards
//! fail.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox::message::OnConflict;
use outbox::store::{ClaimRequest, Completion, Failure, FailureReason, Lease, Release, Store};
use outbox::{Cancelled, Context, Error, Message, PgStore, Published, Worker};
use outbox_tests::{database_url, eventually, Fixture, CITUS_BUCKETS};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgPool};

mod fairness;
mod faults;
mod idle;

const TTL: Duration = Duration::from_secs(60);

/// A fixture on the Citus coordinator; panics unless the server is one with two workers.
async fn cluster() -> Fixture {
    assert!(
        outbox_tests::citus(),
        "run under .ci/citus (OUTBOX_CITUS=1, DATABASE_URL = a Citus coordinator)"
    );
    let f = Fixture::new().await;
    let workers: i64 = sqlx::query_scalar("SELECT count(*) FROM citus_get_active_worker_nodes()")
        .fetch_one(&f.pool)
        .await
        .expect("a Citus coordinator");
    assert_eq!(workers, 2, "the cluster has two active worker nodes");
    f
}

/// Connections on which any multi-shard statement fails.
async fn single_shard_pool() -> PgPool {
    let opts = database_url()
        .parse::<PgConnectOptions>()
        .expect("DATABASE_URL")
        .options([("citus.multi_task_query_log_level", "error")]);
    PgPoolOptions::new()
        .max_connections(4)
        .connect_with(opts)
        .await
        .expect("connect to the coordinator")
}

#[tokio::test]
#[ignore = "needs a Citus cluster: .ci/citus -- cargo nextest run --run-ignored only -E 'test(/citus/)'"]
async fn migrate_refuses_a_queue_table_of_the_other_layout_before_any_ddl() {
    let f = cluster().await;
    // A single-node outbox on the coordinator (a local table), then distributed(16) over it.
    let table = outbox_tests::unique_table("layout");
    let single = outbox::Outbox::builder().table(&table).build().unwrap();
    single.migrate(&f.pool).await.unwrap();
    let distributed = outbox::Outbox::builder()
        .distributed(CITUS_BUCKETS)
        .table(&table)
        .build()
        .unwrap();
    match distributed.migrate(&f.pool).await.unwrap_err() {
        Error::InvalidConfig { knob, reason } => {
            assert_eq!(knob, "distributed");
            assert!(reason.contains("single-node outbox table"), "{reason}");
            assert!(
                reason.contains("Moving a single-node outbox to Citus"),
                "{reason}"
            );
        }
        other => panic!("{other:?}"),
    }
    let columns: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_attribute WHERE attrelid = $1::regclass AND attname = 'bucket'",
    )
    .bind(single.table())
    .fetch_one(&f.pool)
    .await
    .unwrap();
    assert_eq!(columns, 0, "nothing was changed");
    single.migrate(&f.pool).await.expect("still its own");

    // A single-node outbox over a distributed table.
    let dtable = outbox_tests::unique_table("layout_d");
    let d = outbox::Outbox::builder()
        .distributed(CITUS_BUCKETS)
        .table(&dtable)
        .build()
        .unwrap();
    d.migrate(&f.pool).await.unwrap();
    let plain = outbox::Outbox::builder().table(&dtable).build().unwrap();
    match plain.migrate(&f.pool).await.unwrap_err() {
        Error::InvalidConfig { knob, reason } => {
            assert_eq!(knob, "distributed");
            assert!(
                reason.contains("a distributed (Citus) outbox table"),
                "{reason}"
            );
        }
        other => panic!("{other:?}"),
    }
    // validate_schema says the same rather than "index missing" (§13 v3).
    match plain.validate_schema(&f.pool).await.unwrap_err() {
        Error::SchemaMismatch { problems } => {
            assert!(
                problems.iter().any(|p| p.object == dtable
                    && p.message.contains("distributed (Citus) outbox table")
                    && p.message.contains("distributed(buckets)")),
                "{problems:?}"
            );
        }
        other => panic!("{other:?}"),
    }
    for o in [&single, &d] {
        sqlx::raw_sql(AssertSqlSafe(format!(
            "DROP TABLE IF EXISTS {}, {}, {}, {}",
            o.table(),
            o.dead_letter_table(),
            o.migrations_table(),
            o.paused_table()
        )))
        .execute(&f.pool)
        .await
        .expect("drop the tables");
    }
    f.cleanup().await;
}

#[tokio::test]
#[ignore = "needs a Citus cluster: .ci/citus -- cargo nextest run --run-ignored only -E 'test(/citus/)'"]
async fn an_action_by_id_with_another_bucket_count_is_refused_not_reported_missing() {
    let f = cluster().await;
    let mut conn = f.pool.acquire().await.unwrap();
    // A row in a bucket from 8 up (round robin without a shard key): seen by a process
    // built with 8 buckets, its id names another bucket. (In buckets 0..8 the two counts
    // agree on the bucket, and the action finds the row, which is then the right one.)
    let mut id = 0;
    for _ in 0..CITUS_BUCKETS {
        let Published::Inserted { id: new } = f
            .outbox
            .publish(&mut conn, Message::new("q", b"x").schedule(TTL))
            .await
            .unwrap()
        else {
            panic!("inserted")
        };
        id = new;
        if id % 16 >= 8 {
            break;
        }
        f.outbox.delete_pending(&mut conn, id).await.unwrap();
    }
    assert!(id % 16 >= 8, "{id}");
    let name = f
        .outbox
        .table()
        .rsplit('.')
        .next()
        .unwrap()
        .trim_matches('"');
    let eight = outbox::Outbox::builder()
        .distributed(8)
        .table(name)
        .build()
        .unwrap();
    for got in [
        eight.run_now(&mut conn, id).await,
        eight.delete_pending(&mut conn, id).await,
    ] {
        match got.unwrap_err() {
            Error::InvalidConfig { knob, reason } => {
                assert_eq!(knob, "distributed");
                assert!(reason.contains("holds 16 buckets"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
    }
    // A cancel of a key whose bucket differs between the two counts: refused, not missing.
    let key = (0..)
        .map(|i| format!("key-{i}"))
        .find(|k| f.outbox.bucket_of(k).unwrap() >= 8)
        .unwrap();
    f.outbox
        .publish(
            &mut conn,
            Message::new("q", b"t").timer_id(&key).schedule(TTL),
        )
        .await
        .unwrap();
    match eight.cancel(&mut conn, "q", &key).await.unwrap_err() {
        Error::InvalidConfig { knob, reason } => {
            assert_eq!(knob, "distributed");
            assert!(reason.contains("holds 16 buckets"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        f.outbox.cancel(&mut conn, "q", &key).await.unwrap(),
        Cancelled::Deleted { .. }
    ));
    // A worker's claims with the other count are refused, every one, whatever the rows' ids
    // (before, a claim failed only when a claimed id happened not to name its bucket).
    let qs = vec!["q".to_owned()];
    let store = PgStore::new(f.pool.clone(), eight.clone());
    for _ in 0..2 {
        match store
            .claim(ClaimRequest::new(&qs, 10, TTL))
            .await
            .unwrap_err()
        {
            Error::InvalidConfig { knob, .. } => assert_eq!(knob, "distributed"),
            other => panic!("{other:?}"),
        }
    }
    // With the table's count a missing id is just missing, and the row is untouched.
    assert!(matches!(
        f.outbox.run_now(&mut conn, id + 16 * 1000).await.unwrap(),
        outbox::admin::RowAction::NotFound
    ));
    assert_eq!(f.rows("q").await.len(), 1);
    drop(conn);
    f.cleanup().await;
}

#[tokio::test]
#[ignore = "needs a Citus cluster: .ci/citus -- cargo nextest run --run-ignored only -E 'test(/citus/)'"]
async fn a_dead_letter_is_archived_on_its_rows_node_without_two_phase_commit() {
    let f = cluster().await;
    let mut conn = f.pool.acquire().await.unwrap();
    let hs = outbox::message::Headers::from([("k".to_owned(), "v".to_owned())]);
    for i in 0..8 {
        f.outbox
            .publish(
                &mut conn,
                Message::new("dead", format!("{i}").as_bytes()).headers(&hs),
            )
            .await
            .unwrap();
    }
    drop(conn);
    let two_pc = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM pg_dist_transaction")
            .fetch_one(&f.pool)
            .await
            .unwrap()
    };
    let before = two_pc().await;
    let qs = vec!["dead".to_owned()];
    let claimed = f.store.claim(ClaimRequest::new(&qs, 8, TTL)).await.unwrap();
    assert_eq!(claimed.len(), 8);
    for d in &claimed {
        let failure = Failure {
            reason: FailureReason::Rejected,
            last_error: Some("no"),
        };
        assert_eq!(
            f.store.fail(d.lease, failure).await.unwrap(),
            Completion::Deleted
        );
    }
    assert_eq!(
        two_pc().await,
        before,
        "each archive stayed on the node of its row's bucket"
    );
    let mut conn = f.pool.acquire().await.unwrap();
    let letters = f
        .outbox
        .dead_letters(
            &mut conn,
            &outbox::dlq::DeadLetterFilter::new().queue("dead"),
            None,
            100,
        )
        .await
        .unwrap();
    drop(conn);
    assert_eq!(letters.len(), 8);
    let mut originals: Vec<i64> = letters.iter().map(|l| l.original_id).collect();
    originals.sort_unstable();
    let mut ids: Vec<i64> = claimed.iter().map(|d| d.lease.id).collect();
    ids.sort_unstable();
    assert_eq!(originals, ids);
    for l in &letters {
        assert_eq!(
            (
                l.failure_reason.as_str(),
                l.last_error.as_deref(),
                l.attempts_count,
                l.deliveries_count,
                l.headers.as_ref()
            ),
            ("rejected", Some("no"), 1, 1, Some(&hs))
        );
    }
    assert!(f.rows("dead").await.is_empty());
    f.cleanup().await;
}

#[tokio::test]
#[ignore = "needs a Citus cluster: .ci/citus -- cargo nextest run --run-ignored only -E 'test(/citus/)'"]
async fn migrate_distributes_the_queue_and_dead_letter_tables_by_bucket() {
    let f = cluster().await;
    let rows: Vec<(String, String, Option<String>, i32)> = sqlx::query_as(
        "SELECT CASE logicalrelid WHEN $1::regclass THEN 'queue' WHEN $2::regclass THEN 'dlq' ELSE 'paused' END, partmethod::text, \
                CASE WHEN partmethod = 'h' THEN column_to_column_name(logicalrelid, partkey) END, \
                colocationid \
         FROM pg_dist_partition \
         WHERE logicalrelid IN ($1::regclass, $2::regclass, $3::regclass) \
         ORDER BY 1",
    )
    .bind(f.outbox.table())
    .bind(f.outbox.dead_letter_table())
    .bind(f.outbox.paused_table())
    .fetch_all(&f.pool)
    .await
    .unwrap();
    assert_eq!(rows.len(), 3, "{rows:?}");
    let by = |t: &str| {
        rows.iter()
            .find(|r| r.0 == t)
            .unwrap_or_else(|| panic!("{t} in {rows:?}"))
    };
    let (q, d, p) = (by("queue"), by("dlq"), by("paused"));
    assert_eq!((q.1.as_str(), q.2.as_deref()), ("h", Some("bucket")));
    assert_eq!((d.1.as_str(), d.2.as_deref()), ("h", Some("bucket")));
    assert_eq!(q.3, d.3, "queue and dead-letter tables co-located");
    assert_eq!(p.1, "n", "the paused table is a reference table");
    // Applying the migrations again changes nothing, and the schema checks out.
    f.outbox.migrate(&f.pool).await.unwrap();
    f.outbox.validate_schema(&f.pool).await.unwrap();

    // Built with another bucket count: said in Citus terms, before anything runs.
    let other = outbox::Outbox::builder()
        .table(f.outbox.table().trim_matches('"'))
        .distributed(CITUS_BUCKETS * 2)
        .build()
        .unwrap();
    let err = other.validate_schema(&f.pool).await.unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(err, Error::SchemaMismatch { .. }) && text.contains("holds 16 buckets"),
        "{text}"
    );
    // ... and it can neither migrate, nor publish a timer (whose key would land in another
    // bucket than the live row's), nor complete what it claims.
    let err = other.migrate(&f.pool).await.unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidConfig {
                knob: "distributed",
                ..
            }
        ) && err.to_string().contains("holds 16 buckets"),
        "{err}"
    );
    let mut conn = f.pool.acquire().await.unwrap();
    f.outbox
        .publish(&mut conn, Message::new("q", b"x").timer_id("dup"))
        .await
        .unwrap();
    for key in ["dup", "fresh"] {
        let err = other
            .publish(
                &mut conn,
                Message::new("q", b"y")
                    .timer_id(key)
                    .on_conflict(OnConflict::Extend),
            )
            .await;
        assert!(
            matches!(
                err,
                Err(Error::InvalidConfig {
                    knob: "distributed",
                    ..
                }) | Ok(Published::Extended { .. })
            ),
            "{key}: {err:?}"
        );
    }
    let keys: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM {} WHERE timer_id = 'dup'",
        f.outbox.table()
    )))
    .fetch_one(&mut *conn)
    .await
    .unwrap();
    assert_eq!(keys, 1, "no second live row for a key");
    let other_store = PgStore::new(f.pool.clone(), other.clone());
    let err = other_store
        .claim(ClaimRequest::new(&["q".to_owned()], 10, TTL))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidConfig {
                knob: "distributed",
                ..
            }
        ),
        "{err}"
    );
    drop(conn);

    // A single-node outbox's tables, validated as distributed: the queue table has no
    // `bucket` column, so that alone is said (`migrate` does not convert it in place; a
    // fresh-user trial was told to run it for the distributed indexes).
    let local = outbox_tests::unique_table("local");
    let single = outbox::Outbox::builder().table(&local).build().unwrap();
    sqlx::query("SET citus.use_citus_managed_tables = off")
        .execute(&f.pool)
        .await
        .ok();
    single.migrate(&f.pool).await.unwrap();
    let as_distributed = outbox::Outbox::builder()
        .table(&local)
        .distributed(CITUS_BUCKETS)
        .build()
        .unwrap();
    let text = as_distributed
        .validate_schema(&f.pool)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        text.contains(&format!(
            "{local}: is a single-node outbox table (no `bucket` column): build the outbox \
             without `distributed({CITUS_BUCKETS})`"
        )) && !text.contains("hash-distributed"),
        "{text}"
    );
    sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP TABLE {}, {}, {}, {}",
        single.table(),
        single.dead_letter_table(),
        single.migrations_table(),
        single.paused_table()
    )))
    .execute(&f.pool)
    .await
    .unwrap();
    f.cleanup().await;
}

#[tokio::test]
#[ignore = "needs a Citus cluster: .ci/citus -- cargo nextest run --run-ignored only -E 'test(/citus/)'"]
async fn publish_extend_cancel_and_every_completion_stay_on_one_shard() {
    let f = cluster().await;
    let strict = single_shard_pool().await;
    let strict_store = PgStore::new(strict.clone(), f.outbox.clone());
    let mut conn = strict.acquire().await.unwrap();
    let o = &f.outbox;

    // Publishes: plain (round robin over buckets), keyed, extend, a batch.
    let mut ids = Vec::new();
    for i in 0..6 {
        match o
            .publish(&mut conn, Message::new("q", format!("m{i}").as_bytes()))
            .await
            .unwrap()
        {
            Published::Inserted { id } => ids.push(id),
            other => panic!("{other:?}"),
        }
    }
    let buckets: HashSet<i64> = ids.iter().map(|id| id % i64::from(CITUS_BUCKETS)).collect();
    // A shard key puts a plain message in its key's bucket.
    let Published::Inserted { id: keyed_id } = o
        .publish(&mut conn, Message::new("sk", b"s").shard_key("user-9"))
        .await
        .unwrap()
    else {
        panic!("inserted")
    };
    assert_eq!(
        keyed_id % i64::from(CITUS_BUCKETS),
        i64::from(o.bucket_of("user-9").unwrap())
    );
    assert!(
        buckets.len() > 1,
        "plain messages spread over buckets: {ids:?}"
    );
    let keyed = Message::new("q", b"k").timer_id("user-1");
    assert!(matches!(
        o.publish(&mut conn, keyed).await.unwrap(),
        Published::Inserted { .. }
    ));
    assert_eq!(
        o.publish(&mut conn, keyed).await.unwrap(),
        Published::Skipped
    );
    let later = Message::new("q", b"k2")
        .timer_id("user-1")
        .on_conflict(OnConflict::Extend)
        .schedule(outbox::message::Schedule::after(Duration::from_secs(3600)));
    assert!(matches!(
        o.publish(&mut conn, later).await.unwrap(),
        Published::Extended { .. }
    ));
    // The slack: a move by at most the slack writes nothing; a longer one is written.
    let by = |secs| {
        Message::new("q", b"k3")
            .timer_id("user-1")
            .on_conflict(OnConflict::Extend)
            .slack(Duration::from_secs(60))
            .schedule(outbox::message::Schedule::after(Duration::from_secs(secs)))
    };
    assert_eq!(
        o.publish(&mut conn, by(3630)).await.unwrap(),
        Published::Unchanged
    );
    assert!(matches!(
        o.publish(&mut conn, by(3700)).await.unwrap(),
        Published::Extended { .. }
    ));
    let batch = o
        .publish_batch(
            &mut conn,
            "q",
            &[
                outbox::message::BatchItem::new(b"b1"),
                outbox::message::BatchItem::new(b"b2"),
            ],
            outbox::message::Schedule::now(),
        )
        .await
        .unwrap();
    assert_eq!(batch.len(), 2);
    assert_eq!(
        batch[0] % i64::from(CITUS_BUCKETS),
        batch[1] % i64::from(CITUS_BUCKETS),
        "a batch is one statement in one bucket"
    );

    // The claim statement of one bucket, on a connection that refuses multi-shard
    // statements (the store finds the buckets with work by one read across the shards
    // first; that read is allowed to span them).
    let claim_sql = f
        .outbox
        .statements()
        .into_iter()
        .find(|(name, _)| *name == "claim.claim")
        .unwrap()
        .1
        .to_owned();
    let bucket = (ids[0] % i64::from(CITUS_BUCKETS)) as i16;
    let rows: Vec<sqlx::postgres::PgRow> = sqlx::query(AssertSqlSafe(claim_sql))
        .bind(vec!["q".to_owned()])
        .bind(100_i64)
        .bind(sqlx::postgres::types::PgInterval {
            months: 0,
            days: 0,
            microseconds: 60_000_000,
        })
        .bind(uuid::Uuid::new_v4())
        .bind(Vec::<i64>::new())
        .bind(vec![100_i64])
        .bind(bucket)
        .fetch_all(&strict)
        .await
        .expect("the claim of one bucket is single-shard");
    let rows: Vec<(i64,)> = rows
        .iter()
        .map(|r| (sqlx::Row::get::<i64, _>(r, 0),))
        .collect();
    assert!(rows
        .iter()
        .all(|(id,)| id % i64::from(CITUS_BUCKETS) == i64::from(bucket)));
    assert!(!rows.is_empty());

    // Claims through the store (finder across shards, then one claim per bucket).
    let qs = vec!["q".to_owned()];
    let claimed = f
        .store
        .claim(ClaimRequest::new(&qs, 100, TTL))
        .await
        .unwrap();
    assert_eq!(
        claimed.len(),
        7,
        "6 plain + 2 batch - the one claimed above: {claimed:?}"
    );

    // Every completion on the strict store: ack, retry, fail, renew, release, batches.
    let leases: Vec<Lease> = claimed.iter().map(|d| d.lease).collect();
    assert!(strict_store
        .renew(&leases)
        .await
        .unwrap()
        .iter()
        .all(|r| *r == outbox::store::Renewal::Renewed));
    assert_eq!(
        strict_store.ack(leases[0]).await.unwrap(),
        Completion::Deleted
    );
    assert!(matches!(
        strict_store
            .retry(leases[1], Duration::from_secs(3600))
            .await
            .unwrap(),
        Completion::RetryScheduled { .. }
    ));
    let failure = Failure {
        reason: FailureReason::RetryExhausted,
        last_error: Some("boom"),
    };
    assert_eq!(
        strict_store.fail(leases[2], failure).await.unwrap(),
        Completion::Deleted
    );
    let released = strict_store
        .release(&[Release {
            lease: leases[3],
            started: false,
        }])
        .await
        .unwrap();
    assert_eq!(released, vec![outbox::store::Released::Pending]);
    let acked = strict_store.ack_batch(&leases[4..]).await.unwrap();
    assert!(acked.iter().all(|c| *c == Completion::Deleted), "{acked:?}");
    // The failed row went to the dead-letter table, in its bucket.
    let dead: Vec<(i16, i64)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT bucket, original_id FROM {}",
        f.outbox.dead_letter_table()
    )))
    .fetch_all(&f.pool)
    .await
    .unwrap();
    assert_eq!(
        dead,
        vec![(
            (leases[2].id % i64::from(CITUS_BUCKETS)) as i16,
            leases[2].id
        )]
    );

    // Cancel of a pending keyed timer, and of a running one (marked, not deleted).
    assert!(matches!(
        o.cancel(&mut conn, "q", "user-1").await.unwrap(),
        Cancelled::Deleted { .. }
    ));
    o.publish(&mut conn, Message::new("r", b"r").timer_id("user-2"))
        .await
        .unwrap();
    let running = f
        .store
        .claim(ClaimRequest::new(&["r".to_owned()], 1, TTL))
        .await
        .unwrap();
    assert_eq!(running.len(), 1);
    assert!(matches!(
        o.cancel(&mut conn, "r", "user-2").await.unwrap(),
        Cancelled::Running { .. }
    ));
    assert_eq!(
        strict_store.ack(running[0].lease).await.unwrap(),
        Completion::Deleted
    );
    drop(conn);
    strict.close().await;
    f.cleanup().await;
}

#[tokio::test]
#[ignore = "needs a Citus cluster: .ci/citus -- cargo nextest run --run-ignored only -E 'test(/citus/)'"]
async fn one_live_row_per_timer_key_across_the_cluster() {
    let f = cluster().await;
    // Many sessions publish the same keys at once: one row per key survives.
    let mut tasks = Vec::new();
    for s in 0..8 {
        let (pool, outbox) = (f.pool.clone(), f.outbox.clone());
        tasks.push(tokio::spawn(async move {
            let mut conn = pool.acquire().await.unwrap();
            for k in 0..20 {
                let key = format!("key-{k}");
                let body = format!("s{s}");
                let m = Message::new("q", body.as_bytes())
                    .timer_id(&key)
                    .on_conflict(OnConflict::Extend);
                outbox.publish(&mut conn, m).await.unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let (rows, keys): (i64, i64) = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT count(*), count(DISTINCT timer_id) FROM {}",
        f.outbox.table()
    )))
    .fetch_one(&f.pool)
    .await
    .unwrap();
    assert_eq!((rows, keys), (20, 20));
    f.cleanup().await;
}

#[tokio::test]
#[ignore = "needs a Citus cluster: .ci/citus -- cargo nextest run --run-ignored only -E 'test(/citus/)'"]
async fn a_worker_runs_every_message_of_every_bucket_once() {
    let f = cluster().await;
    let mut conn = f.pool.acquire().await.unwrap();
    for i in 0..200 {
        f.outbox
            .publish(&mut conn, Message::new("w", format!("{i}").as_bytes()))
            .await
            .unwrap();
    }
    drop(conn);
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let runs = Arc::new(AtomicUsize::new(0));
    let worker = Worker::builder(f.store.clone())
        .concurrency(4)
        .queue("w", {
            let (seen, runs) = (seen.clone(), runs.clone());
            move |body: Vec<u8>, _: Context| {
                let (seen, runs) = (seen.clone(), runs.clone());
                async move {
                    seen.lock().unwrap().push(String::from_utf8(body).unwrap());
                    runs.fetch_add(1, Ordering::SeqCst);
                    Ok::<(), Error>(())
                }
            }
        })
        .build()
        .unwrap()
        .start();
    eventually(60, "200 runs", || {
        let runs = runs.clone();
        async move { runs.load(Ordering::SeqCst) >= 200 }
    })
    .await;
    let report = worker.shutdown().await;
    assert!(report.graceful, "{report:?}");
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 200, "each once");
    assert_eq!(seen.iter().collect::<HashSet<_>>().len(), 200);
    let left: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM {}",
        f.outbox.table()
    )))
    .fetch_one(&f.pool)
    .await
    .unwrap();
    assert_eq!(left, 0, "every row acked");
    f.cleanup().await;
}

#[tokio::test]
#[ignore = "needs a Citus cluster: .ci/citus -- cargo nextest run --run-ignored only -E 'test(/citus/)'"]
async fn a_write_co_located_with_the_outbox_commits_without_two_phase_commit() {
    let f = cluster().await;
    let users = outbox_tests::unique_table("users");
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE {users} (bucket smallint NOT NULL, user_id text NOT NULL, last_seen timestamptz, \
         PRIMARY KEY (bucket, user_id)); \
         SELECT create_distributed_table('{users}', 'bucket', colocate_with => '{t}');",
        t = f.outbox.table().replace('\'', "''")
    )))
    .execute(&f.pool)
    .await
    .unwrap();
    let two_pc = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM pg_dist_transaction")
            .fetch_one(&f.pool)
            .await
            .unwrap()
    };
    let before = two_pc().await;
    for i in 0..20 {
        let key = format!("user-{i}");
        let bucket = f.outbox.bucket_of(&key).unwrap();
        let mut tx = f.pool.begin().await.unwrap();
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {users} (bucket, user_id, last_seen) VALUES ($1, $2, now()) \
             ON CONFLICT (bucket, user_id) DO UPDATE SET last_seen = excluded.last_seen"
        )))
        .bind(bucket)
        .bind(&key)
        .execute(&mut *tx)
        .await
        .unwrap();
        f.outbox
            .publish(
                &mut tx,
                Message::new("presence", b"{}")
                    .timer_id(&key)
                    .on_conflict(OnConflict::Extend),
            )
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }
    assert_eq!(two_pc().await, before, "no ping needed two-phase commit");

    // Not co-located (another co-location group): still atomic, by two-phase commit when
    // the rows land on two nodes. A rollback after the extend leaves neither row; a commit
    // keeps both.
    let other = outbox_tests::unique_table("other");
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE {other} (user_id text PRIMARY KEY); \
         SELECT create_distributed_table('{other}', 'user_id', colocate_with => 'none');"
    )))
    .execute(&f.pool)
    .await
    .unwrap();
    let mut tx = f.pool.begin().await.unwrap();
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {other} VALUES ('rolled-back')"
    )))
    .execute(&mut *tx)
    .await
    .unwrap();
    f.outbox
        .publish(
            &mut tx,
            Message::new("presence", b"{}")
                .timer_id("rolled-back")
                .on_conflict(OnConflict::Extend),
        )
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    let (a, b): (i64, i64) = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT (SELECT count(*) FROM {other}), \
                (SELECT count(*) FROM {t} WHERE queue = 'presence' AND timer_id = 'rolled-back' AND bucket = $1)",
        t = f.outbox.table()
    )))
    .bind(f.outbox.bucket_of("rolled-back").unwrap())
    .fetch_one(&f.pool)
    .await
    .unwrap();
    assert_eq!((a, b), (0, 0));
    let mut tx = f.pool.begin().await.unwrap();
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {other} VALUES ('committed')"
    )))
    .execute(&mut *tx)
    .await
    .unwrap();
    f.outbox
        .publish(
            &mut tx,
            Message::new("presence", b"{}")
                .timer_id("committed")
                .on_conflict(OnConflict::Extend),
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let (a, b): (i64, i64) = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT (SELECT count(*) FROM {other} WHERE user_id = 'committed'), \
                (SELECT count(*) FROM {t} WHERE queue = 'presence' AND timer_id = 'committed' AND bucket = $1)",
        t = f.outbox.table()
    )))
    .bind(f.outbox.bucket_of("committed").unwrap())
    .fetch_one(&f.pool)
    .await
    .unwrap();
    assert_eq!((a, b), (1, 1));
    sqlx::raw_sql(AssertSqlSafe(format!("DROP TABLE {users}, {other}")))
        .execute(&f.pool)
        .await
        .unwrap();
    f.cleanup().await;
}

#[tokio::test]
#[ignore = "needs a Citus cluster: .ci/citus -- cargo nextest run --run-ignored only -E 'test(/citus/)'"]
async fn reads_pause_actions_by_id_redrive_and_purge_work_across_buckets() {
    use outbox::admin::RowAction;
    use outbox::message::Schedule;
    let f = cluster().await;
    let strict = single_shard_pool().await;
    let mut conn = f.pool.acquire().await.unwrap();
    let mut one = strict.acquire().await.unwrap();
    let o = &f.outbox;
    let mut ids = Vec::new();
    for _ in 0..3 {
        match o.publish(&mut conn, Message::new("p", b"x")).await.unwrap() {
            Published::Inserted { id } => ids.push(id),
            x => panic!("{x:?}"),
        }
    }
    // Reads across the shards.
    assert_eq!(o.pending(&mut conn, "p", 10).await.unwrap().len(), 3);
    let stats = o
        .stats(&mut conn, &outbox::stats::StatsRequest::new(TTL))
        .await
        .unwrap();
    assert_eq!(stats.len(), 1);
    assert!(o
        .dead_letters(&mut conn, &outbox::dlq::DeadLetterFilter::new(), None, 10)
        .await
        .unwrap()
        .is_empty());
    // Pause and resume (the reference table), and the actions by id, each on one shard.
    assert!(o.pause_queue(&mut conn, "p").await.unwrap());
    assert_eq!(o.paused_queues(&mut conn).await.unwrap().len(), 1);
    assert!(o.resume_queue(&mut conn, "p").await.unwrap());
    assert!(matches!(
        o.run_now(&mut one, ids[0]).await.unwrap(),
        RowAction::Rescheduled { .. }
    ));
    assert!(matches!(
        o.reschedule(&mut one, ids[1], Schedule::after(Duration::from_secs(5)))
            .await
            .unwrap(),
        RowAction::Rescheduled { .. }
    ));
    assert_eq!(
        o.delete_pending(&mut one, ids[2]).await.unwrap(),
        RowAction::Deleted
    );
    assert_eq!(
        o.delete_pending(&mut one, ids[2]).await.unwrap(),
        RowAction::NotFound
    );
    // Purge: bucket by bucket. Dead letters in several buckets, purged in batches of 2.
    for i in 0..5 {
        o.publish(&mut conn, Message::new("dead", format!("{i}").as_bytes()))
            .await
            .unwrap();
    }
    let claimed = f
        .store
        .claim(ClaimRequest::new(&["dead".to_owned()], 10, TTL))
        .await
        .unwrap();
    assert_eq!(claimed.len(), 5);
    for d in &claimed {
        let failure = Failure {
            reason: FailureReason::Rejected,
            last_error: Some("no"),
        };
        assert_eq!(
            f.store.fail(d.lease, failure).await.unwrap(),
            Completion::Deleted
        );
    }
    // Redrive: bucket by bucket in one transaction; each new row stays in its dead
    // letter's bucket.
    use outbox::dlq::{Redrive, RedriveResult};
    let letters = o
        .dead_letters(
            &mut conn,
            &outbox::dlq::DeadLetterFilter::new().queue("dead"),
            None,
            10,
        )
        .await
        .unwrap();
    assert_eq!(letters.len(), 5);
    let bucket = |id: i64| id % i64::from(CITUS_BUCKETS);
    let buckets: HashSet<i64> = letters.iter().map(|d| bucket(d.original_id)).collect();
    assert!(
        buckets.len() > 1,
        "round robin spreads the rows: {buckets:?}"
    );
    let outcomes = o
        .redrive_dead_letters(
            &mut conn,
            &Redrive::matching(outbox::dlq::DeadLetterFilter::new().queue("dead"), 10),
        )
        .await
        .unwrap();
    assert_eq!(outcomes.len(), 5);
    for (letter, outcome) in letters.iter().zip(&outcomes) {
        assert_eq!(outcome.dead_letter_id, letter.id);
        let RedriveResult::Redriven { id } = outcome.result else {
            panic!("{outcome:?}");
        };
        assert_eq!(bucket(id), bucket(letter.original_id));
    }
    assert_eq!(o.pending(&mut conn, "dead", 10).await.unwrap().len(), 5);
    let again = o
        .redrive_dead_letters(&mut conn, &Redrive::ids([letters[0].id, i64::MAX]))
        .await
        .unwrap();
    assert!(
        matches!(again[0].result, RedriveResult::AlreadyRedriven { .. }),
        "{again:?}"
    );
    assert_eq!(again[1].result, RedriveResult::NotFound);
    tokio::time::sleep(Duration::from_millis(20)).await;
    let purged = o
        .purge_dead_letters(
            &strict,
            &outbox::dlq::DeadLetterFilter::new().older_than(Duration::from_millis(1)),
            2,
        )
        .await
        .unwrap();
    assert_eq!(purged, 5);
    drop((conn, one));
    strict.close().await;
    f.cleanup().await;
}

#[tokio::test]
#[ignore = "needs a Citus cluster: .ci/citus -- cargo nextest run --run-ignored only -E 'test(/citus/)'"]
async fn a_publish_wakes_a_worker_listening_on_the_coordinator() {
    let f = cluster().await;
    let idle_poll = Duration::from_secs(30);
    let runs = Arc::new(AtomicUsize::new(0));
    let worker = Worker::builder(f.store.clone())
        .concurrency(2)
        .idle_poll(idle_poll)
        .queue("wake", outbox_tests::count_runs::<Vec<u8>>(&runs))
        .build()
        .unwrap()
        .start();
    // Let the worker go idle: nothing due, its next look is `idle_poll` away.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut conn = f.pool.acquire().await.unwrap();
    let published = std::time::Instant::now();
    // A plain message, a keyed timer, an extend that inserts: each notifies on commit.
    f.outbox
        .publish(&mut conn, Message::new("wake", b"a"))
        .await
        .unwrap();
    f.outbox
        .publish(&mut conn, Message::new("wake", b"b").timer_id("k1"))
        .await
        .unwrap();
    f.outbox
        .publish(
            &mut conn,
            Message::new("wake", b"c")
                .timer_id("k2")
                .on_conflict(OnConflict::Extend),
        )
        .await
        .unwrap();
    eventually(10, "three runs woken by NOTIFY", || {
        let runs = runs.clone();
        async move { runs.load(Ordering::SeqCst) == 3 }
    })
    .await;
    // Well inside the idle poll: the notifications reached the coordinator's LISTEN.
    assert!(
        published.elapsed() * 3 < idle_poll,
        "{:?}",
        published.elapsed()
    );
    drop(conn);
    assert!(worker.shutdown().await.graceful);
    f.cleanup().await;
}
