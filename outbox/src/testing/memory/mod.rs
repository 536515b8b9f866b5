//! [`MemoryStore`]: the storage contract of [`PgStore`](crate::PgStore) in memory, on a
//! virtual clock.
//!
//! Every operation mirrors one statement of `sql/`; the comments name the SQL detail each
//! branch reproduces. The project's contract suite and model-based test run the same
//! scenarios against both stores and compare the rows.
//!
//! One file per statement family, named as in `sql/`: `publish.rs`, `cancel.rs`,
//! `claim.rs`, `complete.rs`, `periodic.rs`, `read.rs`, `dlq.rs`, `stats.rs`, `admin.rs`.
//! Each holds the [`State`] operations that mirror its statements and the inherent
//! `MemoryStore` methods that call them; `state.rs` holds the tables, the clock and what
//! every family shares. This file holds the store itself, its clock and seeding methods,
//! and the [`Store`] implementation the worker drives.

mod admin;
mod cancel;
mod claim;
mod complete;
mod dlq;
mod periodic;
mod publish;
mod read;
mod state;
mod stats;

use std::fmt;
use std::future::{ready, Future};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use chrono::{DateTime, Utc};

// Named by the docs only.
#[cfg(doc)]
use crate::{message::Schedule, timer::Publisher};

use self::state::{plus, row_order, to_postgres_precision, State};
use crate::error::{Error, Result};
use crate::stats::{QueueStats, StatsRequest};
use crate::store::rows::{DeadLetter, StoredRow};
use crate::store::{
    Armed, ClaimRequest, Completion, Delivery, Failure, Lease, NextWakeup, RegisterSchedule,
    Registered, Release, Released, Renewal, Store, Wakeup,
};

/// An in-memory [`Store`] with the same observable behaviour as [`PgStore`](crate::PgStore),
/// for testing handlers and timer logic without a database.
///
/// What "the same" means: for the same sequence of operations, both stores return the same
/// outcomes and hold the same rows: ids count up from 1, one per row inserted (a publish,
/// registration or redrive that finds its key held uses up none), one random lease token
/// per claim, the same deliveries and attempts counts, retry history, rearm columns and
/// dead-letter rows, and timestamps at Postgres' precision (whole microseconds). The project's contract suite checks this
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
///   queues rotated after [`ClaimRequest::resume_after`], each queue's rows by deadline,
///   then id.
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
}

impl crate::store::sealed::Sealed for MemoryStore {}

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
