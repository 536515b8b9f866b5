//! The circuit of a queue whose handler forwards to a service that can be down as a whole
//! (a relay's broker): while the service fails, the worker stops claiming the queue, and
//! the rows a failing run held are given back untouched (pending as before, the delivery not
//! counted). After a back-off one probe row is claimed; its success closes the circuit.
//!
//! A run tells the circuit with [`Circuit::unavailable`] (this row is not at fault: give it
//! back) or [`Circuit::available`] (the service answered, whatever it said about the row).

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// The first back-off after the service failed; it doubles per failed probe.
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
/// The longest back-off: a service that returns is used again within this (plus one probe).
pub(crate) const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// What a claim may take of a queue behind a circuit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Gate {
    /// The service works: claim as usual.
    Closed,
    /// The back-off is over: claim one row to probe the service.
    Probe,
    /// The service failed: claim nothing until this instant.
    Open(Instant),
}

#[derive(Debug, Default)]
struct State {
    /// Failures in a row (0: closed).
    failures: u32,
    /// No claim before this.
    open_until: Option<Instant>,
    /// The last failure's text, for the log.
    reason: String,
}

/// One circuit, shared by the queues of one relay and its runs.
#[derive(Debug, Default)]
pub(crate) struct Circuit {
    state: Mutex<State>,
    /// Rows whose run found the service unavailable: the worker gives them back.
    given_back: Mutex<HashSet<i64>>,
    /// Set when a run closed the circuit; the worker then wakes its claim loop.
    closed: std::sync::atomic::AtomicBool,
}

impl Circuit {
    /// What a claim may take now.
    pub(crate) fn gate(&self, now: Instant) -> Gate {
        let s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        match s.open_until {
            Some(until) if now < until => Gate::Open(until),
            _ if s.failures > 0 => Gate::Probe,
            _ => Gate::Closed,
        }
    }

    /// Whether a run should not even try the service now (the circuit is open).
    pub(crate) fn is_open(&self) -> bool {
        matches!(self.gate(Instant::now()), Gate::Open(_))
    }

    /// The run of row `id` found the service unavailable (`reason`): the row is to be given
    /// back, and the circuit opens (again) with a longer back-off.
    pub(crate) fn unavailable(&self, id: i64, reason: &str) {
        self.given_back
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id);
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        // Runs that were in flight together fail together: one step of back-off for them.
        if s.open_until.is_some_and(|u| now < u) {
            return;
        }
        let backoff = FIRST_BACKOFF
            .saturating_mul(1 << s.failures.min(8))
            .min(MAX_BACKOFF);
        s.failures = s.failures.saturating_add(1);
        s.open_until = Some(now + backoff);
        if s.failures == 1 || s.reason != reason {
            tracing::warn!(
                reason,
                backoff_ms = backoff.as_millis() as u64,
                "outbox: relay sink unavailable; claims of its queues paused, rows given back"
            );
        }
        s.reason = reason.to_owned();
    }

    /// The service answered a run: closes the circuit. `true` when it was not closed (the
    /// claim loop should look again at once).
    pub(crate) fn available(&self) -> bool {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if s.failures == 0 {
            return false;
        }
        tracing::info!(
            failures = s.failures,
            "outbox: relay sink available again; claims resume"
        );
        *s = State::default();
        self.closed
            .store(true, std::sync::atomic::Ordering::Relaxed);
        true
    }

    /// Whether a run closed the circuit since the last call.
    pub(crate) fn take_closed(&self) -> bool {
        self.closed
            .swap(false, std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether the run of row `id` asked for its row to be given back (and forgets it).
    pub(crate) fn take_given_back(&self, id: i64) -> bool {
        self.given_back
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn opens_backs_off_probes_and_closes() {
        let c = Circuit::default();
        assert_eq!(c.gate(Instant::now()), Gate::Closed);
        c.unavailable(1, "down");
        c.unavailable(2, "down");
        assert!(c.take_given_back(1) && c.take_given_back(2) && !c.take_given_back(1));
        let Gate::Open(until) = c.gate(Instant::now()) else {
            panic!("open")
        };
        assert_eq!(
            until - Instant::now(),
            FIRST_BACKOFF,
            "one step for runs in flight"
        );
        tokio::time::advance(FIRST_BACKOFF).await;
        assert_eq!(c.gate(Instant::now()), Gate::Probe);
        c.unavailable(3, "down");
        let Gate::Open(until) = c.gate(Instant::now()) else {
            panic!("open")
        };
        assert_eq!(until - Instant::now(), FIRST_BACKOFF * 2);
        for _ in 0..10 {
            tokio::time::advance(MAX_BACKOFF).await;
            c.unavailable(4, "down");
        }
        let Gate::Open(until) = c.gate(Instant::now()) else {
            panic!("open")
        };
        assert_eq!(until - Instant::now(), MAX_BACKOFF, "capped");
        assert!(c.available());
        assert!(!c.available());
        assert_eq!(c.gate(Instant::now()), Gate::Closed);
    }
}
