//! Reading live rows without leasing them: a plain `SELECT` that takes no row lock, so a
//! read never delays a claim or a completion (dead letters are listed by `sql::dlq`).

use sqlx::SqlStr;

use super::text::query;
use crate::names::Names;

/// The columns of a stored row, in the order `store/rows.rs` decodes them.
pub(crate) const ROW_COLUMNS: &str = "id, queue, payload, headers, attempts_count, \
     deliveries_count, created_at, next_attempt_at, first_attempt_at, last_attempt_at, \
     acquired_at, acquired_token, timer_id, rearm_at, rearm_payload, rearm_headers, cancelled_at";

/// The columns of a dead-letter row, in the order `store/rows.rs` decodes them.
pub(crate) const DEAD_LETTER_COLUMNS: &str = "id, original_id, queue, payload, headers, \
     timer_id, attempts_count, deliveries_count, created_at, failed_at, failure_reason, \
     last_error, redriven_at, redriven_id";

#[derive(Debug)]
pub(crate) struct Read {
    /// `$1` queue, `$2` limit: live rows (pending and leased) by deadline, then id.
    pub pending: SqlStr,
}

impl Read {
    pub(crate) fn render(n: &Names) -> Self {
        let t = &n.qtable;
        let pending = format!(
            r#"
SELECT {ROW_COLUMNS} FROM {t}
WHERE queue = $1 ORDER BY next_attempt_at, id LIMIT $2"#
        );
        Read {
            pending: query(pending),
        }
    }

    #[cfg(any(test, feature = "testing"))]
    pub(super) fn all(&self) -> Vec<(&'static str, &str)> {
        vec![("read.pending", self.pending.as_str())]
    }
}
