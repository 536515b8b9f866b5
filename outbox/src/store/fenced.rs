//! The fenced writes after a claim, on Postgres: success (one row or a batch), retry,
//! terminal failure, lease renewal and release, each matching the row id **and** the lease
//! token, so a worker whose lease was taken over writes nothing. They execute the
//! statements `sql::complete` renders, on the connection or pool they are handed:
//! [`PgStore`](crate::PgStore) hands them its pools (and splits a batch that meets a row
//! lock), a handler's transaction hands [`ack_on`] itself
//! ([`HandlerTransaction::commit`](crate::HandlerTransaction::commit)). The arm of a
//! periodic run's next instant (`sql::periodic`) is fenced the same way and lives here too.
//! Each takes its connection as a [`Db`] picked by the outbox's [`Scope`] and finishes it
//! (commits the library's own transaction through a pooler; nothing otherwise).

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::postgres::PgRow;
use sqlx::{Acquire, Row, SqlStr};
use uuid::Uuid;

use super::{clean_error_text, Armed, Completion, Failure, Lease, Release, Released, Renewal};
use crate::error::{Error, OutboxSql, Result};
use crate::scope::{BindBucket, Db, Scope};
use crate::sql::binds::{interval, micros};
use crate::sql::complete::Complete;
use crate::sql::periodic::Periodic;

/// Success on one row: the DELETE (`… AND rearm_at IS NULL`, fenced by the token), and only
/// when it matched nothing the follow-up that decides under the row lock (apply the rearm,
/// delete a row whose rearm a cancel dropped meanwhile, or report the lease lost).
/// On `db`: a connection of the store's pools, or a handler's transaction.
pub(crate) async fn ack_on(
    sql: &Complete,
    scope: Scope,
    mut db: Db<'_>,
    lease: Lease,
) -> Result<Completion> {
    let done = scope
        .query(sql.ack_delete.clone())
        .bind(lease.id)
        .bind(lease.token)
        .bucket(sql.bucket_of(lease.id))
        .execute(&mut *db)
        .await
        .outbox_sql()?;
    if done.rows_affected() == 1 {
        db.done().await?;
        return Ok(Completion::Deleted);
    }
    let outcome = settle(sql, scope, &mut db, &lease).await?;
    db.done().await?;
    Ok(outcome)
}

/// The batched DELETE of successes: the leases whose rows it deleted. The rest (a rearm
/// queued, or the lease lost) go to one follow-up statement.
pub(crate) async fn ack_batch_delete_on(
    sql: &Complete,
    scope: Scope,
    mut db: Db<'_>,
    leases: &[Lease],
) -> Result<HashSet<Lease>> {
    let rows = by_lease(&sql.ack_batch_delete, sql, scope, &mut db, leases).await?;
    db.done().await?;
    rows.iter().map(lease_at).collect()
}

/// The batched follow-up for the rows the DELETE did not return: applies their rearm, or
/// deletes them; a lease missing from the result is lost.
pub(crate) async fn ack_batch_settle_on(
    sql: &Complete,
    scope: Scope,
    mut db: Db<'_>,
    leases: &[Lease],
) -> Result<HashMap<Lease, Completion>> {
    let rows = by_lease(&sql.ack_batch_settle, sql, scope, &mut db, leases).await?;
    wake_rows(sql, scope, &mut db, &rows).await?;
    db.done().await?;
    let mut settled = HashMap::new();
    for r in rows {
        let at: Option<DateTime<Utc>> = r.try_get(2).outbox_sql()?;
        settled.insert(
            lease_at(&r)?,
            at.map_or(Completion::Deleted, |at| Completion::Rearmed { at }),
        );
    }
    Ok(settled)
}

pub(crate) async fn retry_on(
    sql: &Complete,
    scope: Scope,
    mut db: Db<'_>,
    lease: Lease,
    delay: Duration,
) -> Result<Completion> {
    let row = scope
        .query(sql.retry.clone())
        .bind(lease.id)
        .bind(lease.token)
        .bind(interval(micros(delay, "delay")?))
        .bucket(sql.bucket_of(lease.id))
        .fetch_one(&mut *db)
        .await
        .outbox_sql()?;
    scope
        .wake(&mut db, sql.wake.as_ref(), [row.try_get(3).outbox_sql()?])
        .await?;
    db.done().await?;
    let locked: i64 = row.try_get(0).outbox_sql()?;
    let at: Option<DateTime<Utc>> = row.try_get(1).outbox_sql()?;
    let rearmed: Option<bool> = row.try_get(2).outbox_sql()?;
    Ok(match (locked, at, rearmed) {
        (0, _, _) => Completion::LeaseLost,
        (_, Some(at), Some(true)) => Completion::Rearmed { at },
        (_, Some(at), _) => Completion::RetryScheduled { at },
        // A cancel reached the row while it ran: deleted instead of retried.
        (_, None, _) => Completion::Cancelled,
    })
}

pub(crate) async fn fail_on(
    sql: &Complete,
    scope: Scope,
    mut db: Db<'_>,
    archive: bool,
    lease: Lease,
    failure: Failure<'_>,
) -> Result<Completion> {
    if !archive {
        // Without a dead-letter table a terminal failure ends the row like a success.
        let cancelled: Option<bool> = scope
            .query_scalar(sql.fail_delete.clone())
            .bind(lease.id)
            .bind(lease.token)
            .bucket(sql.bucket_of(lease.id))
            .fetch_optional(&mut *db)
            .await
            .outbox_sql()?;
        let outcome = match cancelled {
            Some(true) => Completion::Cancelled,
            Some(false) => Completion::Deleted,
            None => settle(sql, scope, &mut db, &lease).await?,
        };
        db.done().await?;
        return Ok(outcome);
    }
    if let Some(insert) = &sql.fail_archive_insert {
        return fail_in_steps(sql, insert, scope, db, lease, failure).await;
    }
    let row = scope
        .query(sql.fail_archive.clone())
        .bind(lease.id)
        .bind(lease.token)
        .bind(failure.reason.as_str())
        .bind(failure.last_error.map(clean_error_text))
        .bind(i32::from(failure.reason.handler_ran()))
        .bucket(sql.bucket_of(lease.id))
        .fetch_one(&mut *db)
        .await
        .outbox_sql()?;
    scope
        .wake(&mut db, sql.wake.as_ref(), [row.try_get(2).outbox_sql()?])
        .await?;
    db.done().await?;
    if row.try_get::<Option<bool>, _>(3).outbox_sql()? == Some(true) {
        return Ok(Completion::Cancelled);
    }
    settled(&row)
}

/// Distributed mode: the terminal failure with the dead-letter queue as two single-shard
/// statements in one transaction, both on the row's bucket (the queue and dead-letter tables
/// are co-located): the fenced delete or rearm, which returns the row as it was, then its
/// archive by `INSERT … VALUES` (see `Complete::fail_archive_insert`). The transaction
/// stays on one worker node: no two-phase commit, and a node that is down stalls only the
/// failures of its own buckets.
async fn fail_in_steps(
    sql: &Complete,
    insert: &SqlStr,
    scope: Scope,
    mut db: Db<'_>,
    lease: Lease,
    failure: Failure<'_>,
) -> Result<Completion> {
    let bucket = sql.bucket_of(lease.id);
    let mut tx = (&mut *db).begin().await.outbox_sql()?;
    let row = scope
        .query(sql.fail_archive.clone())
        .bind(lease.id)
        .bind(lease.token)
        .bind(bucket)
        .fetch_one(&mut *tx)
        .await
        .outbox_sql()?;
    let locked: i64 = row.try_get(0).outbox_sql()?;
    let cancelled = row.try_get::<Option<bool>, _>(3).outbox_sql()? == Some(true);
    if locked > 0 && !cancelled {
        let attempts: i32 = row.try_get(8).outbox_sql()?;
        scope
            .query(insert.clone())
            .bind(bucket)
            .bind(lease.id)
            .bind(row.try_get::<String, _>(4).outbox_sql()?)
            .bind(row.try_get::<Vec<u8>, _>(5).outbox_sql()?)
            .bind(
                row.try_get::<Option<serde_json::Value>, _>(6)
                    .outbox_sql()?,
            )
            .bind(row.try_get::<Option<String>, _>(7).outbox_sql()?)
            .bind(attempts + i32::from(failure.reason.handler_ran()))
            .bind(row.try_get::<i32, _>(9).outbox_sql()?)
            .bind(row.try_get::<DateTime<Utc>, _>(10).outbox_sql()?)
            .bind(failure.reason.as_str())
            .bind(failure.last_error.map(clean_error_text))
            .execute(&mut *tx)
            .await
            .outbox_sql()?;
    }
    tx.commit().await.outbox_sql()?;
    scope
        .wake(&mut db, sql.wake.as_ref(), [row.try_get(2).outbox_sql()?])
        .await?;
    db.done().await?;
    if cancelled {
        return Ok(Completion::Cancelled);
    }
    settled(&row)
}

pub(crate) async fn renew_on(
    sql: &Complete,
    scope: Scope,
    mut db: Db<'_>,
    leases: &[Lease],
) -> Result<Vec<Renewal>> {
    let rows = by_lease(&sql.renew, sql, scope, &mut db, leases).await?;
    db.done().await?;
    let mut held = HashMap::new();
    for r in rows {
        let lease = lease_at(&r)?;
        let cancelled: bool = r.try_get(2).outbox_sql()?;
        held.insert(
            lease,
            if cancelled {
                Renewal::Cancelled
            } else {
                Renewal::Renewed
            },
        );
    }
    Ok(leases
        .iter()
        .map(|l| held.get(l).copied().unwrap_or(Renewal::Lost))
        .collect())
}

pub(crate) async fn release_on(
    sql: &Complete,
    scope: Scope,
    mut db: Db<'_>,
    items: &[Release],
) -> Result<Vec<Released>> {
    let mut rows = Vec::new();
    for (bucket, group) in sql.by_bucket(items, |r| r.lease.id) {
        let (ids, tokens) = columns(group.iter().map(|r| r.lease));
        let started: Vec<bool> = group.iter().map(|r| r.started).collect();
        rows.extend(
            scope
                .query(sql.release.clone())
                .bind(&ids)
                .bind(&tokens)
                .bind(&started)
                .bucket(bucket)
                .fetch_all(&mut *db)
                .await
                .outbox_sql()?,
        );
    }
    wake_rows(sql, scope, &mut db, &rows).await?;
    db.done().await?;
    let mut done = HashMap::new();
    for r in rows {
        let lease = lease_at(&r)?;
        let outcome: String = r.try_get(2).outbox_sql()?;
        done.insert(
            lease,
            match outcome.as_str() {
                "cancelled" => Released::Cancelled,
                "retried" => Released::Retried,
                _ => Released::Pending,
            },
        );
    }
    Ok(items
        .iter()
        .map(|r| done.get(&r.lease).copied().unwrap_or(Released::LeaseLost))
        .collect())
}

/// Runs `statement`, a batched statement over the leases' `($1::bigint[], $2::uuid[])`, once
/// per bucket of `leases` in distributed mode (once in all for a single node), on `db`.
async fn by_lease(
    statement: &SqlStr,
    sql: &Complete,
    scope: Scope,
    db: &mut Db<'_>,
    leases: &[Lease],
) -> Result<Vec<PgRow>> {
    let mut rows = Vec::new();
    for (bucket, group) in sql.by_bucket(leases, |l| l.id) {
        let (ids, tokens) = columns(group.into_iter());
        rows.extend(
            scope
                .query(statement.clone())
                .bind(&ids)
                .bind(&tokens)
                .bucket(bucket)
                .fetch_all(&mut **db)
                .await
                .outbox_sql()?,
        );
    }
    Ok(rows)
}

/// Sends the wake-up payloads in column 3 of a batched statement's `rows` (distributed
/// mode, `Scope::wake`); reads nothing on a single node, whose statements notify themselves.
async fn wake_rows(sql: &Complete, scope: Scope, db: &mut Db<'_>, rows: &[PgRow]) -> Result<()> {
    if sql.wake.is_none() {
        return Ok(());
    }
    let wakes = rows
        .iter()
        .map(|r| r.try_get(3))
        .collect::<Result<Vec<_>, _>>()
        .outbox_sql()?;
    scope.wake(db, sql.wake.as_ref(), wakes).await
}

/// Leases as the two array parameters `($1::bigint[], $2::uuid[])` of a batched statement.
fn columns(leases: impl Iterator<Item = Lease>) -> (Vec<i64>, Vec<Uuid>) {
    leases.map(|l| (l.id, l.token)).unzip()
}

/// The lease a batched statement's row reports in its first two columns `(id, token)`:
/// outcomes are matched back by the whole lease, since a stale and a fresh lease of one row
/// may share a batch.
fn lease_at(row: &PgRow) -> Result<Lease> {
    Ok(Lease {
        id: row.try_get(0).outbox_sql()?,
        token: row.try_get(1).outbox_sql()?,
    })
}

/// The follow-up of a success whose fenced DELETE matched nothing (`ack_settle`, under the
/// row lock): applies a queued rearm (and sends its wake-up), deletes a row whose rearm a
/// cancel dropped, or finds the lease lost.
async fn settle(
    sql: &Complete,
    scope: Scope,
    db: &mut Db<'_>,
    lease: &Lease,
) -> Result<Completion> {
    let row = scope
        .query(sql.ack_settle.clone())
        .bind(lease.id)
        .bind(lease.token)
        .bucket(sql.bucket_of(lease.id))
        .fetch_one(&mut **db)
        .await
        .outbox_sql()?;
    scope
        .wake(db, sql.wake.as_ref(), [row.try_get(2).outbox_sql()?])
        .await?;
    settled(&row)
}

/// Reads `(rows locked, rearm deadline)` from a locking completion statement.
fn settled(row: &PgRow) -> Result<Completion> {
    let locked: i64 = row.try_get(0).outbox_sql()?;
    let rearmed: Option<DateTime<Utc>> = row.try_get(1).outbox_sql()?;
    Ok(match (locked, rearmed) {
        (0, _) => Completion::LeaseLost,
        (_, Some(at)) => Completion::Rearmed { at },
        (_, None) => Completion::Deleted,
    })
}

/// `arm_next` on `db`: one locking statement, see [`Armed`]; `bucket` is the row's
/// (distributed mode).
pub(crate) async fn arm_next_on(
    sql: &Periodic,
    scope: Scope,
    mut db: Db<'_>,
    lease: Lease,
    at: DateTime<Utc>,
    bucket: Option<i16>,
) -> Result<Armed> {
    let row = scope
        .query(sql.arm_next.clone())
        .bind(lease.id)
        .bind(lease.token)
        .bind(at)
        .bucket(bucket)
        .fetch_one(&mut *db)
        .await
        .outbox_sql()?;
    db.done().await?;
    let locked: i64 = row.try_get(0).outbox_sql()?;
    let cancelled: Option<bool> = row.try_get(1).outbox_sql()?;
    let stored: Option<DateTime<Utc>> = row.try_get(2).outbox_sql()?;
    let written: bool = row.try_get(3).outbox_sql()?;
    Ok(match (locked, cancelled, stored) {
        (0, _, _) => Armed::LeaseLost,
        (_, Some(true), _) => Armed::Cancelled,
        (_, _, Some(at)) if written => Armed::Queued { at },
        (_, _, Some(at)) => Armed::Kept { at },
        // Locked and not cancelled: the statement either kept a rearm or wrote one.
        (_, _, None) => {
            return Err(Error::Database(sqlx::Error::Protocol(
                "arm_next held the row but reported no rearm".to_owned(),
            )))
        }
    })
}
