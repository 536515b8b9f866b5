//! Fixtures shared by the integration tests: a pool on real Postgres and a fresh,
//! uniquely named outbox table per test.
//!
//! Postgres is found through `DATABASE_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`). If it cannot be reached the tests **fail**
//! with a message saying how to start it: they never skip silently.

pub mod contract;
pub mod proxy;

use std::time::Duration;

use outbox::{Outbox, OutboxBuilder, PgStore, StoredRow};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, ConnectOptions, Connection, PgPool};

/// The database URL the tests use.
pub fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// A pool of at most `max` connections; panics with instructions when Postgres is down.
pub async fn pool_with(max: u32) -> PgPool {
    let url = database_url();
    let opts: PgConnectOptions = url
        .parse::<PgConnectOptions>()
        .unwrap_or_else(|e| panic!("DATABASE_URL {url:?} is not a Postgres URL: {e}"))
        .disable_statement_logging();
    // One direct connection first: it fails at once with the real cause ("connection
    // refused", "role does not exist"), where a pool would retry until its timeout.
    let probe = sqlx::PgConnection::connect_with(&opts).await.map(drop);
    let pool = match probe {
        Ok(()) => {
            PgPoolOptions::new()
                .max_connections(max)
                .acquire_timeout(Duration::from_secs(30))
                .connect_with(opts)
                .await
        }
        Err(e) => Err(e),
    };
    match pool {
        Ok(pool) => pool,
        Err(e) => panic!(
            "cannot reach Postgres at {url}: {e}\n\
             start it with `pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start` \
             or set DATABASE_URL; these tests do not skip"
        ),
    }
}

/// A pool of 8 connections.
pub async fn pool() -> PgPool {
    pool_with(8).await
}

/// A unique, valid table name for one test.
pub fn unique_table(prefix: &str) -> String {
    format!(
        "{prefix}_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    )
}

/// One test's outbox: fresh tables, a pool, a store.
pub struct Fixture {
    /// The pool.
    pub pool: PgPool,
    /// The configured outbox (unique table).
    pub outbox: Outbox,
    /// A Postgres store over both.
    pub store: PgStore,
}

impl Fixture {
    /// Fresh migrated tables with the dead-letter queue on.
    pub async fn new() -> Fixture {
        Fixture::with(|b| b.dead_letter(true)).await
    }

    /// Fresh migrated tables configured by `configure`.
    pub async fn with(configure: impl FnOnce(OutboxBuilder) -> OutboxBuilder) -> Fixture {
        let pool = pool().await;
        let outbox = configure(Outbox::builder().table(unique_table("t")))
            .build()
            .expect("valid test names");
        outbox.migrate(&pool).await.expect("migrations apply");
        let store = PgStore::new(pool.clone(), outbox.clone());
        Fixture {
            pool,
            outbox,
            store,
        }
    }

    /// Every live row of `queue`, ordered by deadline then id.
    pub async fn rows(&self, queue: &str) -> Vec<StoredRow> {
        let mut conn = self.pool.acquire().await.expect("connection");
        self.outbox
            .pending(&mut conn, queue, 100_000)
            .await
            .expect("pending")
    }

    /// The one live row of `queue`; panics unless there is exactly one.
    pub async fn only_row(&self, queue: &str) -> StoredRow {
        let mut rows = self.rows(queue).await;
        assert_eq!(
            rows.len(),
            1,
            "expected exactly one row in {queue}: {rows:#?}"
        );
        rows.remove(0)
    }

    /// Drops the test's tables.
    pub async fn cleanup(self) {
        let sql = format!(
            "DROP TABLE IF EXISTS {}, {}, {}",
            self.outbox.table(),
            self.outbox.dead_letter_table(),
            self.outbox.migrations_table()
        );
        sqlx::raw_sql(AssertSqlSafe(sql))
            .execute(&self.pool)
            .await
            .expect("drop tables");
    }
}

/// Polls `cond` every 20 ms until it holds; panics naming `what` after `secs` seconds.
pub async fn eventually<F, Fut>(secs: u64, what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let end = tokio::time::Instant::now() + Duration::from_secs(secs);
    while tokio::time::Instant::now() < end {
        if cond().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("timed out waiting for: {what}");
}

/// A handler that only counts its runs in `runs` (for any payload type).
pub fn count_runs<T>(
    runs: &std::sync::Arc<std::sync::atomic::AtomicUsize>,
) -> impl Fn(T, outbox::Context) -> std::future::Ready<()> + Send + Sync + 'static {
    let runs = runs.clone();
    move |_: T, _: outbox::Context| {
        runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        std::future::ready(())
    }
}
