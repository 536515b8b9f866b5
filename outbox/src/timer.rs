//! The typed layer's runtime side (SPEC §9): the [`Timer`] trait, the [`Publisher`] trait
//! that typed functions publish through, and the typed publish / extend / cancel helpers.

use std::future::Future;

use serde::de::DeserializeOwned;
use serde::Serialize;
use sqlx::pool::PoolConnection;
use sqlx::{PgConnection, Postgres, Transaction};

use crate::cancel::Cancelled;
use crate::error::{Error, Result};
use crate::publish::{Message, OnConflict, Published, Schedule};
use crate::schema::Outbox;

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
    /// How many claims a row may have before it is a terminal failure with reason
    /// `max_deliveries`, checked before the handler runs (SPEC §6). At least 1.
    const MAX_DELIVERIES: u32;

    /// Encodes the payload as stored (JSON).
    ///
    /// # Errors
    /// [`Error::Encode`] if serde_json refuses the value (for example a map with non-string keys).
    fn encode(&self) -> Result<Vec<u8>> {
        serde_json::to_vec(self).map_err(Error::Encode)
    }

    /// Decodes a stored payload.
    ///
    /// # Errors
    /// The serde_json error when the bytes are not this type's JSON.
    fn decode(bytes: &[u8]) -> std::result::Result<Self, serde_json::Error> {
        serde_json::from_slice(bytes)
    }
}

/// Something typed functions can publish and cancel through: a Postgres connection or
/// transaction (using [`Outbox::global`]'s tables), an [`Outbox`] bound to a connection
/// ([`Outbox::on`]), or the in-memory store of [`crate::testing`].
///
/// Pass a sqlx transaction as `&mut *tx` (a `&mut PgConnection`) or as `&mut tx`.
pub trait Publisher: Send {
    /// Publishes one message.
    fn publish_message<'a>(
        &'a mut self,
        message: Message<'a>,
    ) -> impl Future<Output = Result<Published>> + Send + 'a;

    /// Cancels a timer (SPEC §3).
    fn cancel_timer<'a>(
        &'a mut self,
        queue: &'a str,
        timer_id: &'a str,
    ) -> impl Future<Output = Result<Cancelled>> + Send + 'a;
}

/// Connections and transactions publish into [`Outbox::global`]'s tables.
macro_rules! publish_via_global {
    ($($conn:ty),*) => {$(
        impl Publisher for $conn {
            fn publish_message<'a>(
                &'a mut self,
                message: Message<'a>,
            ) -> impl Future<Output = Result<Published>> + Send + 'a {
                Outbox::global().publish(self, message)
            }

            fn cancel_timer<'a>(
                &'a mut self,
                queue: &'a str,
                timer_id: &'a str,
            ) -> impl Future<Output = Result<Cancelled>> + Send + 'a {
                Outbox::global().cancel(self, queue, timer_id)
            }
        }
    )*};
}

publish_via_global!(
    PgConnection,
    PoolConnection<Postgres>,
    Transaction<'_, Postgres>
);

/// An [`Outbox`] bound to a connection or transaction, so typed functions publish into
/// its tables instead of [`Outbox::global`]'s. Made by [`Outbox::on`].
#[derive(Debug)]
pub struct Bound<'c> {
    outbox: &'c Outbox,
    conn: &'c mut PgConnection,
}

impl Outbox {
    /// Binds this outbox to a connection or transaction (`&mut *tx`) for the typed
    /// functions:
    ///
    /// ```no_run
    /// # async fn f(pool: sqlx::PgPool, outbox: outbox::Outbox) -> Result<(), outbox::Error> {
    /// # #[derive(serde::Serialize, serde::Deserialize)] struct Ping;
    /// # impl outbox::Timer for Ping { const QUEUE: &'static str = "ping"; const MAX_DELIVERIES: u32 = 3; }
    /// let mut tx = pool.begin().await?;
    /// outbox::publish_timer(&mut outbox.on(&mut tx), "id-1", &Ping, std::time::Duration::from_secs(5)).await?;
    /// tx.commit().await?;
    /// # Ok(()) }
    /// ```
    pub fn on<'c>(&'c self, conn: &'c mut PgConnection) -> Bound<'c> {
        Bound { outbox: self, conn }
    }
}

impl Publisher for Bound<'_> {
    fn publish_message<'a>(
        &'a mut self,
        message: Message<'a>,
    ) -> impl Future<Output = Result<Published>> + Send + 'a {
        self.outbox.publish(self.conn, message)
    }

    fn cancel_timer<'a>(
        &'a mut self,
        queue: &'a str,
        timer_id: &'a str,
    ) -> impl Future<Output = Result<Cancelled>> + Send + 'a {
        self.outbox.cancel(self.conn, queue, timer_id)
    }
}

/// Schedules the timer `(T::QUEUE, timer_id)` with `payload`; if a live row holds the key,
/// nothing changes ([`Published::Skipped`]). What `publish_<snake>` generated by
/// `#[timer]` calls.
///
/// # Errors
/// [`Error::Encode`], [`Error::InvalidArgument`] (before any SQL), [`Error::Database`].
pub async fn publish_timer<T: Timer, P: Publisher + ?Sized>(
    conn: &mut P,
    timer_id: &str,
    payload: &T,
    schedule: impl Into<Schedule>,
) -> Result<Published> {
    send_timer(conn, timer_id, payload, schedule.into(), OnConflict::Ignore).await
}

/// Schedules or extends the timer `(T::QUEUE, timer_id)`: inserts it, moves a pending
/// timer's deadline later (SPEC §4), or queues a rearm on a running one (SPEC §5). What
/// `extend_<snake>` generated by `#[timer]` calls.
///
/// # Errors
/// As [`publish_timer`].
pub async fn extend_timer<T: Timer, P: Publisher + ?Sized>(
    conn: &mut P,
    timer_id: &str,
    payload: &T,
    schedule: impl Into<Schedule>,
) -> Result<Published> {
    send_timer(conn, timer_id, payload, schedule.into(), OnConflict::Extend).await
}

/// Cancels the timer `(T::QUEUE, timer_id)` (SPEC §3). What `cancel_<snake>` calls.
///
/// # Errors
/// [`Error::InvalidArgument`] (before any SQL), [`Error::Database`].
pub async fn cancel_timer<T: Timer, P: Publisher + ?Sized>(
    conn: &mut P,
    timer_id: &str,
) -> Result<Cancelled> {
    conn.cancel_timer(T::QUEUE, timer_id).await
}

async fn send_timer<T: Timer, P: Publisher + ?Sized>(
    conn: &mut P,
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
