//! The Postgres store: claim, fenced completions, lease renewal and release, wake-ups, and
//! the reads operators use. It executes the statements `sql::claim`, `sql::complete` and
//! `sql::read` render, on two pools: the caller's, and one with a short `lock_timeout` for
//! the writes that must never wait for a row lock while holding another (so they cannot
//! deadlock with an application's transaction).

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::future::join_all;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::types::Json;
use sqlx::{PgConnection, Postgres, Row};
use uuid::Uuid;

use super::connect::explain;
use super::fenced::{
    ack_batch_delete_on, ack_batch_settle_on, ack_on, arm_next_on, fail_on, release_on, renew_on,
    retry_on,
};
use super::periodic::check_instant;
use super::plan::{plan, Visit, Work};
use super::rows::{delivery_from_row, DeadLetter, StoredRow};
use super::{
    check_retry_delay, clean_error_text, fair_order, Armed, AutovacuumOff, ClaimRequest,
    Completion, Delivery, Failure, Lease, NextWakeup, RegisterSchedule, Registered, Release,
    Released, Renewal, Store, TransactionSource, Wakeup,
};
use crate::cancel::Cancelled;
use crate::dlq::DeadLetterFilter;
use crate::error::{Error, OutboxSql, Result};
use crate::message::envelope::{Message, Published};
use crate::message::validate_queue;
use crate::outbox::Outbox;
use crate::scope::{BindBucket, Db, Scope};
use crate::sql::binds::{interval, micros};
use crate::sql::complete::Complete;
use crate::sql::periodic::Periodic;
use crate::stats::{QueueStats, StatsRequest};
use crate::timer::{cancel_in_own_transaction, publish_autocommit, Publisher};

/// The `lock_timeout` of the store's own pool, for completions, lease renewal and release:
/// far below Postgres' default `deadlock_timeout` of 1 s, so a worker statement that waits
/// on a row an application transaction holds gives up (and finishes its rows one at a time)
/// before Postgres' deadlock check could abort the application's transaction.
pub const LOCK_TIMEOUT: Duration = Duration::from_millis(200);

/// The Postgres implementation of [`Store`]: a pool and an [`Outbox`] (names and SQL).
///
/// Claims run on connections of the pool, each statement in its own short transaction.
/// While a worker's claims follow each other (a backlog), its claim loop keeps the one
/// connection they run on out of the pool, so every claim finds the statement prepared and
/// planned there; the connection goes back when the loop is about to sleep or stops
/// ([`ClaimRequest::keep_connection()`]). The worker opens the second pool's first
/// connection (below) when it starts, so its first completions do not wait for a connect.
/// Publishing inside your own transaction goes through [`Outbox::publish`] or the functions
/// `#[timer]` generates, handed `&mut *tx`; handed `&store` they publish on a pool connection
/// instead, outside any transaction of yours ([`Publisher`]).
///
/// # Connections
///
/// A worker over this store uses three kinds of connection:
///
/// | for | from | at most |
/// |---|---|---|
/// | claims, wake-up reads; handlers' own transactions ([`Context::begin`](crate::Context::begin)); a completion that must wait for a row lock; the queue-depth gauge's read of the statistics, when on | the pool you give | 2 + one per handler slot (its transaction while it runs, or its completion after): 1 for claims and wake-up reads, 1 for the batched acks' rows that wait for a row lock (finished one at a time), + 1 with the queue-depth gauge |
/// | completions, lease renewal, release at shutdown | a second pool the store opens on first use (a worker's start), with your pool's connect options (not its `after_connect` hooks: put session settings such as `synchronous_commit` in the connect options) and size, plus `lock_timeout = 200ms` (a startup parameter; through a transaction-mode pooler, [`transaction_pooler`](crate::OutboxBuilder::transaction_pooler), a `SET LOCAL` in each write's transaction instead) | `concurrency + 2` |
/// | `LISTEN` for wake-ups | a connection of its own, outside both pools | 1 |
///
/// Completions, renewal and release run with a short `lock_timeout` because an application
/// transaction may hold a timer row's lock (an extend) while waiting for another row the
/// worker's statement already locked: with a timeout well below Postgres'
/// `deadlock_timeout` (1 s) the worker gives up first, so the deadlock check never aborts
/// your transaction. A statement that times out is split, and its rows finished one at a
/// time; a single-row completion then runs on your pool, without the timeout, and waits for
/// the lock (holding no other): that is how a completion orders itself after an extend that
/// holds the row. The timeout is never set on your pool's connections, which handlers use.
///
/// So give a worker a pool of its own of at least `concurrency + 2` connections
/// (`concurrency + 3` with the queue-depth gauge; the worker's `build()` checks it), and
/// count on up to twice that many server connections, plus one, per worker. Two settings of that pool are worth knowing:
///
/// - `PgPoolOptions::test_before_acquire(false)` saves a round trip per statement: sqlx
///   otherwise pings every connection it checks out. The worker does not need the ping: a
///   claim that fails on a dead connection backs off and runs again, and a completion that
///   does is retried while its lease lasts. The ping cost up to a third of consumer
///   throughput in the project's benchmarks
///   (<https://github.com/outbox-rs/outbox/blob/main/docs/lab-notes/2026-11-29.md>, "Diagnostics").
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
    /// The pool with `lock_timeout`, opened on first use (opening a pool needs a runtime,
    /// and `new` may run outside one).
    fenced: Arc<OnceLock<PgPool>>,
    /// The connection of the last claim, kept for the next one while claims follow each
    /// other (see [`ClaimConnection`]).
    claimer: Arc<ClaimConnection>,
    outbox: Outbox,
    /// Distributed mode: where the next claim starts among the buckets with work.
    bucket_cursor: Arc<AtomicUsize>,
    /// Distributed mode: the table's bucket count was found to be the outbox's.
    buckets_checked: Arc<AtomicBool>,
    /// Distributed mode: when the claim last logged that it went bucket by bucket.
    fallback_logged: Arc<Mutex<Option<std::time::Instant>>>,
}

/// The connection a busy claim loop claims on, one claim after another. The claim
/// statement is prepared and planned once per server connection (sqlx caches prepared
/// statements per connection; Postgres caches catalog entries per backend), and the pool
/// hands its idle connections out in turn: without this slot the claims of a draining worker
/// land on every connection of the pool in turn, each paying the first parse and plan
/// (issue 27, measured on a 1 000-row drain: 2–3.5 ms parse + 1–2 ms bind per claim on a
/// connection new to it, against 0.8 ms bind once warm). Only for a claim that asks for it
/// ([`ClaimRequest::keep_connection()`], which the worker's claim loop sets), so a caller of
/// [`Store::claim`] never finds a connection missing from its pool. The connection goes
/// back to the pool when the claim loop reads its next wake-up, i.e. when it is about to
/// sleep, and when the loop stops; one that failed is never kept. Only outside a
/// transaction-mode pooler, whose statements are unnamed anyway.
#[derive(Debug, Default)]
struct ClaimConnection(Mutex<Option<PoolConnection<Postgres>>>);

impl ClaimConnection {
    fn take(&self) -> Option<PoolConnection<Postgres>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    /// Keeps `conn` for the next claim, unless another one is kept already (a second worker
    /// over the same store): then `conn` goes back to the pool.
    fn keep(&self, conn: PoolConnection<Postgres>) {
        let mut slot = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            *slot = Some(conn);
        }
    }
}

impl PgStore {
    /// A store over `pool` for the tables `outbox` names.
    pub fn new(pool: PgPool, outbox: Outbox) -> Self {
        PgStore {
            pool,
            fenced: Arc::new(OnceLock::new()),
            claimer: Arc::default(),
            outbox,
            bucket_cursor: Arc::default(),
            buckets_checked: Arc::default(),
            fallback_logged: Arc::default(),
        }
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

    fn scope(&self) -> Scope {
        self.outbox.scope()
    }

    /// A connection for a write with the short `lock_timeout` (see the type's docs).
    async fn fenced_db(&self) -> Result<Db<'static>> {
        self.scope()
            .acquire_fenced(self.fenced(), LOCK_TIMEOUT)
            .await
    }

    /// A connection of the caller's pool for statements that commit on their own.
    async fn pool_db(&self) -> Result<Db<'static>> {
        self.scope().acquire(&self.pool).await
    }

    /// The pool with a short `lock_timeout` (see the type's docs).
    fn fenced(&self) -> &PgPool {
        self.fenced.get_or_init(|| {
            let ms = LOCK_TIMEOUT.as_millis().to_string() + "ms";
            let options = (*self.pool.connect_options()).clone();
            // Through a transaction-mode pooler the startup parameter would be refused (or
            // dropped): each write sets it with SET LOCAL instead (`Scope::acquire_fenced`).
            let options = match self.scope() {
                Scope::Session | Scope::Unnamed => options.options([("lock_timeout", ms.as_str())]),
                Scope::Transaction => options,
            };
            let of = self.pool.options();
            PgPoolOptions::new()
                .max_connections(of.get_max_connections())
                .acquire_timeout(of.get_acquire_timeout())
                .test_before_acquire(of.get_test_before_acquire())
                .idle_timeout(of.get_idle_timeout())
                .connect_lazy_with(options)
        })
    }

    /// [`Store::claim`] on the given connection: one statement, one new lease token for the
    /// whole claim. It takes up to `request.limit` rows of the requested queues whose
    /// deadline has come (`next_attempt_at <= now()`) and that are unleased or whose lease is
    /// older than `request.lease_ttl` by the database clock, sets the token and
    /// `acquired_at = now()`, and adds 1 to `deliveries_count`. `FOR UPDATE SKIP LOCKED`
    /// skips rows another transaction has locked, so two claims never take the same row and
    /// a claim never waits on an application's lock. On a bare connection the claim is its
    /// own short transaction (what [`Store::claim`] does); inside a transaction the row locks
    /// are held until it ends (the test hook `claim_on`).
    pub(crate) async fn claim_with(
        &self,
        conn: &mut PgConnection,
        request: ClaimRequest<'_>,
    ) -> Result<Vec<Delivery>> {
        for q in request.queues {
            validate_queue(q)?;
        }
        let ttl = interval(micros(request.lease_ttl, "lease_ttl")?);
        let (queues, caps) = request.per_queue()?;
        if queues.is_empty() || request.limit == 0 {
            return Ok(Vec::new());
        }
        let sql = &self.outbox.sql().claim;
        let scope = self.scope();
        let token = Uuid::new_v4();
        let route = self.route(conn, request, &queues, &caps).await?;
        let (dynamic, visits) = (route.dynamic, route.visits);
        let (tried, mut failed) = (visits.len(), Vec::new());
        let mut caps = caps;
        let mut out = Vec::new();
        for visit in visits {
            let left = request.limit - out.len();
            if left == 0 {
                break;
            }
            let left = i64::try_from(left).unwrap_or(i64::MAX);
            // A planned visit takes its shares; a dynamic one what the queues have left.
            let (visit_queues, visit_caps, limit) = match &visit.plan {
                Some(p) => (&p.queues, &p.caps, p.limit().min(left)),
                None => (&queues, &caps, left),
            };
            let query = match request.only {
                None => scope.query(sql.claim.clone()),
                Some(_) => scope.query(sql.claim_only.clone()),
            }
            .bind(visit_queues)
            .bind(limit)
            .bind(ttl)
            .bind(token)
            .bind(request.exclude)
            .bind(visit_caps);
            let query = match request.only {
                None => query,
                Some(ids) => query.bind(ids),
            }
            .bucket(visit.bucket);
            let rows = match query.fetch_all(&mut *conn).await.outbox_sql() {
                Ok(rows) => rows,
                // Visiting every bucket because the read across the shards failed (a worker
                // node down): a bucket whose shard does not answer is skipped, so the rows
                // of the nodes that do answer keep being claimed.
                Err(e) if route.every => {
                    failed.push(e);
                    continue;
                }
                Err(e) => return Err(e),
            };
            let claimed = rows
                .iter()
                .map(delivery_from_row)
                .collect::<Result<Vec<_>>>()?;
            // A row id names its bucket only with the table's bucket count: a process built
            // with another count would fence every completion against the wrong shard. The
            // rows claimed here stay leased until their lease expires.
            if let (Some(b), Some(layout)) = (visit.bucket, self.outbox.buckets()) {
                if let Some(d) = claimed
                    .iter()
                    .find(|d| d.lease.id.rem_euclid(i64::from(layout)) != i64::from(b))
                {
                    return Err(Error::InvalidConfig {
                        knob: "distributed",
                        reason: format!(
                            "row {} claimed in bucket {b} does not name it with distributed({layout}): this worker's bucket count is not the table's (validate_schema names it)",
                            d.lease.id
                        ),
                    });
                }
            }
            if dynamic && visit.bucket.is_some() {
                spend_caps(&mut caps, &queues, claimed.iter().map(|d| d.queue.as_str()));
            }
            out.extend(claimed);
        }
        if !failed.is_empty() && failed.len() == tried {
            return Err(failed.swap_remove(0));
        }
        // RETURNING follows the update order, not the CTE's; restore the contract's order.
        fair_order(&mut out, request.resume_after);
        Ok(out)
    }

    /// The statements of a claim over `queues` (in the round's order, `caps` parallel): one
    /// over the whole table on a single node; in distributed mode one per bucket, planned
    /// from one read across the shards (`store/plan.rs`). A claim among given ids
    /// (`ClaimRequest::only`) visits the buckets with work and lets each take what the
    /// queues have left, since the read counts rows it may not take. When that read fails
    /// (a worker node down) the claim visits every bucket the same way, from a cursor that
    /// moves on by one every claim, so the buckets of the nodes that answer can still be
    /// claimed and none is always last.
    async fn route(
        &self,
        conn: &mut PgConnection,
        request: ClaimRequest<'_>,
        queues: &[String],
        caps: &[i64],
    ) -> Result<Route> {
        let (Some(finder), Some(layout)) =
            (&self.outbox.sql().claim.buckets, self.outbox.buckets())
        else {
            return Ok(Route::dynamic(vec![None], false));
        };
        // A process built with another bucket count would read every row's bucket wrongly
        // (a keyed timer's, the one an id names): its claims are refused, every one, until
        // the table's CHECK says the counts agree (read once per store).
        if !self.buckets_checked.load(Ordering::Relaxed) {
            self.outbox.require_table_buckets_if(conn, true).await?;
            self.buckets_checked.store(true, Ordering::Relaxed);
        }
        let ttl = interval(micros(request.lease_ttl, "lease_ttl")?);
        let found = self
            .scope()
            .query(finder.clone())
            .bind(queues)
            .bind(ttl)
            .bind(request.exclude)
            .fetch_all(&mut *conn)
            .await
            .outbox_sql()
            .and_then(|rows| {
                rows.iter()
                    .map(|r| {
                        Ok(Work {
                            bucket: r.try_get(0).outbox_sql()?,
                            queue: r.try_get(1).outbox_sql()?,
                            rows: r.try_get(2).outbox_sql()?,
                        })
                    })
                    .collect::<Result<Vec<Work>>>()
            });
        let work = match found {
            Ok(work) => work,
            Err(e) if e.is_missing_paused_table() => return Err(e),
            Err(e) => {
                // Once every 10 s at most: with a node down every claim goes this way.
                let now = std::time::Instant::now();
                let mut last = self
                    .fallback_logged
                    .lock()
                    .unwrap_or_else(|p| p.into_inner());
                if last.is_none_or(|l| now.duration_since(l) >= Duration::from_secs(10)) {
                    *last = Some(now);
                    tracing::warn!(error = %e, "the read for buckets with work failed; claiming bucket by bucket (logged at most every 10 s)");
                }
                drop(last);
                let mut every: Vec<Option<i16>> = (0..layout as i16).map(Some).collect();
                let turn = self.bucket_cursor.fetch_add(1, Ordering::Relaxed) % every.len();
                every.rotate_left(turn);
                return Ok(Route::dynamic(every, true));
            }
        };
        if request.only.is_some() {
            let mut buckets: Vec<Option<i16>> = Vec::new();
            for w in &work {
                if !buckets.contains(&Some(w.bucket)) {
                    buckets.push(Some(w.bucket));
                }
            }
            return Ok(Route::dynamic(buckets, false));
        }
        let visits = plan(queues, caps, request.limit, &work)
            .into_iter()
            .map(|p| Step {
                bucket: Some(p.bucket),
                plan: Some(p),
            })
            .collect();
        Ok(Route {
            visits,
            dynamic: false,
            every: false,
        })
    }

    /// [`Scope::unmigrated_or`] on a connection of the pool (the failed one is given back
    /// first, so a pool of one connection does not wait for itself).
    async fn unmigrated_or(&self, e: Error) -> Error {
        if !e.is_missing_paused_table() {
            return e;
        }
        match self.pool.acquire().await {
            Ok(mut conn) => {
                self.scope()
                    .unmigrated_or(&mut conn, self.outbox.table(), e)
                    .await
            }
            Err(_) => e,
        }
    }

    /// Live rows of `queue` (pending and leased), ordered by deadline then id, at most
    /// `limit`, read on a pool connection without leasing or locking them. For operators and
    /// tests; [`Outbox::pending`] reads on your own connection.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a bad queue name;
    /// [`Error::Database`](crate::Error::Database).
    pub async fn pending(&self, queue: &str, limit: usize) -> Result<Vec<StoredRow>> {
        validate_queue(queue)?;
        let mut conn = self.pool.acquire().await.outbox_sql()?;
        self.outbox.pending(&mut conn, queue, limit).await
    }

    /// Dead letters of `filter` with an id above `after`, by id, at most `limit`, read on a
    /// pool connection: [`Outbox::dead_letters`], which reads on your own connection, has
    /// the rules ([`crate::dlq`] the paging).
    ///
    /// # Errors
    /// As [`Outbox::dead_letters`].
    pub async fn dead_letters(
        &self,
        filter: &DeadLetterFilter,
        after: Option<i64>,
        limit: usize,
    ) -> Result<Vec<DeadLetter>> {
        crate::dlq::require_enabled(self.outbox.dead_letter_enabled())?;
        filter.binds()?;
        let mut conn = self.pool.acquire().await.outbox_sql()?;
        self.outbox
            .dead_letters(&mut conn, filter, after, limit)
            .await
    }

    /// The queue statistics of [`Outbox::stats`], read on a connection of the pool (one
    /// statement, no row lock).
    ///
    /// # Errors
    /// As [`Outbox::stats`].
    pub async fn stats(&self, request: &StatsRequest) -> Result<Vec<QueueStats>> {
        request.validate()?;
        let mut conn = self.pool.acquire().await.outbox_sql()?;
        self.outbox.stats(&mut conn, request).await
    }

    /// Runs a single-row write on the fenced pool; if it timed out on a row lock, runs it
    /// again on the caller's pool, where it may wait (it holds no other row lock).
    async fn single<T, F, Fut>(&self, write: F) -> Result<T>
    where
        F: Fn(Db<'static>) -> Fut,
        Fut: Future<Output = Result<T>>,
    {
        match write(self.fenced_db().await?).await {
            Err(e) if e.is_lock_timeout() => write(self.pool_db().await?).await,
            done => done,
        }
    }
}

/// The statements of one claim or peek (`PgStore::route`).
struct Route {
    visits: Vec<Step>,
    /// The visits take what the queues have left (`spend_caps`), not a plan's shares.
    dynamic: bool,
    /// The visits are every bucket, because the read across the shards failed.
    every: bool,
}

impl Route {
    fn dynamic(buckets: Vec<Option<i16>>, every: bool) -> Self {
        Route {
            visits: buckets
                .into_iter()
                .map(|bucket| Step { bucket, plan: None })
                .collect(),
            dynamic: true,
            every,
        }
    }
}

/// One statement of a claim or peek: its bucket (none on a single node) and, when planned,
/// the queues and shares it takes.
struct Step {
    bucket: Option<i16>,
    plan: Option<Visit>,
}

/// Distributed mode: lowers each queue's cap (parallel to `queues`) by the rows one bucket
/// gave, so the next bucket's claim takes only what the queue has left.
fn spend_caps<'q>(caps: &mut [i64], queues: &[String], taken: impl Iterator<Item = &'q str>) {
    for queue in taken {
        if let Some(i) = queues.iter().position(|q| q == queue) {
            caps[i] = (caps[i] - 1).max(0);
        }
    }
}

impl super::sealed::Sealed for PgStore {}

impl Store for PgStore {
    async fn claim(&self, request: ClaimRequest<'_>) -> Result<Vec<Delivery>> {
        if request.keep_connection && self.scope() != Scope::Transaction {
            let mut conn = match self.claimer.take() {
                Some(c) => c,
                None => match self.pool.acquire().await {
                    Ok(c) => c,
                    Err(e) => return Err(explain(&self.pool, e.into()).await),
                },
            };
            return match self.claim_with(&mut conn, request).await {
                Ok(claimed) => {
                    self.claimer.keep(conn);
                    Ok(claimed)
                }
                Err(e) => {
                    // A connection whose claim failed is not kept (see `ClaimConnection`);
                    // give it back first: the look-up takes one of its own.
                    drop(conn);
                    Err(self.unmigrated_or(e).await)
                }
            };
        }
        let mut conn = match self.pool_db().await {
            Ok(c) => c,
            Err(e) => return Err(explain(&self.pool, e).await),
        };
        let claimed = match self.claim_with(&mut conn, request).await {
            Ok(c) => c,
            Err(e) => {
                // Give the connection back first: the look-up takes one of its own.
                drop(conn);
                return Err(self.unmigrated_or(e).await);
            }
        };
        conn.done().await?;
        Ok(claimed)
    }

    async fn claim_in_order(
        &self,
        request: ClaimRequest<'_>,
        key_header: &str,
    ) -> Result<Vec<Delivery>> {
        if !self.claims_in_order() {
            return Err(super::in_order_unsupported());
        }
        for q in request.queues {
            validate_queue(q)?;
        }
        let ttl = interval(micros(request.lease_ttl, "lease_ttl")?);
        if request.queues.is_empty() || request.limit == 0 {
            return Ok(Vec::new());
        }
        let sql = crate::sql::claim::ordered_claim(self.outbox.names(), key_header);
        let mut conn = match self.pool_db().await {
            Ok(c) => c,
            Err(e) => return Err(explain(&self.pool, e).await),
        };
        let rows = self
            .scope()
            .query(sql)
            .bind(request.queues)
            .bind(i64::try_from(request.limit).unwrap_or(i64::MAX))
            .bind(ttl)
            .bind(request.exclude)
            .bind(Uuid::new_v4())
            .fetch_all(&mut *conn)
            .await
            .outbox_sql();
        let rows = match rows {
            Ok(rows) => rows,
            Err(e) => {
                drop(conn);
                return Err(self.unmigrated_or(e).await);
            }
        };
        conn.done().await?;
        let mut claimed = rows
            .iter()
            .map(delivery_from_row)
            .collect::<Result<Vec<_>>>()?;
        claimed.sort_by_key(|d| d.lease.id);
        Ok(claimed)
    }

    fn claims_in_order(&self) -> bool {
        self.outbox.buckets().is_none()
    }

    async fn ack(&self, lease: Lease) -> Result<Completion> {
        let (sql, scope) = (self.sql(), self.scope());
        self.single(|db| ack_on(sql, scope, db, lease)).await
    }

    async fn ack_batch(&self, leases: &[Lease]) -> Result<Vec<Completion>> {
        if leases.is_empty() {
            return Ok(Vec::new());
        }
        // A statement that meets a row locked by another transaction (or one row's bad data)
        // changed nothing: its rows are finished one at a time, so the others land at once
        // and only the locked one waits (SPEC §7.4). The DELETE commits on its own, so rows
        // it deleted are never retried.
        let one_by_one = |rest: Vec<Lease>| async move {
            let done = join_all(rest.iter().map(|&l| self.ack(l))).await;
            rest.into_iter()
                .zip(done)
                .map(|(l, c)| c.map(|c| (l, c)))
                .collect::<Result<HashMap<Lease, Completion>>>()
        };
        let (sql, scope) = (self.sql(), self.scope());
        let deleted = match ack_batch_delete_on(sql, scope, self.fenced_db().await?, leases).await {
            Ok(d) => d,
            Err(e) if e.is_lock_timeout() || e.is_row_fault() => {
                let done = one_by_one(leases.to_vec()).await?;
                return Ok(leases.iter().map(|l| done[l]).collect());
            }
            Err(e) => return Err(e),
        };
        let rest: Vec<Lease> = leases
            .iter()
            .copied()
            .filter(|l| !deleted.contains(l))
            .collect();
        // The follow-up runs only for the rows the DELETE did not return (SPEC §5.2).
        let settled = if rest.is_empty() {
            HashMap::new()
        } else {
            match ack_batch_settle_on(sql, scope, self.fenced_db().await?, &rest).await {
                Err(e) if e.is_lock_timeout() || e.is_row_fault() => one_by_one(rest).await?,
                done => done?,
            }
        };
        Ok(leases
            .iter()
            .map(|l| {
                if deleted.contains(l) {
                    Completion::Deleted
                } else {
                    settled.get(l).copied().unwrap_or(Completion::LeaseLost)
                }
            })
            .collect())
    }

    async fn retry(&self, lease: Lease, delay: Duration) -> Result<Completion> {
        check_retry_delay(delay)?;
        let (sql, scope) = (self.sql(), self.scope());
        self.single(|db| retry_on(sql, scope, db, lease, delay))
            .await
    }

    async fn fail(&self, lease: Lease, failure: Failure<'_>) -> Result<Completion> {
        let (sql, scope) = (self.sql(), self.scope());
        let archive = self.outbox.dead_letter_enabled();
        self.single(|db| fail_on(sql, scope, db, archive, lease, failure))
            .await
    }

    async fn renew(&self, leases: &[Lease]) -> Result<Vec<Renewal>> {
        if leases.is_empty() {
            return Ok(Vec::new());
        }
        let (sql, scope) = (self.sql(), self.scope());
        match renew_on(sql, scope, self.fenced_db().await?, leases).await {
            // A row locked by another transaction (an extend): renew the rest one at a time,
            // and report the locked one as busy, not lost, without waiting for it.
            Err(e) if e.is_lock_timeout() => {
                let singles = join_all(leases.iter().map(|l| async move {
                    let db = self.fenced_db().await?;
                    match renew_on(sql, scope, db, std::slice::from_ref(l)).await {
                        Ok(r) => Ok(r[0]),
                        Err(e) if e.is_lock_timeout() => Ok(Renewal::Busy),
                        Err(e) => Err(e),
                    }
                }))
                .await;
                singles.into_iter().collect()
            }
            done => done,
        }
    }

    async fn release(&self, items: &[Release]) -> Result<Vec<Released>> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let (sql, scope) = (self.sql(), self.scope());
        match release_on(sql, scope, self.fenced_db().await?, items).await {
            Err(e) if e.is_lock_timeout() || e.is_row_fault() => {
                let singles = join_all(items.iter().map(|item| async move {
                    let one = std::slice::from_ref(item);
                    self.single(|db| release_on(sql, scope, db, one))
                        .await
                        .map(|r| r[0])
                }))
                .await;
                singles.into_iter().collect()
            }
            done => done,
        }
    }

    async fn fail_unclaimed(
        &self,
        id: i64,
        lease_ttl: Duration,
        failure: Failure<'_>,
    ) -> Result<Completion> {
        let ttl = interval(micros(lease_ttl, "lease_ttl")?);
        let mut db = self.pool_db().await?;
        let deleted: i64 = self
            .scope()
            .query_scalar(self.sql().fail_unclaimed.clone())
            .bind(id)
            .bind(ttl)
            .bind(failure.reason.as_str())
            .bind(failure.last_error.map(clean_error_text))
            .bind(self.outbox.dead_letter_enabled())
            .bucket(self.outbox.bucket_of_id(id))
            .fetch_one(&mut *db)
            .await
            .outbox_sql()?;
        db.done().await?;
        Ok(if deleted > 0 {
            Completion::Deleted
        } else {
            Completion::LeaseLost
        })
    }

    async fn arm_next(&self, lease: Lease, at: DateTime<Utc>) -> Result<Armed> {
        check_instant("at", at)?;
        let (sql, scope) = (&self.outbox.sql().periodic, self.scope());
        let bucket = self.outbox.bucket_of_id(lease.id);
        self.single(|db| arm_next_on(sql, scope, db, lease, at, bucket))
            .await
    }

    async fn register_schedule(&self, request: RegisterSchedule<'_>) -> Result<Registered> {
        // On the caller's pool: a registration may wait for a claim's or a completion's row
        // lock, and holds no other.
        let bucket = self.outbox.bucket_for(Some(request.timer_id), None);
        register_on(
            &self.outbox.sql().periodic,
            self.scope(),
            &self.pool,
            request,
            bucket,
        )
        .await
    }

    async fn next_wakeup(&self, request: ClaimRequest<'_>) -> Result<NextWakeup> {
        for q in request.queues {
            validate_queue(q)?;
        }
        let ttl = interval(micros(request.lease_ttl, "lease_ttl")?);
        let query = self
            .scope()
            .query(self.outbox.sql().claim.next_wakeup.clone())
            .bind(request.queues)
            .bind(ttl)
            .bind(request.exclude);
        // The claim loop is about to sleep: read on the claims' connection, then give it
        // back to the pool (`ClaimConnection`).
        let row = match self.claimer.take() {
            Some(mut conn) => {
                let row = query.fetch_one(&mut *conn).await.outbox_sql();
                drop(conn);
                row
            }
            None => {
                let mut db = self.pool_db().await?;
                let row = query.fetch_one(&mut *db).await.outbox_sql();
                if row.is_ok() {
                    db.done().await?;
                }
                row
            }
        };
        let row = match row {
            Ok(row) => row,
            Err(e) => return Err(self.unmigrated_or(e).await),
        };
        Ok(NextWakeup {
            now: row.try_get(0).outbox_sql()?,
            deadline: row.try_get(1).outbox_sql()?,
            upcoming: row.try_get(2).outbox_sql()?,
            lease_expiry: row.try_get(3).outbox_sql()?,
        })
    }

    async fn peek(&self, request: ClaimRequest<'_>) -> Result<Vec<(i64, String)>> {
        for q in request.queues {
            validate_queue(q)?;
        }
        let ttl = interval(micros(request.lease_ttl, "lease_ttl")?);
        let (queues, caps) = request.per_queue()?;
        if queues.is_empty() || request.limit == 0 {
            return Ok(Vec::new());
        }
        let mut db = self.pool_db().await?;
        let mut rows: Vec<sqlx::postgres::PgRow> = Vec::new();
        let mut caps = caps;
        // As `claim_with`: the same route, the same shares.
        let route = self.route(&mut db, request, &queues, &caps).await?;
        for visit in route.visits {
            let Some(left) = request.limit.checked_sub(rows.len()).filter(|n| *n > 0) else {
                break;
            };
            let left = i64::try_from(left).unwrap_or(i64::MAX);
            let (visit_queues, visit_caps, limit) = match &visit.plan {
                Some(p) => (&p.queues, &p.caps, p.limit().min(left)),
                None => (&queues, &caps, left),
            };
            let found = self
                .scope()
                .query(self.outbox.sql().claim.peek.clone())
                .bind(visit_queues)
                .bind(limit)
                .bind(ttl)
                .bind(request.exclude)
                .bind(visit_caps)
                .bucket(visit.bucket)
                .fetch_all(&mut *db)
                .await
                .outbox_sql()?;
            if route.dynamic && visit.bucket.is_some() {
                let taken: Vec<String> = found
                    .iter()
                    .map(|r| r.try_get(1).outbox_sql())
                    .collect::<Result<_>>()?;
                spend_caps(&mut caps, &queues, taken.iter().map(String::as_str));
            }
            rows.extend(found);
        }
        db.done().await?;
        rows.iter()
            .map(|r| Ok((r.try_get(0).outbox_sql()?, r.try_get(1).outbox_sql()?)))
            .collect()
    }

    async fn wakeups(&self) -> Result<Option<tokio::sync::mpsc::Receiver<Wakeup>>> {
        Ok(Some(
            super::listen::start(&self.pool, self.outbox.channel()).await,
        ))
    }

    async fn now(&self) -> Result<DateTime<Utc>> {
        let mut db = self.pool_db().await?;
        let now = self
            .scope()
            .query_scalar(self.outbox.sql().claim.now.clone())
            .fetch_one(&mut *db)
            .await
            .outbox_sql()?;
        db.done().await?;
        Ok(now)
    }

    fn dead_letter_enabled(&self) -> bool {
        self.outbox.dead_letter_enabled()
    }

    async fn warm_up(&self) {
        if let Err(e) = self.fenced().acquire().await {
            tracing::debug!(error = %e, "outbox: the completion pool could not open a connection at start");
        }
    }

    fn claims_stopped(&self) {
        drop(self.claimer.take());
    }

    fn transactions(&self) -> Option<TransactionSource> {
        Some(TransactionSource::new(
            self.pool.clone(),
            self.outbox.sql().complete.clone(),
            self.scope(),
        ))
    }

    /// One catalog read: the `autovacuum` setting and the queue table's
    /// `autovacuum_enabled` storage parameter.
    async fn autovacuum_off(&self) -> Result<Option<AutovacuumOff>> {
        let mut db = self.pool_db().await?;
        let (exists, server, table): (bool, bool, bool) = self
            .scope()
            .query_as(crate::sql::catalog::AUTOVACUUM_OFF)
            .bind(self.outbox.table())
            .fetch_one(&mut *db)
            .await
            .outbox_sql()?;
        db.done().await?;
        if !exists {
            // Asked at start-up: a worker started before `migrate()` hears it here first.
            return Err(Error::NotMigrated {
                detail: format!("relation {} does not exist", self.outbox.table()),
            });
        }
        Ok((server || table).then(|| AutovacuumOff {
            table: self.outbox.table().to_owned(),
            server,
            table_option: table,
        }))
    }

    /// [`PgStore::stats`], on a connection of the pool.
    async fn queue_stats(&self, request: &StatsRequest) -> Result<Option<Vec<QueueStats>>> {
        self.stats(request).await.map(Some)
    }

    /// The pool's `max_connections` (the store's own pool has the same size).
    fn max_connections(&self) -> Option<u32> {
        Some(self.pool.options().get_max_connections())
    }

    fn transaction_pooler(&self) -> bool {
        self.outbox.transaction_pooler()
    }

    fn queue_table_name(&self) -> String {
        self.outbox.table().replace('"', "")
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

/// `register` on `db`: one statement (`periodic.register`), see [`Registered`]; `bucket`
/// is the key's (distributed mode).
pub(crate) async fn register_on(
    sql: &Periodic,
    scope: Scope,
    pool: &PgPool,
    request: RegisterSchedule<'_>,
    bucket: Option<i16>,
) -> Result<Registered> {
    request.validate()?;
    let mut db = scope.acquire(pool).await?;
    let statement = |sql: &sqlx::SqlStr| {
        scope
            .query(sql.clone())
            .bind(request.queue)
            .bind(request.timer_id)
            .bind(request.payload)
            .bind(Json(request.headers))
            .bind(request.first)
            .bucket(bucket)
    };
    let mut row = statement(&sql.register)
        .fetch_optional(&mut *db)
        .await
        .outbox_sql()?;
    if let Some(insert) = &sql.register_insert {
        // Distributed mode: the rewrite of the key's row first, then the insert when it
        // found none, again while the insert meets a row committed in between (as a
        // distributed keyed publish, `publish.rs`).
        let mut rounds = 0;
        while row.is_none() {
            row = statement(insert)
                .fetch_optional(&mut *db)
                .await
                .outbox_sql()?;
            if row.is_some() {
                break;
            }
            rounds += 1;
            if rounds == crate::publish::KEYED_ROUNDS {
                return Err(Error::Database(sqlx::Error::Protocol(format!(
                    "the schedule's key was created and deleted by others {rounds} times while this registration ran"
                ))));
            }
            row = statement(&sql.register)
                .fetch_optional(&mut *db)
                .await
                .outbox_sql()?;
        }
        if let Some(r) = &row {
            if r.try_get::<Option<i64>, _>(0).outbox_sql()?.is_none() {
                row = None;
            }
        }
    }
    if let Some(r) = &row {
        scope
            .wake(&mut db, sql.wake.as_ref(), [r.try_get(4).outbox_sql()?])
            .await?;
    }
    db.done().await?;
    let Some(row) = row else {
        return Ok(Registered::Unchanged);
    };
    let id: i64 = row.try_get(0).outbox_sql()?;
    let inserted: bool = row.try_get(1).outbox_sql()?;
    let leased: bool = row.try_get(2).outbox_sql()?;
    let at: DateTime<Utc> = row.try_get(3).outbox_sql()?;
    Ok(if inserted {
        Registered::Inserted { id, at }
    } else if leased {
        Registered::RearmReplaced { id, at }
    } else {
        Registered::Rescheduled { id, at }
    })
}
