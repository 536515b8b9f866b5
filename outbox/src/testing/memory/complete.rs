//! `sql/complete.rs`: the fenced completions (ack, batched ack, retry, terminal failure),
//! renewal, release at shutdown, and the terminal failure of a row no claim can take.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use chrono::{DateTime, Utc};

use super::state::{cancelled, clear_rearm, plus, State};
use crate::error::Result;
use crate::sql::binds::micros;
use crate::store::rows::{DeadLetter, StoredRow};
use crate::store::{clean_error_text, Completion, Failure, Lease, Release, Released, Renewal};

impl State {
    /// As on Postgres: `DELETE … AND rearm_at IS NULL`, else the fenced rearm UPDATE.
    pub(super) fn ack(&mut self, lease: Lease) -> Completion {
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
    pub(super) fn ack_batch(&mut self, leases: &[Lease]) -> Vec<Completion> {
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
    pub(super) fn retry(&mut self, lease: Lease, delay: Duration) -> Result<Completion> {
        crate::store::check_retry_delay(delay)?;
        let delay = micros(delay, "delay")?;
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
                let at = plus(now, delay, "delay")?;
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
    pub(super) fn fail(&mut self, lease: Lease, failure: Failure<'_>) -> Completion {
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
    pub(super) fn renew(&mut self, leases: &[Lease]) -> Vec<Renewal> {
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
    pub(super) fn release(&mut self, items: &[Release]) -> Vec<Released> {
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
    pub(super) fn fail_unclaimed(
        &mut self,
        id: i64,
        lease_ttl: Duration,
        failure: Failure<'_>,
    ) -> Result<Completion> {
        let expired_before = plus(self.now, -micros(lease_ttl, "lease_ttl")?, "lease_ttl")?;
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
