//! The dashboard's own statements (reads only: every write is the library's), rendered once
//! per dashboard from the `Outbox`'s quoted table names, and the rows they return. Each one
//! reaches the queue table through an index (`<table>_pending_idx`, `<table>_lease_idx`,
//! the primary key or `<table>_timer_uq`); the tests below check their plans with
//! `EXPLAIN` on a table whose statistics are stale.

use chrono::{DateTime, Utc};
use outbox::Outbox;
use sqlx::postgres::PgRow;
use sqlx::{AssertSqlSafe, PgConnection, Row, SqlSafeStr, SqlStr};

/// The columns of a row in a list: no payload, its size.
const LIST: &str = "id, timer_id, next_attempt_at, acquired_at, attempts_count, \
    deliveries_count, rearm_at, cancelled_at, octet_length(payload) AS payload_bytes";

/// Which live rows a queue page lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StateFilter {
    All,
    Pending,
    Due,
    Leased,
}

impl StateFilter {
    pub(crate) const EVERY: [StateFilter; 4] = [
        StateFilter::All,
        StateFilter::Pending,
        StateFilter::Due,
        StateFilter::Leased,
    ];

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            StateFilter::All => "all",
            StateFilter::Pending => "pending",
            StateFilter::Due => "due",
            StateFilter::Leased => "leased",
        }
    }

    pub(crate) fn parse(s: &str) -> Option<Self> {
        Self::EVERY.into_iter().find(|f| f.as_str() == s)
    }
}

#[derive(Debug)]
pub(crate) struct Statements {
    /// `$1` queue, `$2` after deadline, `$3` after id, `$4` limit: one statement per
    /// [`StateFilter`], in the order of [`StateFilter::EVERY`].
    pub list: [SqlStr; 4],
    /// `$1` id: one live row, every column, and `now()`.
    pub row: SqlStr,
    /// `$1` queue, `$2` timer id: the live row's id.
    pub by_timer: SqlStr,
    /// `$1 text[]` queues, `$2` cap: due rows of each, counted up to the cap.
    pub due: SqlStr,
    /// `$1` queue table, `$2` dead-letter table (quoted names): their sizes in bytes, the
    /// queue table's finished-rows counter, and `now()`.
    pub sizes: SqlStr,
    /// `$1` queue: whether the queue has a live row (the pause hint).
    pub any: SqlStr,
    /// Whether the database's default collation orders text byte by byte (`C`, `POSIX`,
    /// `C.UTF-8`), so that a key prefix is one range of the timer key's index.
    pub bytewise: SqlStr,
    /// `$1` limit per queue: the periodic schedules' rows (timer key `schedule:<name>`) of
    /// every queue with keyed timers, found by a skip scan of `<table>_timer_uq` (one probe
    /// per queue), each queue's read as one index range of the prefix. For byte-ordered
    /// collations only (see `bytewise`).
    pub schedules_range: SqlStr,
    /// As `schedules_range`, for other collations: each queue's keyed timers filtered by the
    /// prefix (its cost grows with the queue's keyed timers).
    pub schedules_filter: SqlStr,
}

fn statement(text: String) -> SqlStr {
    // Safe: our own text and the identifiers `Outbox` quoted; every value is bound.
    AssertSqlSafe(text).into_sql_str()
}

impl Statements {
    pub(crate) fn render(outbox: &Outbox) -> Self {
        let t = outbox.table();
        let branch = |cond: &str| {
            format!(
                "SELECT {LIST} FROM {t} WHERE queue = $1 AND {cond} \
                 AND (next_attempt_at, id) > ($2, $3) ORDER BY next_attempt_at, id LIMIT $4"
            )
        };
        let pending = branch("acquired_token IS NULL");
        let due = branch("acquired_token IS NULL AND next_attempt_at <= now()");
        let leased = branch("acquired_token IS NOT NULL");
        // Both partial indexes, each branch stopped at the limit, then merged.
        let all = format!(
            "SELECT * FROM (({pending}) UNION ALL ({leased})) AS r \
             ORDER BY next_attempt_at, id LIMIT $4"
        );
        let schedules = |range: &str| {
            let header = outbox::store::SCHEDULE_HEADER;
            let prefix = outbox::store::SCHEDULE_KEY_PREFIX;
            format!(
                "WITH RECURSIVE qs(queue) AS ( \
                   (SELECT queue FROM {t} WHERE timer_id IS NOT NULL ORDER BY queue LIMIT 1) \
                   UNION ALL \
                   SELECT (SELECT n.queue FROM {t} AS n WHERE n.timer_id IS NOT NULL \
                           AND n.queue > qs.queue ORDER BY n.queue LIMIT 1) \
                   FROM qs WHERE qs.queue IS NOT NULL) \
                 SELECT r.id, r.queue, r.timer_id, r.next_attempt_at, r.last_attempt_at, \
                        r.acquired_at, r.rearm_at, r.cancelled_at, r.fingerprint, \
                        r.attempts_count \
                 FROM qs, LATERAL (SELECT id, queue, timer_id, next_attempt_at, \
                        last_attempt_at, acquired_at, rearm_at, cancelled_at, \
                        headers ->> '{header}' AS fingerprint, attempts_count FROM {t} \
                        WHERE queue = qs.queue AND timer_id IS NOT NULL {range} \
                        AND starts_with(timer_id, '{prefix}') ORDER BY timer_id LIMIT $1) AS r \
                 WHERE qs.queue IS NOT NULL ORDER BY r.queue, r.timer_id"
            )
        };
        // The prefix's range in byte order: from `schedule:` up to `schedule;`, the first
        // text after every key with the prefix (its last byte plus one).
        let prefix = outbox::store::SCHEDULE_KEY_PREFIX;
        let mut upper = prefix.as_bytes().to_vec();
        if let Some(last) = upper.last_mut() {
            *last += 1;
        }
        let upper = String::from_utf8_lossy(&upper).into_owned();
        let range = format!("AND timer_id >= '{prefix}' AND timer_id < '{upper}'");
        Statements {
            bytewise: statement("SELECT 'B' < 'a' AND 'a;' > 'a:~' AND 'a:' < 'a:!'".to_owned()),
            schedules_range: statement(schedules(&range)),
            schedules_filter: statement(schedules("")),
            list: [
                statement(all),
                statement(pending),
                statement(due),
                statement(leased),
            ],
            row: statement(format!(
                "SELECT id, queue, payload, headers, attempts_count, deliveries_count, \
                 created_at, next_attempt_at, first_attempt_at, last_attempt_at, acquired_at, \
                 acquired_token, timer_id, rearm_at, rearm_payload, rearm_headers, \
                 cancelled_at, now() AS now FROM {t} WHERE id = $1"
            )),
            by_timer: statement(format!(
                "SELECT id FROM {t} WHERE queue = $1 AND timer_id = $2"
            )),
            due: statement(format!(
                "SELECT q, (SELECT count(*) FROM (SELECT 1 FROM {t} WHERE queue = q \
                 AND acquired_token IS NULL AND next_attempt_at <= now() LIMIT $2) AS d) \
                 FROM unnest($1::text[]) AS q"
            )),
            sizes: statement(
                "SELECT coalesce(pg_total_relation_size(to_regclass($1)), 0), \
                 coalesce(pg_total_relation_size(to_regclass($2)), 0), \
                 coalesce((SELECT n_tup_del FROM pg_stat_user_tables \
                           WHERE relid = to_regclass($1)), 0), now()"
                    .to_owned(),
            ),
            // Scalar subqueries ordered as the partial indexes are, so each probe is one
            // index entry whatever the planner thinks of the queue's size (an EXISTS would
            // drop the ORDER BY and LIMIT, and a seq scan may then look cheaper).
            any: statement(format!(
                "SELECT (SELECT id FROM {t} WHERE queue = $1 AND acquired_token IS NULL \
                 ORDER BY next_attempt_at LIMIT 1) IS NOT NULL \
                 OR (SELECT id FROM {t} WHERE queue = $1 AND acquired_token IS NOT NULL \
                 ORDER BY acquired_at LIMIT 1) IS NOT NULL"
            )),
        }
    }
}

/// A live row as a queue page lists it.
#[derive(Debug, Clone)]
pub(crate) struct ListedRow {
    pub id: i64,
    pub timer_id: Option<String>,
    pub next_attempt_at: DateTime<Utc>,
    pub acquired_at: Option<DateTime<Utc>>,
    pub attempts: i32,
    pub deliveries: i32,
    pub rearm_at: Option<DateTime<Utc>>,
    pub cancelled_at: Option<DateTime<Utc>>,
    pub payload_bytes: i32,
}

impl ListedRow {
    fn from_row(r: &PgRow) -> sqlx::Result<Self> {
        Ok(ListedRow {
            id: r.try_get(0)?,
            timer_id: r.try_get(1)?,
            next_attempt_at: r.try_get(2)?,
            acquired_at: r.try_get(3)?,
            attempts: r.try_get(4)?,
            deliveries: r.try_get(5)?,
            rearm_at: r.try_get(6)?,
            cancelled_at: r.try_get(7)?,
            payload_bytes: r.try_get(8)?,
        })
    }
}

/// One live row, every column.
#[derive(Debug, Clone)]
pub(crate) struct FullRow {
    pub id: i64,
    pub queue: String,
    pub payload: Vec<u8>,
    pub headers: Option<serde_json::Value>,
    pub attempts: i32,
    pub deliveries: i32,
    pub created_at: DateTime<Utc>,
    pub next_attempt_at: DateTime<Utc>,
    pub first_attempt_at: Option<DateTime<Utc>>,
    pub last_attempt_at: Option<DateTime<Utc>>,
    pub acquired_at: Option<DateTime<Utc>>,
    pub acquired_token: Option<uuid::Uuid>,
    pub timer_id: Option<String>,
    pub rearm_at: Option<DateTime<Utc>>,
    pub rearm_payload: Option<Vec<u8>>,
    pub rearm_headers: Option<serde_json::Value>,
    pub cancelled_at: Option<DateTime<Utc>>,
    pub now: DateTime<Utc>,
}

fn persistent(outbox: &Outbox) -> bool {
    // Through a pooler in transaction mode, statements go unnamed (as the library's do).
    !outbox.transaction_pooler()
}

/// The database's clock (`now()`): what relative ages are measured against.
pub(crate) async fn now(outbox: &Outbox, conn: &mut PgConnection) -> sqlx::Result<DateTime<Utc>> {
    sqlx::query_scalar("SELECT now()")
        .persistent(persistent(outbox))
        .fetch_one(conn)
        .await
}

/// A page of `queue`'s live rows after `(after_at, after_id)` in deadline order.
pub(crate) async fn list(
    sql: &Statements,
    outbox: &Outbox,
    conn: &mut PgConnection,
    filter: StateFilter,
    queue: &str,
    after: Option<(DateTime<Utc>, i64)>,
    limit: i64,
) -> sqlx::Result<Vec<ListedRow>> {
    let index = StateFilter::EVERY
        .iter()
        .position(|f| *f == filter)
        .unwrap_or(0);
    // Before every deadline: 0001-01-01 UTC (Postgres takes no chrono minimum).
    let start = DateTime::from_timestamp(-62_135_596_800, 0).unwrap_or_default();
    let (at, id) = after.unwrap_or((start, 0));
    let rows = sqlx::query(sql.list[index].clone())
        .bind(queue)
        .bind(at)
        .bind(id)
        .bind(limit)
        .persistent(persistent(outbox))
        .fetch_all(conn)
        .await?;
    rows.iter().map(ListedRow::from_row).collect()
}

/// Live row `id`, if there is one.
pub(crate) async fn row(
    sql: &Statements,
    outbox: &Outbox,
    conn: &mut PgConnection,
    id: i64,
) -> sqlx::Result<Option<FullRow>> {
    let Some(r) = sqlx::query(sql.row.clone())
        .bind(id)
        .persistent(persistent(outbox))
        .fetch_optional(conn)
        .await?
    else {
        return Ok(None);
    };
    Ok(Some(FullRow {
        id: r.try_get(0)?,
        queue: r.try_get(1)?,
        payload: r.try_get(2)?,
        headers: r.try_get(3)?,
        attempts: r.try_get(4)?,
        deliveries: r.try_get(5)?,
        created_at: r.try_get(6)?,
        next_attempt_at: r.try_get(7)?,
        first_attempt_at: r.try_get(8)?,
        last_attempt_at: r.try_get(9)?,
        acquired_at: r.try_get(10)?,
        acquired_token: r.try_get(11)?,
        timer_id: r.try_get(12)?,
        rearm_at: r.try_get(13)?,
        rearm_payload: r.try_get(14)?,
        rearm_headers: r.try_get(15)?,
        cancelled_at: r.try_get(16)?,
        now: r.try_get(17)?,
    }))
}

/// The id of the live row of `queue` keyed `timer_id`.
pub(crate) async fn by_timer(
    sql: &Statements,
    outbox: &Outbox,
    conn: &mut PgConnection,
    queue: &str,
    timer_id: &str,
) -> sqlx::Result<Option<i64>> {
    sqlx::query_scalar(sql.by_timer.clone())
        .bind(queue)
        .bind(timer_id)
        .persistent(persistent(outbox))
        .fetch_optional(conn)
        .await
}

/// Due rows of each queue, counted up to `cap`.
pub(crate) async fn due(
    sql: &Statements,
    outbox: &Outbox,
    conn: &mut PgConnection,
    queues: &[String],
    cap: i64,
) -> sqlx::Result<Vec<(String, i64)>> {
    let rows = sqlx::query(sql.due.clone())
        .bind(queues)
        .bind(cap)
        .persistent(persistent(outbox))
        .fetch_all(conn)
        .await?;
    rows.iter()
        .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
        .collect()
}

/// The tables' sizes and counter (see [`Statements::sizes`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sizes {
    pub queue_bytes: i64,
    pub dead_letter_bytes: i64,
    pub finished: i64,
    pub now: DateTime<Utc>,
}

pub(crate) async fn sizes(
    sql: &Statements,
    outbox: &Outbox,
    conn: &mut PgConnection,
) -> sqlx::Result<Sizes> {
    let dlq = outbox
        .dead_letter_enabled()
        .then(|| outbox.dead_letter_table());
    let r = sqlx::query(sql.sizes.clone())
        .bind(outbox.table())
        .bind(dlq)
        .persistent(persistent(outbox))
        .fetch_one(conn)
        .await?;
    Ok(Sizes {
        queue_bytes: r.try_get(0)?,
        dead_letter_bytes: r.try_get(1)?,
        finished: r.try_get(2)?,
        now: r.try_get(3)?,
    })
}

/// Whether `queue` has a live row.
pub(crate) async fn any(
    sql: &Statements,
    outbox: &Outbox,
    conn: &mut PgConnection,
    queue: &str,
) -> sqlx::Result<bool> {
    sqlx::query_scalar(sql.any.clone())
        .bind(queue)
        .persistent(persistent(outbox))
        .fetch_one(conn)
        .await
}

/// A periodic schedule's row.
#[derive(Debug, Clone)]
pub(crate) struct ScheduleRow {
    pub id: i64,
    pub queue: String,
    pub timer_id: String,
    pub next_attempt_at: DateTime<Utc>,
    pub last_attempt_at: Option<DateTime<Utc>>,
    pub acquired_at: Option<DateTime<Utc>>,
    pub rearm_at: Option<DateTime<Utc>>,
    pub cancelled_at: Option<DateTime<Utc>>,
    pub fingerprint: Option<String>,
    pub attempts: i32,
}

/// Every queue's schedules (at most `per_queue` each), and whether the read was one index
/// range per queue (a byte-ordered collation) or a filter of each queue's keyed timers.
pub(crate) async fn schedules(
    sql: &Statements,
    outbox: &Outbox,
    conn: &mut PgConnection,
    per_queue: i64,
) -> sqlx::Result<(Vec<ScheduleRow>, bool)> {
    let bytewise: bool = sqlx::query_scalar(sql.bytewise.clone())
        .persistent(persistent(outbox))
        .fetch_one(&mut *conn)
        .await?;
    let statement = if bytewise {
        sql.schedules_range.clone()
    } else {
        sql.schedules_filter.clone()
    };
    let rows = sqlx::query(statement)
        .bind(per_queue)
        .persistent(persistent(outbox))
        .fetch_all(conn)
        .await?;
    let rows = rows
        .iter()
        .map(|r| {
            Ok(ScheduleRow {
                id: r.try_get(0)?,
                queue: r.try_get(1)?,
                timer_id: r.try_get(2)?,
                next_attempt_at: r.try_get(3)?,
                last_attempt_at: r.try_get(4)?,
                acquired_at: r.try_get(5)?,
                rearm_at: r.try_get(6)?,
                cancelled_at: r.try_get(7)?,
                fingerprint: r.try_get(8)?,
                attempts: r.try_get(9)?,
            })
        })
        .collect::<sqlx::Result<Vec<_>>>()?;
    Ok((rows, bytewise))
}
