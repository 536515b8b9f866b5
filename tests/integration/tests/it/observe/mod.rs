//! What the runtime reports: metrics, the queue-depth gauge, OpenTelemetry spans.

mod metrics;
mod queue_depth;
mod telemetry;

/// Panics unless this test has its process to itself, as under `cargo nextest run` (the
/// README's test command), which runs every test in a process of its own. For the tests
/// that need process-wide state of their own: the global `metrics` recorder, the
/// descriptions the runtime sends once per process, the queue-depth gauge's poller slot.
fn own_process() {
    assert_eq!(
        std::env::var("NEXTEST_EXECUTION_MODE").as_deref(),
        Ok("process-per-test"),
        "this test needs a process of its own: run it with `cargo nextest run`"
    );
}
