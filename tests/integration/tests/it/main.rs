//! The integration tests of the runtime, one test binary with a module per topic:
//!
//! - `contract`: every storage scenario, written once and run on Postgres and on
//!   `MemoryStore` with the same expected values, one file per concern;
//! - `model`: random operation sequences applied to both stores in lockstep;
//! - `postgres`: what only a real database shows — its clock, locks and races, plans,
//!   limits, grants, migrations, the schema, a rolling deploy, several processes;
//! - `worker`: a worker's runs, wake-ups, reliability, transactions, fairness, periodic
//!   timers, virtual time (`run_due`), its warnings;
//! - `observe`: metrics, the queue-depth gauge, OpenTelemetry spans;
//! - `docs`: the README and the examples it shows, the public surface.
//!
//! Postgres comes from `DATABASE_URL` (see `outbox_tests`); each test makes its own
//! uniquely named tables, so tests run in parallel and beside other runs.
//!
//! # A process per test
//!
//! `cargo nextest run` (the README's test command) runs every test in a process of its
//! own. Three tests need that, because the runtime keeps some state per process: the
//! metric descriptions, sent once per process to the recorder of that moment
//! (`observe::metrics::every_metric_has_a_unit_and_a_description`), and the queue-depth
//! gauge's poller slot, which the two `observe::queue_depth` tests that read the gauge
//! through the global recorder rely on. Each asserts first that it has the process to
//! itself (`observe::own_process`), so under `cargo test`, which runs the binary's tests as
//! threads of one process, they fail with that message instead of at random.
//!
//! Every other test keeps its state to itself: metrics recorders and tracing subscribers
//! are set for the test's thread (`metrics::set_default_local_recorder`,
//! `tracing::subscriber::set_default`), and `#[tokio::test]` runs the test and the tasks it
//! spawns on that one thread; virtual time (`start_paused`) belongs to the test's runtime.

mod contract;
mod docs;
mod model;
mod observe;
mod postgres;
mod worker;
