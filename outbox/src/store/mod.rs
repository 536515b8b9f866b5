//! The storage contract the worker drives (SPEC §5, §6, §7), with two implementations:
//! [`PgStore`](crate::PgStore) (Postgres, the product) and
//! [`MemoryStore`](crate::testing::MemoryStore) (in memory, for tests). The project's
//! contract suite runs every scenario against both.
//!
//! # Design
//!
//! [`Store`] holds **only what a worker needs**, grouped by job:
//!
//! | group | methods | rule |
//! |---|---|---|
//! | claiming | [`Store::claim`] | due rows and rows whose lease expired, `FOR UPDATE SKIP LOCKED`, one new lease token per claim |
//! | completing | [`Store::ack`], [`Store::ack_batch`], [`Store::retry`], [`Store::fail`] | every write matches the row id **and** the lease token; a queued rearm is applied by the same write |
//! | waking up | [`Store::next_wakeup`], [`Store::wakeups`] | sleep until the earliest deadline or a notification, never poll in a loop |
//! | clock and settings | [`Store::now`], [`Store::dead_letter_enabled`] | deadlines and lease ages come from the store's clock |
//!
//! Everything else lives outside the trait, so a store is small to implement and the worker
//! cannot reach what it should not:
//!
//! - **Publishing and cancelling** go through [`Publisher`](crate::Publisher), which both
//!   stores implement for `&Store` (and Postgres connections and transactions implement for
//!   your own transaction).
//! - **Inspection** (live rows, dead letters) is inherent on each store
//!   ([`PgStore::pending`](crate::PgStore::pending),
//!   [`MemoryStore::rows`](crate::testing::MemoryStore::rows), …): what an operator or a
//!   test reads is not part of what a worker does.
//! - **Capabilities only a database has** — a handler doing its own writes in the same
//!   transaction as its row's completion — belong in traits of their own that only
//!   `PgStore` implements, so asking for one on a store that cannot offer it fails to
//!   compile instead of pretending to work.
//!
//! The contract grows by groups: keeping a running handler's lease alive and giving rows
//! back at shutdown belong with completing (fenced by the same token), and registering a
//! recurring schedule belongs with claiming (it writes the row a claim will find). Requests
//! that may gain options are structs ([`ClaimRequest`]), so adding one is not a breaking
//! change.

use std::future::Future;
use std::time::Duration;

use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::publish::{Headers, MAX_DELAY};

pub(crate) mod listen;
pub mod postgres;
pub(crate) mod rows;

/// The fence of every write after a claim: the row id and the lease token of the claim
/// (SPEC §5.1). A write whose token no longer matches changes nothing and reports
/// [`Completion::LeaseLost`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Lease {
    /// The row id.
    pub id: i64,
    /// The claim's token (one random token per claim).
    pub token: Uuid,
}

/// A claimed row: what a handler gets, plus the lease that fences its completion.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivery {
    /// Row id and lease token.
    pub lease: Lease,
    /// The queue.
    pub queue: String,
    /// The encoded message (JSON for typed timers).
    pub payload: Vec<u8>,
    /// Headers, if the message has any.
    pub headers: Option<Headers>,
    /// The timer key; `None` for plain messages.
    pub timer_id: Option<String>,
    /// Failed handler runs before this one (retry history).
    pub attempts_count: i32,
    /// Claims so far, this one included (so 1 on the first delivery).
    pub deliveries_count: i32,
    /// When the row was first published.
    pub created_at: DateTime<Utc>,
    /// The deadline this delivery was due at (`next_attempt_at` when claimed).
    pub deadline: DateTime<Utc>,
    /// The first failed run, if any.
    pub first_attempt_at: Option<DateTime<Utc>>,
    /// When the lease was taken (database clock). `claimed_at - deadline` is the firing
    /// lateness.
    pub claimed_at: DateTime<Utc>,
}

/// How a fenced completion ended (SPEC §5.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Completion {
    /// The row is gone (and archived, for a terminal failure with the dead-letter queue on).
    Deleted,
    /// A queued rearm was applied: the row is a pending timer again, due at `at`.
    Rearmed {
        /// The rearm deadline.
        at: DateTime<Utc>,
    },
    /// The row waits for a retry at `at`.
    RetryScheduled {
        /// The retry deadline (database clock).
        at: DateTime<Utc>,
    },
    /// A cancel reached the row while its handler ran, and the run failed: the row is
    /// deleted instead of being retried or archived (a cancelled timer must not fire again).
    /// A successful run of a cancelled row reports [`Completion::Deleted`], as usual.
    Cancelled,
    /// The lease token no longer matches (another worker reclaimed the row after the lease
    /// expired, or the row is gone). Nothing was written.
    LeaseLost,
}

/// Why a delivery ended in a terminal failure (SPEC §7.2); stored in the dead-letter
/// table's `failure_reason`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FailureReason {
    /// `deliveries_count` passed the timer's `max_deliveries`; the handler did not run.
    MaxDeliveries,
    /// The retry strategy gave up (`max_attempts` or `max_total_delay`).
    RetryExhausted,
    /// The handler rejected the message.
    Rejected,
    /// The payload could not be decoded; the handler did not run.
    DecodeError,
}

impl FailureReason {
    /// The value stored in `failure_reason`.
    pub fn as_str(self) -> &'static str {
        match self {
            FailureReason::MaxDeliveries => "max_deliveries",
            FailureReason::RetryExhausted => "retry_exhausted",
            FailureReason::Rejected => "rejected",
            FailureReason::DecodeError => "decode_error",
        }
    }

    /// Whether the handler ran (and failed): such a failure counts in `attempts_count`.
    pub fn handler_ran(self) -> bool {
        matches!(
            self,
            FailureReason::RetryExhausted | FailureReason::Rejected
        )
    }
}

impl std::fmt::Display for FailureReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A terminal failure to record.
#[derive(Debug, Clone, Copy)]
pub struct Failure<'a> {
    /// Why.
    pub reason: FailureReason,
    /// The last error text, stored in the dead-letter table's `last_error`.
    pub last_error: Option<&'a str>,
}

/// The longest `last_error` kept in the dead-letter table, in bytes; longer texts are cut at
/// a character boundary.
pub const MAX_LAST_ERROR_BYTES: usize = 16 * 1024;

/// The queues of a claim or wake-up query, each once: a queue named twice would get two
/// candidate branches whose duplicates eat into the claim's LIMIT.
pub(crate) fn distinct(queues: &[String]) -> Vec<String> {
    let mut q = queues.to_vec();
    q.sort_unstable();
    q.dedup();
    q
}

/// Retry delays longer than [`crate::MAX_DELAY`] are rejected before any SQL: the deadline
/// would leave the range chrono and Postgres share.
pub(crate) fn check_retry_delay(delay: Duration) -> Result<()> {
    if delay > MAX_DELAY {
        return Err(Error::InvalidArgument {
            field: "delay",
            reason: "the retry delay is longer than 10 000 years (overflow)".to_owned(),
        });
    }
    Ok(())
}

/// Makes an error text storable: Postgres `text` cannot hold NUL, and a runaway error
/// message should not bloat the dead-letter table.
pub(crate) fn clean_error_text(s: &str) -> String {
    let mut end = s.len().min(MAX_LAST_ERROR_BYTES);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].replace('\0', "\\0")
}

/// When a worker should next look: the earliest pending deadline and the earliest lease
/// expiry of its queues.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NextWakeup {
    /// The store's clock when it answered, so a worker can map deadlines onto its own clock
    /// without trusting the two clocks to agree.
    pub now: DateTime<Utc>,
    /// Earliest `next_attempt_at` among unleased rows.
    pub deadline: Option<DateTime<Utc>>,
    /// Earliest `next_attempt_at` among unleased rows that is still in the future. When
    /// `deadline` is already past yet the claim did not take that row (another
    /// transaction holds its lock), this is the next moment something new becomes due.
    pub upcoming: Option<DateTime<Utc>>,
    /// Earliest moment a held lease expires (`acquired_at + lease_ttl`).
    pub lease_expiry: Option<DateTime<Utc>>,
}

impl NextWakeup {
    /// The earlier of the two.
    pub fn earliest(&self) -> Option<DateTime<Utc>> {
        match (self.deadline, self.lease_expiry) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

/// A hint that work may be due, pushed by the store to sleeping workers (SPEC §7.3).
/// Hints are never needed for correctness: a worker that misses one finds the row at its
/// next scan; they only make firing on time.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Wakeup {
    /// A row was published to `queue`, due at `at` (the store's clock).
    Published {
        /// The queue.
        queue: String,
        /// Its deadline.
        at: DateTime<Utc>,
    },
    /// The notification channel is down; hints may be missing until [`Wakeup::Listening`].
    Lost,
    /// Listening again after [`Wakeup::Lost`]: anything may have been missed, re-scan.
    Listening,
}

/// What a claim asks for (SPEC §6): up to `limit` due rows of `queues`, counting a leased
/// row as due again once its lease is older than `lease_ttl`.
///
/// ```
/// use std::time::Duration;
/// let queues = ["presence.expiry".to_owned()];
/// let request = outbox::ClaimRequest::new(&queues, 10, Duration::from_secs(60));
/// assert_eq!(request.limit, 10);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct ClaimRequest<'a> {
    /// The queues to claim from (1..=255 bytes each, no NUL). Named twice counts once.
    pub queues: &'a [String],
    /// The most rows to claim.
    pub limit: usize,
    /// How old a lease must be before its row may be claimed again.
    pub lease_ttl: Duration,
}

impl<'a> ClaimRequest<'a> {
    /// Up to `limit` due rows of `queues`, with leases older than `lease_ttl` counted as
    /// expired.
    pub fn new(queues: &'a [String], limit: usize, lease_ttl: Duration) -> Self {
        ClaimRequest {
            queues,
            limit,
            lease_ttl,
        }
    }
}

/// The storage operations a worker needs (see the [module docs](self) for what is
/// deliberately not here). Both stores implement them with the same observable behaviour;
/// the project's contract suite checks that.
///
/// Every completion is fenced by the [`Lease`] (SPEC §5.1) and treats a queued rearm as
/// SPEC §5.1's table says.
pub trait Store: Clone + Send + Sync + 'static {
    /// Claims up to `request.limit` due rows of `request.queues` (SPEC §6): unleased rows
    /// whose deadline has passed, and leased rows whose lease is older than
    /// `request.lease_ttl`. Each claimed row gets one new token for this claim,
    /// `acquired_at = now`, `deliveries_count + 1`. Ordered by deadline, then id.
    fn claim(
        &self,
        request: ClaimRequest<'_>,
    ) -> impl Future<Output = Result<Vec<Delivery>>> + Send;

    /// Success: deletes the row, or applies its queued rearm (SPEC §5.1, §5.2).
    fn ack(&self, lease: Lease) -> impl Future<Output = Result<Completion>> + Send;

    /// Success for many rows at once; one [`Completion`] per lease, in order.
    fn ack_batch(&self, leases: &[Lease]) -> impl Future<Output = Result<Vec<Completion>>> + Send;

    /// A failed run with a retry `delay` (from the database clock). A queued rearm replaces
    /// the retry and keeps `deliveries_count` (SPEC §5.1).
    fn retry(
        &self,
        lease: Lease,
        delay: Duration,
    ) -> impl Future<Output = Result<Completion>> + Send;

    /// A terminal failure: archives the failed run when the dead-letter queue is on, and
    /// deletes the row or applies its queued rearm, in one step (SPEC §5.1).
    fn fail(
        &self,
        lease: Lease,
        failure: Failure<'_>,
    ) -> impl Future<Output = Result<Completion>> + Send;

    /// Earliest deadline and lease expiry of `queues` (SPEC §7.3), to sleep until.
    fn next_wakeup(
        &self,
        queues: &[String],
        lease_ttl: Duration,
    ) -> impl Future<Output = Result<NextWakeup>> + Send;

    /// Starts pushing [`Wakeup`] hints. The stream is listening when this returns (so a
    /// scan after it misses nothing). `None` means the store has no push channel and
    /// workers rely on deadlines and the idle poll alone (the default).
    fn wakeups(
        &self,
    ) -> impl Future<Output = Result<Option<tokio::sync::mpsc::Receiver<Wakeup>>>> + Send {
        async { Ok(None) }
    }

    /// The store's clock (the database clock for Postgres, the virtual clock in memory).
    fn now(&self) -> impl Future<Output = Result<DateTime<Utc>>> + Send;

    /// Whether terminal failures are archived.
    fn dead_letter_enabled(&self) -> bool;
}
