//! Recurrences of periodic timers: when the next run of a schedule is due.
//!
//! A [`Recurrence`] is either a **fixed interval** ([`Recurrence::every`],
//! [`Recurrence::parse_every`]; always available) or a **cron expression in a time zone**
//! (`Recurrence::cron`; cargo feature `cron`). Its arithmetic is pure: every function
//! takes the current time as a parameter and reads no clock, so the worker passes the
//! **database** clock (the claim's `now()`), and tests pass any instant they like.
//!
//! # Constructors
//!
//! - [`Recurrence::every`]`(Duration)`: a fixed step of real (UTC) time, above zero, at most
//!   [`MAX_DELAY`] (10 000 years of 366 days), in whole microseconds (the resolution of a
//!   Postgres `timestamptz`). Anything else is [`Error::InvalidArgument`] with
//!   `field = "every"`.
//! - [`Recurrence::parse_every`]`(&str)`: the same from a human duration as the `humantime`
//!   crate reads it: `"30s"`, `"5m"`, `"1h"`, `"1h 30m"`, `"500ms"`, `"2days"`. A string
//!   it cannot read, or one in months or years (`"1M"`, `"1yr"`, `"1year"`: humantime's fixed
//!   averages, not calendar units), is [`Error::InvalidArgument`] with `field = "every"`.
//! - `Recurrence::cron(expr, tz)` (feature `cron`): a cron expression of **5 fields**
//!   (`minute hour day-of-month month day-of-week`, second 0) or **6 fields** (a leading
//!   `second`), as the `croner` crate reads it (ranges, lists, steps, `L`, `W`, `#`, month
//!   and weekday names, nicknames such as `@daily`; day of month and day of week match when
//!   either does, as in Vixie cron; no year field), at most [`MAX_CRON_BYTES`] bytes, that
//!   matches at least one instant; and an IANA time-zone name (`"Europe/Berlin"`, `"UTC"`),
//!   from the `chrono-tz` database, case-sensitive. A bad expression is
//!   [`Error::InvalidArgument`] with `field = "cron"`, an unknown zone with `field = "tz"`.
//!
//! # Which instants fire
//!
//! [`Recurrence::next_after`]`(now)` is the first instant **strictly after** `now`: `now`
//! itself never counts, even when it lies exactly on an instant. For a cron expression that
//! is the first matching wall-clock time after `now` in the zone (instants are whole
//! seconds). For an interval, which has no wall-clock anchor, it is `now + interval`.
//!
//! [`Recurrence::next_instant`]`(deadline, now)` is the rule a periodic run applies when it
//! starts, with `deadline` the run's own deadline and `now` the database clock:
//!
//! - the next instant after `deadline` (for an interval: `deadline + interval`, so the
//!   schedule keeps its grid however late each run starts);
//! - **missed instants**: if that instant is already `<= now` (workers were down, the queue
//!   was paused), the **latest** instant `<= now` is returned instead, so everything missed
//!   fires **once**, right away, and the schedule continues from there (for an interval,
//!   on the same grid: `deadline + k × interval` for the largest such `k` with the
//!   instant `<= now`).
//!
//! Both return `None` only when no instant exists in the range of `chrono` (or, for cron,
//! before the year 5000).
//!
//! # Daylight saving time
//!
//! An interval is a step of real time: across a DST change it keeps its length in UTC (a
//! `"1h"` schedule fires every 3600 s, so its wall-clock times shift by an hour). A cron
//! expression follows the zone's wall clock, as croner resolves it. croner counts a job as
//! **fixed-time** when its second, minute and hour fields are each a single value
//! (`0 30 2 * * *`, `0 6 * * *`); a wildcard, step, range or **list** in any of them
//! (`0 * * * *`, `*/15 * * * *`, `0 0 2,14 * * *`) makes it an interval/wildcard job. The
//! module's tests prove these cases in `Europe/Berlin`, 2026:
//!
//! - **A wall time that does not exist** (29 March, 02:00–03:00 is skipped): a job with
//!   fixed second, minute and hour (`0 30 2 * * *`) fires **once** on that day, at the first
//!   time after the gap, 03:00 CEST (01:00 UTC); interval and wildcard jobs (`0 * * * *`,
//!   `*/15 * * * *`) have no instants inside the gap and continue with the next one after it
//!   (03:00, 03:15, … CEST), and `0 0 2,14 * * *` fires only at 14:00 that day.
//! - **A wall time that occurs twice** (25 October, 02:00–03:00 is repeated): a fixed-time
//!   job fires **once**, at the first occurrence, 02:30 CEST (00:30 UTC); interval and
//!   wildcard jobs fire at **both** passes (hourly: 02:00 CEST and 02:00 CET, one hour
//!   apart; every 15 minutes: eight instants in the two hours of 02:xx wall time;
//!   `0 0 2,14 * * *`: 02:00 twice, then 14:00).
//!
//! # Fingerprints
//!
//! [`Recurrence::fingerprint`] is a text naming the schedule, stored with a registered
//! periodic timer: `every:<seconds>s` (or `every:<µs>us` for an interval that is not whole
//! seconds), `cron:<expression>@<zone>` with the expression's fields separated by single
//! spaces. Registration compares it to notice a changed schedule, and a run reads it back
//! ([`Recurrence::from_fingerprint`]) to compute its next instant, so the recurrence stored
//! with the row, not the running worker's code, decides when the schedule fires next. The
//! format is **stable across versions**: a new release never changes the fingerprint of an
//! unchanged schedule, and reads every fingerprint an earlier one wrote.
//!
//! [`MAX_DELAY`]: crate::message::MAX_DELAY
//! [`Error::InvalidArgument`]: crate::error::Error::InvalidArgument

use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};

use crate::error::{Error, Result};
use crate::message::MAX_DELAY;

/// The name of the schedule declared on a payload type (`#[timer(every = …)]` or
/// `#[timer(cron = …, tz = …)]`, [`Timer::declared_schedule`](crate::Timer::declared_schedule)):
/// its keyed timer is `schedule:default` in the type's queue. A schedule registered with
/// `WorkerBuilder::schedule` under the same name for the same type is refused by `build`.
pub const DECLARED_SCHEDULE_NAME: &str = "default";

/// Longest cron expression accepted by `Recurrence::cron`, in bytes (its fingerprint is
/// kept in the row's headers, so it stays small).
pub const MAX_CRON_BYTES: usize = 256;

/// A schedule's recurrence: a fixed interval or a cron expression in a time zone. See the
/// [module docs](self) for the accepted input and which instants fire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recurrence(Kind);

#[derive(Debug, Clone, PartialEq, Eq)]
enum Kind {
    /// A step of real time, in whole microseconds (above zero, at most `MAX_DELAY`).
    Every(Duration),
    #[cfg(feature = "cron")]
    Cron {
        /// The fields as given, joined by single spaces (for the fingerprint).
        expr: String,
        /// Boxed: a parsed pattern is several hundred bytes, an interval sixteen.
        cron: Box<croner::Cron>,
        tz: chrono_tz::Tz,
    },
}

impl Recurrence {
    /// A fixed interval of real time: above zero, at most 10 000 years of 366 days
    /// ([`message::MAX_DELAY`](crate::message::MAX_DELAY)), in whole microseconds. Otherwise
    /// [`Error::InvalidArgument`] (`field = "every"`).
    pub fn every(interval: Duration) -> Result<Self> {
        if interval.is_zero() {
            return Err(Error::invalid(
                "every",
                "must be above zero: the schedule would never advance",
            ));
        }
        if interval > MAX_DELAY {
            return Err(Error::invalid(
                "every",
                "is longer than 10 000 years of 366 days (overflow)",
            ));
        }
        if !interval.subsec_nanos().is_multiple_of(1_000) {
            return Err(Error::invalid(
                "every",
                "must be a whole number of microseconds (the resolution of a Postgres timestamp)",
            ));
        }
        Ok(Recurrence(Kind::Every(interval)))
    }

    /// A fixed interval from a human duration (`"30s"`, `"5m"`, `"1h"`, `"1h 30m"`), as the
    /// `humantime` crate reads it, then checked as [`Recurrence::every`] does. A string it
    /// cannot read is [`Error::InvalidArgument`] (`field = "every"`).
    ///
    /// Months and years (`"1M"`, `"1month"`, `"1y"`, `"1year"`) are refused: humantime reads
    /// them as fixed averages (30.44 and 365.25 days), not calendar months, and `"1M"` (a
    /// month) is one letter away from `"1m"` (a minute). Use a cron expression for "on the
    /// first of each month", or days (`"30days"`) for a fixed step.
    pub fn parse_every(text: &str) -> Result<Self> {
        Self::every(parse_interval("every", text)?)
    }

    /// The recurrence a [`fingerprint`](Self::fingerprint) names: the inverse of
    /// `fingerprint`, so `Recurrence::from_fingerprint(&r.fingerprint()) == Ok(r)`. A
    /// registered schedule's row carries its fingerprint, and a run's next instant comes from
    /// it, so any worker that handles the queue keeps the stored schedule going.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] (`field = "fingerprint"`) for a text that is not a
    /// fingerprint, or names a cron expression without the `cron` feature; the checks of
    /// [`every`](Self::every) and `cron` for the recurrence it names.
    pub fn from_fingerprint(text: &str) -> Result<Self> {
        let unknown = || {
            Error::invalid(
                "fingerprint",
                format!("{text:?} is not a schedule's fingerprint (`every:<n>s`, `every:<n>us` or `cron:<expression>@<zone>`)"),
            )
        };
        if let Some(every) = text.strip_prefix("every:") {
            let (digits, unit): (&str, fn(u64) -> Duration) =
                if let Some(us) = every.strip_suffix("us") {
                    (us, Duration::from_micros)
                } else if let Some(s) = every.strip_suffix('s') {
                    (s, Duration::from_secs)
                } else {
                    return Err(unknown());
                };
            if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
                return Err(unknown());
            }
            let n: u64 = digits.parse().map_err(|_| unknown())?;
            return Self::every(unit(n));
        }
        if let Some(cron) = text.strip_prefix("cron:") {
            // A zone name holds no `@`; an expression may (`@daily`).
            let (expr, zone) = cron.rsplit_once('@').ok_or_else(unknown)?;
            return Self::cron_from_fingerprint(text, expr, zone);
        }
        Err(unknown())
    }

    #[cfg(feature = "cron")]
    fn cron_from_fingerprint(_text: &str, expr: &str, zone: &str) -> Result<Self> {
        Self::cron(expr, zone)
    }

    #[cfg(not(feature = "cron"))]
    fn cron_from_fingerprint(text: &str, _expr: &str, _zone: &str) -> Result<Self> {
        Err(Error::invalid(
            "fingerprint",
            format!("{text:?} is a cron schedule, and this build of outbox has no `cron` feature"),
        ))
    }

    /// A cron expression evaluated in an IANA time zone (feature `cron`).
    ///
    /// `expr` has 5 fields (`minute hour day-of-month month day-of-week`; second 0) or 6
    /// (a leading `second`), as the `croner` crate reads them, at most [`MAX_CRON_BYTES`]
    /// bytes, and must match at least one instant (`0 0 30 2 *`, the 30th of February, is
    /// rejected). `tz` is an IANA name such as `"Europe/Berlin"` or `"UTC"`
    /// (case-sensitive). A bad expression is [`Error::InvalidArgument`] with
    /// `field = "cron"`, an unknown zone with `field = "tz"`.
    #[cfg(feature = "cron")]
    #[cfg_attr(docsrs, doc(cfg(feature = "cron")))]
    pub fn cron(expr: &str, tz: &str) -> Result<Self> {
        use croner::parser::{CronParser, Seconds, Year};

        if expr.len() > MAX_CRON_BYTES {
            return Err(Error::invalid(
                "cron",
                format!("is longer than {MAX_CRON_BYTES} bytes"),
            ));
        }
        let normalized = expr.split_whitespace().collect::<Vec<_>>().join(" ");
        let cron = CronParser::builder()
            .seconds(Seconds::Optional)
            .year(Year::Disallowed)
            .build()
            .parse(&normalized)
            .map_err(|e| {
                Error::invalid("cron", format!("{expr:?} is not a cron expression: {e}"))
            })?;
        let zone: chrono_tz::Tz = tz
            .parse()
            .map_err(|_| Error::invalid("tz", format!("{tz:?} is not an IANA time zone")))?;
        // Without a year field every expression that matches once matches again within 28
        // years or so; one that never matches (the 30th of February) would make every later
        // search run to croner's year limit, so it is refused here, once.
        let probe = DateTime::<Utc>::UNIX_EPOCH.with_timezone(&zone);
        if cron.find_next_occurrence(&probe, false).is_err() {
            return Err(Error::invalid(
                "cron",
                format!("{expr:?} matches no instant"),
            ));
        }
        Ok(Recurrence(Kind::Cron {
            expr: normalized,
            cron: Box::new(cron),
            tz: zone,
        }))
    }

    /// The first instant strictly after `now` (`now` itself never counts). For an interval
    /// that is `now + interval`; for a cron expression the first matching wall-clock time
    /// after `now` in its zone. `None` when there is none in range (see the module docs).
    pub fn next_after(&self, now: DateTime<Utc>) -> Option<DateTime<Utc>> {
        match &self.0 {
            Kind::Every(interval) => now.checked_add_signed(delta(*interval)?),
            #[cfg(feature = "cron")]
            Kind::Cron { cron, tz, .. } => {
                // Instants are whole seconds: the first one after the second `now` falls
                // in is the first one after `now`.
                let floor = floor_second(now)?.with_timezone(tz);
                let next = cron.find_next_occurrence(&floor, false).ok()?;
                Some(next.with_timezone(&Utc))
            }
        }
    }

    /// The instant a periodic run whose deadline was `deadline` queues when it starts at
    /// `now`: the next instant after `deadline`; if that is already `<= now` (missed
    /// instants), the latest instant `<= now`, so the missed ones fire once and the schedule
    /// continues from there. For an interval the instants are `deadline + k × interval`.
    /// `None` when there is none in range.
    pub fn next_instant(
        &self,
        deadline: DateTime<Utc>,
        now: DateTime<Utc>,
    ) -> Option<DateTime<Utc>> {
        match &self.0 {
            Kind::Every(interval) => {
                let step = interval.as_micros() as i64; // At most MAX_DELAY: fits.
                let behind = now.signed_duration_since(deadline).num_microseconds()?;
                // k >= 1 steps; more when deadline + step is already <= now.
                let steps = (behind / step).max(1);
                deadline.checked_add_signed(TimeDelta::microseconds(steps.checked_mul(step)?))
            }
            #[cfg(feature = "cron")]
            Kind::Cron { cron, tz, .. } => {
                let next = self.next_after(deadline)?;
                if next > now {
                    return Some(next);
                }
                let floor = floor_second(now)?.with_timezone(tz);
                // `next` is itself an instant <= now, so the latest one is never earlier; the
                // max keeps the result after `deadline` even if a backward search resolved a
                // DST fold differently from the forward one (the tests show it does not).
                let latest = cron.find_previous_occurrence(&floor, true).ok();
                Some(latest.map_or(next, |t| t.with_timezone(&Utc).max(next)))
            }
        }
    }

    /// A text naming the schedule, stable across versions: `every:300s` (`every:<µs>us` for
    /// an interval that is not whole seconds) or `cron:<expression>@<zone>` (the fields
    /// separated by single spaces, as given otherwise), e.g. `cron:0 0 6 * * *@Europe/Berlin`.
    pub fn fingerprint(&self) -> String {
        match &self.0 {
            Kind::Every(interval) if interval.subsec_nanos() == 0 => {
                format!("every:{}s", interval.as_secs())
            }
            Kind::Every(interval) => format!("every:{}us", interval.as_micros()),
            #[cfg(feature = "cron")]
            Kind::Cron { expr, tz, .. } => format!("cron:{expr}@{}", tz.name()),
        }
    }
}

/// The fixed units of time humantime knows, as it spells them (its `Unit::from_str`):
/// everything else, months and years among them, is refused.
const FIXED_UNITS: &[&str] = &[
    "nanos", "nsec", "ns", "usec", "us", "millis", "msec", "ms", "seconds", "second", "secs",
    "sec", "s", "minutes", "minute", "min", "mins", "m", "hours", "hour", "hr", "hrs", "h", "days",
    "day", "d", "weeks", "week", "wk", "wks", "w",
];

/// The calendar units humantime knows (fixed averages: a month of 30.44 days, a year of
/// 365.25), named in the error.
const CALENDAR_UNITS: &[&str] = &["M", "month", "months", "y", "yr", "yrs", "year", "years"];

/// The first unit `text` counts in that is not a fixed length of time, and why: a calendar
/// unit (months and years, which humantime reads as fixed averages) or one outside the
/// fixed units humantime knows (an allow-list, so a calendar spelling a later humantime
/// learns is refused too). `None` when every unit is a fixed one.
/// `recurrence`: the text is a periodic timer's step, which a cron expression can replace
/// (the advice says so only then).
fn unfixed_unit(text: &str, recurrence: bool) -> Option<(&str, &'static str)> {
    let unit = text
        .split(|c: char| !c.is_ascii_alphabetic())
        .find(|unit| !unit.is_empty() && !FIXED_UNITS.contains(unit))?;
    let why = if CALENDAR_UNITS.contains(&unit) && recurrence {
        "a calendar unit that humantime reads as a fixed average (a month is 30.44 days, a year \
         365.25): give days (\"30days\") for a fixed step, or a cron expression for calendar \
         dates"
    } else if CALENDAR_UNITS.contains(&unit) {
        "a calendar unit that humantime reads as a fixed average (a month is 30.44 days, a year \
         365.25): give days (\"30days\", \"365days\")"
    } else {
        "not a unit of time: use ns, us, ms, s, m (minutes), h, d or w, or their long names \
         (\"30s\", \"5m\", \"1h 30m\", \"2days\")"
    };
    Some((unit, why))
}

/// A human duration (`"500ms"`, `"30s"`, `"5m"`, `"1h 30m"`, `"7d"`) as the `humantime`
/// crate reads it, with the rule of [`Recurrence::parse_every`]: months and years (`"1M"`,
/// `"1y"`), which humantime reads as fixed averages and of which `"1M"` is one letter away
/// from `"1m"` (a minute), are refused, as is any word that is not a unit of time. The CLI
/// reads its durations with it.
///
/// # Errors
/// [`Error::InvalidArgument`] with `field` as given, saying what is wrong and how to write it.
pub fn parse_interval(field: &'static str, text: &str) -> Result<Duration> {
    if let Some((unit, why)) = unfixed_unit(text, field == "every") {
        return Err(Error::invalid(
            field,
            format!("{text:?} counts in {unit:?}, {why}"),
        ));
    }
    humantime::parse_duration(text.trim())
        .map_err(|e| Error::invalid(field, format!("{text:?} is not a duration: {e}")))
}

fn delta(interval: Duration) -> Option<TimeDelta> {
    TimeDelta::from_std(interval).ok()
}

#[cfg(feature = "cron")]
fn floor_second(t: DateTime<Utc>) -> Option<DateTime<Utc>> {
    DateTime::from_timestamp(t.timestamp(), 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn utc(y: i32, mo: u32, d: u32, h: u32, mi: u32, s: u32) -> DateTime<Utc> {
        Utc.with_ymd_and_hms(y, mo, d, h, mi, s).unwrap()
    }

    fn field(r: Result<Recurrence>) -> &'static str {
        match r {
            Err(Error::InvalidArgument { field, .. }) => field,
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    #[test]
    fn every_rejects_zero_overflow_and_sub_microsecond_intervals() {
        assert_eq!(field(Recurrence::every(Duration::ZERO)), "every");
        assert_eq!(
            field(Recurrence::every(MAX_DELAY + Duration::from_secs(1))),
            "every"
        );
        assert_eq!(
            field(Recurrence::every(Duration::from_nanos(1_500))),
            "every"
        );
        assert!(Recurrence::every(MAX_DELAY).is_ok());
        assert!(Recurrence::every(Duration::from_micros(1)).is_ok());
    }

    #[test]
    fn parse_every_reads_human_durations() {
        let cases = [
            ("30s", 30),
            ("5m", 300),
            ("1h", 3600),
            ("1h 30m", 5400),
            (" 2days ", 172_800),
        ];
        for (text, secs) in cases {
            assert_eq!(
                Recurrence::parse_every(text).unwrap(),
                Recurrence::every(Duration::from_secs(secs)).unwrap(),
                "{text}"
            );
        }
        for bad in ["", "5", "five minutes", "-5m", "0s", "5x"] {
            assert_eq!(field(Recurrence::parse_every(bad)), "every", "{bad:?}");
        }
    }

    #[test]
    fn parse_every_refuses_months_and_years() {
        for bad in [
            "1M",
            "2months",
            "1month",
            "1y",
            "1yr",
            "2yrs",
            "1 yr",
            "1year",
            "3years",
            "1d 1M",
            "1M1d",
            "1hour 1yr",
        ] {
            match Recurrence::parse_every(bad) {
                Err(Error::InvalidArgument { field, reason }) => {
                    assert_eq!(field, "every", "{bad:?}");
                    assert!(reason.contains("calendar unit"), "{bad:?}: {reason}");
                    assert!(reason.contains("cron expression"), "{bad:?}: {reason}");
                }
                other => panic!("{bad:?}: {other:?}"),
            }
        }
        // Units outside the fixed ones are refused by name (not left to humantime, so a
        // calendar spelling it may learn later is refused too).
        for bad in ["5x", "1mo", "1 fortnight", "five minutes"] {
            match Recurrence::parse_every(bad) {
                Err(Error::InvalidArgument { field, reason }) => {
                    assert_eq!(field, "every", "{bad:?}");
                    assert!(reason.contains("not a unit of time"), "{bad:?}: {reason}");
                }
                other => panic!("{bad:?}: {other:?}"),
            }
        }
        // Minutes (lower-case m), milliseconds and days are not calendar units.
        assert_eq!(
            Recurrence::parse_every("1m").unwrap(),
            Recurrence::every(Duration::from_secs(60)).unwrap()
        );
        assert!(Recurrence::parse_every("500ms").is_ok());
        assert!(Recurrence::parse_every("30days").is_ok());
        for fixed in [
            "2min",
            "3mins",
            "1wk",
            "2wks",
            "5µs",
            "7000nanos",
            "1hr 2secs",
        ] {
            assert!(Recurrence::parse_every(fixed).is_ok(), "{fixed:?}");
        }
    }

    #[test]
    fn fingerprints_name_their_recurrence() {
        for r in [
            Recurrence::parse_every("5m").unwrap(),
            Recurrence::every(Duration::from_millis(1500)).unwrap(),
            Recurrence::every(Duration::from_micros(1)).unwrap(),
            Recurrence::every(MAX_DELAY).unwrap(),
        ] {
            assert_eq!(Recurrence::from_fingerprint(&r.fingerprint()).unwrap(), r);
        }
        for bad in [
            "",
            "every:",
            "every:s",
            "every:5",
            "every:5m",
            "every:-5s",
            "every:+5s",
            "every: 5s",
            "every:99999999999999999999s",
            "cron:",
            "nightly",
        ] {
            assert!(
                matches!(
                    Recurrence::from_fingerprint(bad),
                    Err(Error::InvalidArgument { .. })
                ),
                "{bad:?}"
            );
        }
        // A fingerprint of a recurrence `every` refuses is refused as `every` would.
        assert_eq!(field(Recurrence::from_fingerprint("every:0s")), "every");
    }

    #[test]
    fn every_next_after_is_now_plus_interval_strictly_after() {
        let r = Recurrence::parse_every("5m").unwrap();
        let now = utc(2026, 1, 1, 12, 0, 0);
        assert_eq!(r.next_after(now), Some(utc(2026, 1, 1, 12, 5, 0)));
        let huge = Recurrence::every(MAX_DELAY).unwrap();
        assert_eq!(huge.next_after(DateTime::<Utc>::MAX_UTC), None);
    }

    #[test]
    fn every_next_instant_keeps_the_grid_and_fires_missed_instants_once() {
        let r = Recurrence::parse_every("5m").unwrap();
        let deadline = utc(2026, 1, 1, 12, 0, 0);
        // On time or a little late: deadline + interval, whatever `now` is.
        assert_eq!(
            r.next_instant(deadline, deadline),
            Some(utc(2026, 1, 1, 12, 5, 0))
        );
        assert_eq!(
            r.next_instant(deadline, utc(2026, 1, 1, 12, 4, 59)),
            Some(utc(2026, 1, 1, 12, 5, 0))
        );
        // Started early (run now): still the next grid point after the deadline.
        assert_eq!(
            r.next_instant(deadline, utc(2026, 1, 1, 11, 0, 0)),
            Some(utc(2026, 1, 1, 12, 5, 0))
        );
        // Exactly on the next instant: it is <= now, so it is the latest one and fires now.
        assert_eq!(
            r.next_instant(deadline, utc(2026, 1, 1, 12, 5, 0)),
            Some(utc(2026, 1, 1, 12, 5, 0))
        );
        // Three days behind: the latest grid point <= now, once.
        let now = utc(2026, 1, 4, 9, 17, 30);
        let next = r.next_instant(deadline, now).unwrap();
        assert_eq!(next, utc(2026, 1, 4, 9, 15, 0));
        // ...and from there the schedule continues on the grid.
        assert_eq!(r.next_instant(next, now), Some(utc(2026, 1, 4, 9, 20, 0)));
    }

    #[test]
    fn every_steps_real_time_across_dst_changes() {
        // Europe/Berlin, 2026: 29 March 01:00 UTC (02:00 CET -> 03:00 CEST), 25 October
        // 01:00 UTC (03:00 CEST -> 02:00 CET). An interval ignores both.
        let hourly = Recurrence::parse_every("1h").unwrap();
        for start in [utc(2026, 3, 29, 0, 30, 0), utc(2026, 10, 25, 0, 30, 0)] {
            let mut t = start;
            for _ in 0..3 {
                let next = hourly.next_instant(t, t).unwrap();
                assert_eq!(next - t, TimeDelta::hours(1));
                t = next;
            }
            assert_eq!(t, start + TimeDelta::hours(3));
        }
        let daily = Recurrence::parse_every("1day").unwrap();
        assert_eq!(
            daily.next_after(utc(2026, 3, 28, 12, 0, 0)),
            Some(utc(2026, 3, 29, 12, 0, 0))
        );
    }

    #[test]
    fn fingerprints_are_stable_text() {
        assert_eq!(
            Recurrence::parse_every("5m").unwrap().fingerprint(),
            "every:300s"
        );
        assert_eq!(
            Recurrence::every(Duration::from_millis(1500))
                .unwrap()
                .fingerprint(),
            "every:1500000us"
        );
    }

    #[cfg(feature = "cron")]
    mod cron {
        use super::*;

        const BERLIN: &str = "Europe/Berlin";

        /// Every instant of `r` in `(from, to]`, by repeated `next_after`.
        fn instants(r: &Recurrence, from: DateTime<Utc>, to: DateTime<Utc>) -> Vec<DateTime<Utc>> {
            let mut out = Vec::new();
            let mut t = from;
            while let Some(next) = r.next_after(t) {
                if next > to {
                    break;
                }
                assert!(next > t, "next_after({t}) = {next} is not strictly after");
                out.push(next);
                t = next;
            }
            out
        }

        #[test]
        fn bad_expressions_and_zones_are_invalid_arguments() {
            for bad in [
                "",
                "* * * *",
                "0 0 0 * * * 2026",
                "61 * * * *",
                "0 25 * * *",
                "not cron",
                "0 0 30 2 *",
            ] {
                assert_eq!(field(Recurrence::cron(bad, "UTC")), "cron", "{bad:?}");
            }
            let long = format!("0 0 0 1 1 {}", "1,".repeat(200));
            assert_eq!(field(Recurrence::cron(&long, "UTC")), "cron");
            for bad in ["", "Europe/Nowhere", "europe/berlin", "+02:00"] {
                assert_eq!(field(Recurrence::cron("0 6 * * *", bad)), "tz", "{bad:?}");
            }
        }

        #[test]
        fn five_and_six_fields_are_both_accepted() {
            let five = Recurrence::cron("0 6 * * *", BERLIN).unwrap();
            let six = Recurrence::cron("0 0 6 * * *", BERLIN).unwrap();
            let with_seconds = Recurrence::cron("30 0 6 * * *", BERLIN).unwrap();
            let now = utc(2026, 1, 10, 12, 0, 0);
            // 06:00 CET = 05:00 UTC.
            assert_eq!(five.next_after(now), Some(utc(2026, 1, 11, 5, 0, 0)));
            assert_eq!(six.next_after(now), Some(utc(2026, 1, 11, 5, 0, 0)));
            assert_eq!(
                with_seconds.next_after(now),
                Some(utc(2026, 1, 11, 5, 0, 30))
            );
            // Summer: 06:00 CEST = 04:00 UTC.
            assert_eq!(
                five.next_after(utc(2026, 7, 1, 12, 0, 0)),
                Some(utc(2026, 7, 2, 4, 0, 0))
            );
        }

        #[test]
        fn next_after_is_strictly_after_now_also_on_an_instant() {
            let r = Recurrence::cron("*/15 * * * *", "UTC").unwrap();
            let on = utc(2026, 1, 1, 12, 15, 0);
            assert_eq!(r.next_after(on), Some(utc(2026, 1, 1, 12, 30, 0)));
            let just_before = on - TimeDelta::microseconds(1);
            assert_eq!(r.next_after(just_before), Some(on));
            let just_after = on + TimeDelta::microseconds(1);
            assert_eq!(r.next_after(just_after), Some(utc(2026, 1, 1, 12, 30, 0)));
        }

        #[test]
        fn next_instant_fires_missed_instants_once_then_continues() {
            let r = Recurrence::cron("0 0 6 * * *", BERLIN).unwrap();
            let deadline = utc(2026, 1, 10, 5, 0, 0); // 06:00 CET
                                                      // On time: tomorrow 06:00.
            assert_eq!(
                r.next_instant(deadline, deadline + TimeDelta::seconds(2)),
                Some(utc(2026, 1, 11, 5, 0, 0))
            );
            // Three days late, at 07:30 CET on the 13th: the 13th's 06:00, once.
            let now = utc(2026, 1, 13, 6, 30, 0);
            let latest = r.next_instant(deadline, now).unwrap();
            assert_eq!(latest, utc(2026, 1, 13, 5, 0, 0));
            // Its run then queues the 14th.
            assert_eq!(r.next_instant(latest, now), Some(utc(2026, 1, 14, 5, 0, 0)));
            // `now` exactly on an instant counts as reached (<= now).
            let on = utc(2026, 1, 12, 5, 0, 0);
            assert_eq!(r.next_instant(deadline, on), Some(on));
        }

        #[test]
        fn daily_fixed_time_in_the_spring_gap_fires_once_after_the_gap() {
            // 29 March 2026: 02:00 CET jumps to 03:00 CEST (01:00 UTC); 02:30 does not exist.
            let r = Recurrence::cron("0 30 2 * * *", BERLIN).unwrap();
            let got = instants(&r, utc(2026, 3, 27, 12, 0, 0), utc(2026, 3, 31, 12, 0, 0));
            assert_eq!(
                got,
                vec![
                    utc(2026, 3, 28, 1, 30, 0), // 02:30 CET
                    utc(2026, 3, 29, 1, 0, 0),  // 03:00 CEST: the first time after the gap
                    utc(2026, 3, 30, 0, 30, 0), // 02:30 CEST
                    utc(2026, 3, 31, 0, 30, 0),
                ]
            );
        }

        #[test]
        fn daily_fixed_time_in_the_autumn_overlap_fires_once_at_the_first_pass() {
            // 25 October 2026: 03:00 CEST falls back to 02:00 CET (01:00 UTC); 02:30 occurs
            // at 00:30 UTC (CEST) and 01:30 UTC (CET).
            let r = Recurrence::cron("0 30 2 * * *", BERLIN).unwrap();
            let got = instants(&r, utc(2026, 10, 23, 12, 0, 0), utc(2026, 10, 26, 12, 0, 0));
            assert_eq!(
                got,
                vec![
                    utc(2026, 10, 24, 0, 30, 0), // 02:30 CEST
                    utc(2026, 10, 25, 0, 30, 0), // 02:30 CEST, the first pass only
                    utc(2026, 10, 26, 1, 30, 0), // 02:30 CET
                ]
            );
            // Starting inside the second pass does not fire it either.
            assert_eq!(
                r.next_after(utc(2026, 10, 25, 1, 0, 0)),
                Some(utc(2026, 10, 26, 1, 30, 0))
            );
        }

        #[test]
        fn missed_instants_across_dst_days_are_instants_of_the_forward_series() {
            let r = Recurrence::cron("0 30 2 * * *", BERLIN).unwrap();
            // Spring: from the 28th's 02:30 CET, late until 07:00 CEST on the 29th: the
            // 29th's only instant, 03:00 CEST.
            assert_eq!(
                r.next_instant(utc(2026, 3, 28, 1, 30, 0), utc(2026, 3, 29, 5, 0, 0)),
                Some(utc(2026, 3, 29, 1, 0, 0))
            );
            // Autumn: from the 24th's 02:30 CEST, late until 04:00 CET on the 25th: the
            // 25th's only instant, the first pass of 02:30 (CEST).
            assert_eq!(
                r.next_instant(utc(2026, 10, 24, 0, 30, 0), utc(2026, 10, 25, 3, 0, 0)),
                Some(utc(2026, 10, 25, 0, 30, 0))
            );
            // Hourly, late into the second pass of 02:xx: its 02:00 CET fires once.
            let hourly = Recurrence::cron("0 * * * *", BERLIN).unwrap();
            assert_eq!(
                hourly.next_instant(utc(2026, 10, 24, 22, 0, 0), utc(2026, 10, 25, 1, 40, 0)),
                Some(utc(2026, 10, 25, 1, 0, 0))
            );
        }

        #[test]
        fn hourly_across_both_transitions_follows_real_hours() {
            let r = Recurrence::cron("0 * * * *", BERLIN).unwrap();
            // Spring: 00:00 UTC is 01:00 CET, 01:00 UTC is 03:00 CEST; no 02:00 exists.
            let spring = instants(&r, utc(2026, 3, 28, 23, 30, 0), utc(2026, 3, 29, 3, 0, 0));
            assert_eq!(
                spring,
                vec![
                    utc(2026, 3, 29, 0, 0, 0),
                    utc(2026, 3, 29, 1, 0, 0),
                    utc(2026, 3, 29, 2, 0, 0),
                    utc(2026, 3, 29, 3, 0, 0),
                ]
            );
            // Autumn: 02:00 occurs twice (00:00 UTC CEST, 01:00 UTC CET); both fire.
            let autumn = instants(&r, utc(2026, 10, 24, 22, 30, 0), utc(2026, 10, 25, 3, 0, 0));
            assert_eq!(
                autumn,
                vec![
                    utc(2026, 10, 24, 23, 0, 0), // 01:00 CEST
                    utc(2026, 10, 25, 0, 0, 0),  // 02:00 CEST
                    utc(2026, 10, 25, 1, 0, 0),  // 02:00 CET
                    utc(2026, 10, 25, 2, 0, 0),  // 03:00 CET
                    utc(2026, 10, 25, 3, 0, 0),
                ]
            );
        }

        #[test]
        fn every_fifteen_minutes_across_both_transitions() {
            let r = Recurrence::cron("*/15 * * * *", BERLIN).unwrap();
            // Spring: 01:45 CET (00:45 UTC), then 03:00 CEST (01:00 UTC): 15 real minutes.
            let spring = instants(&r, utc(2026, 3, 29, 0, 30, 0), utc(2026, 3, 29, 1, 30, 0));
            assert_eq!(
                spring,
                vec![
                    utc(2026, 3, 29, 0, 45, 0),
                    utc(2026, 3, 29, 1, 0, 0),
                    utc(2026, 3, 29, 1, 15, 0),
                    utc(2026, 3, 29, 1, 30, 0),
                ]
            );
            // Autumn: both passes of 02:xx fire: every 15 real minutes from 00:00 to 02:00
            // UTC, eight instants with a 02:xx wall time.
            let autumn = instants(&r, utc(2026, 10, 24, 23, 50, 0), utc(2026, 10, 25, 2, 0, 0));
            let expected: Vec<_> = (0..=8)
                .map(|i| utc(2026, 10, 25, 0, 0, 0) + TimeDelta::minutes(15 * i))
                .collect();
            assert_eq!(autumn, expected);
        }

        #[test]
        fn a_list_in_the_hour_field_is_not_a_fixed_time_for_dst() {
            // croner treats a job as fixed-time only when second, minute and hour are single
            // values; `2,14` is a list, so on the autumn day its 02:00 fires at both passes
            // (00:00 UTC CEST, 01:00 UTC CET) and on the spring day it has no 02:00 at all.
            let r = Recurrence::cron("0 0 2,14 * * *", BERLIN).unwrap();
            let autumn = instants(&r, utc(2026, 10, 24, 13, 0, 0), utc(2026, 10, 25, 12, 0, 0));
            assert_eq!(
                autumn,
                vec![utc(2026, 10, 25, 0, 0, 0), utc(2026, 10, 25, 1, 0, 0)]
            );
            let spring = instants(&r, utc(2026, 3, 28, 13, 0, 0), utc(2026, 3, 29, 12, 0, 0));
            assert_eq!(spring, vec![utc(2026, 3, 29, 12, 0, 0)]); // 14:00 CEST only
                                                                  // A single 02:00, by contrast: once after the gap, once at the first pass.
            let fixed = Recurrence::cron("0 0 2 * * *", BERLIN).unwrap();
            assert_eq!(
                instants(
                    &fixed,
                    utc(2026, 3, 28, 12, 0, 0),
                    utc(2026, 3, 29, 12, 0, 0)
                ),
                vec![utc(2026, 3, 29, 1, 0, 0)] // 03:00 CEST
            );
            assert_eq!(
                instants(
                    &fixed,
                    utc(2026, 10, 24, 12, 0, 0),
                    utc(2026, 10, 25, 12, 0, 0)
                ),
                vec![utc(2026, 10, 25, 0, 0, 0)] // 02:00 CEST
            );
        }

        #[test]
        fn cron_fingerprints_name_their_recurrence() {
            for (expr, tz) in [
                ("0 0 6 * * *", BERLIN),
                ("*/15 * * * *", "UTC"),
                ("@daily", "America/New_York"),
                ("0 0 2,14 * * MON-FRI", BERLIN),
            ] {
                let r = Recurrence::cron(expr, tz).unwrap();
                assert_eq!(Recurrence::from_fingerprint(&r.fingerprint()).unwrap(), r);
            }
            assert_eq!(
                field(Recurrence::from_fingerprint(
                    "cron:0 0 6 * * *@Mars/Olympus"
                )),
                "tz"
            );
            assert_eq!(
                field(Recurrence::from_fingerprint("cron:bogus@UTC")),
                "cron"
            );
        }

        #[test]
        fn fingerprint_names_expression_and_zone() {
            let r = Recurrence::cron("  0 0 6  * * * ", BERLIN).unwrap();
            assert_eq!(r.fingerprint(), "cron:0 0 6 * * *@Europe/Berlin");
            assert_eq!(
                Recurrence::cron("*/5 * * * *", "UTC")
                    .unwrap()
                    .fingerprint(),
                "cron:*/5 * * * *@UTC"
            );
        }
    }
}
