//! Writing a run's completion: the fenced writes of a claimed row (ack, retry, terminal
//! failure, renewal, a periodic run's next instant), how often each is tried ([`Writes`]),
//! and what a finished completion reports ([`settled`]: the `settle` span's outcome, the
//! metrics, the events, the wake-up hint for the idle claim loop).

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;
use tracing::Span;

use super::shared::{backoff, Shared};
use crate::error::{Error, Result};
use crate::store::{Completion, Lease, Store};
use crate::telemetry;

/// Which completion a write was: the `phase` label of `lease_lost` metrics and events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Success.
    Ack,
    /// A failed run with a retry.
    Retry,
    /// A terminal failure.
    Fail,
    /// A lease renewal.
    Renew,
    /// Queueing a periodic run's next instant when it starts.
    Arm,
}

impl Phase {
    /// The metric label.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Phase::Ack => "ack",
            Phase::Retry => "retry",
            Phase::Fail => "fail",
            Phase::Renew => "renew",
            Phase::Arm => "arm",
        }
    }
}

/// How [`write_with_retry`] names a completion in the logs.
pub(crate) const COMPLETION: &str = "completion";

/// How often the writes of a run are tried: the one thing a started worker and
/// [`Worker::run_due`](crate::Worker::run_due) do differently with a row's writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Attempts {
    /// A started worker: again while the lease lasts ([`write_with_retry`]).
    WhileLeased,
    /// `run_due`: once; the error is the caller's (it ends the call).
    Once,
}

/// The writes of one run, tried as `attempts` says. A write that fails for good is
/// recorded the same way in both modes (an error log, `outbox_completion_errors_total`, a
/// wake-up once the lease has expired); with [`Attempts::Once`] its error is also kept for
/// the caller ([`Writes::failed`]).
pub(crate) struct Writes<'a, S> {
    shared: &'a Shared<S>,
    lease: Lease,
    attempts: Attempts,
    failed: Option<Error>,
}

impl<'a, S: Store> Writes<'a, S> {
    pub(crate) fn new(shared: &'a Shared<S>, lease: Lease, attempts: Attempts) -> Self {
        Writes {
            shared,
            lease,
            attempts,
            failed: None,
        }
    }

    /// Runs a fenced write (`what` names it in the logs); `None` when it did not happen.
    pub(crate) async fn write<T, F, Fut>(&mut self, what: &'static str, mut write: F) -> Option<T>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T>>,
    {
        match self.attempts {
            Attempts::WhileLeased => write_with_retry(self.shared, self.lease, what, write).await,
            Attempts::Once => match write().await {
                Ok(done) => Some(done),
                Err(e) => {
                    gave_up(self.shared, self.lease, what, &e);
                    self.failed = Some(e);
                    None
                }
            },
        }
    }

    /// The error of the write that failed, with [`Attempts::Once`].
    pub(crate) fn failed(self) -> Option<Error> {
        self.failed
    }
}

/// Runs a fenced write (`what` names it in the logs), retrying while the lease lasts
/// (renewals extend it) when the connection failed or the write met a deadlock, a
/// serialization failure or a lock timeout (a fenced write is safe to repeat: it changes
/// the row only while the token still matches). Any other statement error is not retried:
/// the row is left to lease expiry, so one poison row cannot wedge a handler task. `None`
/// when the write did not happen.
pub(crate) async fn write_with_retry<S, T, F, Fut>(
    shared: &Shared<S>,
    lease: Lease,
    what: &'static str,
    mut write: F,
) -> Option<T>
where
    S: Store,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T>>,
{
    let mut attempt = 0;
    loop {
        match write().await {
            Ok(done) => return Some(done),
            Err(e)
                if (e.is_connection_error() || e.is_transient())
                    && Instant::now() + backoff(attempt) < shared.held.until(lease) =>
            {
                tracing::warn!(error = %e, attempt, "outbox: {what} failed; retrying");
                tokio::time::sleep(backoff(attempt)).await;
                attempt += 1;
            }
            Err(e) => {
                gave_up(shared, lease, what, &e);
                return None;
            }
        }
    }
}

/// A write that failed for good: the row is left to its lease.
fn gave_up<S: Store>(shared: &Shared<S>, lease: Lease, what: &'static str, e: &Error) {
    tracing::error!(error = %e, "outbox: {what} failed; the row will be redelivered after its lease expires");
    telemetry::completion_failed();
    // The row is no longer held (so no longer renewed): look again when its lease has
    // expired, not only at the idle poll.
    shared.wake_at_local(shared.held.until(lease) + Duration::from_millis(10));
}

/// What a completion did, as the `settle` span's `outbox.outcome` and, for a write that
/// did not happen, its `error.type`.
pub(crate) fn settle_outcome(
    phase: Phase,
    done: Option<&Completion>,
    dead_letter: bool,
) -> (&'static str, Option<&'static str>) {
    match done {
        None => ("not_written", Some("completion_failed")),
        Some(Completion::LeaseLost) => ("lease_lost", Some("lease_lost")),
        Some(Completion::Cancelled) => ("cancelled", None),
        Some(Completion::Rearmed { .. }) => ("rearmed", None),
        Some(Completion::RetryScheduled { .. }) => ("retried", None),
        Some(Completion::Deleted) => match phase {
            Phase::Fail if dead_letter => ("dead_lettered", None),
            Phase::Fail => ("deleted", None),
            _ => ("acked", None),
        },
    }
}

/// Records a finished completion on its `settle` span, then its metrics, events and
/// wake-up hints ([`report`]).
pub(crate) fn settled<S: Store>(
    shared: &Shared<S>,
    span: &Span,
    queue: &str,
    phase: Phase,
    done: Option<Completion>,
) {
    let (outcome, error_type) =
        settle_outcome(phase, done.as_ref(), shared.store.dead_letter_enabled());
    telemetry::outcome(span, outcome);
    if let Some(e) = error_type {
        telemetry::error(span, e);
    }
    report(shared, queue, phase, done);
}

/// Metrics, events and wake-up hints for a finished completion.
fn report<S: Store>(shared: &Shared<S>, queue: &str, phase: Phase, done: Option<Completion>) {
    match done {
        Some(Completion::Deleted) if phase == Phase::Ack => telemetry::acked(queue),
        Some(Completion::Rearmed { at }) => {
            if phase == Phase::Ack {
                telemetry::acked(queue);
            }
            telemetry::rearmed(queue);
            tracing::info!(rearm_at = %at, "outbox: rearm applied");
            shared.wake_at(at);
        }
        Some(Completion::RetryScheduled { at }) => shared.wake_at(at),
        Some(Completion::Cancelled) => {
            telemetry::cancelled_run(queue);
            tracing::info!(
                phase = phase.as_str(),
                "outbox: the timer was cancelled while it ran; its row is deleted"
            );
        }
        Some(Completion::LeaseLost) => {
            let phase = phase.as_str();
            telemetry::lease_lost(queue, phase);
            tracing::warn!(
                phase,
                "outbox: lease lost; the completion was dropped (the row is gone, or another worker holds it)"
            );
        }
        Some(_) | None => {}
    }
}
