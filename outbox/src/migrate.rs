//! Migrations (SPEC §1.3): the base shape, the rearm columns, and the validation of the
//! rearm CHECK in a transaction of its own.
//!
//! The scripts are rendered by `sql::ddl` for any configured names; the files in the
//! repository's `migrations/` folder are this rendering for the default names (a test keeps
//! them identical), in sqlx's file format, for users who run their own migration tool.
//! Every step is idempotent (`IF NOT EXISTS`, guarded constraint creation), so
//! [`crate::migrate`] is safe to run at every start-up, concurrently from several processes,
//! and after a user applied the same files with another tool.

use sqlx::{Executor, PgPool};

use crate::error::{explain, Result};
use crate::names::Names;
use crate::sql::ddl::{Ddl, ADVISORY_LOCK};

/// One migration step: runs in its own transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigrationStep {
    /// sqlx-style version (orders the files).
    pub version: i64,
    /// sqlx-style description, the file name's tail.
    pub description: &'static str,
    /// The SQL (several statements).
    pub sql: String,
}

impl MigrationStep {
    /// The file name sqlx expects: `<version>_<description>.sql`.
    pub fn file_name(&self) -> String {
        format!("{}_{}.sql", self.version, self.description)
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
        })
        .collect()
}

/// Applies the first `count` steps, each in its own transaction, serialised against
/// concurrent migrators of the same table by a transaction-scoped advisory lock.
pub(crate) async fn run(ddl: &Ddl, names: &Names, pool: &PgPool, count: usize) -> Result<()> {
    let key = format!("outbox.migrate:{}", names.qtable);
    for step in ddl.steps.iter().take(count) {
        let mut tx = match pool.begin().await {
            Ok(tx) => tx,
            Err(e) => return Err(explain(pool, e.into()).await),
        };
        sqlx::query(ADVISORY_LOCK)
            .bind(&key)
            .execute(&mut *tx)
            .await?;
        // A statement without parameters runs on the simple query protocol, which takes
        // several statements in one string.
        (&mut *tx).execute(step.script.clone()).await?;
        tx.commit().await?;
    }
    Ok(())
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
}
