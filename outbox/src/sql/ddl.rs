//! The migration steps (SPEC §1.3), as SQL scripts of several statements each. The files in
//! the repository's `migrations/` folder are this rendering for the default names, byte for
//! byte (sqlx checksums applied files); `migrate.rs` runs them and a unit test there keeps
//! the files identical.

use sqlx::SqlStr;

use super::statement;
use crate::names::{quote_ident, quote_literal, Names};

/// Serialises concurrent migrators of one table: `$1` the table's key. Two processes running
/// `CREATE TABLE IF NOT EXISTS` at once can still collide on the catalog; the lock makes
/// them take turns. Transaction-scoped, so it ends with the step.
pub(crate) const ADVISORY_LOCK: &str = "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))";

/// One rendered step: sqlx-style version, description and script.
#[derive(Debug)]
pub(crate) struct Step {
    pub version: i64,
    pub description: &'static str,
    pub script: SqlStr,
}

#[derive(Debug)]
pub(crate) struct Ddl {
    /// In order; each runs in its own transaction.
    pub steps: Vec<Step>,
}

impl Ddl {
    pub(crate) fn render(n: &Names) -> Self {
        let step = |version, description, script: String| Step {
            version,
            description,
            script: statement(&script),
        };
        Ddl {
            steps: vec![
                step(20240101000001, "outbox_base", base(n)),
                step(20240101000002, "outbox_rearm_columns", rearm_columns(n)),
                step(20240101000003, "outbox_rearm_validate", rearm_validate(n)),
                step(20240101000004, "outbox_cancel_columns", cancel_columns(n)),
                step(20240101000005, "outbox_cancel_validate", cancel_validate(n)),
            ],
        }
    }

    #[cfg(test)]
    pub(super) fn all(&self) -> Vec<(&'static str, &str)> {
        self.steps
            .iter()
            .map(|s| (s.description, s.script.as_str()))
            .collect()
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
{check}"#,
        check = add_check_not_valid(
            n,
            &n.rearm_ck,
            "rearm_at IS NULL OR acquired_token IS NOT NULL"
        ),
    )
}

fn rearm_validate(n: &Names) -> String {
    validate_step(n, "the rearm upgrade, step 2 of 2 (SPEC §1.3)", &n.rearm_ck)
}

/// Adds a CHECK constraint `NOT VALID` unless one of that name exists: a catalog change
/// under a lock held for milliseconds, the scan left to a step of its own.
fn add_check_not_valid(n: &Names, name: &str, check: &str) -> String {
    format!(
        r#"DO $outbox$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_constraint
                   WHERE conrelid = {tlit}::regclass AND conname = {name_lit}) THEN
        ALTER TABLE {t} ADD CONSTRAINT {ck}
            CHECK ({check}) NOT VALID;
    END IF;
END
$outbox$;
"#,
        tlit = n.table_literal(),
        name_lit = quote_literal(name),
        t = n.qtable,
        ck = quote_ident(name),
    )
}

/// Validates a constraint added `NOT VALID`, in a transaction of its own.
fn validate_step(n: &Names, title: &str, name: &str) -> String {
    format!(
        r#"-- outbox: {title}.
-- Its own transaction: VALIDATE scans the table under SHARE UPDATE EXCLUSIVE, which lets
-- reads and writes go on.
ALTER TABLE {t} VALIDATE CONSTRAINT {ck};
"#,
        t = n.qtable,
        ck = quote_ident(name),
    )
}

fn cancel_columns(n: &Names) -> String {
    let t = &n.qtable;
    format!(
        r#"-- outbox: the cancel mark, step 1 of 2 (SPEC §1.3, §3).
-- `cancelled_at` records that a cancel reached a row while its handler ran: however that
-- run ends, the row is deleted, never retried or archived (the cancel dropped any queued
-- rearm; an extend after it queues a new one and clears the mark). A nullable column
-- without a default: no table rewrite. The CHECK is added NOT VALID (a catalog change under
-- a lock held for milliseconds); the next step scans the rows.
ALTER TABLE {t}
    ADD COLUMN IF NOT EXISTS cancelled_at timestamptz;
{check}"#,
        check = add_check_not_valid(
            n,
            &n.cancel_ck,
            "cancelled_at IS NULL OR acquired_token IS NOT NULL"
        ),
    )
}

fn cancel_validate(n: &Names) -> String {
    validate_step(n, "the cancel mark, step 2 of 2 (SPEC §1.3)", &n.cancel_ck)
}
