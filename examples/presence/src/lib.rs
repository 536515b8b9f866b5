//! # presence — the outbox example that does the job end to end
//!
//! A presence service: every `POST /users/{id}/ping` marks the user online and extends the
//! user's expiry timer (an outbox timer, `#[outbox::timer]`) **in the same transaction**;
//! when the timer fires, the expiry handler marks the user offline unless a newer ping
//! arrived. A ping that lands while the expiry handler is running queues a **rearm**, so
//! the timer fires again for the newer deadline (SPEC §5): that is the case this example
//! exists to exercise.
//!
//! - [`server`]: the HTTP API, the users table, the expiry handler and its worker.
//! - [`load`]: a load driver over real HTTP that checks every state it reads, with the
//!   definition of a *wrong transition*.
//! - [`telemetry`]: the worker's metrics through the `metrics-exporter-prometheus` recorder,
//!   served on `GET /metrics` and read back for `GET /stats`.
//!
//! The binary (`cargo run --release -p presence -- --help`) has three subcommands:
//! `serve`, `load --url ...` and `demo` (both in one process).
#![deny(missing_docs)]

pub mod load;
pub mod server;
pub mod telemetry;

pub use load::{run as run_load, LoadConfig, Report};
pub use server::{Audit, PresenceExpiry, Server, ServerConfig, DEFAULT_DATABASE_URL};
