//! Reading rows without leasing them: plain `SELECT`s that take no row lock, so a read
//! never delays a claim or a completion.

use sqlx::SqlStr;

use super::query;
use crate::names::Names;

/// The columns of a stored row, in the order `read.rs` decodes them.
pub(crate) const ROW_COLUMNS: &str = "id, queue, payload, headers, attempts_count, \
     deliveries_count, created_at, next_attempt_at, first_attempt_at, last_attempt_at, \
     acquired_at, acquired_token, timer_id, rearm_at, rearm_payload, rearm_headers, cancelled_at";

/// The columns of a dead-letter row, in the order `read.rs` decodes them.
pub(crate) const DEAD_LETTER_COLUMNS: &str = "id, original_id, queue, payload, headers, \
     timer_id, attempts_count, deliveries_count, created_at, failed_at, failure_reason, last_error";

#[derive(Debug)]
pub(crate) struct Read {
    /// `$1` queue, `$2` limit: live rows (pending and leased) by deadline, then id.
    pub pending: SqlStr,
    /// `$1` queue, `$2` limit: dead letters, oldest first.
    pub dead_letters: SqlStr,
}

impl Read {
    pub(crate) fn render(n: &Names) -> Self {
        let t = &n.qtable;
        let d = &n.qdlq;
        let pending = format!(
            r#"
SELECT {ROW_COLUMNS} FROM {t}
WHERE queue = $1 ORDER BY next_attempt_at, id LIMIT $2"#
        );
        // <dlq>_queue_failed_at_idx serves the filter and the order.
        let dead_letters = format!(
            r#"
SELECT {DEAD_LETTER_COLUMNS} FROM {d}
WHERE queue = $1 ORDER BY failed_at, id LIMIT $2"#
        );
        Read {
            pending: query(pending),
            dead_letters: query(dead_letters),
        }
    }

    pub(super) fn all(&self) -> Vec<(&'static str, &str)> {
        vec![
            ("read.pending", self.pending.as_str()),
            ("read.dead_letters", self.dead_letters.as_str()),
        ]
    }
}
