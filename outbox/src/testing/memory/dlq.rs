//! `sql/dlq.rs`: dead letters listed by filter, redriven, purged by age.

use chrono::{DateTime, Utc};

use super::state::{plus, to_postgres_precision, State};
use super::MemoryStore;
use crate::dlq::{DeadLetterFilter, Redrive, RedriveOutcome, RedriveResult, Selection};
#[cfg(doc)]
use crate::error::Error;
use crate::error::Result;
use crate::sql::binds::micros;
use crate::store::rows::DeadLetter;

impl State {
    /// Whether `d` is a row of `filter` at this clock: the shared filter of `sql/dlq.rs`,
    /// its times at Postgres' precision as sqlx binds them.
    fn dlq_matches(&self, filter: &DeadLetterFilter, d: &DeadLetter) -> Result<bool> {
        let older = match filter.older_than {
            Some(age) => Some(plus(self.now, -micros(age, "older_than")?, "older_than")?),
            None => None,
        };
        let after = filter.failed_after.map(to_postgres_precision);
        let before = filter.failed_before.map(to_postgres_precision);
        Ok(filter.queue.as_ref().is_none_or(|q| &d.queue == q)
            && filter.reason.is_none_or(|r| d.failure_reason == r.as_str())
            && after.is_none_or(|a| d.failed_at >= a)
            && before.is_none_or(|b| d.failed_at < b)
            && older.is_none_or(|o| d.failed_at < o)
            && (filter.include_redriven || d.redriven_at.is_none()))
    }

    /// `dlq.list`: the rows of the filter above the cursor, by id.
    fn dlq_list(
        &self,
        filter: &DeadLetterFilter,
        after: Option<i64>,
        limit: usize,
    ) -> Result<Vec<DeadLetter>> {
        crate::dlq::require_enabled(self.dead_letter)?;
        filter.binds()?;
        let after = after.unwrap_or(i64::MIN);
        let mut out = Vec::new();
        // `dlq` is in id order.
        for d in self.dlq.iter().filter(|d| d.id > after) {
            if out.len() >= limit {
                break;
            }
            if self.dlq_matches(filter, d)? {
                out.push(d.clone());
            }
        }
        Ok(out)
    }

    /// `dlq.redrive_ids` / `dlq.redrive_matching`: classify each selected row, then insert
    /// the ones that pass in id order (only an insert uses up an id: the statement leaves a
    /// held key out before the INSERT), mark them, and notify once per queue.
    fn redrive(&mut self, redrive: &Redrive) -> Result<Vec<RedriveOutcome>> {
        crate::dlq::require_enabled(self.dead_letter)?;
        redrive.check()?;
        let selected: Vec<(i64, Option<usize>)> = match &redrive.selection {
            Selection::Ids(ids) => ids
                .iter()
                .map(|&id| (id, self.dlq.iter().position(|d| d.id == id)))
                .collect(),
            Selection::Matching { filter, limit } => {
                filter.binds()?;
                let mut out = Vec::new();
                for (i, d) in self.dlq.iter().enumerate() {
                    if out.len() >= *limit {
                        break;
                    }
                    if d.redriven_at.is_none() && self.dlq_matches(filter, d)? {
                        out.push((d.id, Some(i)));
                    }
                }
                out
            }
        };
        let now = self.now;
        let mut woken: Vec<String> = Vec::new();
        let mut out = Vec::with_capacity(selected.len());
        for (dead_letter_id, at) in selected {
            let result = match at {
                None => RedriveResult::NotFound,
                Some(i) => self.redrive_one(i, now, &mut woken),
            };
            out.push(RedriveOutcome {
                dead_letter_id,
                result,
            });
        }
        for queue in woken {
            self.notify(&queue, now);
        }
        Ok(out)
    }

    fn redrive_one(
        &mut self,
        i: usize,
        now: DateTime<Utc>,
        woken: &mut Vec<String>,
    ) -> RedriveResult {
        let letter = &self.dlq[i];
        if letter.redriven_at.is_some() {
            return RedriveResult::AlreadyRedriven {
                redriven_id: letter.redriven_id,
            };
        }
        let headers = match crate::dlq::redrive_headers(letter) {
            Ok(h) => h,
            Err(refused) => return refused,
        };
        let (queue, payload, timer_id) = (
            letter.queue.clone(),
            letter.payload.clone(),
            crate::dlq::redrive_timer_id(letter),
        );
        if timer_id
            .as_deref()
            .is_some_and(|k| self.timer_row(&queue, k).is_some())
        {
            return RedriveResult::TimerKeyHeld;
        }
        let id = self.next_id();
        self.insert(id, queue.clone(), payload, Some(headers), timer_id, now);
        let letter = &mut self.dlq[i];
        letter.redriven_at = Some(now);
        letter.redriven_id = Some(id);
        if !woken.contains(&queue) {
            woken.push(queue);
        }
        RedriveResult::Redriven { id }
    }

    /// `dlq.purge`, every batch at once: nothing here is ever locked, so no row is skipped.
    fn purge(&mut self, filter: &DeadLetterFilter, batch_size: usize) -> Result<u64> {
        crate::dlq::require_enabled(self.dead_letter)?;
        crate::dlq::check_purge(filter, batch_size)?;
        let mut keep = Vec::with_capacity(self.dlq.len());
        let mut deleted = 0u64;
        for d in std::mem::take(&mut self.dlq) {
            if self.dlq_matches(filter, &d)? {
                deleted += 1;
            } else {
                keep.push(d);
            }
        }
        self.dlq = keep;
        Ok(deleted)
    }
}

impl MemoryStore {
    /// Dead letters of `filter` with an id above `after`, by id, at most `limit`: what
    /// [`Outbox::dead_letters`](crate::Outbox::dead_letters) reads ([`crate::dlq`] has the
    /// rules and the paging).
    ///
    /// # Errors
    /// [`Error::DeadLetterDisabled`] with the dead-letter queue off;
    /// [`Error::InvalidArgument`] for a filter that breaks a rule.
    pub fn dead_letters(
        &self,
        filter: &DeadLetterFilter,
        after: Option<i64>,
        limit: usize,
    ) -> Result<Vec<DeadLetter>> {
        self.lock().dlq_list(filter, after, limit)
    }

    /// Redrives dead letters as
    /// [`Outbox::redrive_dead_letters`](crate::Outbox::redrive_dead_letters) does, with the
    /// same outcomes, ids and rows: each redriven row is published again due at the store's
    /// clock, and its dead letter records `redriven_at` (the clock) and `redriven_id`.
    /// Atomic on its own, like every call here.
    ///
    /// # Errors
    /// As [`MemoryStore::dead_letters`].
    pub fn redrive_dead_letters(&self, redrive: &Redrive) -> Result<Vec<RedriveOutcome>> {
        self.lock().redrive(redrive)
    }

    /// Deletes the dead letters of `filter`, as
    /// [`Outbox::purge_dead_letters`](crate::Outbox::purge_dead_letters) does, and returns
    /// how many. Nothing is ever locked here, so no row is skipped and the batch size only
    /// has to be valid.
    ///
    /// # Errors
    /// As [`MemoryStore::dead_letters`], and [`Error::InvalidArgument`] for a filter
    /// without an age bound or a `batch_size` of 0.
    pub fn purge_dead_letters(&self, filter: &DeadLetterFilter, batch_size: usize) -> Result<u64> {
        self.lock().purge(filter, batch_size)
    }
}
