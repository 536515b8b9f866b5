//! Queue statistics: how deep and how late each queue is, read in one statement.
//!
//! [`Outbox::stats`](crate::Outbox::stats) answers a [`StatsRequest`] with one
//! [`QueueStats`] per queue, sorted by queue name (byte order):
//!
//! | figure | rows counted |
//! |---|---|
//! | `pending` | unleased rows (`acquired_token IS NULL`), due or not; a row waiting for a retry is pending |
//! | `due` | pending rows whose deadline has passed (`next_attempt_at <= now()`): what a claim would take now |
//! | `leased` | rows a worker holds (`acquired_token IS NOT NULL`) |
//! | `expired_leases` | leased rows whose lease is older than the queue's `lease_ttl` (`acquired_at < now() - lease_ttl`, the claim's own test): a dead worker's rows, claimable again |
//! | `oldest_due_lateness` | `now()` minus the earliest deadline among due rows; `None` when nothing is due |
//! | `rearms` | leased rows with a queued rearm (`rearm_at IS NOT NULL`): extends that landed while the handler ran |
//! | `cancel_marks` | leased rows a cancel reached while they ran (`cancelled_at IS NOT NULL`) |
//! | `dead_letters` | rows of the dead-letter table not redriven (`redriven_at IS NULL`) |
//!
//! Every time comparison uses the database clock (`now()`, the start of the statement's
//! transaction), never the application's. The statement takes no row lock and writes
//! nothing, so it never delays a claim or a completion; it reads one snapshot, so the
//! figures of one answer are consistent with each other.
//!
//! # Which queues
//!
//! With [`StatsRequest::queues`], exactly those queues, each once (a queue without any row
//! gets zeros). Without, every queue that has a live row or a dead letter: a queue whose
//! only rows are dead letters is listed too. In [`StatsMode::Estimate`] without a list,
//! every queue with a pending or leased row, and the dead-letter queues the planner's
//! statistics name (see below).
//!
//! # Lease TTL
//!
//! Whether a lease has expired depends on the `lease_ttl` of the workers serving the queue,
//! which the table does not record: give it ([`StatsRequest::new`]), and per queue where
//! workers differ ([`StatsRequest::lease_ttl_for`]).
//!
//! # Dead letters
//!
//! Counted only when the [`Outbox`](crate::Outbox) has its dead-letter queue on
//! ([`OutboxBuilder::dead_letter`](crate::OutboxBuilder::dead_letter)); off, the
//! statement does not read the dead-letter table and `dead_letters` is
//! [`Count::Unavailable`]. A dead letter once redriven stays in the table (until purged)
//! but is no longer counted. The count reads `redriven_at`, which an upgrade step adds to
//! tables of older deployments: [`Outbox::migrate`](crate::Outbox::migrate) with the
//! dead-letter queue on adds it (without it the call fails with
//! [`Error::UpgradeRequired`]).
//!
//! # Modes
//!
//! [`StatsMode::Exact`] counts rows: one statement that groups the queue table's unleased
//! rows by queue, its leased rows by queue, and the dead-letter table's rows by queue, and
//! joins the three (a queue with only dead letters still appears). Its cost grows with the
//! rows (see "Cost").
//!
//! [`StatsMode::Estimate`] reads the planner's figures instead of the backlog, so its cost
//! does not grow with it. Figure by figure:
//!
//! | figure | in estimate mode |
//! |---|---|
//! | `pending` | [`Count::Estimate`]: the table's `pg_class.reltuples` × the queue's frequency in `pg_stats` for the `queue` column (its entry in `most_common_vals`, or for a queue outside that list the frequency the planner assumes: the rest shared among the other distinct values), minus the queue's leased rows (counted now). As of the last `ANALYZE` (autovacuum's or yours); [`Count::Unavailable`] when the table was never analyzed |
//! | `due` | [`Count::Unavailable`]: no statistic splits pending rows by deadline per queue |
//! | `leased`, `expired_leases`, `rearms`, `cancel_marks` | [`Count::Exact`], counted as in exact mode: leased rows are found through `<table>_lease_idx`, and every worker bounds the leases it holds, so this part does not grow with the backlog |
//! | `oldest_due_lateness` | exact: one probe of `<table>_pending_idx` per queue (the earliest unleased deadline) |
//! | `dead_letters` | [`Count::Estimate`]: the dead-letter table's `reltuples` × the queue's frequency there × the fraction of NULL `redriven_at` in `pg_stats`; [`Count::Unavailable`] before its first `ANALYZE` or with the dead-letter queue off |
//!
//! Without a queue list, estimate mode lists every queue with a pending row, found by a
//! skip scan of the pending index (one index probe per distinct queue, so the cost grows
//! with the number of queues, not of rows), every queue with leased rows, and the
//! dead-letter table's queues in `most_common_vals` (with the default statistics target of
//! 100, every queue that appears at least twice in the `ANALYZE` sample when there are at
//! most 100 queues); name a rarer dead-letter queue in [`StatsRequest::queues`]. A table
//! never analyzed (`reltuples` is -1) gives [`Count::Unavailable`] for `pending`: run
//! `ANALYZE` on it (autovacuum does once enough rows have changed).
//!
//! [`MemoryStore::stats`](crate::testing::MemoryStore::stats) answers the same request
//! with exact counts, in either mode.
//!
//! # The queue-depth gauge
//!
//! A worker built with
//! [`WorkerBuilder::queue_depth_gauge`](crate::WorkerBuilder::queue_depth_gauge) reads
//! these statistics for every queue, once per process every interval (15 s at least), and
//! sets them as the gauges `outbox_queue_depth{queue, state}` and
//! `outbox_queue_oldest_due_lateness_seconds{queue}` through the `metrics` facade.
//!
//! # Cost
//!
//! Exact mode reads every pending row's entry of `<table>_pending_idx (queue,
//! next_attempt_at) WHERE acquired_token IS NULL`, which holds every column the pending
//! branch needs (an index-only scan where the visibility map is set, as after a vacuum;
//! before, the planner reads the heap), the leased rows through `<table>_lease_idx`, and the
//! whole dead-letter table (a sequential scan: `redriven_at` is in no index). So its cost
//! grows with the pending rows and the dead letters; the leased part is bounded by the
//! leases the workers hold. Estimate mode reads the leased rows, one entry of
//! `<table>_pending_idx` per queue and the catalog: no scan of the backlog (a test checks
//! its plan).
//!
//! Measured with `cargo run --release -p outbox-lab -- stats --rows 1000000` (the
//! harness's `stats` command: a database of its own, created and dropped), PostgreSQL 15 on
//! 2 shared cores, `shared_buffers` 128 MB, `jit` on but never reached (every plan stays
//! under `jit_above_cost`), no parallel workers chosen: 10⁶ rows over 8 queues (275 MB with
//! indexes), half of them due, one in 97 leased (10 310 leases), 10⁵ dead letters. Median
//! of 5 reads, in ms:
//!
//! | read | after `ANALYZE` only | after `VACUUM ANALYZE` | plan |
//! |---|---:|---:|---|
//! | exact, every queue | 335 | 187 | a sequential scan of the queue table (after the vacuum: an index-only scan of `<table>_pending_idx`, 989 691 entries, 0 heap fetches); a bitmap scan of `<table>_lease_idx` (10 310 rows); a sequential scan of the dead-letter table |
//! | exact, one queue | 307 | 35 | a bitmap heap scan of the queue's 123 711 pending rows (after the vacuum: index-only); the queue's 1 288 leased rows; a bitmap scan of its 11 250 dead letters |
//! | estimate, every queue | 42 | 46 | the bitmap scan of the 10 310 leased rows; 8 index-only probes of `<table>_pending_idx` |
//! | estimate, one queue | 12 | 8 | the queue's 1 288 leased rows; 1 probe |
//!
//! Without dead letters (`--dead-letters 0`) exact for every queue took 209 ms and 96 ms:
//! the 10⁵ dead letters cost about 100 ms of it. The estimates came within 4 % of the
//! exact pending counts; the dead-letter estimates assume redriven rows spread evenly over
//! the queues. Exact reads at this size suit an operator's command and a gauge read every
//! 15 s or more (0.1–0.3 s of one server core per read); past 10⁷ rows, or with a large
//! dead-letter table, read the gauge in estimate mode.
//!
//! ```no_run
//! # async fn f(pool: sqlx::PgPool) -> Result<(), outbox::Error> {
//! use std::time::Duration;
//! use outbox::stats::{StatsMode, StatsRequest};
//!
//! let outbox = outbox::Outbox::builder().dead_letter(true).build()?;
//! let mut conn = pool.acquire().await?;
//! let request = StatsRequest::new(Duration::from_secs(60))
//!     .lease_ttl_for("reports", Duration::from_secs(600));
//! for q in outbox.stats(&mut conn, &request).await? {
//!     println!("{}: {} pending, {} due, late by {:?}", q.queue, q.pending, q.due, q.oldest_due_lateness);
//! }
//! let rough = outbox.stats(&mut conn, &request.clone().mode(StatsMode::Estimate)).await?;
//! # Ok(()) }
//! ```

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::postgres::types::PgInterval;
use sqlx::postgres::PgRow;
use sqlx::{PgConnection, Row};

use crate::error::{Error, OutboxSql, Result};
use crate::message::{validate_queue, MAX_DELAY};
use crate::scope::Scope;
use crate::sql;
use crate::sql::binds::{interval, micros};

/// How [`Outbox::stats`](crate::Outbox::stats) gets its figures; see the
/// [module docs](self) for what each figure is in each mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum StatsMode {
    /// Count the rows: every figure exact, cost O(rows).
    #[default]
    Exact,
    /// Pending rows and dead letters from the planner's statistics (as of the last
    /// `ANALYZE`), leases counted exactly, `due` not measured; cost independent of the
    /// backlog.
    Estimate,
}

/// One figure of a [`QueueStats`]: counted, estimated, or not measured in this mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Count {
    /// Counted by the statement, as of its snapshot.
    Exact(u64),
    /// Derived from the planner's statistics (as of the last `ANALYZE`).
    Estimate(u64),
    /// Not measured: the mode cannot tell it, or the table it lives in is not read (the
    /// dead-letter table with the dead-letter queue off, a table never analyzed).
    Unavailable,
}

impl Count {
    /// The number, exact or estimated; `None` when unavailable.
    pub fn value(self) -> Option<u64> {
        match self {
            Count::Exact(n) | Count::Estimate(n) => Some(n),
            Count::Unavailable => None,
        }
    }

    /// Whether it was counted.
    pub fn is_exact(self) -> bool {
        matches!(self, Count::Exact(_))
    }
}

/// `12`, `~12` for an estimate, `-` when unavailable; width and alignment apply
/// (`{:>8}`).
impl fmt::Display for Count {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Count::Exact(n) => f.pad(&n.to_string()),
            Count::Estimate(n) => f.pad(&format!("~{n}")),
            Count::Unavailable => f.pad("-"),
        }
    }
}

/// The figures of one queue; the [module docs](self) say which rows each counts.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct QueueStats {
    /// The queue.
    pub queue: String,
    /// Unleased rows, due or not.
    pub pending: Count,
    /// Unleased rows whose deadline has passed.
    pub due: Count,
    /// Rows a worker holds.
    pub leased: Count,
    /// Leased rows whose lease is older than the queue's `lease_ttl`.
    pub expired_leases: Count,
    /// How long the earliest due row has been due (database clock, microseconds); `None`
    /// when no row is due.
    pub oldest_due_lateness: Option<Duration>,
    /// Leased rows with a queued rearm.
    pub rearms: Count,
    /// Leased rows a cancel reached.
    pub cancel_marks: Count,
    /// Dead letters not redriven.
    pub dead_letters: Count,
}

/// What [`Outbox::stats`](crate::Outbox::stats) reads: which queues, in which
/// [`StatsMode`], with which lease TTLs to judge expiry.
///
/// ```
/// use std::time::Duration;
/// use outbox::stats::{StatsMode, StatsRequest};
///
/// let request = StatsRequest::new(Duration::from_secs(60))
///     .lease_ttl_for("reports", Duration::from_secs(600))
///     .queues(["emails", "reports"])
///     .mode(StatsMode::Estimate);
/// assert_eq!(request.lease_ttl_of("reports"), Duration::from_secs(600));
/// assert_eq!(request.lease_ttl_of("emails"), Duration::from_secs(60));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use = "a StatsRequest reads nothing until passed to `Outbox::stats`"]
pub struct StatsRequest {
    lease_ttl: Duration,
    lease_ttls: BTreeMap<String, Duration>,
    queues: Option<Vec<String>>,
    mode: StatsMode,
}

impl StatsRequest {
    /// Every queue, exact counts, leases older than `lease_ttl` counted as expired (give
    /// the `lease_ttl` your workers use; theirs defaults to 60 s).
    pub fn new(lease_ttl: Duration) -> Self {
        StatsRequest {
            lease_ttl,
            lease_ttls: BTreeMap::new(),
            queues: None,
            mode: StatsMode::Exact,
        }
    }

    /// Judges the leases of `queue` by `ttl` instead (the `lease_ttl` of the workers that
    /// serve it). A second call for the same queue replaces the first.
    pub fn lease_ttl_for(mut self, queue: impl Into<String>, ttl: Duration) -> Self {
        self.lease_ttls.insert(queue.into(), ttl);
        self
    }

    /// Reads only these queues (each once, whether it has rows or not) instead of every
    /// queue. An empty list reads nothing.
    pub fn queues<Q: Into<String>>(mut self, queues: impl IntoIterator<Item = Q>) -> Self {
        let mut list: Vec<String> = queues.into_iter().map(Into::into).collect();
        list.sort_unstable();
        list.dedup();
        self.queues = Some(list);
        self
    }

    /// Counts or estimates (default [`StatsMode::Exact`]).
    pub fn mode(mut self, mode: StatsMode) -> Self {
        self.mode = mode;
        self
    }

    /// The lease TTL expiry is judged by for `queue`.
    pub fn lease_ttl_of(&self, queue: &str) -> Duration {
        self.lease_ttls
            .get(queue)
            .copied()
            .unwrap_or(self.lease_ttl)
    }

    /// The queues to read; `None` for every queue.
    pub fn queue_list(&self) -> Option<&[String]> {
        self.queues.as_deref()
    }

    /// The mode.
    pub fn stats_mode(&self) -> StatsMode {
        self.mode
    }

    /// Checks every argument (before any SQL runs): queue names of 1..=255 bytes without
    /// NUL, lease TTLs above zero and at most [`MAX_DELAY`](crate::message::MAX_DELAY).
    pub(crate) fn validate(&self) -> Result<()> {
        check_ttl(self.lease_ttl)?;
        for (queue, ttl) in &self.lease_ttls {
            validate_queue(queue)?;
            check_ttl(*ttl)?;
        }
        for queue in self.queues.iter().flatten() {
            validate_queue(queue)?;
        }
        Ok(())
    }
}

fn check_ttl(ttl: Duration) -> Result<()> {
    if ttl.is_zero() {
        return Err(Error::invalid(
            "lease_ttl",
            "must be above zero: every lease would count as expired",
        ));
    }
    if ttl > MAX_DELAY {
        return Err(Error::invalid(
            "lease_ttl",
            "is longer than 10 000 years of 366 days (overflow)",
        ));
    }
    Ok(())
}

/// The figures of a queue with no row at all: zeros, except what the mode cannot tell.
fn empty(queue: &str, mode: StatsMode, dead_letter: bool) -> QueueStats {
    let (exact, unavailable) = (Count::Exact(0), Count::Unavailable);
    let dead_letters = match (dead_letter, mode) {
        (false, _) => unavailable,
        (true, StatsMode::Exact) => exact,
        (true, StatsMode::Estimate) => Count::Estimate(0),
    };
    let (pending, due) = match mode {
        StatsMode::Exact => (exact, exact),
        StatsMode::Estimate => (Count::Estimate(0), unavailable),
    };
    QueueStats {
        queue: queue.to_owned(),
        pending,
        due,
        leased: exact,
        expired_leases: exact,
        oldest_due_lateness: None,
        rearms: exact,
        cancel_marks: exact,
        dead_letters,
    }
}

/// Sorts by queue (byte order) and, for a request with a queue list, adds the listed
/// queues the answer lacks, with zeros.
pub(crate) fn complete(
    mut out: Vec<QueueStats>,
    list: Option<&[String]>,
    mode: StatsMode,
    dead_letter: bool,
) -> Vec<QueueStats> {
    for q in list.into_iter().flatten() {
        if !out.iter().any(|s| &s.queue == q) {
            out.push(empty(q, mode, dead_letter));
        }
    }
    out.sort_by(|a, b| a.queue.cmp(&b.queue));
    out
}

/// Reads the statistics on `conn` ([`crate::Outbox::stats`]).
pub(crate) async fn read(
    sql: &sql::stats::Stats,
    scope: Scope,
    dead_letter: bool,
    conn: &mut PgConnection,
    request: &StatsRequest,
) -> Result<Vec<QueueStats>> {
    request.validate()?;
    if request.queue_list().is_some_and(<[String]>::is_empty) {
        return Ok(Vec::new());
    }
    let default_ttl = interval(micros(request.lease_ttl, "lease_ttl")?);
    let (ttl_queues, ttls): (Vec<&str>, Vec<PgInterval>) = request
        .lease_ttls
        .iter()
        .map(|(q, t)| Ok((q.as_str(), interval(micros(*t, "lease_ttl")?))))
        .collect::<Result<Vec<_>>>()?
        .into_iter()
        .unzip();
    let queues = request.queue_list();
    let statement = match (request.mode, queues.is_some(), dead_letter) {
        (StatsMode::Exact, false, true) => &sql.exact,
        (StatsMode::Exact, true, true) => &sql.exact_queues,
        (StatsMode::Exact, false, false) => &sql.exact_no_dlq,
        (StatsMode::Exact, true, false) => &sql.exact_queues_no_dlq,
        (StatsMode::Estimate, false, _) => &sql.estimate,
        (StatsMode::Estimate, true, _) => &sql.estimate_queues,
    };
    let mut query = scope
        .query(statement.clone())
        .bind(default_ttl)
        .bind(ttl_queues)
        .bind(ttls);
    if request.mode == StatsMode::Estimate {
        query = query.bind(dead_letter);
    }
    if let Some(list) = queues {
        query = query.bind(list);
    }
    let mut db = scope.on(conn).await?;
    let rows = query.fetch_all(&mut *db).await.outbox_sql()?;
    db.done().await?;
    let out = rows
        .iter()
        .map(|r| decode(r, request.mode))
        .collect::<Result<Vec<_>>>()?;
    Ok(complete(out, queues, request.mode, dead_letter))
}

/// Decodes the columns `sql::stats` documents, in order.
fn decode(r: &PgRow, mode: StatsMode) -> Result<QueueStats> {
    let count = |i: usize| -> Result<Option<u64>> {
        Ok(r.try_get::<Option<i64>, _>(i)
            .outbox_sql()?
            .map(|n| u64::try_from(n).unwrap_or(0)))
    };
    let exact =
        |i: usize| -> Result<Count> { Ok(count(i)?.map_or(Count::Unavailable, Count::Exact)) };
    let estimated = |i: usize| -> Result<Count> {
        Ok(match mode {
            StatsMode::Exact => count(i)?.map_or(Count::Unavailable, Count::Exact),
            StatsMode::Estimate => count(i)?.map_or(Count::Unavailable, Count::Estimate),
        })
    };
    let oldest: Option<DateTime<Utc>> = r.try_get(8).outbox_sql()?;
    let now: DateTime<Utc> = r.try_get(9).outbox_sql()?;
    Ok(QueueStats {
        queue: r.try_get(0).outbox_sql()?,
        pending: estimated(1)?,
        due: exact(2)?,
        leased: exact(3)?,
        expired_leases: exact(4)?,
        rearms: exact(5)?,
        cancel_marks: exact(6)?,
        dead_letters: estimated(7)?,
        oldest_due_lateness: oldest.map(|at| lateness(now, at)),
    })
}

/// `now - at`, never negative.
pub(crate) fn lateness(now: DateTime<Utc>, at: DateTime<Utc>) -> Duration {
    (now - at).to_std().unwrap_or(Duration::ZERO)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_requests_name_the_field() {
        let field = |r: StatsRequest| match r.validate() {
            Err(Error::InvalidArgument { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        let ok = StatsRequest::new(Duration::from_secs(60));
        assert!(ok.validate().is_ok());
        assert_eq!(field(StatsRequest::new(Duration::ZERO)), "lease_ttl");
        assert_eq!(
            field(StatsRequest::new(MAX_DELAY + Duration::from_secs(1))),
            "lease_ttl"
        );
        assert_eq!(
            field(ok.clone().lease_ttl_for("q", Duration::ZERO)),
            "lease_ttl"
        );
        assert_eq!(
            field(ok.clone().lease_ttl_for("", Duration::from_secs(1))),
            "queue"
        );
        assert_eq!(field(ok.clone().queues(["ok", "a\0b"])), "queue");
        assert_eq!(field(ok.queues(["x".repeat(256)])), "queue");
    }

    #[test]
    fn listed_queues_are_sorted_once_and_filled_with_zeros() {
        let r = StatsRequest::new(Duration::from_secs(1)).queues(["b", "a", "b"]);
        assert_eq!(r.queue_list(), Some(&["a".to_owned(), "b".to_owned()][..]));
        let got = complete(Vec::new(), r.queue_list(), StatsMode::Exact, true);
        assert_eq!(got.len(), 2);
        assert_eq!(got[0], empty("a", StatsMode::Exact, true));
        assert_eq!(got[1].dead_letters, Count::Exact(0));
        let est = complete(Vec::new(), r.queue_list(), StatsMode::Estimate, false);
        assert_eq!(est[0].pending, Count::Estimate(0));
        assert_eq!(est[0].due, Count::Unavailable);
        assert_eq!(est[0].dead_letters, Count::Unavailable);
    }

    #[test]
    fn counts_print_their_kind() {
        assert_eq!(Count::Exact(3).to_string(), "3");
        assert_eq!(Count::Estimate(3).to_string(), "~3");
        assert_eq!(Count::Unavailable.to_string(), "-");
        assert_eq!(
            format!("{:>4}|{:<4}|", Count::Estimate(3), Count::Exact(5)),
            "  ~3|5   |"
        );
        assert_eq!(Count::Estimate(3).value(), Some(3));
        assert!(!Count::Estimate(3).is_exact());
    }
}
