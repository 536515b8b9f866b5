//! The message a caller publishes (the envelope around a payload: queue, headers, schedule,
//! timer key) and what publishing it did. Both have their one path at the crate root
//! (`outbox::Message`, `outbox::Published`), so they are defined here rather than in
//! `message/mod.rs`, whose items are `outbox::message::…`.

use std::time::Duration;

use super::schedule::Resolved;
use super::{
    validate_headers, validate_payload, validate_queue, validate_timer_id, Headers, OnConflict,
    Schedule, MAX_SLACK,
};
use crate::error::{Error, Result};
use crate::sql;

/// One message to publish: a queue (1..=255 bytes, no NUL), a payload (at most
/// [`MAX_PAYLOAD_BYTES`]) and options: headers (at most [`MAX_HEADERS_BYTES`], no NUL), a
/// [`Schedule`], a timer key (1..=255 bytes, no NUL) and what to do when that key is taken.
/// Every rule is checked before any SQL runs; a broken one is [`Error::InvalidArgument`]
/// naming the field, and nothing is written.
///
/// ```
/// use std::time::Duration;
/// use outbox::{Message, message::OnConflict};
/// let msg = Message::new("presence.expiry", br#"{"user_id":7}"#)
///     .timer_id("7")
///     .schedule(Duration::from_secs(30))
///     .on_conflict(OnConflict::Extend);
/// ```
///
/// [`MAX_PAYLOAD_BYTES`]: crate::message::MAX_PAYLOAD_BYTES
/// [`MAX_HEADERS_BYTES`]: crate::message::MAX_HEADERS_BYTES
#[derive(Debug, Clone, Copy)]
#[must_use = "a Message is written only by `Outbox::publish` (or a `publish_*`/`extend_*` function)"]
pub struct Message<'a> {
    pub(crate) queue: &'a str,
    pub(crate) payload: &'a [u8],
    pub(crate) headers: Option<&'a Headers>,
    pub(crate) schedule: Schedule,
    pub(crate) timer_id: Option<&'a str>,
    pub(crate) on_conflict: OnConflict,
    pub(crate) slack: Duration,
    pub(crate) shard_key: Option<&'a str>,
}

impl<'a> Message<'a> {
    /// A message for `queue` carrying `payload`, due now, no timer key.
    pub fn new(queue: &'a str, payload: &'a [u8]) -> Self {
        Message {
            queue,
            payload,
            headers: None,
            schedule: Schedule::now(),
            timer_id: None,
            on_conflict: OnConflict::Ignore,
            slack: Duration::ZERO,
            shard_key: None,
        }
    }

    /// In a [distributed](crate::OutboxBuilder::distributed) outbox, puts a plain message
    /// in the bucket of `key` ([`Outbox::bucket_of`](crate::Outbox::bucket_of)), beside the
    /// application's co-located rows of the same entity, so the publish and the
    /// application's write stay on one node. Without it a plain message takes the next
    /// bucket in round robin. A keyed timer always lives in the bucket of its `timer_id`
    /// (one live row per key across the cluster), so the shard key of a message with a
    /// [`timer_id`](Self::timer_id) is not used. Ignored by a single-node outbox.
    pub fn shard_key(mut self, key: &'a str) -> Self {
        self.shard_key = Some(key);
        self
    }

    /// Attaches headers.
    pub fn headers(mut self, headers: &'a Headers) -> Self {
        self.headers = Some(headers);
        self
    }

    /// Sets the deadline (default: now).
    pub fn schedule(mut self, schedule: impl Into<Schedule>) -> Self {
        self.schedule = schedule.into();
        self
    }

    /// Makes this a keyed timer: at most one live row per `(queue, timer_id)`. 1..=255
    /// bytes without NUL, and not starting with `schedule:`, the key space of periodic
    /// timers ([`SCHEDULE_KEY_PREFIX`](crate::store::SCHEDULE_KEY_PREFIX)); anything else is
    /// [`Error::InvalidArgument`] (`field = "timer_id"`) when the message is published.
    pub fn timer_id(mut self, timer_id: &'a str) -> Self {
        self.timer_id = Some(timer_id);
        self
    }

    /// What to do when the timer key is taken (needs [`Message::timer_id`]).
    pub fn on_conflict(mut self, on_conflict: OnConflict) -> Self {
        self.on_conflict = on_conflict;
        self
    }

    /// An [`OnConflict::Extend`] that would move a **pending** timer's deadline later by
    /// `slack` or less writes nothing and returns [`Published::Unchanged`] (default:
    /// zero, so every later deadline is written).
    ///
    /// A timer extended on every request (a presence ping, a session touch) otherwise
    /// writes a new version of its row each time; with a slack it writes at most about
    /// once per `slack` while the requests keep coming, and Postgres keeps fewer dead row
    /// versions and index entries to clean up.
    ///
    /// **The contract you accept**: the timer may fire up to `slack` **earlier** than the
    /// latest extend asked (it fires at the deadline last written). Its handler must
    /// re-check the activity the timer stands for (for example `last_seen + timeout` in
    /// the same transaction as its decision) and, when the deadline has not really passed,
    /// extend the timer again to the real deadline (`Schedule::at(last_seen + timeout)`)
    /// instead of acting. A timer never fires later than asked and never moves earlier.
    ///
    /// Which deadline the slack is measured from:
    /// - pending row: its deadline; written when `new > deadline + slack`;
    /// - running row (handler leased it) without a queued rearm: the slack does **not**
    ///   apply: any deadline later than the one the run was claimed for queues a rearm
    ///   (the run's completion would otherwise delete the row, and a handler that already
    ///   decided could not see the newer activity);
    /// - running row with a queued rearm: the rearm's deadline; moved when
    ///   `new > rearm + slack` (the rearm fires, up to `slack` early, as a pending timer
    ///   would).
    ///
    /// The comparison runs in the database on `timestamptz` values (microseconds).
    /// `slack` needs [`OnConflict::Extend`]; more than [`MAX_SLACK`] or a slack without
    /// `Extend` is [`Error::InvalidArgument`] (`field = "slack"`) before any SQL runs.
    ///
    /// ```
    /// use std::time::Duration;
    /// use outbox::{Message, message::OnConflict};
    /// let msg = Message::new("presence.expiry", br#"{"user_id":7}"#)
    ///     .timer_id("7")
    ///     .schedule(Duration::from_secs(30))
    ///     .on_conflict(OnConflict::Extend)
    ///     .slack(Duration::from_secs(10));
    /// ```
    pub fn slack(mut self, slack: Duration) -> Self {
        self.slack = slack;
        self
    }

    /// Checks every argument rule (names, `Extend` needs a timer id, slack, payload and
    /// header sizes, schedule); nothing has touched the database yet.
    pub(crate) fn validate(&self) -> Result<Resolved> {
        validate_queue(self.queue)?;
        if let Some(id) = self.timer_id {
            validate_timer_id(id)?;
            if id.starts_with(sql::periodic::SCHEDULE_KEY_PREFIX) {
                return Err(Error::invalid(
                    "timer_id",
                    format!(
                        "{id:?}: keys starting with `{}` are reserved for periodic timers \
                         (WorkerBuilder::schedule registers them); to move one run of a schedule, \
                         reschedule its row by id",
                        sql::periodic::SCHEDULE_KEY_PREFIX
                    ),
                ));
            }
        } else if self.on_conflict == OnConflict::Extend {
            return Err(Error::invalid(
                "on_conflict",
                "`Extend` needs a `timer_id`: only keyed timers can be extended",
            ));
        }
        if !self.slack.is_zero() && self.on_conflict != OnConflict::Extend {
            return Err(Error::invalid(
                "slack",
                "a slack needs `OnConflict::Extend`: only an extend can skip a small move",
            ));
        }
        if self.slack > MAX_SLACK {
            return Err(Error::invalid(
                "slack",
                "is longer than 10 000 years of 366 days (overflow)",
            ));
        }
        validate_payload(self.payload)?;
        if let Some(h) = self.headers {
            validate_headers(h)?;
        }
        self.schedule.resolve()
    }
}

/// What a publish did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Published {
    /// A new row was inserted.
    Inserted {
        /// The new row's id.
        id: i64,
    },
    /// [`OnConflict::Ignore`] and a live row holds the timer key; nothing changed.
    Skipped,
    /// [`OnConflict::Extend`] hit a pending row and moved its deadline later, replacing its
    /// payload and headers and resetting its retry history (`attempts_count` 0). A row
    /// waiting for a retry is pending too.
    Extended {
        /// The extended row.
        id: i64,
    },
    /// [`OnConflict::Extend`] hit a row whose handler is running (leased) and queued a
    /// rearm, or moved the queued rearm later. The running handler's lease, deadline and
    /// payload are left alone; the timer fires again at the new deadline, with the new
    /// payload, once the run ends (whether it succeeds, fails or is retried).
    RearmQueued {
        /// The running row.
        id: i64,
    },
    /// [`OnConflict::Extend`] whose deadline is not later than what the live row already
    /// holds (its deadline, or for a running row the later of its claimed deadline and its
    /// queued rearm), or not later by more than the extend's [`Message::slack`]. Nothing
    /// changed: a late, out-of-order extend never shortens a timer. With a slack the timer
    /// may fire up to the slack before this extend's deadline (see [`Message::slack`]).
    Unchanged,
}

impl Published {
    /// The affected row's id, when a row was written.
    pub fn id(&self) -> Option<i64> {
        match *self {
            Published::Inserted { id }
            | Published::Extended { id }
            | Published::RearmQueued { id } => Some(id),
            Published::Skipped | Published::Unchanged => None,
        }
    }
}
