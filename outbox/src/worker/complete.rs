//! Running and completing (SPEC §5.1, §5.2, §7.2, §7.4): the handler tasks take claimed
//! rows from the claim loop, run them through their route, and write the fenced completion
//! — at once, or through the acker that batches successes. A completion that fails on a
//! broken connection is retried while the lease lasts.
//!
//! Everything a worker does for a lease it holds happens here, so keeping a running
//! handler's lease alive belongs here too: the handler task knows which leases it holds and
//! until when.

use std::future::Future;
use std::sync::Arc;

use tokio::sync::{mpsc, Mutex};
use tokio::time::Instant;
use tracing::Instrument;

use super::handler::{decide, Decision};
use super::shared::{backoff, Shared};
use crate::error::Result;
use crate::store::{Completion, Delivery, Failure, Lease, Store};

/// A success waiting in the acker's batch.
#[derive(Debug, Clone)]
pub(crate) struct PendingAck {
    /// The fence of the delete.
    pub lease: Lease,
    /// When the lease expires on the local clock: retrying the write after it is pointless.
    pub lease_end: Instant,
    /// For metrics.
    pub queue: String,
}

/// Which completion a write was: the `phase` label of `lease_lost` metrics and events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Success.
    Ack,
    /// A failed run with a retry.
    Retry,
    /// A terminal failure.
    Fail,
}

impl Phase {
    /// The metric label.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Phase::Ack => "ack",
            Phase::Retry => "retry",
            Phase::Fail => "fail",
        }
    }
}

/// One handler slot: takes claimed rows until the claim loop closes the channel.
pub(crate) async fn handler_task<S: Store>(
    shared: Arc<Shared<S>>,
    deliveries: Arc<Mutex<mpsc::Receiver<Delivery>>>,
    acks: Option<mpsc::Sender<PendingAck>>,
) {
    loop {
        let next = deliveries.lock().await.recv().await;
        let Some(d) = next else { return };
        let span = tracing::info_span!(
            "outbox.delivery",
            queue = %d.queue,
            id = d.lease.id,
            timer_id = d.timer_id.as_deref(),
            delivery = d.deliveries_count,
            attempt = d.attempts_count + 1,
        );
        process(&shared, d, acks.as_ref()).instrument(span).await;
    }
}

/// Handles one delivery and writes its fenced completion.
async fn process<S: Store>(
    shared: &Shared<S>,
    d: Delivery,
    acks: Option<&mpsc::Sender<PendingAck>>,
) {
    // The lease is ours until claimed_at + lease_ttl (time spent waiting in the buffer
    // counts); past it, retrying a failed completion is pointless.
    let lease_end = chrono::TimeDelta::from_std(shared.config.lease_ttl)
        .ok()
        .and_then(|ttl| d.claimed_at.checked_add_signed(ttl))
        .map_or_else(
            || Instant::now() + shared.config.lease_ttl,
            |end| shared.local(end),
        );
    let Some(route) = shared.routes.get(&d.queue) else {
        // Unreachable: we only claim queues we serve. Leave the row to lease expiry.
        tracing::error!("outbox: claimed a row of a queue without handler");
        return;
    };
    let lateness = (d.claimed_at - d.deadline)
        .num_microseconds()
        .unwrap_or(0)
        .max(0) as f64
        / 1e6;
    metrics::histogram!("outbox_firing_lateness_seconds", "queue" => d.queue.clone())
        .record(lateness);
    let started = Instant::now();
    let decision = decide(route, &d).await;
    metrics::histogram!("outbox_handler_duration_seconds", "queue" => d.queue.clone())
        .record(started.elapsed().as_secs_f64());
    let lease = d.lease;
    match decision {
        Decision::Ack => {
            if let Some(acks) = acks {
                let pending = PendingAck {
                    lease,
                    lease_end,
                    queue: d.queue.clone(),
                };
                if acks.send(pending).await.is_ok() {
                    return;
                }
            }
            let done = write_with_retry(lease_end, || shared.store.ack(lease)).await;
            report(shared, &d.queue, Phase::Ack, done);
        }
        Decision::Retry { delay, error } => {
            tracing::info!(delay_ms = delay.as_millis() as u64, error = %error, "outbox: handler failed; retry scheduled");
            let done = write_with_retry(lease_end, || shared.store.retry(lease, delay)).await;
            if matches!(done, Some(Completion::RetryScheduled { .. })) {
                metrics::counter!("outbox_retried_total", "queue" => d.queue.clone()).increment(1);
            }
            report(shared, &d.queue, Phase::Retry, done);
        }
        Decision::Fail { reason, error } => {
            tracing::warn!(reason = %reason, error = error.as_deref().unwrap_or(""), "outbox: terminal failure");
            let failure = Failure {
                reason,
                last_error: error.as_deref(),
            };
            let done = write_with_retry(lease_end, || shared.store.fail(lease, failure)).await;
            if matches!(done, Some(Completion::Deleted | Completion::Rearmed { .. })) {
                metrics::counter!("outbox_terminal_total", "queue" => d.queue.clone(), "reason" => reason.as_str())
                    .increment(1);
                if shared.store.dead_letter_enabled() {
                    metrics::counter!("outbox_dlq_written_total", "queue" => d.queue.clone())
                        .increment(1);
                    tracing::warn!(reason = %reason, "outbox: dead letter written");
                }
            }
            report(shared, &d.queue, Phase::Fail, done);
        }
    }
}

/// Runs a fenced write, retrying connection failures with back-off while the lease lasts
/// (SPEC §7.4). A statement error (say, a constraint violation) is not retried: the row is
/// left to lease expiry, so one poison row cannot wedge a handler task. `None` when the
/// write did not happen.
async fn write_with_retry<T, F, Fut>(lease_end: Instant, mut write: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T>>,
{
    let mut attempt = 0;
    loop {
        match write().await {
            Ok(done) => return Some(done),
            Err(e) if e.is_connection_error() && Instant::now() + backoff(attempt) < lease_end => {
                tracing::warn!(error = %e, attempt, "outbox: completion failed; retrying");
                tokio::time::sleep(backoff(attempt)).await;
                attempt += 1;
            }
            Err(e) => {
                tracing::error!(error = %e, "outbox: completion failed; the rows will be redelivered after their lease expires");
                metrics::counter!("outbox_completion_errors_total").increment(1);
                return None;
            }
        }
    }
}

/// Metrics, events and wake-up hints for a finished completion.
fn report<S: Store>(shared: &Shared<S>, queue: &str, phase: Phase, done: Option<Completion>) {
    match done {
        Some(Completion::Deleted) if phase == Phase::Ack => {
            metrics::counter!("outbox_acked_total", "queue" => queue.to_owned()).increment(1);
        }
        Some(Completion::Rearmed { at }) => {
            if phase == Phase::Ack {
                metrics::counter!("outbox_acked_total", "queue" => queue.to_owned()).increment(1);
            }
            metrics::counter!("outbox_rearmed_total", "queue" => queue.to_owned()).increment(1);
            tracing::info!(rearm_at = %at, "outbox: rearm applied");
            shared.wake_at(at);
        }
        Some(Completion::RetryScheduled { at }) => shared.wake_at(at),
        Some(Completion::Deleted) => {}
        Some(Completion::Cancelled) => {
            metrics::counter!("outbox_cancelled_runs_total", "queue" => queue.to_owned())
                .increment(1);
            tracing::info!(
                phase = phase.as_str(),
                "outbox: the timer was cancelled while it ran; its row is deleted"
            );
        }
        Some(Completion::LeaseLost) => {
            let phase = phase.as_str();
            metrics::counter!("outbox_lease_lost_total", "queue" => queue.to_owned(), "phase" => phase).increment(1);
            tracing::warn!(
                phase,
                "outbox: lease lost; the completion was dropped (another worker holds the row)"
            );
        }
        None => {}
    }
}

/// Collects successful completions and writes them in batches (SPEC §5.2): a batch is
/// flushed when full or as soon as no more successes are waiting, and the rest at shutdown.
pub(crate) async fn acker<S: Store>(shared: Arc<Shared<S>>, mut rx: mpsc::Receiver<PendingAck>) {
    let max = shared.config.ack_batch_size;
    let mut batch: Vec<PendingAck> = Vec::with_capacity(max);
    while let Some(first) = rx.recv().await {
        batch.push(first);
        while batch.len() < max {
            match rx.try_recv() {
                Ok(item) => batch.push(item),
                Err(_) => break,
            }
        }
        let leases: Vec<Lease> = batch.iter().map(|p| p.lease).collect();
        let lease_end = batch
            .iter()
            .map(|p| p.lease_end)
            .min()
            .unwrap_or_else(Instant::now);
        let results = write_with_retry(lease_end, || shared.store.ack_batch(&leases)).await;
        let results = results.map_or_else(
            || vec![None; batch.len()],
            |done| done.into_iter().map(Some).collect(),
        );
        for (pending, done) in batch.drain(..).zip(results) {
            report(&shared, &pending.queue, Phase::Ack, done);
        }
    }
}
