//! The Postgres store: claim (SPEC §6), fenced completions (SPEC §5.1, §5.2), wake-ups
//! (SPEC §7.3), and the reads operators use (SPEC §8). It executes the statements
//! `sql::claim`, `sql::complete` and `sql::read` render.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::postgres::{PgPool, PgRow};
use sqlx::{PgConnection, Row};
use uuid::Uuid;

use super::rows::delivery_from_row;
use super::{
    check_retry_delay, clean_error_text, distinct, ClaimRequest, Completion, Delivery, Failure,
    Lease, NextWakeup, Store, Wakeup,
};
use crate::cancel::Cancelled;
use crate::error::Result;
use crate::outbox::Outbox;
use crate::publish::{interval, micros, validate_queue, Message, Published};
use crate::read::{DeadLetter, StoredRow};
use crate::sql::complete::Complete;
use crate::timer::{cancel_in_own_transaction, publish_autocommit, Publisher};

/// The Postgres implementation of [`Store`]: a pool and an [`Outbox`] (names and SQL).
///
/// Claims and completions run on connections of the pool, each statement in its own short
/// transaction. Publishing inside your own transaction goes through [`Outbox::publish`] or
/// the functions `#[timer]` generates, handed `&mut *tx`; handed `&store` they publish on a
/// pool connection instead, outside any transaction of yours ([`Publisher`]).
///
/// # The worker's pool
///
/// Give a worker a pool of its own, sized `concurrency + 2` (plus one LISTEN connection the
/// store opens itself), so that application traffic cannot delay timers. Two settings of
/// that pool are worth knowing:
///
/// - `PgPoolOptions::test_before_acquire(false)` saves a round trip per statement: sqlx
///   otherwise pings every connection it checks out. The worker does not need the ping: a
///   claim that fails on a dead connection backs off and runs again, and a completion that
///   does is retried while its lease lasts (SPEC §7.4). Measured in `docs/performance.md`.
/// - `synchronous_commit = off` for the worker's connections
///   (`PgConnectOptions::options([("synchronous_commit", "off")])`) removes the WAL flush
///   from every claim and ack. A crash of the database can then forget the last
///   completions (and claims) of the moment: their rows are delivered again, which
///   at-least-once delivery allows; nothing is lost, and publishes stay exactly as durable
///   as the transactions of your application that make them. Leave it on if a second run
///   of a handler after a database crash is not acceptable to you.
///
/// ```no_run
/// # async fn f() -> Result<(), sqlx::Error> {
/// use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
/// let opts: PgConnectOptions = "postgres://postgres@127.0.0.1/app".parse()?;
/// let worker_pool = PgPoolOptions::new()
///     .max_connections(4 + 2)
///     .test_before_acquire(false)
///     .connect_with(opts)
///     .await?;
/// let store = outbox::PgStore::new(worker_pool, outbox::Outbox::default());
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct PgStore {
    pool: PgPool,
    outbox: Outbox,
}

impl PgStore {
    /// A store over `pool` for the tables `outbox` names.
    pub fn new(pool: PgPool, outbox: Outbox) -> Self {
        PgStore { pool, outbox }
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The outbox (names and configuration).
    pub fn outbox(&self) -> &Outbox {
        &self.outbox
    }

    fn sql(&self) -> &Complete {
        &self.outbox.sql().complete
    }

    /// Claims on the given connection (SPEC §6): one statement, one new lease token for
    /// the whole claim. On a bare connection the claim is its own short transaction (what
    /// [`Store::claim`] does); inside your transaction the row locks are held until you
    /// commit, which is how the project's race tests hold a claim open.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a bad queue name or a
    /// `lease_ttl` beyond 64-bit microseconds; [`Error::Database`](crate::Error::Database).
    pub async fn claim_on(
        &self,
        conn: &mut PgConnection,
        request: ClaimRequest<'_>,
    ) -> Result<Vec<Delivery>> {
        for q in request.queues {
            validate_queue(q)?;
        }
        let ttl = interval(micros(request.lease_ttl)?);
        if request.queues.is_empty() || request.limit == 0 {
            return Ok(Vec::new());
        }
        let queues = distinct(request.queues);
        let limit = i64::try_from(request.limit).unwrap_or(i64::MAX);
        let rows = sqlx::query(self.outbox.sql().claim.claim.clone())
            .bind(&queues)
            .bind(limit)
            .bind(ttl)
            .bind(Uuid::new_v4())
            .fetch_all(&mut *conn)
            .await?;
        let mut out = rows
            .iter()
            .map(delivery_from_row)
            .collect::<Result<Vec<_>>>()?;
        // RETURNING follows the update order, not the CTE's; restore the contract's order.
        out.sort_by_key(|d| (d.deadline, d.lease.id));
        Ok(out)
    }

    /// Live rows of `queue` (pending and leased), ordered by deadline then id, at most
    /// `limit`, read on a pool connection without leasing them (SPEC §8). For operators and
    /// tests; [`Outbox::pending`] reads on your own connection.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a bad queue name;
    /// [`Error::Database`](crate::Error::Database).
    pub async fn pending(&self, queue: &str, limit: usize) -> Result<Vec<StoredRow>> {
        validate_queue(queue)?;
        let mut conn = self.pool.acquire().await?;
        self.outbox.pending(&mut conn, queue, limit).await
    }

    /// Rows of the dead-letter table for `queue`, oldest first, at most `limit`.
    ///
    /// # Errors
    /// As [`PgStore::pending`].
    pub async fn dead_letters(&self, queue: &str, limit: usize) -> Result<Vec<DeadLetter>> {
        crate::read::dead_letters(&self.outbox.sql().read, &self.pool, queue, limit).await
    }

    /// The follow-up of a success: runs only when the DELETE matched nothing.
    async fn settle(&self, lease: Lease) -> Result<Completion> {
        let row = sqlx::query(self.sql().ack_settle.clone())
            .bind(lease.id)
            .bind(lease.token)
            .fetch_one(&self.pool)
            .await?;
        settled(&row)
    }
}

impl Store for PgStore {
    async fn claim(&self, request: ClaimRequest<'_>) -> Result<Vec<Delivery>> {
        let mut conn = self.pool.acquire().await?;
        self.claim_on(&mut conn, request).await
    }

    async fn ack(&self, lease: Lease) -> Result<Completion> {
        let done = sqlx::query(self.sql().ack_delete.clone())
            .bind(lease.id)
            .bind(lease.token)
            .execute(&self.pool)
            .await?;
        if done.rows_affected() == 1 {
            return Ok(Completion::Deleted);
        }
        self.settle(lease).await
    }

    async fn ack_batch(&self, leases: &[Lease]) -> Result<Vec<Completion>> {
        if leases.is_empty() {
            return Ok(Vec::new());
        }
        let ids: Vec<i64> = leases.iter().map(|l| l.id).collect();
        let tokens: Vec<Uuid> = leases.iter().map(|l| l.token).collect();
        let deleted: HashSet<Lease> = sqlx::query(self.sql().ack_batch_delete.clone())
            .bind(&ids)
            .bind(&tokens)
            .fetch_all(&self.pool)
            .await?
            .iter()
            .map(|r| {
                Ok(Lease {
                    id: r.try_get(0)?,
                    token: r.try_get(1)?,
                })
            })
            .collect::<Result<_>>()?;
        let mut out = vec![Completion::LeaseLost; leases.len()];
        let mut rest_ids = Vec::new();
        let mut rest_tokens = Vec::new();
        for (i, l) in leases.iter().enumerate() {
            if deleted.contains(l) {
                out[i] = Completion::Deleted;
            } else {
                rest_ids.push(l.id);
                rest_tokens.push(l.token);
            }
        }
        // The follow-up runs only for the rows the DELETE did not return (SPEC §5.2).
        if !rest_ids.is_empty() {
            let rows = sqlx::query(self.sql().ack_batch_settle.clone())
                .bind(&rest_ids)
                .bind(&rest_tokens)
                .fetch_all(&self.pool)
                .await?;
            let mut settled = HashMap::new();
            for r in rows {
                let lease = Lease {
                    id: r.try_get(0)?,
                    token: r.try_get(1)?,
                };
                let at: Option<DateTime<Utc>> = r.try_get(2)?;
                settled.insert(
                    lease,
                    at.map_or(Completion::Deleted, |at| Completion::Rearmed { at }),
                );
            }
            for (i, l) in leases.iter().enumerate() {
                if !deleted.contains(l) {
                    if let Some(&done) = settled.get(l) {
                        out[i] = done;
                    }
                }
            }
        }
        Ok(out)
    }

    async fn retry(&self, lease: Lease, delay: Duration) -> Result<Completion> {
        check_retry_delay(delay)?;
        let row = sqlx::query(self.sql().retry.clone())
            .bind(lease.id)
            .bind(lease.token)
            .bind(interval(micros(delay)?))
            .fetch_one(&self.pool)
            .await?;
        let locked: i64 = row.try_get(0)?;
        let at: Option<DateTime<Utc>> = row.try_get(1)?;
        let rearmed: Option<bool> = row.try_get(2)?;
        Ok(match (locked, at, rearmed) {
            (0, _, _) => Completion::LeaseLost,
            (_, Some(at), Some(true)) => Completion::Rearmed { at },
            (_, Some(at), _) => Completion::RetryScheduled { at },
            // A cancel reached the row while it ran: deleted instead of retried.
            (_, None, _) => Completion::Cancelled,
        })
    }

    async fn fail(&self, lease: Lease, failure: Failure<'_>) -> Result<Completion> {
        if !self.outbox.dead_letter_enabled() {
            // Without a dead-letter table a terminal failure ends the row like a success.
            return self.ack(lease).await;
        }
        let row = sqlx::query(self.sql().fail_archive.clone())
            .bind(lease.id)
            .bind(lease.token)
            .bind(failure.reason.as_str())
            .bind(failure.last_error.map(clean_error_text))
            .bind(i32::from(failure.reason.handler_ran()))
            .fetch_one(&self.pool)
            .await?;
        if row.try_get::<Option<bool>, _>(3)? == Some(true) {
            return Ok(Completion::Cancelled);
        }
        settled(&row)
    }

    async fn next_wakeup(&self, queues: &[String], lease_ttl: Duration) -> Result<NextWakeup> {
        for q in queues {
            validate_queue(q)?;
        }
        let row = sqlx::query(self.outbox.sql().claim.next_wakeup.clone())
            .bind(queues)
            .bind(interval(micros(lease_ttl)?))
            .fetch_one(&self.pool)
            .await?;
        Ok(NextWakeup {
            now: row.try_get(0)?,
            deadline: row.try_get(1)?,
            upcoming: row.try_get(2)?,
            lease_expiry: row.try_get(3)?,
        })
    }

    async fn wakeups(&self) -> Result<Option<tokio::sync::mpsc::Receiver<Wakeup>>> {
        Ok(Some(
            super::listen::start(&self.pool, self.outbox.channel()).await,
        ))
    }

    async fn now(&self) -> Result<DateTime<Utc>> {
        Ok(sqlx::query_scalar(self.outbox.sql().claim.now.clone())
            .fetch_one(&self.pool)
            .await?)
    }

    fn dead_letter_enabled(&self) -> bool {
        self.outbox.dead_letter_enabled()
    }
}

/// Publishes on a pool connection, outside any transaction of yours (autocommit); cancels
/// in a short transaction of its own.
impl Publisher for &PgStore {
    fn publish_message<'m>(
        self,
        message: Message<'m>,
    ) -> impl Future<Output = Result<Published>> + Send {
        publish_autocommit(&self.pool, &self.outbox, message)
    }

    fn cancel_timer(
        self,
        queue: &str,
        timer_id: &str,
    ) -> impl Future<Output = Result<Cancelled>> + Send {
        cancel_in_own_transaction(&self.pool, &self.outbox, queue, timer_id)
    }
}

/// Reads `(rows locked, rearm deadline)` from a locking completion statement.
fn settled(row: &PgRow) -> Result<Completion> {
    let locked: i64 = row.try_get(0)?;
    let rearmed: Option<DateTime<Utc>> = row.try_get(1)?;
    Ok(match (locked, rearmed) {
        (0, _) => Completion::LeaseLost,
        (_, Some(at)) => Completion::Rearmed { at },
        (_, None) => Completion::Deleted,
    })
}
