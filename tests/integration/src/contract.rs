//! One test-support interface over both stores, for the contract suite (`tests/it/contract/`)
//! and the model-based test (`tests/it/model.rs`).
//!
//! # A frozen, test-controlled clock on Postgres
//!
//! Both stores start at [`start`] and their clocks move only when a test calls
//! [`Harness::advance`], so every timestamp is known exactly and the same hand-written
//! expected values hold for both.
//!
//! On Postgres this works without touching the store's SQL: every statement calls `now()`
//! unqualified, so each test gets its own schema holding a one-row `clock` table and a
//! function `now()` that reads it, and its connections run with
//! `search_path = <that schema>, pg_catalog, public`. Naming `pg_catalog` explicitly
//! *after* the test's schema is what lets our `now()` shadow the built-in one (Postgres
//! searches an unlisted `pg_catalog` first). The tables are created under that search path
//! too, so their `DEFAULT now()` columns (`created_at`, the dead-letter `failed_at`) bind to
//! the test's clock. Advancing time is `UPDATE clock SET t = t + interval`.
//!
//! This replaces "the transaction's start time" with "the test's clock": what the contract
//! suite checks is the logic of each statement, not Postgres' clock. The Postgres-only tests
//! (`tests/it/postgres/`) run on the real clock.
//!
//! # On a Citus cluster
//!
//! Under `.ci/citus` ([`crate::citus`]) the outbox is distributed with **one bucket**, so
//! every row id is the sequence value the hand-written expectations count (`nextval × 1 +
//! 0`), and every statement is the distributed one. Citus ships each statement to a worker
//! node with its names schema-qualified, so the test's `now()` runs there too: every worker
//! gets the same schema, its own `clock` table and the same function (created on the node
//! itself, not through Citus), and [`Harness::advance`] moves every node's clock.

use std::future::Future;
use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox::dlq::{DeadLetterFilter, Redrive, RedriveOutcome};
use outbox::testing::MemoryStore;
use outbox::{
    admin::RowAction,
    message::{BatchItem, Schedule},
    store::{DeadLetter, Store, StoredRow},
    Cancelled, Error, Message, Outbox, PgStore, Published, Publisher, Result, Timer,
};
use sqlx::postgres::types::PgInterval;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::types::Json;
use sqlx::{AssertSqlSafe, ConnectOptions, PgPool};

use crate::{database_url, unique_table};

/// Where both stores' clocks start: 2030-01-01T00:00:00Z.
pub fn start() -> DateTime<Utc> {
    DateTime::from_timestamp(1_893_456_000, 0).expect("a valid instant")
}

/// A store under test plus the controls the scenarios need, implemented once per store.
pub trait Harness: Sized {
    /// The store.
    type S: Store;

    /// Which store, for messages.
    const NAME: &'static str;

    /// A fresh, empty store whose clock reads [`start`], with the dead-letter queue on or off.
    fn new(dead_letter: bool) -> impl Future<Output = Self>;

    /// The store.
    fn store(&self) -> &Self::S;

    /// Whether every queue row id comes from one sequence, so a redriven row's id is the
    /// next one after the rows published before it: true on a single node and in memory. On
    /// a Citus cluster a redrive runs on the worker node that holds the bucket and takes its
    /// id from that node's own range of the sequence (docs/guide/citus.md, "How rows find
    /// their shard"); the scenarios then check such an id by what it names, not its value.
    fn ids_from_one_sequence(&self) -> bool {
        true
    }

    /// Moves the store's clock forward by `by`.
    fn advance(&self, by: Duration) -> impl Future<Output = ()>;

    /// Publishes a batch (SPEC §2.3): `Outbox::publish_batch` or `MemoryStore::publish_batch`.
    fn publish_batch(
        &self,
        queue: &str,
        items: &[BatchItem<'_>],
        schedule: Schedule,
    ) -> impl Future<Output = Result<Vec<i64>>>;

    /// `outbox::message::extend_timer` through this store's [`outbox::Publisher`].
    fn extend_typed<T: Timer>(
        &self,
        timer_id: &str,
        payload: &T,
        schedule: Schedule,
    ) -> impl Future<Output = Result<Published>>;

    /// `outbox::message::publish_timer` through this store's [`outbox::Publisher`].
    fn publish_typed<T: Timer>(
        &self,
        timer_id: &str,
        payload: &T,
        schedule: Schedule,
    ) -> impl Future<Output = Result<Published>>;

    /// `outbox::message::cancel_timer` through this store's [`outbox::Publisher`].
    fn cancel_typed<T: Timer>(&self, timer_id: &str) -> impl Future<Output = Result<Cancelled>>;

    /// Publishes one message through this store's [`Publisher`].
    fn publish(&self, message: Message<'_>) -> impl Future<Output = Result<Published>>;

    /// Cancels a timer through this store's [`Publisher`].
    fn cancel(&self, queue: &str, timer_id: &str) -> impl Future<Output = Result<Cancelled>>;

    /// Live rows of `queue`: the store's inherent `pending`.
    fn pending(&self, queue: &str, limit: usize) -> impl Future<Output = Result<Vec<StoredRow>>>;

    /// Dead letters of `queue`, by id: the store's inherent `dead_letters` with a queue
    /// filter. With the dead-letter queue off, that call must refuse
    /// ([`Error::DeadLetterDisabled`]) and the table must hold no row of `queue` (read
    /// around the API): then the answer is empty.
    fn dead_letters(
        &self,
        queue: &str,
        limit: usize,
    ) -> impl Future<Output = Result<Vec<DeadLetter>>>;

    /// Pauses (`true`) or resumes (`false`) `queue`: `pause_queue` / `resume_queue`.
    fn pause(&self, queue: &str, on: bool) -> impl Future<Output = Result<bool>>;

    /// Reschedules (`Some`) or deletes (`None`) pending row `id`: `reschedule` /
    /// `delete_pending`.
    fn act(&self, id: i64, schedule: Option<Schedule>) -> impl Future<Output = Result<RowAction>>;
    /// Lists dead letters: `Outbox::dead_letters` or `MemoryStore::dead_letters`.
    fn list_dead_letters(
        &self,
        filter: &DeadLetterFilter,
        after: Option<i64>,
        limit: usize,
    ) -> impl Future<Output = Result<Vec<DeadLetter>>>;

    /// Redrives: `Outbox::redrive_dead_letters` (on a pool connection, its own
    /// transaction) or `MemoryStore::redrive_dead_letters`.
    fn redrive(&self, redrive: &Redrive) -> impl Future<Output = Result<Vec<RedriveOutcome>>>;

    /// Purges: `Outbox::purge_dead_letters` or `MemoryStore::purge_dead_letters`.
    fn purge_dead_letters(
        &self,
        filter: &DeadLetterFilter,
        batch_size: usize,
    ) -> impl Future<Output = Result<u64>>;

    /// Archives `letter` as another writer would (its `id` ignored; the new id returned):
    /// an `INSERT` of SQL of our own, or `MemoryStore::insert_dead_letter`. The way to a
    /// dead letter whose headers are not a string map (`raw_headers`).
    fn insert_dead_letter(&self, letter: DeadLetter) -> impl Future<Output = i64>;

    /// Releases what the harness holds (the Postgres schema).
    fn finish(self) -> impl Future<Output = ()>;
}

/// [`MemoryStore`] starting at [`start`].
#[derive(Debug, Clone)]
pub struct MemHarness {
    /// The store.
    pub store: MemoryStore,
}

impl Harness for MemHarness {
    type S = MemoryStore;
    const NAME: &'static str = "memory";

    async fn new(dead_letter: bool) -> Self {
        MemHarness {
            store: MemoryStore::starting_at(start()).with_dead_letter(dead_letter),
        }
    }

    fn store(&self) -> &MemoryStore {
        &self.store
    }

    async fn advance(&self, by: Duration) {
        self.store.advance(by);
    }

    async fn publish_batch(
        &self,
        queue: &str,
        items: &[BatchItem<'_>],
        schedule: Schedule,
    ) -> Result<Vec<i64>> {
        self.store.publish_batch(queue, items, schedule)
    }

    async fn extend_typed<T: Timer>(
        &self,
        timer_id: &str,
        payload: &T,
        schedule: Schedule,
    ) -> Result<Published> {
        outbox::message::extend_timer(&self.store, timer_id, payload, schedule).await
    }

    async fn publish_typed<T: Timer>(
        &self,
        timer_id: &str,
        payload: &T,
        schedule: Schedule,
    ) -> Result<Published> {
        outbox::message::publish_timer(&self.store, timer_id, payload, schedule).await
    }

    async fn cancel_typed<T: Timer>(&self, timer_id: &str) -> Result<Cancelled> {
        outbox::message::cancel_timer::<T>(&self.store, timer_id).await
    }

    async fn publish(&self, message: Message<'_>) -> Result<Published> {
        self.store.publish_message(message).await
    }

    async fn cancel(&self, queue: &str, timer_id: &str) -> Result<Cancelled> {
        self.store.cancel_timer(queue, timer_id).await
    }

    async fn pending(&self, queue: &str, limit: usize) -> Result<Vec<StoredRow>> {
        self.store.pending(queue, limit)
    }

    async fn dead_letters(&self, queue: &str, limit: usize) -> Result<Vec<DeadLetter>> {
        let filter = DeadLetterFilter::new().queue(queue);
        if self.store.dead_letter_enabled() {
            return self.store.dead_letters(&filter, None, limit);
        }
        refused(self.store.dead_letters(&filter, None, limit));
        let archived = self.store.dead_letter_rows().into_iter();
        assert_eq!(
            archived.filter(|d| d.queue == queue).count(),
            0,
            "memory: archived with the dead-letter queue off"
        );
        Ok(Vec::new())
    }

    async fn list_dead_letters(
        &self,
        filter: &DeadLetterFilter,
        after: Option<i64>,
        limit: usize,
    ) -> Result<Vec<DeadLetter>> {
        self.store.dead_letters(filter, after, limit)
    }

    async fn redrive(&self, redrive: &Redrive) -> Result<Vec<RedriveOutcome>> {
        self.store.redrive_dead_letters(redrive)
    }

    async fn purge_dead_letters(
        &self,
        filter: &DeadLetterFilter,
        batch_size: usize,
    ) -> Result<u64> {
        self.store.purge_dead_letters(filter, batch_size)
    }

    async fn insert_dead_letter(&self, letter: DeadLetter) -> i64 {
        self.store.insert_dead_letter(letter)
    }

    async fn pause(&self, queue: &str, on: bool) -> Result<bool> {
        if on {
            self.store.pause_queue(queue)
        } else {
            self.store.resume_queue(queue)
        }
    }

    async fn act(&self, id: i64, schedule: Option<Schedule>) -> Result<RowAction> {
        match schedule {
            Some(s) => self.store.reschedule(id, s),
            None => self.store.delete_pending(id),
        }
    }

    async fn finish(self) {}
}

/// [`PgStore`] on its own schema and frozen clock (see the module docs).
#[derive(Debug)]
pub struct PgHarness {
    /// Connections whose `now()` is the test's clock.
    pub pool: PgPool,
    /// The test's tables.
    pub outbox: Outbox,
    /// The store under test.
    pub store: PgStore,
    schema: String,
    /// On a Citus cluster, one connection to each worker node: their clocks.
    workers: Vec<PgPool>,
}

/// A pool of one connection to `url`, statements unlogged.
async fn node(url: &str) -> PgPool {
    let opts = url
        .parse::<PgConnectOptions>()
        .expect("a Postgres URL")
        .disable_statement_logging();
    PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(opts)
        .await
        .unwrap_or_else(|e| panic!("connect to {url}: {e}"))
}

/// The clock table and the `now()` that reads it, in `schema` (which exists), reading
/// [`start`]. On a Citus node DDL propagation is off: each node gets its own.
async fn create_clock(pool: &PgPool, schema: &str) {
    let setup = format!(
        "SET citus.enable_ddl_propagation = off;\
         CREATE TABLE \"{schema}\".clock (t timestamptz NOT NULL);\
         CREATE FUNCTION \"{schema}\".now() RETURNS timestamptz LANGUAGE sql STABLE \
           AS 'SELECT t FROM \"{schema}\".clock';\
         RESET citus.enable_ddl_propagation;"
    );
    let setup = if crate::citus() {
        setup
    } else {
        // A plain Postgres has no such setting.
        setup
            .replace("SET citus.enable_ddl_propagation = off;", "")
            .replace("RESET citus.enable_ddl_propagation;", "")
    };
    sqlx::raw_sql(AssertSqlSafe(setup))
        .execute(pool)
        .await
        .expect("create the clock");
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO \"{schema}\".clock VALUES ($1)"
    )))
    .bind(start())
    .execute(pool)
    .await
    .expect("set the clock");
}

impl PgHarness {
    /// The quoted schema holding the clock and the tables.
    pub fn schema(&self) -> String {
        format!("\"{}\"", self.schema)
    }

    /// Empties the tables and sets the clock back to [`start`]: ids count from 1 again.
    ///
    /// On a Citus cluster the ids come from sequences that are the columns' defaults, not
    /// identities, so `RESTART IDENTITY` leaves them alone: `setval` on the coordinator
    /// (where publishes and the archive take their ids) restarts them, and every node's
    /// clock is set back.
    pub async fn reset(&self) {
        let clock = format!(
            "UPDATE {}.clock SET t = '{}'",
            self.schema(),
            start().to_rfc3339()
        );
        let mut sql = format!(
            "TRUNCATE {}, {} RESTART IDENTITY; {clock}",
            self.outbox.table(),
            self.outbox.dead_letter_table(),
        );
        if crate::citus() {
            for table in ["outbox", "outbox_dlq"] {
                let seq = format!("{}.\"{table}_id_seq\"", self.schema()).replace('\'', "''");
                sql.push_str(&format!("; SELECT setval('{seq}', 1, false)"));
            }
        }
        sqlx::raw_sql(AssertSqlSafe(sql))
            .execute(&self.pool)
            .await
            .expect("reset");
        for pool in &self.workers {
            sqlx::raw_sql(AssertSqlSafe(clock.clone()))
                .execute(pool)
                .await
                .expect("reset a worker node's clock");
        }
    }
}

/// A dead-letter call on a store with the dead-letter queue off must refuse before any SQL.
fn refused<T: std::fmt::Debug>(got: Result<T>) {
    match got {
        Err(Error::DeadLetterDisabled) => {}
        other => panic!("expected DeadLetterDisabled, got {other:?}"),
    }
}

fn interval(d: Duration) -> PgInterval {
    PgInterval {
        months: 0,
        days: 0,
        microseconds: i64::try_from(d.as_micros())
            .expect("a test duration fits in i64 microseconds"),
    }
}

impl Harness for PgHarness {
    type S = PgStore;
    const NAME: &'static str = "postgres";

    async fn new(dead_letter: bool) -> Self {
        let schema = unique_table("clk");
        let admin = crate::pool_with(1).await;
        // On Citus the schema is propagated to the workers (a distributed object).
        sqlx::raw_sql(AssertSqlSafe(format!("CREATE SCHEMA \"{schema}\"")))
            .execute(&admin)
            .await
            .expect("create the clock schema");
        let mut workers = Vec::new();
        for url in crate::citus_workers() {
            let w = node(&url).await;
            sqlx::raw_sql(AssertSqlSafe(format!(
                "SET citus.enable_ddl_propagation = off;\
                 CREATE SCHEMA IF NOT EXISTS \"{schema}\";"
            )))
            .execute(&w)
            .await
            .expect("the clock schema on a worker");
            create_clock(&w, &schema).await;
            workers.push(w);
        }
        create_clock(&admin, &schema).await;
        admin.close().await;

        let url = database_url();
        let opts = url
            .parse::<PgConnectOptions>()
            .expect("DATABASE_URL is a Postgres URL")
            .options([("search_path", format!("{schema},pg_catalog,public"))])
            .disable_statement_logging();
        let pool = PgPoolOptions::new()
            .max_connections(4)
            .acquire_timeout(Duration::from_secs(30))
            .connect_with(opts)
            .await
            .expect("connect to Postgres");
        let now: DateTime<Utc> = sqlx::query_scalar("SELECT now()")
            .fetch_one(&pool)
            .await
            .expect("now()");
        assert_eq!(now, start(), "now() must resolve to the test's clock");

        let builder = if crate::citus() {
            Outbox::builder().distributed(1)
        } else {
            Outbox::builder()
        };
        let outbox = builder
            .schema(schema.clone())
            .table("outbox")
            .dead_letter(dead_letter)
            .build()
            .expect("valid names");
        outbox.migrate(&pool).await.expect("migrations apply");
        let store = PgStore::new(pool.clone(), outbox.clone());
        PgHarness {
            pool,
            outbox,
            store,
            schema,
            workers,
        }
    }

    fn store(&self) -> &PgStore {
        &self.store
    }

    fn ids_from_one_sequence(&self) -> bool {
        !crate::citus()
    }

    async fn advance(&self, by: Duration) {
        let sql = format!("UPDATE {}.clock SET t = t + $1", self.schema());
        for pool in std::iter::once(&self.pool).chain(&self.workers) {
            sqlx::query(AssertSqlSafe(sql.clone()))
                .bind(interval(by))
                .execute(pool)
                .await
                .expect("advance the clock");
        }
    }

    async fn publish_batch(
        &self,
        queue: &str,
        items: &[BatchItem<'_>],
        schedule: Schedule,
    ) -> Result<Vec<i64>> {
        let mut conn = self.pool.acquire().await?;
        self.outbox
            .publish_batch(&mut conn, queue, items, schedule)
            .await
    }

    async fn extend_typed<T: Timer>(
        &self,
        timer_id: &str,
        payload: &T,
        schedule: Schedule,
    ) -> Result<Published> {
        let mut conn = self.pool.acquire().await?;
        outbox::message::extend_timer(self.outbox.on(&mut conn), timer_id, payload, schedule).await
    }

    async fn publish_typed<T: Timer>(
        &self,
        timer_id: &str,
        payload: &T,
        schedule: Schedule,
    ) -> Result<Published> {
        let mut conn = self.pool.acquire().await?;
        outbox::message::publish_timer(self.outbox.on(&mut conn), timer_id, payload, schedule).await
    }

    async fn cancel_typed<T: Timer>(&self, timer_id: &str) -> Result<Cancelled> {
        let mut conn = self.pool.acquire().await?;
        outbox::message::cancel_timer::<T>(self.outbox.on(&mut conn), timer_id).await
    }

    async fn publish(&self, message: Message<'_>) -> Result<Published> {
        self.store.publish_message(message).await
    }

    async fn cancel(&self, queue: &str, timer_id: &str) -> Result<Cancelled> {
        self.store.cancel_timer(queue, timer_id).await
    }

    async fn pending(&self, queue: &str, limit: usize) -> Result<Vec<StoredRow>> {
        self.store.pending(queue, limit).await
    }

    async fn dead_letters(&self, queue: &str, limit: usize) -> Result<Vec<DeadLetter>> {
        let filter = DeadLetterFilter::new().queue(queue);
        if self.store.dead_letter_enabled() {
            return self.store.dead_letters(&filter, None, limit).await;
        }
        refused(self.store.dead_letters(&filter, None, limit).await);
        let archived: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM {} WHERE queue = $1",
            self.outbox.dead_letter_table()
        )))
        .bind(queue)
        .fetch_one(&self.pool)
        .await
        .expect("count dead letters");
        assert_eq!(
            archived, 0,
            "postgres: archived with the dead-letter queue off"
        );
        Ok(Vec::new())
    }

    async fn list_dead_letters(
        &self,
        filter: &DeadLetterFilter,
        after: Option<i64>,
        limit: usize,
    ) -> Result<Vec<DeadLetter>> {
        let mut conn = self.pool.acquire().await?;
        self.outbox
            .dead_letters(&mut conn, filter, after, limit)
            .await
    }

    async fn redrive(&self, redrive: &Redrive) -> Result<Vec<RedriveOutcome>> {
        let mut conn = self.pool.acquire().await?;
        self.outbox.redrive_dead_letters(&mut conn, redrive).await
    }

    async fn purge_dead_letters(
        &self,
        filter: &DeadLetterFilter,
        batch_size: usize,
    ) -> Result<u64> {
        self.outbox
            .purge_dead_letters(&self.pool, filter, batch_size)
            .await
    }

    async fn insert_dead_letter(&self, d: DeadLetter) -> i64 {
        // Raw headers go in as the JSON they are, so the row holds what a foreign writer
        // stored.
        let headers: Option<Json<serde_json::Value>> = match (&d.raw_headers, &d.headers) {
            (Some(raw), _) => Some(Json(
                serde_json::from_str(raw).expect("raw headers are JSON"),
            )),
            (None, Some(h)) => Some(Json(serde_json::to_value(h).expect("headers encode"))),
            (None, None) => None,
        };
        // A distributed table needs the bucket (`PgHarness::new`: one bucket).
        let (bucket, at_bucket) = if crate::citus() {
            ("bucket, ", "0, ")
        } else {
            ("", "")
        };
        sqlx::query_scalar(AssertSqlSafe(format!(
            "INSERT INTO {} ({bucket}original_id, queue, payload, headers, timer_id, \
               attempts_count, deliveries_count, created_at, failed_at, failure_reason, \
               last_error, redriven_at, redriven_id) \
             VALUES ({at_bucket}$1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13) \
             RETURNING id",
            self.outbox.dead_letter_table()
        )))
        .bind(d.original_id)
        .bind(&d.queue)
        .bind(&d.payload)
        .bind(headers)
        .bind(&d.timer_id)
        .bind(d.attempts_count)
        .bind(d.deliveries_count)
        .bind(d.created_at)
        .bind(d.failed_at)
        .bind(&d.failure_reason)
        .bind(&d.last_error)
        .bind(d.redriven_at)
        .bind(d.redriven_id)
        .fetch_one(&self.pool)
        .await
        .expect("insert a dead letter")
    }

    async fn pause(&self, queue: &str, on: bool) -> Result<bool> {
        let mut conn = self.pool.acquire().await?;
        let outbox = self.store.outbox();
        if on {
            outbox.pause_queue(&mut conn, queue).await
        } else {
            outbox.resume_queue(&mut conn, queue).await
        }
    }

    async fn act(&self, id: i64, schedule: Option<Schedule>) -> Result<RowAction> {
        let mut conn = self.pool.acquire().await?;
        let outbox = self.store.outbox();
        match schedule {
            Some(s) => outbox.reschedule(&mut conn, id, s).await,
            None => outbox.delete_pending(&mut conn, id).await,
        }
    }

    async fn finish(self) {
        self.pool.close().await;
        let admin = crate::pool_with(1).await;
        sqlx::raw_sql(AssertSqlSafe(format!(
            "DROP SCHEMA IF EXISTS \"{}\" CASCADE",
            self.schema
        )))
        .execute(&admin)
        .await
        .expect("drop the test schema");
        admin.close().await;
        for w in self.workers {
            sqlx::raw_sql(AssertSqlSafe(format!(
                "SET citus.enable_ddl_propagation = off;\
                 DROP SCHEMA IF EXISTS \"{}\" CASCADE",
                self.schema
            )))
            .execute(&w)
            .await
            .expect("drop the test schema on a worker");
            w.close().await;
        }
    }
}
