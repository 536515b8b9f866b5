//! The typed layer's runtime side: the [`Timer`] trait, the [`Publisher`] trait that typed
//! functions publish through, and the typed publish / extend / cancel helpers.

use std::future::Future;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;
use sqlx::pool::PoolConnection;
use sqlx::{PgConnection, PgPool, Postgres, Transaction};

use crate::cancel::Cancelled;
use crate::error::{explain, Error, Result};
use crate::outbox::{Bound, Outbox};
use crate::periodic::Recurrence;
use crate::publish::{validate_queue, validate_timer_id, Message, OnConflict, Published, Schedule};

/// A typed timer payload bound to a queue.
///
/// `#[outbox::timer(queue = "...", max_deliveries = N)]` implements it; implementing it by
/// hand is equivalent:
///
/// ```
/// #[derive(serde::Serialize, serde::Deserialize)]
/// struct PresenceExpiry { user_id: i64 }
///
/// impl outbox::Timer for PresenceExpiry {
///     const QUEUE: &'static str = "presence.expiry";
///     const MAX_DELIVERIES: u32 = 5;
/// }
/// ```
///
/// Payloads are stored as JSON (serde_json). A stored payload that does not decode into
/// the type is a terminal failure with reason `decode_error` when a worker claims it.
pub trait Timer: Serialize + DeserializeOwned + Send + Sync + 'static {
    /// The queue this timer's rows live in (1..=255 bytes, `[A-Za-z0-9._:-]` when set by
    /// the macro).
    const QUEUE: &'static str;
    /// How many claims a row may have: a claim that brings its `deliveries_count` past this
    /// is a terminal failure with reason `max_deliveries`, and the handler does not run (a
    /// queued rearm still applies). Reclaims after a lost lease count too, so it also stops
    /// a payload that crashes its worker every time. At least 1.
    const MAX_DELIVERIES: u32;

    /// Encodes the payload as stored (JSON), and checks that it decodes back into `Self`:
    /// a value whose JSON does not (a `NaN` or infinite float, which JSON writes as `null`;
    /// a hand-written `Serialize` that does not match its `Deserialize`) would be accepted
    /// now and then fail as `decode_error` when its worker claims it, so it is refused
    /// here, before any SQL runs.
    ///
    /// # Errors
    /// [`Error::Encode`] if serde_json refuses the value (for example a map with
    /// non-string keys) or its JSON does not decode back into the type.
    fn encode(&self) -> Result<Vec<u8>> {
        let bytes = serde_json::to_vec(self).map_err(Error::Encode)?;
        Self::decode(&bytes).map_err(Error::Encode)?;
        Ok(bytes)
    }

    /// Decodes a stored payload.
    ///
    /// # Errors
    /// The serde_json error when the bytes are not this type's JSON.
    fn decode(bytes: &[u8]) -> std::result::Result<Self, serde_json::Error> {
        serde_json::from_slice(bytes)
    }

    /// The schedule declared on the type, `None` by default. `#[outbox::timer(...,
    /// every = "5m")]` or `#[outbox::timer(..., cron = "0 0 6 * * *", tz = "Europe/Berlin")]`
    /// implements it as `Some((recurrence, Self::default()))`: the recurrence, and the
    /// payload every run of the schedule gets.
    ///
    /// Every worker with a handler for the type ([`WorkerBuilder::timer`]) registers it when
    /// it starts, as [`WorkerBuilder::schedule`] would under the name
    /// [`DECLARED_SCHEDULE_NAME`] (`"default"`): the keyed timer `schedule:default` of the
    /// type's queue, with the rules listed there (one live row per schedule, the next
    /// instant queued when a run starts, missed instants fire once).
    ///
    /// An `Err` recurrence (possible only in a hand-written impl: the attribute checks the
    /// expression at compile time) makes [`WorkerBuilder::build`] fail with
    /// [`Error::InvalidArgument`] (`field` `"schedule"`).
    ///
    /// [`WorkerBuilder::timer`]: crate::WorkerBuilder::timer
    /// [`WorkerBuilder::schedule`]: crate::WorkerBuilder::schedule
    /// [`WorkerBuilder::build`]: crate::WorkerBuilder::build
    /// [`DECLARED_SCHEDULE_NAME`]: crate::periodic::DECLARED_SCHEDULE_NAME
    fn declared_schedule() -> Option<(Result<Recurrence>, Self)> {
        None
    }
}

/// Something typed functions publish and cancel through, passed by value:
///
/// | pass | publishes into | transactional |
/// |---|---|---|
/// | `&mut *tx` (a `&mut PgConnection` from a `sqlx::Transaction`) or `&mut tx` | [`Outbox::global`]'s tables | yes: the row exists only if `tx` commits |
/// | `&mut *conn` or `&mut conn` (a connection from `pool.acquire()`) | [`Outbox::global`]'s tables | no (autocommit) |
/// | `&pool` (a `&PgPool`) | [`Outbox::global`]'s tables, on a pool connection | no (autocommit) |
/// | `outbox.on(&mut *tx)` ([`Outbox::on`]) | that outbox's tables | as the connection it binds |
/// | `&store` ([`PgStore`](crate::PgStore)) | the store's outbox, on its pool | no (autocommit) |
/// | `&store` ([`MemoryStore`](crate::testing::MemoryStore)) | the in-memory store | each call atomic |
///
/// Publishing in the same transaction as your domain writes is the point of an outbox:
/// prefer `&mut *tx`. With the autocommit forms a publish commits on its own, even if your
/// other writes later roll back. Without a transaction, a cancel runs its lock-then-write in
/// a short transaction of its own (pool and store forms) or repeats the write's expected
/// state on the bare connection, so it is safe either way.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not something outbox can publish through",
    label = "expected a connection, a transaction, a pool or a store",
    note = "pass your transaction as `&mut *tx`, a pooled connection from `pool.acquire()` as `&mut *conn`, `&pool` (autocommit, not transactional), `outbox.on(&mut *tx)` for another outbox, or `&store`",
    note = "outbox takes sqlx 0.9 types: with another sqlx in your dependencies, `&mut *tx` is a different type (check `cargo tree -i sqlx`)"
)]
pub trait Publisher: Send {
    /// Publishes one message.
    fn publish_message<'m>(
        self,
        message: Message<'m>,
    ) -> impl Future<Output = Result<Published>> + Send;

    /// Cancels a timer: locks its row (`SELECT … FOR UPDATE`), then deletes a pending row, or
    /// marks a running one cancelled and drops its queued rearm (see
    /// [`Cancelled`]).
    fn cancel_timer(
        self,
        queue: &str,
        timer_id: &str,
    ) -> impl Future<Output = Result<Cancelled>> + Send;
}

/// Connections and transactions publish into [`Outbox::global`]'s tables, on themselves.
macro_rules! publish_via_global {
    ($($conn:ty),*) => {$(
        impl Publisher for $conn {
            fn publish_message<'m>(
                self,
                message: Message<'m>,
            ) -> impl Future<Output = Result<Published>> + Send {
                Outbox::global().publish(self, message)
            }

            fn cancel_timer(
                self,
                queue: &str,
                timer_id: &str,
            ) -> impl Future<Output = Result<Cancelled>> + Send {
                Outbox::global().cancel(self, queue, timer_id)
            }
        }
    )*};
}

publish_via_global!(
    &mut PgConnection,
    &mut PoolConnection<Postgres>,
    &mut Transaction<'_, Postgres>
);

impl Publisher for &PgPool {
    fn publish_message<'m>(
        self,
        message: Message<'m>,
    ) -> impl Future<Output = Result<Published>> + Send {
        publish_autocommit(self, Outbox::global(), message)
    }

    fn cancel_timer(
        self,
        queue: &str,
        timer_id: &str,
    ) -> impl Future<Output = Result<Cancelled>> + Send {
        cancel_in_own_transaction(self, Outbox::global(), queue, timer_id)
    }
}

impl Publisher for Bound<'_> {
    fn publish_message<'m>(
        self,
        message: Message<'m>,
    ) -> impl Future<Output = Result<Published>> + Send {
        self.outbox.publish(self.conn, message)
    }

    fn cancel_timer(
        self,
        queue: &str,
        timer_id: &str,
    ) -> impl Future<Output = Result<Cancelled>> + Send {
        self.outbox.cancel(self.conn, queue, timer_id)
    }
}

/// So a `Bound` can be used for several calls: `&mut bound` each time.
impl Publisher for &mut Bound<'_> {
    fn publish_message<'m>(
        self,
        message: Message<'m>,
    ) -> impl Future<Output = Result<Published>> + Send {
        self.outbox.on(self.conn).publish_message(message)
    }

    fn cancel_timer(
        self,
        queue: &str,
        timer_id: &str,
    ) -> impl Future<Output = Result<Cancelled>> + Send {
        self.outbox.on(self.conn).cancel_timer(queue, timer_id)
    }
}

/// A publish on a pool connection, outside any transaction (the `&pool` and `&store` forms).
/// The message is checked before a connection is taken, so bad input never waits for one.
pub(crate) async fn publish_autocommit(
    pool: &PgPool,
    outbox: &Outbox,
    message: Message<'_>,
) -> Result<Published> {
    message.validate()?;
    let mut conn = match pool.acquire().await {
        Ok(c) => c,
        Err(e) => return Err(explain(pool, e.into()).await),
    };
    outbox.publish(&mut conn, message).await
}

/// A cancel in a short transaction of its own, so its lock-then-write holds the row lock
/// from the look to the write (the `&pool` and `&store` forms).
pub(crate) async fn cancel_in_own_transaction(
    pool: &PgPool,
    outbox: &Outbox,
    queue: &str,
    timer_id: &str,
) -> Result<Cancelled> {
    validate_queue(queue)?;
    validate_timer_id(timer_id)?;
    let mut tx = match pool.begin().await {
        Ok(tx) => tx,
        Err(e) => return Err(explain(pool, e.into()).await),
    };
    let out = outbox.cancel(&mut tx, queue, timer_id).await?;
    tx.commit().await?;
    Ok(out)
}

/// Schedules the timer `(T::QUEUE, timer_id)` with `payload`; if a live row holds the key,
/// nothing changes ([`Published::Skipped`]). What `publish_<snake>` generated by
/// `#[timer]` calls.
///
/// # Errors
/// [`Error::Encode`], [`Error::InvalidArgument`] (before any SQL), [`Error::Database`].
pub async fn publish_timer<T: Timer>(
    conn: impl Publisher,
    timer_id: &str,
    payload: &T,
    schedule: impl Into<Schedule>,
) -> Result<Published> {
    send_timer(conn, timer_id, payload, schedule.into(), OnConflict::Ignore).await
}

/// Schedules or extends the timer `(T::QUEUE, timer_id)`: inserts it
/// ([`Published::Inserted`]); moves a pending timer's deadline later, replacing its payload
/// and resetting its retry history ([`Published::Extended`]); or, when its handler is
/// running, queues a rearm that makes it fire again at the new deadline with this payload
/// once the run ends ([`Published::RearmQueued`]). A deadline that is not later than the
/// timer's (or than its queued rearm's) changes nothing ([`Published::Unchanged`]): a timer
/// never moves earlier. What `extend_<snake>` generated by `#[timer]` calls.
///
/// # Errors
/// As [`publish_timer`].
pub async fn extend_timer<T: Timer>(
    conn: impl Publisher,
    timer_id: &str,
    payload: &T,
    schedule: impl Into<Schedule>,
) -> Result<Published> {
    send_timer(conn, timer_id, payload, schedule.into(), OnConflict::Extend).await
}

/// [`extend_timer`] with a slack: a move of a pending timer's deadline (or of a queued
/// rearm's) by `slack` or less writes nothing and returns [`Published::Unchanged`], so a
/// timer extended on every request writes its row about once per `slack`. The timer may
/// then fire up to `slack` **earlier** than this extend asked: its handler must re-check
/// the activity it stands for and extend the timer again to the real deadline instead of
/// acting (the full rules: [`Message::slack`]). What `extend_<snake>_with_slack` generated
/// by `#[timer]` calls.
///
/// # Errors
/// As [`publish_timer`]; a `slack` over [`MAX_SLACK`](crate::message::MAX_SLACK) is
/// [`Error::InvalidArgument`] (`field = "slack"`) before any SQL runs.
pub async fn extend_timer_with_slack<T: Timer>(
    conn: impl Publisher,
    timer_id: &str,
    payload: &T,
    schedule: impl Into<Schedule>,
    slack: Duration,
) -> Result<Published> {
    let bytes = payload.encode()?;
    let message = Message::new(T::QUEUE, &bytes)
        .timer_id(timer_id)
        .schedule(schedule)
        .on_conflict(OnConflict::Extend)
        .slack(slack);
    conn.publish_message(message).await
}

/// Cancels the timer `(T::QUEUE, timer_id)`: a pending timer is deleted; a running one is
/// never deleted but marked, so its row is deleted however the run ends (no retry, no
/// rearm, no dead letter) unless a later extend re-arms it; see [`Cancelled`]. What
/// `cancel_<snake>` calls.
///
/// # Errors
/// [`Error::InvalidArgument`] (before any SQL), [`Error::Database`].
pub async fn cancel_timer<T: Timer>(conn: impl Publisher, timer_id: &str) -> Result<Cancelled> {
    conn.cancel_timer(T::QUEUE, timer_id).await
}

async fn send_timer<T: Timer>(
    conn: impl Publisher,
    timer_id: &str,
    payload: &T,
    schedule: Schedule,
    on_conflict: OnConflict,
) -> Result<Published> {
    let bytes = payload.encode()?;
    let message = Message::new(T::QUEUE, &bytes)
        .timer_id(timer_id)
        .schedule(schedule)
        .on_conflict(on_conflict);
    conn.publish_message(message).await
}
