//! The [`Outbox`] handle: the configured names, every statement rendered once for them,
//! and the operations that run on the caller's own connection or pool (publish, cancel,
//! read, dead letters, migrate, validate). The modules that do the work take the rendered
//! statements, not the handle, so nothing below this file imports it. [`Outbox::on`] is
//! the typed layer's (`message/typed.rs`, above this file: its [`Bound`] holds the handle).
//!
//! [`Bound`]: crate::message::Bound

use std::sync::{Arc, OnceLock};

use sqlx::{PgConnection, PgPool};

use crate::admin::{PausedQueue, RowAction};
use crate::bucket::Buckets;
use crate::cancel::Cancelled;
use crate::dlq::{DeadLetterFilter, Redrive, RedriveOutcome};
use crate::error::{Error, Result};
use crate::message::envelope::{Message, Published};
use crate::message::{BatchItem, Schedule};
use crate::names::Names;
use crate::schema::migrate::{AppliedMigration, MigrateOptions, MigrationStep};
use crate::schema::shape::DEFAULT_TABLE;
use crate::scope::Scope;
use crate::sql::Statements;
use crate::stats::{QueueStats, StatsRequest};
use crate::store::{DeadLetter, StoredRow};

/// A configured outbox: which schema, table and dead-letter table to use, with every SQL
/// statement rendered once for those names.
///
/// Cheap to clone (an `Arc`). Build one with [`Outbox::builder`] or take the defaults with
/// [`Outbox::default`] (table `outbox`, dead-letter table `outbox_dlq`, both in the
/// connection's `search_path`, dead-letter queue off).
///
/// ```
/// let outbox = outbox::Outbox::builder()
///     .schema("jobs")
///     .table("Presence Timers")
///     .dead_letter(true)
///     .build()?;
/// # Ok::<(), outbox::Error>(())
/// ```
#[derive(Clone)]
pub struct Outbox {
    inner: Arc<Inner>,
}

struct Inner {
    names: Names,
    dead_letter: bool,
    scope: Scope,
    sql: Statements,
    /// The next round-robin bucket of a plain message without a shard key.
    round_robin: std::sync::atomic::AtomicU32,
}

impl std::fmt::Debug for Outbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outbox")
            .field("table", &self.inner.names.qtable)
            .field("dead_letter_table", &self.inner.names.qdlq)
            .field("dead_letter", &self.inner.dead_letter)
            .field("transaction_pooler", &self.transaction_pooler())
            .finish()
    }
}

impl Default for Outbox {
    fn default() -> Self {
        // The defaults are valid names, so this cannot fail; a test keeps it that way.
        OutboxBuilder::default()
            .build()
            .expect("the default outbox names are valid")
    }
}

/// The global outbox, and whether `set_global` (rather than `global()`'s default) put it
/// there: what a later `set_global`'s error says.
static GLOBAL: OnceLock<(Outbox, bool)> = OnceLock::new();

impl Outbox {
    /// Starts a configuration with the defaults: table `outbox`, dead-letter table
    /// `<table>_dlq`, the connection's `search_path`, dead-letter queue off, notifications
    /// on.
    pub fn builder() -> OutboxBuilder {
        OutboxBuilder::default()
    }

    /// The outbox used by the functions `#[timer]` generates when they are handed a plain
    /// connection, transaction or pool: the one given to [`Outbox::set_global`], or
    /// [`Outbox::default`] if none was.
    ///
    /// The first call fixes the global outbox for the life of the process: when
    /// `set_global` has not run yet, it installs [`Outbox::default`], and every later
    /// `set_global` fails with [`Error::GlobalAlreadySet`](crate::Error::GlobalAlreadySet).
    /// Call `set_global` before anything calls this (before the first publish through a
    /// generated function).
    pub fn global() -> &'static Outbox {
        &GLOBAL.get_or_init(|| (Outbox::default(), false)).0
    }

    /// Makes this outbox the process-wide one (see [`Outbox::global`]). Call it once, at
    /// start-up, before the first publish.
    ///
    /// # Errors
    /// [`Error::GlobalAlreadySet`](crate::Error::GlobalAlreadySet) when the global outbox is
    /// already fixed: by an earlier `set_global`, or by a call of [`Outbox::global`] (made
    /// by the functions `#[timer]` generates when handed a plain connection, transaction or
    /// pool), which installs [`Outbox::default`] for good. The error's reason says which;
    /// the global outbox stays the one in place and this one is dropped.
    pub fn set_global(self) -> Result<()> {
        GLOBAL.set((self, true)).map_err(|_| {
            let by_call = GLOBAL.get().is_some_and(|(_, by_call)| *by_call);
            let reason = if by_call {
                "`Outbox::set_global` was called before"
            } else {
                "`Outbox::global()` was called first and installed the default outbox"
            };
            Error::GlobalAlreadySet { reason }
        })
    }

    /// The quoted, schema-qualified queue table, as it appears in SQL text.
    pub fn table(&self) -> &str {
        &self.inner.names.qtable
    }

    /// The quoted, schema-qualified dead-letter table, as it appears in SQL text.
    pub fn dead_letter_table(&self) -> &str {
        &self.inner.names.qdlq
    }

    /// The quoted, schema-qualified table where [`Outbox::migrate`] records the steps it
    /// applied (`<table>_schema_migrations`), as it appears in SQL text.
    pub fn migrations_table(&self) -> &str {
        &self.inner.names.qversions
    }

    /// The quoted, schema-qualified table of paused queues (`<table>_paused`, see
    /// [`Outbox::pause_queue`]), as it appears in SQL text.
    pub fn paused_table(&self) -> &str {
        &self.inner.names.qpaused
    }

    /// Whether terminal failures are archived to the dead-letter table.
    pub fn dead_letter_enabled(&self) -> bool {
        self.inner.dead_letter
    }

    /// Whether its statements notify [`Outbox::channel`] (see [`OutboxBuilder::notify`]).
    pub fn notifies(&self) -> bool {
        self.inner.names.notify
    }

    /// The channel workers `LISTEN` on and publishes notify: `<table>_wakeup`
    /// (`<schema>.<table>_wakeup` with an explicit schema). A notification's payload is
    /// `<deadline as epoch milliseconds>:<queue>`, never payload data.
    pub fn channel(&self) -> &str {
        &self.inner.names.channel
    }

    /// The claim statement's SQL text, for operators who want to `EXPLAIN` it. Parameters:
    /// `$1 text[]` queues, `$2 bigint` limit, `$3 interval` lease TTL, `$4 uuid` token,
    /// `$5 bigint[]` ids never to claim (usually empty), `$6 bigint[]` the most rows of each
    /// queue, parallel to `$1` (the limit for each, unless a handler's `max_concurrency`
    /// says less); in [distributed](OutboxBuilder::distributed) mode `$7 smallint` the one
    /// bucket it claims in.
    pub fn claim_sql(&self) -> &str {
        self.inner.sql.claim.claim.as_str()
    }

    /// Whether it was built for a transaction-mode pooler (see
    /// [`OutboxBuilder::transaction_pooler`]).
    pub fn transaction_pooler(&self) -> bool {
        self.inner.scope == Scope::Transaction
    }

    /// The bucket count of a [distributed](OutboxBuilder::distributed) outbox; `None` for a
    /// single node.
    pub fn buckets(&self) -> Option<u16> {
        self.inner.names.buckets.map(Buckets::count)
    }

    /// The bucket a key's rows live in, in a [distributed](OutboxBuilder::distributed)
    /// outbox: 32-bit FNV-1a of the key's UTF-8 bytes modulo the bucket count (a keyed
    /// timer's key is its `timer_id`). Store it in the `bucket` column of the application's
    /// co-located rows of the same entity. `None` for a single node.
    pub fn bucket_of(&self, key: &str) -> Option<i16> {
        self.inner.names.buckets.map(|b| b.of_key(key))
    }

    /// The bucket of a new row: its timer key's, else its shard key's, else the next in
    /// round robin. `None` for a single node.
    pub(crate) fn bucket_for(
        &self,
        timer_id: Option<&str>,
        shard_key: Option<&str>,
    ) -> Option<i16> {
        let b = self.inner.names.buckets?;
        Some(match timer_id.or(shard_key) {
            Some(key) => b.of_key(key),
            None => {
                let next = self
                    .inner
                    .round_robin
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                (next % u32::from(b.count())) as i16
            }
        })
    }

    /// The bucket of a row id in a distributed outbox.
    pub(crate) fn bucket_of_id(&self, id: i64) -> Option<i16> {
        self.inner.names.buckets.map(|b| b.of_id(id))
    }

    pub(crate) fn sql(&self) -> &Statements {
        &self.inner.sql
    }

    pub(crate) fn scope(&self) -> Scope {
        self.inner.scope
    }

    pub(crate) fn names(&self) -> &Names {
        &self.inner.names
    }

    /// Publishes one message on the caller's connection or transaction, in one statement.
    /// The library never begins, commits or rolls back your transaction.
    ///
    /// Pass a transaction as `&mut *tx`: the row and its wake-up notification exist only if
    /// that transaction commits (Postgres delivers a `NOTIFY` only at commit). A relative
    /// [`Schedule`] is computed by the database as `now() + delay`, and `now()` is the
    /// start of your transaction: a message published "now" in a long transaction is due
    /// from its start, and visible to workers once it commits.
    ///
    /// Pass a connection that is in no transaction (`&mut *pool.acquire().await?`) when the
    /// message is all there is to commit: Postgres runs the one statement as a transaction
    /// of its own and commits it before it answers (durably, as the server's
    /// `synchronous_commit` says). That is one round trip, where `BEGIN`, the publish and
    /// `COMMIT` are three (an `Outbox` built for a transaction-mode pooler wraps it in a short
    /// transaction instead: [`OutboxBuilder::transaction_pooler`]).
    ///
    /// With [`OnConflict::Extend`](crate::message::OnConflict::Extend) on a live timer: a pending
    /// row's deadline moves later (payload and headers replaced, retry history reset); a
    /// running row gets a rearm that makes it fire again at the new deadline once its run
    /// ends; a deadline that is not later changes nothing. See [`Published`] for each
    /// outcome.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for input that breaks a
    /// rule of [`Message`] (nothing is sent to the database);
    /// [`Error::UpgradeRequired`](crate::Error::UpgradeRequired) if the table predates the
    /// rearm upgrade and the call extends; [`Error::ReadOnly`](crate::Error::ReadOnly) on a
    /// standby (or a read-only transaction); [`Error::Database`](crate::Error::Database)
    /// otherwise.
    pub async fn publish(
        &self,
        conn: &mut PgConnection,
        message: Message<'_>,
    ) -> Result<Published> {
        let bucket = self.bucket_for(message.timer_id, message.shard_key);
        crate::publish::publish(
            &self.inner.sql.publish,
            self.inner.scope,
            conn,
            message,
            bucket,
        )
        .await
    }

    /// Publishes many messages to one queue in **one statement**: all rows are inserted or
    /// none is. Timer ids are not allowed in a batch. Returns the new ids in the order of
    /// `items`. An empty batch returns an empty list without touching the database.
    ///
    /// # Errors
    /// As [`Outbox::publish`].
    pub async fn publish_batch(
        &self,
        conn: &mut PgConnection,
        queue: &str,
        items: &[BatchItem<'_>],
        schedule: impl Into<Schedule>,
    ) -> Result<Vec<i64>> {
        let schedule = schedule.into();
        crate::publish::publish_batch(
            &self.inner.sql.publish,
            self.inner.scope,
            conn,
            queue,
            items,
            schedule,
            self.bucket_for(None, None),
        )
        .await
    }

    /// Cancels the timer `(queue, timer_id)` on the caller's connection or transaction: locks
    /// the row (`SELECT … FOR UPDATE`), then deletes a pending row, or marks a running row
    /// cancelled (`cancelled_at`) and drops its queued rearm. A running row is never deleted
    /// here, but however its run ends the row is then deleted: no retry, no rearm, no dead
    /// letter. Locking first means a run cannot finish and apply its rearm between the
    /// cancel's look and its write. Two statements. See [`Cancelled`] for each outcome.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for an empty, over-long
    /// (more than 255 bytes) or NUL-containing queue or timer id, before any SQL runs;
    /// [`Error::InvalidConfig`](crate::Error::InvalidConfig) (knob `distributed`) in
    /// distributed mode when no row matched and the table records another bucket count than
    /// this outbox's (a key's bucket depends on the count);
    /// [`Error::Database`](crate::Error::Database).
    pub async fn cancel(
        &self,
        conn: &mut PgConnection,
        queue: &str,
        timer_id: &str,
    ) -> Result<Cancelled> {
        let cancelled = crate::cancel::cancel(
            &self.inner.sql.cancel,
            self.inner.scope,
            conn,
            queue,
            timer_id,
            self.bucket_for(Some(timer_id), None),
        )
        .await?;
        self.require_table_buckets_if(conn, matches!(cancelled, Cancelled::NotFound))
            .await?;
        Ok(cancelled)
    }

    /// Reads live rows of `queue` without leasing or locking them, pending and leased alike,
    /// ordered by deadline then id, at most `limit`. For operators and tests.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a bad queue name;
    /// [`Error::Database`](crate::Error::Database).
    pub async fn pending(
        &self,
        conn: &mut PgConnection,
        queue: &str,
        limit: usize,
    ) -> Result<Vec<StoredRow>> {
        crate::read::pending(&self.inner.sql.read, self.inner.scope, conn, queue, limit).await
    }

    /// Pauses `queue`: from the next claim on, no worker claims its rows (due rows and
    /// rows whose lease expired alike) until [`Outbox::resume_queue`]; publishing goes on
    /// and what already runs finishes. Returns true when this call paused the queue, false
    /// when it was paused already. Takes effect when the caller's transaction commits. See
    /// [`admin`](crate::admin) for the rules.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a bad queue name;
    /// [`Error::UpgradeRequired`](crate::Error::UpgradeRequired) when the paused-queues
    /// table does not exist yet (run [`Outbox::migrate`]), or
    /// [`Error::NotMigrated`](crate::Error::NotMigrated) when the queue table is missing
    /// too (looked up on `conn` after the failed statement; inside your own transaction,
    /// which that statement aborted, the look-up cannot run and `UpgradeRequired` stands);
    /// [`Error::Database`](crate::Error::Database).
    pub async fn pause_queue(&self, conn: &mut PgConnection, queue: &str) -> Result<bool> {
        crate::admin::pause(
            &self.inner.sql.admin,
            self.inner.scope,
            conn,
            self.table(),
            queue,
        )
        .await
    }

    /// Resumes a paused `queue` and wakes the listening workers (the notification is sent
    /// when the caller's transaction commits). Returns true when this call resumed it, false
    /// when it was not paused.
    ///
    /// # Errors
    /// As [`Outbox::pause_queue`].
    pub async fn resume_queue(&self, conn: &mut PgConnection, queue: &str) -> Result<bool> {
        crate::admin::resume(
            &self.inner.sql.admin,
            self.inner.scope,
            conn,
            self.table(),
            queue,
        )
        .await
    }

    /// The paused queues, by name.
    ///
    /// # Errors
    /// As [`Outbox::pause_queue`] (without the queue name to reject).
    pub async fn paused_queues(&self, conn: &mut PgConnection) -> Result<Vec<PausedQueue>> {
        crate::admin::paused(&self.inner.sql.admin, self.inner.scope, conn, self.table()).await
    }

    /// Makes pending row `id` due now (database clock), keeping its counters and retry
    /// history: [`RowAction::Rescheduled`], or [`RowAction::Leased`] when a worker holds
    /// it, or [`RowAction::NotFound`]. Fenced against a concurrent claim (see
    /// [`admin`](crate::admin)).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for an id below 1;
    /// [`Error::InvalidConfig`](crate::Error::InvalidConfig) (knob `distributed`) in
    /// distributed mode when no row matched and the table records another bucket count than
    /// this outbox's (an id names its bucket only with the table's count);
    /// [`Error::Database`](crate::Error::Database).
    pub async fn run_now(&self, conn: &mut PgConnection, id: i64) -> Result<RowAction> {
        self.reschedule(conn, id, Schedule::now()).await
    }

    /// Moves the deadline of pending row `id` to `schedule`, earlier or later:
    /// [`RowAction::Rescheduled`] with the new deadline, [`RowAction::Leased`] or
    /// [`RowAction::NotFound`]. Fenced against a concurrent claim (see
    /// [`admin`](crate::admin)).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for an id below 1 or a bad
    /// schedule (`field = "schedule"`: a negative or overflowing delay, a time outside
    /// Postgres' range); otherwise as [`Outbox::run_now`].
    pub async fn reschedule(
        &self,
        conn: &mut PgConnection,
        id: i64,
        schedule: impl Into<Schedule>,
    ) -> Result<RowAction> {
        let action = crate::admin::reschedule(
            &self.inner.sql.admin,
            self.inner.scope,
            conn,
            id,
            schedule.into(),
            self.bucket_of_id(id),
        )
        .await?;
        self.not_found_checked(conn, action).await
    }

    /// Deletes pending row `id`: [`RowAction::Deleted`], [`RowAction::Leased`] (a worker
    /// holds it: nothing changed) or [`RowAction::NotFound`]. Fenced against a concurrent
    /// claim (see [`admin`](crate::admin)). To stop a keyed timer whatever its state, use
    /// [`Outbox::cancel`].
    ///
    /// # Errors
    /// As [`Outbox::run_now`].
    pub async fn delete_pending(&self, conn: &mut PgConnection, id: i64) -> Result<RowAction> {
        let action = crate::admin::delete(
            &self.inner.sql.admin,
            self.inner.scope,
            conn,
            id,
            self.bucket_of_id(id),
        )
        .await?;
        self.not_found_checked(conn, action).await
    }

    /// Distributed mode: an action by id that found nothing first checks that this outbox's
    /// bucket count is the table's (a row id names its bucket only with that count), so a
    /// process built with another count is told so instead of "not found".
    async fn not_found_checked(
        &self,
        conn: &mut PgConnection,
        action: RowAction,
    ) -> Result<RowAction> {
        self.require_table_buckets_if(conn, matches!(action, RowAction::NotFound))
            .await?;
        Ok(action)
    }

    /// Distributed mode, when `missing`: [`Error::InvalidConfig`](crate::Error::InvalidConfig)
    /// if the table records another bucket count than this outbox's. A key's bucket, and the
    /// bucket an id names, depend on the count, so a process built with another one looks in
    /// the wrong bucket and finds nothing; one catalog read, only on that path.
    pub(crate) async fn require_table_buckets_if(
        &self,
        conn: &mut PgConnection,
        missing: bool,
    ) -> Result<()> {
        if missing && self.inner.names.buckets.is_some() {
            crate::schema::validate::require_table_buckets(
                conn,
                self.inner.scope,
                &self.inner.names,
            )
            .await?;
        }
        Ok(())
    }

    /// Lists dead letters of `filter` on the caller's connection or transaction, by id
    /// (the archive order), those with an id above `after` (the cursor: the last id of the
    /// previous page; `None` for the first), at most `limit`. A plain `SELECT`: no row
    /// lock, so it never delays a redrive, a purge or a worker. Rules and paging:
    /// [`crate::dlq`].
    ///
    /// # Errors
    /// [`Error::DeadLetterDisabled`](crate::Error::DeadLetterDisabled) with the dead-letter
    /// queue off; [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a filter
    /// that breaks a rule of [`DeadLetterFilter`], both before any SQL runs;
    /// [`Error::Database`](crate::Error::Database).
    pub async fn dead_letters(
        &self,
        conn: &mut PgConnection,
        filter: &DeadLetterFilter,
        after: Option<i64>,
        limit: usize,
    ) -> Result<Vec<DeadLetter>> {
        crate::dlq::require_enabled(self.inner.dead_letter)?;
        crate::dlq::list(
            &self.inner.sql.dlq,
            self.inner.scope,
            conn,
            filter,
            after,
            limit,
        )
        .await
    }

    /// Publishes the dead letters `redrive` selects again, each into its original queue with
    /// its original payload, headers and timer key, fresh counters, due now and the header
    /// [`REDRIVEN_FROM_HEADER`](crate::dlq::REDRIVEN_FROM_HEADER), and marks each
    /// (`redriven_at`, `redriven_id`), in **one statement** on the caller's connection or
    /// transaction (`&mut *tx`): the new rows exist and the dead letters are marked if and
    /// only if that transaction commits. A row is redriven once, even with two redrives at
    /// the same time (the second waits for the first's row locks, then reports
    /// [`RedriveResult::AlreadyRedriven`](crate::dlq::RedriveResult::AlreadyRedriven)). A
    /// row that cannot be redriven (key held by a live row, headers not a string map or
    /// over the limit with the new header) gets its own outcome and stays as it was. The
    /// rules: [`crate::dlq`].
    ///
    /// # Errors
    /// [`Error::DeadLetterDisabled`](crate::Error::DeadLetterDisabled) with the dead-letter
    /// queue off; [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a filter
    /// that breaks a rule, both before any SQL runs;
    /// [`Error::Database`](crate::Error::Database).
    pub async fn redrive_dead_letters(
        &self,
        conn: &mut PgConnection,
        redrive: &Redrive,
    ) -> Result<Vec<RedriveOutcome>> {
        crate::dlq::require_enabled(self.inner.dead_letter)?;
        crate::dlq::redrive(&self.inner.sql.dlq, self.inner.scope, conn, redrive).await
    }

    /// Deletes the dead letters of `filter`, which must bound their age
    /// ([`DeadLetterFilter::failed_before`] or [`DeadLetterFilter::older_than`]), oldest
    /// first, `batch_size` rows per statement, each its own short transaction on a
    /// connection of `pool`, until a batch deletes fewer than `batch_size`. Rows locked by
    /// another transaction (a redrive in progress) are skipped, not waited for. Returns how
    /// many rows it deleted. The rules: [`crate::dlq`].
    ///
    /// # Errors
    /// [`Error::DeadLetterDisabled`](crate::Error::DeadLetterDisabled) with the dead-letter
    /// queue off; [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a filter
    /// that breaks a rule or has no age bound, or a `batch_size` of 0, both before any SQL
    /// runs; [`Error::Database`](crate::Error::Database) (the batches before it stay
    /// deleted).
    pub async fn purge_dead_letters(
        &self,
        pool: &PgPool,
        filter: &DeadLetterFilter,
        batch_size: usize,
    ) -> Result<u64> {
        crate::dlq::require_enabled(self.inner.dead_letter)?;
        crate::dlq::purge(
            &self.inner.sql.dlq,
            self.inner.scope,
            pool,
            filter,
            batch_size,
            self.buckets(),
        )
        .await
    }

    /// Reads how deep and how late each queue is, on the caller's connection, in **one
    /// statement** that takes no row lock: pending, due, leased and expired-lease rows, the
    /// oldest due row's lateness, queued rearms, cancel marks and dead letters, per queue,
    /// sorted by queue name. All time comparisons use the database clock (`now()`). Exact
    /// counts cost O(rows); [`StatsMode::Estimate`](crate::stats::StatsMode::Estimate)
    /// reads the planner's statistics instead. The [`stats`](crate::stats) module says
    /// what each figure counts, in each mode, and what it costs.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a bad queue name or a
    /// zero lease TTL, before any SQL runs;
    /// [`Error::UpgradeRequired`](crate::Error::UpgradeRequired) when the dead-letter
    /// queue is on and its table lacks `redriven_at` (run [`Outbox::migrate`]);
    /// [`Error::Database`](crate::Error::Database).
    pub async fn stats(
        &self,
        conn: &mut PgConnection,
        request: &StatsRequest,
    ) -> Result<Vec<QueueStats>> {
        crate::stats::read(
            &self.inner.sql.stats,
            self.inner.scope,
            self.inner.dead_letter,
            conn,
            request,
        )
        .await
    }

    /// The migration steps for this outbox's names, in order. Each runs in its own
    /// transaction, except those with [`MigrationStep::transaction`] false (a
    /// `CREATE INDEX CONCURRENTLY`, which Postgres refuses inside a transaction block).
    /// Useful for users with their own migration tooling and non-default names.
    pub fn migration_steps(&self) -> Vec<MigrationStep> {
        crate::schema::migrate::steps(&self.inner.sql.ddl)
    }

    /// Brings this outbox's tables to the schema this version needs, safe to call at every
    /// start-up, from several processes at once, on a busy database:
    ///
    /// - a step already applied (by an earlier `migrate()`, or by the statements of
    ///   [`Outbox::migration_steps`] run with another tool) is recognised in the catalog and
    ///   skipped, so on an up-to-date schema this only reads the catalog and takes **no
    ///   exclusive lock** (Postgres' `ALTER TABLE … IF NOT EXISTS` would take one first,
    ///   queue behind any open transaction on the table, and stop every publish and claim
    ///   queued behind it). Printing an index predicate or a CHECK opens the table with an
    ///   ACCESS SHARE lock, the lock of a `SELECT`, which waits behind an ACCESS EXCLUSIVE
    ///   lock another session holds or waits for: that read, too, waits at most
    ///   [`MigrateOptions::lock_timeout`] at a time, within [`MigrateOptions::deadline`];
    /// - a step that must run waits for its table locks at most
    ///   [`MigrateOptions::lock_timeout`] at a time (3 s by default): when that runs out, the
    ///   step is rolled back, so the sessions queued behind it go on, and tried again with
    ///   back-off until [`MigrateOptions::deadline`] (5 min), logging which step waits for
    ///   which sessions;
    /// - a new index on an existing table is built `CONCURRENTLY`, outside a transaction,
    ///   which lets writes go on but waits for every transaction in the database older than
    ///   the build; an INVALID index left by an interrupted build is dropped and built
    ///   again;
    /// - each step runs on its own, on a connection of `pool` (its `after_connect` settings
    ///   apply), serialised against concurrent migrators by an advisory lock that is polled
    ///   within the deadline, and is recorded with its time ([`Outbox::applied_migrations`]);
    /// - indexes and CHECKs are recognised by definition, as [`Outbox::validate_schema`]
    ///   matches them, so renaming one does not make a step run again;
    /// - without the dead-letter queue ([`OutboxBuilder::dead_letter`]), the steps that only
    ///   upgrade the dead-letter table (its redrive columns and `(failed_at)` index) are
    ///   left for the `migrate()` of an outbox that has it on.
    ///
    /// The schema named by [`OutboxBuilder::schema`] must exist. It needs a server session
    /// of its own: run it over a direct connection, not through a transaction-mode pooler.
    ///
    /// # Errors
    /// [`Error::SessionRequired`](crate::Error::SessionRequired) on an outbox built with
    /// [`OutboxBuilder::transaction_pooler`], before any SQL runs;
    /// [`Error::UnsupportedPostgres`](crate::Error::UnsupportedPostgres) when the server is
    /// not PostgreSQL 14 to 18 ([`SUPPORTED_POSTGRES`](crate::schema::SUPPORTED_POSTGRES)),
    /// its first read: nothing ran;
    /// [`Error::MigrationBlocked`](crate::Error::MigrationBlocked) naming the step and the
    /// sessions that held its tables past the deadline;
    /// [`Error::ReadOnly`](crate::Error::ReadOnly) when the server is a standby in recovery
    /// (`pg_is_in_recovery()`, read right after the version: nothing ran);
    /// [`Error::Database`](crate::Error::Database) if a statement fails (for example
    /// missing privileges). The steps already applied stay.
    pub async fn migrate(&self, pool: &PgPool) -> Result<()> {
        self.migrate_with(pool, MigrateOptions::default()).await
    }

    /// [`Outbox::migrate`] with another lock timeout or deadline.
    ///
    /// # Errors
    /// As [`Outbox::migrate`], and
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for options out of range.
    pub async fn migrate_with(&self, pool: &PgPool, options: MigrateOptions) -> Result<()> {
        // SPEC §13: the advisory session lock, the session's lock_timeout and the
        // concurrent index build all need a session a transaction-mode pooler does not keep.
        self.inner.scope.require_session(
            "migrate",
            "an advisory lock and a lock_timeout held on its session, and CREATE INDEX CONCURRENTLY outside a transaction",
        )?;
        let (ddl, names) = (&self.inner.sql.ddl, &self.inner.names);
        crate::schema::migrate::run(
            ddl,
            names,
            self.inner.dead_letter,
            pool,
            usize::MAX,
            options,
        )
        .await?;
        // Distributed mode: tables created earlier with another bucket count, or not
        // distributed at all, are not this outbox's; say so rather than "up to date".
        if names.buckets.is_some() {
            match self.validate_schema(pool).await {
                Err(Error::SchemaMismatch { problems }) => {
                    return Err(Error::InvalidConfig {
                        knob: "distributed",
                        reason: format!(
                            "the tables are not this distributed outbox's and migrate cannot convert them: {}",
                            problems
                                .iter()
                                .map(ToString::to_string)
                                .collect::<Vec<_>>()
                                .join("; ")
                        ),
                    })
                }
                other => other?,
            }
        }
        Ok(())
    }

    /// The migration steps recorded as applied to this outbox's tables, by version: when
    /// `migrate()` applied each, or found it already in place. Empty before the first
    /// `migrate()` of this version (steps applied only through
    /// [`Outbox::migration_steps`] with another tool are recorded by that tool, for example
    /// in sqlx's `_sqlx_migrations`).
    ///
    /// # Errors
    /// [`Error::Database`](crate::Error::Database).
    pub async fn applied_migrations(&self, pool: &PgPool) -> Result<Vec<AppliedMigration>> {
        crate::schema::migrate::applied(
            &self.inner.sql.ddl,
            &self.inner.names,
            self.inner.scope,
            pool,
        )
        .await
    }

    /// Checks the live schema against this version's needs and returns **every** problem at
    /// once: missing tables or columns, wrong types or nullability, missing indexes or ones
    /// with the wrong columns, uniqueness or partial predicate, missing or drifted
    /// `<t>_lease_ck` / `<t>_rearm_ck` (matched by definition, not by name), and
    /// dead-letter table drift when the dead-letter queue is on. What an upgrade step of an
    /// older deployment adds (rearm and cancel-mark columns and CHECKs, the dead-letter
    /// `redriven_at`/`redriven_id` columns and `(failed_at)` index) is flagged
    /// `needs_upgrade`: [`Outbox::migrate`] adds them without blocking the application. An
    /// index left INVALID by an interrupted `CREATE INDEX CONCURRENTLY` is reported as
    /// INVALID: Postgres keeps it up to date on every write but never uses it, and
    /// [`Outbox::migrate`] drops and builds it again.
    ///
    /// The reads run in one transaction. Printing an index predicate or a CHECK opens the
    /// table with an ACCESS SHARE lock, the lock of a `SELECT`: like a `SELECT`, the check
    /// waits behind an ACCESS EXCLUSIVE lock another session holds or waits for, as long as
    /// the session's `lock_timeout` allows (none by default).
    ///
    /// # Errors
    /// [`Error::UnsupportedPostgres`](crate::Error::UnsupportedPostgres) before anything
    /// else when the server is not PostgreSQL 14 to 18;
    /// [`Error::SchemaNotFound`](crate::Error::SchemaNotFound) when the schema named by
    /// [`OutboxBuilder::schema`] does not exist (as `migrate` reports it);
    /// [`Error::SchemaMismatch`](crate::Error::SchemaMismatch) listing the problems;
    /// [`Error::Database`](crate::Error::Database) if the catalog cannot be read.
    pub async fn validate_schema(&self, pool: &PgPool) -> Result<()> {
        crate::schema::validate::validate(
            &self.inner.names,
            self.inner.dead_letter,
            self.inner.scope,
            pool,
        )
        .await
    }
}

/// Builder for [`Outbox`]; see there.
#[derive(Debug, Clone)]
#[must_use = "an OutboxBuilder does nothing until `.build()?`"]
pub struct OutboxBuilder {
    schema: Option<String>,
    table: String,
    dlq_table: Option<String>,
    dead_letter: bool,
    notify: bool,
    transaction_pooler: bool,
    buckets: Option<u16>,
}

impl Default for OutboxBuilder {
    fn default() -> Self {
        OutboxBuilder {
            schema: None,
            table: DEFAULT_TABLE.to_owned(),
            dlq_table: None,
            dead_letter: false,
            notify: true,
            transaction_pooler: false,
            buckets: None,
        }
    }
}

impl OutboxBuilder {
    /// Puts both tables in this schema instead of the connection's `search_path`.
    /// The schema must exist (see [`crate::migrate`]'s notes).
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = Some(schema.into());
        self
    }

    /// The queue table name (default `outbox`). Any characters are allowed: every statement
    /// quotes it, so `"jobs.outbox"` is a table with a dot in its name (use
    /// [`OutboxBuilder::schema`] for a schema). Names derived from it must fit Postgres'
    /// 63-byte identifiers; the longest is the dead-letter index
    /// `<table>_dlq_queue_failed_at_idx`, so in practice the table name holds at most 39
    /// bytes (with the default dead-letter table name).
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// The dead-letter table name (default `<table>_dlq`). Setting it turns the
    /// dead-letter queue on.
    pub fn dead_letter_table(mut self, table: impl Into<String>) -> Self {
        self.dlq_table = Some(table.into());
        self.dead_letter = true;
        self
    }

    /// Turns archiving of terminal failures to the dead-letter table on or off (default off;
    /// the migrations create the table either way, so it can be turned on later). Off, a
    /// terminal failure deletes the row (or applies its queued rearm).
    pub fn dead_letter(mut self, on: bool) -> Self {
        self.dead_letter = on;
        self
    }

    /// Whether publishes, and completions that make a row due again (an applied rearm, a
    /// scheduled retry), wake workers with `NOTIFY` on [`Outbox::channel`] (default on).
    ///
    /// Postgres serialises the commits of all transactions that notified, server-wide, on
    /// one lock held until the commit is flushed, so with many connections publishing at
    /// once notifications cap the commit rate (measured: notifying publishes stopped
    /// scaling at 4–8 connections, while without notifications throughput kept growing to
    /// about twice that; see "Growth curves" in
    /// <https://github.com/outbox-rs/outbox/blob/main/docs/lab-notes/2026-11-30.md>). Off, the
    /// statements are the same without `pg_notify`, and workers find new rows only by what
    /// they already know: the deadlines they read after each claim and their
    /// [`idle_poll`](crate::WorkerBuilder::idle_poll) ceiling (default 30 s). Set
    /// `idle_poll` on the workers to the latency a newly published row may wait, e.g.
    /// 200 ms. A process built with notifications on still notifies (and workers still
    /// `LISTEN`), so the setting belongs to each publishing process.
    pub fn notify(mut self, on: bool) -> Self {
        self.notify = on;
        self
    }

    /// Whether this outbox reaches Postgres through a pooler in **transaction mode**
    /// (PgBouncer `pool_mode = transaction`), which hands each transaction to whichever
    /// server connection is free (default off: a direct connection, or a session-mode
    /// pooler). On, nothing the library runs depends on session state:
    ///
    /// - every statement is sent **unnamed** (sqlx's `persistent(false)`): sqlx otherwise
    ///   prepares each statement under a name cached per client connection, and PgBouncer
    ///   1.18 does not carry the name to the next server connection ("prepared statement
    ///   … does not exist");
    /// - every statement runs **inside a transaction**: in yours when the connection you
    ///   pass is in one begun with sqlx's `begin` (`&mut *tx`), otherwise in a short one of
    ///   its own (an unnamed statement outside a transaction takes two round trips, between
    ///   which the pooler may switch server connections). sqlx does not tell a transaction
    ///   begun by sending `BEGIN` yourself, so the library's own `COMMIT` would end it: begin
    ///   yours with sqlx;
    /// - a worker's completions, lease renewals and releases set their short
    ///   `lock_timeout` with `SET LOCAL` in their transaction, instead of a startup
    ///   parameter of the store's second pool ([`PgStore`](crate::PgStore#connections));
    /// - what needs a session is refused: [`Outbox::migrate`] with
    ///   [`Error::SessionRequired`](crate::Error::SessionRequired) (run it over a direct
    ///   connection), a worker that would `LISTEN` when it is built
    ///   ([`Error::InvalidConfig`](crate::Error::InvalidConfig), knob `listen`: build it
    ///   with [`listen(false)`](crate::WorkerBuilder::listen)).
    ///
    /// The cost: each statement takes two round trips instead of one and is parsed and
    /// planned every time (no cached plan), and one that would commit on its own takes a
    /// `BEGIN` and a `COMMIT` round trip more. Measured on 2 cores on 2026-12-02, on a
    /// direct connection with the knob: publishes in application transactions about a
    /// quarter slower, a worker about half as fast; through PgBouncer a little slower
    /// again ("PgBouncer" in
    /// <https://github.com/outbox-rs/outbox/blob/main/docs/lab-notes/2026-12-02.md>). A
    /// worker that can reach the server directly keeps the default.
    /// What to configure on PgBouncer is in the deployment guide
    /// (<https://github.com/outbox-rs/outbox/blob/main/docs/guide/deployment.md#pgbouncer>).
    pub fn transaction_pooler(mut self, on: bool) -> Self {
        self.transaction_pooler = on;
        self
    }

    /// **Distributed mode**, for a Citus cluster: the queue and dead-letter tables are
    /// distributed tables spread over `buckets` logical buckets (a `bucket smallint` column,
    /// the distribution column), and the table of paused queues is a reference table.
    /// Every completion, lease renewal, release, rearm and cancel names one bucket, so Citus
    /// runs it on the one worker node that holds it, like a single-node statement; a worker
    /// claims bucket by bucket, after one read across the shards for the buckets with work.
    ///
    /// - A keyed timer's bucket is [`Outbox::bucket_of`] its `timer_id`: one live row per
    ///   `(queue, timer_id)` across the cluster. A plain message's bucket is that of its
    ///   [`Message::shard_key`](crate::Message::shard_key), or round robin without one.
    /// - To keep a publish, extend or cancel and the application's own rows of the same
    ///   entity on one node (no two-phase commit), distribute the application's table by a
    ///   `bucket smallint` column holding [`Outbox::bucket_of`] the entity's key, with
    ///   `colocate_with` the queue table (the Citus guide in `docs/guide/citus.md`).
    /// - `buckets` is fixed when the tables are created: every process must build with the
    ///   same count ([`Outbox::validate_schema`] checks it against the table's CHECK). More
    ///   buckets than shards spread the rows evenly over the shards; a worker claims bucket
    ///   by bucket, so more buckets also mean more claim statements when work is spread
    ///   thin. 32–128 suits the default 32 shards.
    ///
    /// Needs Citus 11 or later on the server; [`Outbox::migrate`] creates the tables
    /// distributed. A single-node outbox (the default) is unchanged by this knob's existence.
    /// `buckets` must be in `1..=256` ([`Error::InvalidConfig`](crate::Error::InvalidConfig),
    /// knob `distributed`, from [`build`](Self::build)).
    pub fn distributed(mut self, buckets: u16) -> Self {
        self.buckets = Some(buckets);
        self
    }

    /// Checks the names and renders every statement.
    ///
    /// # Errors
    /// [`Error::InvalidName`](crate::Error::InvalidName) naming the first identifier that
    /// is empty, holds a NUL byte or would exceed 63 bytes (the table name itself, or a
    /// derived index, constraint or channel name such as `<table>_timer_id_uq`).
    pub fn build(self) -> Result<Outbox> {
        let mut names = Names::new(self.schema, self.table, self.dlq_table)?;
        names.notify = self.notify;
        if let Some(count) = self.buckets {
            names.buckets = Some(Buckets::new(count).ok_or_else(|| Error::InvalidConfig {
                knob: "distributed",
                reason: format!(
                    "the bucket count must be in 1..={} (got {count})",
                    crate::bucket::MAX_BUCKETS
                ),
            })?);
        }
        let sql = Statements::render(&names);
        Ok(Outbox {
            inner: Arc::new(Inner {
                names,
                dead_letter: self.dead_letter,
                scope: Scope::new(self.transaction_pooler, self.buckets.is_some()),
                sql,
                round_robin: std::sync::atomic::AtomicU32::new(0),
            }),
        })
    }
}

/// Applies the migrations for the default names ([`Outbox::default`]); see
/// [`Outbox::migrate`].
///
/// # Errors
/// As [`Outbox::migrate`].
pub async fn migrate(pool: &PgPool) -> Result<()> {
    Outbox::default().migrate(pool).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_valid() {
        let o = Outbox::default();
        assert_eq!(o.table(), "\"outbox\"");
        assert_eq!(o.dead_letter_table(), "\"outbox_dlq\"");
        assert_eq!(o.channel(), "outbox_wakeup");
        assert!(!o.dead_letter_enabled());
    }

    #[test]
    fn schema_and_odd_names_are_quoted() {
        let o = Outbox::builder()
            .schema("My Schema")
            .table("Presence \"T\"")
            .build()
            .unwrap();
        assert_eq!(o.table(), "\"My Schema\".\"Presence \"\"T\"\"\"");
        assert_eq!(o.channel(), "My Schema.Presence \"T\"_wakeup");
    }

    #[test]
    fn builder_rejects_bad_names() {
        let t = "t".repeat(55);
        assert!(Outbox::builder().table(t).build().is_err());
        assert!(Outbox::builder().table("").build().is_err());
        assert!(Outbox::builder().schema("a\0b").build().is_err());
    }
}
