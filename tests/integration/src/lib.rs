//! Fixtures shared by the integration tests: a pool on real Postgres and a fresh,
//! uniquely named outbox table per test.
//!
//! Postgres is found through `DATABASE_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`). If it cannot be reached the tests **fail**
//! with a message saying what to do (start the server, create the database, or fix the
//! login): they never skip silently.

pub mod contract;
pub mod proxy;

use std::time::Duration;

use outbox::{store::StoredRow, Outbox, OutboxBuilder, PgStore};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, ConnectOptions, Connection, PgPool};

/// The database URL the tests use.
pub fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// A pool of at most `max` connections; panics with what to do when Postgres cannot be
/// reached (see [`unreachable_message`]).
pub async fn pool_with(max: u32) -> PgPool {
    let url = database_url();
    let opts: PgConnectOptions = url
        .parse::<PgConnectOptions>()
        .unwrap_or_else(|e| panic!("DATABASE_URL {:?} is not a Postgres URL: {e}", redact(&url)))
        .disable_statement_logging();
    // One direct connection first: it fails at once with the real cause ("connection
    // refused", "database does not exist"), where a pool would retry until its timeout.
    let probe = sqlx::PgConnection::connect_with(&opts).await.map(drop);
    let pool = match probe {
        Ok(()) => {
            PgPoolOptions::new()
                .max_connections(max)
                .acquire_timeout(Duration::from_secs(30))
                .connect_with(opts.clone())
                .await
        }
        Err(e) => Err(e),
    };
    match pool {
        Ok(pool) => pool,
        Err(e) => panic!("{}", unreachable_message(&opts, &url, &e)),
    }
}

/// What to do about a failed first connection, by its cause: no server answering (start
/// it), a server without the database (create it), a refused login (fix the user or
/// password), or anything else (the error as it came). The tests fail with this message;
/// they never skip.
pub fn unreachable_message(opts: &PgConnectOptions, url: &str, error: &sqlx::Error) -> String {
    let url = redact(url);
    let host = opts.get_host();
    let port = opts.get_port();
    let user = opts.get_username();
    // Without a database in the URL, Postgres uses the user's name.
    let database = opts.get_database().unwrap_or(user);
    let db_code = match error {
        sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
        _ => None,
    };
    match (error, db_code.as_deref()) {
        // invalid_catalog_name: the server is up, only the database is missing.
        (_, Some("3D000")) => {
            let port_arg = if port == 5432 {
                String::new()
            } else {
                format!(" -p {port}")
            };
            format!(
                "Postgres at {url} is running but has no database {database:?}: {error}\n\
                 create it with `createdb -h {host}{port_arg} -U {user} {database}` \
                 or set DATABASE_URL to a database that exists; these tests do not skip"
            )
        }
        // invalid_password, invalid_authorization_specification: up, but the login is refused.
        (_, Some(code @ ("28P01" | "28000"))) => format!(
            "Postgres at {url} refused the login of user {user:?} (SQLSTATE {code}): {error}\n\
             fix the user or password in DATABASE_URL, or allow the user in pg_hba.conf \
             (.ci/run sets `trust` for 127.0.0.1); these tests do not skip"
        ),
        // Nothing listens (TCP refused, no Unix socket): the server is not running.
        (sqlx::Error::Io(io), _)
            if matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::NotFound
            ) =>
        {
            if matches!(host, "localhost" | "127.0.0.1" | "::1" | "[::1]") || host.starts_with('/')
            {
                format!(
                    "no Postgres server answers at {url}: {error}\n\
                     start the local cluster with \
                     `pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start` \
                     or set DATABASE_URL to a running server; these tests do not skip"
                )
            } else {
                format!(
                    "no Postgres server answers at {url}: {error}\n\
                     check that the server at {host}:{port} is running and reachable, \
                     or set DATABASE_URL; these tests do not skip"
                )
            }
        }
        _ => format!(
            "cannot connect to Postgres at {url}: {error}\n\
             check DATABASE_URL (default postgres://postgres@127.0.0.1:5432/test); \
             these tests do not skip"
        ),
    }
}

/// `url` with its password, if any, replaced by `***`, for messages and logs.
pub fn redact(url: &str) -> String {
    let Some(scheme_end) = url.find("://").map(|i| i + 3) else {
        return url.to_owned();
    };
    let rest = &url[scheme_end..];
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let Some(at) = rest[..authority_end].rfind('@') else {
        return url.to_owned();
    };
    match rest[..at].find(':') {
        Some(colon) => format!(
            "{}{}:***{}",
            &url[..scheme_end],
            &rest[..colon],
            &rest[at..]
        ),
        None => url.to_owned(),
    }
}

/// A pool of 8 connections.
pub async fn pool() -> PgPool {
    pool_with(8).await
}

/// Whether the tests run against a Citus cluster (`.ci/citus` sets `OUTBOX_CITUS=1`): the
/// fixtures then build their outboxes distributed.
pub fn citus() -> bool {
    std::env::var("OUTBOX_CITUS").is_ok_and(|v| v == "1")
}

/// The worker nodes' URLs of the Citus cluster (`.ci/citus` sets `OUTBOX_CITUS_WORKERS`);
/// none on a single node.
pub fn citus_workers() -> Vec<String> {
    if !citus() {
        return Vec::new();
    }
    std::env::var("OUTBOX_CITUS_WORKERS")
        .expect("OUTBOX_CITUS_WORKERS names the Citus workers (.ci/citus sets it)")
        .split_whitespace()
        .map(str::to_owned)
        .collect()
}

/// The buckets of the tests' distributed outboxes (more than the cluster's 8 shards).
pub const CITUS_BUCKETS: u16 = 16;

/// `Outbox::builder()`, distributed on a Citus cluster ([`citus`]).
pub fn builder() -> OutboxBuilder {
    if citus() {
        Outbox::builder().distributed(CITUS_BUCKETS)
    } else {
        Outbox::builder()
    }
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
        let outbox = configure(builder().table(unique_table("t")))
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
            "DROP TABLE IF EXISTS {}, {}, {}, {}",
            self.outbox.table(),
            self.outbox.dead_letter_table(),
            self.outbox.migrations_table(),
            self.outbox.paused_table()
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

#[cfg(test)]
mod tests {
    //! The fixture's first-connection messages, against the real server of `DATABASE_URL`:
    //! each cause must lead to its own instruction, not to "start the cluster" for all.

    use super::*;

    /// Connects with `opts` (expected to fail) and returns the fixture's message for it.
    async fn message_for(opts: PgConnectOptions, shown: &str) -> String {
        match sqlx::PgConnection::connect_with(&opts).await {
            Ok(_) => panic!("{shown}: the connection was expected to fail"),
            Err(e) => {
                let msg = unreachable_message(&opts, shown, &e);
                eprintln!("{msg}"); // shown with --no-capture: what a developer would read
                msg
            }
        }
    }

    fn base() -> PgConnectOptions {
        database_url()
            .parse::<PgConnectOptions>()
            .expect("DATABASE_URL is a Postgres URL")
    }

    #[tokio::test]
    async fn a_missing_database_asks_for_createdb_naming_it() {
        let name = unique_table("outbox_missing_db");
        let opts = base().database(&name);
        let msg = message_for(
            opts.clone(),
            &format!("(DATABASE_URL with database {name})"),
        )
        .await;
        let port_arg = match opts.get_port() {
            5432 => String::new(),
            port => format!(" -p {port}"),
        };
        let createdb = format!(
            "createdb -h {}{port_arg} -U {} {name}",
            opts.get_host(),
            opts.get_username()
        );
        assert!(msg.contains(&createdb), "no `{createdb}` in: {msg}");
        assert!(
            !msg.contains("pg_ctlcluster"),
            "a running server is not to be started: {msg}"
        );
    }

    #[tokio::test]
    async fn a_closed_port_asks_to_start_the_server() {
        let opts = base().host("127.0.0.1").port(1);
        let msg = message_for(opts, "postgres://postgres@127.0.0.1:1/test").await;
        assert!(
            msg.contains(
                "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start"
            ),
            "{msg}"
        );
        assert!(!msg.contains("createdb"), "{msg}");
    }

    #[tokio::test]
    async fn an_unknown_role_is_a_login_problem() {
        // SQLSTATE 28000 from any authentication method: the role does not exist.
        let opts = base().username("outbox_no_such_role");
        let msg = message_for(opts, "(DATABASE_URL as outbox_no_such_role)").await;
        assert!(
            msg.contains("refused the login of user \"outbox_no_such_role\""),
            "{msg}"
        );
        assert!(
            !msg.contains("pg_ctlcluster") && !msg.contains("createdb"),
            "{msg}"
        );
    }

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            redact("postgres://u:secret@db:5432/x?sslmode=require"),
            "postgres://u:***@db:5432/x?sslmode=require"
        );
        assert_eq!(
            redact("postgres://postgres@127.0.0.1:5432/test"),
            "postgres://postgres@127.0.0.1:5432/test"
        );
        assert_eq!(redact("postgres:///test"), "postgres:///test");
    }
}
