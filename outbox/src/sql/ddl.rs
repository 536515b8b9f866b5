//! The migration steps, as SQL scripts of several statements each. The files in
//! the repository's `migrations/` folder are this rendering for the default names, byte for
//! byte (sqlx checksums applied files); `schema/migrate.rs` runs them and a unit test there
//! keeps the files identical.

use sqlx::SqlStr;

use super::text::statement;
use crate::names::{quote_ident, quote_literal, Names};

/// Serialises concurrent migrators of one table: `$1` the table's key; true if taken. Two
/// processes running `CREATE TABLE IF NOT EXISTS` at once can still collide on the catalog;
/// the lock makes them take turns. Transaction-scoped, so it ends with the step. A `try`
/// lock, polled: a statement waiting for the lock would hold a snapshot, which a
/// concurrent index build of the lock's holder would wait for (see `migrate`).
pub(crate) const ADVISORY_TRY_LOCK: &str =
    "SELECT pg_try_advisory_xact_lock(hashtextextended($1, 0))";

/// The same lock held by a session, for a step that runs outside a transaction
/// (`CREATE INDEX CONCURRENTLY`); released by [`ADVISORY_UNLOCK`] or when the session ends.
pub(crate) const ADVISORY_TRY_SESSION_LOCK: &str =
    "SELECT pg_try_advisory_lock(hashtextextended($1, 0))";

/// Releases [`ADVISORY_TRY_SESSION_LOCK`].
pub(crate) const ADVISORY_UNLOCK: &str = "SELECT pg_advisory_unlock(hashtextextended($1, 0))";

/// One rendered step: sqlx-style version, description and script, how it runs, and how the
/// catalog shows it has been applied.
#[derive(Debug)]
pub(crate) struct Step {
    pub version: i64,
    pub description: &'static str,
    pub script: SqlStr,
    /// False for a step that must run outside a transaction (`CREATE INDEX CONCURRENTLY`);
    /// its file starts with sqlx's `-- no-transaction` marker.
    pub transaction: bool,
    /// What the catalog holds once the step has been applied.
    pub done: Done,
    /// For a step outside a transaction: the same change as one statement inside a
    /// transaction, used when the table was created by the same `migrate()` call (a brand
    /// new table has no readers whose snapshots a concurrent build would wait for).
    pub fresh_script: Option<SqlStr>,
}

impl Step {
    /// Whether the step only upgrades the dead-letter table (its columns or indexes).
    pub(crate) fn dead_letter_only(&self) -> bool {
        matches!(
            self.done,
            Done::Columns {
                table: Table::DeadLetter,
                ..
            } | Done::Index {
                table: Table::DeadLetter,
                ..
            }
        )
    }
}

/// Which table a catalog fact is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Table {
    Queue,
    DeadLetter,
    /// The table of paused queues.
    Paused,
}

/// What the catalog holds once a step has been applied, so that `migrate()` can skip an
/// applied step by reading the catalog only, without its DDL's table locks: catalog reads
/// take no lock on the tables they describe, so an up-to-date schema never queues behind a
/// long transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Done {
    /// Both tables exist, with every index and the lease CHECK of the base shape.
    Base {
        queue_indexes: Vec<String>,
        dlq_indexes: Vec<String>,
        check: String,
    },
    /// These columns exist on the table, and the named CHECK exists (validated or not).
    ColumnsAndCheck {
        table: Table,
        columns: &'static [&'static str],
        check: String,
    },
    /// The named CHECK exists on the table and is validated.
    Validated { table: Table, check: String },
    /// The table exists.
    Exists { table: Table },
    /// These columns exist on the table.
    Columns {
        table: Table,
        columns: &'static [&'static str],
    },
    /// The named index exists on the table and is valid (an interrupted concurrent build
    /// leaves it INVALID: the step then drops and builds it again).
    Index { table: Table, name: String },
    /// Storage settings: applied once. The step counts as applied when it is recorded, or
    /// when the table already sets any of these parameters (an operator's own choice wins
    /// and is never overwritten).
    Settings {
        table: Table,
        parameters: &'static [&'static str],
    },
}

/// The per-table autovacuum parameters step 0008 sets (see `autovacuum_settings`).
pub(crate) const AUTOVACUUM_PARAMETERS: &[&str] = &[
    "autovacuum_vacuum_threshold",
    "autovacuum_vacuum_scale_factor",
    "autovacuum_vacuum_insert_threshold",
    "autovacuum_vacuum_insert_scale_factor",
    "autovacuum_analyze_threshold",
    "autovacuum_analyze_scale_factor",
    "autovacuum_vacuum_cost_delay",
];

#[derive(Debug)]
pub(crate) struct Ddl {
    /// In order; each runs on its own (a transaction each, or none for a concurrent index).
    pub steps: Vec<Step>,
    /// Creates the table that records applied steps.
    pub versions_create: SqlStr,
    /// `$1` version, `$2` description, `$3` found already applied: records a step.
    pub versions_record: SqlStr,
    /// The recorded steps: `(version, description, applied_at, found)` by version.
    pub versions_list: SqlStr,
    /// Drops an INVALID index left by an interrupted concurrent build (outside a
    /// transaction, concurrently): one statement per index name, rendered on demand.
    drop_invalid: Vec<(String, SqlStr)>,
}

impl Ddl {
    pub(crate) fn render(n: &Names) -> Self {
        let step = |version, description, script: String, done| Step {
            version,
            description,
            transaction: !script.starts_with("-- no-transaction"),
            script: statement(&script),
            done,
            fresh_script: None,
        };
        let rearm_check = n.rearm_ck.clone();
        let cancel_check = n.cancel_ck.clone();
        let versions = &n.qversions;
        Ddl {
            steps: vec![
                step(
                    20240101000001,
                    "outbox_base",
                    match n.buckets {
                        None => base(n),
                        Some(_) => distributed_base(n),
                    },
                    Done::Base {
                        queue_indexes: vec![
                            n.pending_idx.clone(),
                            n.lease_idx.clone(),
                            n.timer_uq.clone(),
                        ],
                        dlq_indexes: vec![n.dlq_idx.clone()],
                        check: n.lease_ck.clone(),
                    },
                ),
                step(
                    20240101000002,
                    "outbox_rearm_columns",
                    rearm_columns(n),
                    Done::ColumnsAndCheck {
                        table: Table::Queue,
                        columns: &["rearm_at", "rearm_payload", "rearm_headers"],
                        check: rearm_check.clone(),
                    },
                ),
                step(
                    20240101000003,
                    "outbox_rearm_validate",
                    rearm_validate(n),
                    Done::Validated {
                        table: Table::Queue,
                        check: rearm_check,
                    },
                ),
                step(
                    20240101000004,
                    "outbox_cancel_columns",
                    cancel_columns(n),
                    Done::ColumnsAndCheck {
                        table: Table::Queue,
                        columns: &["cancelled_at"],
                        check: cancel_check.clone(),
                    },
                ),
                step(
                    20240101000005,
                    "outbox_cancel_validate",
                    cancel_validate(n),
                    Done::Validated {
                        table: Table::Queue,
                        check: cancel_check,
                    },
                ),
                step(
                    20240101000006,
                    "outbox_dlq_redrive_columns",
                    dlq_redrive_columns(n),
                    Done::Columns {
                        table: Table::DeadLetter,
                        columns: &["redriven_at", "redriven_id"],
                    },
                ),
                Step {
                    fresh_script: Some(statement(&format!(
                        "CREATE INDEX IF NOT EXISTS {} ON {} (failed_at)",
                        quote_ident(&n.dlq_failed_idx),
                        n.qdlq
                    ))),
                    ..step(
                        20240101000007,
                        "outbox_dlq_failed_at_index",
                        dlq_failed_at_index(n),
                        Done::Index {
                            table: Table::DeadLetter,
                            name: n.dlq_failed_idx.clone(),
                        },
                    )
                },
                step(
                    20240101000008,
                    "outbox_autovacuum_settings",
                    autovacuum_settings(n),
                    Done::Settings {
                        table: Table::Queue,
                        parameters: AUTOVACUUM_PARAMETERS,
                    },
                ),
                step(
                    20240101000009,
                    "outbox_paused_queues",
                    paused_queues(n),
                    Done::Exists {
                        table: Table::Paused,
                    },
                ),
            ],
            versions_create: statement(&format!(
                "CREATE TABLE IF NOT EXISTS {versions} (\
                 version bigint PRIMARY KEY, \
                 description text NOT NULL, \
                 applied_at timestamptz NOT NULL DEFAULT now(), \
                 found boolean NOT NULL DEFAULT false)"
            )),
            versions_record: statement(&format!(
                "INSERT INTO {versions} (version, description, found) VALUES ($1, $2, $3) \
                 ON CONFLICT (version) DO NOTHING"
            )),
            versions_list: statement(&format!(
                "SELECT version, description, applied_at, found FROM {versions} ORDER BY version"
            )),
            drop_invalid: [&n.dlq_failed_idx]
                .into_iter()
                .map(|name| {
                    let qualified = match n.schema_prefix() {
                        Some(s) => format!("{s}.{}", quote_ident(name)),
                        None => quote_ident(name),
                    };
                    (
                        name.clone(),
                        statement(&format!("DROP INDEX CONCURRENTLY IF EXISTS {qualified}")),
                    )
                })
                .collect(),
        }
    }

    /// The statement that drops the index `name` concurrently, if it is one a step builds.
    pub(crate) fn drop_index(&self, name: &str) -> Option<SqlStr> {
        self.drop_invalid
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, sql)| sql.clone())
    }

    #[cfg(any(test, feature = "testing"))]
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

/// Distributed mode (Citus): the whole current shape at once, as distributed tables (a new
/// mode has no older deployments to upgrade), so the later steps find their pieces in the
/// catalog and are recorded without running. The queue and dead-letter tables are
/// distributed by `bucket` and co-located; the table of paused queues is a reference table
/// (a copy on every node, so the claim's join with it stays on one node). A unique index
/// of a distributed table must hold the distribution column: `bucket` leads every index,
/// and a keyed timer's bucket is a function of its key, so `(bucket, queue, timer_id)` is
/// unique exactly when `(queue, timer_id)` is. Queue row ids are `nextval * buckets +
/// bucket`, so an id names its bucket; the sequences are the id columns' defaults, which
/// makes Citus create them on the worker nodes too (with a range of values of each node's
/// own, for a statement Citus runs on a worker). A dead letter's id is the plain default.
fn distributed_base(n: &Names) -> String {
    let t = &n.qtable;
    let d = &n.qdlq;
    let count = n.buckets.map_or(1, |b| b.count());
    format!(
        r#"-- outbox: the distributed shape (Citus), every column and index of the single-node steps.
CREATE SEQUENCE IF NOT EXISTS {seq} AS bigint;
CREATE TABLE IF NOT EXISTS {t} (
    bucket smallint NOT NULL,
    -- The bucket count of the process that inserted the row: the CHECK refuses a process
    -- built with another count, whose keyed timers would land in other buckets.
    buckets smallint NOT NULL,
    id bigint NOT NULL DEFAULT nextval({seq_lit}),
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
    rearm_at timestamptz,
    rearm_payload bytea,
    rearm_headers jsonb,
    cancelled_at timestamptz,
    PRIMARY KEY (bucket, id),
    CONSTRAINT {bucket_ck} CHECK (bucket >= 0 AND bucket < {count} AND buckets = {count}),
    CONSTRAINT {lease_ck} CHECK ((acquired_token IS NULL) = (acquired_at IS NULL)),
    CONSTRAINT {rearm_ck} CHECK (rearm_at IS NULL OR acquired_token IS NOT NULL),
    CONSTRAINT {cancel_ck} CHECK (cancelled_at IS NULL OR acquired_token IS NOT NULL)
) WITH (fillfactor = 70);
CREATE INDEX IF NOT EXISTS {pending_idx} ON {t} (bucket, queue, next_attempt_at) WHERE acquired_token IS NULL;
CREATE INDEX IF NOT EXISTS {lease_idx} ON {t} (bucket, queue, acquired_at) WHERE acquired_token IS NOT NULL;
CREATE UNIQUE INDEX IF NOT EXISTS {timer_uq} ON {t} (bucket, queue, timer_id) WHERE timer_id IS NOT NULL;

CREATE SEQUENCE IF NOT EXISTS {dseq} AS bigint;
CREATE TABLE IF NOT EXISTS {d} (
    bucket smallint NOT NULL,
    id bigint NOT NULL DEFAULT nextval({dseq_lit}),
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
    last_error text,
    redriven_at timestamptz,
    redriven_id bigint,
    PRIMARY KEY (bucket, id)
);
CREATE INDEX IF NOT EXISTS {dlq_idx} ON {d} (bucket, queue, failed_at);
CREATE INDEX IF NOT EXISTS {dlq_failed_idx} ON {d} (bucket, failed_at);

CREATE TABLE IF NOT EXISTS {p} (
    queue varchar(255) PRIMARY KEY,
    paused_at timestamptz NOT NULL DEFAULT now()
);

DO $outbox$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_dist_partition WHERE logicalrelid = {tlit}::regclass) THEN
        PERFORM create_distributed_table({tlit}, 'bucket');
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_dist_partition WHERE logicalrelid = {dlit}::regclass) THEN
        PERFORM create_distributed_table({dlit}, 'bucket', colocate_with => {tlit});
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_dist_partition WHERE logicalrelid = {plit}::regclass) THEN
        PERFORM create_reference_table({plit});
    END IF;
END
$outbox$;
"#,
        seq = n.qid_seq,
        dseq = n.qdlq_id_seq,
        seq_lit = quote_literal(&n.qid_seq),
        dseq_lit = quote_literal(&n.qdlq_id_seq),
        p = n.qpaused,
        bucket_ck = quote_ident(&n.bucket_ck),
        lease_ck = quote_ident(&n.lease_ck),
        rearm_ck = quote_ident(&n.rearm_ck),
        cancel_ck = quote_ident(&n.cancel_ck),
        pending_idx = quote_ident(&n.pending_idx),
        lease_idx = quote_ident(&n.lease_idx),
        timer_uq = quote_ident(&n.timer_uq),
        dlq_idx = quote_ident(&n.dlq_idx),
        dlq_failed_idx = quote_ident(&n.dlq_failed_idx),
        tlit = n.table_literal(),
        dlit = quote_literal(&n.qdlq),
        plit = quote_literal(&n.qpaused),
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

fn dlq_redrive_columns(n: &Names) -> String {
    format!(
        r#"-- outbox: dead-letter redrive (SPEC §1.2).
-- When a dead letter is re-published, `redriven_at` and `redriven_id` (the new queue row)
-- link it to its new life, so a row is redriven once. Nullable columns without defaults:
-- no table rewrite, a catalog change under a lock held for milliseconds.
ALTER TABLE {d}
    ADD COLUMN IF NOT EXISTS redriven_at timestamptz,
    ADD COLUMN IF NOT EXISTS redriven_id bigint;
"#,
        d = n.qdlq,
    )
}

fn autovacuum_settings(n: &Names) -> String {
    format!(
        r#"-- outbox: autovacuum settings for the queue table (docs/performance.md, "Autovacuum").
-- Every message is inserted, updated when claimed and deleted when acked; every extend and
-- every renewal writes a new row version. The defaults vacuum a table once 20 % of its live
-- rows are dead: with 100 000 live timers, 20 000 dead versions that every claim's index
-- scan walks over first. Here a vacuum starts after 1 000 dead versions plus 1 % of the live
-- rows, runs unthrottled (the table is hot and small next to what it churns), and the
-- statistics follow a burst of inserts after 1 000 rows plus 2 %. Storage parameters only:
-- a catalog change under a SHARE UPDATE EXCLUSIVE lock, which reads and writes do not wait
-- for. Applied once: an operator's later change to any of these is kept.
ALTER TABLE {t} SET (
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_insert_threshold = 1000,
    autovacuum_vacuum_insert_scale_factor = 0.01,
    autovacuum_analyze_threshold = 1000,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_delay = 0
);
"#,
        t = n.qtable,
    )
}

fn dlq_failed_at_index(n: &Names) -> String {
    format!(
        r#"-- no-transaction
-- outbox: purges of dead letters by age (SPEC §1.2). Built CONCURRENTLY, outside a
-- transaction, so writes to the table go on during the build (it waits for every older
-- snapshot in the database first). An interrupted build leaves an INVALID index, which
-- `outbox::migrate` drops and builds again.
CREATE INDEX CONCURRENTLY IF NOT EXISTS {idx} ON {d} (failed_at);
"#,
        idx = quote_ident(&n.dlq_failed_idx),
        d = n.qdlq,
    )
}

fn paused_queues(n: &Names) -> String {
    format!(
        r#"-- outbox: paused queues (SPEC §1, §8).
-- One row per paused queue: a claim finds no row of a queue listed here, publishing goes on.
-- The claim reads this table inside its one statement, so a pause holds from the next claim
-- on. A new table: creating it takes no lock on the queue table.
CREATE TABLE IF NOT EXISTS {p} (
    queue varchar(255) PRIMARY KEY,
    paused_at timestamptz NOT NULL DEFAULT now()
);
"#,
        p = n.qpaused,
    )
}
