//! Claiming. A started worker's claim loop claims when every buffered row has a handler,
//! hands rows to the handler tasks, and when idle sleeps until the earliest deadline, a
//! notification, a completion's hint or the idle ceiling; it backs off after failures.
//! [`Worker::run_due`](crate::Worker::run_due) claims in rounds instead ([`run_due`]) and
//! runs each row inline. Both claim through [`receive`], and run rows through `execute.rs`.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tracing::Instrument;

use super::circuit::Gate;
use super::execute::{execute, Dispatched, Executed, Mode};
use super::poison::claim_isolating;
use super::shared::{backoff, Claimed, RunLink, Shared};
use crate::error::{Error, Result};
use crate::store::{ClaimRequest, Store, Wakeup};
use crate::telemetry;

/// The most deliveries one [`Worker::run_due`](crate::Worker::run_due) call runs.
pub const RUN_DUE_LIMIT: usize = 10_000;

/// What a claim does when its statement fails because of one row's data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OnRowFault {
    /// Claim around the row and set it aside (`poison.rs`): a started worker.
    Isolate,
    /// Fail with the error: `run_due`, whose caller gets it.
    Fail,
}

/// Where the next claim's rounds start: after the queue of the last row claimed, so that a
/// claim smaller than the number of queues with due rows takes the queues it skipped first
/// next time: each queue's earliest due row within `n` claims for `n` queues with due rows.
/// Each worker keeps its own; workers need not agree, since each one's claims are fair on
/// their own.
// SPEC §6 (v3 addendum): fair across claims.
#[derive(Debug, Default)]
struct Rotation {
    /// The queue of the last row of the last claim that took one.
    last: Option<String>,
}

impl Rotation {
    /// `request`, starting its rounds after the last claim's last queue.
    fn apply<'a>(&'a self, request: ClaimRequest<'a>) -> ClaimRequest<'a> {
        match &self.last {
            Some(q) => request.resume_after(q),
            None => request,
        }
    }

    /// Moves on past `batch` (in claim order); an empty claim leaves the rotation as it was.
    fn advance(&mut self, batch: &[Claimed]) {
        if let Some(c) = batch.last() {
            if self.last.as_deref() != Some(c.delivery.queue.as_str()) {
                self.last = Some(c.delivery.queue.clone());
            }
        }
    }
}

/// One claim statement in its `receive` span, the same for the claim loop and `run_due`:
/// the span's fields and links, the claim metrics, and every row it took registered as held
/// from now (its lease runs from here on the local clock).
async fn receive<S: Store>(
    shared: &Shared<S>,
    queues: &[String],
    request: ClaimRequest<'_>,
    on_row_fault: OnRowFault,
) -> Result<Vec<Claimed>> {
    let span = telemetry::receive_span(queues);
    let claimed = async {
        match shared.store.claim(request).await {
            Err(e) if e.is_row_fault() && on_row_fault == OnRowFault::Isolate => {
                claim_isolating(
                    &shared.store,
                    &shared.routes,
                    &shared.quarantine,
                    request,
                    &e,
                )
                .await
            }
            done => done,
        }
    }
    .instrument(span.clone())
    .await;
    held(shared, span, claimed)
}

/// An ordered relay's claim (`Store::claim_in_order`) in its `receive` span, registered as
/// `receive` registers a claim.
async fn receive_in_order<S: Store>(
    shared: &Shared<S>,
    queues: &[String],
    header: &str,
    request: ClaimRequest<'_>,
) -> Result<Vec<Claimed>> {
    let span = telemetry::receive_span(queues);
    let claimed = shared
        .store
        .claim_in_order(request, header)
        .instrument(span.clone())
        .await;
    let mut batch = held(shared, span, claimed)?;
    link_runs(&mut batch, header);
    Ok(batch)
}

/// Links the rows of each key's run in `batch` (in id order, as the store returns it), each
/// to the one after it: a run's rows are consecutive in its key, so each row of a key in the
/// batch waits for the one before it. Rows run in claim order (`run_due`) or are taken by
/// the handler slots in claim order (a started worker), so a row's predecessor has always
/// started before it waits.
fn link_runs(batch: &mut [Claimed], header: &str) {
    let mut last: std::collections::HashMap<(String, String), usize> = Default::default();
    for i in 0..batch.len() {
        let d = &batch[i].delivery;
        let Some(key) = d.headers.as_ref().and_then(|h| h.get(header)) else {
            continue;
        };
        if let Some(before) = last.insert((d.queue.clone(), key.clone()), i) {
            let (then, after) = tokio::sync::oneshot::channel();
            batch[before].run.then = Some(then);
            batch[i].run.after = Some(after);
        }
    }
}

/// A claim's result: its metrics, and every row registered as held from now.
fn held<S: Store>(
    shared: &Shared<S>,
    span: tracing::Span,
    claimed: Result<Vec<crate::store::Delivery>>,
) -> Result<Vec<Claimed>> {
    let batch = match claimed {
        Ok(batch) => batch,
        Err(e) => {
            telemetry::error(&span, e.variant());
            telemetry::claim_failed(e.variant());
            return Err(e);
        }
    };
    telemetry::claim_batch_size(batch.len());
    span.record("messaging.batch.message_count", batch.len() as u64);
    let claimed_at = Instant::now();
    let rows = batch
        .into_iter()
        .map(|d| {
            shared.held.add(&d, claimed_at);
            telemetry::link_creation(&span, d.headers.as_ref(), Some(d.lease.id));
            Claimed {
                delivery: d,
                receive: span.clone(),
                run: RunLink::default(),
            }
        })
        .collect();
    Ok(rows)
}

/// `run_due`'s claim rounds: claims until a claim comes back empty (or [`RUN_DUE_LIMIT`]
/// rows ran), running each row to completion in claim order before the next claim. The
/// first write that fails ends the call with its error; the rows it has not run stay leased.
pub(crate) async fn run_due<S: Store>(
    shared: &Arc<Shared<S>>,
    queues: &[String],
) -> Result<Vec<Dispatched>> {
    let config = shared.config;
    let mut out = Vec::new();
    // Rows given back without a run (a schedule this worker cannot compute): not claimed
    // again by this call. (Nothing else is held between rounds: every row of a round has
    // been completed or given up before the next claim.)
    let mut given_back: Vec<i64> = Vec::new();
    let mut rotation = Rotation::default();
    // An ordered relay's queues are claimed by their own statement, as the claim loop does:
    // the common claim would run a key's rows out of order once one of them is retried.
    let in_order = ordered_queues(shared, queues);
    let common: Vec<String> = queues
        .iter()
        .filter(|q| !in_order.iter().any(|(_, o)| o.contains(q)))
        .cloned()
        .collect();
    while out.len() < RUN_DUE_LIMIT {
        let limit = config.fetch_batch_size.min(RUN_DUE_LIMIT - out.len());
        let mut batch = Vec::new();
        if !common.is_empty() {
            let request =
                ClaimRequest::new(&common, limit, config.lease_ttl).excluding(&given_back);
            let request = rotation.apply(request);
            batch = receive(shared, &common, request, OnRowFault::Fail).await?;
            rotation.advance(&batch);
        }
        for (header, ordered) in &in_order {
            let left = limit.saturating_sub(batch.len());
            if left == 0 {
                break;
            }
            let request = ClaimRequest::new(ordered, left, config.lease_ttl).excluding(&given_back);
            batch.extend(receive_in_order(shared, ordered, header, request).await?);
        }
        if batch.is_empty() {
            break;
        }
        for claimed in batch {
            let id = claimed.delivery.lease.id;
            match execute(shared, claimed, Mode::Inline).await {
                Executed::Done(dispatched) => out.push(dispatched),
                Executed::GivenBack => given_back.push(id),
                Executed::Nothing => {}
                Executed::Failed(e) => return Err(e),
            }
        }
    }
    Ok(out)
}

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
        if matches!(e, Error::NotMigrated { .. } | Error::UpgradeRequired { .. }) {
            // Nothing retries its way past a schema that is missing or predates this version:
            // say what to run (a deployment may start workers before its migration, so the
            // worker keeps trying until then).
            tracing::error!(
                error = %e,
                attempt,
                not_logged = self.suppressed,
                "outbox: {what} failed: the schema needs `migrate` (see the error); retrying \
                 until it has run"
            );
        } else {
            tracing::warn!(
                error = %e,
                attempt,
                connection,
                not_logged = self.suppressed,
                "outbox: {what} failed; backing off"
            );
        }
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

/// How soon an idle loop looks again at due rows held back behind an ordered relay's runs
/// in flight (the end of each run wakes it sooner).
const ORDERED_LOOK_AGAIN: Duration = Duration::from_secs(1);

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
    // The look-ahead's failures count apart from the claim's: on a Citus cluster with a
    // worker node down the claim goes on bucket by bucket while the look-ahead (a read across
    // the shards) keeps failing, and a claim that works must not reset its back-off.
    let mut wakeup_failures = 0u32;
    let mut wakeup_throttle = Throttle::default();
    // Rows due but not claimable (locked by another worker's claim in flight) make the
    // earliest deadline lie in the past; wait a little, growing, instead of spinning.
    let mut contention = Duration::from_millis(10);
    // True while the LISTEN connection is down: poll at least every second (SPEC §7.3).
    let mut degraded = false;
    let mut rotation = Rotation::default();
    let in_order = ordered_queues(shared, queues);
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
        let mut request = ClaimRequest::new(queues, limit, config.lease_ttl)
            .excluding(&exclude)
            .keep_connection();
        if let Some(l) = &limits {
            request = request.queue_limits(l);
        }
        let request = rotation.apply(request);
        // Not raced against the stop signal: once Postgres commits a claim its rows are
        // ours, and dropping the future then would strand them until their lease expires.
        // The claim is one short statement; shutdown releases what it returns. (Shutdown
        // gives up on it only at its deadline, when the database does not answer.)
        // Whether an ordered claim took a run: it found fewer keys than it had room for, so
        // claiming again at once would find no more (the keys it took are in flight).
        let mut took_runs = false;
        let claimed = match receive(shared, queues, request, OnRowFault::Isolate).await {
            Ok(mut b) => {
                // Ordered relays claim their own queues, in order per key, with what is left.
                for (header, ordered) in &in_order {
                    let left = limit.saturating_sub(b.len());
                    let (open, cap) = ordered_gate(shared, ordered, left);
                    if open.is_empty() || cap == 0 {
                        continue;
                    }
                    let request =
                        ClaimRequest::new(&open, cap, config.lease_ttl).excluding(&exclude);
                    match receive_in_order(shared, &open, header, request).await {
                        Ok(more) => {
                            took_runs |= more.iter().any(|c| c.run.after.is_some());
                            b.extend(more);
                        }
                        Err(e) => {
                            failures += 1;
                            throttle.failed("claim in order", &e, failures);
                        }
                    }
                }
                Ok(b)
            }
            Err(e) => Err(e),
        };
        let batch = match claimed {
            Ok(b) => b,
            Err(e) => {
                failures += 1;
                throttle.failed("claim", &e, failures);
                drop(permits);
                if sleep_or_stop(backoff(failures - 1), stopped).await {
                    return;
                }
                continue;
            }
        };
        failures = 0;
        throttle.recovered();
        rotation.advance(&batch);
        let got = batch.len();
        for (permit, claimed) in permits.zip(batch) {
            permit.send(claimed);
        }
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
        if got == limit && !took_runs {
            contention = Duration::from_millis(10);
            continue;
        }
        // Idle: sleep until the earliest deadline, a notification, a completion's hint or
        // the idle ceiling (SPEC §7.3). One index-backed query; none while asleep.
        // Queues at their max_concurrency are left out: their due rows cannot be taken now,
        // and the run that frees a slot wakes us (see `execute.rs`).
        let exclude = shared.exclude();
        let mut open: Vec<String> = match &limits {
            None => queues.to_vec(),
            Some(l) => queues
                .iter()
                .zip(l)
                .filter(|(_, &n)| n > 0)
                .map(|(q, _)| q.clone())
                .collect(),
        };
        // An ordered relay's queues wake the loop too (a key's next row is due while the
        // one before it is in flight: the contention back-off below looks again).
        for (_, ordered) in &in_order {
            open.extend(ordered_gate(shared, ordered, limit).0);
        }
        let request = ClaimRequest::new(&open, limit, config.lease_ttl).excluding(&exclude);
        let next = tokio::select! {
            r = shared.store.next_wakeup(request) => r,
            _ = stopped.changed() => return,
        };
        let next = match next {
            Ok(n) => n,
            Err(e) => {
                wakeup_failures += 1;
                wakeup_throttle.failed("reading the next deadline", &e, wakeup_failures);
                if sleep_or_stop(backoff(wakeup_failures - 1), stopped).await {
                    return;
                }
                continue;
            }
        };
        wakeup_failures = 0;
        wakeup_throttle.recovered();
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
                // While rows of an ordered relay are in flight, due rows of their keys wait
                // behind them, and the end of each run wakes us: look again within a
                // second only (each look reads those rows).
                let ordered_in_flight = in_order
                    .iter()
                    .any(|(_, ordered)| shared.held.holds_any_of(ordered));
                let wait = if ordered_in_flight {
                    ceiling.min(ORDERED_LOOK_AGAIN)
                } else {
                    contention
                };
                target = target.min(now + wait);
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
        // A relay's circuit lets its probe through when its back-off ends.
        if let Some(until) = circuit_reopens(shared, queues) {
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
                            target = target.min(published_wake(shared, &in_order, &queue, at));
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

/// When to claim for a row of `queue` published due at `at` (store clock). A row of an
/// ordered relay's queue while this worker holds rows of that relay in flight waits for the
/// end of a run (which wakes the loop) or a second, as the look-again of due rows behind a
/// run does: the notification does not say the row's key, and a claim while a run is in
/// flight finds its key's rows held back and reads every due row of the queue to be sure
/// (a relay draining one key's backlog of 2·10⁴ rows at 3 400 msg/s went to 1 900 msg/s
/// with 20 publishes a second, and to 1 070 with 200; lab notes of 2026-12-05). A row of a
/// key not in flight is then claimed within that second.
fn published_wake<S: Store>(
    shared: &Shared<S>,
    in_order: &[(String, Vec<String>)],
    queue: &str,
    at: DateTime<Utc>,
) -> Instant {
    let at = shared.local(at);
    let behind_a_run = in_order.iter().any(|(_, ordered)| {
        ordered.iter().any(|q| q == queue) && shared.held.holds_any_of(ordered)
    });
    if behind_a_run {
        at.max(Instant::now() + ORDERED_LOOK_AGAIN)
    } else {
        at
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
    if shared
        .routes
        .values()
        .all(|r| r.max_concurrency.is_none() && r.circuit.is_none())
    {
        return None;
    }
    let active = shared.held.active_by_queue();
    let now = Instant::now();
    Some(
        queues
            .iter()
            .map(|q| {
                let route = shared.routes.get(q);
                // An ordered relay's queue is claimed by its own statement.
                if route.is_some_and(|r| r.ordered_by.is_some()) {
                    return 0;
                }
                let held = active.get(q).copied().unwrap_or(0);
                let free = match route.and_then(|r| r.max_concurrency) {
                    Some(max) => max.saturating_sub(held).min(limit),
                    None => limit,
                };
                // A relay whose sink is down: nothing while its circuit is open, then one
                // row to probe it (none while the queue still holds rows: a run is on it).
                match route.and_then(|r| r.circuit.as_ref()).map(|c| c.gate(now)) {
                    Some(Gate::Open(_)) => 0,
                    Some(Gate::Probe) => free.min(usize::from(held == 0)),
                    Some(Gate::Closed) | None => free,
                }
            })
            .collect(),
    )
}

/// The ordered relays' queues among `queues`, by key header.
fn ordered_queues<S: Store>(shared: &Shared<S>, queues: &[String]) -> Vec<(String, Vec<String>)> {
    let mut by_header: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    for q in queues {
        if let Some(h) = shared.routes.get(q).and_then(|r| r.ordered_by.as_ref()) {
            by_header.entry(h.clone()).or_default().push(q.clone());
        }
    }
    by_header.into_iter().collect()
}

/// Which of an ordered relay's `queues` a claim may take now, and how many rows: none of a
/// queue whose circuit is open, one (a probe) when a circuit is half open.
fn ordered_gate<S: Store>(
    shared: &Shared<S>,
    queues: &[String],
    left: usize,
) -> (Vec<String>, usize) {
    let now = Instant::now();
    let active = shared.held.active_by_queue();
    let mut cap = left;
    let open = queues
        .iter()
        .filter(|q| {
            match shared
                .routes
                .get(*q)
                .and_then(|r| r.circuit.as_ref())
                .map(|c| c.gate(now))
            {
                Some(Gate::Open(_)) => false,
                Some(Gate::Probe) => {
                    cap = cap.min(usize::from(active.get(*q).copied().unwrap_or(0) == 0));
                    true
                }
                Some(Gate::Closed) | None => true,
            }
        })
        .cloned()
        .collect();
    (open, cap)
}

/// The earliest instant a circuit of `queues` lets a probe through, if one is open.
fn circuit_reopens<S: Store>(shared: &Shared<S>, queues: &[String]) -> Option<Instant> {
    let now = Instant::now();
    queues
        .iter()
        .filter_map(|q| shared.routes.get(q)?.circuit.as_ref())
        .filter_map(|c| match c.gate(now) {
            Gate::Open(until) => Some(until),
            Gate::Probe | Gate::Closed => None,
        })
        .min()
}

/// Receives the next hint, or waits forever when there is no hint channel.
async fn recv_wakeup(wakeups: &mut Option<mpsc::Receiver<Wakeup>>) -> Option<Wakeup> {
    match wakeups {
        Some(w) => w.recv().await,
        None => std::future::pending().await,
    }
}

/// Sleeps, returning true if the worker was stopped meanwhile.
async fn sleep_or_stop(d: Duration, stopped: &mut watch::Receiver<bool>) -> bool {
    tokio::select! {
        () = tokio::time::sleep(d) => *stopped.borrow(),
        _ = stopped.changed() => true,
    }
}
