//! What the runtime reports: metrics, the queue-depth gauge, OpenTelemetry spans.

mod metrics;
mod queue_depth;
mod telemetry;
