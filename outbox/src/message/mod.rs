//! Messages beyond the crate root's [`Message`](crate::Message): schedules, conflict rules,
//! headers, batches, the size limits, and the typed publish/extend/cancel functions that
//! `#[timer]` generates wrappers for.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::schema::shape::MAX_NAME_BYTES;

pub(crate) mod envelope;
pub(crate) mod schedule;
pub(crate) mod typed;

pub use self::schedule::{Schedule, MAX_DELAY};
pub use self::typed::{cancel_timer, extend_timer, extend_timer_with_slack, publish_timer, Bound};

use self::schedule::Resolved;

/// Message headers: a string-to-string map stored as `jsonb` (content type, correlation id,
/// user headers). Keys and values may not contain NUL (`jsonb` cannot store `\u0000`).
pub type Headers = BTreeMap<String, String>;

/// Largest payload, in bytes: 64 MiB.
///
/// Postgres itself stores up to 1 GiB in one `bytea` value, but a statement carrying a value
/// near that size exhausts the server's per-message buffers and resets the connection,
/// losing the caller's whole transaction. 64 MiB travels every path (publish, extend and the
/// rearm it queues, claim, dead-letter archive, `pending`) and leaves room for the rest of
/// the row. A larger payload is [`Error::InvalidArgument`] (`field = "payload"`) before any
/// SQL runs; store bigger objects elsewhere and publish a reference to them.
pub const MAX_PAYLOAD_BYTES: usize = 64 * 1024 * 1024;

/// Largest total size of one [`publish_batch`](crate::Outbox::publish_batch), in bytes:
/// 256 MiB, counting every payload and every header key and value of the batch.
///
/// A batch is one statement: its payloads travel as one array value, and Postgres resets the
/// connection (losing the caller's whole transaction) when a statement's values approach
/// 1 GiB. A larger batch is [`Error::InvalidArgument`] (`field = "items"`) before any SQL
/// runs; split it into several batches in the same transaction.
pub const MAX_BATCH_BYTES: usize = 256 * 1024 * 1024;

/// Largest total size of a message's headers, in bytes: 64 KiB, counting every key and
/// value (UTF-8 bytes; the JSON quoting around them is not counted). More is
/// [`Error::InvalidArgument`] (`field = "headers"`) before any SQL runs.
pub const MAX_HEADERS_BYTES: usize = 64 * 1024;

/// Largest extend slack accepted by [`Message::slack`]: the same bound as [`MAX_DELAY`].
///
/// [`Message::slack`]: crate::Message::slack
pub const MAX_SLACK: Duration = MAX_DELAY;

/// What a publish does when a live row already holds the `(queue, timer_id)` key. A key is
/// unique only among live rows (a partial unique index on `(queue, timer_id)`): once a
/// timer's row is gone (it fired, or was cancelled), the key can be scheduled again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnConflict {
    /// Leave the live row alone → [`Published::Skipped`](crate::Published::Skipped)
    /// (default).
    #[default]
    Ignore,
    /// Move a pending row's deadline later, replacing its payload and headers and resetting
    /// its retry history ([`Published::Extended`]); or, when its handler is running (the row
    /// is leased), queue a **rearm**: a deadline, payload and headers kept beside the
    /// running row and installed when the run ends, so the timer fires again
    /// ([`Published::RearmQueued`]). A deadline not later than the row's (for a running row,
    /// than both its claimed deadline and any queued rearm) changes nothing
    /// ([`Published::Unchanged`]). On Postgres this is one statement: it updates the key's
    /// row (an `UPDATE` waits for the row lock of a claim in flight and then re-evaluates
    /// on the leased row, so an extend racing a claim ends as a rearm, never lost); only
    /// when that writes nothing does it lock the row (`SELECT … FOR UPDATE`) to tell "not
    /// later" from "no row", and insert when there is none. An insert that meets a row of
    /// the key committed meanwhile (two first extends of one key) waits for it (`ON
    /// CONFLICT DO NOTHING`), and the statement runs again and extends that row: one row
    /// per key. (After 16 such rounds in a row, a key created and deleted by others that
    /// often meanwhile, the extend fails with a database error.) An extend of an existing
    /// row consumes no value of the table's identity sequence. Needs a timer id. See
    /// [`Message::slack`] to skip small moves.
    ///
    /// [`Published::Extended`]: crate::Published::Extended
    /// [`Published::RearmQueued`]: crate::Published::RearmQueued
    /// [`Published::Unchanged`]: crate::Published::Unchanged
    /// [`Message::slack`]: crate::Message::slack
    Extend,
}

/// One item of [`Outbox::publish_batch`](crate::Outbox::publish_batch).
#[derive(Debug, Clone, Copy)]
#[must_use = "a BatchItem is written only by `Outbox::publish_batch`"]
pub struct BatchItem<'a> {
    /// The encoded message.
    pub payload: &'a [u8],
    /// Optional headers.
    pub headers: Option<&'a Headers>,
}

impl<'a> BatchItem<'a> {
    /// An item without headers.
    pub fn new(payload: &'a [u8]) -> Self {
        BatchItem {
            payload,
            headers: None,
        }
    }
}

/// A validated slack (at most [`MAX_SLACK`]) as whole microseconds.
pub(crate) fn slack_micros(slack: Duration) -> i64 {
    slack.as_micros().min(MAX_SLACK.as_micros()) as i64
}

fn validate_name(field: &'static str, value: &str) -> Result<()> {
    if value.is_empty() {
        return Err(Error::invalid(field, "must not be empty"));
    }
    if value.len() > MAX_NAME_BYTES {
        return Err(Error::invalid(
            field,
            format!(
                "is {} bytes long; at most {MAX_NAME_BYTES} bytes are allowed",
                value.len()
            ),
        ));
    }
    if value.contains('\0') {
        return Err(Error::invalid(field, "must not contain a NUL byte"));
    }
    Ok(())
}

/// Queue names: 1..=255 bytes, no NUL.
pub(crate) fn validate_queue(queue: &str) -> Result<()> {
    validate_name("queue", queue)
}

/// Timer ids: 1..=255 bytes, no NUL.
pub(crate) fn validate_timer_id(timer_id: &str) -> Result<()> {
    validate_name("timer_id", timer_id)
}

pub(crate) fn validate_payload(payload: &[u8]) -> Result<()> {
    if payload.len() > MAX_PAYLOAD_BYTES {
        return Err(Error::invalid(
            "payload",
            format!(
                "is {} bytes; at most {MAX_PAYLOAD_BYTES} bytes (64 MiB) are allowed",
                payload.len()
            ),
        ));
    }
    Ok(())
}

pub(crate) fn validate_headers(headers: &Headers) -> Result<()> {
    let mut total = 0usize;
    for (k, v) in headers {
        if k.contains('\0') || v.contains('\0') {
            return Err(Error::invalid(
                "headers",
                format!("header `{}` contains a NUL byte", k.replace('\0', "\\0")),
            ));
        }
        total = total.saturating_add(k.len()).saturating_add(v.len());
    }
    if total > MAX_HEADERS_BYTES {
        return Err(Error::invalid(
            "headers",
            format!(
                "keys and values total {total} bytes; at most {MAX_HEADERS_BYTES} bytes (64 KiB) are allowed"
            ),
        ));
    }
    Ok(())
}

/// The checks of a batch, before anything is written: the queue, the schedule, and every
/// item's payload and headers. Both stores run them in this order.
pub(crate) fn validate_batch(
    queue: &str,
    items: &[BatchItem<'_>],
    schedule: Schedule,
) -> Result<Resolved> {
    validate_queue(queue)?;
    let resolved = schedule.resolve()?;
    let mut total = 0usize;
    for item in items {
        validate_payload(item.payload)?;
        total = total.saturating_add(item.payload.len());
        if let Some(h) = item.headers {
            validate_headers(h)?;
            total = h
                .iter()
                .fold(total, |t, (k, v)| t.saturating_add(k.len() + v.len()));
        }
    }
    if total > MAX_BATCH_BYTES {
        return Err(Error::invalid(
            "items",
            format!(
                "the batch holds {total} bytes of payloads and headers; at most \
                 {MAX_BATCH_BYTES} bytes (256 MiB) are allowed in one batch: split it into \
                 several batches (in one transaction they still commit together)"
            ),
        ));
    }
    Ok(resolved)
}
