//! Running and completing: the handler tasks take claimed rows from the claim loop, run
//! them through their route, and write the fenced completion — at once, or through the
//! completer that pipelines and coalesces successes; the renewal loop keeps every held
//! lease alive meanwhile. A completion that fails on a broken connection, a deadlock or a
//! lock timeout is retried while its lease lasts.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch, Mutex};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tracing::{Instrument, Span};

use super::handler::{decide, Decided, Decision};
use super::leases::Phase as HeldPhase;
use super::schedule::{self, Start};
use super::shared::{backoff, Claimed, Shared};
use crate::error::Result;
use crate::store::transaction::{CommitHooks, TransactionAccess};
use crate::store::{Armed, Completion, Delivery, Failure, Lease, Release, Renewal, Store};
use crate::telemetry::{self, InFlight};

/// A success waiting for the completer.
#[derive(Debug, Clone)]
pub(crate) struct PendingAck {
    /// The fence of the delete.
    pub lease: Lease,
    /// For metrics.
    pub queue: String,
    /// The run's `settle` span: it ends once the batched delete reported the row.
    pub span: Span,
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

/// One handler slot: takes claimed rows until the claim loop closes the channel.
pub(crate) async fn handler_task<S: Store>(
    shared: Arc<Shared<S>>,
    deliveries: Arc<Mutex<mpsc::Receiver<Claimed>>>,
    acks: Option<mpsc::Sender<PendingAck>>,
) {
    loop {
        let next = deliveries.lock().await.recv().await;
        let Some(Claimed {
            delivery: d,
            receive,
        }) = next
        else {
            return;
        };
        // A row whose lease was lost while it waited, or that shutdown releases, never
        // starts (SPEC §7.5, §7.8).
        let Some(stop) = shared.held.start(d.lease) else {
            continue;
        };
        let span = process_span(&d, &receive);
        drop(receive);
        process(&shared, d, stop, acks.as_ref(), span).await;
    }
}

/// The `process` span of a delivery: follows from the claim's `receive` span, links to the
/// trace context its publish wrote into the headers.
pub(crate) fn process_span(d: &Delivery, receive: &Span) -> Span {
    let run = telemetry::Run {
        queue: &d.queue,
        id: d.lease.id,
        timer_id: d.timer_id.as_deref(),
        delivery: d.deliveries_count,
        attempt: d.attempts_count.saturating_add(1),
    };
    let span = telemetry::process_span(&run, receive);
    telemetry::link_creation(&span, d.headers.as_ref(), None);
    span
}

/// Records what a run decided on its `process` span and ends its in-flight count.
pub(crate) fn finish_run(run: InFlight, decided: &Decided) {
    let (outcome, reason) = match &decided.decision {
        Decision::Ack => ("ack", None),
        Decision::Retry { .. } => ("retry", None),
        Decision::Fail { reason, .. } => ("fail", Some(reason.as_str())),
        Decision::Completed { .. } => ("completed", None),
    };
    run.finish(outcome, reason, decided.error_type);
}

/// Handles one delivery and writes its fenced completion.
async fn process<S: Store>(
    shared: &Arc<Shared<S>>,
    d: Delivery,
    stop: watch::Receiver<Option<super::handler::CancelReason>>,
    acks: Option<&mpsc::Sender<PendingAck>>,
    span: Span,
) {
    let lease = d.lease;
    let Some(route) = shared.routes.get(&d.queue) else {
        // Unreachable: we only claim queues we serve. Leave the row to lease expiry.
        span.in_scope(|| tracing::error!("outbox: claimed a row of a queue without handler"));
        shared.held.remove(lease);
        return;
    };
    let lateness = (d.claimed_at - d.deadline)
        .num_microseconds()
        .unwrap_or(0)
        .max(0) as f64
        / 1e6;
    metrics::histogram!("outbox_firing_lateness_seconds", "queue" => d.queue.clone())
        .record(lateness);
    // A periodic run queues its next instant when it starts, before the handler and the
    // `max_deliveries` check, so every way it ends keeps the schedule (SPEC §9.1). A run
    // whose next instant could not be queued does not start: it would end the schedule.
    let start = span.in_scope(|| schedule::next_instant(&route.schedules, &d));
    let starts = match start {
        Start::Plain => true,
        Start::Hold => {
            hand_back(shared, lease).instrument(span.clone()).await;
            return;
        }
        Start::Arm(at) => {
            let armed = write_with_retry(shared, lease, "arming a schedule's next instant", || {
                shared.store.arm_next(lease, at)
            })
            .instrument(span.clone())
            .await;
            if armed == Some(Armed::LeaseLost) {
                metrics::counter!("outbox_lease_lost_total", "queue" => d.queue.clone(), "phase" => Phase::Arm.as_str())
                    .increment(1);
            }
            let timer_id = d.timer_id.as_deref().unwrap_or_default();
            span.in_scope(|| schedule::may_start(timer_id, at, armed))
        }
    };
    if !starts {
        // Left to its lease, no longer renewed (a write that did not happen already asked to
        // look again once the lease expires; a lost lease is another worker's row).
        shared.held.remove(lease);
        return;
    }
    let started = Instant::now();
    let hooks = Arc::new(HeldCommit {
        shared: shared.clone(),
        lease,
    });
    let transaction = TransactionAccess::new(shared.store.transactions(), lease).hooks(hooks);
    let run = InFlight::start(&d.queue, &span);
    let decided = decide(route, &d, Some(stop), transaction)
        .instrument(span.clone())
        .await;
    finish_run(run, &decided);
    metrics::histogram!("outbox_handler_duration_seconds", "queue" => d.queue.clone())
        .record(started.elapsed().as_secs_f64());
    shared.held.completing(lease);
    // A queue at its max_concurrency is left out of claims; the slot this run frees makes
    // the idle claim loop look again at once (SPEC §6 v2).
    if let Some(max) = route.max_concurrency {
        if shared.held.active(&d.queue) + 1 >= max {
            shared.wake_at_local(Instant::now());
        }
    }
    let settle = telemetry::settle_span(&span, &d.queue, lease.id);
    drop(span);
    if settle_run(shared, &d, decided.decision, acks, &settle)
        .instrument(settle.clone())
        .await
    {
        shared.held.remove(lease);
    }
}

/// A schedule's row this worker cannot run (its recurrence unreadable here, and not among
/// the worker's own): given back untouched, as a row that never started (pending at its
/// instant, the delivery not counted), and left out of this worker's claims for a while (1 s
/// doubling to 5 min), so a worker that can run it takes it meanwhile. If the release fails
/// the row waits for its lease to expire.
async fn hand_back<S: Store>(shared: &Shared<S>, lease: Lease) {
    let failures = shared.quarantine.strike(lease.id);
    let release = [Release {
        lease,
        started: false,
    }];
    if let Err(e) = shared.store.release(&release).await {
        tracing::warn!(error = %e, "outbox: could not give the row back; it is claimed again once its lease expires");
        shared.wake_at_local(shared.held.until(lease) + Duration::from_millis(10));
    }
    tracing::debug!(failures, "outbox: row set aside by this worker");
    shared.held.remove(lease);
}

/// Writes the completion a run decided, in its `settle` span (the events of the write land
/// there). False when a success went to the completer, which then owns the row.
async fn settle_run<S: Store>(
    shared: &Arc<Shared<S>>,
    d: &Delivery,
    decision: Decision,
    acks: Option<&mpsc::Sender<PendingAck>>,
    span: &Span,
) -> bool {
    let lease = d.lease;
    match decision {
        Decision::Ack => {
            if let Some(acks) = acks {
                let pending = PendingAck {
                    lease,
                    queue: d.queue.clone(),
                    span: span.clone(),
                };
                if acks.send(pending).await.is_ok() {
                    return false;
                }
            }
            let done =
                write_with_retry(shared, lease, COMPLETION, || shared.store.ack(lease)).await;
            settled(shared, span, &d.queue, Phase::Ack, done);
        }
        Decision::Retry { delay, error } => {
            let done = write_with_retry(shared, lease, COMPLETION, || {
                shared.store.retry(lease, delay)
            })
            .await;
            if matches!(done, Some(Completion::RetryScheduled { .. })) {
                tracing::info!(delay_ms = delay.as_millis() as u64, error = %error, "outbox: handler failed; retry scheduled");
                metrics::counter!("outbox_retried_total", "queue" => d.queue.clone()).increment(1);
            } else {
                tracing::info!(error = %error, "outbox: handler failed");
            }
            settled(shared, span, &d.queue, Phase::Retry, done);
        }
        Decision::Completed { completion } => {
            // Written by the handler's own transaction (SPEC §7.9).
            settled(shared, span, &d.queue, Phase::Ack, Some(completion));
        }
        Decision::Fail { reason, error } => {
            tracing::warn!(reason = %reason, error = error.as_deref().unwrap_or(""), "outbox: terminal failure");
            let failure = Failure {
                reason,
                last_error: error.as_deref(),
            };
            let done = write_with_retry(shared, lease, COMPLETION, || {
                shared.store.fail(lease, failure)
            })
            .await;
            if matches!(done, Some(Completion::Deleted | Completion::Rearmed { .. })) {
                metrics::counter!("outbox_terminal_total", "queue" => d.queue.clone(), "reason" => reason.as_str())
                    .increment(1);
                if shared.store.dead_letter_enabled() {
                    metrics::counter!("outbox_dlq_written_total", "queue" => d.queue.clone())
                        .increment(1);
                    tracing::warn!(reason = %reason, "outbox: dead letter written");
                }
            }
            span.record("outbox.failure_reason", reason.as_str());
            settled(shared, span, &d.queue, Phase::Fail, done);
        }
    }
    true
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
fn settled<S: Store>(
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

/// The held-lease bookkeeping around a handler's own commit (the row's completion runs
/// inside the handler's transaction, before its `COMMIT`): while it runs, a renewal that
/// finds the row gone is not a lost lease (the commit may have deleted it); once it landed,
/// the row is no longer held (shutdown has nothing to give back).
struct HeldCommit<S: Store> {
    shared: Arc<Shared<S>>,
    lease: Lease,
}

impl<S: Store> CommitHooks for HeldCommit<S> {
    fn committing(&self) {
        self.shared.held.committing(self.lease, true);
    }

    fn failed(&self) {
        self.shared.held.committing(self.lease, false);
    }

    fn committed(&self) {
        self.shared.held.remove(self.lease);
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
                tracing::error!(error = %e, "outbox: {what} failed; the row will be redelivered after its lease expires");
                metrics::counter!("outbox_completion_errors_total").increment(1);
                // The row is no longer held (so no longer renewed): look again when its
                // lease has expired, not only at the idle poll.
                shared.wake_at_local(shared.held.until(lease) + Duration::from_millis(10));
                return None;
            }
        }
    }
}

/// How [`write_with_retry`] names a completion in the logs.
const COMPLETION: &str = "completion";

/// Metrics, events and wake-up hints for a finished completion.
pub(crate) fn report<S: Store>(
    shared: &Shared<S>,
    queue: &str,
    phase: Phase,
    done: Option<Completion>,
) {
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
        Some(Completion::Cancelled) => {
            metrics::counter!("outbox_cancelled_runs_total", "queue" => queue.to_owned())
                .increment(1);
            tracing::info!(
                phase = phase.as_str(),
                "outbox: the timer was cancelled while it ran; its row is deleted"
            );
        }
        Some(Completion::LeaseLost) => lease_lost(queue, phase),
        Some(_) | None => {}
    }
}

fn lease_lost(queue: &str, phase: Phase) {
    let phase = phase.as_str();
    metrics::counter!("outbox_lease_lost_total", "queue" => queue.to_owned(), "phase" => phase)
        .increment(1);
    tracing::warn!(
        phase,
        "outbox: lease lost; the completion was dropped (the row is gone, or another worker holds it)"
    );
}

/// How many batched completions may be written at once: one normally, so successes pile up
/// into full statements while it runs; another each time every one in flight has waited
/// longer than [`STALLED`] — it met a row locked by an application transaction and finishes
/// its rows one at a time, the locked one waiting for that transaction — so it does not
/// hold up the statements behind it. At most `concurrency + 1`: with pipelined acks the
/// handler slots do not write their own acks, so their connections are the completer's to
/// use for such waits (found by a trial: a fixed two let two application locks stall every
/// ack).
fn flushes_in_flight(concurrency: usize) -> usize {
    concurrency.saturating_add(1)
}

/// How long a batched completion runs before the completer starts the next one beside it:
/// longer than the store's lock timeout (200 ms), so only a write that waits on a lock
/// counts as stalled.
const STALLED: Duration = Duration::from_millis(250);

/// The completer: takes the successes handler tasks hand over and writes everything
/// waiting, up to `ack_batch_size`, in one fenced statement as soon as the previous
/// statement returned. No linger timer: a lone success is written at once, a burst that
/// arrived during one commit shares the next. At shutdown it writes what is left.
pub(crate) async fn completer<S: Store>(
    shared: Arc<Shared<S>>,
    mut rx: mpsc::Receiver<PendingAck>,
) {
    let max = shared.config.ack_batch_size;
    let in_flight = flushes_in_flight(shared.config.concurrency);
    let mut flushes = JoinSet::new();
    let mut newest = Instant::now();
    loop {
        while !flushes.is_empty() {
            let may_start_another = flushes.len() < in_flight;
            tokio::select! {
                _ = flushes.join_next() => {}
                () = tokio::time::sleep_until(newest + STALLED), if may_start_another => break,
            }
        }
        let Some(first) = rx.recv().await else { break };
        let mut batch: Vec<PendingAck> = Vec::with_capacity(max);
        batch.push(first);
        while batch.len() < max {
            match rx.try_recv() {
                Ok(item) => batch.push(item),
                Err(_) => break,
            }
        }
        newest = Instant::now();
        let shared = shared.clone();
        flushes.spawn(async move { flush(&shared, batch).await });
    }
    while flushes.join_next().await.is_some() {}
}

async fn flush<S: Store>(shared: &Shared<S>, batch: Vec<PendingAck>) {
    let leases: Vec<Lease> = batch.iter().map(|p| p.lease).collect();
    // The batch lives while its shortest lease does.
    let shortest = leases
        .iter()
        .copied()
        .min_by_key(|&l| shared.held.until(l))
        .unwrap_or(leases[0]);
    let results = write_with_retry(shared, shortest, COMPLETION, || {
        shared.store.ack_batch(&leases)
    })
    .await;
    let results = results.map_or_else(
        || vec![None; batch.len()],
        |done| done.into_iter().map(Some).collect(),
    );
    for (pending, done) in batch.iter().zip(results) {
        pending
            .span
            .in_scope(|| settled(shared, &pending.span, &pending.queue, Phase::Ack, done));
        shared.held.remove(pending.lease);
    }
}

/// Keeps every held lease alive (`acquired_at = now()`, fenced by each token): one renewal
/// statement per worker every third of `lease_ttl`, whatever the number of leases, until
/// `stop` fires. Tells running handlers when their lease was lost or their timer cancelled.
pub(crate) async fn renewal_loop<S: Store>(
    shared: Arc<Shared<S>>,
    mut stop: watch::Receiver<bool>,
) {
    let period = shared.config.lease_ttl / 3;
    let mut failures = 0u32;
    loop {
        tokio::select! {
            () = tokio::time::sleep(period) => {}
            _ = stop.changed() => return,
        }
        if *stop.borrow() {
            return;
        }
        renew_once(&shared, &mut failures).await;
    }
}

/// One renewal round.
pub(crate) async fn renew_once<S: Store>(shared: &Shared<S>, failures: &mut u32) {
    let leases = shared.held.leases();
    if leases.is_empty() {
        return;
    }
    let sent = Instant::now();
    match shared.store.renew(&leases).await {
        Ok(results) => {
            *failures = 0;
            metrics::counter!("outbox_lease_renewals_total").increment(1);
            let pairs: Vec<(Lease, Renewal)> = leases.into_iter().zip(results).collect();
            for (_lease, queue, phase) in shared.held.renewed(&pairs, sent) {
                let label = if phase == HeldPhase::Buffered {
                    "buffered"
                } else {
                    Phase::Renew.as_str()
                };
                metrics::counter!("outbox_lease_lost_total", "queue" => queue, "phase" => label)
                    .increment(1);
                tracing::warn!(
                    phase = label,
                    "outbox: a held lease was lost (the row is gone, or another worker took it after the lease expired); its run's completion will write nothing"
                );
            }
        }
        Err(e) => {
            *failures += 1;
            if *failures == 1 || failures.is_power_of_two() {
                tracing::warn!(error = %e, failures = *failures, held = shared.held.len(), "outbox: lease renewal failed; retrying next period");
            }
        }
    }
}
