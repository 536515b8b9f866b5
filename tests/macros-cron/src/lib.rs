//! Periodic timers declared with `#[timer]`, written the way users write them and compiled
//! under the workspace's strict lints (`missing_docs`, `unused_qualifications`, clippy);
//! `tests/declared.rs` runs them in virtual time.

/// The daily report: every day at 06:00 Berlin time.
#[outbox::timer(
    queue = "reports.daily",
    max_deliveries = 3,
    cron = "0 0 6 * * *",
    tz = "Europe/Berlin"
)]
#[derive(Debug, Default, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DailyReport {
    /// Which report (the default is the empty string).
    pub kind: String,
}

/// A night job at 02:30 Berlin time: the wall time that does not exist on the spring DST
/// day and occurs twice on the autumn one.
#[outbox::timer(
    queue = "maintenance.night",
    max_deliveries = 3,
    cron = "30 2 * * *",
    tz = "Europe/Berlin"
)]
#[derive(Debug, Default, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct NightJob {}

/// Every 15 minutes of UTC wall time (no `tz`: UTC).
#[outbox::timer(
    queue = "maintenance.quarter",
    max_deliveries = 3,
    cron = "*/15 * * * *"
)]
#[derive(Debug, Default, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Quarterly {}

/// Every hour of real time.
#[outbox::timer(queue = "maintenance.hourly", max_deliveries = 3, every = "1h")]
#[derive(Debug, Default, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Hourly {}
