//! The dashboard's fixed bounds, public through the crate root. A leaf.

/// A queue or dead-letter table smaller than this (bytes, `pg_total_relation_size`) is
/// counted exactly on the queues page; a larger one is estimated from the planner's
/// statistics, so the page does not scan a large backlog.
pub const EXACT_STATS_MAX_BYTES: i64 = 16 * 1024 * 1024;

/// The due rows of a queue are counted up to this many; above, the page shows "more than".
pub const DUE_COUNT_CAP: i64 = 1_000;

/// The largest page of rows or dead letters
/// [`Dashboard::page_size`](crate::Dashboard::page_size) accepts.
pub const MAX_PAGE_SIZE: usize = 500;

/// The most a page renders of one payload (bytes of the payload, shown as re-indented JSON
/// or as a hex dump, which is about 5 times longer) on a row's page; the rest is a download (`application/octet-stream`, as an
/// attachment). A dead letter in the list shows [`LIST_SHOWN_BYTES`].
pub const MAX_SHOWN_BYTES: usize = 64 * 1024;

/// The most the dead-letter list renders of each dead letter's payload (bytes of the
/// payload) and headers.
pub const LIST_SHOWN_BYTES: usize = 4 * 1024;
