//! Cancelling a keyed timer (SPEC §3).

use sqlx::{PgConnection, Row};

use crate::error::Result;
use crate::publish::{validate_queue, validate_timer_id};
use crate::sql;

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

/// Cancels a timer on `conn` ([`crate::Outbox::cancel`]).
pub(crate) async fn cancel(
    sql: &sql::cancel::Cancel,
    conn: &mut PgConnection,
    queue: &str,
    timer_id: &str,
) -> Result<Cancelled> {
    validate_queue(queue)?;
    validate_timer_id(timer_id)?;
    loop {
        let row = sqlx::query(sql.lock.clone())
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
                let n = sqlx::query(sql.delete.clone())
                    .bind(id)
                    .execute(&mut *conn)
                    .await?;
                (n.rows_affected() == 1).then_some(Cancelled::Deleted { id })
            }
            Some(token) if has_rearm => {
                let n = sqlx::query(sql.drop_rearm.clone())
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
