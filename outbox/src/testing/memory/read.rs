//! `sql/read.rs`: live rows of a queue, without leasing them.

use super::state::{row_order, State};
use super::MemoryStore;
#[cfg(doc)]
use crate::error::Error;
use crate::error::Result;
use crate::message::validate_queue;
use crate::store::rows::StoredRow;

impl State {
    fn pending(&self, queue: &str, limit: usize) -> Result<Vec<StoredRow>> {
        validate_queue(queue)?;
        let mut rows: Vec<StoredRow> = self
            .rows
            .values()
            .filter(|r| r.queue == queue)
            .cloned()
            .collect();
        rows.sort_by_key(row_order);
        rows.truncate(limit);
        Ok(rows)
    }
}

impl MemoryStore {
    /// Live rows of `queue` (pending and leased), ordered by deadline then id, at most
    /// `limit`: what [`PgStore::pending`](crate::PgStore::pending) reads.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a bad queue name.
    pub fn pending(&self, queue: &str, limit: usize) -> Result<Vec<StoredRow>> {
        self.lock().pending(queue, limit)
    }
}
