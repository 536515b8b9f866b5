//! The operator docs say what the code does: the upgrade guide (`outbox/docs/upgrading.md`,
//! rendered as `outbox::schema::upgrading`) carries the upgrade steps
//! verbatim, and following it on a base-shape table (with rows in it) gives the errors,
//! the `validate_schema` reports and the end state it describes.
//!
//! Postgres comes from `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/test`);
//! the table has a unique name.

use sqlx::AssertSqlSafe;
use std::path::Path;
use std::time::Duration;

use outbox::schema::{migration_steps, UPGRADE_GUIDE};
use outbox::{Error, Outbox};
use presence::server::connect;
use presence::PresenceExpiry;

fn read(rel: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn upgrade_guide_quotes_the_upgrade_migrations_verbatim() {
    let guide = read("outbox/docs/upgrading.md");
    let steps = migration_steps(&Outbox::default());
    for step in &steps[1..] {
        assert!(
            guide.contains(step.sql.trim_end()),
            "the upgrade guide does not quote {} as rendered:\n{}",
            step.file_name(),
            step.sql
        );
        assert!(
            guide.contains(&step.file_name()),
            "the upgrade guide does not name {}",
            step.file_name()
        );
        assert_eq!(read(&format!("migrations/{}", step.file_name())), step.sql);
    }
    // Its sample error messages show the address the errors give.
    assert!(guide.contains(UPGRADE_GUIDE));
}

#[test]
fn readme_starts_with_the_two_commands() {
    let readme = read("README.md");
    let head: String = readme.lines().take(40).collect::<Vec<_>>().join("\n");
    assert!(
        head.contains("cargo run --release -p presence -- demo"),
        "{head}"
    );
    assert!(
        head.contains("cargo nextest run --workspace && cargo test --workspace --doc"),
        "{head}"
    );
    let ci = read(".ci/run");
    assert!(
        ci.contains("cargo nextest run --workspace && cargo test --workspace --doc"),
        "README and .ci/run disagree"
    );
}

#[tokio::test]
async fn following_the_upgrade_guide_on_a_base_table() {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let pool = match connect(&url, 2).await {
        Ok(p) => p,
        Err(e) => panic!("{e}"),
    };
    let table = format!(
        "presence_up_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    );
    let outbox = Outbox::builder().table(&table).build().unwrap();
    outbox.migrate_base_only(&pool).await.unwrap();
    let mut conn = pool.acquire().await.unwrap();
    presence::server::publish_presence_expiry(
        outbox.on(&mut conn),
        "1",
        &PresenceExpiry { user_id: 1 },
        Duration::from_secs(60),
    )
    .await
    .expect("plain publishing works on the base shape");

    // Before: every rearm problem is reported, each pointing at the guide.
    let Err(Error::SchemaMismatch { problems }) = outbox.validate_schema(&pool).await else {
        panic!("a base-shape table must not validate");
    };
    let text: Vec<String> = problems.iter().map(ToString::to_string).collect();
    println!("{}", text.join("\n"));
    for col in ["rearm_at", "rearm_payload", "rearm_headers", "cancelled_at"] {
        let want = format!(
            "{table}.{col}: column is missing (run the schema upgrade: `Outbox::migrate` with this outbox's settings; see {UPGRADE_GUIDE})"
        );
        assert!(text.contains(&want), "{text:#?}");
    }
    for (ck, def) in [
        ("rearm_ck", "rearm_at IS NULL OR acquired_token IS NOT NULL"),
        (
            "cancel_ck",
            "cancelled_at IS NULL OR acquired_token IS NOT NULL",
        ),
    ] {
        let want = format!(
            "{table}: constraint {table}_{ck}: `CHECK ({def})` is missing (run the schema upgrade: `Outbox::migrate` with this outbox's settings; see {UPGRADE_GUIDE})"
        );
        assert!(text.contains(&want), "{text:#?}");
    }
    let want = format!(
        "{table}_paused: table is missing (run the schema upgrade: `Outbox::migrate` with this outbox's settings; see {UPGRADE_GUIDE})"
    );
    assert!(text.contains(&want), "{text:#?}");
    assert_eq!(text.len(), 7, "{text:#?}");
    // With the dead-letter queue on, its upgrade's pieces too.
    let with_dlq = Outbox::builder()
        .table(&table)
        .dead_letter(true)
        .build()
        .unwrap();
    let Err(Error::SchemaMismatch { problems: dlq }) = with_dlq.validate_schema(&pool).await else {
        panic!("a base-shape table must not validate");
    };
    let dlq: Vec<String> = dlq.iter().map(ToString::to_string).collect();
    println!("{}", dlq.join("\n"));
    for col in ["redriven_at", "redriven_id"] {
        let want = format!(
            "{table}_dlq.{col}: column is missing (run the schema upgrade: `Outbox::migrate` with this outbox's settings; see {UPGRADE_GUIDE})"
        );
        assert!(dlq.contains(&want), "{dlq:#?}");
    }
    let want = format!(
        "{table}_dlq: index {table}_dlq_failed_at_idx on (failed_at): index is missing (run the schema upgrade: `Outbox::migrate` with this outbox's settings; see {UPGRADE_GUIDE})"
    );
    assert!(dlq.contains(&want), "{dlq:#?}");
    assert_eq!(dlq.len(), 10, "{dlq:#?}");
    assert!(problems.iter().all(|p| p.needs_upgrade), "{problems:#?}");

    // The error an extend gets.
    let err = presence::server::extend_presence_expiry(
        outbox.on(&mut conn),
        "1",
        &PresenceExpiry { user_id: 1 },
        Duration::from_secs(90),
    )
    .await
    .unwrap_err();
    println!("{err}");
    assert!(matches!(err, Error::UpgradeRequired { .. }), "{err:?}");
    assert!(err.to_string().contains(UPGRADE_GUIDE), "{err}");
    assert!(
        err.to_string()
            .starts_with("the outbox schema predates this version ("),
        "{err}"
    );

    // Each upgrade: step 1 in its own transaction leaves the CHECK NOT VALID, so validation
    // still reports it (and the other upgrade's pieces); step 2 validates it.
    let steps = migration_steps(&outbox);
    let run = |sql: String| {
        let pool = pool.clone();
        async move {
            let mut tx = pool.begin().await.unwrap();
            sqlx::raw_sql(AssertSqlSafe(sql))
                .execute(&mut *tx)
                .await
                .unwrap();
            tx.commit().await.unwrap();
        }
    };
    for (columns, validate, ck, left_after) in [(1, 2, "rearm_ck", 3), (3, 4, "cancel_ck", 1)] {
        run(steps[columns].sql.clone()).await;
        let Err(Error::SchemaMismatch { problems }) = outbox.validate_schema(&pool).await else {
            panic!("a NOT VALID {ck} must be reported");
        };
        let not_valid: Vec<_> = problems
            .iter()
            .filter(|p| p.message.contains("NOT VALID"))
            .collect();
        assert_eq!(not_valid.len(), 1, "{problems:#?}");
        assert!(
            not_valid[0].object.ends_with(&format!("{table}_{ck}")) && not_valid[0].needs_upgrade,
            "{problems:#?}"
        );
        assert_eq!(problems.len(), left_after + 1, "{problems:#?}");
        run(steps[validate].sql.clone()).await;
    }
    // The paused-queues table (a transaction; the one problem left above).
    assert_eq!(steps[8].description, "outbox_paused_queues");
    run(steps[8].sql.clone()).await;
    // The dead-letter redrive columns (a transaction), then the `(failed_at)` index, built
    // CONCURRENTLY and so outside any transaction.
    outbox
        .validate_schema(&pool)
        .await
        .expect("upgraded queue table validates");
    run(steps[5].sql.clone()).await;
    let Err(Error::SchemaMismatch { problems }) = with_dlq.validate_schema(&pool).await else {
        panic!("the missing (failed_at) index must be reported");
    };
    assert_eq!(problems.len(), 1, "{problems:#?}");
    assert!(
        problems[0]
            .object
            .ends_with("_failed_at_idx on (failed_at)"),
        "{problems:#?}"
    );
    assert!(!steps[6].transaction);
    sqlx::raw_sql(AssertSqlSafe(steps[6].sql.clone()))
        .execute(&pool)
        .await
        .unwrap();
    with_dlq
        .validate_schema(&pool)
        .await
        .expect("upgraded tables validate");
    let done = presence::server::extend_presence_expiry(
        outbox.on(&mut conn),
        "1",
        &PresenceExpiry { user_id: 1 },
        Duration::from_secs(90),
    )
    .await
    .unwrap();
    assert!(
        matches!(done, outbox::Published::Extended { .. }),
        "{done:?}"
    );

    sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP TABLE IF EXISTS {}, {}, {}, {}",
        outbox.table(),
        outbox.dead_letter_table(),
        outbox.migrations_table(),
        outbox.paused_table()
    )))
    .execute(&pool)
    .await
    .unwrap();
}

/// A `<t>_rearm_ck` added NOT VALID but not validated yet is reported as NOT VALID (with
/// the VALIDATE step to run), not as missing: `pg_get_constraintdef` appends ` NOT VALID`
/// to its definition, which validate_schema strips before comparing.
#[tokio::test]
async fn not_valid_rearm_check_is_reported_as_not_valid() {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let pool = connect(&url, 1).await.unwrap_or_else(|e| panic!("{e}"));
    let table = format!(
        "presence_nv_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    );
    let outbox = Outbox::builder().table(&table).build().unwrap();
    outbox.migrate_base_only(&pool).await.unwrap();
    let step1 = &migration_steps(&outbox)[1];
    sqlx::raw_sql(AssertSqlSafe(&*step1.sql))
        .execute(&pool)
        .await
        .unwrap();
    let result = outbox.validate_schema(&pool).await;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP TABLE IF EXISTS {}, {}, {}, {}",
        outbox.table(),
        outbox.dead_letter_table(),
        outbox.migrations_table(),
        outbox.paused_table()
    )))
    .execute(&pool)
    .await
    .unwrap();
    let Err(Error::SchemaMismatch { problems }) = result else {
        panic!("expected a mismatch");
    };
    let rearm_ck = problems
        .iter()
        .find(|p| p.object.ends_with("_rearm_ck"))
        .unwrap_or_else(|| panic!("{problems:#?}"));
    assert!(rearm_ck.message.contains("NOT VALID"), "{problems:#?}");
}
