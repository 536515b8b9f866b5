//! Fenced completions: every write after a claim matches the row id and the claim's lease
//! token, so once another worker has re-claimed the row under a new token the write matches
//! nothing and is reported as a lost lease, never as success. A queued rearm turns the row
//! into a pending timer at `rearm_at` on success and on terminal failure, and replaces the
//! delay of a retry; a row cancelled while it ran (and not extended since) is deleted
//! however the run ends. A success is one `DELETE … AND rearm_at IS NULL`; only when it
//! matches nothing does a follow-up statement apply the rearm or find the lease lost.

use sqlx::SqlStr;

use super::text::{in_bucket, notify, query, wake};
use crate::bucket::Buckets;
use crate::names::Names;

/// The SET list that turns a leased row with a queued rearm into a fresh pending timer at
/// `rearm_at` (on success and on terminal failure): new payload, lease cleared, retry
/// history and `deliveries_count` reset. A rearm and a cancel mark together can only come
/// from a publisher that predates the mark; the rearm wins (a ping is never lost) and the
/// mark goes with the lease.
///
/// The rearm's values come from `cur`, the locking CTE, never from the updated table's
/// own columns: when the lock had to wait for an extend's transaction, the CTE sees the
/// committed rearm, but the UPDATE's SET expressions are evaluated on the row version of the
/// statement's snapshot, from before that extend (Postgres re-checks the UPDATE's row
/// against the newest version and keeps the columns it does not set, but does not recompute
/// what it sets). Every locking statement below follows this rule for every value another
/// transaction may change on a leased row (the rearm columns and the cancel mark).
const APPLY_REARM: &str = "next_attempt_at = cur.rearm_at, payload = cur.rearm_payload, \
     headers = cur.rearm_headers, rearm_at = NULL, rearm_payload = NULL, rearm_headers = NULL, \
     acquired_token = NULL, acquired_at = NULL, cancelled_at = NULL, \
     attempts_count = 0, first_attempt_at = NULL, last_attempt_at = NULL, deliveries_count = 0";

/// The columns of the locked row a locking CTE reads for `APPLY_REARM` and the other SET
/// expressions (see there).
const LOCKED_VALUES: &str = "rearm_at, rearm_payload, rearm_headers, attempts_count, \
     first_attempt_at, last_attempt_at, deliveries_count, payload, headers";

#[derive(Debug, Clone)]
pub(crate) struct Complete {
    /// Success, the common path: `$1` id, `$2` token.
    pub ack_delete: SqlStr,
    /// Success, the follow-up when `ack_delete` matched nothing: `$1` id, `$2` token →
    /// `(rows locked, rearm deadline, notify)`.
    pub ack_settle: SqlStr,
    /// Success for many rows: `$1 bigint[]` ids, `$2 uuid[]` tokens → `(id, token)` deleted.
    pub ack_batch_delete: SqlStr,
    /// The batched follow-up: `(id, token, rearm deadline or NULL, notify)` per row settled.
    pub ack_batch_settle: SqlStr,
    /// A failed run: `$1` id, `$2` token, `$3` delay → `(rows locked, deadline or NULL when
    /// the cancelled row was deleted, rearmed, notify)`.
    pub retry: SqlStr,
    /// A terminal failure with the dead-letter queue: `$1` id, `$2` token, `$3` reason,
    /// `$4` last error, `$5` 1 if the handler ran → `(rows locked, rearm deadline, notify,
    /// deleted as cancelled)`. Distributed mode: `$1` id, `$2` token, `$3` bucket, without
    /// the archive, which `fail_archive_insert` writes in the same transaction; it also
    /// returns the archived columns `(queue, payload, headers, timer_id, attempts_count,
    /// deliveries_count, created_at)` of the locked row.
    pub fail_archive: SqlStr,
    /// Distributed mode: the archive of `fail_archive`, an `INSERT … VALUES` of the values
    /// it returned: `$1` bucket, `$2` original id, `$3` queue, `$4` payload, `$5` headers,
    /// `$6` timer id, `$7` attempts, `$8` deliveries, `$9` created, `$10` reason, `$11` last
    /// error. An `INSERT … SELECT` from a CTE is planned through the coordinator, which
    /// sends its rows to every worker node and makes the completion a two-phase commit
    /// across the cluster (and stalls it while any node is down); `VALUES` routes to the
    /// bucket's shard, on the node of the row it archives.
    pub fail_archive_insert: Option<SqlStr>,
    /// A terminal failure without the dead-letter queue: as `ack_delete`, for a cancelled
    /// row too, but reports whether it was cancelled → `(cancelled)`.
    pub fail_delete: SqlStr,
    /// Keeps leases alive: `$1 bigint[]` ids, `$2 uuid[]` tokens → `(id, token, cancelled)`
    /// per lease still held.
    pub renew: SqlStr,
    /// Gives leases back at shutdown: `$1 bigint[]` ids, `$2 uuid[]` tokens, `$3 bool[]`
    /// started → `(id, token, outcome)` per lease still held, outcome one of `pending`,
    /// `retried`, `cancelled`.
    pub release: SqlStr,
    /// The terminal failure of a row no claim can take: `$1` id, `$2` lease TTL, `$3`
    /// reason, `$4` last error, `$5` archive (bool) → `(deleted)`.
    pub fail_unclaimed: SqlStr,
    /// Distributed mode: the bucket layout, which names each lease's bucket from its id.
    pub buckets: Option<Buckets>,
    /// Sends the wake-up payloads its statements return, distributed mode only
    /// (`text::wake`).
    pub wake: Option<SqlStr>,
}

impl Complete {
    /// The bucket parameter of a statement about row `id`: `None` for a single node.
    pub(crate) fn bucket_of(&self, id: i64) -> Option<i16> {
        self.buckets.map(|b| b.of_id(id))
    }

    /// `items` as the batches of one statement each: one per bucket in distributed mode,
    /// all of them at once (bucket `None`) for a single node.
    pub(crate) fn by_bucket<T: Clone>(
        &self,
        items: &[T],
        id: impl Fn(&T) -> i64,
    ) -> Vec<(Option<i16>, Vec<T>)> {
        match self.buckets {
            Some(b) => b
                .group(items, id)
                .into_iter()
                .map(|(k, v)| (Some(k), v))
                .collect(),
            None => vec![(None, items.to_vec())],
        }
    }
}

impl Complete {
    pub(crate) fn render(n: &Names) -> Self {
        let t = &n.qtable;
        let d = &n.qdlq;
        // Distributed mode: every statement names the bucket of its rows as its last
        // parameter (`b3`: `$3`, and so on; `t.`-prefixed where the table is aliased); a
        // batch holds the leases of one bucket (the store splits a batch by bucket).
        let b = |p| in_bucket(n, "", p);
        let tb = |p| in_bucket(n, "t.", p);
        let (b3, tb3, b4, tb4, b6, tb6) = (b(3), tb(3), b(4), tb(4), b(6), tb(6));
        let (dlq_cols, dlq_vals6) = match n.buckets {
            Some(_) => ("bucket, ", "$6::smallint, "),
            None => ("", ""),
        };
        // Plans that do not depend on the statistics (issue 14): with statistics from when
        // the table was nearly empty, the planner believes any scan returns a row or two, so
        // it may take the whole table (or a whole partial index) as the cheapest way in.
        // Every write below therefore (1) names its rows' ids directly (`t.id = $1`,
        // `t.id = ANY($1)`) besides any join, so the primary key bounds it whatever the join
        // order, and (2) fences with `acquired_token IS NOT DISTINCT FROM $token`, not `=`:
        // `=` implies `acquired_token IS NOT NULL`, the predicate of the partial lease
        // index, which a planner that thinks that index holds one entry scans whole instead
        // of the primary key. A lease's token is never NULL, so both compare the same.
        // A row made due again by a completion (a rearm applied, a retry scheduled) is
        // announced like a publish, so every worker on the queue can move its wake-up, not
        // only the one that wrote it (it may be busy, or shutting down). The common delete
        // path notifies nothing.
        //
        // SPEC §5.2: the common success path is this one DELETE. If an extend holds the row
        // lock, the DELETE waits, and Postgres re-evaluates the WHERE on the committed row
        // (READ COMMITTED), so a freshly queued rearm makes it match nothing and we fall
        // through to the settle statement below.
        let ack_delete =
            format!("DELETE FROM {t} WHERE id = $1 AND acquired_token IS NOT DISTINCT FROM $2 AND rearm_at IS NULL{b3}");
        // The follow-up, run only when the DELETE matched nothing. It locks the row first and
        // decides under the lock: a cancel may have dropped the rearm between our two
        // statements (the DELETE skipped the row for a rearm that is gone now), and then the
        // row must still be deleted, not reported as a lost lease and left leased. Zero rows
        // locked is the lost lease.
        let ack_settle = format!(
            r#"
WITH cur AS (
    SELECT id, rearm_at IS NOT NULL AS rearm, {LOCKED_VALUES} FROM {t}
    WHERE id = $1 AND acquired_token IS NOT DISTINCT FROM $2{b3} FOR UPDATE),
deleted AS (DELETE FROM {t} t USING cur WHERE t.id = $1 AND t.id = cur.id AND NOT cur.rearm{tb3}),
rearmed AS (
    UPDATE {t} t SET {APPLY_REARM} FROM cur
    WHERE t.id = $1 AND t.id = cur.id AND cur.rearm{tb3} RETURNING t.next_attempt_at, t.queue)
SELECT (SELECT count(*) FROM cur), (SELECT next_attempt_at FROM rearmed),
       (SELECT {notify} FROM rearmed)"#,
            notify = notify(n, "rearmed")
        );
        // Outcomes are matched back by (id, token): a stale and a fresh lease of one row in
        // the same batch must not share one.
        let ack_batch_delete = format!(
            r#"
DELETE FROM {t} t USING unnest($1::bigint[], $2::uuid[]) AS l(id, token)
WHERE t.id = ANY($1::bigint[]) AND t.id = l.id AND t.acquired_token IS NOT DISTINCT FROM l.token
  AND t.rearm_at IS NULL{tb3}
RETURNING t.id, l.token"#
        );
        // The batched follow-up, for the ids the DELETE did not return; same reasoning as
        // `ack_settle`. Rows are locked in id order so two batches cannot deadlock.
        let ack_batch_settle = format!(
            r#"
WITH cur AS (
    SELECT t.id, l.token, t.rearm_at IS NOT NULL AS rearm,
           t.rearm_at, t.rearm_payload, t.rearm_headers
    FROM {t} t
    JOIN unnest($1::bigint[], $2::uuid[]) AS l(id, token)
      ON t.id = l.id AND t.acquired_token IS NOT DISTINCT FROM l.token
    WHERE t.id = ANY($1::bigint[]){tb3}
    ORDER BY t.id FOR UPDATE OF t),
deleted AS (
    DELETE FROM {t} t USING cur WHERE t.id = ANY($1::bigint[]) AND t.id = cur.id AND NOT cur.rearm{tb3}
    RETURNING cur.id, cur.token),
rearmed AS (
    UPDATE {t} t SET {APPLY_REARM} FROM cur
    WHERE t.id = ANY($1::bigint[]) AND t.id = cur.id AND cur.rearm{tb3}
    RETURNING cur.id, cur.token, t.next_attempt_at, t.queue)
SELECT id, token, NULL::timestamptz, NULL::text FROM deleted
UNION ALL SELECT id, token, next_attempt_at, {notify} FROM rearmed"#,
            notify = notify(n, "rearmed")
        );
        // One statement (SPEC §5.2). The locking CTE reads the latest row version (after any
        // lock wait) and the statement decides on it, since we hold its lock: a queued rearm
        // replaces the retry and keeps deliveries_count, so max_deliveries still stops a
        // handler that fails on every run (SPEC §5.1); a row cancelled while it ran, with no
        // rearm queued after the cancel, is deleted instead of retried (SPEC §3).
        let retry = format!(
            r#"
WITH cur AS (
    SELECT id, rearm_at IS NOT NULL AS rearm,
           cancelled_at IS NOT NULL AND rearm_at IS NULL AS cancelled, {LOCKED_VALUES},
           now() AS at_now, now() + $3::interval AS retry_at
    FROM {t} WHERE id = $1 AND acquired_token IS NOT DISTINCT FROM $2{b4} FOR UPDATE),
gone AS (DELETE FROM {t} t USING cur WHERE t.id = $1 AND t.id = cur.id AND cur.cancelled{tb4}),
up AS (
    UPDATE {t} t SET
        next_attempt_at = CASE WHEN cur.rearm THEN cur.rearm_at ELSE cur.retry_at END,
        payload = CASE WHEN cur.rearm THEN cur.rearm_payload ELSE cur.payload END,
        headers = CASE WHEN cur.rearm THEN cur.rearm_headers ELSE cur.headers END,
        attempts_count = cur.attempts_count + 1,
        first_attempt_at = coalesce(cur.first_attempt_at, cur.at_now),
        last_attempt_at = cur.at_now,
        rearm_at = NULL, rearm_payload = NULL, rearm_headers = NULL,
        acquired_token = NULL, acquired_at = NULL, cancelled_at = NULL
    FROM cur WHERE t.id = $1 AND t.id = cur.id AND NOT cur.cancelled{tb4}
    RETURNING t.next_attempt_at, cur.rearm, t.queue)
SELECT (SELECT count(*) FROM cur), (SELECT next_attempt_at FROM up), (SELECT rearm FROM up),
       (SELECT {notify} FROM up)"#,
            notify = notify(n, "up")
        );
        // Terminal failure with the dead-letter queue: archive the failed run (its own
        // payload) and delete the row or apply its rearm, in one statement (SPEC §5.1). A row
        // cancelled while it ran is deleted without an archive: nobody wants it any more.
        let fail_archive = if n.buckets.is_some() {
            format!(
                r#"
WITH cur AS (
    SELECT id, queue, payload, headers, timer_id, attempts_count, deliveries_count,
           created_at, rearm_at IS NOT NULL AS rearm,
           cancelled_at IS NOT NULL AND rearm_at IS NULL AS cancelled,
           rearm_at, rearm_payload, rearm_headers
    FROM {t} WHERE id = $1 AND acquired_token IS NOT DISTINCT FROM $2{b3} FOR UPDATE),
deleted AS (DELETE FROM {t} t USING cur WHERE t.id = $1 AND t.id = cur.id AND NOT cur.rearm{tb3}),
rearmed AS (
    UPDATE {t} t SET {APPLY_REARM} FROM cur
    WHERE t.id = $1 AND t.id = cur.id AND cur.rearm{tb3} RETURNING t.next_attempt_at, t.queue)
SELECT (SELECT count(*) FROM cur), (SELECT next_attempt_at FROM rearmed),
       (SELECT {notify} FROM rearmed), (SELECT bool_or(cancelled) FROM cur),
       (SELECT queue::text FROM cur), (SELECT payload FROM cur), (SELECT headers FROM cur),
       (SELECT timer_id::text FROM cur), (SELECT attempts_count FROM cur),
       (SELECT deliveries_count FROM cur), (SELECT created_at FROM cur)"#,
                notify = notify(n, "rearmed")
            )
        } else {
            format!(
                r#"
WITH cur AS (
    SELECT id, queue, payload, headers, timer_id, attempts_count, deliveries_count,
           created_at, rearm_at IS NOT NULL AS rearm,
           cancelled_at IS NOT NULL AND rearm_at IS NULL AS cancelled,
           rearm_at, rearm_payload, rearm_headers
    FROM {t} WHERE id = $1 AND acquired_token IS NOT DISTINCT FROM $2{b6} FOR UPDATE),
archived AS (
    INSERT INTO {d} ({dlq_cols}original_id, queue, payload, headers, timer_id, attempts_count,
                     deliveries_count, created_at, failure_reason, last_error)
    SELECT {dlq_vals6}id, queue, payload, headers, timer_id, attempts_count + $5,
           deliveries_count, created_at, $3, $4 FROM cur WHERE NOT cur.cancelled),
deleted AS (DELETE FROM {t} t USING cur WHERE t.id = $1 AND t.id = cur.id AND NOT cur.rearm{tb6}),
rearmed AS (
    UPDATE {t} t SET {APPLY_REARM} FROM cur
    WHERE t.id = $1 AND t.id = cur.id AND cur.rearm{tb6} RETURNING t.next_attempt_at, t.queue)
SELECT (SELECT count(*) FROM cur), (SELECT next_attempt_at FROM rearmed),
       (SELECT {notify} FROM rearmed), (SELECT bool_or(cancelled) FROM cur)"#,
                notify = notify(n, "rearmed")
            )
        };
        let fail_archive_insert = n.buckets.map(|_| {
            query(format!(
                r#"
INSERT INTO {d} (bucket, original_id, queue, payload, headers, timer_id, attempts_count,
                 deliveries_count, created_at, failure_reason, last_error)
VALUES ($1::smallint, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)"#
            ))
        });
        // A terminal failure without the dead-letter queue ends the row like a success; only
        // taken when no rearm is queued (the rearm applies like a success's, via ack_settle).
        let fail_delete = format!(
            r#"
DELETE FROM {t} WHERE id = $1 AND acquired_token IS NOT DISTINCT FROM $2 AND rearm_at IS NULL{b3}
RETURNING cancelled_at IS NOT NULL"#
        );
        // SPEC §7.8: one statement renews every lease the worker holds. It locks the rows it
        // updates; the worker runs it with a short lock_timeout and, if an application
        // transaction holds one of the rows, renews one row at a time instead (SPEC §7.4), so
        // it never waits for a row lock while holding another.
        let renew = format!(
            r#"
UPDATE {t} t SET acquired_at = now()
FROM unnest($1::bigint[], $2::uuid[]) AS l(id, token)
WHERE t.id = ANY($1::bigint[]) AND t.id = l.id AND t.acquired_token IS NOT DISTINCT FROM l.token{tb3}
RETURNING t.id, l.token, t.cancelled_at IS NOT NULL AND t.rearm_at IS NULL"#
        );
        // SPEC §7.5: the release table. Rows are locked in id order, and the worker runs it
        // like the renewal (short lock_timeout, one row at a time on a lock timeout).
        let release = format!(
            r#"
WITH cur AS (
    SELECT t.id, l.token, l.started, t.rearm_at IS NOT NULL AS rearm,
           t.cancelled_at IS NOT NULL AND t.rearm_at IS NULL AS cancelled,
           t.rearm_at, t.rearm_payload, t.rearm_headers, t.attempts_count,
           t.first_attempt_at, t.last_attempt_at, t.deliveries_count, t.next_attempt_at,
           t.payload, t.headers, now() AS at_now
    FROM {t} t
    JOIN unnest($1::bigint[], $2::uuid[], $3::bool[]) AS l(id, token, started)
      ON t.id = l.id AND t.acquired_token IS NOT DISTINCT FROM l.token
    WHERE t.id = ANY($1::bigint[]){tb4}
    ORDER BY t.id FOR UPDATE OF t),
gone AS (
    DELETE FROM {t} t USING cur WHERE t.id = ANY($1::bigint[]) AND t.id = cur.id AND cur.cancelled{tb4}
    RETURNING cur.id, cur.token),
back AS (
    UPDATE {t} t SET
        next_attempt_at = CASE WHEN cur.rearm THEN cur.rearm_at
                               WHEN cur.started THEN cur.at_now
                               ELSE cur.next_attempt_at END,
        payload = CASE WHEN cur.rearm THEN cur.rearm_payload ELSE cur.payload END,
        headers = CASE WHEN cur.rearm THEN cur.rearm_headers ELSE cur.headers END,
        attempts_count = CASE WHEN cur.started THEN cur.attempts_count + 1
                              WHEN cur.rearm THEN 0
                              ELSE cur.attempts_count END,
        first_attempt_at = CASE WHEN cur.started THEN coalesce(cur.first_attempt_at, cur.at_now)
                                WHEN cur.rearm THEN NULL
                                ELSE cur.first_attempt_at END,
        last_attempt_at = CASE WHEN cur.started THEN cur.at_now
                               WHEN cur.rearm THEN NULL
                               ELSE cur.last_attempt_at END,
        deliveries_count = CASE WHEN cur.started THEN cur.deliveries_count
                                ELSE greatest(cur.deliveries_count - 1, 0) END,
        rearm_at = NULL, rearm_payload = NULL, rearm_headers = NULL,
        acquired_token = NULL, acquired_at = NULL, cancelled_at = NULL
    FROM cur WHERE t.id = ANY($1::bigint[]) AND t.id = cur.id AND NOT cur.cancelled{tb4}
    RETURNING cur.id, cur.token, cur.started, t.next_attempt_at, t.queue)
SELECT id, token, 'cancelled', NULL::text FROM gone
UNION ALL
SELECT id, token, CASE WHEN started THEN 'retried' ELSE 'pending' END, {notify} FROM back"#,
            notify = notify(n, "back")
        );
        // SPEC §7.4: a row that no statement can lease (a trigger or constraint raises for
        // it) is ended by a delete, which such a guard on updates does not see. Only a row
        // nobody holds: unleased, or its lease expired.
        let fail_unclaimed = format!(
            r#"
WITH gone AS (
    DELETE FROM {t}
    WHERE id = $1 AND (acquired_token IS NULL OR acquired_at < now() - $2::interval){b6}
    RETURNING id, queue, payload, headers, timer_id, attempts_count, deliveries_count,
              created_at),
archived AS (
    INSERT INTO {d} ({dlq_cols}original_id, queue, payload, headers, timer_id, attempts_count,
                     deliveries_count, created_at, failure_reason, last_error)
    SELECT {dlq_vals6}id, queue, payload, headers, timer_id, attempts_count, deliveries_count,
           created_at, $3, $4 FROM gone WHERE $5)
SELECT count(*) FROM gone"#
        );
        Complete {
            wake: wake(n),
            fail_delete: query(fail_delete),
            renew: query(renew),
            release: query(release),
            fail_unclaimed: query(fail_unclaimed),
            ack_delete: query(ack_delete),
            ack_settle: query(ack_settle),
            ack_batch_delete: query(ack_batch_delete),
            ack_batch_settle: query(ack_batch_settle),
            retry: query(retry),
            fail_archive: query(fail_archive),
            fail_archive_insert,
            buckets: n.buckets,
        }
    }

    #[cfg(any(test, feature = "testing"))]
    pub(super) fn all(&self) -> Vec<(&'static str, &str)> {
        vec![
            ("complete.ack_delete", self.ack_delete.as_str()),
            ("complete.ack_settle", self.ack_settle.as_str()),
            ("complete.ack_batch_delete", self.ack_batch_delete.as_str()),
            ("complete.ack_batch_settle", self.ack_batch_settle.as_str()),
            ("complete.retry", self.retry.as_str()),
            ("complete.fail_archive", self.fail_archive.as_str()),
            ("complete.fail_delete", self.fail_delete.as_str()),
            ("complete.renew", self.renew.as_str()),
            ("complete.release", self.release.as_str()),
            ("complete.fail_unclaimed", self.fail_unclaimed.as_str()),
        ]
    }
}
