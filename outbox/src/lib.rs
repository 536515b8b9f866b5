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
//! The contract is `docs/SPEC.md` in the repository; section numbers (§) in these docs refer
//! to it.
//!
//! ## Quick start
//!
//! ```no_run
//! use std::time::Duration;
//! use outbox::{Context, Outbox, PgStore, Worker};
//!
//! #[outbox::timer(queue = "presence.expiry", max_deliveries = 5)]
//! #[derive(serde::Serialize, serde::Deserialize)]
//! pub struct PresenceExpiry { pub user_id: i64 }
//!
//! async fn on_expiry(t: PresenceExpiry, _ctx: Context) -> Result<(), sqlx::Error> {
//!     // mark t.user_id offline, re-checking last_seen in the same transaction (SPEC §5.4)
//!     Ok(())
//! }
//!
//! # async fn demo(pool: sqlx::PgPool) -> Result<(), outbox::Error> {
//! outbox::migrate(&pool).await?;               // tables `outbox` and `outbox_dlq`
//!
//! // In a request: the domain write and the timer commit together.
//! let mut tx = pool.begin().await?;
//! // sqlx::query("UPDATE users SET last_seen = now() WHERE id = $1")...execute(&mut *tx)
//! extend_presence_expiry(&mut *tx, "42", &PresenceExpiry { user_id: 42 }, Duration::from_secs(30)).await?;
//! tx.commit().await?;
//!
//! // A worker, anywhere.
//! let worker = Worker::builder(PgStore::new(pool.clone(), Outbox::default()))
//!     .timer::<PresenceExpiry>(on_expiry)
//!     .build()?
//!     .start();
//! worker.shutdown().await;
//! # Ok(()) }
//! ```
//!
//! ## Map
//!
//! | concern | where | SPEC |
//! |---|---|---|
//! | table names, identifiers, the [`Outbox`] handle | [`Outbox`], [`OutboxBuilder`] | §1 |
//! | migrations (online: catalog checks, lock timeouts, concurrent index builds) and the schema upgrades | [`migrate`], [`Outbox::migrate`], [`Outbox::migrate_with`], [`MigrateOptions`], [`Outbox::applied_migrations`], [`migration_steps`] | §1.3 |
//! | publish, extend, batch | [`Outbox::publish`], [`Outbox::publish_batch`], [`Message`], [`Published`] | §2, §4, §5 |
//! | cancel (sticks: a running timer is marked, and deleted however its run ends) | [`Outbox::cancel`], [`Cancelled`] | §3 |
//! | claim, fenced completions, renewal, release | [`Store`], [`PgStore`], [`Completion`], [`ClaimRequest`] | §5.1, §5.2, §6, §7.5, §7.8 |
//! | reading and validating | [`Outbox::pending`], [`PgStore::pending`], [`PgStore::dead_letters`], [`Outbox::validate_schema`] | §8 |
//! | the typed layer | [`timer`] (macro), [`Timer`], [`Publisher`] | §9 |
//! | workers | [`Worker`], [`WorkerBuilder`], [`RetryStrategy`], [`Context`], [`Outcome`] | §7 |
//! | leases kept alive, poison rows, shutdown | [`Worker`] (its docs), [`Context::cancelled`], [`HandlerOptions::timeout`], [`ShutdownReport`] | §7.4, §7.5, §7.8 |
//! | tests without a database | [`testing`] | §10 |
//!
//! ## Units and clocks
//!
//! Every duration is a [`std::time::Duration`]; absolute times are `chrono::DateTime<Utc>`.
//! Deadlines, lease ages and retry delays are computed **by the database clock**
//! (`now() + interval`), so clock skew between application hosts and Postgres cannot shift
//! them. `now()` is the start of the *transaction*: a message published "now" inside a long
//! transaction is due from that transaction's start (it becomes visible at commit).
//!
//! ## Errors
//!
//! One [`Error`] type. Input that breaks a rule (an empty queue name, a timer id over 255
//! bytes, a negative delay, `Extend` without a timer id, a header with NUL) is
//! [`Error::InvalidArgument`] naming the field, returned **before any SQL runs**. Bad names
//! are [`Error::InvalidName`], bad worker knobs [`Error::InvalidConfig`], both naming the
//! offender. A table that predates a schema upgrade gives [`Error::UpgradeRequired`],
//! whose message points to `docs/upgrading.md`; a database where the tables do not exist
//! gives [`Error::NotMigrated`], which says to run [`migrate`].
//!
//! ## Decisions where the specification is silent
//!
//! - **Dead-letter queue** is off by default ([`OutboxBuilder::dead_letter`]); the table is
//!   still created by the migrations so it can be turned on without recreating anything
//!   (the `migrate()` of an outbox with it on adds its later upgrades: the redrive columns
//!   and the `(failed_at)` index). Off, a terminal failure deletes the row (or applies its
//!   rearm).
//! - **`Published::Unchanged`** carries no id: reporting it would need a second statement
//!   on a path that wrote nothing.
//! - **Cancel outside a transaction** (a bare connection, autocommit) is still safe: each
//!   write repeats the state it expects and the lock-then-write loop runs again if the row
//!   changed in between.
//! - **Claim order among equal deadlines** follows the pending index (heap order), so the
//!   claim cost stays independent of the backlog even when thousands of rows share one
//!   `now()`; the claimed batch itself is ordered by `(next_attempt_at, id)`.
//! - **`attempts_count` in the dead-letter row** includes the final failed run when the
//!   handler ran (`rejected`, `retry_exhausted`), not for `decode_error` or
//!   `max_deliveries` (the handler never ran).
//! - **`Outcome::RetryAfter`** replaces the strategy's delay but still obeys its
//!   `max_attempts`.
//! - **Raw queues** default to `max_deliveries = 10` ([`DEFAULT_MAX_DELIVERIES`]).
//! - **Panics** in a handler are caught and treated as a failed run (retry per strategy).
//! - **Notifications** carry `<deadline epoch ms>:<queue>` on the channel
//!   `<table>_wakeup` (`<schema>.<table>_wakeup` with an explicit schema).
//! - **Publishing through generated functions** on a plain connection uses
//!   [`Outbox::global`] (the defaults unless [`Outbox::set_global`] was called); to use
//!   another outbox, pass `outbox.on(&mut *tx)` ([`Outbox::on`]).
//! - **Sizes**: a payload holds at most 64 MiB ([`MAX_PAYLOAD_BYTES`]) and a message's
//!   headers 64 KiB in all ([`MAX_HEADERS_BYTES`]): far below Postgres' own 1 GiB, which a
//!   statement cannot carry without resetting the connection.
//! - **Lease renewal** runs every third of `lease_ttl`; a row locked by another transaction
//!   at that moment is reported [`Renewal::Busy`] and tried again next time, never
//!   declared lost on that ground.
//! - **Migration lock waits**: each try of a step waits at most 3 s for its table locks,
//!   and `migrate()` keeps trying for 5 minutes ([`MigrateOptions`]); applied steps are
//!   recorded in `<table>_schema_migrations`, next to the queue table.
//! - **Handler timeout** defaults to 5 minutes ([`DEFAULT_HANDLER_TIMEOUT`]).
//! - **Worker writes with a lock timeout** (completions, renewal, release) use 200 ms
//!   ([`store::postgres::LOCK_TIMEOUT`]) on a second pool the [`PgStore`] opens itself.
//! - **A row no claim can take** is set aside for 1 s, doubling up to 5 minutes, and after
//!   `max_deliveries` such failures deleted (archived with reason `max_deliveries`).
//! - **Shutdown** gives back rows claimed but not started at once, rather than running
//!   them, and returns within `graceful_timeout` + [`SHUTDOWN_GRACE`] (250 ms).
//! - **A failed run of a cancelled timer** reports [`Completion::Cancelled`] (its row is
//!   deleted); a successful one reports [`Completion::Deleted`] as usual.
#![deny(missing_docs)]
#![warn(unreachable_pub)]

// Modules from the leaves up: names → sql → publish, cancel, read, migrate, validate →
// outbox (the handle) → timer (the typed layer) → store → worker, testing. Each imports
// only modules before it.
mod cancel;
mod error;
mod migrate;
mod names;
mod outbox;
mod publish;
mod read;
mod shape;
mod sql;
pub mod store;
pub mod testing;
mod timer;
mod validate;
mod worker;

#[doc(hidden)]
pub mod __private; // Not public API.

pub use cancel::Cancelled;
pub use error::{Error, LockHolder, Result, SchemaProblem, UPGRADE_GUIDE};
pub use migrate::{AppliedMigration, MigrateOptions, MigrationStep};
pub use names::DEFAULT_TABLE;
pub use outbox::{migrate, migration_steps, validate_schema, Bound, Outbox, OutboxBuilder};
pub use outbox_macros::{timer, FromRef};
pub use publish::{
    BatchItem, Headers, Message, OnConflict, Published, Schedule, MAX_DELAY, MAX_HEADERS_BYTES,
    MAX_NAME_BYTES, MAX_PAYLOAD_BYTES, MAX_SLACK,
};
pub use read::{DeadLetter, StoredRow};
pub use store::postgres::PgStore;
pub use store::transaction::{HandlerTransaction, TransactionSource};
pub use store::{
    AutovacuumOff, ClaimRequest, Completion, Delivery, Failure, FailureReason, Lease, NextWakeup,
    Release, Released, Renewal, Store, Wakeup,
};
pub use timer::{
    cancel_timer, extend_timer, extend_timer_with_slack, publish_timer, Publisher, Timer,
};
pub use worker::builder::WorkerBuilder;
pub use worker::handler::{
    CancelReason, Context, Decision, FromRef, Handler, HandlerOptions, IntoOutcome, Outcome,
    DEFAULT_HANDLER_TIMEOUT, DEFAULT_MAX_DELIVERIES,
};
pub use worker::retry::{RetryStrategy, MAX_RETRY_DELAY};
pub use worker::{
    Dispatched, RunningWorker, ShutdownReport, Worker, DEFAULT_ACK_BATCH_SIZE, RUN_DUE_LIMIT,
    SHUTDOWN_GRACE,
};
