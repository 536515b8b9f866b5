//! What the schema's errors carry: the problems [`validate_schema`](super::validate_schema)
//! finds ([`Error::SchemaMismatch`](crate::Error::SchemaMismatch)), the sessions a blocked
//! migration waited for ([`Error::MigrationBlocked`](crate::Error::MigrationBlocked)), and
//! the address of the upgrade guide every error about an older schema points to. A leaf,
//! so that `error.rs` can name them.

use std::fmt;

/// The address of the upgrade guide for this version ([`upgrading`](crate::schema::upgrading)
/// on docs.rs); every error about a schema that predates this version points here.
pub const UPGRADE_GUIDE: &str = concat!(
    "https://docs.rs/outbox/",
    env!("CARGO_PKG_VERSION"),
    "/outbox/schema/upgrading/index.html"
);

/// One difference between the live schema and the one this version needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchemaProblem {
    /// The table, column, index or constraint concerned (for example `outbox.rearm_at`).
    pub object: String,
    /// What is wrong.
    pub message: String,
    /// True when the fix is a schema upgrade of an older deployment ([`UPGRADE_GUIDE`]).
    pub needs_upgrade: bool,
}

impl fmt::Display for SchemaProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.object, self.message)?;
        if self.needs_upgrade {
            write!(f, " (run the schema upgrade: `Outbox::migrate` with this outbox's settings; see {UPGRADE_GUIDE})")?;
        }
        Ok(())
    }
}

/// Another session a migration step waited for ([`Error::MigrationBlocked`]): one holding
/// a lock on an outbox table, or (for a `CREATE INDEX CONCURRENTLY`, which waits for every
/// older transaction of the database) one holding a snapshot.
///
/// [`Error::MigrationBlocked`]: crate::Error::MigrationBlocked
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockHolder {
    /// Its backend process id (`pg_terminate_backend` takes it).
    pub pid: i32,
    /// When its transaction began, if it is in one.
    pub transaction_start: Option<chrono::DateTime<chrono::Utc>>,
    /// `pg_stat_activity.state`, such as `idle in transaction`.
    pub state: Option<String>,
    /// The lock modes it holds on the outbox tables, such as `AccessShareLock`;
    /// `advisory` for another `migrate()` holding the migrators' lock; `snapshot` for a
    /// session whose open snapshot a concurrent index build waits for.
    pub modes: Vec<String>,
}

impl fmt::Display for LockHolder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "pid {}", self.pid)?;
        if let Some(start) = self.transaction_start {
            write!(f, ", transaction since {start}")?;
        }
        if let Some(state) = &self.state {
            write!(f, ", {state}")?;
        }
        write!(f, " ({})", self.modes.join(", "))
    }
}
