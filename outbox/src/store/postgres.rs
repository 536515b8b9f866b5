//! The Postgres store: claim (SPEC §6), fenced completions (SPEC §5.1, §5.2), reads (SPEC §8).

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::postgres::{PgListener, PgPool, PgRow};
use sqlx::types::Json;
use sqlx::Row;
use uuid::Uuid;

use super::{
    clean_error_text, Completion, DeadLetter, Delivery, Failure, Lease, NextWakeup, Store,
    StoredRow, Wakeup,
};
use crate::cancel::Cancelled;
use crate::error::{Error, Result};
use crate::publish::{interval, Headers, Message, Published};
use crate::schema::{Names, Outbox};

/// Every statement of one [`Outbox`], rendered once for its names.
#[derive(Debug)]
pub(crate) struct Sql {
    pub publish: crate::publish::Sql,
    pub cancel: crate::cancel::Sql,
    pub store: StoreSql,
}

impl Sql {
    pub(crate) fn new(n: &Names) -> Self {
        Sql {
            publish: crate::publish::Sql::new(n),
            cancel: crate::cancel::Sql::new(n),
            store: StoreSql::new(n),
        }
    }
}

/// Columns a [`Delivery`] is read from, in [`delivery_from_row`]'s order.
const DELIVERY_COLUMNS: &str = "t.id, t.acquired_token, t.queue, t.payload, t.headers, t.timer_id, \
     t.attempts_count, t.deliveries_count, t.created_at, t.next_attempt_at, t.first_attempt_at, t.acquired_at";

/// Columns a [`StoredRow`] is read from, in [`stored_from_row`]'s order.
const ROW_COLUMNS: &str =
    "id, queue, payload, headers, attempts_count, deliveries_count, created_at, \
     next_attempt_at, first_attempt_at, last_attempt_at, acquired_at, acquired_token, timer_id, \
     rearm_at, rearm_payload, rearm_headers";

/// The SET list that turns a leased row with a queued rearm into a fresh pending timer at
/// `rearm_at` (SPEC §5.1: success and terminal failure): new payload, lease cleared, retry
/// history and `deliveries_count` reset.
const APPLY_REARM: &str =
    "next_attempt_at = t.rearm_at, payload = t.rearm_payload, headers = t.rearm_headers, \
     rearm_at = NULL, rearm_payload = NULL, rearm_headers = NULL, \
     acquired_token = NULL, acquired_at = NULL, \
     attempts_count = 0, first_attempt_at = NULL, last_attempt_at = NULL, deliveries_count = 0";

#[derive(Debug)]
pub(crate) struct StoreSql {
    claim: String,
    ack_delete: String,
    ack_settle: String,
    ack_batch_delete: String,
    ack_batch_settle: String,
    retry: String,
    fail_archive: String,
    next_wakeup: String,
    pending: String,
    dead_letters: String,
}

impl StoreSql {
    fn new(n: &Names) -> Self {
        let t = &n.qtable;
        let d = &n.qdlq;
        // A row made due again by a completion (a rearm applied, a retry scheduled) is
        // announced like a publish, so every worker on the queue can move its wake-up, not
        // only the one that wrote it (it may be busy, or shutting down). The common delete
        // path notifies nothing.
        let notify = |row: &str| crate::publish::notify_expr(n, row);
        // $1 queues, $2 limit, $3 lease ttl, $4 the claim's token.
        // Each queue gets two LATERAL branches with their own LIMIT, each carrying the
        // predicate of its partial index (`acquired_token IS NULL` → <t>_pending_idx,
        // `IS NOT NULL` → <t>_lease_idx), so the cost depends on the limit, not on the
        // backlog. The branches order by their index alone: ordering by (next_attempt_at, id)
        // there would sort every row sharing a deadline (a batch published in one
        // transaction shares `now()`); ties among equal deadlines are taken in index order
        // and the claimed batch is then ordered by (next_attempt_at, id). Rows locked by the
        // branches but cut by the outer LIMIT are released when the statement ends.
        let claim = format!(
            "WITH cand AS (\
               SELECT c.id, c.next_attempt_at FROM unnest($1::text[]) AS q(queue) \
               CROSS JOIN LATERAL (\
                 SELECT id, next_attempt_at FROM {t} \
                 WHERE queue = q.queue AND acquired_token IS NULL AND next_attempt_at <= now() \
                 ORDER BY next_attempt_at LIMIT $2 FOR UPDATE SKIP LOCKED) c \
               UNION ALL \
               SELECT c.id, c.next_attempt_at FROM unnest($1::text[]) AS q(queue) \
               CROSS JOIN LATERAL (\
                 SELECT id, next_attempt_at FROM {t} \
                 WHERE queue = q.queue AND acquired_token IS NOT NULL \
                   AND acquired_at < now() - $3::interval AND next_attempt_at <= now() \
                 ORDER BY acquired_at LIMIT $2 FOR UPDATE SKIP LOCKED) c), \
             due AS (SELECT id FROM cand ORDER BY next_attempt_at, id LIMIT $2) \
             UPDATE {t} t SET acquired_token = $4, acquired_at = now(), \
                              deliveries_count = t.deliveries_count + 1 \
             FROM due WHERE t.id = due.id \
             RETURNING {DELIVERY_COLUMNS}"
        );
        // SPEC §5.2: the common success path is this one DELETE. If an extend holds the row
        // lock, the DELETE waits, and Postgres re-evaluates the WHERE on the committed row
        // (READ COMMITTED), so a freshly queued rearm makes it match nothing and we fall
        // through to the settle statement below.
        let ack_delete =
            format!("DELETE FROM {t} WHERE id = $1 AND acquired_token = $2 AND rearm_at IS NULL");
        // The follow-up, run only when the DELETE matched nothing. It locks the row first and
        // decides under the lock: a cancel may have dropped the rearm between our two
        // statements (the DELETE skipped the row for a rearm that is gone now), and then the
        // row must still be deleted, not reported as a lost lease and left leased. Zero rows
        // locked is the lost lease.
        let ack_settle = format!(
            "WITH cur AS (SELECT id, rearm_at IS NOT NULL AS rearm FROM {t} \
                          WHERE id = $1 AND acquired_token = $2 FOR UPDATE), \
             deleted AS (DELETE FROM {t} t USING cur WHERE t.id = cur.id AND NOT cur.rearm), \
             rearmed AS (UPDATE {t} t SET {APPLY_REARM} FROM cur \
                         WHERE t.id = cur.id AND cur.rearm RETURNING t.next_attempt_at, t.queue) \
             SELECT (SELECT count(*) FROM cur), (SELECT next_attempt_at FROM rearmed), \
                    (SELECT {notify} FROM rearmed)",
            notify = notify("rearmed")
        );
        // Outcomes are matched back by (id, token): a stale and a fresh lease of one row in
        // the same batch must not share one.
        let ack_batch_delete = format!(
            "DELETE FROM {t} t USING unnest($1::bigint[], $2::uuid[]) AS l(id, token) \
             WHERE t.id = l.id AND t.acquired_token = l.token AND t.rearm_at IS NULL \
             RETURNING t.id, l.token"
        );
        // The batched follow-up, for the ids the DELETE did not return; same reasoning as
        // `ack_settle`. Rows are locked in id order so two batches cannot deadlock.
        let ack_batch_settle = format!(
            "WITH cur AS (SELECT t.id, l.token, t.rearm_at IS NOT NULL AS rearm FROM {t} t \
                          JOIN unnest($1::bigint[], $2::uuid[]) AS l(id, token) \
                            ON t.id = l.id AND t.acquired_token = l.token \
                          ORDER BY t.id FOR UPDATE OF t), \
             deleted AS (DELETE FROM {t} t USING cur WHERE t.id = cur.id AND NOT cur.rearm \
                         RETURNING cur.id, cur.token), \
             rearmed AS (UPDATE {t} t SET {APPLY_REARM} FROM cur \
                         WHERE t.id = cur.id AND cur.rearm \
                         RETURNING cur.id, cur.token, t.next_attempt_at, t.queue) \
             SELECT id, token, NULL::timestamptz, NULL::text FROM deleted \
             UNION ALL SELECT id, token, next_attempt_at, {notify} FROM rearmed",
            notify = notify("rearmed")
        );
        // One statement (SPEC §5.2). The locking CTE reads whether a rearm is queued on the
        // latest row version (after any lock wait), only to report which case happened; the
        // UPDATE decides on the same version because we hold its lock.
        // A rearm replaces the retry but keeps deliveries_count, so max_deliveries still
        // stops a handler that fails on every run (SPEC §5.1).
        let retry = format!(
            "WITH cur AS (SELECT id, rearm_at IS NOT NULL AS rearm FROM {t} \
                          WHERE id = $1 AND acquired_token = $2 FOR UPDATE), \
             up AS (UPDATE {t} t SET \
               next_attempt_at = CASE WHEN t.rearm_at IS NOT NULL THEN t.rearm_at ELSE now() + $3::interval END, \
               payload = CASE WHEN t.rearm_at IS NOT NULL THEN t.rearm_payload ELSE t.payload END, \
               headers = CASE WHEN t.rearm_at IS NOT NULL THEN t.rearm_headers ELSE t.headers END, \
               attempts_count = t.attempts_count + 1, \
               first_attempt_at = coalesce(t.first_attempt_at, now()), \
               last_attempt_at = now(), \
               rearm_at = NULL, rearm_payload = NULL, rearm_headers = NULL, \
               acquired_token = NULL, acquired_at = NULL \
             FROM cur WHERE t.id = cur.id \
             RETURNING t.next_attempt_at, cur.rearm, t.queue) \
             SELECT up.next_attempt_at, up.rearm, {notify} FROM up",
            notify = notify("up")
        );
        // Terminal failure with the dead-letter queue: archive the failed run (its own
        // payload) and delete the row or apply its rearm, in one statement (SPEC §5.1).
        // $3 reason, $4 last error, $5 1 if the handler ran (counts as an attempt).
        let fail_archive = format!(
            "WITH cur AS (SELECT id, queue, payload, headers, timer_id, attempts_count, \
                                 deliveries_count, created_at, rearm_at IS NOT NULL AS rearm \
                          FROM {t} WHERE id = $1 AND acquired_token = $2 FOR UPDATE), \
             archived AS (INSERT INTO {d} (original_id, queue, payload, headers, timer_id, \
                            attempts_count, deliveries_count, created_at, failure_reason, last_error) \
                          SELECT id, queue, payload, headers, timer_id, attempts_count + $5, \
                                 deliveries_count, created_at, $3, $4 FROM cur), \
             deleted AS (DELETE FROM {t} t USING cur WHERE t.id = cur.id AND NOT cur.rearm), \
             rearmed AS (UPDATE {t} t SET {APPLY_REARM} FROM cur \
                         WHERE t.id = cur.id AND cur.rearm RETURNING t.next_attempt_at, t.queue) \
             SELECT (SELECT count(*) FROM cur), (SELECT next_attempt_at FROM rearmed), \
                    (SELECT {notify} FROM rearmed)",
            notify = notify("rearmed")
        );
        // Every minimum comes from a partial index (one index probe per queue each).
        let next_wakeup = format!(
            "SELECT now(), \
               (SELECT min(x.next_attempt_at) FROM unnest($1::text[]) AS q(queue) \
                CROSS JOIN LATERAL (SELECT next_attempt_at FROM {t} \
                  WHERE queue = q.queue AND acquired_token IS NULL \
                  ORDER BY next_attempt_at LIMIT 1) x), \
               (SELECT min(x.next_attempt_at) FROM unnest($1::text[]) AS q(queue) \
                CROSS JOIN LATERAL (SELECT next_attempt_at FROM {t} \
                  WHERE queue = q.queue AND acquired_token IS NULL AND next_attempt_at > now() \
                  ORDER BY next_attempt_at LIMIT 1) x), \
               (SELECT min(x.acquired_at) + $2::interval FROM unnest($1::text[]) AS q(queue) \
                CROSS JOIN LATERAL (SELECT acquired_at FROM {t} \
                  WHERE queue = q.queue AND acquired_token IS NOT NULL \
                  ORDER BY acquired_at LIMIT 1) x)"
        );
        let pending = format!(
            "SELECT {ROW_COLUMNS} FROM {t} WHERE queue = $1 ORDER BY next_attempt_at, id LIMIT $2"
        );
        let dead_letters = format!(
            "SELECT id, original_id, queue, payload, headers, timer_id, attempts_count, \
                    deliveries_count, created_at, failed_at, failure_reason, last_error \
             FROM {d} WHERE queue = $1 ORDER BY failed_at, id LIMIT $2"
        );
        StoreSql {
            claim,
            ack_delete,
            ack_settle,
            ack_batch_delete,
            ack_batch_settle,
            retry,
            fail_archive,
            next_wakeup,
            pending,
            dead_letters,
        }
    }
}

fn headers_from(row: &PgRow, idx: usize) -> Result<Option<Headers>> {
    let h: Option<Json<Headers>> = row.try_get(idx)?;
    Ok(h.map(|j| j.0))
}

fn delivery_from_row(row: &PgRow) -> Result<Delivery> {
    Ok(Delivery {
        lease: Lease {
            id: row.try_get(0)?,
            token: row.try_get(1)?,
        },
        queue: row.try_get(2)?,
        payload: row.try_get(3)?,
        headers: headers_from(row, 4)?,
        timer_id: row.try_get(5)?,
        attempts_count: row.try_get(6)?,
        deliveries_count: row.try_get(7)?,
        created_at: row.try_get(8)?,
        deadline: row.try_get(9)?,
        first_attempt_at: row.try_get(10)?,
        claimed_at: row.try_get(11)?,
    })
}

fn stored_from_row(row: &PgRow) -> Result<StoredRow> {
    Ok(StoredRow {
        id: row.try_get(0)?,
        queue: row.try_get(1)?,
        payload: row.try_get(2)?,
        headers: headers_from(row, 3)?,
        attempts_count: row.try_get(4)?,
        deliveries_count: row.try_get(5)?,
        created_at: row.try_get(6)?,
        next_attempt_at: row.try_get(7)?,
        first_attempt_at: row.try_get(8)?,
        last_attempt_at: row.try_get(9)?,
        acquired_at: row.try_get(10)?,
        acquired_token: row.try_get(11)?,
        timer_id: row.try_get(12)?,
        rearm_at: row.try_get(13)?,
        rearm_payload: row.try_get(14)?,
        rearm_headers: headers_from(row, 15)?,
    })
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

fn micros(d: Duration) -> Result<i64> {
    i64::try_from(d.as_micros())
        .map_err(|_| Error::invalid("duration", "overflows 64-bit microseconds"))
}

/// The Postgres implementation of [`Store`]: a pool and an [`Outbox`] (names and SQL).
///
/// Claims and completions run on connections of the pool, each statement in its own short
/// transaction. Publishing inside your own transaction goes through [`Outbox::publish`] or
/// the functions `#[timer]` generates; [`Store::publish`] here is a convenience that runs on
/// a pool connection.
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

    fn sql(&self) -> &StoreSql {
        &self.outbox.sql().store
    }

    /// The follow-up of a success: runs only when the DELETE matched nothing.
    async fn settle(&self, lease: Lease) -> Result<Completion> {
        let row = sqlx::query(&self.sql().ack_settle)
            .bind(lease.id)
            .bind(lease.token)
            .fetch_one(&self.pool)
            .await?;
        settled(&row)
    }
}

impl Store for PgStore {
    async fn claim(
        &self,
        queues: &[String],
        limit: usize,
        lease_ttl: Duration,
    ) -> Result<Vec<Delivery>> {
        let mut conn = self.pool.acquire().await?;
        self.outbox.claim(&mut conn, queues, limit, lease_ttl).await
    }

    async fn ack(&self, lease: Lease) -> Result<Completion> {
        let done = sqlx::query(&self.sql().ack_delete)
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
        let deleted: HashSet<Lease> = sqlx::query(&self.sql().ack_batch_delete)
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
            let rows = sqlx::query(&self.sql().ack_batch_settle)
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
        super::check_retry_delay(delay)?;
        let row = sqlx::query(&self.sql().retry)
            .bind(lease.id)
            .bind(lease.token)
            .bind(interval(micros(delay)?))
            .fetch_optional(&self.pool)
            .await?;
        Ok(match row {
            None => Completion::LeaseLost,
            Some(r) => {
                let at: DateTime<Utc> = r.try_get(0)?;
                if r.try_get::<bool, _>(1)? {
                    Completion::Rearmed { at }
                } else {
                    Completion::RetryScheduled { at }
                }
            }
        })
    }

    async fn fail(&self, lease: Lease, failure: Failure<'_>) -> Result<Completion> {
        if !self.outbox.dead_letter_enabled() {
            // Without a dead-letter table a terminal failure ends the row like a success.
            return self.ack(lease).await;
        }
        let row = sqlx::query(&self.sql().fail_archive)
            .bind(lease.id)
            .bind(lease.token)
            .bind(failure.reason.as_str())
            .bind(failure.last_error.map(clean_error_text))
            .bind(i32::from(failure.reason.handler_ran()))
            .fetch_one(&self.pool)
            .await?;
        settled(&row)
    }

    async fn next_wakeup(&self, queues: &[String], lease_ttl: Duration) -> Result<NextWakeup> {
        for q in queues {
            crate::publish::validate_queue(q)?;
        }
        let row = sqlx::query(&self.sql().next_wakeup)
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

    async fn publish(&self, message: Message<'_>) -> Result<Published> {
        message.validate()?;
        let mut conn = self.pool.acquire().await?;
        self.outbox.publish(&mut conn, message).await
    }

    async fn cancel(&self, queue: &str, timer_id: &str) -> Result<Cancelled> {
        crate::publish::validate_queue(queue)?;
        crate::publish::validate_timer_id(timer_id)?;
        let mut tx = self.pool.begin().await?;
        let out = self.outbox.cancel(&mut tx, queue, timer_id).await?;
        tx.commit().await?;
        Ok(out)
    }

    async fn pending(&self, queue: &str, limit: usize) -> Result<Vec<StoredRow>> {
        let mut conn = self.pool.acquire().await?;
        self.outbox.pending(&mut conn, queue, limit).await
    }

    async fn dead_letters(&self, queue: &str, limit: usize) -> Result<Vec<DeadLetter>> {
        crate::publish::validate_queue(queue)?;
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = sqlx::query(&self.sql().dead_letters)
            .bind(queue)
            .bind(limit)
            .fetch_all(&self.pool)
            .await?;
        rows.iter()
            .map(|r| {
                Ok(DeadLetter {
                    id: r.try_get(0)?,
                    original_id: r.try_get(1)?,
                    queue: r.try_get(2)?,
                    payload: r.try_get(3)?,
                    headers: headers_from(r, 4)?,
                    timer_id: r.try_get(5)?,
                    attempts_count: r.try_get(6)?,
                    deliveries_count: r.try_get(7)?,
                    created_at: r.try_get(8)?,
                    failed_at: r.try_get(9)?,
                    failure_reason: r.try_get(10)?,
                    last_error: r.try_get(11)?,
                })
            })
            .collect()
    }

    fn dead_letter_enabled(&self) -> bool {
        self.outbox.dead_letter_enabled()
    }

    async fn wakeups(&self) -> Result<Option<tokio::sync::mpsc::Receiver<Wakeup>>> {
        let (tx, rx) = tokio::sync::mpsc::channel(256);
        // LISTEN before returning, so the worker's first scan cannot miss a publish.
        let first = listen(&self.pool, self.outbox.channel()).await;
        let start = match first {
            Ok(l) => Some(l),
            Err(e) => {
                tracing::warn!(error = %e, "outbox: LISTEN failed; polling until it is back");
                let _ = tx.try_send(Wakeup::Lost);
                None
            }
        };
        tokio::spawn(listen_loop(
            self.pool.clone(),
            self.outbox.channel().to_owned(),
            start,
            tx,
        ));
        Ok(Some(rx))
    }

    async fn now(&self) -> Result<DateTime<Utc>> {
        Ok(sqlx::query_scalar("SELECT now()")
            .fetch_one(&self.pool)
            .await?)
    }
}

async fn listen(pool: &PgPool, channel: &str) -> Result<PgListener> {
    let mut l = PgListener::connect_with(pool).await?;
    l.listen(channel).await?;
    Ok(l)
}

/// Parses a notification of SPEC §2.4: `<deadline as epoch milliseconds>:<queue>`.
pub(crate) fn parse_notification(payload: &str) -> Option<Wakeup> {
    let (ms, queue) = payload.split_once(':')?;
    let at = DateTime::from_timestamp_millis(ms.parse().ok()?)?;
    Some(Wakeup::Published {
        queue: queue.to_owned(),
        at,
    })
}

/// Forwards notifications until the worker drops the receiver. After a lost connection it
/// reports [`Wakeup::Lost`], re-LISTENs with capped exponential back-off, and reports
/// [`Wakeup::Listening`] only once LISTEN is back, so the worker re-scans after, not
/// before, it can hear new publishes (SPEC §7.3).
async fn listen_loop(
    pool: PgPool,
    channel: String,
    mut listener: Option<PgListener>,
    tx: tokio::sync::mpsc::Sender<Wakeup>,
) {
    let mut backoff = Duration::from_millis(100);
    loop {
        let Some(l) = listener.as_mut() else {
            tokio::select! {
                () = tokio::time::sleep(backoff) => {}
                () = tx.closed() => return,
            }
            match listen(&pool, &channel).await {
                Ok(l) => {
                    listener = Some(l);
                    backoff = Duration::from_millis(100);
                    if tx.send(Wakeup::Listening).await.is_err() {
                        return;
                    }
                }
                Err(e) => {
                    tracing::debug!(error = %e, "outbox: re-LISTEN failed");
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            }
            continue;
        };
        let got = tokio::select! {
            got = l.try_recv() => got,
            () = tx.closed() => return,
        };
        match got {
            Ok(Some(n)) => {
                if let Some(w) = parse_notification(n.payload()) {
                    if tx.send(w).await.is_err() {
                        return;
                    }
                }
            }
            Ok(None) | Err(_) => {
                tracing::warn!("outbox: the LISTEN connection was lost; polling until it is back");
                listener = None;
                if tx.send(Wakeup::Lost).await.is_err() {
                    return;
                }
            }
        }
    }
}

impl Outbox {
    /// Claims up to `limit` due rows of `queues` on the given connection (SPEC §6): one
    /// statement, one new lease token for the whole claim. On a bare connection the claim
    /// is its own short transaction (what [`PgStore`] does); inside your transaction the
    /// row locks are held until you commit, which is how the race tests hold a claim open.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a bad queue name or a `lease_ttl` beyond 64-bit
    /// microseconds; [`Error::Database`].
    pub async fn claim(
        &self,
        conn: &mut sqlx::PgConnection,
        queues: &[String],
        limit: usize,
        lease_ttl: Duration,
    ) -> Result<Vec<Delivery>> {
        for q in queues {
            crate::publish::validate_queue(q)?;
        }
        let ttl = interval(micros(lease_ttl)?);
        if queues.is_empty() || limit == 0 {
            return Ok(Vec::new());
        }
        let queues = &super::distinct(queues);
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = sqlx::query(&self.sql().store.claim)
            .bind(queues)
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

    /// The claim statement's SQL text, for operators who want to `EXPLAIN` it. Parameters:
    /// `$1 text[]` queues, `$2 bigint` limit, `$3 interval` lease TTL, `$4 uuid` token.
    pub fn claim_sql(&self) -> &str {
        &self.sql().store.claim
    }

    /// Reads live rows of `queue` without leasing them (SPEC §8), pending and leased alike,
    /// ordered by deadline then id, at most `limit`. For operators and tests.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a bad queue name; [`Error::Database`].
    pub async fn pending(
        &self,
        conn: &mut sqlx::PgConnection,
        queue: &str,
        limit: usize,
    ) -> Result<Vec<StoredRow>> {
        crate::publish::validate_queue(queue)?;
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = sqlx::query(&self.sql().store.pending)
            .bind(queue)
            .bind(limit)
            .fetch_all(&mut *conn)
            .await?;
        rows.iter().map(stored_from_row).collect()
    }
}
