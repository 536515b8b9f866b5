//! Samples of each queue's figures, taken when the queues page is read (at most one every
//! [`MIN_INTERVAL`]), kept for [`WINDOW`]: the sparklines, the lateness percentiles and the
//! throughput are computed from them. Nothing is stored in the database.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use chrono::{DateTime, Utc};

/// Samples closer together than this are not kept.
pub(crate) const MIN_INTERVAL: Duration = Duration::from_secs(2);
/// How far back the samples go.
pub(crate) const WINDOW: Duration = Duration::from_secs(10 * 60);

/// One queue's figures at one instant (database clock).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sample {
    pub at: DateTime<Utc>,
    /// Pending plus leased rows (estimated or exact).
    pub live: Option<u64>,
    /// The oldest due row's lateness, in seconds (0 when nothing is due).
    pub lateness: f64,
}

/// The table-wide counter of finished rows (`pg_stat_user_tables.n_tup_del` of the queue
/// table: acks, cancels and deletes) at one instant.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Finished {
    pub at: DateTime<Utc>,
    pub deleted: i64,
}

#[derive(Debug, Default)]
pub(crate) struct History {
    queues: BTreeMap<String, VecDeque<Sample>>,
    finished: VecDeque<Finished>,
}

impl History {
    /// Records the samples of one read of the queues page; a read sooner than
    /// [`MIN_INTERVAL`] after the last kept one is dropped. Old samples go.
    pub(crate) fn record(&mut self, at: DateTime<Utc>, queues: &[(String, Sample)], finished: i64) {
        let window = chrono::Duration::from_std(WINDOW).unwrap_or(chrono::Duration::MAX);
        let min = chrono::Duration::from_std(MIN_INTERVAL).unwrap_or(chrono::Duration::MAX);
        if let Some(last) = self.finished.back() {
            if at - last.at < min {
                return;
            }
        }
        self.finished.push_back(Finished {
            at,
            deleted: finished,
        });
        while self.finished.front().is_some_and(|f| at - f.at > window) {
            self.finished.pop_front();
        }
        for (queue, sample) in queues {
            self.queues
                .entry(queue.clone())
                .or_default()
                .push_back(*sample);
        }
        for samples in self.queues.values_mut() {
            while samples.front().is_some_and(|s| at - s.at > window) {
                samples.pop_front();
            }
        }
        self.queues.retain(|_, s| !s.is_empty());
    }

    /// The samples of `queue`, oldest first.
    pub(crate) fn of(&self, queue: &str) -> Vec<Sample> {
        self.queues
            .get(queue)
            .map(|s| s.iter().copied().collect())
            .unwrap_or_default()
    }

    /// Rows finished per second over the samples kept (table-wide), when there are two.
    pub(crate) fn throughput(&self) -> Option<f64> {
        let (first, last) = (self.finished.front()?, self.finished.back()?);
        let secs = (last.at - first.at).num_milliseconds() as f64 / 1000.0;
        // A statistics reset makes the counter go back: no figure then.
        (secs > 0.0 && last.deleted >= first.deleted)
            .then(|| (last.deleted - first.deleted) as f64 / secs)
    }
}

/// The `p`-th percentile (0 to 1, nearest rank) of `values`, `None` when empty.
pub(crate) fn percentile(values: &[f64], p: f64) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = (p * v.len() as f64).ceil() as usize;
    Some(v[rank.clamp(1, v.len()) - 1])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + secs, 0).unwrap()
    }

    fn sample(secs: i64, lateness: f64) -> Sample {
        Sample {
            at: at(secs),
            live: Some(1),
            lateness,
        }
    }

    #[test]
    fn keeps_a_window_and_drops_samples_too_close() {
        let mut h = History::default();
        h.record(at(0), &[("a".into(), sample(0, 1.0))], 100);
        h.record(at(1), &[("a".into(), sample(1, 2.0))], 150);
        assert_eq!(h.of("a").len(), 1, "a sample 1 s after the last is dropped");
        h.record(at(10), &[("a".into(), sample(10, 3.0))], 200);
        assert_eq!(h.of("a").len(), 2);
        assert_eq!(h.throughput(), Some(10.0));
        h.record(at(700), &[("b".into(), sample(700, 0.0))], 300);
        assert!(h.of("a").is_empty(), "samples older than the window go");
        assert_eq!(h.of("b").len(), 1);
        assert_eq!(h.throughput(), None, "one counter sample left");
    }

    #[test]
    fn percentiles_by_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.5), Some(50.0));
        assert_eq!(percentile(&v, 0.99), Some(99.0));
        assert_eq!(percentile(&[7.0], 0.99), Some(7.0));
        assert_eq!(percentile(&[], 0.5), None);
    }
}
