//! Migrations (SPEC §1.3): the base shape, the rearm columns, and the validation of the
//! rearm CHECK in a transaction of its own.
//!
//! The statements are rendered here for any configured names; the files in the
//! repository's `migrations/` folder are this rendering for the default names (a test keeps
//! them identical), in sqlx's file format, for users who run their own migration tool.
//! Every step is idempotent (`IF NOT EXISTS`, guarded constraint creation), so
//! [`migrate`] is safe to run at every start-up, concurrently from several processes, and
//! after a user applied the same files with another tool.

use sqlx::{Executor, PgPool};

use crate::error::Result;
use crate::schema::{quote_ident, quote_literal, Names, Outbox};

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

fn base(n: &Names) -> String {
    let t = &n.qtable;
    let d = &n.qdlq;
    format!(
        r#"-- outbox: the base shape (SPEC §1.1, §1.2), without the rearm columns.
-- Every row is updated once by its claim; free space on its page (fillfactor 70) keeps the
-- new version on the same page, which logs a small diff instead of the whole row.
CREATE TABLE IF NOT EXISTS {t} (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue varchar(255) NOT NULL,
    payload bytea NOT NULL,
    headers jsonb,
    attempts_count integer NOT NULL DEFAULT 0,
    deliveries_count integer NOT NULL DEFAULT 0,
    created_at timestamptz NOT NULL DEFAULT now(),
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    first_attempt_at timestamptz,
    last_attempt_at timestamptz,
    acquired_at timestamptz,
    acquired_token uuid,
    timer_id varchar(255),
    CONSTRAINT {lease_ck} CHECK ((acquired_token IS NULL) = (acquired_at IS NULL))
) WITH (fillfactor = 70);
-- The claim of due rows.
CREATE INDEX IF NOT EXISTS {pending_idx} ON {t} (queue, next_attempt_at) WHERE acquired_token IS NULL;
-- The reclaim of expired leases.
CREATE INDEX IF NOT EXISTS {lease_idx} ON {t} (queue, acquired_at) WHERE acquired_token IS NOT NULL;
-- One live row per timer key.
CREATE UNIQUE INDEX IF NOT EXISTS {timer_uq} ON {t} (queue, timer_id) WHERE timer_id IS NOT NULL;

CREATE TABLE IF NOT EXISTS {d} (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    original_id bigint NOT NULL,
    queue varchar(255) NOT NULL,
    payload bytea NOT NULL,
    headers jsonb,
    timer_id varchar(255),
    attempts_count integer NOT NULL,
    deliveries_count integer NOT NULL,
    created_at timestamptz NOT NULL,
    failed_at timestamptz NOT NULL DEFAULT now(),
    failure_reason varchar(64) NOT NULL,
    last_error text
);
CREATE INDEX IF NOT EXISTS {dlq_idx} ON {d} (queue, failed_at);
"#,
        lease_ck = quote_ident(&n.lease_ck),
        pending_idx = quote_ident(&n.pending_idx),
        lease_idx = quote_ident(&n.lease_idx),
        timer_uq = quote_ident(&n.timer_uq),
        dlq_idx = quote_ident(&n.dlq_idx),
    )
}

fn rearm_columns(n: &Names) -> String {
    let t = &n.qtable;
    format!(
        r#"-- outbox: the rearm upgrade, step 1 of 2 (SPEC §1.3).
-- Nullable columns without defaults: no table rewrite. The CHECK is added NOT VALID, so
-- the ACCESS EXCLUSIVE lock of ADD CONSTRAINT is held only for a catalog change; the scan
-- of existing rows happens in the next step under a weaker lock.
ALTER TABLE {t}
    ADD COLUMN IF NOT EXISTS rearm_at timestamptz,
    ADD COLUMN IF NOT EXISTS rearm_payload bytea,
    ADD COLUMN IF NOT EXISTS rearm_headers jsonb;
DO $outbox$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_constraint
                   WHERE conrelid = {tlit}::regclass AND conname = {ck_lit}) THEN
        ALTER TABLE {t} ADD CONSTRAINT {ck}
            CHECK (rearm_at IS NULL OR acquired_token IS NOT NULL) NOT VALID;
    END IF;
END
$outbox$;
"#,
        tlit = n.table_literal(),
        ck_lit = quote_literal(&n.rearm_ck),
        ck = quote_ident(&n.rearm_ck),
    )
}

fn rearm_validate(n: &Names) -> String {
    format!(
        r#"-- outbox: the rearm upgrade, step 2 of 2 (SPEC §1.3).
-- Its own transaction: VALIDATE scans the table under SHARE UPDATE EXCLUSIVE, which lets
-- reads and writes go on.
ALTER TABLE {t} VALIDATE CONSTRAINT {ck};
"#,
        t = n.qtable,
        ck = quote_ident(&n.rearm_ck),
    )
}

/// The migration steps for `outbox`'s names, in order. Each runs in its own transaction.
/// Useful for users with their own migration tooling and non-default names.
pub fn migration_steps(outbox: &Outbox) -> Vec<MigrationStep> {
    let n = outbox.names();
    vec![
        MigrationStep {
            version: 20240101000001,
            description: "outbox_base",
            sql: base(n),
        },
        MigrationStep {
            version: 20240101000002,
            description: "outbox_rearm_columns",
            sql: rearm_columns(n),
        },
        MigrationStep {
            version: 20240101000003,
            description: "outbox_rearm_validate",
            sql: rearm_validate(n),
        },
    ]
}

impl Outbox {
    /// Applies every migration step for this outbox's names, each in its own transaction,
    /// serialised against concurrent migrators by a transaction-scoped advisory lock.
    /// Idempotent. The schema named by [`crate::OutboxBuilder::schema`] must exist.
    ///
    /// # Errors
    /// [`crate::Error::Database`] if a statement fails (for example a missing schema or
    /// missing privileges); the steps already committed stay.
    pub async fn migrate(&self, pool: &PgPool) -> Result<()> {
        self.migrate_steps(pool, &migration_steps(self)).await
    }

    /// Applies only the base shape (SPEC §1.3 step 1), as a deployment that predates rearm
    /// would have. For upgrade tests and for reproducing old deployments.
    pub async fn migrate_base_only(&self, pool: &PgPool) -> Result<()> {
        let steps = migration_steps(self);
        self.migrate_steps(pool, &steps[..1]).await
    }

    async fn migrate_steps(&self, pool: &PgPool, steps: &[MigrationStep]) -> Result<()> {
        let key = format!("outbox.migrate:{}", self.names().qtable);
        for step in steps {
            let mut tx = pool.begin().await?;
            // Two processes running CREATE TABLE IF NOT EXISTS at once can still collide on
            // the catalog; the lock makes them take turns.
            sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))")
                .bind(&key)
                .execute(&mut *tx)
                .await?;
            // Executor::execute with a plain &str runs the simple query protocol (several
            // statements in one string), and unlike `raw_sql` its future is Send, so
            // `migrate` works inside `tokio::spawn`.
            (&mut *tx).execute(step.sql.as_str()).await?;
            tx.commit().await?;
        }
        Ok(())
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

    /// The checked-in files are exactly the default rendering.
    #[test]
    fn migration_files_match_the_default_rendering() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../migrations");
        for step in migration_steps(&Outbox::default()) {
            let path = dir.join(step.file_name());
            let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
            if std::env::var_os("OUTBOX_WRITE_MIGRATIONS").is_some() {
                std::fs::write(&path, &step.sql).unwrap();
                continue;
            }
            assert_eq!(
                on_disk,
                step.sql,
                "{} differs from the rendering; regenerate with OUTBOX_WRITE_MIGRATIONS=1 cargo test -p outbox migration_files",
                path.display()
            );
        }
    }
}
