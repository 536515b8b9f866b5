//! Cancelling a keyed timer (SPEC §3): lock first, then write.

use sqlx::SqlStr;

use super::query;
use crate::names::Names;

#[derive(Debug)]
pub(crate) struct Cancel {
    /// `$1` queue, `$2` timer id → `(id, acquired_token, has a rearm)`.
    pub lock: SqlStr,
    /// `$1` id: deletes a pending row.
    pub delete: SqlStr,
    /// `$1` id, `$2` token: drops the rearm queued on a running row.
    pub drop_rearm: SqlStr,
}

impl Cancel {
    pub(crate) fn render(n: &Names) -> Self {
        let t = &n.qtable;
        // Lock first: it closes the race in which a run finishes and applies its rearm
        // between our look and our write.
        let lock = format!(
            r#"
SELECT id, acquired_token, rearm_at IS NOT NULL FROM {t}
WHERE queue = $1 AND timer_id = $2
FOR UPDATE"#
        );
        // Both writes repeat the state they expect. Inside a transaction the lock makes
        // that redundant; on a bare connection (autocommit) the lock ends with the SELECT,
        // and the repeated condition turns a lost race into "0 rows" and a retry of the
        // loop instead of a wrong write.
        let delete = format!("DELETE FROM {t} WHERE id = $1 AND acquired_token IS NULL");
        let drop_rearm = format!(
            r#"
UPDATE {t} SET rearm_at = NULL, rearm_payload = NULL, rearm_headers = NULL
WHERE id = $1 AND acquired_token = $2 AND rearm_at IS NOT NULL"#
        );
        Cancel {
            lock: query(lock),
            delete: query(delete),
            drop_rearm: query(drop_rearm),
        }
    }

    #[cfg(test)]
    pub(super) fn all(&self) -> Vec<(&'static str, &str)> {
        vec![
            ("cancel.lock", self.lock.as_str()),
            ("cancel.delete", self.delete.as_str()),
            ("cancel.drop_rearm", self.drop_rearm.as_str()),
        ]
    }
}
