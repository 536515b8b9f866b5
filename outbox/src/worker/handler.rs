//! What a handler author sees: the [`Context`] a handler receives, the [`Outcome`] it
//! returns, the [`Handler`] shape, and its [`HandlerOptions`]. How a run becomes a
//! decision is in `decide.rs`.

use std::any::type_name;
use std::fmt::Display;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::future::BoxFuture;
use tokio::sync::watch;

use super::retry::RetryStrategy;
use crate::error::Result;
use crate::message::Headers;
use crate::store::transaction::{HandlerTransaction, TransactionAccess};
use crate::store::Delivery;

/// Why a running handler is asked to stop ([`Context::cancelled`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CancelReason {
    /// The worker lost the row's lease (it could not renew it in time, and another worker
    /// may have claimed the row): this run's completion will write nothing, so its work
    /// may be done twice. Stop as soon as it is safe.
    LeaseLost,
    /// The timer was cancelled while this run went on: however the run ends, its row is
    /// deleted and the timer does not fire again. Stop if the work is now pointless.
    TimerCancelled,
}

/// What a handler knows about the delivery it runs for, how it learns that it should stop
/// early ([`Context::cancelled`]), and the worker's shared state `St`
/// ([`Context::state`], given once with [`WorkerBuilder::state`](crate::WorkerBuilder::state);
/// `()` when none was given).
pub struct Context<St = ()> {
    id: i64,
    queue: String,
    timer_id: Option<String>,
    headers: Option<Headers>,
    attempt: u32,
    delivery: u32,
    deadline: DateTime<Utc>,
    claimed_at: DateTime<Utc>,
    created_at: DateTime<Utc>,
    stop: watch::Receiver<Option<CancelReason>>,
    state: Arc<St>,
    transaction: TransactionAccess,
}

impl<St> Clone for Context<St> {
    fn clone(&self) -> Self {
        Context {
            id: self.id,
            queue: self.queue.clone(),
            timer_id: self.timer_id.clone(),
            headers: self.headers.clone(),
            attempt: self.attempt,
            delivery: self.delivery,
            deadline: self.deadline,
            claimed_at: self.claimed_at,
            created_at: self.created_at,
            stop: self.stop.clone(),
            state: self.state.clone(),
            transaction: self.transaction.clone(),
        }
    }
}

impl<St> std::fmt::Debug for Context<St> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("id", &self.id)
            .field("queue", &self.queue)
            .field("timer_id", &self.timer_id)
            .field("attempt", &self.attempt)
            .field("delivery", &self.delivery)
            .field("deadline", &self.deadline)
            .field("claimed_at", &self.claimed_at)
            .field("state", &type_name::<St>())
            .finish_non_exhaustive()
    }
}

impl Context {
    pub(crate) fn new(
        d: &Delivery,
        stop: watch::Receiver<Option<CancelReason>>,
        transaction: TransactionAccess,
    ) -> Self {
        Context {
            id: d.lease.id,
            queue: d.queue.clone(),
            timer_id: d.timer_id.clone(),
            headers: d.headers.clone(),
            attempt: u32::try_from(d.attempts_count)
                .unwrap_or(0)
                .saturating_add(1),
            delivery: u32::try_from(d.deliveries_count).unwrap_or(0),
            deadline: d.deadline,
            claimed_at: d.claimed_at,
            created_at: d.created_at,
            stop,
            state: Arc::new(()),
            transaction,
        }
    }

    /// The same context with the worker's state.
    pub(crate) fn with_state<St>(self, state: Arc<St>) -> Context<St> {
        Context {
            id: self.id,
            queue: self.queue,
            timer_id: self.timer_id,
            headers: self.headers,
            attempt: self.attempt,
            delivery: self.delivery,
            deadline: self.deadline,
            claimed_at: self.claimed_at,
            created_at: self.created_at,
            stop: self.stop,
            state,
            transaction: self.transaction,
        }
    }
}

impl<St> Context<St> {
    /// A piece of the worker's state, by type: the state itself (`ctx.state::<AppState>()`),
    /// or any type the state converts into by [`FromRef`] — a field of a state struct that
    /// derives it (`ctx.state::<PgPool>()`). Cloned: keep the pieces cheap to clone (pools,
    /// `Arc`s). Asking for a type the worker was not given does not compile.
    ///
    /// ```
    /// #[derive(Clone, outbox::FromRef)]
    /// struct AppState {
    ///     greeting: std::sync::Arc<str>,
    ///     visits: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// }
    ///
    /// async fn handler(_: Vec<u8>, ctx: outbox::Context<AppState>) {
    ///     let greeting = ctx.state::<std::sync::Arc<str>>();
    ///     println!("{greeting}");
    /// }
    /// ```
    pub fn state<X: FromRef<St>>(&self) -> X {
        X::from_ref(&self.state)
    }

    /// Begins this run's transaction on the worker's database: write your changes through it
    /// (`&mut *tx`), then [`commit`](HandlerTransaction::commit) it, which completes this run's
    /// row **in the same transaction** — your writes and the row's completion commit together
    /// or not at all. A worker that lost the row's lease commits nothing
    /// ([`Error::LeaseLost`](crate::Error::LeaseLost)): the completion's write is fenced by the
    /// lease token, so it matches nothing once another worker has re-claimed the row, and the
    /// whole transaction is rolled back.
    ///
    /// The transaction is always `READ COMMITTED`, whatever the session's default: there a
    /// statement that waited for a row lock re-checks its `WHERE` on the newest committed
    /// row, so the completion sees the row as lease renewals and extends left it (a
    /// `REPEATABLE READ` or `SERIALIZABLE` snapshot would fail the commit with a
    /// serialization error instead).
    ///
    /// ```no_run
    /// async fn on_expiry(user_id: Vec<u8>, ctx: outbox::Context) -> Result<(), outbox::Error> {
    ///     let mut tx = ctx.begin().await?;
    ///     sqlx::query("UPDATE users SET online = false WHERE id = $1")
    ///         .bind(i64::from(user_id[0]))
    ///         .execute(&mut *tx)
    ///         .await?;
    ///     tx.commit().await?; // the row is completed in this transaction
    ///     Ok(())
    /// }
    /// ```
    ///
    /// One transaction per run; it holds one connection of the store's pool while open
    /// (the worker's sizing counts one per handler slot). A run that began one and returns
    /// without committing or rolling it back **fails** ("transaction not committed"); a
    /// run that returns an error or `Outcome::Retry`/`Reject` rolls it back first (its
    /// writes vanish) and is retried or rejected as usual; a run that committed is complete,
    /// whatever it returns afterwards. A transaction moved out of the handler and still
    /// open when the handler returns fails the run too, and can no longer commit.
    ///
    /// # Errors
    /// [`Error::TransactionUnavailable`](crate::Error::TransactionUnavailable) on a store
    /// without database transactions (the in-memory store) or for a second `begin` in one
    /// run; [`Error::Database`](crate::Error::Database) if the pool cannot give a
    /// connection.
    pub async fn begin(&self) -> Result<HandlerTransaction> {
        self.transaction.begin().await
    }

    /// Completes when the worker asks this run to stop, with the reason: the lease was lost
    /// or the timer was cancelled. The worker learns of either at its next lease renewal
    /// (every third of `lease_ttl`). Never completes otherwise, so use it in a
    /// `tokio::select!` beside the work:
    ///
    /// ```
    /// # async fn work() {}
    /// async fn handler(_: Vec<u8>, ctx: outbox::Context) -> Result<(), String> {
    ///     tokio::select! {
    ///         () = work() => Ok(()),
    ///         why = ctx.cancelled() => Err(format!("stopped early: {why:?}")),
    ///     }
    /// }
    /// ```
    ///
    /// The worker never kills a handler for these reasons: stopping is up to the handler.
    /// (Its timeout, [`HandlerOptions::timeout`], does stop it.)
    pub async fn cancelled(&self) -> CancelReason {
        let mut stop = self.stop.clone();
        loop {
            if let Some(reason) = *stop.borrow_and_update() {
                return reason;
            }
            if stop.changed().await.is_err() {
                // The worker is gone without a verdict: nothing will ever be sent.
                return std::future::pending().await;
            }
        }
    }

    /// The reason this run was asked to stop, if it was ([`Context::cancelled`]).
    pub fn cancel_reason(&self) -> Option<CancelReason> {
        *self.stop.borrow()
    }

    /// The row id.
    pub fn id(&self) -> i64 {
        self.id
    }

    /// The queue.
    pub fn queue(&self) -> &str {
        &self.queue
    }

    /// The timer key, for keyed timers.
    pub fn timer_id(&self) -> Option<&str> {
        self.timer_id.as_deref()
    }

    /// The message headers.
    pub fn headers(&self) -> Option<&Headers> {
        self.headers.as_ref()
    }

    /// This run's attempt number: 1 + the failed runs before it.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// This run's delivery number: claims so far, this one included (a redelivery after
    /// a lost lease counts).
    pub fn delivery(&self) -> u32 {
        self.delivery
    }

    /// The deadline the row was due at.
    pub fn deadline(&self) -> DateTime<Utc> {
        self.deadline
    }

    /// When this run's lease was taken (database clock).
    pub fn claimed_at(&self) -> DateTime<Utc> {
        self.claimed_at
    }

    /// When the message was published.
    pub fn created_at(&self) -> DateTime<Utc> {
        self.created_at
    }
}

/// Converts the worker's state `S` into a piece a handler asks for with [`Context::state`];
/// asking for a type the worker's state does not convert into does not compile. Every
/// `Clone` type converts from itself; derive it on a state struct
/// (`#[derive(Clone, outbox::FromRef)]`) to let handlers ask for each field by its type, or
/// implement it by hand.
#[diagnostic::on_unimplemented(
    message = "the worker was not given state of type `{Self}`",
    label = "handlers of this worker can ask only for its state `{S}` or what `{S}` converts into",
    note = "give the worker its state once with `WorkerBuilder::state(...)`: a value of this type, or a struct with a field of this type and `#[derive(Clone, outbox::FromRef)]`",
    note = "the state itself can be asked for by its own type only when it is `Clone`"
)]
pub trait FromRef<S> {
    /// The piece of `state`.
    fn from_ref(state: &S) -> Self;
}

impl<T: Clone> FromRef<T> for T {
    fn from_ref(state: &T) -> Self {
        state.clone()
    }
}

/// How a run ended: the one type every handler's return value converts into
/// ([`IntoOutcome`]). Return it directly, or return `()`, `Result<(), E>` or
/// `Result<Outcome, E>`: `()` and `Ok(())` are [`Outcome::Ack`], `Err(e)` is
/// [`Outcome::Retry`] with `e`'s text.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// Success: the row is deleted (or its queued rearm applied).
    Ack,
    /// A failed run, retried after the delay of the handler's
    /// [`RetryStrategy`](crate::RetryStrategy) (terminal, reason `retry_exhausted`, when the
    /// strategy allows no more). The text is logged with the retry, and stored as
    /// `last_error` of the dead letter when the run ends terminally.
    Retry(String),
    /// A failed run, tried again after this delay (database clock, capped at
    /// [`MAX_RETRY_DELAY`](crate::worker::MAX_RETRY_DELAY)) instead of the strategy's;
    /// `max_attempts` of the strategy still applies.
    RetryAfter(Duration),
    /// Terminal failure now, reason `rejected`, with this error text.
    Reject(String),
}

/// What a handler's return value means: converts into [`Outcome`]. Implemented for `()`,
/// [`Outcome`], and `Result<T, E>` where `T: IntoOutcome` and `E: Display` (an error is
/// [`Outcome::Retry`] with its text).
pub trait IntoOutcome: Send {
    /// The outcome.
    fn into_outcome(self) -> Outcome;
}

impl IntoOutcome for () {
    fn into_outcome(self) -> Outcome {
        Outcome::Ack
    }
}

impl IntoOutcome for Outcome {
    fn into_outcome(self) -> Outcome {
        self
    }
}

impl<T: IntoOutcome, E: Display + Send> IntoOutcome for Result<T, E> {
    fn into_outcome(self) -> Outcome {
        match self {
            Ok(t) => t.into_outcome(),
            Err(e) => Outcome::Retry(e.to_string()),
        }
    }
}

/// An async function of a payload `T` and a [`Context`]: `async fn(T, Context<St>) -> R`
/// where `R: IntoOutcome`, or a closure of that shape. For typed timers `T` is the
/// `#[timer]` struct; for raw queues it is `Vec<u8>`. `St` is the worker's state (`()`
/// unless given with [`WorkerBuilder::state`](crate::WorkerBuilder::state)).
pub trait Handler<T, St = ()>: Send + Sync + 'static {
    /// Runs the handler.
    fn call(&self, payload: T, ctx: Context<St>) -> BoxFuture<'static, Outcome>;
}

impl<T, St, F, Fut> Handler<T, St> for F
where
    F: Fn(T, Context<St>) -> Fut + Send + Sync + 'static,
    Fut: Future + Send + 'static,
    Fut::Output: IntoOutcome,
{
    fn call(&self, payload: T, ctx: Context<St>) -> BoxFuture<'static, Outcome> {
        let fut = self(payload, ctx);
        Box::pin(async move { fut.await.into_outcome() })
    }
}

/// Per-handler settings: retry strategy, timeout and, for raw queues, `max_deliveries`.
#[derive(Debug, Clone, Copy, PartialEq)]
#[must_use = "HandlerOptions apply only once given to `WorkerBuilder::timer_with` or `queue_with`"]
pub struct HandlerOptions {
    pub(crate) retry: RetryStrategy,
    pub(crate) max_deliveries: Option<u32>,
    pub(crate) timeout: Option<Duration>,
    pub(crate) max_concurrency: Option<usize>,
}

/// How long a handler may run before it is stopped, unless set otherwise
/// ([`HandlerOptions::timeout`]): 5 minutes.
pub const DEFAULT_HANDLER_TIMEOUT: Duration = Duration::from_secs(5 * 60);

impl Default for HandlerOptions {
    fn default() -> Self {
        HandlerOptions {
            retry: RetryStrategy::default(),
            max_deliveries: None,
            timeout: Some(DEFAULT_HANDLER_TIMEOUT),
            max_concurrency: None,
        }
    }
}

/// `max_deliveries` of raw queues when none is set: 10.
pub const DEFAULT_MAX_DELIVERIES: u32 = 10;

impl HandlerOptions {
    /// Defaults: [`RetryStrategy::default`], `max_deliveries` from the timer (raw queues:
    /// [`DEFAULT_MAX_DELIVERIES`]).
    pub fn new() -> Self {
        Self::default()
    }

    /// The retry strategy for handler errors.
    pub fn retry(mut self, retry: RetryStrategy) -> Self {
        self.retry = retry;
        self
    }

    /// Claims allowed before the row is terminal (`max_deliveries`), overriding the
    /// timer's `MAX_DELIVERIES`.
    ///
    /// It counts claims, not failures: a claim a crash or a lost lease interrupted counts
    /// too. The check is made at the claim: a row claimed for the `max + 1`-th time is
    /// failed with reason `max_deliveries` without running its handler. So a handler that
    /// fails on the `max`-th delivery still gets the retry its strategy gives, and the row
    /// becomes a dead letter at the claim after that retry's delay. To end sooner, bound the
    /// retries themselves (`RetryStrategy`'s `max_attempts`: reason `retry_exhausted`).
    pub fn max_deliveries(mut self, max: u32) -> Self {
        self.max_deliveries = Some(max);
        self
    }

    /// How long one run may take (default [`DEFAULT_HANDLER_TIMEOUT`], 5 minutes; range
    /// 1 ms..=7 days, checked by the worker's `build()`). A run that takes longer is
    /// stopped — its future is dropped — and counts as a failed run: retried per strategy,
    /// and terminal with reason `timeout` when no retry is left; a warning names the row and
    /// the handler. Dropping a future stops only code that yields to the runtime (`.await`):
    /// blocking code in a handler must bound its own time. Leases are renewed while a
    /// handler runs, so a long timeout never lets a second worker run the row meanwhile.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// The most rows of this queue the worker holds at once, running or claimed and waiting
    /// for a slot (default: no limit of its own, only the worker's `concurrency`; range
    /// 1..=10 000, checked by the worker's `build()`). A worker serving several queues
    /// keeps slots free for the others this way: with `concurrency(8)` and a slow queue
    /// limited to 4, a backlog of that queue never runs more than 4 at once, and the other
    /// queues' rows are claimed and run on the remaining slots as they fall due. The claim
    /// takes at most the free part of the limit from that queue (a queue with none free is
    /// left out of the claim), so rows beyond it stay unleased in the table for other
    /// workers; with several workers the limit is per worker.
    pub fn max_concurrency(mut self, n: usize) -> Self {
        self.max_concurrency = Some(n);
        self
    }

    /// No timeout: a hung handler holds its slot (and its row's lease) until the worker
    /// stops. Use only for handlers that bound their own time.
    pub fn no_timeout(mut self) -> Self {
        self.timeout = None;
        self
    }
}
