//! Dead letters: list them, **redrive** them (publish them again into their queue) and
//! **purge** them by age.
//!
//! Every operation needs the dead-letter queue on
//! ([`OutboxBuilder::dead_letter`](crate::OutboxBuilder::dead_letter), and `migrate` run
//! with it on, which adds the `redriven_at` and `redriven_id` columns and the `(failed_at)`
//! index); with it off they return [`Error::DeadLetterDisabled`] before any SQL runs. Bad
//! arguments are [`Error::InvalidArgument`], also before any SQL.
//!
//! | operation | on Postgres | in memory |
//! |---|---|---|
//! | list, filtered, in pages | [`Outbox::dead_letters`], [`PgStore::dead_letters`] | [`MemoryStore::dead_letters`] |
//! | redrive by ids or by filter | [`Outbox::redrive_dead_letters`] | [`MemoryStore::redrive_dead_letters`] |
//! | purge by age, in batches | [`Outbox::purge_dead_letters`] | [`MemoryStore::purge_dead_letters`] |
//!
//! # Listing
//!
//! A [`DeadLetterFilter`] narrows by queue, [`FailureReason`], archive time
//! (`failed_at`: an absolute half-open range, and/or an age by the database clock) and
//! whether rows already redriven are included (they are by default). Rows come **by id**
//! (the archive order), at most `limit` per call; the cursor is the last id of a page,
//! passed as `after` for the next one (keyset paging on the primary key: rows archived
//! meanwhile show up on later pages, never twice). A page shorter than `limit` is the
//! last. A page walks the primary key from the cursor and checks the filter on each row,
//! so its cost is the number of rows it passes over: the same however deep the page when
//! matches are common, more for a filter few rows match. Measured on 10^6 dead letters
//! (20 queues, 100 days): a page of 100 without a filter or of one queue, at any depth,
//! 0.4–3 ms; of one queue, one reason and a 10-day range, 160–240 ms.
//!
//! # Redrive
//!
//! A [`Redrive`] selects dead letters by id, or every row of a filter up to a limit, and
//! re-publishes each into its **original queue** with its original payload, headers and
//! timer key (a periodic timer's instant, key `schedule:<name>`, goes back as a one-off
//! message instead: without the key and the schedule's fingerprint header, so its handler
//! runs once more and the schedule itself is neither restarted nor touched), with fresh counters (`attempts_count` and `deliveries_count` 0, no retry
//! history), due now, and one more header, [`REDRIVEN_FROM_HEADER`] (`outbox-redriven-from`)
//! = the dead letter's id, replacing one already there. In the same statement the dead
//! letter gets `redriven_at` (the transaction's database time) and `redriven_id` (the new
//! queue row). The new rows wake workers as a publish does (`NOTIFY`, sent at commit).
//!
//! It runs on **your** connection or transaction (`&mut *tx`), so the redrive commits or
//! rolls back with your other writes; the library never commits it. Each row gets a
//! [`RedriveOutcome`]; rows that are not redriven are left as they were:
//!
//! - [`RedriveResult::Redriven`]: the new queue row's id;
//! - [`RedriveResult::AlreadyRedriven`]: an earlier redrive took it (a row is redriven at
//!   most once);
//! - [`RedriveResult::NotFound`]: no dead letter with that id (never archived, or purged);
//! - [`RedriveResult::TimerKeyHeld`]: a live row holds its `(queue, timer_id)` key (a timer
//!   scheduled again since), so publishing it would be a second live row for the key.
//!   Cancel or let that timer run first, then redrive again;
//! - [`RedriveResult::HeadersNotAMap`]: its stored headers are not a JSON object of strings
//!   ([`DeadLetter::raw_headers`]); no queue row may carry such headers;
//! - [`RedriveResult::HeadersTooLarge`]: with the redrive header its headers would pass
//!   [`MAX_HEADERS_BYTES`] (key and value bytes, as a publish counts them).
//!
//! **Concurrency.** The statement locks the selected dead letters with `FOR UPDATE` in id
//! order. A second redrive of the same rows at the same time (two operators) waits for the
//! first transaction to end; Postgres then re-reads each row at its latest version, so it
//! reports [`RedriveResult::AlreadyRedriven`] if the first committed, redrives the rows if
//! it rolled back, and never creates a second queue row for one dead letter. A purge never
//! waits for a redrive (it skips locked rows). Keep a redriving transaction short: it holds
//! those row locks until it ends.
//!
//! **One statement.** Locking, checking, the insert into the queue table
//! (`INSERT … ON CONFLICT (queue, timer_id) WHERE timer_id IS NOT NULL DO NOTHING`, on the
//! partial unique index that keeps one live row per timer key, after a look for the key) and the update of the dead
//! letters are data-modifying CTEs of one statement: there is no moment where a queue row
//! exists and its dead letter is unmarked. Two dead letters of one selection with the same
//! timer key: the lower id is redriven, the other reports
//! [`RedriveResult::TimerKeyHeld`]. A dead letter refused for its key is left out before
//! the insert, so it uses up no id of the queue table's identity (an `INSERT` evaluates the
//! identity default for each row it tries, before `ON CONFLICT` looks); only a row inserted
//! after the statement's snapshot still costs one. Measured on 10^6 dead
//! letters: 1000 rows by ids in 8 ms, 10 000 in 33 ms, 1000 of one queue by filter in
//! 55 ms (each rolled back).
//!
//! # Purge
//!
//! [`Outbox::purge_dead_letters`] deletes the dead letters of a filter that has an age bound
//! ([`DeadLetterFilter::failed_before`] or [`DeadLetterFilter::older_than`]), oldest first,
//! in batches of `batch_size` rows, each batch its own short transaction on the pool
//! (`ORDER BY failed_at LIMIT batch_size` through the `(failed_at)` index, so a batch costs
//! the same however large the table). Rows another transaction has locked (a redrive in
//! progress) are skipped (`FOR UPDATE SKIP LOCKED`), never waited for; a batch that deletes
//! fewer than `batch_size` rows ends the purge, and what it skipped is left for the next
//! one. Measured on 10^6 dead letters: 89 000 rows older than 90 days purged in 100
//! batches of 1000, 635 ms in all. Rows already redriven are purged too unless the filter
//! says
//! [`DeadLetterFilter::include_redriven`]`(false)`. It returns the number of rows deleted.
//! An age given by [`DeadLetterFilter::older_than`] is judged by each batch's own
//! transaction clock.
//!
//! ```no_run
//! use std::time::Duration;
//! use outbox::dlq::{DeadLetterFilter, Redrive, RedriveResult};
//! use outbox::store::FailureReason;
//!
//! # async fn f(pool: sqlx::PgPool) -> Result<(), outbox::Error> {
//! let outbox = outbox::Outbox::builder().dead_letter(true).build()?;
//! let rejected = DeadLetterFilter::new()
//!     .queue("billing.charge")
//!     .reason(FailureReason::Rejected)
//!     .include_redriven(false);
//!
//! // Page through them.
//! let mut conn = pool.acquire().await?;
//! let mut after = None;
//! loop {
//!     let page = outbox.dead_letters(&mut conn, &rejected, after, 100).await?;
//!     for letter in &page {
//!         println!("{} {:?} {}", letter.id, letter.last_error, letter.failed_at);
//!     }
//!     match page.last() {
//!         Some(last) if page.len() == 100 => after = Some(last.id),
//!         _ => break,
//!     }
//! }
//!
//! // Send up to 500 of them back, in your transaction.
//! let mut tx = pool.begin().await?;
//! let outcomes = outbox
//!     .redrive_dead_letters(&mut *tx, &Redrive::matching(rejected, 500))
//!     .await?;
//! tx.commit().await?;
//! let sent = outcomes
//!     .iter()
//!     .filter(|o| matches!(o.result, RedriveResult::Redriven { .. }))
//!     .count();
//!
//! // Retention: drop dead letters older than 30 days, 1000 rows per transaction.
//! let month = Duration::from_secs(30 * 24 * 3600);
//! let purged = outbox
//!     .purge_dead_letters(&pool, &DeadLetterFilter::new().older_than(month), 1000)
//!     .await?;
//! # let _ = (sent, purged);
//! # Ok(()) }
//! ```
//!
//! [`Outbox::dead_letters`]: crate::Outbox::dead_letters
//! [`Outbox::redrive_dead_letters`]: crate::Outbox::redrive_dead_letters
//! [`Outbox::purge_dead_letters`]: crate::Outbox::purge_dead_letters
//! [`PgStore::dead_letters`]: crate::PgStore::dead_letters
//! [`MemoryStore::dead_letters`]: crate::testing::MemoryStore::dead_letters
//! [`MemoryStore::redrive_dead_letters`]: crate::testing::MemoryStore::redrive_dead_letters
//! [`MemoryStore::purge_dead_letters`]: crate::testing::MemoryStore::purge_dead_letters
//! [`DeadLetter::raw_headers`]: crate::store::DeadLetter::raw_headers
//! [`MAX_HEADERS_BYTES`]: crate::message::MAX_HEADERS_BYTES

use std::time::Duration;

use chrono::{DateTime, Datelike, Utc};
use sqlx::postgres::types::PgInterval;
use sqlx::postgres::PgArguments;
use sqlx::query::Query;
use sqlx::{Connection, PgConnection, PgPool, Postgres, Row};

use crate::error::{Error, OutboxSql, Result};
use crate::message::{validate_queue, MAX_HEADERS_BYTES};
use crate::scope::{BindBucket, Scope};
use crate::sql::binds::{interval, micros};
use crate::sql::dlq::Dlq;
use crate::store::rows::{dead_letter_from_row, DeadLetter};
use crate::store::FailureReason;

/// The header a redrive adds to the new queue row: the dead letter's id, in decimal. A
/// handler can read it from [`Delivery::headers`](crate::store::Delivery::headers) to tell
/// a redriven delivery. Redriving a row that already carries it (a redriven row that failed
/// again) replaces the value.
pub const REDRIVEN_FROM_HEADER: &str = "outbox-redriven-from";

/// The longest [`DeadLetterFilter::older_than`]: 1000 years of 366 days.
const MAX_AGE: Duration = Duration::from_secs(1000 * 366 * 24 * 3600);

/// Which dead letters a list, redrive or purge takes. Built with its methods, each
/// condition optional; the default takes every row.
///
/// - [`queue`](Self::queue): one queue (1..=255 bytes, no NUL);
/// - [`reason`](Self::reason): one failure reason;
/// - [`failed_after`](Self::failed_after) / [`failed_before`](Self::failed_before): archived
///   at or after / strictly before an instant (`failed_at`, a half-open range, so adjacent
///   ranges do not overlap). After must be earlier than before;
/// - [`older_than`](Self::older_than): archived more than this long before the database's
///   `now()` (the transaction's start), at most 1000 years (Postgres cannot compute a time
///   before 4713 BC, so `now() - age` must stay above it);
/// - [`include_redriven`](Self::include_redriven): whether rows already redriven are
///   included (default `true`). A redrive never takes them whatever this says.
///
/// A broken rule is [`Error::InvalidArgument`] when the filter is used, before any SQL runs
/// (`field` is `queue`, `failed_at` or `older_than`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use = "a DeadLetterFilter does nothing until passed to a list, redrive or purge"]
pub struct DeadLetterFilter {
    pub(crate) queue: Option<String>,
    pub(crate) reason: Option<FailureReason>,
    pub(crate) failed_after: Option<DateTime<Utc>>,
    pub(crate) failed_before: Option<DateTime<Utc>>,
    pub(crate) older_than: Option<Duration>,
    pub(crate) include_redriven: bool,
}

impl Default for DeadLetterFilter {
    fn default() -> Self {
        DeadLetterFilter {
            queue: None,
            reason: None,
            failed_after: None,
            failed_before: None,
            older_than: None,
            include_redriven: true,
        }
    }
}

impl DeadLetterFilter {
    /// Every dead letter, redriven or not.
    pub fn new() -> Self {
        Self::default()
    }

    /// Only rows of this queue.
    pub fn queue(mut self, queue: impl Into<String>) -> Self {
        self.queue = Some(queue.into());
        self
    }

    /// Only rows archived for this reason.
    pub fn reason(mut self, reason: FailureReason) -> Self {
        self.reason = Some(reason);
        self
    }

    /// Only rows archived at or after `at` (`failed_at >= at`).
    pub fn failed_after(mut self, at: DateTime<Utc>) -> Self {
        self.failed_after = Some(at);
        self
    }

    /// Only rows archived before `at` (`failed_at < at`).
    pub fn failed_before(mut self, at: DateTime<Utc>) -> Self {
        self.failed_before = Some(at);
        self
    }

    /// Only rows archived more than `age` ago by the database clock
    /// (`failed_at < now() - age`).
    pub fn older_than(mut self, age: Duration) -> Self {
        self.older_than = Some(age);
        self
    }

    /// Whether rows already redriven are included (default `true`); `false` keeps only the
    /// rows still waiting for a decision.
    pub fn include_redriven(mut self, on: bool) -> Self {
        self.include_redriven = on;
        self
    }

    /// Whether the filter bounds the age of its rows (`failed_before` or `older_than`), as
    /// a purge requires.
    pub(crate) fn has_age_bound(&self) -> bool {
        self.failed_before.is_some() || self.older_than.is_some()
    }

    /// Checks the rules and returns what the statements bind.
    pub(crate) fn binds(&self) -> Result<FilterBinds<'_>> {
        if let Some(q) = &self.queue {
            validate_queue(q)?;
        }
        for at in [self.failed_after, self.failed_before]
            .into_iter()
            .flatten()
        {
            // Postgres' timestamptz starts at 4713 BC; chrono reaches further back.
            if at.year() < -4712 {
                return Err(Error::invalid(
                    "failed_at",
                    "the time is before postgres' earliest timestamp (4713 BC)",
                ));
            }
        }
        if let (Some(after), Some(before)) = (self.failed_after, self.failed_before) {
            if after >= before {
                return Err(Error::invalid(
                    "failed_at",
                    format!(
                        "the range is empty or inverted: failed_after ({after}) must be earlier than failed_before ({before})"
                    ),
                ));
            }
        }
        let older_than = match self.older_than {
            Some(age) if age > MAX_AGE => {
                return Err(Error::invalid("older_than", "is longer than 1000 years"))
            }
            Some(age) => Some(interval(micros(age, "older_than")?)),
            None => None,
        };
        Ok(FilterBinds {
            queue: self.queue.as_deref(),
            reason: self.reason.map(FailureReason::as_str),
            failed_after: self.failed_after,
            failed_before: self.failed_before,
            older_than,
            include_redriven: self.include_redriven,
        })
    }
}

/// A validated filter, as the statements' parameters `$1..$6`.
pub(crate) struct FilterBinds<'a> {
    queue: Option<&'a str>,
    reason: Option<&'static str>,
    failed_after: Option<DateTime<Utc>>,
    failed_before: Option<DateTime<Utc>>,
    older_than: Option<PgInterval>,
    include_redriven: bool,
}

impl<'a> FilterBinds<'a> {
    fn bind(&self, q: Query<'a, Postgres, PgArguments>) -> Query<'a, Postgres, PgArguments> {
        q.bind(self.queue)
            .bind(self.reason)
            .bind(self.failed_after)
            .bind(self.failed_before)
            .bind(self.older_than)
            .bind(self.include_redriven)
    }
}

/// Which dead letters a redrive takes: listed ids, or the rows of a filter.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use = "a Redrive does nothing until passed to `redrive_dead_letters`"]
pub struct Redrive {
    pub(crate) selection: Selection,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Selection {
    /// Ascending, each once.
    Ids(Vec<i64>),
    Matching {
        filter: DeadLetterFilter,
        limit: usize,
    },
}

impl Redrive {
    /// These dead letters (an id named twice counts once). One outcome per distinct id, in
    /// ascending order, including [`RedriveResult::NotFound`] for ids with no row. No ids:
    /// nothing to do, and no SQL runs.
    pub fn ids(ids: impl IntoIterator<Item = i64>) -> Self {
        let mut ids: Vec<i64> = ids.into_iter().collect();
        ids.sort_unstable();
        ids.dedup();
        Redrive {
            selection: Selection::Ids(ids),
        }
    }

    /// One dead letter.
    pub fn id(id: i64) -> Self {
        Redrive::ids([id])
    }

    /// The rows of `filter` not redriven yet, lowest ids first, at most `limit` of them
    /// (the filter's [`include_redriven`](DeadLetterFilter::include_redriven) does not
    /// matter: a row is redriven once). One outcome per row taken, by id; rows a concurrent
    /// redrive took while this one waited are skipped, not reported. A limit of 0 takes
    /// nothing, and no SQL runs.
    pub fn matching(filter: DeadLetterFilter, limit: usize) -> Self {
        Redrive {
            selection: Selection::Matching { filter, limit },
        }
    }
}

impl Redrive {
    /// Dead-letter ids are positive (an identity column starting at 1): an id below 1 is a
    /// mistake, refused before any SQL as `run_now` refuses one, not reported `NotFound`.
    pub(crate) fn check(&self) -> Result<()> {
        if let Selection::Ids(ids) = &self.selection {
            if let Some(bad) = ids.iter().find(|id| **id < 1) {
                return Err(Error::invalid(
                    "id",
                    format!("dead-letter ids are positive, got {bad}"),
                ));
            }
        }
        Ok(())
    }
}

/// What a redrive did with one dead letter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RedriveOutcome {
    /// The dead letter's id.
    pub dead_letter_id: i64,
    /// What happened to it.
    pub result: RedriveResult,
}

/// What a redrive did with one dead letter; see the [module docs](self) for the rules.
/// Every result but [`RedriveResult::Redriven`] left the dead letter as it was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RedriveResult {
    /// Published again; the dead letter now records `redriven_at` and `redriven_id = id`.
    Redriven {
        /// The new queue row's id.
        id: i64,
    },
    /// An earlier redrive took it.
    AlreadyRedriven {
        /// The queue row that redrive created (`redriven_id`; `None` only if someone else's
        /// SQL set `redriven_at` alone).
        redriven_id: Option<i64>,
    },
    /// No dead letter has this id.
    NotFound,
    /// A live row of the queue holds the dead letter's timer key.
    TimerKeyHeld,
    /// Its stored headers are not a JSON object of strings.
    HeadersNotAMap,
    /// With [`REDRIVEN_FROM_HEADER`] its headers would pass
    /// [`MAX_HEADERS_BYTES`].
    HeadersTooLarge {
        /// Their size with the redrive header, in bytes (keys and values).
        bytes: usize,
    },
}

impl RedriveResult {
    /// The new queue row's id, when this redrive created one.
    pub fn id(&self) -> Option<i64> {
        match *self {
            RedriveResult::Redriven { id } => Some(id),
            _ => None,
        }
    }
}

/// Refuses every dead-letter operation of an outbox or store whose dead-letter queue is off.
pub(crate) fn require_enabled(enabled: bool) -> Result<()> {
    if enabled {
        Ok(())
    } else {
        Err(Error::DeadLetterDisabled)
    }
}

/// The checks of a purge before any SQL: the filter's rules, an age bound, a batch size of
/// at least one row.
pub(crate) fn check_purge(filter: &DeadLetterFilter, batch_size: usize) -> Result<FilterBinds<'_>> {
    let binds = filter.binds()?;
    if !filter.has_age_bound() {
        return Err(Error::invalid(
            "filter",
            "a purge needs an age bound (`failed_before` or `older_than`), so that it cannot empty the table by accident",
        ));
    }
    if batch_size == 0 {
        return Err(Error::invalid("batch_size", "must be at least 1"));
    }
    Ok(binds)
}

/// The timer key a redrive re-publishes `letter` with, in the in-memory store: its own,
/// except a periodic instant's (`schedule:…`), which goes back as a one-off message without
/// a key, so a redrive never restarts a schedule or meets its live row (the redrive
/// statement's `CASE` on the key).
#[cfg(any(test, feature = "testing"))]
pub(crate) fn redrive_timer_id(letter: &DeadLetter) -> Option<String> {
    letter
        .timer_id
        .clone()
        .filter(|k| !k.starts_with(crate::sql::periodic::SCHEDULE_KEY_PREFIX))
}

/// The headers a redrive gives the new queue row, or why it cannot: the in-memory store's
/// equivalent of the checks the redrive statement makes.
#[cfg(any(test, feature = "testing"))]
pub(crate) fn redrive_headers(
    letter: &DeadLetter,
) -> std::result::Result<crate::message::Headers, RedriveResult> {
    if letter.raw_headers.is_some() {
        return Err(RedriveResult::HeadersNotAMap);
    }
    let mut headers = letter.headers.clone().unwrap_or_default();
    // A periodic instant goes back as a one-off message (see `redrive_timer_id`).
    headers.remove(crate::sql::periodic::SCHEDULE_HEADER);
    headers.insert(REDRIVEN_FROM_HEADER.to_owned(), letter.id.to_string());
    let bytes: usize = headers.iter().map(|(k, v)| k.len() + v.len()).sum();
    if bytes > MAX_HEADERS_BYTES {
        return Err(RedriveResult::HeadersTooLarge { bytes });
    }
    Ok(headers)
}

fn limit_param(limit: usize) -> i64 {
    i64::try_from(limit).unwrap_or(i64::MAX)
}

/// [`crate::Outbox::dead_letters`].
pub(crate) async fn list(
    sql: &Dlq,
    scope: Scope,
    conn: &mut PgConnection,
    filter: &DeadLetterFilter,
    after: Option<i64>,
    limit: usize,
) -> Result<Vec<DeadLetter>> {
    let binds = filter.binds()?;
    let mut db = scope.on(conn).await?;
    let rows = binds
        .bind(scope.query(sql.list.clone()))
        .bind(after.unwrap_or(i64::MIN))
        .bind(limit_param(limit))
        .fetch_all(&mut *db)
        .await
        .outbox_sql()?;
    db.done().await?;
    rows.iter().map(dead_letter_from_row).collect()
}

/// [`crate::Outbox::redrive_dead_letters`].
pub(crate) async fn redrive(
    sql: &Dlq,
    scope: Scope,
    conn: &mut PgConnection,
    redrive: &Redrive,
) -> Result<Vec<RedriveOutcome>> {
    redrive.check()?;
    let max = i64::try_from(MAX_HEADERS_BYTES).unwrap_or(i64::MAX);
    if let (Some(ids), Some(matching)) = (&sql.locate_ids, &sql.locate_matching) {
        return redrive_by_bucket(sql, (ids, matching), scope, conn, redrive, max).await;
    }
    let rows = match &redrive.selection {
        Selection::Ids(ids) => {
            if ids.is_empty() {
                return Ok(Vec::new());
            }
            let mut db = scope.on(conn).await?;
            let rows = scope
                .query(sql.redrive_ids.clone())
                .bind(ids)
                .bind(REDRIVEN_FROM_HEADER)
                .bind(max)
                .fetch_all(&mut *db)
                .await
                .outbox_sql()?;
            db.done().await?;
            rows
        }
        Selection::Matching { filter, limit } => {
            let binds = filter.binds()?;
            if *limit == 0 {
                return Ok(Vec::new());
            }
            let mut db = scope.on(conn).await?;
            let rows = binds
                .bind(scope.query(sql.redrive_matching.clone()))
                .bind(limit_param(*limit))
                .bind(REDRIVEN_FROM_HEADER)
                .bind(max)
                .fetch_all(&mut *db)
                .await
                .outbox_sql()?;
            db.done().await?;
            rows
        }
    };
    rows.iter().map(outcome_from_row).collect()
}

/// A redrive of a distributed outbox: where the selected dead letters are (one read across
/// the shards), then `redrive_ids` bucket by bucket in ascending order, each on one bucket's
/// co-located shards, all in one transaction on `conn` (a savepoint inside the caller's),
/// so the new rows exist and the dead letters are marked if and only if it commits. Two
/// redrives lock in the same order (bucket, then id): they never deadlock each other. A
/// row another redrive marks between the read and the lock is reported
/// [`RedriveResult::AlreadyRedriven`].
async fn redrive_by_bucket(
    sql: &Dlq,
    (locate_ids, locate_matching): (&sqlx::SqlStr, &sqlx::SqlStr),
    scope: Scope,
    conn: &mut PgConnection,
    redrive: &Redrive,
    max: i64,
) -> Result<Vec<RedriveOutcome>> {
    let requested: Vec<i64> = match &redrive.selection {
        Selection::Ids(ids) if ids.is_empty() => return Ok(Vec::new()),
        Selection::Ids(ids) => ids.clone(),
        Selection::Matching { limit, .. } if *limit == 0 => return Ok(Vec::new()),
        Selection::Matching { .. } => Vec::new(),
    };
    let mut tx = conn.begin().await.outbox_sql()?;
    let located = match &redrive.selection {
        Selection::Ids(ids) => scope.query(locate_ids.clone()).bind(ids),
        Selection::Matching { filter, limit } => filter
            .binds()?
            .bind(scope.query(locate_matching.clone()))
            .bind(limit_param(*limit)),
    }
    .fetch_all(&mut *tx)
    .await
    .outbox_sql()?;
    let mut by_bucket: std::collections::BTreeMap<i16, Vec<i64>> = Default::default();
    for r in &located {
        let (id, bucket): (i64, i16) = (r.try_get(0).outbox_sql()?, r.try_get(1).outbox_sql()?);
        by_bucket.entry(bucket).or_default().push(id);
    }
    let mut outcomes = Vec::new();
    let mut wakes = Vec::new();
    for (bucket, ids) in by_bucket {
        let rows = scope
            .query(sql.redrive_ids.clone())
            .bind(&ids)
            .bind(REDRIVEN_FROM_HEADER)
            .bind(max)
            .bucket(Some(bucket))
            .fetch_all(&mut *tx)
            .await
            .outbox_sql()?;
        for r in &rows {
            outcomes.push(outcome_from_row(r)?);
            let sent: Option<Vec<String>> = r.try_get(4).outbox_sql()?;
            wakes.extend(sent.into_iter().flatten().map(Some));
        }
    }
    // An id no dead letter has: the statement of a single node reports it from its list.
    let found: std::collections::HashSet<i64> = outcomes.iter().map(|o| o.dead_letter_id).collect();
    let mut missing: Vec<i64> = requested
        .into_iter()
        .filter(|id| !found.contains(id))
        .collect();
    missing.sort_unstable();
    missing.dedup();
    outcomes.extend(missing.into_iter().map(|dead_letter_id| RedriveOutcome {
        dead_letter_id,
        result: RedriveResult::NotFound,
    }));
    outcomes.sort_by_key(|o| o.dead_letter_id);
    scope.wake(&mut tx, sql.wake.as_ref(), wakes).await?;
    tx.commit().await.outbox_sql()?;
    Ok(outcomes)
}

fn outcome_from_row(row: &sqlx::postgres::PgRow) -> Result<RedriveOutcome> {
    let dead_letter_id: i64 = row.try_get(0).outbox_sql()?;
    let outcome: String = row.try_get(1).outbox_sql()?;
    let other: Option<i64> = row.try_get(2).outbox_sql()?;
    let bytes: Option<i64> = row.try_get(3).outbox_sql()?;
    let missing = |what: &str| {
        Error::Database(sqlx::Error::Decode(
            format!("the redrive of dead letter {dead_letter_id} returned no {what}").into(),
        ))
    };
    let result = match outcome.as_str() {
        "redriven" => RedriveResult::Redriven {
            id: other.ok_or_else(|| missing("queue row id"))?,
        },
        "already_redriven" => RedriveResult::AlreadyRedriven { redriven_id: other },
        "not_found" => RedriveResult::NotFound,
        "timer_key_held" => RedriveResult::TimerKeyHeld,
        "headers_not_a_map" => RedriveResult::HeadersNotAMap,
        "headers_too_large" => RedriveResult::HeadersTooLarge {
            bytes: bytes
                .and_then(|b| usize::try_from(b).ok())
                .ok_or_else(|| missing("header size"))?,
        },
        other => {
            return Err(Error::Database(sqlx::Error::Decode(
                format!("unknown redrive outcome `{other}`").into(),
            )))
        }
    };
    Ok(RedriveOutcome {
        dead_letter_id,
        result,
    })
}

/// [`crate::Outbox::purge_dead_letters`].
pub(crate) async fn purge(
    sql: &Dlq,
    scope: Scope,
    pool: &PgPool,
    filter: &DeadLetterFilter,
    batch_size: usize,
    buckets: Option<u16>,
) -> Result<u64> {
    let binds = check_purge(filter, batch_size)?;
    let batch = limit_param(batch_size);
    let mut total = 0u64;
    // A distributed outbox purges bucket by bucket (each statement on one shard), oldest
    // first within each bucket.
    let all: Vec<Option<i16>> = match buckets {
        None => vec![None],
        Some(n) => (0..n as i16).map(Some).collect(),
    };
    for bucket in all {
        loop {
            let mut db = scope.acquire(pool).await?;
            let done = binds
                .bind(scope.query(sql.purge.clone()))
                .bind(batch)
                .bucket(bucket)
                .execute(&mut *db)
                .await
                .outbox_sql()?;
            db.done().await?;
            total += done.rows_affected();
            if done.rows_affected() < batch as u64 {
                break;
            }
        }
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::Headers;

    fn invalid(e: Error) -> &'static str {
        match e {
            Error::InvalidArgument { field, .. } => field,
            other => panic!("expected an invalid argument, got {other:?}"),
        }
    }

    #[test]
    fn filter_rules() {
        let t = DateTime::from_timestamp(1_900_000_000, 0).unwrap();
        assert!(DeadLetterFilter::new().binds().is_ok());
        assert_eq!(
            invalid(DeadLetterFilter::new().queue("").binds().err().unwrap()),
            "queue"
        );
        assert_eq!(
            invalid(
                DeadLetterFilter::new()
                    .failed_after(t)
                    .failed_before(t)
                    .binds()
                    .err()
                    .unwrap()
            ),
            "failed_at",
            "an empty range"
        );
        assert_eq!(
            invalid(
                DeadLetterFilter::new()
                    .failed_after(t + chrono::TimeDelta::seconds(1))
                    .failed_before(t)
                    .binds()
                    .err()
                    .unwrap()
            ),
            "failed_at",
            "an inverted range"
        );
        assert!(DeadLetterFilter::new()
            .failed_after(t)
            .failed_before(t + chrono::TimeDelta::microseconds(1))
            .binds()
            .is_ok());
        assert_eq!(
            invalid(
                DeadLetterFilter::new()
                    .older_than(MAX_AGE + Duration::from_secs(1))
                    .binds()
                    .err()
                    .unwrap()
            ),
            "older_than"
        );
    }

    #[test]
    fn purge_rules() {
        assert_eq!(
            invalid(check_purge(&DeadLetterFilter::new(), 10).err().unwrap()),
            "filter",
            "no age bound"
        );
        let aged = DeadLetterFilter::new().older_than(Duration::from_secs(1));
        assert_eq!(invalid(check_purge(&aged, 0).err().unwrap()), "batch_size");
        assert!(check_purge(&aged, 1).is_ok());
    }

    #[test]
    fn redrive_ids_are_sorted_and_distinct() {
        assert_eq!(
            Redrive::ids([3, 1, 3, 2]).selection,
            Selection::Ids(vec![1, 2, 3])
        );
    }

    #[test]
    fn headers_of_a_redriven_row() {
        let letter = |headers: Option<Headers>, raw: Option<&str>| DeadLetter {
            id: 42,
            original_id: 7,
            queue: "q".to_owned(),
            payload: Vec::new(),
            headers,
            raw_headers: raw.map(str::to_owned),
            timer_id: None,
            attempts_count: 0,
            deliveries_count: 0,
            created_at: DateTime::UNIX_EPOCH,
            failed_at: DateTime::UNIX_EPOCH,
            failure_reason: "rejected".to_owned(),
            last_error: None,
            redriven_at: None,
            redriven_id: None,
        };
        let got = redrive_headers(&letter(None, None)).unwrap();
        assert_eq!(
            got.get(REDRIVEN_FROM_HEADER).map(String::as_str),
            Some("42")
        );
        assert_eq!(
            redrive_headers(&letter(None, Some("[1]"))),
            Err(RedriveResult::HeadersNotAMap)
        );
        // Exactly at the limit passes; one byte more does not. The header counts 20 + 2.
        let fill = |n: usize| Headers::from([("k".to_owned(), "v".repeat(n - 1))]);
        let at_limit = fill(MAX_HEADERS_BYTES - 22);
        assert!(redrive_headers(&letter(Some(at_limit), None)).is_ok());
        let over = fill(MAX_HEADERS_BYTES - 21);
        assert_eq!(
            redrive_headers(&letter(Some(over), None)),
            Err(RedriveResult::HeadersTooLarge {
                bytes: MAX_HEADERS_BYTES + 1
            })
        );
        // A header already there is replaced, not counted twice.
        let again = Headers::from([(REDRIVEN_FROM_HEADER.to_owned(), "9".repeat(100))]);
        let got = redrive_headers(&letter(Some(again), None)).unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!(got[REDRIVEN_FROM_HEADER], "42");
    }
}
