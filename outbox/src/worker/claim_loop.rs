//! The claim loop: claims when every buffered row has a handler, hands rows to the handler
//! tasks, and when idle sleeps until the earliest deadline, a notification, a completion's
//! hint or the idle ceiling. It backs off after failures.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tracing::Instrument;

use super::isolate::claim_isolating;
use super::shared::{backoff, Claimed, Shared};
use crate::error::Error;
use crate::store::{ClaimRequest, Store, Wakeup};
use crate::telemetry;

/// Logs a failure at once and then at most every 10 s, with how many were not logged, so a
/// worker whose database is down says why without flooding the log.
#[derive(Debug, Default)]
struct Throttle {
    last: Option<Instant>,
    suppressed: u32,
    /// Whether the last failure was the connection's (rather than a statement's).
    connection: bool,
}

impl Throttle {
    const EVERY: Duration = Duration::from_secs(10);

    fn failed(&mut self, what: &str, e: &Error, attempt: u32) {
        let now = Instant::now();
        if self.last.is_some_and(|l| now < l + Self::EVERY) {
            self.suppressed += 1;
            return;
        }
        let connection = e.is_connection_error();
        self.connection = connection;
        tracing::warn!(
            error = %e,
            attempt,
            connection,
            not_logged = self.suppressed,
            "outbox: {what} failed; backing off"
        );
        self.last = Some(now);
        self.suppressed = 0;
    }

    fn recovered(&mut self) {
        if self.last.take().is_some() {
            if self.connection {
                tracing::info!("outbox: the database answers again");
            } else {
                tracing::info!("outbox: claims work again");
            }
        }
        self.suppressed = 0;
    }
}

pub(crate) async fn claim_loop<S: Store>(
    shared: &Arc<Shared<S>>,
    queues: &[String],
    mut wakeups: Option<mpsc::Receiver<Wakeup>>,
    deliveries: &mpsc::Sender<Claimed>,
    stopped: &mut watch::Receiver<bool>,
) {
    let config = shared.config;
    let limit = config.fetch_batch_size;
    let mut failures = 0u32;
    let mut throttle = Throttle::default();
    // Rows due but not claimable (locked by another worker's claim in flight) make the
    // earliest deadline lie in the past; wait a little, growing, instead of spinning.
    let mut contention = Duration::from_millis(10);
    // True while the LISTEN connection is down: poll at least every second (SPEC §7.3).
    let mut degraded = false;
    loop {
        if *stopped.borrow() {
            return;
        }
        // Claim only when every buffered row has been taken by a handler, so the leases we
        // hold stay within fetch_batch_size + concurrency + (concurrency + 2) × ack_batch_size
        // (SPEC §7.7).
        let permits = tokio::select! {
            p = deliveries.reserve_many(limit) => match p { Ok(p) => p, Err(_) => return },
            _ = stopped.changed() => return,
        };
        // Never claim a row we still hold (its lease may have run out while we run it)
        // or one set aside as poison.
        let exclude = shared.exclude();
        let limits = queue_limits(shared, queues, limit);
        let mut request = ClaimRequest::new(queues, limit, config.lease_ttl).excluding(&exclude);
        if let Some(l) = &limits {
            request = request.queue_limits(l);
        }
        // Not raced against the stop signal: once Postgres commits a claim its rows are
        // ours, and dropping the future then would strand them until their lease expires.
        // The claim is one short statement; shutdown releases what it returns. (Shutdown
        // gives up on it only at its deadline, when the database does not answer.)
        let receive = telemetry::receive_span(queues);
        let claimed = async {
            match shared.store.claim(request).await {
                Err(e) if e.is_row_fault() => claim_isolating(shared, request, &e).await,
                done => done,
            }
        }
        .instrument(receive.clone())
        .await;
        let batch = match claimed {
            Ok(b) => b,
            Err(e) => {
                telemetry::error(&receive, e.variant());
                failures += 1;
                throttle.failed("claim", &e, failures);
                metrics::counter!("outbox_claim_errors_total").increment(1);
                drop(permits);
                if sleep_or_stop(backoff(failures - 1), stopped).await {
                    return;
                }
                continue;
            }
        };
        failures = 0;
        throttle.recovered();
        let got = batch.len();
        metrics::histogram!("outbox_claim_batch_size").record(got as f64);
        receive.record("messaging.batch.message_count", got as u64);
        let claimed_at = Instant::now();
        for (permit, d) in permits.zip(batch) {
            shared.held.add(&d, claimed_at);
            telemetry::link_creation(&receive, d.headers.as_ref(), Some(d.lease.id));
            permit.send(Claimed {
                delivery: d,
                receive: receive.clone(),
            });
        }
        drop(receive);
        // Hints that arrived while we were busy are covered by this claim or by the
        // next_wakeup below.
        if let Some(w) = wakeups.as_mut() {
            while let Ok(ev) = w.try_recv() {
                match ev {
                    Wakeup::Lost => degraded = true,
                    Wakeup::Listening => degraded = false,
                    Wakeup::Published { .. } => {}
                }
            }
        }
        if got == limit {
            contention = Duration::from_millis(10);
            continue;
        }
        // Idle: sleep until the earliest deadline, a notification, a completion's hint or
        // the idle ceiling (SPEC §7.3). One index-backed query; none while asleep.
        // Queues at their max_concurrency are left out: their due rows cannot be taken now,
        // and the run that frees a slot wakes us (see `complete.rs`).
        let exclude = shared.exclude();
        let open: Vec<String> = match &limits {
            None => queues.to_vec(),
            Some(l) => queues
                .iter()
                .zip(l)
                .filter(|(_, &n)| n > 0)
                .map(|(q, _)| q.clone())
                .collect(),
        };
        let request = ClaimRequest::new(&open, limit, config.lease_ttl).excluding(&exclude);
        let next = tokio::select! {
            r = shared.store.next_wakeup(request) => r,
            _ = stopped.changed() => return,
        };
        let next = match next {
            Ok(n) => n,
            Err(e) => {
                failures += 1;
                throttle.failed("reading the next deadline", &e, failures);
                if sleep_or_stop(backoff(failures - 1), stopped).await {
                    return;
                }
                continue;
            }
        };
        shared.observe_clock(next.now);
        let now = Instant::now();
        let ceiling = if degraded {
            config.idle_poll.min(Duration::from_secs(1))
        } else {
            config.idle_poll
        };
        let mut target = now + ceiling;
        match next.earliest() {
            Some(at) if at <= next.now => {
                // Due rows we could not claim are locked by another transaction (a claim
                // in flight, an uncommitted extend). Look again soon, backing off to at
                // most a second, and never later than the next row that becomes due.
                target = target.min(now + contention);
                if let Some(upcoming) = next.upcoming {
                    target = target.min(shared.local(upcoming));
                }
                contention = (contention * 2).min(ceiling.min(Duration::from_secs(1)));
            }
            Some(at) => {
                contention = Duration::from_millis(10);
                target = target.min(shared.local(at));
            }
            None => contention = Duration::from_millis(10),
        }
        // A row set aside as poison is tried again when its back-off ends.
        if let Some(until) = shared.quarantine.next_until(Instant::now()) {
            target = target.min(until);
        }
        loop {
            if let Some(h) = shared.take_hint() {
                target = target.min(h);
            }
            if target <= Instant::now() {
                break;
            }
            tokio::select! {
                () = tokio::time::sleep_until(target) => break,
                () = shared.hint_changed.notified() => {}
                ev = recv_wakeup(&mut wakeups) => match ev {
                    Some(Wakeup::Published { queue, at }) => {
                        if queues.binary_search(&queue).is_ok() {
                            target = target.min(shared.local(at));
                        }
                    }
                    Some(Wakeup::Lost) => {
                        degraded = true;
                        target = target.min(Instant::now() + Duration::from_secs(1));
                    }
                    Some(Wakeup::Listening) => {
                        // Re-LISTEN done; now re-scan what we may have missed.
                        degraded = false;
                        break;
                    }
                    None => {
                        wakeups = None;
                    }
                },
                _ = stopped.changed() => return,
            }
        }
    }
}

/// The claim's per-queue limits: what each queue's `max_concurrency` leaves free of the
/// rows it holds (buffered or running), `limit` for a queue without one; `None` when no
/// queue has one.
fn queue_limits<S: Store>(
    shared: &Shared<S>,
    queues: &[String],
    limit: usize,
) -> Option<Vec<usize>> {
    if shared.routes.values().all(|r| r.max_concurrency.is_none()) {
        return None;
    }
    let active = shared.held.active_by_queue();
    Some(
        queues
            .iter()
            .map(
                |q| match shared.routes.get(q).and_then(|r| r.max_concurrency) {
                    Some(max) => max
                        .saturating_sub(active.get(q).copied().unwrap_or(0))
                        .min(limit),
                    None => limit,
                },
            )
            .collect(),
    )
}

/// Receives the next hint, or waits forever when there is no hint channel.
async fn recv_wakeup(wakeups: &mut Option<mpsc::Receiver<Wakeup>>) -> Option<Wakeup> {
    match wakeups {
        Some(w) => w.recv().await,
        None => std::future::pending().await,
    }
}

/// Sleeps, returning true if the worker was stopped meanwhile.
pub(crate) async fn sleep_or_stop(d: Duration, stopped: &mut watch::Receiver<bool>) -> bool {
    tokio::select! {
        () = tokio::time::sleep(d) => *stopped.borrow(),
        _ = stopped.changed() => true,
    }
}
