//! Poison rows in a claim. A claim statement that fails because of one row's data (a
//! trigger or a constraint that raises when that row is leased) is retried on halves of the
//! ids it would have taken, down to the failing row; the rest of the batch is delivered.
//! The failing row is set aside in this worker's memory ([`Quarantine`]) with a growing
//! back-off (claims leave it out meanwhile), and after `max_deliveries` observed failures it
//! is ended by a delete-based statement (archived when the dead-letter queue is on), which a
//! guard on updates does not stop. The count lives in memory: a restarted worker starts it
//! again.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use super::decide::Route;
use super::handler::DEFAULT_MAX_DELIVERIES;
use crate::error::{Error, Result};
use crate::store::{fair_order, ClaimRequest, Completion, Delivery, Failure, FailureReason, Store};
use crate::telemetry;

/// Claims what `request` would take, isolating the rows whose lease fails: peeks at the
/// candidates, then claims them in halves until each failing row is alone, which is set
/// aside in `quarantine` (its queue's route gives its `max_deliveries`).
pub(crate) async fn claim_isolating<S: Store>(
    store: &S,
    routes: &HashMap<String, Route>,
    quarantine: &Quarantine,
    request: ClaimRequest<'_>,
    first_error: &Error,
) -> Result<Vec<Delivery>> {
    let candidates = store.peek(request).await?;
    tracing::warn!(
        error = %first_error,
        candidates = candidates.len(),
        "outbox: a claim failed on a row's data; isolating the row"
    );
    let queue_of: HashMap<i64, String> = candidates.iter().cloned().collect();
    let mut out = Vec::new();
    let mut pending: Vec<Vec<i64>> = vec![candidates.into_iter().map(|(id, _)| id).collect()];
    while let Some(ids) = pending.pop() {
        if ids.is_empty() {
            continue;
        }
        match store.claim(request.only(&ids)).await {
            Ok(ds) => out.extend(ds),
            Err(e) if e.is_row_fault() && ids.len() == 1 => {
                let queue = queue_of.get(&ids[0]).map_or("", String::as_str);
                let max = routes
                    .get(queue)
                    .map_or(DEFAULT_MAX_DELIVERIES, |r| r.max_deliveries);
                let row = PoisonRow {
                    id: ids[0],
                    queue,
                    max_deliveries: max,
                };
                set_aside(store, quarantine, row, request.lease_ttl, &e).await;
            }
            Err(e) if e.is_row_fault() => {
                let (a, b) = ids.split_at(ids.len() / 2);
                pending.push(b.to_vec());
                pending.push(a.to_vec());
            }
            // A connection or server error: stop here; the caller backs off. What was
            // claimed so far is delivered.
            Err(e) if out.is_empty() => return Err(e),
            Err(e) => {
                tracing::warn!(error = %e, "outbox: isolating a poison row stopped early");
                break;
            }
        }
    }
    fair_order(&mut out, request.resume_after);
    Ok(out)
}

/// A row no claim could take.
struct PoisonRow<'a> {
    id: i64,
    queue: &'a str,
    /// Its queue's.
    max_deliveries: u32,
}

/// One more observed failure of a row that cannot be claimed: set it aside, or end it once
/// it failed more often than its queue's `max_deliveries`.
async fn set_aside<S: Store>(
    store: &S,
    quarantine: &Quarantine,
    row: PoisonRow<'_>,
    lease_ttl: Duration,
    error: &Error,
) {
    let PoisonRow {
        id,
        queue,
        max_deliveries: max,
    } = row;
    let failures = quarantine.strike(id);
    telemetry::poison_row(queue);
    if failures <= max {
        tracing::error!(
            id,
            queue,
            failures,
            max_deliveries = max,
            error = %error,
            "outbox: this row cannot be claimed; it is set aside and tried again later"
        );
        return;
    }
    let text = format!("the row could not be claimed {failures} times: {error}");
    let failure = Failure {
        reason: FailureReason::MaxDeliveries,
        last_error: Some(&text),
    };
    match store.fail_unclaimed(id, lease_ttl, failure).await {
        Ok(Completion::Deleted) => {
            quarantine.forget(id);
            telemetry::terminal(queue, FailureReason::MaxDeliveries.as_str());
            tracing::error!(
                id,
                queue,
                failures,
                dead_letter = store.dead_letter_enabled(),
                "outbox: a row that could not be claimed is removed (archived when the dead-letter queue is on)"
            );
        }
        Ok(_) => quarantine.forget(id),
        Err(e) => tracing::error!(
            id,
            queue,
            error = %e,
            "outbox: a row that could not be claimed could not be removed either; it stays set aside"
        ),
    }
}

/// The longest a poison row is set aside before the next try.
const MAX_SET_ASIDE: Duration = Duration::from_secs(300);

#[derive(Debug)]
struct Strike {
    failures: u32,
    until: Instant,
}

/// Rows this worker's claims leave out for a while, with their observed failures: rows no
/// claim can take, and schedule rows given back because their recurrence cannot be computed
/// here (`execute.rs`).
#[derive(Debug, Default)]
pub(crate) struct Quarantine {
    rows: Mutex<HashMap<i64, Strike>>,
}

impl Quarantine {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<i64, Strike>> {
        self.rows.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Rows still set aside at `now`.
    pub(crate) fn ids(&self, now: Instant) -> Vec<i64> {
        self.lock()
            .iter()
            .filter(|(_, s)| s.until > now)
            .map(|(&id, _)| id)
            .collect()
    }

    /// When the next set-aside row may be tried again.
    pub(crate) fn next_until(&self, now: Instant) -> Option<Instant> {
        self.lock()
            .values()
            .map(|s| s.until)
            .filter(|&u| u > now)
            .min()
    }

    /// Counts a failure of row `id` and sets it aside (1 s, doubling, at most 5 min).
    /// Returns the failures observed so far.
    pub(crate) fn strike(&self, id: i64) -> u32 {
        let mut rows = self.lock();
        let s = rows.entry(id).or_insert(Strike {
            failures: 0,
            until: Instant::now(),
        });
        s.failures += 1;
        let wait = Duration::from_secs(1)
            .saturating_mul(1 << (s.failures - 1).min(16))
            .min(MAX_SET_ASIDE);
        s.until = Instant::now() + wait;
        s.failures
    }

    pub(crate) fn forget(&self, id: i64) {
        self.lock().remove(&id);
    }
}
