//! Publishing: the single-row inserts, the extend (a pending row's deadline moves later
//! only; a leased row gets a rearm instead), the batch.

use sqlx::SqlStr;

use super::text::{notify, query};
use crate::names::Names;

/// `$1` queue, `$2` payload, `$3` headers, `$4` delay interval, `$5` absolute deadline,
/// `$6` timer id. The deadline is computed by the database clock (`now() + $4`, where
/// `now()` is the transaction's start), so clock skew between hosts cannot shift it.
const COLUMNS: &str = "(queue, payload, headers, next_attempt_at, timer_id)";
const VALUES: &str = "VALUES ($1, $2, $3, coalesce($5::timestamptz, now() + $4::interval), $6)";

#[derive(Debug)]
pub(crate) struct Publish {
    /// A message without a timer id.
    pub plain: SqlStr,
    /// A keyed timer, `OnConflict::Ignore`.
    pub insert: SqlStr,
    /// A keyed timer, `OnConflict::Extend`; `$7` the slack interval.
    pub extend: SqlStr,
    /// Many messages of one queue.
    pub batch: SqlStr,
}

impl Publish {
    pub(crate) fn render(n: &Names) -> Self {
        let t = &n.qtable;
        // The notification is folded into each statement: no extra round trip, and it is
        // sent only if the caller's transaction commits. A plain message (NULL timer_id)
        // can never conflict, so it skips ON CONFLICT: a speculative insert costs an extra
        // WAL record per row.
        let plain = format!(
            r#"
WITH ins AS (
    INSERT INTO {t} {COLUMNS} {VALUES}
    RETURNING id, queue, next_attempt_at)
SELECT ins.id, {notify} FROM ins"#,
            notify = notify(n, "ins"),
        );
        let insert = format!(
            r#"
WITH ins AS (
    INSERT INTO {t} {COLUMNS} {VALUES}
    ON CONFLICT (queue, timer_id) WHERE timer_id IS NOT NULL DO NOTHING
    RETURNING id, queue, next_attempt_at)
SELECT ins.id, {notify} FROM ins"#,
            notify = notify(n, "ins"),
        );
        // One statement for the whole extend path (SPEC §4, §5). The row found decides:
        // pending → move the deadline and reset retry history; leased → queue the rearm.
        // Either only when the new deadline is later (for a leased row, later than both
        // the claimed deadline and any queued rearm). ON CONFLICT DO UPDATE waits on a
        // claim's row lock and then sees the leased row, so a claim racing an extend
        // always ends with a queued rearm (SPEC §5.3). `xmax = 0` marks a fresh insert.
        // The newest intent wins (SPEC §3): an extend that queues a rearm on a running row
        // clears a cancel mark left by an earlier cancel (a pending row never has one).
        // `$7` is the slack (issue 14): a move of a pending deadline or of a queued rearm by
        // at most the slack writes nothing. It never applies to a running row without a
        // rearm (`t.rearm_at + $7` is NULL, which `greatest` ignores): that row's
        // completion would delete it. Failing the WHERE of DO UPDATE only locks the row,
        // so a skipped extend adds no row version and no index entry.
        let pending = "t.acquired_token IS NULL";
        let extend = format!(
            r#"
WITH up AS (
    INSERT INTO {t} AS t {COLUMNS} {VALUES}
    ON CONFLICT (queue, timer_id) WHERE timer_id IS NOT NULL DO UPDATE SET
        next_attempt_at  = CASE WHEN {pending} THEN excluded.next_attempt_at ELSE t.next_attempt_at END,
        payload          = CASE WHEN {pending} THEN excluded.payload ELSE t.payload END,
        headers          = CASE WHEN {pending} THEN excluded.headers ELSE t.headers END,
        attempts_count   = CASE WHEN {pending} THEN 0 ELSE t.attempts_count END,
        first_attempt_at = CASE WHEN {pending} THEN NULL ELSE t.first_attempt_at END,
        last_attempt_at  = CASE WHEN {pending} THEN NULL ELSE t.last_attempt_at END,
        rearm_at         = CASE WHEN {pending} THEN t.rearm_at ELSE excluded.next_attempt_at END,
        rearm_payload    = CASE WHEN {pending} THEN t.rearm_payload ELSE excluded.payload END,
        rearm_headers    = CASE WHEN {pending} THEN t.rearm_headers ELSE excluded.headers END,
        cancelled_at     = NULL
    WHERE excluded.next_attempt_at > CASE WHEN {pending} THEN t.next_attempt_at + $7::interval
                                          ELSE greatest(t.next_attempt_at, t.rearm_at + $7::interval) END
    RETURNING t.id, t.queue, t.next_attempt_at, (t.xmax = 0) AS inserted,
              (t.acquired_token IS NOT NULL) AS leased)
SELECT up.id, up.inserted, up.leased,
       CASE WHEN up.inserted THEN {notify} END
FROM up"#,
            notify = notify(n, "up"),
        );
        // All or nothing, one statement, one notification for the batch (SPEC §2.3).
        // `$1` queue, `$2` payloads, `$3` headers, `$4` delay, `$5` absolute deadline.
        let batch = format!(
            r#"
WITH ins AS (
    INSERT INTO {t} (queue, payload, headers, next_attempt_at)
    SELECT $1, u.payload, u.headers, coalesce($5::timestamptz, now() + $4::interval)
    FROM unnest($2::bytea[], $3::jsonb[]) WITH ORDINALITY AS u(payload, headers, ord)
    ORDER BY u.ord
    RETURNING id, queue, next_attempt_at)
SELECT array_agg(ins.id ORDER BY ins.id),
       (SELECT {notify} FROM ins LIMIT 1)
FROM ins"#,
            notify = notify(n, "ins"),
        );
        Publish {
            plain: query(plain),
            insert: query(insert),
            extend: query(extend),
            batch: query(batch),
        }
    }

    #[cfg(any(test, feature = "testing"))]
    pub(super) fn all(&self) -> Vec<(&'static str, &str)> {
        vec![
            ("publish.plain", self.plain.as_str()),
            ("publish.insert", self.insert.as_str()),
            ("publish.extend", self.extend.as_str()),
            ("publish.batch", self.batch.as_str()),
        ]
    }
}
