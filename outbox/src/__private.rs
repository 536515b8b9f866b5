//! Not public API: what the code `#[timer]` generates names, and nothing else (the
//! project's own test hooks are behind the `testing` feature, in `hooks.rs`). Paths here
//! may change in any release.

// Named by the functions `#[timer]` generates, so a user's own `Option`, `Result`, `Into`,
// `str`, `u32` or `Duration` in scope cannot change their meaning.
pub use ::core::convert::Into;
pub use ::core::option::Option;
pub use ::core::primitive::{str, u32};
pub use ::core::result::Result;
pub use ::core::time::Duration;

/// The payload of a schedule declared with `#[timer(every = …)]` / `#[timer(cron = …)]`:
/// each run gets `T::default()`. A trait of its own (not a bare `Default` bound) so a
/// payload without `Default` gets a message that says what to do instead.
#[diagnostic::on_unimplemented(
    message = "a timer with a schedule in `#[timer]` needs a `Default` payload: `{Self}` does not implement `Default`",
    label = "each run of this schedule gets `{Self}::default()` as its payload",
    note = "derive or implement `Default` for `{Self}`, or remove `every`/`cron` from the attribute and register the schedule on the worker with its payload: `WorkerBuilder::schedule(name, recurrence, payload)`"
)]
pub trait SchedulePayload: Sized {
    /// The payload each run gets.
    fn payload() -> Self;
}

impl<T: Default> SchedulePayload for T {
    fn payload() -> Self {
        T::default()
    }
}

/// `Timer::declared_schedule` of `#[timer(every = "…")]` (the text is checked at compile
/// time by the same rules as `Recurrence::parse_every`).
pub fn every_schedule<T: SchedulePayload>(
    every: &str,
) -> (crate::Result<crate::periodic::Recurrence>, T) {
    (
        crate::periodic::Recurrence::parse_every(every),
        T::payload(),
    )
}

/// `Timer::declared_schedule` of `#[timer(cron = "…", tz = "…")]`.
#[cfg(feature = "cron")]
pub fn cron_schedule<T: SchedulePayload>(
    cron: &str,
    tz: &str,
) -> (crate::Result<crate::periodic::Recurrence>, T) {
    (crate::periodic::Recurrence::cron(cron, tz), T::payload())
}
