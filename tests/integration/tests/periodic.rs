//! Periodic timers on Postgres (SPEC §9.1, issue 17): registrations of one schedule racing
//! each other leave exactly one live row. The single-session rules of `arm_next` and
//! registration are in the contract suite (`contract.rs`), on both stores.

use chrono::{DateTime, TimeDelta, Utc};
use futures::future::join_all;
use outbox::store::{RegisterSchedule, Registered, Store, SCHEDULE_HEADER};
use outbox::{message::Headers, PgStore};
use outbox_tests::{eventually, Fixture};
use sqlx::{AssertSqlSafe, Row};

const Q: &str = "reports";

fn fingerprint(fp: &str) -> Headers {
    [(SCHEDULE_HEADER.to_owned(), fp.to_owned())].into()
}

fn micros(t: DateTime<Utc>) -> DateTime<Utc> {
    DateTime::from_timestamp_micros(t.timestamp_micros()).expect("in range")
}

async fn register(store: &PgStore, key: &str, fp: &str, first: DateTime<Utc>) -> Registered {
    let hs = fingerprint(fp);
    store
        .register_schedule(RegisterSchedule::new(Q, key, b"{}", &hs, first))
        .await
        .expect("register")
}

/// Sessions of this test waiting for a lock on a statement that names its table.
async fn waiting_on_a_lock(f: &Fixture) -> i64 {
    sqlx::query(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
         AND strpos(query, $1) > 0",
    )
    .bind(f.outbox.table().to_string())
    .fetch_one(&f.pool)
    .await
    .unwrap()
    .get(0)
}

/// A registration whose insert waits for another registration's uncommitted insert of the
/// same key takes the conflict branch once that commits: one row, and the second writes
/// nothing (same fingerprint) or brings the row to its schedule (another fingerprint).
#[tokio::test]
async fn a_registration_waiting_on_another_finds_its_row() {
    let f = Fixture::new().await;
    let register_sql = outbox::__private::statements(&f.outbox)
        .into_iter()
        .find(|(name, _)| *name == "periodic.register")
        .expect("the register statement")
        .1;
    let first = micros(Utc::now() + TimeDelta::seconds(60));
    for (key, fp, want_fp) in [("schedule:same", "A", "A"), ("schedule:changed", "B", "B")] {
        let mut tx = f.pool.begin().await.unwrap();
        let inserted = sqlx::query(AssertSqlSafe(register_sql.clone()))
            .bind(Q)
            .bind(key)
            .bind(&b"{}"[..])
            .bind(sqlx::types::Json(fingerprint("A")))
            .bind(first)
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        assert!(inserted.get::<bool, _>(1), "the first registration inserts");
        let store = f.store.clone();
        let second =
            tokio::spawn(
                async move { register(&store, key, fp, first + TimeDelta::seconds(10)).await },
            );
        eventually(
            30,
            "the second registration waits for the first",
            || async { waiting_on_a_lock(&f).await == 1 },
        )
        .await;
        assert!(!second.is_finished());
        tx.commit().await.unwrap();
        let got = second.await.unwrap();
        let rows: Vec<_> = f
            .rows(Q)
            .await
            .into_iter()
            .filter(|r| r.timer_id.as_deref() == Some(key))
            .collect();
        assert_eq!(rows.len(), 1, "{key}: one live row: {rows:#?}");
        assert_eq!(
            rows[0]
                .headers
                .as_ref()
                .and_then(|h| h.get(SCHEDULE_HEADER)),
            Some(&want_fp.to_owned())
        );
        if fp == "A" {
            assert_eq!(got, Registered::Unchanged, "{key}");
            assert_eq!(rows[0].next_attempt_at, first);
        } else {
            assert_eq!(
                got,
                Registered::Rescheduled {
                    id: rows[0].id,
                    at: first + TimeDelta::seconds(10)
                },
                "{key}"
            );
        }
    }
    f.cleanup().await;
}

/// Many workers registering many schedules at once (one statement each, autocommit):
/// every schedule ends with exactly one live row and exactly one registration inserted it.
#[tokio::test]
async fn concurrent_registrations_leave_one_live_row_per_schedule() {
    let f = Fixture::new().await;
    let first = micros(Utc::now() + TimeDelta::seconds(60));
    let keys: Vec<String> = (0..20).map(|i| format!("schedule:s{i}")).collect();
    for round in 0..3 {
        let fp = format!("v{round}");
        let calls = keys
            .iter()
            .flat_map(|k| (0..6).map(move |_| k))
            .map(|k| register(&f.store, k, &fp, first));
        let outcomes = join_all(calls).await;
        for (i, key) in keys.iter().enumerate() {
            let mine = &outcomes[i * 6..(i + 1) * 6];
            let writes = mine
                .iter()
                .filter(|o| !matches!(o, Registered::Unchanged))
                .count();
            assert_eq!(writes, 1, "{key} round {round}: {mine:?}");
            if round == 0 {
                assert!(
                    mine.iter()
                        .any(|o| matches!(o, Registered::Inserted { .. })),
                    "{mine:?}"
                );
            } else {
                assert!(
                    mine.iter()
                        .any(|o| matches!(o, Registered::Rescheduled { .. })),
                    "{mine:?}"
                );
            }
        }
        let rows = f.rows(Q).await;
        assert_eq!(rows.len(), keys.len(), "one row per schedule: {rows:#?}");
        assert!(rows
            .iter()
            .all(|r| { r.headers.as_ref().and_then(|h| h.get(SCHEDULE_HEADER)) == Some(&fp) }));
    }
    // The common start of a worker: the same schedule again writes nothing at all.
    let mut conn = f.pool.acquire().await.unwrap();
    let before: String = sqlx::query(AssertSqlSafe(format!(
        "SELECT string_agg(xmin::text, ',' ORDER BY id) FROM {}",
        f.outbox.table()
    )))
    .fetch_one(&mut *conn)
    .await
    .unwrap()
    .get(0);
    for key in &keys {
        assert_eq!(
            register(&f.store, key, "v2", first).await,
            Registered::Unchanged
        );
    }
    let after: String = sqlx::query(AssertSqlSafe(format!(
        "SELECT string_agg(xmin::text, ',' ORDER BY id) FROM {}",
        f.outbox.table()
    )))
    .fetch_one(&mut *conn)
    .await
    .unwrap()
    .get(0);
    assert_eq!(before, after, "no row version written");
    conn.close().await.unwrap();
    f.cleanup().await;
}
