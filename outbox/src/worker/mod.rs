//! The worker (SPEC §7): one claim loop, `concurrency` handler tasks, fenced completions,
//! on-time wake-ups, recovery from database failures, graceful shutdown.

mod handler;
mod retry;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::sync::{mpsc, watch, Mutex, Notify};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tracing::Instrument;

pub(crate) use handler::{decide, Route};
pub use handler::{
    Context, Handler, HandlerOptions, HandlerResult, IntoOutcome, Outcome, DEFAULT_MAX_DELIVERIES,
};
pub use retry::{RetryStrategy, MAX_RETRY_DELAY};

use crate::error::{Error, Result};
use crate::publish::validate_queue;
use crate::store::{Completion, Delivery, Failure, Lease, Store, Wakeup};
use crate::timer::Timer;

/// Worker knobs (SPEC §7.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Config {
    concurrency: usize,
    fetch_batch_size: usize,
    lease_ttl: Duration,
    idle_poll: Duration,
    ack_batch_size: usize,
    graceful_timeout: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            concurrency: 1,
            fetch_batch_size: 10,
            lease_ttl: Duration::from_secs(60),
            idle_poll: Duration::from_secs(30),
            ack_batch_size: 1,
            graceful_timeout: Duration::from_secs(15),
        }
    }
}

fn check_range<T: PartialOrd + std::fmt::Debug>(
    knob: &'static str,
    v: T,
    min: T,
    max: T,
    unit: &str,
) -> Result<()> {
    if v < min || v > max {
        return Err(Error::config(
            knob,
            format!("must be within {min:?}..={max:?}{unit}, got {v:?}"),
        ));
    }
    Ok(())
}

impl Config {
    fn validate(&self) -> Result<()> {
        check_range("concurrency", self.concurrency, 1, 10_000, "")?;
        check_range("fetch_batch_size", self.fetch_batch_size, 1, 10_000, "")?;
        check_range("ack_batch_size", self.ack_batch_size, 1, 10_000, "")?;
        check_range(
            "lease_ttl",
            self.lease_ttl,
            Duration::from_millis(100),
            Duration::from_secs(7 * 24 * 3600),
            "",
        )?;
        check_range(
            "idle_poll",
            self.idle_poll,
            Duration::from_millis(10),
            Duration::from_secs(24 * 3600),
            "",
        )?;
        check_range(
            "graceful_timeout",
            self.graceful_timeout,
            Duration::ZERO,
            Duration::from_secs(3600),
            "",
        )?;
        Ok(())
    }
}

/// Builds a [`Worker`]; see there. Setters never fail: every value is
/// checked by [`WorkerBuilder::build`].
pub struct WorkerBuilder<S> {
    store: S,
    routes: Vec<Route>,
    config: Config,
    invalid_queue: Option<Error>,
}

impl<S: Store> WorkerBuilder<S> {
    /// Handles the `#[timer]` type `T` (its queue is `T::QUEUE`, its `max_deliveries`
    /// `T::MAX_DELIVERIES`) with `handler`: an `async fn(T, Context) -> R` where `R` is
    /// `()`, [`Outcome`] or a `Result` of those with a displayable error. A handler for
    /// another payload type does not compile. Retries use [`RetryStrategy::default`].
    pub fn timer<T: Timer>(self, handler: impl Handler<T>) -> Self {
        self.timer_with::<T>(handler, HandlerOptions::default())
    }

    /// As [`WorkerBuilder::timer`], with a retry strategy or a `max_deliveries` override.
    pub fn timer_with<T: Timer>(
        mut self,
        handler: impl Handler<T>,
        options: HandlerOptions,
    ) -> Self {
        self.routes.push(Route::typed::<T, _>(handler, options));
        self
    }

    /// Handles the raw queue `queue` with `handler`: an `async fn(Vec<u8>, Context) -> R`
    /// over the stored bytes. `max_deliveries` is [`DEFAULT_MAX_DELIVERIES`].
    pub fn queue(self, queue: impl Into<String>, handler: impl Handler<Vec<u8>>) -> Self {
        self.queue_with(queue, handler, HandlerOptions::default())
    }

    /// As [`WorkerBuilder::queue`], with options.
    pub fn queue_with(
        mut self,
        queue: impl Into<String>,
        handler: impl Handler<Vec<u8>>,
        options: HandlerOptions,
    ) -> Self {
        let queue = queue.into();
        if let Err(e) = validate_queue(&queue) {
            self.invalid_queue.get_or_insert(e);
        }
        self.routes.push(Route::raw(queue, handler, options));
        self
    }

    /// Handler tasks running at once (default 1, range 1..=10 000).
    pub fn concurrency(mut self, n: usize) -> Self {
        self.config.concurrency = n;
        self
    }

    /// Rows claimed per claim statement (default 10, range 1..=10 000). The claim loop
    /// claims again when all claimed rows have been handed to handlers.
    pub fn fetch_batch_size(mut self, n: usize) -> Self {
        self.config.fetch_batch_size = n;
        self
    }

    /// How long a claim is exclusive (default 60 s, range 100 ms..=7 days). After it, other
    /// workers may reclaim the row (SPEC §6).
    pub fn lease_ttl(mut self, ttl: Duration) -> Self {
        self.config.lease_ttl = ttl;
        self
    }

    /// The longest an idle worker sleeps before looking again, which also bounds how late
    /// an expired lease of a dead worker is picked up when nothing else wakes it (default
    /// 30 s, range 10 ms..=24 h). Timers do not wait for it: the worker sleeps until the
    /// earliest deadline and wakes on notifications (SPEC §7.3).
    pub fn idle_poll(mut self, ceiling: Duration) -> Self {
        self.config.idle_poll = ceiling;
        self
    }

    /// Successful completions per batched statement (default 1: one `DELETE` per row,
    /// range 1..=10 000). Above 1, successes are collected and flushed when the batch is
    /// full, whenever no more are waiting (idle), and at shutdown.
    pub fn ack_batch_size(mut self, n: usize) -> Self {
        self.config.ack_batch_size = n;
        self
    }

    /// How long [`RunningWorker::shutdown`] waits for running handlers and pending
    /// completions (default 15 s, range 0..=1 h).
    pub fn graceful_timeout(mut self, timeout: Duration) -> Self {
        self.config.graceful_timeout = timeout;
        self
    }

    /// Checks everything and builds the worker.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the knob whose value is out of range (or `handlers`
    /// when none is registered, `retry` for a bad strategy, `max_deliveries` for 0);
    /// [`Error::InvalidArgument`] for a bad raw queue name; [`Error::DuplicateHandler`]
    /// naming both handlers when two serve one queue.
    pub fn build(self) -> Result<Worker<S>> {
        if let Some(e) = self.invalid_queue {
            return Err(e);
        }
        self.config.validate()?;
        if self.routes.is_empty() {
            return Err(Error::config("handlers", "register at least one handler"));
        }
        let mut routes: HashMap<String, Route> = HashMap::new();
        for route in self.routes {
            validate_queue(&route.queue)?;
            route.retry.validate("retry")?;
            if route.max_deliveries == 0 {
                return Err(Error::config(
                    "max_deliveries",
                    format!("must be at least 1 for queue `{}`", route.queue),
                ));
            }
            if let Some(first) = routes.get(&route.queue) {
                return Err(Error::DuplicateHandler {
                    queue: route.queue.clone(),
                    first: first.name.clone(),
                    second: route.name,
                });
            }
            routes.insert(route.queue.clone(), route);
        }
        let mut queues: Vec<String> = routes.keys().cloned().collect();
        queues.sort();
        Ok(Worker {
            store: self.store,
            routes: Arc::new(routes),
            queues: Arc::new(queues),
            config: self.config,
        })
    }
}

/// A worker (SPEC §7): one claim loop, `concurrency` handler tasks, fenced completions,
/// on-time wake-ups, recovery from database failures, graceful shutdown. Build one with
/// [`Worker::builder`]; [`Worker::start`] runs it.
///
/// ```no_run
/// use std::time::Duration;
/// use outbox::{Context, Outbox, PgStore, Worker};
///
/// #[outbox::timer(queue = "presence.expiry", max_deliveries = 5)]
/// #[derive(serde::Serialize, serde::Deserialize)]
/// struct PresenceExpiry { user_id: i64 }
///
/// async fn on_expiry(t: PresenceExpiry, ctx: Context) -> Result<(), sqlx::Error> {
///     println!("user {} expired (delivery {})", t.user_id, ctx.delivery());
///     Ok(())
/// }
///
/// # async fn run(pool: sqlx::PgPool) -> Result<(), outbox::Error> {
/// let worker = Worker::builder(PgStore::new(pool, Outbox::default()))
///     .timer::<PresenceExpiry>(on_expiry)
///     .concurrency(4)
///     .build()?;
/// let running = worker.start();
/// // ... on SIGTERM:
/// running.shutdown().await;
/// # Ok(()) }
/// ```
///
/// # Sizing
/// A worker holds at most `fetch_batch_size + concurrency × ack_batch_size` leases at once
/// (SPEC §7.7): the claimed rows waiting for a handler, the running ones, and successes
/// waiting in the ack batch. Every one of them must finish within `lease_ttl`, or another
/// worker reclaims the row and this worker's completion is dropped as `lease_lost`. Size
/// `lease_ttl` above the handler's p99 time **plus** the wait in the buffer
/// (`fetch_batch_size / concurrency × handler time`) with a wide margin; when handlers are
/// slow, keep `fetch_batch_size` close to `concurrency`.
///
/// A worker uses its pool for claims and completions (at most
/// `concurrency + 2` statements in flight) plus one dedicated LISTEN connection. Any number
/// of workers, in any number of processes, may serve the same queues (SPEC §7.6):
/// `SKIP LOCKED` claims and token-fenced writes need no coordination. Past what one
/// primary can absorb, split queues across databases, each with its own `Outbox`.
///
/// # Waking up (SPEC §7.3)
/// The worker LISTENs before its first scan. After a claim that did not fill a batch it
/// asks once for the earliest deadline and lease expiry of its queues (two index probes per
/// queue) and sleeps until then, until a notification for one of its queues moves that
/// moment earlier, until one of its own completions makes a row due (a rearm applied, a
/// retry scheduled), or until `idle_poll`. An idle worker issues no queries in between. If
/// the LISTEN connection drops, it polls at least every second until LISTEN is back, and
/// re-scans once it is.
///
/// # Failures (SPEC §7.2, §7.4)
/// A handler error retries per [`RetryStrategy`]; a panic is a failed run; a payload that
/// does not decode, a rejection, exhausted retries and too many deliveries are terminal
/// (archived to the dead-letter table when it is on). A failed claim backs off (100 ms
/// doubling to 5 s) and retries; a completion that fails on a broken connection is retried
/// while the lease lasts, other statement errors leave the row to lease expiry.
///
/// # Shutdown (SPEC §7.5)
/// [`RunningWorker::shutdown`] stops claiming, runs the rows already claimed, waits up to
/// `graceful_timeout` for handlers and flushes batched acks. A handler still running then is
/// abandoned; its row is redelivered once its lease expires. Nothing is lost either way.
pub struct Worker<S> {
    store: S,
    routes: Arc<HashMap<String, Route>>,
    queues: Arc<Vec<String>>,
    config: Config,
}

impl<S> std::fmt::Debug for Worker<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("queues", &self.queues)
            .field("config", &self.config)
            .finish()
    }
}

/// The most deliveries one [`Worker::run_due`] call runs.
pub const RUN_DUE_LIMIT: usize = 10_000;

/// One delivery run by [`Worker::run_due`]: the claimed row, what the handler decided,
/// and how the fenced completion ended.
#[derive(Debug, Clone, PartialEq)]
pub struct Dispatched {
    /// The claimed row.
    pub delivery: Delivery,
    /// What the run decided.
    pub decision: Decision,
    /// How the completion ended (for example [`Completion::Rearmed`] when the timer was
    /// extended during the run).
    pub completion: Completion,
}

/// What to do with a delivery once its handler, or the checks before it, are done.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Decision {
    /// Success.
    Ack,
    /// A failed run, retried after `delay`.
    Retry {
        /// The delay chosen by the strategy or the handler.
        delay: Duration,
        /// The handler's error text.
        error: String,
    },
    /// A terminal failure.
    Fail {
        /// Why.
        reason: crate::FailureReason,
        /// The error text, if any.
        error: Option<String>,
    },
}

/// What [`RunningWorker::shutdown`] observed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShutdownReport {
    /// True when every handler and pending completion finished within `graceful_timeout`.
    pub graceful: bool,
    /// Handlers still running at the timeout and abandoned; their rows are redelivered
    /// after their lease expires.
    pub abandoned: usize,
}

/// A started worker. Dropping it does not stop the worker; call
/// [`RunningWorker::shutdown`].
#[derive(Debug)]
pub struct RunningWorker {
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<ShutdownReport>,
}

impl RunningWorker {
    /// Stops claiming, lets running handlers finish and flushes pending completions, all
    /// within `graceful_timeout` (SPEC §7.5); handlers still running then are abandoned and
    /// their rows are redelivered after their lease expires. Nothing is lost either way.
    pub async fn shutdown(self) -> ShutdownReport {
        let _ = self.stop.send(true);
        match self.task.await {
            Ok(report) => report,
            Err(e) => {
                tracing::error!(error = %e, "outbox worker task failed");
                ShutdownReport {
                    graceful: false,
                    abandoned: 0,
                }
            }
        }
    }

    /// True once the worker has stopped.
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }
}

/// State shared by the claim loop, handler tasks and the acker.
struct Shared<S> {
    store: S,
    routes: Arc<HashMap<String, Route>>,
    config: Config,
    /// Earliest local instant a completion of this worker made a row due (a rearm applied,
    /// a retry scheduled); read by the idle claim loop (SPEC §7.3).
    hint: std::sync::Mutex<Option<Instant>>,
    hint_changed: Notify,
    /// Store clock minus local clock, in microseconds, from the latest `next_wakeup`.
    clock_offset_us: std::sync::atomic::AtomicI64,
}

impl<S: Store> Shared<S> {
    /// Maps a store-clock time onto the local monotonic clock.
    fn local(&self, at: DateTime<Utc>) -> Instant {
        let offset = self
            .clock_offset_us
            .load(std::sync::atomic::Ordering::Relaxed);
        let store_now_us = Utc::now().timestamp_micros() + offset;
        let ahead = at.timestamp_micros() - store_now_us;
        let now = Instant::now();
        if ahead <= 0 {
            now
        } else {
            now + Duration::from_micros(ahead as u64)
        }
    }

    fn wake_at(&self, at: DateTime<Utc>) {
        let local = self.local(at);
        let mut hint = self.hint.lock().unwrap_or_else(|p| p.into_inner());
        if hint.is_none_or(|h| local < h) {
            *hint = Some(local);
            self.hint_changed.notify_one();
        }
    }
}

impl<S: Store> Worker<S> {
    /// Starts building a worker over `store`.
    pub fn builder(store: S) -> WorkerBuilder<S> {
        WorkerBuilder {
            store,
            routes: Vec::new(),
            config: Config::default(),
            invalid_queue: None,
        }
    }

    /// The queues this worker serves, sorted.
    pub fn queues(&self) -> &[String] {
        &self.queues
    }

    /// Runs every row that is due **now**, one at a time and to completion, in claim order,
    /// and returns what happened to each: the synchronous "run everything due" mode of the
    /// test harness (SPEC §10). It claims in rounds until a claim comes back empty, so rows
    /// that become due during the run (a zero-delay retry) run too; a row whose handler
    /// extended its own timer is pending at its new deadline and does not run again until
    /// the store's clock reaches it. No batching, no sleeping, no notifications.
    ///
    /// With [`crate::testing::MemoryStore`] and its virtual clock this is deterministic:
    /// publish, [`advance`](crate::testing::MemoryStore::advance), `run_due`, inspect. It
    /// works on [`PgStore`](crate::PgStore) too (for a drain in a script or a test).
    ///
    /// Stops after [`RUN_DUE_LIMIT`] deliveries, so a handler that keeps making itself due
    /// at once cannot loop forever.
    ///
    /// # Errors
    /// The first storage error; deliveries before it have been completed.
    pub async fn run_due(&self) -> Result<Vec<Dispatched>> {
        let mut out = Vec::new();
        while out.len() < RUN_DUE_LIMIT {
            let limit = self.config.fetch_batch_size.min(RUN_DUE_LIMIT - out.len());
            let batch = self
                .store
                .claim(&self.queues, limit, self.config.lease_ttl)
                .await?;
            if batch.is_empty() {
                break;
            }
            for d in batch {
                let Some(route) = self.routes.get(&d.queue) else {
                    continue;
                };
                let decision = decide(route, &d).await;
                let completion = match &decision {
                    Decision::Ack => self.store.ack(d.lease).await?,
                    Decision::Retry { delay, .. } => self.store.retry(d.lease, *delay).await?,
                    Decision::Fail { reason, error } => {
                        let failure = Failure {
                            reason: *reason,
                            last_error: error.as_deref(),
                        };
                        self.store.fail(d.lease, failure).await?
                    }
                };
                out.push(Dispatched {
                    delivery: d,
                    decision,
                    completion,
                });
            }
        }
        Ok(out)
    }

    /// Spawns the worker on the current Tokio runtime.
    ///
    /// # Panics
    /// Outside a Tokio runtime.
    pub fn start(self) -> RunningWorker {
        let (stop, stopped) = watch::channel(false);
        let task = tokio::spawn(self.run(stopped));
        RunningWorker { stop, task }
    }

    /// Runs until `signal` completes, then shuts down gracefully.
    pub async fn run_until(self, signal: impl std::future::Future<Output = ()>) -> ShutdownReport {
        let running = self.start();
        signal.await;
        running.shutdown().await
    }

    async fn run(self, mut stopped: watch::Receiver<bool>) -> ShutdownReport {
        let config = self.config;
        let shared = Arc::new(Shared {
            store: self.store,
            routes: self.routes,
            config,
            hint: std::sync::Mutex::new(None),
            hint_changed: Notify::new(),
            clock_offset_us: std::sync::atomic::AtomicI64::new(0),
        });
        // LISTEN first, so nothing published after our first scan goes unheard.
        let wakeups = match shared.store.wakeups().await {
            Ok(w) => w,
            Err(e) => {
                tracing::warn!(error = %e, "outbox: no wake-up notifications; relying on deadlines and the idle poll");
                None
            }
        };
        let (deliveries_tx, deliveries_rx) = mpsc::channel::<Delivery>(config.fetch_batch_size);
        let deliveries_rx = Arc::new(Mutex::new(deliveries_rx));
        let (acks_tx, acker) = if config.ack_batch_size > 1 {
            let (tx, rx) = mpsc::channel(config.concurrency * config.ack_batch_size);
            (Some(tx), Some(tokio::spawn(acker(shared.clone(), rx))))
        } else {
            (None, None)
        };
        let mut handlers = JoinSet::new();
        for _ in 0..config.concurrency {
            handlers.spawn(handler_task(
                shared.clone(),
                deliveries_rx.clone(),
                acks_tx.clone(),
            ));
        }
        drop(acks_tx);

        claim_loop(&shared, &self.queues, wakeups, &deliveries_tx, &mut stopped).await;

        // Shutdown (SPEC §7.5): stop claiming; claimed rows still buffered and running
        // handlers get until the deadline; then pending acks are flushed.
        drop(deliveries_tx);
        let deadline = Instant::now() + config.graceful_timeout;
        let mut graceful = true;
        while !handlers.is_empty() {
            match tokio::time::timeout_at(deadline, handlers.join_next()).await {
                Ok(_) => {}
                Err(_) => {
                    graceful = false;
                    break;
                }
            }
        }
        let abandoned = handlers.len();
        if abandoned > 0 {
            tracing::warn!(abandoned, "outbox: handlers still running at graceful_timeout; their rows will be redelivered after the lease expires");
            handlers.abort_all();
        }
        drop(deliveries_rx);
        if let Some(acker) = acker {
            // The acker ends once every handler task (and so every sender) is gone; the
            // aborted ones drop theirs when the abort lands. Give the final flush at most
            // the time left, and never less than one round trip's worth.
            let flush_deadline = deadline.max(Instant::now() + Duration::from_secs(1));
            if tokio::time::timeout_at(flush_deadline, acker)
                .await
                .is_err()
            {
                graceful = false;
                tracing::warn!(
                    "outbox: pending acks not flushed in time; those rows will be redelivered"
                );
            }
        }
        ShutdownReport {
            graceful,
            abandoned,
        }
    }
}

/// The back-off after a failed claim or completion: 100 ms doubling, capped at 5 s.
fn backoff(attempt: u32) -> Duration {
    let ms = 100u64.saturating_mul(1 << attempt.min(6));
    Duration::from_millis(ms.min(5_000))
}

async fn claim_loop<S: Store>(
    shared: &Arc<Shared<S>>,
    queues: &[String],
    mut wakeups: Option<mpsc::Receiver<Wakeup>>,
    deliveries: &mpsc::Sender<Delivery>,
    stopped: &mut watch::Receiver<bool>,
) {
    let config = shared.config;
    let limit = config.fetch_batch_size;
    let mut failures = 0u32;
    // Rows due but not claimable (locked by another worker's claim in flight) make the
    // earliest deadline lie in the past; wait a little, growing, instead of spinning.
    let mut contention = Duration::from_millis(10);
    // True while the LISTEN connection is down: poll at least every second (SPEC §7.3).
    let mut degraded = false;
    loop {
        if *stopped.borrow() {
            return;
        }
        // Claim only when every buffered row has been taken by a handler, so the leases we
        // hold stay within fetch_batch_size + concurrency × ack_batch_size (SPEC §7.7).
        let permits = tokio::select! {
            p = deliveries.reserve_many(limit) => match p { Ok(p) => p, Err(_) => return },
            _ = stopped.changed() => return,
        };
        // Not raced against the stop signal: once Postgres commits a claim its rows are
        // ours, and dropping the future then would strand them until their lease expires.
        // The claim is one short statement; shutdown runs what it returns.
        let claimed = shared.store.claim(queues, limit, config.lease_ttl).await;
        let batch = match claimed {
            Ok(b) => b,
            Err(e) => {
                failures += 1;
                tracing::warn!(error = %e, attempt = failures, "outbox: claim failed; backing off");
                metrics::counter!("outbox_claim_errors_total").increment(1);
                drop(permits);
                if sleep_or_stop(backoff(failures - 1), stopped).await {
                    return;
                }
                continue;
            }
        };
        failures = 0;
        let got = batch.len();
        metrics::histogram!("outbox_claim_batch_size").record(got as f64);
        for (permit, d) in permits.zip(batch) {
            permit.send(d);
        }
        // Hints that arrived while we were busy are covered by this claim or by the
        // next_wakeup below.
        if let Some(w) = wakeups.as_mut() {
            while let Ok(ev) = w.try_recv() {
                match ev {
                    Wakeup::Lost => degraded = true,
                    Wakeup::Listening => degraded = false,
                    Wakeup::Published { .. } => {}
                }
            }
        }
        if got == limit {
            contention = Duration::from_millis(10);
            continue;
        }
        // Idle: sleep until the earliest deadline, a notification, a completion's hint or
        // the idle ceiling (SPEC §7.3). One index-backed query; none while asleep.
        let next = tokio::select! {
            r = shared.store.next_wakeup(queues, config.lease_ttl) => r,
            _ = stopped.changed() => return,
        };
        let next = match next {
            Ok(n) => n,
            Err(e) => {
                failures += 1;
                tracing::warn!(error = %e, "outbox: reading the next deadline failed; backing off");
                if sleep_or_stop(backoff(failures - 1), stopped).await {
                    return;
                }
                continue;
            }
        };
        shared.clock_offset_us.store(
            (next.now - Utc::now()).num_microseconds().unwrap_or(0),
            std::sync::atomic::Ordering::Relaxed,
        );
        let now = Instant::now();
        let ceiling = if degraded {
            config.idle_poll.min(Duration::from_secs(1))
        } else {
            config.idle_poll
        };
        let mut target = now + ceiling;
        match next.earliest() {
            Some(at) if at <= next.now => {
                // Due rows we could not claim are locked by another transaction (a claim
                // in flight, an uncommitted extend). Look again soon, backing off to at
                // most a second, and never later than the next row that becomes due.
                target = target.min(now + contention);
                if let Some(upcoming) = next.upcoming {
                    target = target.min(shared.local(upcoming));
                }
                contention = (contention * 2).min(ceiling.min(Duration::from_secs(1)));
            }
            Some(at) => {
                contention = Duration::from_millis(10);
                target = target.min(shared.local(at));
            }
            None => contention = Duration::from_millis(10),
        }
        loop {
            if let Some(h) = shared.hint.lock().unwrap_or_else(|p| p.into_inner()).take() {
                target = target.min(h);
            }
            if target <= Instant::now() {
                break;
            }
            tokio::select! {
                () = tokio::time::sleep_until(target) => break,
                () = shared.hint_changed.notified() => {}
                ev = recv_wakeup(&mut wakeups) => match ev {
                    Some(Wakeup::Published { queue, at }) => {
                        if queues.binary_search(&queue).is_ok() {
                            target = target.min(shared.local(at));
                        }
                    }
                    Some(Wakeup::Lost) => {
                        degraded = true;
                        target = target.min(Instant::now() + Duration::from_secs(1));
                    }
                    Some(Wakeup::Listening) => {
                        // Re-LISTEN done; now re-scan what we may have missed.
                        degraded = false;
                        break;
                    }
                    None => {
                        wakeups = None;
                    }
                },
                _ = stopped.changed() => return,
            }
        }
    }
}

/// Receives the next hint, or waits forever when there is no hint channel.
async fn recv_wakeup(wakeups: &mut Option<mpsc::Receiver<Wakeup>>) -> Option<Wakeup> {
    match wakeups {
        Some(w) => w.recv().await,
        None => std::future::pending().await,
    }
}

/// Sleeps, returning true if the worker was stopped meanwhile.
async fn sleep_or_stop(d: Duration, stopped: &mut watch::Receiver<bool>) -> bool {
    tokio::select! {
        () = tokio::time::sleep(d) => *stopped.borrow(),
        _ = stopped.changed() => true,
    }
}

async fn handler_task<S: Store>(
    shared: Arc<Shared<S>>,
    deliveries: Arc<Mutex<mpsc::Receiver<Delivery>>>,
    acks: Option<mpsc::Sender<(Lease, Instant, String)>>,
) {
    loop {
        let next = deliveries.lock().await.recv().await;
        let Some(d) = next else { return };
        let span = tracing::info_span!(
            "outbox.delivery",
            queue = %d.queue,
            id = d.lease.id,
            timer_id = d.timer_id.as_deref(),
            delivery = d.deliveries_count,
            attempt = d.attempts_count + 1,
        );
        process(&shared, d, acks.as_ref()).instrument(span).await;
    }
}

/// Handles one delivery and writes its fenced completion.
async fn process<S: Store>(
    shared: &Shared<S>,
    d: Delivery,
    acks: Option<&mpsc::Sender<(Lease, Instant, String)>>,
) {
    // The lease is ours until claimed_at + lease_ttl (time spent waiting in the buffer
    // counts); past it, retrying a failed completion is pointless.
    let lease_end = chrono::TimeDelta::from_std(shared.config.lease_ttl)
        .ok()
        .and_then(|ttl| d.claimed_at.checked_add_signed(ttl))
        .map_or_else(
            || Instant::now() + shared.config.lease_ttl,
            |end| shared.local(end),
        );
    let Some(route) = shared.routes.get(&d.queue) else {
        // Unreachable: we only claim queues we serve. Leave the row to lease expiry.
        tracing::error!("outbox: claimed a row of a queue without handler");
        return;
    };
    let lateness = (d.claimed_at - d.deadline)
        .num_microseconds()
        .unwrap_or(0)
        .max(0) as f64
        / 1e6;
    metrics::histogram!("outbox_firing_lateness_seconds", "queue" => d.queue.clone())
        .record(lateness);
    let started = Instant::now();
    let decision = decide(route, &d).await;
    metrics::histogram!("outbox_handler_duration_seconds", "queue" => d.queue.clone())
        .record(started.elapsed().as_secs_f64());
    let lease = d.lease;
    match decision {
        Decision::Ack => {
            if let Some(acks) = acks {
                if acks.send((lease, lease_end, d.queue.clone())).await.is_ok() {
                    return;
                }
            }
            let done = write_with_retry(lease_end, || shared.store.ack(lease)).await;
            report(shared, &d.queue, "ack", done);
        }
        Decision::Retry { delay, error } => {
            tracing::info!(delay_ms = delay.as_millis() as u64, error = %error, "outbox: handler failed; retry scheduled");
            let done = write_with_retry(lease_end, || shared.store.retry(lease, delay)).await;
            if matches!(done, Some(Completion::RetryScheduled { .. })) {
                metrics::counter!("outbox_retried_total", "queue" => d.queue.clone()).increment(1);
            }
            report(shared, &d.queue, "retry", done);
        }
        Decision::Fail { reason, error } => {
            tracing::warn!(reason = %reason, error = error.as_deref().unwrap_or(""), "outbox: terminal failure");
            let failure = Failure {
                reason,
                last_error: error.as_deref(),
            };
            let done = write_with_retry(lease_end, || shared.store.fail(lease, failure)).await;
            if matches!(done, Some(Completion::Deleted | Completion::Rearmed { .. })) {
                metrics::counter!("outbox_terminal_total", "queue" => d.queue.clone(), "reason" => reason.as_str())
                    .increment(1);
                if shared.store.dead_letter_enabled() {
                    metrics::counter!("outbox_dlq_written_total", "queue" => d.queue.clone())
                        .increment(1);
                    tracing::warn!(reason = %reason, "outbox: dead letter written");
                }
            }
            report(shared, &d.queue, "fail", done);
        }
    }
}

/// Runs a fenced write, retrying connection failures with back-off while the lease lasts
/// (SPEC §7.4). A statement error (say, a constraint violation) is not retried: the row is
/// left to lease expiry, so one poison row cannot wedge a handler task.
async fn write_with_retry<F, Fut>(lease_end: Instant, mut write: F) -> Option<Completion>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Completion>>,
{
    let mut attempt = 0;
    loop {
        match write().await {
            Ok(c) => return Some(c),
            Err(e) if e.is_connection_error() && Instant::now() + backoff(attempt) < lease_end => {
                tracing::warn!(error = %e, attempt, "outbox: completion failed; retrying");
                tokio::time::sleep(backoff(attempt)).await;
                attempt += 1;
            }
            Err(e) => {
                tracing::error!(error = %e, "outbox: completion failed; the row will be redelivered after its lease expires");
                metrics::counter!("outbox_completion_errors_total").increment(1);
                return None;
            }
        }
    }
}

/// Metrics, events and wake-up hints for a finished completion.
fn report<S: Store>(
    shared: &Shared<S>,
    queue: &str,
    phase: &'static str,
    done: Option<Completion>,
) {
    match done {
        Some(Completion::Deleted) if phase == "ack" => {
            metrics::counter!("outbox_acked_total", "queue" => queue.to_owned()).increment(1);
        }
        Some(Completion::Rearmed { at }) => {
            if phase == "ack" {
                metrics::counter!("outbox_acked_total", "queue" => queue.to_owned()).increment(1);
            }
            metrics::counter!("outbox_rearmed_total", "queue" => queue.to_owned()).increment(1);
            tracing::info!(rearm_at = %at, "outbox: rearm applied");
            shared.wake_at(at);
        }
        Some(Completion::RetryScheduled { at }) => shared.wake_at(at),
        Some(Completion::Deleted) => {}
        Some(Completion::LeaseLost) => {
            metrics::counter!("outbox_lease_lost_total", "queue" => queue.to_owned(), "phase" => phase).increment(1);
            tracing::warn!(
                phase,
                "outbox: lease lost; the completion was dropped (another worker holds the row)"
            );
        }
        None => {}
    }
}

/// Collects successful completions and writes them in batches (SPEC §5.2): a batch is
/// flushed when full or as soon as no more successes are waiting, and the rest at shutdown.
async fn acker<S: Store>(shared: Arc<Shared<S>>, mut rx: mpsc::Receiver<(Lease, Instant, String)>) {
    let max = shared.config.ack_batch_size;
    let mut batch = Vec::with_capacity(max);
    while let Some(first) = rx.recv().await {
        batch.push(first);
        while batch.len() < max {
            match rx.try_recv() {
                Ok(item) => batch.push(item),
                Err(_) => break,
            }
        }
        let leases: Vec<Lease> = batch.iter().map(|(l, _, _)| *l).collect();
        let lease_end = batch
            .iter()
            .map(|(_, e, _)| *e)
            .min()
            .unwrap_or_else(Instant::now);
        let results = write_batch_with_retry(&shared, lease_end, &leases).await;
        for ((_, _, queue), done) in batch.drain(..).zip(results) {
            report(&shared, &queue, "ack", done);
        }
    }
}

async fn write_batch_with_retry<S: Store>(
    shared: &Shared<S>,
    lease_end: Instant,
    leases: &[Lease],
) -> Vec<Option<Completion>> {
    let mut attempt = 0;
    loop {
        match shared.store.ack_batch(leases).await {
            Ok(done) => return done.into_iter().map(Some).collect(),
            Err(e) if e.is_connection_error() && Instant::now() + backoff(attempt) < lease_end => {
                tracing::warn!(error = %e, attempt, "outbox: batched ack failed; retrying");
                tokio::time::sleep(backoff(attempt)).await;
                attempt += 1;
            }
            Err(e) => {
                tracing::error!(error = %e, rows = leases.len(), "outbox: batched ack failed; the rows will be redelivered after their lease expires");
                metrics::counter!("outbox_completion_errors_total").increment(1);
                return vec![None; leases.len()];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_and_caps() {
        assert_eq!(backoff(0), Duration::from_millis(100));
        assert_eq!(backoff(1), Duration::from_millis(200));
        assert_eq!(backoff(5), Duration::from_millis(3200));
        assert_eq!(backoff(6), Duration::from_secs(5));
        assert_eq!(backoff(60), Duration::from_secs(5));
    }

    #[test]
    fn knob_ranges_name_the_knob() {
        let bad = [
            Config {
                concurrency: 0,
                ..Config::default()
            },
            Config {
                fetch_batch_size: 0,
                ..Config::default()
            },
            Config {
                ack_batch_size: 10_001,
                ..Config::default()
            },
            Config {
                lease_ttl: Duration::from_millis(1),
                ..Config::default()
            },
            Config {
                idle_poll: Duration::ZERO,
                ..Config::default()
            },
            Config {
                graceful_timeout: Duration::from_secs(7200),
                ..Config::default()
            },
        ];
        let knobs = [
            "concurrency",
            "fetch_batch_size",
            "ack_batch_size",
            "lease_ttl",
            "idle_poll",
            "graceful_timeout",
        ];
        for (c, knob) in bad.iter().zip(knobs) {
            let e = c.validate().unwrap_err();
            assert!(
                matches!(e, Error::InvalidConfig { knob: k, .. } if k == knob),
                "{e}"
            );
        }
        assert!(Config::default().validate().is_ok());
    }
}
