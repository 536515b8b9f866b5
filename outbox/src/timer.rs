//! The typed layer's runtime side: the [`Timer`] trait, and the [`Publisher`] trait that
//! typed functions publish through, with its implementations for connections, transactions
//! and pools (the functions themselves are `message::typed`'s).

use std::future::Future;

use serde::de::DeserializeOwned;
use serde::Serialize;
use sqlx::pool::PoolConnection;
use sqlx::{PgConnection, PgPool, Postgres, Transaction};

use crate::cancel::Cancelled;
use crate::error::{Error, OutboxSql, Result};
use crate::message::envelope::{Message, Published};
use crate::message::{validate_queue, validate_timer_id};
use crate::outbox::Outbox;
use crate::periodic::Recurrence;
use crate::store::connect::explain;

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
        Err(e) => return Err(explain(pool, Error::from_outbox_statement(e)).await),
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
        Err(e) => return Err(explain(pool, Error::from_outbox_statement(e)).await),
    };
    let out = outbox.cancel(&mut tx, queue, timer_id).await?;
    tx.commit().await.outbox_sql()?;
    Ok(out)
}
