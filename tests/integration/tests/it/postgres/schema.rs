//! Migrations (SPEC §1.3), names (SPEC §1) and validate_schema (SPEC §8).

use sqlx::AssertSqlSafe;
use std::time::Duration;

use outbox::dlq::DeadLetterFilter;
use outbox::{
    message::OnConflict,
    schema::SchemaProblem,
    store::{ClaimRequest, Completion, Store},
    Error, Message, Outbox, PgStore,
};
use outbox_tests::{pool, unique_table};

fn problems(e: Error) -> Vec<SchemaProblem> {
    match e {
        Error::SchemaMismatch { problems } => problems,
        other => panic!("expected SchemaMismatch, got {other:?}"),
    }
}

async fn drop_tables(pool: &sqlx::PgPool, outbox: &Outbox) {
    let sql = format!(
        "DROP TABLE IF EXISTS {}, {}, {}, {}",
        outbox.table(),
        outbox.dead_letter_table(),
        outbox.migrations_table(),
        outbox.paused_table()
    );
    sqlx::raw_sql(AssertSqlSafe(&*sql))
        .execute(pool)
        .await
        .unwrap();
}

#[tokio::test]
async fn base_shape_with_rows_is_upgraded_in_place() {
    let pool = pool().await;
    let outbox = Outbox::builder()
        .table(unique_table("up"))
        .dead_letter(true)
        .build()
        .unwrap();
    outbox.migrate_base_only(&pool).await.unwrap();
    let t = outbox.table();

    // Before the upgrade: validate points to the upgrade guide for each missing piece.
    let before = problems(outbox.validate_schema(&pool).await.unwrap_err());
    let upgrade: Vec<_> = before
        .iter()
        .filter(|p| p.needs_upgrade)
        .map(|p| p.object.clone())
        .collect();
    assert_eq!(before.len(), 10, "{before:#?}");
    assert_eq!(
        upgrade.len(),
        10,
        "three rearm columns, the cancel mark, both CHECKs, the paused-queues table, the two \
         dead-letter redrive columns and the dead-letter (failed_at) index: {before:#?}"
    );
    assert!(before
        .iter()
        .any(|p| p.object.ends_with("_paused") && p.message == "table is missing"));
    assert!(before
        .iter()
        .any(|p| p.object.ends_with(".cancelled_at") && p.message == "column is missing"));
    assert!(before.iter().any(|p| p.object.contains("_cancel_ck")));
    assert!(before
        .iter()
        .any(|p| p.object.ends_with(".rearm_at") && p.message == "column is missing"));
    assert!(before.iter().any(|p| p.object.contains("_rearm_ck")));
    let text = Error::SchemaMismatch { problems: before }.to_string();
    assert!(text.contains(outbox::schema::UPGRADE_GUIDE), "{text}");

    // A deployment that predates rearm: one pending, one leased, one timer row.
    let seed = format!(
        "INSERT INTO {t} (queue, payload, headers) VALUES ('q', 'pending', '{{\"k\":\"v\"}}'); \
         INSERT INTO {t} (queue, payload, acquired_at, acquired_token, deliveries_count) \
           VALUES ('q', 'leased', now(), '00000000-0000-0000-0000-000000000001', 1); \
         INSERT INTO {t} (queue, payload, timer_id, next_attempt_at) VALUES ('q', 'timer', 'k1', now() + interval '1 hour')"
    );
    sqlx::raw_sql(AssertSqlSafe(&*seed))
        .execute(&pool)
        .await
        .unwrap();
    let snapshot = format!("SELECT id, queue, payload, headers::text, attempts_count, deliveries_count, created_at, next_attempt_at, acquired_at, acquired_token, timer_id FROM {t} ORDER BY id");
    type Snap = (
        i64,
        String,
        Vec<u8>,
        Option<String>,
        i32,
        i32,
        chrono::DateTime<chrono::Utc>,
        chrono::DateTime<chrono::Utc>,
        Option<chrono::DateTime<chrono::Utc>>,
        Option<uuid::Uuid>,
        Option<String>,
    );
    let rows_before: Vec<Snap> = sqlx::query_as(AssertSqlSafe(&*snapshot))
        .fetch_all(&pool)
        .await
        .unwrap();

    // A completion on the old shape names the upgrade guide (SQLSTATE 42703).
    let store = PgStore::new(pool.clone(), outbox.clone());
    let lease = outbox::store::Lease {
        id: rows_before[1].0,
        token: rows_before[1].9.unwrap(),
    };
    let err = store.ack(lease).await.unwrap_err();
    assert!(matches!(err, Error::UpgradeRequired { .. }), "{err:?}");
    assert!(
        err.to_string().contains(outbox::schema::UPGRADE_GUIDE),
        "{err}"
    );
    // So does an extend, whose statement names the table `t`: the error names the column
    // as the table has it, not as `t.<column>` (found by a fresh-user trial, 2026-12-05).
    let mut conn = pool.acquire().await.unwrap();
    let extend = Message::new("q", b"x")
        .timer_id("k1")
        .on_conflict(OnConflict::Extend);
    let err = outbox.publish(&mut conn, extend).await.unwrap_err();
    let Error::UpgradeRequired { detail } = &err else {
        panic!("expected UpgradeRequired, got {err:?}")
    };
    assert!(
        detail.starts_with("column \"") && !detail.contains("t."),
        "{detail}"
    );
    drop(conn);

    outbox.migrate(&pool).await.unwrap();
    let rows_after: Vec<Snap> = sqlx::query_as(AssertSqlSafe(&*snapshot))
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(rows_before, rows_after, "every row intact");
    let rearm_set: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM {t} WHERE rearm_at IS NOT NULL OR rearm_payload IS NOT NULL OR rearm_headers IS NOT NULL"
    )))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(rearm_set, 0, "the new columns start empty");
    outbox.validate_schema(&pool).await.unwrap();
    let validated: bool = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT convalidated FROM pg_constraint WHERE conrelid = '{}'::regclass AND contype = 'c' AND pg_get_constraintdef(oid) LIKE '%rearm_at%'",
        t.replace('\'', "''")
    )))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(validated, "the VALIDATE step ran");
    // The leased row completes on the new shape; migrate is idempotent.
    assert_eq!(store.ack(lease).await.unwrap(), Completion::Deleted);
    outbox.migrate(&pool).await.unwrap();
    drop_tables(&pool, &outbox).await;
}

#[tokio::test]
async fn validate_reports_every_problem_at_once() {
    let pool = pool().await;
    let table = unique_table("val");
    let outbox = Outbox::builder()
        .table(table.clone())
        .dead_letter(true)
        .build()
        .unwrap();
    outbox.migrate(&pool).await.unwrap();
    outbox.validate_schema(&pool).await.unwrap();
    let t = outbox.table();
    let d = outbox.dead_letter_table();
    let drift = format!(
        "ALTER TABLE {t} DROP CONSTRAINT \"{table}_rearm_ck\"; \
         ALTER TABLE {t} DROP COLUMN rearm_headers; \
         ALTER TABLE {t} ALTER COLUMN headers TYPE json; \
         ALTER TABLE {t} ALTER COLUMN timer_id SET NOT NULL; \
         DROP INDEX \"{table}_pending_idx\"; CREATE INDEX ON {t} (queue, next_attempt_at); \
         DROP INDEX \"{table}_lease_idx\"; CREATE INDEX ON {t} (queue, acquired_at) WHERE acquired_at IS NOT NULL; \
         DROP INDEX \"{table}_timer_id_uq\"; CREATE INDEX ON {t} (queue, timer_id) WHERE timer_id IS NOT NULL; \
         ALTER TABLE {t} DROP CONSTRAINT \"{table}_lease_ck\"; \
         ALTER TABLE {t} ADD CONSTRAINT renamed_lease CHECK ((acquired_at IS NULL) = (acquired_token IS NULL)); \
         ALTER TABLE {t} ADD COLUMN extra int; \
         ALTER TABLE {d} DROP COLUMN last_error"
    );
    sqlx::raw_sql(AssertSqlSafe(&*drift))
        .execute(&pool)
        .await
        .unwrap();
    let found = problems(outbox.validate_schema(&pool).await.unwrap_err());
    let has = |object: &str, message: &str| {
        found
            .iter()
            .any(|p| p.object.contains(object) && p.message.contains(message))
    };
    assert!(has("_rearm_ck", "is missing"), "{found:#?}");
    assert!(has(".rearm_headers", "column is missing"), "{found:#?}");
    assert!(
        has(".headers", "type is `json`, expected `jsonb`"),
        "{found:#?}"
    );
    assert!(has(".timer_id", "must be nullable"), "{found:#?}");
    assert!(has("_pending_idx", "not partial"), "{found:#?}");
    assert!(
        has("_lease_idx", "WHERE (acquired_at IS NOT NULL)"),
        "{found:#?}"
    );
    assert!(has("_timer_id_uq", "not UNIQUE"), "{found:#?}");
    assert!(has("_dlq.last_error", "column is missing"), "{found:#?}");
    assert_eq!(
        found.len(),
        8,
        "the renamed lease CHECK matches by definition, extra columns are fine: {found:#?}"
    );
    assert_eq!(
        found.iter().filter(|p| p.needs_upgrade).count(),
        2,
        "{found:#?}"
    );
    drop_tables(&pool, &outbox).await;

    // A missing table is one problem, not a cascade.
    let found = problems(outbox.validate_schema(&pool).await.unwrap_err());
    assert_eq!(
        found.len(),
        2,
        "queue table and dead-letter table: {found:#?}"
    );
}

/// Names that need quoting, in a non-default schema, through every statement.
#[tokio::test]
async fn quoted_names_in_a_custom_schema_work_everywhere() {
    let pool = pool().await;
    let schema = format!(
        "Outbox \"Tests\" {}",
        &uuid::Uuid::new_v4().simple().to_string()[..6]
    );
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE SCHEMA \"{}\"",
        schema.replace('"', "\"\"")
    )))
    .execute(&pool)
    .await
    .unwrap();
    let outbox = Outbox::builder()
        .schema(schema.clone())
        .table("Presence Timers")
        .dead_letter_table("Dead 'Letters'")
        .build()
        .unwrap();
    outbox.migrate(&pool).await.unwrap();
    outbox.migrate(&pool).await.unwrap();
    outbox.validate_schema(&pool).await.unwrap();
    let store = PgStore::new(pool.clone(), outbox.clone());
    let mut conn = pool.acquire().await.unwrap();
    let m = Message::new("q", b"x")
        .timer_id("k")
        .on_conflict(OnConflict::Extend);
    outbox.publish(&mut conn, m).await.unwrap();
    let d = store
        .claim(ClaimRequest::new(
            &["q".to_owned()],
            1,
            Duration::from_secs(60),
        ))
        .await
        .unwrap()
        .remove(0);
    let later = chrono::Utc::now() + chrono::TimeDelta::hours(1);
    outbox.publish(&mut conn, m.schedule(later)).await.unwrap();
    assert!(matches!(
        store.ack(d.lease).await.unwrap(),
        Completion::Rearmed { .. }
    ));
    assert_eq!(
        outbox.cancel(&mut conn, "q", "k").await.unwrap(),
        outbox::Cancelled::Deleted { id: d.lease.id }
    );
    outbox
        .publish(&mut conn, Message::new("q", b"y"))
        .await
        .unwrap();
    let d = store
        .claim(ClaimRequest::new(
            &["q".to_owned()],
            1,
            Duration::from_secs(60),
        ))
        .await
        .unwrap()
        .remove(0);
    let failure = outbox::store::Failure {
        reason: outbox::store::FailureReason::Rejected,
        last_error: Some("no"),
    };
    assert_eq!(
        store.fail(d.lease, failure).await.unwrap(),
        Completion::Deleted
    );
    assert_eq!(
        store
            .dead_letters(&DeadLetterFilter::new().queue("q"), None, 10)
            .await
            .unwrap()
            .len(),
        1
    );
    let n = store
        .next_wakeup(ClaimRequest::new(
            &["q".to_owned()],
            0,
            Duration::from_secs(60),
        ))
        .await
        .unwrap();
    assert_eq!(n.earliest(), None);
    let tables: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_tables WHERE schemaname = $1")
        .bind(&schema)
        .fetch_one(&pool)
        .await
        .unwrap();
    // The queue, its dead-letter table, the table of applied migration steps and the table
    // of paused queues.
    assert_eq!(tables, 4);
    sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP SCHEMA \"{}\" CASCADE",
        schema.replace('"', "\"\"")
    )))
    .execute(&pool)
    .await
    .unwrap();
}

#[test]
fn overlong_derived_identifiers_are_rejected_by_name() {
    let table = "a".repeat(55);
    let err = Outbox::builder().table(table.clone()).build().unwrap_err();
    match err {
        Error::InvalidName { identifier, reason } => {
            assert_eq!(identifier, format!("{table}_pending_idx"));
            assert!(reason.contains("63 bytes"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    let err = Outbox::builder()
        .table("t")
        .dead_letter_table("d".repeat(45))
        .build()
        .unwrap_err();
    assert!(
        matches!(err, Error::InvalidName { identifier, .. } if identifier.ends_with("_queue_failed_at_idx"))
    );
}
