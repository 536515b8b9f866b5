//! Rows no claim can take (a trigger or constraint raises whenever a claim updates them),
//! set aside in the worker's memory with their observed failures and a growing back-off;
//! claims leave them out until the back-off ends.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// The longest a poison row is set aside before the next try.
const MAX_SET_ASIDE: Duration = Duration::from_secs(300);

#[derive(Debug)]
struct Strike {
    failures: u32,
    until: Instant,
}

/// Rows no claim can take, with their observed failures.
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
