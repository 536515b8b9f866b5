//! The storage contract the worker drives, with two implementations:
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
//! | claiming | [`Store::claim`], [`Store::register_schedule`], [`Store::claim_in_order`] | due rows and rows whose lease expired, `FOR UPDATE SKIP LOCKED`, one new lease token per claim; a schedule's row written once per key; an ordered relay's rows as runs per key (a key's earliest row and the due rows right after it), in id order |
//! | completing | [`Store::arm_next`], [`Store::ack`], [`Store::ack_batch`], [`Store::retry`], [`Store::fail`] | every write matches the row id **and** the lease token; a queued rearm is applied by the same write |
//! | waking up | [`Store::next_wakeup`], [`Store::wakeups`] | sleep until the earliest deadline or a notification, never poll in a loop |
//! | clock and settings | [`Store::now`], [`Store::dead_letter_enabled`], [`Store::autovacuum_off`] | deadlines and lease ages come from the store's clock |
//! | statistics | [`Store::queue_stats`] | what the opt-in queue-depth gauge reports; optional (`None` by default) |
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
//!   transaction as its row's completion — are offered through [`Store::transactions`],
//!   which only `PgStore` answers. A store without it makes
//!   [`Context::begin`](crate::Context::begin) return a typed
//!   [`Error::TransactionUnavailable`] instead of pretending to work. (A compile-time split
//!   was weighed and set aside: it would make a handler written for `PgStore` impossible to
//!   register on the in-memory store, which is how handlers are tested without a database.)
//!
//! The contract grows by groups: keeping a running handler's lease alive and giving rows
//! back at shutdown belong with completing (fenced by the same token), as does queuing a
//! periodic run's next instant ([`Store::arm_next`]); registering a recurring schedule
//! belongs with claiming (it writes the row a claim will find). Both periodic methods have
//! a default that refuses with [`Error::InvalidConfig`], so a store written before them
//! still compiles and says plainly that it cannot run schedules. Requests
//! that may gain options are structs ([`ClaimRequest`]), so adding one is not a breaking
//! change.
//!
//! # On a Citus cluster
//!
//! [`PgStore`](crate::PgStore) over a distributed outbox
//! ([`OutboxBuilder::distributed`](crate::OutboxBuilder::distributed)) keeps this contract
//! with every claim, completion, renewal, release, rearm and cancel on **one shard**. Citus
//! takes `FOR UPDATE SKIP LOCKED` only from a statement with an equality on the
//! distribution column, so the design is route (a) of the two known ones: a small
//! **logical bucket** column is the distribution column (`crate::bucket`: a key's bucket is
//! FNV-1a of the key modulo the bucket count, and a row id is `nextval × buckets + bucket`,
//! so every statement about a known row names its bucket). Route (b), claims addressed to
//! each shard's placement on its worker node, was set aside:
//!
//! - **co-location**: with (a) the application stores the same bucket on its own rows and
//!   distributes them `colocate_with` the queue table, so a publish in its transaction stays
//!   on one node (no two-phase commit); (b) gives the application nothing to co-locate by;
//! - **rebalancing**: with (a) a shard move (`citus_rebalance_start`) changes where a bucket
//!   lives, not which statement reaches it, since the coordinator routes every statement;
//!   (b) would have to follow placements while they move;
//! - **a node that is down**: with (a) a claim of a bucket on the dead node fails alone and
//!   the worker moves on to the other buckets; (b) needs connections to every node.
//!
//! A claim first reads, across the shards and without row locks, how many rows each queue
//! has due in each bucket (`GROUP BY bucket, queue`), then plans one claim statement per
//! bucket so that the whole claim takes what a single node's would: the limit dealt out
//! round robin across the queues, each queue's share taken from its buckets with the
//! earliest due rows. When that read fails (a worker node down) the claim
//! visits every bucket from a rotating cursor instead, each queue's cap shrinking by what a
//! bucket gave. Batched completions run one statement per bucket. Wake-ups go through the coordinator's `LISTEN`: a statement run on
//! a worker node returns its notification's payload and the store sends it on the
//! coordinator. The costs and the set-up: `docs/guide/citus.md`.
//!
//! # Sealed for 0.x
//!
//! Only this crate's stores implement [`Store`]: its methods and the types they take change
//! in minor releases while the crate is 0.x, and what a store must do to keep the worker
//! correct is checked by the project's contract suite, which does not ship. A test may
//! still wrap a store to count its calls or inject a fault: with the `testing` feature,
//! implement [`testing::Unsealed`](crate::testing::Unsealed) for the wrapper beside `Store`
//! (such a wrapper follows the trait's changes, with no compatibility promise).

use std::future::Future;
use std::time::Duration;

use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::message::{Headers, MAX_DELAY};
use crate::scope::Scope;
use crate::sql::complete::Complete;
use crate::stats::{QueueStats, StatsRequest};

pub(crate) mod connect;
pub(crate) mod fenced;
pub(crate) mod listen;
pub(crate) mod periodic;
pub(crate) mod plan;
pub(crate) mod postgres;
pub(crate) mod rows;
pub(crate) mod sealed;
pub(crate) mod transaction;

// Each public item has one path: `PgStore` and `HandlerTransaction` live at the crate root
// (the quick start names them), the rest of what a store reads and answers here.
pub use self::periodic::{
    Armed, RegisterSchedule, Registered, SCHEDULE_HEADER, SCHEDULE_KEY_PREFIX,
};
pub use self::postgres::LOCK_TIMEOUT;
pub use self::rows::{DeadLetter, StoredRow};

/// What a store offers for handler transactions: only [`PgStore`](crate::PgStore) makes
/// one (its pool and the statements of its outbox's completions).
#[derive(Debug, Clone)]
pub struct TransactionSource {
    pub(crate) pool: sqlx::PgPool,
    pub(crate) complete: Complete,
    pub(crate) scope: Scope,
}

impl TransactionSource {
    pub(crate) fn new(pool: sqlx::PgPool, complete: Complete, scope: Scope) -> Self {
        TransactionSource {
            pool,
            complete,
            scope,
        }
    }
}

/// The fence of every write after a claim: the row id and the lease token of the claim.
/// Each write's `WHERE` matches both, so once the lease expired and another worker
/// re-claimed the row under a new token, the write changes nothing and reports
/// [`Completion::LeaseLost`]: a late completion cannot undo the new holder's work.
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
    /// Why the stored row could not be read in full, when it could not: a column that does
    /// not decode (`headers` that are not a string-to-string JSON object, a timestamp out
    /// of chrono's range). The field of that column then holds an empty or default value.
    /// A worker never hands such a delivery to a handler: it ends it as a terminal failure
    /// with reason `decode_error` at once (the dead-letter table keeps the row's stored
    /// bytes and headers as they are), so one bad row never stalls the rows beside it.
    pub decode_error: Option<String>,
}

/// How a fenced completion ended (what each way a run ends does is the table in [`Store`]'s
/// docs).
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

/// Why a delivery ended in a terminal failure; stored in the dead-letter table's
/// `failure_reason`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FailureReason {
    /// `deliveries_count` passed the timer's `max_deliveries`; the handler did not run.
    MaxDeliveries,
    /// The retry strategy gave up (`max_attempts` or `max_total_delay`).
    RetryExhausted,
    /// The handler rejected the message.
    Rejected,
    /// The payload could not be decoded, or the stored row could not be read (headers that
    /// are not a string map, a row every claim of which fails); the handler did not run.
    DecodeError,
    /// The handler ran longer than its timeout, on its last allowed attempt.
    Timeout,
    /// The handler was stopped at the worker's shutdown deadline, on its last allowed
    /// attempt.
    Aborted,
}

impl FailureReason {
    /// The value stored in `failure_reason`.
    pub fn as_str(self) -> &'static str {
        match self {
            FailureReason::MaxDeliveries => "max_deliveries",
            FailureReason::RetryExhausted => "retry_exhausted",
            FailureReason::Rejected => "rejected",
            FailureReason::DecodeError => "decode_error",
            FailureReason::Timeout => "timeout",
            FailureReason::Aborted => "aborted",
        }
    }

    /// Whether the handler ran (and failed): such a failure counts in `attempts_count`.
    pub fn handler_ran(self) -> bool {
        matches!(
            self,
            FailureReason::RetryExhausted
                | FailureReason::Rejected
                | FailureReason::Timeout
                | FailureReason::Aborted
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

/// Where `queue` comes in a claim's round, starting after `resume_after`: the queues
/// named after it first, then those up to and including it, each part in name order
/// (byte order, as Rust compares strings; Postgres never compares the names, it takes the
/// order from the array `per_queue` binds). Sorting by this key rotates the sorted queue
/// list so that it starts after `resume_after`, whether or not that queue is in the list;
/// without one, the list is in name order.
pub(crate) fn round_position<'q>(queue: &'q str, resume_after: Option<&str>) -> (bool, &'q str) {
    (resume_after.is_some_and(|r| queue <= r), queue)
}

/// Puts claimed rows in claim order: a queue's `n`th row in round `n`, each round's queues
/// in [`round_position`] order, each queue's rows by (deadline, id) — what the claim
/// statement selects by.
pub(crate) fn fair_order(rows: &mut Vec<Delivery>, resume_after: Option<&str>) {
    rows.sort_by(|a, b| {
        (&a.queue, a.deadline, a.lease.id).cmp(&(&b.queue, b.deadline, b.lease.id))
    });
    let mut turn = Vec::with_capacity(rows.len());
    for (i, r) in rows.iter().enumerate() {
        let t = match i.checked_sub(1).map(|p| &rows[p]) {
            Some(prev) if prev.queue == r.queue => turn[i - 1] + 1,
            _ => 0usize,
        };
        turn.push(t);
    }
    let mut keyed: Vec<(usize, Delivery)> = turn.into_iter().zip(rows.drain(..)).collect();
    // Stable: within a queue the rows stay by (deadline, id).
    keyed.sort_by(|(ta, a), (tb, b)| {
        (ta, round_position(&a.queue, resume_after))
            .cmp(&(tb, round_position(&b.queue, resume_after)))
    });
    rows.extend(keyed.into_iter().map(|(_, d)| d));
}

/// The refusal of a store without periodic timers (the trait's defaults).
fn periodic_unsupported() -> Error {
    Error::InvalidConfig {
        knob: "store",
        reason: "this store does not support periodic timers (`arm_next`, `register_schedule`)"
            .to_owned(),
    }
}

/// The refusal of a store that cannot claim in order per key (the trait's default).
pub(crate) fn in_order_unsupported() -> Error {
    Error::InvalidConfig {
        knob: "relay",
        reason: "this store cannot claim in order per key: ordering needs a PgStore over an outbox that is not distributed"
            .to_owned(),
    }
}

/// Retry delays longer than [`crate::message::MAX_DELAY`] are rejected before any SQL: the deadline
/// would leave the range chrono and Postgres share.
pub(crate) fn check_retry_delay(delay: Duration) -> Result<()> {
    if delay > MAX_DELAY {
        return Err(Error::InvalidArgument {
            field: "delay",
            reason: "the retry delay is longer than 10 000 years of 366 days (overflow)".to_owned(),
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

/// Why autovacuum will not clean a queue table ([`Store::autovacuum_off`]). At least one
/// of `server` and `table_option` is `true`.
///
/// Every row of a queue table is inserted, updated (claimed, extended, retried) and
/// deleted within minutes, so each message leaves dead row versions and dead index
/// entries behind. Postgres reclaims them only by `VACUUM`; without autovacuum they grow
/// without bound, and every claim and extend walks further through dead index entries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AutovacuumOff {
    /// The queue table, as it appears in SQL text (quoted, schema-qualified).
    pub table: String,
    /// The server runs with `autovacuum = off`.
    pub server: bool,
    /// The table has the storage parameter `autovacuum_enabled = false`.
    pub table_option: bool,
}

/// A hint that work may be due, pushed by the store to sleeping workers (on Postgres, the
/// `NOTIFY` a publish sends, which Postgres delivers only once the publishing transaction
/// commits).
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

/// What a renewal (`acquired_at = now()`, fenced by the lease token) found for one lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Renewal {
    /// Still held: `acquired_at` is now.
    Renewed,
    /// Still held and renewed, but a cancel reached the row: however its run ends, the row
    /// is deleted. The handler may stop early.
    Cancelled,
    /// The token no longer matches (the lease expired and another worker claimed the row,
    /// or the row is gone): the run's completion will write nothing.
    Lost,
    /// Not renewed this time: another transaction holds the row's lock (an extend in
    /// flight) and the renewal does not wait for it. Not lost: nobody can claim a locked
    /// row, and the next renewal tries again.
    Busy,
}

/// A lease given back at shutdown ([`Store::release`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Release {
    /// The lease.
    pub lease: Lease,
    /// Whether its handler started (and was stopped at the shutdown deadline) or the row was
    /// still waiting in the worker's buffer.
    pub started: bool,
}

/// What a release did to one row:
///
/// | held row | becomes |
/// |---|---|
/// | never started, no rearm | pending, due as before, `deliveries_count − 1` (it was not delivered) |
/// | never started, rearm queued | pending at the rearm's deadline with its payload and headers (an extend of a pending row), retry history reset, `deliveries_count − 1` |
/// | cancelled while held | deleted |
/// | started and stopped, no rearm | due now, the attempt recorded (`attempts_count + 1`, `first_attempt_at`, `last_attempt_at`) |
/// | started and stopped, rearm queued | pending at the rearm's deadline, the attempt recorded, `deliveries_count` kept (as a retry with a rearm) |
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Released {
    /// A row that never started is pending again.
    Pending,
    /// A stopped run is due again (now, or at its rearm's deadline).
    Retried,
    /// A cancel had reached the row: it is deleted.
    Cancelled,
    /// The token no longer matches: nothing was written.
    LeaseLost,
}

/// What a claim asks for: up to `limit` due rows of `queues`, counting a leased row as due
/// again once its lease is older than `lease_ttl`, and at most `queue_limits[i]` rows of
/// `queues[i]` when set.
///
/// A claim takes the queues' rows **round robin**, in rounds: round 1 is every queue's
/// earliest due row, round 2 every queue's second, and so on, each queue's rows by
/// deadline. Within a round the queues come in name order (byte order), rotated to start
/// after [`resume_after`](Self::resume_after): the queue after the one the previous claim
/// ended on comes first. The claimed rows come back in that order. A claimer that passes
/// the queue of the last row of each claim as the next claim's `resume_after` (as the
/// worker does) is fair **across claims**, whatever the claim size: with `n` queues
/// holding due rows, each queue's earliest due row is claimed within `n` claims, however
/// old and large the other queues' backlogs are. Without `resume_after` every claim starts
/// at the first queue by name, so a claim smaller than the number of queues with due rows
/// always takes the same ones.
///
/// Among rows with the same deadline Postgres takes them in its index's order, which need
/// not be id order (a row updated without changing its deadline moves within the index);
/// the in-memory store takes them by id.
///
/// ```
/// use std::time::Duration;
/// let queues = ["presence.expiry".to_owned()];
/// let held = [41, 42];
/// let request = outbox::store::ClaimRequest::new(&queues, 10, Duration::from_secs(60)).excluding(&held);
/// assert_eq!(request.limit, 10);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
#[must_use = "a ClaimRequest claims nothing until passed to `Store::claim`"]
pub struct ClaimRequest<'a> {
    /// The queues to claim from (1..=255 bytes each, no NUL). Named twice counts once.
    pub queues: &'a [String],
    /// The most rows to claim.
    pub limit: usize,
    /// How old a lease must be before its row may be claimed again.
    pub lease_ttl: Duration,
    /// Rows never to claim: the ones the claimer still holds (reclaiming its own expired
    /// lease would run a row twice at once) and rows it has set aside. Default none.
    pub exclude: &'a [i64],
    /// When set, claim only among these rows: how a worker isolates the one row that makes
    /// a claim fail. Default unset (every due row).
    pub only: Option<&'a [i64]>,
    /// When set, the most rows to claim of each queue, parallel to `queues` (its length must
    /// be theirs); each is also bounded by `limit`, and a queue named more than once gets the
    /// smallest of its limits. Default unset: `limit` for every queue. How a worker keeps a queue
    /// within its handler's `max_concurrency`.
    pub queue_limits: Option<&'a [usize]>,
    /// When set, each round of the claim starts with the first queue named after this one
    /// (byte order) and wraps around: pass the queue of the previous claim's last row. It
    /// need not be one of `queues` (a queue left out of this claim still has its place in
    /// the order). Default unset: rounds start at the first queue by name.
    pub resume_after: Option<&'a str>,
    /// When set, the Postgres store keeps the claim's connection out of its pool for the
    /// next claim, until [`Store::next_wakeup`] or [`Store::claims_stopped`] gives it back: a
    /// claim loop that claims again at once then claims on one warm connection instead of
    /// each connection of the pool in turn. Default unset (the connection goes back to the
    /// pool after the claim); the worker's claim loop sets it. Without effect in memory.
    /// While the store keeps it, `PgPool::close` waits for it (sqlx closes a pool once every
    /// connection is back): a caller of [`Store::claim`] that sets this calls
    /// [`Store::claims_stopped`] before closing the pool.
    pub keep_connection: bool,
}

impl<'a> ClaimRequest<'a> {
    /// Up to `limit` due rows of `queues`, with leases older than `lease_ttl` counted as
    /// expired.
    pub fn new(queues: &'a [String], limit: usize, lease_ttl: Duration) -> Self {
        ClaimRequest {
            queues,
            limit,
            lease_ttl,
            exclude: &[],
            only: None,
            queue_limits: None,
            resume_after: None,
            keep_connection: false,
        }
    }

    /// Keeps the claim's connection for the next claim (the field of the same name says
    /// how long).
    pub fn keep_connection(mut self) -> Self {
        self.keep_connection = true;
        self
    }

    /// Starts each round after `queue` (see [`resume_after`](Self::resume_after)).
    pub fn resume_after(mut self, queue: &'a str) -> Self {
        self.resume_after = Some(queue);
        self
    }

    /// Claims at most `limits[i]` rows of `queues[i]`.
    pub fn queue_limits(mut self, limits: &'a [usize]) -> Self {
        self.queue_limits = Some(limits);
        self
    }

    /// The distinct queues with something to take, in the order of a round (sorted by name,
    /// rotated to start after `resume_after`), each with its limit (`limit` or its own,
    /// whichever is smaller), as the claim statement binds them: the statement takes a
    /// queue's place in the round from its position in the array.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `queue_limits` is not as long as `queues`.
    pub(crate) fn per_queue(&self) -> Result<(Vec<String>, Vec<i64>)> {
        let limits = match self.queue_limits {
            Some(l) if l.len() != self.queues.len() => {
                return Err(Error::InvalidArgument {
                    field: "queue_limits",
                    reason: format!(
                        "{} limits for {} queues; give one per queue",
                        l.len(),
                        self.queues.len()
                    ),
                })
            }
            l => l,
        };
        let mut pairs: Vec<(&String, usize)> = self
            .queues
            .iter()
            .enumerate()
            .map(|(i, q)| (q, limits.map_or(self.limit, |l| l[i].min(self.limit))))
            .collect();
        // Sorted by place in the round, the smallest limit first, so dedup keeps the
        // smallest; a queue with nothing to take is left out (its rows are neither read nor
        // locked).
        let after = self.resume_after;
        pairs.sort_unstable_by(|a, b| {
            (round_position(a.0, after), a.1).cmp(&(round_position(b.0, after), b.1))
        });
        pairs.dedup_by(|a, b| a.0 == b.0);
        Ok(pairs
            .into_iter()
            .filter(|&(_, l)| l > 0)
            .map(|(q, l)| (q.clone(), i64::try_from(l).unwrap_or(i64::MAX)))
            .unzip())
    }

    /// Never claims the rows `ids`.
    pub fn excluding(mut self, ids: &'a [i64]) -> Self {
        self.exclude = ids;
        self
    }

    /// Claims only among the rows `ids`.
    pub fn only(mut self, ids: &'a [i64]) -> Self {
        self.only = Some(ids);
        self
    }
}

/// The storage operations a worker needs (see the [module docs](self) for what is
/// deliberately not here). Both stores implement them with the same observable behaviour;
/// the project's contract suite checks that. Sealed for 0.x (see the
/// [module docs](self#sealed-for-0x)).
///
/// Every write after a claim is fenced by the [`Lease`]: it matches the row id and the
/// claim's token, so once another worker has re-claimed the row (under a new token) the
/// write changes nothing and reports [`Completion::LeaseLost`], never success. A queued
/// rearm (an extend that landed while the row was leased) and a cancel mark (a cancel that
/// landed while it was leased) are applied by the same write:
///
/// | run ends with | no rearm queued | rearm queued |
/// |---|---|---|
/// | success ([`ack`](Store::ack), [`ack_batch`](Store::ack_batch)) | row deleted | pending at the rearm's deadline with its payload and headers; rearm and lease cleared; retry history and `deliveries_count` reset to 0 |
/// | failure with a retry ([`retry`](Store::retry)) | pending at `now() + delay`; `attempts_count + 1`, `first_attempt_at`/`last_attempt_at` set; lease cleared | the rearm replaces the retry: pending at the rearm's deadline with its payload; retry history updated as for the failed run; `deliveries_count` kept, so `max_deliveries` still stops a handler that fails on every run |
/// | terminal failure ([`fail`](Store::fail)) | archived (when the dead-letter queue is on) and deleted, in one step | the failed run archived (its own payload, when the dead-letter queue is on) and the rearm applied as for success, in one step |
/// | any of these, on a row a cancel reached while it was leased | deleted; nothing archived, no retry ([`Completion::Cancelled`] for a failed run) | — (an extend after the cancel queues a rearm and clears the mark: the newest intent wins) |
///
/// A lease that expires (its worker died) leaves a queued rearm in place; it applies when
/// the next run's completion lands.
pub trait Store: sealed::Sealed + Clone + Send + Sync + 'static {
    /// Claims up to `request.limit` due rows of `request.queues`: unleased rows whose
    /// deadline has passed, and leased rows whose lease is older than `request.lease_ttl`
    /// (by the store's clock). Each claimed row gets one new token for this claim,
    /// `acquired_at = now`, `deliveries_count + 1`; a reclaimed row that a cancel reached is
    /// deleted instead of delivered. Returned in claim order (see [`ClaimRequest`]). On
    /// Postgres the claim is one `FOR UPDATE SKIP LOCKED` statement: it skips rows another
    /// transaction has locked, so two workers never claim the same row.
    fn claim(
        &self,
        request: ClaimRequest<'_>,
    ) -> impl Future<Output = Result<Vec<Delivery>>> + Send;

    /// Claims up to `request.limit` due rows of `request.queues` **in order per key**, in
    /// id order, as **runs**: a row whose header `key_header` has the value of a row with a
    /// lower id still in the table (pending, leased or waiting for a retry) is left out,
    /// unless that row is claimed by the same call. So a key's rows come as a run, its
    /// earliest row and the consecutive due rows after it, and nothing more of the key is
    /// claimed until the run's rows are gone (acked or dead-lettered). The caller runs a
    /// run's rows one after another, each only once the one before it succeeded, and gives
    /// the rest back untouched ([`Store::release`], not started) when one does not. Rows
    /// without the header are not held back and have no run.
    /// `queue_limits`, `only` and `resume_after` of the request do not apply. How a relay
    /// with [`Relay::ordered_by_header`](crate::relay::Relay::ordered_by_header) claims.
    ///
    /// The default refuses with [`Error::InvalidConfig`] (`knob` `"relay"`): only
    /// [`PgStore`](crate::PgStore) over an outbox that is not distributed claims in order
    /// ([`Store::claims_in_order`]).
    fn claim_in_order(
        &self,
        request: ClaimRequest<'_>,
        key_header: &str,
    ) -> impl Future<Output = Result<Vec<Delivery>>> + Send {
        let _ = (request, key_header);
        async { Err(in_order_unsupported()) }
    }

    /// Whether [`Store::claim_in_order`] works on this store (`false`, the default: a
    /// worker's `build()` then refuses an ordered relay).
    fn claims_in_order(&self) -> bool {
        false
    }

    /// Success: deletes the row, or applies its queued rearm (see the table above). On
    /// Postgres one `DELETE … AND rearm_at IS NULL` in the common case; only when it matches
    /// nothing does a second statement apply the rearm or find the lease lost.
    fn ack(&self, lease: Lease) -> impl Future<Output = Result<Completion>> + Send;

    /// Success for many rows at once; one [`Completion`] per lease, in order.
    fn ack_batch(&self, leases: &[Lease]) -> impl Future<Output = Result<Vec<Completion>>> + Send;

    /// A failed run with a retry `delay` (from the database clock). A queued rearm replaces
    /// the retry and keeps `deliveries_count` (see the table above).
    fn retry(
        &self,
        lease: Lease,
        delay: Duration,
    ) -> impl Future<Output = Result<Completion>> + Send;

    /// A terminal failure: archives the failed run when the dead-letter queue is on, and
    /// deletes the row or applies its queued rearm, in one step (see the table above).
    fn fail(
        &self,
        lease: Lease,
        failure: Failure<'_>,
    ) -> impl Future<Output = Result<Completion>> + Send;

    /// Keeps leases alive: one statement sets `acquired_at = now()` on every row still held
    /// by its token, so a run may last longer than `lease_ttl`. Returns one [`Renewal`] per
    /// lease, in order: renewed, renewed but a cancel reached the row (its run's end will
    /// delete it), lost, or busy (another transaction holds the row's lock; tried again
    /// next time, not lost).
    fn renew(&self, leases: &[Lease]) -> impl Future<Output = Result<Vec<Renewal>>> + Send;

    /// Gives leases back at shutdown, fenced by their tokens, so other workers can claim the
    /// rows at once instead of waiting for the lease to expire. What happens to each row is
    /// [`Released`]'s table. One [`Released`] per item, in order.
    fn release(&self, items: &[Release]) -> impl Future<Output = Result<Vec<Released>>> + Send;

    /// A terminal failure of a row no claim can take (every statement that would lease it
    /// fails): deletes it — archiving it first when the dead-letter queue is on — if it is
    /// unleased or its lease is older than `lease_ttl`, by a statement that updates
    /// nothing (a trigger or constraint that raises on updates of that row does not stop a
    /// delete). [`Completion::LeaseLost`] when the row is gone or held.
    fn fail_unclaimed(
        &self,
        id: i64,
        lease_ttl: Duration,
        failure: Failure<'_>,
    ) -> impl Future<Output = Result<Completion>> + Send;

    /// Queues the next instant `at` of a periodic run as the rearm of its leased row, with
    /// the row's own payload and headers, when the run starts: fenced by the lease token and
    /// by the absence of a cancel mark (a cancel mark is never cleared here). A rearm already
    /// queued stays when it is not earlier than `at` or when it carries another schedule's
    /// fingerprint (a registration of a changed schedule queued it); otherwise `at` replaces
    /// it. What each way the run ends then does is the completion table above. See
    /// [`Armed`]. On Postgres one statement that locks the row first.
    ///
    /// The default refuses with [`Error::InvalidConfig`] (`knob` `"store"`): the store
    /// cannot run periodic timers.
    fn arm_next(
        &self,
        lease: Lease,
        at: DateTime<Utc>,
    ) -> impl Future<Output = Result<Armed>> + Send {
        let _ = (lease, at);
        async { Err(periodic_unsupported()) }
    }

    /// Registers a schedule: inserts its row, leaves it alone when the stored schedule is
    /// the same, or brings it to the new one (the table of [`Registered`]). On Postgres one
    /// statement: it locks and updates the stored row, or inserts with
    /// `INSERT … ON CONFLICT DO UPDATE` on the timer key's unique index when there is none,
    /// so workers that register one schedule at once leave one live row, and a stored
    /// schedule consumes no value of the table's identity sequence.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a request that breaks [`RegisterSchedule`]'s rules,
    /// before anything is written. The default refuses with [`Error::InvalidConfig`]
    /// (`knob` `"store"`): the store cannot run periodic timers.
    fn register_schedule(
        &self,
        request: RegisterSchedule<'_>,
    ) -> impl Future<Output = Result<Registered>> + Send {
        let _ = request;
        async { Err(periodic_unsupported()) }
    }

    /// Earliest deadline and lease expiry among the rows `request` could claim, to sleep
    /// until: its queues, leases expiring after its `lease_ttl`, its `exclude`d rows left out
    /// (`limit` and `only` do not matter).
    fn next_wakeup(
        &self,
        request: ClaimRequest<'_>,
    ) -> impl Future<Output = Result<NextWakeup>> + Send;

    /// The `(id, queue)` of the rows `request` would claim, in claim order, without locking
    /// or changing anything. A worker uses it to isolate a row whose claim fails (a trigger
    /// or constraint that raises for that row alone): it claims the ids it peeked in halves
    /// until the failing row is alone.
    fn peek(
        &self,
        request: ClaimRequest<'_>,
    ) -> impl Future<Output = Result<Vec<(i64, String)>>> + Send;

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

    /// Opens what the worker's first completions need (the Postgres store's completion
    /// pool opens its first connection), so that they do not wait for a connect; run once
    /// when a worker starts, before its first claim. A failure is not reported here: the
    /// completion that needs the connection reports it. The default does nothing.
    fn warm_up(&self) -> impl Future<Output = ()> + Send {
        async {}
    }

    /// The claim loop has stopped: give back anything kept for the next claim (the
    /// Postgres store's claim connection goes back to its pool). The default does nothing.
    fn claims_stopped(&self) {}

    /// What this store offers for handlers that complete their row in their own transaction
    /// ([`Context::begin`](crate::Context::begin)): only [`PgStore`](crate::PgStore) offers it.
    /// A store without (the default) makes `Context::begin` return
    /// [`Error::TransactionUnavailable`]: a typed refusal, never a pretend transaction.
    fn transactions(&self) -> Option<TransactionSource> {
        None
    }

    /// Whether autovacuum is off for the store's queue table, checked once when a worker
    /// starts (it logs a warning naming the table). `None` (the default) when it is on or
    /// the store has no such thing (the in-memory store). A queue table that does not exist
    /// is [`Error::NotMigrated`] (the worker logs it at start, as an error).
    fn autovacuum_off(&self) -> impl Future<Output = Result<Option<AutovacuumOff>>> + Send {
        async { Ok(None) }
    }

    /// The statistics of the queues `request` names (every queue without a list), as
    /// [`Outbox::stats`](crate::Outbox::stats) reads them: what the worker's opt-in
    /// queue-depth gauge
    /// ([`WorkerBuilder::queue_depth_gauge`](crate::WorkerBuilder::queue_depth_gauge))
    /// reports. `None` (the default) when the store has no statistics; the gauge then logs
    /// that once and stops.
    fn queue_stats(
        &self,
        request: &StatsRequest,
    ) -> impl Future<Output = Result<Option<Vec<QueueStats>>>> + Send {
        let _ = request;
        async { Ok(None) }
    }

    /// The most connections the store can have open for a worker's statements at once, if
    /// it is bounded (a pool's size); `None` (the default) when it is not. A worker's
    /// `build()` checks it against the connections the worker needs.
    fn max_connections(&self) -> Option<u32> {
        None
    }

    /// The name of the store's queue table, unquoted and schema-qualified when a schema is
    /// configured (`outbox`, `app.outbox`): a relay's message ids start with it, so two
    /// tables relaying to one broker never share an id. The in-memory store answers
    /// `memory` (the default).
    fn queue_table_name(&self) -> String {
        "memory".to_owned()
    }

    /// Whether the store reaches Postgres through a transaction-mode pooler
    /// ([`OutboxBuilder::transaction_pooler`](crate::OutboxBuilder::transaction_pooler)),
    /// where a `LISTEN` would not last beyond its transaction: a worker's `build()` then
    /// refuses [`listen(true)`](crate::WorkerBuilder::listen). `false` (the default) for
    /// stores with a session of their own.
    fn transaction_pooler(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(queues: &[&str], after: Option<&str>, limits: Option<&[usize]>) -> Vec<(String, i64)> {
        let queues: Vec<String> = queues.iter().map(|q| (*q).to_owned()).collect();
        let mut r = ClaimRequest::new(&queues, 5, Duration::from_secs(1));
        if let Some(a) = after {
            r = r.resume_after(a);
        }
        if let Some(l) = limits {
            r = r.queue_limits(l);
        }
        let (qs, caps) = r.per_queue().unwrap();
        qs.into_iter().zip(caps).collect()
    }

    fn names(v: &[(String, i64)]) -> Vec<&str> {
        v.iter().map(|(q, _)| q.as_str()).collect()
    }

    #[test]
    fn a_round_starts_after_resume_after_in_name_order() {
        let qs = ["c", "a", "b"];
        assert_eq!(names(&order(&qs, None, None)), ["a", "b", "c"]);
        assert_eq!(names(&order(&qs, Some("a"), None)), ["b", "c", "a"]);
        assert_eq!(names(&order(&qs, Some("b"), None)), ["c", "a", "b"]);
        assert_eq!(
            names(&order(&qs, Some("c"), None)),
            ["a", "b", "c"],
            "wraps"
        );
        // A name not in the list has its place by name.
        assert_eq!(names(&order(&qs, Some("ab"), None)), ["b", "c", "a"]);
        assert_eq!(names(&order(&qs, Some(""), None)), ["a", "b", "c"]);
        assert_eq!(names(&order(&qs, Some("zz"), None)), ["a", "b", "c"]);
        // Byte order, not a locale's: "B" sorts before "a".
        assert_eq!(names(&order(&["a", "B"], Some("B"), None)), ["a", "B"]);
        assert_eq!(names(&order(&["a", "B"], Some("a"), None)), ["B", "a"]);
    }

    #[test]
    fn the_rotation_keeps_the_smallest_limit_and_drops_queues_without_room() {
        let got = order(&["b", "a", "b", "c"], Some("a"), Some(&[3, 0, 1, 2]));
        assert_eq!(got, [("b".to_owned(), 1), ("c".to_owned(), 2)]);
    }
}
