//! Running one claimed row, the same code for a started worker's handler slots and for
//! [`Worker::run_due`](crate::Worker::run_due): its lateness, a periodic run's next instant
//! (and whether the run may start, or its row is given back), the decision (`decide.rs`),
//! the completion that decision asks for, and their metrics and spans. The two differ only in
//! how the completion is written ([`Mode`]).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, Mutex};
use tokio::time::Instant;
use tracing::{Instrument, Span};

use super::acks::PendingAck;
use super::complete::{settled, Attempts, Phase, Writes, COMPLETION};
use super::decide::{decide, Decided, Decision};
use super::schedule::{self, Start};
use super::shared::{Claimed, Shared};
use crate::error::{Error, Result};
use crate::store::transaction::{CommitHooks, TransactionAccess};
use crate::store::{Armed, Completion, Delivery, Failure, Lease, Release, Store};
use crate::telemetry::{self, InFlight};

/// How a run's completion is written: the one thing a started worker and `run_due` do
/// differently with a claimed row.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Mode<'a> {
    /// A started worker's handler slot: a success goes to the completer when there is one
    /// (`acks`, with `ack_batch_size` > 1), every other write is made here and tried again
    /// while the lease lasts ([`Attempts::WhileLeased`]).
    Pipelined {
        acks: Option<&'a mpsc::Sender<PendingAck>>,
    },
    /// `run_due`: every write once, here ([`Attempts::Once`]); the first that fails is
    /// recorded like any write that failed for good, and is then the call's error.
    Inline,
}

impl Mode<'_> {
    fn attempts(self) -> Attempts {
        match self {
            Mode::Pipelined { .. } => Attempts::WhileLeased,
            Mode::Inline => Attempts::Once,
        }
    }
}

/// One delivery run by [`Worker::run_due`](crate::Worker::run_due): the claimed row, what
/// the handler decided, and how the fenced completion ended.
#[derive(Debug, Clone, PartialEq)]
pub struct Dispatched {
    /// The claimed row.
    pub delivery: Delivery,
    /// What the run decided.
    pub decision: Decision,
    /// How the completion ended (for example [`Completion::Rearmed`] when the timer was
    /// extended during the run).
    pub completion: Completion,
}

/// What became of one claimed row.
#[derive(Debug)]
pub(crate) enum Executed {
    /// It ran and its completion was written.
    Done(Dispatched),
    /// Given back untouched: a schedule's row this worker cannot compute ([`hand_back`]), a
    /// relay's row whose broker was unavailable, or a row of a run whose previous row did
    /// not succeed ([`give_back`]).
    GivenBack,
    /// Nothing to report: the row did not start, its success went to the completer, or
    /// (pipelined) its completion was not written.
    Nothing,
    /// Inline: the write that failed, after the row's telemetry recorded it.
    Failed(Error),
}

/// One handler slot of a started worker: takes claimed rows until the claim loop closes the
/// channel.
pub(crate) async fn handler_task<S: Store>(
    shared: Arc<Shared<S>>,
    deliveries: Arc<Mutex<mpsc::Receiver<Claimed>>>,
    acks: Option<mpsc::Sender<PendingAck>>,
) {
    let mode = Mode::Pipelined {
        acks: acks.as_ref(),
    };
    loop {
        let next = deliveries.lock().await.recv().await;
        let Some(claimed) = next else {
            return;
        };
        // Pipelined writes report their own failures; there is nothing to hand back.
        execute(&shared, claimed, mode).await;
    }
}

/// Runs one claimed row and writes its completion as `mode` says.
pub(crate) async fn execute<S: Store>(
    shared: &Arc<Shared<S>>,
    claimed: Claimed,
    mode: Mode<'_>,
) -> Executed {
    let Claimed {
        delivery: d,
        receive,
        run,
    } = claimed;
    let lease = d.lease;
    // A row of a run starts only once the row before it succeeded; otherwise it is given
    // back untouched, and so is the rest of the run (dropping `run.then` tells the next).
    if let Some(after) = run.after {
        if after.await != Ok(true) {
            let released = give_back(shared, lease).await;
            return match (released, mode) {
                (Err(e), Mode::Inline) => Executed::Failed(e),
                _ => Executed::GivenBack,
            };
        }
    }
    let mut then = run.then;
    // A row whose lease was lost while it waited, or that shutdown releases, never starts
    // (SPEC §7.5, §7.8).
    let Some(stop) = shared.held.start(lease) else {
        return Executed::Nothing;
    };
    let span = process_span(&d, &receive);
    // The claim's span ends once every row it took has started.
    drop(receive);
    let Some(route) = shared.routes.get(&d.queue) else {
        // Unreachable: we only claim queues we serve. Leave the row to lease expiry.
        span.in_scope(|| tracing::error!("outbox: claimed a row of a queue without handler"));
        shared.held.remove(lease);
        return Executed::Nothing;
    };
    let lateness = (d.claimed_at - d.deadline)
        .num_microseconds()
        .unwrap_or(0)
        .max(0) as f64
        / 1e6;
    telemetry::firing_lateness(&d.queue, lateness);
    let mut writes = Writes::new(shared, lease, mode.attempts());
    // A periodic run queues its next instant when it starts, before the handler and the
    // `max_deliveries` check, so every way it ends keeps the schedule (SPEC §9.1). A run
    // whose next instant could not be queued does not start: it would end the schedule.
    let starts = match span.in_scope(|| schedule::next_instant(&route.schedules, &d)) {
        Start::Plain => true,
        Start::Hold => {
            let released = hand_back(shared, lease).instrument(span.clone()).await;
            return match (released, mode) {
                (Err(e), Mode::Inline) => Executed::Failed(e),
                _ => Executed::GivenBack,
            };
        }
        Start::Arm(at) => {
            let armed = writes
                .write("arming a schedule's next instant", || {
                    shared.store.arm_next(lease, at)
                })
                .instrument(span.clone())
                .await;
            if armed == Some(Armed::LeaseLost) {
                telemetry::lease_lost(&d.queue, Phase::Arm.as_str());
            }
            let timer_id = d.timer_id.as_deref().unwrap_or_default();
            span.in_scope(|| schedule::may_start(timer_id, at, armed))
        }
    };
    if !starts {
        // Left to its lease, no longer renewed (a write that did not happen already asked to
        // look again once the lease expires; a lost lease is another worker's row).
        shared.held.remove(lease);
        return writes.failed().map_or(Executed::Nothing, Executed::Failed);
    }
    let started = Instant::now();
    let hooks = Arc::new(HeldCommit {
        shared: shared.clone(),
        lease,
    });
    let transaction = TransactionAccess::new(shared.store.transactions(), lease).hooks(hooks);
    let run = InFlight::start(&d.queue, &span);
    let decided = decide(route, &d, stop, transaction)
        .instrument(span.clone())
        .await;
    finish_run(run, &decided);
    telemetry::handler_duration(&d.queue, started.elapsed().as_secs_f64());
    if let Some(circuit) = &route.circuit {
        // The relay's sink answered again: the claim loop may take its queues at once.
        if circuit.take_closed() {
            shared.wake_at_local(Instant::now());
        }
        // The sink was unavailable: the row is not at fault. Given back untouched (pending
        // as before, the delivery not counted); claims of the queue wait for the circuit.
        if circuit.take_given_back(lease.id) {
            let released = give_back(shared, lease).instrument(span.clone()).await;
            return match (released, mode) {
                (Err(e), Mode::Inline) => Executed::Failed(e),
                _ => Executed::GivenBack,
            };
        }
    }
    // The broker confirmed this row (the circuit gave nothing back): the next row of its run
    // may be published now, while this one's ack is written.
    let succeeded = matches!(decided.decision, Decision::Ack);
    let ends_run = then.is_none() || !succeeded;
    if let Some(next) = then.take() {
        // The next row's slot may be gone with shutdown; it gives its row back then.
        let _ = next.send(succeeded);
    }
    // An ordered relay's key may have a next row to claim once this run ends.
    let wakes = route.ordered_by.is_some() && ends_run;
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
    let decision = decided.decision;
    let written = settle_run(shared, &d, &decision, mode, wakes, &mut writes, &settle)
        .instrument(settle.clone())
        .await;
    let Settled::Written(done) = written else {
        // The completer owns the row now.
        return Executed::Nothing;
    };
    shared.held.remove(lease);
    // An ordered relay's run ended (acked, retried or dead-lettered): the claim loop looks
    // again for the next row of its key.
    if wakes {
        shared.wake_at_local(Instant::now());
    }
    match (writes.failed(), done) {
        (Some(e), _) => Executed::Failed(e),
        (None, Some(completion)) => Executed::Done(Dispatched {
            delivery: d,
            decision,
            completion,
        }),
        (None, None) => Executed::Nothing,
    }
}

/// The `process` span of a delivery: follows from the claim's `receive` span, links to the
/// trace context its publish wrote into the headers.
fn process_span(d: &Delivery, receive: &Span) -> Span {
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
fn finish_run(run: InFlight, decided: &Decided) {
    let (outcome, reason) = match &decided.decision {
        Decision::Ack => ("ack", None),
        Decision::Retry { .. } => ("retry", None),
        Decision::Fail { reason, .. } => ("fail", Some(reason.as_str())),
        Decision::Completed { .. } => ("completed", None),
    };
    run.finish(outcome, reason, decided.error_type);
}

/// A schedule's row this worker cannot run (its recurrence unreadable here, and not among
/// the worker's own): given back untouched, as a row that never started (pending at its
/// instant, the delivery not counted), and left out of this worker's claims for a while (1 s
/// doubling to 5 min), so a worker that can run it takes it meanwhile. If the release fails
/// the row waits for its lease to expire.
async fn hand_back<S: Store>(shared: &Shared<S>, lease: Lease) -> Result<()> {
    let failures = shared.quarantine.strike(lease.id);
    let release = [Release {
        lease,
        started: false,
    }];
    let released = shared.store.release(&release).await.map(drop);
    if let Err(e) = &released {
        tracing::warn!(error = %e, "outbox: could not give the row back; it is claimed again once its lease expires");
        shared.wake_at_local(shared.held.until(lease) + Duration::from_millis(10));
    }
    tracing::debug!(failures, "outbox: row set aside by this worker");
    shared.held.remove(lease);
    released
}

/// A relay's row whose sink was unavailable: given back as a row that never started
/// (pending at its deadline, `deliveries_count − 1`, no attempt recorded), so an outage of
/// the broker neither counts towards `max_deliveries` nor dead-letters anything. If the
/// release fails the row waits for its lease to expire.
async fn give_back<S: Store>(shared: &Shared<S>, lease: Lease) -> Result<()> {
    let release = [Release {
        lease,
        started: false,
    }];
    let released = shared.store.release(&release).await.map(drop);
    if let Err(e) = &released {
        tracing::warn!(error = %e, "outbox: could not give the row back; it is claimed again once its lease expires");
        shared.wake_at_local(shared.held.until(lease) + Duration::from_millis(10));
    }
    shared.held.remove(lease);
    released
}

/// How [`settle_run`] left a run's completion.
enum Settled {
    /// A success handed to the completer, which writes and reports it.
    Handed,
    /// Written here (`None`: the write did not happen).
    Written(Option<Completion>),
}

/// Writes the completion a run decided, in its `settle` span (the events of the write land
/// there), and reports it.
async fn settle_run<S: Store>(
    shared: &Shared<S>,
    d: &Delivery,
    decision: &Decision,
    mode: Mode<'_>,
    wakes: bool,
    writes: &mut Writes<'_, S>,
    span: &Span,
) -> Settled {
    let lease = d.lease;
    let (phase, done) = match decision {
        Decision::Ack => {
            if let Mode::Pipelined { acks: Some(acks) } = mode {
                let pending = PendingAck {
                    lease,
                    queue: d.queue.clone(),
                    span: span.clone(),
                    wakes,
                };
                if acks.send(pending).await.is_ok() {
                    return Settled::Handed;
                }
            }
            let done = writes.write(COMPLETION, || shared.store.ack(lease)).await;
            (Phase::Ack, done)
        }
        Decision::Retry { delay, error } => {
            let done = writes
                .write(COMPLETION, || shared.store.retry(lease, *delay))
                .await;
            if matches!(done, Some(Completion::RetryScheduled { .. })) {
                tracing::info!(delay_ms = delay.as_millis() as u64, error = %error, "outbox: handler failed; retry scheduled");
                telemetry::retried(&d.queue);
            } else {
                tracing::info!(error = %error, "outbox: handler failed");
            }
            (Phase::Retry, done)
        }
        // Written by the handler's own transaction (SPEC §7.9).
        Decision::Completed { completion } => (Phase::Ack, Some(*completion)),
        Decision::Fail { reason, error } => {
            tracing::warn!(reason = %reason, error = error.as_deref().unwrap_or(""), "outbox: terminal failure");
            let failure = Failure {
                reason: *reason,
                last_error: error.as_deref(),
            };
            let done = writes
                .write(COMPLETION, || shared.store.fail(lease, failure))
                .await;
            if matches!(done, Some(Completion::Deleted | Completion::Rearmed { .. })) {
                telemetry::terminal(&d.queue, reason.as_str());
                if shared.store.dead_letter_enabled() {
                    telemetry::dead_letter_written(&d.queue);
                    tracing::warn!(reason = %reason, "outbox: dead letter written");
                }
            }
            span.record("outbox.failure_reason", reason.as_str());
            (Phase::Fail, done)
        }
    };
    settled(shared, span, &d.queue, phase, done);
    Settled::Written(done)
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
