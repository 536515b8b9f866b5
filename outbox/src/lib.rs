//! # outbox — durable, typed timers and messages on Postgres
//!
//! A Postgres table is the queue (the *transactional outbox*): your application writes its
//! domain rows and a queue row **in the same transaction**, so a message exists if and only
//! if the business change committed. Workers claim due rows with `FOR UPDATE SKIP LOCKED`
//! under a lease token, and every write after a claim is fenced by that token.
//!
//! On top sit **keyed timers**: one live row per `(queue, timer_id)`, scheduled, extended
//! (later only) and cancelled. Extending a timer whose handler is already running queues a
//! **rearm** on the running row, applied atomically when the run ends, so the extension is
//! never lost.
//!
//! The contract is the project's `SPEC.md`; section numbers (§) in these docs refer to it.
#![deny(missing_docs)]
#![warn(unreachable_pub)]

mod cancel;
mod error;
mod migrate;
mod publish;
mod schema;
pub mod store;
pub mod testing;
mod timer;
mod validate;
mod worker;

#[doc(hidden)]
pub mod __private; // Not public API.

pub use cancel::Cancelled;
pub use error::{Error, Result, SchemaProblem, UPGRADE_GUIDE};
pub use migrate::{migrate, migration_steps, MigrationStep};
pub use outbox_macros::timer;
pub use publish::{
    BatchItem, Headers, Message, OnConflict, Published, Schedule, MAX_DELAY, MAX_NAME_BYTES,
    MAX_PAYLOAD_BYTES,
};
pub use schema::{Outbox, OutboxBuilder, DEFAULT_TABLE};
pub use store::{
    Completion, DeadLetter, Delivery, Failure, FailureReason, Lease, NextWakeup, PgStore, Store,
    StoredRow, Wakeup,
};
pub use timer::{cancel_timer, extend_timer, publish_timer, Bound, Publisher, Timer};
pub use validate::validate_schema;
pub use worker::{
    Context, Handler, HandlerOptions, HandlerResult, IntoOutcome, Outcome, RetryStrategy,
    RunningWorker, ShutdownReport, Worker, WorkerBuilder, DEFAULT_MAX_DELIVERIES, MAX_RETRY_DELAY,
};
