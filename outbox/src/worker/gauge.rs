//! The opt-in queue-depth gauge: the queue statistics, read every interval by **one**
//! worker of the process and set as gauges through the `metrics` facade.
//!
//! Every worker built with the gauge runs this loop, but only the one holding the
//! process-wide poller slot reads: another worker of the process skips its ticks until the
//! holder stops (its slot is given back when its loop ends, also when the task is aborted),
//! then the first of them to tick takes the slot over. So a process with several workers
//! reads the statistics once per interval, not once per worker.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::MissedTickBehavior;

use super::shared::Shared;
use crate::stats::{QueueStats, StatsMode, StatsRequest};
use crate::store::Store;
use crate::telemetry;

/// The worker loop holding the poller slot (0: none).
static POLLER: AtomicU64 = AtomicU64::new(0);
static NEXT_ID: AtomicU64 = AtomicU64::new(1);
/// The series set at the last read, so a queue that vanished from the statistics (no row
/// left) is set to 0 instead of keeping its last value.
static REPORTED: Mutex<BTreeSet<(String, &'static str)>> = Mutex::new(BTreeSet::new());

/// The `state` label of the lateness series in [`REPORTED`] (not a label value).
const LATENESS_KEY: &str = "";

/// One loop's claim on the poller slot, given back when dropped.
struct Slot(u64);

impl Slot {
    fn new() -> Self {
        Slot(NEXT_ID.fetch_add(1, Ordering::Relaxed))
    }

    /// Holds the slot, taking it if free.
    fn hold(&self) -> bool {
        match POLLER.compare_exchange(0, self.0, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => true,
            Err(holder) => holder == self.0,
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let _ = POLLER.compare_exchange(self.0, 0, Ordering::AcqRel, Ordering::Acquire);
    }
}

/// Reads the statistics of every queue every `every` (the first read at once) while this
/// loop holds the poller slot, judging lease expiry by the worker's `lease_ttl`. Runs until
/// its task is aborted, or until the store turns out to have no statistics.
pub(crate) async fn queue_depth<S: Store>(
    shared: Arc<Shared<S>>,
    every: Duration,
    mode: StatsMode,
) {
    let slot = Slot::new();
    let request = StatsRequest::new(shared.config.lease_ttl).mode(mode);
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if !slot.hold() {
            continue;
        }
        match shared.store.queue_stats(&request).await {
            Ok(Some(stats)) => report(&stats),
            Ok(None) => {
                tracing::warn!(
                    "outbox: the store has no queue statistics; the queue-depth gauge is off"
                );
                return;
            }
            Err(e) => tracing::warn!(
                error = %e,
                "outbox: the queue-depth gauge could not read the queue statistics; it tries again in {every:?}"
            ),
        }
    }
}

/// Sets the gauges of one read: each figure the mode measured, the oldest due lateness (0
/// when nothing is due), and 0 for every series of the previous read that this one lacks.
fn report(stats: &[QueueStats]) {
    let mut now: BTreeSet<(String, &'static str)> = BTreeSet::new();
    for s in stats {
        let figures = [
            ("pending", s.pending),
            ("due", s.due),
            ("leased", s.leased),
            ("expired_leases", s.expired_leases),
            ("rearms", s.rearms),
            ("cancel_marks", s.cancel_marks),
            ("dead_letters", s.dead_letters),
        ];
        for (state, count) in figures {
            if let Some(n) = count.value() {
                telemetry::queue_depth(&s.queue, state, n as f64);
                now.insert((s.queue.clone(), state));
            }
        }
        let late = s.oldest_due_lateness.unwrap_or(Duration::ZERO);
        telemetry::oldest_due_lateness(&s.queue, late.as_secs_f64());
        now.insert((s.queue.clone(), LATENESS_KEY));
    }
    let mut reported = REPORTED.lock().unwrap_or_else(|p| p.into_inner());
    for (queue, state) in reported.difference(&now) {
        if *state == LATENESS_KEY {
            telemetry::oldest_due_lateness(queue, 0.0);
        } else {
            telemetry::queue_depth(queue, state, 0.0);
        }
    }
    *reported = now;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_slot_per_process_given_back_on_drop() {
        let (a, b) = (Slot::new(), Slot::new());
        assert!(a.hold());
        assert!(a.hold(), "the holder keeps it");
        assert!(!b.hold());
        drop(a);
        assert!(b.hold(), "taken over once given back");
        drop(b);
        assert_eq!(POLLER.load(Ordering::Acquire), 0);
    }
}
