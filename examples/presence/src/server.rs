//! The presence service: an axum HTTP API over a users table, whose expiry timers are
//! outbox timers, and the worker that runs the expiry handler.
//!
//! - `POST /users/{id}/ping` sets `online = true, last_seen = now()` and extends the user's
//!   [`PresenceExpiry`] timer to `now() + timeout`, **in one transaction**, with a slack
//!   ([`ServerConfig::slack`]): a ping that would move a waiting timer by less than the
//!   slack writes nothing to the timer's row. A ping that lands while the expiry handler
//!   runs queues a rearm: the timer fires again for the new deadline.
//! - `DELETE /users/{id}/session` (log out) sets the user offline and cancels the timer, in
//!   one transaction.
//! - `GET /users/{id}` reads the user's state.
//! - The expiry handler locks the user's row and goes offline only if `last_seen + timeout`
//!   has passed (SPEC §5.4: a rearm does not undo what a running handler did, so the
//!   handler must re-check); otherwise it extends the timer to `last_seen + timeout` (a
//!   timer extended with a slack may fire up to the slack early, and this puts it back).
//!   Both in its own transaction, which also completes the timer's row (SPEC §7.9). It
//!   gets the service's state from the worker (`Context::state`).
//! - `GET /stats` (JSON) and `GET /metrics` (the Prometheus text format, from the
//!   [`telemetry`] module's exporter) report what the service and the worker did.

use sqlx::AssertSqlSafe;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use chrono::{DateTime, Utc};
use outbox::{
    message::Schedule, Cancelled, Context, Outbox, PgStore, Published, RunningWorker,
    ShutdownReport, Worker,
};
use serde::{Deserialize, Serialize};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, PgPool, Row};
use tokio::sync::watch;

use metrics_exporter_prometheus::PrometheusHandle;

use crate::telemetry::{self, Scrape};

/// The expiry timer of one user. Its timer id is the user id.
#[outbox::timer(queue = "presence.expiry", max_deliveries = 5)]
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PresenceExpiry {
    /// The user whose presence expires.
    pub user_id: i64,
}

/// The database the binary uses when `DATABASE_URL` is not set.
pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

/// The default users table.
pub const DEFAULT_USERS_TABLE: &str = "presence_users";

/// What can stop the service from starting.
#[derive(Debug)]
pub enum Error {
    /// Postgres could not be reached; the message says what to run.
    Unreachable {
        /// The URL, password redacted.
        url: String,
        /// The command that creates the URL's database, for when the server is up but the
        /// database is missing (`createdb -h <host> [-p <port>] -U <user> <database>`).
        createdb: String,
        /// What sqlx reported.
        source: sqlx::Error,
    },
    /// A setting is unusable.
    Config(String),
    /// The outbox refused something (migrations, schema validation, worker settings).
    Outbox(outbox::Error),
    /// A statement failed.
    Database(sqlx::Error),
    /// Binding the HTTP listener failed.
    Io(std::io::Error),
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            // The server answered: no cluster to start. A missing database (3D000) is
            // created; a refused login (28000, 28P01) is a user or password to fix.
            Error::Unreachable {
                url,
                createdb,
                source: source @ sqlx::Error::Database(db),
            } if db.code().as_deref() == Some("3D000") => write!(
                f,
                "Postgres at {url} is running but has no such database: {source}\n\
                 create it with `{createdb}` \
                 or set DATABASE_URL to one that exists (default {DEFAULT_DATABASE_URL})"
            ),
            Error::Unreachable {
                url,
                source: source @ sqlx::Error::Database(_),
                ..
            } => write!(
                f,
                "Postgres at {url} refused the connection: {source}\n\
                 check the user and password in DATABASE_URL (default {DEFAULT_DATABASE_URL})"
            ),
            // Not local: starting the local cluster would not help.
            Error::Unreachable { url, source, .. } if !is_local(url) => write!(
                f,
                "cannot reach Postgres at {url}: {source}\n\
                 check the host and port in DATABASE_URL, or unset it to use the local default \
                 ({DEFAULT_DATABASE_URL})"
            ),
            Error::Unreachable { url, source, .. } => write!(
                f,
                "cannot reach Postgres at {url}: {source}\n\
                 start the local cluster with\n    \
                 pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start\n\
                 or set DATABASE_URL to a running Postgres (default {DEFAULT_DATABASE_URL})"
            ),
            Error::Config(m) => write!(f, "{m}"),
            Error::Outbox(e) => write!(f, "outbox: {e}"),
            Error::Database(e) => write!(f, "database: {e}"),
            Error::Io(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for Error {}

/// Whether a (redacted) database URL points at this machine.
fn is_local(url: &str) -> bool {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let host_port = rest.rsplit_once('@').map_or(rest, |(_, h)| h);
    let host = host_port.split(['/', '?']).next().unwrap_or("");
    let host = host.rsplit_once(':').map_or(host, |(h, _)| h);
    matches!(host, "" | "localhost" | "127.0.0.1" | "[::1]" | "::1")
}

impl From<outbox::Error> for Error {
    fn from(e: outbox::Error) -> Self {
        Error::Outbox(e)
    }
}

impl From<sqlx::Error> for Error {
    fn from(e: sqlx::Error) -> Self {
        Error::Database(e)
    }
}

/// Replaces the password of a `postgres://user:password@host/db` URL with `***`.
pub fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let Some((userinfo, host)) = rest.rsplit_once('@') else {
        return url.to_owned();
    };
    match userinfo.split_once(':') {
        Some((user, _)) => format!("{scheme}://{user}:***@{host}"),
        None => url.to_owned(),
    }
}

/// A pool of at most `max` connections, without a test on acquire (see [`connect_with`]).
/// Fails within ~5 s with [`Error::Unreachable`] when Postgres is down.
pub async fn connect(url: &str, max: u32) -> Result<PgPool, Error> {
    connect_with(url, max, false).await
}

/// [`connect`], choosing whether to ping each connection as it leaves the pool
/// (`test_before_acquire`): one round trip more per request, which the service does
/// without (a statement on a dead connection fails that request, and sqlx drops the
/// connection).
pub async fn connect_with(url: &str, max: u32, test_before_acquire: bool) -> Result<PgPool, Error> {
    connect_pool(url, max, test_before_acquire, false).await
}

/// [`connect_with`]; `async_commit` sets `synchronous_commit = off` on the pool's
/// connections (sent at connect, no round trip per request): a commit returns before its
/// WAL is flushed, and a crash of the database server may forget the last few hundred
/// milliseconds of acknowledged commits.
pub async fn connect_pool(
    url: &str,
    max: u32,
    test_before_acquire: bool,
    async_commit: bool,
) -> Result<PgPool, Error> {
    let opts: PgConnectOptions = url.parse::<PgConnectOptions>().map_err(|e| {
        Error::Config(format!(
            "DATABASE_URL {} is not a Postgres URL: {e}",
            redact(url)
        ))
    })?;
    let mut opts = opts.disable_statement_logging();
    if async_commit {
        opts = opts.options([("synchronous_commit", "off")]);
    }
    let createdb = format!(
        "createdb -h {}{} -U {} {}",
        opts.get_host(),
        match opts.get_port() {
            5432 => String::new(),
            port => format!(" -p {port}"),
        },
        opts.get_username(),
        // Without a database in the URL, Postgres uses the user's name.
        opts.get_database().unwrap_or(opts.get_username())
    );
    let unreachable = |source| Error::Unreachable {
        url: redact(url),
        createdb: createdb.clone(),
        source,
    };
    // One plain connection first: a pool only says "timed out", this says why.
    match tokio::time::timeout(Duration::from_secs(5), opts.connect()).await {
        Ok(Ok(conn)) => drop(conn),
        Ok(Err(e)) => return Err(unreachable(e)),
        Err(_) => return Err(unreachable(sqlx::Error::PoolTimedOut)),
    }
    PgPoolOptions::new()
        .max_connections(max)
        .test_before_acquire(test_before_acquire)
        .acquire_timeout(Duration::from_secs(5))
        .connect_with(opts)
        .await
        .map_err(unreachable)
}

/// Settings of [`Server::start`].
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Postgres URL.
    pub database_url: String,
    /// Where to serve HTTP (port 0: any free port; see [`Server::addr`]).
    pub listen: SocketAddr,
    /// How long a user stays online after their last ping.
    pub timeout: Duration,
    /// Simulated work in the expiry handler before it locks the user row (telling the
    /// user's contacts, say). Pings that land meanwhile queue a rearm.
    pub handler_delay: Duration,
    /// Expiry handlers running at once.
    pub concurrency: usize,
    /// The slack of a ping's extend (`extend_presence_expiry_with_slack`): a ping that
    /// would move the waiting timer later by this much or less writes nothing to the
    /// timer's row, so a user pinging every few seconds writes it about once per slack.
    /// The timer may then fire up to the slack early; the expiry handler finds the user
    /// still active and extends the timer to `last_seen + timeout`. Zero: every ping
    /// writes. Must be shorter than the timeout.
    pub slack: Duration,
    /// The worker's `ack_batch_size` (1: one completion statement per run).
    pub ack_batch_size: usize,
    /// Ping every connection as it leaves the pools (a round trip per request).
    pub test_before_acquire: bool,
    /// `synchronous_commit = off` on the requests' pool (see [`connect_pool`]): a ping's
    /// commit does not wait for the WAL flush. A crash of the database server may then
    /// forget the last acknowledged pings (their users can go offline early); the expiry
    /// handlers' pool keeps durable commits.
    pub async_commit: bool,
    /// Connections for HTTP requests and expiry handlers. The worker's claims and
    /// completions use a pool of their own (`concurrency + 3`), so a burst of requests
    /// cannot delay timers.
    pub pool_size: u32,
    /// The outbox tables the timers live in.
    pub outbox: Outbox,
    /// The users table (letters, digits, `_`; created if missing).
    pub users_table: String,
    /// Start from empty tables: delete every user and every `presence.expiry` timer row
    /// (running or not) at start. For the demo's own tables only.
    pub reset: bool,
}

impl ServerConfig {
    /// Defaults: 127.0.0.1:3000, 30 s timeout, no handler delay, 8 expiry handlers, no
    /// slack, one completion per run, no connection test on acquire, 16 connections, the
    /// default outbox tables, table `presence_users`, no reset.
    pub fn new(database_url: impl Into<String>) -> Self {
        ServerConfig {
            database_url: database_url.into(),
            listen: SocketAddr::from(([127, 0, 0, 1], 3000)),
            timeout: Duration::from_secs(30),
            handler_delay: Duration::ZERO,
            concurrency: 8,
            slack: Duration::ZERO,
            ack_batch_size: 1,
            test_before_acquire: false,
            async_commit: false,
            pool_size: 16,
            outbox: Outbox::default(),
            users_table: DEFAULT_USERS_TABLE.to_owned(),
            reset: false,
        }
    }

    fn validate(&self) -> Result<(), Error> {
        let t = &self.users_table;
        let ident = !t.is_empty()
            && t.len() <= 63
            && t.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
            && t.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !ident {
            return Err(Error::Config(format!(
                "users table `{t}`: use 1..=63 ASCII letters, digits and `_`, not starting with a digit"
            )));
        }
        if self.timeout < Duration::from_millis(200)
            || self.timeout > Duration::from_secs(24 * 3600)
        {
            return Err(Error::Config(format!(
                "timeout {:?}: must be within 200 ms..=24 h",
                self.timeout
            )));
        }
        if self.slack >= self.timeout {
            return Err(Error::Config(
                "slack must be shorter than the timeout".into(),
            ));
        }
        if self.handler_delay >= self.timeout {
            return Err(Error::Config(
                "handler delay must be shorter than the timeout".into(),
            ));
        }
        if self.pool_size < 2 {
            return Err(Error::Config("pool size must be at least 2".into()));
        }
        Ok(())
    }
}

/// The SQL of the users table, rendered once for its name.
struct UserSql {
    create: String,
    reset_users: String,
    reset_timers: String,
    ping: String,
    logout: String,
    get: String,
    lock_for_expiry: String,
    go_offline: String,
    count: String,
    audit: String,
    /// `SELECT create_distributed_table(…)` for the users table on Citus.
    distribute: Option<String>,
    /// The outbox, for the bucket of a user's rows.
    bucket: Outbox,
}

impl UserSql {
    fn new(table: &str, outbox: &Outbox) -> Self {
        let u = format!("\"{table}\"");
        let o = outbox.table();
        // On Citus (`--citus`) the users table is distributed by the outbox's bucket of the
        // user's timer key and co-located with the queue table, and every statement about
        // one user names the bucket as its last parameter: a ping (user upsert and extend)
        // and an expiry (lock, update, completion) each stay on one node.
        let citus = outbox.buckets().is_some();
        let b = |param: u32| {
            if citus {
                format!(" AND bucket = ${param}")
            } else {
                String::new()
            }
        };
        UserSql {
            create: if citus {
                format!(
                    "CREATE TABLE IF NOT EXISTS {u} (\
                       bucket smallint NOT NULL, \
                       user_id bigint NOT NULL, \
                       online boolean NOT NULL, \
                       last_seen timestamptz NOT NULL, \
                       offline_since timestamptz, \
                       offline_reason text, \
                       PRIMARY KEY (bucket, user_id))"
                )
            } else {
                format!(
                    "CREATE TABLE IF NOT EXISTS {u} (\
                       user_id bigint PRIMARY KEY, \
                       online boolean NOT NULL, \
                       last_seen timestamptz NOT NULL, \
                       offline_since timestamptz, \
                       offline_reason text)"
                )
            },
            distribute: citus.then(|| {
                let lit = |s: &str| format!("'{}'", s.replace('\'', "''"));
                format!(
                    "SELECT create_distributed_table({ul}, 'bucket', colocate_with => {ol}) \
                     WHERE NOT EXISTS (SELECT FROM pg_dist_partition WHERE logicalrelid = {ul}::regclass)",
                    ul = lit(&u),
                    ol = lit(o)
                )
            }),
            reset_users: format!("DELETE FROM {u}"),
            reset_timers: format!("DELETE FROM {o} WHERE queue = $1"),
            // `greatest` keeps last_seen monotonic if two pings of one user race.
            ping: if citus {
                format!(
                    "INSERT INTO {u} AS u (bucket, user_id, online, last_seen) VALUES ($2, $1, true, now()) \
                     ON CONFLICT (bucket, user_id) DO UPDATE SET online = true, \
                       last_seen = greatest(u.last_seen, excluded.last_seen), \
                       offline_since = NULL, offline_reason = NULL \
                     RETURNING u.last_seen"
                )
            } else {
                format!(
                    "INSERT INTO {u} AS u (user_id, online, last_seen) VALUES ($1, true, now()) \
                     ON CONFLICT (user_id) DO UPDATE SET online = true, \
                       last_seen = greatest(u.last_seen, excluded.last_seen), \
                       offline_since = NULL, offline_reason = NULL \
                     RETURNING u.last_seen"
                )
            },
            logout: format!(
                "UPDATE {u} SET online = false, offline_since = now(), offline_reason = 'logout' \
                 WHERE user_id = $1{b2}",
                b2 = b(2)
            ),
            get: format!(
                "SELECT online, last_seen, offline_since, offline_reason FROM {u} WHERE user_id = $1{b2}",
                b2 = b(2)
            ),
            // The row lock orders this check against a concurrent ping (which updates the
            // row first, then extends the timer): we see either the state before the ping
            // (and the ping's extend queues a rearm or a new timer) or the state after it.
            // `now()` is this transaction's start, after the claim, so for the deadline the
            // timer was due at the condition below holds.
            // Also the real deadline, `last_seen + timeout`, to extend the timer to when the
            // user is still active.
            lock_for_expiry: format!(
                "SELECT online, last_seen + $2::bigint * interval '1 microsecond' <= now(), \
                        last_seen + $2::bigint * interval '1 microsecond' \
                 FROM {u} WHERE user_id = $1{b3} FOR UPDATE",
                b3 = b(3)
            ),
            go_offline: format!(
                "UPDATE {u} SET online = false, offline_since = now(), offline_reason = 'expired' \
                 WHERE user_id = $1{b2}",
                b2 = b(2)
            ),
            count: format!(
                "SELECT count(*) FILTER (WHERE online), count(*) FILTER (WHERE NOT online) \
                 FROM {u} WHERE user_id BETWEEN $1 AND $2"
            ),
            // One snapshot of users and their timer rows (the unique index on
            // (queue, timer_id) serves the probe; on Citus the co-located bucket joins them).
            audit: format!(
                "SELECT u.user_id, u.online, u.offline_reason, \
                        EXISTS (SELECT 1 FROM {o} t WHERE t.queue = $3 AND t.timer_id = u.user_id::text{tb}) \
                 FROM {u} u WHERE u.user_id BETWEEN $1 AND $2 ORDER BY u.user_id",
                tb = if citus { " AND t.bucket = u.bucket" } else { "" }
            ),
            bucket: outbox.clone(),
        }
    }

    /// The bucket of a user's rows on Citus (that of the user's timer key); `None` on one node.
    fn bucket(&self, user_id: i64) -> Option<i16> {
        self.bucket.bucket_of(&user_id.to_string())
    }
}

/// A statement about one user with its bucket bound last, on Citus.
fn with_bucket<'q>(
    q: sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
    bucket: Option<i16>,
) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    match bucket {
        Some(b) => q.bind(b),
        None => q,
    }
}

/// [`with_bucket`] for a `query_as`.
fn with_bucket_as<'q, O>(
    q: sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments>,
    bucket: Option<i16>,
) -> sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments> {
    match bucket {
        Some(b) => q.bind(b),
        None => q,
    }
}

/// Counters of what the service did, shown on `GET /stats`.
#[derive(Default)]
struct Counters {
    pings: AtomicU64,
    pings_inserted: AtomicU64,
    pings_extended: AtomicU64,
    pings_rearm_queued: AtomicU64,
    pings_unchanged: AtomicU64,
    logouts: AtomicU64,
    cancel_deleted: AtomicU64,
    cancel_rearm_dropped: AtomicU64,
    cancel_running: AtomicU64,
    cancel_not_found: AtomicU64,
    fired: AtomicU64,
    went_offline: AtomicU64,
    kept_online: AtomicU64,
    rearmed_by_handler: AtomicU64,
    already_offline: AtomicU64,
    handler_errors: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

struct App {
    pool: PgPool,
    outbox: Outbox,
    sql: UserSql,
    timeout: Duration,
    slack: Duration,
    handler_delay: Duration,
    counters: Counters,
    metrics: Option<&'static PrometheusHandle>,
}

/// A running service: HTTP server and expiry worker.
pub struct Server {
    addr: SocketAddr,
    app: Arc<App>,
    stop_http: watch::Sender<bool>,
    http: tokio::task::JoinHandle<std::io::Result<()>>,
    worker: RunningWorker,
    worker_pool: PgPool,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl Server {
    /// Connects, applies the outbox migrations ([`Outbox::migrate`]), creates the users
    /// table, checks the schema ([`Outbox::validate_schema`]), starts the expiry worker and
    /// serves HTTP.
    ///
    /// # Errors
    /// [`Error::Unreachable`] when Postgres is down, and the other [`Error`]s.
    pub async fn start(config: ServerConfig) -> Result<Server, Error> {
        config.validate()?;
        let metrics = telemetry::install();
        let pool = connect_pool(
            &config.database_url,
            config.pool_size,
            config.test_before_acquire,
            config.async_commit,
        )
        .await?;
        let worker_pool = connect_with(
            &config.database_url,
            config.concurrency as u32 + 3,
            config.test_before_acquire,
        )
        .await?;
        config.outbox.migrate(&pool).await?;
        config.outbox.validate_schema(&pool).await?;
        let sql = UserSql::new(&config.users_table, &config.outbox);
        sqlx::query(AssertSqlSafe(&*sql.create))
            .execute(&pool)
            .await?;
        if let Some(distribute) = &sql.distribute {
            sqlx::query(AssertSqlSafe(&**distribute))
                .execute(&pool)
                .await?;
        }
        if config.reset {
            sqlx::query(AssertSqlSafe(&*sql.reset_users))
                .execute(&pool)
                .await?;
            sqlx::query(AssertSqlSafe(&*sql.reset_timers))
                .bind(<PresenceExpiry as outbox::Timer>::QUEUE)
                .execute(&pool)
                .await?;
        }
        let app = Arc::new(App {
            pool,
            outbox: config.outbox.clone(),
            sql,
            timeout: config.timeout,
            slack: config.slack,
            handler_delay: config.handler_delay,
            counters: Counters::default(),
            metrics,
        });

        let worker = Worker::builder(PgStore::new(worker_pool.clone(), config.outbox.clone()))
            .state(app.clone())
            .timer::<PresenceExpiry>(expire)
            .concurrency(config.concurrency)
            .fetch_batch_size(config.concurrency)
            .ack_batch_size(config.ack_batch_size)
            .build()?
            .start();

        let listener = tokio::net::TcpListener::bind(config.listen)
            .await
            .map_err(Error::Io)?;
        let addr = listener.local_addr().map_err(Error::Io)?;
        let router = Router::new()
            .route("/users/{id}", get(get_user))
            .route("/users/{id}/ping", post(ping))
            .route("/users/{id}/session", delete(logout))
            .route("/stats", get(stats))
            .route("/metrics", get(prometheus))
            .with_state(app.clone());
        let (stop_http, mut stopped) = watch::channel(false);
        let http = tokio::spawn(async move {
            axum::serve(listener, router)
                .with_graceful_shutdown(async move {
                    let _ = stopped.wait_for(|s| *s).await;
                })
                .await
        });
        Ok(Server {
            addr,
            app,
            stop_http,
            http,
            worker,
            worker_pool,
        })
    }

    /// The address the HTTP server listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://<addr>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The pool requests and handlers use.
    pub fn pool(&self) -> &PgPool {
        &self.app.pool
    }

    /// The outbox the timers live in.
    pub fn outbox(&self) -> &Outbox {
        &self.app.outbox
    }

    /// Reads the users `first..first + count` and whether each has a live timer row, in
    /// one snapshot.
    ///
    /// # Errors
    /// The database error.
    pub async fn audit(&self, first: i64, count: i64) -> Result<Audit, sqlx::Error> {
        let rows: Vec<(i64, bool, Option<String>, bool)> =
            sqlx::query_as(AssertSqlSafe(&*self.app.sql.audit))
                .bind(first)
                .bind(first + count - 1)
                .bind(<PresenceExpiry as outbox::Timer>::QUEUE)
                .fetch_all(&self.app.pool)
                .await?;
        let mut audit = Audit::default();
        for (id, online, reason, timer) in rows {
            audit.users += 1;
            if online && !timer {
                audit.online_without_timer.push(id);
            }
            if reason.as_deref() == Some("logout") && timer {
                audit.logged_out_with_timer.push(id);
            }
            if online {
                audit.online.push(id);
            }
        }
        Ok(audit)
    }

    /// The service's counters and the worker's metrics.
    pub async fn stats(&self, range: Option<(i64, i64)>) -> Result<Stats, sqlx::Error> {
        self.app.stats(range).await
    }

    /// Stops HTTP, then the worker (running handlers finish, SPEC §7.5), then closes the
    /// pools.
    pub async fn shutdown(self) -> ShutdownReport {
        let _ = self.stop_http.send(true);
        match self.http.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "http server failed"),
            Err(e) => tracing::warn!(error = %e, "http server task failed"),
        }
        let report = self.worker.shutdown().await;
        self.worker_pool.close().await;
        self.app.pool.close().await;
        report
    }
}

/// What [`Server::audit`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Audit {
    /// Users read.
    pub users: usize,
    /// Online users.
    pub online: Vec<i64>,
    /// Online users without a live timer row: they would stay online forever. Must be
    /// empty: a ping sets `online` and extends the timer in one transaction, and a rearm
    /// keeps the row alive past a running handler.
    pub online_without_timer: Vec<i64>,
    /// Logged-out users whose timer row is still there. Empty once the handlers that were
    /// running at logout time (`Cancelled::Running`) have finished.
    pub logged_out_with_timer: Vec<i64>,
}

/// The expiry handler (SPEC §5.4, §7.9): re-check `last_seen` under the user's row lock and
/// go offline, in the handler's own transaction, which also completes the timer's row
/// (`tx.commit()`): the offline transition and the completion commit together, so a crash
/// or a lost lease between them cannot leave one without the other. Lock order: the
/// user's row first, then (at commit) the timer's, as the ping and logout requests do.
///
/// A user still active (`last_seen + timeout` not passed) keeps the timer: the handler
/// extends it to exactly `last_seen + timeout`. That is the contract of the ping's slack
/// (the timer fired up to the slack early because a ping within the slack wrote nothing),
/// and it also covers a ping that committed before this check: either its extend queued a
/// rearm at least as late (then this extend changes nothing) or it wrote nothing. The
/// extend lands on this run's own leased row, so it queues a rearm that `commit` applies.
async fn expire(t: PresenceExpiry, ctx: Context<Arc<App>>) -> Result<(), outbox::Error> {
    let app = ctx.state::<Arc<App>>();
    bump(&app.counters.fired);
    if !app.handler_delay.is_zero() {
        // Stand-in for real work (notifying the user's contacts, say). A ping that lands
        // now finds the timer row leased and queues a rearm.
        tokio::time::sleep(app.handler_delay).await;
    }
    let result = async {
        let mut tx = ctx.begin().await?;
        let row: Option<(bool, bool, DateTime<Utc>)> = with_bucket_as(
            sqlx::query_as(AssertSqlSafe(&*app.sql.lock_for_expiry))
                .bind(t.user_id)
                .bind(app.timeout.as_micros() as i64),
            app.sql.bucket(t.user_id),
        )
        .fetch_optional(&mut *tx)
        .await?;
        let counter = match row {
            Some((true, true, _)) => {
                with_bucket(
                    sqlx::query(AssertSqlSafe(&*app.sql.go_offline)).bind(t.user_id),
                    app.sql.bucket(t.user_id),
                )
                .execute(&mut *tx)
                .await?;
                &app.counters.went_offline
            }
            // A newer ping: the timer must fire again at its real deadline. A ping whose
            // extend queued a rearm at least as late makes this an `Unchanged`.
            Some((true, false, deadline)) => {
                let rearm = extend_presence_expiry(
                    &mut app.outbox.on(&mut tx),
                    &t.user_id.to_string(),
                    &t,
                    Schedule::at(deadline),
                )
                .await?;
                if matches!(rearm, Published::RearmQueued { .. }) {
                    bump(&app.counters.rearmed_by_handler);
                }
                &app.counters.kept_online
            }
            Some((false, _, _)) | None => &app.counters.already_offline,
        };
        tx.commit().await?;
        bump(counter);
        Ok::<(), outbox::Error>(())
    }
    .await;
    if let Err(e) = &result {
        bump(&app.counters.handler_errors);
        tracing::warn!(user_id = t.user_id, delivery = ctx.delivery(), error = %e, "expiry handler failed; the worker retries");
    }
    result
}

/// An error answered as `500` with its text.
struct AppError(String);

impl IntoResponse for AppError {
    fn into_response(self) -> Response {
        tracing::warn!(error = %self.0, "request failed");
        (StatusCode::INTERNAL_SERVER_ERROR, self.0).into_response()
    }
}

impl From<sqlx::Error> for AppError {
    fn from(e: sqlx::Error) -> Self {
        AppError(e.to_string())
    }
}

impl From<outbox::Error> for AppError {
    fn from(e: outbox::Error) -> Self {
        AppError(e.to_string())
    }
}

/// The answer to a ping.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PingReply {
    /// The user.
    pub user_id: i64,
    /// The stored `last_seen`.
    pub last_seen: DateTime<Utc>,
    /// What the extend did: `inserted`, `extended`, `rearm_queued` (the expiry handler was
    /// running) or `unchanged`.
    pub timer: String,
}

async fn ping(
    State(app): State<Arc<App>>,
    Path(user_id): Path<i64>,
) -> Result<Json<PingReply>, AppError> {
    let mut tx = app.pool.begin().await?;
    let ping = sqlx::query_scalar(AssertSqlSafe(&*app.sql.ping)).bind(user_id);
    let ping = match app.sql.bucket(user_id) {
        Some(b) => ping.bind(b),
        None => ping,
    };
    let last_seen: DateTime<Utc> = ping.fetch_one(&mut *tx).await?;
    let timer = extend_presence_expiry_with_slack(
        &mut app.outbox.on(&mut tx),
        &user_id.to_string(),
        &PresenceExpiry { user_id },
        app.timeout,
        app.slack,
    )
    .await?;
    tx.commit().await?;
    let c = &app.counters;
    bump(&c.pings);
    let timer = match timer {
        Published::Inserted { .. } => {
            bump(&c.pings_inserted);
            "inserted"
        }
        Published::Extended { .. } => {
            bump(&c.pings_extended);
            "extended"
        }
        Published::RearmQueued { .. } => {
            bump(&c.pings_rearm_queued);
            "rearm_queued"
        }
        _ => {
            bump(&c.pings_unchanged);
            "unchanged"
        }
    };
    Ok(Json(PingReply {
        user_id,
        last_seen,
        timer: timer.to_owned(),
    }))
}

/// The answer to a logout.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LogoutReply {
    /// The user.
    pub user_id: i64,
    /// Whether the user existed.
    pub found: bool,
    /// What the cancel did: `deleted`, `rearm_dropped`, `running` (the expiry handler is
    /// running; it finds the user offline) or `not_found`.
    pub timer: String,
}

async fn logout(
    State(app): State<Arc<App>>,
    Path(user_id): Path<i64>,
) -> Result<Json<LogoutReply>, AppError> {
    let mut tx = app.pool.begin().await?;
    // The user row first, as a ping does, so the two never wait on each other's locks in
    // opposite orders.
    let found = with_bucket(
        sqlx::query(AssertSqlSafe(&*app.sql.logout)).bind(user_id),
        app.sql.bucket(user_id),
    )
    .execute(&mut *tx)
    .await?
    .rows_affected()
        == 1;
    let cancelled =
        cancel_presence_expiry(&mut app.outbox.on(&mut tx), &user_id.to_string()).await?;
    tx.commit().await?;
    let c = &app.counters;
    bump(&c.logouts);
    let timer = match cancelled {
        Cancelled::Deleted { .. } => {
            bump(&c.cancel_deleted);
            "deleted"
        }
        Cancelled::RearmDropped { .. } => {
            bump(&c.cancel_rearm_dropped);
            "rearm_dropped"
        }
        Cancelled::Running { .. } => {
            bump(&c.cancel_running);
            "running"
        }
        _ => {
            bump(&c.cancel_not_found);
            "not_found"
        }
    };
    Ok(Json(LogoutReply {
        user_id,
        found,
        timer: timer.to_owned(),
    }))
}

/// A user's state.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct UserState {
    /// The user.
    pub user_id: i64,
    /// Online or not.
    pub online: bool,
    /// The latest ping.
    pub last_seen: DateTime<Utc>,
    /// When the user went offline.
    pub offline_since: Option<DateTime<Utc>>,
    /// Why: `expired` or `logout`.
    pub offline_reason: Option<String>,
}

async fn get_user(
    State(app): State<Arc<App>>,
    Path(user_id): Path<i64>,
) -> Result<Response, AppError> {
    let row = with_bucket(
        sqlx::query(AssertSqlSafe(&*app.sql.get)).bind(user_id),
        app.sql.bucket(user_id),
    )
    .fetch_optional(&app.pool)
    .await?;
    let Some(row) = row else {
        return Ok((StatusCode::NOT_FOUND, "no such user").into_response());
    };
    Ok(Json(UserState {
        user_id,
        online: row.try_get(0)?,
        last_seen: row.try_get(1)?,
        offline_since: row.try_get(2)?,
        offline_reason: row.try_get(3)?,
    })
    .into_response())
}

/// Firing lateness of the expiry timers: claim time − deadline (database clock), from the
/// worker's `outbox_firing_lateness_seconds` histogram (a Prometheus summary: the quantiles
/// cover the last [`telemetry::SUMMARY_WINDOW`], the count the whole process).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Lateness {
    /// Firings measured since the process started.
    pub count: u64,
    /// Median over the window, milliseconds.
    pub p50_ms: f64,
    /// 99th percentile over the window, milliseconds.
    pub p99_ms: f64,
    /// Largest within the window, milliseconds.
    pub max_ms: f64,
}

/// `GET /stats`: the service's counters and the worker's metrics.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    /// The presence timeout, milliseconds.
    pub timeout_ms: u64,
    /// The expiry handler's simulated work, milliseconds.
    pub handler_delay_ms: u64,
    /// Online users (in the requested range).
    pub online: i64,
    /// Offline users (in the requested range).
    pub offline: i64,
    /// Pings committed.
    pub pings: u64,
    /// Pings whose extend inserted a new timer.
    pub pings_inserted: u64,
    /// Pings whose extend moved a pending timer later.
    pub pings_extended: u64,
    /// Pings that landed while the expiry handler ran and queued a rearm.
    pub pings_rearm_queued: u64,
    /// Pings whose extend changed nothing (not later, or within the slack).
    pub pings_unchanged: u64,
    /// Logouts committed.
    pub logouts: u64,
    /// Logouts that deleted a pending timer.
    pub cancel_deleted: u64,
    /// Logouts that dropped a queued rearm.
    pub cancel_rearm_dropped: u64,
    /// Logouts that found the handler running with nothing queued.
    pub cancel_running: u64,
    /// Logouts without a timer.
    pub cancel_not_found: u64,
    /// Expiry handler runs.
    pub fired: u64,
    /// Runs that set the user offline.
    pub went_offline: u64,
    /// Runs that found a newer ping and left the user online.
    pub kept_online: u64,
    /// Of those, runs whose own extend queued the rearm (the timer had fired early
    /// because of the slack, or the ping's extend did not reach the row first).
    pub rearmed_by_handler: u64,
    /// The slack of a ping's extend, milliseconds.
    pub slack_ms: u64,
    /// Runs that found the user already offline (logged out) or unknown.
    pub already_offline: u64,
    /// Runs that failed (retried by the worker).
    pub handler_errors: u64,
    /// Rearms the worker applied (`outbox_rearmed_total`, summed over the process); `None`
    /// when another `metrics` recorder was installed first (see [`telemetry::install`]).
    pub rearms_applied: Option<u64>,
    /// Completions the worker dropped because the lease was lost (`outbox_lease_lost_total`).
    pub lease_lost: Option<u64>,
    /// Runs retried (`outbox_retried_total`).
    pub retried: Option<u64>,
    /// Terminal failures (`outbox_terminal_total`).
    pub terminal: Option<u64>,
    /// Firing lateness (`outbox_firing_lateness_seconds` of the expiry queue): quantiles over
    /// the last [`telemetry::SUMMARY_WINDOW`], count since the process started.
    pub lateness: Option<Lateness>,
}

impl App {
    async fn stats(&self, range: Option<(i64, i64)>) -> Result<Stats, sqlx::Error> {
        let (first, last) = range.unwrap_or((i64::MIN, i64::MAX));
        let (online, offline): (i64, i64) = sqlx::query_as(AssertSqlSafe(&*self.sql.count))
            .bind(first)
            .bind(last)
            .fetch_one(&self.pool)
            .await?;
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        // The same text `GET /metrics` serves, read back.
        let m = self.metrics.map(|h| Scrape::parse(&h.render()));
        let m = m.as_ref();
        Ok(Stats {
            timeout_ms: self.timeout.as_millis() as u64,
            handler_delay_ms: self.handler_delay.as_millis() as u64,
            online,
            offline,
            pings: get(&c.pings),
            pings_inserted: get(&c.pings_inserted),
            pings_extended: get(&c.pings_extended),
            pings_rearm_queued: get(&c.pings_rearm_queued),
            pings_unchanged: get(&c.pings_unchanged),
            logouts: get(&c.logouts),
            cancel_deleted: get(&c.cancel_deleted),
            cancel_rearm_dropped: get(&c.cancel_rearm_dropped),
            cancel_running: get(&c.cancel_running),
            cancel_not_found: get(&c.cancel_not_found),
            fired: get(&c.fired),
            went_offline: get(&c.went_offline),
            kept_online: get(&c.kept_online),
            rearmed_by_handler: get(&c.rearmed_by_handler),
            slack_ms: self.slack.as_millis() as u64,
            already_offline: get(&c.already_offline),
            handler_errors: get(&c.handler_errors),
            rearms_applied: m.map(|m| m.counter("outbox_rearmed_total")),
            lease_lost: m.map(|m| m.counter("outbox_lease_lost_total")),
            retried: m.map(|m| m.counter("outbox_retried_total")),
            terminal: m.map(|m| m.counter("outbox_terminal_total")),
            lateness: m
                .and_then(|m| {
                    m.summary(
                        "outbox_firing_lateness_seconds",
                        ("queue", <PresenceExpiry as outbox::Timer>::QUEUE),
                    )
                })
                // The exporter's quantiles are sketch estimates (0.01 % relative error) and
                // can sit a hair above the exact largest value (quantile 1); no quantile
                // exceeds the largest value, so they are capped there.
                .map(|q| Lateness {
                    count: q.count,
                    p50_ms: q.p50.min(q.max) * 1e3,
                    p99_ms: q.p99.min(q.max) * 1e3,
                    max_ms: q.max * 1e3,
                }),
        })
    }
}

/// `GET /stats?first=<id>&count=<n>`: counts online/offline among those users only.
#[derive(Debug, Deserialize)]
struct StatsQuery {
    first: Option<i64>,
    count: Option<i64>,
}

async fn stats(
    State(app): State<Arc<App>>,
    Query(q): Query<StatsQuery>,
) -> Result<Json<Stats>, AppError> {
    let range = q
        .first
        .map(|f| (f, f.saturating_add(q.count.unwrap_or(1).max(1) - 1)));
    Ok(Json(app.stats(range).await?))
}

/// `GET /metrics`: the exporter's rendering, in the text format version 0.0.4.
async fn prometheus(State(app): State<Arc<App>>) -> Response {
    match app.metrics {
        Some(m) => (
            [(
                axum::http::header::CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8",
            )],
            m.render(),
        )
            .into_response(),
        None => (StatusCode::NOT_FOUND, "metrics go to another recorder").into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server that is up but lacks the database asks for `createdb` naming it, not for
    /// the cluster to be started; a closed port asks for the cluster to be started.
    #[tokio::test]
    async fn unreachable_says_create_the_database_or_start_the_server() {
        let url = std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
        let opts: PgConnectOptions = url.parse().expect("DATABASE_URL is a Postgres URL");
        let name = format!(
            "presence_missing_{}",
            &uuid::Uuid::new_v4().simple().to_string()[..12]
        );
        // DATABASE_URL with its database replaced (credentials and parameters kept).
        let (base, query) = url.split_once('?').unwrap_or((&url, ""));
        let authority_start = base.find("://").map_or(0, |i| i + 3);
        let server = match base[authority_start..].find('/') {
            Some(slash) => &base[..authority_start + slash],
            None => base,
        };
        let query = if query.is_empty() {
            String::new()
        } else {
            format!("?{query}")
        };
        let missing = format!("{server}/{name}{query}");
        let msg = match connect(&missing, 1).await {
            Ok(_) => panic!("{missing} exists"),
            Err(e) => e.to_string(),
        };
        assert!(
            msg.contains(&format!(" -U {} {name}`", opts.get_username())),
            "{msg}"
        );
        assert!(msg.contains("createdb -h "), "{msg}");
        assert!(!msg.contains("pg_ctlcluster"), "{msg}");

        let msg = match connect("postgres://postgres@127.0.0.1:1/test", 1).await {
            Ok(_) => panic!("something listens on port 1"),
            Err(e) => e.to_string(),
        };
        assert!(msg.contains("pg_ctlcluster"), "{msg}");
        assert!(!msg.contains("createdb"), "{msg}");
    }

    #[test]
    fn redacts_passwords() {
        assert_eq!(
            redact("postgres://u:secret@h:5432/db"),
            "postgres://u:***@h:5432/db"
        );
        assert_eq!(
            redact("postgres://postgres@127.0.0.1/x"),
            "postgres://postgres@127.0.0.1/x"
        );
        assert_eq!(redact("not a url"), "not a url");
    }

    #[test]
    fn rejects_bad_settings() {
        let mut c = ServerConfig::new(DEFAULT_DATABASE_URL);
        assert!(c.validate().is_ok());
        c.users_table = "users; drop".into();
        assert!(c.validate().is_err());
        c.users_table = "presence_users".into();
        c.handler_delay = c.timeout;
        assert!(c.validate().is_err());
    }
}
