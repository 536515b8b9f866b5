//! [`Worker`], [`RunningWorker`], shutdown and [`Worker::run_due`]: the worker's life from
//! start to stop. The other files hold its parts (the map is in `mod.rs`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch, Mutex, OnceCell};
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::acks::completer;
use super::claim::{self, claim_loop};
use super::config::Config;
use super::decide::Route;
use super::execute::{handler_task, Dispatched};
use super::gauge::queue_depth;
use super::leases::Phase;
use super::renewal::renewal_loop;
use super::schedule::{register_all, register_one, Schedule};
use super::shared::{Claimed, Shared};
use crate::error::Result;
use crate::store::{Completion, Failure, FailureReason, Registered, Release, Released, Store};
use crate::telemetry;

/// A worker: one claim loop, `concurrency` handler tasks, fenced completions, on-time
/// wake-ups, recovery from database failures, graceful shutdown. Build one with
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
/// # Leases
/// A claim leases its rows for `lease_ttl`; the worker **renews** every lease it holds —
/// rows waiting in its buffer, running, or waiting for a batched ack — with one statement
/// every third of `lease_ttl`, whatever the number of leases. So a handler may run far
/// longer than `lease_ttl` and still run once: `lease_ttl` is how long a **dead** worker's
/// rows wait before another worker takes them, and can be short (seconds). All workers
/// serving a queue must use the same `lease_ttl`: expiry is judged by the claimer's value.
/// A worker never claims a row it still holds.
///
/// When a renewal finds a lease lost (the worker could not renew it in time and another
/// worker claimed the row) or the timer cancelled, the running handler learns it through
/// [`Context::cancelled`](crate::Context::cancelled) and may stop early; a row whose lease
/// was lost before it started never starts. Each handler has a timeout
/// ([`HandlerOptions::timeout`](crate::HandlerOptions::timeout), 5 minutes by default): a
/// run past it is stopped and counts as a failed run (terminal reason `timeout` when no
/// retry is left), with a warning naming the row and the handler.
///
/// # Sizing
/// A worker holds at most `fetch_batch_size + concurrency + (concurrency + 2) ×
/// ack_batch_size` leases at once: the claimed rows waiting for a handler, the running
/// ones, and the successes the completer has not written yet — one statement's worth
/// waiting while up to `concurrency + 1` are being written (more than one only while rows
/// locked by application transactions hold earlier statements, see "Acks" below). With
/// `ack_batch_size(1)` the last term is 0: each handler writes its own completion. Every
/// one of these leases is renewed while it waits (see "Leases"), so a slow commit never
/// lets one expire. Keep `fetch_batch_size` close to `concurrency` when handlers are slow,
/// so claimed rows do not wait long in the buffer (another worker could run them
/// meanwhile).
///
/// Over a [`PgStore`](crate::PgStore) a worker needs `concurrency + 2` connections of the
/// store's pool at once (per handler slot one: the handler's own transaction while it runs
/// ([`Context::begin`](crate::Context::begin)), or its completion after; one for claims;
/// one for the batched acks and the renewal), `concurrency + 3` with the queue-depth gauge
/// ([`WorkerBuilder::queue_depth_gauge`](crate::WorkerBuilder::queue_depth_gauge): one for
/// its read of the statistics), checked by
/// [`WorkerBuilder::build`](crate::WorkerBuilder::build) (a worker whose handlers are all
/// relays, [`WorkerBuilder::relay`](crate::WorkerBuilder::relay), needs 3: a relay's run
/// holds no connection); the store opens a second pool
/// of the same size for writes with a short lock timeout (see its docs), and LISTEN uses
/// one connection of its own. Any number of workers, in any number of processes, may serve
/// the same queues without coordination: the claim's `FOR UPDATE SKIP LOCKED` skips rows
/// another transaction has locked, so two workers never claim the same row, and every later
/// write is fenced by the claim's token. Past what one primary can absorb, split queues
/// across databases, each with its own `Outbox`.
///
/// # Acks
/// A successful run is acknowledged by deleting its row, fenced by its lease token (a
/// `DELETE … WHERE (id, acquired_token) IN (…)`: a row another worker re-claimed after this
/// lease expired carries another token and is left alone). By default the acks are
/// **pipelined**: a handler that returns `Ok` hands its row to the worker's completer and
/// starts the next row at once; the completer writes every success that is waiting in one
/// statement as soon as its previous statement returned — a lone success is written at
/// once, a burst that arrived during one commit shares the next. There is no linger timer,
/// so pipelining adds no latency; [`WorkerBuilder::ack_batch_size`](crate::WorkerBuilder::ack_batch_size)
/// (default [`DEFAULT_ACK_BATCH_SIZE`](crate::worker::DEFAULT_ACK_BATCH_SIZE)) caps the rows of one statement, and `1` turns the
/// completer off (each handler task writes its own ack before it takes the next row).
/// At shutdown the completer gets until the graceful deadline; then it is stopped and starts
/// no further write, but a statement it had already sent (say, one waiting for an
/// application's row lock) may still commit on the server after `shutdown` returned — the
/// report then counts that row as unreleased although it is gone.
/// An ack counts (metrics, [`RunningWorker::shutdown`]) only once its statement committed;
/// until then the row stays leased and renewed, and a crash before the commit means the
/// row is delivered again after `lease_ttl`, as for any lease. Retries and terminal
/// failures are written by the handler task itself.
///
/// A row locked by an application transaction (say, an extend in a transaction that has
/// not committed) does not hold the other acks back: each write waits at most the store's
/// lock timeout (200 ms) before it splits into single-row writes (the locked row's own ack
/// then waits for the application's transaction), and while a write waits the completer
/// starts the next statement beside it — up to `concurrency + 1` statements at once, the
/// connections the handler slots would have used for their own acks. So up to
/// `concurrency` rows locked at the same time by applications hold back nothing else;
/// beyond that, the other acks wait until one of those transactions ends.
///
/// # Waking up
/// A publish sends a `pg_notify` in its own transaction (unless the outbox has
/// notifications off), and Postgres delivers a notification only when that transaction
/// commits, so a rolled-back publish wakes nobody. The worker LISTENs before its first
/// scan. After a claim that did not fill a batch it asks once for the earliest deadline and
/// lease expiry of its queues (two index probes per queue) and sleeps until then, until a
/// notification for one of its queues moves that moment earlier, until one of its own
/// completions makes a row due (a rearm applied, a retry scheduled), or until `idle_poll`.
/// An idle worker issues no queries in between (the lease renewal runs only while it holds
/// leases). If the LISTEN connection drops, it polls at least every second until LISTEN is
/// back, and re-scans once it is.
///
/// # Failures
/// A handler error retries per [`RetryStrategy`](crate::RetryStrategy); a panic is a failed
/// run; a payload that does not decode, a rejection, exhausted retries and too many
/// deliveries are terminal (archived to the dead-letter table when it is on). One bad row
/// never stalls the others:
///
/// - a row whose stored fields do not decode (headers that are not a string map) is a
///   terminal `decode_error` on its own; the rest of its batch runs;
/// - a claim that fails because of one row's data (a trigger or constraint that raises when
///   the row is leased) is retried on halves of its rows down to that row, which is set
///   aside in this worker's memory (1 s, doubling, at most 5 min) and, after
///   `max_deliveries` such failures, deleted — archived with reason `max_deliveries` when
///   the dead-letter queue is on — by a statement that updates nothing (a restart of the
///   worker starts that count again);
/// - a failed claim of another kind backs off (100 ms doubling to 5 s) and retries; the
///   cause is logged at once and then at most every 10 s, with the real reason when the
///   database cannot be reached (connection refused, not "pool timed out"), and counted in
///   `outbox_claim_errors_total{error}`. A standby's refusal is
///   [`Error::ReadOnly`](crate::Error::ReadOnly): the worker keeps trying the same way, so
///   it resumes once the standby is promoted (within the 5 s cap), without a restart;
/// - a completion that fails on a broken connection (SQLSTATE classes 08 and 57P, `25P03`),
///   a deadlock, a serialization failure, a lock timeout or a cancelled statement (`57014`,
///   a `statement_timeout`) is retried while the lease lasts; other statement errors leave
///   the row to lease expiry.
///
/// A process that crashes on a payload (an abort, running out of memory) takes the whole
/// batch it had claimed with it: deliveries are counted when a row is claimed, so every row
/// of that batch spends a delivery, and a crash loop ends each of them on
/// `max_deliveries` after that many restarts. Keep `fetch_batch_size` small (close to
/// `concurrency`) for handlers that may crash their process, and `max_deliveries` above the
/// restarts you expect.
///
/// # Locks taken by your transactions
/// Completions, renewals and releases never wait for a row lock while holding another (a
/// short `lock_timeout`, then one row at a time), so they cannot deadlock with your
/// transactions. A transaction of yours that extends or cancels timers and also writes
/// domain rows should lock the **domain rows first, then the timer rows**: the worker's
/// single-row completion may wait on a timer row your transaction holds, and that order
/// keeps the waits one-way.
///
/// # Shutdown
/// [`RunningWorker::shutdown`] stops claiming and gives back the rows claimed but not
/// started (pending again, as if never claimed). Running handlers get until
/// `graceful_timeout`; one still running then is stopped, and its row given back as a
/// failed attempt, due at once (or ended with reason `aborted` when its strategy has no
/// retry left). Batched acks are flushed. Everything is fenced by the lease tokens, so
/// other workers can claim the rows at once instead of waiting for `lease_ttl`. The
/// shutdown returns within `graceful_timeout` + [`SHUTDOWN_GRACE`] even when the database
/// does not answer; what it could not give back is reported in the
/// [`ShutdownReport`] and expires as usual. Nothing is lost either way.
#[must_use = "a Worker does nothing until `.start()` (or `.run_due()` in tests)"]
pub struct Worker<S> {
    store: S,
    routes: Arc<HashMap<String, Route>>,
    queues: Arc<Vec<String>>,
    schedules: Arc<Vec<Schedule>>,
    /// Set once the schedules are registered by [`Worker::run_due`]'s first call (or a
    /// successful [`Worker::register_schedules`]): a test driving the worker with `run_due`
    /// gets its schedules as a started worker does, once per worker, as once per start.
    registered: OnceCell<()>,
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

/// What [`RunningWorker::shutdown`] did with the rows the worker held. Every lease still
/// held at shutdown is given back by a write fenced by its token, so other workers can
/// claim the rows at once instead of waiting for `lease_ttl`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct ShutdownReport {
    /// True when every handler and completion finished within `graceful_timeout` and every
    /// lease left was given back.
    pub graceful: bool,
    /// Handlers still running at `graceful_timeout`, stopped (their futures dropped) and
    /// their rows given back (counted in `retried` or `aborted`).
    pub abandoned: usize,
    /// Rows claimed but never started, given back: pending again, due as before,
    /// `deliveries_count − 1` (or at their queued rearm's deadline).
    pub released: usize,
    /// Stopped runs given back as a failed attempt: due now (or at their queued rearm's
    /// deadline).
    pub retried: usize,
    /// Stopped runs with no retry left: ended on the terminal path, reason `aborted`.
    pub aborted: usize,
    /// Held rows a cancel had reached: deleted.
    pub cancelled: usize,
    /// Leases that could not be given back in time (the database did not answer, or a
    /// completion was still in flight): another worker claims those rows once their lease
    /// expires.
    pub unreleased: usize,
}

/// A started worker. Call [`RunningWorker::shutdown`] to stop it and await what it gave
/// back.
///
/// Dropping it (also `let _ = worker.start()`) starts the same shutdown at once, without
/// waiting for it, and logs a warning: the shutdown runs as a task
/// of the Tokio runtime, so it completes only while the runtime keeps running. When the
/// runtime ends too (the handle dropped at the end of `main`), the rows the worker held are
/// not given back; nothing is lost, but they wait for their lease to expire (`lease_ttl`,
/// 60 s by default) before another worker claims them.
#[derive(Debug)]
#[must_use = "dropping a RunningWorker (also with `let _ =`) stops the worker at once, without waiting for it: if the runtime ends too (the end of `main`), held rows wait for `lease_ttl` before another worker takes them; keep it and call `.shutdown().await`"]
pub struct RunningWorker {
    stop: watch::Sender<bool>,
    /// `None` once `shutdown` took it.
    task: Option<tokio::task::JoinHandle<ShutdownReport>>,
}

impl RunningWorker {
    /// Stops claiming, gives back the rows not started, lets running handlers finish until
    /// `graceful_timeout` and gives back the rows of those still running, and flushes pending
    /// completions (see [`Worker`]'s docs, "Shutdown"). Returns within `graceful_timeout` +
    /// [`SHUTDOWN_GRACE`]. Nothing is lost either way.
    pub async fn shutdown(mut self) -> ShutdownReport {
        self.stop.send_replace(true);
        let Some(task) = self.task.take() else {
            return ShutdownReport::default();
        };
        match task.await {
            Ok(report) => report,
            Err(e) => {
                tracing::error!(error = %e, "outbox worker task failed");
                ShutdownReport::default()
            }
        }
    }

    /// True once the worker has stopped.
    pub fn is_finished(&self) -> bool {
        self.task.as_ref().is_none_or(|t| t.is_finished())
    }
}

// A drop without `shutdown` still stops the worker (the claim loop sees the stop channel
// close), but nobody awaits it: say so once, since the usual cause is a `let _ =` or a handle
// that went out of scope, which stops the worker at once and silently.
impl Drop for RunningWorker {
    fn drop(&mut self) {
        if !*self.stop.borrow() && !self.is_finished() {
            tracing::warn!(
                "outbox: a RunningWorker was dropped without shutdown(): the worker stops now, \
                 in the background (running handlers get graceful_timeout); if the runtime ends \
                 first, the rows it holds wait for lease_ttl. Keep the handle and call \
                 .shutdown().await"
            );
        }
    }
}

impl<S: Store> Worker<S> {
    /// Assembles a checked configuration (see [`Worker::builder`]).
    pub(crate) fn new(
        store: S,
        routes: HashMap<String, Route>,
        schedules: Vec<Schedule>,
        config: Config,
    ) -> Self {
        let mut queues: Vec<String> = routes.keys().cloned().collect();
        queues.sort();
        Worker {
            store,
            routes: Arc::new(routes),
            queues: Arc::new(queues),
            schedules: Arc::new(schedules),
            registered: OnceCell::new(),
            config,
        }
    }

    /// Registers every schedule of the worker (those of
    /// [`WorkerBuilder::schedule`](crate::WorkerBuilder::schedule) and those declared on the
    /// handled types with `#[timer(every = …)]` or `#[timer(cron = …)]`) once, in the order
    /// they were declared, and returns what each registration did, as
    /// `(timer_id, registered)`: the first instant strictly after the store's clock, one
    /// statement per schedule.
    ///
    /// You rarely need it: [`Worker::start`] registers before its first claim, and
    /// [`Worker::run_due`] on its first call. Call it to see what a registration did (for
    /// example [`Registered::Unchanged`] when the stored schedule is the same), or to register
    /// at a chosen virtual time before the first `run_due`. Each call registers again (as a
    /// new worker start would); once one has succeeded, `run_due` does not register again.
    ///
    /// # Errors
    /// The first storage error (earlier schedules stay registered);
    /// [`Error::InvalidConfig`](crate::Error::InvalidConfig) (`knob` `"store"`) from a store
    /// without periodic timers.
    pub async fn register_schedules(&self) -> Result<Vec<(String, Registered)>> {
        let out = self.register_each().await?;
        // A `run_due` racing this call may be registering too; a second registration of the
        // same schedule writes nothing, so losing the race to set the cell is harmless.
        let _ = self.registered.set(());
        Ok(out)
    }

    async fn register_each(&self) -> Result<Vec<(String, Registered)>> {
        let mut out = Vec::with_capacity(self.schedules.len());
        for schedule in self.schedules.iter() {
            let registered = register_one(&self.store, schedule).await?;
            out.push((schedule.timer_id.clone(), registered));
        }
        Ok(out)
    }

    /// The queues this worker serves, sorted.
    pub fn queues(&self) -> &[String] {
        &self.queues
    }

    /// Runs every row that is due **now**, one at a time and to completion, in claim order,
    /// and returns what happened to each: the synchronous "run everything due" mode of the
    /// test harness. It claims in rounds until a claim comes back empty, so rows that
    /// become due during the run (a zero-delay retry) run too; a row whose handler extended
    /// its own timer is pending at its new deadline and does not run again until the
    /// store's clock reaches it. No batching, no sleeping, no notifications.
    ///
    /// Each row runs through the same code as on a started worker, with the same metrics,
    /// spans and events; only its writes differ: each is made once, in this call (a success
    /// is not pipelined, a failed write is not retried), and the first that fails is the
    /// call's error.
    ///
    /// With [`crate::testing::MemoryStore`] and its virtual clock this is deterministic:
    /// publish, [`advance`](crate::testing::MemoryStore::advance), `run_due`, inspect. It
    /// works on [`PgStore`](crate::PgStore) too (for a drain in a script or a test).
    ///
    /// **Schedules**: the first call registers the worker's schedules, as
    /// [`Worker::start`] does when it starts (see [`Worker::register_schedules`]), before it
    /// claims; later calls do not register again (once per worker, as once per start). Each
    /// schedule's first instant is the first one strictly after the store's clock **at that
    /// first call**, so call `run_due` once before you advance the clock to start the
    /// schedules where the test starts. A failed registration is returned as the error and
    /// tried again by the next call. Each run of a schedule queues its next instant when it
    /// starts, as on a started worker; the [`testing`](crate::testing) module docs show a day of
    /// a five-minute schedule in virtual time.
    ///
    /// Stops after [`RUN_DUE_LIMIT`](crate::worker::RUN_DUE_LIMIT) deliveries, so a handler
    /// that keeps making itself due at once cannot loop forever.
    ///
    /// # Errors
    /// The first storage error (of the first call's registration, of a claim, of queueing a
    /// periodic run's next instant, of giving back a schedule's row this worker cannot
    /// compute, or of a completion); deliveries before it have been completed, and the row
    /// it met stays leased until its lease expires.
    pub async fn run_due(&self) -> Result<Vec<Dispatched>> {
        telemetry::describe();
        // As `start` registers before its first claim. `get_or_try_init` leaves the cell
        // empty on an error, so the next call tries again.
        self.registered
            .get_or_try_init(|| async { self.register_each().await.map(drop) })
            .await?;
        // What this call holds and sets aside lasts for this call, as for one start.
        let shared = Arc::new(Shared::new(
            self.store.clone(),
            self.routes.clone(),
            self.config,
        ));
        claim::run_due(&shared, &self.queues).await
    }

    /// Spawns the worker on the current Tokio runtime.
    ///
    /// # Panics
    /// Outside a Tokio runtime.
    pub fn start(self) -> RunningWorker {
        telemetry::describe();
        let (stop, stopped) = watch::channel(false);
        let task = tokio::spawn(self.run(stopped));
        RunningWorker {
            stop,
            task: Some(task),
        }
    }

    /// Runs until `signal` completes, then shuts down gracefully.
    pub async fn run_until(self, signal: impl std::future::Future<Output = ()>) -> ShutdownReport {
        let running = self.start();
        signal.await;
        running.shutdown().await
    }

    async fn run(self, mut stopped: watch::Receiver<bool>) -> ShutdownReport {
        let config = self.config;
        let shared = Arc::new(Shared::new(self.store, self.routes, config));
        // LISTEN first, so nothing published after our first scan goes unheard. A
        // poll-only worker (`listen(false)`, for transaction-mode poolers) never asks.
        let listen = async {
            if !config.listen {
                return None;
            }
            match shared.store.wakeups().await {
                Ok(w) => w,
                Err(e) => {
                    tracing::warn!(error = %e, "outbox: no wake-up notifications; relying on deadlines and the idle poll");
                    None
                }
            }
        };
        // Independent of each other, so at once: the LISTEN connection, the autovacuum
        // check and the store's warm-up (its completions' first connection), all before the
        // first claim, whose rows the first completions then need not wait for a connect.
        let (wakeups, (), ()) = tokio::join!(
            listen,
            warn_if_autovacuum_off(&shared.store),
            shared.store.warm_up()
        );
        let (deliveries_tx, deliveries_rx) = mpsc::channel::<Claimed>(config.fetch_batch_size);
        let deliveries_rx = Arc::new(Mutex::new(deliveries_rx));
        // One statement's worth of successes may wait while the completer writes: a burst
        // behind a slow commit fills its next statement, and a full channel holds the
        // handlers back, which keeps the lease bound (SPEC §7.7).
        let (acks_tx, completer_task) = if config.ack_batch_size > 1 {
            let (tx, rx) = mpsc::channel(config.ack_batch_size);
            (Some(tx), Some(tokio::spawn(completer(shared.clone(), rx))))
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
        let (stop_renewal, renewal_stopped) = watch::channel(false);
        let renewal = tokio::spawn(renewal_loop(shared.clone(), renewal_stopped));
        // Schedules are registered before the first claim, so a schedule first due at once
        // is found by the first scan.
        register_all(&shared.store, &self.schedules, &stopped).await;
        let claims = tokio::spawn({
            let (shared, queues, mut stopped) =
                (shared.clone(), self.queues.clone(), stopped.clone());
            async move {
                claim_loop(&shared, &queues, wakeups, &deliveries_tx, &mut stopped).await;
                shared.store.claims_stopped();
            }
        });
        let gauge = config
            .queue_depth
            .map(|g| tokio::spawn(queue_depth(shared.clone(), g.every, g.mode)));
        // The claim loop ends only when told to stop (or when every handler task is gone).
        let _ = stopped.changed().await;
        // The gauge stops with the worker; aborting its task gives its poller slot back,
        // so another worker of the process takes over.
        if let Some(gauge) = gauge {
            gauge.abort();
        }
        shutdown(
            &shared,
            claims,
            handlers,
            completer_task,
            stop_renewal,
            renewal,
        )
        .await
    }
}

/// A queue table without autovacuum bloats without bound (measured: 372 000 dead tuples
/// for 6 600 live rows after two presence demos), so say so once, at start. A failed check
/// is not worth stopping a worker for.
async fn warn_if_autovacuum_off<S: Store>(store: &S) {
    match store.autovacuum_off().await {
        Ok(Some(off)) => {
            let why = match (off.server, off.table_option) {
                (true, true) => "the server runs with autovacuum = off and the table has autovacuum_enabled = false",
                (true, false) => "the server runs with autovacuum = off",
                _ => "the table has autovacuum_enabled = false",
            };
            tracing::warn!(
                table = %off.table,
                server_autovacuum_off = off.server,
                table_autovacuum_disabled = off.table_option,
                "outbox: autovacuum is off for the queue table ({why}): every claimed, extended and \
                 deleted row leaves dead row versions and index entries that nothing reclaims, so \
                 the table and its indexes grow without bound and claims and extends slow down; \
                 turn autovacuum on or VACUUM the table regularly"
            );
        }
        Ok(None) => {}
        // A worker started before `migrate()`: its claims fail (and back off) until the
        // tables exist; say why once, at start, where it is seen.
        Err(e @ crate::error::Error::NotMigrated { .. }) => {
            tracing::error!(error = %e, "outbox: the worker started, but the queue table does not exist; it keeps retrying until migrate() has run")
        }
        Err(e) => {
            tracing::debug!(error = %e, "outbox: could not check autovacuum for the queue table")
        }
    }
}

/// How long after `graceful_timeout` the last writes of a shutdown (releases, the final ack
/// flush) may take: the shutdown returns within `graceful_timeout` + this, whatever the
/// database does.
pub const SHUTDOWN_GRACE: Duration = Duration::from_millis(250);

/// Shutdown: stop claiming; give back the rows claimed but not started; let running
/// handlers finish until `graceful_timeout`, then stop them and give their rows back as
/// failed attempts (or end them, when no retry is left); flush batched acks.
async fn shutdown<S: Store>(
    shared: &Arc<Shared<S>>,
    claims: tokio::task::JoinHandle<()>,
    mut handlers: JoinSet<()>,
    completer: Option<tokio::task::JoinHandle<()>>,
    stop_renewal: watch::Sender<bool>,
    renewal: tokio::task::JoinHandle<()>,
) -> ShutdownReport {
    let config = shared.config;
    let deadline = Instant::now() + config.graceful_timeout;
    let last_call = deadline + SHUTDOWN_GRACE;
    let mut report = ShutdownReport {
        graceful: true,
        ..ShutdownReport::default()
    };
    // No buffered row starts from here on.
    shared.held.close();
    // A claim in flight finishes (its rows are then given back); one the database does not
    // answer is given up at the last call (its rows, if it committed, expire).
    if tokio::time::timeout_at(last_call, claims).await.is_err() {
        report.graceful = false;
        tracing::warn!("outbox: a claim in flight did not finish before the shutdown deadline");
    }
    let buffered: Vec<Release> = shared
        .held
        .rows()
        .into_iter()
        .filter(|r| r.phase == Phase::Buffered)
        .map(|r| Release {
            lease: r.lease,
            started: false,
        })
        .collect();
    give_back(shared, &buffered, last_call, &mut report).await;

    while !handlers.is_empty() {
        if tokio::time::timeout_at(deadline, handlers.join_next())
            .await
            .is_err()
        {
            report.graceful = false;
            break;
        }
    }
    if !handlers.is_empty() {
        // Tasks still busy at the deadline: a handler still running, or a completion still
        // waiting (on a row lock an application transaction holds, or on the database).
        let rows = shared.held.rows();
        let running = rows.iter().filter(|r| r.phase == Phase::Running).count();
        let completing = rows.iter().filter(|r| r.phase == Phase::Completing).count();
        report.abandoned = running;
        if running > 0 {
            tracing::warn!(
                handlers = running,
                "outbox: handlers still running at graceful_timeout are stopped; their rows are given back"
            );
        }
        if completing > 0 {
            tracing::warn!(
                completions = completing,
                "outbox: completions still waiting at graceful_timeout are abandoned; their rows are claimed again once their lease expires"
            );
        }
        handlers.abort_all();
        while handlers.join_next().await.is_some() {}
    }
    // Runs stopped at the deadline: a failed attempt each, given back due now, or ended
    // when their strategy has no retry left.
    let mut stopped_runs = Vec::new();
    for row in shared.held.rows() {
        if row.phase != Phase::Running {
            continue;
        }
        let failures = u32::try_from(row.attempts_count)
            .unwrap_or(0)
            .saturating_add(1);
        let exhausted = shared
            .routes
            .get(&row.queue)
            .is_some_and(|r| !r.retry.allows_another(failures));
        if exhausted {
            let failure = Failure {
                reason: FailureReason::Aborted,
                last_error: Some("aborted at shutdown"),
            };
            let ended = tokio::time::timeout_at(last_call, shared.store.fail(row.lease, failure));
            match ended.await {
                Ok(Ok(Completion::Cancelled)) => report.cancelled += 1,
                Ok(Ok(Completion::LeaseLost)) => {}
                Ok(Ok(_)) => report.aborted += 1,
                _ => {
                    report.unreleased += 1;
                    report.graceful = false;
                }
            }
            shared.held.remove(row.lease);
        } else {
            stopped_runs.push(Release {
                lease: row.lease,
                started: true,
            });
        }
    }
    give_back(shared, &stopped_runs, last_call, &mut report).await;

    if let Some(mut completer) = completer {
        // The completer ends once every handler task (and so every sender) is gone. At the
        // deadline it is stopped, so no ack is written after shutdown returns (a statement
        // already sent may still commit on the server; its rows are then simply gone).
        if tokio::time::timeout_at(last_call, &mut completer)
            .await
            .is_err()
        {
            completer.abort();
            let _ = completer.await;
            report.graceful = false;
            tracing::warn!(
                "outbox: pending acks not written in time; those rows will be redelivered after their lease expires"
            );
        }
    }
    let _ = stop_renewal.send(true);
    renewal.abort();
    // Whatever is still held could not be given back (a completion still in flight, or
    // the database did not answer): it expires after lease_ttl.
    let left = shared.held.len();
    if left > 0 {
        report.unreleased += left;
        report.graceful = false;
        tracing::warn!(
            unreleased = left,
            "outbox: leases not given back at shutdown; those rows are claimed again once their lease expires"
        );
    }
    report
}

/// Releases `items` before `last_call`, counting what happened in `report`.
async fn give_back<S: Store>(
    shared: &Shared<S>,
    items: &[Release],
    last_call: Instant,
    report: &mut ShutdownReport,
) {
    if items.is_empty() {
        return;
    }
    match tokio::time::timeout_at(last_call, shared.store.release(items)).await {
        Ok(Ok(done)) => {
            for (item, released) in items.iter().zip(done) {
                match released {
                    Released::Pending => report.released += 1,
                    Released::Retried => report.retried += 1,
                    Released::Cancelled => report.cancelled += 1,
                    _ => {}
                }
                shared.held.remove(item.lease);
            }
        }
        Ok(Err(e)) => {
            report.graceful = false;
            tracing::warn!(error = %e, rows = items.len(), "outbox: could not give leases back at shutdown; those rows are claimed again once their lease expires");
        }
        Err(_) => {
            report.graceful = false;
            tracing::warn!(
                rows = items.len(),
                "outbox: giving leases back did not finish before the shutdown deadline"
            );
        }
    }
}
