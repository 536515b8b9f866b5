//! A runtime role without DDL rights (the deployment `docs/guide/deployment.md` describes
//! under that heading): `migrate` runs at deploy as the owner; the application's role holds
//! only the grants listed there, and everything it does at run time works —
//! `validate_schema` and an up-to-date `migrate()` at start, publish, extend, cancel, a
//! worker's claim, ack, retry and dead-letter archive — while DDL is refused. The grants are
//! the page's SQL block, read out of the markdown and run verbatim: each test gets a
//! database of its own (the default table names, in `public`), the group role `app` the
//! block names (made once per server, never given anything outside these databases), and a
//! fresh login role that is a member of `app`. Postgres: `DATABASE_URL` (its user must be
//! able to create roles and databases, as `postgres` is). `managed.rs` uses the same set-up.

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

/// The first `sql` block under `## A runtime role without DDL rights` in
/// `docs/guide/deployment.md`, as written there.
pub(super) fn documented_grants() -> String {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/guide/deployment.md"
    );
    let page = std::fs::read_to_string(path).expect("read docs/guide/deployment.md");
    let section = page
        .split("\n## A runtime role without DDL rights\n")
        .nth(1)
        .expect("the page has the section");
    let section = section.split("\n## ").next().unwrap();
    let block = section
        .split("```sql\n")
        .nth(1)
        .expect("the section has an sql block");
    block.split("```").next().unwrap().to_owned()
}

/// A database of one test's own, migrated by the owner with the default names and the
/// dead-letter queue on, the documented grants applied to `app`, and a fresh login role in
/// `app`. Dropped (database and login role) by [`AppDatabase::drop_all`].
pub(super) struct AppDatabase {
    pub name: String,
    pub owner: PgPool,
    pub outbox: Outbox,
    pub role: String,
    server: PgPool,
}

impl AppDatabase {
    pub async fn create() -> AppDatabase {
        let server = pool().await;
        let name = unique_table("gdb");
        server
            .execute(AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .await
            .unwrap();
        // `app` is shared by every database of the server; concurrent tests race to make it.
        server
            .execute(
                "DO $$ BEGIN CREATE ROLE app NOLOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE; \
                 EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL; END $$",
            )
            .await
            .unwrap();
        let superuser: bool = sqlx::query_scalar(
            "SELECT rolsuper OR rolcreatedb FROM pg_roles WHERE rolname = 'app'",
        )
        .fetch_one(&server)
        .await
        .unwrap();
        assert!(
            !superuser,
            "the server's role `app` must be an ordinary role"
        );
        let role = unique_table("outbox_rt");
        server
            .execute(AssertSqlSafe(format!(
                "CREATE ROLE {role} LOGIN IN ROLE app"
            )))
            .await
            .unwrap();
        let owner = PgPoolOptions::new()
            .max_connections(4)
            .connect_with(options().database(&name))
            .await
            .unwrap();
        let outbox = Outbox::builder().dead_letter(true).build().unwrap();
        outbox
            .migrate(&owner)
            .await
            .expect("the owner migrates at deploy");
        sqlx::raw_sql(AssertSqlSafe(documented_grants()))
            .execute(&owner)
            .await
            .expect("the documented grants run as written");
        AppDatabase {
            name,
            owner,
            outbox,
            role,
            server,
        }
    }

    /// A pool of `max` connections as the login role.
    pub async fn app_pool(&self, max: u32) -> PgPool {
        PgPoolOptions::new()
            .max_connections(max)
            .connect_with(
                options()
                    .database(&self.name)
                    .username(&self.role)
                    .password(""),
            )
            .await
            .expect("the runtime role connects (trust auth on the test server)")
    }

    pub async fn drop_all(self) {
        self.owner.close().await;
        for sql in [
            format!("DROP DATABASE {} WITH (FORCE)", self.name),
            format!("DROP ROLE {}", self.role),
        ] {
            self.server.execute(AssertSqlSafe(sql)).await.unwrap();
        }
    }
}

fn options() -> PgConnectOptions {
    database_url().parse().unwrap()
}

#[tokio::test]
async fn a_runtime_role_with_only_dml_grants_runs_everything_but_ddl() {
    let db = AppDatabase::create().await;
    let (owner, outbox) = (db.owner.clone(), db.outbox.clone());
    let app = db.app_pool(6).await;
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
    db.drop_all().await;
}
