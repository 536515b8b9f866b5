//! `sql/admin.rs`: pausing and resuming a queue, and acting on one pending row by id.

use super::state::State;
use super::MemoryStore;
use crate::admin::{PausedQueue, RowAction};
#[cfg(doc)]
use crate::error::Error;
use crate::error::Result;
use crate::message::{validate_queue, Schedule};

impl State {
    /// `sql::admin`: the pause and resume statements.
    fn pause(&mut self, queue: &str, on: bool) -> Result<bool> {
        validate_queue(queue)?;
        if on {
            if self.paused.contains_key(queue) {
                return Ok(false);
            }
            self.paused.insert(queue.to_owned(), self.now);
            return Ok(true);
        }
        if self.paused.remove(queue).is_none() {
            return Ok(false);
        }
        let now = self.now;
        self.notify(queue, now);
        Ok(true)
    }

    /// `sql::admin`: a pending row's new deadline, or its deletion (`schedule` None).
    fn act(&mut self, id: i64, schedule: Option<Schedule>) -> Result<RowAction> {
        crate::admin::validate_id(id)?;
        let at = match schedule {
            Some(s) => Some(self.deadline(s.resolve()?)?),
            None => None,
        };
        let Some(row) = self.rows.get_mut(&id) else {
            return Ok(RowAction::NotFound);
        };
        if row.acquired_token.is_some() {
            return Ok(RowAction::Leased);
        }
        let Some(at) = at else {
            self.rows.remove(&id);
            return Ok(RowAction::Deleted);
        };
        row.next_attempt_at = at;
        let queue = row.queue.clone();
        self.notify(&queue, at);
        Ok(RowAction::Rescheduled {
            next_attempt_at: at,
        })
    }
}

impl MemoryStore {
    /// Pauses `queue`, as [`Outbox::pause_queue`](crate::Outbox::pause_queue) does: claims
    /// skip it (due rows and expired leases alike) and the next wake-up ignores its
    /// deadlines; publishing goes on. True when this call paused it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a bad queue name.
    pub fn pause_queue(&self, queue: &str) -> Result<bool> {
        self.lock().pause(queue, true)
    }

    /// Resumes `queue` and wakes listening workers, as
    /// [`Outbox::resume_queue`](crate::Outbox::resume_queue) does. True when this call
    /// resumed it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a bad queue name.
    pub fn resume_queue(&self, queue: &str) -> Result<bool> {
        self.lock().pause(queue, false)
    }

    /// The paused queues, by name.
    pub fn paused_queues(&self) -> Vec<PausedQueue> {
        self.lock()
            .paused
            .iter()
            .map(|(queue, at)| PausedQueue {
                queue: queue.clone(),
                paused_at: *at,
            })
            .collect()
    }

    /// Makes pending row `id` due now, as [`Outbox::run_now`](crate::Outbox::run_now) does.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an id below 1.
    pub fn run_now(&self, id: i64) -> Result<RowAction> {
        self.reschedule(id, Schedule::now())
    }

    /// Moves the deadline of pending row `id`, as
    /// [`Outbox::reschedule`](crate::Outbox::reschedule) does.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an id below 1 or a bad schedule.
    pub fn reschedule(&self, id: i64, schedule: impl Into<Schedule>) -> Result<RowAction> {
        self.lock().act(id, Some(schedule.into()))
    }

    /// Deletes pending row `id`, as
    /// [`Outbox::delete_pending`](crate::Outbox::delete_pending) does.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an id below 1.
    pub fn delete_pending(&self, id: i64) -> Result<RowAction> {
        self.lock().act(id, None)
    }
}
