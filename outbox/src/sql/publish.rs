//! Publishing: the single-row inserts, the extend (a pending row's deadline moves later
//! only; a leased row gets a rearm instead), the batch.

use sqlx::SqlStr;

use super::text::{in_bucket, notify, query, wake};
use crate::names::Names;

/// `$1` queue, `$2` payload, `$3` headers, `$4` delay interval, `$5` absolute deadline,
/// `$6` timer id. The deadline is computed by the database clock (`now() + $4`, where
/// `now()` is the transaction's start), so clock skew between hosts cannot shift it.

#[derive(Debug)]
pub(crate) struct Publish {
    /// A message without a timer id.
    pub plain: SqlStr,
    /// A keyed timer, `OnConflict::Ignore`.
    pub insert: SqlStr,
    /// A keyed timer, `OnConflict::Extend`; `$7` the slack interval → one row `(id,
    /// inserted, leased, notify)` when it wrote, one row `(NULL, false, false, NULL)` when
    /// the key's row was found and left as it was, none when its insert met a row of the
    /// key committed after the statement's snapshot (then run it again). Distributed mode:
    /// the rewrite of the key's row only, one row `(id or NULL when nothing was written,
    /// false, leased, NULL)` when the key has a row, none when it has not (then `insert`).
    pub extend: SqlStr,
    /// Distributed mode: `$1` queue, `$2` timer id, `$3` bucket → how many rows hold the
    /// key, the look before `insert` (see `render`).
    pub held: Option<SqlStr>,
    /// Many messages of one queue.
    pub batch: SqlStr,
    /// Sends the wake-up payloads its statements return, distributed mode only
    /// (`text::wake`).
    pub wake: Option<SqlStr>,
}

/// Distributed mode: the leading columns of an insert and their values, the bucket from
/// parameter `$param`, this outbox's bucket count (which the table's CHECK compares with
/// its own, so a process built with another count cannot insert) and the id
/// `nextval * buckets + bucket` (Citus evaluates `nextval`
/// on the coordinator, before it routes the insert to the bucket's shard). Empty for a
/// single node, whose id is the identity default.
pub(super) fn bucket_columns(n: &Names, param: u32) -> (&'static str, String) {
    match n.buckets {
        Some(b) => (
            "bucket, buckets, id, ",
            format!(
                "${param}::smallint, {count}, nextval('{seq}') * {count} + ${param}::smallint, ",
                seq = n.qid_seq.replace('\'', "''"),
                count = b.count()
            ),
        ),
        None => ("", String::new()),
    }
}

impl Publish {
    pub(crate) fn render(n: &Names) -> Self {
        let t = &n.qtable;
        // Distributed mode: each statement names its bucket as its last parameter (`$7`,
        // `$8` for the extend, `$6` for the batch); see `bucket.rs`.
        let (bc, bv) = bucket_columns(n, 7);
        let conflict = if n.buckets.is_some() {
            "(bucket, queue, timer_id)"
        } else {
            "(queue, timer_id)"
        };
        // The notification is folded into each statement: no extra round trip, and it is
        // sent only if the caller's transaction commits. A plain message (NULL timer_id)
        // can never conflict, so it skips ON CONFLICT: a speculative insert costs an extra
        // WAL record per row.
        let plain = format!(
            r#"
WITH ins AS (
    INSERT INTO {t} ({bc}queue, payload, headers, next_attempt_at, timer_id) VALUES ({bv}$1, $2, $3, coalesce($5::timestamptz, now() + $4::interval), $6)
    RETURNING id, queue, next_attempt_at)
SELECT ins.id, {notify} FROM ins"#,
            notify = notify(n, "ins"),
        );
        // A keyed insert that first looks for the key: when a live row holds it, the INSERT
        // gets no row to insert and so never evaluates the identity default (`nextval` runs
        // per row inserted, and a skipped publish must not use up a value: at the end of the
        // identity's range every such publish would fail). The look is at the statement's
        // snapshot; ON CONFLICT stays as the guard for a row inserted after it.
        let insert = format!(
            r#"
WITH ins AS (
    INSERT INTO {t} ({bc}queue, payload, headers, next_attempt_at, timer_id)
    SELECT {bv}$1::text, $2::bytea, $3::jsonb, coalesce($5::timestamptz, now() + $4::interval), $6::text
    WHERE NOT EXISTS (SELECT FROM {t} WHERE queue = $1::text AND timer_id = $6::text{b7})
    ON CONFLICT {conflict} WHERE timer_id IS NOT NULL DO NOTHING
    RETURNING id, queue, next_attempt_at)
SELECT ins.id, {notify} FROM ins"#,
            notify = notify(n, "ins"),
            b7 = in_bucket(n, "", 7),
        );
        // One statement for the whole extend path (SPEC §4, §5). The row found decides:
        // pending → move the deadline and reset retry history; leased → queue the rearm.
        // Either only when the new deadline is later (for a leased row, later than both
        // the claimed deadline and any queued rearm). The newest intent wins (SPEC §3): an
        // extend that queues a rearm on a running row clears a cancel mark left by an
        // earlier cancel (a pending row never has one). `$7` is the slack (issue 14): a move
        // of a pending deadline or of a queued rearm by at most the slack writes nothing. It
        // never applies to a running row without a rearm (`t.rearm_at + $7` is NULL, which
        // `greatest` ignores): that row's completion would delete it.
        //
        // The common case, a key whose row moves, is `upd` alone: an UPDATE of the key's
        // row, with no lock taken first (issue 27: a `SELECT … FOR UPDATE` before it wrote a
        // lock record and cost about a tenth of the extend). Postgres locks the row as it
        // updates it; when another transaction changed the row after the snapshot (a claim,
        // an extend) it waits, then re-evaluates the WHERE and the SET on the committed
        // version (READ COMMITTED), so a claim racing an extend is seen and the extend
        // queues a rearm (SPEC §5.3).
        //
        // Only when `upd` wrote nothing does `cur` run (its one-time filter skips the scan
        // otherwise): it locks the key's row at its latest version. A row there means the
        // extend was not later: one row with a NULL id, nothing written. No row means the
        // key has none (or a completion deleted it after the snapshot), and `ins` inserts
        // the timer: a `nextval` only then, so an existing row consumes no identity value.
        // A row of the key committed after the snapshot is met by ON CONFLICT, which waits
        // for it and then inserts nothing: the statement returns no row, and the caller
        // runs it again, on a snapshot that sees that row (`publish.rs`).
        // `v` is the proposed row, named `excluded` as in an ON CONFLICT clause.
        let pending = "t.acquired_token IS NULL";
        let set = format!(
            r#"next_attempt_at  = CASE WHEN {pending} THEN excluded.next_attempt_at ELSE t.next_attempt_at END,
        payload          = CASE WHEN {pending} THEN excluded.payload ELSE t.payload END,
        headers          = CASE WHEN {pending} THEN excluded.headers ELSE t.headers END,
        attempts_count   = CASE WHEN {pending} THEN 0 ELSE t.attempts_count END,
        first_attempt_at = CASE WHEN {pending} THEN NULL ELSE t.first_attempt_at END,
        last_attempt_at  = CASE WHEN {pending} THEN NULL ELSE t.last_attempt_at END,
        rearm_at         = CASE WHEN {pending} THEN t.rearm_at ELSE excluded.next_attempt_at END,
        rearm_payload    = CASE WHEN {pending} THEN t.rearm_payload ELSE excluded.payload END,
        rearm_headers    = CASE WHEN {pending} THEN t.rearm_headers ELSE excluded.headers END,
        cancelled_at     = NULL"#
        );
        let later = "excluded.next_attempt_at > CASE WHEN t.acquired_token IS NULL THEN t.next_attempt_at + $7::interval
        ELSE greatest(t.next_attempt_at, t.rearm_at + $7::interval) END";
        let extend = format!(
            r#"
WITH v AS (
    SELECT $1::text AS queue, $2::bytea AS payload, $3::jsonb AS headers,
           coalesce($5::timestamptz, now() + $4::interval) AS next_attempt_at, $6::text AS timer_id),
upd AS (
    UPDATE {t} AS t SET
        {set}
    FROM v AS excluded
    WHERE t.queue = $1::text AND t.timer_id = $6::text
      AND {later}
    RETURNING t.id, false AS inserted, (t.acquired_token IS NOT NULL) AS leased),
cur AS (
    SELECT id FROM {t} WHERE queue = $1::text AND timer_id = $6::text
      AND NOT EXISTS (SELECT FROM upd) FOR UPDATE),
ins AS (
    INSERT INTO {t} (queue, payload, headers, next_attempt_at, timer_id)
    SELECT queue, payload, headers, next_attempt_at, timer_id FROM v
    WHERE NOT EXISTS (SELECT FROM upd) AND NOT EXISTS (SELECT FROM cur)
    ON CONFLICT {conflict} WHERE timer_id IS NOT NULL DO NOTHING
    RETURNING id, queue, next_attempt_at)
SELECT id, inserted, leased, NULL::text FROM upd
UNION ALL SELECT ins.id, true, false, {notify} FROM ins
UNION ALL SELECT NULL::bigint, false, false, NULL::text FROM cur"#,
            notify = notify(n, "ins"),
        );
        // All or nothing, one statement, one notification for the batch (SPEC §2.3).
        // `$1` queue, `$2` payloads, `$3` headers, `$4` delay, `$5` absolute deadline; in
        // distributed mode `$6` the one bucket of the whole batch.
        let (bc6, bv6) = bucket_columns(n, 6);
        let batch = format!(
            r#"
WITH ins AS (
    INSERT INTO {t} ({bc6}queue, payload, headers, next_attempt_at)
    SELECT {bv6}$1, u.payload, u.headers, coalesce($5::timestamptz, now() + $4::interval)
    FROM unnest($2::bytea[], $3::jsonb[]) WITH ORDINALITY AS u(payload, headers, ord)
    ORDER BY u.ord
    RETURNING id, queue, next_attempt_at)
SELECT array_agg(ins.id ORDER BY ins.id),
       (SELECT {notify} FROM ins LIMIT 1)
FROM ins"#,
            notify = notify(n, "ins"),
        );
        // Distributed mode (Citus): a keyed write is two single-shard statements, never a
        // CTE that inserts from a SELECT or from a table-less CTE (Citus plans those in
        // steps through the coordinator, ships intermediate results to every node and turns
        // the caller's transaction into a two-phase commit), and never `ON CONFLICT … DO
        // UPDATE` (Citus refuses a non-IMMUTABLE function there, and `timestamptz ±
        // interval` is only STABLE). First `held` (Ignore) or `extend` (the lock and rewrite
        // of the key's row, as a single node's `cur` and `upd`), then, only when no row of
        // the key was found, the INSERT … VALUES with `ON CONFLICT … DO NOTHING`: an existing
        // key consumes no sequence value, as on a single node. An insert that meets a row
        // committed after the look (it returns nothing) goes back to the first statement
        // (`publish.rs`).
        let (insert, extend, held) = match n.buckets {
            None => (insert, extend, None),
            Some(_) => {
                let insert = format!(
                    r#"
WITH ins AS (
    INSERT INTO {t} ({bc}queue, payload, headers, next_attempt_at, timer_id) VALUES ({bv}$1, $2, $3, coalesce($5::timestamptz, now() + $4::interval), $6)
    ON CONFLICT {conflict} WHERE timer_id IS NOT NULL DO NOTHING
    RETURNING id, queue, next_attempt_at)
SELECT ins.id, {notify} FROM ins"#,
                    notify = notify(n, "ins"),
                );
                let held = format!(
                    "SELECT count(*) FROM {t} WHERE queue = $1::text AND timer_id = $2::text{b3}",
                    b3 = in_bucket(n, "", 3),
                );
                // Every value from `now()` or `timestamptz + interval` (STABLE) is computed
                // in `cur`, on the locked row's latest version: Citus refuses a function
                // that is not IMMUTABLE inside CASE or COALESCE of a statement that writes.
                let due = "coalesce($5::timestamptz, cur.relative)";
                let proposed = |text: &str| {
                    text.replace("excluded.next_attempt_at", due)
                        .replace("excluded.payload", "$2::bytea")
                        .replace("excluded.headers", "$3::jsonb")
                };
                let later = format!(
                    "{due} > CASE WHEN t.acquired_token IS NULL THEN cur.pending_bound
        ELSE greatest(t.next_attempt_at, cur.rearm_bound) END"
                );
                let extend = format!(
                    r#"
WITH cur AS (
    SELECT id, now() + $4::interval AS relative, next_attempt_at + $7::interval AS pending_bound,
           rearm_at + $7::interval AS rearm_bound
    FROM {t} WHERE queue = $1::text AND timer_id = $6::text{b8} FOR UPDATE),
upd AS (
    UPDATE {t} AS t SET
        {set}
    FROM cur
    WHERE t.queue = $1::text AND t.timer_id = $6::text AND t.id = cur.id{tb8}
      AND {later}
    RETURNING t.id, (t.acquired_token IS NOT NULL) AS leased)
SELECT upd.id, false, upd.leased, NULL::text
FROM cur LEFT JOIN upd ON upd.id = cur.id"#,
                    set = proposed(&set),
                    b8 = in_bucket(n, "", 8),
                    tb8 = in_bucket(n, "t.", 8),
                );
                (insert, extend, Some(query(held)))
            }
        };
        Publish {
            wake: wake(n),
            held,
            plain: query(plain),
            insert: query(insert),
            extend: query(extend),
            batch: query(batch),
        }
    }

    #[cfg(any(test, feature = "testing"))]
    pub(super) fn all(&self) -> Vec<(&'static str, &str)> {
        vec![
            ("publish.plain", self.plain.as_str()),
            ("publish.insert", self.insert.as_str()),
            ("publish.extend", self.extend.as_str()),
            ("publish.batch", self.batch.as_str()),
        ]
    }
}
