//! The schedule arguments of `#[timer]`: `every = "5m"`, or `cron = "..."` with an optional
//! `tz = "..."` (feature `cron`). Checked here, at compile time, by the rules the runtime's
//! `outbox::periodic::Recurrence::{parse_every, cron}` apply, with the same crates
//! (humantime; croner and chrono-tz), so an attribute that compiles never fails at run
//! time. The runtime checks again (a hand-written `Timer` impl has no compile-time check);
//! the macro tests keep the two in step (`tests/macros-cron`).

use syn::LitStr;

use crate::args::{example, Slot};
use crate::errors::Errors;
use crate::model::Declared;

/// The longest interval: `outbox::message::MAX_DELAY`, 10 000 years of 366 days.
const MAX_EVERY_SECS: u64 = 10_000 * 366 * 24 * 3600;

/// Checks `every`, `cron` and `tz` together; `None` when no schedule is declared or one is
/// wrong (the error is recorded, spanned at the string that causes it).
pub(crate) fn check(
    every: Slot<LitStr>,
    cron: Slot<LitStr>,
    tz: Slot<LitStr>,
    errors: &mut Errors,
) -> Option<Declared> {
    match (every, cron) {
        (Slot::Given(_), Slot::Given(cron)) => {
            errors.error(
                &cron,
                "`every` and `cron` are two schedules; a type declares at most one: keep one, \
                 and register more on the worker with `WorkerBuilder::schedule(name, \
                 recurrence, payload)`",
            );
            None
        }
        (Slot::Given(every), cron) => {
            let tz_ok = match &tz {
                Slot::Given(tz) => {
                    errors.error(
                        tz,
                        "`tz` is the time zone of a `cron` expression; an `every` interval is \
                         a step of real time and has none: remove `tz`",
                    );
                    false
                }
                Slot::Invalid => false,
                Slot::Absent => true,
            };
            let ok = check_every(&every, errors) && tz_ok && !matches!(cron, Slot::Invalid);
            ok.then(|| Declared::Every {
                text: every.value(),
                span: every.span(),
            })
        }
        (every, Slot::Given(cron)) => {
            let tz = match tz {
                Slot::Given(tz) => Some(tz),
                Slot::Absent => None,
                Slot::Invalid => return None,
            };
            let ok = check_cron(&cron, tz.as_ref(), errors) && !matches!(every, Slot::Invalid);
            ok.then(|| Declared::Cron {
                expr: cron.value(),
                tz: tz.map_or_else(|| "UTC".to_owned(), |tz| tz.value()),
                span: cron.span(),
            })
        }
        (_, _) => {
            if let Slot::Given(tz) = &tz {
                errors.error(
                    tz,
                    format!(
                        "`tz` is the time zone of a `cron` expression, and there is none: add {}",
                        example("cron")
                    ),
                );
            }
            None
        }
    }
}

/// The fixed units of time humantime knows, as it spells them (its `Unit::from_str`), as
/// `outbox::periodic` lists them:
/// everything else, months and years among them, is refused.
const FIXED_UNITS: &[&str] = &[
    "nanos", "nsec", "ns", "usec", "us", "millis", "msec", "ms", "seconds", "second", "secs",
    "sec", "s", "minutes", "minute", "min", "mins", "m", "hours", "hour", "hr", "hrs", "h", "days",
    "day", "d", "weeks", "week", "wk", "wks", "w",
];

/// The calendar units humantime knows (fixed averages: a month of 30.44 days, a year of
/// 365.25), named in the error.
const CALENDAR_UNITS: &[&str] = &["M", "month", "months", "y", "yr", "yrs", "year", "years"];

/// `Recurrence::parse_every`'s rules: a human duration (humantime) without months or
/// years, above zero, at most 10 000 × 366 days, in whole microseconds.
fn check_every(lit: &LitStr, errors: &mut Errors) -> bool {
    let text = lit.value();
    // As `Recurrence::parse_every` (outbox's periodic.rs, which says why): fixed units only,
    // by an allow-list of humantime's; months and years named as such.
    let unfixed = text
        .split(|c: char| !c.is_ascii_alphabetic())
        .find(|unit| !unit.is_empty() && !FIXED_UNITS.contains(unit));
    if let Some(unit) = unfixed {
        let why = if CALENDAR_UNITS.contains(&unit) {
            "a calendar unit that humantime reads as a fixed average (a month is 30.44 days, a \
             year 365.25): give days (\"30days\") for a fixed step, or a `cron` expression for \
             calendar dates"
        } else {
            "not a unit of time: use ns, us, ms, s, m (minutes), h, d or w, or their long names \
             (\"30s\", \"5m\", \"1h 30m\", \"2days\")"
        };
        errors.error(lit, format!("`every` counts in {unit:?}, {why}"));
        return false;
    }
    let interval = match humantime::parse_duration(text.trim()) {
        Ok(interval) => interval,
        Err(e) => {
            errors.error(
                lit,
                format!(
                    "`every` must be a duration such as \"30s\", \"5m\", \"1h 30m\" or \"2days\"; \
                     {text:?} is not one: {e}"
                ),
            );
            return false;
        }
    };
    let problem = if interval.is_zero() {
        Some("must be above zero: the schedule would never advance")
    } else if interval.as_secs() > MAX_EVERY_SECS
        || (interval.as_secs() == MAX_EVERY_SECS && interval.subsec_nanos() > 0)
    {
        Some("must be at most 10 000 years of 366 days")
    } else if !interval.subsec_nanos().is_multiple_of(1_000) {
        Some("must be a whole number of microseconds (the resolution of a Postgres timestamp)")
    } else {
        None
    };
    match problem {
        Some(problem) => {
            errors.error(lit, format!("`every` {problem}"));
            false
        }
        None => true,
    }
}

/// Without the feature: the arguments exist, but checking them needs croner and the
/// time-zone database, which the feature compiles.
#[cfg(not(feature = "cron"))]
fn check_cron(lit: &LitStr, _tz: Option<&LitStr>, errors: &mut Errors) -> bool {
    errors.error(
        lit,
        "`cron` needs the `cron` feature of outbox (it compiles the cron parser and the \
         time-zone database): `outbox = { version = \"0.1\", features = [\"cron\"] }` in \
         Cargo.toml; or use `every = \"...\"` for a fixed interval, which needs no feature",
    );
    false
}

/// `Recurrence::cron`'s rules: at most 256 bytes, 5 or 6 fields as croner reads them (seconds
/// optional, no year), an IANA zone, and at least one matching instant.
#[cfg(feature = "cron")]
fn check_cron(lit: &LitStr, tz: Option<&LitStr>, errors: &mut Errors) -> bool {
    use croner::parser::{CronParser, Seconds, Year};

    /// `outbox::periodic::MAX_CRON_BYTES`.
    const MAX_CRON_BYTES: usize = 256;

    let mut ok = true;
    let zone = match tz {
        None => Some(chrono_tz::UTC),
        Some(tz) => match tz.value().parse::<chrono_tz::Tz>() {
            Ok(zone) => Some(zone),
            Err(_) => {
                errors.error(
                    tz,
                    format!(
                        "unknown time zone {:?}: `tz` is an IANA name such as \"Europe/Berlin\" \
                         or \"UTC\" (case-sensitive)",
                        tz.value()
                    ),
                );
                ok = false;
                None
            }
        },
    };
    let expr = lit.value();
    if expr.len() > MAX_CRON_BYTES {
        errors.error(
            lit,
            format!(
                "`cron` is {} bytes long; the limit is {MAX_CRON_BYTES}",
                expr.len()
            ),
        );
        return false;
    }
    let normalized = expr.split_whitespace().collect::<Vec<_>>().join(" ");
    let parsed = CronParser::builder()
        .seconds(Seconds::Optional)
        .year(Year::Disallowed)
        .build()
        .parse(&normalized);
    let cron = match parsed {
        Ok(cron) => cron,
        Err(e) => {
            errors.error(
                lit,
                format!(
                    "{expr:?} is not a cron expression ({}): write 5 fields (minute hour \
                     day-of-month month day-of-week) or 6 (a leading second), e.g. {}",
                    e.to_string().trim_end_matches('.'),
                    example("cron")
                ),
            );
            return false;
        }
    };
    if let Some(zone) = zone {
        let probe = chrono::DateTime::<chrono::Utc>::UNIX_EPOCH.with_timezone(&zone);
        if cron.find_next_occurrence(&probe, false).is_err() {
            errors.error(
                lit,
                format!("{expr:?} matches no instant: the schedule would never fire"),
            );
            ok = false;
        }
    }
    ok
}

#[cfg(test)]
mod tests {
    use super::*;
    use proc_macro2::Span;

    fn lit(s: &str) -> LitStr {
        LitStr::new(s, Span::call_site())
    }

    fn count(errors: Errors) -> usize {
        errors
            .into_compile_errors()
            .to_string()
            .matches("compile_error")
            .count()
    }

    fn every(text: &str) -> (bool, usize) {
        let mut errors = Errors::default();
        let ok = check_every(&lit(text), &mut errors);
        (ok, count(errors))
    }

    #[test]
    fn every_follows_the_runtime_rules() {
        for good in ["30s", "5m", "1h 30m", " 2days ", "500ms", "1us"] {
            assert_eq!(every(good), (true, 0), "{good:?}");
        }
        for bad in ["", "5", "0s", "-5m", "five minutes", "1500ns", "10100years"] {
            assert_eq!(every(bad), (false, 1), "{bad:?}");
        }
    }

    #[test]
    fn both_schedules_or_a_stray_tz_are_errors() {
        let mut errors = Errors::default();
        let both = check(
            Slot::Given(lit("5m")),
            Slot::Given(lit("* * * * *")),
            Slot::Absent,
            &mut errors,
        );
        assert!(both.is_none());
        assert_eq!(count(errors), 1);

        let mut errors = Errors::default();
        let stray = check(
            Slot::Absent,
            Slot::Absent,
            Slot::Given(lit("UTC")),
            &mut errors,
        );
        assert!(stray.is_none());
        assert_eq!(count(errors), 1);

        let mut errors = Errors::default();
        let with_every = check(
            Slot::Given(lit("5m")),
            Slot::Absent,
            Slot::Given(lit("UTC")),
            &mut errors,
        );
        assert!(with_every.is_none());
        assert_eq!(count(errors), 1);
    }

    #[test]
    fn no_schedule_is_fine() {
        let mut errors = Errors::default();
        assert!(check(Slot::Absent, Slot::Absent, Slot::Absent, &mut errors).is_none());
        assert!(errors.is_empty());
    }
}
