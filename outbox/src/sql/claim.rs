//! Claiming due rows (SPEC §6) and finding when to look next (SPEC §7.3).

use sqlx::SqlStr;

use super::query;
use crate::names::Names;

/// The columns a claim returns, in the order `store/rows.rs` decodes a delivery from.
pub(crate) const DELIVERY_COLUMNS: &str = "t.id, t.acquired_token, t.queue, t.payload, t.headers, \
     t.timer_id, t.attempts_count, t.deliveries_count, t.created_at, t.next_attempt_at, \
     t.first_attempt_at, t.acquired_at";

#[derive(Debug)]
pub(crate) struct Claim {
    /// `$1 text[]` queues, `$2 bigint` limit, `$3 interval` lease TTL, `$4 uuid` token.
    pub claim: SqlStr,
    /// `$1 text[]` queues, `$2 interval` lease TTL → `(now, earliest deadline, earliest
    /// future deadline, earliest lease expiry)`.
    pub next_wakeup: SqlStr,
    /// The store's clock.
    pub now: SqlStr,
}

impl Claim {
    pub(crate) fn render(n: &Names) -> Self {
        let t = &n.qtable;
        // Each queue gets two LATERAL branches with their own LIMIT, each carrying the
        // predicate of its partial index (`acquired_token IS NULL` → <t>_pending_idx,
        // `IS NOT NULL` → <t>_lease_idx), so the cost depends on the limit, not on the
        // backlog. The branches order by their index alone: ordering by (next_attempt_at, id)
        // there would sort every row sharing a deadline (a batch published in one
        // transaction shares `now()`); ties among equal deadlines are taken in index order
        // and the claimed batch is then ordered by (next_attempt_at, id). Rows locked by the
        // branches but cut by the outer LIMIT are released when the statement ends.
        //
        // A reclaimed row (its lease expired) that a cancel reached while it ran, with no
        // rearm queued after the cancel, is deleted instead of delivered (SPEC §3): the
        // `gone` branch. Pending rows never carry the mark, so the common path only pays
        // for a join over the claimed ids.
        let claim = format!(
            r#"
WITH cand AS (
    SELECT c.id, c.next_attempt_at, false AS cancelled FROM unnest($1::text[]) AS q(queue)
    CROSS JOIN LATERAL (
        SELECT id, next_attempt_at FROM {t}
        WHERE queue = q.queue AND acquired_token IS NULL AND next_attempt_at <= now()
        ORDER BY next_attempt_at LIMIT $2 FOR UPDATE SKIP LOCKED) c
    UNION ALL
    SELECT c.id, c.next_attempt_at, c.cancelled FROM unnest($1::text[]) AS q(queue)
    CROSS JOIN LATERAL (
        SELECT id, next_attempt_at, cancelled_at IS NOT NULL AND rearm_at IS NULL AS cancelled
        FROM {t}
        WHERE queue = q.queue AND acquired_token IS NOT NULL
          AND acquired_at < now() - $3::interval AND next_attempt_at <= now()
        ORDER BY acquired_at LIMIT $2 FOR UPDATE SKIP LOCKED) c),
due AS (SELECT id, cancelled FROM cand ORDER BY next_attempt_at, id LIMIT $2),
gone AS (DELETE FROM {t} t USING due WHERE t.id = due.id AND due.cancelled)
UPDATE {t} t SET acquired_token = $4, acquired_at = now(),
                 deliveries_count = t.deliveries_count + 1
FROM due WHERE t.id = due.id AND NOT due.cancelled
RETURNING {DELIVERY_COLUMNS}"#
        );
        // Every minimum comes from a partial index (one index probe per queue each).
        let next_wakeup = format!(
            r#"
SELECT now(),
    (SELECT min(x.next_attempt_at) FROM unnest($1::text[]) AS q(queue)
     CROSS JOIN LATERAL (SELECT next_attempt_at FROM {t}
         WHERE queue = q.queue AND acquired_token IS NULL
         ORDER BY next_attempt_at LIMIT 1) x),
    (SELECT min(x.next_attempt_at) FROM unnest($1::text[]) AS q(queue)
     CROSS JOIN LATERAL (SELECT next_attempt_at FROM {t}
         WHERE queue = q.queue AND acquired_token IS NULL AND next_attempt_at > now()
         ORDER BY next_attempt_at LIMIT 1) x),
    (SELECT min(x.acquired_at) + $2::interval FROM unnest($1::text[]) AS q(queue)
     CROSS JOIN LATERAL (SELECT acquired_at FROM {t}
         WHERE queue = q.queue AND acquired_token IS NOT NULL
         ORDER BY acquired_at LIMIT 1) x)"#
        );
        Claim {
            claim: query(claim),
            next_wakeup: query(next_wakeup),
            now: SqlStr::from_static("SELECT now()"),
        }
    }

    #[cfg(test)]
    pub(super) fn all(&self) -> Vec<(&'static str, &str)> {
        vec![
            ("claim.claim", self.claim.as_str()),
            ("claim.next_wakeup", self.next_wakeup.as_str()),
            ("claim.now", self.now.as_str()),
        ]
    }
}
