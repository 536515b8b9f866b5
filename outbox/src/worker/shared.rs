//! What the claim loop, the handler tasks, the completer and the renewal loop share (and a
//! `run_due` call, for its duration): the store,
//! the routes, the knobs, the held leases, the rows set aside as poison, the mapping from
//! the store's clock to the local one, and the wake-up hint a completion leaves for the idle
//! claim loop.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::sync::Notify;
use tokio::time::Instant;

use super::config::Config;
use super::decide::Route;
use super::leases::Held;
use super::poison::Quarantine;
use crate::store::{Delivery, Store};

/// A claimed row on its way from the claim loop to a handler task, with the `receive` span
/// of the claim that took it (its `process` span follows from it).
pub(crate) struct Claimed {
    pub(crate) delivery: Delivery,
    pub(crate) receive: tracing::Span,
    /// Its place in a run of an ordered relay's key (none for every other row).
    pub(crate) run: RunLink,
}

/// A row's links in a **run**: the consecutive rows of one key an ordered relay claimed
/// together (`Store::claim_in_order`). A row starts only once the row before it in the run
/// succeeded (`after` yields `true`), and tells the row after it how it ended (`then`); a
/// link dropped unsent reads as a failure, so every way a run can end early (a failed or
/// given-back publish, a lost lease, shutdown) gives the rest of the run back untouched.
// SPEC §14: the messages of one key reach the broker in commit order.
#[derive(Debug, Default)]
pub(crate) struct RunLink {
    pub(crate) after: Option<tokio::sync::oneshot::Receiver<bool>>,
    pub(crate) then: Option<tokio::sync::oneshot::Sender<bool>>,
}

/// State shared by the claim loop, handler tasks and the completer.
pub(crate) struct Shared<S> {
    pub(crate) store: S,
    pub(crate) routes: Arc<HashMap<String, Route>>,
    pub(crate) config: Config,
    /// Every lease the worker holds.
    pub(crate) held: Held,
    /// Rows no claim can take, set aside with back-off.
    pub(crate) quarantine: Quarantine,
    /// Earliest local instant a completion of this worker made a row due (a rearm applied,
    /// a retry scheduled); read by the idle claim loop, which wakes then.
    hint: std::sync::Mutex<Option<Instant>>,
    pub(crate) hint_changed: Notify,
    /// Store clock minus local clock, in microseconds, from the latest `next_wakeup`.
    clock_offset_us: std::sync::atomic::AtomicI64,
}

impl<S: Store> Shared<S> {
    pub(crate) fn new(store: S, routes: Arc<HashMap<String, Route>>, config: Config) -> Self {
        Shared {
            store,
            routes,
            held: Held::new(config.lease_ttl),
            quarantine: Quarantine::default(),
            config,
            hint: std::sync::Mutex::new(None),
            hint_changed: Notify::new(),
            clock_offset_us: std::sync::atomic::AtomicI64::new(0),
        }
    }

    /// Records the store's clock as read at `store_now`, for [`Shared::local`].
    pub(crate) fn observe_clock(&self, store_now: DateTime<Utc>) {
        self.clock_offset_us.store(
            (store_now - Utc::now()).num_microseconds().unwrap_or(0),
            std::sync::atomic::Ordering::Relaxed,
        );
    }

    /// The rows a claim must leave out: the ones held, and the ones set aside.
    pub(crate) fn exclude(&self) -> Vec<i64> {
        let mut ids = self.held.ids();
        ids.extend(self.quarantine.ids(Instant::now()));
        ids
    }

    /// Takes the hint a completion left, if any.
    pub(crate) fn take_hint(&self) -> Option<Instant> {
        self.hint.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    /// Maps a store-clock time onto the local monotonic clock.
    pub(crate) fn local(&self, at: DateTime<Utc>) -> Instant {
        let offset = self
            .clock_offset_us
            .load(std::sync::atomic::Ordering::Relaxed);
        let store_now_us = Utc::now().timestamp_micros() + offset;
        let ahead = at.timestamp_micros() - store_now_us;
        let now = Instant::now();
        if ahead <= 0 {
            now
        } else {
            now + Duration::from_micros(ahead as u64)
        }
    }

    pub(crate) fn wake_at(&self, at: DateTime<Utc>) {
        self.wake_at_local(self.local(at));
    }

    /// As [`Shared::wake_at`], on the local clock.
    pub(crate) fn wake_at_local(&self, local: Instant) {
        let mut hint = self.hint.lock().unwrap_or_else(|p| p.into_inner());
        if hint.is_none_or(|h| local < h) {
            *hint = Some(local);
            self.hint_changed.notify_one();
        }
    }
}

/// The back-off after a failed claim or completion: 100 ms doubling, capped at 5 s.
pub(crate) fn backoff(attempt: u32) -> Duration {
    let ms = 100u64.saturating_mul(1 << attempt.min(6));
    Duration::from_millis(ms.min(5_000))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_and_caps() {
        assert_eq!(backoff(0), Duration::from_millis(100));
        assert_eq!(backoff(1), Duration::from_millis(200));
        assert_eq!(backoff(5), Duration::from_millis(3200));
        assert_eq!(backoff(6), Duration::from_secs(5));
        assert_eq!(backoff(60), Duration::from_secs(5));
    }
}
