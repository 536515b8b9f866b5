//! Workers: the handler traits, the decision a run comes to, the report of a
//! [`Worker::run_due`](crate::Worker::run_due) call, and the worker's defaults.
//!
//! The worker itself is [`Worker`](crate::Worker) (built with
//! [`WorkerBuilder`](crate::WorkerBuilder), started as a
//! [`RunningWorker`](crate::RunningWorker)); what a handler receives and returns is
//! [`Context`](crate::Context), [`Outcome`](crate::Outcome) and
//! [`HandlerOptions`](crate::HandlerOptions), all at the crate root.

// Files by job: `config.rs` (knobs), `builder.rs` (WorkerBuilder), `handler.rs` (what a
// handler gets and returns, and the decision a run comes to), `retry.rs` (strategies),
// `claim_loop.rs` (claiming and waking up), `complete.rs` (running handlers and writing
// their completions), `leases.rs` (held rows and renewal), `isolate.rs` and `quarantine.rs`
// (a claim that fails), `gauge.rs` (the opt-in queue-depth gauge), `schedule.rs` (periodic timers), `shared.rs` (state
// those share), and `run.rs` (Worker,
// RunningWorker, shutdown, run_due). Each public item has one path: the crate root for what
// the quick start types, this module for the rest.
pub(crate) mod builder;
mod claim_loop;
mod complete;
mod config;
mod gauge;
pub(crate) mod handler;
mod isolate;
mod leases;
mod quarantine;
pub(crate) mod retry;
pub(crate) mod run;
mod schedule;
mod shared;

pub use self::config::{DEFAULT_ACK_BATCH_SIZE, MIN_QUEUE_DEPTH_INTERVAL};
pub use self::handler::{
    CancelReason, Decision, Handler, IntoOutcome, DEFAULT_HANDLER_TIMEOUT, DEFAULT_MAX_DELIVERIES,
};
pub use self::retry::MAX_RETRY_DELAY;
pub use self::run::{Dispatched, RUN_DUE_LIMIT, SHUTDOWN_GRACE};
