//! What the runtime's metrics mean: the unit and description of every metric it records
//! through the `metrics` facade, given to the installed recorder once per process (when the
//! first worker starts or the first message is published), so an exporter can show units and
//! help texts (Prometheus `# HELP`, OpenTelemetry units).

use std::sync::Once;

use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};

/// Describes every metric to the recorder installed now (once per process: a recorder
/// installed later gets the values but not the descriptions).
pub(crate) fn describe() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        describe_counter!(
            "outbox_published_total",
            Unit::Count,
            "Rows inserted by publish and extend statements, by queue, counted when the \
             statement returns inside the caller's transaction: a rolled-back transaction is \
             not taken back, so this bounds committed messages from above"
        );
        describe_counter!(
            "outbox_acked_total",
            Unit::Count,
            "Successful runs whose fenced completion committed, by queue"
        );
        describe_counter!(
            "outbox_rearmed_total",
            Unit::Count,
            "Runs whose completion applied a queued rearm (the timer is pending again), by queue"
        );
        describe_counter!(
            "outbox_retried_total",
            Unit::Count,
            "Failed runs scheduled for another attempt, by queue"
        );
        describe_counter!(
            "outbox_terminal_total",
            Unit::Count,
            "Rows ended for good without success, by queue and reason (deleted, or archived \
             with the dead-letter queue on)"
        );
        describe_counter!(
            "outbox_dlq_written_total",
            Unit::Count,
            "Rows archived to the dead-letter table, by queue"
        );
        describe_counter!(
            "outbox_lease_lost_total",
            Unit::Count,
            "Writes that found their lease gone (expired and taken by another worker), by queue \
             and phase"
        );
        describe_counter!(
            "outbox_cancelled_runs_total",
            Unit::Count,
            "Runs of timers cancelled while running, whose rows were deleted, by queue"
        );
        describe_counter!(
            "outbox_poison_rows_total",
            Unit::Count,
            "Rows no claim could take, set aside by the worker, by queue"
        );
        describe_counter!(
            "outbox_lease_renewals_total",
            Unit::Count,
            "Lease renewal statements that succeeded"
        );
        describe_counter!(
            "outbox_claim_errors_total",
            Unit::Count,
            "Claim statements that failed (the worker backs off and tries again)"
        );
        describe_counter!(
            "outbox_completion_errors_total",
            Unit::Count,
            "Completions that failed for good (the row is redelivered after its lease expires)"
        );
        describe_histogram!(
            "outbox_firing_lateness_seconds",
            Unit::Seconds,
            "Claim time minus deadline of each delivery, by queue"
        );
        describe_histogram!(
            "outbox_handler_duration_seconds",
            Unit::Seconds,
            "Wall time of each handler run, by queue"
        );
        describe_histogram!(
            "outbox_claim_batch_size",
            Unit::Count,
            "Rows returned by each claim statement"
        );
        describe_gauge!(
            "outbox_queue_depth",
            Unit::Count,
            "Rows of each queue by state (pending, due, leased, expired_leases, rearms, \
             cancel_marks, dead_letters), from the queue statistics the opt-in queue-depth \
             gauge reads once per process every interval (estimates in estimate mode); every \
             process reports the same figures, so aggregate with max"
        );
        describe_gauge!(
            "outbox_queue_oldest_due_lateness_seconds",
            Unit::Seconds,
            "How long the oldest due row of each queue has waited (0 when none is due), from \
             the statistics of the opt-in queue-depth gauge"
        );
    });
}
