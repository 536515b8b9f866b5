//! Migrations: the steps `sql::ddl` renders, run so that they never stop the
//! application.
//!
//! - A step already applied is recognised in the catalog and skipped: on an up-to-date schema
//!   `migrate()` only reads the catalog. Printing an index predicate or a CHECK there opens
//!   the table with an ACCESS SHARE lock (the one a `SELECT` takes), which waits behind an
//!   ACCESS EXCLUSIVE lock held or queued: the read is bounded by `lock_timeout` and the
//!   deadline like a step.
//! - A step that must run holds its table locks under a short `lock_timeout`; when it times
//!   out (a long transaction holds the table), it is rolled back and tried again with
//!   back-off until a total deadline, so other sessions' publishes and claims queue behind it
//!   for at most the lock timeout at a time.
//! - A new index is built `CONCURRENTLY` outside a transaction; an INVALID one left by an
//!   interrupted build is dropped and built again.
//! - Every step applied (or found applied) is recorded in `<table>_schema_migrations`.
//!
//! Users who run their own migration tool get the same scripts from `migration_steps()`
//! (for the default names they are also the files of the project repository's
//! `migrations/` folder, in sqlx's format; a test keeps them identical).

use std::collections::HashSet;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::pool::PoolConnection;
use sqlx::{Executor, PgConnection, PgPool, Postgres, Row};
use tokio::time::Instant;

use super::problem::LockHolder;
use super::shape::{self, LiveCheck, LiveIndex};
use crate::error::{Error, OutboxSql, Result};
use crate::names::Names;
use crate::scope::{Db, Scope};
use crate::sql::catalog;
use crate::sql::ddl::{
    Ddl, Done, Step, Table, ADVISORY_TRY_LOCK, ADVISORY_TRY_SESSION_LOCK, ADVISORY_UNLOCK,
};
use crate::store::connect::explain;

/// One migration step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigrationStep {
    /// sqlx-style version (orders the files).
    pub version: i64,
    /// sqlx-style description, the file name's tail.
    pub description: &'static str,
    /// The SQL (several statements, or one for a step that runs outside a transaction).
    pub sql: String,
    /// Whether the step runs in a transaction of its own (true), or outside any transaction
    /// (false: a `CREATE INDEX CONCURRENTLY`; its file starts with `-- no-transaction`,
    /// which sqlx's migrator honours).
    pub transaction: bool,
}

impl MigrationStep {
    /// The file name sqlx expects: `<version>_<description>.sql`.
    pub fn file_name(&self) -> String {
        format!("{}_{}.sql", self.version, self.description)
    }
}

/// A step recorded as applied ([`crate::Outbox::applied_migrations`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppliedMigration {
    /// The step's version.
    pub version: i64,
    /// The step's description.
    pub description: String,
    /// When `migrate()` applied it, or found it applied (database clock).
    pub applied_at: DateTime<Utc>,
    /// True when `migrate()` found the step already in place (applied by another tool, or
    /// by a version that did not record steps) rather than applying it.
    pub found: bool,
}

/// How `migrate()` waits for the table locks a step needs.
///
/// ```
/// use std::time::Duration;
/// let options = outbox::schema::MigrateOptions::default()
///     .lock_timeout(Duration::from_secs(2))
///     .deadline(Duration::from_secs(60));
/// # let _ = options;
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use = "MigrateOptions apply only once given to `Outbox::migrate_with`"]
pub struct MigrateOptions {
    lock_timeout: Duration,
    deadline: Duration,
}

impl Default for MigrateOptions {
    fn default() -> Self {
        MigrateOptions {
            lock_timeout: Duration::from_secs(3),
            deadline: Duration::from_secs(300),
        }
    }
}

impl MigrateOptions {
    /// The longest one try of a step waits for a table lock (default 3 s, range
    /// 10 ms..=10 min). While a step waits, other sessions' statements on that table queue
    /// behind it, so keep it short; a step that times out is rolled back and tried again.
    pub fn lock_timeout(mut self, timeout: Duration) -> Self {
        self.lock_timeout = timeout;
        self
    }

    /// How long `migrate()` keeps trying a step whose locks are taken (default 5 min, range
    /// 0..=24 h). Past it, [`Error::MigrationBlocked`] names the step and the sessions that
    /// hold the table.
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = deadline;
        self
    }

    fn validate(&self) -> Result<()> {
        if self.lock_timeout < Duration::from_millis(10)
            || self.lock_timeout > Duration::from_secs(600)
        {
            return Err(Error::invalid(
                "lock_timeout",
                format!("must be within 10ms..=10 min, got {:?}", self.lock_timeout),
            ));
        }
        if self.deadline > Duration::from_secs(24 * 3600) {
            return Err(Error::invalid(
                "deadline",
                format!("must be at most 24 h, got {:?}", self.deadline),
            ));
        }
        Ok(())
    }
}

/// The public view of the rendered steps.
pub(crate) fn steps(ddl: &Ddl) -> Vec<MigrationStep> {
    ddl.steps
        .iter()
        .map(|s| MigrationStep {
            version: s.version,
            description: s.description,
            sql: s.script.as_str().to_owned(),
            transaction: s.transaction,
        })
        .collect()
}

/// What the catalog says about one table.
#[derive(Debug, Default)]
struct TableFacts {
    oid: Option<i64>,
    columns: HashSet<String>,
    /// The storage parameters the table sets (names only).
    parameters: HashSet<String>,
    indexes: Vec<LiveIndex>,
    checks: Vec<LiveCheck>,
}

/// What the catalog says about the outbox's tables. Reading it takes the ACCESS SHARE lock
/// of printing their index predicates and CHECKs, nothing stronger.
#[derive(Debug, Default)]
struct Facts {
    queue: TableFacts,
    dlq: TableFacts,
    paused: TableFacts,
    versions: bool,
}

impl Facts {
    /// Reads on `db` (inside a step's transaction, on that transaction's connection: a pool
    /// of one connection must not wait for a second).
    async fn read(db: &mut PgConnection, n: &Names) -> Result<Facts> {
        Ok(Facts {
            queue: table_facts(db, &n.qtable).await?,
            dlq: table_facts(db, &n.qdlq).await?,
            paused: table_facts(db, &n.qpaused).await?,
            versions: oid(db, &n.qversions).await?.is_some(),
        })
    }

    /// Reads in one transaction of its own (one commit for the dozen catalog reads), bounded
    /// like a step ([`with_retries`]): printing an index predicate or a CHECK opens the table
    /// with an ACCESS SHARE lock (`catalog::INDEXES`), which waits behind an ACCESS
    /// EXCLUSIVE lock another session holds or waits for.
    async fn read_pool(
        pool: &PgPool,
        n: &Names,
        options: MigrateOptions,
        started: Instant,
    ) -> Result<Facts> {
        with_retries(
            pool,
            n,
            "reading the catalog",
            true,
            options,
            started,
            || async {
                let mut db = match Db::begin(pool).await {
                    Ok(db) => db,
                    Err(e) => return Err(explain(pool, e).await),
                };
                set_lock_timeout(&mut db, "SET LOCAL", options).await?;
                let facts = Facts::read(&mut db, n).await?;
                db.done().await?;
                Ok(facts)
            },
        )
        .await
    }

    /// The tables' oids alone, all [`holders`] needs: `to_regclass` takes no lock, so this
    /// never waits, unlike [`Facts::read_pool`].
    async fn oids_only(pool: &PgPool, n: &Names) -> Result<Facts> {
        let mut conn = acquire(pool).await?;
        let table = |oid| TableFacts {
            oid,
            ..TableFacts::default()
        };
        Ok(Facts {
            queue: table(oid(&mut *conn, &n.qtable).await?),
            dlq: table(oid(&mut *conn, &n.qdlq).await?),
            paused: TableFacts::default(),
            versions: false,
        })
    }

    fn table(&self, t: Table) -> &TableFacts {
        match t {
            Table::Queue => &self.queue,
            Table::DeadLetter => &self.dlq,
            Table::Paused => &self.paused,
        }
    }

    fn oids(&self) -> Vec<i64> {
        [self.queue.oid, self.dlq.oid]
            .into_iter()
            .flatten()
            .collect()
    }

    /// Whether the catalog shows `done`. Indexes and CHECKs are matched by definition, as
    /// `validate_schema` matches them (`shape`), so a renamed one still counts.
    fn holds(&self, done: &Done, n: &Names) -> bool {
        let index = |t: &TableFacts, name: &String| {
            wanted_index(n, name).is_some_and(|w| w.present_in(&t.indexes))
        };
        let check =
            |t: &TableFacts, name: &String| wanted_check(n, name).and_then(|w| w.state(&t.checks));
        match done {
            Done::Base {
                queue_indexes,
                dlq_indexes,
                check: lease,
            } => {
                self.queue.oid.is_some()
                    && self.dlq.oid.is_some()
                    && queue_indexes.iter().all(|i| index(&self.queue, i))
                    && dlq_indexes.iter().all(|i| index(&self.dlq, i))
                    && check(&self.queue, lease).is_some()
            }
            Done::ColumnsAndCheck {
                table,
                columns,
                check: name,
            } => {
                let t = self.table(*table);
                columns.iter().all(|c| t.columns.contains(*c)) && check(t, name).is_some()
            }
            Done::Validated { table, check: name } => check(self.table(*table), name) == Some(true),
            Done::Exists { table } => self.table(*table).oid.is_some(),
            Done::Columns { table, columns } => {
                let t = self.table(*table);
                columns.iter().all(|c| t.columns.contains(*c))
            }
            Done::Index { table, name } => index(self.table(*table), name),
            Done::Settings { table, parameters } => {
                let t = self.table(*table);
                parameters.iter().any(|p| t.parameters.contains(*p))
            }
        }
    }
}

fn wanted_index(n: &Names, name: &str) -> Option<shape::WantedIndex> {
    shape::queue_indexes(n)
        .into_iter()
        .chain(shape::dlq_indexes(n))
        .find(|w| w.name == name)
}

fn wanted_check(n: &Names, name: &str) -> Option<shape::WantedCheck> {
    shape::queue_checks(n).into_iter().find(|w| w.name == name)
}

async fn acquire(pool: &PgPool) -> Result<PoolConnection<Postgres>> {
    match pool.acquire().await {
        Ok(c) => Ok(c),
        Err(e) => Err(explain(pool, Error::from_outbox_statement(e)).await),
    }
}

async fn oid(db: impl sqlx::PgExecutor<'_>, qualified: &str) -> Result<Option<i64>> {
    sqlx::query_scalar(catalog::TABLE_OID)
        .bind(qualified)
        .fetch_one(db)
        .await
        .outbox_sql()
}

/// The names a catalog query (`$1` = table oid) returns, one per row.
async fn names_of(db: &mut PgConnection, sql: &'static str, oid: i64) -> Result<HashSet<String>> {
    let names: Vec<String> = sqlx::query_scalar(sql)
        .bind(oid)
        .fetch_all(db)
        .await
        .outbox_sql()?;
    Ok(names.into_iter().collect())
}

async fn table_facts(db: &mut PgConnection, qualified: &str) -> Result<TableFacts> {
    let Some(oid) = oid(&mut *db, qualified).await? else {
        return Ok(TableFacts::default());
    };
    let columns = names_of(&mut *db, catalog::COLUMNS, oid).await?;
    let parameters = names_of(&mut *db, catalog::STORAGE_PARAMETERS, oid).await?;
    Ok(TableFacts {
        oid: Some(oid),
        columns,
        parameters,
        // migrate() runs only on a session (SPEC §13): refused through a pooler.
        indexes: shape::live_indexes(&mut *db, Scope::Session, qualified).await?,
        checks: shape::live_checks(&mut *db, Scope::Session, qualified).await?,
    })
}

/// A standby in recovery takes no DDL and no write to the record of applied steps: say
/// so before reading the catalog, whatever it would show (issue 26).
async fn refuse_standby(pool: &PgPool) -> Result<()> {
    let in_recovery: bool = match sqlx::query_scalar("SELECT pg_is_in_recovery()")
        .fetch_one(pool)
        .await
    {
        Ok(r) => r,
        Err(e) => return Err(explain(pool, Error::from_outbox_statement(e)).await),
    };
    if in_recovery {
        return Err(Error::ReadOnly {
            detail: "pg_is_in_recovery() is true: the server is a standby in recovery".to_owned(),
            source: None,
        });
    }
    Ok(())
}

/// Applies the first `count` steps that the catalog does not show applied; a step the
/// catalog shows applied is skipped without taking its DDL's table locks.
/// Without the dead-letter queue, the steps that only upgrade the dead-letter table are
/// left for the `migrate()` that turns it on.
pub(crate) async fn run(
    ddl: &Ddl,
    names: &Names,
    dead_letter: bool,
    pool: &PgPool,
    count: usize,
    options: MigrateOptions,
) -> Result<()> {
    options.validate()?;
    super::server::require(pool, super::server::SUPPORTED_POSTGRES).await?;
    refuse_standby(pool).await?;
    let started = Instant::now();
    let mut facts = Facts::read_pool(pool, names, options, started).await?;
    refuse_other_layout(names, pool, &facts).await?;
    let mut recorded = recorded_versions(ddl, pool, &facts).await?;
    // Tables this call creates are new: nobody reads them yet, so their indexes need no
    // concurrent build.
    let fresh = facts.queue.oid.is_none() && facts.dlq.oid.is_none();
    for step in ddl.steps.iter().take(count) {
        if !dead_letter && step.dead_letter_only() {
            continue;
        }
        // Settings are applied once: recorded means done, even if an operator reset them.
        let once = matches!(step.done, Done::Settings { .. }) && recorded.contains(&step.version);
        if once || facts.holds(&step.done, names) {
            if !recorded.contains(&step.version) {
                if !facts.versions {
                    create_versions(ddl, names, pool, &mut facts, started, options).await?;
                }
                record(ddl, pool, &facts, step, true).await?;
                recorded.insert(step.version);
            }
            continue;
        }
        if !facts.versions {
            create_versions(ddl, names, pool, &mut facts, started, options).await?;
        }
        apply_with_retries(ddl, names, pool, step, options, fresh, started).await?;
        recorded.insert(step.version);
        facts = Facts::read_pool(pool, names, options, started).await?;
    }
    Ok(())
}

/// A queue table of the other layout is refused before any DDL, with what to do: the
/// single-node and the distributed (Citus) shapes differ in their key, ids and indexes, and
/// neither `migrate()` converts one into the other in place (the guide's "Moving a
/// single-node outbox to Citus" says how to move). Without this, a distributed `migrate()`
/// over a single-node table failed on its first index (`column "bucket" does not exist`),
/// and a single-node one over a distributed table said it was up to date.
async fn refuse_other_layout(n: &Names, pool: &PgPool, facts: &Facts) -> Result<()> {
    if let (Some(b), None) = (n.buckets, facts.queue.oid) {
        // Distributed mode on a database without Citus: said before anything is created
        // (it used to fail on `pg_dist_partition` with a "not migrated" error, leaving the
        // table of applied steps behind).
        let mut conn = acquire(pool).await?;
        let citus: bool = sqlx::query_scalar(catalog::CITUS_INSTALLED)
            .fetch_one(&mut *conn)
            .await
            .outbox_sql()?;
        if !citus {
            return Err(Error::InvalidConfig {
                knob: "distributed",
                reason: format!(
                    "distributed({}) needs the Citus extension in this database (CREATE EXTENSION citus, on the coordinator of a Citus cluster); build the outbox without `distributed` for a single Postgres",
                    b.count()
                ),
            });
        }
    }
    // A table of either name that is not an outbox table (one of the application's, say):
    // the first step would fail on a missing column with a raw database error after
    // creating the table of applied steps, or (the dead-letter table) be indexed and altered
    // and the run reported done (found by a fresh-user trial). Said before any DDL, with
    // every column each lacks.
    let mut foreign = Vec::new();
    if facts.queue.oid.is_some() {
        foreign = super::validate::foreign_columns(n, |c| facts.queue.columns.contains(c));
    }
    if facts.dlq.oid.is_some() {
        foreign.extend(super::validate::foreign_dlq_columns(n, |c| {
            facts.dlq.columns.contains(c)
        }));
    }
    if !foreign.is_empty() {
        return Err(Error::SchemaMismatch { problems: foreign });
    }
    if facts.queue.oid.is_none() {
        return Ok(());
    }
    let has_bucket = facts.queue.columns.contains("bucket");
    let reason = match (n.buckets, has_bucket) {
        (Some(b), false) => format!(
            "{} is a single-node outbox table (no `bucket` column); distributed({}) does not convert it in place: create the distributed outbox under another table name and drain this one (see \"Moving a single-node outbox to Citus\" in the Citus guide)",
            n.qtable,
            b.count()
        ),
        (None, true) => {
            let mut conn = acquire(pool).await?;
            let citus: bool = sqlx::query_scalar(catalog::CITUS_INSTALLED)
                .fetch_one(&mut *conn)
                .await
                .outbox_sql()?;
            let how = if citus {
                "a distributed (Citus) outbox table"
            } else {
                "the distributed (Citus) shape"
            };
            format!(
                "{} is {how} (it has a `bucket` column): build the outbox with `distributed(buckets)`, the table's bucket count (`validate_schema` in that mode names it)",
                n.qtable
            )
        }
        _ => return Ok(()),
    };
    Err(Error::InvalidConfig {
        knob: "distributed",
        reason,
    })
}

async fn recorded_versions(ddl: &Ddl, pool: &PgPool, facts: &Facts) -> Result<HashSet<i64>> {
    if !facts.versions {
        return Ok(HashSet::new());
    }
    sqlx::query(ddl.versions_list.clone())
        .fetch_all(pool)
        .await
        .outbox_sql()?
        .iter()
        .map(|r| r.try_get::<i64, _>(0))
        .collect::<std::result::Result<_, _>>()
        .outbox_sql()
}

/// The table of applied steps: a new table, so creating it locks nothing of the outbox's;
/// under the migrators' advisory lock, because two `CREATE TABLE IF NOT EXISTS` at once can
/// collide on the catalog's unique indexes.
async fn create_versions(
    ddl: &Ddl,
    names: &Names,
    pool: &PgPool,
    facts: &mut Facts,
    started: Instant,
    options: MigrateOptions,
) -> Result<()> {
    let mut tx = begin_locked(names, pool, "schema_migrations", started, options).await?;
    sqlx::query(ddl.versions_create.clone())
        .execute(&mut *tx)
        .await
        .outbox_sql()?;
    tx.commit().await.outbox_sql()?;
    facts.versions = true;
    Ok(())
}

async fn record(
    ddl: &Ddl,
    db: impl sqlx::PgExecutor<'_>,
    facts: &Facts,
    step: &Step,
    found: bool,
) -> Result<()> {
    if !facts.versions {
        return Err(Error::invalid("migrations", "the version table is missing"));
    }
    sqlx::query(ddl.versions_record.clone())
        .bind(step.version)
        .bind(step.description)
        .bind(found)
        .execute(db)
        .await
        .outbox_sql()?;
    Ok(())
}

/// The back-off between tries: 100 ms doubling to 2 s.
fn backoff(attempt: u32) -> Duration {
    Duration::from_millis(100)
        .saturating_mul(1 << attempt.min(5))
        .min(Duration::from_secs(2))
}

/// Runs `step` until it succeeds, retrying lock timeouts (and deadlocks) with back-off until
/// the deadline, counted from the start of `migrate()`.
async fn apply_with_retries(
    ddl: &Ddl,
    names: &Names,
    pool: &PgPool,
    step: &Step,
    options: MigrateOptions,
    fresh: bool,
    started: Instant,
) -> Result<()> {
    let once = || async {
        match (&step.fresh_script, step.transaction) {
            (Some(script), false) if fresh => {
                apply_in_transaction(ddl, names, pool, step, script, options, started).await
            }
            (_, true) => {
                apply_in_transaction(ddl, names, pool, step, &step.script, options, started).await
            }
            (_, false) => apply_concurrently(ddl, names, pool, step, options, started).await,
        }
    };
    let (what, transaction) = (step.description, step.transaction);
    with_retries(pool, names, what, transaction, options, started, once).await
}

/// Tries `once` until it succeeds or fails otherwise than by waiting for other sessions: a
/// lock timeout (or a deadlock) is rolled back, logged with the sessions holding locks on
/// the tables, and tried again after a back-off, until the deadline counted from the start
/// of `migrate()`; then [`Error::MigrationBlocked`] names `step` and those sessions
/// (`transaction`: whether the try ran in a transaction, see [`holders`]).
async fn with_retries<T, F, Fut>(
    pool: &PgPool,
    names: &Names,
    step: &str,
    transaction: bool,
    options: MigrateOptions,
    started: Instant,
    mut once: F,
) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    let mut attempt: u32 = 0;
    loop {
        let e = match once().await {
            Ok(done) => return Ok(done),
            Err(e) if e.is_lock_timeout() || e.sqlstate().as_deref() == Some("40P01") => e,
            Err(e) => return Err(e),
        };
        let holders = holders_of(pool, names, transaction).await;
        let wait = backoff(attempt);
        attempt += 1;
        if started.elapsed() + wait > options.deadline {
            return Err(Error::MigrationBlocked {
                step: step.to_owned(),
                waited: started.elapsed(),
                holders,
            });
        }
        tracing::warn!(
            step,
            attempt,
            error = %e,
            holders = %describe(&holders),
            "outbox: a migration step waits for other sessions; it was rolled back and is tried again"
        );
        tokio::time::sleep(wait).await;
    }
}

fn describe(holders: &[LockHolder]) -> String {
    holders
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Who a step waited for: the sessions holding locks on the outbox's tables or the
/// migrators' advisory lock, and for a concurrent build also those holding a snapshot.
async fn holders(
    pool: &PgPool,
    facts: &Facts,
    transaction: bool,
    names: &Names,
) -> Result<Vec<LockHolder>> {
    let mut rows = sqlx::query(catalog::LOCK_HOLDERS)
        .bind(facts.oids())
        .bind(migrate_key(names))
        .fetch_all(pool)
        .await
        .outbox_sql()?;
    if !transaction {
        rows.extend(
            sqlx::query(catalog::SNAPSHOT_HOLDERS)
                .fetch_all(pool)
                .await
                .outbox_sql()?,
        );
    }
    let mut holders: Vec<LockHolder> = Vec::new();
    for r in rows {
        let pid: i32 = r.try_get(0).outbox_sql()?;
        let mode: String = r.try_get(3).outbox_sql()?;
        if let Some(h) = holders.iter_mut().find(|h| h.pid == pid) {
            if !h.modes.contains(&mode) {
                h.modes.push(mode);
            }
            continue;
        }
        holders.push(LockHolder {
            pid,
            transaction_start: r.try_get(1).outbox_sql()?,
            state: r.try_get(2).outbox_sql()?,
            modes: vec![mode],
        });
    }
    Ok(holders)
}

/// The migrators' advisory lock is taken with `pg_try_advisory_*` and polled, never waited
/// for inside a statement: a statement that waits holds a snapshot, and a
/// `CREATE INDEX CONCURRENTLY` of the migrator holding the lock waits for every older
/// snapshot, so a waiting migrator and the build would wait for each other (Postgres then
/// cancels one of them as a deadlock). Polling also keeps the deadline: past it, the error
/// names the session holding the lock.
struct LockPoll<'a> {
    names: &'a Names,
    pool: &'a PgPool,
    step: &'a str,
    started: Instant,
    options: MigrateOptions,
    wait: Duration,
}

impl<'a> LockPoll<'a> {
    fn new(
        names: &'a Names,
        pool: &'a PgPool,
        step: &'a str,
        started: Instant,
        options: MigrateOptions,
    ) -> Self {
        LockPoll {
            names,
            pool,
            step,
            started,
            options,
            wait: Duration::from_millis(10),
        }
    }

    /// After a try that did not get the lock: sleeps (10 ms doubling to 500 ms), or past
    /// the deadline returns the error naming who holds it.
    async fn again(&mut self) -> Result<()> {
        if self.started.elapsed() + self.wait > self.options.deadline {
            return Err(Error::MigrationBlocked {
                step: self.step.to_owned(),
                waited: self.started.elapsed(),
                holders: holders_of(self.pool, self.names, true).await,
            });
        }
        tokio::time::sleep(self.wait).await;
        self.wait = (self.wait * 2).min(Duration::from_millis(500));
        Ok(())
    }
}

/// A transaction holding the migrators' advisory lock (released at its end).
async fn begin_locked(
    names: &Names,
    pool: &PgPool,
    step: &str,
    started: Instant,
    options: MigrateOptions,
) -> Result<sqlx::Transaction<'static, Postgres>> {
    let key = migrate_key(names);
    let mut poll = LockPoll::new(names, pool, step, started, options);
    loop {
        let mut tx = match pool.begin().await {
            Ok(tx) => tx,
            Err(e) => return Err(explain(pool, Error::from_outbox_statement(e)).await),
        };
        let got: bool = sqlx::query_scalar(ADVISORY_TRY_LOCK)
            .bind(&key)
            .fetch_one(&mut *tx)
            .await
            .outbox_sql()?;
        if got {
            return Ok(tx);
        }
        // Not holding the transaction open while waiting: it would keep a pool connection.
        tx.rollback().await.outbox_sql()?;
        poll.again().await?;
    }
}

/// A transactional step: one transaction with the advisory lock, a local `lock_timeout`, a
/// last look at the catalog (another migrator may have done it meanwhile), the script, and
/// the record of it.
async fn apply_in_transaction(
    ddl: &Ddl,
    names: &Names,
    pool: &PgPool,
    step: &Step,
    script: &sqlx::SqlStr,
    options: MigrateOptions,
    started: Instant,
) -> Result<()> {
    let mut tx = begin_locked(names, pool, step.description, started, options).await?;
    // Before the catalog read: printing an index predicate takes an ACCESS SHARE lock.
    set_lock_timeout(&mut tx, "SET LOCAL", options).await?;
    let facts = Facts::read(&mut tx, names).await?;
    if !facts.holds(&step.done, names) {
        // Without parameters a statement runs on the simple query protocol, which takes the
        // several statements of a script in one string.
        (&mut *tx).execute(script.clone()).await.outbox_sql()?;
    }
    record(ddl, &mut *tx, &facts, step, false).await?;
    tx.commit().await.outbox_sql()?;
    tracing::info!(step = step.description, "outbox: migration step applied");
    Ok(())
}

/// A step outside a transaction (`CREATE INDEX CONCURRENTLY`), on a connection of the pool
/// (so its `after_connect` settings, such as a `search_path`, apply) that is closed
/// afterwards instead of going back, so the session's `lock_timeout` never reaches other
/// users of the pool: the session's advisory lock, an INVALID index from an interrupted
/// build dropped first, the script, the record.
async fn apply_concurrently(
    ddl: &Ddl,
    names: &Names,
    pool: &PgPool,
    step: &Step,
    options: MigrateOptions,
    started: Instant,
) -> Result<()> {
    let key = migrate_key(names);
    let mut poll = LockPoll::new(names, pool, step.description, started, options);
    let mut conn = loop {
        let mut conn = acquire(pool).await?;
        // Closed, not given back, whatever happens next (even if the caller drops this
        // future): the session may hold the advisory lock and a `lock_timeout`.
        conn.close_on_drop();
        let got: bool = sqlx::query_scalar(ADVISORY_TRY_SESSION_LOCK)
            .bind(&key)
            .fetch_one(&mut *conn)
            .await
            .outbox_sql()?;
        if got {
            break conn;
        }
        // Not held while waiting: a pool of one connection needs it to look up who holds
        // the lock.
        drop(conn);
        poll.again().await?;
    };
    let done = build_index(ddl, names, &mut conn, step, options).await;
    let _ = sqlx::query(ADVISORY_UNLOCK)
        .bind(&key)
        .execute(&mut *conn)
        .await;
    done
}

async fn build_index(
    ddl: &Ddl,
    names: &Names,
    conn: &mut PgConnection,
    step: &Step,
    options: MigrateOptions,
) -> Result<()> {
    // Before the catalog read: printing an index predicate takes an ACCESS SHARE lock.
    set_lock_timeout(&mut *conn, "SET", options).await?;
    let mut facts = Facts::read(&mut *conn, names).await?;
    if !facts.holds(&step.done, names) {
        if let Done::Index { table, name } = &step.done {
            let left = wanted_index(names, name)
                .is_some_and(|w| w.invalid_in(&facts.table(*table).indexes));
            if let (true, Some(drop)) = (left, ddl.drop_index(name)) {
                tracing::warn!(
                    index = %name,
                    "outbox: an INVALID index left by an interrupted build is dropped and built again"
                );
                conn.execute(drop).await.outbox_sql()?;
            }
        }
        conn.execute(step.script.clone()).await.outbox_sql()?;
        facts = Facts::read(&mut *conn, names).await?;
    }
    record(ddl, &mut *conn, &facts, step, false).await?;
    tracing::info!(step = step.description, "outbox: migration step applied");
    Ok(())
}

/// `SET LOCAL` (in a transaction) or `SET` (the session of a concurrent build, closed
/// afterwards) of the migration's `lock_timeout`.
async fn set_lock_timeout(
    conn: &mut PgConnection,
    set: &str,
    options: MigrateOptions,
) -> Result<()> {
    let sql = format!("{set} lock_timeout = {}", options.lock_timeout.as_millis());
    conn.execute(sqlx::AssertSqlSafe(sql)).await.outbox_sql()?;
    Ok(())
}

/// [`holders`] of the tables as they are now, or none when even that cannot be read.
async fn holders_of(pool: &PgPool, names: &Names, transaction: bool) -> Vec<LockHolder> {
    match Facts::oids_only(pool, names).await {
        Ok(facts) => holders(pool, &facts, transaction, names)
            .await
            .unwrap_or_default(),
        Err(_) => Vec::new(),
    }
}

fn migrate_key(names: &Names) -> String {
    format!("outbox.migrate:{}", names.qtable)
}

/// The recorded steps ([`crate::Outbox::applied_migrations`]); empty before the first
/// `migrate()`.
pub(crate) async fn applied(
    ddl: &Ddl,
    names: &Names,
    scope: Scope,
    pool: &PgPool,
) -> Result<Vec<AppliedMigration>> {
    let mut db = scope.acquire(pool).await?;
    let exists = scope
        .query_scalar::<Option<i64>>(catalog::TABLE_OID)
        .bind(&names.qversions)
        .fetch_one(&mut *db)
        .await
        .outbox_sql()?
        .is_some();
    if !exists {
        db.done().await?;
        return Ok(Vec::new());
    }
    let rows = scope
        .query(ddl.versions_list.clone())
        .fetch_all(&mut *db)
        .await
        .outbox_sql()?;
    db.done().await?;
    rows.iter()
        .map(|r| {
            Ok(AppliedMigration {
                version: r.try_get(0).outbox_sql()?,
                description: r.try_get(1).outbox_sql()?,
                applied_at: r.try_get(2).outbox_sql()?,
                found: r.try_get(3).outbox_sql()?,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use crate::outbox::Outbox;

    /// The checked-in files are exactly the default rendering. A new step's file is written
    /// by running this test once with `OUTBOX_WRITE_NEW_MIGRATIONS=1`; a file that exists is
    /// never overwritten.
    #[test]
    fn migration_files_match_the_default_rendering() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../migrations");
        for step in Outbox::default().migration_steps() {
            let path = dir.join(step.file_name());
            if !path.exists() && std::env::var_os("OUTBOX_WRITE_NEW_MIGRATIONS").is_some() {
                std::fs::write(&path, &step.sql).expect("write the new migration file");
            }
            let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
            assert_eq!(
                on_disk,
                step.sql,
                "{} differs from the rendering; shipped migration files must stay byte-identical (sqlx checksums them): change the rendering back, or add a new step",
                path.display()
            );
        }
    }

    #[test]
    fn concurrent_steps_are_marked_for_sqlx() {
        for step in Outbox::default().migration_steps() {
            assert_eq!(
                step.sql.starts_with("-- no-transaction"),
                !step.transaction,
                "{}",
                step.file_name()
            );
        }
    }
}
