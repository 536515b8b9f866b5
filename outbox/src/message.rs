//! Messages beyond the crate root's [`Message`](crate::Message): schedules, conflict rules,
//! headers, batches, the size limits, and the typed publish/extend/cancel functions that
//! `#[timer]` generates wrappers for.

pub use crate::outbox::Bound;
pub use crate::publish::{
    BatchItem, Headers, OnConflict, Schedule, MAX_DELAY, MAX_HEADERS_BYTES, MAX_PAYLOAD_BYTES,
    MAX_SLACK,
};
pub use crate::timer::{cancel_timer, extend_timer, extend_timer_with_slack, publish_timer};
