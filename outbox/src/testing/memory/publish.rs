//! `sql/publish.rs`: the single-row insert and extend, the batch; and the [`Publisher`]
//! implementation the functions `#[timer]` generates call.

use std::future::{ready, Future};

use chrono::TimeDelta;

use super::state::State;
use super::MemoryStore;
use crate::cancel::Cancelled;
#[cfg(doc)]
use crate::error::Error;
use crate::error::Result;
use crate::message::envelope::{Message, Published};
use crate::message::{slack_micros, validate_batch, BatchItem, OnConflict, Schedule};
use crate::publish;
use crate::timer::Publisher;

impl State {
    /// `publish.rs`: the insert statement (`Ignore`) and the extend statement (`Extend`).
    fn publish(&mut self, message: Message<'_>) -> Result<Published> {
        let schedule = message.validate()?;
        let at = self.deadline(schedule)?;
        // The statements look for the key first: only a real insert evaluates the identity
        // default, so only an insert uses up an id.
        let existing = message
            .timer_id
            .and_then(|k| self.timer_row(message.queue, k));
        let Some(existing) = existing else {
            let id = self.next_id();
            self.insert(
                id,
                message.queue.to_owned(),
                message.payload.to_vec(),
                message.headers.cloned(),
                message.timer_id.map(str::to_owned),
                at,
            );
            // Only an insert notifies; an extend or a skipped publish does not (SPEC §2.4).
            self.notify(message.queue, at);
            return Ok(Published::Inserted { id });
        };
        if message.on_conflict == OnConflict::Ignore {
            return Ok(Published::Skipped);
        }
        let slack = TimeDelta::microseconds(slack_micros(message.slack));
        let Some(row) = self.rows.get_mut(&existing) else {
            return Ok(Published::Skipped);
        };
        if row.acquired_token.is_none() {
            // SPEC §4: later only (by more than the slack); new payload and headers; retry
            // history reset.
            if at <= row.next_attempt_at + slack {
                return Ok(Published::Unchanged);
            }
            row.next_attempt_at = at;
            row.payload = message.payload.to_vec();
            row.headers = message.headers.cloned();
            row.attempts_count = 0;
            row.first_attempt_at = None;
            row.last_attempt_at = None;
            Ok(Published::Extended { id: row.id })
        } else {
            // SPEC §5: later than greatest(claimed deadline, rearm_at + slack); `greatest`
            // ignores NULL, so the slack never applies to a running row without a rearm.
            let current = row.rearm_at.map_or(row.next_attempt_at, |r| {
                (r + slack).max(row.next_attempt_at)
            });
            if at <= current {
                return Ok(Published::Unchanged);
            }
            row.rearm_at = Some(at);
            row.rearm_payload = Some(message.payload.to_vec());
            row.rearm_headers = message.headers.cloned();
            // The newest intent wins: an extend after a cancel re-arms the timer.
            row.cancelled_at = None;
            Ok(Published::RearmQueued { id: row.id })
        }
    }

    /// `Outbox::publish_batch`: the same checks in the same order, ids in item order.
    fn publish_batch(
        &mut self,
        queue: &str,
        items: &[BatchItem<'_>],
        schedule: Schedule,
    ) -> Result<Vec<i64>> {
        let resolved = validate_batch(queue, items, schedule)?;
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let at = self.deadline(resolved)?;
        let mut ids = Vec::with_capacity(items.len());
        for item in items {
            let id = self.next_id();
            self.insert(
                id,
                queue.to_owned(),
                item.payload.to_vec(),
                item.headers.cloned(),
                None,
                at,
            );
            ids.push(id);
        }
        // One notification for the batch.
        self.notify(queue, at);
        Ok(ids)
    }
}

impl MemoryStore {
    /// Publishes many messages to one queue at once, like
    /// [`Outbox::publish_batch`](crate::Outbox::publish_batch): all or nothing, no timer
    /// ids, new ids in the order of `items`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a bad queue name, schedule, payload (over 64 MiB) or
    /// headers (over 64 KiB, or a NUL), checked before anything is written.
    pub fn publish_batch(
        &self,
        queue: &str,
        items: &[BatchItem<'_>],
        schedule: impl Into<Schedule>,
    ) -> Result<Vec<i64>> {
        let span = crate::telemetry::send_span(queue, None, Some(items.len()));
        let traced = publish::batch_trace_context(&span, items);
        let rebuilt;
        let items = match &traced {
            Some(traced) => {
                rebuilt = publish::traced_items(items, traced);
                &rebuilt[..]
            }
            None => items,
        };
        let result = span.in_scope(|| self.lock().publish_batch(queue, items, schedule.into()));
        publish::sent_batch(&span, &result);
        result
    }
}

/// Lets the functions `#[timer]` generates publish into the store:
/// `extend_presence_expiry(&store, "7", &payload, Duration::from_secs(60))`. Each call is
/// atomic on its own.
impl Publisher for &MemoryStore {
    fn publish_message<'m>(
        self,
        message: Message<'m>,
    ) -> impl Future<Output = Result<Published>> + Send {
        // The same `send` span and trace context as a publish on Postgres.
        let span = publish::send_span(&message);
        let traced = publish::with_trace_context(&span, message.headers);
        let message = Message {
            headers: traced.as_ref().or(message.headers),
            ..message
        };
        let result = span.in_scope(|| self.lock().publish(message));
        publish::sent(&span, &result);
        ready(result)
    }

    fn cancel_timer(
        self,
        queue: &str,
        timer_id: &str,
    ) -> impl Future<Output = Result<Cancelled>> + Send {
        ready(self.lock().cancel(queue, timer_id))
    }
}
