//! When a message becomes due: [`Schedule`], its rules, and what a valid one binds.

use std::time::{Duration, SystemTime};

use chrono::{DateTime, Datelike, TimeDelta, Utc};
use sqlx::postgres::types::PgInterval;

use crate::error::{Error, Result};
use crate::sql::binds::interval;

/// Longest delay accepted by [`Schedule`]: 10 000 years of 366 days. Anything longer is an overflow in
/// practice and would push the deadline towards the end of Postgres' timestamp range.
pub const MAX_DELAY: Duration = Duration::from_secs(10_000 * 366 * 24 * 3600);

/// When a message becomes visible to workers: its deadline (`next_attempt_at`).
///
/// Build one from a [`std::time::Duration`] or [`chrono::TimeDelta`] (relative to the
/// **database** clock: the deadline is computed server-side as `now() + interval`, so clock
/// skew between application and database cannot shift it), from a
/// `chrono::DateTime<Utc>` or [`SystemTime`] (absolute), or use [`Schedule::now`].
///
/// Negative or overflowing delays (more than [`MAX_DELAY`]) and absolute times outside
/// Postgres' range (4713 BC to 294276 AD; a [`SystemTime`] past chrono's last year, 262 142,
/// too) are rejected with [`Error::InvalidArgument`] (`field = "schedule"`) before any SQL
/// runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Schedule(pub(crate) ScheduleKind);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum ScheduleKind {
    #[default]
    Now,
    /// Microseconds after the database's `now()`; may be negative until validated.
    In(i128),
    At(DateTime<Utc>),
    /// A [`SystemTime`] that `DateTime<Utc>` cannot hold: later than chrono's last year
    /// (`true`) or earlier than its first; rejected by `resolve`.
    Unrepresentable {
        later: bool,
    },
}

impl Schedule {
    /// Due immediately (the default).
    pub fn now() -> Self {
        Schedule(ScheduleKind::Now)
    }

    /// Due `delay` after the database's `now()`.
    pub fn after(delay: Duration) -> Self {
        Schedule(ScheduleKind::In(delay.as_micros() as i128))
    }

    /// Due at an absolute UTC instant.
    pub fn at(at: DateTime<Utc>) -> Self {
        Schedule(ScheduleKind::At(at))
    }

    /// Checks the rules above and returns what the SQL binds: `(interval, absolute)`.
    pub(crate) fn resolve(self) -> Result<Resolved> {
        match self.0 {
            ScheduleKind::Now => Ok(Resolved::In(0)),
            ScheduleKind::In(us) => {
                if us < 0 {
                    return Err(Error::invalid("schedule", "the delay is negative"));
                }
                if us > MAX_DELAY.as_micros() as i128 {
                    return Err(Error::invalid(
                        "schedule",
                        "the delay is longer than 10 000 years of 366 days (overflow)",
                    ));
                }
                Ok(Resolved::In(us as i64))
            }
            ScheduleKind::At(at) => {
                // Postgres' timestamptz spans 4713 BC to 294276 AD; chrono's range is wider
                // at the bottom only.
                if at.year() < -4712 {
                    return Err(Error::invalid(
                        "schedule",
                        "the time is before postgres' earliest timestamp (4713 BC)",
                    ));
                }
                Ok(Resolved::At(at))
            }
            ScheduleKind::Unrepresentable { later } => Err(Error::invalid(
                "schedule",
                if later {
                    "the time is after the last instant a chrono DateTime holds (year 262 142)"
                } else {
                    "the time is before postgres' earliest timestamp (4713 BC)"
                },
            )),
        }
    }
}

/// A validated schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Resolved {
    /// Microseconds after now, non-negative.
    In(i64),
    At(DateTime<Utc>),
}

impl Resolved {
    pub(crate) fn binds(self) -> (PgInterval, Option<DateTime<Utc>>) {
        match self {
            Resolved::In(us) => (interval(us), None),
            Resolved::At(at) => (interval(0), Some(at)),
        }
    }
}

impl From<Duration> for Schedule {
    fn from(d: Duration) -> Self {
        Schedule::after(d)
    }
}

impl From<TimeDelta> for Schedule {
    fn from(d: TimeDelta) -> Self {
        // `num_microseconds` is None only beyond ±292 000 years: keep the sign, so a huge
        // negative delay is reported as negative and a huge positive one as an overflow.
        let overflow = if d < TimeDelta::zero() {
            i128::MIN
        } else {
            i128::MAX
        };
        Schedule(ScheduleKind::In(
            d.num_microseconds().map_or(overflow, i128::from),
        ))
    }
}

impl From<DateTime<Utc>> for Schedule {
    fn from(at: DateTime<Utc>) -> Self {
        Schedule::at(at)
    }
}

impl From<SystemTime> for Schedule {
    fn from(at: SystemTime) -> Self {
        // chrono's own conversion panics beyond its range: convert by hand and let
        // `resolve` refuse what does not fit.
        let at_utc = match at.duration_since(SystemTime::UNIX_EPOCH) {
            Ok(after) => i64::try_from(after.as_secs())
                .ok()
                .and_then(|s| DateTime::from_timestamp(s, after.subsec_nanos())),
            Err(e) => {
                let before = e.duration();
                i64::try_from(before.as_secs()).ok().and_then(|s| {
                    // `before` = s seconds and n nanoseconds ahead of the instant: step back
                    // one more second and forward by the rest.
                    match before.subsec_nanos() {
                        0 => DateTime::from_timestamp(-s, 0),
                        n => DateTime::from_timestamp(-s - 1, 1_000_000_000 - n),
                    }
                })
            }
        };
        match at_utc {
            Some(at) => Schedule::at(at),
            None => Schedule(ScheduleKind::Unrepresentable {
                later: at > SystemTime::UNIX_EPOCH,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(s: Schedule) -> String {
        match s.resolve() {
            Err(Error::InvalidArgument { field, reason }) => {
                assert_eq!(field, "schedule");
                reason
            }
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    /// Found by a fresh user: a `SystemTime` in the year ~272 000 (inside Postgres' range,
    /// past chrono's) panicked in chrono's conversion while the message was built.
    #[test]
    fn a_system_time_past_chronos_range_is_refused_not_a_panic() {
        let far = SystemTime::UNIX_EPOCH + Duration::from_secs(270_000 * 365 * 86_400);
        assert!(refused(Schedule::from(far)).contains("262 142"));
        let long_ago = SystemTime::UNIX_EPOCH - Duration::from_secs(300_000 * 365 * 86_400);
        assert!(refused(Schedule::from(long_ago)).contains("4713 BC"));
    }

    #[test]
    fn a_system_time_converts_to_the_same_instant() {
        for t in [
            SystemTime::UNIX_EPOCH,
            SystemTime::UNIX_EPOCH + Duration::new(1_700_000_000, 123_456_789),
            SystemTime::UNIX_EPOCH - Duration::new(1, 500_000_000),
            SystemTime::UNIX_EPOCH - Duration::from_secs(86_400),
        ] {
            let want: DateTime<Utc> = t.into();
            assert_eq!(Schedule::from(t), Schedule::at(want), "{t:?}");
        }
    }
}
