//! Telemetry: the spans of publishing and delivering, the trace context a message carries
//! from its publish to its handler (feature `opentelemetry`), and the metrics.
//!
//! # Spans
//!
//! Every publish, claim, handler run and completion is a `tracing` span at level `INFO`
//! (target `outbox::telemetry`), named and attributed by the OpenTelemetry semantic
//! conventions for messaging, **version 1.44.0** ([`SEMCONV_VERSION`]; the messaging
//! conventions are still of status "development" there, so a later version may rename
//! things: this crate moves to it in a release that says so). `tracing` field names may
//! contain dots, so the attributes are plain span fields: any `tracing` subscriber sees
//! them, and `tracing-opentelemetry` turns them into OpenTelemetry attributes, its `otel.*`
//! fields into the span's name, kind and status.
//!
//! | span (`tracing` name) | OpenTelemetry name (`otel.name`) | kind | covers |
//! |---|---|---|---|
//! | `send` | `send <queue>` | producer | one publish or extend ([`Outbox::publish`](crate::Outbox::publish), the `#[timer]` functions, `&store`), or one [`Outbox::publish_batch`](crate::Outbox::publish_batch) |
//! | `receive` | `receive <queue>`, or `receive` when the worker serves several queues | client | one claim statement (a batch receive: it takes up to `fetch_batch_size` rows) |
//! | `process` | `process <queue>` | consumer | one handler run, from the checks before it (`max_deliveries`, decoding) to its decision |
//! | `settle` | `settle <queue>` | client | the fenced completion of that run: delete (ack), retry, terminal failure or the rearm applied by either |
//!
//! Attributes, set when the span starts unless said otherwise:
//!
//! - every span: `messaging.system` = `"outbox"` ([`MESSAGING_SYSTEM`]),
//!   `messaging.operation.type` and `messaging.operation.name` (both `send`, `receive`,
//!   `process` or `settle`), `messaging.destination.name` (the queue; on `receive` only
//!   when the worker serves one queue, since one claim reads all of them);
//! - `send`: `outbox.timer_id` (keyed timers), `messaging.batch.message_count` (batches),
//!   and when the statement returned, `messaging.message.id` (the row id, when a row was
//!   written) and `outbox.outcome`: `inserted`, `skipped`, `extended`, `rearm_queued`,
//!   `unchanged` (the [`Published`](crate::Published) variants) or `batch_inserted`;
//! - `receive`: `messaging.batch.message_count` (rows the claim returned, 0 included),
//!   recorded when the statement returned;
//! - `process`: `messaging.message.id` (the row id), `outbox.timer_id`, `outbox.delivery`
//!   (claims so far, this one included), `outbox.attempt` (failed runs before this one,
//!   plus one), and at its end `outbox.outcome`: `ack`, `retry`, `fail` (with
//!   `outbox.failure_reason`, as stored in the dead-letter table) or `completed` (the
//!   handler's own transaction completed the row);
//! - `settle`: `messaging.message.id`, and when the write returned `outbox.outcome`:
//!   `acked`, `rearmed` (a queued rearm was applied: the timer is pending again),
//!   `retried`, `dead_lettered` (terminal failure, archived) or `deleted` (terminal
//!   failure, dead-letter queue off), both with `outbox.failure_reason`, `cancelled` (the
//!   timer was cancelled while it ran), `lease_lost` or `not_written`.
//!
//! `outbox.outcome` and `outbox.failure_reason` are this crate's own attributes (the
//! `outbox.` namespace, as the conventions ask of system-specific ones).
//!
//! **Errors** set `error.type` and `otel.status_code = "error"` on the span that failed;
//! a success sets neither. The values (low cardinality, as the conventions ask):
//!
//! | span | `error.type` |
//! |---|---|
//! | `send`, `receive` | the [`Error`](crate::Error) variant: `InvalidArgument`, `Database`, `NotMigrated`, … |
//! | `process` | `handler_error` (the handler returned an error or `Outcome::Retry`), `panic`, `timeout`, `rejected` (`Outcome::Reject`), `decode_error`, `max_deliveries`, `transaction_error` (the handler's transaction did not commit), `retry_exhausted` (`Outcome::RetryAfter` with no attempt left), `lease_lost` (the handler's commit found the lease gone), `stopped` (the run was stopped at shutdown before it decided; the span has no `outbox.outcome`) |
//! | `settle` | `lease_lost` (the write found another lease: nothing written), `completion_failed` (the write failed for good; the row is redelivered after its lease expires) |
//!
//! A run that fails and is retried has an error on its `process` span and none on its
//! `settle` span (the retry was written as asked); a terminal failure likewise (the
//! dead letter was written).
//!
//! **Why `messaging.system = "outbox"`**: the conventions' list has no value for a queue
//! kept in a database table by a library (its values name brokers: `kafka`, `rabbitmq`,
//! …), and allows a custom one. `postgresql` would be wrong twice: Postgres is not the
//! messaging system the spans describe, and `postgresql` is a `db.system.name` value that
//! database client spans (sqlx's) already use for the statements underneath.
//!
//! **Events** stay as before and land in the span they happened in: a lost lease (with its
//! `phase`), an applied rearm, a scheduled retry and a written dead letter in `settle`, a
//! timeout in `process`.
//!
//! ## How the spans relate
//!
//! - `send` is a child of the span current at the publish (your request's), like any
//!   `tracing` span.
//! - `receive` is a child of the current span: in a started worker there is none, so each
//!   claim is a trace of its own; in [`Worker::run_due`](crate::Worker::run_due), the
//!   caller's span.
//! - `process` is a child of the current span (none in a started worker's handler task:
//!   each run starts a trace of its own; the caller's span in `run_due`), *follows from*
//!   the `receive` span of the claim that took its row (`tracing`'s `follows_from`, which
//!   `tracing-opentelemetry` turns into a span link), and with the feature on **links** to
//!   the publish's `send` span through the trace context in the row's headers.
//! - `settle` is a child of `process`. A success written through the worker's pipelined
//!   acks is settled by the completer task in a batched statement after the handler
//!   returned: its `settle` span starts when the run hands the ack over and ends when the
//!   statement reported the row, so it includes the wait for the batch.
//!
//! ## Trace context in the row's headers (feature `opentelemetry`)
//!
//! With the cargo feature `opentelemetry` on, a publish writes the W3C trace context of its
//! `send` span into the message's headers: [`TRACEPARENT_HEADER`] (`traceparent`, 55
//! bytes) and, when the span's trace state is not empty, [`TRACESTATE_HEADER`]
//! (`tracestate`). The context is that of the `send` span (the conventions' "creation
//! context": a single-message send needs no separate "create" span); the items of one
//! batch share the batch's `send` context. The W3C format is always used, whatever
//! propagator the application installed globally: the headers are stored data that other
//! processes and versions read back, so their format is fixed.
//!
//! - **Your headers win**: a message whose headers already hold `traceparent` keeps them
//!   as they are (the conventions' "custom creation context"), and a `tracestate` of yours
//!   is never replaced.
//! - **Within the limit**: the trace context is added only if the headers, with it, stay
//!   within [`MAX_HEADERS_BYTES`](crate::message::MAX_HEADERS_BYTES) (keys and values
//!   counted as the limit counts them). Otherwise the message is published **without** it,
//!   the publish does not fail, and a `DEBUG` event says so; its delivery then has no link
//!   to the publish.
//! - **Only a real context is written**: without a `tracing-opentelemetry` layer in the
//!   subscriber, or with the `send` span disabled by a filter, nothing is added (so the
//!   feature alone changes no row).
//! - **An extend** writes its own context with the headers it replaces: the timer's next
//!   run links to the latest extend that changed the row.
//!
//! At delivery, the context is read back from the headers and added as a **link** of the
//! `process` span (and of the `receive` span that claimed the row, with the row's
//! `messaging.message.id` as the link's attribute), not as its parent. Why a link:
//!
//! - a claim is a batch receive, and one span has one parent but may link to every
//!   message it took: the conventions make links the default for this reason;
//! - timers run long after their publish (minutes, days) and keyed timers run again
//!   (retries, rearms): as a child, every later run would land in the trace of the
//!   request that published it, long after that trace ended;
//! - each run keeps a trace of its own, with its own sampling decision.
//!
//! Tracing backends show the link as a jump from the handler run to the publish. A
//! `traceparent` that does not parse (written by something else) is ignored.
//!
//! **Supported versions**: `opentelemetry` 0.33 and `opentelemetry_sdk` 0.33 (the W3C
//! propagator) with `tracing-opentelemetry` 0.34. Your application's layer must use the
//! same versions (with two copies of `tracing-opentelemetry` in the build, this crate
//! finds no OpenTelemetry context and writes nothing; `cargo tree -i tracing-opentelemetry`
//! shows one copy). Without the feature none of these crates is compiled.
//!
//! ```toml
//! [dependencies]
//! outbox = { version = "0.1", features = ["opentelemetry"] }
//! opentelemetry = "0.33"
//! opentelemetry_sdk = "0.33"
//! tracing-opentelemetry = "0.34"
//! ```
//!
//! # Metrics
//!
//! Recorded through the `metrics` facade; install any exporter (Prometheus, OpenTelemetry)
//! to collect them. Each comes with its unit and a description, given to the recorder
//! installed when the first worker starts or the first message is published.
//!
//! | metric | type, unit | labels | meaning |
//! |---|---|---|---|
//! | `outbox_published_total` | counter | `queue` | rows inserted by publish and extend statements, when the statement returns inside your transaction: a rolled-back transaction is not taken back, so this bounds committed messages from above |
//! | `outbox_acked_total` | counter | `queue` | successful runs whose completion committed |
//! | `outbox_rearmed_total` | counter | `queue` | completions that applied a queued rearm |
//! | `outbox_retried_total` | counter | `queue` | failed runs scheduled for another attempt |
//! | `outbox_terminal_total` | counter | `queue`, `reason` | rows ended for good without success |
//! | `outbox_dlq_written_total` | counter | `queue` | rows archived to the dead-letter table |
//! | `outbox_lease_lost_total` | counter | `queue`, `phase` | writes that found their lease gone; `phase` is `ack`, `retry`, `fail`, `renew`, `buffered` (lost while waiting for a handler slot) or `arm` (a periodic run's next instant, before it started) |
//! | `outbox_cancelled_runs_total` | counter | `queue` | runs of timers cancelled while running |
//! | `outbox_poison_rows_total` | counter | `queue` | rows no claim could take, set aside |
//! | `outbox_lease_renewals_total` | counter | | renewal statements that succeeded |
//! | `outbox_claim_errors_total` | counter | `error` | claim statements that failed, by the [`Error`](crate::Error) variant's name (`ReadOnly` on a standby, `Database` for a lost connection, …); the worker backs off, at most 5 s between tries |
//! | `outbox_completion_errors_total` | counter | | fenced writes of a run that failed for good (a completion, or the next instant a periodic run queues when it starts); the row is redelivered after its lease expires |
//! | `outbox_in_flight` | gauge, count | `queue` | handler runs in progress: up when a run starts, down when it ends, whichever way (success, error, panic, timeout, or stopped at shutdown) |
//! | `outbox_firing_lateness_seconds` | histogram, s | `queue` | claim time minus deadline of each delivery |
//! | `outbox_handler_duration_seconds` | histogram, s | `queue` | wall time of each handler run |
//! | `outbox_claim_batch_size` | histogram, count | | rows returned by each claim |
//!
//! # Cost
//!
//! Without a subscriber, or with a subscriber whose filter leaves the `INFO` spans of
//! `outbox::telemetry` out, a span costs one check of the filter. With the feature on and a
//! `tracing-opentelemetry` layer feeding the SDK's batch processor (its exporter dropping
//! the spans), the project's benchmark harness measured, on a shared and busy machine (so
//! the figures are noisy; medians of 15 alternating runs of 5000 messages):
//!
//! | scenario | client CPU per message, off → on | throughput, off → on |
//! |---|---|---|
//! | consumer, 1 worker task, claims of 100 | 10 → 26 µs | 17 350 → 13 896 msg/s (0.80×) |
//! | consumer, 4 worker tasks, claims of 10 | 40 → 68 µs | 4 434 → 3 538 msg/s (0.80×) |
//! | 5000 publishes in one transaction | 38 → 44 µs | 8 172 → 9 465 msg/s (noise) |
//! | 5000 publishes, one transaction each | 152 → 186 µs | 1 367 → 1 165 msg/s (0.85×) |
//!
//! Each row also carries the 66 bytes of `traceparent` (key and value), which its WAL
//! records carry too. The repository's `docs/benchmarks.md` ("Telemetry") says how to run
//! the comparison.

use std::sync::Once;

use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
use tracing::field::Empty;
use tracing::Span;

/// The version of the OpenTelemetry semantic conventions the span names and attributes
/// follow.
pub const SEMCONV_VERSION: &str = "1.44.0";

/// The value of `messaging.system` on every span of this crate.
pub const MESSAGING_SYSTEM: &str = "outbox";

/// The header that carries the W3C `traceparent` of a message's publish (feature
/// `opentelemetry`).
pub const TRACEPARENT_HEADER: &str = "traceparent";

/// The header that carries the W3C `tracestate` of a message's publish, when it is not
/// empty (feature `opentelemetry`).
pub const TRACESTATE_HEADER: &str = "tracestate";

/// Describes every metric to the recorder installed now (once per process: a recorder
/// installed later gets the values but not the descriptions).
pub(crate) fn describe() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        describe_counter!(
            name::PUBLISHED,
            Unit::Count,
            "Rows inserted by publish and extend statements, by queue, counted when the \
             statement returns inside the caller's transaction: a rolled-back transaction is \
             not taken back, so this bounds committed messages from above"
        );
        describe_counter!(
            name::ACKED,
            Unit::Count,
            "Successful runs whose fenced completion committed, by queue"
        );
        describe_counter!(
            name::REARMED,
            Unit::Count,
            "Runs whose completion applied a queued rearm (the timer is pending again), by queue"
        );
        describe_counter!(
            name::RETRIED,
            Unit::Count,
            "Failed runs scheduled for another attempt, by queue"
        );
        describe_counter!(
            name::TERMINAL,
            Unit::Count,
            "Rows ended for good without success, by queue and reason (deleted, or archived \
             with the dead-letter queue on)"
        );
        describe_counter!(
            name::DLQ_WRITTEN,
            Unit::Count,
            "Rows archived to the dead-letter table, by queue"
        );
        describe_counter!(
            name::LEASE_LOST,
            Unit::Count,
            "Writes that found their lease gone (expired and taken by another worker), by queue \
             and phase"
        );
        describe_counter!(
            name::CANCELLED_RUNS,
            Unit::Count,
            "Runs of timers cancelled while running, whose rows were deleted, by queue"
        );
        describe_counter!(
            name::POISON_ROWS,
            Unit::Count,
            "Rows no claim could take, set aside by the worker, by queue"
        );
        describe_counter!(
            name::LEASE_RENEWALS,
            Unit::Count,
            "Lease renewal statements that succeeded"
        );
        describe_counter!(
            name::CLAIM_ERRORS,
            Unit::Count,
            "Claim statements that failed, by error (the worker backs off and tries again)"
        );
        describe_counter!(
            name::COMPLETION_ERRORS,
            Unit::Count,
            "Completions that failed for good (the row is redelivered after its lease expires)"
        );
        describe_gauge!(
            name::IN_FLIGHT,
            Unit::Count,
            "Handler runs in progress, by queue: raised when a run starts, lowered when it \
             ends, whichever way (success, error, panic, timeout, stopped at shutdown)"
        );
        describe_histogram!(
            name::FIRING_LATENESS,
            Unit::Seconds,
            "Claim time minus deadline of each delivery, by queue"
        );
        describe_histogram!(
            name::HANDLER_DURATION,
            Unit::Seconds,
            "Wall time of each handler run, by queue"
        );
        describe_histogram!(
            name::CLAIM_BATCH_SIZE,
            Unit::Count,
            "Rows returned by each claim statement"
        );
        describe_gauge!(
            name::QUEUE_DEPTH,
            Unit::Count,
            "Rows of each queue by state (pending, due, leased, expired_leases, rearms, \
             cancel_marks, dead_letters), from the queue statistics the opt-in queue-depth \
             gauge reads once per process every interval (estimates in estimate mode); every \
             process reports the same figures, so aggregate with max"
        );
        describe_gauge!(
            name::OLDEST_DUE_LATENESS,
            Unit::Seconds,
            "How long the oldest due row of each queue has waited (0 when none is due), from \
             the statistics of the opt-in queue-depth gauge"
        );
    });
}

/// Every metric's name, written once: [`describe`] and the recording functions below are the
/// only users, so a name cannot drift between its description and its calls.
mod name {
    pub(super) const PUBLISHED: &str = "outbox_published_total";
    pub(super) const ACKED: &str = "outbox_acked_total";
    pub(super) const REARMED: &str = "outbox_rearmed_total";
    pub(super) const RETRIED: &str = "outbox_retried_total";
    pub(super) const TERMINAL: &str = "outbox_terminal_total";
    pub(super) const DLQ_WRITTEN: &str = "outbox_dlq_written_total";
    pub(super) const LEASE_LOST: &str = "outbox_lease_lost_total";
    pub(super) const CANCELLED_RUNS: &str = "outbox_cancelled_runs_total";
    pub(super) const POISON_ROWS: &str = "outbox_poison_rows_total";
    pub(super) const LEASE_RENEWALS: &str = "outbox_lease_renewals_total";
    pub(super) const CLAIM_ERRORS: &str = "outbox_claim_errors_total";
    pub(super) const COMPLETION_ERRORS: &str = "outbox_completion_errors_total";
    pub(super) const IN_FLIGHT: &str = "outbox_in_flight";
    pub(super) const FIRING_LATENESS: &str = "outbox_firing_lateness_seconds";
    pub(super) const HANDLER_DURATION: &str = "outbox_handler_duration_seconds";
    pub(super) const CLAIM_BATCH_SIZE: &str = "outbox_claim_batch_size";
    pub(super) const QUEUE_DEPTH: &str = "outbox_queue_depth";
    pub(super) const OLDEST_DUE_LATENESS: &str = "outbox_queue_oldest_due_lateness_seconds";
}

// The metric calls, one function per metric (the table in the module docs says what each
// counts). The worker and the publish functions record through these only.

/// `outbox_published_total{queue}`: `rows` inserted by one publish or extend statement.
/// Describes the metrics first: a process that only publishes starts no worker.
pub(crate) fn published(queue: &str, rows: u64) {
    describe();
    metrics::counter!(name::PUBLISHED, "queue" => queue.to_owned()).increment(rows);
}

/// `outbox_acked_total{queue}`: a successful run whose completion committed.
pub(crate) fn acked(queue: &str) {
    metrics::counter!(name::ACKED, "queue" => queue.to_owned()).increment(1);
}

/// `outbox_rearmed_total{queue}`: a completion that applied a queued rearm.
pub(crate) fn rearmed(queue: &str) {
    metrics::counter!(name::REARMED, "queue" => queue.to_owned()).increment(1);
}

/// `outbox_retried_total{queue}`: a failed run scheduled for another attempt.
pub(crate) fn retried(queue: &str) {
    metrics::counter!(name::RETRIED, "queue" => queue.to_owned()).increment(1);
}

/// `outbox_terminal_total{queue, reason}`: a row ended for good without success (`reason`
/// as stored in the dead-letter table).
pub(crate) fn terminal(queue: &str, reason: &'static str) {
    metrics::counter!(name::TERMINAL, "queue" => queue.to_owned(), "reason" => reason).increment(1);
}

/// `outbox_dlq_written_total{queue}`: a row archived to the dead-letter table.
pub(crate) fn dead_letter_written(queue: &str) {
    metrics::counter!(name::DLQ_WRITTEN, "queue" => queue.to_owned()).increment(1);
}

/// `outbox_lease_lost_total{queue, phase}`: a write (or a renewal) that found its lease gone.
pub(crate) fn lease_lost(queue: &str, phase: &'static str) {
    metrics::counter!(name::LEASE_LOST, "queue" => queue.to_owned(), "phase" => phase).increment(1);
}

/// `outbox_cancelled_runs_total{queue}`: a run of a timer cancelled while it ran.
pub(crate) fn cancelled_run(queue: &str) {
    metrics::counter!(name::CANCELLED_RUNS, "queue" => queue.to_owned()).increment(1);
}

/// `outbox_poison_rows_total{queue}`: a row no claim could take, set aside.
pub(crate) fn poison_row(queue: &str) {
    metrics::counter!(name::POISON_ROWS, "queue" => queue.to_owned()).increment(1);
}

/// `outbox_lease_renewals_total`: a renewal statement that succeeded.
pub(crate) fn lease_renewed() {
    metrics::counter!(name::LEASE_RENEWALS).increment(1);
}

/// `outbox_claim_errors_total{error}`: a claim statement that failed, by the error's
/// variant name.
pub(crate) fn claim_failed(error: &'static str) {
    metrics::counter!(name::CLAIM_ERRORS, "error" => error).increment(1);
}

/// `outbox_completion_errors_total`: a fenced write of a run that failed for good.
pub(crate) fn completion_failed() {
    metrics::counter!(name::COMPLETION_ERRORS).increment(1);
}

/// `outbox_firing_lateness_seconds{queue}`: claim time minus deadline of one delivery.
pub(crate) fn firing_lateness(queue: &str, seconds: f64) {
    metrics::histogram!(name::FIRING_LATENESS, "queue" => queue.to_owned()).record(seconds);
}

/// `outbox_handler_duration_seconds{queue}`: the wall time of one handler run.
pub(crate) fn handler_duration(queue: &str, seconds: f64) {
    metrics::histogram!(name::HANDLER_DURATION, "queue" => queue.to_owned()).record(seconds);
}

/// `outbox_claim_batch_size`: the rows one claim statement returned.
pub(crate) fn claim_batch_size(rows: usize) {
    metrics::histogram!(name::CLAIM_BATCH_SIZE).record(rows as f64);
}

/// `outbox_queue_depth{queue, state}`: one figure of the queue statistics.
pub(crate) fn queue_depth(queue: &str, state: &'static str, rows: f64) {
    metrics::gauge!(name::QUEUE_DEPTH, "queue" => queue.to_owned(), "state" => state).set(rows);
}

/// `outbox_queue_oldest_due_lateness_seconds{queue}`: how long the oldest due row waited.
pub(crate) fn oldest_due_lateness(queue: &str, seconds: f64) {
    metrics::gauge!(name::OLDEST_DUE_LATENESS, "queue" => queue.to_owned()).set(seconds);
}

/// The `send` span of one publish (`batch`: the item count of a batch).
pub(crate) fn send_span(queue: &str, timer_id: Option<&str>, batch: Option<usize>) -> Span {
    tracing::info_span!(
        "send",
        otel.name = %format_args!("send {queue}"),
        otel.kind = "producer",
        otel.status_code = Empty,
        messaging.system = MESSAGING_SYSTEM,
        messaging.operation.type = "send",
        messaging.operation.name = "send",
        messaging.destination.name = queue,
        messaging.message.id = Empty,
        messaging.batch.message_count = batch.map(|n| n as u64),
        outbox.timer_id = timer_id,
        outbox.outcome = Empty,
        error.type = Empty,
    )
}

/// The `receive` span of one claim over `queues`.
pub(crate) fn receive_span(queues: &[String]) -> Span {
    let queue = match queues {
        [one] => Some(one.as_str()),
        _ => None,
    };
    tracing::info_span!(
        "receive",
        otel.name = %ReceiveName(queue),
        otel.kind = "client",
        otel.status_code = Empty,
        messaging.system = MESSAGING_SYSTEM,
        messaging.operation.type = "receive",
        messaging.operation.name = "receive",
        messaging.destination.name = queue,
        messaging.batch.message_count = Empty,
        error.type = Empty,
    )
}

/// `receive <queue>`, or `receive` for a claim over several queues (no one destination).
struct ReceiveName<'a>(Option<&'a str>);

impl std::fmt::Display for ReceiveName<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(queue) => write!(f, "receive {queue}"),
            None => f.write_str("receive"),
        }
    }
}

/// What the `process` span of a delivery describes.
pub(crate) struct Run<'a> {
    pub(crate) queue: &'a str,
    pub(crate) id: i64,
    pub(crate) timer_id: Option<&'a str>,
    pub(crate) delivery: i32,
    pub(crate) attempt: i32,
}

/// The `process` span of one handler run, following from the `receive` span that claimed
/// its row.
pub(crate) fn process_span(run: &Run<'_>, receive: &Span) -> Span {
    let span = tracing::info_span!(
        "process",
        otel.name = %format_args!("process {}", run.queue),
        otel.kind = "consumer",
        otel.status_code = Empty,
        messaging.system = MESSAGING_SYSTEM,
        messaging.operation.type = "process",
        messaging.operation.name = "process",
        messaging.destination.name = run.queue,
        messaging.message.id = %run.id,
        outbox.timer_id = run.timer_id,
        outbox.delivery = run.delivery,
        outbox.attempt = run.attempt,
        outbox.outcome = Empty,
        outbox.failure_reason = Empty,
        error.type = Empty,
    );
    span.follows_from(receive);
    span
}

/// The `settle` span of a run's completion, a child of its `process` span.
pub(crate) fn settle_span(process: &Span, queue: &str, id: i64) -> Span {
    tracing::info_span!(
        parent: process,
        "settle",
        otel.name = %format_args!("settle {queue}"),
        otel.kind = "client",
        otel.status_code = Empty,
        messaging.system = MESSAGING_SYSTEM,
        messaging.operation.type = "settle",
        messaging.operation.name = "settle",
        messaging.destination.name = queue,
        messaging.message.id = %id,
        outbox.outcome = Empty,
        outbox.failure_reason = Empty,
        error.type = Empty,
    )
}

/// Records the outcome (`outbox.outcome`) of a span's operation.
pub(crate) fn outcome(span: &Span, outcome: &'static str) {
    span.record("outbox.outcome", outcome);
}

/// Records a failure: `error.type` and the error status.
pub(crate) fn error(span: &Span, error_type: &str) {
    span.record("error.type", error_type);
    span.record("otel.status_code", "error");
}

/// One handler run in progress: holds `outbox_in_flight{queue}` up by one until it is
/// dropped, on every way a run ends, a dropped future included (the worker's shutdown
/// stops a run by dropping it). A run dropped before [`InFlight::finish`] marks its span
/// `error.type = "stopped"`.
pub(crate) struct InFlight {
    gauge: metrics::Gauge,
    span: Span,
    finished: bool,
}

impl InFlight {
    pub(crate) fn start(queue: &str, span: &Span) -> Self {
        describe();
        let gauge = metrics::gauge!(name::IN_FLIGHT, "queue" => queue.to_owned());
        gauge.increment(1.0);
        InFlight {
            gauge,
            span: span.clone(),
            finished: false,
        }
    }

    /// The run decided: records its outcome and failure class on its span.
    pub(crate) fn finish(
        mut self,
        decision: &'static str,
        failure_reason: Option<&'static str>,
        error_type: Option<&'static str>,
    ) {
        self.finished = true;
        outcome(&self.span, decision);
        if let Some(reason) = failure_reason {
            self.span.record("outbox.failure_reason", reason);
        }
        if let Some(e) = error_type {
            error(&self.span, e);
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.gauge.decrement(1.0);
        if !self.finished {
            error(&self.span, "stopped");
        }
    }
}

/// The W3C trace context of `span` as header values `(traceparent, tracestate)`, the
/// second when the trace state is not empty; `None` when the span has no OpenTelemetry
/// context (no layer, a disabled span).
#[cfg(feature = "opentelemetry")]
pub(crate) fn trace_context(span: &Span) -> Option<(String, Option<String>)> {
    use opentelemetry::propagation::TextMapPropagator;
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    struct Carrier(Option<String>, Option<String>);
    impl opentelemetry::propagation::Injector for Carrier {
        fn set(&mut self, key: &str, value: String) {
            match key {
                TRACEPARENT_HEADER => self.0 = Some(value),
                TRACESTATE_HEADER if !value.is_empty() => self.1 = Some(value),
                _ => {}
            }
        }
    }
    if span.is_disabled() {
        return None;
    }
    let mut carrier = Carrier(None, None);
    opentelemetry_sdk::propagation::TraceContextPropagator::new()
        .inject_context(&span.context(), &mut carrier);
    carrier.0.map(|parent| (parent, carrier.1))
}

/// Without the feature there is no context to write.
#[cfg(not(feature = "opentelemetry"))]
pub(crate) fn trace_context(_span: &Span) -> Option<(String, Option<String>)> {
    None
}

/// Links `span` to the creation context a delivery's headers carry (the `traceparent` its
/// publish wrote), with the attribute `messaging.message.id` when `id` is given (on a
/// `receive` span, which links to every row it took). Nothing without the feature, without
/// headers, or with a `traceparent` that does not parse.
#[cfg(feature = "opentelemetry")]
pub(crate) fn link_creation(
    span: &Span,
    headers: Option<&std::collections::BTreeMap<String, String>>,
    id: Option<i64>,
) {
    use opentelemetry::propagation::TextMapPropagator;
    use opentelemetry::trace::TraceContextExt;
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    struct Headers<'a>(&'a std::collections::BTreeMap<String, String>);
    impl opentelemetry::propagation::Extractor for Headers<'_> {
        fn get(&self, key: &str) -> Option<&str> {
            self.0.get(key).map(String::as_str)
        }
        fn keys(&self) -> Vec<&str> {
            self.0.keys().map(String::as_str).collect()
        }
    }
    let Some(headers) = headers else { return };
    if span.is_disabled() || !headers.contains_key(TRACEPARENT_HEADER) {
        return;
    }
    let cx =
        opentelemetry_sdk::propagation::TraceContextPropagator::new().extract(&Headers(headers));
    let creation = cx.span().span_context().clone();
    if !creation.is_valid() {
        return;
    }
    match id {
        Some(id) => span.add_link_with_attributes(
            creation,
            vec![opentelemetry::KeyValue::new(
                "messaging.message.id",
                id.to_string(),
            )],
        ),
        None => span.add_link(creation),
    }
}

/// Without the feature there is nothing to link.
#[cfg(not(feature = "opentelemetry"))]
pub(crate) fn link_creation(
    _span: &Span,
    _headers: Option<&std::collections::BTreeMap<String, String>>,
    _id: Option<i64>,
) {
}

#[cfg(test)]
mod tests {
    //! The spans as a plain `tracing` subscriber sees them (the feature's OpenTelemetry side
    //! is tested against Postgres in the integration tests).

    use std::collections::BTreeMap;
    use std::sync::{Arc, Mutex};

    use tracing::field::{Field, Visit};
    use tracing::span::{Attributes, Id, Record};
    use tracing::Subscriber;
    use tracing_subscriber::layer::{Context, SubscriberExt};
    use tracing_subscriber::registry::LookupSpan;
    use tracing_subscriber::Layer;

    use crate::testing::MemoryStore;
    use crate::{Message, Outcome, Publisher, Worker};

    /// A closed span: its `tracing` name, its fields, and its parent's name.
    #[derive(Debug, Clone)]
    struct Closed {
        name: &'static str,
        fields: BTreeMap<String, String>,
        parent: Option<&'static str>,
    }

    #[derive(Default)]
    struct Fields(BTreeMap<String, String>);

    impl Visit for Fields {
        fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
            self.0.insert(
                field.name().to_owned(),
                format!("{value:?}").replace('"', ""),
            );
        }
    }

    #[derive(Clone, Default)]
    struct Capture(Arc<Mutex<Vec<Closed>>>);

    impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Capture {
        fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
            let mut fields = Fields::default();
            attrs.record(&mut fields);
            ctx.span(id).unwrap().extensions_mut().insert(fields);
        }

        fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
            let span = ctx.span(id).unwrap();
            let mut ext = span.extensions_mut();
            values.record(ext.get_mut::<Fields>().unwrap());
        }

        fn on_close(&self, id: Id, ctx: Context<'_, S>) {
            let span = ctx.span(&id).unwrap();
            let fields = span.extensions_mut().remove::<Fields>().unwrap().0;
            self.0.lock().unwrap().push(Closed {
                name: span.name(),
                fields,
                parent: span.parent().map(|p| p.name()),
            });
        }
    }

    /// Without the feature (and without an OpenTelemetry layer) the spans carry the
    /// conventions' names and attributes all the same, and no trace context is written.
    #[tokio::test]
    async fn plain_tracing_spans_carry_the_conventions_names_and_attributes() {
        let capture = Capture::default();
        let _guard =
            tracing::subscriber::set_default(tracing_subscriber::registry().with(capture.clone()));
        let store = MemoryStore::new();
        let published = (&store)
            .publish_message(Message::new("q.plain", b"x").timer_id("k"))
            .await
            .unwrap();
        let worker = Worker::builder(store.clone())
            .queue("q.plain", |_: Vec<u8>, _: crate::Context| async {
                Outcome::Reject("no".into())
            })
            .build()
            .unwrap();
        let done = worker.run_due().await.unwrap();
        assert_eq!(done.len(), 1);
        assert_eq!(done[0].delivery.headers, None, "no context without a layer");
        let id = published.id().unwrap().to_string();
        let spans = capture.0.lock().unwrap().clone();
        let find = |name: &str| {
            spans
                .iter()
                .find(|s| s.name == name)
                .unwrap_or_else(|| panic!("no span {name}: {spans:#?}"))
        };
        let field = |s: &Closed, k: &str| s.fields.get(k).cloned();
        for (name, kind) in [
            ("send", "producer"),
            ("receive", "client"),
            ("process", "consumer"),
            ("settle", "client"),
        ] {
            let s = find(name);
            assert_eq!(
                field(s, "otel.name"),
                Some(format!("{name} q.plain")),
                "{s:?}"
            );
            assert_eq!(field(s, "otel.kind").as_deref(), Some(kind));
            assert_eq!(field(s, "messaging.system").as_deref(), Some("outbox"));
            assert_eq!(field(s, "messaging.operation.type").as_deref(), Some(name));
            assert_eq!(field(s, "messaging.operation.name").as_deref(), Some(name));
            assert_eq!(
                field(s, "messaging.destination.name").as_deref(),
                Some("q.plain")
            );
        }
        let send = find("send");
        assert_eq!(field(send, "messaging.message.id"), Some(id.clone()));
        assert_eq!(field(send, "outbox.timer_id").as_deref(), Some("k"));
        assert_eq!(field(send, "outbox.outcome").as_deref(), Some("inserted"));
        let receive = find("receive");
        assert_eq!(
            field(receive, "messaging.batch.message_count").as_deref(),
            Some("1")
        );
        let process = find("process");
        assert_eq!(field(process, "messaging.message.id"), Some(id.clone()));
        assert_eq!(field(process, "outbox.delivery").as_deref(), Some("1"));
        assert_eq!(field(process, "outbox.attempt").as_deref(), Some("1"));
        assert_eq!(field(process, "outbox.outcome").as_deref(), Some("fail"));
        assert_eq!(
            field(process, "outbox.failure_reason").as_deref(),
            Some("rejected")
        );
        assert_eq!(field(process, "error.type").as_deref(), Some("rejected"));
        assert_eq!(field(process, "otel.status_code").as_deref(), Some("error"));
        let settle = find("settle");
        assert_eq!(settle.parent, Some("process"));
        assert_eq!(field(settle, "messaging.message.id"), Some(id));
        // The memory store keeps no dead-letter table unless asked: the row is deleted.
        assert_eq!(field(settle, "outbox.outcome").as_deref(), Some("deleted"));
        assert_eq!(
            field(settle, "outbox.failure_reason").as_deref(),
            Some("rejected")
        );
        assert_eq!(field(settle, "error.type"), None);
    }
}
