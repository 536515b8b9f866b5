//! The storage side of periodic timers: what a worker writes when a periodic run starts
//! ([`Store::arm_next`](super::Store::arm_next)) and when it registers a schedule
//! ([`Store::register_schedule`](super::Store::register_schedule)), and what each reports.
//! The Postgres executors of the statements `sql::periodic` renders are in `fenced.rs`
//! (arm: a fenced write) and `postgres.rs` (register).
//!
//! A schedule is a keyed timer whose key is `schedule:<name>` and whose headers carry a
//! fingerprint of the schedule under [`SCHEDULE_HEADER`]: any number of workers keep one
//! live row per schedule through the timer key's unique index, with no leader.

use chrono::{DateTime, Datelike, Utc};

use crate::error::{Error, Result};
use crate::message::{
    validate_headers, validate_payload, validate_queue, validate_timer_id, Headers,
};
use crate::periodic::Recurrence;

/// The header that holds a schedule's fingerprint: a text that names the recurrence (its
/// cron expression and time zone, or its interval;
/// [`Recurrence::fingerprint`](crate::periodic::Recurrence::fingerprint)). Registration
/// compares it (and the payload) with the stored one to decide whether the stored row
/// follows an older schedule; a run reads it back to compute the next instant.
pub const SCHEDULE_HEADER: &str = crate::sql::periodic::SCHEDULE_HEADER;

/// The prefix of every schedule's timer key: a schedule named `nightly` is the timer
/// `schedule:nightly` of its queue. The key space is reserved: a publish or extend of a
/// timer id with this prefix is refused ([`Error::InvalidArgument`], `field` `"timer_id"`),
/// so only registrations write those rows; a cancel of one is allowed (it stops the
/// schedule).
pub const SCHEDULE_KEY_PREFIX: &str = crate::sql::periodic::SCHEDULE_KEY_PREFIX;

/// What [`Store::arm_next`](super::Store::arm_next) found on the running row.
///
/// At the start of a periodic run the worker queues the schedule's next instant as a rearm
/// on the leased row, carrying the row's own payload and headers, so every way the run ends
/// keeps the schedule: success and terminal failure apply the rearm (a fresh instance due
/// at the next instant), a retry is replaced by it, a crash leaves it queued for the run
/// that reclaims the row. The write is fenced by the lease token and by the absence of a
/// cancel mark: it never clears a cancel mark, so a cancel stops the schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Armed {
    /// The next instant is queued as the row's rearm, due at `at`.
    Queued {
        /// The rearm deadline (the next instant given).
        at: DateTime<Utc>,
    },
    /// A rearm already queued stays and nothing was written: it is not earlier than the next
    /// instant (a reclaimed run finds the one its crashed predecessor queued; a user's
    /// extend to a later deadline), or a registration of a changed schedule queued it (its
    /// fingerprint differs from the running row's), which wins earlier or not.
    Kept {
        /// The deadline of the rearm that stays.
        at: DateTime<Utc>,
    },
    /// A cancel reached the row: nothing was written, and the schedule stops when the run
    /// ends, until the schedule is registered again.
    Cancelled,
    /// The lease token no longer matches (the row was reclaimed or is gone). Nothing was
    /// written.
    LeaseLost,
}

/// A schedule to register ([`Store::register_schedule`](super::Store::register_schedule)):
/// the row of timer `timer_id` on `queue`, due first at `first`.
///
/// `timer_id` starts with [`SCHEDULE_KEY_PREFIX`] followed by a non-empty name, and
/// `headers` hold the schedule's fingerprint under [`SCHEDULE_HEADER`]
/// (exactly as [`Recurrence::fingerprint`] gives it, and one this build can read back). Queue,
/// timer id, payload and headers follow the rules of a publish (1..=255 bytes without NUL;
/// payload at most 64 MiB; headers at most 64 KiB in total, no NUL).
///
/// ```
/// use outbox::store::{RegisterSchedule, SCHEDULE_HEADER};
/// use outbox::periodic::Recurrence;
/// let every = Recurrence::parse_every("5m")?;
/// let headers = [(SCHEDULE_HEADER.to_owned(), every.fingerprint())].into();
/// let first = chrono::Utc::now();
/// let request = RegisterSchedule::new("reports", "schedule:cleanup", b"{}", &headers, first);
/// assert_eq!(request.timer_id, "schedule:cleanup");
/// # Ok::<(), outbox::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct RegisterSchedule<'a> {
    /// The queue.
    pub queue: &'a str,
    /// The timer key, `schedule:<name>`.
    pub timer_id: &'a str,
    /// The payload every instance of the schedule carries.
    pub payload: &'a [u8],
    /// The headers every instance carries, the fingerprint among them.
    pub headers: &'a Headers,
    /// The schedule's first instant (computed from the store's clock).
    pub first: DateTime<Utc>,
}

impl<'a> RegisterSchedule<'a> {
    /// Registers timer `timer_id` of `queue`, first due at `first`.
    pub fn new(
        queue: &'a str,
        timer_id: &'a str,
        payload: &'a [u8],
        headers: &'a Headers,
        first: DateTime<Utc>,
    ) -> Self {
        RegisterSchedule {
            queue,
            timer_id,
            payload,
            headers,
            first,
        }
    }

    /// The checks run before anything is written.
    pub(crate) fn validate(&self) -> Result<()> {
        validate_queue(self.queue)?;
        validate_timer_id(self.timer_id)?;
        if self
            .timer_id
            .strip_prefix(SCHEDULE_KEY_PREFIX)
            .is_none_or(str::is_empty)
        {
            return Err(Error::invalid(
                "timer_id",
                format!("a schedule's key is `{SCHEDULE_KEY_PREFIX}<name>` with a non-empty name"),
            ));
        }
        validate_payload(self.payload)?;
        validate_headers(self.headers)?;
        let Some(fingerprint) = self.headers.get(SCHEDULE_HEADER) else {
            return Err(Error::invalid(
                "headers",
                format!("a schedule's headers hold its fingerprint under `{SCHEDULE_HEADER}`"),
            ));
        };
        // Every worker that runs the row computes its next instant from it, and registration
        // compares it as text: only the canonical spelling a `Recurrence` gives is stored.
        let canonical = Recurrence::from_fingerprint(fingerprint).map(|r| r.fingerprint());
        match canonical {
            Ok(canonical) if canonical == *fingerprint => {}
            Ok(canonical) => {
                return Err(Error::invalid(
                    "headers",
                    format!("`{SCHEDULE_HEADER}` {fingerprint:?} is not in canonical form: {canonical:?}"),
                ))
            }
            Err(e) => {
                return Err(Error::invalid(
                    "headers",
                    format!("`{SCHEDULE_HEADER}` must be a recurrence's fingerprint (Recurrence::fingerprint): {e}"),
                ))
            }
        }
        check_instant("first", self.first)
    }
}

/// What a registration did.
///
/// | stored row | same schedule | another payload, same fingerprint | another fingerprint |
/// |---|---|---|---|
/// | none (never registered, or deleted by a cancel) | [`Inserted`](Registered::Inserted) | [`Inserted`](Registered::Inserted) | [`Inserted`](Registered::Inserted) |
/// | pending | [`Unchanged`](Registered::Unchanged) | [`Rescheduled`](Registered::Rescheduled): the new payload and headers, **its deadline kept**, retry history reset | [`Rescheduled`](Registered::Rescheduled): due at `first` (earlier allowed; an overdue row keeps its deadline and fires at once) with the new payload and headers, retry history reset |
/// | leased, running | [`Unchanged`](Registered::Unchanged) (its run queues the next instant) | [`RearmReplaced`](Registered::RearmReplaced): the queued rearm carries the new payload and headers, **its deadline kept** (`first` when none was queued yet) | [`RearmReplaced`](Registered::RearmReplaced): its rearm is `first` with the new payload and headers, whatever rearm was queued (earlier allowed) |
/// | leased, a cancel reached it | [`RearmReplaced`](Registered::RearmReplaced): the cancel mark cleared, the rearm queued at `first` | the same | the same |
///
/// "Same schedule" is the same fingerprint ([`SCHEDULE_HEADER`]) and the same payload
/// bytes as the row carries next: a queued rearm's when there is one, else the row's. So a
/// changed payload applies at the next registration without moving the schedule's grid,
/// and a payload whose encoding changes from start to start (a map in another order) costs
/// a write per start but never moves a deadline. An insert and a rewritten pending row
/// wake the queue's workers; a queued rearm wakes them when the run's completion applies
/// it. On Postgres one `INSERT … ON CONFLICT DO UPDATE` on the timer key's unique index, so
/// concurrent registrations of one schedule leave one row; "unchanged" writes nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Registered {
    /// No live row held the key: a new row, due at `at`.
    Inserted {
        /// The new row's id.
        id: i64,
        /// Its deadline (`first`).
        at: DateTime<Utc>,
    },
    /// The live row follows the same schedule: nothing was written.
    Unchanged,
    /// A pending row of another schedule (or payload) now follows this one, due at `at`.
    Rescheduled {
        /// The row id.
        id: i64,
        /// Its deadline: `first` for another fingerprint (the one it had if that was
        /// overdue), the one it had for another payload alone.
        at: DateTime<Utc>,
    },
    /// A leased row's rearm now installs this schedule at `at` when its run ends.
    RearmReplaced {
        /// The row id.
        id: i64,
        /// The rearm deadline: `first` for another fingerprint (or when none was queued),
        /// the queued one's for another payload alone.
        at: DateTime<Utc>,
    },
}

/// Postgres' `timestamptz` starts in 4713 BC; chrono's range is wider at the bottom.
pub(crate) fn check_instant(field: &'static str, at: DateTime<Utc>) -> Result<()> {
    if at.year() < -4712 {
        return Err(Error::invalid(
            field,
            "the time is before postgres' earliest timestamp (4713 BC)",
        ));
    }
    Ok(())
}
