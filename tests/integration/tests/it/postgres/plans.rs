//! Plans that do not depend on fresh statistics (SPEC §6, §12 v2).
//!
//! The case: a table drained until its statistics say it is nearly empty, one long-lived
//! timer left on its last page (so VACUUM cannot truncate it), then a burst of 200 000
//! rows that fits in the pages the drain freed, with no ANALYZE since (autovacuum off for
//! the table). The planner scales `reltuples` by the table's current size in pages, which
//! did not change, so it believes the table holds one row. With such statistics the
//! planner believes the table holds a row or two; a write that found its rows only through
//! a join (`t.id = due.id`) was planned with the whole table as the outer side, every row
//! filtered against the claimed ids (~490 ms per claim of 10 here). Every statement the
//! runtime runs must have a shape whose only sensible plan reaches the table through an
//! index condition: this test builds the state and reads each plan with `EXPLAIN`.

use std::time::Duration;

use outbox::{
    message::{BatchItem, Schedule},
    store::{ClaimRequest, Store},
    Message,
};
use outbox_tests::Fixture;
use serde_json::Value;
use sqlx::postgres::types::PgInterval;
use sqlx::AssertSqlSafe;
use uuid::Uuid;

const TTL: Duration = Duration::from_secs(60);
const BURST: usize = 200_000;
const BATCH: usize = 10_000;

fn interval(micros: i64) -> PgInterval {
    PgInterval {
        months: 0,
        days: 0,
        microseconds: micros,
    }
}

/// Every scan node of `plan` on `table`, as `(node type, has an index condition)`.
fn scans_of(plan: &Value, table: &str, out: &mut Vec<(String, bool)>) {
    let kind = plan["Node Type"].as_str().unwrap_or("").to_owned();
    // ModifyTable names the relation too; only scans read it.
    if plan.get("Relation Name").and_then(Value::as_str) == Some(table) && kind.ends_with("Scan") {
        let cond = ["Index Cond", "Recheck Cond", "TID Cond"]
            .iter()
            .any(|k| plan.get(*k).is_some());
        out.push((kind, cond));
    }
    if let Some(children) = plan.get("Plans").and_then(Value::as_array) {
        for c in children {
            scans_of(c, table, out);
        }
    }
}

type Scalar<'q> = sqlx::query::QueryScalar<'q, sqlx::Postgres, Value, sqlx::postgres::PgArguments>;

/// The JSON plan of `sql` with its parameters bound by `bind`.
async fn plan_of<'q>(
    f: &Fixture,
    sql: &'q str,
    bind: impl FnOnce(Scalar<'q>) -> Scalar<'q>,
) -> Value {
    let text: &'q str = Box::leak(format!("EXPLAIN (FORMAT JSON) {sql}").into_boxed_str());
    bind(sqlx::query_scalar(AssertSqlSafe(text)))
        .fetch_one(&f.pool)
        .await
        .unwrap_or_else(|e| panic!("EXPLAIN failed: {e}\n{sql}"))
}

/// The scans of the fixture's table in the plan of `sql` (see [`plan_of`]), and the plan's
/// text for messages.
async fn explain<'q>(
    f: &Fixture,
    sql: &'q str,
    bind: impl FnOnce(Scalar<'q>) -> Scalar<'q>,
) -> (Vec<(String, bool)>, String) {
    let plan = plan_of(f, sql, bind).await;
    let table = f.outbox.table().trim_matches('"').to_owned();
    let mut scans = Vec::new();
    scans_of(&plan[0]["Plan"], &table, &mut scans);
    (scans, serde_json::to_string_pretty(&plan).unwrap())
}

/// Builds the stale-statistics state on the fixture's table.
async fn stale_statistics(f: &Fixture) {
    let t = f.outbox.table();
    let setup = format!(
        "ALTER TABLE {t} SET (autovacuum_enabled = false, toast.autovacuum_enabled = false); \
         INSERT INTO {t} (queue, payload, next_attempt_at) \
           SELECT 'drained', 'x', now() FROM generate_series(1, 400000);"
    );
    sqlx::raw_sql(AssertSqlSafe(setup))
        .execute(&f.pool)
        .await
        .unwrap();
    // The long-lived timer, on the last page.
    let mut conn = f.pool.acquire().await.unwrap();
    f.outbox
        .publish(
            &mut conn,
            Message::new("long", b"keep")
                .timer_id("one")
                .schedule(Duration::from_secs(86_400)),
        )
        .await
        .unwrap();
    let drain = format!("DELETE FROM {t} WHERE queue = 'drained'");
    sqlx::raw_sql(AssertSqlSafe(drain))
        .execute(&f.pool)
        .await
        .unwrap();
    let vacuum = format!("VACUUM ANALYZE {t}");
    sqlx::raw_sql(AssertSqlSafe(vacuum))
        .execute(&f.pool)
        .await
        .unwrap();
    // The burst, with the public batch publish; no ANALYZE after it.
    let payloads: Vec<Vec<u8>> = (0..BATCH).map(|i| format!("m{i}").into_bytes()).collect();
    for _ in 0..BURST / BATCH {
        let items: Vec<BatchItem<'_>> = payloads.iter().map(|p| BatchItem::new(p)).collect();
        f.outbox
            .publish_batch(&mut conn, "q", &items, Schedule::now())
            .await
            .unwrap();
    }
}

#[tokio::test]
async fn every_statement_reaches_the_table_through_an_index_with_stale_statistics() {
    let f = Fixture::new().await;
    stale_statistics(&f).await;
    let t = f.outbox.table();
    let name = t.trim_matches('"').to_owned();

    // The state is the case's: the statistics still say the table is nearly empty.
    let reltuples: f32 =
        sqlx::query_scalar("SELECT reltuples FROM pg_class WHERE oid = $1::regclass")
            .bind(t)
            .fetch_one(&f.pool)
            .await
            .unwrap();
    assert!(
        reltuples < 10.0,
        "statistics were refreshed: reltuples {reltuples}"
    );
    let live: i64 = sqlx::query_scalar(AssertSqlSafe(format!("SELECT count(*) FROM {t}")))
        .fetch_one(&f.pool)
        .await
        .unwrap();
    assert_eq!(live, BURST as i64 + 1);
    // And it misleads the planner: the claim's shape before this fix (its write found the
    // claimed rows only through a join with the locking CTE) is planned with a full scan of
    // the primary key as the outer side, 200 000 rows × 10 filtered.
    let join_only = format!(
        "WITH due AS (SELECT c.id FROM unnest(ARRAY['q', 'long']) AS q(queue) \
           CROSS JOIN LATERAL (SELECT id FROM {t} WHERE queue = q.queue \
             AND acquired_token IS NULL AND next_attempt_at <= now() \
             ORDER BY next_attempt_at LIMIT 10 FOR UPDATE SKIP LOCKED) c ORDER BY id LIMIT 10) \
         UPDATE {t} t SET acquired_at = now() FROM due WHERE t.id = due.id"
    );
    let (scans, plan) = explain(&f, &join_only, |q| q).await;
    assert!(
        scans.iter().any(|(kind, cond)| kind == "Seq Scan" || !cond),
        "the stale statistics did not mislead the planner; the case is not reproduced:\n{plan}"
    );

    // Real leases to explain the completions with.
    let queues = vec!["q".to_owned(), "long".to_owned()];
    let claimed = f
        .store
        .claim(ClaimRequest::new(&queues, 10, TTL))
        .await
        .unwrap();
    assert_eq!(claimed.len(), 10);
    let ids: Vec<i64> = claimed.iter().map(|d| d.lease.id).collect();
    let tokens: Vec<Uuid> = claimed.iter().map(|d| d.lease.token).collect();
    let (id, token) = (ids[0], tokens[0]);
    let caps = vec![10i64, 10];
    let ttl = interval(60_000_000);

    let statements = f.outbox.statements();
    let mut checked = Vec::new();
    let mut unbounded = Vec::new();
    for (stmt, sql) in &statements {
        let explained = match *stmt {
            "claim.claim" => {
                explain(&f, sql, |q| {
                    q.bind(queues.clone())
                        .bind(10i64)
                        .bind(ttl)
                        .bind(Uuid::new_v4())
                        .bind(Vec::<i64>::new())
                        .bind(caps.clone())
                })
                .await
            }
            "claim.claim_only" => {
                explain(&f, sql, |q| {
                    q.bind(queues.clone())
                        .bind(10i64)
                        .bind(ttl)
                        .bind(Uuid::new_v4())
                        .bind(Vec::<i64>::new())
                        .bind(caps.clone())
                        .bind(ids.clone())
                })
                .await
            }
            "claim.peek" => {
                explain(&f, sql, |q| {
                    q.bind(queues.clone())
                        .bind(10i64)
                        .bind(ttl)
                        .bind(ids.clone())
                        .bind(caps.clone())
                })
                .await
            }
            "claim.next_wakeup" => {
                explain(&f, sql, |q| {
                    q.bind(queues.clone()).bind(ttl).bind(ids.clone())
                })
                .await
            }
            "complete.ack_delete"
            | "complete.ack_settle"
            | "complete.fail_delete"
            | "cancel.mark" => explain(&f, sql, |q| q.bind(id).bind(token)).await,
            "complete.retry" => {
                explain(&f, sql, |q| {
                    q.bind(id).bind(token).bind(interval(1_000_000))
                })
                .await
            }
            "complete.fail_archive" => {
                explain(&f, sql, |q| {
                    q.bind(id)
                        .bind(token)
                        .bind("rejected")
                        .bind(Some("boom"))
                        .bind(1i32)
                })
                .await
            }
            "complete.ack_batch_delete" | "complete.ack_batch_settle" | "complete.renew" => {
                explain(&f, sql, |q| q.bind(ids.clone()).bind(tokens.clone())).await
            }
            "complete.release" => {
                explain(&f, sql, |q| {
                    q.bind(ids.clone())
                        .bind(tokens.clone())
                        .bind(vec![true; ids.len()])
                })
                .await
            }
            "complete.fail_unclaimed" => {
                explain(&f, sql, |q| {
                    q.bind(id)
                        .bind(ttl)
                        .bind("rejected")
                        .bind(Some("boom"))
                        .bind(true)
                })
                .await
            }
            "periodic.arm_next" => {
                explain(&f, sql, |q| q.bind(id).bind(token).bind(chrono::Utc::now())).await
            }
            // The keyed writes look for their key's row before they insert (issue 27): the
            // look must go through `<t>_timer_id_uq`.
            "publish.insert" => {
                explain(&f, sql, |q| {
                    q.bind("long")
                        .bind(b"x".to_vec())
                        .bind(None::<Value>)
                        .bind(interval(0))
                        .bind(None::<chrono::DateTime<chrono::Utc>>)
                        .bind("one")
                })
                .await
            }
            "publish.extend" => {
                explain(&f, sql, |q| {
                    q.bind("long")
                        .bind(b"x".to_vec())
                        .bind(None::<Value>)
                        .bind(interval(0))
                        .bind(None::<chrono::DateTime<chrono::Utc>>)
                        .bind("one")
                        .bind(interval(0))
                })
                .await
            }
            "periodic.register" => {
                explain(&f, sql, |q| {
                    q.bind("long")
                        .bind("schedule:s")
                        .bind(b"x".to_vec())
                        .bind(serde_json::json!({}))
                        .bind(chrono::Utc::now())
                })
                .await
            }
            "cancel.lock" => explain(&f, sql, |q| q.bind("long").bind("one")).await,
            "cancel.delete" => explain(&f, sql, |q| q.bind(id)).await,
            _ => continue,
        };
        let (scans, plan) = explained;
        assert!(!scans.is_empty(), "{stmt} does not read {name}?\n{plan}");
        for (kind, cond) in &scans {
            if !(matches!(
                kind.as_str(),
                "Index Scan" | "Index Only Scan" | "Bitmap Heap Scan" | "Tid Scan"
            ) && *cond)
            {
                unbounded.push(format!(
                    "{stmt}: {kind} on {name} without an index condition:\n{plan}"
                ));
            }
        }
        checked.push(*stmt);
    }
    assert!(unbounded.is_empty(), "{}", unbounded.join("\n"));
    // Every statement of the worker's path was read (a renamed one must not slip out).
    for must in [
        "claim.claim",
        "claim.claim_only",
        "claim.peek",
        "claim.next_wakeup",
        "complete.ack_delete",
        "complete.ack_settle",
        "complete.ack_batch_delete",
        "complete.ack_batch_settle",
        "complete.retry",
        "complete.fail_archive",
        "complete.fail_delete",
        "complete.renew",
        "complete.release",
        "complete.fail_unclaimed",
        "cancel.lock",
        "cancel.delete",
        "cancel.mark",
        "periodic.arm_next",
        "periodic.register",
        "publish.insert",
        "publish.extend",
    ] {
        assert!(checked.contains(&must), "{must} was not explained");
    }

    // With fresh statistics the claim's estimates stay those of its limit: each branch's
    // LIMIT must be a value the planner knows. A LIMIT read from the LATERAL's outer side
    // is estimated as a tenth of the table, which at 10^7 rows turned on JIT compilation
    // (470 ms for a 1 ms claim, found by the growth curves).
    let analyze = format!("ANALYZE {t}");
    sqlx::raw_sql(AssertSqlSafe(analyze))
        .execute(&f.pool)
        .await
        .unwrap();
    let claim_sql = &statements
        .iter()
        .find(|(n, _)| *n == "claim.claim")
        .unwrap()
        .1;
    let plan = plan_of(&f, claim_sql, |q| {
        q.bind(queues.clone())
            .bind(10i64)
            .bind(ttl)
            .bind(Uuid::new_v4())
            .bind(Vec::<i64>::new())
            .bind(caps.clone())
    })
    .await;
    fn cte<'a>(plan: &'a Value, name: &str) -> Option<&'a Value> {
        if plan.get("Subplan Name").and_then(Value::as_str) == Some(name) {
            return Some(plan);
        }
        plan.get("Plans")?
            .as_array()?
            .iter()
            .find_map(|c| cte(c, name))
    }
    let cand = cte(&plan[0]["Plan"], "CTE cand").expect("the claim has its candidates CTE");
    let rows = cand["Plan Rows"].as_f64().unwrap();
    assert!(
        rows <= (2 * 10 * queues.len()) as f64,
        "the candidates are estimated at {rows} rows, beyond 2 branches × {} queues × limit 10:\n{plan:#}",
        queues.len()
    );
    let cost = plan[0]["Plan"]["Total Cost"].as_f64().unwrap();
    assert!(
        cost < 100_000.0,
        "estimated cost {cost} reaches jit_above_cost"
    );

    // And the claim still takes the oldest rows of the burst, round robin with the other
    // queue (whose only timer is not due).
    let again = f
        .store
        .claim(ClaimRequest::new(&queues, 10, TTL).excluding(&ids))
        .await
        .unwrap();
    assert_eq!(again.len(), 10);
    assert!(again.iter().all(|d| d.queue == "q"));
    assert!(again.iter().all(|d| !ids.contains(&d.lease.id)));
    f.cleanup().await;
}

/// The ordered relay's claim (`Relay::ordered_by_header`) on a backlog of 10⁵ keyed rows
/// with fresh statistics, with and without the key index the guide recommends: every read
/// of the table goes through an index condition, and the estimated cost stays below
/// `jit_above_cost` (its first shape, one scan of the table in id order, was planned as a
/// sequential scan with a probe per row once the key index existed, 950 ms a claim, and
/// without it at a cost that switched on JIT compilation: 390 ms for a 1.3 ms claim).
#[tokio::test]
async fn the_ordered_claim_reaches_the_table_through_indexes_below_jit_cost() {
    let f = Fixture::new().await;
    let t = f.outbox.table();
    let name = t.trim_matches('"').to_owned();
    let fill = format!(
        "INSERT INTO {t} (queue, payload, headers, next_attempt_at) \
           SELECT 'orders', 'x', jsonb_build_object('key', 'k' || (i % 1000)), \
                  now() - interval '1 minute' \
           FROM generate_series(1, 100000) i; \
         ANALYZE {t};"
    );
    sqlx::raw_sql(AssertSqlSafe(fill))
        .execute(&f.pool)
        .await
        .unwrap();
    let sql = f.outbox.ordered_claim_statement("key");
    for with_index in [false, true] {
        if with_index {
            let index = format!(
                "CREATE INDEX {name}_key_idx ON {t} (queue, (headers ->> 'key'), id) \
                   WHERE headers ? 'key'; ANALYZE {t};"
            );
            sqlx::raw_sql(AssertSqlSafe(index))
                .execute(&f.pool)
                .await
                .unwrap();
        }
        let plan = plan_of(&f, &sql, |q| {
            q.bind(vec!["orders".to_owned()])
                .bind(64i64)
                .bind(interval(60_000_000))
                .bind(Vec::<i64>::new())
                .bind(Uuid::new_v4())
        })
        .await;
        let mut scans = Vec::new();
        scans_of(&plan[0]["Plan"], &name, &mut scans);
        assert!(!scans.is_empty(), "no read of {name}?\n{plan:#}");
        for (kind, cond) in &scans {
            assert!(
                matches!(
                    kind.as_str(),
                    "Index Scan" | "Index Only Scan" | "Bitmap Heap Scan"
                ) && *cond,
                "key index {with_index}: {kind} on {name} without an index condition:\n{plan:#}"
            );
        }
        let cost = plan[0]["Plan"]["Total Cost"].as_f64().unwrap();
        assert!(
            cost < 100_000.0,
            "key index {with_index}: estimated cost {cost} reaches jit_above_cost:\n{plan:#}"
        );
    }
    f.cleanup().await;
}
