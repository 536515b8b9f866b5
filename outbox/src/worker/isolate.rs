//! Poison rows in a claim. A claim statement that fails because of one row's data (a
//! trigger or a constraint that raises when that row is leased) is retried on halves of the
//! ids it would have taken, down to the failing row; the rest of the batch is delivered.
//! The failing row is set aside in this worker's memory with a growing back-off (claims
//! leave it out meanwhile), and after `max_deliveries` observed failures it is ended by a
//! delete-based statement (archived when the dead-letter queue is on), which a guard on
//! updates does not stop. The count lives in memory: a restarted worker starts it again.

use std::collections::HashMap;
use std::time::Duration;

use super::handler::DEFAULT_MAX_DELIVERIES;
use super::shared::Shared;
use crate::error::{Error, Result};
use crate::store::{ClaimRequest, Completion, Delivery, Failure, FailureReason, Store};

/// Claims what `request` would take, isolating the rows whose lease fails: peeks at the
/// candidates, then claims them in halves until each failing row is alone.
pub(crate) async fn claim_isolating<S: Store>(
    shared: &Shared<S>,
    request: ClaimRequest<'_>,
    first_error: &Error,
) -> Result<Vec<Delivery>> {
    let candidates = shared.store.peek(request).await?;
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
        match shared.store.claim(request.only(&ids)).await {
            Ok(ds) => out.extend(ds),
            Err(e) if e.is_row_fault() && ids.len() == 1 => {
                let queue = queue_of.get(&ids[0]).map_or("", String::as_str);
                set_aside(shared, ids[0], queue, request.lease_ttl, &e).await;
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
    out.sort_by_key(|d| (d.deadline, d.lease.id));
    Ok(out)
}

/// One more observed failure of a row that cannot be claimed: set it aside, or end it once
/// it failed more often than its queue's `max_deliveries`.
async fn set_aside<S: Store>(
    shared: &Shared<S>,
    id: i64,
    queue: &str,
    lease_ttl: Duration,
    error: &Error,
) {
    let failures = shared.quarantine.strike(id);
    let max = shared
        .routes
        .get(queue)
        .map_or(DEFAULT_MAX_DELIVERIES, |r| r.max_deliveries);
    metrics::counter!("outbox_poison_rows_total", "queue" => queue.to_owned()).increment(1);
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
    match shared.store.fail_unclaimed(id, lease_ttl, failure).await {
        Ok(Completion::Deleted) => {
            shared.quarantine.forget(id);
            metrics::counter!("outbox_terminal_total", "queue" => queue.to_owned(), "reason" => FailureReason::MaxDeliveries.as_str())
                .increment(1);
            tracing::error!(
                id,
                queue,
                failures,
                dead_letter = shared.store.dead_letter_enabled(),
                "outbox: a row that could not be claimed is removed (archived when the dead-letter queue is on)"
            );
        }
        Ok(_) => shared.quarantine.forget(id),
        Err(e) => tracing::error!(
            id,
            queue,
            error = %e,
            "outbox: a row that could not be claimed could not be removed either; it stays set aside"
        ),
    }
}
