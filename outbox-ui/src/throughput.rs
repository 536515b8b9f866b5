//! Rows finished per queue: a counter table beside the queue table
//! (`<table>_finished`), kept by a statement-level `AFTER DELETE` trigger on the queue
//! table, which the operator installs on purpose ([`Dashboard::install_throughput_counter`](crate::Dashboard::install_throughput_counter),
//! `outbox ui --throughput-counter`).
//!
//! Why a trigger and not the library's own statements: a row leaves the queue table by a
//! `DELETE` in a dozen statements of the library (the single and batched ack and their
//! settle statements, a retry or fail of a cancelled row, the dead-letter archive, release,
//! cancel, `delete_pending`) and each would need its own counting CTE, its statement
//! snapshots, the gate's counts and a distributed variant. One trigger sees every one of
//! them, costs nothing where it is not installed, and is removed in one call.
//!
//! Each deleting statement adds, per queue it deleted rows of, one upsert of the row
//! `(queue, its backend's pid, this minute)`: only that backend ever writes that row, so
//! completers never wait on each other's counter (and two transactions that delete rows of
//! two queues in opposite orders cannot deadlock on it). Rows older than
//! [`KEEP_MINUTES`] are pruned by the trigger when it starts a new minute's row, skipping any
//! row another transaction holds.

use chrono::{DateTime, Utc};
use outbox::Outbox;
use sqlx::{AssertSqlSafe, PgConnection, PgPool, Row};

/// The counter table's comment, then the install instant in seconds since 1970.
pub(crate) const INSTALLED_PREFIX: &str = "outbox-ui throughput counter, counting since epoch ";

/// How many minutes of counts the table keeps.
pub(crate) const KEEP_MINUTES: i64 = 60;

/// The window of the per-queue rate on the queues page: the current minute and the
/// `WINDOW_MINUTES - 1` before it.
pub(crate) const WINDOW_MINUTES: i64 = 5;

/// The counter's names, derived from the queue table's as the library derives
/// `<table>_paused`.
#[derive(Debug, Clone)]
pub(crate) struct Names {
    /// `<schema>."<table>_finished"`, quoted.
    pub table: String,
    /// `<schema>."<table>_finished_count"`, the trigger's function, quoted.
    function: String,
    /// `"<table>_finished_trg"`, quoted, unqualified (a trigger belongs to its table).
    trigger: String,
}

impl Names {
    pub(crate) fn of(outbox: &Outbox) -> Self {
        // `paused_table()` is `[<schema>.]"<table>_paused"`: the library already checked that
        // `<table>_schema_migrations` fits in 63 bytes, so these shorter suffixes fit too.
        let paused = outbox.paused_table();
        let stem = paused.strip_suffix("_paused\"").unwrap_or(paused);
        let bare = match stem.rfind(".\"") {
            Some(i) => &stem[i + 1..],
            None => stem,
        };
        Names {
            table: format!("{stem}_finished\""),
            function: format!("{stem}_finished_count\""),
            trigger: format!("{bare}_finished_trg\""),
        }
    }
}

/// `schema`: the queue table's schema, quoted: the function names its table with it, since
/// it runs with a fixed `search_path`.
fn install_statements(outbox: &Outbox, n: &Names, schema: &str) -> Vec<String> {
    let t = outbox.table();
    let Names {
        table: c,
        function: f,
        trigger: g,
    } = n;
    let bare = match c.rfind(".\"") {
        Some(i) => &c[i + 1..],
        None => c.as_str(),
    };
    let qc = format!("{schema}.{bare}");
    let qc_literal = qc.replace('\'', "''");
    vec![
        // Waiting long for the queue table's lock would stall every worker queued behind it.
        "SET LOCAL lock_timeout = '5s'".to_owned(),
        format!(
            "CREATE TABLE IF NOT EXISTS {c} (queue text NOT NULL, backend int NOT NULL, \
             minute timestamptz NOT NULL, finished bigint NOT NULL, \
             PRIMARY KEY (queue, minute, backend))"
        ),
        format!(
            // SECURITY DEFINER: the function writes the counter as its owner (who installed
            // it), so a role that may delete queue rows (a worker's) needs no right on the
            // counter table, and an ack never fails for want of one. Its search_path is
            // fixed, as such a function's must be.
            r#"CREATE OR REPLACE FUNCTION {f}() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
    fresh boolean;
BEGIN
    -- The counter table dropped alone (not by remove_throughput_counter) must never fail
    -- the queue's acks: without it the trigger counts nothing.
    IF to_regclass('{qc_literal}') IS NULL THEN
        RETURN NULL;
    END IF;
    -- One row per (queue, backend, minute): no other backend ever waits on it.
    WITH up AS (
        INSERT INTO {qc} AS c (queue, backend, minute, finished)
        SELECT queue::text, pg_backend_pid(), date_trunc('minute', now()), count(*)
        FROM done GROUP BY queue ORDER BY queue
        ON CONFLICT (queue, minute, backend) DO UPDATE SET finished = c.finished + excluded.finished
        RETURNING xmax = 0 AS inserted)
    SELECT coalesce(bool_or(inserted), false) INTO fresh FROM up;
    IF fresh THEN
        DELETE FROM {qc} WHERE ctid IN (
            SELECT ctid FROM {qc} WHERE minute < date_trunc('minute', now()) - interval '{KEEP_MINUTES} minutes'
            FOR UPDATE SKIP LOCKED);
    END IF;
    RETURN NULL;
END
$fn$"#
        ),
        format!(
            "CREATE OR REPLACE TRIGGER {g} AFTER DELETE ON {t} \
             REFERENCING OLD TABLE AS done FOR EACH STATEMENT EXECUTE FUNCTION {f}()"
        ),
        // When the counter started counting (kept by a new install, not reset by a repeated
        // one): the rate averages only over the time since, never over minutes before it.
        format!(
            "DO $do$ BEGIN IF coalesce(obj_description(to_regclass('{c_literal}'), 'pg_class'), '') \
             NOT LIKE '{INSTALLED_PREFIX}%' THEN EXECUTE format('COMMENT ON TABLE %s IS %L', \
             '{c_literal}', '{INSTALLED_PREFIX}' || extract(epoch FROM now())::text); END IF; END $do$",
            c_literal = c.replace('\'', "''"),
        ),
    ]
}

/// Creates (or replaces) the counter table, its function and the trigger, in one
/// transaction.
pub(crate) async fn install(outbox: &Outbox, pool: &PgPool) -> Result<(), crate::error::UiError> {
    let n = Names::of(outbox);
    let mut tx = pool.begin().await?;
    let schema: Option<String> = sqlx::query_scalar(
        "SELECT quote_ident(n.nspname) FROM pg_class c \
         JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = to_regclass($1)",
    )
    .bind(outbox.table())
    .fetch_optional(&mut *tx)
    .await?;
    let Some(schema) = schema else {
        return Err(crate::error::UiError::NoQueueTable {
            table: outbox.table().to_owned(),
        });
    };
    for s in install_statements(outbox, &n, &schema) {
        sqlx::raw_sql(AssertSqlSafe(s)).execute(&mut *tx).await?;
    }
    Ok(tx.commit().await?)
}

/// Drops the trigger, its function and the counter table.
pub(crate) async fn remove(outbox: &Outbox, pool: &PgPool) -> sqlx::Result<()> {
    let n = Names::of(outbox);
    let t = outbox.table();
    let mut tx = pool.begin().await?;
    for s in [
        "SET LOCAL lock_timeout = '5s'".to_owned(),
        format!("DROP TRIGGER IF EXISTS {} ON {t}", n.trigger),
        format!("DROP FUNCTION IF EXISTS {}()", n.function),
        format!("DROP TABLE IF EXISTS {}", n.table),
    ] {
        sqlx::raw_sql(AssertSqlSafe(s)).execute(&mut *tx).await?;
    }
    tx.commit().await
}

/// What the queues page shows: each queue's rows finished per minute over the window
/// (oldest first, [`WINDOW_MINUTES`] of them), and when the counter started counting.
#[derive(Debug, Clone)]
pub(crate) struct Rates {
    pub(crate) per_minute: std::collections::BTreeMap<String, Vec<i64>>,
    /// The start of the window's first minute.
    start: DateTime<Utc>,
    now: DateTime<Utc>,
    /// When the counter was installed (`None` for one installed before this was kept).
    installed: Option<DateTime<Utc>>,
}

impl Rates {
    /// How long the counter must have counted before a rate is shown.
    pub(crate) const FIRST: chrono::Duration = chrono::Duration::seconds(60);

    /// Rows of `queue` finished per second over the window, or over the time since the
    /// counter was installed when that is shorter; `None` during its first minute (too
    /// little time to tell).
    pub(crate) fn per_second(&self, queue: &str) -> Option<f64> {
        if self.installed.is_some_and(|at| self.now - at < Self::FIRST) {
            return None;
        }
        let from = self.installed.map_or(self.start, |at| at.max(self.start));
        let span = (self.now - from).num_milliseconds() as f64 / 1000.0;
        if span <= 0.0 {
            return None;
        }
        let total: i64 = self.per_minute.get(queue).map_or(0, |m| m.iter().sum());
        Some(total as f64 / span)
    }

    /// Rows of `queue` finished per minute, oldest first; `None` for a minute that ended
    /// before the counter was installed (it counted nothing then).
    pub(crate) fn minutes(&self, queue: &str) -> Vec<Option<f64>> {
        let counts = self.per_minute.get(queue);
        (0..WINDOW_MINUTES)
            .map(|i| {
                let end = self.start + chrono::Duration::minutes(i + 1);
                if self.installed.is_some_and(|at| at >= end) {
                    return None;
                }
                let i = usize::try_from(i).unwrap_or(0);
                Some(counts.and_then(|c| c.get(i)).copied().unwrap_or(0) as f64)
            })
            .collect()
    }

    /// When the counter was installed, if known.
    pub(crate) fn installed(&self) -> Option<DateTime<Utc>> {
        self.installed
    }
}

/// Reads the counter, if installed (its table and its trigger on the queue table).
pub(crate) async fn read(outbox: &Outbox, conn: &mut PgConnection) -> sqlx::Result<Option<Rates>> {
    let n = Names::of(outbox);
    let installed: bool = sqlx::query_scalar(
        "SELECT to_regclass($1) IS NOT NULL AND EXISTS (SELECT 1 FROM pg_trigger \
         WHERE tgrelid = to_regclass($2) AND tgname = $3 AND tgenabled <> 'D')",
    )
    .bind(&n.table)
    .bind(outbox.table())
    .bind(n.trigger.trim_matches('"').replace("\"\"", "\""))
    .persistent(!outbox.transaction_pooler())
    .fetch_one(&mut *conn)
    .await?;
    if !installed {
        return Ok(None);
    }
    let head = sqlx::query(AssertSqlSafe(format!(
        "SELECT date_trunc('minute', now()) - interval '{back} minutes', now(), \
         obj_description(to_regclass($1), 'pg_class')",
        back = WINDOW_MINUTES - 1,
    )))
    .bind(&n.table)
    .persistent(!outbox.transaction_pooler())
    .fetch_one(&mut *conn)
    .await?;
    let comment: Option<String> = head.try_get(2)?;
    let mut rates = Rates {
        per_minute: std::collections::BTreeMap::new(),
        start: head.try_get(0)?,
        now: head.try_get(1)?,
        installed: comment
            .as_deref()
            .and_then(|c| c.strip_prefix(INSTALLED_PREFIX))
            .and_then(|e| e.trim().parse::<f64>().ok())
            .and_then(|e| DateTime::from_timestamp_micros((e * 1e6) as i64)),
    };
    // The primary key leads with the queue; the table holds at most an hour of minutes per
    // queue and backend, so the sum reads it whole.
    let rows = sqlx::query(AssertSqlSafe(format!(
        "SELECT queue, (extract(epoch FROM minute - date_trunc('minute', now())) / 60)::int, \
         sum(finished)::bigint \
         FROM {c} WHERE minute > date_trunc('minute', now()) - interval '{m} minutes' \
         GROUP BY 1, 2",
        c = n.table,
        m = WINDOW_MINUTES,
    )))
    .persistent(!outbox.transaction_pooler())
    .fetch_all(&mut *conn)
    .await?;
    for r in &rows {
        let queue: String = r.try_get(0)?;
        let minute: i32 = r.try_get(1)?;
        let count: i64 = r.try_get(2)?;
        let series = rates
            .per_minute
            .entry(queue)
            .or_insert_with(|| vec![0; WINDOW_MINUTES as usize]);
        // minute is 0 for the current one, -1 for the one before, …
        let slot = (WINDOW_MINUTES - 1) + i64::from(minute);
        if let Some(x) = usize::try_from(slot).ok().and_then(|i| series.get_mut(i)) {
            *x += count;
        }
    }
    Ok(Some(rates))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_queue_table() {
        let o = Outbox::builder().table("jobs").build().unwrap();
        let n = Names::of(&o);
        assert!(n.table.ends_with("\"jobs_finished\""), "{}", n.table);
        assert!(
            n.function.ends_with("\"jobs_finished_count\""),
            "{}",
            n.function
        );
        assert_eq!(n.trigger, "\"jobs_finished_trg\"");
        let o = Outbox::builder()
            .schema("ops")
            .table("jobs")
            .build()
            .unwrap();
        let n = Names::of(&o);
        assert_eq!(n.table, "\"ops\".\"jobs_finished\"");
        assert_eq!(n.trigger, "\"jobs_finished_trg\"");
    }
}
