//! The one error type of the runtime crate.

use std::fmt;

use crate::schema::problem::{LockHolder, SchemaProblem, UPGRADE_GUIDE};

/// Everything that can go wrong in `outbox`.
///
/// Validation errors ([`Error::InvalidArgument`], [`Error::InvalidName`],
/// [`Error::InvalidConfig`], [`Error::DuplicateHandler`], [`Error::DeadLetterDisabled`],
/// [`Error::SessionRequired`]) are
/// returned **before any SQL runs**: nothing has been written when you see one.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An argument of a publish, extend, cancel or read call broke a rule: a queue name or
    /// timer id that is empty, longer than 255 bytes or contains NUL; a payload over 64 MiB;
    /// headers over 64 KiB in total or containing NUL; a negative or overflowing delay;
    /// `OnConflict::Extend` without a timer id. `field` names the argument (`queue`,
    /// `timer_id`, `payload`, `headers`, `schedule`, ...).
    #[error("invalid `{field}`: {reason}")]
    InvalidArgument {
        /// The argument that was rejected.
        field: &'static str,
        /// The rule it broke.
        reason: String,
    },

    /// A configured schema or table name is unusable, or a derived identifier (an index,
    /// a constraint, the NOTIFY channel) would exceed Postgres' 63-byte identifier limit.
    #[error("invalid name: identifier `{}` {reason}", Printable(.identifier))]
    InvalidName {
        /// The identifier that does not fit (for example `my_long_table_pending_idx`).
        identifier: String,
        /// Why it does not fit.
        reason: String,
    },

    /// A builder knob has a value outside its allowed range (a worker's, or an outbox's
    /// `distributed`), or the configuration cannot do what was asked (an operation a
    /// distributed outbox does not offer yet: knob `distributed`).
    #[error("invalid setting `{knob}`: {reason}")]
    InvalidConfig {
        /// The knob, as named on the builder (for example `concurrency`).
        knob: &'static str,
        /// What is allowed.
        reason: String,
    },

    /// Two handlers were registered for one queue on one worker.
    #[error("two handlers for queue `{}`: `{}` and `{}`", Printable(.queue), Printable(.first), Printable(.second))]
    DuplicateHandler {
        /// The queue both handlers claim.
        queue: String,
        /// The handler registered first (its payload type name for typed handlers).
        first: String,
        /// The handler registered second.
        second: String,
    },

    /// The outbox's tables predate a schema upgrade this version needs: a rearm column or the
    /// cancel mark `cancelled_at` is missing, or the dead-letter table lacks the redrive
    /// columns (`redriven_at`, `redriven_id`: its tables were migrated with the dead-letter
    /// queue off) (Postgres reported SQLSTATE 42703, `undefined_column`), or the table of
    /// paused queues `<table>_paused` is missing (SQLSTATE 42P01, `undefined_table`; every
    /// claim reads it). Run [`crate::migrate`] (or apply the statements of
    /// `migration_steps()` with your own migration tool) with this outbox's settings before
    /// deploying this version.
    #[error("the outbox schema predates this version ({detail}); run the schema upgrade first: `Outbox::migrate` with this outbox's settings (its names, and `dead_letter(true)` when it keeps dead letters; `outbox migrate --dead-letter` in the CLI), see {UPGRADE_GUIDE}")]
    UpgradeRequired {
        /// What Postgres reported.
        detail: String,
    },

    /// The queue table does not exist (SQLSTATE 42P01): the migrations have not run against
    /// this database, schema or `search_path`. Run [`crate::migrate`] (or
    /// [`crate::Outbox::migrate`] for your names) first.
    #[error("the outbox tables do not exist ({detail}); run `Outbox::migrate` with this outbox's settings (`outbox::migrate()` for the default names; or the SQL of `outbox::schema::migration_steps()`) against this database first; a schema the outbox names must exist before that (`CREATE SCHEMA`)")]
    NotMigrated {
        /// What Postgres reported (it names the missing table).
        detail: String,
    },

    /// The schema the [`Outbox`](crate::Outbox) names does not exist (SQLSTATE 3F000
    /// invalid_schema_name). `migrate` creates the outbox's tables, never the schema itself
    /// (who owns a schema, and its grants, is the database owner's decision): create it first
    /// (`CREATE SCHEMA <name>`), then migrate.
    #[error("the schema does not exist ({detail}); create it first (`CREATE SCHEMA …`): `outbox::migrate` creates the outbox's tables, not their schema")]
    SchemaNotFound {
        /// What Postgres reported (it names the schema).
        detail: String,
    },

    /// The server is a PostgreSQL major version this release does not support
    /// ([`SUPPORTED_POSTGRES`](crate::schema::SUPPORTED_POSTGRES): 14 to 18), read from its
    /// `server_version_num` setting. [`crate::migrate`] and
    /// [`crate::schema::validate_schema`] (and [`crate::Outbox`]'s methods of the same names)
    /// check it first: nothing was read from or written to the outbox's tables.
    #[error("PostgreSQL {version} is not supported: this version of outbox runs on PostgreSQL {} to {}", .supported.0, .supported.1)]
    UnsupportedPostgres {
        /// The server's `server_version`, as it reports it (for example `13.14 (Debian
        /// 13.14-1)`).
        version: String,
        /// Its major version, from `server_version_num` (`None` when that did not parse as
        /// a PostgreSQL version number).
        major: Option<u32>,
        /// The supported major versions, lowest and highest.
        supported: (u32, u32),
    },

    /// A migration step could not run within the deadline of [`crate::schema::MigrateOptions`]:
    /// other sessions held what it needs the whole time (a table lock held by a long
    /// transaction or an idle-in-transaction session; the advisory lock of another
    /// `migrate()` busy with a long step; for a `CREATE INDEX CONCURRENTLY`, an older
    /// snapshot anywhere in the database). Nothing of that step was applied (an
    /// interrupted `CREATE INDEX CONCURRENTLY` may leave an INVALID index, which the next
    /// `migrate()` drops and builds again); the steps before it stay applied. Run
    /// `migrate()` again once those sessions are done.
    #[error("migration step `{step}` could not run within {waited:?}: it kept waiting for other sessions (for table locks, another migrate(), or older snapshots a concurrent index build waits for; each try waits at most its lock_timeout, then gives way); sessions it waited for: {}", LockHolders(.holders))]
    MigrationBlocked {
        /// The step (its description, as in the file name).
        step: String,
        /// How long it kept trying.
        waited: std::time::Duration,
        /// The other sessions that held locks on the tables or the migrators' advisory
        /// lock at the last try (and, for a `CREATE INDEX CONCURRENTLY`, those holding a
        /// snapshot), where readable.
        holders: Vec<LockHolder>,
    },

    /// [`crate::schema::validate_schema`] found the live database different from what this
    /// version needs. Every problem is listed. Any other call gives it (one problem) when
    /// the table it names lacks a column that every version's queue and dead-letter tables
    /// have (Postgres reported SQLSTATE 42703, `undefined_column`): the name is not an
    /// outbox table's.
    #[error("the outbox schema does not match this version: {}", SchemaProblems(.problems))]
    SchemaMismatch {
        /// Every problem found, in a stable order.
        problems: Vec<SchemaProblem>,
    },

    /// A typed payload could not be encoded to JSON, or its JSON does not decode back into
    /// its type (a `NaN` float, which JSON writes as `null`).
    #[error("could not encode the payload as JSON that decodes back into its type: {0}")]
    Encode(#[source] serde_json::Error),

    /// A handler's transaction could not complete its row: the worker's lease on the row
    /// was lost (the row is gone, or another worker took it after the lease expired), so
    /// the whole transaction was rolled back and none of the handler's writes is visible.
    #[error("the lease of row {id} was lost (the row is gone, or another worker holds it); the handler's transaction was rolled back")]
    LeaseLost {
        /// The row id.
        id: i64,
    },

    /// [`Context::begin`](crate::Context::begin) cannot give a transaction: the store has
    /// no database (the in-memory store), or this run already began one.
    #[error("no handler transaction: {reason}")]
    TransactionUnavailable {
        /// Why.
        reason: String,
    },

    /// A dead-letter operation (list, redrive, purge; [`crate::dlq`]) on an outbox or store
    /// whose dead-letter queue is off. Nothing ran. Turn it on with
    /// [`OutboxBuilder::dead_letter`](crate::OutboxBuilder::dead_letter)`(true)` (or
    /// `MemoryStore::with_dead_letter(true)`) and run `migrate` with it on, which adds the
    /// columns a redrive writes.
    #[error("the dead-letter queue is off for this outbox: build it with `OutboxBuilder::dead_letter(true)` and run `migrate` with it (which adds the redrive columns) to list, redrive or purge dead letters")]
    DeadLetterDisabled,

    /// The server refused a write because it is read-only: a hot standby in recovery
    /// (Postgres refuses every write there, and `LISTEN` too, with SQLSTATE 25006
    /// `read_only_sql_transaction`), a session or role with `default_transaction_read_only
    /// = on`, or a caller's transaction begun `READ ONLY` (`SET TRANSACTION READ ONLY`) in
    /// which a publish, extend or cancel ran. Publishing, cancelling and every worker write
    /// need the primary. A worker that meets it keeps running: it backs off (at most 5 s
    /// between tries), counts each failed claim in
    /// `outbox_claim_errors_total{error="ReadOnly"}`, and resumes by itself once the server
    /// accepts writes (a promoted standby). `migrate` asks `pg_is_in_recovery()` first and
    /// refuses a standby with this error before any DDL (`source` is then `None`).
    #[error("the server or the transaction is read-only ({detail}): outbox writes need a read-write transaction on the primary, not a standby in recovery, a read-only session or a transaction begun READ ONLY")]
    ReadOnly {
        /// What Postgres reported, or that `pg_is_in_recovery()` is true.
        detail: String,
        /// The statement error (SQLSTATE 25006), when a statement was refused.
        #[source]
        source: Option<sqlx::Error>,
    },

    /// An operation that needs a server session of its own was asked of an outbox built
    /// with [`OutboxBuilder::transaction_pooler`](crate::OutboxBuilder::transaction_pooler)
    /// (a transaction-mode pooler such as PgBouncer `pool_mode = transaction` hands each
    /// transaction to any server connection, so session state does not survive it).
    /// Nothing ran. `migrate` is one: it holds an advisory lock and a `lock_timeout` on its
    /// session and builds an index `CONCURRENTLY`. Run it over a direct connection (an
    /// outbox without the knob, on a pool that reaches the server itself).
    #[error("{what} needs a server session of its own ({why}), which a transaction-mode pooler does not keep: run it over a direct connection to the server, with an outbox built without `transaction_pooler`")]
    SessionRequired {
        /// The operation (for example `migrate`).
        what: &'static str,
        /// The session state it relies on.
        why: &'static str,
    },

    /// [`Outbox::set_global`](crate::Outbox::set_global) came too late: the process-wide
    /// outbox was already fixed, by an earlier `set_global` or by a call of
    /// [`Outbox::global`](crate::Outbox::global) (which the functions `#[timer]` generates
    /// make for a plain connection, transaction or pool), which fixes the default outbox
    /// for good. Nothing changed: the global outbox stays the one in place.
    #[error("the global outbox is already set ({reason}); call `Outbox::set_global` once, at start-up, before anything publishes")]
    GlobalAlreadySet {
        /// Which came first: `set_global` or `global()`.
        reason: &'static str,
    },

    /// Postgres or the connection failed. A `sqlx::Error` of your own statement, turned
    /// into this type by `?` (`From<sqlx::Error>`), is always this variant, whatever its
    /// SQLSTATE: only the library's own statements become [`Error::NotMigrated`],
    /// [`Error::UpgradeRequired`], [`Error::SchemaNotFound`] or [`Error::ReadOnly`].
    #[error("database error: {}", DatabaseText(.0))]
    Database(#[source] sqlx::Error),
}

/// A database error as Postgres reported it: its message, SQLSTATE, detail and hint. sqlx's
/// own text appends "at line N", the line of Postgres' C source that raised the error,
/// which reads like a line of the statement (found by the fresh-user trial of 2026-12-05:
/// `column "bucket" does not exist at line 3665`). Any other sqlx error keeps its text.
struct DatabaseText<'a>(&'a sqlx::Error);

impl fmt::Display for DatabaseText<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sqlx::Error::Database(db) = self.0 else {
            return write!(f, "{}", self.0);
        };
        f.write_str(db.message())?;
        if let Some(code) = db.code() {
            write!(f, " (SQLSTATE {code})")?;
        }
        if let Some(pg) = db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>() {
            if let Some(detail) = pg.detail() {
                write!(f, "; detail: {detail}")?;
            }
            if let Some(hint) = pg.hint() {
                write!(f, "; hint: {hint}")?;
            }
        }
        Ok(())
    }
}

/// A name from the caller, with its control characters escaped (`\0`, `\n`, `\u{1b}`): a
/// message never carries a raw NUL or terminal escape from bad input.
pub(crate) struct Printable<'a>(pub(crate) &'a str);

impl fmt::Display for Printable<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for c in self.0.chars() {
            if c.is_control() {
                write!(f, "{}", c.escape_debug())?;
            } else {
                fmt::Write::write_char(f, c)?;
            }
        }
        Ok(())
    }
}

struct LockHolders<'a>(&'a [LockHolder]);

impl fmt::Display for LockHolders<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str("none readable");
        }
        for (i, h) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{h}")?;
        }
        Ok(())
    }
}

struct SchemaProblems<'a>(&'a [SchemaProblem]);

impl fmt::Display for SchemaProblems<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, p) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{p}")?;
        }
        Ok(())
    }
}

// Debug shows the variant and the message, not the fields: `fn main() -> Result<(), Box<dyn
// Error>>` prints an error with Debug, and the advice (run migrate, create the schema, which
// forms publish) lives in the message. `{:#?}` keeps the fields for a closer look.
impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if f.alternate() {
            return fmt::Debug::fmt(&Fields(self), f);
        }
        write!(f, "{}: {self}", self.variant())
    }
}

/// The derived, field-by-field form, for `{:#?}`.
struct Fields<'a>(&'a Error);

impl fmt::Debug for Fields<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Error::InvalidArgument { field, reason } => f
                .debug_struct("InvalidArgument")
                .field("field", field)
                .field("reason", reason)
                .finish(),
            Error::InvalidName { identifier, reason } => f
                .debug_struct("InvalidName")
                .field("identifier", identifier)
                .field("reason", reason)
                .finish(),
            Error::InvalidConfig { knob, reason } => f
                .debug_struct("InvalidConfig")
                .field("knob", knob)
                .field("reason", reason)
                .finish(),
            Error::DuplicateHandler {
                queue,
                first,
                second,
            } => f
                .debug_struct("DuplicateHandler")
                .field("queue", queue)
                .field("first", first)
                .field("second", second)
                .finish(),
            Error::UpgradeRequired { detail } => f
                .debug_struct("UpgradeRequired")
                .field("detail", detail)
                .finish(),
            Error::NotMigrated { detail } => f
                .debug_struct("NotMigrated")
                .field("detail", detail)
                .finish(),
            Error::SchemaNotFound { detail } => f
                .debug_struct("SchemaNotFound")
                .field("detail", detail)
                .finish(),
            Error::UnsupportedPostgres {
                version,
                major,
                supported,
            } => f
                .debug_struct("UnsupportedPostgres")
                .field("version", version)
                .field("major", major)
                .field("supported", supported)
                .finish(),
            Error::MigrationBlocked {
                step,
                waited,
                holders,
            } => f
                .debug_struct("MigrationBlocked")
                .field("step", step)
                .field("waited", waited)
                .field("holders", holders)
                .finish(),
            Error::SchemaMismatch { problems } => f
                .debug_struct("SchemaMismatch")
                .field("problems", problems)
                .finish(),
            Error::Encode(e) => f.debug_tuple("Encode").field(e).finish(),
            Error::LeaseLost { id } => f.debug_struct("LeaseLost").field("id", id).finish(),
            Error::TransactionUnavailable { reason } => f
                .debug_struct("TransactionUnavailable")
                .field("reason", reason)
                .finish(),
            Error::DeadLetterDisabled => f.write_str("DeadLetterDisabled"),
            Error::ReadOnly { detail, source } => f
                .debug_struct("ReadOnly")
                .field("detail", detail)
                .field("source", source)
                .finish(),
            Error::SessionRequired { what, why } => f
                .debug_struct("SessionRequired")
                .field("what", what)
                .field("why", why)
                .finish(),
            Error::GlobalAlreadySet { reason } => f
                .debug_struct("GlobalAlreadySet")
                .field("reason", reason)
                .finish(),
            Error::Database(e) => f.debug_tuple("Database").field(e).finish(),
        }
    }
}

/// Any sqlx error is [`Error::Database`], whatever its SQLSTATE: `?` on your own statement
/// (in a handler's transaction, on your own connection) never turns a typo'd table into
/// [`Error::NotMigrated`]. Only the crate's own statements are classified (the schema
/// variants, [`Error::ReadOnly`]), because only there does a missing table or column mean
/// the outbox's schema.
impl From<sqlx::Error> for Error {
    fn from(e: sqlx::Error) -> Self {
        Error::Database(e)
    }
}

/// `.outbox_sql()?` on the result of one of the crate's own statements: its error goes
/// through [`Error::from_outbox_statement`], the one place the SQLSTATE rules live.
pub(crate) trait OutboxSql<T> {
    /// The result, its error classified as an error of the outbox's own SQL.
    fn outbox_sql(self) -> Result<T>;
}

impl<T> OutboxSql<T> for std::result::Result<T, sqlx::Error> {
    fn outbox_sql(self) -> Result<T> {
        self.map_err(Error::from_outbox_statement)
    }
}

impl Error {
    /// The error of a statement of the crate's own, by SQLSTATE. Every statement of ours
    /// names only our tables, our columns, our schema (and the catalog), so there a missing
    /// one means the schema has not been migrated (or upgraded); a user's statement gets
    /// [`Error::Database`] through `From`.
    pub(crate) fn from_outbox_statement(e: sqlx::Error) -> Self {
        // SQLSTATE 42703 undefined_column, its message without our statements' table alias
        // (`unaliased`):
        // - the only columns this version reads that an older deployment lacks are the rearm
        //   columns, the cancel mark (SPEC §1.3) and the dead-letter redrive columns (issue
        //   16: a table migrated with the dead-letter queue off, then used with it on);
        // - only a distributed outbox's statements name `bucket`, so this outbox is built
        //   with `distributed` over a table created without it (found by the fresh-user
        //   trial of 2026-12-05, as a raw database error).
        if let sqlx::Error::Database(db) = &e {
            if db.code().as_deref() == Some("42703") {
                let detail = unaliased(db.message());
                if ["rearm_", "cancelled_at", "redriven_"]
                    .iter()
                    .any(|c| detail.contains(c))
                {
                    return Error::UpgradeRequired { detail };
                }
                if detail.starts_with("column \"bucket\" ") {
                    return Error::InvalidConfig {
                        knob: "distributed",
                        reason: format!(
                            "this outbox is built with `distributed`, but its table has no bucket column ({}): the table was created for a single node; build the outbox without `distributed` (the CLI: without --distributed), as the table was migrated",
                            db.message()
                        ),
                    };
                }
                // Any other column: every version's tables have it, so the table the
                // outbox names is not an outbox table (a wrong `--table`, say `pg_class`;
                // found by the fresh-user trial of 2026-12-05 as a raw database error).
                let column = detail
                    .split('"')
                    .nth(1)
                    .filter(|c| !c.is_empty())
                    .unwrap_or(&detail)
                    .to_owned();
                return Error::not_an_outbox_table(column, &detail);
            }
        }
        // SQLSTATE 23514 check_violation of a distributed table's bucket CHECK: this process
        // is built with another bucket count than the table's (docs/guide/citus.md).
        if let sqlx::Error::Database(db) = &e {
            // Citus relays a worker node's error without its constraint field: the name is
            // in the message.
            if db.code().as_deref() == Some("23514")
                && (db.constraint().is_some_and(|c| c.ends_with("_bucket_ck"))
                    || db.message().contains("_bucket_ck\""))
            {
                return Error::InvalidConfig {
                    knob: "distributed",
                    reason: format!(
                        "this outbox's bucket count is not the table's ({}): every process must build with the count the table was created with (validate_schema names it)",
                        db.message()
                    ),
                };
            }
        }
        // SQLSTATE 25006 read_only_sql_transaction: a hot standby (every write and LISTEN,
        // "cannot execute … in a read-only transaction" / "… during recovery") or a
        // read-only session (issue 26).
        if let sqlx::Error::Database(db) = &e {
            if db.code().as_deref() == Some("25006") {
                return Error::ReadOnly {
                    detail: db.message().to_owned(),
                    source: Some(e),
                };
            }
        }
        // SQLSTATE 3F000 invalid_schema_name: an explicit schema of the Outbox that was never
        // created (migrate does not create schemas).
        if let sqlx::Error::Database(db) = &e {
            if db.code().as_deref() == Some("3F000") {
                return Error::SchemaNotFound {
                    detail: db.message().to_owned(),
                };
            }
        }
        // SQLSTATE 42P01 undefined_table: every statement of ours names only our tables
        // (and the catalog), so the migrations have not run here — or, when the missing
        // table is the paused-queues table (`<table>_paused`, added by an upgrade step and
        // read by every claim), only the upgrade has not.
        if let sqlx::Error::Database(db) = &e {
            if db.code().as_deref() == Some("42P01") && db.message().contains(PAUSED_MISSING) {
                return Error::UpgradeRequired {
                    detail: db.message().to_owned(),
                };
            }
            if db.code().as_deref() == Some("42P01") {
                return Error::NotMigrated {
                    detail: db.message().to_owned(),
                };
            }
        }
        Error::Database(e)
    }
}

/// Postgres' 42703 message without the statement's table alias: `column t.rearm_at does
/// not exist` (our statements name the queue table `t`) reads `column "rearm_at" does not
/// exist`, which names a column the user can look for. Any other message is kept.
fn unaliased(message: &str) -> String {
    let aliased = message
        .strip_prefix("column ")
        .and_then(|m| m.strip_suffix(" does not exist"))
        .and_then(|c| c.split_once('.'))
        .filter(|(alias, column)| {
            !alias.is_empty() && !column.is_empty() && !column.contains([' ', '"', '.'])
        });
    match aliased {
        Some((_, column)) => format!("column \"{column}\" does not exist"),
        None => message.to_owned(),
    }
}

/// The end of Postgres' 42P01 message for a missing paused-queues table (`<table>_paused`).
const PAUSED_MISSING: &str = "_paused\" does not exist";

impl Error {
    /// A table this outbox names lacks `column`, which every version's tables have: it is
    /// not an outbox table. `detail` says how that was found.
    pub(crate) fn not_an_outbox_table(column: String, detail: &str) -> Error {
        Error::SchemaMismatch {
            problems: vec![SchemaProblem {
                object: column,
                message: format!(
                    "column is missing ({detail}): the table this outbox names is not an \
                     outbox table; name the outbox's table (`OutboxBuilder::table`, \
                     `--table`; `validate_schema` lists every difference)"
                ),
                needs_upgrade: false,
            }],
        }
    }

    /// True for the [`Error::UpgradeRequired`] of a missing paused-queues table: a statement
    /// that names it before the queue table meets it first on a database never migrated at
    /// all, so the caller asks whether the queue table exists before believing it.
    pub(crate) fn is_missing_paused_table(&self) -> bool {
        matches!(self, Error::UpgradeRequired { detail } if detail.ends_with(PAUSED_MISSING))
    }

    /// The variant's name, as in the type (`"NotMigrated"`).
    pub(crate) fn variant(&self) -> &'static str {
        match self {
            Error::InvalidArgument { .. } => "InvalidArgument",
            Error::InvalidName { .. } => "InvalidName",
            Error::InvalidConfig { .. } => "InvalidConfig",
            Error::DuplicateHandler { .. } => "DuplicateHandler",
            Error::UpgradeRequired { .. } => "UpgradeRequired",
            Error::NotMigrated { .. } => "NotMigrated",
            Error::SchemaNotFound { .. } => "SchemaNotFound",
            Error::UnsupportedPostgres { .. } => "UnsupportedPostgres",
            Error::MigrationBlocked { .. } => "MigrationBlocked",
            Error::SchemaMismatch { .. } => "SchemaMismatch",
            Error::Encode(_) => "Encode",
            Error::LeaseLost { .. } => "LeaseLost",
            Error::TransactionUnavailable { .. } => "TransactionUnavailable",
            Error::DeadLetterDisabled => "DeadLetterDisabled",
            Error::ReadOnly { .. } => "ReadOnly",
            Error::SessionRequired { .. } => "SessionRequired",
            Error::GlobalAlreadySet { .. } => "GlobalAlreadySet",
            Error::Database(_) => "Database",
        }
    }

    pub(crate) fn invalid(field: &'static str, reason: impl Into<String>) -> Self {
        Error::InvalidArgument {
            field,
            reason: reason.into(),
        }
    }

    pub(crate) fn config(knob: &'static str, reason: impl Into<String>) -> Self {
        Error::InvalidConfig {
            knob,
            reason: reason.into(),
        }
    }

    /// True for failures of the connection or the server (as opposed to a statement
    /// that Postgres rejected); the worker rebuilds its connections after these. Besides
    /// I/O and pool failures: SQLSTATE class 08 (connection exception), class 57P (the
    /// server shutting down or terminating the session, `57P05`
    /// `idle_session_timeout` included) and `25P03` (the session ended by
    /// `idle_in_transaction_session_timeout`).
    pub fn is_connection_error(&self) -> bool {
        match self {
            Error::Database(e) => {
                matches!(
                    e,
                    sqlx::Error::Io(_)
                        | sqlx::Error::PoolTimedOut
                        | sqlx::Error::PoolClosed
                        | sqlx::Error::WorkerCrashed
                        | sqlx::Error::Tls(_)
                        | sqlx::Error::Protocol(_)
                ) || matches!(e, sqlx::Error::Database(db)
                    if db.code().is_some_and(|c| c.starts_with("08") || c.starts_with("57P") || c == "25P03"))
            }
            _ => false,
        }
    }
}

impl Error {
    /// The SQLSTATE Postgres reported, if this is a statement error.
    pub fn sqlstate(&self) -> Option<String> {
        match self {
            Error::Database(sqlx::Error::Database(db))
            | Error::ReadOnly {
                source: Some(sqlx::Error::Database(db)),
                ..
            } => db.code().map(|c| c.into_owned()),
            _ => None,
        }
    }

    /// True when the statement gave up waiting for a row lock (SQLSTATE 55P03
    /// `lock_not_available`: the worker's own `lock_timeout` ran out).
    pub fn is_lock_timeout(&self) -> bool {
        self.sqlstate().as_deref() == Some("55P03")
    }

    /// True for errors that a second try of the same write can clear: a deadlock (40P01),
    /// a serialization failure (40001), a lock timeout (55P03) or a cancelled statement
    /// (57014 `query_canceled`: a `statement_timeout` set on the role or the server, or
    /// `pg_cancel_backend`). The worker retries a completion that meets one while its
    /// lease lasts.
    pub fn is_transient(&self) -> bool {
        matches!(
            self.sqlstate().as_deref(),
            Some("40P01" | "40001" | "55P03" | "57014")
        )
    }

    /// True for errors caused by one row's data: a data exception (class 22), an integrity
    /// constraint violation (class 23) or an exception raised by a trigger (`P0001`). Only
    /// these start the isolation of a claim that fails (the claim is retried on halves of its
    /// rows down to the failing one); connection loss, timeouts, lock and serialization errors
    /// never do.
    pub fn is_row_fault(&self) -> bool {
        self.sqlstate()
            .is_some_and(|c| c.starts_with("22") || c.starts_with("23") || c == "P0001")
    }
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    /// The fresh-user trial of 2026-12-05: an upgrade error said `column t.rearm_at does not
    /// exist`, naming our statement's alias `t`, which the user's table does not have.
    #[test]
    fn an_upgrade_error_names_the_column_without_our_alias() {
        assert_eq!(
            unaliased("column t.rearm_at does not exist"),
            r#"column "rearm_at" does not exist"#
        );
        assert_eq!(
            unaliased("column d.redriven_at does not exist"),
            r#"column "redriven_at" does not exist"#
        );
        for kept in [
            r#"column "cancelled_at" does not exist"#,
            r#"column "rearm_at" of relation "outbox" does not exist"#,
            "column .rearm_at does not exist",
            r#"relation "outbox_paused" does not exist"#,
        ] {
            assert_eq!(unaliased(kept), kept);
        }
    }

    /// `main` returning `Result<(), Box<dyn Error>>` prints with Debug: the advice must be
    /// there (found by the issue-15 trial: `Error: NotMigrated { detail: … }` said nothing
    /// about migrate).
    #[test]
    fn debug_carries_the_message_and_alternate_the_fields() {
        let e = Error::NotMigrated {
            detail: r#"relation "outbox" does not exist"#.to_owned(),
        };
        assert_eq!(
            format!("{e:?}"),
            format!("NotMigrated: {e}"),
            "Debug is the variant and the message"
        );
        assert!(format!("{e:?}").contains("run `Outbox::migrate` with this outbox's settings"));
        assert_eq!(
            format!("{e:#?}"),
            "NotMigrated {\n    detail: \"relation \\\"outbox\\\" does not exist\",\n}"
        );
        let e = Error::invalid("queue", "must not be empty");
        assert_eq!(
            format!("{e:?}"),
            "InvalidArgument: invalid `queue`: must not be empty"
        );
    }

    /// A name from the caller is echoed with its control characters escaped (found by a
    /// review: a schema name with a NUL put the raw byte into the message).
    #[test]
    fn messages_escape_control_characters_of_names() {
        let e = crate::Outbox::builder().schema("a\0b").build().unwrap_err();
        assert!(matches!(&e, Error::InvalidName { identifier, .. } if identifier == "a\0b"));
        let text = e.to_string();
        assert!(
            text.starts_with(r"invalid name: identifier `a\0b` "),
            "{text}"
        );
        assert!(!text.chars().any(char::is_control), "{text:?}");
        let e = Error::DuplicateHandler {
            queue: "q\n\u{1b}[2J".to_owned(),
            first: "A".to_owned(),
            second: "B".to_owned(),
        };
        assert_eq!(
            e.to_string(),
            r"two handlers for queue `q\n\u{1b}[2J`: `A` and `B`"
        );
        // Printable characters, quotes included, stay as they are.
        assert_eq!(Printable(r#"my "t" é"#).to_string(), r#"my "t" é"#);
    }

    /// `set_global` after `global()` fails and says why (found by a review: it returned the
    /// outbox back and said nothing). No other unit test touches the global outbox.
    #[test]
    fn set_global_after_global_says_why() {
        let _ = crate::Outbox::global();
        let late = crate::Outbox::builder().table("late").build().unwrap();
        let e = late.set_global().unwrap_err();
        assert!(matches!(e, Error::GlobalAlreadySet { .. }), "{e:?}");
        assert_eq!(
            e.to_string(),
            "the global outbox is already set (`Outbox::global()` was called first and \
             installed the default outbox); call `Outbox::set_global` once, at start-up, \
             before anything publishes"
        );
        assert_eq!(crate::Outbox::global().table(), "\"outbox\"");
    }

    /// Every error a variant wraps is its `source()`, so a reporter that walks the chain
    /// (anyhow's `{:#}`, `tracing-error`) reaches sqlx's or serde_json's own error. One
    /// value of each variant: a new variant must say here whether it wraps one.
    #[test]
    fn wrapped_errors_are_their_source() {
        use std::error::Error as _;

        fn chain(e: &Error) -> Vec<String> {
            std::iter::successors(Some(e as &dyn std::error::Error), |e| (*e).source())
                .map(ToString::to_string)
                .collect()
        }
        fn wraps(e: &Error) -> bool {
            match e {
                Error::Encode(_) | Error::Database(_) => true,
                Error::ReadOnly { source, .. } => source.is_some(),
                Error::InvalidArgument { .. }
                | Error::InvalidName { .. }
                | Error::InvalidConfig { .. }
                | Error::DuplicateHandler { .. }
                | Error::UpgradeRequired { .. }
                | Error::NotMigrated { .. }
                | Error::SchemaNotFound { .. }
                | Error::UnsupportedPostgres { .. }
                | Error::MigrationBlocked { .. }
                | Error::SchemaMismatch { .. }
                | Error::LeaseLost { .. }
                | Error::TransactionUnavailable { .. }
                | Error::DeadLetterDisabled
                | Error::SessionRequired { .. }
                | Error::GlobalAlreadySet { .. } => false,
            }
        }

        let json = serde_json::from_slice::<u32>(b"\"7\"").unwrap_err();
        let json_text = json.to_string();
        let encode = Error::Encode(json);
        let source = encode.source().expect("Encode has a source");
        assert_eq!(
            source
                .downcast_ref::<serde_json::Error>()
                .map(ToString::to_string),
            Some(json_text.clone())
        );
        assert_eq!(chain(&encode)[1..], [json_text]);

        let database = Error::from(sqlx::Error::PoolTimedOut);
        let source = database.source().expect("Database has a source");
        assert!(matches!(
            source.downcast_ref::<sqlx::Error>(),
            Some(sqlx::Error::PoolTimedOut)
        ));
        assert_eq!(
            chain(&database)[1..],
            [sqlx::Error::PoolTimedOut.to_string()]
        );

        let detail = || "relation \"outbox\" does not exist".to_owned();
        let all = [
            encode,
            database,
            Error::invalid("queue", "must not be empty"),
            Error::InvalidName {
                identifier: "t".to_owned(),
                reason: "is empty".to_owned(),
            },
            Error::config("concurrency", "must be at least 1"),
            Error::DuplicateHandler {
                queue: "q".to_owned(),
                first: "A".to_owned(),
                second: "B".to_owned(),
            },
            Error::UpgradeRequired { detail: detail() },
            Error::NotMigrated { detail: detail() },
            Error::SchemaNotFound { detail: detail() },
            Error::UnsupportedPostgres {
                version: "13.14".to_owned(),
                major: Some(13),
                supported: (14, 18),
            },
            Error::MigrationBlocked {
                step: "base".to_owned(),
                waited: std::time::Duration::from_secs(1),
                holders: Vec::new(),
            },
            Error::SchemaMismatch {
                problems: Vec::new(),
            },
            Error::LeaseLost { id: 1 },
            Error::TransactionUnavailable {
                reason: "no database".to_owned(),
            },
            Error::DeadLetterDisabled,
            Error::ReadOnly {
                detail: "pg_is_in_recovery() is true".to_owned(),
                source: None,
            },
            Error::SessionRequired {
                what: "migrate",
                why: "an advisory lock",
            },
            Error::GlobalAlreadySet {
                reason: "`set_global` was called before",
            },
        ];
        for e in &all {
            assert_eq!(e.source().is_some(), wraps(e), "{}: {e}", e.variant());
        }
    }
}
