//! Bind conversions: how a Rust value becomes a statement's parameter where sqlx has no
//! direct mapping (a `Duration` as an `interval`). A leaf like the statement text beside
//! it: it converts, and executes nothing.

use std::time::Duration;

use sqlx::postgres::types::PgInterval;

use crate::error::{Error, Result};

/// A duration as whole microseconds, for an `interval` parameter.
pub(crate) fn micros(d: Duration, field: &'static str) -> Result<i64> {
    i64::try_from(d.as_micros()).map_err(|_| Error::invalid(field, "overflows 64-bit microseconds"))
}

/// An `interval` parameter of `microseconds` (no months or days, so Postgres adds it to a
/// `timestamptz` exactly, whatever the calendar).
pub(crate) fn interval(microseconds: i64) -> PgInterval {
    PgInterval {
        months: 0,
        days: 0,
        microseconds,
    }
}
