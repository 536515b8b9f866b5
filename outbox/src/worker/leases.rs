//! The leases a worker holds: every claimed row from its claim until its completion lands —
//! waiting in the buffer, running, or waiting to be acked. The claim loop registers them,
//! the handler tasks move them along, the renewal loop keeps them alive and tells running
//! handlers when one is lost or cancelled, and shutdown releases what is left.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use super::handler::CancelReason;
use crate::store::{Delivery, Lease, Renewal};

/// Where a held row is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Claimed, waiting in the buffer for a handler slot.
    Buffered,
    /// Its handler runs.
    Running,
    /// Its handler is done; the completion is being written (or waits in the ack batch).
    Completing,
}

#[derive(Debug)]
struct Entry {
    lease: Lease,
    queue: String,
    /// Failed runs before this one, for the release of a run stopped at shutdown.
    attempts_count: i32,
    phase: Phase,
    /// The running handler's own transaction is committing (the row's completion runs inside
    /// it): the commit may delete the row at any moment.
    committing: bool,
    /// The local instant the lease expires unless renewed.
    until: Instant,
    /// Tells the running handler it should stop; `Some` once the lease is lost or the timer
    /// cancelled.
    stop: watch::Sender<Option<CancelReason>>,
}

/// A held row as shutdown sees it.
#[derive(Debug, Clone)]
pub(crate) struct HeldRow {
    pub lease: Lease,
    pub queue: String,
    pub attempts_count: i32,
    pub phase: Phase,
}

/// The registry of held leases.
#[derive(Debug)]
pub(crate) struct Held {
    lease_ttl: Duration,
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    rows: HashMap<i64, Entry>,
    /// Set at shutdown: no buffered row starts any more (they are released instead).
    closed: bool,
}

impl Held {
    pub(crate) fn new(lease_ttl: Duration) -> Self {
        Held {
            lease_ttl,
            inner: Mutex::new(Inner::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers a claimed row; its lease runs from `claimed` (local clock).
    pub(crate) fn add(&self, d: &Delivery, claimed: Instant) {
        let (stop, _) = watch::channel(None);
        self.lock().rows.insert(
            d.lease.id,
            Entry {
                lease: d.lease,
                queue: d.queue.clone(),
                attempts_count: d.attempts_count,
                phase: Phase::Buffered,
                committing: false,
                until: claimed + self.lease_ttl,
                stop,
            },
        );
    }

    /// A handler slot takes the row: `Some(stop signal)` if it may start, `None` if it must
    /// not (the lease was lost while it waited, or shutdown began), in which case the
    /// handler task drops the delivery.
    pub(crate) fn start(&self, lease: Lease) -> Option<watch::Receiver<Option<CancelReason>>> {
        let mut inner = self.lock();
        if inner.closed {
            return None;
        }
        let entry = inner.rows.get_mut(&lease.id).filter(|e| e.lease == lease)?;
        if entry
            .stop
            .borrow()
            .is_some_and(|r| r == CancelReason::LeaseLost)
        {
            inner.rows.remove(&lease.id);
            return None;
        }
        entry.phase = Phase::Running;
        Some(entry.stop.subscribe())
    }

    /// The handler is done; its completion is being written.
    pub(crate) fn completing(&self, lease: Lease) {
        if let Some(e) = self.lock().rows.get_mut(&lease.id) {
            if e.lease == lease {
                e.phase = Phase::Completing;
            }
        }
    }

    /// The running handler's own commit starts (`true`) or failed (`false`).
    pub(crate) fn committing(&self, lease: Lease, on: bool) {
        if let Some(e) = self.lock().rows.get_mut(&lease.id) {
            if e.lease == lease {
                e.committing = on;
            }
        }
    }

    /// The completion landed (or was dropped): the row is no longer held.
    pub(crate) fn remove(&self, lease: Lease) {
        let mut inner = self.lock();
        if inner.rows.get(&lease.id).is_some_and(|e| e.lease == lease) {
            inner.rows.remove(&lease.id);
        }
    }

    /// When the lease runs out unless renewed (local clock); now if it is not held.
    pub(crate) fn until(&self, lease: Lease) -> Instant {
        self.lock()
            .rows
            .get(&lease.id)
            .filter(|e| e.lease == lease)
            .map_or_else(Instant::now, |e| e.until)
    }

    /// Ids of every held row: a claim leaves them out, so a worker never reclaims (and runs a
    /// second time) a row whose lease it still holds.
    pub(crate) fn ids(&self) -> Vec<i64> {
        self.lock().rows.keys().copied().collect()
    }

    /// Every held lease, for a renewal.
    pub(crate) fn leases(&self) -> Vec<Lease> {
        self.lock().rows.values().map(|e| e.lease).collect()
    }

    /// How many rows of `queue` wait for a slot or run: what counts against the queue's
    /// `max_concurrency`.
    pub(crate) fn active(&self, queue: &str) -> usize {
        self.lock()
            .rows
            .values()
            .filter(|e| e.queue == queue && e.phase != Phase::Completing)
            .count()
    }

    /// [`Held::active`] of every queue with such rows, in one pass.
    pub(crate) fn active_by_queue(&self) -> HashMap<String, usize> {
        let mut out = HashMap::new();
        for e in self.lock().rows.values() {
            if e.phase != Phase::Completing {
                *out.entry(e.queue.clone()).or_insert(0) += 1;
            }
        }
        out
    }

    /// Whether any row of `queues` is held, in any phase (completing included).
    pub(crate) fn holds_any_of(&self, queues: &[String]) -> bool {
        self.lock().rows.values().any(|e| queues.contains(&e.queue))
    }

    /// How many rows are held.
    pub(crate) fn len(&self) -> usize {
        self.lock().rows.len()
    }

    /// Applies a renewal taken at `renewed` (local clock, before the statement was sent).
    /// Returns the leases found lost, with their queues, for the caller's metrics.
    pub(crate) fn renewed(
        &self,
        results: &[(Lease, Renewal)],
        renewed: Instant,
    ) -> Vec<(Lease, String, Phase)> {
        let mut inner = self.lock();
        let mut lost = Vec::new();
        for &(lease, renewal) in results {
            let Some(e) = inner.rows.get_mut(&lease.id).filter(|e| e.lease == lease) else {
                continue;
            };
            match renewal {
                Renewal::Renewed => e.until = e.until.max(renewed + self.lease_ttl),
                Renewal::Cancelled => {
                    e.until = e.until.max(renewed + self.lease_ttl);
                    e.stop.send_if_modified(|r| {
                        let changed = r.is_none();
                        r.get_or_insert(CancelReason::TimerCancelled);
                        changed
                    });
                }
                // A row whose completion is being written may be gone because that
                // completion landed first: the completion reports what happened.
                Renewal::Lost if e.phase == Phase::Completing || e.committing => {}
                Renewal::Lost => {
                    e.stop.send_replace(Some(CancelReason::LeaseLost));
                    lost.push((lease, e.queue.clone(), e.phase));
                }
                // Locked by another transaction: not renewed this time, not lost either.
                _ => {}
            }
        }
        lost
    }

    /// Shutdown: no buffered row starts any more.
    pub(crate) fn close(&self) {
        self.lock().closed = true;
    }

    /// Every held row now.
    pub(crate) fn rows(&self) -> Vec<HeldRow> {
        self.lock()
            .rows
            .values()
            .map(|e| HeldRow {
                lease: e.lease,
                queue: e.queue.clone(),
                attempts_count: e.attempts_count,
                phase: e.phase,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::Utc;
    use uuid::Uuid;

    fn delivery(id: i64) -> Delivery {
        Delivery {
            lease: Lease {
                id,
                token: Uuid::new_v4(),
            },
            queue: "q".into(),
            payload: Vec::new(),
            headers: None,
            timer_id: None,
            attempts_count: 0,
            deliveries_count: 1,
            created_at: Utc::now(),
            deadline: Utc::now(),
            first_attempt_at: None,
            claimed_at: Utc::now(),
            decode_error: None,
        }
    }

    /// A renewal that finds a row gone while the row's own completion is being written
    /// does not call it lost: that completion may have deleted it first.
    #[tokio::test]
    async fn a_lost_renewal_of_a_completing_row_is_not_a_lost_lease() {
        let held = Held::new(Duration::from_secs(30));
        let (running, completing, buffered) = (delivery(1), delivery(2), delivery(3));
        for d in [&running, &completing, &buffered] {
            held.add(d, Instant::now());
        }
        let stop = held.start(running.lease).unwrap();
        held.start(completing.lease).unwrap();
        held.completing(completing.lease);
        let lost = held.renewed(
            &[
                (running.lease, Renewal::Lost),
                (completing.lease, Renewal::Lost),
                (buffered.lease, Renewal::Lost),
            ],
            Instant::now(),
        );
        let ids: Vec<i64> = lost.iter().map(|(l, _, _)| l.id).collect();
        assert_eq!(ids.len(), 2);
        assert!(ids.contains(&1) && ids.contains(&3), "{ids:?}");
        assert_eq!(*stop.borrow(), Some(CancelReason::LeaseLost));
        assert!(
            held.start(buffered.lease).is_none(),
            "a lost buffered row never starts"
        );
    }
}
