//! The dashboard's error type: a leaf, so every module may name it.

/// Why a [`Dashboard`](crate::Dashboard) could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum UiError {
    /// The `Outbox` is distributed (`OutboxBuilder::distributed`): its indexes lead with the
    /// bucket, and the dashboard's statements are written for a single node.
    #[error("the dashboard does not support a distributed outbox (Citus) yet")]
    Distributed,
    /// A statement of [`Dashboard::install_throughput_counter`](crate::Dashboard::install_throughput_counter) or
    /// [`Dashboard::remove_throughput_counter`](crate::Dashboard::remove_throughput_counter) failed.
    #[error("the throughput counter: {0}")]
    Database(#[from] sqlx::Error),
    /// [`Dashboard::install_throughput_counter`](crate::Dashboard::install_throughput_counter): the queue table does not exist (run the
    /// outbox's migrations first).
    #[error("the queue table {table} does not exist: migrate first")]
    NoQueueTable {
        /// The queue table, as the `Outbox` names it.
        table: String,
    },
    /// A setting is out of its range.
    #[error("invalid dashboard setting {field}: {reason}")]
    InvalidSetting {
        /// The setting.
        field: &'static str,
        /// Why.
        reason: String,
    },
}
