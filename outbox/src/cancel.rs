//! Cancelling a keyed timer: lock the row first (`SELECT … FOR UPDATE`), then delete a
//! pending row or mark a running one.

use sqlx::{PgConnection, Row};

use crate::error::{OutboxSql, Result};
use crate::message::{validate_queue, validate_timer_id};
use crate::scope::{BindBucket, Scope};
use crate::sql;

/// What a cancel did. A cancel locks the timer's row first (`SELECT … FOR UPDATE`) and then
/// writes, so a run cannot finish and apply its rearm between the cancel's look and its
/// write. A running row is never deleted by a cancel: its handler is still at work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Cancelled {
    /// The timer was pending; its row is deleted.
    Deleted {
        /// The deleted row.
        id: i64,
    },
    /// The timer's handler is running and a rearm was queued; the rearm is dropped and the
    /// row is marked cancelled, as for [`Cancelled::Running`].
    RearmDropped {
        /// The running row.
        id: i64,
    },
    /// The timer's handler is running; its row is marked cancelled (`cancelled_at`). A
    /// running row is never deleted by cancel (its handler is still at work), but however
    /// the run ends — success, a retry, a terminal failure, a crash of its worker — the row
    /// is then deleted: no retry, no dead letter, no redelivery. The handler learns of the
    /// cancel at its worker's next lease renewal. An extend after the cancel re-arms the
    /// timer and clears the mark: the newest intent wins.
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
    scope: Scope,
    conn: &mut PgConnection,
    queue: &str,
    timer_id: &str,
    bucket: Option<i16>,
) -> Result<Cancelled> {
    validate_queue(queue)?;
    validate_timer_id(timer_id)?;
    // Through a pooler, a bare connection gets one transaction around the lock and the
    // write, which also keeps the row locked from the look to the write.
    let mut db = scope.on(conn).await?;
    let outcome = cancel_on(sql, scope, &mut db, queue, timer_id, bucket).await?;
    db.done().await?;
    Ok(outcome)
}

async fn cancel_on(
    sql: &sql::cancel::Cancel,
    scope: Scope,
    conn: &mut PgConnection,
    queue: &str,
    timer_id: &str,
    bucket: Option<i16>,
) -> Result<Cancelled> {
    loop {
        let row = scope
            .query(sql.lock.clone())
            .bind(queue)
            .bind(timer_id)
            .bucket(bucket)
            .fetch_optional(&mut *conn)
            .await
            .outbox_sql()?;
        let Some(row) = row else {
            return Ok(Cancelled::NotFound);
        };
        let id: i64 = row.try_get(0).outbox_sql()?;
        let token: Option<uuid::Uuid> = row.try_get(1).outbox_sql()?;
        let done = match token {
            None => {
                let n = scope
                    .query(sql.delete.clone())
                    .bind(id)
                    .bucket(bucket)
                    .execute(&mut *conn)
                    .await
                    .outbox_sql()?;
                (n.rows_affected() == 1).then_some(Cancelled::Deleted { id })
            }
            Some(token) => {
                let had_rearm: Option<bool> = scope
                    .query_scalar(sql.mark.clone())
                    .bind(id)
                    .bind(token)
                    .bucket(bucket)
                    .fetch_optional(&mut *conn)
                    .await
                    .outbox_sql()?;
                had_rearm.map(|had| {
                    if had {
                        Cancelled::RearmDropped { id }
                    } else {
                        Cancelled::Running { id }
                    }
                })
            }
        };
        if let Some(outcome) = done {
            return Ok(outcome);
        }
        // Only reachable without a transaction: the row changed between the SELECT and
        // the write. Look again.
    }
}
