//! `sql/claim.rs`: the claim (fair across queues, per-queue caps, a reclaimed cancelled row
//! deleted), what it would take (`peek`), and the next wake-up.

use std::collections::HashSet;

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::state::{cancelled, plus, row_order, State};
use crate::error::Result;
use crate::message::validate_queue;
use crate::sql::binds::micros;
use crate::store::rows::StoredRow;
use crate::store::{ClaimRequest, Delivery, Lease, NextWakeup};

impl State {
    /// The candidates of the claim statement: `(deadline, id)` of what a claim would take,
    /// in claim order, at most `limit`.
    pub(super) fn candidates(
        &self,
        request: ClaimRequest<'_>,
    ) -> Result<Vec<(DateTime<Utc>, i64)>> {
        for q in request.queues {
            validate_queue(q)?;
        }
        let ttl = micros(request.lease_ttl, "lease_ttl")?;
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
        // queue's candidates by (deadline, id) within its cap; then the best `limit` by
        // round, then by the queue's place in the round (its position in `per_queue`'s
        // rotated list) — the claim statement's FAIR_ORDER, `turn <= cap` and CLAIM_ORDER.
        let mut candidates: Vec<(usize, usize, DateTime<Utc>, i64)> = Vec::new();
        for (pos, (q, cap)) in queues.iter().zip(caps).enumerate() {
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
                    .map(|(turn, (at, id))| (turn, pos, at, id)),
            );
        }
        candidates.sort();
        candidates.truncate(limit);
        Ok(candidates
            .into_iter()
            .map(|(_, _, at, id)| (at, id))
            .collect())
    }

    /// The claim statement of `store/postgres.rs`: one new token for the claim,
    /// `acquired_at = now`, `deliveries_count + 1`; a reclaimed cancelled row is deleted.
    pub(super) fn claim(&mut self, request: ClaimRequest<'_>) -> Result<Vec<Delivery>> {
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
        crate::store::fair_order(&mut out, request.resume_after);
        Ok(out)
    }

    pub(super) fn next_wakeup(&self, request: ClaimRequest<'_>) -> Result<NextWakeup> {
        for q in request.queues {
            validate_queue(q)?;
        }
        let ttl = micros(request.lease_ttl, "lease_ttl")?;
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
        let lease_expiry = oldest_lease
            .map(|a| plus(a, ttl, "lease_ttl"))
            .transpose()?;
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
}
