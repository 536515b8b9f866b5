//! Workers: the handler traits, the decision a run comes to, the report of a
//! [`Worker::run_due`](crate::Worker::run_due) call, and the worker's defaults.
//!
//! The worker itself is [`Worker`](crate::Worker) (built with
//! [`WorkerBuilder`](crate::WorkerBuilder), started as a
//! [`RunningWorker`](crate::RunningWorker)); what a handler receives and returns is
//! [`Context`](crate::Context), [`Outcome`](crate::Outcome) and
//! [`HandlerOptions`](crate::HandlerOptions), all at the crate root.

// Files by job. Each public item has one path: the crate root for what the quick start
// types, this module for the rest.
//
//   lifecycle.rs  Worker, RunningWorker, start, shutdown, run_due
//   builder.rs    WorkerBuilder            config.rs  the knobs and their checks
//   handler.rs    what a handler author sees: Context, Outcome, Handler, HandlerOptions
//   retry.rs      RetryStrategy            schedule.rs  periodic timers: register, arm
//   claim.rs      claiming: the claim loop (sleep until due, back-off), run_due's rounds
//   execute.rs    one claimed row, the same for both (Mode::Pipelined | Mode::Inline)
//   decide.rs     max_deliveries, decoding, the handler call, outcome → Decision
//   complete.rs   the fenced writes, tried as the mode says; what a completion reports
//   acks.rs       the completer (pipelined acks)    renewal.rs  lease renewal
//   leases.rs     held leases and their phase       poison.rs   isolation, quarantine
//   gauge.rs      the opt-in queue-depth gauge      shared.rs   what the tasks share
//   circuit.rs    a relay's circuit: claims paused while its broker is down
//
// A claimed row's walk: claim.rs (claim, register as held) → execute.rs (arm a periodic
// run, decide.rs, the completion) → complete.rs (write, report) or acks.rs (batched).
mod acks;
pub(crate) mod builder;
pub(crate) mod circuit;
mod claim;
mod complete;
mod config;
pub(crate) mod decide;
mod execute;
mod gauge;
pub(crate) mod handler;
mod leases;
pub(crate) mod lifecycle;
mod poison;
mod renewal;
pub(crate) mod retry;
mod schedule;
mod shared;

pub use self::claim::RUN_DUE_LIMIT;
pub use self::config::{DEFAULT_ACK_BATCH_SIZE, MIN_QUEUE_DEPTH_INTERVAL};
pub use self::decide::Decision;
pub use self::execute::Dispatched;
pub use self::handler::{
    CancelReason, Handler, IntoOutcome, DEFAULT_HANDLER_TIMEOUT, DEFAULT_MAX_DELIVERIES,
};
pub use self::lifecycle::SHUTDOWN_GRACE;
pub use self::retry::MAX_RETRY_DELAY;
