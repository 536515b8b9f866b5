//! Through a real PgBouncer 1.18 in transaction mode (`outbox_bench::pgbouncer`, configured
//! with the block of docs/guide/deployment.md, "PgBouncer", as written), SPEC §13: what
//! sqlx's protocol meets there (`protocol`), then the library with
//! `OutboxBuilder::transaction_pooler(true)`: the publishing API (`publish`), workers and
//! handler transactions (`worker`), reads, statistics, operator actions and dead letters
//! (`reads`), and what needs a session (`refusals`). The CLI's runs through the pooler are
//! in outbox-cli/tests/cli.rs.

mod protocol;
mod publish;
mod reads;
mod refusals;
mod worker;

use std::time::Duration;

use outbox::{Outbox, PgStore};
use outbox_bench::pgbouncer::PgBouncer;
use outbox_tests::{database_url, pool, unique_table};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, ConnectOptions, PgPool};

/// A PgBouncer in front of the test server.
pub(crate) struct Bouncer(PgBouncer);

impl Bouncer {
    pub(crate) fn start() -> Bouncer {
        Bouncer(PgBouncer::start(&database_url()))
    }
}

impl std::ops::Deref for Bouncer {
    type Target = PgBouncer;
    fn deref(&self) -> &PgBouncer {
        &self.0
    }
}

/// A pool of at most `max` client connections to the pooler.
pub(crate) async fn pooled(bouncer: &Bouncer, max: u32) -> PgPool {
    let opts: PgConnectOptions = bouncer.url().parse().expect("the pooler's URL");
    PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(opts.disable_statement_logging())
        .await
        .unwrap_or_else(|e| {
            panic!(
                "connect through pgbouncer: {e}; its log:\n{}",
                bouncer.log()
            )
        })
}

/// One test's tables, migrated over a direct connection, and the same tables reached
/// through a fresh PgBouncer by an outbox built for it.
pub(crate) struct Through {
    /// Held for its `Drop`, which stops the pooler.
    _bouncer: Bouncer,
    /// Straight to the server: migrate, and the test's own checks.
    pub direct: PgPool,
    /// Through PgBouncer.
    pub pooled: PgPool,
    /// `transaction_pooler(true)`, dead-letter queue on.
    pub outbox: Outbox,
    /// The same names without the knob (for migrate, and to show what fails without it).
    pub plain: Outbox,
    /// A store over `pooled` and `outbox`.
    pub store: PgStore,
}

impl Through {
    /// Fresh tables and a pooler; `max` client connections through it.
    pub async fn new(max: u32) -> Through {
        let bouncer = Bouncer::start();
        let direct = pool().await;
        let table = unique_table("pgb");
        let plain = Outbox::builder()
            .table(&table)
            .dead_letter(true)
            .build()
            .expect("valid names");
        plain
            .migrate(&direct)
            .await
            .expect("migrate over a direct connection");
        let outbox = Outbox::builder()
            .table(&table)
            .dead_letter(true)
            .transaction_pooler(true)
            .build()
            .expect("valid names");
        let pooled = pooled(&bouncer, max).await;
        let store = PgStore::new(pooled.clone(), outbox.clone());
        Through {
            _bouncer: bouncer,
            direct,
            pooled,
            outbox,
            plain,
            store,
        }
    }

    /// Every live row of `queue`, read over the direct connection.
    pub async fn rows(&self, queue: &str) -> Vec<outbox::store::StoredRow> {
        let mut conn = self.direct.acquire().await.expect("connection");
        self.plain
            .pending(&mut conn, queue, 100_000)
            .await
            .expect("pending")
    }

    /// Drops the test's tables (the pooler stops when `self` is dropped).
    pub async fn cleanup(self) {
        self.pooled.close().await;
        let sql = format!(
            "DROP TABLE IF EXISTS {}, {}, {}, {}",
            self.plain.table(),
            self.plain.dead_letter_table(),
            self.plain.migrations_table(),
            self.plain.paused_table()
        );
        sqlx::raw_sql(AssertSqlSafe(sql))
            .execute(&self.direct)
            .await
            .expect("drop tables");
    }
}
