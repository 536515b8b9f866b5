//! Publishing, extending and the argument rules they share.
//!
//! Everything here runs on the **caller's** connection or transaction: the library never
//! begins, commits or rolls back it, so a message exists if and only if the caller's
//! transaction commits (the transactional outbox).

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use chrono::{DateTime, Datelike, TimeDelta, Utc};
use sqlx::postgres::types::PgInterval;
use sqlx::types::Json;
use sqlx::{PgConnection, Row};
use tracing::{Instrument, Span};

use crate::error::{Error, Result};
use crate::sql;
use crate::telemetry;

/// Message headers: a string-to-string map stored as `jsonb` (content type, correlation id,
/// user headers). Keys and values may not contain NUL (`jsonb` cannot store `\u0000`).
pub type Headers = BTreeMap<String, String>;

/// Longest queue name and timer id, in bytes (the columns are `varchar(255)`).
pub const MAX_NAME_BYTES: usize = 255;

/// Largest payload, in bytes: 64 MiB.
///
/// Postgres itself stores up to 1 GiB in one `bytea` value, but a statement carrying a value
/// near that size exhausts the server's per-message buffers and resets the connection,
/// losing the caller's whole transaction. 64 MiB travels every path (publish, extend and the
/// rearm it queues, claim, dead-letter archive, `pending`) and leaves room for the rest of
/// the row. A larger payload is [`Error::InvalidArgument`] (`field = "payload"`) before any
/// SQL runs; store bigger objects elsewhere and publish a reference to them.
pub const MAX_PAYLOAD_BYTES: usize = 64 * 1024 * 1024;

/// Largest total size of a message's headers, in bytes: 64 KiB, counting every key and
/// value (UTF-8 bytes; the JSON quoting around them is not counted). More is
/// [`Error::InvalidArgument`] (`field = "headers"`) before any SQL runs.
pub const MAX_HEADERS_BYTES: usize = 64 * 1024;

/// Longest delay accepted by [`Schedule`]: 10 000 years of 366 days. Anything longer is an overflow in
/// practice and would push the deadline towards the end of Postgres' timestamp range.
pub const MAX_DELAY: Duration = Duration::from_secs(10_000 * 366 * 24 * 3600);

/// When a message becomes visible to workers: its deadline (`next_attempt_at`).
///
/// Build one from a [`std::time::Duration`] or [`chrono::TimeDelta`] (relative to the
/// **database** clock: the deadline is computed server-side as `now() + interval`, so clock
/// skew between application and database cannot shift it), from a
/// `chrono::DateTime<Utc>` or [`SystemTime`] (absolute), or use [`Schedule::now`].
///
/// Negative or overflowing delays (more than [`MAX_DELAY`]) and absolute times outside
/// Postgres' range are rejected with [`Error::InvalidArgument`] (`field = "schedule"`)
/// before any SQL runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Schedule(pub(crate) ScheduleKind);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum ScheduleKind {
    #[default]
    Now,
    /// Microseconds after the database's `now()`; may be negative until validated.
    In(i128),
    At(DateTime<Utc>),
}

impl Schedule {
    /// Due immediately (the default).
    pub fn now() -> Self {
        Schedule(ScheduleKind::Now)
    }

    /// Due `delay` after the database's `now()`.
    pub fn after(delay: Duration) -> Self {
        Schedule(ScheduleKind::In(delay.as_micros() as i128))
    }

    /// Due at an absolute UTC instant.
    pub fn at(at: DateTime<Utc>) -> Self {
        Schedule(ScheduleKind::At(at))
    }

    /// Checks the rules above and returns what the SQL binds: `(interval, absolute)`.
    pub(crate) fn resolve(self) -> Result<Resolved> {
        match self.0 {
            ScheduleKind::Now => Ok(Resolved::In(0)),
            ScheduleKind::In(us) => {
                if us < 0 {
                    return Err(Error::invalid("schedule", "the delay is negative"));
                }
                if us > MAX_DELAY.as_micros() as i128 {
                    return Err(Error::invalid(
                        "schedule",
                        "the delay is longer than 10 000 years of 366 days (overflow)",
                    ));
                }
                Ok(Resolved::In(us as i64))
            }
            ScheduleKind::At(at) => {
                // Postgres' timestamptz spans 4713 BC to 294276 AD; chrono's range is wider
                // at the bottom only.
                if at.year() < -4712 {
                    return Err(Error::invalid(
                        "schedule",
                        "the time is before postgres' earliest timestamp (4713 BC)",
                    ));
                }
                Ok(Resolved::At(at))
            }
        }
    }
}

/// A validated schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Resolved {
    /// Microseconds after now, non-negative.
    In(i64),
    At(DateTime<Utc>),
}

impl Resolved {
    pub(crate) fn binds(self) -> (PgInterval, Option<DateTime<Utc>>) {
        match self {
            Resolved::In(us) => (interval(us), None),
            Resolved::At(at) => (interval(0), Some(at)),
        }
    }
}

/// A validated slack (at most [`MAX_SLACK`]) as whole microseconds.
pub(crate) fn slack_micros(slack: Duration) -> i64 {
    slack.as_micros().min(MAX_SLACK.as_micros()) as i64
}

/// A duration as whole microseconds, for an `interval` parameter.
pub(crate) fn micros(d: Duration) -> Result<i64> {
    i64::try_from(d.as_micros())
        .map_err(|_| Error::invalid("duration", "overflows 64-bit microseconds"))
}

pub(crate) fn interval(microseconds: i64) -> PgInterval {
    PgInterval {
        months: 0,
        days: 0,
        microseconds,
    }
}

impl From<Duration> for Schedule {
    fn from(d: Duration) -> Self {
        Schedule::after(d)
    }
}

impl From<TimeDelta> for Schedule {
    fn from(d: TimeDelta) -> Self {
        // `num_microseconds` is None only beyond ±292 000 years: keep the sign, so a huge
        // negative delay is reported as negative and a huge positive one as an overflow.
        let overflow = if d < TimeDelta::zero() {
            i128::MIN
        } else {
            i128::MAX
        };
        Schedule(ScheduleKind::In(
            d.num_microseconds().map_or(overflow, i128::from),
        ))
    }
}

impl From<DateTime<Utc>> for Schedule {
    fn from(at: DateTime<Utc>) -> Self {
        Schedule::at(at)
    }
}

impl From<SystemTime> for Schedule {
    fn from(at: SystemTime) -> Self {
        Schedule::at(at.into())
    }
}

/// What a publish does when a live row already holds the `(queue, timer_id)` key. A key is
/// unique only among live rows (a partial unique index on `(queue, timer_id)`): once a
/// timer's row is gone (it fired, or was cancelled), the key can be scheduled again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnConflict {
    /// Leave the live row alone → [`Published::Skipped`] (default).
    #[default]
    Ignore,
    /// Move a pending row's deadline later, replacing its payload and headers and resetting
    /// its retry history ([`Published::Extended`]); or, when its handler is running (the row
    /// is leased), queue a **rearm**: a deadline, payload and headers kept beside the
    /// running row and installed when the run ends, so the timer fires again
    /// ([`Published::RearmQueued`]). A deadline not later than the row's (for a running row,
    /// than both its claimed deadline and any queued rearm) changes nothing
    /// ([`Published::Unchanged`]). On Postgres this is one `INSERT … ON CONFLICT DO UPDATE`,
    /// which waits for the row lock of a claim in flight and then sees the leased row, so an
    /// extend racing a claim ends as a rearm, never lost. Needs a timer id. See
    /// [`Message::slack`] to skip small moves.
    Extend,
}

/// Largest extend slack accepted by [`Message::slack`]: the same bound as [`MAX_DELAY`].
pub const MAX_SLACK: Duration = MAX_DELAY;

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
        }
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

/// The `send` span of one message.
pub(crate) fn send_span(message: &Message<'_>) -> Span {
    telemetry::send_span(message.queue, message.timer_id, None)
}

/// Records what a publish did on its `send` span.
pub(crate) fn sent(span: &Span, result: &Result<Published>) {
    match result {
        Ok(published) => {
            if let Some(id) = published.id() {
                span.record("messaging.message.id", id);
            }
            telemetry::outcome(
                span,
                match published {
                    Published::Inserted { .. } => "inserted",
                    Published::Skipped => "skipped",
                    Published::Extended { .. } => "extended",
                    Published::RearmQueued { .. } => "rearm_queued",
                    Published::Unchanged => "unchanged",
                },
            );
        }
        Err(e) => telemetry::error(span, e.variant()),
    }
}

/// The message's headers with the W3C trace context of `span` added (`traceparent`, and
/// `tracestate` when not empty), or `None` to publish the headers as they are: without the
/// feature, without an OpenTelemetry context, when the caller's headers hold a
/// `traceparent` already (theirs win), or when the added context would take the headers
/// past [`MAX_HEADERS_BYTES`] (the publish goes on without it).
pub(crate) fn with_trace_context(span: &Span, headers: Option<&Headers>) -> Option<Headers> {
    if headers.is_some_and(|h| h.contains_key(telemetry::TRACEPARENT_HEADER)) {
        return None;
    }
    add_trace_context(span, headers, telemetry::trace_context(span)?)
}

/// The headers of a batch's items with the trace context of the batch's `send` span added
/// (as [`with_trace_context`] decides for each item); `None` when nothing is added.
pub(crate) fn batch_trace_context(
    span: &Span,
    items: &[BatchItem<'_>],
) -> Option<Vec<Option<Headers>>> {
    if items.is_empty() {
        return None;
    }
    let context = telemetry::trace_context(span)?;
    Some(
        items
            .iter()
            .map(|i| match i.headers {
                Some(h) if h.contains_key(telemetry::TRACEPARENT_HEADER) => None,
                headers => add_trace_context(span, headers, context.clone()),
            })
            .collect(),
    )
}

/// `headers` with `(traceparent, tracestate)` added, unless they would then exceed the
/// limit; a `tracestate` of the caller's stays.
fn add_trace_context(
    span: &Span,
    headers: Option<&Headers>,
    (parent, state): (String, Option<String>),
) -> Option<Headers> {
    let state =
        state.filter(|_| !headers.is_some_and(|h| h.contains_key(telemetry::TRACESTATE_HEADER)));
    let mut total = headers.map_or(0, |h| {
        h.iter().fold(0usize, |n, (k, v)| {
            n.saturating_add(k.len()).saturating_add(v.len())
        })
    });
    total = total
        .saturating_add(telemetry::TRACEPARENT_HEADER.len())
        .saturating_add(parent.len());
    if let Some(state) = &state {
        total = total
            .saturating_add(telemetry::TRACESTATE_HEADER.len())
            .saturating_add(state.len());
    }
    if total > MAX_HEADERS_BYTES {
        span.in_scope(|| {
            tracing::debug!(
                bytes = total,
                limit = MAX_HEADERS_BYTES,
                "outbox: the trace context is not written into the message's headers: with it they would exceed the header limit"
            );
        });
        return None;
    }
    let mut out = headers.cloned().unwrap_or_default();
    out.insert(telemetry::TRACEPARENT_HEADER.to_owned(), parent);
    if let Some(state) = state {
        out.insert(telemetry::TRACESTATE_HEADER.to_owned(), state);
    }
    Some(out)
}

/// `items` with the headers of [`batch_trace_context`] in place of theirs, where it added
/// a context.
pub(crate) fn traced_items<'b>(
    items: &[BatchItem<'b>],
    traced: &'b [Option<Headers>],
) -> Vec<BatchItem<'b>> {
    items
        .iter()
        .zip(traced)
        .map(|(i, t)| BatchItem {
            payload: i.payload,
            headers: t.as_ref().or(i.headers),
        })
        .collect()
}

/// Records what a batch publish did on its `send` span.
pub(crate) fn sent_batch(span: &Span, result: &Result<Vec<i64>>) {
    match result {
        Ok(_) => telemetry::outcome(span, "batch_inserted"),
        Err(e) => telemetry::error(span, e.variant()),
    }
}

/// Publishes one message on `conn` ([`crate::Outbox::publish`]), in its `send` span.
pub(crate) async fn publish(
    sql: &sql::publish::Publish,
    conn: &mut PgConnection,
    message: Message<'_>,
) -> Result<Published> {
    let span = send_span(&message);
    let traced = with_trace_context(&span, message.headers);
    let message = Message {
        headers: traced.as_ref().or(message.headers),
        ..message
    };
    let result = publish_untraced(sql, conn, message)
        .instrument(span.clone())
        .await;
    sent(&span, &result);
    result
}

/// [`publish`] without its span.
async fn publish_untraced(
    sql: &sql::publish::Publish,
    conn: &mut PgConnection,
    message: Message<'_>,
) -> Result<Published> {
    let resolved = message.validate()?;
    let (delay, at) = resolved.binds();
    let statement = match (message.on_conflict, message.timer_id) {
        (OnConflict::Extend, _) => &sql.extend,
        (OnConflict::Ignore, Some(_)) => &sql.insert,
        (OnConflict::Ignore, None) => &sql.plain,
    };
    let mut query = sqlx::query(statement.clone())
        .bind(message.queue)
        .bind(message.payload)
        .bind(message.headers.map(Json))
        .bind(delay)
        .bind(at)
        .bind(message.timer_id);
    if message.on_conflict == OnConflict::Extend {
        query = query.bind(interval(slack_micros(message.slack)));
    }
    let row = query.fetch_optional(&mut *conn).await?;
    let inserted = |id| {
        telemetry::published(message.queue, 1);
        Published::Inserted { id }
    };
    let Some(r) = row else {
        // Nothing written: the key was taken, or the extend was not later.
        return Ok(match message.on_conflict {
            OnConflict::Ignore => Published::Skipped,
            OnConflict::Extend => Published::Unchanged,
        });
    };
    let id: i64 = r.try_get(0)?;
    if message.on_conflict == OnConflict::Ignore {
        return Ok(inserted(id));
    }
    let (was_inserted, leased): (bool, bool) = (r.try_get(1)?, r.try_get(2)?);
    Ok(if was_inserted {
        inserted(id)
    } else if leased {
        Published::RearmQueued { id }
    } else {
        Published::Extended { id }
    })
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
    for item in items {
        validate_payload(item.payload)?;
        if let Some(h) = item.headers {
            validate_headers(h)?;
        }
    }
    Ok(resolved)
}

/// Publishes a batch on `conn` ([`crate::Outbox::publish_batch`]), in its `send` span.
pub(crate) async fn publish_batch(
    sql: &sql::publish::Publish,
    conn: &mut PgConnection,
    queue: &str,
    items: &[BatchItem<'_>],
    schedule: Schedule,
) -> Result<Vec<i64>> {
    let span = telemetry::send_span(queue, None, Some(items.len()));
    let traced = batch_trace_context(&span, items);
    let rebuilt;
    let items = match &traced {
        Some(traced) => {
            rebuilt = traced_items(items, traced);
            &rebuilt[..]
        }
        None => items,
    };
    let result = publish_batch_untraced(sql, conn, queue, items, schedule)
        .instrument(span.clone())
        .await;
    sent_batch(&span, &result);
    result
}

/// [`publish_batch`] without its span.
async fn publish_batch_untraced(
    sql: &sql::publish::Publish,
    conn: &mut PgConnection,
    queue: &str,
    items: &[BatchItem<'_>],
    schedule: Schedule,
) -> Result<Vec<i64>> {
    let resolved = validate_batch(queue, items, schedule)?;
    if items.is_empty() {
        return Ok(Vec::new());
    }
    let (delay, at) = resolved.binds();
    let payloads: Vec<&[u8]> = items.iter().map(|i| i.payload).collect();
    let headers: Vec<Option<Json<&Headers>>> = items.iter().map(|i| i.headers.map(Json)).collect();
    let row = sqlx::query(sql.batch.clone())
        .bind(queue)
        .bind(payloads)
        .bind(headers)
        .bind(delay)
        .bind(at)
        .fetch_one(&mut *conn)
        .await?;
    let ids: Vec<i64> = row.try_get::<Option<Vec<i64>>, _>(0)?.unwrap_or_default();
    telemetry::published(queue, ids.len() as u64);
    Ok(ids)
}
