//! The store's tables and clock, and what every statement family shares: ids, deadlines
//! at Postgres' precision, the wake-up hints a `pg_notify` would send, the row a lease
//! fences.

use std::collections::BTreeMap;

use chrono::{DateTime, NaiveDate, NaiveDateTime, TimeDelta, Utc};

use crate::error::{Error, Result};
use crate::message::schedule::Resolved;
use crate::message::Headers;
use crate::store::rows::{DeadLetter, StoredRow};
use crate::store::{Completion, Lease, Wakeup};

#[derive(Debug)]
pub(super) struct State {
    /// The virtual clock, always at whole microseconds.
    pub(super) now: DateTime<Utc>,
    pub(super) dead_letter: bool,
    /// The last id handed out by the queue table's identity (0 = none yet).
    pub(super) last_id: i64,
    /// The same for the dead-letter table.
    pub(super) last_dlq_id: i64,
    /// Live rows by id.
    pub(super) rows: BTreeMap<i64, StoredRow>,
    /// The dead-letter table, in insertion (= id) order.
    pub(super) dlq: Vec<DeadLetter>,
    /// Workers listening for wake-up hints ([`Store::wakeups`]).
    pub(super) listeners: Vec<tokio::sync::mpsc::Sender<Wakeup>>,
    /// Paused queues and when they were paused (the `<table>_paused` table).
    pub(super) paused: BTreeMap<String, DateTime<Utc>>,
}

impl Default for State {
    fn default() -> Self {
        let now = Utc::now();
        // Whole seconds: printed times stay readable, and sub-second noise from the wall
        // clock does not leak into tests.
        let now = DateTime::from_timestamp(now.timestamp(), 0).unwrap_or(now);
        State::at(now)
    }
}

impl State {
    pub(super) fn at(now: DateTime<Utc>) -> Self {
        State {
            now: to_postgres_precision(now),
            dead_letter: false,
            last_id: 0,
            last_dlq_id: 0,
            rows: BTreeMap::new(),
            dlq: Vec::new(),
            listeners: Vec::new(),
            paused: BTreeMap::new(),
        }
    }
}

/// Postgres' epoch: `timestamptz` values travel as microseconds since it.
fn postgres_epoch() -> NaiveDateTime {
    NaiveDate::from_ymd_opt(2000, 1, 1)
        .and_then(|d| d.and_hms_opt(0, 0, 0))
        .unwrap_or_default()
}

/// The instant Postgres stores for `t`: sqlx sends whole microseconds since 2000-01-01,
/// truncated towards that epoch (chrono's `num_microseconds`).
pub(super) fn to_postgres_precision(t: DateTime<Utc>) -> DateTime<Utc> {
    let epoch = postgres_epoch();
    match (t.naive_utc() - epoch).num_microseconds() {
        Some(us) => (epoch + TimeDelta::microseconds(us)).and_utc(),
        None => t,
    }
}

/// `t + us` microseconds, as Postgres' `timestamptz + interval`.
pub(super) fn plus(t: DateTime<Utc>, us: i64, field: &'static str) -> Result<DateTime<Utc>> {
    t.checked_add_signed(TimeDelta::microseconds(us))
        .ok_or_else(|| Error::invalid(field, "the resulting time is out of range"))
}

pub(super) fn row_order(r: &StoredRow) -> (DateTime<Utc>, i64) {
    (r.next_attempt_at, r.id)
}

impl State {
    /// What a publish's `pg_notify` tells listeners: the queue and the deadline at
    /// millisecond precision. Hints are best effort, as NOTIFY is: a full or closed channel
    /// drops them.
    pub(super) fn notify(&mut self, queue: &str, at: DateTime<Utc>) {
        let at = DateTime::from_timestamp_millis(at.timestamp_millis()).unwrap_or(at);
        self.listeners.retain(|tx| {
            let hint = Wakeup::Published {
                queue: queue.to_owned(),
                at,
            };
            !matches!(
                tx.try_send(hint),
                Err(tokio::sync::mpsc::error::TrySendError::Closed(_))
            )
        });
    }

    /// A completion that made the row due again (a rearm applied, a retry scheduled) is
    /// announced like a publish, as the Postgres statements do.
    pub(super) fn announce(&mut self, id: i64, done: Completion) {
        if let Completion::Rearmed { at } | Completion::RetryScheduled { at } = done {
            if let Some(queue) = self.rows.get(&id).map(|r| r.queue.clone()) {
                self.notify(&queue, at);
            }
        }
    }

    pub(super) fn next_id(&mut self) -> i64 {
        self.last_id += 1;
        self.last_id
    }

    pub(super) fn deadline(&self, schedule: Resolved) -> Result<DateTime<Utc>> {
        match schedule {
            Resolved::In(us) => plus(self.now, us, "schedule"),
            Resolved::At(at) => Ok(to_postgres_precision(at)),
        }
    }

    pub(super) fn timer_row(&self, queue: &str, timer_id: &str) -> Option<i64> {
        self.rows
            .values()
            .find(|r| r.queue == queue && r.timer_id.as_deref() == Some(timer_id))
            .map(|r| r.id)
    }

    /// Inserts the row an insert statement writes: pending at `at`, created at the clock, no
    /// retry history, lease, rearm or cancel mark.
    pub(super) fn insert(
        &mut self,
        id: i64,
        queue: String,
        payload: Vec<u8>,
        headers: Option<Headers>,
        timer_id: Option<String>,
        at: DateTime<Utc>,
    ) {
        let row = StoredRow {
            id,
            queue,
            payload,
            headers,
            attempts_count: 0,
            deliveries_count: 0,
            created_at: self.now,
            next_attempt_at: at,
            first_attempt_at: None,
            last_attempt_at: None,
            acquired_at: None,
            acquired_token: None,
            timer_id,
            rearm_at: None,
            rearm_payload: None,
            rearm_headers: None,
            cancelled_at: None,
            raw_headers: None,
            raw_rearm_headers: None,
        };
        self.rows.insert(id, row);
    }

    /// The row `lease` fences, if its token still matches (`WHERE id = $1 AND
    /// acquired_token = $2`).
    pub(super) fn leased(&mut self, lease: Lease) -> Option<&mut StoredRow> {
        self.rows
            .get_mut(&lease.id)
            .filter(|r| r.acquired_token == Some(lease.token))
    }
}

/// `cancelled_at IS NOT NULL AND rearm_at IS NULL`: a cancel reached the running row and no
/// extend re-armed it since. Such a row ends deleted however its run ends.
pub(super) fn cancelled(row: &StoredRow) -> bool {
    row.cancelled_at.is_some() && row.rearm_at.is_none()
}

pub(super) fn clear_rearm(row: &mut StoredRow) {
    row.rearm_at = None;
    row.rearm_payload = None;
    row.rearm_headers = None;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn precision_matches_sqlx() {
        let t = DateTime::parse_from_rfc3339("2030-01-01T00:00:00.123456789Z")
            .unwrap()
            .with_timezone(&Utc);
        assert_eq!(
            to_postgres_precision(t),
            DateTime::parse_from_rfc3339("2030-01-01T00:00:00.123456Z").unwrap()
        );
        // Before 2000 sqlx truncates towards its epoch, i.e. upwards.
        let t = DateTime::parse_from_rfc3339("1999-12-31T23:59:59.000000500Z")
            .unwrap()
            .with_timezone(&Utc);
        assert_eq!(
            to_postgres_precision(t),
            DateTime::parse_from_rfc3339("1999-12-31T23:59:59.000001Z").unwrap()
        );
    }
}
