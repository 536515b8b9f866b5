//! [`MemoryStore`]: the storage contract of [`PgStore`](crate::PgStore) in memory, on a
//! virtual clock.
//!
//! Every operation mirrors one statement of `sql/`; the comments name the SQL detail each
//! branch reproduces. The project's contract suite and model-based test run the same
//! scenarios against both stores and compare the rows.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::future::{ready, Future};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use chrono::{DateTime, NaiveDate, NaiveDateTime, TimeDelta, Utc};
use uuid::Uuid;

use crate::admin::{PausedQueue, RowAction};
use crate::cancel::Cancelled;
use crate::dlq::{DeadLetterFilter, Redrive, RedriveOutcome, RedriveResult, Selection};
use crate::error::{Error, Result};
use crate::message::envelope::{Message, Published};
use crate::message::schedule::Resolved;
use crate::message::{
    slack_micros, validate_batch, validate_queue, validate_timer_id, BatchItem, OnConflict,
    Schedule,
};
use crate::publish;
use crate::sql::binds::micros;
use crate::stats::{complete, lateness, Count, QueueStats, StatsMode, StatsRequest};
use crate::store::rows::{DeadLetter, StoredRow};
use crate::store::{
    clean_error_text, Armed, ClaimRequest, Completion, Delivery, Failure, Lease, NextWakeup,
    RegisterSchedule, Registered, Release, Released, Renewal, Store, Wakeup, SCHEDULE_HEADER,
};
use crate::timer::Publisher;

/// An in-memory [`Store`] with the same observable behaviour as [`PgStore`](crate::PgStore),
/// for testing handlers and timer logic without a database.
///
/// What "the same" means: for the same sequence of operations, both stores return the same
/// outcomes and hold the same rows: ids count up from 1 (a single-row publish uses up an id
/// even when it inserts nothing, as a Postgres identity column does under
/// `INSERT … ON CONFLICT`), one random lease token per claim, the same deliveries and
/// attempts counts, retry history, rearm columns and dead-letter rows, and timestamps at
/// Postgres' precision (whole microseconds). The project's contract suite checks this
/// scenario by scenario against Postgres.
///
/// # The virtual clock
///
/// The store's clock (what `now()` is in SQL) stands still until you move it with
/// [`MemoryStore::advance`] or [`MemoryStore::set_time`]. A deadline computed from a
/// relative [`Schedule`] is "the store's clock + delay", exactly as Postgres computes
/// `now() + interval`; an absolute schedule is taken as given. [`MemoryStore::new`] starts
/// the clock at the current wall-clock time (whole seconds) so that absolute schedules
/// built from [`Utc::now`] behave as expected; [`MemoryStore::starting_at`] starts it at a
/// fixed instant for fully reproducible tests.
///
/// # Sharing
///
/// Cheap to clone: clones share the same rows and clock (an `Arc<Mutex<…>>`), so one clone
/// can sit in a worker while the test publishes and inspects through another. It also
/// implements [`Publisher`], so the `publish_*`, `extend_*` and `cancel_*` functions that
/// `#[timer]` generates run against it: `publish_presence_expiry(&store, …)`.
///
/// # Differences from Postgres
///
/// - There are no transactions: each call is atomic on its own and calls are serialised.
///   What a transaction would add (a rolled-back publish leaving no row, lock waits) is
///   covered by the Postgres-only tests.
/// - A handler's own transaction ([`Context::begin`](crate::Context::begin)) is **refused**
///   with [`Error::TransactionUnavailable`]: there is no database to run the handler's SQL,
///   and a pretend transaction would report a success nothing backs. The run fails like any
///   handler error (the harness reports it). Test transactional handlers against Postgres
///   (`Worker::run_due` drains a `PgStore` the same way), or keep the database writes
///   behind a function you can swap in tests.
/// - Among rows with the **same** deadline, a claim with a `limit` that cuts through them
///   takes the lowest ids; Postgres takes them in index order (usually, but not always, the
///   same). The returned deliveries are in claim order in both stores: round robin across
///   queues, each queue's rows by deadline, then id.
/// - Absurd durations: a retry delay or lease TTL that puts a time beyond the year 262 000
///   (chrono's range) is an [`Error::InvalidArgument`] (`duration`, `lease_ttl`) here;
///   Postgres either stores a time it cannot hand back to chrono or rejects it with a
///   database error. Anything a worker produces is far inside both ranges.
/// - Dead letters: a redrive never waits for another one and a purge never skips a row,
///   since nothing is ever locked; the outcomes, ids and rows are those of Postgres once
///   the other transaction has ended.
/// - Lookups scan every row: it is meant for tests, not for millions of rows.
/// - The clock stands still within a step: an extend "now + 0" issued by a handler during
///   `run_due` is not later than the deadline the run was claimed for, so it is
///   `Unchanged`, where on Postgres (whose `now()` has moved on) it queues a rearm. Give
///   such extends a delay, or `advance` the clock.
/// - [`Worker::run_due`](crate::Worker::run_due) runs handlers without renewing leases, so
///   [`Context::cancelled`](crate::Context::cancelled) never fires there; a worker
///   [`start`](crate::Worker::start)ed over this store renews and signals as on Postgres.
///
/// # Example
///
/// ```
/// use std::time::Duration;
/// use outbox::testing::MemoryStore;
/// use outbox::{Message, Published, Publisher, store::{ClaimRequest, Completion, Store}, message::OnConflict};
///
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// let store = MemoryStore::new();
/// let queues = ["presence.expiry".to_owned()];
/// let ping = |payload: &'static [u8]| {
///     Message::new("presence.expiry", payload)
///         .timer_id("user-7")
///         .schedule(Duration::from_secs(60))
///         .on_conflict(OnConflict::Extend)
/// };
/// assert_eq!(store.publish_message(ping(b"{}")).await?, Published::Inserted { id: 1 });
///
/// // Not due yet.
/// let due = ClaimRequest::new(&queues, 10, Duration::from_secs(30));
/// assert!(store.claim(due).await?.is_empty());
/// store.advance(Duration::from_secs(60));
/// let d = store.claim(due).await?.remove(0);
///
/// // A ping while the handler runs queues a rearm; the ack applies it.
/// store.advance(Duration::from_secs(1));
/// assert_eq!(store.publish_message(ping(b"{}")).await?, Published::RearmQueued { id: 1 });
/// let Completion::Rearmed { at } = store.ack(d.lease).await? else { panic!() };
/// assert_eq!(at, store.time() + Duration::from_secs(60));
/// # Ok::<(), outbox::Error>(())
/// # }).unwrap();
/// ```
#[derive(Clone, Default)]
pub struct MemoryStore {
    state: Arc<Mutex<State>>,
}

impl fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.lock();
        f.debug_struct("MemoryStore")
            .field("now", &s.now)
            .field("dead_letter", &s.dead_letter)
            .field("rows", &s.rows.len())
            .field("dead_letters", &s.dlq.len())
            .finish()
    }
}

#[derive(Debug)]
struct State {
    /// The virtual clock, always at whole microseconds.
    now: DateTime<Utc>,
    dead_letter: bool,
    /// The last id handed out by the queue table's identity (0 = none yet).
    last_id: i64,
    /// The same for the dead-letter table.
    last_dlq_id: i64,
    /// Live rows by id.
    rows: BTreeMap<i64, StoredRow>,
    /// The dead-letter table, in insertion (= id) order.
    dlq: Vec<DeadLetter>,
    /// Workers listening for wake-up hints ([`Store::wakeups`]).
    listeners: Vec<tokio::sync::mpsc::Sender<Wakeup>>,
    /// Paused queues and when they were paused (the `<table>_paused` table).
    paused: BTreeMap<String, DateTime<Utc>>,
}

impl Default for State {
    fn default() -> Self {
        let now = Utc::now();
        // Whole seconds: printed times stay readable, and sub-second noise from the wall
        // clock does not leak into tests.
        let now = DateTime::from_timestamp(now.timestamp(), 0).unwrap_or(now);
        State::at(now)
    }
}

impl State {
    fn at(now: DateTime<Utc>) -> Self {
        State {
            now: to_postgres_precision(now),
            dead_letter: false,
            last_id: 0,
            last_dlq_id: 0,
            rows: BTreeMap::new(),
            dlq: Vec::new(),
            listeners: Vec::new(),
            paused: BTreeMap::new(),
        }
    }
}

/// Postgres' epoch: `timestamptz` values travel as microseconds since it.
fn postgres_epoch() -> NaiveDateTime {
    NaiveDate::from_ymd_opt(2000, 1, 1)
        .and_then(|d| d.and_hms_opt(0, 0, 0))
        .unwrap_or_default()
}

/// The instant Postgres stores for `t`: sqlx sends whole microseconds since 2000-01-01,
/// truncated towards that epoch (chrono's `num_microseconds`).
fn to_postgres_precision(t: DateTime<Utc>) -> DateTime<Utc> {
    let epoch = postgres_epoch();
    match (t.naive_utc() - epoch).num_microseconds() {
        Some(us) => (epoch + TimeDelta::microseconds(us)).and_utc(),
        None => t,
    }
}

/// `t + us` microseconds, as Postgres' `timestamptz + interval`.
fn plus(t: DateTime<Utc>, us: i64, field: &'static str) -> Result<DateTime<Utc>> {
    t.checked_add_signed(TimeDelta::microseconds(us))
        .ok_or_else(|| Error::invalid(field, "the resulting time is out of range"))
}

fn row_order(r: &StoredRow) -> (DateTime<Utc>, i64) {
    (r.next_attempt_at, r.id)
}

impl State {
    /// What a publish's `pg_notify` tells listeners: the queue and the deadline at
    /// millisecond precision. Hints are best effort, as NOTIFY is: a full or closed channel
    /// drops them.
    fn notify(&mut self, queue: &str, at: DateTime<Utc>) {
        let at = DateTime::from_timestamp_millis(at.timestamp_millis()).unwrap_or(at);
        self.listeners.retain(|tx| {
            let hint = Wakeup::Published {
                queue: queue.to_owned(),
                at,
            };
            !matches!(
                tx.try_send(hint),
                Err(tokio::sync::mpsc::error::TrySendError::Closed(_))
            )
        });
    }

    /// A completion that made the row due again (a rearm applied, a retry scheduled) is
    /// announced like a publish, as the Postgres statements do.
    fn announce(&mut self, id: i64, done: Completion) {
        if let Completion::Rearmed { at } | Completion::RetryScheduled { at } = done {
            if let Some(queue) = self.rows.get(&id).map(|r| r.queue.clone()) {
                self.notify(&queue, at);
            }
        }
    }

    fn next_id(&mut self) -> i64 {
        self.last_id += 1;
        self.last_id
    }

    fn deadline(&self, schedule: Resolved) -> Result<DateTime<Utc>> {
        match schedule {
            Resolved::In(us) => plus(self.now, us, "schedule"),
            Resolved::At(at) => Ok(to_postgres_precision(at)),
        }
    }

    fn timer_row(&self, queue: &str, timer_id: &str) -> Option<i64> {
        self.rows
            .values()
            .find(|r| r.queue == queue && r.timer_id.as_deref() == Some(timer_id))
            .map(|r| r.id)
    }

    /// The row `lease` fences, if its token still matches (`WHERE id = $1 AND
    /// acquired_token = $2`).
    fn leased(&mut self, lease: Lease) -> Option<&mut StoredRow> {
        self.rows
            .get_mut(&lease.id)
            .filter(|r| r.acquired_token == Some(lease.token))
    }

    /// `publish.rs`: the insert statement (`Ignore`) and the extend statement (`Extend`).
    fn publish(&mut self, message: Message<'_>) -> Result<Published> {
        let schedule = message.validate()?;
        let at = self.deadline(schedule)?;
        // The identity default is evaluated before ON CONFLICT looks for the key, so every
        // single-row publish uses up an id, whatever it ends up doing.
        let id = self.next_id();
        let existing = message
            .timer_id
            .and_then(|k| self.timer_row(message.queue, k));
        let Some(existing) = existing else {
            self.rows.insert(
                id,
                StoredRow {
                    id,
                    queue: message.queue.to_owned(),
                    payload: message.payload.to_vec(),
                    headers: message.headers.cloned(),
                    attempts_count: 0,
                    deliveries_count: 0,
                    created_at: self.now,
                    next_attempt_at: at,
                    first_attempt_at: None,
                    last_attempt_at: None,
                    acquired_at: None,
                    acquired_token: None,
                    timer_id: message.timer_id.map(str::to_owned),
                    rearm_at: None,
                    rearm_payload: None,
                    rearm_headers: None,
                    cancelled_at: None,
                    raw_headers: None,
                    raw_rearm_headers: None,
                },
            );
            // Only an insert notifies; an extend or a skipped publish does not (SPEC §2.4).
            self.notify(message.queue, at);
            return Ok(Published::Inserted { id });
        };
        if message.on_conflict == OnConflict::Ignore {
            return Ok(Published::Skipped);
        }
        let slack = TimeDelta::microseconds(slack_micros(message.slack));
        let Some(row) = self.rows.get_mut(&existing) else {
            return Ok(Published::Skipped);
        };
        if row.acquired_token.is_none() {
            // SPEC §4: later only (by more than the slack); new payload and headers; retry
            // history reset.
            if at <= row.next_attempt_at + slack {
                return Ok(Published::Unchanged);
            }
            row.next_attempt_at = at;
            row.payload = message.payload.to_vec();
            row.headers = message.headers.cloned();
            row.attempts_count = 0;
            row.first_attempt_at = None;
            row.last_attempt_at = None;
            Ok(Published::Extended { id: row.id })
        } else {
            // SPEC §5: later than greatest(claimed deadline, rearm_at + slack); `greatest`
            // ignores NULL, so the slack never applies to a running row without a rearm.
            let current = row.rearm_at.map_or(row.next_attempt_at, |r| {
                (r + slack).max(row.next_attempt_at)
            });
            if at <= current {
                return Ok(Published::Unchanged);
            }
            row.rearm_at = Some(at);
            row.rearm_payload = Some(message.payload.to_vec());
            row.rearm_headers = message.headers.cloned();
            // The newest intent wins: an extend after a cancel re-arms the timer.
            row.cancelled_at = None;
            Ok(Published::RearmQueued { id: row.id })
        }
    }

    /// `cancel.rs`: lock, then delete a pending row, or mark a running row cancelled
    /// (dropping its rearm).
    fn cancel(&mut self, queue: &str, timer_id: &str) -> Result<Cancelled> {
        validate_queue(queue)?;
        validate_timer_id(timer_id)?;
        let Some(id) = self.timer_row(queue, timer_id) else {
            return Ok(Cancelled::NotFound);
        };
        let Some(row) = self.rows.get_mut(&id) else {
            return Ok(Cancelled::NotFound);
        };
        if row.acquired_token.is_none() {
            self.rows.remove(&id);
            return Ok(Cancelled::Deleted { id });
        }
        let had_rearm = row.rearm_at.is_some();
        clear_rearm(row);
        row.cancelled_at = Some(row.cancelled_at.unwrap_or(self.now));
        Ok(if had_rearm {
            Cancelled::RearmDropped { id }
        } else {
            Cancelled::Running { id }
        })
    }

    /// `periodic.rs`, `arm_next`: lock the leased row, keep a rearm that is not earlier
    /// than `at` or that a registration of another schedule queued, else queue `at` with
    /// the row's own payload and headers; never on a cancel-marked row.
    fn arm_next(&mut self, lease: Lease, at: DateTime<Utc>) -> Armed {
        let at = to_postgres_precision(at);
        let Some(row) = self.leased(lease) else {
            return Armed::LeaseLost;
        };
        if row.cancelled_at.is_some() {
            return Armed::Cancelled;
        }
        if let Some(queued) = row.rearm_at {
            let theirs = row
                .rearm_headers
                .as_ref()
                .and_then(|h| h.get(SCHEDULE_HEADER));
            let ours = row.headers.as_ref().and_then(|h| h.get(SCHEDULE_HEADER));
            if queued >= at || (theirs.is_some() && theirs != ours) {
                return Armed::Kept { at: queued };
            }
        }
        row.rearm_at = Some(at);
        row.rearm_payload = Some(row.payload.clone());
        row.rearm_headers = row.headers.clone();
        Armed::Queued { at }
    }

    /// `periodic.rs`, `register`: insert, or compare the fingerprint and payload the row
    /// carries next and bring the row to the new schedule (another payload alone keeps the
    /// timing).
    fn register_schedule(&mut self, request: RegisterSchedule<'_>) -> Result<Registered> {
        request.validate()?;
        let at = to_postgres_precision(request.first);
        // The identity default is evaluated before ON CONFLICT looks for the key.
        let id = self.next_id();
        let Some(existing) = self.timer_row(request.queue, request.timer_id) else {
            self.rows.insert(
                id,
                StoredRow {
                    id,
                    queue: request.queue.to_owned(),
                    payload: request.payload.to_vec(),
                    headers: Some(request.headers.clone()),
                    attempts_count: 0,
                    deliveries_count: 0,
                    created_at: self.now,
                    next_attempt_at: at,
                    first_attempt_at: None,
                    last_attempt_at: None,
                    acquired_at: None,
                    acquired_token: None,
                    timer_id: Some(request.timer_id.to_owned()),
                    rearm_at: None,
                    rearm_payload: None,
                    rearm_headers: None,
                    cancelled_at: None,
                    raw_headers: None,
                    raw_rearm_headers: None,
                },
            );
            self.notify(request.queue, at);
            return Ok(Registered::Inserted { id, at });
        };
        let Some(row) = self.rows.get_mut(&existing) else {
            return Ok(Registered::Unchanged);
        };
        // What the row carries next: its queued rearm, else itself.
        let (next_headers, next_payload) = if row.rearm_at.is_some() {
            (row.rearm_headers.as_ref(), row.rearm_payload.as_deref())
        } else {
            (row.headers.as_ref(), Some(row.payload.as_slice()))
        };
        let moved = next_headers.and_then(|h| h.get(SCHEDULE_HEADER))
            != request.headers.get(SCHEDULE_HEADER);
        let same_payload = next_payload == Some(request.payload);
        let stopped = row.cancelled_at.is_some() && row.rearm_at.is_none();
        if !moved && same_payload && !stopped {
            return Ok(Registered::Unchanged);
        }
        row.cancelled_at = None;
        if row.acquired_token.is_none() {
            // Another recurrence moves the deadline unless it is overdue (the missed instant
            // fires once); another payload alone keeps it.
            if moved && row.next_attempt_at > self.now {
                row.next_attempt_at = at;
            }
            row.payload = request.payload.to_vec();
            row.headers = Some(request.headers.clone());
            row.attempts_count = 0;
            row.first_attempt_at = None;
            row.last_attempt_at = None;
            let (id, due) = (row.id, row.next_attempt_at);
            self.notify(request.queue, due);
            Ok(Registered::Rescheduled { id, at: due })
        } else {
            let rearm_at = match row.rearm_at {
                Some(queued) if !moved => queued,
                _ => at,
            };
            row.rearm_at = Some(rearm_at);
            row.rearm_payload = Some(request.payload.to_vec());
            row.rearm_headers = Some(request.headers.clone());
            Ok(Registered::RearmReplaced {
                id: row.id,
                at: rearm_at,
            })
        }
    }

    /// The candidates of the claim statement: `(deadline, id)` of what a claim would take,
    /// in claim order, at most `limit`.
    fn candidates(&self, request: ClaimRequest<'_>) -> Result<Vec<(DateTime<Utc>, i64)>> {
        for q in request.queues {
            validate_queue(q)?;
        }
        let ttl = micros(request.lease_ttl)?;
        let limit = request.limit;
        let (queues, caps) = request.per_queue()?;
        if queues.is_empty() || limit == 0 {
            return Ok(Vec::new());
        }
        let now = self.now;
        let expired_before = plus(now, -ttl, "lease_ttl")?;
        let allowed = |r: &StoredRow| {
            !request.exclude.contains(&r.id) && request.only.is_none_or(|ids| ids.contains(&r.id))
        };
        // Two branches per queue (named twice or not), each with the claim's LIMIT; each
        // queue's candidates by (deadline, id) within its cap; then the best `limit` round
        // robin across queues — the claim statement's FAIR_ORDER and `turn <= cap`.
        let mut candidates: Vec<(usize, DateTime<Utc>, i64)> = Vec::new();
        for (q, cap) in queues.iter().zip(caps) {
            // A paused queue's branches find nothing.
            if self.paused.contains_key(q) {
                continue;
            }
            let cap = usize::try_from(cap).unwrap_or(usize::MAX);
            let mut due: Vec<&StoredRow> = self
                .rows
                .values()
                .filter(|r| {
                    &r.queue == q
                        && r.acquired_token.is_none()
                        && r.next_attempt_at <= now
                        && allowed(r)
                })
                .collect();
            due.sort_by_key(|r| row_order(r));
            let mut mine: Vec<(DateTime<Utc>, i64)> =
                due.iter().take(limit).map(|r| row_order(r)).collect();

            let mut expired: Vec<&StoredRow> = self
                .rows
                .values()
                .filter(|r| {
                    &r.queue == q
                        && r.acquired_token.is_some()
                        && r.acquired_at.is_some_and(|a| a < expired_before)
                        && r.next_attempt_at <= now
                        && allowed(r)
                })
                .collect();
            expired.sort_by_key(|r| (r.acquired_at, r.id));
            mine.extend(expired.iter().take(limit).map(|r| row_order(r)));
            mine.sort();
            candidates.extend(
                mine.into_iter()
                    .take(cap)
                    .enumerate()
                    .map(|(turn, (at, id))| (turn, at, id)),
            );
        }
        candidates.sort();
        candidates.truncate(limit);
        Ok(candidates.into_iter().map(|(_, at, id)| (at, id)).collect())
    }

    /// The claim statement of `store/postgres.rs`: one new token for the claim,
    /// `acquired_at = now`, `deliveries_count + 1`; a reclaimed cancelled row is deleted.
    fn claim(&mut self, request: ClaimRequest<'_>) -> Result<Vec<Delivery>> {
        let candidates = self.candidates(request)?;
        let now = self.now;
        // UPDATE … FROM updates a row once however often it is joined.
        let mut seen = HashSet::new();
        let token = Uuid::new_v4();
        let mut out = Vec::new();
        for (_, id) in candidates {
            if !seen.insert(id) {
                continue;
            }
            let Some(row) = self.rows.get_mut(&id) else {
                continue;
            };
            // The `gone` branch: a reclaimed row that a cancel reached while it ran is
            // deleted, not delivered.
            if cancelled(row) {
                self.rows.remove(&id);
                continue;
            }
            row.acquired_token = Some(token);
            row.acquired_at = Some(now);
            row.deliveries_count += 1;
            out.push(Delivery {
                lease: Lease { id, token },
                queue: row.queue.clone(),
                payload: row.payload.clone(),
                headers: row.headers.clone(),
                timer_id: row.timer_id.clone(),
                attempts_count: row.attempts_count,
                deliveries_count: row.deliveries_count,
                created_at: row.created_at,
                deadline: row.next_attempt_at,
                first_attempt_at: row.first_attempt_at,
                claimed_at: now,
                decode_error: None,
            });
        }
        crate::store::fair_order(&mut out);
        Ok(out)
    }

    /// As on Postgres: `DELETE … AND rearm_at IS NULL`, else the fenced rearm UPDATE.
    fn ack(&mut self, lease: Lease) -> Completion {
        let Some(row) = self.leased(lease) else {
            return Completion::LeaseLost;
        };
        if row.rearm_at.is_none() {
            self.rows.remove(&lease.id);
            Completion::Deleted
        } else {
            Completion::Rearmed {
                at: apply_rearm(row),
            }
        }
    }

    /// The batched DELETE, then one rearm UPDATE for the leases it did not return. Like
    /// the Postgres store, outcomes are matched to leases by row id.
    fn ack_batch(&mut self, leases: &[Lease]) -> Vec<Completion> {
        if leases.is_empty() {
            return Vec::new();
        }
        // Keyed by the whole lease, not the id: a stale and a fresh lease of one row in
        // the same batch must not share an outcome.
        let mut deleted = HashSet::new();
        for l in leases {
            if self.leased(*l).is_some_and(|r| r.rearm_at.is_none()) {
                self.rows.remove(&l.id);
                deleted.insert(*l);
            }
        }
        let mut rearmed = HashMap::new();
        for l in leases.iter().filter(|l| !deleted.contains(l)) {
            if let Some(row) = self.leased(*l).filter(|r| r.rearm_at.is_some()) {
                rearmed.insert(*l, apply_rearm(row));
            }
        }
        leases
            .iter()
            .map(|l| {
                if deleted.contains(l) {
                    Completion::Deleted
                } else if let Some(&at) = rearmed.get(l) {
                    Completion::Rearmed { at }
                } else {
                    Completion::LeaseLost
                }
            })
            .collect()
    }

    /// The retry statement: a cancelled row is deleted; the rearm, if queued, replaces the
    /// retry; history is updated either way and `deliveries_count` is kept.
    fn retry(&mut self, lease: Lease, delay: Duration) -> Result<Completion> {
        crate::store::check_retry_delay(delay)?;
        let delay = micros(delay)?;
        let now = self.now;
        let Some(row) = self.leased(lease) else {
            return Ok(Completion::LeaseLost);
        };
        if cancelled(row) {
            self.rows.remove(&lease.id);
            return Ok(Completion::Cancelled);
        }
        row.cancelled_at = None;
        let (at, outcome) = match row.rearm_at.take() {
            Some(at) => {
                row.payload = row.rearm_payload.take().unwrap_or_default();
                row.headers = row.rearm_headers.take();
                (at, Completion::Rearmed { at })
            }
            // Only this branch computes `now() + delay` (SQL's CASE is lazy).
            None => {
                let at = plus(now, delay, "duration")?;
                (at, Completion::RetryScheduled { at })
            }
        };
        row.next_attempt_at = at;
        row.attempts_count += 1;
        row.first_attempt_at = Some(row.first_attempt_at.unwrap_or(now));
        row.last_attempt_at = Some(now);
        clear_rearm(row);
        row.acquired_token = None;
        row.acquired_at = None;
        Ok(outcome)
    }

    /// The dead-letter statement: archive the failed run (its own payload), then delete the
    /// row or apply its rearm. Without the dead-letter queue, a success.
    fn fail(&mut self, lease: Lease, failure: Failure<'_>) -> Completion {
        if self.leased(lease).is_some_and(|r| cancelled(r)) {
            // Nobody wants a cancelled timer's failure: deleted, not archived.
            self.rows.remove(&lease.id);
            return Completion::Cancelled;
        }
        if !self.dead_letter {
            return self.ack(lease);
        }
        let now = self.now;
        let Some(row) = self.leased(lease) else {
            return Completion::LeaseLost;
        };
        if cancelled(row) {
            // Nobody wants a cancelled timer's failure: deleted, not archived.
            self.rows.remove(&lease.id);
            return Completion::Cancelled;
        }
        let archived = DeadLetter {
            id: 0,
            original_id: row.id,
            queue: row.queue.clone(),
            payload: row.payload.clone(),
            headers: row.headers.clone(),
            raw_headers: None,
            timer_id: row.timer_id.clone(),
            attempts_count: row.attempts_count + i32::from(failure.reason.handler_ran()),
            deliveries_count: row.deliveries_count,
            created_at: row.created_at,
            failed_at: now,
            failure_reason: failure.reason.as_str().to_owned(),
            last_error: failure.last_error.map(clean_error_text),
            redriven_at: None,
            redriven_id: None,
        };
        let outcome = if row.rearm_at.is_some() {
            Completion::Rearmed {
                at: apply_rearm(row),
            }
        } else {
            self.rows.remove(&lease.id);
            Completion::Deleted
        };
        self.last_dlq_id += 1;
        self.dlq.push(DeadLetter {
            id: self.last_dlq_id,
            ..archived
        });
        outcome
    }

    /// The renewal statement: `acquired_at = now()` on every row its token still holds.
    fn renew(&mut self, leases: &[Lease]) -> Vec<Renewal> {
        let now = self.now;
        leases
            .iter()
            .map(|&l| match self.leased(l) {
                Some(row) => {
                    row.acquired_at = Some(now);
                    if cancelled(row) {
                        Renewal::Cancelled
                    } else {
                        Renewal::Renewed
                    }
                }
                None => Renewal::Lost,
            })
            .collect()
    }

    /// The release statement: see [`Released`]. Like the statement, a lease
    /// named twice is released once and both items report that outcome.
    fn release(&mut self, items: &[Release]) -> Vec<Released> {
        let mut done: HashMap<Lease, Released> = HashMap::new();
        for item in items {
            if let std::collections::hash_map::Entry::Vacant(slot) = done.entry(item.lease) {
                slot.insert(self.release_one(*item));
            }
        }
        items.iter().map(|i| done[&i.lease]).collect()
    }

    fn release_one(&mut self, item: Release) -> Released {
        let now = self.now;
        {
            let Some(row) = self.leased(item.lease) else {
                return Released::LeaseLost;
            };
            if cancelled(row) {
                self.rows.remove(&item.lease.id);
                return Released::Cancelled;
            }
            let rearm = row.rearm_at.take();
            if let Some(at) = rearm {
                row.next_attempt_at = at;
                row.payload = row.rearm_payload.take().unwrap_or_default();
                row.headers = row.rearm_headers.take();
            }
            if item.started {
                if rearm.is_none() {
                    row.next_attempt_at = now;
                }
                row.attempts_count += 1;
                row.first_attempt_at = Some(row.first_attempt_at.unwrap_or(now));
                row.last_attempt_at = Some(now);
            } else {
                if rearm.is_some() {
                    row.attempts_count = 0;
                    row.first_attempt_at = None;
                    row.last_attempt_at = None;
                }
                row.deliveries_count = (row.deliveries_count - 1).max(0);
            }
            clear_rearm(row);
            row.acquired_token = None;
            row.acquired_at = None;
            row.cancelled_at = None;
            let (queue, at) = (row.queue.clone(), row.next_attempt_at);
            self.notify(&queue, at);
        }
        if item.started {
            Released::Retried
        } else {
            Released::Pending
        }
    }

    /// The delete-based terminal failure of a row no claim can take.
    fn fail_unclaimed(
        &mut self,
        id: i64,
        lease_ttl: Duration,
        failure: Failure<'_>,
    ) -> Result<Completion> {
        let expired_before = plus(self.now, -micros(lease_ttl)?, "lease_ttl")?;
        let free = self.rows.get(&id).is_some_and(|r| {
            r.acquired_token.is_none() || r.acquired_at.is_some_and(|a| a < expired_before)
        });
        if !free {
            return Ok(Completion::LeaseLost);
        }
        let Some(row) = self.rows.remove(&id) else {
            return Ok(Completion::LeaseLost);
        };
        if self.dead_letter {
            self.last_dlq_id += 1;
            self.dlq.push(DeadLetter {
                id: self.last_dlq_id,
                original_id: row.id,
                queue: row.queue,
                payload: row.payload,
                headers: row.headers,
                raw_headers: None,
                timer_id: row.timer_id,
                attempts_count: row.attempts_count,
                deliveries_count: row.deliveries_count,
                created_at: row.created_at,
                failed_at: self.now,
                failure_reason: failure.reason.as_str().to_owned(),
                last_error: failure.last_error.map(clean_error_text),
                redriven_at: None,
                redriven_id: None,
            });
        }
        Ok(Completion::Deleted)
    }

    fn next_wakeup(&self, request: ClaimRequest<'_>) -> Result<NextWakeup> {
        for q in request.queues {
            validate_queue(q)?;
        }
        let ttl = micros(request.lease_ttl)?;
        let served = |r: &&StoredRow| {
            request.queues.contains(&r.queue)
                && !self.paused.contains_key(&r.queue)
                && !request.exclude.contains(&r.id)
        };
        let deadline = self
            .rows
            .values()
            .filter(served)
            .filter(|r| r.acquired_token.is_none())
            .map(|r| r.next_attempt_at)
            .min();
        let oldest_lease = self
            .rows
            .values()
            .filter(served)
            .filter(|r| r.acquired_token.is_some())
            .filter_map(|r| r.acquired_at)
            .min();
        let lease_expiry = oldest_lease.map(|a| plus(a, ttl, "duration")).transpose()?;
        let upcoming = self
            .rows
            .values()
            .filter(served)
            .filter(|r| r.acquired_token.is_none() && r.next_attempt_at > self.now)
            .map(|r| r.next_attempt_at)
            .min();
        Ok(NextWakeup {
            now: self.now,
            deadline,
            upcoming,
            lease_expiry,
        })
    }

    fn pending(&self, queue: &str, limit: usize) -> Result<Vec<StoredRow>> {
        validate_queue(queue)?;
        let mut rows: Vec<StoredRow> = self
            .rows
            .values()
            .filter(|r| r.queue == queue)
            .cloned()
            .collect();
        rows.sort_by_key(row_order);
        rows.truncate(limit);
        Ok(rows)
    }

    /// Whether `d` is a row of `filter` at this clock: the shared filter of `sql/dlq.rs`,
    /// its times at Postgres' precision as sqlx binds them.
    fn dlq_matches(&self, filter: &DeadLetterFilter, d: &DeadLetter) -> Result<bool> {
        let older = match filter.older_than {
            Some(age) => Some(plus(self.now, -micros(age)?, "older_than")?),
            None => None,
        };
        let after = filter.failed_after.map(to_postgres_precision);
        let before = filter.failed_before.map(to_postgres_precision);
        Ok(filter.queue.as_ref().is_none_or(|q| &d.queue == q)
            && filter.reason.is_none_or(|r| d.failure_reason == r.as_str())
            && after.is_none_or(|a| d.failed_at >= a)
            && before.is_none_or(|b| d.failed_at < b)
            && older.is_none_or(|o| d.failed_at < o)
            && (filter.include_redriven || d.redriven_at.is_none()))
    }

    /// `dlq.list`: the rows of the filter above the cursor, by id.
    fn dlq_list(
        &self,
        filter: &DeadLetterFilter,
        after: Option<i64>,
        limit: usize,
    ) -> Result<Vec<DeadLetter>> {
        crate::dlq::require_enabled(self.dead_letter)?;
        filter.binds()?;
        let after = after.unwrap_or(i64::MIN);
        let mut out = Vec::new();
        // `dlq` is in id order.
        for d in self.dlq.iter().filter(|d| d.id > after) {
            if out.len() >= limit {
                break;
            }
            if self.dlq_matches(filter, d)? {
                out.push(d.clone());
            }
        }
        Ok(out)
    }

    /// `dlq.redrive_ids` / `dlq.redrive_matching`: classify each selected row, then insert
    /// the ones that pass in id order (each attempt uses up an id, as the INSERT's identity
    /// default does before ON CONFLICT looks), mark them, and notify once per queue.
    fn redrive(&mut self, redrive: &Redrive) -> Result<Vec<RedriveOutcome>> {
        crate::dlq::require_enabled(self.dead_letter)?;
        redrive.check()?;
        let selected: Vec<(i64, Option<usize>)> = match &redrive.selection {
            Selection::Ids(ids) => ids
                .iter()
                .map(|&id| (id, self.dlq.iter().position(|d| d.id == id)))
                .collect(),
            Selection::Matching { filter, limit } => {
                filter.binds()?;
                let mut out = Vec::new();
                for (i, d) in self.dlq.iter().enumerate() {
                    if out.len() >= *limit {
                        break;
                    }
                    if d.redriven_at.is_none() && self.dlq_matches(filter, d)? {
                        out.push((d.id, Some(i)));
                    }
                }
                out
            }
        };
        let now = self.now;
        let mut woken: Vec<String> = Vec::new();
        let mut out = Vec::with_capacity(selected.len());
        for (dead_letter_id, at) in selected {
            let result = match at {
                None => RedriveResult::NotFound,
                Some(i) => self.redrive_one(i, now, &mut woken),
            };
            out.push(RedriveOutcome {
                dead_letter_id,
                result,
            });
        }
        for queue in woken {
            self.notify(&queue, now);
        }
        Ok(out)
    }

    fn redrive_one(
        &mut self,
        i: usize,
        now: DateTime<Utc>,
        woken: &mut Vec<String>,
    ) -> RedriveResult {
        let letter = &self.dlq[i];
        if letter.redriven_at.is_some() {
            return RedriveResult::AlreadyRedriven {
                redriven_id: letter.redriven_id,
            };
        }
        let headers = match crate::dlq::redrive_headers(letter) {
            Ok(h) => h,
            Err(refused) => return refused,
        };
        let (queue, payload, timer_id) = (
            letter.queue.clone(),
            letter.payload.clone(),
            crate::dlq::redrive_timer_id(letter),
        );
        let id = self.next_id();
        if timer_id
            .as_deref()
            .is_some_and(|k| self.timer_row(&queue, k).is_some())
        {
            return RedriveResult::TimerKeyHeld;
        }
        self.rows.insert(
            id,
            StoredRow {
                id,
                queue: queue.clone(),
                payload,
                headers: Some(headers),
                attempts_count: 0,
                deliveries_count: 0,
                created_at: now,
                next_attempt_at: now,
                first_attempt_at: None,
                last_attempt_at: None,
                acquired_at: None,
                acquired_token: None,
                timer_id,
                rearm_at: None,
                rearm_payload: None,
                rearm_headers: None,
                cancelled_at: None,
                raw_headers: None,
                raw_rearm_headers: None,
            },
        );
        let letter = &mut self.dlq[i];
        letter.redriven_at = Some(now);
        letter.redriven_id = Some(id);
        if !woken.contains(&queue) {
            woken.push(queue);
        }
        RedriveResult::Redriven { id }
    }

    /// `dlq.purge`, every batch at once: nothing here is ever locked, so no row is skipped.
    fn purge(&mut self, filter: &DeadLetterFilter, batch_size: usize) -> Result<u64> {
        crate::dlq::require_enabled(self.dead_letter)?;
        crate::dlq::check_purge(filter, batch_size)?;
        let mut keep = Vec::with_capacity(self.dlq.len());
        let mut deleted = 0u64;
        for d in std::mem::take(&mut self.dlq) {
            if self.dlq_matches(filter, &d)? {
                deleted += 1;
            } else {
                keep.push(d);
            }
        }
        self.dlq = keep;
        Ok(deleted)
    }

    /// `sql::stats`' exact statement: unleased rows (due when their deadline has passed),
    /// leased rows (expired when `acquired_at < now - ttl`, the queue's own TTL where the
    /// request gives one), rearms and cancel marks, and dead letters when the dead-letter
    /// queue is on. Exact in either mode: there are no planner statistics to read.
    fn stats(&self, request: &StatsRequest) -> Result<Vec<QueueStats>> {
        request.validate()?;
        let list = request.queue_list();
        if list.is_some_and(<[String]>::is_empty) {
            return Ok(Vec::new());
        }
        let wanted = |q: &str| list.is_none_or(|l| l.iter().any(|x| x == q));
        #[derive(Default)]
        struct Acc {
            pending: u64,
            due: u64,
            earliest: Option<DateTime<Utc>>,
            leased: u64,
            expired: u64,
            rearms: u64,
            cancel_marks: u64,
            dead: u64,
        }
        let mut by: BTreeMap<&str, Acc> = BTreeMap::new();
        for r in self.rows.values().filter(|r| wanted(&r.queue)) {
            let acc = by.entry(&r.queue).or_default();
            match r.acquired_at.filter(|_| r.acquired_token.is_some()) {
                None => {
                    acc.pending += 1;
                    acc.due += u64::from(r.next_attempt_at <= self.now);
                    acc.earliest = Some(
                        acc.earliest
                            .map_or(r.next_attempt_at, |e| e.min(r.next_attempt_at)),
                    );
                }
                Some(acquired_at) => {
                    let ttl = micros(request.lease_ttl_of(&r.queue))?;
                    let cutoff = plus(self.now, -ttl, "lease_ttl")?;
                    acc.leased += 1;
                    acc.expired += u64::from(acquired_at < cutoff);
                    acc.rearms += u64::from(r.rearm_at.is_some());
                    acc.cancel_marks += u64::from(r.cancelled_at.is_some());
                }
            }
        }
        if self.dead_letter {
            // Every archived row counts: this store has no redrive, so none is redriven.
            // Dead letters not redriven, as `redriven_at IS NULL` in the statement.
            for d in self
                .dlq
                .iter()
                .filter(|d| wanted(&d.queue) && d.redriven_at.is_none())
            {
                by.entry(&d.queue).or_default().dead += 1;
            }
        }
        let out = by
            .into_iter()
            .map(|(queue, a)| QueueStats {
                queue: queue.to_owned(),
                pending: Count::Exact(a.pending),
                due: Count::Exact(a.due),
                leased: Count::Exact(a.leased),
                expired_leases: Count::Exact(a.expired),
                oldest_due_lateness: a
                    .earliest
                    .filter(|e| *e <= self.now)
                    .map(|e| lateness(self.now, e)),
                rearms: Count::Exact(a.rearms),
                cancel_marks: Count::Exact(a.cancel_marks),
                dead_letters: if self.dead_letter {
                    Count::Exact(a.dead)
                } else {
                    Count::Unavailable
                },
            })
            .collect();
        Ok(complete(out, list, StatsMode::Exact, self.dead_letter))
    }

    /// `sql::admin`: the pause and resume statements.
    fn pause(&mut self, queue: &str, on: bool) -> Result<bool> {
        validate_queue(queue)?;
        if on {
            if self.paused.contains_key(queue) {
                return Ok(false);
            }
            self.paused.insert(queue.to_owned(), self.now);
            return Ok(true);
        }
        if self.paused.remove(queue).is_none() {
            return Ok(false);
        }
        let now = self.now;
        self.notify(queue, now);
        Ok(true)
    }

    /// `sql::admin`: a pending row's new deadline, or its deletion (`schedule` None).
    fn act(&mut self, id: i64, schedule: Option<Schedule>) -> Result<RowAction> {
        crate::admin::validate_id(id)?;
        let at = match schedule {
            Some(s) => Some(self.deadline(s.resolve()?)?),
            None => None,
        };
        let Some(row) = self.rows.get_mut(&id) else {
            return Ok(RowAction::NotFound);
        };
        if row.acquired_token.is_some() {
            return Ok(RowAction::Leased);
        }
        let Some(at) = at else {
            self.rows.remove(&id);
            return Ok(RowAction::Deleted);
        };
        row.next_attempt_at = at;
        let queue = row.queue.clone();
        self.notify(&queue, at);
        Ok(RowAction::Rescheduled {
            next_attempt_at: at,
        })
    }

    /// `Outbox::publish_batch`: the same checks in the same order, ids in item order.
    fn publish_batch(
        &mut self,
        queue: &str,
        items: &[BatchItem<'_>],
        schedule: Schedule,
    ) -> Result<Vec<i64>> {
        let resolved = validate_batch(queue, items, schedule)?;
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let at = self.deadline(resolved)?;
        let mut ids = Vec::with_capacity(items.len());
        for item in items {
            let id = self.next_id();
            self.rows.insert(
                id,
                StoredRow {
                    id,
                    queue: queue.to_owned(),
                    payload: item.payload.to_vec(),
                    headers: item.headers.cloned(),
                    attempts_count: 0,
                    deliveries_count: 0,
                    created_at: self.now,
                    next_attempt_at: at,
                    first_attempt_at: None,
                    last_attempt_at: None,
                    acquired_at: None,
                    acquired_token: None,
                    timer_id: None,
                    rearm_at: None,
                    rearm_payload: None,
                    rearm_headers: None,
                    cancelled_at: None,
                    raw_headers: None,
                    raw_rearm_headers: None,
                },
            );
            ids.push(id);
        }
        // One notification for the batch.
        self.notify(queue, at);
        Ok(ids)
    }
}

/// `cancelled_at IS NOT NULL AND rearm_at IS NULL`: a cancel reached the running row and no
/// extend re-armed it since. Such a row ends deleted however its run ends.
fn cancelled(row: &StoredRow) -> bool {
    row.cancelled_at.is_some() && row.rearm_at.is_none()
}

fn clear_rearm(row: &mut StoredRow) {
    row.rearm_at = None;
    row.rearm_payload = None;
    row.rearm_headers = None;
}

/// `APPLY_REARM`: the leased row becomes a fresh pending timer at `rearm_at` with the rearm
/// payload; lease, rearm columns, retry history and `deliveries_count` cleared.
fn apply_rearm(row: &mut StoredRow) -> DateTime<Utc> {
    let at = row.rearm_at.unwrap_or(row.next_attempt_at);
    row.next_attempt_at = at;
    row.payload = row.rearm_payload.take().unwrap_or_default();
    row.headers = row.rearm_headers.take();
    clear_rearm(row);
    row.acquired_token = None;
    row.acquired_at = None;
    row.cancelled_at = None;
    row.attempts_count = 0;
    row.first_attempt_at = None;
    row.last_attempt_at = None;
    row.deliveries_count = 0;
    at
}

impl MemoryStore {
    /// An empty store, dead-letter queue off (like [`Outbox::default`](crate::Outbox)),
    /// its clock at the current wall-clock time rounded down to whole seconds.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty store whose clock starts at `start` (kept to whole microseconds, as
    /// Postgres would store it). Use a fixed instant for reproducible tests.
    pub fn starting_at(start: DateTime<Utc>) -> Self {
        MemoryStore {
            state: Arc::new(Mutex::new(State::at(start))),
        }
    }

    /// Turns archiving of terminal failures on or off (default off), as
    /// [`OutboxBuilder::dead_letter`](crate::OutboxBuilder::dead_letter) does. Affects
    /// every clone.
    pub fn with_dead_letter(self, on: bool) -> Self {
        self.lock().dead_letter = on;
        self
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Nothing panics while holding the lock; recover the state rather than
        // propagating a poison from an unrelated panic.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The virtual clock: what `now()` is for this store.
    pub fn time(&self) -> DateTime<Utc> {
        self.lock().now
    }

    /// Moves the virtual clock forward by `by` (kept to whole microseconds). Rows become
    /// due and leases expire accordingly; nothing runs by itself.
    ///
    /// # Panics
    /// If the clock would leave chrono's range (about 262 000 years).
    pub fn advance(&self, by: Duration) {
        let mut s = self.lock();
        let us = i64::try_from(by.as_micros()).unwrap_or(i64::MAX);
        s.now = plus(s.now, us, "advance")
            .unwrap_or_else(|_| panic!("MemoryStore::advance({by:?}) leaves the clock's range"));
    }

    /// Sets the virtual clock to `now` (kept to whole microseconds). Moving it backwards is
    /// allowed, as a database clock can jump; deadlines already stored do not move.
    pub fn set_time(&self, now: DateTime<Utc>) {
        self.lock().now = to_postgres_precision(now);
    }

    /// Every live row of every queue (pending and leased), ordered by deadline, then id.
    pub fn rows(&self) -> Vec<StoredRow> {
        let mut rows: Vec<StoredRow> = self.lock().rows.values().cloned().collect();
        rows.sort_by_key(row_order);
        rows
    }

    /// Every row of the dead-letter table, by id (the archive order), whether the
    /// dead-letter queue is on or not.
    pub fn dead_letter_rows(&self) -> Vec<DeadLetter> {
        self.lock().dlq.clone()
    }

    /// Live rows of `queue` (pending and leased), ordered by deadline then id, at most
    /// `limit`: what [`PgStore::pending`](crate::PgStore::pending) reads.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a bad queue name.
    pub fn pending(&self, queue: &str, limit: usize) -> Result<Vec<StoredRow>> {
        self.lock().pending(queue, limit)
    }

    /// Dead letters of `filter` with an id above `after`, by id, at most `limit`: what
    /// [`Outbox::dead_letters`](crate::Outbox::dead_letters) reads ([`crate::dlq`] has the
    /// rules and the paging).
    ///
    /// # Errors
    /// [`Error::DeadLetterDisabled`] with the dead-letter queue off;
    /// [`Error::InvalidArgument`] for a filter that breaks a rule.
    pub fn dead_letters(
        &self,
        filter: &DeadLetterFilter,
        after: Option<i64>,
        limit: usize,
    ) -> Result<Vec<DeadLetter>> {
        self.lock().dlq_list(filter, after, limit)
    }

    /// Redrives dead letters as
    /// [`Outbox::redrive_dead_letters`](crate::Outbox::redrive_dead_letters) does, with the
    /// same outcomes, ids and rows: each redriven row is published again due at the store's
    /// clock, and its dead letter records `redriven_at` (the clock) and `redriven_id`.
    /// Atomic on its own, like every call here.
    ///
    /// # Errors
    /// As [`MemoryStore::dead_letters`].
    pub fn redrive_dead_letters(&self, redrive: &Redrive) -> Result<Vec<RedriveOutcome>> {
        self.lock().redrive(redrive)
    }

    /// Deletes the dead letters of `filter`, as
    /// [`Outbox::purge_dead_letters`](crate::Outbox::purge_dead_letters) does, and returns
    /// how many. Nothing is ever locked here, so no row is skipped and the batch size only
    /// has to be valid.
    ///
    /// # Errors
    /// As [`MemoryStore::dead_letters`], and [`Error::InvalidArgument`] for a filter
    /// without an age bound or a `batch_size` of 0.
    pub fn purge_dead_letters(&self, filter: &DeadLetterFilter, batch_size: usize) -> Result<u64> {
        self.lock().purge(filter, batch_size)
    }

    /// Appends `letter` to the dead-letter table as another writer would (rows archived by
    /// an older version or by SQL of your own, such as headers that are not a string map,
    /// which no call of this store produces), to test what your tooling does with them. Its
    /// `id` is ignored: the table's identity assigns the next one, which is returned. Its
    /// times are kept to whole microseconds.
    pub fn insert_dead_letter(&self, letter: DeadLetter) -> i64 {
        let mut s = self.lock();
        s.last_dlq_id += 1;
        let id = s.last_dlq_id;
        s.dlq.push(DeadLetter {
            id,
            created_at: to_postgres_precision(letter.created_at),
            failed_at: to_postgres_precision(letter.failed_at),
            redriven_at: letter.redriven_at.map(to_postgres_precision),
            ..letter
        });
        id
    }

    /// Inserts `row` into the queue table as another writer would (a row written by an older
    /// or a newer version, or by SQL of your own, such as a schedule whose fingerprint this
    /// build cannot read, which no call of this store produces), to test what a worker does
    /// with it. Its `id` is ignored: the table's identity assigns the next one, which is
    /// returned. Its times are kept to whole microseconds.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] (`field` `"timer_id"`) when a live row already holds its
    /// `(queue, timer_id)` key, as the unique index would refuse it; nothing is written.
    pub fn insert_row(&self, row: StoredRow) -> Result<i64> {
        let mut s = self.lock();
        if let Some(key) = row.timer_id.as_deref() {
            if s.timer_row(&row.queue, key).is_some() {
                return Err(Error::invalid(
                    "timer_id",
                    format!("a live row of queue {:?} holds the key {key:?}", row.queue),
                ));
            }
        }
        let id = s.next_id();
        let at = to_postgres_precision(row.next_attempt_at);
        let queue = row.queue.clone();
        s.rows.insert(
            id,
            StoredRow {
                id,
                created_at: to_postgres_precision(row.created_at),
                next_attempt_at: at,
                first_attempt_at: row.first_attempt_at.map(to_postgres_precision),
                last_attempt_at: row.last_attempt_at.map(to_postgres_precision),
                acquired_at: row.acquired_at.map(to_postgres_precision),
                rearm_at: row.rearm_at.map(to_postgres_precision),
                cancelled_at: row.cancelled_at.map(to_postgres_precision),
                ..row
            },
        );
        s.notify(&queue, at);
        Ok(id)
    }

    /// Pauses `queue`, as [`Outbox::pause_queue`](crate::Outbox::pause_queue) does: claims
    /// skip it (due rows and expired leases alike) and the next wake-up ignores its
    /// deadlines; publishing goes on. True when this call paused it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a bad queue name.
    pub fn pause_queue(&self, queue: &str) -> Result<bool> {
        self.lock().pause(queue, true)
    }

    /// Resumes `queue` and wakes listening workers, as
    /// [`Outbox::resume_queue`](crate::Outbox::resume_queue) does. True when this call
    /// resumed it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a bad queue name.
    pub fn resume_queue(&self, queue: &str) -> Result<bool> {
        self.lock().pause(queue, false)
    }

    /// The paused queues, by name.
    pub fn paused_queues(&self) -> Vec<PausedQueue> {
        self.lock()
            .paused
            .iter()
            .map(|(queue, at)| PausedQueue {
                queue: queue.clone(),
                paused_at: *at,
            })
            .collect()
    }

    /// Makes pending row `id` due now, as [`Outbox::run_now`](crate::Outbox::run_now) does.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an id below 1.
    pub fn run_now(&self, id: i64) -> Result<RowAction> {
        self.reschedule(id, Schedule::now())
    }

    /// Moves the deadline of pending row `id`, as
    /// [`Outbox::reschedule`](crate::Outbox::reschedule) does.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an id below 1 or a bad schedule.
    pub fn reschedule(&self, id: i64, schedule: impl Into<Schedule>) -> Result<RowAction> {
        self.lock().act(id, Some(schedule.into()))
    }

    /// Deletes pending row `id`, as
    /// [`Outbox::delete_pending`](crate::Outbox::delete_pending) does.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an id below 1.
    pub fn delete_pending(&self, id: i64) -> Result<RowAction> {
        self.lock().act(id, None)
    }

    /// Queue statistics, as [`Outbox::stats`](crate::Outbox::stats) reads them: the same
    /// figures, by the store's clock, always counted exactly (also for
    /// [`StatsMode::Estimate`]: there are no planner statistics here).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a bad queue name or a zero lease TTL.
    pub fn stats(&self, request: &StatsRequest) -> Result<Vec<QueueStats>> {
        self.lock().stats(request)
    }

    /// Publishes many messages to one queue at once, like
    /// [`Outbox::publish_batch`](crate::Outbox::publish_batch): all or nothing, no timer
    /// ids, new ids in the order of `items`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a bad queue name, schedule, payload (over 64 MiB) or
    /// headers (over 64 KiB, or a NUL), checked before anything is written.
    pub fn publish_batch(
        &self,
        queue: &str,
        items: &[BatchItem<'_>],
        schedule: impl Into<Schedule>,
    ) -> Result<Vec<i64>> {
        let span = crate::telemetry::send_span(queue, None, Some(items.len()));
        let traced = publish::batch_trace_context(&span, items);
        let rebuilt;
        let items = match &traced {
            Some(traced) => {
                rebuilt = publish::traced_items(items, traced);
                &rebuilt[..]
            }
            None => items,
        };
        let result = span.in_scope(|| self.lock().publish_batch(queue, items, schedule.into()));
        publish::sent_batch(&span, &result);
        result
    }
}

impl Store for MemoryStore {
    fn claim(
        &self,
        request: ClaimRequest<'_>,
    ) -> impl Future<Output = Result<Vec<Delivery>>> + Send {
        ready(self.lock().claim(request))
    }

    fn ack(&self, lease: Lease) -> impl Future<Output = Result<Completion>> + Send {
        let mut st = self.lock();
        let done = st.ack(lease);
        st.announce(lease.id, done);
        ready(Ok(done))
    }

    fn ack_batch(&self, leases: &[Lease]) -> impl Future<Output = Result<Vec<Completion>>> + Send {
        let mut st = self.lock();
        let done = st.ack_batch(leases);
        for (l, c) in leases.iter().zip(&done) {
            st.announce(l.id, *c);
        }
        ready(Ok(done))
    }

    fn retry(
        &self,
        lease: Lease,
        delay: Duration,
    ) -> impl Future<Output = Result<Completion>> + Send {
        let mut st = self.lock();
        let done = st.retry(lease, delay);
        if let Ok(c) = done {
            st.announce(lease.id, c);
        }
        ready(done)
    }

    fn fail(
        &self,
        lease: Lease,
        failure: Failure<'_>,
    ) -> impl Future<Output = Result<Completion>> + Send {
        let mut st = self.lock();
        let done = st.fail(lease, failure);
        st.announce(lease.id, done);
        ready(Ok(done))
    }

    fn renew(&self, leases: &[Lease]) -> impl Future<Output = Result<Vec<Renewal>>> + Send {
        ready(Ok(self.lock().renew(leases)))
    }

    fn release(&self, items: &[Release]) -> impl Future<Output = Result<Vec<Released>>> + Send {
        ready(Ok(self.lock().release(items)))
    }

    fn fail_unclaimed(
        &self,
        id: i64,
        lease_ttl: Duration,
        failure: Failure<'_>,
    ) -> impl Future<Output = Result<Completion>> + Send {
        ready(self.lock().fail_unclaimed(id, lease_ttl, failure))
    }

    fn arm_next(
        &self,
        lease: Lease,
        at: DateTime<Utc>,
    ) -> impl Future<Output = Result<Armed>> + Send {
        let done = crate::store::periodic::check_instant("at", at)
            .map(|()| self.lock().arm_next(lease, at));
        ready(done)
    }

    fn register_schedule(
        &self,
        request: RegisterSchedule<'_>,
    ) -> impl Future<Output = Result<Registered>> + Send {
        ready(self.lock().register_schedule(request))
    }

    fn next_wakeup(
        &self,
        request: ClaimRequest<'_>,
    ) -> impl Future<Output = Result<NextWakeup>> + Send {
        ready(self.lock().next_wakeup(request))
    }

    fn peek(
        &self,
        request: ClaimRequest<'_>,
    ) -> impl Future<Output = Result<Vec<(i64, String)>>> + Send {
        let st = self.lock();
        ready(st.candidates(request).map(|c| {
            c.into_iter()
                .filter_map(|(_, id)| st.rows.get(&id).map(|r| (id, r.queue.clone())))
                .collect()
        }))
    }

    fn dead_letter_enabled(&self) -> bool {
        self.lock().dead_letter
    }

    /// Hints for every insert from now on, as Postgres' `LISTEN` gives them. Moving the
    /// virtual clock sends nothing: a worker over this store finds rows made due by
    /// [`MemoryStore::advance`] at its next scan (its idle poll).
    fn wakeups(
        &self,
    ) -> impl Future<Output = Result<Option<tokio::sync::mpsc::Receiver<Wakeup>>>> + Send {
        let (tx, rx) = tokio::sync::mpsc::channel(256);
        self.lock().listeners.push(tx);
        ready(Ok(Some(rx)))
    }

    fn now(&self) -> impl Future<Output = Result<DateTime<Utc>>> + Send {
        ready(Ok(self.lock().now))
    }

    /// [`MemoryStore::stats`].
    fn queue_stats(
        &self,
        request: &StatsRequest,
    ) -> impl Future<Output = Result<Option<Vec<QueueStats>>>> + Send {
        ready(self.lock().stats(request).map(Some))
    }
}

/// Lets the functions `#[timer]` generates publish into the store:
/// `extend_presence_expiry(&store, "7", &payload, Duration::from_secs(60))`. Each call is
/// atomic on its own.
impl Publisher for &MemoryStore {
    fn publish_message<'m>(
        self,
        message: Message<'m>,
    ) -> impl Future<Output = Result<Published>> + Send {
        // The same `send` span and trace context as a publish on Postgres.
        let span = publish::send_span(&message);
        let traced = publish::with_trace_context(&span, message.headers);
        let message = Message {
            headers: traced.as_ref().or(message.headers),
            ..message
        };
        let result = span.in_scope(|| self.lock().publish(message));
        publish::sent(&span, &result);
        ready(result)
    }

    fn cancel_timer(
        self,
        queue: &str,
        timer_id: &str,
    ) -> impl Future<Output = Result<Cancelled>> + Send {
        ready(self.lock().cancel(queue, timer_id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn precision_matches_sqlx() {
        let t = DateTime::parse_from_rfc3339("2030-01-01T00:00:00.123456789Z")
            .unwrap()
            .with_timezone(&Utc);
        assert_eq!(
            to_postgres_precision(t),
            DateTime::parse_from_rfc3339("2030-01-01T00:00:00.123456Z").unwrap()
        );
        // Before 2000 sqlx truncates towards its epoch, i.e. upwards.
        let t = DateTime::parse_from_rfc3339("1999-12-31T23:59:59.000000500Z")
            .unwrap()
            .with_timezone(&Utc);
        assert_eq!(
            to_postgres_precision(t),
            DateTime::parse_from_rfc3339("1999-12-31T23:59:59.000001Z").unwrap()
        );
    }
}
