//! The version gate of `migrate()` and `validate_schema` (issue 26): the server's
//! `server_version_num`, read on the real server, against the supported majors 14 to 18.
//! `.ci/postgres-version` sets `OUTBOX_PG_MAJOR` to the major it started, so the version
//! matrix fails if a run reached another server; `.ci/run` also runs these tests against
//! PostgreSQL 13, which both functions must refuse.

use std::time::Duration;

use outbox::schema::{MigrateOptions, SUPPORTED_POSTGRES};
use outbox::{Error, Outbox};
use outbox_tests::{pool, unique_table};

/// The server's `(server_version, server_version_num / 10000)`, read with plain SQL.
async fn server(pool: &sqlx::PgPool) -> (String, u32) {
    let (version, num): (String, i32) = sqlx::query_as(
        "SELECT current_setting('server_version'), current_setting('server_version_num')::int",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    (version, u32::try_from(num / 10_000).unwrap())
}

fn supported(major: u32) -> bool {
    (SUPPORTED_POSTGRES.0..=SUPPORTED_POSTGRES.1).contains(&major)
}

#[tokio::test]
async fn the_server_is_the_major_the_matrix_started_and_is_read_as_it_reports() {
    let pool = pool().await;
    let (_, major) = server(&pool).await;
    if let Ok(expected) = std::env::var("OUTBOX_PG_MAJOR") {
        assert_eq!(
            major.to_string(),
            expected,
            "OUTBOX_PG_MAJOR says the run is on PostgreSQL {expected}, DATABASE_URL reached {major}"
        );
    }
    let outbox = Outbox::builder()
        .table(unique_table("ver"))
        .build()
        .unwrap();
    // The gate's own reading of the version, with a range that holds every major.
    assert_eq!(
        outbox
            .require_postgres_within(&pool, (0, u32::MAX))
            .await
            .unwrap(),
        major
    );
}

#[tokio::test]
async fn a_server_outside_the_range_is_refused_naming_its_version_and_the_range() {
    let pool = pool().await;
    let (version, major) = server(&pool).await;
    let outbox = Outbox::builder()
        .table(unique_table("ver"))
        .build()
        .unwrap();
    for range in [(major + 1, major + 3), (major - 2, major - 1)] {
        match outbox.require_postgres_within(&pool, range).await {
            Err(Error::UnsupportedPostgres {
                version: v,
                major: m,
                supported,
            }) => {
                assert_eq!(v, version);
                assert_eq!(m, Some(major));
                assert_eq!(supported, range);
            }
            other => panic!("PostgreSQL {version} against {range:?}: {other:?}"),
        }
    }
}

/// On a supported server both run; on one outside the range (PostgreSQL 13 in `.ci/run`)
/// both are refused with the server's version, and `migrate()` created nothing.
#[tokio::test]
async fn migrate_and_validate_accept_or_refuse_the_server_by_its_major_version() {
    let pool = pool().await;
    let (version, major) = server(&pool).await;
    let outbox = Outbox::builder()
        .table(unique_table("ver"))
        .dead_letter(true)
        .build()
        .unwrap();
    let migrated = outbox.migrate(&pool).await;
    let validated = outbox.validate_schema(&pool).await;
    let created: Option<i64> = sqlx::query_scalar("SELECT to_regclass($1)::oid::bigint")
        .bind(outbox.table())
        .fetch_one(&pool)
        .await
        .unwrap();
    if supported(major) {
        migrated.unwrap();
        validated.unwrap();
        assert!(created.is_some());
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP TABLE {}, {}, {}, {}",
            outbox.table(),
            outbox.dead_letter_table(),
            outbox.migrations_table(),
            outbox.paused_table()
        )))
        .execute(&pool)
        .await
        .unwrap();
        return;
    }
    for (what, result) in [("migrate", migrated), ("validate_schema", validated)] {
        match result {
            Err(e @ Error::UnsupportedPostgres { .. }) => {
                let msg = e.to_string();
                assert!(msg.contains(&format!("PostgreSQL {version}")), "{msg}");
                assert!(msg.contains("PostgreSQL 14 to 18"), "{msg}");
                let Error::UnsupportedPostgres { major: m, .. } = e else {
                    unreachable!()
                };
                assert_eq!(m, Some(major));
            }
            other => panic!("{what} on PostgreSQL {version}: {other:?}"),
        }
    }
    assert_eq!(
        created, None,
        "migrate() created tables on PostgreSQL {version}"
    );
}

/// Options out of range are refused before the version is read: against a server that
/// does not answer, the error is the options', not a connection error.
#[tokio::test]
async fn bad_migrate_options_are_typed_before_any_sql() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    drop(listener);
    let nowhere = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(Duration::from_secs(2))
        .connect_lazy(&format!("postgres://postgres@127.0.0.1:{port}/test"))
        .unwrap();
    let outbox = Outbox::builder()
        .table(unique_table("ver"))
        .build()
        .unwrap();
    let options = MigrateOptions::default().lock_timeout(Duration::from_millis(1));
    match outbox.migrate_with(&nowhere, options).await {
        Err(Error::InvalidArgument { field, .. }) => assert_eq!(field, "lock_timeout"),
        other => panic!("{other:?}"),
    }
    // With valid options the version read is the first statement: it meets the dead port.
    match outbox.migrate(&nowhere).await {
        Err(e @ Error::Database(_)) => assert!(e.is_connection_error(), "{e:?}"),
        other => panic!("{other:?}"),
    }
}
