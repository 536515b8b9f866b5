//! The worker's knobs: their defaults and allowed ranges. A value out of range is rejected
//! when the worker is built, with an error naming the knob.

use std::time::Duration;

use crate::error::{Error, Result};
use crate::stats::StatsMode;

/// The default cap on successful completions written by one statement (`ack_batch_size`).
///
/// A finished handler hands its success to the worker's completer and takes the next row at
/// once; the completer writes everything that is ready in one fenced `DELETE` as soon as its
/// previous write returned — no linger timer, so a lone success is written at once and a
/// burst shares one commit. 100 keeps one statement's row list and WAL short while a burst
/// behind a slow commit still fits in one or two statements.
pub const DEFAULT_ACK_BATCH_SIZE: usize = 100;

/// The shortest interval of the queue-depth gauge: exact statistics read every row of the
/// queue table, so the gauge reads them at most every 15 s.
pub const MIN_QUEUE_DEPTH_INTERVAL: Duration = Duration::from_secs(15);

/// The opt-in queue-depth gauge: how often, and exact or estimated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct QueueDepth {
    pub(crate) every: Duration,
    pub(crate) mode: StatsMode,
}

/// Worker knobs; defaults: `concurrency` 1, `fetch_batch_size` 10, `lease_ttl` 60 s,
/// `idle_poll` 30 s, `ack_batch_size` [`DEFAULT_ACK_BATCH_SIZE`], `graceful_timeout` 15 s,
/// no queue-depth gauge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Config {
    pub(crate) concurrency: usize,
    pub(crate) fetch_batch_size: usize,
    pub(crate) lease_ttl: Duration,
    pub(crate) idle_poll: Duration,
    pub(crate) ack_batch_size: usize,
    pub(crate) graceful_timeout: Duration,
    /// LISTEN for the wake-up notifications publishes send (off: poll-only).
    pub(crate) listen: bool,
    /// The queue-depth gauge, when on.
    pub(crate) queue_depth: Option<QueueDepth>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            concurrency: 1,
            fetch_batch_size: 10,
            lease_ttl: Duration::from_secs(60),
            idle_poll: Duration::from_secs(30),
            ack_batch_size: DEFAULT_ACK_BATCH_SIZE,
            graceful_timeout: Duration::from_secs(15),
            listen: true,
            queue_depth: None,
        }
    }
}

fn check_range<T: PartialOrd + std::fmt::Debug>(
    knob: &'static str,
    v: T,
    min: T,
    max: T,
    unit: &str,
) -> Result<()> {
    if v < min || v > max {
        return Err(Error::config(
            knob,
            format!("must be within {min:?}..={max:?}{unit}, got {v:?}"),
        ));
    }
    Ok(())
}

impl Config {
    /// The connections a worker needs from its store's pool at once, so that it never waits
    /// forever on its own pool: one completion per handler slot, the completer, the renewal,
    /// and the queue-depth gauge's read when it is on (only one worker of a process reads,
    /// but any of them may take over, so each counts it). The claim loop and the lease
    /// release at shutdown take turns with them; LISTEN is outside the pool.
    pub(crate) fn connections_needed(&self) -> u32 {
        self.connections_with_slots(self.concurrency)
    }

    /// As [`Config::connections_needed`], counting `slots` handler slots: a worker whose
    /// handlers are all relays counts one, since a relay's run holds no connection (no
    /// transaction of its own) and its slot's completion takes one only for its statement.
    pub(crate) fn connections_with_slots(&self, slots: usize) -> u32 {
        u32::try_from(slots)
            .unwrap_or(u32::MAX)
            .saturating_add(2)
            .saturating_add(u32::from(self.queue_depth.is_some()))
    }

    pub(crate) fn validate(&self) -> Result<()> {
        check_range("concurrency", self.concurrency, 1, 10_000, "")?;
        check_range("fetch_batch_size", self.fetch_batch_size, 1, 10_000, "")?;
        check_range("ack_batch_size", self.ack_batch_size, 1, 10_000, "")?;
        check_range(
            "lease_ttl",
            self.lease_ttl,
            Duration::from_millis(100),
            Duration::from_secs(7 * 24 * 3600),
            "",
        )?;
        check_range(
            "idle_poll",
            self.idle_poll,
            Duration::from_millis(10),
            Duration::from_secs(24 * 3600),
            "",
        )?;
        check_range(
            "graceful_timeout",
            self.graceful_timeout,
            Duration::ZERO,
            Duration::from_secs(3600),
            "",
        )?;
        if let Some(g) = self.queue_depth {
            check_range(
                "queue_depth_gauge",
                g.every,
                MIN_QUEUE_DEPTH_INTERVAL,
                Duration::from_secs(24 * 3600),
                " (the statistics are read once per process per interval)",
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn knob_ranges_name_the_knob() {
        let bad = [
            Config {
                concurrency: 0,
                ..Config::default()
            },
            Config {
                fetch_batch_size: 0,
                ..Config::default()
            },
            Config {
                ack_batch_size: 10_001,
                ..Config::default()
            },
            Config {
                lease_ttl: Duration::from_millis(1),
                ..Config::default()
            },
            Config {
                idle_poll: Duration::ZERO,
                ..Config::default()
            },
            Config {
                graceful_timeout: Duration::from_secs(7200),
                ..Config::default()
            },
            Config {
                queue_depth: Some(QueueDepth {
                    every: Duration::from_secs(14),
                    mode: StatsMode::Exact,
                }),
                ..Config::default()
            },
        ];
        let knobs = [
            "concurrency",
            "fetch_batch_size",
            "ack_batch_size",
            "lease_ttl",
            "idle_poll",
            "graceful_timeout",
            "queue_depth_gauge",
        ];
        for (c, knob) in bad.iter().zip(knobs) {
            let e = c.validate().unwrap_err();
            assert!(
                matches!(e, Error::InvalidConfig { knob: k, .. } if k == knob),
                "{e}"
            );
        }
        assert!(Config::default().validate().is_ok());
        let gauge = Config {
            queue_depth: Some(QueueDepth {
                every: MIN_QUEUE_DEPTH_INTERVAL,
                mode: StatsMode::Estimate,
            }),
            ..Config::default()
        };
        assert!(gauge.validate().is_ok());
        assert_eq!(
            gauge.connections_needed(),
            Config::default().connections_needed() + 1
        );
    }
}
