//! [`WorkerBuilder`]: handlers and knobs, all checked by [`WorkerBuilder::build`].

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use super::config::{Config, QueueDepth};
use super::decide::Route;
use super::handler::{Handler, HandlerOptions};
use super::lifecycle::Worker;
use super::schedule::{Declared, Schedule};
use crate::error::{Error, Printable, Result};
use crate::message::validate_queue;
use crate::periodic::{Recurrence, DECLARED_SCHEDULE_NAME};
use crate::stats::StatsMode;
use crate::store::{Store, SCHEDULE_KEY_PREFIX};
use crate::timer::Timer;

impl<S: Store> Worker<S> {
    /// Starts building a worker over `store`.
    pub fn builder(store: S) -> WorkerBuilder<S> {
        WorkerBuilder {
            store,
            routes: Vec::new(),
            config: Config::default(),
            invalid_queue: None,
            schedules: Vec::new(),
            state: Arc::new(()),
        }
    }
}

/// Builds a [`Worker`]; see there. Setters never fail: every value is
/// checked by [`WorkerBuilder::build`]. `St` is the state handlers registered from now on
/// receive ([`WorkerBuilder::state`]).
#[must_use = "a WorkerBuilder does nothing until `.build()?.start()`"]
pub struct WorkerBuilder<S, St = ()> {
    store: S,
    routes: Vec<Route>,
    config: Config,
    invalid_queue: Option<Error>,
    schedules: Vec<Declared>,
    state: Arc<St>,
}

impl<S: Store, Old> WorkerBuilder<S, Old> {
    /// Gives the worker's handlers a shared state: handlers registered after this take a
    /// [`Context<St>`](crate::Context) and ask for the state, or a piece of it, by type with
    /// [`Context::state`](crate::Context::state) — the state itself, or a field of a state
    /// struct that derives [`FromRef`](crate::FromRef). Asking for a type the worker was not
    /// given does not compile. Give it once, before the handlers that use it: handlers
    /// registered earlier keep the state they were registered with, and a second call replaces
    /// the state for the handlers registered after it.
    ///
    /// ```no_run
    /// use outbox::{Context, Outbox, PgStore, Worker};
    ///
    /// #[derive(Clone, outbox::FromRef)]
    /// struct AppState {
    ///     db: sqlx::PgPool,
    /// }
    ///
    /// async fn on_job(_: Vec<u8>, ctx: Context<AppState>) -> Result<(), sqlx::Error> {
    ///     let db = ctx.state::<sqlx::PgPool>();
    ///     sqlx::query("SELECT 1").execute(&db).await?;
    ///     Ok(())
    /// }
    ///
    /// # fn f(pool: sqlx::PgPool) -> Result<(), outbox::Error> {
    /// let worker = Worker::builder(PgStore::new(pool.clone(), Outbox::default()))
    ///     .state(AppState { db: pool })
    ///     .queue("jobs", on_job)
    ///     .build()?;
    /// # Ok(()) }
    /// ```
    pub fn state<St: Send + Sync + 'static>(self, state: St) -> WorkerBuilder<S, St> {
        WorkerBuilder {
            store: self.store,
            routes: self.routes,
            config: self.config,
            invalid_queue: self.invalid_queue,
            schedules: self.schedules,
            state: Arc::new(state),
        }
    }
}

impl<S: Store, St: Send + Sync + 'static> WorkerBuilder<S, St> {
    /// Handles the `#[timer]` type `T` (its queue is `T::QUEUE`, its `max_deliveries`
    /// `T::MAX_DELIVERIES`) with `handler`: an `async fn(T, Context) -> R` where `R` is
    /// `()`, [`Outcome`](crate::Outcome) or a `Result` of those with a displayable error. A handler for
    /// another payload type does not compile. Retries use [`RetryStrategy::default`](crate::RetryStrategy::default).
    /// A worker serving several queues claims them in turns, fairly across claims: see
    /// [`fetch_batch_size`](Self::fetch_batch_size).
    pub fn timer<T: Timer>(self, handler: impl Handler<T, St>) -> Self {
        self.timer_with::<T>(handler, HandlerOptions::default())
    }

    /// As [`WorkerBuilder::timer`], with a retry strategy or a `max_deliveries` override.
    pub fn timer_with<T: Timer>(
        mut self,
        handler: impl Handler<T, St>,
        options: HandlerOptions,
    ) -> Self {
        let state = self.state.clone();
        self.routes
            .push(Route::typed::<T, _, St>(handler, state, options));
        // A schedule declared on the type runs wherever the type is handled.
        self.schedules.extend(Declared::declared_on::<T>());
        self
    }

    /// Handles the raw queue `queue` with `handler`: an `async fn(Vec<u8>, Context) -> R`
    /// over the stored bytes. `max_deliveries` is [`DEFAULT_MAX_DELIVERIES`](crate::worker::DEFAULT_MAX_DELIVERIES).
    /// A worker serving several queues claims them in turns, fairly across claims: see
    /// [`fetch_batch_size`](Self::fetch_batch_size).
    pub fn queue(self, queue: impl Into<String>, handler: impl Handler<Vec<u8>, St>) -> Self {
        self.queue_with(queue, handler, HandlerOptions::default())
    }

    /// As [`WorkerBuilder::queue`], with options.
    pub fn queue_with(
        mut self,
        queue: impl Into<String>,
        handler: impl Handler<Vec<u8>, St>,
        options: HandlerOptions,
    ) -> Self {
        let queue = queue.into();
        if let Err(e) = validate_queue(&queue) {
            self.invalid_queue.get_or_insert(e);
        }
        let state = self.state.clone();
        self.routes.push(Route::raw(queue, handler, state, options));
        self
    }

    /// Registers a route built elsewhere in the crate (a relay's, `relay.rs`), with the
    /// builder's state; an error found while building it is reported by `build()`.
    pub(crate) fn push_route(
        mut self,
        make: impl FnOnce(&S, Arc<St>) -> Result<Vec<Route>>,
    ) -> Self {
        match make(&self.store, self.state.clone()) {
            Ok(routes) => self.routes.extend(routes),
            Err(e) => {
                self.invalid_queue.get_or_insert(e);
            }
        }
        self
    }

    /// Runs the `#[timer]` type `T` on a schedule: the timer `schedule:<name>` of `T`'s queue,
    /// carrying `payload` (stored as JSON, as a published `T` is), due at every instant of
    /// `recurrence` ([`Recurrence`](crate::periodic::Recurrence): a fixed interval or a cron
    /// expression in a time zone). A type may have several schedules under distinct names.
    /// A type that declares its own schedule in its attribute (`#[timer(every = "5m")]`,
    /// `#[timer(cron = "0 0 6 * * *", tz = "Europe/Berlin")]`) has it under the name
    /// [`DECLARED_SCHEDULE_NAME`](crate::periodic::DECLARED_SCHEDULE_NAME) (`"default"`),
    /// added by [`timer`](Self::timer) with `T::default()` as its payload and following the
    /// same rules; `schedule` then takes any other name.
    ///
    /// The rules:
    ///
    /// - **One live row per schedule**, whatever the number of workers and restarts: the
    ///   schedule is a keyed timer, and the unique index on `(queue, timer_id)` keeps one live
    ///   row per key; no leader is elected. The `schedule:` keys are reserved: publishes and
    ///   extends of them are refused, cancels are allowed.
    /// - **Registration** at [`Worker::start`] (before the first claim; in tests, by the
    ///   first [`Worker::run_due`] call): one statement per schedule,
    ///   first due at the recurrence's first instant strictly after the **database** clock
    ///   (`now()`). The schedule's fingerprint
    ///   ([`Recurrence::fingerprint`](crate::periodic::Recurrence::fingerprint)) is kept in the
    ///   row's headers under [`SCHEDULE_HEADER`](crate::store::SCHEDULE_HEADER). A failed
    ///   registration on a database error is logged and tried again (100 ms doubling to 5 s)
    ///   until it succeeds or the worker stops; claiming starts after it.
    /// - **When a run of the schedule starts** (after the claim, before the handler and before
    ///   the `max_deliveries` terminal path), the worker queues the next instant as the row's
    ///   rearm, fenced by the lease token and never clearing a cancel mark: the instant after
    ///   the run's deadline, from the claim's database clock, on the recurrence **stored
    ///   with the row** (the fingerprint of the last registration, read back with
    ///   [`Recurrence::from_fingerprint`](crate::periodic::Recurrence::from_fingerprint); the
    ///   worker's own recurrence for that name when the stored one is missing or unreadable
    ///   in this build). So any worker that handles the queue keeps the schedule going, its
    ///   code registering it or not (an older version during a deploy, another program), and
    ///   a worker that can compute neither (a cron schedule on a build without the `cron`
    ///   feature, say) does not start the run: it gives the row back untouched and leaves it
    ///   out of its claims for a while (1 s doubling to 5 min) for a worker that can.
    ///   Success and terminal failure both re-arm the schedule, and a crash keeps the rearm
    ///   queued for the run that reclaims the row. The write is retried as completions are (a
    ///   broken connection, a deadlock or a lock timeout, while the lease lasts); if it still does
    ///   not happen, or the lease was lost, **the run does not start**: the row keeps its instant
    ///   and runs again, armed, once its lease expires, so a failed write never ends a schedule.
    /// - **A deploy skips no instant that had not started**: a row claimed but not yet
    ///   started when the worker shuts down carries no rearm; it is given back with its
    ///   instant, which the next worker runs. A run stopped at the shutdown deadline counts as
    ///   a failed attempt and yields to the next instant, as retries do.
    /// - **Missed instants fire once**: when workers were down past several instants, the
    ///   latest instant not after the claim fires once, right away, and the schedule goes on
    ///   from there.
    /// - **Retries yield to the next instant**: a failed run with a retry left is not retried
    ///   at its backoff; the row is due at the next instant instead.
    /// - **An interval's grid starts at registration** (its first instant is the database
    ///   clock plus the interval), not on the hour: use a cron expression for wall-clock
    ///   times.
    /// - **A cancel** ([`Outbox::cancel`](crate::Outbox::cancel) of `schedule:<name>`) stops
    ///   the schedule until the next worker start registers it again; to stop it for good,
    ///   remove it from the code, deploy, then cancel it (removing the code alone does not:
    ///   the workers that handle the queue follow the recurrence stored with the row).
    /// - **A changed schedule** (another fingerprint) applies at the next worker start: the
    ///   registration moves the pending row to the new first instant, **earlier deadlines
    ///   included** (an overdue row keeps its deadline and fires at once), or replaces the
    ///   rearm queued on a running one. A changed payload with the same recurrence applies
    ///   at the next start too, keeping the row's deadline.
    ///   During a rolling deploy the last worker to start wins, on old workers too (they
    ///   follow the stored recurrence).
    ///
    /// Checked by [`build`](Self::build): the name is non-empty and `schedule:<name>` is at
    /// most 255 bytes without NUL ([`Error::InvalidArgument`], `field` `"schedule"`), the
    /// payload encodes (`field` `"schedule"`) within 64 MiB, a handler for `T`'s queue is
    /// registered on this builder and the name is not taken twice on that queue
    /// ([`Error::InvalidConfig`], `knob` `"schedule"`).
    ///
    /// ```no_run
    /// use outbox::periodic::Recurrence;
    /// use outbox::{Context, Outbox, PgStore, Worker};
    ///
    /// #[outbox::timer(queue = "maintenance", max_deliveries = 3)]
    /// #[derive(serde::Serialize, serde::Deserialize)]
    /// struct Cleanup { older_than_days: u32 }
    ///
    /// async fn cleanup(job: Cleanup, _ctx: Context) -> Result<(), sqlx::Error> { Ok(()) }
    ///
    /// # fn f(pool: sqlx::PgPool) -> Result<(), outbox::Error> {
    /// let worker = Worker::builder(PgStore::new(pool, Outbox::default()))
    ///     .timer::<Cleanup>(cleanup)
    ///     .schedule("cleanup", Recurrence::parse_every("5m")?, Cleanup { older_than_days: 30 })
    ///     .build()?;
    /// # Ok(()) }
    /// ```
    pub fn schedule<T: Timer>(mut self, name: &str, recurrence: Recurrence, payload: T) -> Self {
        self.schedules
            .push(Declared::of::<T>(name, Ok(recurrence), &payload));
        self
    }

    /// Handler tasks running at once (default 1, range 1..=10 000).
    pub fn concurrency(mut self, n: usize) -> Self {
        self.config.concurrency = n;
        self
    }

    /// Rows claimed per claim statement (default 10, range 1..=10 000). The claim loop
    /// claims again when all claimed rows have been handed to handlers.
    ///
    /// **Several queues, any batch size.** A claim takes the worker's queues in turns: each
    /// queue's earliest due row, then each queue's second, and so on, each queue's rows by
    /// deadline. A claim ends where its batch is full, and the next claim starts its turns
    /// with the queue after the one the previous claim ended on (queues in name order,
    /// wrapping around). So with `n` queues holding due rows, each queue's earliest due row
    /// is claimed within `n` claims, whatever the batch size and however old or large the
    /// other queues' backlogs: with `fetch_batch_size(1)` and two queues, a row that falls
    /// due now in one is claimed by the next claim or the one after, even behind thousands
    /// of overdue rows of the other. Several workers each keep their own turn; a row another
    /// worker has locked is skipped (`FOR UPDATE SKIP LOCKED`), so the bound holds for each
    /// worker's claims. A queue at its
    /// [`max_concurrency`](crate::HandlerOptions::max_concurrency) is left out of a claim
    /// and keeps its place in the turns.
    pub fn fetch_batch_size(mut self, n: usize) -> Self {
        self.config.fetch_batch_size = n;
        self
    }

    /// How long a claim is exclusive (default 60 s, range 100 ms..=7 days). The worker renews
    /// every lease it holds about every `lease_ttl / 3` while the row waits or runs, so a long
    /// handler keeps its row; once a lease is older than `lease_ttl` by the database clock
    /// (`acquired_at < now() - lease_ttl`), any worker may reclaim the row. So this is how long
    /// a dead worker's rows wait before they are delivered again. Expiry is judged by the
    /// claiming worker's value: give every worker that serves a queue the same one.
    pub fn lease_ttl(mut self, ttl: Duration) -> Self {
        self.config.lease_ttl = ttl;
        self
    }

    /// The longest an idle worker sleeps before looking again, which also bounds how late an
    /// expired lease of a dead worker is picked up when nothing else wakes it (default 30 s,
    /// range 10 ms..=24 h). Timers do not wait for it: the worker sleeps until the earliest
    /// deadline among its queues and wakes on the notification a publish sends when it commits
    /// (unless the outbox has notifications off).
    pub fn idle_poll(mut self, ceiling: Duration) -> Self {
        self.config.idle_poll = ceiling;
        self
    }

    /// Whether the worker LISTENs for the wake-up notification a publish sends when it
    /// commits (default `true`). `false` makes a **poll-only** worker: it never runs `LISTEN`
    /// and finds new rows by sleeping until the earliest deadline it knows of or
    /// [`idle_poll`](Self::idle_poll), whichever comes first, so a row published "now" while
    /// it sleeps runs up to `idle_poll` late: lower `idle_poll` (say 1 s) with it.
    ///
    /// For connection poolers in transaction mode (PgBouncer `pool_mode = transaction`):
    /// `LISTEN` belongs to a server session, and such a pooler hands each transaction to any
    /// session, so notifications would be lost or go to the wrong client. Pair it with
    /// [`OutboxBuilder::notify(false)`](crate::OutboxBuilder::notify) on the publishers'
    /// [`Outbox`](crate::Outbox) to save the `pg_notify` they would send for nobody. A
    /// worker whose store's outbox is built with
    /// [`transaction_pooler(true)`](crate::OutboxBuilder::transaction_pooler) must have it
    /// off: `build()` refuses `listen(true)` there with [`Error::InvalidConfig`], knob
    /// `listen`.
    pub fn listen(mut self, on: bool) -> Self {
        self.config.listen = on;
        self
    }

    /// The most successful completions one ack statement writes (default
    /// [`DEFAULT_ACK_BATCH_SIZE`](crate::worker::DEFAULT_ACK_BATCH_SIZE), range 1..=10 000). Acks
    /// are pipelined: a finished handler hands its success to the worker's completer and
    /// takes the next row at once, and the completer writes everything waiting, up to this
    /// cap, in one fenced `DELETE` as soon as its previous one returned (no linger: a lone
    /// success is written at once). `1` writes one `DELETE` per row from the handler task,
    /// before it takes the next row. See [`Worker`](crate::Worker)'s "Acks" and "Sizing".
    pub fn ack_batch_size(mut self, n: usize) -> Self {
        self.config.ack_batch_size = n;
        self
    }

    /// Turns on the queue-depth gauge (default off): the queue statistics of every queue of
    /// the store's table ([`Outbox::stats`](crate::Outbox::stats), in `mode`, lease expiry
    /// judged by this worker's [`lease_ttl`](Self::lease_ttl)), read once at start and then
    /// every `interval` (at least [`MIN_QUEUE_DEPTH_INTERVAL`](crate::worker::MIN_QUEUE_DEPTH_INTERVAL),
    /// 15 s, at most 24 h), and set as gauges through the `metrics` facade:
    ///
    /// - `outbox_queue_depth{queue, state}`: rows, with `state` one of `pending`, `due`,
    ///   `leased`, `expired_leases`, `rearms`, `cancel_marks`, `dead_letters` (each figure
    ///   the mode measures; an estimate in [`StatsMode::Estimate`] where the
    ///   [`stats`](crate::stats) module says so);
    /// - `outbox_queue_oldest_due_lateness_seconds{queue}`: how long the oldest due row has
    ///   waited (0 when nothing is due).
    ///
    /// A queue that has no row left is set to 0. **One read per process**: however many
    /// workers of the process have the gauge on, one of them reads at a time, and another
    /// takes over within its own interval when it stops; several processes each read and
    /// report the same figures, so aggregate them with `max`, not `sum`. A process whose
    /// workers serve several outboxes reports the table of the worker that reads. Exact
    /// counts read every row of the table (the [`stats`](crate::stats) module gives the
    /// measured cost): choose the interval, or [`StatsMode::Estimate`], accordingly.
    ///
    /// The read takes one connection of the store's pool, which the pool-size check of
    /// [`build`](Self::build) counts (`concurrency + 3` with the gauge). A failed read is
    /// logged and tried again at the next interval.
    pub fn queue_depth_gauge(mut self, interval: Duration, mode: StatsMode) -> Self {
        self.config.queue_depth = Some(QueueDepth {
            every: interval,
            mode,
        });
        self
    }

    /// How long [`RunningWorker::shutdown`](crate::RunningWorker::shutdown) waits for running handlers and pending
    /// completions (default 15 s, range 0..=1 h).
    pub fn graceful_timeout(mut self, timeout: Duration) -> Self {
        self.config.graceful_timeout = timeout;
        self
    }

    /// Checks everything and builds the worker.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the knob whose value is out of range (or `handlers`
    /// when none is registered, `retry` for a bad strategy, `max_deliveries` for 0,
    /// `queue_depth_gauge` for an interval under 15 s, `max_connections` for a store pool
    /// smaller than the worker needs, `listen` for a worker that would `LISTEN` through a
    /// transaction-mode pooler);
    /// [`Error::InvalidArgument`] for a bad raw queue name; [`Error::DuplicateHandler`]
    /// naming both handlers when two serve one queue; for schedules, the errors listed at
    /// [`schedule`](Self::schedule).
    pub fn build(self) -> Result<Worker<S>> {
        if let Some(e) = self.invalid_queue {
            return Err(e);
        }
        self.config.validate()?;
        // SPEC §13: LISTEN belongs to a server session, which a transaction-mode pooler
        // does not keep beyond a transaction.
        if self.config.listen && self.store.transaction_pooler() {
            return Err(Error::config(
                "listen",
                "the store's outbox is built with `transaction_pooler(true)`, and a transaction-mode \
                 pooler does not keep a LISTEN beyond its transaction: build the worker with \
                 `listen(false)` (poll-only, with a short `idle_poll`), or give it a store over a \
                 direct connection",
            ));
        }
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
                    format!("must be at least 1 for queue `{}`", Printable(&route.queue)),
                ));
            }
            if let Some(t) = route.timeout {
                if t < Duration::from_millis(1) || t > Duration::from_secs(7 * 24 * 3600) {
                    return Err(Error::config(
                        "timeout",
                        format!(
                            "must be within 1ms..=7 days for queue `{}`, got {t:?}",
                            Printable(&route.queue)
                        ),
                    ));
                }
            }
            if let Some(n) = route.max_concurrency {
                if !(1..=10_000).contains(&n) {
                    return Err(Error::config(
                        "max_concurrency",
                        format!(
                            "must be within 1..=10000 for queue `{}`, got {n}",
                            Printable(&route.queue)
                        ),
                    ));
                }
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
        let mut schedules: Vec<Schedule> = Vec::with_capacity(self.schedules.len());
        for declared in self.schedules {
            let schedule = declared.check()?;
            let Some(route) = routes.get_mut(&schedule.queue) else {
                return Err(Error::config(
                    "schedule",
                    format!(
                        "`{}` of queue `{}` has no handler: register one for the queue on this builder",
                        schedule.timer_id, schedule.queue
                    ),
                ));
            };
            if route.schedules.contains_key(&schedule.timer_id) {
                let declared = format!("{SCHEDULE_KEY_PREFIX}{DECLARED_SCHEDULE_NAME}");
                let why = if schedule.timer_id == declared {
                    format!(
                        " (\"{DECLARED_SCHEDULE_NAME}\" is the name of the schedule a type declares in \
                         `#[timer(every = …)]` or `#[timer(cron = …)]`: give `schedule` another name)"
                    )
                } else {
                    String::new()
                };
                return Err(Error::config(
                    "schedule",
                    format!(
                        "`{}` is registered twice on queue `{}`{why}",
                        schedule.timer_id, schedule.queue
                    ),
                ));
            }
            route
                .schedules
                .insert(schedule.timer_id.clone(), schedule.recurrence.clone());
            schedules.push(schedule);
        }
        if let Some(has) = self.store.max_connections() {
            // A relay's run holds no connection: only other handlers count per slot.
            let relays_only = routes.values().all(|r| r.circuit.is_some());
            let needs = if relays_only {
                self.config.connections_with_slots(1)
            } else {
                self.config.connections_needed()
            };
            if has < needs {
                return Err(Error::config(
                    "max_connections",
                    format!(
                        "the store's pool holds {has} connection(s); a worker with concurrency {c} needs {needs}: \
                         {slots} for the handler slots (each handler's own transaction while it runs, or its completion after), \
                         1 for claims and wake-up reads, 1 for a batched ack that must wait for a row lock \
                         (the completer finishes such rows one at a time on this pool){gauge} \
                         (the other completions and the lease renewal use a second pool the store opens, \
                         LISTEN a connection of its own)",
                        c = self.config.concurrency,
                        slots = needs - 2 - u32::from(self.config.queue_depth.is_some()),
                        gauge = if self.config.queue_depth.is_some() {
                            ", 1 for the queue-depth gauge's read"
                        } else {
                            ""
                        },
                    ),
                ));
            }
        }
        Ok(Worker::new(self.store, routes, schedules, self.config))
    }
}
