//! Lease renewal: one statement per worker every third of `lease_ttl` keeps every held lease
//! alive, and tells running handlers when their lease was lost or their timer cancelled.

use std::sync::Arc;

use tokio::sync::watch;
use tokio::time::Instant;

use super::complete::Phase;
use super::leases::Phase as HeldPhase;
use super::shared::Shared;
use crate::store::{Lease, Renewal, Store};
use crate::telemetry;

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
async fn renew_once<S: Store>(shared: &Shared<S>, failures: &mut u32) {
    let leases = shared.held.leases();
    if leases.is_empty() {
        return;
    }
    let sent = Instant::now();
    match shared.store.renew(&leases).await {
        Ok(results) => {
            *failures = 0;
            telemetry::lease_renewed();
            let pairs: Vec<(Lease, Renewal)> = leases.into_iter().zip(results).collect();
            for (_lease, queue, phase) in shared.held.renewed(&pairs, sent) {
                let label = if phase == HeldPhase::Buffered {
                    "buffered"
                } else {
                    Phase::Renew.as_str()
                };
                telemetry::lease_lost(&queue, label);
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
