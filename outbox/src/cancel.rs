//! Cancelling a keyed timer (SPEC §3).

use sqlx::{PgConnection, Row};

use crate::error::Result;
use crate::publish::{validate_queue, validate_timer_id};
use crate::schema::{Names, Outbox};

/// What a cancel did (SPEC §3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Cancelled {
    /// The timer was pending; its row is deleted.
    Deleted {
        /// The deleted row.
        id: i64,
    },
    /// The timer's handler is running and a rearm was queued; the rearm is dropped, so the
    /// timer will not fire again after this run.
    RearmDropped {
        /// The running row.
        id: i64,
    },
    /// The timer's handler is running and nothing is queued behind it; nothing changed and
    /// the run completes normally. A running row is never deleted by cancel. If the running
    /// worker dies instead of completing, the lease expires and the row is redelivered, so
    /// the handler runs once more; cancel again after that run if it must not.
    Running {
        /// The running row.
        id: i64,
    },
    /// No live row holds this key.
    NotFound,
}

#[derive(Debug)]
pub(crate) struct Sql {
    lock: String,
    delete: String,
    drop_rearm: String,
}

impl Sql {
    pub(crate) fn new(n: &Names) -> Self {
        let t = &n.qtable;
        Sql {
            // Lock first: it closes the race in which a run finishes and applies its rearm
            // between our look and our write.
            lock: format!(
                "SELECT id, acquired_token, rearm_at IS NOT NULL FROM {t} \
                 WHERE queue = $1 AND timer_id = $2 FOR UPDATE"
            ),
            // Both writes repeat the state they expect. Inside a transaction the lock makes
            // that redundant; on a bare connection (autocommit) the lock ends with the
            // SELECT, and the repeated condition turns a lost race into "0 rows" and a retry
            // of the loop instead of a wrong write.
            delete: format!("DELETE FROM {t} WHERE id = $1 AND acquired_token IS NULL"),
            drop_rearm: format!(
                "UPDATE {t} SET rearm_at = NULL, rearm_payload = NULL, rearm_headers = NULL \
                 WHERE id = $1 AND acquired_token = $2 AND rearm_at IS NOT NULL"
            ),
        }
    }
}

impl Outbox {
    /// Cancels the timer `(queue, timer_id)` on the caller's connection or transaction
    /// (SPEC §3): locks the row, then deletes a pending row, drops a queued rearm of a
    /// running row, or leaves a running row alone. Two statements.
    ///
    /// # Errors
    /// [`crate::Error::InvalidArgument`] for an empty, over-long (more than 255 bytes) or
    /// NUL-containing queue or timer id, before any SQL runs; [`crate::Error::Database`].
    pub async fn cancel(
        &self,
        conn: &mut PgConnection,
        queue: &str,
        timer_id: &str,
    ) -> Result<Cancelled> {
        validate_queue(queue)?;
        validate_timer_id(timer_id)?;
        let sql = &self.sql().cancel;
        loop {
            let row = sqlx::query(&sql.lock)
                .bind(queue)
                .bind(timer_id)
                .fetch_optional(&mut *conn)
                .await?;
            let Some(row) = row else {
                return Ok(Cancelled::NotFound);
            };
            let id: i64 = row.try_get(0)?;
            let token: Option<uuid::Uuid> = row.try_get(1)?;
            let has_rearm: bool = row.try_get(2)?;
            let done = match token {
                None => {
                    let n = sqlx::query(&sql.delete)
                        .bind(id)
                        .execute(&mut *conn)
                        .await?;
                    (n.rows_affected() == 1).then_some(Cancelled::Deleted { id })
                }
                Some(token) if has_rearm => {
                    let n = sqlx::query(&sql.drop_rearm)
                        .bind(id)
                        .bind(token)
                        .execute(&mut *conn)
                        .await?;
                    (n.rows_affected() == 1).then_some(Cancelled::RearmDropped { id })
                }
                Some(_) => Some(Cancelled::Running { id }),
            };
            if let Some(outcome) = done {
                return Ok(outcome);
            }
            // Only reachable without a transaction: the row changed between the SELECT and
            // the write. Look again.
        }
    }
}
