//! # outbox — durable, typed timers and messages on Postgres
//!
//! A Postgres table is the queue (the *transactional outbox*): your application writes its
//! domain rows and a queue row **in the same transaction**, so a message exists if and only
//! if the business change committed. Workers claim due rows with `FOR UPDATE SKIP LOCKED`
//! (Postgres skips rows another transaction has locked, so two workers never take the same
//! row and neither waits for the other) under a lease token, and every write after a claim
//! names that token in its `WHERE` clause: a worker whose lease expired and was taken over
//! matches no row, so it cannot undo the new owner's work.
//!
//! On top sit **keyed timers**: one live row per `(queue, timer_id)` (a unique index), scheduled,
//! extended (later only) and cancelled. Extending a timer whose handler is already running
//! queues a **rearm** on the running row, applied atomically by the statement that ends the
//! run, so the extension is never lost.
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
//!     // Mark t.user_id offline. A rearm does not undo what a run did, so re-check
//!     // last_seen in the same transaction as the write.
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
//! The crate root holds what the quick start types; every other item has one path, in a
//! module named for its job.
//!
//! | concern | where |
//! |---|---|
//! | table names and identifiers, the [`Outbox`] handle | [`Outbox`], [`OutboxBuilder`] |
//! | publish, extend, cancel | [`Outbox::publish`], [`Outbox::publish_batch`], [`Outbox::cancel`], [`Message`], [`Published`], [`Cancelled`]; schedules, headers, batches and limits in [`message`] |
//! | the typed layer | [`timer`] (the attribute), [`Timer`], [`Publisher`]; the functions it wraps in [`message`] |
//! | workers and handlers | [`Worker`], [`WorkerBuilder`], [`RunningWorker`], [`ShutdownReport`], [`Context`], [`Outcome`], [`HandlerOptions`], [`RetryStrategy`], [`HandlerTransaction`]; traits, decisions and defaults in [`worker`] |
//! | storage: claim, fenced completions, renewal, release, reading rows | [`PgStore`]; the [`store::Store`] contract and its types in [`store`] |
//! | operator actions: pause and resume a queue, run, reschedule or delete a pending row | [`Outbox::pause_queue`], [`Outbox::resume_queue`], [`Outbox::run_now`], [`Outbox::reschedule`], [`Outbox::delete_pending`]; rules and outcomes in [`admin`] |
//! | dead letters: list, redrive, purge | [`dlq`]; [`Outbox::dead_letters`], [`Outbox::redrive_dead_letters`], [`Outbox::purge_dead_letters`] |
//! | queue statistics: depth, lateness, leases, dead letters | [`Outbox::stats`]; requests, figures and modes in [`stats`] |
//! | migrations (online), validation, upgrading an older schema | [`migrate`], [`Outbox::migrate`]; the rest in [`schema`], the guide in [`schema::upgrading`] |
//! | spans (OpenTelemetry messaging conventions), trace context in headers (feature `opentelemetry`), metrics | [`telemetry`] |
//! | recurrences of periodic timers: fixed intervals, cron expressions in a time zone (feature `cron`), next instants across DST | [`periodic`] |
//! | tests without a database (feature `testing`) | [`testing`] |
//!
//! ## Features
//!
//! - `testing` (off by default): the `testing` module, an in-memory store with a virtual
//!   clock that behaves as [`PgStore`] does, so handlers are tested without a database and
//!   without sleeping. Turn it on for your tests only:
//!   `[dev-dependencies] outbox = { version = "0.1", features = ["testing"] }`.
//! - `opentelemetry` (off by default): each publish writes the W3C trace context of its
//!   `send` span (`traceparent`, `tracestate`) into the message's headers, within the
//!   header limit, and each delivery's `receive` and `process` spans link to it. Built on
//!   `opentelemetry` 0.33, `opentelemetry_sdk` 0.33 and `tracing-opentelemetry` 0.34, the
//!   versions your application's layer must use. Without it the spans carry the same
//!   names and attributes as plain `tracing` spans. See [`telemetry`].
//! - `cron` (off by default): `periodic::Recurrence::cron`, cron expressions (5 fields, or 6
//!   with seconds) evaluated in an IANA time zone, with DST handled by the `croner` crate
//!   and zones from `chrono-tz` (which compiles the time-zone database into your binary,
//!   hence a feature). Fixed intervals ([`periodic::Recurrence::every`]) need no feature.
//!   See [`periodic`].
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
//! whose message links the upgrade guide ([`schema::upgrading`]); a database where the
//! tables do not exist gives [`Error::NotMigrated`], which says to run [`migrate`]; a table
//! that is not an outbox table (it lacks a column every version has) gives
//! [`Error::SchemaMismatch`]; an explicit schema that does not exist gives
//! [`Error::SchemaNotFound`] from `migrate` and `validate_schema` (which create and check
//! tables, not schemas), and [`Error::NotMigrated`] from every other call (Postgres reports
//! a missing table there). These come only from the library's own statements: your own
//! SQL's `sqlx::Error`, turned into an [`Error`] by `?` (in a handler's transaction, say),
//! is always [`Error::Database`], whatever its SQLSTATE. Through a transaction-mode pooler
//! ([`OutboxBuilder::transaction_pooler`]), what needs a server session of its own
//! (`migrate`) is [`Error::SessionRequired`], before any SQL runs.
//!
//! ## Decisions a user relies on
//!
//! - **Dead-letter queue** is off by default ([`OutboxBuilder::dead_letter`]); the table is
//!   still created by the migrations so it can be turned on without recreating anything.
//!   Off, a terminal failure deletes the row (or applies its rearm), and the operations
//!   of [`dlq`] return [`Error::DeadLetterDisabled`].
//! - **`Published::Unchanged`** carries no id: reporting it would need a second statement
//!   on a path that wrote nothing.
//! - **Cancel outside a transaction** (a bare connection, autocommit) is still safe: each
//!   write repeats the state it expects and the lock-then-write loop runs again if the row
//!   changed in between.
//! - **Claim order among equal deadlines** follows the pending index (heap order), so the
//!   claim cost stays independent of the backlog even when thousands of rows share one
//!   `now()`; the queues of one claim take turns (round robin), each within its own limit,
//!   and a worker's next claim starts after the queue its last claim ended on.
//! - **`attempts_count` in the dead-letter row** includes the final failed run when the
//!   handler ran (`rejected`, `retry_exhausted`), not for `decode_error` or
//!   `max_deliveries` (the handler never ran).
//! - **`Outcome::RetryAfter`** replaces the strategy's delay but still obeys its
//!   `max_attempts`.
//! - **Raw queues** default to `max_deliveries = 10` ([`worker::DEFAULT_MAX_DELIVERIES`]).
//! - **Panics** in a handler are caught and treated as a failed run (retry per strategy).
//! - **Notifications** carry `<deadline epoch ms>:<queue>` on the channel
//!   `<table>_wakeup` (`<schema>.<table>_wakeup` with an explicit schema), sent with
//!   `pg_notify` in the publishing transaction: Postgres delivers it at commit, never for a
//!   rolled-back one.
//! - **Publishing through generated functions** on a plain connection uses
//!   [`Outbox::global`] (the defaults unless [`Outbox::set_global`] was called); to use
//!   another outbox, pass `outbox.on(&mut *tx)` ([`Outbox::on`]).
//! - **Sizes**: a payload holds at most 64 MiB ([`message::MAX_PAYLOAD_BYTES`]) and a
//!   message's headers 64 KiB in all ([`message::MAX_HEADERS_BYTES`]), a batch 256 MiB in
//!   all ([`message::MAX_BATCH_BYTES`]): far below Postgres' own 1 GiB limit, which a
//!   statement cannot carry without resetting the connection.
//! - **Lease renewal** runs every third of `lease_ttl`; a row locked by another transaction
//!   at that moment is reported [`store::Renewal::Busy`] and tried again next time, never
//!   declared lost on that ground.
//! - **Migration lock waits**: each try of a step waits at most 3 s for its table locks
//!   (`SET lock_timeout`: a DDL statement waiting for a lock blocks every later query of the
//!   table, so waits are kept short and retried), and `migrate()` keeps trying for 5 minutes
//!   ([`schema::MigrateOptions`]); applied steps are recorded in
//!   `<table>_schema_migrations`, next to the queue table.
//! - **Handler timeout** defaults to 5 minutes ([`worker::DEFAULT_HANDLER_TIMEOUT`]).
//! - **Worker writes with a lock timeout** (completions, renewal, release) use 200 ms
//!   ([`store::LOCK_TIMEOUT`]) on a second pool the [`PgStore`] opens itself.
//! - **A row no claim can take** is set aside for 1 s, doubling up to 5 minutes, and after
//!   `max_deliveries` such failures deleted (archived with reason `max_deliveries`).
//! - **Shutdown** gives back rows claimed but not started at once, rather than running
//!   them, and returns within `graceful_timeout` + [`worker::SHUTDOWN_GRACE`] (250 ms).
//! - **Queue statistics** count dead letters only when the dead-letter queue is on, and only
//!   those not redriven; the opt-in queue-depth gauge reads them once per process (one
//!   worker reads, another takes over when it stops), at least 15 s apart, with the reading
//!   worker's `lease_ttl` ([`stats`]).
//! - **A failed run of a cancelled timer** reports [`store::Completion::Cancelled`] (its row
//!   is deleted); a successful one reports [`store::Completion::Deleted`] as usual.
#![deny(missing_docs)]
#![warn(unreachable_pub)]
#![cfg_attr(docsrs, feature(doc_cfg))]

// Modules from the leaves up; each imports only modules before it (`python3
// .ci/check-module-graph --print` lists the imports): error (and `schema::problem`, what
// its variants carry), names, telemetry, `store::connect` → sql (statement text, `sql::text`
// and `sql::binds`; executes nothing) → the vocabulary and its rules: `schema::shape`,
// `message` (`schedule`, `envelope`), periodic → the executors of the rendered statements:
// publish, cancel, admin, stats, `schema::{migrate, validate}` → `store` itself (the
// contract's types, `store::sealed`), `store::{rows, fenced, listen, periodic}` → read,
// dlq → outbox (the handle: the names and the rendered statements) → over the handle:
// `schema`'s two functions, timer and `message::typed` (the typed layer), the stores
// (`store::transaction`, `store::postgres`) → worker, testing, hooks (the test hooks).
//
// The public surface: the crate root holds what the quick start types; everything else has
// exactly one path, in `admin`, `dlq`, `message`, `schema`, `stats`, `store`, `telemetry`,
// `worker` or `testing`, and is defined in that module's file or directory
// (`message::Schedule` in `message/schedule.rs`). An item with only a root path is defined
// in a private module (`Message` in `message/envelope.rs`), so that it keeps one path.
mod bucket;
mod cancel;
mod error;
#[cfg(feature = "testing")]
mod hooks;
mod names;
mod outbox;
mod publish;
mod read;
mod scope;
mod sql;
mod timer;

pub mod admin;
pub mod dlq;
pub mod message;
pub mod periodic;
pub mod relay;
pub mod schema;
pub mod stats;
pub mod store;
pub mod telemetry;
#[cfg(any(test, feature = "testing"))]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub mod testing;
pub mod worker;

#[doc(hidden)]
pub mod __private; // Not public API.

pub use cancel::Cancelled;
pub use error::{Error, Result};
pub use message::envelope::{Message, Published};
pub use outbox::{migrate, Outbox, OutboxBuilder};
pub use outbox_macros::{timer, FromRef};
pub use store::postgres::PgStore;
pub use store::transaction::HandlerTransaction;
pub use timer::{Publisher, Timer};
pub use worker::builder::WorkerBuilder;
pub use worker::handler::{Context, FromRef, HandlerOptions, Outcome};
pub use worker::lifecycle::{RunningWorker, ShutdownReport, Worker};
pub use worker::retry::RetryStrategy;

// The README's code blocks, and the guide's, are compiled as this crate's doc tests
// (cfg(doctest) only, so a packaged build never reads a file outside the crate). A block
// that is not Rust needs a language tag.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
struct ReadmeDoctests;
#[cfg(doctest)]
#[doc = include_str!("../../docs/guide/README.md")]
struct GuideIndexDoctests;
#[cfg(doctest)]
#[doc = include_str!("../../docs/guide/timers.md")]
struct GuideTimersDoctests;
#[cfg(doctest)]
#[doc = include_str!("../../docs/guide/periodic.md")]
struct GuidePeriodicDoctests;
#[cfg(doctest)]
#[doc = include_str!("../../docs/guide/workers.md")]
struct GuideWorkersDoctests;
#[cfg(doctest)]
#[doc = include_str!("../../docs/guide/scaling.md")]
struct GuideScalingDoctests;
#[cfg(doctest)]
#[doc = include_str!("../../docs/guide/deployment.md")]
struct GuideDeploymentDoctests;
#[cfg(doctest)]
#[doc = include_str!("../../docs/guide/operations.md")]
struct GuideOperationsDoctests;
#[cfg(doctest)]
#[doc = include_str!("../../docs/guide/reliability.md")]
struct GuideReliabilityDoctests;
#[cfg(doctest)]
#[doc = include_str!("../../docs/guide/testing.md")]
struct GuideTestingDoctests;
#[cfg(doctest)]
#[doc = include_str!("../../docs/guide/relay.md")]
struct GuideRelayDoctests;
