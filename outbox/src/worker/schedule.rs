//! Periodic timers on the worker: the schedules registered with
//! [`WorkerBuilder::schedule`](crate::WorkerBuilder::schedule), their registration when the
//! worker starts, and the next instant a periodic run queues when it starts.
//!
//! A schedule is the keyed timer `schedule:<name>` of its type's queue. Registration writes
//! its row once per worker start (one statement, so racing workers leave one live row); a
//! run of that row, when it starts, queues the schedule's next instant as a rearm on its own
//! leased row, so every way the run ends keeps the schedule going.

// SPEC §9.1: the rearm is queued when the run starts (after the claim, before the handler
// and before the `max_deliveries` terminal path), from the database clock.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use tokio::sync::watch;

use super::shared::backoff;
use crate::error::{Error, Printable, Result};
use crate::message::{validate_payload, validate_timer_id, Headers};
use crate::periodic::{Recurrence, DECLARED_SCHEDULE_NAME};
use crate::store::SCHEDULE_KEY_PREFIX;
use crate::store::{Armed, Delivery, RegisterSchedule, Registered, Store, SCHEDULE_HEADER};
use crate::timer::Timer;

/// A schedule declared on the builder, checked by `build`.
#[derive(Debug, Clone)]
pub(crate) struct Declared {
    pub(crate) queue: &'static str,
    /// The payload type, for error messages.
    pub(crate) type_name: &'static str,
    pub(crate) name: String,
    /// The recurrence, or why the type's declared one is invalid (only a hand-written
    /// `Timer::declared_schedule` can fail: the attribute checks at compile time).
    pub(crate) recurrence: std::result::Result<Recurrence, String>,
    /// The encoded payload, or the encoding error `build` returns.
    pub(crate) payload: std::result::Result<Vec<u8>, String>,
}

/// A checked schedule: what registration writes.
#[derive(Debug, Clone)]
pub(crate) struct Schedule {
    pub(crate) queue: String,
    pub(crate) timer_id: String,
    pub(crate) recurrence: Recurrence,
    pub(crate) payload: Vec<u8>,
    pub(crate) headers: Headers,
}

impl Declared {
    /// A schedule of `T`: `name`, `recurrence` and the payload each run gets.
    pub(crate) fn of<T: Timer>(
        name: &str,
        recurrence: std::result::Result<Recurrence, String>,
        payload: &T,
    ) -> Declared {
        Declared {
            queue: T::QUEUE,
            type_name: std::any::type_name::<T>(),
            name: name.to_owned(),
            recurrence,
            payload: payload.encode().map_err(|e| e.to_string()),
        }
    }

    /// The schedule declared on `T` itself (`#[timer(every = …)]`, `#[timer(cron = …)]`),
    /// under [`DECLARED_SCHEDULE_NAME`]; `None` for a type without one.
    pub(crate) fn declared_on<T: Timer>() -> Option<Declared> {
        let (recurrence, payload) = T::declared_schedule()?;
        Some(Declared::of::<T>(
            DECLARED_SCHEDULE_NAME,
            recurrence.map_err(|e| e.to_string()),
            &payload,
        ))
    }

    /// The checks of `build`, before anything is written.
    pub(crate) fn check(self) -> Result<Schedule> {
        if self.name.is_empty() {
            return Err(Error::invalid(
                "schedule",
                format!("a schedule of {} needs a non-empty name", self.type_name),
            ));
        }
        let timer_id = format!("{SCHEDULE_KEY_PREFIX}{}", self.name);
        validate_timer_id(&timer_id).map_err(|e| {
            Error::invalid(
                "schedule",
                format!("schedule {:?} of {}: {e}", self.name, self.type_name),
            )
        })?;
        let recurrence = self.recurrence.map_err(|e| {
            Error::invalid(
                "schedule",
                format!(
                    "schedule {:?} of {}: invalid recurrence: {e}",
                    self.name, self.type_name
                ),
            )
        })?;
        let payload = self.payload.map_err(|e| {
            Error::invalid(
                "schedule",
                format!(
                    "schedule {:?}: the payload of {} does not encode: {e}",
                    self.name, self.type_name
                ),
            )
        })?;
        validate_payload(&payload)?;
        let headers: Headers = [(SCHEDULE_HEADER.to_owned(), recurrence.fingerprint())].into();
        Ok(Schedule {
            queue: self.queue.to_owned(),
            timer_id,
            recurrence,
            payload,
            headers,
        })
    }
}

/// Registers every schedule once, first due at the recurrence's first instant after the
/// store's clock. A database error is logged and tried again after the worker's back-off
/// (100 ms doubling to 5 s) until it succeeds or the worker is stopped; any other error
/// (a store without periodic timers) is logged and that schedule is skipped.
pub(crate) async fn register_all<S: Store>(
    store: &S,
    schedules: &[Schedule],
    stopped: &watch::Receiver<bool>,
) {
    for schedule in schedules {
        let mut attempt = 0u32;
        loop {
            match register_one(store, schedule).await {
                Ok(registered) => {
                    tracing::debug!(queue = %schedule.queue, timer_id = %schedule.timer_id, ?registered, "outbox: schedule registered");
                    break;
                }
                // A standby (ReadOnly) may be promoted while we wait: retry it too.
                Err(e @ Error::Database(_))
                | Err(e @ Error::NotMigrated { .. })
                | Err(e @ Error::ReadOnly { .. }) => {
                    tracing::warn!(queue = %schedule.queue, timer_id = %schedule.timer_id, error = %e, "outbox: could not register a schedule; retrying");
                    let mut stop = stopped.clone();
                    if *stop.borrow() {
                        return;
                    }
                    tokio::select! {
                        _ = tokio::time::sleep(backoff(attempt)) => {}
                        _ = stop.wait_for(|s| *s) => return,
                    }
                    attempt = attempt.saturating_add(1);
                }
                Err(e) => {
                    tracing::error!(queue = %schedule.queue, timer_id = %schedule.timer_id, error = %e, "outbox: could not register a schedule; it does not run until the next start");
                    break;
                }
            }
        }
    }
}

/// One registration: the first instant from the store's clock.
pub(crate) async fn register_one<S: Store>(store: &S, schedule: &Schedule) -> Result<Registered> {
    let now = store.now().await?;
    let first = schedule.recurrence.next_after(now).ok_or_else(|| {
        Error::invalid(
            "schedule",
            format!(
                "{} has no instant after {now}",
                Printable(&schedule.timer_id)
            ),
        )
    })?;
    store
        .register_schedule(RegisterSchedule::new(
            &schedule.queue,
            &schedule.timer_id,
            &schedule.payload,
            &schedule.headers,
            first,
        ))
        .await
}

/// What a claimed row needs before it starts running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Start {
    /// Nothing: not a schedule's row (or a schedule with no next instant, which ends).
    Plain,
    /// Queue this next instant first ([`may_start`] says whether the run starts).
    Arm(DateTime<Utc>),
    /// Do not start: the row's schedule cannot be computed here; it is given back for a
    /// worker that can.
    Hold,
}

/// What a claimed row needs before it starts running: [`Start::Arm`] with the next instant
/// for a row of a schedule (its key starts with `schedule:`), [`Start::Plain`] for any
/// other row.
///
/// The recurrence is the one the row carries (its fingerprint header, written by the last
/// registration), so every worker that handles the queue keeps a stored schedule going on
/// the schedule last registered: one whose code lacks the schedule (an older version during
/// a deploy, another program handling the same type, a schedule removed from the code but
/// not cancelled) as well as one that registered another version of it. A row without a
/// fingerprint this build can read (a user's extend replaced the headers, a cron schedule on
/// a build without the `cron` feature) follows the worker's own schedule of that name, if
/// it has one. The instant is the next one after the row's deadline, from the claim's
/// database clock. [`Start::Plain`] also for a schedule with no next instant (logged: it
/// ends with this run) and for a `schedule:` row without a fingerprint that the worker does
/// not register (a plain timer). [`Start::Hold`] for a stored fingerprint this build cannot
/// read on a worker that does not register the schedule (logged as an error): running it
/// would end the schedule.
pub(crate) fn next_instant(schedules: &HashMap<String, Recurrence>, d: &Delivery) -> Start {
    let Some(timer_id) = d.timer_id.as_deref() else {
        return Start::Plain;
    };
    if !timer_id.starts_with(SCHEDULE_KEY_PREFIX) {
        return Start::Plain;
    }
    let stored = d
        .headers
        .as_ref()
        .and_then(|h| h.get(SCHEDULE_HEADER))
        .map(|fp| (fp, Recurrence::from_fingerprint(fp)));
    let own = schedules.get(timer_id);
    let recurrence = match (stored, own) {
        (Some((_, Ok(stored))), own) => {
            if own.is_none() {
                tracing::info!(
                    timer_id,
                    "outbox: this worker does not register the schedule; it runs on the recurrence stored with it (cancel it to stop it for good)"
                );
            }
            std::borrow::Cow::Owned(stored)
        }
        (stored, Some(own)) => {
            if let Some((fp, Err(e))) = stored {
                tracing::warn!(timer_id, fingerprint = %fp, error = %e, "outbox: the stored schedule is unreadable here; this worker's own recurrence applies");
            }
            std::borrow::Cow::Borrowed(own)
        }
        (Some((fp, Err(e))), None) => {
            tracing::error!(timer_id, fingerprint = %fp, error = %e, "outbox: the stored schedule is unreadable here and this worker does not register it; the run does not start (running it would end the schedule): the row is given back for a worker that can run it");
            return Start::Hold;
        }
        (None, None) => return Start::Plain,
    };
    match recurrence.next_instant(d.deadline, d.claimed_at) {
        Some(at) => Start::Arm(at),
        None => {
            tracing::warn!(
                timer_id,
                "outbox: the schedule has no next instant; it ends with this run"
            );
            Start::Plain
        }
    }
}

/// Whether a periodic run may start, from what arming its next instant wrote: it starts
/// once the next instant is queued (or a queued one kept) and when a cancel reached the row
/// (the run goes on as any cancelled run; the schedule stops after it). It does not start
/// when the lease was lost (another worker holds the row, or it is gone) or when the write
/// did not happen (`None`): the run would end the row without a next instant and stop the
/// schedule, so the row is left to its lease instead and runs again, armed, once the lease
/// has expired.
pub(crate) fn may_start(timer_id: &str, at: DateTime<Utc>, armed: Option<Armed>) -> bool {
    match armed {
        Some(armed @ (Armed::Queued { .. } | Armed::Kept { .. })) => {
            tracing::debug!(timer_id, ?armed, next = %at, "outbox: schedule armed");
            true
        }
        Some(Armed::Cancelled) => {
            tracing::info!(timer_id, "outbox: the schedule was cancelled; it stops after this run until the next registration");
            true
        }
        Some(Armed::LeaseLost) => {
            tracing::warn!(
                timer_id,
                "outbox: lease lost before the schedule was armed; the run does not start"
            );
            false
        }
        None => {
            tracing::error!(timer_id, next = %at, "outbox: could not queue a schedule's next instant; the run does not start and the row runs again after its lease expires");
            false
        }
    }
}
