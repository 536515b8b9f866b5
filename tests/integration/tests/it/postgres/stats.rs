//! Queue statistics on Postgres (SPEC §8): exact counts of crafted
//! rows on the database clock, the caller's own snapshot, estimate mode after `ANALYZE`
//! (and its plan: no scan of the backlog), dead letters with the dead-letter queue off and
//! on a table without the redrive columns, and bad input rejected before any SQL. The
//! counting logic on a frozen clock, shared with the in-memory store, is in the contract
//! suite (`contract::stats`).

use std::time::Duration;

use outbox::stats::{Count, QueueStats, StatsMode, StatsRequest};
use outbox::{Error, Outbox};
use outbox_tests::Fixture;
use serde_json::Value;
use sqlx::{AssertSqlSafe, PgPool};

const TTL: Duration = Duration::from_secs(60);

async fn exec(pool: &PgPool, sql: String) {
    sqlx::raw_sql(AssertSqlSafe(sql.clone()))
        .execute(pool)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{sql}"));
}

async fn stats(f: &Fixture, request: &StatsRequest) -> Vec<QueueStats> {
    let mut conn = f.pool.acquire().await.unwrap();
    f.outbox.stats(&mut conn, request).await.unwrap()
}

fn of<'a>(all: &'a [QueueStats], queue: &str) -> &'a QueueStats {
    all.iter()
        .find(|s| s.queue == queue)
        .unwrap_or_else(|| panic!("no figures for {queue}: {all:#?}"))
}

/// `lateness` lies in `[at_least, at_least + 30 s)`: the rows were written a moment before
/// the read, on the same clock (30 s: far beyond any test's pause between the two).
fn late_by(lateness: Option<Duration>, at_least: u64) {
    let l = lateness.expect("a due row");
    assert!(
        l >= Duration::from_secs(at_least) && l < Duration::from_secs(at_least + 30),
        "{l:?} vs {at_least} s"
    );
}

/// Rows in every state, written with SQL relative to `now()`:
///
/// - `a`: pending not due (in 1 h), due 10 s ago, due 5 s ago; leased 1 s ago; leased
///   120 s ago with a queued rearm; leased 120 s ago with a cancel mark; one dead letter;
/// - `b`: due 20 s ago; leased 90 s ago (expired under 60 s, not under 300 s);
/// - `only-dead`: three dead letters, one of them redriven (not counted).
async fn crafted(f: &Fixture) {
    let (t, d) = (f.outbox.table(), f.outbox.dead_letter_table());
    exec(
        &f.pool,
        format!(
            "INSERT INTO {t} (queue, payload, next_attempt_at) VALUES \
               ('a', 'x', now() + interval '1 hour'), \
               ('a', 'x', now() - interval '10 seconds'), \
               ('a', 'x', now() - interval '5 seconds'), \
               ('b', 'x', now() - interval '20 seconds'); \
             INSERT INTO {t} (queue, payload, next_attempt_at, acquired_at, acquired_token, \
                              rearm_at, rearm_payload, cancelled_at) VALUES \
               ('a', 'x', now() - interval '2 seconds', now() - interval '1 second', gen_random_uuid(), NULL, NULL, NULL), \
               ('a', 'x', now() - interval '3 minutes', now() - interval '120 seconds', gen_random_uuid(), now() + interval '1 minute', 'r', NULL), \
               ('a', 'x', now() - interval '3 minutes', now() - interval '120 seconds', gen_random_uuid(), NULL, NULL, now()), \
               ('b', 'x', now() - interval '2 minutes', now() - interval '90 seconds', gen_random_uuid(), NULL, NULL, NULL); \
             INSERT INTO {d} (original_id, queue, payload, attempts_count, deliveries_count, \
                              created_at, failure_reason, redriven_at) VALUES \
               (1, 'a', 'x', 1, 1, now(), 'rejected', NULL), \
               (2, 'only-dead', 'x', 1, 1, now(), 'rejected', NULL), \
               (3, 'only-dead', 'x', 1, 1, now(), 'rejected', NULL), \
               (4, 'only-dead', 'x', 1, 1, now(), 'rejected', now());"
        ),
    )
    .await;
}

#[tokio::test]
async fn exact_counts_of_every_state_on_the_database_clock() {
    let f = Fixture::new().await;
    crafted(&f).await;
    let e = Count::Exact;

    let all = stats(&f, &StatsRequest::new(TTL)).await;
    let queues: Vec<&str> = all.iter().map(|s| s.queue.as_str()).collect();
    assert_eq!(queues, ["a", "b", "only-dead"], "{all:#?}");
    let a = of(&all, "a");
    assert_eq!(
        (a.pending, a.due, a.leased, a.expired_leases),
        (e(3), e(2), e(3), e(2))
    );
    assert_eq!(
        (a.rearms, a.cancel_marks, a.dead_letters),
        (e(1), e(1), e(1))
    );
    late_by(a.oldest_due_lateness, 10);
    let b = of(&all, "b");
    assert_eq!(
        (b.pending, b.due, b.leased, b.expired_leases, b.dead_letters),
        (e(1), e(1), e(1), e(1), e(0))
    );
    late_by(b.oldest_due_lateness, 20);
    let dead = of(&all, "only-dead");
    assert_eq!(
        (dead.pending, dead.due, dead.leased, dead.dead_letters),
        (e(0), e(0), e(0), e(2)),
        "the redriven dead letter is not counted"
    );
    assert_eq!(dead.oldest_due_lateness, None);

    // b's workers hold leases for 5 minutes: its 90 s old lease has not expired.
    let per_queue = StatsRequest::new(TTL).lease_ttl_for("b", Duration::from_secs(300));
    let all = stats(&f, &per_queue).await;
    assert_eq!(of(&all, "b").expired_leases, e(0));
    assert_eq!(of(&all, "a").expired_leases, e(2));

    // The statement runs on the caller's connection, in its snapshot: a row this
    // transaction inserted counts before it commits, for this transaction only.
    let mut tx = f.pool.begin().await.unwrap();
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {} (queue, payload) VALUES ('c', 'x')",
        f.outbox.table()
    )))
    .execute(&mut *tx)
    .await
    .unwrap();
    let inside = f
        .outbox
        .stats(&mut tx, &StatsRequest::new(TTL).queues(["c"]))
        .await
        .unwrap();
    assert_eq!((inside[0].pending, inside[0].due), (e(1), e(1)));
    let outside = stats(&f, &StatsRequest::new(TTL).queues(["c"])).await;
    assert_eq!(outside[0].pending, e(0));
    tx.rollback().await.unwrap();
    f.cleanup().await;
}

/// Rows per queue for the estimate test: `a` 6 000 (50 of them leased, 30 of those expired),
/// `b` 3 000, `c` 1 000; dead letters: 400 of `dlq-only`, 100 of `a`.
async fn backlog(f: &Fixture) {
    let (t, d) = (f.outbox.table(), f.outbox.dead_letter_table());
    exec(
        &f.pool,
        format!(
            "INSERT INTO {t} (queue, payload, next_attempt_at) \
               SELECT q, 'x', now() - interval '1 minute' + (i % 120) * interval '1 second' \
               FROM (VALUES ('a', 5950), ('b', 3000), ('c', 1000)) AS v(q, n), \
                    generate_series(1, n) AS i; \
             INSERT INTO {t} (queue, payload, next_attempt_at, acquired_at, acquired_token) \
               SELECT 'a', 'x', now() - interval '5 minutes', \
                      now() - CASE WHEN i <= 30 THEN interval '10 minutes' ELSE interval '1 second' END, \
                      gen_random_uuid() \
               FROM generate_series(1, 50) AS i; \
             INSERT INTO {d} (original_id, queue, payload, attempts_count, deliveries_count, \
                              created_at, failure_reason) \
               SELECT i, CASE WHEN i <= 400 THEN 'dlq-only' ELSE 'a' END, 'x', 1, 1, now(), 'rejected' \
               FROM generate_series(1, 500) AS i;"
        ),
    )
    .await;
}

/// `got` is an estimate within 5 % of `truth`.
fn near(got: Count, truth: u64) {
    let Count::Estimate(n) = got else {
        panic!("expected an estimate of {truth}, got {got:?}")
    };
    let off = n.abs_diff(truth) as f64 / truth.max(1) as f64;
    assert!(off <= 0.05, "estimate {n} vs {truth}");
}

#[tokio::test]
async fn estimate_mode_reads_the_planner_statistics() {
    let f = Fixture::new().await;
    let estimate = StatsRequest::new(TTL).mode(StatsMode::Estimate);

    // Before the first ANALYZE of a table there is nothing to estimate from (a new table's
    // reltuples is -1): the dead-letter table's figure is unavailable. (The migrations
    // leave the queue table at reltuples 0: an estimate of nothing.) Leases are counted.
    let fresh = stats(&f, &estimate.clone().queues(["a"])).await;
    assert_eq!(fresh[0].dead_letters, Count::Unavailable, "{fresh:#?}");
    assert!(
        matches!(fresh[0].pending, Count::Unavailable | Count::Estimate(0)),
        "{fresh:#?}"
    );
    assert_eq!(fresh[0].leased, Count::Exact(0));
    assert!(stats(&f, &estimate).await.is_empty());

    backlog(&f).await;
    exec(
        &f.pool,
        format!(
            "ANALYZE {}; ANALYZE {}",
            f.outbox.table(),
            f.outbox.dead_letter_table()
        ),
    )
    .await;
    let all = stats(&f, &estimate).await;
    let queues: Vec<&str> = all.iter().map(|s| s.queue.as_str()).collect();
    assert_eq!(queues, ["a", "b", "c", "dlq-only"], "{all:#?}");
    let a = of(&all, "a");
    near(a.pending, 5950);
    assert_eq!(a.due, Count::Unavailable);
    assert_eq!(
        (a.leased, a.expired_leases, a.rearms, a.cancel_marks),
        (
            Count::Exact(50),
            Count::Exact(30),
            Count::Exact(0),
            Count::Exact(0)
        )
    );
    late_by(a.oldest_due_lateness, 60);
    near(a.dead_letters, 100);
    near(of(&all, "b").pending, 3000);
    near(of(&all, "c").pending, 1000);
    near(of(&all, "dlq-only").dead_letters, 400);
    assert_eq!(of(&all, "dlq-only").oldest_due_lateness, None);

    // Listed queues: a queue the statistics do not know is estimated at (nearly) nothing.
    let listed = stats(&f, &estimate.clone().queues(["c", "ghost"])).await;
    assert_eq!(listed.len(), 2);
    near(listed[0].pending, 1000);
    let Count::Estimate(ghost) = listed[1].pending else {
        panic!("{listed:#?}")
    };
    assert!(ghost <= 50, "{ghost}");

    // With the dead-letter queue off the dead-letter table is not read.
    let quiet = Outbox::builder()
        .table(f.outbox.table().trim_matches('"'))
        .build()
        .unwrap();
    let mut conn = f.pool.acquire().await.unwrap();
    let off = quiet.stats(&mut conn, &estimate).await.unwrap();
    assert!(off.iter().all(|s| s.dead_letters == Count::Unavailable));
    assert_eq!(
        off.iter().map(|s| s.queue.as_str()).collect::<Vec<_>>(),
        ["a", "b", "c"]
    );
    f.cleanup().await;
}

/// Found by a trial run: a queue table never analyzed (`reltuples` -1, as Postgres
/// 14+ marks a new table until its first VACUUM or ANALYZE) showed `~0` pending for a queue
/// with rows, and a queue without leases vanished from the list. Now its pending figure is
/// unavailable and every queue with a pending row is listed (a skip scan of the pending
/// index).
#[tokio::test]
async fn estimate_mode_on_a_table_never_analyzed() {
    let f = Fixture::new().await;
    backlog(&f).await;
    // What a table that was never vacuumed or analyzed shows (the test role is the
    // database owner and a superuser on the test server).
    exec(
        &f.pool,
        format!(
            "UPDATE pg_class SET reltuples = -1 WHERE oid = to_regclass('{}')",
            f.outbox.table().replace('\'', "''")
        ),
    )
    .await;
    let all = stats(&f, &StatsRequest::new(TTL).mode(StatsMode::Estimate)).await;
    let queues: Vec<&str> = all.iter().map(|s| s.queue.as_str()).collect();
    assert_eq!(queues, ["a", "b", "c"], "{all:#?}");
    for s in &all {
        assert_eq!(s.pending, Count::Unavailable, "{s:#?}");
    }
    assert_eq!(of(&all, "a").leased, Count::Exact(50));
    late_by(of(&all, "b").oldest_due_lateness, 60);
    f.cleanup().await;
}

/// Every scan node of `plan` on `table`, by node type.
fn scans_of(plan: &Value, table: &str, out: &mut Vec<String>) {
    let kind = plan["Node Type"].as_str().unwrap_or("");
    if plan.get("Relation Name").and_then(Value::as_str) == Some(table) {
        out.push(kind.to_owned());
    }
    for c in plan
        .get("Plans")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        scans_of(c, table, out);
    }
}

/// The estimate statements never scan the queue table (the backlog) sequentially: the
/// leased rows come from the lease index, the oldest deadline from one probe of the
/// pending index per queue.
#[tokio::test]
async fn estimate_mode_does_not_scan_the_backlog() {
    let f = Fixture::new().await;
    backlog(&f).await;
    exec(&f.pool, format!("ANALYZE {}", f.outbox.table())).await;
    let table = f.outbox.table().trim_matches('"').to_owned();
    let statements = f.outbox.statements();
    let mut seen = 0;
    for (name, sql) in &statements {
        if !name.starts_with("stats.estimate") {
            continue;
        }
        let text = format!("EXPLAIN (FORMAT JSON) {sql}");
        let ttls: Vec<String> = Vec::new();
        let mut q = sqlx::query_scalar::<_, Value>(AssertSqlSafe(text))
            .bind(sqlx::postgres::types::PgInterval {
                months: 0,
                days: 0,
                microseconds: 60_000_000,
            })
            .bind(ttls)
            .bind(Vec::<sqlx::postgres::types::PgInterval>::new())
            .bind(true);
        if *name == "stats.estimate_queues" {
            q = q.bind(vec!["a".to_owned(), "b".to_owned()]);
        }
        let plan = q.fetch_one(&f.pool).await.unwrap();
        let mut scans = Vec::new();
        scans_of(&plan[0]["Plan"], &table, &mut scans);
        assert!(!scans.is_empty(), "{name}: {plan:#}");
        assert!(
            scans.iter().all(|k| k != "Seq Scan"),
            "{name} scans the queue table: {scans:?}\n{plan:#}"
        );
        seen += 1;
    }
    assert_eq!(seen, 2);
    f.cleanup().await;
}

#[tokio::test]
async fn dead_letters_need_the_redrive_columns_only_with_the_dead_letter_queue_on() {
    // Migrated with the dead-letter queue off: the steps that add `redriven_at` were left
    // for an outbox that has it on.
    let f = Fixture::with(|b| b.dead_letter(false)).await;
    let columns: Vec<String> = sqlx::query_scalar(
        "SELECT attname::text FROM pg_attribute WHERE attrelid = $1::regclass AND attnum > 0",
    )
    .bind(f.outbox.dead_letter_table())
    .fetch_all(&f.pool)
    .await
    .unwrap();
    assert!(!columns.iter().any(|c| c == "redriven_at"), "{columns:?}");
    let got = stats(&f, &StatsRequest::new(TTL).queues(["a"])).await;
    assert_eq!(got[0].dead_letters, Count::Unavailable);

    let on = Outbox::builder()
        .table(f.outbox.table().trim_matches('"'))
        .dead_letter(true)
        .build()
        .unwrap();
    let mut conn = f.pool.acquire().await.unwrap();
    let e = on
        .stats(&mut conn, &StatsRequest::new(TTL))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::UpgradeRequired { .. }), "{e:?}");
    on.migrate(&f.pool).await.unwrap();
    assert!(on
        .stats(&mut conn, &StatsRequest::new(TTL))
        .await
        .unwrap()
        .is_empty());
    drop(conn);
    f.cleanup().await;
}

#[tokio::test]
async fn bad_requests_are_rejected_before_any_sql() {
    // Tables that do not exist: a request that reached the database would fail with
    // NotMigrated, so an InvalidArgument proves nothing was sent.
    let pool = outbox_tests::pool_with(1).await;
    let missing = Outbox::builder()
        .table(outbox_tests::unique_table("nope"))
        .dead_letter(true)
        .build()
        .unwrap();
    let mut conn = pool.acquire().await.unwrap();
    let ok = StatsRequest::new(TTL);
    for (request, field) in [
        (StatsRequest::new(Duration::ZERO), "lease_ttl"),
        (ok.clone().lease_ttl_for("a", Duration::ZERO), "lease_ttl"),
        (ok.clone().queues([""]), "queue"),
        (
            ok.clone().mode(StatsMode::Estimate).queues(["x\0y"]),
            "queue",
        ),
    ] {
        match missing.stats(&mut conn, &request).await {
            Err(Error::InvalidArgument { field: f, .. }) => assert_eq!(f, field),
            other => panic!("{request:?}: {other:?}"),
        }
    }
    for mode in [StatsMode::Exact, StatsMode::Estimate] {
        let e = missing
            .stats(&mut conn, &ok.clone().mode(mode))
            .await
            .unwrap_err();
        assert!(matches!(e, Error::NotMigrated { .. }), "{mode:?}: {e:?}");
    }
}
