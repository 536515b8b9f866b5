//! Operator actions: pause and resume a queue, and run, reschedule or delete one pending row
//! by id.
//!
//! Each action is a method of [`Outbox`](crate::Outbox) that takes a connection
//! (`&mut PgConnection`, or `&mut *tx` for a transaction), so it commits with whatever else
//! the caller's transaction does; on a bare connection it commits on its own.
//!
//! # Pausing a queue
//!
//! [`Outbox::pause_queue`](crate::Outbox::pause_queue) writes the queue's name into the
//! table `<table>_paused` (created by [`Outbox::migrate`](crate::Outbox::migrate)). Every
//! claim reads that table **inside its one statement**, so once the pause has committed no
//! worker of this version claims a row of the queue — neither a due row nor a row whose lease
//! expired — from its next claim on. What already runs finishes normally (its completion, a
//! retry's new deadline and a queued rearm are written as usual). Publishing, extending and
//! cancelling go on: rows accumulate and wait. An idle worker does not wake up for a paused
//! queue's deadlines; [`Outbox::resume_queue`](crate::Outbox::resume_queue) deletes the name
//! and notifies the workers (`NOTIFY`, delivered when the resume commits), so they claim again
//! within one wake-up; a worker that does not listen (`WorkerBuilder::listen(false)`) finds the
//! rows at its next idle poll. A queue can be paused before it has any row. Workers of a
//! version before the paused-queues table ignore pauses.
//!
//! # Acting on a pending row
//!
//! [`Outbox::run_now`](crate::Outbox::run_now),
//! [`Outbox::reschedule`](crate::Outbox::reschedule) and
//! [`Outbox::delete_pending`](crate::Outbox::delete_pending) act on one live row by its id
//! (the `id` of [`StoredRow`](crate::store::StoredRow), as
//! [`Outbox::pending`](crate::Outbox::pending) lists them). Each is one statement that locks
//! the row first (`SELECT … FOR UPDATE`): if a worker's claim locked the row before, the
//! action waits for that claim to commit and then sees the row leased, so it changes nothing
//! and answers [`RowAction::Leased`] — a running handler's row is never moved or deleted
//! under it (cancel a timer with [`Outbox::cancel`](crate::Outbox::cancel), which handles a
//! running one). A claim that comes after the lock skips the row (`SKIP LOCKED`) until the
//! action's transaction ends. A new deadline notifies like a publish, so a sleeping worker
//! wakes for an earlier one. Rescheduling keeps the row's retry history and counters; only
//! its deadline moves, earlier or later (unlike an extend, which only moves a timer later).

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, Row};

use crate::error::{Error, OutboxSql, Result};
use crate::message::{validate_queue, Schedule};
use crate::scope::{BindBucket, Scope};
use crate::sql;

/// What an action on one row by id did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RowAction {
    /// The row was pending; its deadline is now `next_attempt_at` (database clock).
    Rescheduled {
        /// The new deadline.
        next_attempt_at: DateTime<Utc>,
    },
    /// The row was pending and is deleted: it will not run.
    Deleted,
    /// A worker holds the row (its handler runs, or its lease has not been reclaimed yet):
    /// nothing changed.
    Leased,
    /// No live row has this id: it completed, was cancelled or deleted, or never existed.
    NotFound,
}

/// A paused queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PausedQueue {
    /// The queue.
    pub queue: String,
    /// When it was paused (database clock).
    pub paused_at: DateTime<Utc>,
}

/// Pauses `queue`; true when this call paused it, false when it was paused already.
pub(crate) async fn pause(
    sql: &sql::admin::Admin,
    scope: Scope,
    conn: &mut PgConnection,
    qtable: &str,
    queue: &str,
) -> Result<bool> {
    toggle(&sql.pause, None, scope, conn, qtable, queue).await
}

/// Resumes `queue`; true when this call resumed it, false when it was not paused.
pub(crate) async fn resume(
    sql: &sql::admin::Admin,
    scope: Scope,
    conn: &mut PgConnection,
    qtable: &str,
    queue: &str,
) -> Result<bool> {
    toggle(&sql.resume, sql.wake.as_ref(), scope, conn, qtable, queue).await
}

/// Pause or resume: `statement` on `queue`, true when it returned a row (this call changed
/// the queue's state). A missing paused-queues table is told apart from a database never
/// migrated by a look-up on `conn` after the failed statement. `wake` sends the
/// notification a resume returns (distributed mode).
async fn toggle(
    statement: &sqlx::SqlStr,
    wake: Option<&sqlx::SqlStr>,
    scope: Scope,
    conn: &mut PgConnection,
    qtable: &str,
    queue: &str,
) -> Result<bool> {
    validate_queue(queue)?;
    let mut db = scope.on(conn).await?;
    let row = scope
        .query(statement.clone())
        .bind(queue)
        .fetch_optional(&mut *db)
        .await
        .outbox_sql();
    let row = match row {
        Ok(row) => row,
        Err(e) => {
            drop(db);
            return Err(scope.unmigrated_or(conn, qtable, e).await);
        }
    };
    if let (Some(row), Some(_)) = (&row, wake) {
        scope
            .wake(&mut db, wake, [row.try_get(0).outbox_sql()?])
            .await?;
    }
    db.done().await?;
    Ok(row.is_some())
}

/// Every paused queue, by name.
pub(crate) async fn paused(
    sql: &sql::admin::Admin,
    scope: Scope,
    conn: &mut PgConnection,
    qtable: &str,
) -> Result<Vec<PausedQueue>> {
    let mut db = scope.on(conn).await?;
    let rows = scope
        .query(sql.paused.clone())
        .fetch_all(&mut *db)
        .await
        .outbox_sql();
    let rows = match rows {
        Ok(rows) => rows,
        Err(e) => {
            drop(db);
            return Err(scope.unmigrated_or(conn, qtable, e).await);
        }
    };
    db.done().await?;
    rows.iter()
        .map(|r| {
            Ok(PausedQueue {
                queue: r.try_get(0).outbox_sql()?,
                paused_at: r.try_get(1).outbox_sql()?,
            })
        })
        .collect()
}

/// Moves the deadline of pending row `id` to `schedule`.
pub(crate) async fn reschedule(
    sql: &sql::admin::Admin,
    scope: Scope,
    conn: &mut PgConnection,
    id: i64,
    schedule: Schedule,
    bucket: Option<i16>,
) -> Result<RowAction> {
    validate_id(id)?;
    let (interval, at) = schedule.resolve()?.binds();
    let mut db = scope.on(conn).await?;
    let row = scope
        .query(sql.reschedule.clone())
        .bind(id)
        .bind(interval)
        .bind(at)
        .bucket(bucket)
        .fetch_optional(&mut *db)
        .await
        .outbox_sql()?;
    if let Some(row) = &row {
        scope
            .wake(&mut db, sql.wake.as_ref(), [row.try_get(2).outbox_sql()?])
            .await?;
    }
    db.done().await?;
    let Some(row) = row else {
        return Ok(RowAction::NotFound);
    };
    let leased: bool = row.try_get(0).outbox_sql()?;
    let at: Option<DateTime<Utc>> = row.try_get(1).outbox_sql()?;
    Ok(match (leased, at) {
        (true, _) => RowAction::Leased,
        (false, Some(next_attempt_at)) => RowAction::Rescheduled { next_attempt_at },
        // The locked row was pending and the update matched it by id: it cannot miss.
        (false, None) => RowAction::NotFound,
    })
}

/// Deletes pending row `id`.
pub(crate) async fn delete(
    sql: &sql::admin::Admin,
    scope: Scope,
    conn: &mut PgConnection,
    id: i64,
    bucket: Option<i16>,
) -> Result<RowAction> {
    validate_id(id)?;
    let mut db = scope.on(conn).await?;
    let row = scope
        .query(sql.delete.clone())
        .bind(id)
        .bucket(bucket)
        .fetch_optional(&mut *db)
        .await
        .outbox_sql()?;
    db.done().await?;
    let Some(row) = row else {
        return Ok(RowAction::NotFound);
    };
    let leased: bool = row.try_get(0).outbox_sql()?;
    let deleted: bool = row.try_get(1).outbox_sql()?;
    Ok(match (leased, deleted) {
        (true, _) => RowAction::Leased,
        (false, true) => RowAction::Deleted,
        (false, false) => RowAction::NotFound,
    })
}

/// Row ids are positive (an identity column starting at 1).
pub(crate) fn validate_id(id: i64) -> Result<()> {
    if id < 1 {
        return Err(Error::invalid("id", "row ids are positive"));
    }
    Ok(())
}
