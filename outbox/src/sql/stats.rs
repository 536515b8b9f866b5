//! Queue statistics: one read-only statement per request, no row locks, so it never delays a
//! claim or a completion. `stats.rs` executes it and decodes the rows.
//!
//! Every variant returns the same columns, in this order: `queue`, `pending`, `due`,
//! `leased`, `expired_leases`, `rearms`, `cancel_marks`, `dead_letters` (bigint, NULL when
//! the variant does not measure it), `oldest_due` (the earliest deadline of an unleased row,
//! when it has passed), `now()` (the database clock the figures were taken at).
//!
//! Parameters common to every variant: `$1 interval` the default lease TTL, `$2 text[]` and
//! `$3 interval[]` per-queue TTLs (parallel arrays, each queue once). The `*_queues` variants
//! read only the queues of their last parameter (`text[]`).

use sqlx::SqlStr;

use super::text::query;
use crate::names::{quote_literal, Names};

#[derive(Debug)]
pub(crate) struct Stats {
    /// Exact counts of every queue; `$1`–`$3`.
    pub exact: SqlStr,
    /// Exact counts of the queues `$4 text[]`.
    pub exact_queues: SqlStr,
    /// As `exact`, without the dead-letter table (its `dead_letters` is NULL).
    pub exact_no_dlq: SqlStr,
    /// As `exact_queues`, without the dead-letter table.
    pub exact_queues_no_dlq: SqlStr,
    /// Planner estimates for the queues the statistics know; `$4 boolean` whether to
    /// estimate dead letters.
    pub estimate: SqlStr,
    /// Planner estimates for the queues `$5 text[]`; `$4` as in `estimate`.
    pub estimate_queues: SqlStr,
}

/// The per-queue lease TTLs (`$2`, `$3`) as a relation.
const TTLS: &str = "SELECT queue, ttl FROM unnest($2::text[], $3::interval[]) AS o(queue, ttl)";

/// Counts of the leased rows of each queue. `<t>_lease_idx (queue, acquired_at) WHERE
/// acquired_token IS NOT NULL` finds them (its predicate is this `WHERE`'s), so the cost
/// follows the leases held, which every worker bounds, not the backlog; the heap is read
/// for the rearm and cancel columns of those rows only. Expiry is the claim's test
/// (`acquired_at < now() - ttl`), with the queue's own TTL where one is given.
fn leased(t: &str, only: &str) -> String {
    format!(
        r#"
    SELECT l.queue::text AS queue, count(*) AS leased,
           count(*) FILTER (WHERE l.acquired_at < now() - coalesce(ttls.ttl, $1::interval)) AS expired,
           count(*) FILTER (WHERE l.rearm_at IS NOT NULL) AS rearms,
           count(*) FILTER (WHERE l.cancelled_at IS NOT NULL) AS cancel_marks
    FROM {t} l LEFT JOIN ttls ON ttls.queue = l.queue
    WHERE l.acquired_token IS NOT NULL{only}
    GROUP BY l.queue"#
    )
}

/// Exact counts: every pending row is counted (`<t>_pending_idx (queue, next_attempt_at)
/// WHERE acquired_token IS NULL` holds both columns the branch reads, so an index-only scan
/// can serve it where the visibility map allows), the leased rows through `<t>_lease_idx`,
/// and the dead letters not yet redriven by a scan of the dead-letter table. O(rows).
fn exact(n: &Names, queues: bool, dlq: bool) -> String {
    let t = &n.qtable;
    let d = &n.qdlq;
    let only = |col: &str| {
        if queues {
            format!(" AND {col} = ANY($4::text[])")
        } else {
            String::new()
        }
    };
    let (pending_only, leased_only) = (only("queue"), only("l.queue"));
    let leased = leased(t, &leased_only);
    let (dead, dead_col) = if dlq {
        (
            format!(
                "SELECT queue::text AS queue, count(*) AS dead_letters FROM {d}\n    \
                 WHERE redriven_at IS NULL{} GROUP BY queue",
                only("queue")
            ),
            "coalesce(d.dead_letters, 0)",
        )
    } else {
        (
            "SELECT NULL::text AS queue, NULL::bigint AS dead_letters WHERE false".to_owned(),
            "d.dead_letters",
        )
    };
    format!(
        r#"
WITH ttls AS (
    {TTLS}
), pending AS (
    SELECT queue::text AS queue, count(*) AS pending,
           count(*) FILTER (WHERE next_attempt_at <= now()) AS due,
           min(next_attempt_at) AS earliest
    FROM {t}
    WHERE acquired_token IS NULL{pending_only}
    GROUP BY queue
), leased AS ({leased}
), dead AS (
    {dead}
)
SELECT queue, coalesce(p.pending, 0), coalesce(p.due, 0), coalesce(l.leased, 0),
       coalesce(l.expired, 0), coalesce(l.rearms, 0), coalesce(l.cancel_marks, 0), {dead_col},
       CASE WHEN p.earliest <= now() THEN p.earliest END, now()
FROM pending p FULL JOIN leased l USING (queue) FULL JOIN dead d USING (queue)"#
    )
}

/// What `ANALYZE` recorded for the `queue` column of `table` (a quoted, qualified name as
/// a literal), as three relations named `<p>_stat` (its `reltuples`, when the table has been
/// vacuumed or analyzed), `<p>_mcv` (the most common queues and their frequencies) and
/// `<p>_other` (the frequency the planner assumes for a queue outside that list: the rest,
/// shared by the other distinct values, at most the least common listed frequency).
/// `to_regclass` makes a missing table an empty relation instead of an error; `when` gates
/// the whole read (a constant or a parameter).
fn column_stats(p: &str, table_literal: &str, when: &str) -> String {
    format!(
        r#"{p}_stat AS (
    SELECT c.reltuples::float8 AS reltuples,
           s.most_common_vals::text::text[] AS vals, s.most_common_freqs AS freqs,
           s.null_frac::float8 AS null_frac,
           CASE WHEN s.n_distinct < 0 THEN -s.n_distinct * c.reltuples ELSE s.n_distinct END
             AS distinct_values
    FROM pg_class c
    JOIN pg_namespace ns ON ns.oid = c.relnamespace
    LEFT JOIN pg_stats s ON s.schemaname = ns.nspname AND s.tablename = c.relname
                         AND s.attname = 'queue' AND NOT s.inherited
    WHERE c.oid = to_regclass({table_literal}) AND c.reltuples >= 0 AND {when}
), {p}_mcv AS (
    SELECT v.queue, v.freq::float8 AS freq
    FROM {p}_stat, unnest({p}_stat.vals, {p}_stat.freqs) AS v(queue, freq)
), {p}_other AS (
    SELECT least(
             greatest(1 - coalesce((SELECT sum(f) FROM unnest(freqs) AS f), 0) - null_frac, 0)
               / greatest(distinct_values - coalesce(cardinality(vals), 0), 1),
             coalesce(freqs[cardinality(freqs)], 1))::float8 AS freq
    FROM {p}_stat WHERE distinct_values IS NOT NULL
)"#
    )
}

/// Planner estimates: the rows of each queue from `reltuples` × the queue's frequency in
/// `pg_stats` (no scan), minus its leased rows; leased rows, expired leases, rearms and
/// cancel marks counted exactly as in `exact` (bounded by the leases held); the oldest due
/// deadline by one probe of `<t>_pending_idx` per queue (min/max optimisation: an index scan
/// with `LIMIT 1`); dead letters from the dead-letter table's `reltuples` × the queue's
/// frequency × the fraction of NULL `redriven_at` (not redriven).
fn estimate(n: &Names, queues: bool) -> String {
    let t = &n.qtable;
    let tstats = column_stats("t", &n.table_literal(), "true");
    let dstats = column_stats("d", &quote_literal(&n.qdlq), "$4::boolean");
    let leased = leased(
        t,
        if queues {
            " AND l.queue = ANY($5::text[])"
        } else {
            ""
        },
    );
    let set = if queues {
        "SELECT DISTINCT queue FROM unnest($5::text[]) AS x(queue)"
    } else {
        "SELECT queue FROM pending_queues UNION SELECT queue FROM leased \
         UNION SELECT queue FROM d_mcv"
    };
    // Every queue with a pending row, by a skip scan of `<t>_pending_idx` (one index probe
    // per distinct queue, in queue order): the planner's most common values miss rare
    // queues, and a table never analyzed has none at all.
    let pending_queues = format!(
        r#"pending_queues AS (
    WITH RECURSIVE walk(queue) AS (
        (SELECT queue FROM {t} WHERE acquired_token IS NULL ORDER BY queue LIMIT 1)
        UNION ALL
        SELECT (SELECT o.queue FROM {t} o
                WHERE o.acquired_token IS NULL AND o.queue > walk.queue
                ORDER BY o.queue LIMIT 1)
        FROM walk WHERE walk.queue IS NOT NULL)
    SELECT queue FROM walk WHERE queue IS NOT NULL
)"#
    );
    format!(
        r#"
WITH ttls AS (
    {TTLS}
), leased AS ({leased}
), {pending_queues}, {tstats}, {dstats}, redriven AS (
    SELECT s.null_frac::float8 AS not_redriven
    FROM pg_class c
    JOIN pg_namespace ns ON ns.oid = c.relnamespace
    JOIN pg_stats s ON s.schemaname = ns.nspname AND s.tablename = c.relname
                   AND s.attname = 'redriven_at' AND NOT s.inherited
    WHERE c.oid = to_regclass({dlit}) AND $4::boolean
), queues AS (
    {set}
)
SELECT q.queue,
       CASE WHEN ts.reltuples IS NULL THEN NULL -- never analyzed: no figure to give
            WHEN ts.reltuples = 0 THEN 0
            ELSE greatest(round(ts.reltuples * coalesce(tm.freq, tother.freq))
                          - coalesce(l.leased, 0), 0)
       END::bigint,
       NULL::bigint,
       coalesce(l.leased, 0), coalesce(l.expired, 0), coalesce(l.rearms, 0),
       coalesce(l.cancel_marks, 0),
       CASE WHEN ds.reltuples = 0 THEN 0
            ELSE round(ds.reltuples * coalesce(dm.freq, dother.freq)
                       * coalesce(r.not_redriven, 1))
       END::bigint,
       (SELECT min(o.next_attempt_at) FROM {t} o
        WHERE o.queue = q.queue AND o.acquired_token IS NULL AND o.next_attempt_at <= now()),
       now()
FROM queues q
LEFT JOIN leased l USING (queue)
LEFT JOIN t_mcv tm USING (queue)
LEFT JOIN d_mcv dm USING (queue)
LEFT JOIN t_stat ts ON true
LEFT JOIN t_other tother ON true
LEFT JOIN d_stat ds ON true
LEFT JOIN d_other dother ON true
LEFT JOIN redriven r ON true"#,
        dlit = quote_literal(&n.qdlq),
    )
}

impl Stats {
    pub(crate) fn render(n: &Names) -> Self {
        Stats {
            exact: query(exact(n, false, true)),
            exact_queues: query(exact(n, true, true)),
            exact_no_dlq: query(exact(n, false, false)),
            exact_queues_no_dlq: query(exact(n, true, false)),
            estimate: query(estimate(n, false)),
            estimate_queues: query(estimate(n, true)),
        }
    }

    #[cfg(any(test, feature = "testing"))]
    pub(super) fn all(&self) -> Vec<(&'static str, &str)> {
        vec![
            ("stats.exact", self.exact.as_str()),
            ("stats.exact_queues", self.exact_queues.as_str()),
            ("stats.exact_no_dlq", self.exact_no_dlq.as_str()),
            (
                "stats.exact_queues_no_dlq",
                self.exact_queues_no_dlq.as_str(),
            ),
            ("stats.estimate", self.estimate.as_str()),
            ("stats.estimate_queues", self.estimate_queues.as_str()),
        ]
    }
}
