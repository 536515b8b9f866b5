//! `sql/stats.rs`: queue statistics, always counted exactly.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};

use super::state::{plus, State};
use super::MemoryStore;
#[cfg(doc)]
use crate::error::Error;
use crate::error::Result;
use crate::sql::binds::micros;
use crate::stats::{complete, lateness, Count, QueueStats, StatsMode, StatsRequest};

impl State {
    /// `sql::stats`' exact statement: unleased rows (due when their deadline has passed),
    /// leased rows (expired when `acquired_at < now - ttl`, the queue's own TTL where the
    /// request gives one), rearms and cancel marks, and dead letters when the dead-letter
    /// queue is on. Exact in either mode: there are no planner statistics to read.
    pub(super) fn stats(&self, request: &StatsRequest) -> Result<Vec<QueueStats>> {
        request.validate()?;
        let list = request.queue_list();
        if list.is_some_and(<[String]>::is_empty) {
            return Ok(Vec::new());
        }
        let wanted = |q: &str| list.is_none_or(|l| l.iter().any(|x| x == q));
        #[derive(Default)]
        struct Acc {
            pending: u64,
            due: u64,
            earliest: Option<DateTime<Utc>>,
            leased: u64,
            expired: u64,
            rearms: u64,
            cancel_marks: u64,
            dead: u64,
        }
        let mut by: BTreeMap<&str, Acc> = BTreeMap::new();
        for r in self.rows.values().filter(|r| wanted(&r.queue)) {
            let acc = by.entry(&r.queue).or_default();
            match r.acquired_at.filter(|_| r.acquired_token.is_some()) {
                None => {
                    acc.pending += 1;
                    acc.due += u64::from(r.next_attempt_at <= self.now);
                    acc.earliest = Some(
                        acc.earliest
                            .map_or(r.next_attempt_at, |e| e.min(r.next_attempt_at)),
                    );
                }
                Some(acquired_at) => {
                    let ttl = micros(request.lease_ttl_of(&r.queue), "lease_ttl")?;
                    let cutoff = plus(self.now, -ttl, "lease_ttl")?;
                    acc.leased += 1;
                    acc.expired += u64::from(acquired_at < cutoff);
                    acc.rearms += u64::from(r.rearm_at.is_some());
                    acc.cancel_marks += u64::from(r.cancelled_at.is_some());
                }
            }
        }
        if self.dead_letter {
            // Every archived row counts: this store has no redrive, so none is redriven.
            // Dead letters not redriven, as `redriven_at IS NULL` in the statement.
            for d in self
                .dlq
                .iter()
                .filter(|d| wanted(&d.queue) && d.redriven_at.is_none())
            {
                by.entry(&d.queue).or_default().dead += 1;
            }
        }
        let out = by
            .into_iter()
            .map(|(queue, a)| QueueStats {
                queue: queue.to_owned(),
                pending: Count::Exact(a.pending),
                due: Count::Exact(a.due),
                leased: Count::Exact(a.leased),
                expired_leases: Count::Exact(a.expired),
                oldest_due_lateness: a
                    .earliest
                    .filter(|e| *e <= self.now)
                    .map(|e| lateness(self.now, e)),
                rearms: Count::Exact(a.rearms),
                cancel_marks: Count::Exact(a.cancel_marks),
                dead_letters: if self.dead_letter {
                    Count::Exact(a.dead)
                } else {
                    Count::Unavailable
                },
            })
            .collect();
        Ok(complete(out, list, StatsMode::Exact, self.dead_letter))
    }
}

impl MemoryStore {
    /// Queue statistics, as [`Outbox::stats`](crate::Outbox::stats) reads them: the same
    /// figures, by the store's clock, always counted exactly (also for
    /// [`StatsMode::Estimate`]: there are no planner statistics here).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a bad queue name or a zero lease TTL.
    pub fn stats(&self, request: &StatsRequest) -> Result<Vec<QueueStats>> {
        self.lock().stats(request)
    }
}
