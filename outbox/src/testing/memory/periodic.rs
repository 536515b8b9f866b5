//! `sql/periodic.rs`: arming a schedule's next instant at the start of a run, and
//! registering a schedule.

use chrono::{DateTime, Utc};

use super::state::{to_postgres_precision, State};
use crate::error::Result;
use crate::store::{Armed, Lease, RegisterSchedule, Registered, SCHEDULE_HEADER};

impl State {
    /// `periodic.rs`, `arm_next`: lock the leased row, keep a rearm that is not earlier
    /// than `at` or that a registration of another schedule queued, else queue `at` with
    /// the row's own payload and headers; never on a cancel-marked row.
    pub(super) fn arm_next(&mut self, lease: Lease, at: DateTime<Utc>) -> Armed {
        let at = to_postgres_precision(at);
        let Some(row) = self.leased(lease) else {
            return Armed::LeaseLost;
        };
        if row.cancelled_at.is_some() {
            return Armed::Cancelled;
        }
        if let Some(queued) = row.rearm_at {
            let theirs = row
                .rearm_headers
                .as_ref()
                .and_then(|h| h.get(SCHEDULE_HEADER));
            let ours = row.headers.as_ref().and_then(|h| h.get(SCHEDULE_HEADER));
            if queued >= at || (theirs.is_some() && theirs != ours) {
                return Armed::Kept { at: queued };
            }
        }
        row.rearm_at = Some(at);
        row.rearm_payload = Some(row.payload.clone());
        row.rearm_headers = row.headers.clone();
        Armed::Queued { at }
    }

    /// `periodic.rs`, `register`: insert, or compare the fingerprint and payload the row
    /// carries next and bring the row to the new schedule (another payload alone keeps the
    /// timing).
    pub(super) fn register_schedule(
        &mut self,
        request: RegisterSchedule<'_>,
    ) -> Result<Registered> {
        request.validate()?;
        let at = to_postgres_precision(request.first);
        // The statement looks for the key first: only an insert uses up an id.
        let Some(existing) = self.timer_row(request.queue, request.timer_id) else {
            let id = self.next_id();
            self.insert(
                id,
                request.queue.to_owned(),
                request.payload.to_vec(),
                Some(request.headers.clone()),
                Some(request.timer_id.to_owned()),
                at,
            );
            self.notify(request.queue, at);
            return Ok(Registered::Inserted { id, at });
        };
        let Some(row) = self.rows.get_mut(&existing) else {
            return Ok(Registered::Unchanged);
        };
        // What the row carries next: its queued rearm, else itself.
        let (next_headers, next_payload) = if row.rearm_at.is_some() {
            (row.rearm_headers.as_ref(), row.rearm_payload.as_deref())
        } else {
            (row.headers.as_ref(), Some(row.payload.as_slice()))
        };
        let moved = next_headers.and_then(|h| h.get(SCHEDULE_HEADER))
            != request.headers.get(SCHEDULE_HEADER);
        let same_payload = next_payload == Some(request.payload);
        let stopped = row.cancelled_at.is_some() && row.rearm_at.is_none();
        if !moved && same_payload && !stopped {
            return Ok(Registered::Unchanged);
        }
        row.cancelled_at = None;
        if row.acquired_token.is_none() {
            // Another recurrence moves the deadline unless it is overdue (the missed instant
            // fires once); another payload alone keeps it.
            if moved && row.next_attempt_at > self.now {
                row.next_attempt_at = at;
            }
            row.payload = request.payload.to_vec();
            row.headers = Some(request.headers.clone());
            row.attempts_count = 0;
            row.first_attempt_at = None;
            row.last_attempt_at = None;
            let (id, due) = (row.id, row.next_attempt_at);
            self.notify(request.queue, due);
            Ok(Registered::Rescheduled { id, at: due })
        } else {
            let rearm_at = match row.rearm_at {
                Some(queued) if !moved => queued,
                _ => at,
            };
            row.rearm_at = Some(rearm_at);
            row.rearm_payload = Some(request.payload.to_vec());
            row.rearm_headers = Some(request.headers.clone());
            Ok(Registered::RearmReplaced {
                id: row.id,
                at: rearm_at,
            })
        }
    }
}
