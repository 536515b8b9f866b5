//! Operator actions: pausing and resuming a queue, and acting on one pending row by id (run
//! it now, reschedule it, delete it). Each row action locks the row first
//! (`SELECT … FOR UPDATE`): a claim that locked the row before us has committed its lease by
//! the time our lock is granted, and the locking read sees the row as that claim left it —
//! leased, so the action changes nothing. A claim after us skips the row we hold
//! (`SKIP LOCKED`) until our transaction ends.

use sqlx::SqlStr;

use super::text::{in_bucket, notify, query, wake};
use crate::names::Names;

#[derive(Debug)]
pub(crate) struct Admin {
    /// `$1` queue → `paused_at` when this call paused it, no row when it was paused already.
    pub pause: SqlStr,
    /// `$1` queue → one row (the notification) when this call resumed it, none when it was
    /// not paused.
    pub resume: SqlStr,
    /// `(queue, paused_at)` of every paused queue, by name.
    pub paused: SqlStr,
    /// `$1` id, `$2 interval`, `$3 timestamptz` (absolute, or NULL for `now() + $2`) →
    /// `(leased, new deadline or NULL)`; no row when the id is not a live row.
    pub reschedule: SqlStr,
    /// `$1` id → `(leased, deleted)`; no row when the id is not a live row.
    pub delete: SqlStr,
    /// Sends the wake-up payloads its statements return, distributed mode only
    /// (`text::wake`).
    pub wake: Option<SqlStr>,
}

impl Admin {
    pub(crate) fn render(n: &Names) -> Self {
        let t = &n.qtable;
        let p = &n.qpaused;
        let pause = format!(
            r#"
INSERT INTO {p} (queue) VALUES ($1)
ON CONFLICT (queue) DO NOTHING
RETURNING paused_at"#
        );
        // Workers sleeping on a paused queue's deadlines left them out (`next_wakeup` skips
        // paused queues): the notification, due now, wakes them to claim again.
        let resume = format!(
            r#"
WITH gone AS (DELETE FROM {p} WHERE queue = $1 RETURNING queue)
SELECT {notify} FROM (SELECT queue, now() AS next_attempt_at FROM gone) gone"#,
            notify = notify(n, "gone")
        );
        let paused = format!("SELECT queue, paused_at FROM {p} ORDER BY queue");
        // The values come from the locking CTE, which sees the row after any lock wait (see
        // `sql::complete`'s `APPLY_REARM`); `t.id = $1` keeps the write on the primary key.
        // The new deadline notifies like a publish: an earlier deadline wakes a sleeping
        // worker.
        let reschedule = format!(
            r#"
WITH old AS (
    SELECT id, acquired_token IS NOT NULL AS leased,
           coalesce($3::timestamptz, now() + $2::interval) AS at
    FROM {t} WHERE id = $1{b4} FOR UPDATE),
up AS (
    UPDATE {t} t SET next_attempt_at = old.at
    FROM old WHERE t.id = $1 AND t.id = old.id AND NOT old.leased{tb4}
    RETURNING t.queue, t.next_attempt_at)
SELECT old.leased, up.next_attempt_at,
       CASE WHEN up.queue IS NOT NULL THEN {notify} END
FROM old LEFT JOIN up ON true"#,
            notify = notify(n, "up"),
            b4 = in_bucket(n, "", 4),
            tb4 = in_bucket(n, "t.", 4),
        );
        let delete = format!(
            r#"
WITH old AS (
    SELECT id, acquired_token IS NOT NULL AS leased FROM {t} WHERE id = $1{b2} FOR UPDATE),
gone AS (
    DELETE FROM {t} t USING old
    WHERE t.id = $1 AND t.id = old.id AND NOT old.leased{tb2}
    RETURNING t.id)
SELECT old.leased, gone.id IS NOT NULL
FROM old LEFT JOIN gone ON true"#,
            b2 = in_bucket(n, "", 2),
            tb2 = in_bucket(n, "t.", 2),
        );
        Admin {
            wake: wake(n),
            pause: query(pause),
            resume: query(resume),
            paused: query(paused),
            reschedule: query(reschedule),
            delete: query(delete),
        }
    }

    #[cfg(any(test, feature = "testing"))]
    pub(super) fn all(&self) -> Vec<(&'static str, &str)> {
        vec![
            ("admin.pause", self.pause.as_str()),
            ("admin.resume", self.resume.as_str()),
            ("admin.paused", self.paused.as_str()),
            ("admin.reschedule", self.reschedule.as_str()),
            ("admin.delete", self.delete.as_str()),
        ]
    }
}
