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
//! own, and the tests that read process-wide state rely on it:
//!
//! - the metric descriptions, which the runtime sends once per process to the recorder of
//!   that moment (`observe::metrics::every_metric_has_a_unit_and_a_description`);
//! - the queue-depth gauge's poller slot, one per process, read through the global
//!   `metrics` recorder (`observe::queue_depth`);
//! - what `tracing` caches for the whole process about which span and event sites are
//!   enabled: another test hitting them first, on a thread without a subscriber, can leave
//!   a span or a log line unrecorded (`observe::telemetry`, `worker::warnings`).
//!
//! Each of them calls [`own_process`] first, so under `cargo test`, which runs the
//! binary's tests as threads of one process, they fail with that message instead of at
//! random. Every other test keeps its state to itself: the other metrics tests record into
//! a recorder of their own thread (`metrics::set_default_local_recorder`), and
//! `#[tokio::test]` runs a test and the tasks it spawns on that one thread; virtual time
//! (`start_paused`) belongs to the test's own runtime.

mod contract;
mod docs;
mod model;
mod observe;
mod postgres;
mod relay;
mod worker;

/// Panics unless this test has its process to itself, as under `cargo nextest run`, which
/// runs every test in a process of its own: for the tests that read process-wide state
/// (see the crate docs).
fn own_process() {
    assert_eq!(
        std::env::var("NEXTEST_EXECUTION_MODE").as_deref(),
        Ok("process-per-test"),
        "this test needs a process of its own: run it with `cargo nextest run`"
    );
}
