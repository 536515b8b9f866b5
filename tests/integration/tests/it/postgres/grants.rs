//! A runtime role without DDL rights (the deployment `docs/guide/deployment.md` describes
//! under that heading): `migrate` runs at deploy as the owner; the application's role holds
//! only the grants listed there, and everything it does at run time works —
//! `validate_schema` and an up-to-date `migrate()` at start, publish, extend, cancel, a
//! worker's claim, ack, retry and dead-letter archive — while DDL is refused. Postgres: `DATABASE_URL` (its user must be
//! able to create roles, as `postgres` is).

use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, Executor, PgPool};

use outbox::{Context, Error, Outbox, Outcome, PgStore, Published, RetryStrategy, Worker};
use outbox_tests::{database_url, eventually, pool, unique_table};

#[outbox::timer(queue = "grants.job", max_deliveries = 3)]
#[derive(serde::Serialize, serde::Deserialize)]
struct Job {
    n: i64,
}

/// The grants `docs/guide/deployment.md` lists, for `outbox`'s two tables and its
/// record of applied migrations.
fn runtime_grants(outbox: &Outbox, role: &str) -> Vec<String> {
    let (table, dlq, applied, paused) = (
        outbox.table(),
        outbox.dead_letter_table(),
        outbox.migrations_table(),
        outbox.paused_table(),
    );
    vec![
        format!("GRANT SELECT, INSERT, UPDATE, DELETE ON {table} TO {role}"),
        format!("GRANT SELECT, INSERT, UPDATE, DELETE ON {dlq} TO {role}"),
        format!("GRANT SELECT ON {applied} TO {role}"),
        format!("GRANT SELECT ON {paused} TO {role}"),
    ]
}

async fn runtime_pool(role: &str) -> PgPool {
    let options: PgConnectOptions = database_url().parse().unwrap();
    PgPoolOptions::new()
        .max_connections(6)
        .connect_with(options.username(role).password(""))
        .await
        .expect("the runtime role connects (trust auth on the test server)")
}

#[tokio::test]
async fn a_runtime_role_with_only_dml_grants_runs_everything_but_ddl() {
    let owner = pool().await;
    let outbox = Outbox::builder()
        .table(unique_table("grants"))
        .dead_letter(true)
        .build()
        .unwrap();
    outbox
        .migrate(&owner)
        .await
        .expect("the owner migrates at deploy");

    let role = unique_table("outbox_rt");
    owner
        .execute(AssertSqlSafe(format!("CREATE ROLE {role} LOGIN")))
        .await
        .unwrap();
    for grant in runtime_grants(&outbox, &role) {
        owner.execute(AssertSqlSafe(grant)).await.unwrap();
    }

    let app = runtime_pool(&role).await;
    // At start: the schema check and an up-to-date migrate only read the catalog.
    outbox
        .validate_schema(&app)
        .await
        .expect("validate_schema as the runtime role");
    outbox
        .migrate(&app)
        .await
        .expect("an up-to-date migrate needs no DDL right");

    // Publish, extend and cancel in the application's own transactions.
    let mut tx = app.begin().await.unwrap();
    let first = extend_job(outbox.on(&mut tx), "a", &Job { n: 1 }, Duration::ZERO)
        .await
        .unwrap();
    assert!(matches!(first, Published::Inserted { .. }), "{first:?}");
    publish_job(outbox.on(&mut tx), "b", &Job { n: 2 }, Duration::ZERO)
        .await
        .unwrap();
    publish_job(
        outbox.on(&mut tx),
        "c",
        &Job { n: 3 },
        Duration::from_secs(3600),
    )
    .await
    .unwrap();
    cancel_job(outbox.on(&mut tx), "c").await.unwrap();
    tx.commit().await.unwrap();

    // A worker as the runtime role: job 1 is acked, job 2 fails for good and is archived.
    let worker = Worker::builder(PgStore::new(app.clone(), outbox.clone()))
        .timer_with::<Job>(
            |j: Job, _ctx: Context| async move {
                if j.n == 2 {
                    Outcome::Reject("not wanted".to_owned())
                } else {
                    Outcome::Ack
                }
            },
            outbox::HandlerOptions::default().retry(RetryStrategy::none()),
        )
        .build()
        .unwrap()
        .start();
    eventually(20, "both jobs are done", || async {
        let live: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM {}",
            outbox.table()
        )))
        .fetch_one(&owner)
        .await
        .unwrap();
        live == 0
    })
    .await;
    let report = worker.shutdown().await;
    assert!(report.graceful, "{report:?}");
    let archived: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM {}",
        outbox.dead_letter_table()
    )))
    .fetch_one(&owner)
    .await
    .unwrap();
    assert_eq!(archived, 1, "the rejected job is in the dead-letter table");

    // DDL is the owner's: the runtime role cannot change the table.
    let denied = sqlx::query(AssertSqlSafe(format!(
        "ALTER TABLE {} ADD COLUMN x int",
        outbox.table()
    )))
    .execute(&app)
    .await
    .unwrap_err();
    let denied = Error::from(denied);
    assert!(denied.to_string().contains("must be owner"), "{denied}");
    // Pausing is an operator's write: the runtime role only reads the paused queues.
    let mut conn = app.acquire().await.unwrap();
    assert!(outbox.paused_queues(&mut conn).await.unwrap().is_empty());
    let refused = outbox
        .pause_queue(&mut conn, "grants.job")
        .await
        .unwrap_err();
    assert!(
        refused.to_string().contains("permission denied"),
        "{refused}"
    );
    drop(conn);

    app.close().await;
    for sql in [
        format!(
            "DROP TABLE {}, {}, {}, {}",
            outbox.table(),
            outbox.dead_letter_table(),
            outbox.migrations_table(),
            outbox.paused_table()
        ),
        format!("DROP ROLE {role}"),
    ] {
        owner.execute(AssertSqlSafe(sql)).await.unwrap();
    }
}
