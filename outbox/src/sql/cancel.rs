//! Cancelling a keyed timer: lock the row first (`SELECT … FOR UPDATE`), then write, so a
//! run cannot finish and apply its rearm between the cancel's look and its write.

use sqlx::SqlStr;

use super::text::{in_bucket, query};
use crate::names::Names;

#[derive(Debug)]
pub(crate) struct Cancel {
    /// `$1` queue, `$2` timer id → `(id, acquired_token)`. In distributed mode each
    /// statement's last parameter is the bucket (`$3`, `$2`, `$3`).
    pub lock: SqlStr,
    /// `$1` id: deletes a pending row.
    pub delete: SqlStr,
    /// `$1` id, `$2` token: marks a running row cancelled and drops its queued rearm →
    /// `(had a rearm)`.
    pub mark: SqlStr,
}

impl Cancel {
    pub(crate) fn render(n: &Names) -> Self {
        let t = &n.qtable;
        // Lock first: it closes the race in which a run finishes and applies its rearm
        // between our look and our write.
        let lock = format!(
            r#"
SELECT id, acquired_token FROM {t}
WHERE queue = $1 AND timer_id = $2{b3}
FOR UPDATE"#,
            b3 = in_bucket(n, "", 3),
        );
        // Both writes repeat the state they expect. Inside a transaction the lock makes
        // that redundant; on a bare connection (autocommit) the lock ends with the SELECT,
        // and the repeated condition turns a lost race into "0 rows" and a retry of the
        // loop instead of a wrong write.
        // `IS NOT DISTINCT FROM NULL`, not `IS NULL`: the latter is the predicate of the
        // partial pending index, which stale statistics make look cheaper than the primary
        // key (see `sql::complete`).
        let delete = format!(
            "DELETE FROM {t} WHERE id = $1 AND acquired_token IS NOT DISTINCT FROM NULL::uuid{b2}",
            b2 = in_bucket(n, "", 2),
        );
        // A running row is never deleted: its handler is still at work. The mark makes every
        // way the run ends delete the row instead of retrying, re-arming or archiving it; an
        // earlier mark is kept. The old version of the row says whether a rearm was dropped,
        // so the outcome is right even without a transaction around the two statements. Its
        // values come from the locking CTE, which sees the row after any lock wait (see
        // `sql::complete`'s `APPLY_REARM`). `t.id = $1` keeps the write on the primary key
        // whatever the statistics say (see `sql::complete`).
        let mark = format!(
            r#"
WITH old AS (
    SELECT id, rearm_at IS NOT NULL AS had_rearm, cancelled_at, now() AS at_now FROM {t}
    WHERE id = $1 AND acquired_token IS NOT DISTINCT FROM $2{b3} FOR UPDATE)
UPDATE {t} t SET rearm_at = NULL, rearm_payload = NULL, rearm_headers = NULL,
                 cancelled_at = coalesce(old.cancelled_at, old.at_now)
FROM old WHERE t.id = $1 AND t.id = old.id{tb3}
RETURNING old.had_rearm"#,
            b3 = in_bucket(n, "", 3),
            tb3 = in_bucket(n, "t.", 3),
        );
        Cancel {
            lock: query(lock),
            delete: query(delete),
            mark: query(mark),
        }
    }

    #[cfg(any(test, feature = "testing"))]
    pub(super) fn all(&self) -> Vec<(&'static str, &str)> {
        vec![
            ("cancel.lock", self.lock.as_str()),
            ("cancel.delete", self.delete.as_str()),
            ("cancel.mark", self.mark.as_str()),
        ]
    }
}
