//! Claiming due rows (one statement: `FOR UPDATE SKIP LOCKED` skips rows another
//! transaction has locked, so two workers never claim the same row) and finding when to
//! look next (the earliest deadline or lease expiry, from the partial indexes).

use sqlx::SqlStr;

use super::text::{in_bucket, query};
use crate::names::{quote_literal, Names};

/// The columns a claim returns, in the order `store/rows.rs` decodes a delivery from.
pub(crate) const DELIVERY_COLUMNS: &str = "t.id, t.acquired_token, t.queue, t.payload, t.headers, \
     t.timer_id, t.attempts_count, t.deliveries_count, t.created_at, t.next_attempt_at, \
     t.first_attempt_at, t.acquired_at";

#[derive(Debug)]
pub(crate) struct Claim {
    /// `$1 text[]` queues in the order of a round (a queue's position in the array is its
    /// place in each round), `$2 bigint` limit, `$3 interval` lease TTL, `$4 uuid` token,
    /// `$5 bigint[]` ids never to claim, `$6 bigint[]` the most rows to take of each queue
    /// (parallel to `$1`).
    pub claim: SqlStr,
    /// As `claim`, among `$7 bigint[]` ids only: isolates a row that makes a claim fail.
    pub claim_only: SqlStr,
    /// What `claim` would take, without locking or writing anything: `$1` queues (in the
    /// order of a round, as for `claim`), `$2` limit, `$3` lease TTL, `$4` ids never to
    /// claim, `$5` per-queue caps → `(id, queue)`
    /// in claim order.
    pub peek: SqlStr,
    /// `$1 text[]` queues, `$2 interval` lease TTL, `$3 bigint[]` ids to leave out →
    /// `(now, earliest deadline, earliest future deadline, earliest lease expiry)`.
    pub next_wakeup: SqlStr,
    /// The store's clock.
    pub now: SqlStr,
    /// Distributed mode: `$1 text[]` queues, `$2 interval` lease TTL, `$3 bigint[]` ids to
    /// leave out → `(bucket smallint, queue text, rows bigint)` for every bucket and active
    /// queue with due rows (unleased, or with an expired lease), the earliest due row first
    /// (ties by bucket, then queue). A read across the shards (no row locks); the claim
    /// plans its statements from it (`store/plan.rs`).
    pub buckets: Option<SqlStr>,
}

/// The queues of `unnest` (an alias `u` with a column `queue`) that are not paused, as the
/// FROM item `q`: a paused queue's branches find nothing, inside the claim's own statement,
/// so a pause holds from the next claim on without a second round trip. The anti-join probes
/// the paused table's primary key once per queue.
fn active_queues(unnest: &str, paused: &str) -> String {
    format!(
        "(SELECT u.* FROM {unnest} WHERE NOT EXISTS (SELECT 1 FROM {paused} p WHERE p.queue = u.queue)) AS q"
    )
}

/// The two candidate branches of a claim, per queue: due unleased rows, and due rows whose
/// lease expired, each with the queue's cap beside it. `exclude` is the parameter of the ids
/// never to take, `caps` the parameter of the per-queue caps, `only` (if any) the parameter of
/// the ids to take among, and `lock` adds the row locks of a real claim.
///
/// Each branch's `LIMIT` is the claim's own (`$2`), not the queue's cap: a `LIMIT` taken from
/// a column of the `LATERAL`'s outer side is unknown to the planner, which then assumes a
/// tenth of the table — at 10⁷ rows an estimate over a million, a cost that switches on JIT
/// compilation (measured: 470 ms of JIT for a 1 ms claim). The cap is applied after the
/// branches (`turn <= cap`); the few rows a capped queue's branch locked beyond its cap are
/// released when the claim's statement ends.
fn candidates(
    t: &str,
    paused: &str,
    exclude: &str,
    caps: &str,
    only: Option<&str>,
    lock: bool,
    bucket: &str,
) -> String {
    let only = only.map_or(String::new(), |p| format!(" AND id = ANY({p}::bigint[])"));
    let lock = if lock { " FOR UPDATE SKIP LOCKED" } else { "" };
    let queues = active_queues(
        &format!("unnest($1::text[], {caps}::bigint[]) WITH ORDINALITY AS u(queue, cap, pos)"),
        paused,
    );
    format!(
        r#"
    SELECT c.id, c.queue, c.next_attempt_at, c.deliveries_count, false AS cancelled, q.cap, q.pos
    FROM {queues}
    CROSS JOIN LATERAL (
        SELECT id, queue, next_attempt_at, deliveries_count FROM {t}
        WHERE queue = q.queue AND acquired_token IS NULL AND next_attempt_at <= now()
          AND id <> ALL({exclude}::bigint[]){only}{bucket}
        ORDER BY next_attempt_at LIMIT $2{lock}) c
    UNION ALL
    SELECT c.id, c.queue, c.next_attempt_at, c.deliveries_count, c.cancelled, q.cap, q.pos
    FROM {queues}
    CROSS JOIN LATERAL (
        SELECT id, queue, next_attempt_at, deliveries_count,
               cancelled_at IS NOT NULL AND rearm_at IS NULL AS cancelled
        FROM {t}
        WHERE queue = q.queue AND acquired_token IS NOT NULL
          AND acquired_at < now() - $3::interval AND next_attempt_at <= now()
          AND id <> ALL({exclude}::bigint[]){only}{bucket}
        ORDER BY acquired_at LIMIT $2{lock}) c"#
    )
}

/// A candidate's round: its rank among its queue's candidates by deadline. A queue's first
/// row comes before any queue's second, so a backlog of one queue, however old its
/// deadlines, never holds back the due rows of another within a claim.
const FAIR_ORDER: &str = "row_number() OVER (PARTITION BY queue ORDER BY next_attempt_at, id)";

/// The claim order: by round, then by the queue's place in the round (its position in
/// `$1`, which the caller rotates to start after the queue the previous claim ended on, so
/// that a claim smaller than the number of queues with due rows does not take the same
/// queues every time: fair across claims). `(turn, pos)` is unique per candidate.
const CLAIM_ORDER: &str = "turn, pos";

/// A claim over `candidates`: one new token, `deliveries_count + 1`, cancelled rows deleted.
/// The count comes from the locked candidate, not the updated table (see
/// `sql::complete`'s `APPLY_REARM` for why).
fn claim(t: &str, candidates: &str, bucket: &str) -> String {
    // `t.id = ANY(ARRAY(…))` gives both writes an index condition of their own, so their
    // plan cannot depend on the table's statistics: with statistics from when the table was
    // nearly empty, a join `t.id = due.id` alone may be planned with the whole table as the
    // outer side (every row filtered against the claimed ids), hundreds of milliseconds
    // per claim on a large backlog until the next ANALYZE.
    format!(
        r#"
WITH cand AS ({candidates}),
due AS (
    SELECT id, deliveries_count, cancelled
    FROM (SELECT *, {FAIR_ORDER} AS turn FROM cand) r
    WHERE turn <= cap
    ORDER BY {CLAIM_ORDER} LIMIT $2),
gone AS (
    DELETE FROM {t} t USING due
    WHERE t.id = ANY(ARRAY(SELECT id FROM due WHERE cancelled))
      AND t.id = due.id AND due.cancelled{bucket})
UPDATE {t} t SET acquired_token = $4, acquired_at = now(),
                 deliveries_count = due.deliveries_count + 1
FROM due
WHERE t.id = ANY(ARRAY(SELECT id FROM due WHERE NOT cancelled))
  AND t.id = due.id AND NOT due.cancelled{bucket}
RETURNING {DELIVERY_COLUMNS}"#
    )
}

/// Distributed mode: `next_wakeup` as plain aggregates, which Citus runs on every shard and
/// combines (a LATERAL probe per queue does not distribute). Each aggregate keeps the
/// predicate of its partial index. Paused queues are left out through the reference table.
fn distributed_next_wakeup(t: &str, p: &str) -> String {
    let active = format!("queue = ANY($1::text[]) AND id <> ALL($3::bigint[]) AND NOT EXISTS (SELECT 1 FROM {p} p WHERE p.queue = x.queue)");
    format!(
        r#"
SELECT now(),
    (SELECT min(next_attempt_at) FROM {t} x WHERE acquired_token IS NULL AND {active}),
    (SELECT min(next_attempt_at) FROM {t} x WHERE acquired_token IS NULL AND next_attempt_at > now() AND {active}),
    (SELECT min(acquired_at) + $2::interval FROM {t} x WHERE acquired_token IS NOT NULL AND {active})"#
    )
}

/// Distributed mode: where a claim's work is (see `Claim::buckets`). Each branch carries the
/// predicate of its partial index (pending, lease) and is grouped by the distribution column
/// first, so Citus runs it whole on every shard and only merges the groups.
fn distributed_buckets(t: &str, p: &str) -> String {
    let active = format!("queue = ANY($1::text[]) AND id <> ALL($3::bigint[]) AND NOT EXISTS (SELECT 1 FROM {p} p WHERE p.queue = x.queue)");
    format!(
        r#"
SELECT bucket, queue::text, sum(n)::bigint FROM (
    SELECT bucket, queue, count(*) AS n, min(next_attempt_at) AS due FROM {t} x
    WHERE acquired_token IS NULL AND next_attempt_at <= now() AND {active}
    GROUP BY bucket, queue
    UNION ALL
    SELECT bucket, queue, count(*) AS n, min(next_attempt_at) AS due FROM {t} x
    WHERE acquired_token IS NOT NULL AND acquired_at < now() - $2::interval
      AND next_attempt_at <= now() AND {active}
    GROUP BY bucket, queue) w
GROUP BY bucket, queue ORDER BY min(due), bucket, queue"#
    )
}

/// The claim of a relay ordered by the header `header`: up to `$2` due rows of the queues
/// `$1` (`$3` lease TTL, `$4` ids never to claim, `$5` the new token), leaving out every
/// row that has a row of the same queue and the same value of `header` with a lower id
/// still in the table (pending, leased or waiting for a retry), unless that row is taken by
/// the same claim: a key's rows are claimed as a **run**, its earliest row (the head) and
/// the rows right after it in id order, and the worker runs a run's rows one after another,
/// each only once the one before it succeeded. A row without the header is not held back
/// and has no run. Rows of paused queues are left out. A row a cancel reached while it ran,
/// whose lease then expired (with no rearm queued), is deleted instead (`gone`, as the
/// common claim's `gone` branch does: a cancelled row is never run again): left in place it
/// would never be claimed (the common claim does not look at an ordered relay's queues) and
/// stay in the table for ever. Rendered per relay (the header is a literal, so an
/// expression index on `(queue, (headers ->> 'header'), id) WHERE headers ? 'header'`
/// serves the probe and the run). Not for a distributed outbox.
///
/// The heads come per queue from the two partial indexes, as in the common claim
/// (`LATERAL … ORDER BY <index column> LIMIT $2`), each probed for an earlier row of its
/// key; the heads are then taken oldest id first. Pending heads are looked for first among
/// the queue's `8 × $2` earliest due rows (`early`, read without locks, the heads then
/// locked by primary key), and among all its due rows only when those held none (every
/// key there waits behind a run in flight or a retry): so a claim after a run reads a few
/// hundred rows, not the key's whole backlog (one key of 2·10⁴ rows relayed at 1 148 msg/s
/// reading the backlog at every claim, 5 122 with the early rows first; lab notes of
/// 2026-12-05). A key whose rows lie beyond the early rows waits while the early rows hold
/// a head: pending rows go oldest deadline first. A scan of the whole table in id order
/// filtered by the probe was planned, on a backlog of 10⁵ rows, as a sequential scan with a
/// probe per row (950 ms with the key index), or with a cost that switched on JIT
/// compilation (390 ms of JIT for a 1.3 ms claim without it); this shape claims in about
/// 1 ms either way. When the early rows hold no head, rows held back behind their key's
/// earlier row are all read and probed: that claim's cost grows with the due rows of keys
/// whose head is in flight.
///
/// Runs are looked for only when the heads leave room (fewer than `$2`): with many keys
/// each claim fills with heads and pays nothing for runs. A head's run is read from the ids
/// after it within a window of `4 × $2` ids (an id range: through the key index when it
/// exists, the primary key otherwise, so at most that many rows either way), at most `$2 -
/// 1` rows, and it ends at the first row that is not pending and due, or that another
/// transaction holds locked (`FOR UPDATE SKIP LOCKED` skips it; the run keeps only the rows
/// before it, so it never has a gap). The batch is then cut to `$2` rows by position in
/// the run (every head, then every run's second row, …), so each run keeps a prefix.
pub(crate) fn ordered_claim(n: &Names, header: &str) -> SqlStr {
    let (t, p) = (&n.qtable, &n.qpaused);
    let h = quote_literal(header);
    let queues = active_queues("unnest($1::text[]) AS u(queue)", p);
    // No earlier row of the key is left (a cancelled row whose lease expired is never
    // relayed: it does not hold its key's later rows back). The probe looks for the nearest
    // earlier row, walking the index down from the row (`ORDER BY id DESC LIMIT 1`; `OFFSET
    // 0` keeps Postgres from dropping the order inside `EXISTS`): walking up from the key's
    // lowest id first passes the entries of every row of the key acked since the last
    // vacuum, for every row probed (one key of 2·10⁴ rows relayed at 229 msg/s that way,
    // 774 walking down; lab notes of 2026-12-05).
    let head = format!(
        r#"NOT (c.headers ? {h} AND EXISTS (
              SELECT 1 FROM {t} e
              WHERE e.queue = c.queue AND e.headers ? {h}
                AND e.headers ->> {h} = c.headers ->> {h} AND e.id < c.id
                AND NOT (e.cancelled_at IS NOT NULL AND e.rearm_at IS NULL
                         AND e.acquired_at < now() - $3::interval)
              ORDER BY e.id DESC LIMIT 1 OFFSET 0))"#
    );
    // A run's rows must be pending and due: the window's running `bool_and` ends the run
    // at the first that is not (SPEC §14: one key's messages reach the broker in order).
    let runnable = "e.acquired_token IS NULL AND e.next_attempt_at <= now() \
                    AND e.id <> ALL($4::bigint[])";
    query(format!(
        r#"
WITH gone AS (
    -- Through the lease index (queue, acquired_at) WHERE acquired_token IS NOT NULL; the
    -- locks skip a row another claim is deleting or an ack holds.
    DELETE FROM {t} g
    WHERE g.id = ANY(ARRAY(
        SELECT x.id FROM {t} x
        WHERE x.queue = ANY($1::text[]) AND x.acquired_token IS NOT NULL
          AND x.acquired_at < now() - $3::interval
          AND x.cancelled_at IS NOT NULL AND x.rearm_at IS NULL
          AND x.id <> ALL($4::bigint[])
          AND NOT EXISTS (SELECT 1 FROM {p} p WHERE p.queue = x.queue)
        LIMIT $2 FOR UPDATE SKIP LOCKED))),
early AS MATERIALIZED (
    SELECT w.id, w.queue FROM {queues}
    CROSS JOIN LATERAL (
        SELECT c.id, c.queue FROM (
            SELECT c.id, c.queue, c.headers FROM {t} c
            WHERE c.queue = q.queue AND c.acquired_token IS NULL
              AND c.next_attempt_at <= now() AND c.id <> ALL($4::bigint[])
            ORDER BY c.next_attempt_at LIMIT 8 * $2) c
        WHERE {head} LIMIT $2) w),
cand AS (
    SELECT c.id, c.deliveries_count, c.queue, c.headers ->> {h} AS k FROM early w
    CROSS JOIN LATERAL (
        SELECT c.id, c.deliveries_count, c.queue, c.headers FROM {t} c
        WHERE c.id = w.id AND c.acquired_token IS NULL AND c.next_attempt_at <= now()
        FOR UPDATE SKIP LOCKED) c
    UNION ALL
    SELECT c.id, c.deliveries_count, c.queue, c.headers ->> {h} AS k FROM {queues}
    CROSS JOIN LATERAL (
        SELECT c.id, c.deliveries_count, c.queue, c.headers FROM {t} c
        WHERE c.queue = q.queue AND c.acquired_token IS NULL AND c.next_attempt_at <= now()
          AND c.id <> ALL($4::bigint[]) AND {head}
          -- Per queue, a filter on the scan (not a join after it): the scan runs only when
          -- the queue's early rows held no head.
          AND (SELECT count(*) FROM early e WHERE e.queue = q.queue) = 0
        ORDER BY c.next_attempt_at LIMIT $2 FOR UPDATE SKIP LOCKED) c
    UNION ALL
    SELECT c.id, c.deliveries_count, c.queue, c.headers ->> {h} AS k FROM {queues}
    CROSS JOIN LATERAL (
        SELECT c.id, c.deliveries_count, c.queue, c.headers FROM {t} c
        WHERE c.queue = q.queue AND c.acquired_token IS NOT NULL
          AND c.acquired_at < now() - $3::interval AND c.next_attempt_at <= now()
          AND NOT (c.cancelled_at IS NOT NULL AND c.rearm_at IS NULL)
          AND c.id <> ALL($4::bigint[]) AND {head}
        ORDER BY c.acquired_at LIMIT $2 FOR UPDATE SKIP LOCKED) c),
heads AS (SELECT * FROM cand ORDER BY id LIMIT $2),
next AS MATERIALIZED (
    SELECT h.id AS head, r.id, r.deliveries_count, r.pos
    FROM heads h CROSS JOIN LATERAL (
        SELECT e.id, e.deliveries_count,
               row_number() OVER (ORDER BY e.id) AS pos,
               bool_and({runnable}) OVER (ORDER BY e.id) AS runs
        FROM (SELECT e.* FROM {t} e
              WHERE h.k IS NOT NULL AND e.queue = h.queue AND e.headers ? {h}
                AND e.headers ->> {h} = h.k
                AND e.id > h.id AND e.id <= h.id + 4 * $2
              ORDER BY e.id LIMIT $2 - 1) e) r
    WHERE r.runs AND (SELECT count(*) FROM heads) < $2),
locked AS (
    -- One primary-key probe per row of `next`.
    SELECT n.head, n.pos, e.id, e.deliveries_count FROM next n
    CROSS JOIN LATERAL (
        SELECT e.id, e.deliveries_count FROM {t} e
        WHERE e.id = n.id AND {runnable}
        FOR UPDATE SKIP LOCKED) e),
run AS (
    -- A row stays when every row before it in its run is locked too (positions from 1).
    SELECT id, deliveries_count, pos FROM (
        SELECT id, deliveries_count, pos,
               count(*) OVER (PARTITION BY head ORDER BY pos) AS held
        FROM locked) r
    WHERE held = pos),
due AS (
    SELECT id, deliveries_count FROM (
        SELECT id, deliveries_count, 0 AS pos FROM heads
        UNION ALL
        SELECT id, deliveries_count, pos FROM run) a
    ORDER BY pos, id LIMIT $2)
UPDATE {t} t SET acquired_token = $5, acquired_at = now(),
                 deliveries_count = due.deliveries_count + 1
FROM due
WHERE t.id = ANY(ARRAY(SELECT id FROM due)) AND t.id = due.id
RETURNING {DELIVERY_COLUMNS}"#
    ))
}

impl Claim {
    pub(crate) fn render(n: &Names) -> Self {
        let t = &n.qtable;
        let p = &n.qpaused;
        // Each queue gets two LATERAL branches with their own LIMIT, each carrying the
        // predicate of its partial index (`acquired_token IS NULL` → <t>_pending_idx,
        // `IS NOT NULL` → <t>_lease_idx), so the cost depends on the limit, not on the
        // backlog. The branches order by their index alone: ordering by (next_attempt_at, id)
        // there would sort every row sharing a deadline (a batch published in one
        // transaction shares `now()`); ties among equal deadlines are taken in index order
        // and the claimed batch is then ordered round robin across queues (FAIR_ORDER, then
        // CLAIM_ORDER, whose rotation makes it fair across claims, SPEC §6 v3), each queue
        // within its cap (what its `max_concurrency` leaves free; a queue with nothing free
        // is not passed at all). Rows locked by the branches but cut by a cap or the outer
        // LIMIT are released when the statement ends.
        //
        // A reclaimed row (its lease expired) that a cancel reached while it ran, with no
        // rearm queued after the cancel, is deleted instead of delivered (SPEC §3): the
        // `gone` branch. Pending rows never carry the mark, so the common path only pays
        // for a join over the claimed ids.
        //
        // `$5` leaves out the rows the worker still holds (a reclaim of its own expired
        // lease would run a row twice at once, SPEC §7.8) and rows it has set aside as
        // poison (SPEC §7.4); usually empty, it is a filter on rows the index already found.
        //
        // Distributed mode: a claim takes the rows of one bucket, its last parameter (`$7`,
        // `$8` for `claim_only`, `$6` for `peek`), so Citus runs the whole statement on the
        // one shard of the bucket; `buckets` finds which buckets have work.
        let claim_all = claim(
            t,
            &candidates(t, p, "$5", "$6", None, true, &in_bucket(n, "", 7)),
            &in_bucket(n, "t.", 7),
        );
        let claim_only = claim(
            t,
            &candidates(t, p, "$5", "$6", Some("$7"), true, &in_bucket(n, "", 8)),
            &in_bucket(n, "t.", 8),
        );
        let peek = format!(
            r#"
WITH cand AS ({candidates})
SELECT id, queue FROM (SELECT *, {FAIR_ORDER} AS turn FROM cand) r
WHERE turn <= cap
ORDER BY {CLAIM_ORDER} LIMIT $2"#,
            candidates = candidates(t, p, "$4", "$5", None, false, &in_bucket(n, "", 6))
        );
        // Every minimum comes from a partial index (one index probe per queue each); `$3`
        // leaves out the rows the claim would leave out, and paused queues are left out as
        // the claim leaves them out: an idle worker never wakes for a paused queue's due rows
        // (resume notifies instead).
        let queues = active_queues("unnest($1::text[]) AS u(queue)", p);
        let next_wakeup = if n.buckets.is_some() {
            distributed_next_wakeup(t, p)
        } else {
            format!(
                r#"
SELECT now(),
    (SELECT min(x.next_attempt_at) FROM {queues}
     CROSS JOIN LATERAL (SELECT next_attempt_at FROM {t}
         WHERE queue = q.queue AND acquired_token IS NULL AND id <> ALL($3::bigint[])
         ORDER BY next_attempt_at LIMIT 1) x),
    (SELECT min(x.next_attempt_at) FROM {queues}
     CROSS JOIN LATERAL (SELECT next_attempt_at FROM {t}
         WHERE queue = q.queue AND acquired_token IS NULL AND next_attempt_at > now()
           AND id <> ALL($3::bigint[])
         ORDER BY next_attempt_at LIMIT 1) x),
    (SELECT min(x.acquired_at) + $2::interval FROM {queues}
     CROSS JOIN LATERAL (SELECT acquired_at FROM {t}
         WHERE queue = q.queue AND acquired_token IS NOT NULL AND id <> ALL($3::bigint[])
         ORDER BY acquired_at LIMIT 1) x)"#
            )
        };
        Claim {
            claim: query(claim_all),
            claim_only: query(claim_only),
            peek: query(peek),
            next_wakeup: query(next_wakeup),
            now: SqlStr::from_static("SELECT now()"),
            buckets: n.buckets.map(|_| query(distributed_buckets(t, p))),
        }
    }

    #[cfg(any(test, feature = "testing"))]
    pub(super) fn all(&self) -> Vec<(&'static str, &str)> {
        vec![
            ("claim.claim", self.claim.as_str()),
            ("claim.claim_only", self.claim_only.as_str()),
            ("claim.peek", self.peek.as_str()),
            ("claim.next_wakeup", self.next_wakeup.as_str()),
            ("claim.now", self.now.as_str()),
        ]
    }
}
